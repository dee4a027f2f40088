"""The capacity search, pure: which load to run next given the verdicts so far, and what they show.

A point is a load value (``capacity.over``: a rate or a concurrency) with its runs' verdicts (True: the
run met the SLO). A point's verdict is the majority of its runs; a tie fails (the cautious side). The
bracket: ``hi`` the lowest failing value, ``lo`` the highest passing value below it. The steps, each
taken only when the previous ones have nothing left to do:

1. start at ``start`` (or at a hint's ``lo``: a real-time confirmation starts from virtual time's bracket);
2. double ``lo`` while nothing fails (up to ``max``: then "at least max"); halve ``hi`` while nothing
   below it passes (down to ``min``: then "fails at every load tried"); a hint's other end comes first,
   an end of the hint whose first runs disagree with it is run ``repeats`` times before the search moves
   away from it, and from a hint the steps are ``1 + 2 x tolerance`` instead of doubling;
3. bisect, at the geometric middle (the tolerance is relative), until ``hi / lo - 1 <= tolerance``
   (whole numbers: until adjacent);
4. repeat ``lo``, then ``hi``, until each has ``repeats`` runs. A repeat that turns a verdict over moves
   the bracket, and the search goes on from there.

Everything is a function of the points, so a resumed search continues where it stopped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from loadlab.experiment.spec import CapacitySpec

Points = Mapping[float, Sequence[bool]]


@dataclass(frozen=True)
class Step:
    """The next run of a search: at ``value``, and why (start, hint, double, halve, up, down, bisect, repeat)."""

    value: float
    why: str


def verdict(runs: Sequence[bool]) -> bool:
    """A point passes when most of its runs do."""
    return 2 * sum(runs) > len(runs)


def bracket(points: Points) -> tuple[float | None, float | None]:
    """(lo, hi): the highest passing value below the lowest failing one, and that failing value."""
    fails = [v for v, runs in points.items() if runs and not verdict(runs)]
    hi = min(fails) if fails else None
    passes = [v for v, runs in points.items() if runs and verdict(runs) and (hi is None or v < hi)]
    return (max(passes) if passes else None), hi


def snap(value: float, cap: CapacitySpec) -> float:
    """A value as run: a whole number of requests in flight (at least 1), a rate to 3 significant digits."""
    if cap.integer:
        return max(1, round(value))
    return float(f"{value:.3g}")


def close(lo: float, hi: float, cap: CapacitySpec) -> bool:
    """The bracket is narrow enough: within the tolerance, or adjacent whole numbers."""
    return hi <= lo * (1 + cap.tolerance) or (cap.integer and hi - lo <= 1)


def next_step(points: Points, cap: CapacitySpec, hint: tuple[float, float] | None = None) -> Step | None:
    """The next run, or None when the search is over (see the module's docstring)."""
    lo, hi = bracket(points)

    def new(value: float, why: str) -> Step | None:
        value = snap(value, cap)
        if value in points:  # rounding met a value already tried: nothing new to learn there
            return None
        return Step(value, why) if len(points) < cap.max_points else None

    if lo is None and hi is None:
        return new(hint[0] if hint else cap.start, "hint" if hint else "start")
    # From a hint, steps are small (a confirmation expects agreement within a few tolerances), and an end
    # that disagrees with the hint on its first runs gets all its runs before the search moves away.
    step = 1 + 2 * cap.tolerance if hint else 2.0
    if hint:
        for end, expected in ((snap(hint[0], cap), True), (snap(hint[1], cap), False)):
            runs = points.get(end)
            if runs and len(runs) < cap.repeats and verdict(runs) != expected:
                return Step(end, "repeat")
    if hi is None:  # everything passes so far: go up
        if hint and snap(hint[1], cap) > lo and snap(hint[1], cap) not in points:
            return new(hint[1], "hint")
        return new(min(lo * step, cap.max), "up" if hint else "double") if lo < cap.max else None
    if lo is None:  # everything fails so far: go down
        if hint and snap(hint[0], cap) < hi and snap(hint[0], cap) not in points:
            return new(hint[0], "hint")
        return new(max(hi / step, cap.min), "down" if hint else "halve") if hi > cap.min else None
    if not close(lo, hi, cap):
        middle = snap(math.sqrt(lo * hi), cap)
        step = new(middle, "bisect") if lo < middle < hi else None
        if step is not None:  # else (max_points reached) the boundary as it stands is repeated
            return step
    for value in (lo, hi):  # the boundary, repeated: the confidence of the answer
        if len(points[value]) < cap.repeats:
            return Step(value, "repeat")
    return None


def show(value: float | None, cap: CapacitySpec) -> str:
    """A load value as text: ``24.1 req/s``, ``48 in flight``."""
    if value is None:
        return "n/a"
    return f"{int(value) if cap.integer else value:g} {cap.unit}"


def outcome(points: Points, cap: CapacitySpec, hint: tuple[float, float] | None = None) -> dict[str, Any]:
    """What a search shows: ``capacity`` (the highest value that passed below the first that failed, None
    when nothing passed), ``status`` (found: both ends; at_least: nothing failed up to the last value
    tried; none: nothing passed; with ``done`` False, the search has more to run), both ends with their
    runs, and ``confidence`` in words ("passes 3/3 at 24.1 req/s, fails 3/3 at 25.3 req/s")."""
    lo, hi = bracket(points)
    ends = []
    for word, value in (("passes", lo), ("fails", hi)):
        if value is not None:
            runs = points[value]
            count = sum(runs) if word == "passes" else len(runs) - sum(runs)
            ends.append(f"{word} {count}/{len(runs)} at {show(value, cap)}")
    status = "found" if lo is not None and hi is not None else "at_least" if lo is not None else "none"
    return {
        "capacity": lo,
        "status": status,
        "lo": lo,
        "hi": hi,
        "lo_runs": list(points[lo]) if lo is not None else [],
        "hi_runs": list(points[hi]) if hi is not None else [],
        "values_tried": len(points),
        "runs": sum(len(r) for r in points.values()),
        "done": next_step(points, cap, hint) is None,
        "confidence": ", ".join(ends) or "nothing run yet",
    }
