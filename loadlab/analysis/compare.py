"""`loadlab compare RUN_A RUN_B`: the figures that matter, side by side, with the change from A to B."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loadlab.analysis.report import write_report
from loadlab.analysis.summary import SUMMARY_JSON, Summary, itl_estimated, itl_notes

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


def _rows(a: Any, b: Any, figures) -> list[dict[str, Any]]:
    """A row per figure both have: A, B, the change from A to B and whether it is notably better or worse."""
    rows = []
    for label, path, unit, lower_better in figures:
        va, vb = _get(a, path), _get(b, path)
        if not isinstance(va, int | float) or not isinstance(vb, int | float):
            continue
        change = (vb - va) / abs(va) if va else None
        verdict = ""
        if change is not None and abs(change) >= NOTABLE:
            verdict = "better" if (change < 0) == lower_better else "worse"
        rows.append({"figure": label, "unit": unit, "a": va, "b": vb, "change": change, "verdict": verdict})
    return rows


def compare(a: Summary, b: Summary) -> list[dict[str, Any]]:
    return _rows(a, b, FIGURES)


# Each class's figures, as the run's (summary.json's classes[i] keys); its verdict follows them.
CLASS_FIGURES = (
    ("output throughput", ("output_throughput",), "tok/s", False),
    *(
        (f"{metric} {label}", (stem, stat), "ms", True)
        for metric, stem in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("E2E", "e2e_latency_ms"))
        for label, stat in (("P50", "median"), ("P95", "p95"), ("P99", "p99"))
    ),
    ("failed requests", ("failed",), "", True),
)


def compare_classes(a: Summary, b: Summary) -> list[dict[str, Any]]:
    """Each class of either run (A's order, then B's others): its TTFT P95 and SLO verdict in A and B, and
    ``figures``, its figures side by side as ``compare`` gives the run's (empty when one run lacks it)."""
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
            "a_measured": None if ca is None else ca.measured_requests,
            "b_measured": None if cb is None else cb.measured_requests,
            "figures": _rows(ca, cb, CLASS_FIGURES) if ca is not None and cb is not None else [],
        })  # fmt: skip
    return rows


def _verdict(present: bool, v: bool | None) -> str:
    return "-" if not present else ("n/a" if v is None else ("PASS" if v else "FAIL"))


def _figure_line(r: dict[str, Any], indent: str = "") -> str:
    change = f"{r['change'] * 100:+.1f}%" if r["change"] is not None else "n/a"
    name = f"{indent}{r['figure']} ({r['unit']})" if r["unit"] else f"{indent}{r['figure']}"
    return f"{name:<28} {r['a']:>12.2f} {r['b']:>12.2f} {change:>8}  {r['verdict']}"


def _class_block(rows: list[dict[str, Any]]) -> list[str]:
    """Each class's figures in A and B side by side, then its verdict in each."""
    if not rows:
        return []
    lines = ["", f"{'per class':<28} {'A':>12} {'B':>12} {'change':>8}", "-" * 64]
    for r in rows:
        measured = " / ".join("-" if r[f"{x}_measured"] is None else str(r[f"{x}_measured"]) for x in "ab")
        lines.append(f"class {r['class']} ({measured} measured)")
        lines += [_figure_line(f, "  ") for f in r["figures"]]
        lines.append(f"{'  SLO':<28} {_verdict(r['a_present'], r['a_pass']):>12} "
                     f"{_verdict(r['b_present'], r['b_pass']):>12}")  # fmt: skip
    lines.append("('-': the run has no such class)")
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
        lines += [f"note: {run}: {note}" for note in itl_notes(s)]
    lines += ["", f"{'figure':<28} {'A':>12} {'B':>12} {'change':>8}", "-" * 64]
    estimated = " ".join(run for run, s in (("A", a), ("B", b)) if itl_estimated(s))
    for r in rows:
        if estimated and r["figure"].startswith("ITL"):
            r = {**r, "figure": f"{r['figure']} (est. {estimated})"}
        lines.append(_figure_line(r))
    if a.slo.passed is not None or b.slo.passed is not None:
        every = " (every class)" if a.classes or b.classes else ""
        lines.append(
            f"{'SLO' + every:<28} {_verdict(True, a.slo.passed):>12} {_verdict(True, b.slo.passed):>12}"
        )
    classes = compare_classes(a, b)
    lines += _class_block(classes)
    notable = [f"{r['figure']} {r['verdict']}" for r in rows if r["verdict"]]  # the run's; each class's above
    flips = [f"{c['class']} {_verdict(True, c['a_pass'])} -> {_verdict(True, c['b_pass'])}" for c in classes
             if c["a_present"] and c["b_present"] and c["a_pass"] != c["b_pass"]]  # fmt: skip
    lines += ["", "Changes of 5% or more: " + (", ".join(notable) or "none")]
    if flips:
        lines.append("Verdicts that changed: " + ", ".join(flips))
    return "\n".join(lines) + "\n"
