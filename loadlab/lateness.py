"""A fixed-bin histogram of lateness: how late something happened against when it was due.

Used by the simulated server (its own pass-end and token-write lateness) and by the load generator's
self-calibration (how late an I/O event is handled).
"""

from __future__ import annotations


class LatenessHistogram:
    """Fixed 0.1 ms bins up to 100 ms (and one overflow bin), so recording is O(1) and quantiles are exact
    to the bin width however long the process runs. Early (negative) values count as on time."""

    BIN_S = 0.0001
    BINS = 1000

    def __init__(self) -> None:
        self.counts = [0] * (self.BINS + 1)
        self.count = 0
        self.max_s = 0.0

    def record(self, late_s: float) -> None:
        if late_s < 0.0:
            late_s = 0.0
        i = int(late_s / self.BIN_S)
        self.counts[i if i < self.BINS else self.BINS] += 1
        self.count += 1
        if late_s > self.max_s:
            self.max_s = late_s

    def quantile(self, q: float) -> float:
        """Upper edge of the bin holding the q-quantile, in seconds (the overflow bin reports the max)."""
        if not self.count:
            return 0.0
        rank = q * self.count
        seen = 0
        for i, n in enumerate(self.counts):
            seen += n
            if seen >= rank and n:
                return self.max_s if i == self.BINS else min((i + 1) * self.BIN_S, self.max_s)
        return self.max_s

    def summary_ms(self) -> dict:
        return {
            "count": self.count,
            **{f"p{round(q * 100)}": round(self.quantile(q) * 1000, 2) for q in (0.5, 0.9, 0.99)},
            "max": round(self.max_s * 1000, 2),
        }
