"""The twin's scheduler on a virtual clock: time advances pass by pass, with no waiting.

``run_requests`` is the simplest driver of the scheduler's contract (``next_iteration(now)``, then
``complete(it, end)``): requests queued at given arrival times, run until idle. ``quantize`` keeps virtual
time on a grid where sums and millisecond conversions are exact; ``token_events`` and ``output_ids_for``
turn a finished request into what a client would have seen. ``loadlab.virtual`` drives the same
scheduler with a client model to run whole profiles.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable

import numpy as np

from loadlab.sim.scheduler import Iteration, Request, Scheduler
from loadlab.sim.tokenize import OUTPUT_IDS, output_start

TICK = 2.0**-20  # virtual time is kept on a grid of ~0.95 us so that epoch + t and ms conversions are exact


def quantize(seconds: float) -> float:
    """Rounds a duration to the virtual clock's grid (at least one tick). On the grid, every time below
    2**22 s added to an integer epoch, and every difference times 1000, is exact in a double: a request
    sent the moment another ends starts exactly at its end, as the records then show."""
    return max(1, round(seconds / TICK)) * TICK


def output_ids_for(prompt: list[int], max_new: int) -> list[int]:
    """The ids the server would generate for ``prompt`` (the same deterministic output as over HTTP)."""
    start = output_start(prompt)
    reps = (start + max_new) // len(OUTPUT_IDS) + 1
    return list((OUTPUT_IDS * reps)[start : start + max_new])


def token_events(times, t_send: float, interval: int) -> tuple[list[float], list[int]]:
    """(arrival_ms, arrival_tokens) of one request's events: tokens 1, 1 + I, 1 + 2I, ... and the last."""
    n = len(times)
    if n == 0:
        return [], []
    ms = (np.frombuffer(times, dtype=np.float64) if isinstance(times, array) else np.asarray(times)) - t_send
    ms *= 1000.0
    if interval <= 1:
        return ms.tolist(), [1] * n
    ks = list(range(0, n, interval))  # token indices (0-based) that end an event: 0, I, 2I, ...
    if ks[-1] != n - 1:
        ks.append(n - 1)
    toks = [1] + [b - a for a, b in zip(ks, ks[1:], strict=False)]
    return ms[ks].tolist(), toks


def run_requests(
    sched: Scheduler,
    arrivals: list[tuple[float, Request]],
    observe: Callable[[Iteration, Scheduler], None] | None = None,
) -> float:
    """Drives ``sched`` on a virtual clock until it is idle and every request has arrived: each request is
    queued at its arrival time (arrivals during a pass wait for its end). ``observe(it, sched)`` sees each
    pass after it is decided and before it completes. Returns the final time. (Tests and experiments.)"""
    pending = sorted(arrivals, key=lambda a: a[0])
    i, n, t = 0, len(pending), 0.0
    while True:
        while i < n and pending[i][0] <= t:
            sched.add_request(pending[i][1], pending[i][0])
            i += 1
        it = sched.next_iteration(t)
        if it is None:
            if i < n:
                t = max(t, pending[i][0])
                continue
            return t
        if observe is not None:
            observe(it, sched)
        end = t + quantize(it.duration)
        while i < n and pending[i][0] <= end:
            sched.add_request(pending[i][1], pending[i][0])
            i += 1
        sched.complete(it, end)
        t = end
