"""`loadlab compare RUN_A RUN_B`: the figures that matter, side by side, with the change from A to B."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loadlab.analysis.report import write_report
from loadlab.analysis.summary import SUMMARY_JSON, Summary

# (label, attribute path in Summary, unit, better when lower); summary.json's key in the comment
FIGURES = (
    ("output throughput", ("output_throughput",), "tok/s", False),
    ("request throughput", ("request_throughput",), "req/s", False),
    ("TTFT P50", ("ttft_ms", "median"), "ms", True),  # median_ttft_ms
    ("TTFT P95", ("ttft_ms", "p95"), "ms", True),  # p95_ttft_ms
    ("TTFT P99", ("ttft_ms", "p99"), "ms", True),  # p99_ttft_ms
    ("TPOT P50", ("tpot_ms", "median"), "ms", True),  # median_tpot_ms
    ("TPOT P95", ("tpot_ms", "p95"), "ms", True),  # p95_tpot_ms
    ("ITL P95", ("itl_ms", "p95"), "ms", True),  # p95_itl_ms
    ("ITL P99", ("itl_ms", "p99"), "ms", True),  # p99_itl_ms
    ("E2E P95", ("e2e_latency_ms", "p95"), "ms", True),  # p95_e2e_latency_ms
    ("failed requests", ("failed",), "", True),
    ("in flight (mean)", ("in_flight", "mean"), "", False),
    ("mean queue delay", ("server", "mean_queue_time_ms"), "ms", True),
    ("peak KV usage", ("server", "peak_token_usage"), "", True),
    ("retractions", ("server", "retractions"), "", True),
    ("client error bound", ("client", "error_bound_ms"), "ms", True),
)
NOTABLE = 0.05  # a change of 5% or more is called out


def _get(s: Any, path: tuple[str, ...]) -> Any:
    for name in path:
        s = None if s is None else getattr(s, name)  # client may be null
    return s


def load_summary(run_dir: Path) -> Summary:
    """RUN_DIR's summary.json, written first from the records when there is none (``SummaryError`` when
    it cannot be read)."""
    if not (Path(run_dir) / SUMMARY_JSON).exists():
        return write_report(run_dir)
    return Summary.read(run_dir)


def compare(a: Summary, b: Summary) -> list[dict[str, Any]]:
    rows = []
    for label, path, unit, lower_better in FIGURES:
        va, vb = _get(a, path), _get(b, path)
        if not isinstance(va, int | float) or not isinstance(vb, int | float):
            continue
        change = (vb - va) / abs(va) if va else None
        verdict = ""
        if change is not None and abs(change) >= NOTABLE:
            verdict = "better" if (change < 0) == lower_better else "worse"
        rows.append({"figure": label, "unit": unit, "a": va, "b": vb, "change": change, "verdict": verdict})
    return rows


def compare_classes(a: Summary, b: Summary) -> list[dict[str, Any]]:
    """Each class of either run (A's order, then B's others): its TTFT P95 and SLO verdict in A and B."""
    by_a = {c.name: c for c in a.classes}
    by_b = {c.name: c for c in b.classes}
    rows = []
    for name in [*by_a, *(n for n in by_b if n not in by_a)]:
        ca, cb = by_a.get(name), by_b.get(name)
        rows.append({
            "class": name,
            "a_ttft_p95": None if ca is None else ca.ttft_ms.p95,
            "b_ttft_p95": None if cb is None else cb.ttft_ms.p95,
            "a_pass": None if ca is None else ca.slo.passed,
            "b_pass": None if cb is None else cb.slo.passed,
            "a_present": ca is not None,
            "b_present": cb is not None,
        })  # fmt: skip
    return rows


def _class_block(a: Summary, b: Summary) -> list[str]:
    rows = compare_classes(a, b)
    if not rows:
        return []

    def ms(present: bool, v: float | None) -> str:
        return "-" if not present else ("n/a" if v is None else f"{v:.2f}")

    def verdict(present: bool, v: bool | None) -> str:
        return "-" if not present else ("n/a" if v is None else ("PASS" if v else "FAIL"))

    lines = ["", f"{'class':<16} {'A TTFT P95':>11} {'B TTFT P95':>11} {'A SLO':>6} {'B SLO':>6}", "-" * 54]
    for r in rows:
        lines.append(
            f"{r['class']:<16} {ms(r['a_present'], r['a_ttft_p95']):>11} {ms(r['b_present'], r['b_ttft_p95']):>11} "
            f"{verdict(r['a_present'], r['a_pass']):>6} {verdict(r['b_present'], r['b_pass']):>6}"
        )
    lines.append("(TTFT P95 in ms; '-': the run has no such class)")
    return lines


def render(a_dir: Path, b_dir: Path, a: Summary, b: Summary, rows: list[dict[str, Any]]) -> str:
    lines = [f"A: {a_dir} ({a.load_model}; {a.measured_requests} measured)",
             f"B: {b_dir} ({b.load_model}; {b.measured_requests} measured)", ""]  # fmt: skip
    for key in ("load_model", "target_url", "api", "profile_name"):
        if getattr(a, key) != getattr(b, key):
            lines.append(f"note: {key} differs: A {getattr(a, key)!r}, B {getattr(b, key)!r}")
    for run, s in (("A", a), ("B", b)):
        if s.partial:
            lines.append(f"note: {run} is a partial run")
        if s.client is not None and s.client.client_bound:
            lines.append(f"note: {run} was client-bound: its latencies include the load generator's delay")
    lines += ["", f"{'figure':<28} {'A':>12} {'B':>12} {'change':>8}", "-" * 64]
    for r in rows:
        change = f"{r['change'] * 100:+.1f}%" if r["change"] is not None else "n/a"
        name = f"{r['figure']} ({r['unit']})" if r["unit"] else r["figure"]
        lines.append(f"{name:<28} {r['a']:>12.2f} {r['b']:>12.2f} {change:>8}  {r['verdict']}")
    lines += _class_block(a, b)
    notable = [r for r in rows if r["verdict"]]
    lines += [
        "",
        "Changes of 5% or more: " + (", ".join(f"{r['figure']} {r['verdict']}" for r in notable) or "none"),
    ]
    return "\n".join(lines) + "\n"
