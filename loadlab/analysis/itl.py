"""ITL over a big run's events, exactly, without holding a sample per token (issue 17, part 5).

A million records carry ~100M token-carrying events and ~160M per-token ITL samples: materialising those
samples for the run and again for each SLO class took most of a 45 s summary. Here the events are kept as
each batch's (a Parquet row group's) later-event gaps and token counts (``RunEvents``), and every scope's
figures come from two passes over them (``itl_figures``):

1. one histogram per *cell* (the requests that belong to the same set of scopes: the run and one class, say)
   over buckets of the value's bits (sign, exponent and 12 bits of mantissa, ~0.025 % wide), per event and
   weighted by tokens, plus each cell's sums; a scope's histogram is the sum of its cells';
2. one gather of the events in the buckets that hold a wanted order statistic, whose exact value a radix
   select among the few gathered finds (``weighted_kth``).

The per-token samples of a request are ``gap / tokens`` repeated ``tokens`` times (``stats.itl_samples``);
here each event stands for its repeats with a weight, so a percentile is the same order statistic of the same
multiset as numpy.percentile over the materialised samples, to the last bit (tests/test_big_runs.py). Means
and standard deviations are sums per request, then per cell (Chan's combination across cells), equal to
numpy's to ~1e-12.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loadlab.analysis.stats import Events, lerp, linear_positions

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

    @classmethod
    def of_batches(cls, batches: Iterable[EventBatch], keep_times: bool = False) -> RunEvents:
        """From batches of whole records in the run's order. ``keep_times``: also keep every event's receipt
        time and tokens (``times``; the report's timeline)."""
        chunks: list[_Chunk] = []
        per_row: list[tuple[np.ndarray, ...]] = []
        row0 = 0
        for ms, ms_lengths, tok, tok_lengths in batches:
            ev = Events(ms, ms_lengths, tok, tok_lengths)
            later = ev.later
            gaps = ev.gaps
            zero = np.flatnonzero(gaps == 0.0)
            zero_gaps = np.zeros(ev.rows, dtype=np.int64)
            if zero.size:  # each zero gap's record, in bulk
                np.add.at(zero_gaps, np.searchsorted(np.cumsum(later), zero, side="right"), 1)
            chunk = _Chunk(row0, ev.rows, gaps, _narrow(ev.later_tok), later)
            if keep_times:
                chunk.ms, chunk.all_tok, chunk.lengths = ev.ms, ev.tok, ev.lengths
            chunks.append(chunk)
            per_row.append((ev.lengths, ev.first_tokens, ev.token_sum, zero_gaps))
            row0 += ev.rows
        if not per_row:
            return cls()
        lengths, first_tokens, token_sum, zero_gaps = (np.concatenate(c) for c in zip(*per_row, strict=True))
        return cls(chunks, lengths, first_tokens, token_sum, zero_gaps)

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
    chunks = [c for c in events.chunks if c.gaps.size]
    out: list[dict[str, Pooled]] = [{} for _ in scopes]
    per_event = [np.repeat(cells[c.row0 : c.row0 + c.rows], c.later) for c in chunks]
    for metric in ITL_METRICS:
        weighted = metric == "itl_ms"
        values = [c.gaps / c.tok if weighted else c.gaps for c in chunks]
        weights = [c.tok for c in chunks] if weighted else [None] * len(chunks)
        figures = _scope_figures(values, weights, per_event, n_cells, scope_cells, qs)
        for i, f in enumerate(figures):
            out[i][metric] = f
    return out


def _cells(scopes: Sequence[np.ndarray], rows: int) -> tuple[np.ndarray, list[list[int]]]:
    """Each record's cell (the records in exactly the same scopes; -1: in none) and each scope's cells."""
    code = np.zeros(rows, dtype=np.int64)
    for i, mask in enumerate(scopes):
        code |= np.asarray(mask, dtype=bool).astype(np.int64) << i
    used = np.unique(code[code != 0])
    cells = np.full(rows, -1, dtype=np.int16)
    if used.size:
        member = code != 0
        cells[member] = np.searchsorted(used, code[member]).astype(np.int16)
    scope_cells = [[j for j, u in enumerate(used.tolist()) if u >> i & 1] for i in range(len(scopes))]
    return cells, scope_cells


def _scope_figures(values, weights, cells, n_cells, scope_cells, qs) -> list[Pooled]:
    """Pass 1 (histograms and sums per cell), then the wanted order statistics of every scope (pass 2)."""
    empty = [Pooled(0, None, None, {}) for _ in scope_cells]
    if n_cells == 0 or not values:
        return empty
    lo_key, hi_key = math.inf, -math.inf
    for v in values:
        if v.size:
            lo_key = min(lo_key, int(v.min().view(np.int64)) if v.min() > 0 else 0)
            hi_key = max(hi_key, int(v.max().view(np.int64)) if v.max() > 0 else 0)
    shift = _SHIFT
    while (max(hi_key, _TINY_KEY) >> shift) - (max(lo_key, _TINY_KEY) >> shift) + 1 > _MAX_BUCKETS:
        shift += 1
    lo_bucket = max(lo_key, _TINY_KEY) >> shift
    n_buckets = (max(hi_key, _TINY_KEY) >> shift) - lo_bucket + 1
    slots = (n_cells + 1) * n_buckets  # the last cell: records in no scope
    hist = np.zeros(slots)
    count = np.zeros(n_cells + 1)
    total = np.zeros(n_cells + 1)
    bucket_of = _Buckets(shift, lo_bucket, n_buckets)
    for v, w, cell in zip(values, weights, cells, strict=True):
        idx = bucket_of(v, cell)
        hist += np.bincount(idx, weights=w, minlength=slots)
        count += np.bincount(cell, weights=w, minlength=n_cells + 1)
        total += np.bincount(cell, weights=v if w is None else v * w, minlength=n_cells + 1)
    hist = hist.reshape(n_cells + 1, n_buckets)
    mean_cell = np.divide(total, count, out=np.zeros_like(total), where=count > 0)
    # Second moments about each cell's own mean (no cancellation), in the gather pass below.
    m2 = np.zeros(n_cells + 1)

    # The buckets of every wanted order statistic, per scope.
    wants = []  # (scope, q list, ranks (lo, hi), their buckets, counts below each bucket)
    lut = np.zeros((n_cells + 1) * n_buckets, dtype=bool)
    for mine in scope_cells:
        n = int(round(count[mine].sum())) if mine else 0
        if n == 0:
            wants.append(None)
            continue
        cum = np.cumsum(hist[mine].sum(axis=0))
        lo, hi, gamma = linear_positions(n, qs)
        ks = np.unique(np.concatenate([lo, hi]))
        buckets = np.searchsorted(cum, ks, side="right")
        below = np.where(buckets > 0, cum[np.maximum(buckets - 1, 0)], 0)
        for b in np.unique(buckets).tolist():
            for cell in mine:
                lut[cell * n_buckets + b] = True
        wants.append((mine, n, lo, hi, gamma, ks, buckets, below))

    gathered_v, gathered_w, gathered_cell, gathered_bucket = [], [], [], []
    for v, w, cell in zip(values, weights, cells, strict=True):
        idx = bucket_of(v, cell)
        d = v - mean_cell[cell]
        m2 += np.bincount(cell, weights=d * d if w is None else d * d * w, minlength=n_cells + 1)
        take = np.flatnonzero(lut[idx])
        if take.size:
            gathered_v.append(v[take])
            gathered_w.append(None if w is None else w[take])
            gathered_cell.append(cell[take])
            gathered_bucket.append(idx[take] - cell[take].astype(np.int64) * n_buckets)
    gv = np.concatenate(gathered_v) if gathered_v else np.empty(0)
    gw = None if weights[0] is None else (np.concatenate(gathered_w) if gathered_w else np.empty(0))
    gc = np.concatenate(gathered_cell) if gathered_cell else np.empty(0, dtype=np.int64)
    gb = np.concatenate(gathered_bucket) if gathered_bucket else np.empty(0, dtype=np.int64)

    out = []
    for s, want in enumerate(wants):
        if want is None:
            out.append(empty[s])
            continue
        mine, n, lo, hi, gamma, ks, buckets, below = want
        in_scope = np.isin(gc, mine)
        values_at = {}
        for b in np.unique(buckets).tolist():
            sel = in_scope & (gb == b)
            at = buckets == b
            local = (ks[at] - below[at]).astype(np.int64)
            found = weighted_kth(gv[sel], None if gw is None else gw[sel], local)
            values_at.update(zip(ks[at].tolist(), found.tolist(), strict=True))
        lows = np.array([values_at[k] for k in lo.tolist()])
        highs = np.array([values_at[k] for k in hi.tolist()])
        known = dict(zip(qs, lerp(lows, highs, gamma).tolist(), strict=True))
        cnt, mean, var = _combined(count[mine], mean_cell[mine], m2[mine])
        out.append(Pooled(n, mean, math.sqrt(var), known, _Drawer(values, weights, cells, mine)))
    return out


class _Buckets:
    """Each value's level-1 bucket within its cell's row of the histogram."""

    def __init__(self, shift: int, lo: int, n: int):
        self.shift, self.lo, self.n, self.hi = (
            np.int64(shift),
            np.int64(lo),
            np.int64(n),
            np.int64(lo + n - 1),
        )

    def __call__(self, v: np.ndarray, cell: np.ndarray) -> np.ndarray:
        b = np.right_shift(v.view(np.int64), self.shift)
        np.clip(b, self.lo, self.hi, out=b)
        b += cell.astype(np.int64) * self.n - self.lo
        return b


def _combined(count: np.ndarray, mean: np.ndarray, m2: np.ndarray) -> tuple[float, float, float]:
    """Count, mean and (population) variance of the union of cells (Chan et al.'s pairwise combination)."""
    n_all = float(count.sum())
    if n_all == 0:
        return 0.0, math.nan, math.nan
    mean_all = float((count * mean).sum() / n_all)
    var = float((m2.sum() + (count * (mean - mean_all) ** 2).sum()) / n_all)
    return n_all, mean_all, max(var, 0.0)


def _ordered_keys(v: np.ndarray) -> np.ndarray:
    """float64 -> int64 in the same order (negatives' bits flipped)."""
    k = v.view(np.int64)
    return np.where(k < 0, k ^ np.int64(0x7FFFFFFFFFFFFFFF), k)


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
    bucket = (keys - kmin) >> shift
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

    def __init__(self, values, weights, cells, mine):
        self.values, self.weights, self.cells, self.mine = values, weights, cells, mine

    def __call__(self, n: int) -> np.ndarray:
        rng = np.random.default_rng(0)
        chosen = [np.flatnonzero(np.isin(c, self.mine)) for c in self.cells]
        sizes = np.array([c.size for c in chosen])
        top = max((int(w.max()) for w in self.weights if w is not None and w.size), default=1)
        mean = (
            sum(float(w[c].sum()) for w, c in zip(self.weights, chosen, strict=True)) / sizes.sum()
            if top > 1
            else 1.0
        )
        draws = min(int(sizes.sum()), int(n * top / mean * 1.2) + 16)
        at = np.sort(rng.integers(0, sizes.sum(), draws))
        ends = np.cumsum(sizes)
        picked = []
        for i, (v, w, c) in enumerate(zip(self.values, self.weights, chosen, strict=True)):
            start = ends[i] - sizes[i]
            local = at[(at >= start) & (at < ends[i])] - start
            if not local.size:
                continue
            rows = c[local]
            if w is not None and top > 1:
                rows = rows[rng.random(rows.size) * top < w[rows]]
            picked.append(v[rows])
        drawn = np.concatenate(picked) if picked else np.empty(0)
        return np.sort(rng.permutation(drawn)[:n])
