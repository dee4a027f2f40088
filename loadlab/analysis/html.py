"""`report.html`: one self-contained page (plots embedded as PNG) beside summary.md.

Latency CDFs (TTFT, TPOT, ITL per token, E2E) of the measured, completed requests, and a per-second
timeline over the run (the warm-up shaded): output tokens/s and requests in flight (from the records),
TTFT of the requests sent in each second, and the server's running/queued requests and KV usage (from its
/metrics, when scraped; a cluster's KV as the servers' mean and highest). With several workers (records
naming their worker, or several servers scraped), a per-worker timeline: each worker's requests in flight
(records' served_by), and its running and queued requests and KV usage (its own /metrics rows), one line
per worker, so one idle while others queue shows.
With SLO classes the page opens with them: the overall verdict, a table of the classes side by side (counts,
TTFT/TPOT/E2E P50/P95/P99, output tok/s, verdict) and TTFT, TPOT and E2E CDFs with a line per class and each
class's SLO limits, in its colour.
"""

from __future__ import annotations

import base64
import html
import io
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from loadlab.analysis.itl import PLOT_SAMPLES, Pooled, RunEvents, Timeline
from loadlab.analysis.metrics import record_events, strings
from loadlab.analysis.server_metrics import gauge_series, same_server
from loadlab.analysis.stats import quantiles
from loadlab.analysis.summary import Summary, itl_estimated, itl_notes
from loadlab.records import MEASURE, OK

REPORT_HTML = "report.html"


class RenderError(RuntimeError):
    """The page could not be rendered (no browser, or the browser failed): one line."""


def screenshot(page: Path, png: Path, width: int = 1280, height: int = 2400) -> Path:
    """Renders ``page`` in headless Chromium (Debian: ``apt-get install chromium``; not a dependency) and
    saves a screenshot: the check that a report renders with its plots. ``png`` is replaced only by a
    screenshot that was taken."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise RenderError("no chromium on PATH (Debian: apt-get install chromium)")
    if not page.is_file():
        raise RenderError(f"{page}: no such page")
    shot = png.with_name(png.name + ".tmp.png").resolve()
    # /dev/shm is 64 MB in a container: without --disable-dev-shm-usage Chromium may crash or draw nothing.
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
           f"--window-size={width},{height}", f"--screenshot={shot}", page.resolve().as_uri()]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        shot.unlink(missing_ok=True)
        raise RenderError(f"chromium did not render {page} within 120 s") from None
    if done.returncode != 0 or not shot.exists():
        shot.unlink(missing_ok=True)
        tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
        raise RenderError(f"chromium could not render {page} (exit status {done.returncode}): {tail[0]}")
    shot.replace(png)
    return png


def png_base64(fig, tight: bool = False) -> str:
    """The figure as a PNG in base64. A report's figures set their own margins (``subplots_adjust``, sized
    for their labels): ``tight`` (cropped to what was drawn) draws a figure twice, half of a report's plotting
    time; a figure whose labels' size is not known beforehand asks for it."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight" if tight else None)
    return base64.b64encode(buf.getvalue()).decode()


def _cdfs(samples: dict[str, np.ndarray], itl_label: str = "ITL (per token)"):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(13.3, 3.6))
    fig.subplots_adjust(left=0.05, right=0.99, bottom=0.15, top=0.85, wspace=0.22)
    for ax, (stem, title) in zip(axes, (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", itl_label),
                                        ("e2e_latency_ms", "E2E")), strict=True):  # fmt: skip
        values, count = _plotted(samples.get(stem))
        if isinstance(samples.get(stem), Pooled):  # ITL over the events: its exact percentiles, taken already
            marks = np.array([samples[stem].known.get(q, np.nan) for q in (50.0, 95.0, 99.0, 99.9)])
        else:
            marks = quantiles(values if count == values.size else samples.get(stem), [50, 95, 99, 99.9])
        if values.size:
            ax.plot(values, np.arange(1, values.size + 1) / values.size)
            for mark in marks[:3]:
                ax.axvline(mark, color="grey", lw=0.6, ls=":")
        clipped = ""
        if values.size and values[-1] > 3 * marks[3]:  # a long tail hides the body
            ax.set_xlim(values[0], marks[3])
            clipped = ", to P99.9"
        drawn = f", the line drawn through {values.size} of them" if count > values.size else ""
        ax.set_title(f"{title} CDF\n({count} samples{clipped}{drawn})", fontsize=9)
        ax.set_xlabel("ms")
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction")
    return fig


def _in_flight_per_second(s: np.ndarray, e: np.ndarray, span: int) -> np.ndarray:
    """The time-weighted number of the intervals [s, e) (seconds since the first send) in flight in each
    second [b, b + 1) of ``span``: each interval adds its part of its first and last second and 1 to every
    second in between."""
    s, e = s[e > s], e[e > s]
    first, last = np.floor(s).astype(np.int64), np.floor(e).astype(np.int64)
    same = first == last
    out = np.zeros(span + 1)
    for at, part in ((first[same], (e - s)[same]), (first[~same], (first + 1 - s)[~same]),
                     (last[~same], (e - last)[~same])):  # fmt: skip
        out += np.bincount(at, weights=part, minlength=span + 1)[: span + 1]
    full = np.zeros(span + 2)  # +1 over (first, last): a difference array
    np.add.at(full, first[~same] + 1, 1.0)
    np.add.at(full, last[~same], -1.0)
    return (out + np.cumsum(full)[: span + 1])[:span]


def _median_per_second(second: np.ndarray, values: np.ndarray, rows: np.ndarray, span: int) -> np.ndarray:
    """The median of ``values[rows]`` per second (``second``: each row's); NaN in a second without one."""
    out = np.full(span, np.nan)
    second, values = second[rows].astype(np.int64), values[rows]
    inside = (second >= 0) & (second < span)
    second, values = second[inside], values[inside]
    if not second.size:
        return out
    order = np.lexsort((values, second))
    second, values = second[order], values[order]
    starts = np.flatnonzero(np.concatenate([[True], second[1:] != second[:-1]]))
    counts = np.diff(np.append(starts, second.size))
    low, high = starts + (counts - 1) // 2, starts + counts // 2
    out[second[starts]] = (values[low] + values[high]) / 2  # np.median's middle pair
    return out


def timeline_of(df: pd.DataFrame) -> Timeline:
    """The timeline's seconds: each record's send time, the first send (its origin) and the seconds to the
    last end (at least 1)."""
    t_send = pd.to_numeric(df["t_send_wall"], errors="coerce").to_numpy(dtype=float)
    e2e = pd.to_numeric(df["e2e_ms"], errors="coerce").to_numpy(dtype=float)
    t0 = float(np.nanmin(t_send)) if t_send.size and np.isfinite(t_send).any() else 0.0
    end = np.where(np.isfinite(e2e), t_send + e2e / 1000.0, t_send)
    span = max(1, int(np.ceil(np.nanmax(end) - t0))) if t_send.size and np.isfinite(end).any() else 1
    return t_send, t0, span


def _timeline(df: pd.DataFrame, server_rows: list[dict[str, Any]], events: RunEvents | None = None):
    import matplotlib.pyplot as plt

    t_send, t0, span = timeline = timeline_of(df)
    e2e = pd.to_numeric(df["e2e_ms"], errors="coerce").to_numpy(dtype=float)
    end = np.where(np.isfinite(e2e), t_send + e2e / 1000.0, t_send)
    seconds = np.arange(span)
    events = events if events is not None else record_events(df, keep_times=True)
    tokens = events.seconds(timeline)
    # Time-weighted requests in flight per second (every request, warm-up and failures included).
    s_rel, e_rel = t_send - t0, end - t0
    valid = np.isfinite(s_rel) & np.isfinite(e_rel)
    in_flight = _in_flight_per_second(s_rel[valid], e_rel[valid], span)
    measured_ok = (df["phase"] == MEASURE).to_numpy() & (df["outcome"] == OK).to_numpy()
    ttft = pd.to_numeric(df["ttft_ms"], errors="coerce").to_numpy(dtype=float)
    ttft_p50 = _median_per_second(np.floor(t_send - t0), ttft, measured_ok & np.isfinite(ttft), span)
    fig, axes = plt.subplots(4, 1, figsize=(13.3, 9.2), sharex=True)
    fig.subplots_adjust(left=0.07, right=0.99, bottom=0.06, top=0.99, hspace=0.15)
    axes[0].plot(seconds, tokens, drawstyle="steps-post")
    axes[0].set_ylabel("output tokens/s")
    axes[1].plot(seconds, in_flight, drawstyle="steps-post", label="in flight (client, mean per second)")
    axes[1].set_ylabel("requests")
    axes[2].plot(seconds, ttft_p50, marker=".", lw=0.8)
    axes[2].set_ylabel("TTFT P50 of sends (ms)")
    servers = sorted({r["url"] for r in server_rows if "m" in r})
    if servers:
        for name, key in (
            ("running (server)", "sglang:num_running_reqs"),
            ("queued (server)", "sglang:num_queue_reqs"),
        ):
            ts, values = gauge_series(server_rows, key)  # summed across the servers
            axes[1].plot(
                np.array(ts) - t0,
                values,
                label=name.replace("server", f"{len(servers)} servers") if len(servers) > 1 else name,
            )
        # KV usage is a share of each server's own cache: one server's line, or with several the mean and the
        # fullest per round (each server's own line is the per-worker figure's).
        kv_lines = (
            [("mean", lambda v: sum(v) / len(v)), ("highest", max)] if len(servers) > 1 else [(None, sum)]
        )
        for label, combine in kv_lines:
            ts, values = gauge_series(server_rows, "sglang:token_usage", combine)
            axes[3].plot(np.array(ts) - t0, 100 * np.array(values, dtype=float),
                         label=label and f"{label} of {len(servers)} servers")  # fmt: skip
        if len(servers) > 1:
            axes[3].legend(loc="upper right", fontsize=8)
        axes[3].set_ylabel("KV usage (%)")
    else:
        axes[3].text(
            0.5, 0.5, "no server metrics (/metrics not scraped)", ha="center", transform=axes[3].transAxes
        )
    measured_sends = t_send[(df["phase"] == MEASURE).to_numpy() & np.isfinite(t_send)]
    if measured_sends.size and measured_sends.min() > t0:  # the warm-up came first: shade it
        for ax in axes:
            ax.axvspan(0, measured_sends.min() - t0, color="#ffb000", alpha=0.15, lw=0)
        axes[0].text(0.002, 0.92, "warm-up", transform=axes[0].transAxes, va="top", color="#a06000")
    axes[0].set_ylim(bottom=0)
    axes[1].set_ylim(bottom=0)
    axes[1].legend(loc="upper right")
    axes[3].set_xlabel("seconds since the first send")
    for ax in axes:
        ax.grid(alpha=0.3)
    return fig


def _timeline_origin(df: pd.DataFrame) -> float:
    t_send = pd.to_numeric(df["t_send_wall"], errors="coerce").to_numpy(dtype=float)
    return float(np.nanmin(t_send)) if t_send.size and np.isfinite(t_send).any() else 0.0


def _per_worker(df: pd.DataFrame, server_rows: list[dict[str, Any]], workers: list[str],
                down: dict[str, float] | None = None):  # fmt: skip
    """One line per worker: requests in flight (client side, the records it served), running and queued
    requests and KV usage (its own /metrics rows); a dashed line in its colour where it stopped answering
    (``down``: worker -> epoch s). Workers are the records' served_by values and the scraped URLs, matched
    by ``same_server``."""
    import matplotlib.pyplot as plt

    t0 = _timeline_origin(df)
    scraped = {same_server(r["url"]) for r in server_rows if "m" in r and isinstance(r.get("url"), str)}
    names = sorted({same_server(w) for w in workers} | scraped)
    colors = {w: plt.cm.tab10(i % 10) for i, w in enumerate(names)}
    fig, axes = plt.subplots(4, 1, figsize=(13.3, 8.6), sharex=True)
    fig.subplots_adjust(left=0.07, right=0.99, bottom=0.06, top=0.96, hspace=0.15)
    t_send = pd.to_numeric(df["t_send_wall"], errors="coerce").to_numpy(dtype=float)
    e2e = pd.to_numeric(df["e2e_ms"], errors="coerce").to_numpy(dtype=float)
    end = np.where(np.isfinite(e2e), t_send + e2e / 1000.0, t_send)
    served = strings(df, "served_by")
    names_of = {v: same_server(v) for v in set(served.tolist()) if v is not None}
    served = np.array([names_of.get(v) for v in served.tolist()], dtype=object)
    span = max(1, int(np.ceil(np.nanmax(end) - t0))) if end.size and np.isfinite(end).any() else 1
    seconds = np.arange(span)
    for w in names:
        mine = (served == w) & np.isfinite(t_send) & np.isfinite(end)
        if mine.any():  # time-weighted requests in flight per second, every phase and outcome
            flight = _in_flight_per_second(t_send[mine] - t0, end[mine] - t0, span)
            axes[0].plot(seconds, flight, drawstyle="steps-post", color=colors[w], label=w)
        rows = [
            r
            for r in server_rows
            if "m" in r and isinstance(r.get("url"), str) and same_server(r["url"]) == w
        ]
        for ax, key, scale in ((axes[1], "sglang:num_running_reqs", 1), (axes[2], "sglang:num_queue_reqs", 1),
                               (axes[3], "sglang:token_usage", 100)):  # fmt: skip
            points = [(r["t"] - t0, r["m"][key] * scale) for r in rows if key in r["m"]]
            if points:
                ax.plot(*zip(*points, strict=True), color=colors[w], label=w)
    for ax, label in zip(axes, ("in flight (client)", "running (server)", "queued (server)",
                                "KV usage (%)"), strict=True):  # fmt: skip
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(loc="upper right", fontsize=8)
        else:
            why = "no records name a worker" if ax is axes[0] else "no server metrics (/metrics not scraped)"
            ax.text(0.5, 0.5, why, ha="center", transform=ax.transAxes)
    for w, t_down in (down or {}).items():
        w = same_server(w)
        for ax in axes:
            ax.axvline(t_down - t0, color=colors.get(w, "black"), linestyle="--", linewidth=1)
        axes[0].annotate(f"{w} stopped answering", (t_down - t0, 0), xytext=(3, 3), textcoords="offset points",
                         fontsize=8, color=colors.get(w, "black"))  # fmt: skip
    axes[0].set_title("Per worker")
    axes[3].set_xlabel("seconds since the first send")
    return fig


# -- per SLO class ------------------------------------------------------------------------------------------
# Each class's colour, in the summary's order (the profile's): matplotlib's tab10 without its blue (the
# run-wide lines) and its grey (the percentile marks), so a class is never mistaken for either. Past eight
# classes the colours repeat with a dash-dot line.
CLASS_COLOURS = ("#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf")
VERDICT_COLOURS = {True: "#116329", False: "#a40e26", None: "#666666"}  # darker than any class colour
CLASS_PANELS = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2e_latency_ms", "E2E"))
# The per-class table's counts and statistics: (heading, the summary.json key or statistic of a class).
CLASS_COUNTS = (("measured", "measured_requests"), ("completed", "completed"), ("failed", "failed"))
CLASS_STATS = (("P50", "median"), ("P95", "p95"), ("P99", "p99"))


def class_colour(i: int) -> str:
    return CLASS_COLOURS[i % len(CLASS_COLOURS)]


def _sorted_finite(values: Any) -> np.ndarray:
    return _plotted(values)[0]


# A CDF line is drawn through this many samples at most: past it, a uniform draw of them (seeded, so a
# report is the same each time it is made) shows the same curve, to the width of a line, at a small part of
# the cost (sorting and drawing 100M ITL samples takes minutes). The percentile marks stay exact.


def _plotted(values: Any) -> tuple[np.ndarray, int]:
    """The sorted finite samples a CDF line is drawn through, and how many finite samples there are."""
    if isinstance(values, Pooled):
        return values.draw(PLOT_SAMPLES), values.count
    v = np.asarray(values if values is not None else [], dtype=float).ravel()
    finite = np.isfinite(v)
    count = int(np.count_nonzero(finite))
    if count > PLOT_SAMPLES:
        v = v if count == v.size else v[finite]
        return np.sort(v[np.random.default_rng(0).integers(0, v.size, PLOT_SAMPLES)]), count
    v = np.sort(v)
    return v[np.isfinite(v)], count


def _class_cdfs(summary: Summary, class_samples: dict[str, dict[str, np.ndarray]]):
    """TTFT, TPOT and E2E CDFs, one line per class in its colour, and each limit the class is judged by (its
    slo, else the profile's) as a dashed vertical line in the same colour, a circle at its percentile."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, axes = plt.subplots(1, len(CLASS_PANELS), figsize=(13.3, 4.2))
    fig.subplots_adjust(left=0.05, right=0.99, bottom=0.13, top=0.83, wspace=0.2)
    for ax, (stem, title) in zip(axes, CLASS_PANELS, strict=True):
        top = 0.0
        for i, c in enumerate(summary.classes):
            values = _sorted_finite(class_samples.get(c.name, {}).get(stem))
            if not values.size:
                continue
            style = "-" if i < len(CLASS_COLOURS) else "-."
            ax.plot(
                values, np.arange(1, values.size + 1) / values.size, color=class_colour(i), ls=style, lw=1.8
            )
            tail = quantiles(class_samples[c.name][stem], [99.9])[0]
            top = max(top, tail if values[-1] > 3 * tail else values[-1])  # a long tail hides the body
        shown, data_top = 0, top
        for i, c in enumerate(summary.classes):
            for o in c.slo.objectives:
                if o.metric != stem:
                    continue
                colour = class_colour(i)
                if data_top and o.threshold_ms > 2 * data_top:  # far beyond the data: named at the edge
                    ax.text(0.98, 0.08 + 0.09 * shown, f"{c.name}: P{o.percentile} limit {o.threshold_ms:g} ms \u2192",
                            transform=ax.transAxes, ha="right", color=colour, fontsize=8)  # fmt: skip
                    shown += 1
                    continue
                top = max(top, o.threshold_ms)
                ax.axvline(o.threshold_ms, color=colour, ls="--", lw=1.2)
                ax.plot([o.threshold_ms], [o.percentile / 100], marker="o", ms=6, mfc="none", color=colour)
        if top:
            ax.set_xlim(0, top * 1.03)
        else:
            ax.text(0.5, 0.5, "no samples", ha="center", transform=ax.transAxes)
        ax.set_title(f"{title} CDF per class")
        ax.set_xlabel("ms")
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3)
    handles = [
        Line2D([], [], color=class_colour(i), ls="-" if i < len(CLASS_COLOURS) else "-.", lw=1.8,
               label=f"{c.name} ({c.completed} completed)")
        for i, c in enumerate(summary.classes)
    ]  # fmt: skip
    limit = Line2D([], [], color="black", ls="--", lw=1.2, marker="o", mfc="none",
                   label="SLO limit (its class's colour; o at its percentile)")  # fmt: skip
    # Above the panels, in one row: inside one it would hide a class's lines.
    fig.legend(handles=[*handles, limit], loc="upper center", bbox_to_anchor=(0.5, 1.0),
               ncol=len(handles) + 1, fontsize=9, frameon=False)  # fmt: skip
    axes[0].set_ylabel("fraction")
    return fig


def _cell(key: str, value: Any, digits: str = ".2f") -> str:
    """A table cell holding one summary.json value: shown rounded, exact in ``data-value`` (JSON's text)."""
    if value is None:
        shown, exact = "n/a", "null"
    elif isinstance(value, bool):
        shown, exact = verdict_text(value), "true" if value else "false"
    elif isinstance(value, int):
        shown, exact = str(value), str(value)
    else:
        shown, exact = f"{value:{digits}}", repr(float(value))
    return f"<td data-key='{key}' data-value='{exact}'>{shown}</td>"


def verdict_text(passed: bool | None) -> str:
    return "n/a" if passed is None else ("PASS" if passed else "FAIL")


def _verdict(passed: bool | None) -> str:
    exact = "null" if passed is None else ("true" if passed else "false")
    return (f"<td class='verdict' data-key='slo.pass' data-value='{exact}' style='color:{VERDICT_COLOURS[passed]}'>"
            f"<b>{verdict_text(passed)}</b></td>")  # fmt: skip


def _objectives(objectives) -> str:
    return (
        "; ".join(
            f"{o.metric.removesuffix('_ms').removesuffix('_latency').upper()} P{o.percentile} "
            f"{'n/a' if o.value_ms is None else f'{o.value_ms:.2f}'} ms (limit {o.threshold_ms:g} ms)"
            for o in objectives
        )
        or "none"
    )


def _class_section(summary: Summary, image: str) -> str:
    """The per-class verdicts: the overall one, a table (classes side by side, in their colours) and the
    CDFs. Each figure cell names its summary.json key (``classes[i]``) and holds its exact value."""
    slo = summary.slo
    also = f", and the run-wide objectives over all requests ({html.escape(_objectives(slo.objectives))})"
    overall = (
        f"<p id='overall-slo'>Overall SLO: <b data-value='{'null' if slo.passed is None else str(slo.passed).lower()}' "
        f"style='color:{VERDICT_COLOURS[slo.passed]}'>{verdict_text(slo.passed)}</b> (it passes only when every "
        f"class passes{also if slo.objectives else ''}; a class without objectives is n/a and not counted)</p>"
    )
    metric_heads = "".join(f"<th colspan='3'>{t} (ms)</th>" for _, t in CLASS_PANELS)
    head = (
        "<tr><th rowspan='2'>class</th><th rowspan='2'>share</th>"
        + "".join(f"<th rowspan='2'>{h}</th>" for h, _ in CLASS_COUNTS)
        + metric_heads
        + "<th rowspan='2'>output tok/s</th><th rowspan='2'>SLO</th><th rowspan='2'>objectives</th></tr><tr>"
        + "".join(f"<th>{h}</th>" for _ in CLASS_PANELS for h, _ in CLASS_STATS)
        + "</tr>"
    )
    rows = []
    for i, c in enumerate(summary.classes):
        cells = [
            f"<td class='name' data-key='name'><span class='swatch' style='background:{class_colour(i)}'></span>"
            f"{html.escape(c.name)}</td>",
            _cell("share", c.share, "g"),
            *(_cell(key, getattr(c, key)) for _, key in CLASS_COUNTS),
            *(
                _cell(f"{stat}_{stem}", getattr(getattr(c, stem), stat))
                for stem, _ in CLASS_PANELS
                for _, stat in CLASS_STATS
            ),
            _cell("output_throughput", c.output_throughput),
            _verdict(c.slo.passed),
            f"<td class='name'>{html.escape(_objectives(c.slo.objectives))}</td>",
        ]
        rows.append(f"<tr data-class='{html.escape(c.name)}'>{''.join(cells)}</tr>")
    return (
        f"<h2>Per class</h2>{overall}<table id='classes'>{head}{''.join(rows)}</table>"
        "<p class='note'>Latencies over each class's measured, completed requests; output tok/s over the run's "
        "measured duration; SLO: the class's verdict against its own slo, else the profile's.</p>"
        f"<img alt='per-class latency CDFs' src='data:image/png;base64,{image}'>"
    )


CLASS_CSS = (
    "table{border-collapse:collapse;font-size:90%}th,td{border:1px solid #ccc;padding:2px 6px}"
    "td{text-align:right}td.name{text-align:left}td[data-key=name]{white-space:nowrap}th{background:#f6f6f6}"
    ".swatch{display:inline-block;width:.9em;height:.9em;margin-right:.4em;vertical-align:-.1em}"
    ".note{color:#555;font-size:90%}"
)


def render_html(summary: Summary, samples: dict[str, np.ndarray], df: pd.DataFrame,
                server_rows: list[dict[str, Any]], markdown: str,
                class_samples: dict[str, dict[str, np.ndarray]] | None = None,
                events: RunEvents | None = None) -> str:  # fmt: skip
    """The page. With SLO classes it opens with the per-class section (``class_samples``: each class's
    samples, as ``compute_summary`` gives them); without, the page has no trace of them. ``events``: the
    records' events (``record_events(df)``) when the caller has them already."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workers = [w.served_by for w in summary.workers]
    scraped = {same_server(r["url"]) for r in server_rows if "m" in r and isinstance(r.get("url"), str)}
    itl_label = "ITL (per token, estimated)" if itl_estimated(summary) else "ITL (per token)"
    makers = [lambda: _cdfs(samples, itl_label), lambda: _timeline(df, server_rows, events)]
    if workers or len(scraped) > 1:  # a cluster: each worker on its own line
        down = {w.served_by: w.unreachable_from for w in summary.workers if w.unreachable_from is not None}
        makers.append(lambda: _per_worker(df, server_rows, workers, down))
    if summary.classes:  # last, so the images above keep their places
        makers.append(lambda: _class_cdfs(summary, class_samples or {}))
    images = []
    for make in makers:
        fig = make()
        images.append(png_base64(fig))
        plt.close(fig)
    per_class = _class_section(summary, images.pop()) if summary.classes else ""
    per_worker = (
        f"<h2>Per worker</h2><img alt='per-worker timeline' src='data:image/png;base64,{images[2]}'>"
        if len(images) > 2
        else ""
    )
    title = html.escape(f"loadlab report: {summary.run_id or 'run'}")
    # The findings first: each qualifies the figures below it (over capacity, KV, load not locked, ...).
    findings = "".join(
        f"<p class='finding' data-kind='{f.kind}'><b>{html.escape(f.parts()[0])}</b>: "
        f"{html.escape(f.parts()[1])}</p>"
        for f in summary.findings
    )
    # Beside the CDFs: ITL per token rests on counts the client made when the server counted only at the end.
    itl = "".join(
        f"<p class='itl-counts' data-estimated='{str(itl_estimated(summary)).lower()}'>"
        f"<b>{html.escape(note.split(': ', 1)[0])}</b>: {html.escape(note.split(': ', 1)[1])}</p>"
        for note in itl_notes(summary)
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title>"
        "<style>body{font-family:sans-serif;max-width:1200px;margin:1em auto}img{max-width:100%}"
        "pre{white-space:pre-wrap;background:#f6f6f6;padding:1em}.finding,.itl-counts{background:#fff4e5;padding:.5em 1em}"
        f"{CLASS_CSS if per_class else ''}</style>"
        f"</head><body><h1>{title}</h1>{findings}{per_class}"
        f"<h2>Latency CDFs</h2>{itl}<img alt='latency CDFs' src='data:image/png;base64,{images[0]}'>"
        f"<h2>Timeline</h2><img alt='timeline' src='data:image/png;base64,{images[1]}'>{per_worker}"
        f"<h2>Summary</h2><pre>{html.escape(markdown)}</pre></body></html>\n"
    )
