"""The exact result as a terminal block: printed last by a headless run (after Locust's own tables, whose
percentiles are rounded buckets), so the last screen a user sees holds the figures of summary.md."""

from __future__ import annotations

from pathlib import Path

from loadlab.analysis.report import receipt_line, slo_lines
from loadlab.analysis.summary import LatencyStats, Summary, itl_estimated, itl_notes

WIDTH = 78
_ROWS = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_latency_ms"))
_STATS = (("P50", "median"), ("P95", "p95"), ("P99", "p99"), ("mean", "mean"), ("max", "max"))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def render_console(s: Summary, report: Path | None = None) -> str:
    """summary.md's first sections in a fixed-width block: counts, exact latency percentiles, throughput,
    each class, the SLO verdict, and where the report is."""
    title = f" loadlab: exact result, {s.run_id or 'run'} "
    lines = ["", title.center(WIDTH, "=")]
    state = "PARTIAL run" if s.partial else "complete"
    failed = (
        f", failed {s.failed} (" + ", ".join(f"{k} {v}" for k, v in s.failures.items()) + ")"
        if s.failed
        else ""
    )
    lines.append(f"{state}: {s.measured_requests} measured, {s.completed} completed{failed}; {s.load_model}")
    lines.append(
        f"{s.duration:.1f} s, {s.request_throughput:.2f} req/s, {s.output_throughput:.1f} output tok/s, "
        f"{s.input_throughput:.1f} input tok/s"
    )
    lines.append("")
    lines.append(f"{'ms (exact)':<12}" + "".join(f"{name:>11}" for name, _ in _STATS) + f"{'samples':>10}")
    for label, stem in _ROWS:
        stats: LatencyStats | None = getattr(s, stem)
        if stats is None:
            continue
        count = getattr(s.samples, stem) or 0
        if stem == "itl_ms" and itl_estimated(s):
            label = "ITL (est.)"
        lines.append(
            f"{label:<12}" + "".join(f"{_ms(getattr(stats, a)):>11}" for _, a in _STATS) + f"{count:>10}"
        )
    lines += itl_notes(s)
    if s.classes:
        lines.append("")
        lines.append(
            f"{'class':<12}{'measured':>9}{'failed':>8}{'TTFT P95':>11}{'TPOT P95':>11}{'tok/s':>10}  SLO"
        )
        for c in s.classes:
            verdict = "n/a" if c.slo.passed is None else ("PASS" if c.slo.passed else "FAIL")
            lines.append(
                f"{c.name:<12}{c.measured_requests:>9}{c.failed:>8}{_ms(c.ttft_ms.p95):>11}"
                f"{_ms(c.tpot_ms.p95):>11}{c.output_throughput:>10.1f}  {verdict}"
            )
    lines.append("")
    lines += [line.removeprefix("- ") for line in slo_lines(s)]
    if s.goodput_ratio is not None:
        lines.append(
            f"Goodput: {s.goodput_ratio * 100:.1f}% of measured requests within every per-request limit "
            f"({s.request_goodput:.2f} req/s, {s.output_goodput:.1f} output tok/s)"
        )
    for finding in s.findings:
        title, _ = finding.parts()
        lines.append(f"Finding: {title} (summary.md says why)")
    receipt = receipt_line(s)
    if receipt:
        lines.append(receipt)
    if s.client is not None and s.client.client_bound:
        exact = s.receipt is not None and s.receipt.clock == "kernel"  # kernel receipt times: sends late only
        lines.append("CLIENT-BOUND: " + "; ".join(s.client.reasons)
                     + (" (receipt times from the kernel: latencies exact, sends late)" if exact else ""))  # fmt: skip
    if report is not None:
        lines.append(f"report: {report}")
    lines.append("=" * WIDTH)
    return "\n".join(lines) + "\n"
