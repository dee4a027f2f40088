"""A sweep's result as pages: `sweep.md` (the seed's table, capacity at SLO for a capacity search, over
capacity, knees, Pareto fronts, choice, findings, a confirmation against virtual time) and `sweep.html` (the
curves along the configurations, the SLO lines, the knees and the choice marked; the Pareto view and
capacity per configuration; and the same table)."""

from __future__ import annotations

import html
from typing import Any

from loadlab.experiment.aggregate import COLUMNS, KNEE_GAIN, LATENCY_COLUMNS, LATENCY_KNEE_RULE
from loadlab.experiment.search import show
from loadlab.experiment.spec import SweepSpec, is_number, label


def render_csv(spec: SweepSpec, result: dict[str, Any]) -> str:
    """sweep.csv, for the spreadsheet the seed's team kept its sweep in: a row per configuration, sweep.md's
    table with numbers instead of text: each axis, then each column's median, min and max over the repeats
    (empty where the runs have none), the repeats finished, whether it meets the SLO (every class too), why
    not, and whether it is the SLO-first choice. A capacity search's has its capacity at SLO, first failing
    value and confidence after the axes."""
    import csv
    import io

    rejected = {r["config"]: "; ".join(r["reasons"]) for r in result["rejected"]}
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    axis_names = list(spec.axes)
    cap = spec.capacity
    header = list(axis_names)
    if cap is not None:  # a capacity search: its answer first (the columns are the runs there)
        header += [f"capacity at SLO ({cap.unit})", f"first fail ({cap.unit})", "confidence"]
    for column, *_ in COLUMNS:
        header += [column, f"{column} min", f"{column} max"]
    writer.writerow([*header, "repeats", "meets SLO", "rejected because", "chosen"])
    for row in result["rows"]:
        name = label(row["config"])
        cells: list[Any] = [row["config"][a] for a in axis_names]
        if cap is not None:
            found = row.get("capacity") or {}
            cells += [found.get(k) if found.get(k) is not None else "" for k in ("capacity", "hi")]
            cells.append(found.get("confidence", "") if found.get("values_tried") else "")
        for column, *_ in COLUMNS:
            v = row["values"][column]
            cells += ["" if v[k] is None else v[k] for k in ("median", "min", "max")]
        ran = row["repeats"] > 0 or name in rejected
        cells += [row["repeats"], (name not in rejected) if ran else "", rejected.get(name, ""),
                  name == result["choice"]]  # fmt: skip
        writer.writerow(cells)
    return out.getvalue()


def render_md(spec: SweepSpec, result: dict[str, Any], complete: bool) -> str:
    """sweep.md; ``complete``: False says the table holds an interrupted sweep's finished runs."""
    lines = [f"# loadlab sweep: {spec.name}", ""]
    failed = [label(r["config"]) for r in result["rows"] if r.get("error")]
    if failed:
        lines += [
            f"> **Failed**: {', '.join(failed)} (reasons below). Run the same command to try again.",
            "",
        ]
    elif not complete:
        lines += ["> **Incomplete**: interrupted; the table holds the finished runs. Run the same command to "
                  "resume.", ""]  # fmt: skip
    cap = spec.capacity
    if cap is not None:
        lines += [f"Profile `{spec.profile}`: for each configuration the highest {cap.over} at which the SLO "
                  f"holds (capacity at SLO): doubling from {show(cap.start, cap)}, then bisection to within "
                  f"{cap.tolerance:.0%}, {cap.repeats} run(s) at the last passing and first failing value (repeat "
                  "r with the profile's seed + r); a value passes when most of its runs meet the SLO (every "
                  "class its own). The other columns are the runs at that capacity (medians, range in "
                  "brackets).", ""]  # fmt: skip
    else:
        lines += [f"Profile `{spec.profile}`, {spec.repeats} repeat(s) per configuration; each cell is the "
                  "median of the repeats with their range in brackets.", ""]  # fmt: skip
    axis_names = list(spec.axes)
    overload = any(row.get("over_capacity") is not None for row in result["rows"])
    header = list(axis_names)
    if cap is not None:
        header += [f"capacity at SLO ({cap.unit})", "confidence"]
    header += [c for c, *_ in COLUMNS] + (["over capacity"] if overload else [])
    lines += ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for row in result["rows"]:
        cells = [str(row["config"][a]) for a in axis_names]
        if cap is not None:
            cells += _capacity_cells(row, cap)
        for column, _, _, digits in COLUMNS:
            cells.append(_cell(row["values"][column], digits))
        if overload:
            cells.append(_overload_cell(row))
        lines.append("| " + " | ".join(cells) + " |")
    evidence = [_overload_evidence(row) for row in result["rows"] if row.get("over_capacity")]
    if evidence:
        lines += ["", "Overload verdicts (open loop; each run's, summary.md) and the criteria that fired: offered "
                  "above capacity or TTFT growing make a row over capacity (its TTFT grows with the run's length; "
                  "it fails the SLO); in-flight growth alone is stated, not failed:", ""] + evidence  # fmt: skip
    classes = class_columns(result["rows"])
    if classes:
        lines += ["", "Each SLO class on its own (medians of the repeats; a class passes when each objective's "
                  "median is within its SLO, as the choice requires of every class):", ""]  # fmt: skip
        header = list(axis_names)
        for name, objectives in classes.items():
            header += [f"{name} {o['label']} ms (SLO {o['threshold_ms']:g})" for o in objectives] or [
                f"{name} TTFT P95 ms"
            ]
            header += [f"{name} output tok/s", name]
        lines += ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
        for row in result["rows"]:
            cells = [str(row["config"][a]) for a in axis_names]
            mine = {c["name"]: c for c in row.get("classes") or []}
            for name, objectives in classes.items():
                c = mine.get(name)
                if c is None:
                    cells += ["n/a"] * (max(len(objectives), 1) + 2)
                    continue
                by_key = {o["key"]: o for o in c["objectives"]}
                if objectives:
                    cells += [_cell(by_key[o["key"]], 0) if o["key"] in by_key else "n/a" for o in objectives]
                else:
                    cells.append(_cell(c["TTFT P95 ms"], 0))
                cells += [_cell(c["output tok/s"], 0), _verdict(c)]
            lines.append("| " + " | ".join(cells) + " |")
    slo = result.get("slo") or {}
    knee = result["knee"] or (f"n/a ({result['knee_note']})" if result.get("knee_note") else "n/a")
    lines += ["", f"- Knee (the next configuration adds < {KNEE_GAIN:.0%} throughput): {knee}"]
    if result.get("latency_knee") or not result.get("knee_note"):
        lines.append(f"- Latency-aware knee ({LATENCY_KNEE_RULE}): {result.get('latency_knee') or 'n/a'}")
    for column, front in (result.get("pareto") or {}).items():
        if front:
            lines.append(f"- Pareto-optimal on output tok/s against {column.replace(' ms', '')} (no other "
                         f"configuration has both more throughput and less latency): {', '.join(front)}")  # fmt: skip
    slo_text = ", ".join(f"{k} < {v:g}" for k, v in slo.items()) or "none"
    if classes:
        own = "; ".join(f"{name} " + (", ".join(f"{o['label']} < {o['threshold_ms']:g} ms" for o in objectives)
                                      or "no SLO") for name, objectives in classes.items())  # fmt: skip
        slo_text = (f"{slo_text} and " if slo else "") + f"every class its own SLO: {own}"
    rule = (
        f"the highest capacity at SLO, {slo_text}"
        if cap is not None
        else f"highest throughput meeting {slo_text}"
    )
    lines.append(f"- SLO-first choice ({rule}): {result['choice'] or 'none meets it'}")
    if result.get("choice_note"):
        lines.append(f"  - {result['choice_note']}")
    refined = [
        str(next(iter(r["config"].values()))) for r in result["rows"] if r.get("refined") and r["repeats"]
    ]
    if refined:
        lines.append(f"- Refined around the coarse sweep's knee: {', '.join(refined)} added")
    for item in result["rejected"]:
        lines.append(f"  - rejected {item['config']}: {'; '.join(item['reasons'])}")
    for finding in result["findings"]:
        lines.append(f"- {finding}")
    if result.get("confirmation"):
        lines += _confirmation_lines(result["confirmation"], cap)
    return "\n".join(lines) + "\n"


def _capacity_cells(row: dict[str, Any], cap) -> list[str]:
    """A row's capacity at SLO and its confidence (not run: a confirmation's other configurations)."""
    found = row.get("capacity") or {}
    if not found.get("values_tried"):
        return ["not run", ""]
    value = found["capacity"]
    shown = "none" if value is None else f"{int(value) if cap.integer else value:g}"
    if found["status"] == "at_least":
        shown = f">= {shown}"
    if not found["done"]:
        shown += " (searching)"
    return [f"**{shown}**", found["confidence"]]


def _overload_cell(row: dict[str, Any]) -> str:
    """A row's overload verdict: over capacity by the criteria that fail it (offered above capacity, TTFT
    growing), or only in-flight growth (said, not failed: no significance test, and it fires on Poisson
    noise when requests last long), or no; with its runs."""
    n, repeats = row.get("over_capacity"), row["repeats"]
    if n is None:
        return "n/a"
    if row.get("overloaded"):
        return f"**yes** ({row['overloaded']}/{repeats})"
    return f"in flight growing ({n}/{repeats})" if n else f"no (0/{repeats})"


def _overload_evidence(row: dict[str, Any]) -> str:
    """One over-capacity row's evidence in words (the medians of its runs' overload figures)."""
    e = row.get("overload") or {}
    said = []
    if e.get("offered_prompt_tokens_per_s") is not None:
        served = e.get("served_prompt_tokens_per_s")
        said.append(f"offered {e['offered_prompt_tokens_per_s']:.0f} prompt tok/s"
                    + (f" against {served:.0f} served while requests waited" if served is not None else ""))  # fmt: skip
    if e.get("ttft_slope") is not None:
        said.append(f"TTFT from the due time rising {e['ttft_slope'] * 1000:.0f} ms per second of arrivals")
    if e.get("in_flight_growth_per_s") is not None:
        said.append(f"in flight growing by {e['in_flight_growth_per_s']:.1f}/s at the end")
    rate = f" at {row['rate']:g} req/s" if row.get("rate") is not None else ""
    fired = ", ".join(
        f"{name.replace('_', ' ')} {n}" for name, n in (row.get("overload_criteria") or {}).items() if n
    )
    return f"- {label(row['config'])}{rate}: {row['over_capacity']} of {row['repeats']} runs ({fired}); " + (
        "; ".join(said) or "no figures"
    )


def _confirmation_lines(items: list[dict[str, Any]], cap) -> list[str]:
    """The real-time confirmation against virtual time: each configuration's capacity in both."""
    lines = ["", "Real time against virtual time (the virtual-time search's best configuration and its "
             "neighbours, each real-time search started from its virtual bracket):", "",
             "| configuration | virtual time | real time | real / virtual - 1 | virtual confidence | real confidence |",
             "|---|---:|---:|---:|---|---|"]  # fmt: skip
    for item in items:
        diff = f"{item['difference']:+.1%}" if item["difference"] is not None else "n/a"
        name = item["config"] + (" (best)" if item["best"] else "")
        lines.append(f"| {name} | {show(item['virtual'], cap)} | {show(item['real'], cap)} | {diff} | "
                     f"{item['virtual_confidence']} | {item['real_confidence'] or 'not run'} |")  # fmt: skip
    return lines


def _cell(v: dict[str, Any], digits: int) -> str:
    """A median with the repeats' range in brackets when they differ."""
    if v["median"] is None:
        return "n/a"
    if v["min"] == v["max"]:
        return f"{v['median']:.{digits}f}"
    return f"{v['median']:.{digits}f} [{v['min']:.{digits}f}-{v['max']:.{digits}f}]"


def _verdict(c: dict[str, Any]) -> str:
    """A class's verdict in a configuration; where its runs' own verdicts differ, how many passed."""
    text = {True: "pass", False: "**FAIL**", None: "no SLO"}[c["pass"]]
    if c["pass"] is not None and c["runs"] > 1 and c["runs_passed"] not in (0, c["runs"]):
        text += f" ({c['runs_passed']} of {c['runs']} runs passed)"
    if c["failed"]:
        text += f", {c['failed']} failed"
    return text


def class_columns(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Every class of the rows, in order of appearance, with the objectives of its SLO (the first row's
    that has it: a sweep does not vary a class's SLO)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        for c in row.get("classes") or []:
            out.setdefault(c["name"], c["objectives"])
    return out


# Colours of what the pages mark (tests/test_analysis.py finds them in a screenshot).
PARETO_COLOUR = "#ff7f0e"  # the Pareto-optimal configurations
LATENCY_KNEE_COLOUR = "#9467bd"  # the latency-aware knee
CAPACITY_COLOUR = "#17becf"  # capacity at SLO per configuration


def render_html(spec: SweepSpec, result: dict[str, Any]) -> str:
    """The sweep's curves along its configurations: throughput, TTFT P95 and TPOT P95 (medians, with the
    repeats' range), the SLO lines, the knee and the latency-aware knee marked, with classes each class's
    key figure against its SLO; then the Pareto view (throughput against TTFT P95 and against TPOT P95,
    the SLO lines, the Pareto-optimal configurations joined) and, for a capacity search, capacity at SLO
    per configuration; plus the tables of sweep.md."""
    # Heavy, loaded only when a page is drawn: matplotlib, and loadlab.analysis.html (numpy, pandas).
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from loadlab.analysis.html import png_base64

    rows = [r for r in result["rows"] if r["repeats"]]
    labels = [label(r["config"]) for r in rows]
    axis_names = list(spec.axes)
    # One axis: its values on the x axis, its name below; several: each configuration's label.
    ticks = [str(r["config"][axis_names[0]]) for r in rows] if len(axis_names) == 1 else labels
    values = [r["config"][axis_names[0]] for r in rows]
    # One axis of positive numbers (limits, loads): at their values on a log scale, so refined points sit
    # where they belong; otherwise one slot per configuration.
    log_x = len(axis_names) == 1 and bool(rows) and all(is_number(v) and v > 0 for v in values)
    x = values if log_x else list(range(len(rows)))
    slo = result.get("slo") or {}
    classes = class_columns(rows)
    fig, axes = plt.subplots(1, 4 if classes else 3, figsize=(21 if classes else 16, 4))
    for ax, column, limit in zip(axes[:3], ("output tok/s", "TTFT P95 ms", "TPOT P95 ms"),
                                 (None, slo.get("ttft_p95_ms"), slo.get("tpot_p95_ms")), strict=True):  # fmt: skip
        med = [r["values"][column]["median"] for r in rows]
        lo = [r["values"][column]["min"] for r in rows]
        hi = [r["values"][column]["max"] for r in rows]
        ax.plot(x, [m if m is not None else float("nan") for m in med], marker="o")
        ax.fill_between(x, [v if v is not None else float("nan") for v in lo],
                        [v if v is not None else float("nan") for v in hi], alpha=0.2)  # fmt: skip
        if limit is not None:
            ax.axhline(limit, color="red", ls="--", lw=1, label=f"SLO {limit:g}")
        if result.get("knee") in labels:
            ax.axvline(x[labels.index(result["knee"])], color="grey", ls=":", lw=1, label="knee")
        if result.get("latency_knee") in labels:
            ax.axvline(x[labels.index(result["latency_knee"])], color=LATENCY_KNEE_COLOUR, ls="-.", lw=1.5,
                       label="latency-aware knee")  # fmt: skip
        if result.get("choice") in labels and med[labels.index(result["choice"])] is not None:
            i = labels.index(result["choice"])
            ax.plot([x[i]], [med[i]], marker="*", ms=16, color="green", ls="none", label="SLO-first choice")
        if ax.get_legend_handles_labels()[0]:  # no SLO, knee or choice to mark: no empty legend
            ax.legend(fontsize=8)
        ax.set_ylim(bottom=0)  # small differences stay small
        ax.set_title(column)
    if classes:
        _class_panel(axes[3], rows, classes, x)
    for ax in axes:
        if log_x:
            ax.set_xscale("log")
            ax.minorticks_off()
        ax.set_xticks(x, ticks, rotation=0 if len(axis_names) == 1 else 30, ha="center" if len(axis_names) == 1
                      else "right", fontsize=8)  # fmt: skip
        if len(axis_names) == 1:
            ax.set_xlabel(axis_names[0])
        ax.grid(alpha=0.3)
    images = [png_base64(fig, tight=True)]  # the configurations' labels, rotated, vary in size
    plt.close(fig)
    cap = spec.capacity
    fig, axes = plt.subplots(1, 3 if cap else 2, figsize=(16 if cap else 11, 4.2))
    for ax, column in zip(axes, LATENCY_COLUMNS, strict=False):
        _pareto_panel(ax, rows, ticks, column, slo.get(column.split()[0].lower() + "_p95_ms"), result)
    if cap is not None:
        _capacity_panel(axes[2], rows, x, ticks, log_x, cap, axis_names)
    images.append(png_base64(fig, tight=True))
    plt.close(fig)
    title = html.escape(f"loadlab sweep: {spec.name}")
    table = html.escape(render_md(spec, result, complete=True))
    imgs = "".join(f"<img alt='sweep {what}' style='max-width:100%' src='data:image/png;base64,{image}'><br>"
                   for what, image in zip(("curves", "pareto"), images, strict=True))  # fmt: skip
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title><style>"
            "body{font-family:sans-serif}pre{white-space:pre-wrap;background:#f6f6f6;padding:1em}</style>"
            f"</head><body><h1>{title}</h1>{imgs}"
            f"<p>Latency-aware knee: {html.escape(LATENCY_KNEE_RULE)}. Pareto-optimal: no other configuration has "
            "both more output throughput and less latency on that panel.</p>"
            f"<pre>{table}</pre></body></html>\n")  # fmt: skip


def _pareto_panel(ax, rows: list[dict[str, Any]], ticks: list[str], column: str, limit, result: dict) -> None:
    """Output throughput against one latency figure, one point per configuration (labelled), the SLO as a
    vertical line, the Pareto-optimal configurations marked and joined."""
    front = set((result.get("pareto") or {}).get(column) or [])
    pts = [(r["values"][column]["median"], r["values"]["output tok/s"]["median"], tick, label(r["config"]))
           for r, tick in zip(rows, ticks, strict=True)]  # fmt: skip
    pts = [p for p in pts if p[0] is not None and p[1] is not None]
    ax.plot(
        [p[0] for p in pts], [p[1] for p in pts], marker="o", ls="none", color="C0", label="configuration"
    )
    best = sorted(p for p in pts if p[3] in front)
    if best:
        ax.plot([p[0] for p in best], [p[1] for p in best], marker="D", ms=9, color=PARETO_COLOUR, lw=2,
                label="Pareto-optimal")  # fmt: skip
    for lat, thr, tick, _ in pts:
        ax.annotate(tick, (lat, thr), textcoords="offset points", xytext=(4, 4), fontsize=8)
    if limit is not None:
        ax.axvline(limit, color="red", ls="--", lw=1, label=f"SLO {limit:g} ms")
    choice = next((p for p in pts if p[3] == result.get("choice")), None)
    if choice is not None:
        ax.plot(
            [choice[0]], [choice[1]], marker="*", ms=16, color="green", ls="none", label="SLO-first choice"
        )
    lats = [p[0] for p in pts]
    if lats and min(lats) > 0 and max(lats) / min(lats) > 20:  # seconds and minutes side by side
        ax.set_xscale("log")
    ax.set_ylim(bottom=0)
    ax.set_xlabel(column)
    ax.set_ylabel("output tok/s")
    ax.set_title(f"Pareto: output tok/s against {column.replace(' ms', '')}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _capacity_panel(ax, rows, x, ticks, log_x: bool, cap, axis_names: list[str]) -> None:
    """Capacity at SLO per configuration, the first failing value above it shaded."""
    lo = [(r.get("capacity") or {}).get("lo") for r in rows]
    hi = [(r.get("capacity") or {}).get("hi") for r in rows]
    ax.plot(x, [v if v is not None else float("nan") for v in lo], marker="s", color=CAPACITY_COLOUR, lw=2,
            label="capacity at SLO (last pass)")  # fmt: skip
    ax.plot(x, [v if v is not None else float("nan") for v in hi], marker="x", color="red", ls="none",
            label="first fail")  # fmt: skip
    if log_x:
        ax.set_xscale("log")
        ax.minorticks_off()
    ax.set_xticks(x, ticks, fontsize=8, rotation=0 if len(axis_names) == 1 else 30)
    if len(axis_names) == 1:
        ax.set_xlabel(axis_names[0])
    ax.set_ylim(bottom=0)
    ax.set_title(f"capacity at SLO ({cap.over}, {cap.unit})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _class_panel(ax, rows: list[dict[str, Any]], classes: dict[str, list[dict[str, Any]]], x: list) -> None:
    """Each class's first objective (its key figure) as a fraction of its SLO: above the line at 1 it
    fails. One panel for all classes, whatever their thresholds (1.5 s and 30 s side by side)."""
    for name, objectives in classes.items():
        if not objectives:
            continue
        key, threshold = objectives[0]["key"], objectives[0]["threshold_ms"]
        ratios = []
        for row in rows:
            c = next((c for c in row.get("classes") or [] if c["name"] == name), None)
            o = next((o for o in (c or {}).get("objectives", []) if o["key"] == key), None)
            ratios.append(o["median"] / threshold if o and o["median"] is not None else float("nan"))
        ax.plot(x, ratios, marker="s", label=f"{name} {objectives[0]['label']} / {threshold:g} ms")
    ax.axhline(1, color="red", ls="--", lw=1, label="SLO")
    ax.set_ylim(bottom=0)
    ax.set_title("each class: key figure / its SLO")
    ax.legend(fontsize=8)
