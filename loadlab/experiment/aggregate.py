"""A sweep's runs, aggregated: per configuration the median of the repeats with their spread, the knee
(per doubling along one numeric axis) and the latency-aware knee, the Pareto fronts, the SLO-first choice
with ties and a reason for every rejected configuration, plain-language findings (over capacity, trends,
a choice made on throughput alone, ...), and the refine step's values around the knee. A capacity search's
rows are its configurations at their capacity at SLO, and the choice is the highest capacity.

Rows are plain dicts (``config``, ``repeats``, ``values``: column -> median/min/max, ``failed``,
``client_bound``, ``error_bound_ms``, ``over_capacity`` and ``overload``: the runs' overload verdicts,
``rate``, ``refined``, ``error``, ``classes``: each SLO class's objectives and verdict; a capacity search's
``capacity``: the search's outcome); they are written into sweep.json as they are. With classes, a
configuration meets the SLO only when every class meets its own (and the run as a whole the sweep's).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from loadlab.analysis.summary import SUMMARY_JSON, Summary, SummaryError
from loadlab.experiment.search import outcome, show
from loadlab.experiment.spec import CapacitySpec, SweepError, SweepSpec, configurations, is_number, label

KNEE_GAIN = 0.05  # the knee: the first configuration after which the next adds less than 5% throughput
TIE_GAIN = 0.01  # throughputs this close are a tie for the SLO-first choice (the earlier one is kept)

# The seed's table: (column, summary path, scale, digits)
COLUMNS = (
    ("output tok/s", ("output_throughput",), 1, 0),
    ("TTFT P50 ms", ("median_ttft_ms",), 1, 0),
    ("TTFT P95 ms", ("p95_ttft_ms",), 1, 0),
    ("TPOT P95 ms", ("p95_tpot_ms",), 1, 1),
    ("mean queue delay ms", ("server", "mean_queue_time_ms"), 1, 0),
    ("peak KV usage %", ("server", "peak_token_usage"), 100, 0),
    ("in flight (mean)", ("in_flight", "mean"), 1, 1),
    ("max running", ("server", "max_running"), 1, 0),
    ("retractions", ("server", "retractions"), 1, 0),
)


def read_run_summary(run_dir: str | Path) -> dict[str, Any] | None:
    """A finished run's summary (through the typed ``Summary``, as summary.json's keys), or None when it
    has none. The one place a sweep reads summaries."""
    if not (Path(run_dir) / SUMMARY_JSON).exists():
        return None
    try:
        return Summary.read(Path(run_dir)).dump()
    except SummaryError as e:
        raise SweepError(str(e)) from None


def _get(d: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(d, dict):
            return None
        d = d.get(key)
    return d


def aggregate(
    spec: SweepSpec,
    configs: list[dict],
    runs: Mapping[str, str],
    failed: Mapping[str, str] | None = None,
    points: Mapping[str, Mapping[str, Sequence[str]]] | None = None,
    hints: Mapping[str, tuple[float, float]] | None = None,
) -> dict[str, Any]:
    """One row per configuration (``configs``: the coarse ones, then the refined) from the runs finished
    (``runs``: "k/r" -> run dir) and the failures (``failed``: k -> reason), then the knee and the choice.
    A capacity search (``spec.capacity``) has ``points`` instead (k -> load value -> its runs' dirs, in
    repeat order; ``hints``: k -> the bracket it started from): each row is the configuration at its
    capacity, with the search's outcome in ``capacity``."""
    coarse = configurations(spec.axes)
    rows = []
    for k, config in enumerate(configs):
        if spec.capacity is not None:
            row = capacity_row(spec, config, (points or {}).get(str(k), {}), (hints or {}).get(str(k)))
        else:
            summaries = []
            for r in range(spec.repeats):
                run_dir = runs.get(f"{k}/{r}")
                summary = read_run_summary(run_dir) if run_dir else None
                if summary is not None:
                    summaries.append(summary)
            row = summary_row(config, summaries)
        row["refined"] = config not in coarse
        row["error"] = (failed or {}).get(str(k))
        rows.append(row)
    if any(row["refined"] for row in rows):  # one numeric axis: refined values go between the coarse ones
        rows.sort(key=lambda row: next(iter(row["config"].values())))
    return {"rows": rows, **choose(rows, spec.slo, spec.capacity)}


# The overload verdict's criteria (each run's summary.json `overload`), and those that fail the SLO: the
# server could not take the prompts in, or TTFT grew through the run.
OVERLOAD_CRITERIA = ("offered_above_capacity", "ttft_growing", "in_flight_growing")
OVERLOAD_FAILS = ("offered_above_capacity", "ttft_growing")
# The overload verdict's evidence a row shows (medians over its runs): each run's summary.json `overload`.
OVERLOAD_EVIDENCE = ("offered_prompt_tokens_per_s", "served_prompt_tokens_per_s", "ttft_slope",
                     "in_flight_growth_per_s")  # fmt: skip


def summary_row(config: dict[str, Any], summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """A configuration's row from its runs' summaries: each column's median and range, failed requests,
    the load generator's flags, the SLO classes, and (open loop) the overload verdict: ``over_capacity``
    counts the runs whose summary says arrivals outran the server (None when no summary has a verdict: a
    closed loop, or a summary from before verdicts), ``overloaded`` those where a criterion that speaks to
    TTFT fired (OVERLOAD_FAILS), ``overload_criteria`` the runs per criterion, ``overload`` the evidence's
    medians."""
    row: dict[str, Any] = {"config": config, "repeats": len(summaries), "values": {}}
    for column, path, scale, _ in COLUMNS:
        values = [v * scale for s in summaries if isinstance(v := _get(s, path), int | float)]
        row["values"][column] = _spread(values)
    row["failed"] = sum(int(s.get("failed") or 0) for s in summaries)
    # The load generator's own timing quality: runs it flagged, and its worst error bound (P99, ms).
    clients = [s.get("client") or {} for s in summaries]
    row["client_bound"] = sum(bool(c.get("client_bound")) for c in clients)
    bounds = [c["error_bound_ms"] for c in clients if isinstance(c.get("error_bound_ms"), int | float)]
    row["error_bound_ms"] = max(bounds) if bounds else None
    verdicts = [v for s in summaries if isinstance(v := s.get("overload"), dict)]
    row["over_capacity"] = sum(bool(v.get("over_capacity")) for v in verdicts) if verdicts else None
    # Which criteria fired, per criterion (runs). Only the two that speak to a TTFT SLO fail a row (see
    # slo_reasons): in-flight growth alone fires on Poisson noise near capacity (TTFT P95 179 ms, +0.78/s
    # in flight at 11.6 req/s with 256 running, in virtual time).
    row["overload_criteria"] = (
        {c: sum(bool(v.get(c)) for v in verdicts) for c in OVERLOAD_CRITERIA} if verdicts else None
    )
    row["overloaded"] = sum(any(v.get(c) for c in OVERLOAD_FAILS) for v in verdicts) if verdicts else None
    row["overload"] = {key: _spread([v[key] for v in verdicts if isinstance(v.get(key), int | float)])["median"]
                       for key in OVERLOAD_EVIDENCE} if verdicts else None  # fmt: skip
    rates = [s["request_rate"] for s in summaries if isinstance(s.get("request_rate"), int | float)]
    row["rate"] = statistics.median(rates) if rates else None  # the open loop's configured rate
    row["classes"] = class_rows(summaries)
    return row


def slo_reasons(row: dict[str, Any], slo: Mapping[str, Any]) -> list[str]:
    """Why a row fails the SLO (empty: it meets it): its medians of TTFT P95 and TPOT P95 against the
    SLO's, every class against its own, failed requests, and an open loop over capacity in most of its
    runs by the criteria that speak to TTFT (offered prompt tokens above what the server took in, or TTFT
    growing through the run: a longer run would fail)."""
    limits = {"TTFT P95 ms": slo.get("ttft_p95_ms"), "TPOT P95 ms": slo.get("tpot_p95_ms")}
    reasons = []
    for column, limit in limits.items():
        value = _median(row, column)
        if limit is not None and (value is None or value > limit):
            # Whole ms, unless that would read "100 ms > 100 ms" (a value just over the line).
            if value is None:
                reasons.append(f"no {column}")
                continue
            shown = f"{value:.0f}" if round(value) > limit else f"{value:.1f}"
            reasons.append(f"{column.replace(' ms', '')} {shown} ms > {limit:g} ms")
    # Every class must meet its own SLO (a class's slo, else the profile's: the sweep's slo: too).
    for c in row.get("classes") or []:
        for o in c["objectives"]:
            if not o["pass"]:
                reasons.append(f"class {c['name']}: {o['label']} {o['median']:.0f} ms > {o['threshold_ms']:g} ms"
                               if o["median"] is not None else f"class {c['name']}: no {o['label']}")  # fmt: skip
    if row["failed"]:
        by_class = [f"{c['name']} {c['failed']}" for c in row.get("classes") or [] if c["failed"]]
        reasons.append(f"{row['failed']} failed requests" + (f" ({', '.join(by_class)})" if by_class else ""))
    if row.get("overloaded") and 2 * row["overloaded"] > row["repeats"]:
        reasons.append("over capacity (arrivals outran the server: TTFT grows with the run's length)")
    return reasons


def run_reasons(config: dict[str, Any], summary: dict[str, Any], slo: Mapping[str, Any]) -> list[str]:
    """Why one run fails the SLO (empty: it meets it), by the rule the sweep applies to a row."""
    return slo_reasons(summary_row(config, [summary]), slo)


def capacity_row(
    spec: SweepSpec,
    config: dict[str, Any],
    points: Mapping[str, Sequence[str]],
    hint: tuple[float, float] | None,
) -> dict[str, Any]:
    """A configuration's capacity search as a row: each run judged on its own against the SLO (every
    class too), the search's outcome (``capacity``), and the figures of the runs at the capacity found (at
    the lowest value tried when nothing passed: ``capacity.at`` says which)."""
    cap = spec.capacity
    assert cap is not None
    summaries: dict[float, list[dict[str, Any]]] = {}
    verdicts: dict[float, list[bool]] = {}
    for key, run_dirs in points.items():
        value = float(key)
        summaries[value] = [s for d in run_dirs if (s := read_run_summary(d)) is not None]
        verdicts[value] = [not run_reasons(config, s, spec.slo) for s in summaries[value]]
    found = outcome(verdicts, cap, hint)
    at = found["capacity"] if found["capacity"] is not None else min(verdicts, default=None)
    row = summary_row(config, summaries.get(at, []) if at is not None else [])
    found["at"] = at
    found["why_none"] = None
    if found["capacity"] is None and at is not None:
        why = "; ".join(slo_reasons(row, spec.slo))
        found["why_none"] = f"fails the SLO at every load tried, down to {show(at, cap)} ({why})"
    row["capacity"] = found
    return row


METRIC_NAMES = {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "itl_ms": "ITL", "e2e_latency_ms": "E2E"}


def _spread(values: list[float]) -> dict[str, float | None]:
    return {"median": statistics.median(values) if values else None, "min": min(values, default=None),
            "max": max(values, default=None)}  # fmt: skip


def class_rows(summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each SLO class of the repeats' summaries (``classes[]``, in the first one's order): per objective of
    its SLO the median and range of its value over the repeats and the threshold, its output tokens/s and
    TTFT P95, its failed requests, how many runs' own verdicts passed, and ``pass``: every objective's
    median within its threshold (the rule the sweep applies to the run as a whole), None without an SLO."""
    names: list[str] = []
    by_name: dict[str, list[dict]] = {}
    for s in summaries:
        for c in s.get("classes") or []:
            if c["name"] not in by_name:
                names.append(c["name"])
            by_name.setdefault(c["name"], []).append(c)
    out = []
    for name in names:
        runs = by_name[name]
        objectives: dict[str, dict[str, Any]] = {}
        for c in runs:
            for o in c["slo"]["objectives"]:
                entry = objectives.setdefault(o["key"], {
                    "key": o["key"], "label": f"{METRIC_NAMES.get(o['metric'], o['metric'])} P{o['percentile']:g}",
                    "threshold_ms": o["threshold_ms"], "values": []})  # fmt: skip
                if o["value_ms"] is not None:
                    entry["values"].append(o["value_ms"])
        listed = []
        for entry in objectives.values():
            values = entry.pop("values")
            # A repeat without samples has no value: the median is of those that had one, and a class
            # with none at all fails (as an objective without samples fails in a run's own verdict).
            entry.update(_spread(values))
            entry["pass"] = entry["median"] is not None and entry["median"] <= entry["threshold_ms"]
            listed.append(entry)
        verdicts = [c["slo"]["pass"] for c in runs if c["slo"]["pass"] is not None]
        out.append({
            "name": name,
            "objectives": listed,
            "output tok/s": _spread([c["output_throughput"] for c in runs if c.get("output_throughput") is not None]),
            "TTFT P95 ms": _spread([c["p95_ttft_ms"] for c in runs if c.get("p95_ttft_ms") is not None]),
            "failed": sum(int(c.get("failed") or 0) for c in runs),
            "runs_passed": sum(bool(v) for v in verdicts),
            "runs": len(runs),
            "pass": all(o["pass"] for o in listed) if listed else None,
        })  # fmt: skip
    return out


def refine_configs(
    rows: list[dict], n: int, axes: Mapping[str, Sequence[Any]] | None = None
) -> list[dict[str, Any]]:
    """``n`` more values of the (only) axis on each side of the knee, up to its neighbours: evenly spaced
    on a log scale for positive values (limits and loads are swept in doublings), rounded for an integer
    axis; values already swept (in ``rows`` or among the sweep's ``axes``) are skipped."""
    done = [r for r in rows if r["repeats"]]
    knee = knee_index(done)
    if knee is None:
        return []
    axis = next(iter(done[0]["config"]))
    values = [r["config"][axis] for r in done]
    swept = set((axes or {}).get(axis, [])) | set(values)
    integer = all(float(v).is_integer() for v in swept)  # 8.0, 16.0 are counts too: --set needs integers
    added: list[float] = []
    for lo, hi in ((knee - 1, knee), (knee, knee + 1)):
        if lo < 0 or hi >= len(values):
            continue
        a, b = values[lo], values[hi]
        for i in range(1, n + 1):
            f = i / (n + 1)
            v = a * (b / a) ** f if a > 0 else a + (b - a) * f
            v = round(v) if integer else float(f"{v:.6g}")
            if a < v < b and v not in swept and v not in added:
                added.append(v)
    return [{axis: v} for v in added]


def _median(row: dict, column: str) -> float | None:
    return row["values"][column]["median"]


def knee_index(rows: list[dict]) -> int | None:
    """The first row after which the next adds less than KNEE_GAIN throughput (rows in sweep order). Along
    one axis of positive numbers the gain is taken per doubling of the value, so the knee does not move
    when a refine step puts more rows in between (coarse sweeps double: the same rule there)."""
    thr = [_median(r, "output tok/s") for r in rows]
    values = [next(iter(r["config"].values())) if len(r["config"]) == 1 else None for r in rows]
    scaled = all(is_number(v) and v > 0 for v in values)
    for i, t in enumerate(thr):
        nxt = thr[i + 1] if i + 1 < len(thr) else None
        if t is None:
            continue
        if nxt is None:
            return i
        gain = nxt / t if t > 0 else float("inf")
        if scaled and values[i + 1] > values[i]:
            gain **= 1 / math.log2(values[i + 1] / values[i])
        if gain < 1 + KNEE_GAIN:
            return i
    return None


def _highest_throughput(rows: list[dict]) -> tuple[dict | None, str | None]:
    """The row with the highest median throughput; but where earlier rows (smaller limits or loads) tie
    with it, the first of them: a tie is within TIE_GAIN or within the repeats' spread (ranges overlap).
    With the limit unable to bind (32 in flight against 32..512) the rows differ by noise only, and the
    smaller limit is the honest answer, not whichever won the noise."""
    rows = [r for r in rows if _median(r, "output tok/s") is not None]
    if not rows:
        return None, None
    best = max(rows, key=lambda r: _median(r, "output tok/s"))
    top, low = _median(best, "output tok/s"), best["values"]["output tok/s"]["min"]

    def ties(r: dict) -> bool:
        median, high = _median(r, "output tok/s"), r["values"]["output tok/s"]["max"]
        if median >= top * (1 - TIE_GAIN):
            return True
        # Within the repeats' spread: each median inside the other's range, and never more than the knee's
        # gain apart (one outlier repeat must not make a slow configuration a tie).
        spread = high is not None and low is not None and median >= low and top <= high
        return spread and r["repeats"] > 1 and best["repeats"] > 1 and median >= top * (1 - KNEE_GAIN)

    first = next(r for r in rows if ties(r))
    if first is best:
        return best, None
    return first, (f"{label(first['config'])} ties with {label(best['config'])} on throughput ("
                   f"{_median(first, 'output tok/s'):.0f} vs {top:.0f} tok/s, within {TIE_GAIN:.0%} or the "
                   "repeats' spread): the earlier configuration is kept")  # fmt: skip


def _highest_capacity(rows: list[dict], cap: CapacitySpec) -> tuple[dict | None, str | None]:
    """The row with the highest capacity at SLO; capacities within the search's tolerance of it tie, and
    the first of them (the smaller configuration) is kept: the search cannot tell them apart."""
    if not rows:
        return None, None
    best = max(rows, key=lambda r: r["capacity"]["capacity"])
    top = best["capacity"]["capacity"]
    first = next(r for r in rows if r["capacity"]["capacity"] * (1 + cap.tolerance) >= top)
    if first is best:
        return best, None
    return first, (f"{label(first['config'])} ties with {label(best['config'])} on capacity ("
                   f"{show(first['capacity']['capacity'], cap)} vs {show(top, cap)}, within the search's "
                   f"{cap.tolerance:.0%}): the earlier configuration is kept")  # fmt: skip


LATENCY_COLUMNS = ("TTFT P95 ms", "TPOT P95 ms")
LATENCY_KNEE_RULE = (
    "the last configuration before the first step along the sweep whose latency cost exceeds its throughput "
    "gain: the larger relative rise of TTFT P95 and TPOT P95 against the relative rise of output tokens/s, "
    "both per doubling of the axis's value (per step along other axes)"
)


def _doublings(a: dict, b: dict) -> float:
    """Doublings of the axis's value from row a to row b (one axis of positive numbers), else 1 step."""
    if len(a["config"]) == 1:
        va, vb = next(iter(a["config"].values())), next(iter(b["config"].values()))
        if is_number(va) and is_number(vb) and 0 < va < vb:
            return math.log2(vb / va)
    return 1.0


def latency_knee_index(rows: list[dict]) -> int | None:
    """The latency-aware knee (LATENCY_KNEE_RULE): the first row whose next step raises latency by more
    than it raises throughput, relative and per doubling; the last row when every step paid its way."""
    rows = [r for r in rows if (_median(r, "output tok/s") or 0) > 0]
    if not rows:
        return None
    for i, (a, b) in enumerate(itertools.pairwise(rows)):
        if len(a["config"]) > 1:  # several axes: no order of quantities to walk
            return None
        n = _doublings(a, b)
        gain = (_median(b, "output tok/s") / _median(a, "output tok/s")) ** (1 / n) - 1
        costs = [(vb / va) ** (1 / n) - 1 for c in LATENCY_COLUMNS
                 if (va := _median(a, c)) and (vb := _median(b, c)) and va > 0 and vb > 0]  # fmt: skip
        if costs and max(costs) > gain:
            return i
    return len(rows) - 1


def pareto_front(rows: list[dict], column: str) -> list[int]:
    """The rows no other row beats on both output throughput (higher) and ``column`` (lower)."""
    pts = [(i, t, v) for i, r in enumerate(rows)
           if (t := _median(r, "output tok/s")) is not None and (v := _median(r, column)) is not None]  # fmt: skip
    return [i for i, t, v in pts
            if not any(t2 >= t and v2 <= v and (t2 > t or v2 < v) for _, t2, v2 in pts)]  # fmt: skip


def overload_finding(rows: list[dict]) -> str | None:
    """Open loop: the configurations whose runs were over capacity (each run's overload verdict, by the
    criteria that speak to TTFT: ``overloaded``), and what that means for their TTFT and for any TTFT SLO at
    this rate."""
    judged = [r for r in rows if r.get("overloaded") is not None]
    over = [r for r in judged if r["overloaded"]]
    if not over:
        return None
    rates = {r["rate"] for r in over}
    at = f" at {rates.pop():g} req/s" if len(rates) == 1 and None not in rates else ""
    every = len(over) == len(judged)
    names = ", ".join(label(r["config"]) for r in over)
    where = f"every configuration ({names})" if every else names
    return (f"over capacity in {where}{at} ({sum(r['overloaded'] for r in over)} of "
            f"{sum(r['repeats'] for r in over)} runs): arrivals outran the server, so TTFT grows with the run's "
            "length and its percentiles describe this run's length, not a steady state; "
            f"{'no configuration' if every else 'none of these'} can meet a TTFT SLO at this rate (`loadlab "
            "capacity` finds the rate each one can serve)")  # fmt: skip


def trend_finding(rows: list[dict]) -> str | None:
    """Along one numeric axis (three rows or more): TTFT P95 or TPOT P95 rising or falling at every step,
    by more than 20% end to end (the seed's "TPOT P95 grows with the limit")."""
    if len(rows) < 3 or any(
        len(r["config"]) != 1 or not is_number(next(iter(r["config"].values()))) for r in rows
    ):
        return None
    axis = next(iter(rows[0]["config"]))
    said = []
    for column in LATENCY_COLUMNS:
        values = [_median(r, column) for r in rows]
        if any(v is None or v <= 0 for v in values):
            continue
        steps = [b / a for a, b in itertools.pairwise(values)]
        digits = 1 if values[0] < 100 else 0
        span = f"{values[0]:.{digits}f} -> {values[-1]:.{digits}f} ms"
        if all(x > 1 for x in steps) and values[-1] > 1.2 * values[0]:
            said.append(f"{column.replace(' ms', '')} grows ({span})")
        elif all(x < 1 for x in steps) and values[-1] < values[0] / 1.2:
            said.append(f"{column.replace(' ms', '')} falls ({span})")
    return f"along {axis}: {' and '.join(said)} at every step" if said else None


def throughput_alone_finding(
    rows: list[dict], rejected: list[tuple[dict, list[str]]], choice: dict | None
) -> str | None:
    """The seed's pitfall "a choice made on throughput alone": the highest-throughput configuration fails
    the SLO; names the SLO-first choice instead (or that none meets it)."""
    measured = [r for r in rows if _median(r, "output tok/s") is not None and not r.get("error")]
    if len(measured) < 2:
        return None
    best = max(measured, key=lambda r: _median(r, "output tok/s"))
    why = next((why for r, why in rejected if r is best), None)
    if not why:
        return None
    top = _median(best, "output tok/s")
    text = (f"a choice made on throughput alone would take {label(best['config'])} (the highest, {top:.0f} "
            f"tok/s), which fails the SLO ({'; '.join(why)}): ")  # fmt: skip
    if choice is None:
        return text + "no configuration meets the SLO at this load"
    got = _median(choice, "output tok/s")
    return text + (f"the SLO-first choice is {label(choice['config'])} ({got:.0f} tok/s, {1 - got / top:.0%} less "
                   "throughput)")  # fmt: skip


def choose(
    rows: list[dict], slo: Mapping[str, Any] | None, capacity: CapacitySpec | None = None
) -> dict[str, Any]:
    """The knee along the sweep's order and the SLO-first choice, with reasons and findings. With a
    capacity search the choice is the configuration with the highest capacity at SLO."""
    done = [r for r in rows if r["repeats"]]
    # A knee needs an order of quantities; an axis of choices (cluster files, policies) has none.
    choice_axis = next((a for r in done for a, v in r["config"].items() if not is_number(v)), None)
    k = knee_index(done) if choice_axis is None else None
    knee = label(done[k]["config"]) if k is not None else None
    lk = latency_knee_index(done) if choice_axis is None else None
    slo = dict(slo or {})
    rejected, passing = [], []
    for r in rows:
        if r.get("error"):  # the server or a run failed: the reason is the finding (e.g. out of memory)
            rejected.append((r, [f"failed: {r['error']}"]))
            continue
        if not r["repeats"]:
            continue
        if capacity is not None:
            found = r["capacity"]
            reasons = [found["why_none"]] if found["capacity"] is None else []
        else:
            reasons = slo_reasons(r, slo)
        (rejected if reasons else passing).append((r, reasons))
    if capacity is not None:
        choice, choice_note = _highest_capacity([r for r, _ in passing], capacity)
    else:
        choice, choice_note = _highest_throughput([r for r, _ in passing])
    findings = []
    server_axes = [a for a in (done[0]["config"] if done else {}) if "." not in a]
    for axis in server_axes:
        never_bound = []
        for r in done:
            limit, running = r["config"][axis], _median(r, "max running")
            if isinstance(limit, int | float) and running is not None and running < limit:
                never_bound.append(limit)
        if never_bound and "running" in axis:
            peak = max(_median(r, "max running") or 0 for r in done)
            findings.append(f"{axis} at {', '.join(str(v) for v in never_bound)} never bound: at most "
                            f"{peak:.0f} requests were ever running, below the limit")  # fmt: skip
    if k is not None and len(done) > 1 and k == len(done) - 1 and not any(r.get("error") for r in rows):
        findings.append(f"throughput still grew up to {knee}: the knee may lie beyond the sweep")
    failing = [r for r in done if r["failed"]]
    if failing:
        findings.append(f"requests failed in {', '.join(label(r['config']) for r in failing)} (kinds in each run's "
                        "summary.md; e.g. timeouts while queued): the latency columns cover completed requests "
                        "only, so there they read low")  # fmt: skip
    flagged = [r for r in done if r.get("client_bound")]
    if flagged:
        runs = sum(r["client_bound"] for r in flagged)
        bounds = [r["error_bound_ms"] for r in flagged if r.get("error_bound_ms") is not None]
        worst = f"timing error bound up to {max(bounds):.1f} ms at P99, " if bounds else ""
        findings.append(f"{runs} of {sum(r['repeats'] for r in done)} runs were client-bound ({worst}in "
                        f"{', '.join(label(r['config']) for r in flagged)}): their latencies include the load "
                        "generator's own delay (summary.md says why); rerun on a quieter machine or with more "
                        "workers")  # fmt: skip
    first_retract = next((r for r in done if (_median(r, "retractions") or 0) > 0), None)
    if first_retract is not None:
        findings.append(
            f"retractions appear from {label(first_retract['config'])}: the KV pool ran out during decode"
        )
    findings += [f for f in (trend_finding(done),) if f]
    if capacity is None:  # a capacity search's rows are at their capacity: neither applies there
        findings += [
            f for f in (overload_finding(done), throughput_alone_finding(done, rejected, choice)) if f
        ]
    return {
        "knee": knee,
        "latency_knee": label(done[lk]["config"]) if lk is not None else None,
        "pareto": {
            column: [label(done[i]["config"]) for i in pareto_front(done, column)]
            for column in LATENCY_COLUMNS
        },  # fmt: skip
        "knee_note": f"{choice_axis} is a choice, not a quantity: no knee along it" if choice_axis else None,
        "choice": label(choice["config"]) if choice else None,
        "choice_note": choice_note,
        "slo": slo,
        "rejected": [{"config": label(r["config"]), "reasons": why} for r, why in rejected],
        "findings": findings,
    }
