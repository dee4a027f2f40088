"""A sweep's result as pages: `sweep.md` (the seed's table, knee, choice, findings) and `sweep.html` (the
curves along the configurations, the SLO lines, the knee and the choice marked, and the same table)."""

from __future__ import annotations

import html
from typing import Any

from loadlab.experiment.aggregate import COLUMNS, KNEE_GAIN
from loadlab.experiment.spec import SweepSpec, is_number, label


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
            v = row["values"][column]
            if v["median"] is None:
                cells.append("n/a")
            elif v["min"] == v["max"]:
                cells.append(f"{v['median']:.{digits}f}")
            else:
                cells.append(f"{v['median']:.{digits}f} [{v['min']:.{digits}f}-{v['max']:.{digits}f}]")
        lines.append("| " + " | ".join(cells) + " |")
    slo = result.get("slo") or {}
    lines += [
        "",
        f"- Knee (the next configuration adds < {KNEE_GAIN:.0%} throughput): {result['knee'] or 'n/a'}",
    ]
    slo_text = ", ".join(f"{k} < {v:g}" for k, v in slo.items()) or "none"
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


def render_html(spec: SweepSpec, result: dict[str, Any]) -> str:
    """The sweep's curves along its configurations: throughput, TTFT P95 and TPOT P95 (medians, with the
    repeats' range), the SLO lines and the knee marked; plus the table of sweep.md."""
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
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    for ax, column, limit in zip(axes, ("output tok/s", "TTFT P95 ms", "TPOT P95 ms"),
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
        ax.legend(fontsize=8)
        ax.set_ylim(bottom=0)  # small differences stay small
        ax.set_title(column)
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
