"""ITL over a big run's events, exactly, without holding a sample per token (issue 17, part 5).

A million records carry ~100M token-carrying events and ~160M per-token ITL samples: materialising those
samples for the run and again for each SLO class took most of a 45 s summary. Here each batch of records (a
Parquet row group) is cleaned and scanned as it is read (``scan_events``), and only each record's sums are
kept (``RunEvents``):

- a histogram per *cell* (the requests that belong to the same set of scopes: the run and one class, say)
  over buckets of the value's bits (sign, exponent and 12 bits of mantissa, ~0.025 % wide), per event or
  weighted by tokens; a scope's histogram is the sum of its cells';
- the events in the buckets that hold a wanted order statistic, gathered, whose exact values a radix select
  among those few finds (``weighted_kth``). With 16 batches or more a pilot of every eighth says, before
  the pass, where each order statistic will lie; the pass gathers those buckets with a margin as it counts;
- the means and standard deviations from the records' sums of gaps and squared gaps;
- report.html's tokens received per second, and each scope's plot draw from a sample of events taken at
  rates the pilot sets (a scope too small for them drawn whole), so the page needs no event kept either.

The histograms are exact after the one pass, so when the pilot misled (a statistic outside what was
gathered) or the sums would lose precision (a near-constant metric), one more pass (over the batches read
again, or the chunks kept) gathers exactly the wanted buckets and the moments about each cell's mean.

The per-token samples of a request are ``gap / tokens`` repeated ``tokens`` times (``stats.itl_samples``);
here each event stands for its repeats with a weight, so a percentile is the same order statistic of the same
multiset as numpy.percentile over the materialised samples, to the last bit (tests/test_big_runs.py). Means
and standard deviations agree with numpy's to ~1e-12.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loadlab.analysis.stats import Events, lerp, linear_positions
from loadlab.records import in_background, in_order, side_by_side

# A batch of records' per-event columns: receipt times (ms), each record's number of them, tokens per event,
# each record's number of them (``records.event_batches``).
EventBatch = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]

ITL_METRICS = ("itl_ms", "itl_per_event_ms")
PLOT_SAMPLES = 200_000  # a CDF line is drawn through at most this many samples (report.html)
_WEIGHTED = {"itl_ms": True, "itl_per_event_ms": False}  # per token: each event weighted by its tokens


@dataclass
class _Chunk:
    """One batch's token-carrying events as the gaps between them, in place: entry j is the gap before the
    batch's event j + 1 (its records' events one after another) and that event's tokens. Where event j + 1 is
    a record's first (``bounds``), the entry is 0 and no gap of any record: the scan gives it no scope's cell
    (a later event's gaps are not copied out of the others: a million records' ~100M events, a copy each
    batch, cost more than all the rest of cleaning)."""

    row0: int  # the batch's first record in the run
    rows: int
    gaps: np.ndarray  # float64 ms
    tok: np.ndarray  # the narrowest unsigned type that holds them
    lengths: np.ndarray  # each record's events
    bounds: np.ndarray  # the entries before a record's first event
    later: np.ndarray  # each record's number of later events (all but its first)
    with_later: np.ndarray  # the records (in the chunk) that have any, and the entry of their first gap
    starts: np.ndarray
    ms: np.ndarray | None = None  # every kept event's receipt time and tokens (a timeline, keep_times)
    all_tok: np.ndarray | None = None

    def valid(self, rows: np.ndarray | None = None) -> np.ndarray:
        """The entries that are some record's gap (of the records ``rows``, a mask over the run's, selects)."""
        keep = np.ones(self.gaps.size, dtype=bool)
        keep[self.bounds] = False
        if rows is not None:
            keep &= np.repeat(np.asarray(rows, dtype=bool)[self.row0 : self.row0 + self.rows], self.lengths)[
                1:
            ]
        return keep


@dataclass
class _Cleaned:
    """A batch read and cleaned ahead (the pilot's), with its records' arrays."""

    chunk: _Chunk
    rows: tuple[np.ndarray, ...] | None  # None: a chunk kept from a reading


@dataclass
class EventSource:
    """Batches of whole records in the run's order that can be read again (a file's row groups, a table's
    batches, chunks kept from a reading): each batch's number of records, and ``read(which)`` giving the
    batches at the indices ``which`` (None: all) in order. ``start_pilot``: the pilot's batches (every few,
    ``scan_events``) read and cleaned in a native thread while the caller does something else."""

    sizes: list[int]
    read: Callable[[Sequence[int] | None], Iterable[Any]]
    _pilot: Any = None

    @classmethod
    def of(cls, batches: Iterable[EventBatch | _Chunk]) -> EventSource:
        held = list(batches)
        sizes = [b.rows if isinstance(b, _Chunk) else len(b[1]) for b in held]
        return cls(sizes, lambda which=None: held if which is None else [held[i] for i in which])

    def numbered(self, which: Sequence[int] | None = None) -> Iterator[tuple[int, Any]]:
        """The batches ``which`` selects, each with its first record's place in the run."""
        row0 = self._row0()
        at = range(len(self.sizes)) if which is None else which
        return zip((row0[i] for i in at), self.read(which), strict=True)

    def _row0(self) -> list[int]:
        return np.concatenate([[0], np.cumsum(self.sizes, dtype=np.int64)]).tolist()

    def pilot_indices(self) -> list[int]:
        n = len(self.sizes)
        return list(range(0, n, n // _PILOT_CHUNKS)) if n >= _PILOT_MIN else []

    def start_pilot(self) -> None:
        self._pilot = in_background(self._read_pilot)

    def pilot(self) -> dict[int, _Cleaned]:
        """The pilot's batches, cleaned (with their receipt times, for a timeline)."""
        if self._pilot is None:
            self.start_pilot()
        return self._pilot.result()

    def _read_pilot(self) -> dict[int, _Cleaned]:
        which = self.pilot_indices()
        return {
            i: _Cleaned(*_chunk_of(item, True)) for i, item in zip(which, self.numbered(which), strict=True)
        }

    def with_pilot(self) -> Iterator[tuple[int, Any]]:
        """Every batch, each with its first record's place; the pilot's as they were cleaned (not read twice)."""
        pilot = self.pilot()
        rest = iter(self.numbered([i for i in range(len(self.sizes)) if i not in pilot]))
        row0 = self._row0()
        self._pilot = None  # handed over: not held after this pass
        for i in range(len(self.sizes)):
            yield (row0[i], pilot.pop(i)) if i in pilot else next(rest)


@dataclass
class RunEvents:
    """Every record's token-carrying events, cleaned as ``stats.Events`` cleans them.

    Per record (concatenated): ``lengths`` (kept events), ``first_tokens`` (tokens of the first; NaN without
    one), ``token_sum``, ``zero_gaps`` (later events received at the same time as the one before: a read
    that carried several), and the sums of its gaps and squared gaps. Per event, where they were kept
    (``chunks``: ``of_batches``, or a scan that keeps them), the gaps and token counts, chunk by chunk (each
    chunk's laid out in place, ``_Chunk``). ``figures``: each scope's ITL where a scan took them as it read (``scan_events``), by the
    scope's name (None: the run)."""

    chunks: list[_Chunk] = field(default_factory=list)
    lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    first_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0))
    token_sum: np.ndarray = field(default_factory=lambda: np.zeros(0))
    zero_gaps: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    gap_sum: np.ndarray = field(default_factory=lambda: np.zeros(0))  # the sum of a record's gaps
    # Per record, the sums of its gaps' squares, and of each squared gap over its tokens (per-token samples'
    # second moment about 0: tokens x (gap / tokens)^2).
    gap_squares: np.ndarray = field(default_factory=lambda: np.zeros(0))
    gap_squares_per_token: np.ndarray = field(default_factory=lambda: np.zeros(0))
    figures: dict[str | None, dict[str, Pooled]] | None = None
    tokens_per_second: np.ndarray | None = None  # over a scan's timeline (``scan_events``)

    @classmethod
    def of_batches(cls, batches: Iterable[EventBatch], keep_times: bool = False) -> RunEvents:
        """From batches of whole records in the run's order, every chunk kept. ``keep_times``: also keep every
        event's receipt time and tokens (``seconds``: the report's timeline). Batches are cleaned two at a time
        in native threads where there are any (numpy's loops release the GIL), kept in order."""

        def numbered():
            row0 = 0
            for batch in batches:
                yield row0, batch
                row0 += len(batch[1])

        return _read(numbered(), keep=True, keep_times=keep_times).events

    @property
    def rows(self) -> int:
        return int(self.lengths.size)

    @property
    def later(self) -> np.ndarray:
        return np.maximum(self.lengths - 1, 0)

    def seconds(self, timeline: Timeline) -> np.ndarray:
        """Output tokens received in each second of ``timeline``: a scan's count when it took that one, else
        from the chunks kept with their receipt times (``of_batches(keep_times=True)``)."""
        if self.tokens_per_second is not None and self.tokens_per_second.size == timeline[2]:
            return self.tokens_per_second
        return sum((_tokens_per_second(c, *timeline) for c in self.chunks), np.zeros(timeline[2]))

    def pooled(self, rows: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """``stats.pooled_events`` over the records ``rows`` selects, materialised (small runs, tests)."""
        gaps, tok = [], []
        for c in self.chunks:
            keep = c.valid(rows)
            gaps.append(c.gaps[keep])
            tok.append(c.tok[keep])
        g = np.concatenate(gaps) if gaps else np.empty(0)
        t = np.concatenate(tok).astype(np.int64) if tok else np.empty(0, dtype=np.int64)
        sel = slice(None) if rows is None else np.asarray(rows, dtype=bool)
        return {
            "itl_per_token": np.repeat(g / t, t) if g.size else np.empty(0),
            "itl_per_event": g,
            "first_tokens": self.first_tokens[sel],
            "token_sum": self.token_sum[sel],
        }


@dataclass
class _Job:
    """What a pass over batches takes of each: per metric (weighted or not) what ``plan`` says, with the
    ``scan``'s cells; the tokens received in each second of ``timeline`` (each record's send time, the
    origin and the seconds); the scan's plot sample (``sample``)."""

    scan: _Scan | None = None
    plan: dict[bool, _Step] = field(default_factory=dict)
    timeline: Timeline | None = None
    sample: bool = False


# Each record's send time (s), the timeline's origin and its number of seconds (``html.timeline_of``).
Timeline = tuple[np.ndarray, float, int]


@dataclass
class _Read:
    events: RunEvents
    passed: dict[bool, _Passed]
    tokens_per_second: np.ndarray | None
    sample: list[tuple[np.ndarray, np.ndarray, np.ndarray]]


def _read(
    numbered: Iterable[tuple[int, Any]], keep: bool, job: _Job | None = None, keep_times=False
) -> _Read:
    """One pass over batches (each with its first record's place): each cleaned (a chunk kept from before is
    used as it is) and what ``job`` says taken of it, two at a time in native threads; the chunks kept if
    ``keep`` (with their receipt times if ``keep_times``). The records' arrays are those of the batches
    cleaned."""
    job = job or _Job()
    passed = {weighted: _Passed(job.scan.nc, step.counting) for weighted, step in job.plan.items()}
    seconds = np.zeros(job.timeline[2]) if job.timeline is not None else None
    chunks: list[_Chunk] = []
    per_row: list[tuple[np.ndarray, ...]] = []
    sample = []
    work = functools.partial(_work, job=job, keep_times=keep_times, keep=keep)
    for chunk, rows, parts, tokens, drawn in in_order(work, numbered, ahead=8):
        if keep:
            chunks.append(chunk)
        if rows is not None:
            per_row.append(rows)
        for weighted, part in parts.items():
            passed[weighted].add(part)
        if tokens is not None:
            seconds += tokens
        if drawn is not None:
            sample.append(drawn)
    events = RunEvents(chunks, *(np.concatenate(c) for c in zip(*per_row, strict=True))) if per_row else None
    return _Read(events or RunEvents(chunks), passed, seconds, sample)


def _chunk_of(
    numbered: tuple[int, Any], keep_times: bool, transient: bool = False
) -> tuple[_Chunk, tuple[np.ndarray, ...] | None]:
    """A batch's chunk, placed in the run, and its records' arrays (None for a chunk kept from a reading)."""
    row0, batch = numbered
    if isinstance(batch, _Chunk):
        return batch, None
    if isinstance(batch, _Cleaned):
        return batch.chunk, batch.rows
    chunk, rows = _cleaned(batch, keep_times, transient)
    chunk.row0 = row0
    return chunk, rows


def _work(numbered: tuple[int, Any], job: _Job, keep_times: bool, keep: bool):
    # A chunk not kept has its gaps in this thread's buffers, until its next batch.
    chunk, rows = _chunk_of(numbered, keep_times or job.timeline is not None, transient=not keep)
    scan = job.scan
    cell = scan.event_cells(chunk) if scan is not None and (job.plan or job.sample) else None
    parts = scan.parts(chunk, job.plan, cell) if job.plan else {}
    tokens = _tokens_per_second(chunk, *job.timeline) if job.timeline is not None else None
    drawn = scan.sample(chunk, cell) if job.sample else None
    if not keep_times and not isinstance(numbered[1], _Chunk):  # receipt times wanted for this pass only
        chunk.ms = chunk.all_tok = None
    return chunk, rows, parts, tokens, drawn


def _tokens_per_second(c: _Chunk, t_send: np.ndarray, t0: float, span: int) -> np.ndarray:
    """The tokens a chunk's events carried, by the second of the timeline they were received in."""
    if c.ms is None:
        raise ValueError("RunEvents: receipt times were not kept (keep_times=False)")
    ts = np.repeat(t_send[c.row0 : c.row0 + c.lengths.size] - t0, c.lengths)
    sent = np.isfinite(ts)
    at = ((ts + c.ms / 1000.0)[sent]).astype(int)
    return np.bincount(np.clip(at, 0, span - 1), weights=c.all_tok[sent], minlength=span)[:span]


_scratch = threading.local()  # per thread: buffers for a batch's gaps (fresh memory is page faults)


def _buffer(name: str, size: int) -> np.ndarray:
    """This thread's float buffer ``name``, at least ``size`` long (reused from batch to batch)."""
    have = getattr(_scratch, name, None)
    if have is None or have.size < size:
        have = np.empty(_roomy(size))
        setattr(_scratch, name, have)
    return have[:size]


def _roomy(size: int) -> int:
    """A buffer's size for ``size`` with room for the next batches (whose sizes vary a little about it):
    each thread's buffers are made once a pass, not again for each batch a little larger."""
    return max(size + size // 4, 1024)


def _cleaned(
    batch: EventBatch, keep_times: bool, transient: bool = False
) -> tuple[_Chunk, tuple[np.ndarray, ...]]:
    """One batch's chunk (its first record's place left at 0) and its per-record arrays: kept events, first
    tokens, tokens, zero gaps, and the sums of gaps, squared gaps and squared gaps over tokens. ``transient``:
    the chunk's gaps in this thread's buffer (valid until the thread's next batch)."""
    ev = Events(*batch, gaps=False)
    n = max(ev.ms.size - 1, 0)
    gaps = _buffer("gaps", n) if transient else np.empty(n)
    np.subtract(ev.ms[1:], ev.ms[:-1], out=gaps)
    bounds = ev.first[1:] - 1  # the entries before each record's first event
    gaps[bounds] = np.nan  # not a gap: not counted as zero
    zero = np.flatnonzero(gaps == 0.0)
    zero_gaps = np.zeros(ev.rows, dtype=np.int64)
    if zero.size:  # each zero gap's record, in bulk
        np.add.at(zero_gaps, np.searchsorted(np.cumsum(ev.lengths), zero + 1, side="right"), 1)
    gaps[bounds] = 0.0  # adds nothing to the sums below
    later = ev.later
    with_later = np.flatnonzero(later)
    starts = (np.cumsum(ev.lengths) - ev.lengths)[with_later]  # each one's first gap: at its first event
    top = int(ev.tok.max()) if ev.tok.size else 0
    one_each = top <= 1  # a token an event (events without one are gone)
    tok = np.ones(n, dtype=np.uint8) if one_each else _narrow(ev.tok[1:], top)
    gap_sum, squares, per_token = np.zeros(ev.rows), np.zeros(ev.rows), np.zeros(ev.rows)
    if with_later.size:
        gap_sum[with_later] = np.add.reduceat(gaps, starts)
        square = np.multiply(gaps, gaps, out=_buffer("square", n))
        squares[with_later] = np.add.reduceat(square, starts)
        if one_each:  # a squared gap over one token is itself
            per_token[with_later] = squares[with_later]
        else:
            per_token[with_later] = np.add.reduceat(np.divide(square, tok, out=square), starts)
    chunk = _Chunk(0, ev.rows, gaps, tok, ev.lengths, bounds, later, with_later, starts)
    if keep_times:
        chunk.ms, chunk.all_tok = ev.ms, ev.tok
    return chunk, (ev.lengths, ev.first_tokens, ev.token_sum, zero_gaps, gap_sum, squares, per_token)


def _narrow(tok: np.ndarray, top: int) -> np.ndarray:
    """Token counts (at most ``top``) in the narrowest unsigned type that holds them (a byte each, as a
    rule)."""
    for kind in (np.uint8, np.uint16, np.uint32):
        if top <= np.iinfo(kind).max:
            return tok.astype(kind)
    return tok.astype(np.int64)


# ---------------------------------------------------------------------------------------------------
# Figures


@dataclass
class Pooled:
    """A metric's samples over a scope's events, not held one by one: their count, mean, standard deviation
    and the exact percentiles asked for (0 and 100 are the minimum and maximum), and a uniform draw of them
    for a plot (``draw``: from the scan's sample of events)."""

    count: int
    mean: float | None
    std: float | None
    known: dict[float, float]
    _draw: Any = None

    def draw(self, n: int) -> np.ndarray:
        """Up to ``n`` of the samples drawn uniformly (seeded: a report is the same each time it is made)."""
        return self._draw(n) if self._draw is not None and self.count else np.empty(0)


# Level-1 buckets: the bits of a float64 from the sign down to 12 bits of mantissa (4096 buckets a binade),
# over a fixed range, 2^-20 ms to 2^30 ms (values beyond it fall in the end buckets, which the select splits
# like any other): a pass knows its buckets before its first event. A histogram is bucket-major (a bucket's
# cells side by side), so a batch's counts stop at its highest value's bucket.
_SHIFT = 40
_LO = int(np.float64(2.0**-20).view(np.int64)) >> _SHIFT
_HI = int(np.float64(2.0**30).view(np.int64)) >> _SHIFT
_BUCKETS = _HI - _LO + 1
# The per-token pass computes every event's own bucket when more than this share of a batch's events carry
# several tokens; below it, only theirs (the others' are the per-event ones).
_OWN_BUCKETS_ABOVE = 0.2  # measured: equal costs at ~20 % (bench/RESULTS.md, big runs e)
_SORT_MAX = 1 << 15  # a gathered set this small is sorted; larger ones are split by their bits again

# The one-pass scan: a pilot of about this many batches, for scans of at least _PILOT_MIN batches.
_PILOT_CHUNKS = 8
_PILOT_MIN = 16
# Moments from the records' sums are kept when the sum of squares is at most this many times the second
# moment about the mean (a cancellation of at most 4 of the 16 digits); else a pass about the cells' means.
_PRECISION = 1e4


@dataclass
class Scanned:
    """``scan_events``' result: the records' events, each scope's figures (in the scopes' order), and per
    metric whether the one pass sufficed (False: a second pass was needed)."""

    events: RunEvents
    figures: list[dict[str, Pooled]]
    one_pass: dict[str, bool]


def scan_events(
    source: EventSource,
    scopes: Sequence[np.ndarray],
    qs: Sequence[float],
    timeline: Timeline | None = None,
    known: RunEvents | None = None,
) -> Scanned:
    """The records' events read from ``source``, and for each scope (a boolean mask over the records) its
    per-token (``itl_ms``) and per-event (``itl_per_event_ms``) ITL: count, mean, std, the q-th percentiles
    (0..100, numpy's linear method) and a draw for a plot, taken as the batches are read. ``timeline``: also
    the tokens received in each of its seconds (``RunEvents.tokens_per_second``). ``known``: the records'
    events when ``source`` reads their kept chunks (their records' sums are taken from it)."""
    rows = int(sum(source.sizes))
    for mask in scopes:
        if len(mask) != rows:
            raise ValueError(f"scan_events: a scope of {len(mask)} records over {rows} records' events")
    qs = sorted({float(q) for q in (0, 100, *qs)})
    cells, scope_cells = _cells(scopes, rows)
    n_cells = int(cells.max()) + 1 if cells.size and cells.max() >= 0 else 0
    cells[cells < 0] = n_cells  # records in no scope: a cell of their own, never read
    scan = _Scan(cells, n_cells)
    metrics = {metric: _WEIGHTED[metric] for metric in ITL_METRICS}
    # Nothing to scan when no scope has a record: the events are only read.
    job = _Job(scan, {weighted: _Step() for weighted in metrics.values()} if n_cells else {}, timeline)
    batches = len(source.sizes)
    if batches >= _PILOT_MIN and job.plan:  # where each order statistic will lie, from every few batches
        pilot = source.pilot()
        piloted = _read(((c.chunk.row0, c.chunk) for c in pilot.values()), False, _Job(scan, job.plan)).passed
        job.plan = {w: _Step(lut=scan.predicted(piloted[w].histogram(), scope_cells, qs)) for w in job.plan}
        share = sum(c.chunk.rows for c in pilot.values()) / max(rows, 1)
        top = max((int(c.chunk.tok.max()) for c in pilot.values() if c.chunk.tok.size), default=1)
        scan.sampling(piloted[False].histogram(), piloted[True].histogram(), share, scope_cells, top)
        job.sample = True  # else in the second pass, at rates from this pass's counts
    # Few batches: a second pass reads the kept chunks; a source of kept chunks keeps them.
    keep = batches < _PILOT_MIN or known is not None
    everything = source.with_pilot() if batches >= _PILOT_MIN else source.numbered()
    read = _read(everything, keep, job)
    events, passed = read.events if known is None else known, read.passed
    events.tokens_per_second = read.tokens_per_second
    if events.rows != rows:
        raise ValueError(f"scan_events: {events.rows} records' events read, {rows} expected")
    scan.sums(events)
    # The pass's answers where it gathered every wanted bucket and the sums kept their precision; the rest
    # from one more pass: the wanted buckets exactly, the moments about each cell's mean.
    wants, again = {}, {}
    for weighted in job.plan:
        p = passed[weighted]
        p.s1, p.s2, p.count = scan.total, scan.squares[weighted], scan.count[weighted]
        wants[weighted] = _targets(p.histogram(), scope_cells, qs, scan.count[weighted])
        lut = job.plan[weighted].lut
        gathered = lut is not None and all(
            lut[b * scan.nc + cell] for want in wants[weighted] if want is not None
            for b in np.unique(want.at).tolist() for cell in want.cells
        )  # fmt: skip
        precise = not np.any((scan.count[weighted] > 0) & (p.s2 > _PRECISION * np.maximum(p.m2(), 0)))
        if not (gathered and precise):
            again[weighted] = _Step(
                counting=False,
                lut=None if gathered else scan.wanted(wants[weighted]),
                centre=None if precise else p.mean(),
            )
    if again:
        second = EventSource.of(events.chunks) if keep else source
        if not job.sample and job.plan:  # no pilot: the plot sample's rates from the exact counts
            top = max((int(c.tok.max()) for c in events.chunks if c.tok.size), default=1)
            scan.sampling(passed[False].histogram(), passed[True].histogram(), 1.0, scope_cells, top)
        sampled = _read(second.numbered(), False, _Job(scan, again, sample=not job.sample))
        more = sampled.passed
        read.sample += sampled.sample
        for weighted, step in again.items():
            p, q = passed[weighted], more[weighted]
            if step.lut is not None:
                p.gathered = q.gathered
            if step.centre is not None:
                p.s1, p.s2, p.centre = q.s1, q.s2, step.centre
    scan.drawn = read.sample
    figures: list[dict[str, Pooled]] = [{} for _ in scopes]
    answered = side_by_side(  # per event and per token at once (numpy's selections release the GIL)
        [functools.partial(scan.answer, passed[w], wants[w], scope_cells, qs, w) for w in job.plan]
    )
    by_weight = dict(zip(job.plan, answered, strict=True))
    for metric, weighted in metrics.items():
        pooled = by_weight.get(weighted) or [Pooled(0, None, None, {}) for _ in scopes]
        for figure, one in zip(figures, pooled, strict=True):
            figure[metric] = one
    return Scanned(events, figures, {m: w not in again for m, w in metrics.items()})


def itl_figures(
    events: RunEvents, scopes: Sequence[np.ndarray], qs: Sequence[float]
) -> list[dict[str, Pooled]]:
    """``scan_events``' figures over events whose chunks were kept (``RunEvents.of_batches``)."""
    return scan_events(EventSource.of(events.chunks), scopes, qs, known=events).figures


def _cells(scopes: Sequence[np.ndarray], rows: int) -> tuple[np.ndarray, list[list[int]]]:
    """Each record's cell (the records in exactly the same scopes; -1: in none) and each scope's cells."""
    code = np.zeros(rows, dtype=np.int64)
    for i, mask in enumerate(scopes):
        code |= np.asarray(mask, dtype=bool).astype(np.int64) << i
    used = np.unique(code[code != 0])
    cells = np.full(rows, -1, dtype=np.int64)
    if used.size:
        member = code != 0
        cells[member] = np.searchsorted(used, code[member])
    scope_cells = [[j for j, u in enumerate(used.tolist()) if u >> i & 1] for i in range(len(scopes))]
    return cells, scope_cells


@dataclass
class _Step:
    """What a pass takes of a metric: each cell's histogram (``counting``), the events in the buckets
    ``lut`` marks, each cell's first and second moments about ``centre``."""

    counting: bool = True
    lut: np.ndarray | None = None
    centre: np.ndarray | None = None


@dataclass
class _Part:
    """What a pass took of one batch: its histogram (as far as its highest bucket), moments, gathered events."""

    hist: np.ndarray | None = None
    s1: np.ndarray | None = None
    s2: np.ndarray | None = None
    gathered: tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray] | None = None


class _Passed:
    """A pass's sums over its batches (per metric): the histogram, moments about ``centre``, gathered events
    (values, weights, cells, buckets)."""

    def __init__(self, nc: int, counting: bool):
        self.nc = nc
        self.hist = np.zeros(_BUCKETS * nc) if counting else None
        self.s1, self.s2, self.centre = np.zeros(nc), np.zeros(nc), np.zeros(nc)
        self.count: np.ndarray | None = None
        self.gathered: list[tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray]] = []

    def add(self, part: _Part) -> None:
        if part.hist is not None:
            self.hist[: part.hist.size] += part.hist
        if part.s1 is not None:
            self.s1 += part.s1
            self.s2 += part.s2
        if part.gathered is not None:
            self.gathered.append(part.gathered)

    def histogram(self) -> np.ndarray:
        """Per cell (rows), its count in each bucket."""
        return self.hist.reshape(_BUCKETS, self.nc).T

    def shift(self) -> np.ndarray:  # each cell's mean's distance from the centre
        return self.s1 / np.maximum(self.count, 1)

    def m2(self) -> np.ndarray:  # each cell's sum of squared deviations from its mean
        return self.s2 - self.s1 * self.shift()

    def mean(self) -> np.ndarray:
        return self.centre + self.shift()


class _Scan:
    """A scan's cells and, once the events are read, each cell's counts and sums; ``parts`` takes a batch's
    share of a pass in buffers reused from batch to batch (on a VM a fresh gigabyte costs ~1 s of page
    faults: a pass allocates nothing per event)."""

    def __init__(self, cells: np.ndarray, n_cells: int):
        self.cells, self.n_cells, self.nc = cells, n_cells, n_cells + 1
        self.narrow = np.int8 if n_cells < 127 else np.int32
        self.count: dict[bool, np.ndarray] = {}
        self.squares: dict[bool, np.ndarray] = {}
        self.total = np.zeros(self.nc)
        # The plot sample: each cell's rate, each scope's (per metric), the events drawn (gaps, tokens, cells).
        self.rate = np.zeros(self.nc)
        self.scope_rate: dict[tuple[bool, tuple[int, ...]], float] = {}
        self.drawn: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def sampling(
        self, event_hist, token_hist, share: float, scope_cells: list[list[int]], top: int = 1
    ) -> None:
        """The plot sample's rates: every scope's draw of ``PLOT_SAMPLES`` per event and per token (each
        event then kept in proportion to its tokens, at most ``top``), from the events and tokens counted per
        cell in ``share`` of the records (a pilot's; 1: a pass over all of them)."""
        for mine in scope_cells:
            for weighted, hist, per in ((False, event_hist, 1), (True, token_hist, top)):
                seen = float(hist[mine].sum()) / share if mine else 0.0
                rate = min(1.0, (PLOT_SAMPLES * per * 1.2 + 16) / seen) if seen else 1.0
                self.scope_rate[weighted, tuple(mine)] = rate
                self.rate[mine] = np.maximum(self.rate[mine], rate)

    def sample(self, c: _Chunk, cell: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """A chunk's events (``cell``: each one's cell) in the plot sample, each with its cell's rate (seeded
        by the chunk's place: a report is the same each time it is made)."""
        n = c.gaps.size
        if not n or not self.rate.any():
            return None
        rng = np.random.default_rng([c.row0, 7])
        full = self.rate >= 1
        picked = [np.flatnonzero(full[cell])] if full.any() else []  # cells drawn whole
        low = float(self.rate[~full].max()) if (~full).any() else 0.0
        if low > 0:  # the rest: every event at the highest rate (geometric steps), then each at its cell's
            pos = np.cumsum(rng.geometric(low, int(n * low * 1.1) + 64)) - 1
            while pos[-1] < n:
                pos = np.concatenate([pos, pos[-1] + np.cumsum(rng.geometric(low, int(n * low * 0.2) + 64))])
            pos = pos[pos < n]
            pos = pos[~full[cell[pos]]]
            picked.append(pos[rng.random(pos.size) * low < self.rate[cell[pos]]])
        pos = np.sort(np.concatenate(picked)) if picked else np.empty(0, dtype=np.int64)
        return c.gaps[pos], c.tok[pos], cell[pos]

    def sums(self, events: RunEvents) -> None:
        """Per cell, from the records' sums: the events' and tokens' counts, the gaps' sum and squares."""
        minlength = self.nc
        self.total = np.bincount(self.cells, weights=events.gap_sum, minlength=minlength)
        self.squares = {
            False: np.bincount(self.cells, weights=events.gap_squares, minlength=minlength),
            True: np.bincount(self.cells, weights=events.gap_squares_per_token, minlength=minlength),
        }
        later_tokens = np.nan_to_num(events.token_sum - events.first_tokens)
        self.count = {
            False: np.bincount(self.cells, weights=events.later, minlength=minlength),
            True: np.bincount(self.cells, weights=later_tokens, minlength=minlength),
        }

    def values(self, c: _Chunk, weighted: bool, bufs: _Buffers) -> tuple[np.ndarray, np.ndarray | None]:
        """A chunk's values (per token: gap / tokens) and weights."""
        if not weighted:
            return c.gaps, None
        return np.divide(c.gaps, c.tok, out=bufs.value[: c.gaps.size]), c.tok

    def event_cells(self, c: _Chunk) -> np.ndarray:
        """Each entry's cell: its event's record's; an entry before a record's first event none of a scope's."""
        cell = np.repeat(self.cells[c.row0 : c.row0 + c.rows].astype(self.narrow), c.lengths)[1:]
        cell[c.bounds] = self.n_cells
        return cell

    def parts(self, c: _Chunk, plan: dict[bool, _Step], cell: np.ndarray) -> dict[bool, _Part]:
        """A batch's share of a pass (in a worker thread; ``cell``: each event's cell).

        An event of one token has the same value per token as per event, so the per-token histogram and
        gathering reuse the per-event buckets and compute their own only for the events of several tokens
        (all of them, as a rule, when a server sends one token an event)."""
        n = c.gaps.size
        if not n:
            return {}
        bufs = _buffers(n)
        out = {}
        index = self._buckets(c.gaps, cell, bufs.index[:n])
        # Counts up to the highest bucket this batch reaches.
        counts = np.bincount(index) if any(step.counting for step in plan.values()) else None
        for weighted, step in plan.items():
            part = out[weighted] = _Part()
            if step.centre is not None:  # moments about the cells' centres (a second pass)
                value, weight = self.values(c, weighted, bufs)
                self._moments(c, step, part, value, weight, cell, bufs)
            if not weighted:
                at, value_at = index, None
                if step.counting:
                    part.hist = counts
            else:
                several = c.tok > 1
                n_several = int(np.count_nonzero(several))
                value_at = c.tok
                if n_several > _OWN_BUCKETS_ABOVE * n:  # many events of several tokens: each its own bucket
                    value = np.divide(c.gaps, c.tok, out=bufs.value[:n])
                    at = self._buckets(value, cell, bufs.index2[:n])
                    if step.counting:
                        part.hist = np.bincount(at, weights=c.tok)
                elif n_several:  # the few events of several tokens: their own buckets, each token counted
                    multi = np.flatnonzero(several)
                    at = bufs.index2[:n]
                    np.copyto(at, index)
                    own = self._buckets(c.gaps[multi] / c.tok[multi], cell[multi], None)
                    at[multi] = own
                    if step.counting:
                        part.hist = counts.astype(float)
                        part.hist -= np.bincount(index[multi], minlength=part.hist.size)
                        part.hist += np.bincount(own, weights=c.tok[multi], minlength=part.hist.size)
                else:  # one token an event: the per-event buckets and counts
                    at = index
                    if step.counting:
                        part.hist = counts
            if step.lut is not None:
                take = np.flatnonzero(step.lut[at])
                if take.size:
                    tok = None if value_at is None else value_at[take]
                    part.gathered = (
                        c.gaps[take] if tok is None else c.gaps[take] / tok,
                        tok,
                        cell[take].astype(np.int64),
                        at[take] // self.nc,
                    )
        return out

    def _buckets(self, value: np.ndarray, cell: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        """Each value's bucket and cell as one histogram index (bucket-major)."""
        index = np.right_shift(value.view(np.int64), _SHIFT, out=out)
        np.clip(index, _LO, _HI, out=index)
        index -= _LO
        index *= self.nc
        index += cell
        return index

    def _moments(self, c: _Chunk, step: _Step, part: _Part, value, weight, cell, bufs: _Buffers) -> None:
        """Each cell's first and second moments about its centre, per record then per cell."""
        n = c.gaps.size
        rows = self.cells[c.row0 : c.row0 + c.rows][c.with_later]
        d = bufs.scratch[:n]
        np.take(step.centre, cell, out=d)
        np.subtract(value, d, out=d)
        d[c.bounds] = 0.0  # no record's gap
        w_d = d if weight is None else np.multiply(d, weight, out=bufs.value2[:n])
        part.s1 = np.bincount(rows, weights=np.add.reduceat(w_d, c.starts), minlength=self.nc)
        np.multiply(w_d, d, out=d)
        part.s2 = np.bincount(rows, weights=np.add.reduceat(d, c.starts), minlength=self.nc)

    def wanted(self, wants: list[_Target | None]) -> np.ndarray:
        """The buckets (per cell) that hold a wanted order statistic of a scope."""
        lut = np.zeros(_BUCKETS * self.nc, dtype=bool)
        grid = lut.reshape(_BUCKETS, self.nc)
        for want in wants:
            if want is not None:
                for b in np.unique(want.at).tolist():
                    grid[b, want.cells] = True
        return lut

    def predicted(self, pilot_hist: np.ndarray, scope_cells: list[list[int]], qs: list[float]) -> np.ndarray:
        """The buckets where a pilot's histogram says each wanted order statistic lies, with a margin of
        six standard errors of a quantile's rank plus 0.1 % of the ranks either side."""
        lut = np.zeros(_BUCKETS * self.nc, dtype=bool)
        grid = lut.reshape(_BUCKETS, self.nc)
        for mine in scope_cells:
            cum = np.cumsum(pilot_hist[mine].sum(axis=0)) if mine else np.zeros(1)
            if cum[-1] == 0:
                continue
            p = np.array(qs) / 100
            margin = 6 * np.sqrt(p * (1 - p) / cum[-1]) + 0.001
            first = np.searchsorted(cum, np.clip(p - margin, 0, 1) * cum[-1], side="right")
            first[p - margin <= 0] = 0  # the minimum may lie below anything the pilot saw: every bucket up
            last = np.searchsorted(cum, np.clip(p + margin, 0, 1) * cum[-1], side="right")
            last[p + margin >= 1] = _BUCKETS - 1  # and the maximum above it
            for a, b in zip(first.tolist(), np.minimum(last, _BUCKETS - 1).tolist(), strict=True):
                grid[a : b + 1, mine] = True
        return lut

    def answer(self, passed, wants, scope_cells, qs, weighted) -> list[Pooled]:
        """Every scope's figures from a pass that gathered the buckets of every wanted order statistic."""
        count = self.count[weighted]
        passed.count = count
        mean, m2 = passed.mean(), np.maximum(passed.m2(), 0)
        g = passed.gathered
        gv = np.concatenate([x[0] for x in g]) if g else np.empty(0)
        gw = np.concatenate([x[1] for x in g]) if weighted and g else None
        gc = np.concatenate([x[2] for x in g]) if g else np.empty(0, dtype=np.int64)
        gb = np.concatenate([x[3] for x in g]) if g else np.empty(0, dtype=np.int64)
        out = []
        for mine, want in zip(scope_cells, wants, strict=True):
            if want is None:
                out.append(Pooled(0, None, None, {}))
                continue
            member = np.zeros(self.nc, dtype=bool)
            member[mine] = True
            in_scope = member[gc]
            found: dict[int, float] = {}
            for b in np.unique(want.at).tolist():
                sel = in_scope & (gb == b)
                here = want.at == b
                local = (want.ks[here] - want.below[here]).astype(np.int64)
                kth = weighted_kth(gv[sel], None if gw is None else gw[sel], local)
                found.update(zip(want.ks[here].tolist(), kth.tolist(), strict=True))
            lows = np.array([found[k] for k in want.lo.tolist()])
            highs = np.array([found[k] for k in want.hi.tolist()])
            known = dict(zip(qs, lerp(lows, highs, want.gamma).tolist(), strict=True))
            _, mean_all, var = _combined(count[mine], mean[mine], m2[mine])
            out.append(Pooled(want.n, mean_all, math.sqrt(var), known, _Drawer(self, weighted, mine)))
        return out


@dataclass
class _Target:
    cells: list[int]
    n: int
    lo: np.ndarray
    hi: np.ndarray
    gamma: np.ndarray
    ks: np.ndarray  # the order statistics wanted (0-based ranks), their buckets, and the count below each
    at: np.ndarray
    below: np.ndarray


def _targets(hist, scope_cells, qs, count) -> list[_Target | None]:
    """Per scope, the order statistics its percentiles need and the bucket each lies in."""
    out: list[_Target | None] = []
    for mine in scope_cells:
        n = int(round(count[mine].sum())) if mine else 0
        if n == 0:
            out.append(None)
            continue
        cum = np.cumsum(hist[mine].sum(axis=0))
        lo, hi, gamma = linear_positions(n, qs)
        ks = np.unique(np.concatenate([lo, hi]))
        at = np.searchsorted(cum, ks, side="right")
        below = np.where(at > 0, cum[np.maximum(at - 1, 0)], 0)
        out.append(_Target(mine, n, lo, hi, gamma, ks, at, below))
    return out


class _Buffers:
    def __init__(self, size: int):
        self.size = size
        self.value = np.empty(size)
        self.value2 = np.empty(size)
        self.scratch = np.empty(size)
        self.index = np.empty(size, dtype=np.int64)
        self.index2 = np.empty(size, dtype=np.int64)


_thread_buffers = threading.local()


def _buffers(size: int) -> _Buffers:
    """This thread's buffers, at least ``size`` long (reused from batch to batch)."""
    bufs = getattr(_thread_buffers, "bufs", None)
    if bufs is None or bufs.size < size:
        bufs = _thread_buffers.bufs = _Buffers(_roomy(size))
    return bufs


def _combined(count: np.ndarray, mean: np.ndarray, m2: np.ndarray) -> tuple[float, float, float]:
    """Count, mean and (population) variance of the union of cells (Chan et al.'s pairwise combination)."""
    n_all = float(count.sum())
    if n_all == 0:
        return 0.0, math.nan, math.nan
    mean_all = float((count * mean).sum() / n_all)
    var = float((m2.sum() + (count * (mean - mean_all) ** 2).sum()) / n_all)
    return n_all, mean_all, max(var, 0.0)


def _ordered_keys(v: np.ndarray) -> np.ndarray:
    """float64 -> uint64 in the same order: a negative's bits all flipped, a positive's sign bit set."""
    k = v.view(np.uint64)
    sign = np.uint64(1 << 63)
    return np.where(k & sign, ~k, k | sign)


def weighted_kth(values: np.ndarray, weights: np.ndarray | None, ranks: np.ndarray) -> np.ndarray:
    """The ``ranks``-th smallest (0-based) of the multiset where ``values[i]`` appears ``weights[i]`` times
    (once each without weights): a radix select on the values' ordered bits, ~4096 buckets a level, sorting
    only what is left below ``_SORT_MAX`` values."""
    ranks = np.asarray(ranks, dtype=np.int64)
    out = np.empty(ranks.size)
    if values.size <= _SORT_MAX:
        order = np.argsort(values, kind="stable")
        if weights is None:
            out[:] = values[order][ranks]
        else:
            cum = np.cumsum(weights[order], dtype=np.int64)
            out[:] = values[order][np.searchsorted(cum, ranks, side="right")]
        return out
    keys = _ordered_keys(values)
    kmin, kmax = int(keys.min()), int(keys.max())
    if kmin == kmax:  # all equal
        out[:] = values[0]
        return out
    shift = max(0, (kmax - kmin).bit_length() - 12)
    bucket = ((keys - np.uint64(kmin)) >> np.uint64(shift)).astype(np.int64)
    counts = np.bincount(bucket, weights=weights)
    cum = np.cumsum(counts)
    where = np.searchsorted(cum, ranks, side="right")
    for b in np.unique(where).tolist():
        at = where == b
        sel = bucket == b
        base = int(round(cum[b - 1])) if b > 0 else 0
        out[at] = weighted_kth(values[sel], None if weights is None else weights[sel], ranks[at] - base)
    return out


class _Drawer:
    """A uniform draw of a scope's samples for a plot, from the scan's plot sample: its events thinned to the
    scope's rate (uniform over the scope's events), each then kept with a probability proportional to its
    tokens for the per-token samples (uniform over the tokens), seeded."""

    def __init__(self, scan: _Scan, weighted: bool, mine: list[int]):
        self.scan, self.weighted, self.mine = scan, weighted, mine

    def __call__(self, n: int) -> np.ndarray:
        scan, rng = self.scan, np.random.default_rng(0)
        if not scan.drawn:
            return np.empty(0)
        gaps, tok, cell = (np.concatenate(x) for x in zip(*scan.drawn, strict=True))
        member = np.zeros(scan.nc, dtype=bool)
        member[self.mine] = True
        rate = scan.scope_rate[self.weighted, tuple(self.mine)]
        keep = member[cell] & (rng.random(cell.size) * scan.rate[cell] < rate)
        values, weights = gaps[keep], tok[keep]
        if self.weighted and values.size:
            accept = rng.random(values.size) * int(weights.max()) < weights
            values = values[accept] / weights[accept]
        return np.sort(rng.permutation(values)[:n])
