"""Per-request metrics and the run summary, computed exactly from the raw records.

Every number here comes from the records (``loadlab.records``) of the measured phase; nothing is
rounded or bucketed before the percentiles are taken. Percentiles are ``numpy.percentile``'s linear
interpolation (numpy's default, the same as sglang ``bench_serving``; computed by ``stats.quantiles``, equal
to numpy's to the last bit, and shared with the live figures), standard deviations are the
population ones (``numpy.std``, ddof=0, as ``bench_serving``). The definitions, with the reasons for
each, are in ``docs/metrics.md``; keep the two in step.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np
import pandas as pd

from loadlab.analysis import verdicts
from loadlab.analysis.itl import ITL_METRICS, EventSource, Pooled, RunEvents, itl_figures
from loadlab.analysis.server_metrics import gauge_peaks, outages, same_server, scrape_interval, server_summary
from loadlab.analysis.stats import (  # the definitions, shared with the live figures (loadlab.swarm.live)
    Described,
    evaluate_slo,
    finite_quantiles,
    itl_samples,  # noqa: F401 - importable from here, as before
    latency_samples,  # noqa: F401
    lists_batch,
    overall_pass,
    percentile,
    pooled_events,  # noqa: F401
    samples_of_events,
    slo_objectives,
    token_events,  # noqa: F401
)
from loadlab.analysis.summary import SUMMARY_SCHEMA, SUMMARY_VERSION, Summary
from loadlab.manifest import ClientVerdict, Manifest
from loadlab.records import (
    COUNTS_CHUNKS,
    COUNTS_SERVER,
    EVENT_FIELDS,
    MEASURE,
    OK,
    RECORD_FIELDS,
    STATUS_FRONT,
    WARMUP,
    in_background,
    table_event_batches,
)

PERCENTILES = (90, 95, 99)

# The record columns the summary and the report read as a table: all but the per-event ones (read a batch at
# a time: ``record_events``, ``records.event_batches``) and the ones no figure uses (server_id is a distinct
# string per record: ~1 s of a million records' reading).
REPORT_FIELDS = tuple(
    name
    for name in RECORD_FIELDS
    if name
    not in (*EVENT_FIELDS, "server_id", "worker_id", "user_id", "api", "finish_reason", "prefix_group")
)
PERCENTILE_METHOD = "exact: numpy.percentile over the raw per-request samples, linear interpolation"

# Latency metrics in the summary, in display order: key stem -> what it is.
LATENCY_METRICS = {
    "ttft_ms": "time to first token",
    "tpot_ms": "time per output token, (E2E - TTFT) / (output_tokens - 1)",
    "tpot_decode_ms": "time per decoded token, (E2E - TTFT) / (output_tokens - tokens in 1st event)",
    "itl_ms": "inter-token latency, per token",
    "itl_per_event_ms": "inter-event gap, one per token-carrying event",
    "e2e_latency_ms": "end-to-end latency",
}


# ---------------------------------------------------------------------------------------------------
# Small exact statistics


def describe(samples: Any, stem: str) -> dict[str, float | None]:
    """bench_serving-style keys for one metric: mean_X, median_X, std_X, p90_X, p95_X, p99_X, min_X,
    max_X. All None when there are no samples. The median is the linear-interpolation 50th percentile
    (equal to numpy.median up to the last bit)."""
    return _described(samples, stem)[0]


def describe_all(samples: dict[str, Any]) -> tuple[dict[str, float | None], dict[str, Described]]:
    """``describe`` of every metric, and each metric's samples with its percentiles (``Described``) for
    ``evaluate_slo``, which then takes them rather than selecting again."""
    out: dict[str, float | None] = {}
    known: dict[str, Described] = {}
    for stem, arr in samples.items():
        figures, known[stem] = _described(arr, stem)
        out.update(figures)
    return out, known


def _described(samples: Any, stem: str) -> tuple[dict[str, float | None], Described]:
    stats = ("mean", "median", "std", *(f"p{p}" for p in PERCENTILES), "min", "max")
    if isinstance(samples, Pooled):  # ITL over a run's events: itl_figures took its figures already
        if not samples.count:
            return {f"{stat}_{stem}": None for stat in stats}, Described(None, {}, 0)
        known = samples.known
        out = {f"mean_{stem}": samples.mean, f"median_{stem}": known[50.0], f"std_{stem}": samples.std}
        out.update({f"p{p}_{stem}": known[float(p)] for p in PERCENTILES})
        out.update({f"min_{stem}": known[0.0], f"max_{stem}": known[100.0]})
        return out, Described(None, known, samples.count)
    arr = np.asarray(samples, dtype=float).ravel()
    finite = np.isfinite(arr)
    if not finite.all():
        arr = arr[finite]
    del finite
    if arr.size == 0:
        return {f"{stat}_{stem}": None for stat in stats}, Described(arr, {}, 0)
    qs = [0, 50, *PERCENTILES, 100]
    values = finite_quantiles(arr, qs)  # one selection
    out: dict[str, float | None] = {
        f"mean_{stem}": float(np.mean(arr)),
        f"median_{stem}": float(values[1]),
        f"std_{stem}": float(np.std(arr)),
    }
    for p, value in zip(PERCENTILES, values[2:-1], strict=True):
        out[f"p{p}_{stem}"] = float(value)
    out[f"min_{stem}"] = float(values[0])
    out[f"max_{stem}"] = float(values[-1])
    return out, Described(arr, dict(zip(qs, values.tolist(), strict=True)), int(arr.size))


def in_flight(starts: Any, ends: Any, window_start: float, window_end: float) -> dict[str, float | None]:
    """Requests in flight over [window_start, window_end], exactly, by an event sweep.

    Each request is in flight over [start, end). Returns the time-weighted mean and the min and max of
    the in-flight count over the parts of the window of positive length. None without a window.
    """
    return flight_figures(flight_steps(starts, ends, window_start, window_end), window_start, window_end)


def flight_figures(
    steps: tuple[np.ndarray, np.ndarray] | None, window_start: float, window_end: float
) -> dict[str, float | None]:
    """``in_flight``'s figures from its sweep (``flight_steps``)."""
    if steps is None:
        return {"mean": None, "min": None, "max": None}
    counts, lengths = steps
    return {
        "mean": float(np.sum(counts * lengths) / (window_end - window_start)),
        "min": int(np.min(counts)),
        "max": int(np.max(counts)),
    }


def flight_steps(
    starts: Any, ends: Any, window_start: float, window_end: float
) -> tuple[np.ndarray, np.ndarray] | None:
    """The requests in flight over each part of [window_start, window_end] of positive length between two
    starts or ends, and each part's length (``in_flight``'s sweep; None without a window or parts)."""
    if not (_finite(window_start) and _finite(window_end)) or window_end <= window_start:
        return None
    s = np.asarray(starts, dtype=float).ravel()
    e = np.asarray(ends, dtype=float).ravel()
    ok = np.isfinite(s) & np.isfinite(e)
    s = np.maximum(s[ok], window_start)
    e = np.minimum(e[ok], window_end)
    keep = e > s
    # A run's records are in send order, and end nearly so: the stable sort (runs found and merged) is
    # linear on them where quicksort is not (a million sends 3 ms, not 70).
    s, e = np.sort(s[keep], kind="stable"), np.sort(e[keep], kind="stable")
    # Ends first, so that a stable sort puts an end before a start at the same time (back to back is not
    # overlap); the two sorted runs merge in one linear pass (a stable sort finds the runs): a million
    # requests in ~0.1 s, not a lexsort.
    times = np.concatenate([[window_start], e, s, [window_end]])
    deltas = np.concatenate([[0.0], -np.ones(e.size), np.ones(s.size), [0.0]])
    order = np.argsort(times, kind="stable")
    times, deltas = times[order], deltas[order]
    counts = np.cumsum(deltas)[:-1]  # the count over [times[k], times[k+1])
    lengths = np.diff(times)
    positive = lengths > 0
    if not positive.any():
        return None
    return counts[positive], lengths[positive]


def _finite(x: Any) -> bool:
    try:
        return x is not None and math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


# ---------------------------------------------------------------------------------------------------
# Record columns, tolerant of missing columns, nulls and either storage (JSONL lists, Parquet arrays)


def _numeric(df: pd.DataFrame, col: str) -> np.ndarray:
    if col not in df.columns:
        return np.full(len(df), np.nan)
    return pd.to_numeric(df[col], errors="coerce").to_numpy(dtype=float, na_value=np.nan)


def strings(df: pd.DataFrame, col: str) -> np.ndarray:
    """A text column as an object array of str and None (categorical columns without Python per row)."""
    if col not in df.columns:
        return np.full(len(df), None, dtype=object)
    column = df[col]
    if isinstance(column.dtype, pd.CategoricalDtype):  # load_records(arrow=True): no Python per row
        categories = [v if isinstance(v, str) else None for v in column.cat.categories.tolist()]
        return np.array([*categories, None], dtype=object)[column.cat.codes.to_numpy()]  # code -1: null
    return np.array([v if isinstance(v, str) else None for v in column.tolist()], dtype=object)


class Labels:
    """A text column as integer codes (a categorical column's own), so that a million records' masks by value
    compare integers, not Python strings."""

    def __init__(self, df: pd.DataFrame, col: str):
        column = df[col] if col in df.columns else None
        if column is not None and isinstance(column.dtype, pd.CategoricalDtype):
            self.codes = column.cat.codes.to_numpy()  # -1: null
            names = [v if isinstance(v, str) else None for v in column.cat.categories.tolist()]
        else:
            self.codes, uniques = pd.factorize(strings(df, col), use_na_sentinel=True)
            names = [v if isinstance(v, str) else None for v in uniques.tolist()]
        self.code = {name: i for i, name in enumerate(names) if name is not None}
        self.named = self.codes >= 0
        for i, name in enumerate(names):  # a category that is not text counts as none
            if name is None:
                self.named &= self.codes != i

    def equals(self, value: str) -> np.ndarray:
        """The records whose value is ``value``."""
        i = self.code.get(value)
        return self.codes == i if i is not None else np.zeros(self.codes.size, dtype=bool)

    def present(self, rows: np.ndarray) -> set[str]:
        """The values of the records ``rows`` selects (none counted out)."""
        used = set(np.unique(self.codes[rows & self.named]).tolist())
        return {name for name, i in self.code.items() if i in used}


def _objects(df: pd.DataFrame, col: str) -> list[Any]:
    if col not in df.columns:
        return [None] * len(df)
    return df[col].tolist()


def record_events(df: pd.DataFrame, keep_times: bool = False) -> RunEvents:
    """The records' token-carrying events (``event_source``'s batches), every chunk kept. ``keep_times``: as
    ``RunEvents.of_batches``."""
    return RunEvents.of_batches(event_source(df).read(None), keep_times)


def event_source(df: pd.DataFrame) -> EventSource:
    """The records' per-event columns as batches (``itl.scan_events``): from Arrow's flat values batch by
    batch when the DataFrame holds them (``load_records(arrow=True)``), else from the per-record lists or
    arrays."""
    if "arrival_ms" not in df.columns:
        none = np.zeros(len(df), dtype=np.int64)
        return EventSource.of([(np.empty(0), none, np.empty(0), none)])
    columns = [df[name] for name in ("arrival_ms", "arrival_tokens") if name in df.columns]
    if all(isinstance(c.dtype, pd.ArrowDtype) for c in columns):
        import pyarrow as pa

        table = pa.table({c.name: c.array.__arrow_array__() for c in columns})
        return EventSource.of(table_event_batches(table))
    tokens = _objects(df, "arrival_tokens")
    return EventSource.of([lists_batch(_objects(df, "arrival_ms"), tokens)])


def _objects_array(df: pd.DataFrame, col: str) -> np.ndarray:
    return np.array(_objects(df, col), dtype=object)


def counts_from(df: pd.DataFrame, rows: np.ndarray, exact: np.ndarray) -> dict[str, int]:
    """The selected records by their ``arrival_tokens_from``, sorted. Records written before the field had
    the server's counts when exact, else one token per chunk."""
    idx = np.flatnonzero(rows)
    if idx.size == 0:
        return {}
    counts: dict[str, int] = {}
    given = np.zeros(idx.size, dtype=bool)
    if "arrival_tokens_from" in df.columns:
        column = df["arrival_tokens_from"].iloc[idx]
        given = column.notna().to_numpy()
        for name, n in column[given].value_counts().items():  # categorical: counted by code
            if n:
                counts[str(name)] = int(n)
    for name, n in ((COUNTS_SERVER, exact[idx] & ~given), (COUNTS_CHUNKS, ~exact[idx] & ~given)):
        if n.any():
            counts[name] = counts.get(name, 0) + int(n.sum())
    return dict(sorted(counts.items()))


def _bools(df: pd.DataFrame, col: str, default: bool) -> np.ndarray:
    if col not in df.columns:
        return np.full(len(df), default)
    if df[col].dtype == bool:  # no nulls
        return df[col].to_numpy()
    return np.array(
        [
            default if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)) else bool(v)
            for v in df[col].tolist()
        ],
        dtype=bool,
    )


# ---------------------------------------------------------------------------------------------------
# Manifest helpers


def _get(mapping: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(mapping, dict):
            return None
        mapping = mapping.get(key)
    return mapping


def _client(client: ClientVerdict | None) -> dict[str, Any] | None:
    """The load generators' self-calibration (manifest ``client``): error bound and client-bound verdict."""
    if client is None:
        return None
    return {
        "error_bound_ms": client.error_bound_ms,
        "client_bound": client.client_bound,
        "reasons": list(client.reasons),
        "limits": client.limits,
        "generators": [
            {
                "worker_id": g.worker_id,
                "probe_lateness_p99_ms": (g.probe_lateness_ms or {}).get("p99"),
                "probe_lateness_max_ms": (g.probe_lateness_ms or {}).get("max"),
                "cpu_mean": g.cpu_mean,
                "cpu_max": g.cpu_max,
            }
            for g in client.generators
        ],
    }


# ---------------------------------------------------------------------------------------------------
# The summary


@dataclasses.dataclass(frozen=True)
class _FromManifest:
    """What the summary takes from the run manifest, all read in ``_from_manifest``."""

    run_id: Any
    profile_name: Any
    target_url: Any
    api: Any
    server_version: Any
    load_model: str
    max_concurrency: int | None
    request_rate: float | None
    complete: bool | None
    expected_measured: int | None
    lost_in_flight: int
    lost_in_flight_measured: int
    lost_in_flight_by_worker: dict[str, int]
    load_generators: int
    client: dict[str, Any] | None
    slo: Any  # the profile's slo mapping, parsed by evaluate_slo
    classes: list[Any]  # the profile's classes (name, share, slo, ...), [] without
    load_kind: str | None = None  # "closed" or "open"; None without a manifest
    profile: dict[str, Any] | None = None  # the resolved profile: the workload behind the expected cache hits
    virtual_peak_usage: float | None = None  # a virtual run's peak KV usage (it has no /metrics)
    prompt_lengths: str | None = None  # a file's workload: how its lengths were counted
    receipt: dict[str, Any] | None = None  # the manifest's receipt (reader, clocks, fallback)


def _from_manifest(manifest: Manifest | None) -> _FromManifest:
    """Every read of the run manifest that compute_summary makes (none: a run directory without one)."""
    if manifest is None:
        return _FromManifest(
            None, None, None, None, None, "unknown", None, None, None, None, 0, 0, {}, 1, None, None, []
        )
    profile, load, lost = manifest.profile, manifest.load, manifest.lost_in_flight
    by_worker: dict[str, int] = {}
    for item in lost:
        by_worker[item.worker] = by_worker.get(item.worker, 0) + 1
    return _FromManifest(
        run_id=manifest.run_id,
        profile_name=profile.get("name"),
        target_url=manifest.target.url,
        api=_get(profile, "target", "api"),
        server_version=_get(manifest.target.server_info, "version"),
        load_model=load.description,
        max_concurrency=load.concurrency,
        request_rate=load.rate,
        complete=manifest.complete,
        expected_measured=manifest.counts.measured_expected,
        lost_in_flight=len(lost),
        lost_in_flight_measured=sum(1 for x in lost if x.phase == MEASURE),
        lost_in_flight_by_worker=by_worker,
        load_generators=len(manifest.load_generators) or 1,
        client=_client(manifest.client),
        slo=profile.get("slo"),
        classes=list(profile.get("classes") or []),
        load_kind=load.model,
        profile=profile,
        virtual_peak_usage=getattr(manifest.virtual_stats, "peak_token_usage_measured", None),
        prompt_lengths=getattr(manifest.workload_source, "lengths", None),
        receipt=manifest.receipt.model_dump() if manifest.receipt is not None else None,
    )


CLOCK_NAMES = {"kernel": "kernel", "user": "user space", "mixed": "mixed"}


def _receipt(df, measured, ok, events: RunEvents, info: dict[str, Any] | None) -> dict[str, Any] | None:
    """Which clock timed the measured requests (records' receipt_clock) and the reads that carried several
    token events (records' coalesced_reads; the events, from equal arrival times within a request). None for
    a run whose records say nothing of it (virtual time, records written before)."""
    clocks = strings(df, "receipt_clock")[measured]
    known = int(np.count_nonzero(clocks != None))  # noqa: E711 - elementwise over an object array
    if not known and info is None:
        return None
    kernel = int(np.count_nonzero(clocks == "kernel"))
    if not known:
        clock = None
    elif kernel == known:
        clock = "kernel"
    elif int(np.count_nonzero(clocks == "user")) == known:
        clock = "user space"
    else:
        clock = "mixed"
    reads = _numeric(df, "coalesced_reads")[ok]
    # A later event at its predecessor's time shares its read (zero gaps, counted per record).
    shared = int(events.zero_gaps[ok].sum())
    n_events = int(events.lengths[ok].sum())
    info = info or {}
    fallback = info.get("fallback")
    if fallback is None and info.get("clock_requested") == "kernel" and known and clock != "kernel":
        fallback = f"{known - kernel} of {known} requests had reads without a kernel timestamp"
    return {
        "clock": clock,
        "kernel_fraction": kernel / known if known else None,
        "reader": info.get("reader"),
        "clock_requested": info.get("clock_requested"),
        "fallback": fallback,
        "coalesced_reads": int(np.nansum(reads)) if reads.size else 0,
        "coalesced_events": shared,
        "coalesced_event_fraction": shared / n_events if n_events else None,
    }


@dataclasses.dataclass
class ItlScopes:
    """The sets of records whose ITL a summary reports, over all records: the run's completed measured
    requests (name None) and each SLO class's, with every percentile the summary, the report's plots and an
    SLO objective take of it."""

    names: list[str | None]
    masks: list[np.ndarray]
    qs: list[float]

    def named(self, figures: list[dict[str, Pooled]]) -> dict[str | None, dict[str, Pooled]]:
        """``itl_figures``' (or ``scan_events``') figures of these scopes, by name."""
        return dict(zip(self.names, figures, strict=True))

    def taken(self, figures: dict[str | None, dict[str, Pooled]] | None) -> bool:
        """Whether ``figures`` (``RunEvents.figures``) are these scopes' with every percentile wanted."""
        return (
            figures is not None
            and list(figures) == self.names
            and all(
                all(q in pooled.known for q in self.qs)
                for scope in figures.values()
                for pooled in scope.values()
                if pooled.count
            )
        )


def itl_scopes(df: pd.DataFrame, manifest: Manifest | None) -> ItlScopes:
    """The ITL scopes ``compute_summary(df, manifest)`` reports, for a caller that takes their figures as it
    reads the events (``itl.scan_events``)."""
    phase, outcome = strings(df, "phase"), strings(df, "outcome")
    measured = phase == MEASURE
    return _itl_scopes(
        _from_manifest(manifest), measured & (outcome == OK), measured, Labels(df, "request_class")
    )


def _itl_scopes(run: _FromManifest, ok: np.ndarray, measured: np.ndarray, request_class: Labels) -> ItlScopes:
    profile_classes = {c["name"]: c for c in run.classes if isinstance(c, dict) and "name" in c}
    others = sorted(request_class.present(measured) - set(profile_classes))
    class_names = [*profile_classes, *others]
    qs = {50.0, *map(float, PERCENTILES), 99.9}  # 99.9: the report's plots
    for slo in [run.slo, *(c.get("slo") for c in profile_classes.values())]:
        qs.update(float(q) for metric, q, _, _ in slo_objectives(slo)[0] if metric in ITL_METRICS)
    masks = [ok, *(ok & request_class.equals(name) for name in class_names)]
    return ItlScopes([None, *class_names], masks, sorted(qs))


def compute_summary(
    df: pd.DataFrame | None,
    manifest: Manifest | None,
    server_rows: list[dict[str, Any]] | None = None,
    samples_out: dict[str, np.ndarray] | None = None,
    class_samples_out: dict[str, dict[str, np.ndarray]] | None = None,
    events: RunEvents | Any = None,
) -> Summary:
    """The run summary from its records (a DataFrame as ``load_records`` returns) and manifest.

    Pure: reads nothing, writes nothing. Keys follow sglang bench_serving where it has one (duration,
    completed, total_input_tokens, ..., mean_ttft_ms, p99_itl_ms, median_e2e_latency_ms, concurrency);
    the rest are documented in docs/metrics.md and typed in ``Summary`` (summary.py). ``samples_out`` and
    ``class_samples_out`` (class name -> its samples) receive the per-request samples behind the figures,
    for the plots. ``events``: ``record_events(df)``, when the caller has it already, or a future of them
    (``.result()``): the figures that need no events are taken while the caller's reading goes on.
    """
    run = _from_manifest(manifest)
    if df is None:
        df = pd.DataFrame(columns=list(RECORD_FIELDS))
    df = df.reset_index(drop=True)

    phase = strings(df, "phase")
    outcome = strings(df, "outcome")
    measured = phase == MEASURE
    warmup = phase == WARMUP
    ok = measured & (outcome == OK)
    not_ok = measured & ~ok

    t_send = _numeric(df, "t_send_wall")
    ttft = _numeric(df, "ttft_ms")
    e2e = _numeric(df, "e2e_ms")
    prompt_tokens = _numeric(df, "prompt_tokens")
    output_tokens = _numeric(df, "output_tokens")
    cached_tokens = _numeric(df, "cached_tokens")
    input_len = _numeric(df, "input_len")
    max_new_tokens = _numeric(df, "max_new_tokens")
    exact = _bools(df, "tokens_per_event_exact", True)
    # The figures that need no events first: a caller still reading them (a report's scan, in a native
    # thread) goes on meanwhile.
    scheduled_col = _numeric(df, "t_scheduled_wall")
    server_rows = server_rows or []
    margin = scrape_interval(server_rows)  # scrapes one interval either side of the window belong to it

    # The measured window: first measured send to last measured end, any outcome.
    end_wall = np.where(np.isfinite(e2e), t_send + e2e / 1000.0, t_send)
    m_send = t_send[measured & np.isfinite(t_send)]
    m_end = end_wall[measured & np.isfinite(t_send)]
    if m_send.size:
        window_start, window_end = float(np.min(m_send)), float(np.max(m_end))
        duration = window_end - window_start
    else:
        window_start = window_end = None
        duration = None
    has_duration = duration is not None and duration > 0

    # Cached-token ratio over completed requests reporting both counts.
    both = ok & np.isfinite(cached_tokens) & np.isfinite(prompt_tokens)
    cached_reported = int(both.sum())
    prompt_sum = float(np.sum(prompt_tokens[both]))
    cached_ratio = (
        float(np.sum(cached_tokens[both]) / prompt_sum) if cached_reported and prompt_sum > 0 else None
    )

    # In flight: all records' intervals (warm-up and failures are real load) over the measured window; how
    # long more than the configured concurrency were (a load not locked).
    steps = flight_steps(t_send, end_wall, window_start, window_end) if has_duration else None
    flight = flight_figures(steps, window_start, window_end)
    cap = run.max_concurrency
    above_cap = float(np.sum(steps[1][steps[0] > cap])) if steps is not None and cap is not None else 0.0
    # The workload's own bound on the cache hits, over the requests the server's ratio is taken over (all
    # completed ones when the server reported none).
    prompt_each = np.where(
        np.isfinite(prompt_tokens), prompt_tokens, input_len
    )  # the server's, else intended
    shared = verdicts.reusable_prefix(run.profile, _numeric(df, "index"))
    over = both if cached_reported else ok
    over_prompts = prompt_each[over]
    expected_cached_ratio = (
        float(np.nansum(shared[over]) / np.nansum(over_prompts))
        if shared is not None and over.any() and np.nansum(over_prompts) > 0
        else None
    )

    overload = verdicts.overload(scheduled_col, t_send, ttft, prompt_each, measured, ok, t_send, end_wall)
    if events is None:  # every record's token-carrying events, flat
        events = record_events(df)
    elif not isinstance(events, RunEvents):  # still being read
        events = events.result()

    # Failures by kind.
    failures: dict[str, int] = {}
    for kind in outcome[not_ok]:
        key = kind if kind else "unknown"
        failures[key] = failures.get(key, 0) + 1
    failures = dict(sorted(failures.items()))

    # Per-request samples of the completed (ok, measured) requests.
    server_queue_col = _numeric(df, "server_queue_ms")

    # Per SLO class: its measured records alone (below). The ITL of the run and of every class in one go
    # over the events, with every percentile an SLO objective or the report asks of it: taken as the events
    # were read (scan_events, a report's), else here in native threads while the per-request figures are
    # taken (numpy's loops run without the GIL).
    request_class = Labels(df, "request_class")
    profile_classes = {c["name"]: c for c in run.classes if isinstance(c, dict) and "name" in c}
    scopes = _itl_scopes(run, ok, measured, request_class)
    class_names = scopes.names[1:]
    taken = events.figures if scopes.taken(events.figures) else None
    job = None if taken else in_background(lambda: scopes.named(itl_figures(events, scopes.masks, scopes.qs)))

    def itl_of(scope: str | None, metric: str) -> Pooled:
        return (taken or job.result())[scope][metric]

    def samples_of(done: np.ndarray, scope: str | None) -> tuple[dict[str, Any], np.ndarray]:
        """The latency samples of the requests ``done`` selects (the run's or class ``scope``'s completed
        requests), and their resolved output token counts."""
        ok_idx = np.flatnonzero(done)
        ok_ttft, ok_e2e = ttft[ok_idx], e2e[ok_idx]
        pooled = {  # ITL: filled in when it is ready (resolved)
            "itl_per_token": functools.partial(itl_of, scope, "itl_ms"),
            "itl_per_event": functools.partial(itl_of, scope, "itl_per_event_ms"),
            "first_tokens": events.first_tokens[ok_idx],
            "token_sum": events.token_sum[ok_idx],
        }
        samples, ok_out = samples_of_events(ok_ttft, ok_e2e, output_tokens[ok_idx], pooled)
        # Open loop: latency counted from when the send was due, so queueing inside the client cannot hide
        # (coordinated omission). Only when the load model scheduled sends.
        scheduled = scheduled_col[ok_idx]
        if np.isfinite(scheduled).any():
            queue = (t_send[ok_idx] - scheduled) * 1000.0
            has = np.isfinite(queue)
            samples["client_queue_ms"] = queue[has]
            samples["ttft_from_scheduled_ms"] = (ok_ttft + queue)[has & np.isfinite(ok_ttft)]
            samples["e2e_from_scheduled_ms"] = (ok_e2e + queue)[has & np.isfinite(ok_e2e)]
        # The server's waiting queue per request, where it says (meta_info.queue_time, --enable-metrics).
        server_queue = server_queue_col[ok_idx]
        if np.isfinite(server_queue).any():
            samples["server_queue_ms"] = server_queue[np.isfinite(server_queue)]
        return samples, ok_out

    samples, ok_out = samples_of(ok, None)
    out_tokens_resolved = output_tokens.copy()
    output_fallback = int((ok & ~np.isfinite(output_tokens)).sum())
    out_tokens_resolved[np.flatnonzero(ok)] = ok_out
    # Each request's own TPOT (NaN without one), for its goodput.
    with np.errstate(divide="ignore", invalid="ignore"):
        tpot_each = np.where(out_tokens_resolved > 1, (e2e - ttft) / (out_tokens_resolved - 1), np.nan)

    # Token totals over completed requests.
    completed = int(ok.sum())
    input_known = np.isfinite(prompt_tokens[ok])
    input_fallback = int((~input_known).sum())
    input_vals = np.where(input_known, prompt_tokens[ok], input_len[ok])
    total_input = int(np.nansum(input_vals)) if completed else 0
    total_output = int(np.nansum(out_tokens_resolved[ok])) if completed else 0

    e2e_ok_s = e2e[ok]
    e2e_ok_s = e2e_ok_s[np.isfinite(e2e_ok_s)] / 1000.0

    # NaN compares False, so requests missing either count are not short.
    short = ok & (max_new_tokens > 0) & (out_tokens_resolved < max_new_tokens)

    # Per worker: the measured records each worker served (served_by, the x-loadlab-worker header).
    served_by = Labels(df, "served_by")
    attributed = served_by.named
    scrape_start = None if window_start is None else window_start - margin
    scrape_end = None if window_end is None else window_end + margin
    kv_peaks = gauge_peaks(server_rows, "sglang:token_usage", scrape_start, scrape_end)
    # Workers that stopped answering their /metrics (a worker killed mid-run). Every scrape counts, also
    # those after the last measured request: the scraper runs only while the run does (it is stopped
    # before an embedded cluster is), and a worker that died at the end may have failed only those.
    down = outages(server_rows)
    named = served_by.present(measured)
    # A worker that died before it served a measured request still has an entry, so the report names it.
    named |= {url for url in down if not any(same_server(w) == url for w in named)}
    workers = []
    for worker in sorted(named):
        mine = measured & served_by.equals(worker)
        done = mine & ok
        worker_failures: dict[str, int] = {}
        for kind in outcome[mine & ~ok]:
            worker_failures[kind or "unknown"] = worker_failures.get(kind or "unknown", 0) + 1
        ttft_w, e2e_w, out_w = ttft[done], e2e[done], out_tokens_resolved[done]
        with np.errstate(divide="ignore", invalid="ignore"):
            tpot_w = (e2e_w - ttft_w) / (out_w - 1)
        tpot_w = tpot_w[(out_w > 1) & np.isfinite(tpot_w)]
        reported = done & np.isfinite(cached_tokens) & np.isfinite(prompt_tokens)
        prompts = float(np.sum(prompt_tokens[reported]))
        output_w = int(np.nansum(out_w)) if done.any() else 0
        workers.append(
            {
                "served_by": worker,
                "measured_requests": int(mine.sum()),
                "completed": int(done.sum()),
                "failed": int((mine & ~ok).sum()),
                "failures": dict(sorted(worker_failures.items())),
                "total_output_tokens": output_w,
                "output_throughput": output_w / duration if has_duration else None,
                "median_ttft_ms": percentile(ttft_w, 50),
                "p95_ttft_ms": percentile(ttft_w, 95),
                "p95_tpot_ms": percentile(tpot_w, 95),
                "cached_token_ratio": float(np.sum(cached_tokens[reported]) / prompts)
                if prompts > 0
                else None,
                "cached_tokens_reported": int(reported.sum()),
                "peak_token_usage": kv_peaks.get(same_server(worker)),
                **_outage(down.get(same_server(worker)), window_start),
            }
        )

    # Failures a front answered itself (status_source front: the request never reached a worker), by status.
    source = strings(df, "status_source")
    at_front = not_ok & (source == STATUS_FRONT)
    front_failures: dict[str, int] = {}
    for status, kind in zip(_numeric(df, "http_status")[at_front], outcome[at_front], strict=True):
        key = str(int(status)) if np.isfinite(status) else (kind or "unknown")
        front_failures[key] = front_failures.get(key, 0) + 1

    measured_requests = int(measured.sum())
    partial = run.complete is not True or (
        run.expected_measured is not None
        and measured_requests + run.lost_in_flight_measured < run.expected_measured
    )

    def per_s(x: float) -> float | None:
        return x / duration if has_duration else None

    summary: dict[str, Any] = {
        "schema": SUMMARY_SCHEMA,
        "version": SUMMARY_VERSION,
        "run_id": run.run_id,
        "profile_name": run.profile_name,
        "target_url": run.target_url,
        "api": run.api,
        "server_version": run.server_version,
        "load_model": run.load_model,
        "prompt_lengths": run.prompt_lengths,
        "max_concurrency": run.max_concurrency,
        "request_rate": run.request_rate,
        "complete": run.complete,
        "partial": bool(partial),
        "warmup_requests": int(warmup.sum()),
        "measured_requests": measured_requests,
        "expected_measured": run.expected_measured,
        "lost_in_flight": run.lost_in_flight,
        "lost_in_flight_measured": run.lost_in_flight_measured,
        "lost_in_flight_by_worker": run.lost_in_flight_by_worker,
        "load_generators": run.load_generators,
        "client": run.client,
        # Scrapes one interval either side of the window still belong to it (counters need two points).
        "server": server_summary(server_rows, scrape_start, scrape_end),
        "workers": workers,
        "unattributed_requests": int((measured & ~attributed).sum()),
        "completed": completed,
        "failed": int(not_ok.sum()),
        "failures": failures,
        "front_failed": int(at_front.sum()),
        "front_failures": dict(sorted(front_failures.items())),
        "duration": duration,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "input_tokens_fallback": input_fallback,
        "output_tokens_fallback": output_fallback,
        "request_throughput": per_s(completed),
        "input_throughput": per_s(total_input),
        "output_throughput": per_s(total_output),
        "total_throughput": per_s(total_input + total_output),
        "concurrency": per_s(float(np.sum(e2e_ok_s))) if completed else (0.0 if has_duration else None),
        "in_flight": flight,
        "cached_token_ratio": cached_ratio,
        "cached_tokens_reported": cached_reported,
        "tokens_per_event_inexact": int((ok & ~exact).sum()),
        "itl_estimated": bool((ok & ~exact).any()),
        "itl_estimated_ratio": float((ok & ~exact).sum() / completed) if completed else None,
        "arrival_tokens_from": counts_from(df, ok, exact),
        "short_outputs": int(short.sum()),
        "percentile_method": PERCENTILE_METHOD,
        "samples": {stem: _count(arr) for stem, arr in resolved(samples).items()},
    }
    figures, described = describe_all(samples)
    summary.update(figures)
    server = summary["server"]
    server["queue_time_source"] = "metrics" if server.get("mean_queue_time_ms") is not None else None
    if server["queue_time_source"] is None and "server_queue_ms" in samples:  # no /metrics: the events say
        server["mean_queue_time_ms"] = summary["mean_server_queue_ms"]
        server["queue_time_source"] = "meta_info"
    summary["slo"] = evaluate_slo(run.slo, described, summary["failed"])
    summary["receipt"] = _receipt(df, measured, ok, events, run.receipt)

    def goodput_of(slo: Any, mine: np.ndarray) -> dict[str, Any]:
        limits = verdicts.goodput_limits(slo_objectives(slo)[0])
        return verdicts.goodput(limits, mine, ok, ttft, tpot_each, e2e, out_tokens_resolved, duration)

    summary.update(goodput_of(run.slo, measured))

    summary["expected_cached_token_ratio"] = expected_cached_ratio

    # Per SLO class: its measured records alone, the same definitions, its own SLO.
    summary["classes"] = []
    for name in class_names:
        mine = measured & request_class.equals(name)
        done = mine & ok
        class_samples, class_out = samples_of(done, name)
        class_figures, class_described = describe_all(resolved(class_samples))
        class_failures: dict[str, int] = {}
        for kind in outcome[mine & ~ok]:
            class_failures[kind or "unknown"] = class_failures.get(kind or "unknown", 0) + 1
        output_c = int(np.nansum(class_out)) if done.any() else 0
        declared = profile_classes.get(name, {})
        slo_c = declared.get("slo") if declared.get("slo") is not None else run.slo
        entry = {
            "name": name,
            "share": declared.get("share"),
            "measured_requests": int(mine.sum()),
            "completed": int(done.sum()),
            "failed": int((mine & ~ok).sum()),
            "failures": dict(sorted(class_failures.items())),
            "total_output_tokens": output_c,
            "request_throughput": per_s(int(done.sum())),
            "output_throughput": per_s(output_c),
            "samples": {stem: _count(arr) for stem, arr in class_samples.items()},
            "slo": evaluate_slo(slo_c, class_described, int((mine & ~ok).sum())),
            **goodput_of(slo_c, mine),
        }
        entry.update(class_figures)
        summary["classes"].append(entry)
        if class_samples_out is not None:  # each class's own samples, for its plots
            class_samples_out[name] = class_samples
    summary["sessions"], summary["turns"] = _turns(df, measured, ok, ttft, prompt_each, cached_tokens)
    summary["slo"]["pass"] = overall_pass(
        [summary["slo"]["pass"], *(c["slo"]["pass"] for c in summary["classes"])]
    )
    classes = summary["classes"]
    if classes and any(c["goodput_limits"] is not None for c in classes):
        # With classes each request is judged by its own class's limits (which inherit the profile's); a
        # class without any per-request limit has nothing to fail, so its completed requests count as good.
        def judged(c: dict, good_key: str, all_key: str) -> float | None:
            return c[good_key] if c["goodput_limits"] is not None else c[all_key]

        good = sum(judged(c, "good_requests", "completed") for c in classes)
        summary["good_requests"] = good
        summary["goodput_ratio"] = good / measured_requests if measured_requests else None
        for key, whole in (
            ("request_goodput", "request_throughput"),
            ("output_goodput", "output_throughput"),
        ):
            parts = [judged(c, key, whole) for c in classes]
            summary[key] = None if any(v is None for v in parts) else float(sum(parts))

    # The overload verdict (open loop) and the pitfalls the data shows.
    summary["overload"] = overload
    closed = run.load_kind == "closed"
    # A conversation's users think between turns (fewer in flight than users, by design), and its cache hits
    # rise along each session: the pitfalls below judge its first turns only, and its concurrency by them.
    first_turns = ok & ~(_numeric(df, "turn") > 1)
    thinks = bool(_get(run.profile, "workload", "think_time_s"))
    retractions = server.get("retractions")
    if retractions is None:  # no /metrics (a virtual run): the records' own counts
        counts = _numeric(df, "num_retractions")[measured]
        retractions = float(np.nansum(counts)) if np.isfinite(counts).any() else None
    refused = verdicts.refused_for_size(_numeric(df, "http_status"), strings(df, "error"), not_ok)
    peak_usage = server.get("peak_token_usage")
    findings = [
        verdicts.overload_finding(summary["overload"], measured_requests),
        verdicts.kv_finding(
            peak_usage if peak_usage is not None else run.virtual_peak_usage, retractions, refused
        ),
        verdicts.lock_finding(closed and not thinks, run.max_concurrency, flight, above_cap, duration),
        verdicts.warmup_finding(
            int(warmup.sum()),
            run.max_concurrency if closed else None,
            t_send,
            ttft,
            cached_tokens,
            prompt_tokens,
            first_turns,
        ),
        verdicts.cache_finding(summary["expected_cached_token_ratio"], cached_ratio, len(workers)),
    ]
    summary["findings"] = [f for f in findings if f is not None]
    if samples_out is not None:  # the per-request samples, for plots
        samples_out.update(samples)
    return Summary.model_validate(clean(summary))  # the flat keys of summary.json, as summary.json is read


def resolved(samples: dict[str, Any]) -> dict[str, Any]:
    """``samples`` with every metric still being computed (a function of no argument) in its place, in
    place and in the same order."""
    for stem, value in samples.items():
        if callable(value):
            samples[stem] = value()
    return samples


def _count(samples: Any) -> int:
    return samples.count if isinstance(samples, Pooled) else int(samples.size)


def _turns(
    df: pd.DataFrame, measured: np.ndarray, ok: np.ndarray, ttft: np.ndarray, prompt: np.ndarray,
    cached: np.ndarray,
) -> tuple[int | None, list[dict[str, Any]]]:  # fmt: skip
    """A conversation's measured sessions and per turn (the records' turn) its counts, mean prompt, cache-hit
    ratio and TTFT; (None, []) for records without turns. ``prompt``: each record's prompt tokens (the
    server's, else the length sent)."""
    turn, session = _numeric(df, "turn"), _numeric(df, "session")
    has = measured & np.isfinite(turn)
    if not has.any():
        return None, []
    out = []
    for t in np.unique(turn[has]).astype(int).tolist():
        mine = has & (turn == t)
        done = mine & ok
        reported = done & np.isfinite(cached) & np.isfinite(prompt)
        prompts = float(np.sum(prompt[reported]))
        ttft_t = ttft[done]
        ttft_t = ttft_t[np.isfinite(ttft_t)]
        out.append(
            {
                "turn": t,
                "measured_requests": int(mine.sum()),
                "completed": int(done.sum()),
                "mean_prompt_tokens": float(np.nanmean(prompt[done])) if done.any() else None,
                "cached_token_ratio": float(np.sum(cached[reported]) / prompts) if prompts > 0 else None,
                "cached_tokens_reported": int(reported.sum()),
                "mean_ttft_ms": float(np.mean(ttft_t)) if ttft_t.size else None,
                "median_ttft_ms": percentile(ttft_t, 50),
                "p95_ttft_ms": percentile(ttft_t, 95),
                "p99_ttft_ms": percentile(ttft_t, 99),
            }
        )
    return int(np.unique(session[has & np.isfinite(session)]).size), out


def _outage(outage: tuple[float, float | None] | None, window_start: float | None) -> dict[str, Any]:
    """A worker's outage fields: when it stopped answering (epoch s, and since the first measured send)
    and when it answered again."""
    if outage is None:
        return {"unreachable_from": None, "unreachable_after_s": None, "reachable_again_from": None}
    start, back = outage
    return {
        "unreachable_from": start,
        "unreachable_after_s": start - window_start if window_start is not None else None,
        "reachable_again_from": back,
    }


def clean(value: Any) -> Any:
    """JSON-safe copy: numpy scalars to Python, NaN and infinities to None."""
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
