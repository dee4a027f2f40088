"""Per-request records and the run manifest: the raw truth every report is computed from.

Records are appended to ``records.jsonl`` and flushed as each request ends, so a killed run leaves a
readable file; ``finalize`` converts them to ``records.parquet``. The columns are documented in
``docs/records.md``; keep the two in step.
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import functools
import os
import re
import socket
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
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


def merge_spills(run_dir: Path, have: IndexSet | set[int]) -> list[dict[str, Any]]:
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
                if isinstance(index, int) and index >= 0 and index not in have:
                    have.add(index)
                    out.write(orjson.dumps(row) + b"\n")
                    added.append(row)
        out.flush()
        os.fsync(out.fileno())
    return added


class IndexSet:
    """A set of request indices (small non-negative ints) in one byte per index up to the largest: what a
    run keeps of the requests it has recorded (1M of them: 1 MB, where a set of ints takes ~60 MB)."""

    def __init__(self, indices=()):
        self._bits = bytearray()
        self._count = 0
        for i in indices:
            self.add(i)

    def add(self, index: int) -> None:
        if index < 0:
            raise ValueError(f"a request index is not negative: {index}")
        if index >= len(self._bits):
            self._bits.extend(bytes(max(index + 1 - len(self._bits), len(self._bits))))
        if not self._bits[index]:
            self._bits[index] = 1
            self._count += 1

    def __contains__(self, index: object) -> bool:
        return isinstance(index, int) and 0 <= index < len(self._bits) and self._bits[index] == 1

    def __len__(self) -> int:
        return self._count

    def __iter__(self):
        return (i for i, bit in enumerate(self._bits) if bit)

    def issuperset(self, indices) -> bool:
        return all(i in self for i in indices)


_INDEX = re.compile(rb'^\{"index":(\d+),')  # how RequestRecord.to_json_line starts a line


def recorded_indices(run_dir: Path) -> IndexSet:
    """The indices records.jsonl holds (read from each line's start, as a run writes it; any other line is
    parsed whole; a torn last line is skipped)."""
    have = IndexSet()
    jsonl = Path(run_dir) / RECORDS_JSONL
    if not jsonl.exists():
        return have
    with open(jsonl, "rb") as f:
        for line in f:
            match = _INDEX.match(line)
            if match is not None and line.endswith(b"}\n"):
                have.add(int(match.group(1)))
                continue
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if isinstance(row, dict) and isinstance(row.get("index"), int) and row["index"] >= 0:
                have.add(row["index"])
    return have


def load_records(run_dir: Path, columns: list[str] | None = None, arrow: bool = False):
    """Returns the run's records as a pandas DataFrame (Parquet if written, else the JSONL).

    By default each per-event cell is a numpy array (Parquet) or a list (JSONL). With ``arrow`` the two
    per-event columns stay Arrow lists (``pd.ArrowDtype``: no Python object per cell; ``list_values``
    gives a chunk's flat values) and the text columns are categorical: what the post-processor reads a big run
    with. ``columns``: only these (in this order), e.g. what a report needs."""
    import pandas as pd  # heavy: only the post-processor needs it

    run_dir = Path(run_dir)
    names = list(columns) if columns is not None else list(RECORD_FIELDS)
    parquet = run_dir / RECORDS_PARQUET
    if not arrow:
        if parquet.exists():
            return pd.read_parquet(parquet, columns=columns)
        jsonl = run_dir / RECORDS_JSONL
        if not jsonl.exists():
            raise FileNotFoundError(f"{run_dir}: no {RECORDS_PARQUET} or {RECORDS_JSONL}")
        rows = read_jsonl_records(jsonl)
        return pd.DataFrame(rows, columns=list(RECORD_FIELDS))[names]
    import pyarrow as pa  # heavy, as pandas
    import pyarrow.parquet as pq

    text = [n for n in names if arrow_types()[n] == pa.string()]
    if parquet.exists():
        table = pq.read_table(parquet, columns=names, read_dictionary=text)
    else:
        jsonl = run_dir / RECORDS_JSONL
        if not jsonl.exists():
            raise FileNotFoundError(f"{run_dir}: no {RECORDS_PARQUET} or {RECORDS_JSONL}")
        batches = [_arrow_table(rows, names) for rows in _jsonl_chunks(jsonl, ROW_GROUP_ROWS)]
        table = pa.concat_tables(batches) if batches else _arrow_table([], names)
        table = table.select(names)
    for name in text:
        column = table.column(name)
        if not pa.types.is_dictionary(column.type):
            table = table.set_column(table.schema.get_field_index(name), name, column.dictionary_encode())

    def lists(arrow_type):  # the per-event columns stay Arrow: no Python object per cell
        return pd.ArrowDtype(arrow_type) if pa.types.is_list(arrow_type) else None

    return table.to_pandas(types_mapper=lists, self_destruct=True)


def list_values(array) -> tuple[np.ndarray, np.ndarray]:
    """One Arrow list array's flat values and each list's length (a null list: none), numpy arrays without a
    copy where Arrow allows it."""
    import pyarrow.compute as pc

    if array.null_count == 0 and array.values.null_count == 0:  # the usual case: Arrow's own buffers
        offsets = array.offsets.to_numpy()
        values = array.values.to_numpy()[offsets[0] : offsets[-1]]
        return values, np.diff(offsets).astype(np.int64)
    lengths = pc.list_value_length(array).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    values = array.flatten()  # the values of the non-null lists, the array's slice taken into account
    return values.to_numpy(zero_copy_only=False), lengths


# The per-event columns: lists in Parquet, a JSON array in a CSV cell.
EVENT_FIELDS = ("arrival_ms", "arrival_tokens")


def event_batches(run_dir: Path, groups=None):
    """records.parquet's per-event columns a row group at a time, in the file's order (``groups``: only the
    row groups at those indices): (receipt times, each record's number of them, tokens per event, each
    record's number of them) as numpy arrays. Only a group or two are held at a time: a million records'
    ~100M events never sit in memory as Arrow columns. The next group is read in a native thread while the
    caller works on this one (Arrow decodes without the GIL), except in a gevent-patched process, where
    threads are greenlets."""
    import pyarrow.parquet as pq

    def read():
        with pq.ParquetFile(Path(run_dir) / RECORDS_PARQUET) as file:
            have = [name for name in EVENT_FIELDS if name in file.schema_arrow.names]
            one_token = one_token_groups(file)
            for group in range(file.num_row_groups) if groups is None else groups:
                if group in one_token:  # the token counts are all 1, one per receipt time: not read
                    table = file.read_row_group(group, columns=["arrival_ms"])
                    ms, lengths = list_values(_one_chunk(table.column("arrival_ms")))
                    yield ms, lengths, np.broadcast_to(np.int64(1), ms.shape), lengths
                    continue
                table = file.read_row_group(group, columns=have)
                yield _event_columns(table, table.num_rows)

    return read_ahead(read())


# records.parquet's footer: the row groups whose every record's events carry one token each (TableWriter).
ONE_TOKEN_GROUPS = "loadlab.one_token_groups"


def one_token_groups(file) -> set[int]:
    """The row groups of a records.parquet (a ``pyarrow.parquet.ParquetFile``) whose every event carries one
    token, as its writer marked them in the footer (``ONE_TOKEN_GROUPS``) and the group's own statistics
    bear out (its token counts' minimum and maximum 1, or no count at all): those need not be read.
    None for a file written before the mark, or by another writer."""
    mark = (file.metadata.metadata or {}).get(ONE_TOKEN_GROUPS.encode())
    names = file.schema_arrow.names
    if mark is None or "arrival_ms" not in names or "arrival_tokens" not in names:
        return set()
    try:
        marked = {int(g) for g in orjson.loads(mark)}
    except (orjson.JSONDecodeError, TypeError, ValueError):
        return set()
    paths = [file.schema.column(i).path for i in range(len(file.schema))]
    if "arrival_tokens.list.element" not in paths:
        return set()
    leaf = paths.index("arrival_tokens.list.element")  # the token counts themselves
    out = set()
    for group in marked:
        if not 0 <= group < file.num_row_groups:
            continue
        stats = file.metadata.row_group(group).column(leaf).statistics
        if stats is None:
            continue
        # Every count 1, or none at all (only empty lists; an empty list is a null slot to the statistics).
        if not stats.has_min_max or (stats.min == 1 and stats.max == 1):
            out.add(group)
    return out


def _one_token_each(table) -> bool:
    """Whether every record of an Arrow table of records has one token an event: its token counts all 1 and
    as many as its receipt times, or none (which counts one an event: ``stats.Events``)."""
    import pyarrow.compute as pc

    if not {"arrival_ms", "arrival_tokens"} <= set(table.column_names):
        return False
    tok, ms = table.column("arrival_tokens"), table.column("arrival_ms")
    counts = pc.list_value_length(tok).fill_null(0)
    times = pc.list_value_length(ms).fill_null(0)
    if pc.any(pc.and_(pc.not_equal(counts, times), pc.not_equal(counts, 0))).as_py():
        return False
    values = pc.list_flatten(tok)
    if values.null_count:
        return False
    if not len(values):
        return True
    low_high = pc.min_max(values).as_py()
    return low_high["min"] == 1 and low_high["max"] == 1


def row_group_sizes(run_dir: Path) -> list[int]:
    """records.parquet's records per row group (``event_batches``' batches), from its footer."""
    import pyarrow.parquet as pq

    metadata = pq.read_metadata(Path(run_dir) / RECORDS_PARQUET)
    return [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]


def native_threads() -> bool:
    """Whether ``threading`` makes native threads here (not in a gevent-patched process: greenlets there)."""
    import sys

    gevent_monkey = sys.modules.get("gevent.monkey")
    return gevent_monkey is None or not gevent_monkey.is_module_patched("threading")


def side_by_side(calls) -> list[Any]:
    """The results of ``calls`` (functions of no argument), each in a native thread where there are any (work
    that releases the GIL, as numpy's and Arrow's loops do, then uses several cores); in turn otherwise."""
    if len(calls) < 2 or not native_threads():
        return [call() for call in calls]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(calls), thread_name_prefix="loadlab-side") as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


class _Done:
    def __init__(self, value: Any):
        self.value = value

    def result(self) -> Any:
        return self.value


def in_background(fn, *args) -> Any:
    """``fn(*args)`` started in a native thread; ``.result()`` waits for it (raising its error). Called at
    once where there are no native threads (a gevent-patched process)."""
    if not native_threads():
        return _Done(fn(*args))
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(1, thread_name_prefix="loadlab-background")
    future = pool.submit(fn, *args)
    pool.shutdown(wait=False)  # the thread ends with its one task
    return future


def in_order(fn, items, workers: int = 2, ahead: int = 4):
    """``fn(item)`` for each of ``items``, yielded in their order, up to ``ahead`` of them computed in
    ``workers`` native threads (work that releases the GIL then uses several cores); in turn where there are
    no native threads."""
    if not native_threads():
        yield from (fn(item) for item in items)
        return
    import collections
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers, thread_name_prefix="loadlab-in-order") as pool:
        pending: collections.deque = collections.deque()
        try:
            for item in items:
                pending.append(pool.submit(fn, item))
                if len(pending) > ahead:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:  # a consumer that stopped early: the rest is not computed
                future.cancel()


def read_ahead(items, depth: int = 2):
    """``items`` (an iterator), produced in a native thread up to ``depth`` ahead of the consumer; as it is in
    a gevent-patched process (no native thread to be had there: threading is greenlets)."""
    import threading

    if not native_threads():
        yield from items
        return
    import queue

    ready: queue.Queue = queue.Queue(depth)
    done = object()
    stop = threading.Event()

    def produce():
        try:
            for item in items:
                if stop.is_set():
                    return
                ready.put((item, None))
            ready.put((done, None))
        except BaseException as exc:  # handed to the consumer, raised there
            ready.put((done, exc))

    thread = threading.Thread(target=produce, name="loadlab-read-ahead", daemon=True)
    thread.start()
    try:
        while True:
            item, exc = ready.get()
            if item is done:
                if exc is not None:
                    raise exc
                return
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # let the producer see the stop (it may wait on a full queue)
            with contextlib.suppress(queue.Empty):
                ready.get(timeout=0.05)


def table_event_batches(table):
    """``event_batches`` of an Arrow table of records held in memory (its chunks, one batch each)."""
    for batch in table.select([n for n in EVENT_FIELDS if n in table.column_names]).to_batches():
        yield _event_columns(batch, batch.num_rows)


def _event_columns(table, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    out = []
    for name in EVENT_FIELDS:
        if name not in table.column_names:  # records from before the column: none
            out += [np.empty(0), np.zeros(rows, dtype=np.int64)]
            continue
        out += list(list_values(_one_chunk(table.column(name))))
    return out[0], out[1], out[2], out[3]


def _one_chunk(column):
    """A table's column as one array (one chunk as a rule: no copy then); an array as it is."""
    if hasattr(column, "num_chunks"):
        return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    return column


# Rows in one Parquet row group and CSV batch: what the process that owns a run holds before writing them.
ROW_GROUP_ROWS = 8192


class TableWriter:
    """records.parquet and records.csv written as records come (the process that owns a run; a JSONL file
    converted chunk by chunk), a row group of ``rows`` records at a time, so that no process ever holds
    every record and the end of a run only writes the last group.

    The files are written under a temporary name (``.records.parquet.partial``...) and take their names at
    ``close``: a run killed meanwhile leaves only records.jsonl, as before. ``offload`` runs each group's
    writing (``offload(fn)``; it may run it later, e.g. in a native thread, returning something whose
    ``get()`` waits for it); None: at once. At most ``BEHIND_MAX`` groups wait to be written: past that,
    ``add`` waits for the oldest, so records that come faster than they are written cannot pile up."""

    BEHIND_MAX = 2  # offloaded groups waiting to be written before adding one more waits for the oldest

    def __init__(self, run_dir: Path, rows: int = ROW_GROUP_ROWS, offload=None):
        import pyarrow  # noqa: F401 - heavy: loaded here, when the run starts, not at its first row group

        self.dir = Path(run_dir)
        self.rows = rows
        self.offload = offload
        self.count = 0
        self._pending: list[Any] = []  # records or JSONL rows (dicts) not written yet
        self._waiting: list[Any] = []  # offloaded groups being written
        self._parquet = None
        self._csv = None
        self.closed = False
        self._groups = 0  # row groups written (each write one, an empty one too)
        self._one_token: list[int] = []  # those whose every event carries one token (``one_token_groups``)

    def add(self, record: RequestRecord | dict[str, Any]) -> None:
        self._pending.append(record)
        self.count += 1
        if len(self._pending) >= self.rows:
            self._write_pending()

    def _write_pending(self) -> None:
        rows, self._pending = self._pending, []
        if not rows:
            return
        if self.offload is None:
            self._write(rows)
            return
        self._waiting = [w for w in self._waiting if w is not None and not _done(w)]
        while len(self._waiting) >= self.BEHIND_MAX:  # records come faster than they are written: wait
            self._waiting.pop(0).get()
        self._waiting.append(self.offload(functools.partial(self._write, rows)))

    def _write(self, rows: list[Any]) -> None:
        import pyarrow.csv as pacsv
        import pyarrow.parquet as pq

        table = _arrow_table(rows, RECORD_FIELDS)
        if self._parquet is None:
            # Receipt times are full doubles: neither a dictionary nor compression shrinks them, and reading
            # them back without either is ~2x faster (a million records' ~100M events: 1.2 s -> 0.6 s).
            paths = {name: f"{name}.list.element" if name in EVENT_FIELDS else name for name in RECORD_FIELDS}
            self._parquet = pq.ParquetWriter(
                self._partial(RECORDS_PARQUET),
                table.schema,
                use_dictionary=[path for name, path in paths.items() if name != "arrival_ms"],
                compression={
                    path: "none" if name == "arrival_ms" else "snappy" for name, path in paths.items()
                },
            )
        if _one_token_each(table):
            self._one_token.append(self._groups)
        self._parquet.write_table(table)
        self._groups += 1
        table = _csv_table(table, rows)
        if self._csv is None:
            self._csv = pacsv.CSVWriter(self._partial(RECORDS_CSV), table.schema)
        self._csv.write_table(table)

    def _partial(self, name: str) -> Path:
        return self.dir / f".{name}.partial"

    def close(self) -> Path:
        """Writes what is left and gives the files their names; returns records.parquet's path."""
        if not self.closed:
            self.closed = True
            try:
                self._write_pending()
                for waiting in self._waiting:
                    if waiting is not None:
                        waiting.get()  # re-raises a group's failure
                if self._parquet is None:  # no record: the files with their columns and no row
                    self._write([])
                self._parquet.add_key_value_metadata(
                    {ONE_TOKEN_GROUPS: orjson.dumps(self._one_token).decode()}
                )
            finally:
                for writer in (self._parquet, self._csv):
                    if writer is not None:
                        writer.close()
            for name in (RECORDS_PARQUET, RECORDS_CSV):
                os.replace(self._partial(name), self.dir / name)
        return self.dir / RECORDS_PARQUET

    def discard(self) -> None:
        """Gives up the files (the caller writes them otherwise)."""
        self.closed = True
        for writer in (self._parquet, self._csv):
            if writer is not None:
                with contextlib.suppress(Exception):
                    writer.close()
        for name in (RECORDS_PARQUET, RECORDS_CSV):
            self._partial(name).unlink(missing_ok=True)


def _done(waiting: Any) -> bool:
    ready = getattr(waiting, "ready", None)
    return bool(ready()) if callable(ready) else False


def _jsonl_chunks(path: Path, rows: int):
    """A records.jsonl file's rows (dicts), ``rows`` at a time; a torn line is skipped."""
    chunk: list[dict[str, Any]] = []
    with open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                chunk.append(orjson.loads(line))
            except orjson.JSONDecodeError:
                continue
            if len(chunk) >= rows:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


def write_parquet(run_dir: Path) -> Path:
    """Converts records.jsonl into records.parquet and records.csv, a row group at a time (the JSONL stays
    as the crash-safe copy): what a run that did not write them as it went (or ``loadlab report`` after a
    spill merge) does."""
    run_dir = Path(run_dir)
    writer = TableWriter(run_dir)
    jsonl = run_dir / RECORDS_JSONL
    if jsonl.exists():
        for chunk in _jsonl_chunks(jsonl, writer.rows):
            for row in chunk:
                writer.add(row)
    return writer.close()


def write_records(run_dir: Path, records: list[RequestRecord]) -> None:
    """records.jsonl, records.parquet and records.csv in one go, for a run that holds all its records at the
    end (a virtual-time run has nothing to lose to a crash)."""
    run_dir = Path(run_dir)
    with open(run_dir / RECORDS_JSONL, "wb") as f:
        f.write(b"".join(r.to_json_line() for r in records))
    writer = TableWriter(run_dir)
    for record in records:
        writer.add(record)
    writer.close()


def _values(rows: list[Any], name: str) -> list[Any]:
    if rows and all(type(r) is RequestRecord for r in rows):
        return [getattr(r, name) for r in rows]
    return [r.get(name) if isinstance(r, dict) else getattr(r, name, None) for r in rows]


def _arrow_table(rows: list[Any], names):
    """The records' columns ``names`` as an Arrow table of the Parquet types."""
    import pyarrow as pa  # heavy imports, only when a run is finalized

    types = arrow_types()
    arrays = {}
    for name in names:
        values = _values(rows, name)
        flat = _flat(values) if name in EVENT_FIELDS else None
        if flat is not None:
            # flat values + offsets: ~100x faster than pa.array on a list of lists, the same column
            offsets = np.zeros(len(values) + 1, dtype=np.int32)
            np.cumsum([len(v) for v in values], out=offsets[1:])
            arrays[name] = pa.ListArray.from_arrays(
                pa.array(offsets), pa.array(flat).cast(types[name].value_type)
            )
        else:
            arrays[name] = pa.array(values, type=types[name])
    return pa.table(arrays)


def _flat(values: list[Any]) -> np.ndarray | None:
    """Lists of numbers as one float array (C loops: ``array.extend`` per list); None if any is not a list
    of numbers (then Arrow converts them one by one, nulls included)."""
    flat = array.array("d")
    try:
        for v in values:
            if type(v) is not list:
                return None
            flat.extend(v)
    except TypeError:  # not a number (a JSONL file written by hand): Arrow says what is wrong
        return None
    return np.frombuffer(flat, dtype=np.float64) if len(flat) else np.empty(0)


def _csv_table(table, rows: list[Any]):
    """records.csv's columns: the Parquet table's, in its order; CSV has no lists, so each per-event column
    is one cell holding a JSON array (empty when the record has none)."""
    import pyarrow as pa

    for name in EVENT_FIELDS:
        cells = [orjson.dumps(v).decode() if v is not None else None for v in _values(rows, name)]
        table = table.set_column(table.schema.get_field_index(name), name, pa.array(cells, type=pa.string()))
    return table


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
