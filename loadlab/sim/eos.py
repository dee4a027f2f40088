"""Where the twin's model stops on its own (EOS): an output length per request from a stated distribution.

A real model decides EOS from the prompt; the twin has no model, so ``--eos-len-dist`` (a server setting,
as the model is the server's) states how long its answers run, and each request's length is drawn from it
by a hash of its prompt: the same prompt always stops at the same length (as greedy decoding would), in
real time and in virtual time alike. A request that asks ``ignore_eos`` never stops early (SGLang's rule).

The distribution, as ``KIND:PARAMETERS``:

- ``fixed:N``: every answer is N tokens.
- ``uniform:LOW-HIGH``: uniform over the integers LOW..HIGH, inclusive (mean (LOW + HIGH) / 2, variance
  ((HIGH - LOW + 1)^2 - 1) / 12).
- ``exponential:MEAN``: the discrete exponential: each token is the EOS with probability p = 1 / MEAN, so
  the length is geometric on 1, 2, ... (mean MEAN, variance (1 - p) / p^2).

The answer is then min(that length, max_new_tokens): it ends with finish reason ``stop`` when the drawn
length is shorter, else ``length``. The EOS token counts as an output token (SGLang counts it).
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

EOS_KINDS = ("fixed", "uniform", "exponential")
_SALT = b"loadlab-eos-1"  # never change: it fixes every request's length


@dataclass(frozen=True)
class EosLengths:
    """A parsed ``--eos-len-dist``; ``length(prompt)`` is a request's answer length before the cap."""

    kind: str
    low: int = 1  # fixed: N; uniform: LOW
    high: int = 1  # uniform: HIGH
    mean: float = 1.0  # exponential: MEAN

    def length(self, prompt: Sequence[int]) -> int:
        if self.kind == "fixed":
            return self.low
        u = _unit(prompt)
        if self.kind == "uniform":
            return self.low + min(int(u * (self.high - self.low + 1)), self.high - self.low)
        p = 1.0 / self.mean
        if p >= 1.0:
            return 1
        # Inverse CDF of the geometric distribution on 1, 2, ...: P(L <= k) = 1 - (1 - p)^k.
        return max(1, math.ceil(math.log1p(-u) / math.log1p(-p)))


def _unit(prompt: Sequence[int]) -> float:
    """A number in [0, 1) from the prompt's token ids (64 bits of a keyed hash, 53 of them used)."""
    data = array("q", prompt).tobytes()
    digest = hashlib.blake2b(data, digest_size=8, key=_SALT).digest()
    return (int.from_bytes(digest, "little") >> 11) * 2.0**-53


def parse_eos_dist(text: str) -> EosLengths:
    """``KIND:PARAMETERS`` (above) -> ``EosLengths``; ValueError with what is wrong, in one line."""
    kind, sep, rest = text.partition(":")
    kind, rest = kind.strip(), rest.strip()
    example = "fixed:128, uniform:16-512 or exponential:200"
    if not sep or kind not in EOS_KINDS:
        raise ValueError(f"expected KIND:PARAMETERS with KIND one of {', '.join(EOS_KINDS)}, e.g. {example}; "
                         f"got {text!r}")  # fmt: skip
    try:
        if kind == "fixed":
            n = int(rest)
            if n < 1:
                raise ValueError
            return EosLengths(kind, low=n, high=n)
        if kind == "uniform":
            low, dash, high = rest.partition("-")
            lo, hi = int(low), int(high)
            if not dash or not 1 <= lo <= hi:
                raise ValueError
            return EosLengths(kind, low=lo, high=hi)
        mean = float(rest)
        if not (math.isfinite(mean) and mean >= 1):
            raise ValueError
        return EosLengths(kind, mean=mean)
    except ValueError:
        want = {"fixed": "N, a whole number of tokens >= 1", "uniform": "LOW-HIGH, whole numbers 1 <= LOW <= HIGH",
                "exponential": "MEAN, a number of tokens >= 1"}[kind]  # fmt: skip
        raise ValueError(f"{kind}: expected {want} (e.g. {example}); got {text!r}") from None
