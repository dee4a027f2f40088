"""The numeric definitions every loadlab figure uses, with numpy only (no pandas): percentiles, per-request
latency samples (TTFT, TPOT, ITL, E2E), SLO objectives. The post-processor (``metrics.py``) and the live
figures on a Locust master (``loadlab.swarm.live``) both call these, so a live figure over the same
records is the same number as summary.json's, bit for bit. Definitions: docs/metrics.md.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

# SLO keys in the profile: "<metric>_p<percentile>_ms" -> the latency metric they bound.
SLO_METRICS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "itl": "itl_ms", "e2e": "e2e_latency_ms"}
_SLO_KEY = re.compile(r"^(ttft|tpot|itl|e2e)_p(\d+(?:\.\d+)?)_ms$")


# ---------------------------------------------------------------------------------------------------
# Percentiles: numpy.percentile's linear method, from order statistics


def linear_positions(n: int, qs: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where the q-th percentiles (0..100) of ``n`` sorted samples lie: the positions below and above each
    and the weight between them, as numpy.percentile's default (linear, Hyndman & Fan 7) computes them."""
    q = np.true_divide(np.asarray(qs, dtype=float), 100)
    virtual = (n - 1) * q
    below = np.floor(virtual)
    gamma = virtual - below
    lo = below.astype(np.intp)
    hi = lo + 1
    top = virtual >= n - 1
    lo[top] = hi[top] = n - 1  # the maximum: numpy's weight there is moot, both bounds are the same sample
    return lo, hi, gamma


def lerp(a: np.ndarray, b: np.ndarray, gamma: np.ndarray) -> np.ndarray:
    """numpy.percentile's interpolation between the bounding samples (from the nearer end, as numpy does,
    so the result is the same to the last bit)."""
    diff = b - a
    return np.where(gamma >= 0.5, b - diff * (1 - gamma), a + diff * gamma)


def quantiles(samples: Any, qs: Any) -> np.ndarray | None:
    """The exact q-th percentiles (0..100) of the finite samples; None without any. Equal to
    ``numpy.percentile(samples, qs, method="linear")`` (tests/test_live.py checks it bit for bit)."""
    arr = np.asarray(samples, dtype=float).ravel()
    finite = np.isfinite(arr)
    return finite_quantiles(arr if finite.all() else arr[finite], qs)


def finite_quantiles(arr: np.ndarray, qs: Any) -> np.ndarray | None:
    """``quantiles`` of a 1-d float array whose samples are all finite (left as it is)."""
    if arr.size == 0:
        return None
    lo, hi, gamma = linear_positions(arr.size, qs)
    ks = np.unique(np.concatenate([lo, hi]))
    values = dict(zip(ks.tolist(), order_statistics(arr, ks).tolist(), strict=True))
    return lerp(np.array([values[k] for k in lo.tolist()]), np.array([values[k] for k in hi.tolist()]), gamma)


# Above this many samples order statistics are found by bracketing (a sorted subsample says where each
# lies; one pass counts below and gathers the few in between); below it np.partition on a copy is faster.
BRACKET_MIN = 1 << 22
_SUBSAMPLE = 1 << 16
_TAIL_FROM = 0.75  # order statistics above this fraction share one bracket up to the maximum


def order_statistics(arr: np.ndarray, ks: np.ndarray) -> np.ndarray:
    """The ``ks``-th smallest (0-based, sorted, distinct) of ``arr`` (finite, not changed): exactly what
    sorting it would put there.

    A large array is not copied whole: a sorted strided subsample brackets each order statistic (six
    standard deviations of its rank either side), one pass per bracket counts the samples below it and
    gathers those inside, and np.partition finds the statistic among them. A bracket the data do not
    bear out (the count below it is off) falls back to partitioning a copy, so the result never depends
    on the subsample."""
    ks = np.asarray(ks, dtype=np.intp)
    n = arr.size
    if n < BRACKET_MIN:
        part = arr.copy()
        part.partition(ks)
        return part[ks]
    step = max(1, n // _SUBSAMPLE)
    sample = np.sort(arr[::step])
    m = sample.size
    brackets: list[list[Any]] = []  # [low value or None, high value or None, [ks]]
    for k in ks.tolist():
        p = k / (n - 1)
        r = p * (m - 1)
        margin = 6.0 * math.sqrt(m * p * (1 - p)) + 8.0
        low_rank = math.floor(r - margin)
        high_rank = math.ceil(r + margin)
        low = float(sample[low_rank]) if low_rank >= 0 else None
        high = float(sample[high_rank]) if high_rank < m and p < _TAIL_FROM else None
        if brackets and (
            brackets[-1][1] is None or low is None or low <= brackets[-1][1]
        ):  # overlaps the previous one: one bracket
            last = brackets[-1]
            last[1] = None if (high is None or last[1] is None) else max(last[1], high)
            last[2].append(k)
        else:
            brackets.append([low, high, [k]])
    out = {}
    for low, high, mine in brackets:
        if low is None and high is None:
            inside, below = arr.copy(), 0
        elif low is None:
            inside, below = arr[arr <= high], 0
        else:
            at_least = arr >= low
            below = n - int(np.count_nonzero(at_least))
            inside = arr[at_least & (arr <= high)] if high is not None else arr[at_least]
            del at_least
        local = np.array(mine, dtype=np.intp) - below
        if local.min() < 0 or local.max() >= inside.size:  # the subsample misled: the sure way
            part = arr.copy()
            part.partition(ks)
            return part[ks]
        inside.partition(local)
        out.update(zip(mine, inside[local].tolist(), strict=True))
    return np.array([out[k] for k in ks.tolist()])


def percentile(samples: Any, q: float) -> float | None:
    """The exact q-th percentile (0..100) with linear interpolation; None without samples."""
    values = quantiles(samples, [q])
    return None if values is None else float(values[0])


class SortedSamples:
    """A growing multiset of samples whose percentiles cost O(log n), not O(n): a large sorted array and a
    small one that new samples merge into, folded into the large one when it grows past a fraction of it
    (each sample is copied O(1) times on average). For the live figures, refreshed every 2 s.

    ``add`` takes ``run``, how to run a merge (``run(merge, a, b)``): a merge of millions of samples takes
    ~100 ms in which numpy releases the GIL, so a gevent process runs it in a native thread and its event
    loop goes on; None runs it here."""

    FOLD_FRACTION = 8  # the small array is folded in once it holds more than 1/8 of the large one
    FOLD_MIN = 4096
    INLINE_MAX = 65536  # merges up to this many samples are not worth a thread

    def __init__(self) -> None:
        self.large = np.empty(0)
        self.small = np.empty(0)
        self.total = 0.0  # the samples' sum (a Prometheus histogram's _sum)

    def __len__(self) -> int:
        return self.large.size + self.small.size

    def add(self, values: Any, run: Callable[..., np.ndarray] | None = None) -> None:
        new = np.asarray(values, dtype=float).ravel()
        new = np.sort(new[np.isfinite(new)])
        if new.size == 0:
            return
        self.total += float(new.sum())
        self.small = self._merged(self.small, new, run)
        if self.small.size > max(self.large.size // self.FOLD_FRACTION, self.FOLD_MIN):
            # One assignment after the merge: a reader in between sees the old arrays, never half of it.
            self.large, self.small = self._merged(self.large, self.small, run), np.empty(0)

    def copies(self, n: int) -> int:
        """How many samples adding ``n`` copies (the merge into the small array, and the fold it may
        trigger)."""
        small = self.small.size + n
        folds = small > max(self.large.size // self.FOLD_FRACTION, self.FOLD_MIN)
        return small + (self.large.size + small if folds else 0)

    def _merged(self, a: np.ndarray, b: np.ndarray, run: Callable[..., np.ndarray] | None) -> np.ndarray:
        if run is None or a.size + b.size <= self.INLINE_MAX:
            return merge_sorted(a, b)
        return run(merge_sorted, a, b)

    def kths(self, ks: Any) -> np.ndarray:
        """The k-th smallest samples (0-based) of the union of the two sorted arrays: for each k a binary
        search for how many of the k+1 smallest come from the large array. (A loop over scalars: ~20
        times faster than the same search vectorised, for the handful of k a refresh asks.)"""
        a, b = self.large, self.small
        ks = np.asarray(ks, dtype=np.intp)
        if b.size == 0:
            return a[ks]
        if a.size == 0:
            return b[ks]
        out = np.empty(ks.size)
        for n, k in enumerate(ks.tolist()):
            lo, hi = max(0, k + 1 - b.size), min(k + 1, a.size)
            while lo < hi:
                i = (lo + hi) // 2
                if b[k - i] > a[i]:  # taking i from a and k+1-i from b leaves a's next one out: take more
                    lo = i + 1
                else:
                    hi = i
            j = k + 1 - lo
            out[n] = max(a[lo - 1] if lo > 0 else -math.inf, b[j - 1] if j > 0 else -math.inf)
        return out

    def quantiles(self, qs: Any) -> np.ndarray | None:
        """The same figures as ``quantiles`` over the same samples; None without any."""
        n = len(self)
        if n == 0:
            return None
        lo, hi, gamma = linear_positions(n, qs)
        bounds = self.kths(np.concatenate([lo, hi]))
        return lerp(bounds[: lo.size], bounds[lo.size :], gamma)

    def percentile(self, q: float) -> float | None:
        values = self.quantiles([q])
        return None if values is None else float(values[0])

    def count_at_most(self, bounds: Any) -> np.ndarray:
        """How many samples are <= each bound (a Prometheus histogram's cumulative buckets)."""
        bounds = np.asarray(bounds, dtype=float)
        return np.searchsorted(self.large, bounds, side="right") + np.searchsorted(
            self.small, bounds, side="right"
        )


def merge_sorted(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Two sorted arrays as one sorted array, in O(len(a) + len(b))."""
    if a.size == 0:
        return b
    return np.insert(a, np.searchsorted(a, b, side="right"), b)


# ---------------------------------------------------------------------------------------------------
# Per-request samples


def as_array(value: Any) -> np.ndarray:
    """A record's list column as a float array: accepts lists, numpy arrays (Parquet), None and NaN."""
    if value is None:
        return np.empty(0)
    if isinstance(value, float) and math.isnan(value):
        return np.empty(0)
    try:
        arr = np.asarray(value, dtype=float).ravel()
    except (TypeError, ValueError):
        return np.empty(0)
    return arr


def token_events(arrival_ms: Any, arrival_tokens: Any) -> tuple[np.ndarray, np.ndarray]:
    """The token-carrying events of one request as (offset ms, tokens). Events carrying no token are
    dropped; a missing token list counts one token per event."""
    ms = as_array(arrival_ms)
    tok = as_array(arrival_tokens)
    if tok.size == 0:
        tok = np.ones(ms.size)
    n = min(ms.size, tok.size)
    ms, tok = ms[:n], np.rint(tok[:n])
    keep = np.isfinite(ms) & np.isfinite(tok) & (tok > 0)
    return ms[keep], tok[keep].astype(np.int64)


def itl_samples(arrival_ms: Any, arrival_tokens: Any) -> tuple[np.ndarray, np.ndarray]:
    """One request's ITL samples: (per token, per event).

    For consecutive token-carrying events j-1, j the gap is arrival_ms[j] - arrival_ms[j-1]; event j
    contributes gap / tokens[j], repeated tokens[j] times, to the per-token samples (bench_serving's
    native backend), and the raw gap once to the per-event samples (its OpenAI backends).
    """
    return itl_from_events(*token_events(arrival_ms, arrival_tokens))


def itl_from_events(ms: np.ndarray, tok: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``itl_samples`` on events already cleaned by ``token_events``."""
    if ms.size < 2:
        return np.empty(0), np.empty(0)
    gaps = np.diff(ms)
    per_token = np.repeat(gaps / tok[1:], tok[1:])
    return per_token, gaps


def pooled_events(arrival_ms: list[Any], arrival_tokens: list[Any]) -> dict[str, np.ndarray]:
    """``itl_samples`` and ``token_events`` over many requests at once, vectorised.

    Returns the pooled ITL samples (``itl_per_token``, ``itl_per_event``) and, per request,
    ``first_tokens`` (tokens in the first token-carrying event; NaN without one) and ``token_sum``.
    """
    return Events.of_lists(arrival_ms, arrival_tokens).pooled()


class Events:
    """The token-carrying events of many requests, flat: every request's receipt times one after the other
    (``ms``), the tokens each carried (``tok``) and each request's number of them (``lengths``), cleaned as
    ``token_events`` cleans one request's (a request without token counts counts one per event, a ragged
    pair is cut to the shorter, events without a token or a finite time are dropped), in numpy's bulk
    operations: a million requests' events cost no Python per request.

    ``pooled(rows)`` is ``pooled_events`` over the requests ``rows`` selects, bit for bit (the same
    samples in the same order)."""

    def __init__(self, ms: Any, ms_lengths: Any, tok: Any, tok_lengths: Any, gaps: bool = True):
        """``gaps``: also each later event's gap and tokens (``gaps``, ``later_mask``; a caller that lays out
        the gaps its own way, ``itl``'s scan, goes without). ``first``: each request's first event, where it
        has one."""
        ms = np.asarray(ms, dtype=float)
        ms_lengths = np.asarray(ms_lengths, dtype=np.int64)
        tok = np.asarray(tok)
        tok_lengths = np.asarray(tok_lengths, dtype=np.int64)
        if tok.dtype.kind not in "iuf":
            tok = tok.astype(float)
        self.rows = ms_lengths.size
        if not np.array_equal(ms_lengths, tok_lengths):
            ms, tok, ms_lengths = _aligned(ms, ms_lengths, tok, tok_lengths)
        if tok.dtype.kind == "f":
            tok = np.rint(tok)
            keep = np.isfinite(ms) & np.isfinite(tok) & (tok > 0)
        elif not ms.size or (math.isfinite(np.add.reduce(ms)) and tok.min() > 0):
            keep = None  # every event kept (a finite sum: every time finite), checked without a mask
        else:
            keep = np.isfinite(ms) & (tok > 0)
        lengths = ms_lengths
        if keep is not None and not keep.all():
            lengths = np.zeros(self.rows, dtype=np.int64)
            has = ms_lengths > 0
            lengths[has] = np.add.reduceat(keep, _starts(ms_lengths)[has], dtype=np.int64)
            ms, tok = ms[keep], tok[keep]
        del keep
        self.ms, self.tok, self.lengths = ms, tok.astype(np.int64, copy=False), lengths
        nonempty = lengths > 0
        self.first = first = _starts(lengths)[nonempty]
        self.first_tokens = np.full(self.rows, np.nan)
        self.first_tokens[nonempty] = self.tok[first]
        self.token_sum = np.zeros(self.rows)
        if first.size:
            self.token_sum[nonempty] = np.add.reduceat(self.tok, first)
        self.later = np.maximum(lengths - 1, 0)  # each request's later events
        if gaps:
            later = np.ones(ms.size, dtype=bool)
            later[first] = False
            self.later_mask = later  # every event but a request's first
            self.gaps = np.diff(ms)[later[1:]]  # the gap before each later event of its request

    @property
    def later_tok(self) -> np.ndarray:
        """The tokens each later event carried."""
        return self.tok[self.later_mask]

    @classmethod
    def of_lists(cls, arrival_ms: list[Any], arrival_tokens: list[Any]) -> Events:
        """From per-request lists or arrays (records as ``RequestRecord`` or a DataFrame hold them)."""
        return cls(*lists_batch(arrival_ms, arrival_tokens))

    def pooled(self, rows: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """``pooled_events`` over the requests ``rows`` (a boolean mask; None: all) selects."""
        gaps, tok = self.gaps, self.later_tok
        first_tokens, token_sum = self.first_tokens, self.token_sum
        if rows is not None:
            rows = np.asarray(rows, dtype=bool)
            first_tokens, token_sum = first_tokens[rows], token_sum[rows]
            if not rows[self.later > 0].all():
                mine = np.repeat(rows, self.later)
                gaps, tok = gaps[mine], tok[mine]
        return {
            "itl_per_token": np.repeat(gaps / tok, tok) if gaps.size else np.empty(0),
            "itl_per_event": gaps,
            "first_tokens": first_tokens,
            "token_sum": token_sum,
        }


def lists_batch(
    arrival_ms: list[Any], arrival_tokens: list[Any]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per-request lists or arrays of receipt times and tokens as one batch of flat columns: (times, each
    request's number of them, tokens, each request's number of them); None and NaN cells hold none."""
    ms_lengths = np.fromiter((_length(v) for v in arrival_ms), dtype=np.int64, count=len(arrival_ms))
    tok_lengths = np.fromiter((_length(v) for v in arrival_tokens), dtype=np.int64, count=len(arrival_tokens))
    if ms_lengths.size != tok_lengths.size:
        raise ValueError("arrival_ms and arrival_tokens: not the same number of requests")
    return _flatten(arrival_ms, ms_lengths), ms_lengths, _flatten(arrival_tokens, tok_lengths), tok_lengths


def _starts(lengths: np.ndarray) -> np.ndarray:
    starts = np.zeros(lengths.size, dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return starts


def _aligned(ms: np.ndarray, ms_lengths: np.ndarray, tok: np.ndarray, tok_lengths: np.ndarray):
    """Receipt times and tokens of the same length per request, as ``token_events`` pairs them: one token
    per event where a request has no counts, a ragged pair cut to the shorter; the tokens of a request
    without receipt times dropped."""
    keep = np.where(tok_lengths == 0, ms_lengths, np.minimum(ms_lengths, tok_lengths))
    if np.array_equal(keep, ms_lengths):
        ms_sel = None
    else:
        ms_sel = np.arange(ms.size) - np.repeat(_starts(ms_lengths), ms_lengths) < np.repeat(keep, ms_lengths)
    counted = (tok_lengths > 0) & (keep > 0)
    tok_sel = (
        np.arange(tok.size) - np.repeat(_starts(tok_lengths), tok_lengths) < np.repeat(keep, tok_lengths)
    ) & (np.repeat(counted, tok_lengths))
    out_tok = np.ones(int(keep.sum()), dtype=tok.dtype)
    out_tok[np.repeat(counted, keep)] = tok[tok_sel]
    return (ms if ms_sel is None else ms[ms_sel]), out_tok, keep


def _flatten(values: list[Any], lengths: np.ndarray) -> np.ndarray:
    """Per-request lists (JSONL) or arrays (Parquet) as one float array; None and NaN cells hold none."""
    parts = [v for v, n in zip(values, lengths.tolist(), strict=True) if n]
    total = int(lengths.sum())
    if not total:
        return np.empty(0)
    return _concat(parts, total)


def _concat(parts: list[Any], total: int) -> np.ndarray:
    """Concatenates lists (JSONL) and arrays (Parquet) into one float array."""
    if all(isinstance(p, np.ndarray) for p in parts):
        return np.concatenate(parts).astype(float, copy=False)
    return np.fromiter(itertools.chain.from_iterable(parts), dtype=float, count=total)


def _length(value: Any) -> int:
    if value is None or isinstance(value, float):
        return 0
    try:
        return len(value)
    except TypeError:
        return 0


def latency_samples(
    ttft: np.ndarray,
    e2e: np.ndarray,
    output_tokens: np.ndarray,
    arrival_ms: list[Any],
    arrival_tokens: list[Any],
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The latency samples of completed requests (arrays aligned per request; NaN where a record has no
    value) and their output token counts: the server's count, else the tokens the events carried."""
    return samples_of_events(ttft, e2e, output_tokens, pooled_events(arrival_ms, arrival_tokens))


def samples_of_events(
    ttft: np.ndarray, e2e: np.ndarray, output_tokens: np.ndarray, events: dict[str, np.ndarray]
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """``latency_samples`` with the requests' events already pooled (``pooled_events``, ``Events.pooled``)."""
    out = np.where(np.isfinite(output_tokens), output_tokens, events["token_sum"])
    with np.errstate(divide="ignore", invalid="ignore"):
        tpot = (e2e - ttft) / (out - 1)
        tpot = tpot[(out > 1) & np.isfinite(tpot)]
        decode_denominator = out - events["first_tokens"]
        tpot_decode = (e2e - ttft) / decode_denominator
        tpot_decode = tpot_decode[(decode_denominator > 0) & np.isfinite(tpot_decode)]
    samples = {
        "ttft_ms": ttft[np.isfinite(ttft)],
        "tpot_ms": tpot,
        "tpot_decode_ms": tpot_decode,
        "itl_ms": events["itl_per_token"],
        "itl_per_event_ms": events["itl_per_event"],
        "e2e_latency_ms": e2e[np.isfinite(e2e)],
    }
    return samples, out


# ---------------------------------------------------------------------------------------------------
# SLO


def _finite(x: Any) -> bool:
    try:
        return x is not None and math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def slo_objectives(slo: Any) -> tuple[list[tuple[str, float, float, str]], list[str]]:
    """Parses the profile's slo mapping into [(metric, percentile, threshold_ms, key)] and the keys it
    did not understand. Keys look like ttft_p95_ms; null values are unset objectives."""
    objectives, unknown = [], []
    if not isinstance(slo, dict):
        return objectives, unknown
    for key, threshold in slo.items():
        if threshold is None:
            continue
        match = _SLO_KEY.match(str(key))
        if not match or not _finite(threshold):
            unknown.append(str(key))
            continue
        q = float(match.group(2))
        objectives.append(
            (SLO_METRICS[match.group(1)], int(q) if q.is_integer() else q, float(threshold), key)
        )
    order = list(SLO_METRICS.values())
    objectives.sort(key=lambda o: (order.index(o[0]), o[1]))
    return objectives, unknown


def evaluate_slo(slo: Any, samples: dict[str, Any], failed: int) -> dict[str, Any]:
    """Each objective's percentile against its threshold (pass when value <= threshold); an objective
    with no samples fails. ``pass`` is all objectives passing, None when there are none. ``samples`` maps a
    metric to its samples: an array, or a ``SortedSamples`` (the live figures)."""
    objectives, unknown = slo_objectives(slo)
    results = []
    for metric, q, threshold, key in objectives:
        value, count = _percentile_of(samples.get(metric), q)
        results.append(
            {
                "key": key,
                "metric": metric,
                "percentile": q,
                "threshold_ms": threshold,
                "value_ms": value,
                "samples": count,
                "pass": value is not None and value <= threshold,
            }
        )
    out: dict[str, Any] = {
        "objectives": results,
        "pass": all(r["pass"] for r in results) if results else None,
        "failed_requests": int(failed),
    }
    if unknown:
        out["unrecognized"] = sorted(unknown)
    return out


class Described:
    """A metric's samples with the percentiles already taken from them (the summary's describe): an SLO
    objective on one of those percentiles reads it instead of selecting again."""

    def __init__(self, samples: np.ndarray, known: dict[float, float], count: int):
        self.samples, self.known, self.count = samples, known, count


def _percentile_of(samples: Any, q: float) -> tuple[float | None, int]:
    if isinstance(samples, Described):
        if q in samples.known:
            return samples.known[q], samples.count
        samples = samples.samples
    if isinstance(samples, SortedSamples):
        return samples.percentile(q), len(samples)
    arr = np.asarray(samples if samples is not None else [], dtype=float)
    return percentile(arr, q), int(np.isfinite(arr).sum())


def overall_pass(verdicts: Iterable[bool | None]) -> bool | None:
    """The run's verdict from its run-wide one and its classes': every one that has objectives passes;
    None when none has any."""
    judged = [v for v in verdicts if v is not None]
    return all(judged) if judged else None
