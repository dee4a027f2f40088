"""Request tickets: each index handed out exactly once, warm-up first, with a due time in open loop.

A measured ticket is only handed out once every warm-up request has finished (a barrier), so no measured
request shares the server with warm-up traffic; the cost is that the in-flight count dips while the last
warm-up requests drain.
"""

from __future__ import annotations

import random
import time
from typing import NamedTuple

from gevent.event import Event

from loadlab.records import MEASURE, WARMUP


class Ticket(NamedTuple):
    index: int
    phase: str
    due: float | None  # open loop: when the request should be sent (epoch s); closed loop: None


class Arrivals:
    """Open-loop send times: ``rate`` per second, Poisson or evenly spaced, from a seeded generator. The
    clock starts with the first ticket and again when the warm-up barrier opens."""

    def __init__(self, rate: float, arrival: str, seed: int):
        self.rate = rate
        self.constant = arrival == "constant"
        self.rng = random.Random(f"loadlab-arrivals-{seed}")
        self.next_due: float | None = None

    def restart(self) -> None:
        self.next_due = None

    def due(self) -> float:
        now = time.time()
        due = now if self.next_due is None else self.next_due
        self.next_due = due + (1.0 / self.rate if self.constant else self.rng.expovariate(self.rate))
        return due


class Tickets:
    """Hands out request indices so each index is sent exactly once, warm-up before measured; in open
    loop each ticket also carries its due time."""

    def __init__(self, warmup: int, measured: int, arrivals: Arrivals | None = None):
        self.arrivals = arrivals
        self.warmup = warmup
        self.total = warmup + measured
        self.next_index = 0
        self.warmup_finished = 0
        self.measured_finished = 0
        self.warmup_done = Event()
        self.all_done = Event()
        self.measure_started_wall: float | None = None
        self.on_measure_start = None  # called once, with the first measured ticket
        if warmup == 0:
            self.warmup_done.set()

    def take(self) -> Ticket | None:
        """The next ticket, or None when every request has been handed out. May block at the warm-up
        barrier."""
        if self.next_index >= self.total:
            return None
        index = self.next_index
        self.next_index += 1
        if index < self.warmup:
            return Ticket(index, WARMUP, self._due())
        self.warmup_done.wait()
        if self.measure_started_wall is None:
            self.measure_started_wall = time.time()
            if self.arrivals is not None:
                self.arrivals.restart()  # measured arrivals start when the barrier opens
            if self.on_measure_start is not None:
                self.on_measure_start()
        return Ticket(index, MEASURE, self._due())

    def _due(self) -> float | None:
        return self.arrivals.due() if self.arrivals is not None else None

    def finished(self, phase: str) -> None:
        if phase == WARMUP:
            self.warmup_finished += 1
            if self.warmup_finished == self.warmup:
                self.warmup_done.set()
        else:
            self.measured_finished += 1
            if self.measured_finished == self.total - self.warmup:
                self.all_done.set()
