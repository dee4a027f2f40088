"""ITL over a big run's events, exactly, without holding a sample per token (issue 17, part 5).

A million records carry ~100M token-carrying events and ~160M per-token ITL samples: materialising those
samples for the run and again for each SLO class took most of a 45 s summary. Here the events are kept as
each batch's (a Parquet row group's) later-event gaps and token counts (``RunEvents``, with each record's
sums of gaps and squared gaps), and every scope's figures come from passes over them (``itl_figures``):

- a histogram per *cell* (the requests that belong to the same set of scopes: the run and one class, say)
  over buckets of the value's bits (sign, exponent and 12 bits of mantissa, ~0.025 % wide), per event or
  weighted by tokens; a scope's histogram is the sum of its cells';
- the events in the buckets that hold a wanted order statistic, gathered, whose exact values a radix select
  among those few finds (``weighted_kth``).

With 16 chunks or more this is one pass: a pilot of every eighth chunk says where each order statistic will
lie, and the pass gathers those buckets with a margin as it counts; the means and standard deviations come
from the records' sums. When the pilot misled (a statistic outside what was gathered) or the sums would lose
precision (a near-constant metric), two exact passes follow: the counts, then the wanted buckets and the
moments about each cell's exact mean.

The per-token samples of a request are ``gap / tokens`` repeated ``tokens`` times (``stats.itl_samples``);
here each event stands for its repeats with a weight, so a percentile is the same order statistic of the same
multiset as numpy.percentile over the materialised samples, to the last bit (tests/test_big_runs.py). Means
and standard deviations agree with numpy's to ~1e-12.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loadlab.analysis.stats import Events, lerp, linear_positions
from loadlab.records import in_order, side_by_side

# A batch of records' per-event columns: receipt times (ms), each record's number of them, tokens per event,
# each record's number of them (``records.event_batches``).
EventBatch = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]

ITL_METRICS = ("itl_ms", "itl_per_event_ms")


@dataclass
class _Chunk:
    """One batch's later events (every token-carrying event but a request's first)."""

    row0: int  # the batch's first record in the run
    rows: int
    gaps: np.ndarray  # float64 ms, the gap before each later event
    tok: np.ndarray  # the tokens each later event carried (the narrowest unsigned type that holds them)
    later: np.ndarray  # each record's number of later events
    with_later: np.ndarray  # the records (in the chunk) that have any, and where their later events start
    starts: np.ndarray
    ms: np.ndarray | None = None  # every kept event's receipt time and tokens, for the timeline (keep_times)
    all_tok: np.ndarray | None = None
    lengths: np.ndarray | None = None


@dataclass
class RunEvents:
    """Every record's token-carrying events, cleaned as ``stats.Events`` cleans them, one chunk per batch.

    Per record (concatenated): ``lengths`` (kept events), ``first_tokens`` (tokens of the first; NaN without
    one), ``token_sum``, ``zero_gaps`` (later events received at the same time as the one before: a read
    that carried several). Per event only the gaps and token counts of later events, chunk by chunk."""

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

    @classmethod
    def of_batches(cls, batches: Iterable[EventBatch], keep_times: bool = False) -> RunEvents:
        """From batches of whole records in the run's order. ``keep_times``: also keep every event's receipt
        time and tokens (``times``; the report's timeline). Batches are cleaned two at a time in native
        threads where there are any (numpy's loops release the GIL), kept in order."""
        chunks: list[_Chunk] = []
        per_row: list[tuple[np.ndarray, ...]] = []
        row0 = 0
        for chunk, rows in in_order(functools.partial(_cleaned, keep_times=keep_times), batches):
            chunk.row0 = row0
            chunks.append(chunk)
            per_row.append(rows)
            row0 += chunk.rows
        if not per_row:
            return cls()
        return cls(chunks, *(np.concatenate(c) for c in zip(*per_row, strict=True)))

    @property
    def rows(self) -> int:
        return int(self.lengths.size)

    @property
    def later(self) -> np.ndarray:
        return np.maximum(self.lengths - 1, 0)

    def times(self) -> Iterator[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
        """Per chunk (kept with ``keep_times``): its first record, each record's kept events, their receipt
        times and tokens."""
        for c in self.chunks:
            if c.ms is None:
                raise ValueError("RunEvents: receipt times were not kept (keep_times=False)")
            yield c.row0, c.lengths, c.ms, c.all_tok

    def pooled(self, rows: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """``stats.pooled_events`` over the records ``rows`` selects, materialised (small runs, tests)."""
        gaps, tok = [], []
        for c in self.chunks:
            mine = slice(c.row0, c.row0 + c.rows)
            keep = None if rows is None else np.repeat(np.asarray(rows, dtype=bool)[mine], c.later)
            gaps.append(c.gaps if keep is None else c.gaps[keep])
            tok.append(c.tok if keep is None else c.tok[keep])
        g = np.concatenate(gaps) if gaps else np.empty(0)
        t = np.concatenate(tok).astype(np.int64) if tok else np.empty(0, dtype=np.int64)
        sel = slice(None) if rows is None else np.asarray(rows, dtype=bool)
        return {
            "itl_per_token": np.repeat(g / t, t) if g.size else np.empty(0),
            "itl_per_event": g,
            "first_tokens": self.first_tokens[sel],
            "token_sum": self.token_sum[sel],
        }


_scratch = threading.local()  # per thread: the gaps between all of a batch's events (fresh memory is faults)


def _cleaned(batch: EventBatch, keep_times: bool) -> tuple[_Chunk, tuple[np.ndarray, ...]]:
    """One batch's chunk (its first record's place left at 0) and its per-record arrays: kept events, first
    tokens, tokens, zero gaps, and the sums of gaps, squared gaps and squared gaps over tokens."""
    ms, ms_lengths, tok, tok_lengths = batch
    scratch = getattr(_scratch, "array", None)
    if scratch is None or scratch.size < len(ms):
        scratch = _scratch.array = np.empty(len(ms))
    ev = Events(ms, ms_lengths, tok, tok_lengths, scratch)
    later = ev.later
    gaps = ev.gaps
    zero = np.flatnonzero(gaps == 0.0)
    zero_gaps = np.zeros(ev.rows, dtype=np.int64)
    if zero.size:  # each zero gap's record, in bulk
        np.add.at(zero_gaps, np.searchsorted(np.cumsum(later), zero, side="right"), 1)
    with_later = np.flatnonzero(later)
    starts = np.zeros(with_later.size, dtype=np.int64)
    np.cumsum(later[with_later][:-1], out=starts[1:])
    later_tok = _narrow(ev.tok)[ev.later_mask]
    gap_sum, squares, per_token = np.zeros(ev.rows), np.zeros(ev.rows), np.zeros(ev.rows)
    if with_later.size:
        gap_sum[with_later] = np.add.reduceat(gaps, starts)
        square = np.multiply(gaps, gaps, out=scratch[: gaps.size])
        squares[with_later] = np.add.reduceat(square, starts)
        per_token[with_later] = np.add.reduceat(np.divide(square, later_tok, out=square), starts)
    chunk = _Chunk(0, ev.rows, gaps, later_tok, later, with_later, starts)
    if keep_times:
        chunk.ms, chunk.all_tok, chunk.lengths = ev.ms, ev.tok, ev.lengths
    return chunk, (ev.lengths, ev.first_tokens, ev.token_sum, zero_gaps, gap_sum, squares, per_token)


def _narrow(tok: np.ndarray) -> np.ndarray:
    """Token counts in the narrowest unsigned type that holds them (a byte each, as a rule)."""
    top = int(tok.max()) if tok.size else 0
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
    for a plot (``draw``)."""

    count: int
    mean: float | None
    std: float | None
    known: dict[float, float]
    _draw: Any = None

    def draw(self, n: int) -> np.ndarray:
        """Up to ``n`` of the samples drawn uniformly (seeded: a report is the same each time it is made)."""
        return self._draw(n) if self._draw is not None and self.count else np.empty(0)


# Level-1 buckets: the bits of a float64 from the sign down to 12 bits of mantissa (4096 buckets a binade).
_SHIFT = 40
_TINY_KEY = int(np.float64(2.0**-20).view(np.int64))  # ms: below it (zeros, negatives) one bucket
_MAX_BUCKETS = 1 << 18
_SORT_MAX = 1 << 15  # a gathered set this small is sorted; larger ones are split by their bits again


def itl_figures(
    events: RunEvents, scopes: Sequence[np.ndarray], qs: Sequence[float]
) -> list[dict[str, Pooled]]:
    """For each scope (a boolean mask over the records), its per-token (``itl_ms``) and per-event
    (``itl_per_event_ms``) ITL: count, mean, std and the q-th percentiles (0..100, numpy's linear method)."""
    qs = sorted({float(q) for q in (0, 100, *qs)})
    cells, scope_cells = _cells(scopes, events.rows)
    n_cells = int(cells.max()) + 1 if cells.size and cells.max() >= 0 else 0
    cells[cells < 0] = n_cells  # records in no scope: a cell of their own, never read
    scan = _Scan(events, cells, n_cells)
    out: list[dict[str, Pooled]] = [{} for _ in scopes]
    # The two metrics' scans side by side (numpy's element-wise loops run without the GIL).
    scans = [functools.partial(scan.figures, metric == "itl_ms", scope_cells, qs) for metric in ITL_METRICS]
    for metric, figures in zip(ITL_METRICS, side_by_side(scans), strict=True):
        for i, f in enumerate(figures):
            out[i][metric] = f
    return out


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


class _Scan:
    """The passes over the events' chunks, in buffers reused from chunk to chunk (on a VM a fresh gigabyte
    costs ~1 s of page faults: a pass allocates nothing per event)."""

    def __init__(self, events: RunEvents, cells: np.ndarray, n_cells: int):
        self.chunks = [c for c in events.chunks if c.gaps.size]
        self.cells, self.n_cells = cells, n_cells
        self.size = max((c.gaps.size for c in self.chunks), default=0)
        self.one_pass = {False: False, True: False}  # per metric (weighted: per token), how it went
        narrow = np.int8 if n_cells < 127 else np.int32
        self.event_cells = [
            np.repeat(cells[c.row0 : c.row0 + c.rows].astype(narrow), c.later) for c in self.chunks
        ]
        # Bounds of every value (per token: gap / tokens lies between gap / most tokens and gap).
        self.gap_min = min((float(c.gaps.min()) for c in self.chunks), default=0.0)
        self.gap_max = max((float(c.gaps.max()) for c in self.chunks), default=0.0)
        self.tok_max = max((int(c.tok.max()) for c in self.chunks), default=1)
        self.total = np.bincount(cells, weights=events.gap_sum, minlength=n_cells + 1)
        self.squares = {
            False: np.bincount(cells, weights=events.gap_squares, minlength=n_cells + 1),
            True: np.bincount(cells, weights=events.gap_squares_per_token, minlength=n_cells + 1),
        }
        # Per record: its later events' count and tokens (the per-event and per-token counts), per cell.
        later = events.later
        self.count = {
            False: np.bincount(cells, weights=later, minlength=n_cells + 1),
            True: np.bincount(
                cells, weights=np.nan_to_num(events.token_sum - events.first_tokens), minlength=n_cells + 1
            ),
        }

    def buffers(self) -> _Buffers:
        """A pass's buffers: one set per thread, reused from chunk to chunk."""
        return _Buffers(self.size)

    def chunk(
        self, i: int, weighted: bool, bufs: _Buffers
    ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """Chunk ``i``'s values (per token: gap / tokens), weights and each event's cell, in ``bufs``."""
        c = self.chunks[i]
        n = c.gaps.size
        cell = bufs.cell[:n]
        cell[:] = self.event_cells[i]
        if not weighted:
            return c.gaps, None, cell
        value = bufs.value[:n]
        np.divide(c.gaps, c.tok, out=value)
        return value, c.tok, cell

    def figures(self, weighted: bool, scope_cells: list[list[int]], qs: list[float]) -> list[Pooled]:
        n_cells = self.n_cells
        empty = [Pooled(0, None, None, {}) for _ in scope_cells]
        if n_cells == 0 or not self.chunks:
            return empty
        low = self.gap_min / self.tok_max if weighted and self.gap_min > 0 else self.gap_min
        lo_key = max(int(np.float64(low).view(np.int64)), _TINY_KEY) if low > 0 else _TINY_KEY
        hi_key = max(int(np.float64(self.gap_max).view(np.int64)), _TINY_KEY)
        shift = _SHIFT
        while (hi_key >> shift) - (lo_key >> shift) + 1 > _MAX_BUCKETS:
            shift += 1
        buckets = _Buckets(shift, lo_key >> shift, (hi_key >> shift) - (lo_key >> shift) + 1)
        count = self.count[weighted]
        chunks = list(range(len(self.chunks)))
        answer = None
        if len(chunks) >= _PILOT_MIN:
            # One pass: a pilot of every few chunks says where each wanted order statistic will lie, and the
            # pass gathers those buckets (with a margin) as it counts; the moments come from each record's
            # sums (RunEvents). The answer stands if every statistic fell in a gathered bucket and the
            # moments kept their precision.
            pilot = self._pass(chunks[:: len(chunks) // _PILOT_CHUNKS], weighted, buckets)
            lut = self._predicted(pilot.hist, scope_cells, qs, count, buckets)
            scan = self._pass(chunks, weighted, buckets, lut=lut)
            scan.s1, scan.s2 = self.total, self.squares[weighted]
            answer = self._answer(scan, lut, count, np.zeros(n_cells + 1), scope_cells, qs, buckets, weighted)
        self.one_pass[weighted] = answer is not None
        if answer is None:  # two passes: the counts, then exactly the wanted buckets about exact means
            scan = self._pass(chunks, weighted, buckets)
            mean = np.divide(self.total, count, out=np.zeros(n_cells + 1), where=count > 0)
            lut = self._wanted(scan.hist, scope_cells, qs, count, buckets)
            second = self._pass(chunks, weighted, buckets, lut=lut, centre=mean, counting=False)
            second.hist = scan.hist
            answer = self._answer(second, lut, count, mean, scope_cells, qs, buckets, weighted, exact=True)
        return answer

    def _pass(self, chunks, weighted, buckets, lut=None, centre=None, counting=True) -> _Passed:
        """One pass over ``chunks``: each cell's histogram (``counting``), the events in the buckets ``lut``
        marks, and (``centre``) each cell's first and second moments about it."""
        n_cells, slots = self.n_cells, (self.n_cells + 1) * buckets.n
        out = _Passed(np.zeros(slots) if counting else None, np.zeros(n_cells + 1), np.zeros(n_cells + 1))
        bufs = self.buffers()
        for i in chunks:
            c = self.chunks[i]
            value, weight, cell = self.chunk(i, weighted, bufs)
            index = buckets(value, cell, bufs.index[: value.size])
            if counting:
                out.hist += np.bincount(index, weights=weight, minlength=slots)
            if centre is not None:  # moments about the cells' means
                rows = self.cells[c.row0 : c.row0 + c.rows][c.with_later]
                d = bufs.scratch[: value.size]
                np.take(centre, cell, out=d)
                np.subtract(value, d, out=d)
                w_d = d if weight is None else np.multiply(d, weight, out=bufs.value2[: value.size])
                out.s1 += np.bincount(rows, weights=np.add.reduceat(w_d, c.starts), minlength=n_cells + 1)
                np.multiply(w_d, d, out=d)
                out.s2 += np.bincount(rows, weights=np.add.reduceat(d, c.starts), minlength=n_cells + 1)
            if lut is not None:
                take = np.flatnonzero(lut[index])
                if take.size:
                    out.values.append(value[take])
                    out.weights.append(None if weight is None else weight[take])
                    out.cells.append(cell[take])
                    out.buckets.append(index[take] - cell[take] * buckets.n)
        if counting:
            out.hist = out.hist.reshape(n_cells + 1, buckets.n)
        return out

    def _wanted(self, hist, scope_cells, qs, count, buckets) -> np.ndarray:
        """The buckets (per cell) that hold a wanted order statistic of a scope."""
        lut = np.zeros((self.n_cells + 1) * buckets.n, dtype=bool)
        for want in _targets(hist, scope_cells, qs, count):
            if want is not None:
                for b in np.unique(want.at).tolist():
                    lut[np.array(want.cells) * buckets.n + b] = True
        return lut

    def _predicted(self, pilot_hist, scope_cells, qs, count, buckets) -> np.ndarray:
        """The buckets where a pilot's histogram says each wanted order statistic lies, with a margin of
        six standard errors of a quantile's rank plus 0.1 % of the ranks either side."""
        lut = np.zeros((self.n_cells + 1) * buckets.n, dtype=bool)
        for mine in scope_cells:
            n = float(count[mine].sum()) if mine else 0.0
            cum = np.cumsum(pilot_hist[mine].sum(axis=0)) if mine else np.zeros(1)
            if n == 0 or cum[-1] == 0:
                continue
            p = np.array(qs) / 100
            margin = 6 * np.sqrt(p * (1 - p) / cum[-1]) + 0.001
            first = np.searchsorted(cum, np.clip(p - margin, 0, 1) * cum[-1], side="right")
            first[p - margin <= 0] = 0  # the minimum may lie below anything the pilot saw: every bucket up
            last = np.searchsorted(cum, np.clip(p + margin, 0, 1) * cum[-1], side="right")
            last[p + margin >= 1] = buckets.n - 1  # and the maximum above it
            for a, b in zip(first.tolist(), np.minimum(last, buckets.n - 1).tolist(), strict=True):
                for cell in mine:
                    lut[cell * buckets.n + a : cell * buckets.n + b + 1] = True
        return lut

    def _answer(
        self, scan, lut, count, centre, scope_cells, qs, buckets, weighted, exact=False
    ) -> list[Pooled] | None:
        """Every scope's figures from a pass that gathered ``lut``'s buckets; None when a wanted order
        statistic lies outside them or the moments lost their precision (the pilot misled), unless
        ``exact`` (the moments are about the exact means and the buckets are the wanted ones)."""
        wants = _targets(scan.hist, scope_cells, qs, count)
        for want in wants:
            if want is not None and not all(
                lut[cell * buckets.n + b] for b in np.unique(want.at).tolist() for cell in want.cells
            ):
                return None
        safe = np.maximum(count, 1)
        shift = scan.s1 / safe  # the mean's distance from the centre
        m2 = scan.s2 - scan.s1 * shift
        if not exact and np.any((count > 0) & (scan.s2 > _PRECISION * np.maximum(m2, 0))):
            return None
        mean = centre + shift
        gv = np.concatenate(scan.values) if scan.values else np.empty(0)
        gw = np.concatenate(scan.weights) if weighted and scan.weights else None
        gc = np.concatenate(scan.cells) if scan.cells else np.empty(0, dtype=np.int64)
        gb = np.concatenate(scan.buckets) if scan.buckets else np.empty(0, dtype=np.int64)
        out = []
        for mine, want in zip(scope_cells, wants, strict=True):
            if want is None:
                out.append(Pooled(0, None, None, {}))
                continue
            in_scope = np.isin(gc, mine)
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
            _, mean_all, var = _combined(count[mine], mean[mine], np.maximum(m2[mine], 0))
            out.append(Pooled(want.n, mean_all, math.sqrt(var), known, _Drawer(self, weighted, mine)))
        return out


# The one-pass scan: a pilot of about this many chunks, for scans of at least _PILOT_MIN chunks.
_PILOT_CHUNKS = 8
_PILOT_MIN = 16
# Moments about a pilot's mean are kept when the sum of squares is at most this many times the second
# moment about the mean (a cancellation of at most 4 of the 16 digits); else the exact two passes.
_PRECISION = 1e4


@dataclass
class _Passed:
    hist: Any
    s1: np.ndarray
    s2: np.ndarray
    values: list = field(default_factory=list)
    weights: list = field(default_factory=list)
    cells: list = field(default_factory=list)
    buckets: list = field(default_factory=list)


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
        self.value = np.empty(size)
        self.value2 = np.empty(size)
        self.scratch = np.empty(size)
        self.index = np.empty(size, dtype=np.int64)
        self.cell = np.empty(size, dtype=np.int64)


class _Buckets:
    """Each value's level-1 bucket within its cell's row of the histogram."""

    def __init__(self, shift: int, lo: int, n: int):
        self.shift, self.lo, self.n, self.hi = np.int64(shift), np.int64(lo), int(n), np.int64(lo + n - 1)

    def __call__(self, value: np.ndarray, cell: np.ndarray, out: np.ndarray) -> np.ndarray:
        np.right_shift(value.view(np.int64), self.shift, out=out)
        np.clip(out, self.lo, self.hi, out=out)
        out -= self.lo
        out += cell * self.n
        return out


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
    """A uniform draw of a scope's samples for a plot: events drawn uniformly, each kept with a probability
    proportional to its weight (so tokens are drawn uniformly), seeded."""

    def __init__(self, scan: _Scan, weighted: bool, mine: list[int]):
        self.scan, self.weighted, self.mine = scan, weighted, mine

    def __call__(self, n: int) -> np.ndarray:
        rng = np.random.default_rng(0)
        chunks = self.scan.chunks
        top = max((int(c.tok.max()) for c in chunks), default=1) if self.weighted else 1
        # The scope's events, chunk by chunk (its records' later events).
        mine_rows = np.isin(self.scan.cells, self.mine)
        sizes = np.array([int(c.later[mine_rows[c.row0 : c.row0 + c.rows]].sum()) for c in chunks])
        events = int(sizes.sum())
        if not events:
            return np.empty(0)
        tokens = float(self.scan.count[self.weighted][self.mine].sum())
        draws = min(events, int(n * top * events / tokens * 1.2) + 16)
        at = np.sort(rng.integers(0, events, draws)) if draws < events else np.arange(events)
        ends = np.cumsum(sizes)
        bufs = self.scan.buffers()
        picked = []
        for i, (c, end, size) in enumerate(zip(chunks, ends.tolist(), sizes.tolist(), strict=True)):
            local = at[(at >= end - size) & (at < end)] - (end - size)
            if not local.size:
                continue
            value, weight, _ = self.scan.chunk(i, self.weighted, bufs)
            positions = np.flatnonzero(np.repeat(mine_rows[c.row0 : c.row0 + c.rows], c.later))[local]
            if weight is not None and top > 1:
                positions = positions[rng.random(positions.size) * top < weight[positions]]
            picked.append(value[positions].copy())
        drawn = np.concatenate(picked) if picked else np.empty(0)
        return np.sort(rng.permutation(drawn)[:n])
