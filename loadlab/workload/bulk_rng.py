"""The first numbers of many ``numpy.random.default_rng([*prefix, index, *suffix])`` generators at once.

A workload draws each request's randomness from a generator seeded by (seed, index, salt), so a request is a
pure function of its index. Building a million such generators one at a time costs ~19 µs each (numpy's
SeedSequence in Python); a bound that needs every request's first few draws (the RAG workload's cache hits,
``RagGenerator.reusable_prefix``) then costs seconds. Here numpy's SeedSequence (the entropy pool's hash and
mix) and PCG64 (its 128-bit LCG and XSL-RR output) are computed for all indices together in numpy's integer
arithmetic, bit for bit: ``first_doubles`` equals ``default_rng([...]).random(n)`` row by row, and
``first_integers`` its ``integers(low, high + 1)`` calls (tests/test_verdicts.py checks both against numpy).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_M32 = np.uint64(0xFFFFFFFF)
_INIT_A, _MULT_A = 0x43B0D7E5, 0x931E8875
_INIT_B, _MULT_B = 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R = 0xCA01F9DD, 0x4973F715
_POOL = 4
# PCG64's multiplier (numpy's PCG_DEFAULT_MULTIPLIER_128), as its high and low 64 bits.
_MUL_HI, _MUL_LO = np.uint64(2549297995355413924), np.uint64(4865540595714422341)


def _words(n: int) -> list[int]:
    """A non-negative integer as SeedSequence takes it: its 32-bit words, least significant first."""
    if n < 0:
        raise ValueError("seed words must be non-negative")
    out = [n & 0xFFFFFFFF]
    n >>= 32
    while n:
        out.append(n & 0xFFFFFFFF)
        n >>= 32
    return out


def _u32(x):
    return np.asarray(x, dtype=np.uint64) & _M32


class _Hash:
    """SeedSequence's hashmix with its running constant (the constant is the same for every row)."""

    def __init__(self, init: int, mult: int):
        self.const, self.mult = init, mult

    def __call__(self, value):
        value = _u32(value) ^ np.uint64(self.const)
        self.const = (self.const * self.mult) & 0xFFFFFFFF
        value = (value * np.uint64(self.const)) & _M32
        return value ^ (value >> np.uint64(16))


def _mix(x, y):
    result = (np.uint64(_MIX_L) * x - np.uint64(_MIX_R) * y) & _M32
    return result ^ (result >> np.uint64(16))


def _pool(entropy: list) -> list:
    """SeedSequence's mixed entropy pool (4 words) from its entropy words (scalars or per-row arrays)."""
    hashmix = _Hash(_INIT_A, _MULT_A)
    pool = [hashmix(entropy[i] if i < len(entropy) else 0) for i in range(_POOL)]
    for src in range(_POOL):
        for dst in range(_POOL):
            if src != dst:
                pool[dst] = _mix(pool[dst], hashmix(pool[src]))
    for src in range(_POOL, len(entropy)):
        for dst in range(_POOL):
            pool[dst] = _mix(pool[dst], hashmix(entropy[src]))
    return pool


def _state64(pool: list, n: int) -> list:
    """SeedSequence.generate_state(n, uint64): 2n 32-bit words from the pool, paired low word first."""
    hashmix = _Hash(_INIT_B, _MULT_B)
    words = []
    for i in range(2 * n):
        value = pool[i % _POOL] ^ np.uint64(hashmix.const)
        hashmix.const = (hashmix.const * hashmix.mult) & 0xFFFFFFFF
        value = (value * np.uint64(hashmix.const)) & _M32
        words.append(value ^ (value >> np.uint64(16)))
    return [words[2 * i] | (words[2 * i + 1] << np.uint64(32)) for i in range(n)]


def _mulhi(a, b):
    """The high 64 bits of the 128-bit products a * b (uint64 arrays)."""
    a0, a1, b0, b1 = a & _M32, a >> np.uint64(32), b & _M32, b >> np.uint64(32)
    mid = (a1 * b0 & _M32) + (a0 * b1 & _M32) + (a0 * b0 >> np.uint64(32))
    return a1 * b1 + (a1 * b0 >> np.uint64(32)) + (a0 * b1 >> np.uint64(32)) + (mid >> np.uint64(32))


def _step(hi, lo, inc_hi, inc_lo):
    """One PCG64 step: state = state * multiplier + increment (mod 2^128)."""
    new_hi = _mulhi(lo, _MUL_LO) + lo * _MUL_HI + hi * _MUL_LO
    new_lo = lo * _MUL_LO
    out_lo = new_lo + inc_lo
    carry = (out_lo < new_lo).astype(np.uint64)
    return new_hi + inc_hi + carry, out_lo


def first_words(prefix: Sequence[int], indices: np.ndarray, suffix: Sequence[int], n: int) -> np.ndarray:
    """Row i: the first ``n`` 64-bit outputs of ``numpy.random.default_rng([*prefix, indices[i], *suffix])``'s
    PCG64 (``bit_generator.random_raw(n)``)."""
    indices = np.asarray(indices, dtype=np.uint64)
    if indices.size and int(indices.max()) > 0xFFFFFFFF:
        raise ValueError("bulk_rng: indices above 2^32 - 1 take two seed words")
    entropy = [*(w for p in prefix for w in _words(p)), indices, *(w for s in suffix for w in _words(s))]
    with np.errstate(over="ignore"):
        seed_hi, seed_lo, inc_hi, inc_lo = _state64(_pool(entropy), 4)
        shape = indices.shape
        seed_hi, seed_lo, inc_hi, inc_lo = (
            np.broadcast_to(x, shape) for x in (seed_hi, seed_lo, inc_hi, inc_lo)
        )
        # pcg_setseq_128_srandom: inc = (initseq << 1) | 1; state = 0; step; state += initstate; step.
        inc_hi, inc_lo = (
            (inc_hi << np.uint64(1)) | (inc_lo >> np.uint64(63)),
            (inc_lo << np.uint64(1)) | np.uint64(1),
        )
        hi, lo = _step(np.zeros(shape, np.uint64), np.zeros(shape, np.uint64), inc_hi, inc_lo)
        lo2 = lo + seed_lo
        hi = hi + seed_hi + (lo2 < lo).astype(np.uint64)
        hi, lo = _step(hi, lo2, inc_hi, inc_lo)
        out = np.empty((*shape, n), dtype=np.uint64)
        for j in range(n):
            hi, lo = _step(hi, lo, inc_hi, inc_lo)
            # XSL-RR: (hi ^ lo) rotated right by the state's top 6 bits.
            x, rot = hi ^ lo, hi >> np.uint64(58)
            out[..., j] = (x >> rot) | (x << ((np.uint64(64) - rot) & np.uint64(63)))
    return out


def first_doubles(prefix: Sequence[int], indices: np.ndarray, suffix: Sequence[int], n: int) -> np.ndarray:
    """Row i: the first ``n`` of ``numpy.random.default_rng([*prefix, indices[i], *suffix]).random()``."""
    # A double from a word's top 53 bits.
    return (first_words(prefix, indices, suffix, n) >> np.uint64(11)).astype(np.float64) * (
        1.0 / 9007199254740992.0
    )


def first_integers(
    prefix: Sequence[int], indices: np.ndarray, suffix: Sequence[int], ranges: Sequence[tuple[int, int]]
) -> np.ndarray:
    """Row i, column j: the j-th of ``[rng.integers(low, high + 1) for low, high in ranges]`` drawn in turn
    from ``rng = numpy.random.default_rng([*prefix, indices[i], *suffix])`` (inclusive ranges under 2^32 wide;
    an empty range ``low == high`` draws nothing, as numpy's doesn't).

    numpy draws such an integer from the generator's next 32-bit half-word (the low half of a 64-bit output
    first) by Lemire's multiply-and-reject; a row whose draws are rejected more often than the spare words
    allow (about one in 2^32 / width), or whose index takes two seed words (above 2^32 - 1), is drawn by numpy
    itself."""
    indices = np.asarray(indices, dtype=np.int64)
    for low, high in ranges:
        if not 0 <= high - low < 0xFFFFFFFF:
            raise ValueError(f"first_integers: the range {low}..{high} is not 1 to 2^32 - 1 wide")
    spare = 4  # half-words for rejections
    short = (indices < 0) | (indices > 0xFFFFFFFF)
    words = first_words(prefix, np.where(short, 0, indices), suffix, (len(ranges) + spare + 1) // 2)
    halves = np.empty((indices.size, 2 * words.shape[1]), dtype=np.uint64)
    halves[:, 0::2], halves[:, 1::2] = words & _M32, words >> np.uint64(32)
    out = np.empty((indices.size, len(ranges)), dtype=np.int64)
    taken = np.zeros(indices.size, dtype=np.int64)  # each row's half-words used
    rows = np.arange(indices.size)
    for j, (low, high) in enumerate(ranges):
        width = high - low + 1
        if width == 1:
            out[:, j] = low
            continue
        threshold = np.uint64((0x100000000 - width) % width)
        pending = rows[~short]
        while pending.size:
            fits = taken[pending] < halves.shape[1]
            short[pending[~fits]] = True
            pending = pending[fits]
            m = halves[pending, taken[pending]] * np.uint64(width)
            taken[pending] += 1
            kept = (m & _M32) >= threshold
            out[pending[kept], j] = low + (m[kept] >> np.uint64(32)).astype(np.int64)
            pending = pending[~kept]
    for row in np.flatnonzero(short).tolist():
        rng = np.random.default_rng([*prefix, int(indices[row]), *suffix])
        out[row] = [rng.integers(low, high + 1) for low, high in ranges]
    return out


SHORT = 256  # permutations up to this long are made in bulk


def permutations(prefix: Sequence[int], indices: np.ndarray, suffix: Sequence[int], n: int) -> np.ndarray:
    """Row i: ``numpy.random.default_rng([*prefix, indices[i], *suffix]).permutation(n)``.

    numpy shuffles ``arange(n)`` by Fisher-Yates from the last place down, each place's partner drawn from the
    next 32-bit half-words masked to the place's bit length, a draw above the place rejected. Done here for
    all rows together when ``n`` is small (a permutation then costs a generator's making, ~20 µs in numpy);
    a row whose rejections outrun the spare words, or whose index takes two seed words, is numpy's own."""
    indices = np.asarray(indices, dtype=np.int64)
    if n > SHORT or not indices.size:  # long permutations amortise numpy's generator
        return np.array(
            [np.random.default_rng([*prefix, int(i), *suffix]).permutation(n) for i in indices.tolist()],
            dtype=np.int64,
        ).reshape(indices.size, n)
    short = (indices < 0) | (indices > 0xFFFFFFFF)
    words = first_words(prefix, np.where(short, 0, indices), suffix, n + 8)
    halves = np.empty((indices.size, 2 * words.shape[1]), dtype=np.uint64)
    halves[:, 0::2], halves[:, 1::2] = words & _M32, words >> np.uint64(32)
    out = np.broadcast_to(np.arange(n, dtype=np.int64), (indices.size, n)).copy()
    taken = np.zeros(indices.size, dtype=np.int64)
    rows = np.arange(indices.size)
    for place in range(n - 1, 0, -1):
        mask = np.uint64((1 << place.bit_length()) - 1)
        partner = np.zeros(indices.size, dtype=np.int64)
        pending = rows[~short]
        while pending.size:
            fits = taken[pending] < halves.shape[1]
            short[pending[~fits]] = True
            pending = pending[fits]
            value = (halves[pending, taken[pending]] & mask).astype(np.int64)
            taken[pending] += 1
            kept = value <= place
            partner[pending[kept]] = value[kept]
            pending = pending[~kept]
        here = out[rows, place].copy()
        out[rows, place] = out[rows, partner]
        out[rows, partner] = here
    for row in np.flatnonzero(short).tolist():
        out[row] = np.random.default_rng([*prefix, int(indices[row]), *suffix]).permutation(n)
    return out
