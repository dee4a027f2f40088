"""Post-processor: exact per-request metrics, throughput, in-flight load and SLO verdicts from raw
records, and the report files (summary.json, summary.md). Definitions: docs/metrics.md."""

from loadlab.analysis.metrics import compute_summary
from loadlab.analysis.report import render_markdown, write_report
from loadlab.analysis.summary import Summary, SummaryError

__all__ = ["Summary", "SummaryError", "compute_summary", "render_markdown", "write_report"]
