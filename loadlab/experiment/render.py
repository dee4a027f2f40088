"""A sweep's result as pages: `sweep.md` (the seed's table, knee, choice, findings) and `sweep.html` (the
curves along the configurations, the SLO lines, the knee and the choice marked, and the same table)."""

from __future__ import annotations

import html
from typing import Any

from loadlab.experiment.aggregate import COLUMNS, KNEE_GAIN
from loadlab.experiment.spec import SweepSpec, is_number, label


def render_csv(spec: SweepSpec, result: dict[str, Any]) -> str:
    """sweep.csv, for the spreadsheet the seed's team kept its sweep in: a row per configuration, sweep.md's
    table with numbers instead of text: each axis, then each column's median, min and max over the repeats
    (empty where the runs have none), the repeats finished, whether it meets the SLO (every class too), why
    not, and whether it is the SLO-first choice."""
    import csv
    import io

    rejected = {r["config"]: "; ".join(r["reasons"]) for r in result["rejected"]}
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    axis_names = list(spec.axes)
    header = list(axis_names)
    for column, *_ in COLUMNS:
        header += [column, f"{column} min", f"{column} max"]
    writer.writerow([*header, "repeats", "meets SLO", "rejected because", "chosen"])
    for row in result["rows"]:
        name = label(row["config"])
        cells: list[Any] = [row["config"][a] for a in axis_names]
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
    lines += [f"Profile `{spec.profile}`, {spec.repeats} repeat(s) per configuration; each cell is the "
              "median of the repeats with their range in brackets.", ""]  # fmt: skip
    axis_names = list(spec.axes)
    header = axis_names + [c for c, *_ in COLUMNS]
    lines += ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for row in result["rows"]:
        cells = [str(row["config"][a]) for a in axis_names]
        for column, _, _, digits in COLUMNS:
            cells.append(_cell(row["values"][column], digits))
        lines.append("| " + " | ".join(cells) + " |")
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
    slo_text = ", ".join(f"{k} < {v:g}" for k, v in slo.items()) or "none"
    if classes:
        own = "; ".join(f"{name} " + (", ".join(f"{o['label']} < {o['threshold_ms']:g} ms" for o in objectives)
                                      or "no SLO") for name, objectives in classes.items())  # fmt: skip
        slo_text = (f"{slo_text} and " if slo else "") + f"every class its own SLO: {own}"
    lines.append(
        f"- SLO-first choice (highest throughput meeting {slo_text}): {result['choice'] or 'none meets it'}"
    )
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
    return "\n".join(lines) + "\n"


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


def render_html(spec: SweepSpec, result: dict[str, Any]) -> str:
    """The sweep's curves along its configurations: throughput, TTFT P95 and TPOT P95 (medians, with the
    repeats' range), the SLO lines and the knee marked, with classes each class's key figure against its
    SLO; plus the tables of sweep.md."""
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
    image = png_base64(fig)
    plt.close(fig)
    title = html.escape(f"loadlab sweep: {spec.name}")
    table = html.escape(render_md(spec, result, complete=True))
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title><style>"
            "body{font-family:sans-serif}pre{white-space:pre-wrap;background:#f6f6f6;padding:1em}</style>"
            f"</head><body><h1>{title}</h1>"
            f"<img alt='sweep curves' style='max-width:100%' src='data:image/png;base64,{image}'>"
            f"<pre>{table}</pre></body></html>\n")  # fmt: skip


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
