"""A sweep's runs, aggregated: per configuration the median of the repeats with their spread, the knee
(per doubling along one numeric axis), the SLO-first choice with ties and a reason for every rejected
configuration, plain-language findings, and the refine step's values around the knee.

Rows are plain dicts (``config``, ``repeats``, ``values``: column -> median/min/max, ``failed``,
``client_bound``, ``error_bound_ms``, ``refined``, ``error``, ``classes``: each SLO class's objectives and
verdict); they are written into sweep.json as they are. With classes, a configuration meets the SLO only
when every class meets its own (and the run as a whole the sweep's).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from loadlab.analysis.summary import SUMMARY_JSON, Summary, SummaryError
from loadlab.experiment.spec import SweepError, SweepSpec, configurations, is_number, label

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
    spec: SweepSpec, configs: list[dict], runs: Mapping[str, str], failed: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """One row per configuration (``configs``: the coarse ones, then the refined) from the runs finished
    (``runs``: "k/r" -> run dir) and the failures (``failed``: k -> reason), then the knee and the choice."""
    coarse = configurations(spec.axes)
    rows = []
    for k, config in enumerate(configs):
        summaries = []
        for r in range(spec.repeats):
            run_dir = runs.get(f"{k}/{r}")
            summary = read_run_summary(run_dir) if run_dir else None
            if summary is not None:
                summaries.append(summary)
        row: dict[str, Any] = {"config": config, "repeats": len(summaries), "values": {}}
        for column, path, scale, _ in COLUMNS:
            values = [v * scale for s in summaries if isinstance(v := _get(s, path), int | float)]
            row["values"][column] = {
                "median": statistics.median(values) if values else None,
                "min": min(values) if values else None,
                "max": max(values) if values else None,
            }
        row["failed"] = sum(int(s.get("failed") or 0) for s in summaries)
        # The load generator's own timing quality: runs it flagged, and its worst error bound (P99, ms).
        clients = [s.get("client") or {} for s in summaries]
        row["client_bound"] = sum(bool(c.get("client_bound")) for c in clients)
        bounds = [c["error_bound_ms"] for c in clients if isinstance(c.get("error_bound_ms"), int | float)]
        row["error_bound_ms"] = max(bounds) if bounds else None
        # Open loop: runs whose arrivals outran the server (each summary's overload verdict).
        row["over_capacity"] = sum(bool((s.get("overload") or {}).get("over_capacity")) for s in summaries)
        row["refined"] = config not in coarse
        row["error"] = (failed or {}).get(str(k))
        row["classes"] = class_rows(summaries)
        rows.append(row)
    if any(row["refined"] for row in rows):  # one numeric axis: refined values go between the coarse ones
        rows.sort(key=lambda row: next(iter(row["config"].values())))
    return {"rows": rows, **choose(rows, spec.slo)}


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


def choose(rows: list[dict], slo: Mapping[str, Any] | None) -> dict[str, Any]:
    """The knee along the sweep's order and the SLO-first choice, with reasons and findings."""
    done = [r for r in rows if r["repeats"]]
    # A knee needs an order of quantities; an axis of choices (cluster files, policies) has none.
    choice_axis = next((a for r in done for a, v in r["config"].items() if not is_number(v)), None)
    k = knee_index(done) if choice_axis is None else None
    knee = label(done[k]["config"]) if k is not None else None
    slo = dict(slo or {})
    limits = {"TTFT P95 ms": slo.get("ttft_p95_ms"), "TPOT P95 ms": slo.get("tpot_p95_ms")}
    rejected, passing = [], []
    for r in rows:
        if r.get("error"):  # the server or a run failed: the reason is the finding (e.g. out of memory)
            rejected.append((r, [f"failed: {r['error']}"]))
            continue
        if not r["repeats"]:
            continue
        reasons = []
        for column, limit in limits.items():
            value = _median(r, column)
            if limit is not None and (value is None or value > limit):
                reasons.append(f"{column.replace(' ms', '')} {value:.0f} ms > {limit:g} ms" if value is not None
                               else f"no {column}")  # fmt: skip
        # Every class must meet its own SLO (a class's slo, else the profile's: the sweep's slo: too).
        for c in r.get("classes") or []:
            for o in c["objectives"]:
                if not o["pass"]:
                    reasons.append(f"class {c['name']}: {o['label']} {o['median']:.0f} ms > {o['threshold_ms']:g} ms"
                                   if o["median"] is not None else f"class {c['name']}: no {o['label']}")  # fmt: skip
        if r["failed"]:
            by_class = [f"{c['name']} {c['failed']}" for c in r.get("classes") or [] if c["failed"]]
            reasons.append(
                f"{r['failed']} failed requests" + (f" ({', '.join(by_class)})" if by_class else "")
            )
        (rejected if reasons else passing).append((r, reasons))
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
    overloaded = [r for r in done if r.get("over_capacity")]
    if overloaded:
        runs = sum(r["over_capacity"] for r in overloaded)
        findings.append(f"over capacity in {', '.join(label(r['config']) for r in overloaded)} ({runs} of "
                        f"{sum(r['repeats'] for r in overloaded)} runs): arrivals outran the server, so TTFT grows "
                        "with run length; their TTFT percentiles describe the runs' length, not a steady state, and "
                        "no limit among them can meet a TTFT SLO at this rate (each run's summary.md has the "
                        "figures)")  # fmt: skip
    first_retract = next((r for r in done if (_median(r, "retractions") or 0) > 0), None)
    if first_retract is not None:
        findings.append(
            f"retractions appear from {label(first_retract['config'])}: the KV pool ran out during decode"
        )
    return {
        "knee": knee,
        "knee_note": f"{choice_axis} is a choice, not a quantity: no knee along it" if choice_axis else None,
        "choice": label(choice["config"]) if choice else None,
        "choice_note": choice_note,
        "slo": slo,
        "rejected": [{"config": label(r["config"]), "reasons": why} for r, why in rejected],
        "findings": findings,
    }
