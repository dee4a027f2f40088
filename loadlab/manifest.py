"""The run manifest (``manifest.json``): what was run, against what, with which load, and how it ended.

Typed and versioned; written by the process that owns the run directory (``swarm/run.py`` for a Locust
run, ``virtual.py`` for a virtual-time run) through ``write_manifest``, read by everything else through
``read_manifest``. Written when the run starts (``complete: false``) and rewritten atomically when it
ends, so a killed run still says what it was. ``docs/records.md`` documents every field (a test checks).
"""

from __future__ import annotations

import json
import os
import platform
import uuid
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from loadlab import __version__

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1  # bump when a field changes meaning; readers accept every version up to this one


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ClusterWorkerInfo(_Model):
    url: str = Field(description="the worker's base URL")
    district: str = Field(description="its district")


class ClusterDistrictInfo(_Model):
    name: str = Field(description="the district's name")
    workers: int = Field(description="how many workers it has")
    settings: dict[str, Any] = Field(description="its workers' twin settings (SGLang names; gpu, model too)")
    serves: list[str] | None = Field(None, description="the SLO classes it serves (None: any class)")


class ClusterInfo(_Model):
    file: str = Field(description="the cluster file (`target.cluster`)")
    name: str = Field(description="the cluster's name")
    front_kind: Literal["router", "omni", "none"] = Field(description="the front: router, omni or none")
    policy: str | None = Field(description="the front's policy (null without a front)")
    front_url: str | None = Field(description="the front's URL (null without a front)")
    workers: list[ClusterWorkerInfo] = Field(description="every worker, in the file's order")
    districts: list[ClusterDistrictInfo] = Field(description="the districts, in the file's order")
    workers_per_process: int = Field(description="twins served by one process")
    front_settings: dict[str, Any] | None = Field(
        None,
        description="the front's knobs as resolved from the file (omni: orientation, policy, poll_interval_s, "
        "queue_size, switch with auto expanded, switch_after_waiting; router: policy, and poll_interval_s when set); null without a front",
    )
    overrides: dict[str, Any] | None = Field(
        None, description="settings laid over the file (target.cluster_overrides), dotted; null: none"
    )


class TargetInfo(_Model):
    url: str = Field(description="the target's base URL (`virtual` for a virtual-time run)")
    embedded: bool = Field(
        False, description="the embedded twin (or a cluster of twins) was started for this run"
    )
    virtual: bool = Field(False, description="the twin's scheduler on a virtual clock, no HTTP")
    embedded_settings: dict[str, Any] | None = Field(
        None, description="the profile's `target.embedded` settings (embedded and virtual runs)"
    )
    server_info: dict[str, Any] | None = Field(None, description="the target's `/server_info` at start")
    cluster: ClusterInfo | None = Field(
        None, description="the cluster started for the run (`target.cluster`)"
    )


class LoadDescription(_Model):
    model: Literal["closed", "open"] = Field(description="closed loop or open loop")
    concurrency: int | None = Field(
        None, description="closed loop: requests in flight; open loop: the cap (null: no cap)"
    )
    rate: float | None = Field(None, description="open loop: requests per second")
    arrival: Literal["poisson", "constant", "trace"] | None = Field(
        None, description="open loop: arrival process (trace: the trace workload's own times)"
    )
    speed: float | None = Field(None, description="trace arrivals: how many times faster than the trace")
    users: int | None = Field(None, description="open loop: Locust users (one request in flight each)")
    description: str = Field(description="the load in words, as the report states it")


class WorkloadSource(_Model):
    path: str = Field(description="the file the workload replays (`workload.path`)")
    format: Literal["jsonl", "sharegpt", "mooncake"] = Field(description="how it was read")
    entries_read: int = Field(description="prompts (or trace lines) read from it, before the filter")
    entries: int = Field(description="those the requests are drawn from, after the filter")
    filtered: dict[str, int] = Field(default_factory=dict, description="left out, by reason")
    lengths: str = Field(description="how prompt and output lengths were counted (exact, or an estimate)")
    trace_span_s: float | None = Field(None, description="trace: first to last timestamp, seconds")
    repeated_block_share: float | None = Field(
        None, description="trace: share of prompt blocks whose hash-id prefix an earlier line already had"
    )
    repeated_token_share: float | None = Field(
        None, description="trace: share of prompt tokens in those blocks"
    )


class Counts(_Model):
    warmup_expected: int = Field(description="warm-up requests the profile asks for")
    measured_expected: int = Field(description="measured requests the profile asks for")
    warmup_finished: int | None = Field(None, description="warm-up requests that ended (any outcome)")
    measured_finished: int | None = Field(None, description="measured requests that ended (any outcome)")
    records: int | None = Field(None, description="records written")
    outcomes: dict[str, int] = Field(default_factory=dict, description="records per outcome")
    lost_in_flight: int | None = Field(None, description="requests lost with a load generator that went away")
    recovered_from_spills: int | None = Field(
        None, description="records only workers' spill files held, merged in"
    )


class LostRequest(_Model):
    index: int = Field(description="the request's index")
    phase: str = Field(description="warmup or measure")
    worker: str = Field(description="the worker that held it")


class LoadGenerator(_Model):
    worker_id: str = Field(description="Locust's id of the worker")
    host: str | None = Field(None, description="the worker's host name")
    pid: int | None = Field(None, description="the worker's process id")
    clock_offset_s: float | None = Field(None, description="the master's clock minus the worker's")
    rtt_s: float | None = Field(None, description="the round trip of the clock estimate")
    records: int = Field(0, description="records the master received from it")
    lost_in_flight: int = Field(0, description="its requests lost in flight")
    record_batches_missing: int = Field(0, description="record batches that never arrived")
    gone: bool = Field(False, description="it went away during the run")


class TicketLeases(_Model):
    """Distributed: how the master leased tickets (a request, or a conversation's session) to the workers in
    blocks, and how long users waited for one (what the master adds to each request)."""

    leased: int = Field(0, description="tickets leased to the workers")
    blocks: int = Field(0, description="the messages that carried them")
    leased_again: int = Field(0, description="tickets of workers that went away, leased to the others")
    returned_unsent: int = Field(0, description="requests the workers returned unsent at the drain")
    measured_takes: int = Field(0, description="measured tickets users took from their worker's stock")
    empty_takes: int = Field(0, description="of those, takes that found the stock empty (a block awaited)")
    wait_ms_per_take: float | None = Field(None, description="users' mean wait for a measured ticket, ms")


class GeneratorCalibration(_Model):
    worker_id: str = Field(description="the load generator process")
    probe_lateness_ms: dict[str, float | int | None] | None = Field(
        None, description="how late the process handled I/O: its lateness histogram's summary"
    )
    cpu_mean: float | None = Field(
        None, description="CPU, fraction of one core, mean over the measured phase"
    )
    cpu_max: float | None = Field(None, description="CPU, the busiest sample")
    seconds: float | None = Field(None, description="how long it measured")


class ClientVerdict(_Model):
    error_bound_ms: float | None = Field(description="client timing error bound: the worst process's P99")
    client_bound: bool = Field(description="a load generator was over a limit: the figures are suspect")
    reasons: list[str] = Field(default_factory=list, description="which limit, where")
    limits: dict[str, float] = Field(description="`lateness_p99_ms` and `cpu_mean` limits")
    generators: list[GeneratorCalibration] = Field(default_factory=list, description="per process")


class ReceiptInfo(_Model):
    reader: str = Field(
        description="the stream reader: lean (loadlab's own) or geventhttpclient (also for https)"
    )
    clock_requested: str = Field(description="the profile's target.receipt_clock: kernel or user")
    clock: str = Field(description="the clock the reader times reads with: kernel, or user when it cannot")
    fallback: str | None = Field(
        None,
        description="why the kernel does not time the run although asked to (null: it does, or not asked)",
    )


class VirtualStats(_Model):
    virtual_duration_s: float = Field(description="simulated seconds from the first send to the last end")
    measure_start_s: float | None = Field(description="simulated time the measured phase began")
    forward_passes: int = Field(description="forward passes the scheduler ran")
    num_retractions_total: int = Field(description="requests retracted (KV cache full)")
    num_priority_preemptions_total: int = Field(
        0, description="running requests preempted by higher-priority ones (priority scheduling)"
    )
    evicted_tokens_total: int = Field(description="prefix-cache tokens evicted")
    peak_used_tokens_measured: int | None = Field(description="peak KV tokens in use, measured phase")
    peak_token_usage_measured: float | None = Field(description="that peak over the KV pool size")
    mean_queue_delay_ms: float | None = Field(description="mean time measured requests waited to run")
    max_total_num_tokens: int = Field(description="the KV pool size in tokens")
    cost_model: str = Field(description="the GPU x model preset (each distinct one, for a cluster)")
    workers: int = Field(1, description="simulated GPUs (a cluster's workers); counts are summed over them")
    switched: dict[str, dict[str, int]] | None = Field(
        None,
        description="omni's switch: requests of each class it diverted to each district, warm-up included "
        "(null: no switch)",
    )
    wall_s: float = Field(description="wall-clock seconds the simulation took")


class Versions(_Model):
    loadlab: str = Field(description="loadlab's version")
    locust: str | None = Field(None, description="Locust's version (Locust runs)")
    gevent: str | None = Field(None, description="gevent's version (Locust runs)")
    python: str = Field(description="Python's version")
    platform: str = Field(description="the operating system")


class Manifest(_Model):
    version: int = Field(MANIFEST_VERSION, description="the manifest schema's version")
    run_id: str = Field(description="the run directory's name")
    profile_path: str | None = Field(None, description="the profile file")
    profile: dict[str, Any] = Field(description="the fully resolved profile (overrides applied)")
    target: TargetInfo = Field(description="what the run was aimed at")
    model: str | None = Field(None, description="the model name sent (OpenAI APIs)")
    load: LoadDescription = Field(description="the load applied")
    workload_source: WorkloadSource | None = Field(
        None, description="a workload replayed from a file (dataset, trace); null for generated ones"
    )
    started_wall: float = Field(description="epoch seconds the run started")
    ended_wall: float | None = Field(None, description="epoch seconds the run ended (null while it runs)")
    complete: bool = Field(False, description="every measured request ended")
    counts: Counts = Field(description="requests expected, finished and recorded")
    versions: Versions = Field(description="software versions")
    command: list[str] = Field(description="the command line")
    lost_in_flight: list[LostRequest] = Field(default_factory=list, description="requests lost in flight")
    load_generators: list[LoadGenerator] = Field(default_factory=list, description="distributed: per worker")
    tickets: TicketLeases | None = Field(None, description="distributed: the master's ticket leases")
    client: ClientVerdict | None = Field(None, description="the load generators' self-calibration")
    receipt: ReceiptInfo | None = Field(
        None, description="how events are timed on receipt (this process's reader; null: a virtual run)"
    )
    failure: str | None = Field(
        None, description="why the run was ended early: a worker's reason, or the target refusing the API key"
    )
    virtual: bool = Field(False, description="a virtual-time run")
    sim: dict[str, Any] | None = Field(None, description="virtual: the twin's resolved settings")
    virtual_stats: VirtualStats | None = Field(None, description="virtual: the simulation's own figures")
    spill_of_worker: str | None = Field(
        None, description="a worker's copy of the manifest, beside its spill file on another machine"
    )


def software_versions(**more: str) -> Versions:
    """loadlab's, Python's and the platform's versions, with ``more`` (e.g. ``locust=...``)."""
    return Versions(
        loadlab=__version__, python=platform.python_version(), platform=platform.platform(), **more
    )


def write_manifest(run_dir: Path, manifest: Manifest) -> None:
    """Writes manifest.json atomically (a crash never leaves a half-written manifest)."""
    path = Path(run_dir) / MANIFEST
    # A name of its own per process and call: two writers of one directory never share a temporary file.
    tmp = path.with_name(f".{MANIFEST}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(json.dumps(manifest.model_dump(mode="json"), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


class ManifestError(ValueError):
    """manifest.json cannot be read; the message names the file and what is wrong."""


def read_manifest(run_dir: Path) -> Manifest | None:
    """The run's manifest, None if the run directory has none. Raises ManifestError for one that does
    not parse or does not fit the schema (one line)."""
    path = Path(run_dir) / MANIFEST
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ManifestError(f"{path}: not readable JSON ({e})") from None
    if isinstance(data, dict) and isinstance(data.get("version"), int) and data["version"] > MANIFEST_VERSION:
        raise ManifestError(f"{path}: version {data['version']} is newer than this loadlab reads")
    try:
        return Manifest.model_validate(data)
    except ValueError as e:
        first = str(e).splitlines()
        raise ManifestError(f"{path}: does not fit the manifest schema: {' '.join(first[:3])}") from None
