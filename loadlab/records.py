"""Per-request records and the run manifest: the raw truth every report is computed from.

Records are appended to ``records.jsonl`` and flushed as each request ends, so a killed run leaves a
readable file; ``finalize`` converts them to ``records.parquet``. The columns are documented in
``docs/records.md``; keep the two in step.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import re
import socket
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson

RECORDS_JSONL = "records.jsonl"
RECORDS_CSV = "records.csv"  # for spreadsheets: the same columns, the per-event lists as JSON arrays
RECORDS_PARQUET = "records.parquet"
SPILL_DIR = "spill"  # workers' own copies of their records (distributed runs), one JSONL file per worker
# The target's /metrics, one JSON line per scrape (loadlab.target.scraper writes, analysis.server_metrics reads)
SERVER_METRICS = "server_metrics.jsonl"
DEFAULT_SCRAPE_INTERVAL_S = 1.0

# Outcomes a request can end with. "ok" is the only success.
OK = "ok"
HTTP_ERROR = "http_error"  # the server answered with a non-2xx status
REJECTED = "rejected"  # HTTP 429: a front (or server) refused it for load, e.g. omni's full queue
STREAM_ERROR = "stream_error"  # an in-stream {"error": ...} event or an abort finish_reason
DROPPED = "dropped"  # the connection closed before the stream ended
TIMEOUT = "timeout"  # no byte for idle_timeout_s, or the whole request passed timeout_s
CONNECT_ERROR = "connect_error"  # could not connect or send the request
PROTOCOL_ERROR = "protocol_error"  # the server sent something that is not SGLang's wire format
CANCELLED = "cancelled"  # the run stopped (e.g. -t ran out) while the request was in flight
CLIENT_ERROR = "client_error"  # loadlab itself failed on this request (a bug: the error says what)
OUTCOMES = (
    OK,
    HTTP_ERROR,
    REJECTED,
    STREAM_ERROR,
    DROPPED,
    TIMEOUT,
    CONNECT_ERROR,
    PROTOCOL_ERROR,
    CANCELLED,
    CLIENT_ERROR,
)

WARMUP = "warmup"
MEASURE = "measure"

# Who gave a response its status (a record's status_source): a worker (the response carried the worker
# header, x-loadlab-worker) or a front in front of the workers answering itself (x-loadlab-front: e.g. the
# omni front's 429; or sglang-router's x-smg-error-code on the errors it makes itself, e.g. its 500 when
# every retry failed). Null when none of them came (a real SGLang, also behind a real router).
STATUS_WORKER = "worker"
STATUS_FRONT = "front"
STATUS_SOURCES = (STATUS_WORKER, STATUS_FRONT)

# Where a record's per-event token counts (arrival_tokens) came from (its arrival_tokens_from). Only the
# server's counts are certain; a server that ignores stream_options.continuous_usage_stats counts tokens
# only at the end, and the client then gives each content chunk its share (docs/metrics.md, "ITL when the
# server counts only at the end").
COUNTS_SERVER = "server"  # the server's cumulative counts on every event (native meta_info, OpenAI usage)
COUNTS_TOKENIZER = "tokenizer"  # each chunk's text counted with the profile's target.tokenizer
COUNTS_SPREAD = "spread"  # the server's final count spread over the chunks
COUNTS_CHUNKS = "chunks"  # no count from the server at all: one token per chunk
COUNTS_SOURCES = (COUNTS_SERVER, COUNTS_TOKENIZER, COUNTS_SPREAD, COUNTS_CHUNKS)

# What timed a request's events on receipt (a record's receipt_clock): the kernel's receive timestamp of
# every read (SO_TIMESTAMPNS), user space (perf_counter() once the read returned) for every read, or
# some reads each way (the kernel gave no timestamp for some).
CLOCK_KERNEL = "kernel"
CLOCK_USER = "user"
CLOCK_MIXED = "mixed"
RECEIPT_CLOCKS = (CLOCK_KERNEL, CLOCK_USER, CLOCK_MIXED)


@dataclass(slots=True)
class RequestRecord:
    """One request, as the client saw it. Times are milliseconds from the send unless named _wall."""

    index: int  # the request spec's index: (profile, seed, index) determines the request
    phase: str  # WARMUP or MEASURE
    api: str  # generate | completions | chat
    worker_id: str  # the load generator process that sent it
    user_id: int  # the Locust user (one request in flight per user)
    t_send_wall: float  # epoch seconds when the request was sent
    outcome: str = OK
    error: str | None = None
    http_status: int | None = None
    server_id: str | None = None  # meta_info.id (native) or the chunk id (OpenAI), to join server logs
    ttft_ms: float | None = None  # send -> first event carrying a token
    e2e_ms: float | None = None  # send -> last line of the stream (or the failure)
    arrival_ms: list[float] = field(default_factory=list)  # per token-carrying event, offset from send
    arrival_tokens: list[int] = field(default_factory=list)  # tokens carried by that event
    tokens_per_event_exact: bool = True  # False when the per-event counts are estimated (see below)
    input_len: int = 0  # prompt length the workload intended
    max_new_tokens: int = 0
    prompt_tokens: int | None = None  # server-reported
    output_tokens: int | None = None  # server-reported completion tokens
    cached_tokens: int | None = None  # server-reported prefix-cache hit
    num_retractions: int | None = None  # server-reported (native API only)
    server_queue_ms: float | None = (
        None  # meta_info.queue_time: the server's waiting queue (native, --enable-metrics)
    )
    finish_reason: str | None = None
    prefix_group: int | None = None
    t_scheduled_wall: float | None = None  # open-loop load models: when the send was due
    served_by: str | None = None  # the response's x-loadlab-worker header: the worker that served it
    status_source: str | None = None  # STATUS_WORKER, STATUS_FRONT or None: who answered (headers above)
    request_class: str | None = (
        None  # the profile's SLO class of the request (its spec's); None without classes
    )
    session: int | None = None  # a conversation's session (its spec's); None for any other workload
    turn: int | None = None  # the request's turn in its session, 1 first
    arrival_tokens_from: str = COUNTS_SERVER  # where arrival_tokens came from: a COUNTS_* above
    receipt_clock: str | None = None  # RECEIPT_CLOCKS: what timed its events; None: no body byte read
    coalesced_reads: int | None = None  # reads that completed 2+ token events (they share its time)

    def to_json_line(self) -> bytes:
        return orjson.dumps(self) + b"\n"  # orjson serialises dataclasses natively (~50x asdict)


RECORD_FIELDS = tuple(f.name for f in dataclasses.fields(RequestRecord))


class RecordWriter:
    """Appends records to ``run_dir/records.jsonl`` (or another file name), one flushed line per request."""

    def __init__(self, run_dir: Path, name: str = RECORDS_JSONL):
        self.path = Path(run_dir) / name
        self._file = open(self.path, "ab")  # noqa: SIM115 - kept open for the run
        self.count = 0

    def write(self, record: RequestRecord) -> None:
        self._file.write(record.to_json_line())
        self._file.flush()
        self.count += 1

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()


def read_jsonl_records(path: Path) -> list[dict[str, Any]]:
    """Reads a records.jsonl file; a torn last line (killed writer) is skipped, not fatal."""
    rows = []
    with open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                rows.append(orjson.loads(line))
            except orjson.JSONDecodeError:
                continue
    return rows


def worker_id() -> str:
    """The id of this load generator process, in every record it writes: ``host:pid``."""
    return f"{socket.gethostname()}:{os.getpid()}"


def spill_name(worker_id: str) -> str:
    """A worker's spill file name under ``SPILL_DIR``."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", worker_id) + ".jsonl"


def merge_spills(run_dir: Path, have: set[int]) -> list[dict[str, Any]]:
    """Appends to records.jsonl every record in ``run_dir/spill/*.jsonl`` whose index is not in ``have``
    (updated); returns the records added. A request is recorded once even if several files hold it."""
    spill = Path(run_dir) / SPILL_DIR
    files = sorted(spill.glob("*.jsonl")) if spill.is_dir() else []
    added: list[dict[str, Any]] = []
    if not files:
        return added
    with open(Path(run_dir) / RECORDS_JSONL, "ab") as out:
        for path in files:
            for row in read_jsonl_records(path):
                index = row.get("index")
                if isinstance(index, int) and index not in have:
                    have.add(index)
                    out.write(orjson.dumps(row) + b"\n")
                    added.append(row)
        out.flush()
        os.fsync(out.fileno())
    return added


def recorded_indices(run_dir: Path) -> set[int]:
    jsonl = Path(run_dir) / RECORDS_JSONL
    return {row["index"] for row in read_jsonl_records(jsonl) if "index" in row} if jsonl.exists() else set()


def load_records(run_dir: Path):
    """Returns the run's records as a pandas DataFrame (Parquet if written, else the JSONL)."""
    import pandas as pd  # heavy: only the post-processor needs it

    run_dir = Path(run_dir)
    parquet = run_dir / RECORDS_PARQUET
    if parquet.exists():
        return pd.read_parquet(parquet)
    jsonl = run_dir / RECORDS_JSONL
    if not jsonl.exists():
        raise FileNotFoundError(f"{run_dir}: no {RECORDS_PARQUET} or {RECORDS_JSONL}")
    rows = read_jsonl_records(jsonl)
    return pd.DataFrame(rows, columns=list(RECORD_FIELDS))


def write_parquet(run_dir: Path) -> Path:
    """Converts records.jsonl into records.parquet (the JSONL stays as the crash-safe copy)."""
    run_dir = Path(run_dir)
    rows = read_jsonl_records(run_dir / RECORDS_JSONL) if (run_dir / RECORDS_JSONL).exists() else []
    return _write_table(run_dir, {name: [row.get(name) for row in rows] for name in RECORD_FIELDS})


def write_records(run_dir: Path, records: list[RequestRecord]) -> None:
    """records.jsonl and records.parquet in one go, for a run that holds all its records at the end (a
    virtual-time run has nothing to lose to a crash)."""
    run_dir = Path(run_dir)
    with open(run_dir / RECORDS_JSONL, "wb") as f:
        f.write(b"".join(r.to_json_line() for r in records))
    _write_table(run_dir, {name: [getattr(r, name) for r in records] for name in RECORD_FIELDS})


def _write_table(run_dir: Path, columns: dict[str, list]) -> Path:
    import numpy as np  # heavy imports, only when a run is finalized
    import pyarrow as pa
    import pyarrow.parquet as pq

    types = arrow_types()
    arrays = {}
    for name, values in columns.items():
        if name in _LIST_COLUMNS and all(v is not None for v in values):
            # flat values + offsets: ~10x faster than pa.array on a list of lists, the same column
            offsets = np.zeros(len(values) + 1, dtype=np.int32)
            np.cumsum([len(v) for v in values], out=offsets[1:])
            flat = np.fromiter(
                itertools.chain.from_iterable(values), dtype=np.float64, count=int(offsets[-1])
            )
            arrays[name] = pa.ListArray.from_arrays(
                pa.array(offsets), pa.array(flat).cast(types[name].value_type)
            )
        else:
            arrays[name] = pa.array(values, type=types[name])
    out = run_dir / RECORDS_PARQUET
    table = pa.table(arrays)
    pq.write_table(table, out)
    _write_csv(run_dir / RECORDS_CSV, table, columns)
    return out


def _write_csv(path: Path, table, columns: dict[str, list]) -> None:
    """records.csv: every column of the Parquet table in its order; CSV has no lists, so each per-event
    column is one cell holding a JSON array (empty when the record has none)."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    for name in _LIST_COLUMNS:
        cells = [orjson.dumps(v).decode() if v is not None else None for v in columns[name]]
        table = table.set_column(table.schema.get_field_index(name), name, pa.array(cells, type=pa.string()))
    pacsv.write_csv(table, path)


_LIST_COLUMNS = ("arrival_ms", "arrival_tokens")


@functools.cache
def arrow_types() -> dict[str, Any]:
    import pyarrow as pa  # heavy: only when Parquet is written

    types = {
        "index": pa.int64(),
        "phase": pa.string(),
        "api": pa.string(),
        "worker_id": pa.string(),
        "user_id": pa.int64(),
        "t_send_wall": pa.float64(),
        "outcome": pa.string(),
        "error": pa.string(),
        "http_status": pa.int64(),
        "server_id": pa.string(),
        "ttft_ms": pa.float64(),
        "e2e_ms": pa.float64(),
        "arrival_ms": pa.list_(pa.float64()),
        "arrival_tokens": pa.list_(pa.int64()),
        "tokens_per_event_exact": pa.bool_(),
        "arrival_tokens_from": pa.string(),
        "input_len": pa.int64(),
        "max_new_tokens": pa.int64(),
        "prompt_tokens": pa.int64(),
        "output_tokens": pa.int64(),
        "cached_tokens": pa.int64(),
        "num_retractions": pa.int64(),
        "server_queue_ms": pa.float64(),
        "finish_reason": pa.string(),
        "prefix_group": pa.int64(),
        "t_scheduled_wall": pa.float64(),
        "served_by": pa.string(),
        "status_source": pa.string(),
        "request_class": pa.string(),
        "session": pa.int64(),
        "turn": pa.int64(),
        "receipt_clock": pa.string(),
        "coalesced_reads": pa.int64(),
    }
    missing = set(RECORD_FIELDS) - set(types)
    assert not missing, f"no Arrow type for record fields {missing}"
    return types


def default_run_name(profile_name: str, suffix: str = "") -> str:
    """``YYYYmmdd-HHMMSS-<profile>[suffix]``: the run directory name when none is given."""
    return f"{datetime.now().strftime('%Y%m%d-%H%M%S')}-{profile_name}{suffix}"


def unique_run_name(out_root: str | Path, name: str) -> str:
    """``name``, or ``name-2``, ``name-3``... if a run directory of that name already exists."""
    candidate, n = name, 1
    while (Path(out_root) / candidate).exists():
        n += 1
        candidate = f"{name}-{n}"
    return candidate
