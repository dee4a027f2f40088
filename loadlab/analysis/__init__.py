"""Post-processor: exact per-request metrics, throughput, in-flight load and SLO verdicts from raw
records, and the report files (summary.json, summary.md). Definitions: docs/metrics.md."""

from loadlab.analysis.metrics import compute_summary
from loadlab.analysis.report import write_report

__all__ = ["compute_summary", "write_report"]
