"""`loadlab compare RUN_A RUN_B`: the figures that matter, side by side, with the change from A to B."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loadlab.analysis.report import SUMMARY_JSON, write_report

# (label, summary path, unit, better when lower)
FIGURES = (
    ("output throughput", ("output_throughput",), "tok/s", False),
    ("request throughput", ("request_throughput",), "req/s", False),
    ("TTFT P50", ("median_ttft_ms",), "ms", True),
    ("TTFT P95", ("p95_ttft_ms",), "ms", True),
    ("TTFT P99", ("p99_ttft_ms",), "ms", True),
    ("TPOT P50", ("median_tpot_ms",), "ms", True),
    ("TPOT P95", ("p95_tpot_ms",), "ms", True),
    ("ITL P95", ("p95_itl_ms",), "ms", True),
    ("ITL P99", ("p99_itl_ms",), "ms", True),
    ("E2E P95", ("p95_e2e_latency_ms",), "ms", True),
    ("failed requests", ("failed",), "", True),
    ("in flight (mean)", ("in_flight", "mean"), "", False),
    ("mean queue delay", ("server", "mean_queue_time_ms"), "ms", True),
    ("peak KV usage", ("server", "peak_token_usage"), "", True),
    ("retractions", ("server", "retractions"), "", True),
    ("client error bound", ("client", "error_bound_ms"), "ms", True),
)
NOTABLE = 0.05  # a change of 5% or more is called out


def _get(d: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        d = d.get(key) if isinstance(d, dict) else None
    return d


def load_summary(run_dir: Path) -> dict[str, Any]:
    path = Path(run_dir) / SUMMARY_JSON
    if not path.exists():
        return write_report(run_dir)
    return json.loads(path.read_text())


def compare(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
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


def render(a_dir: Path, b_dir: Path, a: dict[str, Any], b: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [f"A: {a_dir} ({a.get('load_model')}; {a.get('measured_requests')} measured)",
             f"B: {b_dir} ({b.get('load_model')}; {b.get('measured_requests')} measured)", ""]  # fmt: skip
    for key in ("load_model", "target_url", "api", "profile_name"):
        if a.get(key) != b.get(key):
            lines.append(f"note: {key} differs: A {a.get(key)!r}, B {b.get(key)!r}")
    for run, s in (("A", a), ("B", b)):
        if s.get("partial"):
            lines.append(f"note: {run} is a partial run")
        if (s.get("client") or {}).get("client_bound"):
            lines.append(f"note: {run} was client-bound: its latencies include the load generator's delay")
    lines += ["", f"{'figure':<28} {'A':>12} {'B':>12} {'change':>8}", "-" * 64]
    for r in rows:
        change = f"{r['change'] * 100:+.1f}%" if r["change"] is not None else "n/a"
        name = f"{r['figure']} ({r['unit']})" if r["unit"] else r["figure"]
        lines.append(f"{name:<28} {r['a']:>12.2f} {r['b']:>12.2f} {change:>8}  {r['verdict']}")
    notable = [r for r in rows if r["verdict"]]
    lines += [
        "",
        "Changes of 5% or more: " + (", ".join(f"{r['figure']} {r['verdict']}" for r in notable) or "none"),
    ]
    return "\n".join(lines) + "\n"
