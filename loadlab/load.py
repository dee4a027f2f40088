"""The load a run applies: request tickets (each index handed out exactly once, warm-up first, with a
warm-up barrier), open-loop arrivals (ONE arrival generator for every driver: Locust users, a
distributed run's master and the virtual-time run), and the load's description in the manifest.

A measured ticket is only handed out once every warm-up request has finished (a barrier), so no measured
request shares the server with warm-up traffic; the cost is that the in-flight count dips while the last
warm-up requests drain. The open-loop arrival clock starts with the first ticket and again when the barrier
opens; the gaps come from one seeded generator on the virtual-time grid, so a profile's due times, as
offsets from the phase's start, are the same in a real run and in ``loadlab sim --virtual``.
"""

from __future__ import annotations

import random
import time
from array import array
from bisect import bisect_right
from collections.abc import Callable
from typing import NamedTuple

from gevent.event import Event

from loadlab.manifest import LoadDescription
from loadlab.profile import Profile
from loadlab.records import MEASURE, WARMUP
from loadlab.sim.clock import TICK, quantize


class Ticket(NamedTuple):
    index: int
    phase: str
    due: float | None  # open loop: when the request should be sent (the driver's clock); closed loop: None
    # Requests index, index + 1, ...: a conversation's session (its turns, sent in order by the one user that
    # holds the ticket; ``due`` is its first turn's); 1 for any other workload.
    turns: int = 1


class Arrivals:
    """Open-loop due times: ``rate`` per second, Poisson or evenly spaced, from a seeded generator.
    ``due(now)`` is the next due time on the caller's clock: the phase's start (``now`` at the first call
    after ``restart()``) plus an offset that sums gaps on the virtual clock's grid, so the offsets are
    exact and the same whatever the clock."""

    def __init__(self, rate: float, arrival: str, seed: int):
        self.rate = rate
        self.constant = arrival == "constant"
        self.rng = random.Random(f"loadlab-arrivals-{seed}")  # salt: never change (it fixes every due time)
        self.start: float | None = None
        self.offset = 0.0

    def restart(self) -> None:
        self.start = None

    def due(self, now: float, index: int) -> float:
        if self.start is None:
            self.start, self.offset = now, 0.0
        due = self.start + self.offset
        gap = 1.0 / self.rate if self.constant else self.rng.expovariate(self.rate)
        self.offset += quantize(gap)
        return due


class TraceArrivals:
    """A trace's own due times: request ``index`` at its time in the trace (seconds from the trace's first
    line) divided by ``speed``, counted from the phase's first request, which is due when the phase starts
    (warm-up at the first ticket, measured when the barrier opens). Offsets are put on the virtual clock's
    grid one by one, so they are exact and the same whatever the clock."""

    def __init__(self, times_s: list[float], speed: float):
        self.times = times_s
        self.speed = speed
        self.start: float | None = None
        self.first = 0.0

    def restart(self) -> None:
        self.start = None

    def due(self, now: float, index: int) -> float:
        t = self.times[index]
        if self.start is None:
            self.start, self.first = now, t
        return self.start + round((t - self.first) / self.speed / TICK) * TICK


def arrivals_for(profile: Profile, workload=None) -> Arrivals | TraceArrivals | None:
    """The profile's arrival generator (open loop), or None (closed loop). Trace arrivals take their times
    from the workload (a trace's ``arrival_times_s()``)."""
    load = profile.load
    if load.model != "open":
        return None
    if load.arrival == "trace":
        times = workload.arrival_times_s() if workload is not None else None
        if times is None or len(times) < profile.total_requests:
            have = "no trace" if times is None else f"a trace of {len(times)} requests"
            raise ValueError(
                f"trace arrivals for {profile.total_requests} requests need as many lines: {have}"
            )
        return TraceArrivals(times, load.speed)
    return Arrivals(load.rate, load.arrival, profile.seed)


def tickets_for(profile: Profile, workload=None) -> Tickets:
    """The profile's tickets: its request counts, its arrivals (a trace's from ``workload``), its
    sessions."""
    requests = profile.requests
    return Tickets(requests.warmup, requests.measured, arrivals_for(profile, workload), profile.session_turns)


class Tickets:
    """Hands out request indices so each index is sent exactly once, warm-up before measured; in open
    loop each ticket also carries its due time. With ``turns`` > 1 a ticket is a conversation's session:
    the indices from a multiple of ``turns`` to the next, or to the end of its phase (so the last measured
    session may be shorter); counts (``finished``, the barrier) stay per request.

    Two ways to take one: ``take()`` blocks at the warm-up barrier (gevent: Locust users and the master's
    lease handler), ``take_ready(now)`` never blocks (the virtual-time run: None while the barrier is
    closed, or when every ticket is out; ``exhausted`` tells which)."""

    def __init__(
        self, warmup: int, measured: int, arrivals: Arrivals | TraceArrivals | None = None, turns: int = 1
    ):
        self.arrivals = arrivals
        self.warmup = warmup
        self.total = warmup + measured
        self.turns = turns
        self.next_index = 0
        self.warmup_finished = 0
        self.measured_finished = 0
        self.warmup_done = Event()
        self.all_done = Event()
        self.measure_started_wall: float | None = None  # when the first measured ticket was taken
        self.on_measure_start = None  # called once, with the first measured ticket
        self.dues = array("d")  # open loop: every ticket's due time so far, in order (they never decrease)
        # A distributed run's master: the requests handed out of here that no user has started (the workers'
        # stocks, tickets waiting to be leased again); they are not in flight.
        self.not_started: Callable[[float], int] | None = None  # (now) -> those due by now
        if warmup == 0:
            self.warmup_done.set()

    @property
    def exhausted(self) -> bool:
        return self.next_index >= self.total

    def take(self) -> Ticket | None:
        """The next ticket, or None when every request has been handed out. May block at the warm-up
        barrier."""
        if self.exhausted:
            return None
        if self.next_index >= self.warmup:
            self.warmup_done.wait()
        return self.take_ready(time.time())

    def take_ready(self, now: float) -> Ticket | None:
        """The next ticket if one may be handed out at ``now`` (the driver's clock), else None."""
        if self.exhausted:
            return None
        index = self.next_index
        if index < self.warmup:
            n = self._take_turns(index, self.warmup)
            return Ticket(index, WARMUP, self._due(now, index), n)
        if not self.warmup_done.is_set():
            return None
        n = self._take_turns(index, self.total)
        if self.measure_started_wall is None:
            self.measure_started_wall = now
            if self.arrivals is not None:
                self.arrivals.restart()  # measured arrivals start when the barrier opens
            if self.on_measure_start is not None:
                self.on_measure_start()
        return Ticket(index, MEASURE, self._due(now, index), n)

    def _take_turns(self, index: int, phase_end: int) -> int:
        """Hands out the indices from ``index`` to the end of its session (never past its phase's end)."""
        n = min(self.turns - index % self.turns, phase_end - index)
        self.next_index += n
        return n

    def _due(self, now: float, index: int) -> float | None:
        if self.arrivals is None:
            return None
        due = self.arrivals.due(now, index)
        self.dues.append(due)
        return due

    def before_send(self, index: int) -> None:
        """Called by the user right before it sends request ``index``: nothing to wait for here (a
        distributed run's worker waits until the master has been told the ticket started)."""

    def in_flight(self, now: float) -> int:
        """Requests handed out, due by ``now`` (the driver's clock) and not finished: the live in-flight
        count (an open loop's tickets wait for their due time first)."""
        out = self.next_index if self.arrivals is None else bisect_right(self.dues, now)
        held = self.not_started(now) if self.not_started is not None else 0
        return max(0, out - held - self.warmup_finished - self.measured_finished)

    def finished(self, phase: str) -> bool:
        """Counts a finished request; True when it was the last warm-up request (the barrier opens)."""
        if phase == WARMUP:
            self.warmup_finished += 1
            if self.warmup_finished == self.warmup:
                self.warmup_done.set()
                return True
            return False
        self.measured_finished += 1
        if self.measured_finished == self.total - self.warmup:
            self.all_done.set()
        return False

    @property
    def done(self) -> bool:
        return self.all_done.is_set()


def describe_load(profile: Profile, users: int) -> LoadDescription:
    """The load the run applies, in the words every report uses: the closed loop's concurrency, or the
    open loop's rate and cap. ``users`` is Locust's user count (the closed loop's concurrency, the open
    loop's cap); an open loop asked without a cap and given a user for every request has no cap."""
    load = profile.load
    turns = profile.session_turns
    # A conversation's user holds its session from the first turn to the last reply, thinking included: the
    # concurrency and the cap count sessions, and the rate is of sessions.
    sessions = f" sessions of {turns} turns" if turns > 1 else ""
    if load.model == "closed":
        held = f"{users}{sessions} at a time" if turns > 1 else f"{users} in flight"
        return LoadDescription(model="closed", concurrency=users, description=f"closed loop, {held}")
    uncapped = load.concurrency is None and users >= profile.requests.warmup + profile.requests.measured
    cap = (
        f"no cap on{sessions or ' requests'} in flight"
        if uncapped
        else f"at most {users}{sessions} in flight"
    )
    per = "sessions/s" if turns > 1 else "req/s"
    trace = load.arrival == "trace"
    pace = (f"at the trace's own times{f' x{load.speed:g} speed' if load.speed != 1 else ''}" if trace
            else f"{load.rate:g} {per} ({load.arrival})")  # fmt: skip
    return LoadDescription(
        model="open",
        rate=load.rate,
        arrival=load.arrival,
        speed=load.speed if trace else None,
        concurrency=None if uncapped else users,
        users=users,
        description=f"open loop, {pace}, {cap}",
    )
