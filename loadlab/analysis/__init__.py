"""Post-processor: exact per-request metrics, throughput, in-flight load and SLO verdicts from raw
records, and the report files (summary.json, summary.md, report.html). Definitions: docs/metrics.md.
The public API (docs/metrics.md): ``compute_summary``, ``write_report``, ``Summary``.

The names load on first use: the live figures import ``loadlab.analysis.stats`` (numpy only) into every
Locust process, which should not pay for pandas and pydantic at start-up."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loadlab.analysis.metrics import compute_summary
    from loadlab.analysis.report import write_report
    from loadlab.analysis.summary import Summary, SummaryError

__all__ = ["Summary", "SummaryError", "compute_summary", "write_report"]
_WHERE = {
    "compute_summary": "loadlab.analysis.metrics",
    "write_report": "loadlab.analysis.report",
    "Summary": "loadlab.analysis.summary",
    "SummaryError": "loadlab.analysis.summary",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'loadlab.analysis' has no attribute {name!r}")
