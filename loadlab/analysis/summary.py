"""summary.json as a typed, versioned contract: the ``Summary`` model, its save and its load.

``compute_summary`` (metrics.py) computes the figures and returns a ``Summary``; ``write_report`` writes it
with ``Summary.write``; ``loadlab compare`` (and any script) reads it back with ``Summary.read``. Every field
is typed and described here and documented in docs/metrics.md ("summary.json fields"; a test keeps the two
in step). An unknown key is rejected (``extra="forbid"``), and so are NaN and infinities: a figure that
cannot be computed is null.

Two things differ between the JSON and the Python objects:

- The latency statistics are flat keys on disk, bench_serving's ``<stat>_<metric>`` (``p99_ttft_ms``,
  ``mean_itl_ms``), and one ``LatencyStats`` per metric in Python (``summary.ttft_ms.p99``).
- Fields only some runs have (the open-loop latencies from the due time, the server's queue time per
  request, unrecognized SLO keys, the scrape-only server figures of a run without /metrics) are left out of
  the JSON when None instead of written as null; every other field is always there, null or not.

``SUMMARY_VERSION`` is the ``version`` key. Any change to the fields (added, removed, renamed, another type
or meaning) is a new version: bump it, and ``schema`` with it.
"""

from __future__ import annotations

import json
import os
import typing
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
    model_validator,
)

SUMMARY_JSON = "summary.json"
SUMMARY_VERSION = 6  # 2: workers and unattributed_requests (per-worker attribution); 3: classes; 4: goodput,
# the overload verdict, findings and the expected cached-token ratio; 5: a conversation's sessions and turns,
# a file workload's prompt_lengths; 6: estimated ITL (itl_estimated, itl_estimated_ratio, arrival_tokens_from)
SUMMARY_SCHEMA = "loadlab.summary/6"  # kept beside version, which came later; bumped with it
# Older versions this one reads: each added fields only, so an old file reads with their defaults.
READS_VERSIONS = (1, 2, 3, 4, 5, 6)
# Version 3 added classes, workers[].unreachable_from, unreachable_after_s, reachable_again_from, front_failed
# and front_failures; version 4 goodput_limits, good_requests, goodput_ratio, request_goodput, output_goodput
# (top level and classes[]), overload, expected_cached_token_ratio and findings; version 5 sessions, turns and
# prompt_lengths; version 6 itl_estimated, itl_estimated_ratio and arrival_tokens_from.
# Each has a default (null or empty), so older summaries read; `loadlab report RUN_DIR` computes the new
# figures from the records.


class SummaryError(ValueError):
    """A summary.json that is missing, unreadable or not this version's shape; one line."""


def write_atomic(path: Path, text: str) -> None:
    """Writes ``path`` so that a crash leaves the old file or the new one, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class _Model(BaseModel):
    """Shared by every part of the summary: unknown keys and non-finite floats are errors; fields named in
    ``_omit_when_none`` are left out of the JSON when None."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True, populate_by_name=True)

    _omit_when_none: ClassVar[tuple[str, ...]] = ()

    def _omitted(self) -> set[str]:
        return {name for name in self._omit_when_none if getattr(self, name) is None}

    def _reshape(self, out: dict[str, Any]) -> dict[str, Any]:
        return out

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out = handler(self)
        fields = type(self).model_fields
        for name in self._omitted():
            out.pop(name, None)
            out.pop(fields[name].alias or name, None)
        return self._reshape(out)


# ---------------------------------------------------------------------------------------------------
# The parts


class LatencyStats(_Model):
    """One latency metric over its samples (ms), exact: on disk ``<stat>_<metric>``, e.g. ``p99_ttft_ms``.
    All null when the metric has no samples."""

    mean: float | None = Field(description="Mean of the samples (ms).")
    median: float | None = Field(description="50th percentile, linear interpolation (ms).")
    std: float | None = Field(description="Population standard deviation, ddof 0 (ms).")
    p90: float | None = Field(description="90th percentile, linear interpolation (ms).")
    p95: float | None = Field(description="95th percentile, linear interpolation (ms).")
    p99: float | None = Field(description="99th percentile, linear interpolation (ms).")
    min: float | None = Field(description="Smallest sample (ms).")
    max: float | None = Field(description="Largest sample (ms).")


class Samples(_Model):
    """How many samples each latency metric has; the open-loop and server-queue metrics only when the run
    has them."""

    _omit_when_none = (
        "client_queue_ms",
        "ttft_from_scheduled_ms",
        "e2e_from_scheduled_ms",
        "server_queue_ms",
    )

    ttft_ms: int = Field(description="TTFT samples: completed measured requests with a TTFT.")
    tpot_ms: int = Field(
        description="TPOT samples: completed measured requests with more than one output token."
    )
    tpot_decode_ms: int = Field(
        description="Decode TPOT samples: completed requests with tokens after the first event."
    )
    itl_ms: int = Field(description="Per-token ITL samples, pooled over the completed requests.")
    itl_per_event_ms: int = Field(
        description="Per-event ITL samples (one per token-carrying event after the first)."
    )
    e2e_latency_ms: int = Field(description="E2E samples: completed measured requests with an E2E.")
    client_queue_ms: int | None = Field(None, description="Client queue samples (open loop only).")
    ttft_from_scheduled_ms: int | None = Field(
        None, description="TTFT-from-due-time samples (open loop only)."
    )
    e2e_from_scheduled_ms: int | None = Field(None, description="E2E-from-due-time samples (open loop only).")
    server_queue_ms: int | None = Field(
        None, description="Server queue-time samples (only when the server reports it)."
    )


class InFlight(_Model):
    """Requests in flight over the measured window (every record, warm-up and failures included)."""

    mean: float | None = Field(
        description="Time-weighted mean over the measured window; null without a window."
    )
    min: int | None = Field(description="Fewest in flight over the window; null without a window.")
    max: int | None = Field(description="Most in flight over the window; null without a window.")


class Server(_Model):
    """The target's /metrics over the measured window (one scrape interval either side). Without a scrape
    in the window (``available`` false) the scrape-only figures are absent."""

    _SCRAPED: ClassVar[tuple[str, ...]] = ("servers", "mean_queue_time_ms", "peak_token_usage", "mean_running",
                                           "max_running", "mean_queued", "max_queued", "cache_hit_rate",
                                           "retractions")  # fmt: skip

    available: bool = Field(description="Whether any scrape in the window had metrics.")
    servers: int | None = Field(None, description="Servers scraped (target URLs with metrics in the window).")
    scrapes: int = Field(description="Scrapes with metrics in the window.")
    mean_queue_time_ms: float | None = Field(
        None,
        description="Mean queue delay: delta queue_time_seconds_sum / delta _count (ms), or the requests' "
        "meta_info.queue_time mean without /metrics (see queue_time_source).",
    )
    peak_token_usage: float | None = Field(None, description="Largest sglang:token_usage (KV pool fraction).")
    mean_running: float | None = Field(None, description="Mean sglang:num_running_reqs, summed over servers.")
    max_running: float | None = Field(
        None, description="Largest sglang:num_running_reqs, summed over servers."
    )
    mean_queued: float | None = Field(None, description="Mean sglang:num_queue_reqs, summed over servers.")
    max_queued: float | None = Field(None, description="Largest sglang:num_queue_reqs, summed over servers.")
    cache_hit_rate: float | None = Field(
        None, description="Delta cached_tokens_total / delta prompt_tokens_total."
    )
    retractions: float | None = Field(None, description="Delta sglang:num_retracted_requests_total.")
    errors: list[str] = Field(description="Up to three distinct scrape errors.")
    queue_time_source: Literal["metrics", "meta_info"] | None = Field(
        description="Where mean_queue_time_ms came from: /metrics, the requests' meta_info, or null (neither)."
    )

    def _omitted(self) -> set[str]:
        if self.available:
            return set()
        return {name for name in self._SCRAPED if getattr(self, name) is None}


class Worker(_Model):
    """One worker's share of the measured requests: the records whose ``served_by`` (the response's
    x-loadlab-worker header) names it; and, from its own /metrics scrapes, whether it stopped answering."""

    served_by: str = Field(description="The worker's id, as the records' served_by.")
    measured_requests: int = Field(description="Measured records it served, any outcome.")
    completed: int = Field(description="Of those, outcome ok.")
    failed: int = Field(description="Of those, any other outcome.")
    failures: dict[str, int] = Field(description="Its failed measured requests by outcome, sorted.")
    total_output_tokens: int = Field(description="Output tokens of its completed requests.")
    output_throughput: float | None = Field(
        description="total_output_tokens / the run's duration (tok/s); null without a duration."
    )
    median_ttft_ms: float | None = Field(description="TTFT P50 of its completed requests (ms).")
    p95_ttft_ms: float | None = Field(description="TTFT P95 of its completed requests (ms).")
    p95_tpot_ms: float | None = Field(description="TPOT P95 of its completed requests (ms).")
    cached_token_ratio: float | None = Field(
        description="sum(cached_tokens) / sum(prompt_tokens) over its completed requests reporting both."
    )
    cached_tokens_reported: int = Field(description="Its completed requests reporting both counts.")
    peak_token_usage: float | None = Field(
        description="Largest sglang:token_usage of its own /metrics (server_metrics rows whose url is its id) "
        "over the measured window; null when it was not scraped."
    )
    unreachable_from: float | None = Field(
        None,
        description="When it stopped answering: the first failed /metrics scrape of it (server_metrics rows "
        "whose url is its id) after a good one (epoch s); null if that never happened.",
    )
    unreachable_after_s: float | None = Field(
        None, description="unreachable_from - the first measured send (s): T+N s; null if never."
    )
    reachable_again_from: float | None = Field(
        None,
        description="The first good scrape after unreachable_from (epoch s): it answered again; null if it "
        "never did (or never stopped).",
    )


class ClientLimits(_Model):
    """The limits a load generator was held to (``--client-limit-ms``, ``--client-limit-cpu``)."""

    lateness_p99_ms: float = Field(
        description="Probe lateness P99 above which a process is client-bound (ms)."
    )
    cpu_mean: float = Field(
        description="Mean CPU (fraction of a core) above which a process is client-bound."
    )


class Generator(_Model):
    """One load-generator process's self-calibration."""

    worker_id: str | None = Field(description="The process (as the records' worker_id).")
    probe_lateness_p99_ms: float | None = Field(description="P99 of how late the probe was read (ms).")
    probe_lateness_max_ms: float | None = Field(description="Largest probe lateness (ms).")
    cpu_mean: float | None = Field(description="Mean CPU over the measured phase (fraction of a core).")
    cpu_max: float | None = Field(description="Largest CPU sample (fraction of a core).")


class Client(_Model):
    """The load generators' timing quality: the error bound on every latency and the client-bound verdict."""

    error_bound_ms: float | None = Field(description="Worst process's probe lateness P99 (ms).")
    client_bound: bool = Field(description="Whether a process passed a limit: its figures are suspect.")
    reasons: list[str] = Field(description="Which process passed which limit.")
    limits: ClientLimits | None = Field(description="The limits applied.")
    generators: list[Generator] = Field(description="Each load-generator process.")


class Receipt(_Model):
    """Which clock timed the events on receipt, and how often one read carried several token events."""

    clock: Literal["kernel", "user space", "mixed"] | None = Field(
        description="What timed the measured requests' reads: the kernel's receive timestamps, user space "
        "(perf_counter() after the read), or mixed (some of each); null: no record says."
    )
    kernel_fraction: float | None = Field(
        description="Measured requests whose every read the kernel timed, over those with a receipt clock."
    )
    reader: str | None = Field(
        description="The stream reader (manifest receipt.reader): lean or geventhttpclient."
    )
    clock_requested: str | None = Field(description="The profile's target.receipt_clock: kernel or user.")
    fallback: str | None = Field(
        description="Why the kernel did not time the run though asked to (the manifest's, or the records'); "
        "null when it did or was not asked."
    )
    coalesced_reads: int = Field(
        description="Reads that completed two or more token events of a completed measured request (those "
        "events share the read's time: their gap reads 0)."
    )
    coalesced_events: int = Field(
        description="Token events that shared a read with an earlier event of their request."
    )
    coalesced_event_fraction: float | None = Field(
        description="coalesced_events over the completed measured requests' token events."
    )


class SloObjective(_Model):
    """One objective of the profile's slo mapping and its verdict."""

    key: str = Field(description="The profile's key, e.g. ttft_p95_ms.")
    metric: Literal["ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"] = Field(
        description="The latency metric it bounds."
    )
    percentile: int | float = Field(description="The percentile (0-100) it bounds.")
    threshold_ms: float = Field(description="The limit (ms).")
    value_ms: float | None = Field(
        description="That exact percentile of the metric (ms); null without samples."
    )
    samples: int = Field(description="Samples the percentile was taken over.")
    passed: bool = Field(alias="pass", description="value_ms <= threshold_ms; false without samples.")


class Slo(_Model):
    """The SLO verdict."""

    _omit_when_none = ("unrecognized",)

    objectives: list[SloObjective] = Field(description="Each objective, in metric then percentile order.")
    passed: bool | None = Field(alias="pass", description="Every objective passes; null without objectives.")
    failed_requests: int = Field(description="Measured requests that failed (not in the latencies).")
    unrecognized: list[str] | None = Field(
        None, description="SLO keys not understood, sorted; absent when none."
    )


class Overload(_Model):
    """Open loop only: whether arrivals outran the server, and the evidence (docs/metrics.md, Overload)."""

    over_capacity: bool = Field(
        description="Arrivals outran the server: offered_above_capacity, ttft_growing or in_flight_growing."
    )
    offered_above_capacity: bool = Field(
        description="offered_prompt_tokens_per_s is more than 10% above served_prompt_tokens_per_s."
    )
    ttft_growing: bool = Field(
        description="TTFT from the due time rose at least 50 ms per second of arrivals over the arrivals' "
        "second half, significantly (ttft_slope_t >= 3, or an exact fit)."
    )
    in_flight_growing: bool = Field(
        description="Requests in flight grew by at least 5% of the arrival rate per second (in_flight_growth_per_s)."
    )
    arrival_rate: float = Field(description="Measured arrivals per second: (count - 1) / arrival_span_s.")
    arrival_span_s: float = Field(description="First to last measured due time (s).")
    mean_prompt_tokens: float | None = Field(
        description="Mean prompt tokens of the measured requests (the server's count, else the intended length)."
    )
    offered_prompt_tokens_per_s: float | None = Field(description="arrival_rate x mean_prompt_tokens.")
    served_prompt_tokens_per_s: float | None = Field(
        description="Prompt tokens of the completed measured requests / backlog_s: what the server took in "
        "while requests waited; null without a backlog."
    )
    backlog_s: float = Field(
        description="Time some measured request had been sent and had no first token yet (s)."
    )
    ttft_slope: float | None = Field(
        description="Least-squares slope of TTFT from the due time against the due time, over the requests due "
        "in the arrivals' second half (ms per ms); null with fewer than 10 of them."
    )
    ttft_slope_t: float | None = Field(
        description="That slope over its standard error; null without a slope or when the fit is exact."
    )
    ttft_slope_samples: int = Field(description="Requests the slope was fitted over.")
    in_flight_growth_per_s: float | None = Field(
        description="Mean in flight over the arrivals' last quarter minus over the quarter before, per second "
        "of a quarter (requests/s)."
    )


FindingKind = Literal[
    "over_capacity", "kv_reservation", "load_not_locked", "no_warmup", "prefix_cache_mismatch"
]


class Finding(_Model):
    """One of the method's pitfalls, reported only when the run's data shows it (docs/metrics.md, Findings)."""

    kind: FindingKind = Field(description="Which finding.")
    message: str = Field(description="The finding in plain words, with its figures and what to do.")
    evidence: dict[str, float | None] = Field(description="The figures behind it, by name.")

    def parts(self) -> tuple[str, str]:
        """Its title and its text: a message reads "Title: text"."""
        title, _, text = self.message.partition(": ")
        return title, text


# ---------------------------------------------------------------------------------------------------
# The flat latency keys on disk (the summary's and each class's)


class _FlatLatency(_Model):
    """The latency table (the run's, or one class's): LatencyStats fields that are flat ``<stat>_<metric>``
    keys on disk, with a ``samples`` part that has a count for exactly the metrics present."""

    samples: Samples = Field(description="Samples per latency metric.")
    ttft_ms: LatencyStats = Field(description="TTFT: send to the first token-carrying event.")
    tpot_ms: LatencyStats = Field(description="TPOT, bench_serving's: (E2E - TTFT) / (output_tokens - 1).")
    tpot_decode_ms: LatencyStats = Field(
        description="TPOT per decoded token: (E2E - TTFT) / (output_tokens - tokens in the first event)."
    )
    itl_ms: LatencyStats = Field(description="ITL per token: each event's gap spread over its tokens.")
    itl_per_event_ms: LatencyStats = Field(
        description="ITL per event: the raw gaps between token-carrying events."
    )
    e2e_latency_ms: LatencyStats = Field(description="E2E: send to the stream's last line.")
    client_queue_ms: LatencyStats | None = Field(None, description="Open loop only: send - due time.")
    ttft_from_scheduled_ms: LatencyStats | None = Field(
        None, description="Open loop only: TTFT from the due time."
    )
    e2e_from_scheduled_ms: LatencyStats | None = Field(
        None, description="Open loop only: E2E from the due time."
    )
    server_queue_ms: LatencyStats | None = Field(
        None, description="The server's queue time per request (meta_info.queue_time), when reported."
    )

    @model_validator(mode="before")
    @classmethod
    def _nest_latency(cls, data: Any) -> Any:
        """``p99_ttft_ms`` and its siblings into ``ttft_ms: {p99: ...}``."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for stem in LATENCY_STEMS:
            flat = {stat: f"{stat}_{stem}" for stat in STATS}
            found = {stat: data.pop(key) for stat, key in flat.items() if key in data}
            if found:
                if stem in data:
                    raise ValueError(f"{stem}: given both nested and as flat keys")
                data[stem] = found
        return data

    def _reshape(self, out: dict[str, Any]) -> dict[str, Any]:
        flat: dict[str, Any] = {}
        for key, value in out.items():
            if key in LATENCY_STEMS:
                if value is not None:  # an absent metric (open loop only, ...) has no keys at all
                    flat.update({f"{stat}_{key}": value[stat] for stat in STATS})
            else:
                flat[key] = value
        return flat

    @model_validator(mode="after")
    def _stats_match_samples(self):
        for stem in LATENCY_STEMS:
            if (getattr(self, stem) is None) != (getattr(self.samples, stem) is None):
                raise ValueError(f"{stem}: statistics and samples.{stem} must be both present or both absent")
        return self


class _Goodput(_Model):
    """Goodput (DistServe's): the requests that met every per-request limit. The run's and each class's."""

    goodput_limits: dict[str, float] | None = Field(
        None,
        description="Per-request limits (ms) by metric (ttft_ms, tpot_ms, e2e_latency_ms): each SLO "
        "objective's threshold, the lowest where a metric has several; null without such an objective (and in "
        "summaries written before goodput).",
    )
    good_requests: int | None = Field(
        None, description="Completed measured requests within every limit; null without limits."
    )
    goodput_ratio: float | None = Field(
        None,
        description="good_requests / measured_requests (failed requests never count); null without limits.",
    )
    request_goodput: float | None = Field(
        None, description="good_requests / the run's duration (req/s); null without limits."
    )
    output_goodput: float | None = Field(
        None,
        description="Output tokens of the good requests / the run's duration (tok/s); null without limits.",
    )


class RequestClass(_FlatLatency, _Goodput):
    """One SLO class of the profile (the records' request_class): its measured requests alone, with the
    run's definitions, and its own SLO verdict. The latency statistics are flat keys, as at the top level."""

    name: str = Field(description="The class's name, as the records' request_class.")
    share: float | None = Field(description="Its share in the profile; null for a class the profile lacks.")
    measured_requests: int = Field(description="Its measured records, any outcome.")
    completed: int = Field(description="Of those, outcome ok.")
    failed: int = Field(description="Of those, any other outcome.")
    failures: dict[str, int] = Field(description="Its failed measured requests by outcome, sorted.")
    total_output_tokens: int = Field(description="Output tokens of its completed requests.")
    request_throughput: float | None = Field(description="completed / the run's duration (req/s).")
    output_throughput: float | None = Field(description="total_output_tokens / the run's duration (tok/s).")
    slo: Slo = Field(description="Its verdict against its own SLO (the class's slo, else the profile's).")


class Turn(_Model):
    """One turn of a conversation's sessions (the records' turn): its measured requests alone. Later turns
    carry the earlier ones in their prompts, so their cache-hit ratio should rise."""

    turn: int = Field(description="The turn, 1 first (the records' turn).")
    measured_requests: int = Field(description="Measured records of this turn, any outcome.")
    completed: int = Field(description="Of those, outcome ok.")
    mean_prompt_tokens: float | None = Field(
        description="Mean prompt length of its completed requests (server-reported, else the length sent)."
    )
    cached_token_ratio: float | None = Field(
        description="sum(cached_tokens) / sum(prompt_tokens) over its completed requests reporting both."
    )
    cached_tokens_reported: int = Field(description="Its completed requests reporting both counts.")
    mean_ttft_ms: float | None = Field(description="Mean TTFT of its completed requests (ms).")
    median_ttft_ms: float | None = Field(description="TTFT P50 of its completed requests (ms).")
    p95_ttft_ms: float | None = Field(description="TTFT P95 of its completed requests (ms).")
    p99_ttft_ms: float | None = Field(description="TTFT P99 of its completed requests (ms).")


# ---------------------------------------------------------------------------------------------------
# The summary


class Summary(_FlatLatency, _Goodput):
    """The run summary (summary.json), computed exactly from the raw records: docs/metrics.md."""

    schema_name: Literal["loadlab.summary/6"] = Field(
        alias="schema", description="The schema, loadlab.summary/6."
    )
    version: Literal[6] = Field(
        SUMMARY_VERSION,
        description="Schema version of this summary (versions 1-5 and summaries without the key read as 6).",
    )
    run_id: str | None = Field(description="The run's id (manifest run_id).")
    profile_name: str | None = Field(description="The profile's name.")
    target_url: str | None = Field(description="The target's URL.")
    api: str | None = Field(description="The API the requests used: generate, completions or chat.")
    server_version: str | None = Field(description="The target's /server_info version at the start.")
    load_model: str = Field(description="The configured load in words, e.g. 'closed loop, 32 in flight'.")
    prompt_lengths: str | None = Field(
        None, description="A file's workload: how its lengths were counted (manifest workload_source)."
    )
    max_concurrency: int | None = Field(description="The configured cap on requests in flight.")
    request_rate: float | None = Field(description="The configured open-loop rate (req/s).")
    complete: bool | None = Field(description="The manifest's complete flag; null when it has none.")
    partial: bool = Field(description="Not complete, or fewer measured requests than expected.")
    warmup_requests: int = Field(description="Warm-up records (excluded from the figures).")
    measured_requests: int = Field(description="Measured records, any outcome.")
    expected_measured: int | None = Field(description="Measured requests the profile asked for.")
    lost_in_flight: int = Field(description="Requests lost with load generators that went away.")
    lost_in_flight_measured: int = Field(description="Of those, measured ones.")
    lost_in_flight_by_worker: dict[str, int] = Field(description="Lost requests per worker.")
    load_generators: int = Field(description="Load-generator processes (1 for a one-process run).")
    client: Client | None = Field(description="The load generators' self-calibration; null without one.")
    receipt: Receipt | None = Field(
        None,
        description="Which clock timed the run's events and the coalesced reads; null for virtual runs "
        "and summaries written before it.",
    )
    server: Server = Field(description="The target's /metrics over the measured window.")
    workers: list[Worker] = Field(
        default_factory=list,
        description="Per worker that served measured requests (records' served_by), and per scraped server "
        "that stopped answering, sorted by id; empty when neither (and in summaries written before "
        "attribution).",
    )
    unattributed_requests: int | None = Field(
        None,
        description="Measured records without served_by (no worker header), in no workers entry; null in "
        "summaries written before attribution.",
    )
    completed: int = Field(description="Measured requests with outcome ok.")
    failed: int = Field(description="Measured requests with any other outcome.")
    failures: dict[str, int] = Field(description="Failed measured requests by outcome, sorted.")
    front_failed: int | None = Field(
        None,
        description="Of the failed measured requests, those a front answered itself (status_source front: "
        "never reached a worker); null in summaries written before it was counted.",
    )
    front_failures: dict[str, int] = Field(
        default_factory=dict, description="Those front failures by HTTP status, sorted."
    )
    duration: float | None = Field(description="First measured send to last measured end (s).")
    total_input_tokens: int = Field(description="Prompt tokens of the completed requests.")
    total_output_tokens: int = Field(description="Output tokens of the completed requests.")
    input_tokens_fallback: int = Field(description="Completed requests counted by intended input length.")
    output_tokens_fallback: int = Field(description="Completed requests counted by streamed tokens.")
    request_throughput: float | None = Field(description="completed / duration (req/s).")
    input_throughput: float | None = Field(description="total_input_tokens / duration (tok/s).")
    output_throughput: float | None = Field(description="total_output_tokens / duration (tok/s).")
    total_throughput: float | None = Field(description="(input + output tokens) / duration (tok/s).")
    concurrency: float | None = Field(description="bench_serving's: sum of completed E2E (s) / duration.")
    in_flight: InFlight = Field(description="Requests in flight over the measured window.")
    cached_token_ratio: float | None = Field(
        description="sum(cached_tokens) / sum(prompt_tokens) where both reported."
    )
    cached_tokens_reported: int = Field(description="Completed requests reporting both counts.")
    expected_cached_token_ratio: float | None = Field(
        None,
        description="The workload's upper bound on cached_token_ratio: prompt tokens each request shares with a "
        "lower-index request of the run, over the same requests; null when the manifest's profile cannot say.",
    )
    tokens_per_event_inexact: int = Field(
        description="Completed requests without exact per-event token counts."
    )
    itl_estimated: bool = Field(
        False,
        description="Some completed request's per-event token counts, so its ITL, are estimated: the server "
        "sent token counts only at the end (or none); false in summaries written before version 6.",
    )
    itl_estimated_ratio: float | None = Field(
        None, description="tokens_per_event_inexact / completed; null without completed requests."
    )
    arrival_tokens_from: dict[str, int] = Field(
        default_factory=dict,
        description="Completed requests by where their per-event token counts came from (the records' "
        "arrival_tokens_from: server, tokenizer, spread, chunks), sorted; empty before version 6.",
    )
    short_outputs: int = Field(description="Completed requests with fewer output tokens than max_new_tokens.")
    percentile_method: str = Field(description="How percentiles are computed, in words.")
    slo: Slo = Field(
        description="The SLO verdict; with classes, pass only when every class's verdict passes too."
    )
    classes: list[RequestClass] = Field(
        default_factory=list,
        description="Per SLO class (the profile's classes, in its order; then any other request_class of the "
        "records, sorted); empty without classes (and in summaries written before classes).",
    )
    sessions: int | None = Field(
        None, description="A conversation's measured sessions (distinct records' session); null for others."
    )
    turns: list[Turn] = Field(
        default_factory=list,
        description="Per conversation turn (the records' turn), in order; empty for other workloads (and in "
        "summaries written before conversations).",
    )
    overload: Overload | None = Field(
        None, description="Open loop: whether arrivals outran the server; null for a closed loop."
    )
    findings: list[Finding] = Field(
        default_factory=list, description="The pitfalls the data shows, most serious first; empty when none."
    )
    records_source: Literal["records.parquet", "records.jsonl"] | None = Field(
        None, description="The records file write_report read; null without one (and from compute_summary)."
    )

    # -- save and load

    def dump(self) -> dict[str, Any]:
        """The JSON object of summary.json."""
        return self.model_dump(mode="json", by_alias=True)

    def to_json(self) -> str:
        return json.dumps(self.dump(), indent=2, allow_nan=False) + "\n"

    def write(self, run_dir: Path) -> Path:
        """Writes RUN_DIR/summary.json (atomically) and returns its path."""
        path = Path(run_dir) / SUMMARY_JSON
        write_atomic(path, self.to_json())
        return path

    @classmethod
    def read(cls, run_dir: Path) -> Summary:
        """RUN_DIR/summary.json; ``SummaryError`` when it is missing, unreadable or another version's."""
        path = Path(run_dir) / SUMMARY_JSON
        fix = f"loadlab report {run_dir} rewrites it from the records"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise SummaryError(f"{path}: no such file ({fix})") from None
        except (OSError, ValueError) as e:
            raise SummaryError(f"{path}: unreadable ({e}); {fix}") from None
        return cls.from_json_dict(data, where=str(path), fix=fix)

    @classmethod
    def from_json_dict(
        cls,
        data: Any,
        where: str = "summary",
        fix: str = "loadlab report RUN_DIR rewrites it from the records",
    ) -> Summary:
        """A summary from the JSON object of summary.json; ``SummaryError`` when it is not this version's."""
        if not isinstance(data, dict):
            raise SummaryError(f"{where}: not a JSON object; {fix}")
        version = data.get("version", 1)
        if version not in READS_VERSIONS:
            raise SummaryError(
                f"{where}: summary version {version!r}; this loadlab reads versions "
                f"{', '.join(map(str, READS_VERSIONS))} ({fix})"
            )
        if version != SUMMARY_VERSION:  # older: only fields were added since, which take their defaults
            data = {**data, "version": SUMMARY_VERSION, "schema": SUMMARY_SCHEMA}
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            first = e.errors()[0]
            loc = ".".join(str(part) for part in first["loc"]) or "(top level)"
            raise SummaryError(
                f"{where}: not a version-{SUMMARY_VERSION} summary ({e.error_count()} problem(s); {loc}: "
                f"{first['msg']}); {fix}"
            ) from None


def _is_stats(annotation: Any) -> bool:
    return annotation is LatencyStats or LatencyStats in typing.get_args(annotation)


# The latency metrics (fields holding LatencyStats) and the statistics of each, in order.
LATENCY_STEMS: tuple[str, ...] = tuple(n for n, f in Summary.model_fields.items() if _is_stats(f.annotation))
STATS: tuple[str, ...] = tuple(LatencyStats.model_fields)


# ---------------------------------------------------------------------------------------------------
# Estimated ITL, in words (summary.md, report.html, the console block and compare say the same)

# How the client counted the chunks of a server that counts only at the end, in words (records'
# arrival_tokens_from; the rules in docs/metrics.md).
_COUNTS_WORDS = {
    "tokenizer": "each chunk's text counted with target.tokenizer",
    "spread": "the final count spread over the chunks",
    "chunks": "no count from the server at all: one token per chunk",
}
# The latency rows that depend on the per-event token counts (the others use the server's total or times).
ESTIMATED_ROWS = {"itl_ms", "tpot_decode_ms"}


def _pct(part: int, whole: int) -> str:
    share = 100.0 * part / whole if whole else 0.0
    return f"{share:.0f}%" if share >= 1 or share == 0 else f"{share:.2g}%"


def itl_estimated(s: Summary) -> bool:
    """The run's ITL is (partly) estimated; also for a summary written before ``itl_estimated``."""
    return s.itl_estimated or s.tokens_per_event_inexact > 0


def itl_notes(s: Summary) -> list[str]:
    """What summary.md, report.html, the console block and compare say when the server did not count every
    event itself: "ITL estimated: ..." when some per-event counts are estimated (and how the client
    counted), else how the client counted exactly. Empty when the server counted every event (and in
    summaries written before the fields)."""
    counted = {k: v for k, v in s.arrival_tokens_from.items() if k in _COUNTS_WORDS}
    how = "; ".join(f"{_COUNTS_WORDS[k]}: {v}" for k, v in counted.items())
    if itl_estimated(s):
        n = s.tokens_per_event_inexact
        return [
            "ITL estimated: the server sent token counts only at the end"
            + (" (or none)" if "chunks" in counted else "")
            + f"; {_pct(n, s.completed)} of requests "
            f"({n} of {s.completed}"
            + (f"; {how}" if how else "")
            + "). ITL per token and TPOT (decode) rest "
            "on those counts; TTFT, TPOT, E2E and ITL per event do not."
        ]
    if counted:
        return [
            f"ITL counted by the client: the server sent token counts only at the end; {how} "
            f"({_pct(sum(counted.values()), s.completed)} of requests), adding up to the server's counts."
        ]
    return []
