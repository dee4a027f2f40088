"""Report writers: summary.json (machine-readable) and summary.md (for people), from a run directory."""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any

import pandas as pd

from loadlab.analysis.html import REPORT_HTML, render_html, timeline_of
from loadlab.analysis.itl import EventSource, RunEvents, scan_events
from loadlab.analysis.metrics import REPORT_FIELDS, compute_summary, event_source, itl_scopes
from loadlab.analysis.server_metrics import read_server_metrics
from loadlab.analysis.summary import (
    ESTIMATED_ROWS,
    SUMMARY_JSON,
    Client,
    Finding,
    LatencyStats,
    Overload,
    Server,
    Summary,
    itl_estimated,
    itl_notes,
    write_atomic,
)
from loadlab.manifest import read_manifest
from loadlab.records import (
    RECORD_FIELDS,
    RECORDS_JSONL,
    RECORDS_PARQUET,
    event_batches,
    in_background,
    load_records,
    row_group_sizes,
)

__all__ = ["SUMMARY_JSON", "SUMMARY_MD", "render_markdown", "write_report"]

SUMMARY_MD = "summary.md"


def write_report(run_dir: Path, html: bool = True) -> Summary:
    """Computes the summary of the run in ``run_dir`` and writes summary.json, summary.md and (``html``)
    report.html there.

    Reads records.parquet if present, else records.jsonl (a partial or killed run); a run directory with
    neither gets an empty summary rather than no report. Returns the summary.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such run directory")
    if (run_dir / RECORDS_PARQUET).exists():
        source = RECORDS_PARQUET
    elif (run_dir / RECORDS_JSONL).exists():
        source = RECORDS_JSONL
    else:
        source = None
    with _small_pages():
        return _write_report(run_dir, source, html)


@contextlib.contextmanager
def _small_pages():
    """numpy asks the kernel for huge pages for every large array; where memory must first be compacted
    for them (a VM, a long-running machine) each fresh gigabyte then costs seconds, and a big run's report
    allocates many: measured on the 2-core VM, 100M-element operations took 2.5 s with them, 0.6 s
    without (bench/RESULTS.md, issue 17). Off while the report is computed, then as it was."""
    try:
        from numpy._core.multiarray import _set_madvise_hugepage  # numpy 2
    except ImportError:  # pragma: no cover - numpy 1.x
        try:
            from numpy.core.multiarray import _set_madvise_hugepage
        except ImportError:
            _set_madvise_hugepage = None
    before = _set_madvise_hugepage(False) if _set_madvise_hugepage is not None else None
    try:
        yield
    finally:
        if _set_madvise_hugepage is not None:
            _set_madvise_hugepage(before)


def _write_report(run_dir: Path, source: str | None, html: bool) -> Summary:
    # Arrow lists and categorical text: no Python object per record or per event (a million records).
    manifest = read_manifest(run_dir)
    if source == RECORDS_PARQUET:
        # The per-event columns apart, a row group at a time (the pilot's while the other columns load).
        batches = EventSource(row_group_sizes(run_dir), functools.partial(event_batches, run_dir))
        batches.start_pilot()
        df = load_records(run_dir, columns=list(REPORT_FIELDS), arrow=True)
    else:
        df = load_records(run_dir, arrow=True) if source else pd.DataFrame(columns=list(RECORD_FIELDS))
        batches = event_source(df)
    # The ITL figures (and report.html's tokens per second and plot samples) taken as the events are read,
    # nothing per event kept; meanwhile compute_summary takes what needs no events.
    scopes = itl_scopes(df, manifest)
    timeline = timeline_of(df) if html else None

    def scanned() -> RunEvents:
        done = scan_events(batches, scopes.masks, scopes.qs, timeline)
        done.events.figures = scopes.named(done.figures)
        return done.events

    events = in_background(scanned)
    server_rows = read_server_metrics(run_dir)
    samples: dict = {}
    class_samples: dict = {}
    summary = compute_summary(df, manifest, server_rows, samples, class_samples, events)
    summary = summary.model_copy(update={"records_source": source})
    markdown = render_markdown(summary)
    summary.write(run_dir)
    write_atomic(run_dir / SUMMARY_MD, markdown)
    if html:  # plots take about a second
        write_atomic(
            run_dir / REPORT_HTML,
            render_html(summary, samples, df, server_rows, markdown, class_samples, events.result()),
        )
    return summary


# ---------------------------------------------------------------------------------------------------
# Markdown

_LATENCY_ROWS = (
    ("TTFT", "ttft_ms"),
    ("TPOT", "tpot_ms"),
    ("TPOT (decode)", "tpot_decode_ms"),
    ("ITL (per token)", "itl_ms"),
    ("ITL (per event)", "itl_per_event_ms"),
    ("E2E", "e2e_latency_ms"),
    ("Client queue (send - due)", "client_queue_ms"),
    ("TTFT from due time", "ttft_from_scheduled_ms"),
    ("E2E from due time", "e2e_from_scheduled_ms"),
    ("Server queue (meta_info)", "server_queue_ms"),
)
# Shown only when there are samples: open loop (due times) and servers that report their queue time.
_OPTIONAL_ROWS = {"client_queue_ms", "ttft_from_scheduled_ms", "e2e_from_scheduled_ms", "server_queue_ms"}
_LATENCY_COLUMNS = (
    ("mean", "mean"),
    ("P50", "median"),
    ("P90", "p90"),
    ("P95", "p95"),
    ("P99", "p99"),
    ("max", "max"),
)


def _num(value: Any, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}f}"


def _server_lines(server: Server) -> list[str]:
    """The seed's server-side columns, from the target's /metrics during the run."""
    lines = ["## Server (from /metrics during the measured window)", ""]
    if not server.available:
        why = "; ".join(server.errors) or "no metrics were scraped"
        queue = server.mean_queue_time_ms
        from_meta = (
            [f"- Mean queue delay (from meta_info.queue_time): {_num(queue)} ms"] if queue is not None else []
        )
        return lines + [f"- Unavailable: {why}.", *from_meta, ""]
    usage = server.peak_token_usage
    hit = server.cache_hit_rate
    return lines + [
        f"- Mean queue delay: {_num(server.mean_queue_time_ms)} ms"
        + (" (from meta_info.queue_time)" if server.queue_time_source == "meta_info" else ""),
        f"- Peak KV usage (token_usage): {_num(usage * 100 if usage is not None else None, 1)}%",
        f"- Running requests: mean {_num(server.mean_running)}, max {_num(server.max_running, 0)}",
        f"- Queued requests: mean {_num(server.mean_queued)}, max {_num(server.max_queued, 0)}",
        f"- Cache-hit rate (cached / prompt tokens): {_num(hit * 100 if hit is not None else None, 1)}%",
        f"- Retractions: {_num(server.retractions, 0)}",
        f"- Scrapes: {server.scrapes} from {server.servers} server(s)",
        "",
    ]


def _worker_lines(s: Summary) -> list[str]:
    """The per-worker table: only when some response named its worker (x-loadlab-worker)."""
    if not s.workers:
        return []

    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{x * 100:.1f}%"

    lines = [
        "## Per worker (from each response's x-loadlab-worker)",
        "",
        "| worker | measured | completed | failed | output tok/s | TTFT P50 | TTFT P95 | TPOT P95 | cached | peak KV |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for w in s.workers:
        lines.append(
            f"| {w.served_by} | {w.measured_requests} | {w.completed} | {w.failed} | {_num(w.output_throughput)} | "
            f"{_num(w.median_ttft_ms)} | {_num(w.p95_ttft_ms)} | {_num(w.p95_tpot_ms)} | "
            f"{pct(w.cached_token_ratio)} | {pct(w.peak_token_usage)} |"
        )
    lines += [
        "",
        "Latencies in ms. Output tok/s is over the run's measured duration; cached is cached / prompt tokens of "
        "the worker's completed requests; peak KV is the largest token_usage of the worker's own /metrics (n/a: "
        "not scraped).",
    ]
    if s.unattributed_requests:
        lines.append(
            f"{s.unattributed_requests} measured request(s) named no worker (no x-loadlab-worker header: a "
            "server that sends none, a front answering itself, or no response) and are in no row."
        )
    return [*lines, ""]


def _turn_lines(s: Summary) -> list[str]:
    """The per-turn table: only for a conversation (the records' turn)."""
    if not s.turns:
        return []
    lines = [
        f"## Per turn ({s.sessions} measured sessions)",
        "",
        "| turn | measured | completed | mean prompt tokens | cached | TTFT mean | TTFT P50 | TTFT P95 | TTFT P99 |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t in s.turns:
        hit = "n/a" if t.cached_token_ratio is None else f"{t.cached_token_ratio * 100:.1f}%"
        lines.append(
            f"| {t.turn} | {t.measured_requests} | {t.completed} | {_num(t.mean_prompt_tokens)} | {hit} | "
            f"{_num(t.mean_ttft_ms)} | {_num(t.median_ttft_ms)} | {_num(t.p95_ttft_ms)} | {_num(t.p99_ttft_ms)} |"
        )
    lines += [
        "",
        "Latencies in ms. Each turn's prompt holds the session's earlier turns and the server's replies; cached "
        "is cached / prompt tokens of the turn's completed requests.",
        "",
    ]
    return lines


def verdict_word(passed: bool | None) -> str:
    return "n/a" if passed is None else ("PASS" if passed else "FAIL")


def _class_lines(s: Summary) -> list[str]:
    """The per-class table: only with SLO classes (the records' request_class)."""
    if not s.classes:
        return []
    lines = [
        "## Per class",
        "",
        "| class | share | measured | completed | failed | req/s | output tok/s | TTFT P50 | TTFT P95 | "
        "TTFT P99 | TPOT P50 | TPOT P95 | TPOT P99 | ITL P95 | E2E P50 | E2E P95 | E2E P99 | SLO |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in s.classes:
        share = "n/a" if c.share is None else f"{c.share:g}"
        ttft, tpot, e2e = c.ttft_ms, c.tpot_ms, c.e2e_latency_ms
        lines.append(
            f"| {c.name} | {share} | {c.measured_requests} | {c.completed} | {c.failed} | "
            f"{_num(c.request_throughput)} | {_num(c.output_throughput)} | {_num(ttft.median)} | "
            f"{_num(ttft.p95)} | {_num(ttft.p99)} | {_num(tpot.median)} | {_num(tpot.p95)} | {_num(tpot.p99)} | "
            f"{_num(c.itl_ms.p95)} | {_num(e2e.median)} | {_num(e2e.p95)} | {_num(e2e.p99)} | "
            f"{verdict_word(c.slo.passed)} |"
        )
    lines += [
        "",
        "Latencies in ms, over each class's completed requests; throughputs over the run's measured duration. "
        "SLO: the class's own verdict (its slo, else the profile's; n/a without objectives).",
        "",
    ]
    return lines


def _at(seconds: float | None, epoch: float | None) -> str:
    """A moment of the run: T+N s from the first measured send, else the epoch time."""
    if seconds is not None:
        return f"T{'+' if seconds >= 0 else '-'}{abs(seconds):.1f} s"
    return f"{epoch:.3f} (epoch s)" if epoch is not None else "an unknown time"


def _outage_lines(s: Summary) -> list[str]:
    """One plain line per worker that stopped answering (its /metrics scrapes failed after a good one)."""
    lines = []
    for w in s.workers:
        if w.unreachable_from is None:
            continue
        if w.reachable_again_from is None:
            after = "and never answered again"
        else:
            since = w.unreachable_after_s
            back = None if since is None else since + (w.reachable_again_from - w.unreachable_from)
            after = f"and answered again at {_at(back, w.reachable_again_from)}"
        if w.failed:
            outcomes = ", ".join(f"{k}: {v}" for k, v in w.failures.items())
            cost = f"{w.failed} measured request(s) failed on it ({outcomes})"
        else:
            cost = "no measured request failed on it"
        lines += [
            f"> **Worker {w.served_by} stopped answering at {_at(w.unreachable_after_s, w.unreachable_from)}** "
            f"(T = the first measured send; its /metrics scrapes failed from then on) {after}; {cost}; "
            f"{w.completed} completed on it.",
            "",
        ]
    return lines


def receipt_line(s: Summary) -> str | None:
    """Which clock timed the run's events, and the coalesced reads, in one sentence (summary.md, console)."""
    r = s.receipt
    if r is None:
        return None
    if r.clock == "kernel":
        clock = "the kernel's receive timestamps (SO_TIMESTAMPNS)"
    elif r.clock == "mixed":
        share = f"{r.kernel_fraction:.1%}" if r.kernel_fraction is not None else "some"
        clock = f"mixed: the kernel for {share} of the requests, user space for the rest"
    elif r.clock == "user space":
        clock = "user space (perf_counter() after each read)"
    else:
        clock = "unknown (no record says)"
    reader = f", {r.reader} reader" if r.reader else ""
    line = f"Receipt clock: {clock}{reader}."
    if r.fallback:
        line += f" Kernel clock not used: {r.fallback}."
    if r.coalesced_event_fraction is not None:
        line += (
            f" Coalesced reads: {r.coalesced_reads} ({r.coalesced_events} token events, "
            f"{r.coalesced_event_fraction:.2%}, shared a read with the event before: their gap reads 0)."
        )
    return line


def _client_lines(client: Client | None, receipt_clock: str | None = None) -> list[str]:
    """The load generator's own timing quality, beside the latencies it qualifies. ``receipt_clock``: which
    clock timed the events (summary ``receipt.clock``): the kernel's times stay exact on a busy client."""
    if client is None:
        return []
    cpus = [g.cpu_mean for g in client.generators if g.cpu_mean is not None]
    cpu = f"; CPU {max(cpus):.0%} of a core (busiest load generator, mean)" if cpus else ""
    lines = [
        f"Client timing error bound: {_num(client.error_bound_ms)} ms (P99 of how late a load generator handled "
        f"I/O, worst of {len(client.generators)}){cpu}.",
        "",
    ]
    if client.client_bound:
        if receipt_clock == "kernel":  # the events' times are the kernel's: only the sends were late
            why = ("The tokens' receipt times were taken by the kernel, so TTFT, ITL and E2E stay exact; what the "
                   "busy client delayed is its sends (requests started later than planned: less load offered)")  # fmt: skip
        else:
            why = "These latencies include the load generator's own delay"
        lines += [
            "> **Client-bound**: " + "; ".join(client.reasons) + f". {why}: add workers (`loadlab run "
            "--workers N`) or lower the load per process.",
            "",
        ]
    return lines


def slo_lines(s: Summary) -> list[str]:
    """The SLO verdict as bullet lines: each objective, each class's, the overall verdict (summary.md's
    SLO section and the console's result block)."""
    slo = s.slo
    lines: list[str] = []
    if not slo.objectives:
        lines.append(
            "- No SLO objectives in the profile." if not s.classes else "- No run-wide SLO objectives."
        )
    for o in slo.objectives:
        verdict = "PASS" if o.passed else "FAIL"
        note = " (no samples)" if o.value_ms is None else ""
        lines.append(
            f"- {verdict}: P{o.percentile} {o.metric} = {_num(o.value_ms)} ms (limit {_num(o.threshold_ms)} ms){note}"
        )
    for c in s.classes:
        for o in c.slo.objectives:
            verdict = "PASS" if o.passed else "FAIL"
            lines.append(f"- {verdict}: class {c.name}: P{o.percentile} {o.metric} = {_num(o.value_ms)} ms "
                         f"(limit {_num(o.threshold_ms)} ms)")  # fmt: skip
    if slo.objectives or (s.classes and slo.passed is not None):
        every = " (every class too)" if s.classes else ""
        lines.append(f"- Overall{every}: {'PASS' if slo.passed else 'FAIL'}")
    if slo.failed_requests:
        lines.append(
            f"- Note: {slo.failed_requests} measured request(s) failed; failures are not in the latencies."
        )
    if slo.unrecognized:
        lines.append(f"- Ignored SLO keys: {', '.join(slo.unrecognized)}")
    return lines


def _finding_lines(findings: list[Finding]) -> list[str]:
    """Findings as the report's other warnings (Client-bound), one quoted paragraph each."""
    lines = []
    for f in findings:
        title, text = f.parts()
        lines += [f"> **{title}**: {text}", ""]
    return lines


def _overload_line(o: Overload | None) -> list[str]:
    """The overload verdict's figures in the load section (open loop), whichever way it went."""
    if o is None:
        return []
    served = (
        f"the server took in {_num(o.served_prompt_tokens_per_s, 0)} prompt tok/s while requests waited for their "
        f"first token ({_num(o.backlog_s, 1)} s of backlog)"
    )
    slope = (
        f"TTFT from the due time {o.ttft_slope * 1000:+.0f} ms per second of arrivals over their second half"
        + (f" (t {o.ttft_slope_t:.1f})" if o.ttft_slope_t is not None else "")
        if o.ttft_slope is not None
        else "too few requests for a TTFT trend"
    )
    verdict = "**over capacity**" if o.over_capacity else "within capacity"
    return [
        f"- Offered load: {o.arrival_rate:.2f} req/s x {_num(o.mean_prompt_tokens, 0)} prompt tokens = "
        f"{_num(o.offered_prompt_tokens_per_s, 0)} prompt tok/s; {served}; {slope}; in flight "
        f"{o.in_flight_growth_per_s:+.2f}/s at the end of the arrivals: {verdict}"
    ]


def _limits(limits: dict[str, float]) -> str:
    names = {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "e2e_latency_ms": "E2E"}
    return ", ".join(f"{names[m]} <= {v:g} ms" for m, v in limits.items())


def _goodput_lines(s: Summary) -> list[str]:
    """DistServe's goodput: requests within every per-request limit (each SLO objective's threshold)."""
    lines = ["## Goodput", ""]
    if s.goodput_ratio is None:
        lines.append("- No per-request limits: the SLO sets no TTFT, TPOT or E2E objective, so goodput is not "
                     "defined (ITL objectives bound the pooled gaps, not a request).")  # fmt: skip
    else:
        ratio = _num(s.goodput_ratio * 100 if s.goodput_ratio is not None else None, 1)
        limits = (
            "each request its own class's (below; a class without any counts its completed requests)"
            if s.classes
            else _limits(s.goodput_limits)
        )
        lines += [
            f"- Per-request limits (each SLO objective's threshold): {limits}",
            f"- Good requests (completed within every limit; failed requests never count): {s.good_requests} "
            f"of {s.measured_requests} measured ({ratio}%)",
            f"- Request goodput: {_num(s.request_goodput)} req/s (of {_num(s.request_throughput)} req/s completed)",
            f"- Output goodput: {_num(s.output_goodput)} tok/s (of {_num(s.output_throughput)} tok/s)",
        ]
    for c in s.classes:
        if c.goodput_limits is None:
            lines.append(f"- Class {c.name}: no per-request limits")
            continue
        ratio = _num(c.goodput_ratio * 100 if c.goodput_ratio is not None else None, 1)
        lines.append(f"- Class {c.name} ({_limits(c.goodput_limits)}): {c.good_requests} of {c.measured_requests} "
                     f"good ({ratio}%), {_num(c.request_goodput)} req/s, {_num(c.output_goodput)} output tok/s")  # fmt: skip
    return [*lines, ""]


def render_markdown(s: Summary) -> str:
    """A plain-Markdown human view of a summary."""
    title = " / ".join(str(x) for x in (s.run_id, s.profile_name) if x) or "run"
    lines = [f"# loadlab report: {title}", ""]
    if s.partial:
        if s.complete is None:
            why = "the manifest does not say the run completed"
        elif s.complete is False:
            why = "the run did not complete"
        else:
            why = "fewer measured requests than expected"
        expected = s.expected_measured
        got = f"{s.measured_requests} of {expected}" if expected is not None else str(s.measured_requests)
        lines += [f"> **Partial run**: {why}; {got} measured requests recorded.", ""]
    if s.lost_in_flight:
        by = ", ".join(f"{n} on {w}" for w, n in sorted(s.lost_in_flight_by_worker.items()))
        lines += [
            f"> **{s.lost_in_flight} requests lost in flight** ({s.lost_in_flight_measured} of them "
            f"measured) on load generators that went away: {by}. They reached the server but have no record; "
            "every request that completed is in the records.",
            "",
        ]

    lines += _outage_lines(s)
    # Over capacity qualifies every figure below, so it comes first; the other findings follow the latencies.
    lines += _finding_lines([f for f in s.findings if f.kind == "over_capacity"])

    target = s.target_url or "unknown"
    if s.api:
        target += f" ({s.api} API)"
    if s.server_version:
        target += f", SGLang {s.server_version}"
    lines += [
        f"- Load model: {s.load_model}",
        *([f"- Prompt lengths: {s.prompt_lengths}"] if s.prompt_lengths else []),
        f"- Target: {target}",
        f"- Warm-up requests (excluded): {s.warmup_requests}",
        f"- Measured requests: {s.measured_requests}"
        + (f" (expected {s.expected_measured})" if s.expected_measured is not None else ""),
        f"- Completed: {s.completed}, failed: {s.failed}"
        + (" (" + ", ".join(f"{k}: {v}" for k, v in s.failures.items()) + ")" if s.failures else ""),
    ]
    if s.front_failed:
        lines.append(
            f"- Failed at the front (answered by the front itself, never by a worker): {s.front_failed} ("
            + ", ".join(f"HTTP {k}: {v}" if k.isdigit() else f"{k}: {v}" for k, v in s.front_failures.items())
            + ")"
        )
    if s.records_source:
        lines.append(f"- Records: {s.records_source}")
    lines.append("")

    lines += [
        "## Latency (ms)",
        "",
        "| metric | samples | " + " | ".join(c for c, _ in _LATENCY_COLUMNS) + " |",
    ]
    lines.append("|---|---:|" + "---:|" * len(_LATENCY_COLUMNS))
    for label, stem in _LATENCY_ROWS:
        stats: LatencyStats | None = getattr(s, stem)
        count = getattr(s.samples, stem) or 0
        if stats is None or (stem in _OPTIONAL_ROWS and not count):
            continue
        cells = [_num(getattr(stats, stat)) for _, stat in _LATENCY_COLUMNS]
        if stem in ESTIMATED_ROWS and itl_estimated(s):
            label += ", estimated"
        lines.append(f"| {label} | {count} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Percentiles are exact (numpy, linear interpolation) over the measured, completed requests. "
        "TPOT = (E2E - TTFT) / (output tokens - 1), as sglang bench_serving; TPOT (decode) divides by the "
        "tokens after the first event instead. ITL per token spreads each event's gap over its tokens.",
        "",
    ]
    for note in itl_notes(s):
        title, text = note.split(": ", 1)
        lines += [f"> **{title}**: {text}", ""]
    lines += _client_lines(s.client, s.receipt.clock if s.receipt is not None else None)
    receipt = receipt_line(s)
    if receipt:
        lines += [receipt, ""]
    lines += _finding_lines([f for f in s.findings if f.kind != "over_capacity"])

    lines += ["## Throughput", ""]
    lines += [
        f"- Duration: {_num(s.duration, 3)} s",
        f"- Requests: {_num(s.request_throughput)} req/s",
        f"- Input tokens: {s.total_input_tokens} ({_num(s.input_throughput)} tok/s)"
        + (
            f"; {s.input_tokens_fallback} requests without a server prompt count used the intended length"
            if s.input_tokens_fallback
            else ""
        ),
        f"- Output tokens: {s.total_output_tokens} ({_num(s.output_throughput)} tok/s)"
        + (
            f"; {s.output_tokens_fallback} requests without a server count used the streamed tokens"
            if s.output_tokens_fallback
            else ""
        ),
        f"- Short outputs (fewer tokens than max_new_tokens): {s.short_outputs}",
        "",
        "## Load actually applied",
        "",
    ]
    flight = s.in_flight
    lines += [
        f"- In flight over the measured window (all requests, time-weighted): mean {_num(flight.mean)}, "
        f"min {_num(flight.min)}, max {_num(flight.max)}",
        f"- Concurrency (bench_serving: sum of completed E2E / duration): {_num(s.concurrency)}",
    ]
    lines += _overload_line(s.overload)
    ratio, bound = s.cached_token_ratio, s.expected_cached_token_ratio
    lines.append(
        f"- Cached-token ratio: {_num(ratio * 100 if ratio is not None else None, 1)}"
        + ("%" if ratio is not None else "")
        + f" ({s.cached_tokens_reported} requests reported cached tokens)"
        + (
            f"; the workload allows at most {bound * 100:.1f}% (prefixes shared with earlier requests)"
            if bound is not None
            else ""
        )  # fmt: skip
    )
    lines.append("")
    lines += _server_lines(s.server)
    lines += _worker_lines(s)
    lines += _class_lines(s)
    lines += _turn_lines(s)

    lines += ["## SLO", ""]
    lines += slo_lines(s)
    lines.append("")
    lines += _goodput_lines(s)
    return "\n".join(lines)
