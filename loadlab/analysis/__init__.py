"""Post-processor: exact per-request metrics, throughput, in-flight load and SLO verdicts from raw
records, and the report files (summary.json, summary.md, report.html). Definitions: docs/metrics.md.
The public API (docs/metrics.md): ``compute_summary``, ``write_report``, ``Summary``."""

from loadlab.analysis.metrics import compute_summary
from loadlab.analysis.report import write_report
from loadlab.analysis.summary import Summary, SummaryError

__all__ = ["Summary", "SummaryError", "compute_summary", "write_report"]
