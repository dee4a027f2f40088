"""The Locust master's side of a distributed run (the protocol: ``loadlab.swarm.messages``)."""

from __future__ import annotations

import heapq
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import gevent
from locust.runners import STATE_MISSING

from loadlab import exits
from loadlab.load import Ticket
from loadlab.manifest import LoadGenerator, TicketLeases
from loadlab.swarm.messages import (
    LEASE_GUARD_S,
    ClockReport,
    Drain,
    Drained,
    Failed,
    Ping,
    Pong,
    RecordBatch,
    ReturnTickets,
    RunInfo,
    TicketBlock,
    WantTickets,
    listen,
)

log = logging.getLogger("loadlab")
# Open loop: how long before its due time a ticket goes to a worker (covers the hop and clock offsets).
LEASE_AHEAD_S = 0.5
# Open loop: a held ask waits this much past the next ticket's lease time, so that the tickets due just
# after it travel in the same block (each still goes out at least LEASE_AHEAD_S - this before it is due).
OPEN_BATCH_S = 0.02
# How long a worker may start the tickets of a block after the master sent it (master's clock); what it
# has not started by then it returns. A missing worker's unstarted tickets are leased again only once their
# lease has expired (plus LEASE_GUARD_S for the clocks' offset estimate), so a worker that was only stalled
# cannot start them too.
LEASE_VALID_S = 5.0

DRAIN_TIMEOUT_S = 30.0  # how long the master waits for workers to send their last records
CLOCK_WARN_S = 0.010  # worker clock offsets above this blur a cross-host timeline: warn


class Coordinator:
    """The master's side: leases tickets, collects records, watches workers, drains them at the end."""

    def __init__(self, environment, on_failure: Callable[[], None]):
        self.environment = environment
        self.runner = environment.runner
        self.on_failure = on_failure  # ends the run when a worker cannot run (in its own greenlet)
        self.run = None  # loadlab.swarm.run.Run, set by start_run
        self.leases: dict[str, dict[int, str]] = defaultdict(dict)  # worker -> {index: phase}, no record yet
        # worker -> {first index: ticket}: leased, not reported handed to a user (it can be leased again)
        self.unstarted: dict[str, dict[int, Ticket]] = defaultdict(dict)
        self.lease_end: dict[str, float] = {}  # worker -> its latest block's valid_until
        self.expiring: list[tuple[float, str, dict[int, Ticket]]] = []  # a missing worker's unstarted tickets
        self.pool: list[Ticket] = []  # tickets to lease again (a heap by index), before any new one
        self.asks: dict[str, WantTickets] = {}  # held asks, oldest first
        self.upcoming: Ticket | None = (
            None  # open loop: the next new ticket, not due within LEASE_AHEAD_S yet
        )
        self.timer = None  # open loop: the greenlet that serves held asks when ``upcoming`` may be leased
        self.re_leased: dict[str, int] = defaultdict(int)  # worker gone -> its unstarted tickets leased again
        self.taken_from: dict[int, str] = {}  # a ticket leased again -> the worker that had it
        self.blocks = 0  # TicketBlocks sent (the run's "tickets per message" figure)
        self.leased = 0
        self.returned = 0  # tickets the workers returned unstarted at the drain (they get no record)
        self.next_seq: dict[str, int] = defaultdict(int)
        self.gaps: dict[str, int] = defaultdict(int)  # batches that never arrived, per worker
        self.records_from: dict[str, int] = defaultdict(int)
        self.clocks: dict[str, dict[str, Any]] = {}
        self.gone: set[str] = set()
        self.drained: dict[str, int] = {}
        self.calibration: dict[str, dict[str, Any]] = {}  # worker -> its ClientMonitor summary
        self.waits: dict[
            str, tuple[int, float]
        ] = {}  # worker -> (measured takes, time users waited for them)
        self.drain_done = False
        self.failure: str | None = None
        listen(
            self.runner,
            {
                WantTickets: self._on_want,
                ReturnTickets: self._on_return,
                RecordBatch: self._on_records,
                Drained: self._on_drained,
                Ping: self._on_ping,
                ClockReport: self._on_clock,
                Failed: self._on_failed,
            },
        )
        environment.events.worker_connect.add_listener(self._on_worker_connect)
        gevent.spawn(self._watch_workers)

    # -- the run ----------------------------------------------------------------------------------------
    def start_run(self, run, target_url: str) -> None:
        self.run = run
        self.target_url = target_url
        self.drain_done = False
        self.drained = {}
        self.waits = {}
        self.re_leased.clear()
        self.pool, self.asks, self.upcoming, self.expiring = [], {}, None, []
        self.unstarted.clear()
        self.taken_from.clear()
        self.blocks = self.leased = self.returned = 0
        # The barrier opens: serve held asks (in a greenlet: a rawlink callback runs in the hub, which must
        # not wait on a socket).
        run.tickets.warmup_done.rawlink(lambda _e: gevent.spawn(self._serve))
        run.tickets.not_started = self._not_started
        run.manifest.load_generators = self.load_generators()
        self._send_run(None)

    def _not_started(self, now: float) -> int:
        """Requests handed out of the run's tickets that no user has started: the workers' stocks, a dead
        worker's waiting to expire, the pool to lease again, the open loop's next ticket (not in flight);
        in an open loop only those due by ``now`` (the others are not counted as handed out yet)."""
        held = [*self.pool, *(t for u in self.unstarted.values() for t in u.values())]
        held += [t for e in self.expiring for t in e[2].values()]
        if self.upcoming is not None:
            held.append(self.upcoming)
        return sum(t.turns for t in held if t.due is None or t.due <= now)

    def _send_run(self, worker: str | None) -> None:
        """The run, to every worker (None) or to one that joins while it runs (before Locust gives it
        users: messages to a worker arrive in order)."""
        run = self.run
        RunInfo(
            run_id=run.run_id,
            rid_prefix=run.rid_prefix,
            profile=run.manifest.profile,
            profile_path=run.manifest.profile_path,
            target_url=self.target_url,
            model=run.model,
            manifest=run.manifest.model_dump(mode="json"),
        ).send(self.runner, client_id=worker)

    def _on_worker_connect(self, client_id: str, **_kw) -> None:
        if self.run is not None and not self.run.finalized and not self.drain_done:
            self._send_run(client_id)

    def load_generators(self) -> list[LoadGenerator]:
        """Per worker: clock offset, records received, requests lost in flight on it."""
        lost: dict[str, int] = defaultdict(int)
        if self.run is not None:
            for item in self.run.lost.values():
                lost[item["worker"]] += 1
        ids = set(self.clocks) | set(self.records_from) | set(lost)
        return [
            LoadGenerator(
                worker_id=w,
                **self.clocks.get(w, {}),
                records=self.records_from.get(w, 0),
                lost_in_flight=lost.get(w, 0),
                record_batches_missing=self.gaps.get(w, 0),
                gone=w in self.gone,
            )
            for w in sorted(ids)
        ]

    # -- tickets ----------------------------------------------------------------------------------------
    def _on_want(self, worker: str, want: WantTickets) -> None:
        self.asks.pop(worker, None)  # one ask at a time per worker: a newer one replaces it
        self.asks[worker] = want
        self._serve()

    def _serve(self, tick: bool = False) -> None:
        """Answers held asks, oldest first, each with a block of what can be leased now (pool first, then new
        tickets); an ask nothing can be leased for stays held, unless no ticket can ever come (then every
        held ask is answered with ``done``). In open loop asks are served on a timer (``tick``) that runs
        OPEN_BATCH_S after the next ticket may be leased, so a block carries every ticket that entered the
        window meanwhile rather than one ticket per ask. Never waits: it runs in message handlers."""
        run = self.run
        open_loop = run is not None and run.tickets.arrivals is not None
        while self.asks and (tick or not open_loop):
            worker, want = next(iter(self.asks.items()))
            tickets = self._take(want.n)
            if not tickets:
                break
            del self.asks[worker]
            self._lease(worker, want.id, tickets)
        if self.asks and self._no_more():
            for worker, want in self.asks.items():
                TicketBlock.of(want.id, [], 0.0, done=True).send(self.runner, client_id=worker)
            self.asks.clear()
        if open_loop:
            self._arm_timer()

    def _take(self, n: int) -> list[Ticket]:
        """Up to ``n`` tickets that may be handed out now, of one phase: tickets to lease again first (their
        due times, if any, have passed or are near), then new ones, up to the warm-up barrier and, in open
        loop, up to those due within LEASE_AHEAD_S."""
        run = self.run
        if run is None or run.finalized or self.drain_done:
            return []
        n = min(n, self._fair_share())
        out: list[Ticket] = []
        while self.pool and len(out) < n:
            out.append(heapq.heappop(self.pool))
        tickets = run.tickets
        horizon = time.time() + LEASE_AHEAD_S
        while len(out) < n:
            ticket = self.upcoming
            if ticket is None:
                ticket = tickets.take_ready(time.time())  # None at the barrier or when every ticket is out
                if ticket is None:
                    break
            if ticket.due is not None and ticket.due > horizon:
                self.upcoming = ticket  # taken from the dispenser (its due time is fixed), not leased yet
                break
            self.upcoming = None
            if out and ticket.phase != out[0].phase:  # cannot happen (the barrier); kept as a guarantee
                heapq.heappush(self.pool, ticket)
                break
            out.append(ticket)
        return out

    def _fair_share(self) -> int:
        """The most one block may take: what is left of the phase shared among the live workers, so that
        near the end of the run (or of the warm-up) no worker's stock keeps tickets the others' free users
        could send."""
        tickets = self.run.tickets
        end = tickets.warmup if tickets.next_index < tickets.warmup else tickets.total
        left = end - tickets.next_index + len(self.pool) + (self.upcoming is not None)
        workers = sum(1 for c in self.runner.clients.all if c.state != STATE_MISSING) or 1
        return max(1, -(-left // workers))

    def _no_more(self) -> bool:
        """No ticket can be leased ever again: the dispenser is empty and no leased ticket can come back."""
        run = self.run
        if run is None or run.finalized or self.drain_done:
            return True
        if self.pool or self.upcoming is not None or not run.tickets.exhausted:
            return False
        return not self.expiring and not any(self.unstarted.values())

    def _lease(self, worker: str, ask_id: int, tickets: list[Ticket]) -> None:
        # Leased even to a missing worker: its unstarted tickets come back after the lease expires.
        valid_until = time.time() + LEASE_VALID_S
        self.lease_end[worker] = valid_until
        leases, unstarted = self.leases[worker], self.unstarted[worker]
        for ticket in tickets:
            unstarted[ticket.index] = ticket
            for index in range(ticket.index, ticket.index + ticket.turns):  # a session's every turn
                leases[index] = ticket.phase
        self.blocks += 1
        self.leased += len(tickets)
        TicketBlock.of(ask_id, tickets, valid_until).send(self.runner, client_id=worker)

    def _arm_timer(self) -> None:
        """Open loop: serve held asks OPEN_BATCH_S after the next ticket may be leased."""
        if self.timer is not None or not self.asks:
            return
        ticket = self.upcoming
        wait = 0.0 if ticket is None or self.pool else max(0.0, ticket.due - LEASE_AHEAD_S - time.time())
        self.timer = gevent.spawn_later(wait + OPEN_BATCH_S, self._on_timer)

    def _on_timer(self) -> None:
        self.timer = None
        self._serve(tick=True)

    def _on_return(self, worker: str, returned: ReturnTickets) -> None:
        """Tickets a worker will never start: leased again (ignored if they already were, the worker having
        gone missing meanwhile)."""
        unstarted, leases = self.unstarted[worker], self.leases[worker]
        for index in returned.indices:
            ticket = unstarted.pop(index, None)
            if ticket is None:
                continue
            for i in range(ticket.index, ticket.index + ticket.turns):
                leases.pop(i, None)
            heapq.heappush(self.pool, ticket)
            if self.drain_done:
                self.returned += ticket.turns
        self._serve()

    def _started(self, worker: str, indices: list[int]) -> None:
        unstarted = self.unstarted[worker]
        for index in indices:
            if unstarted.pop(index, None) is None and self.taken_from.get(index) == worker:
                log.error(
                    "loadlab: worker %s started request %d after its tickets were leased again (it was "
                    "missing): the request may be sent twice; its first record is kept",
                    worker,
                    index,
                )

    # -- records ----------------------------------------------------------------------------------------
    def _on_records(self, worker: str, batch: RecordBatch) -> None:
        seq = batch.seq
        expected = self.next_seq[worker]
        if seq != expected:
            self.gaps[worker] += max(seq - expected, 0)
            log.error("loadlab: worker %s: record batches %d..%d never arrived", worker, expected, seq - 1)
        self.next_seq[worker] = seq + 1
        run = self.run
        if batch.started:
            self._started(worker, batch.started)
        unstarted = self.unstarted[worker]
        for rec in batch.decoded():
            self.leases[worker].pop(rec.index, None)
            unstarted.pop(rec.index, None)
            self.records_from[worker] += 1
            if run is not None:
                run.record(rec)
        if batch.started and self.asks:
            self._serve()  # the last unstarted tickets started: held asks may learn there are no more

    # -- workers ----------------------------------------------------------------------------------------
    def _watch_workers(self) -> None:
        """A worker Locust marks missing (no heartbeat for ~4 s) or that left: its started tickets without a
        record are lost in flight; its unstarted ones are leased again once their lease has expired (kept
        for it if it comes back before)."""
        while True:
            gevent.sleep(1.0)
            self._expire()
            for worker in set(self.leases) | {e[1] for e in self.expiring}:
                node = self.runner.clients.get(worker)
                if node is not None and node.state != STATE_MISSING:
                    self.gone.discard(worker)  # back (a stalled machine): its late records are recovered
                    self._restore(worker)
                    continue
                self.asks.pop(worker, None)  # not served: it would only come back after the lease
                leased = self.leases.pop(worker, {})
                unstarted = self.unstarted.pop(worker, {})
                if node is None and not leased:  # it quit cleanly with nothing in flight
                    continue
                unused = {i for t in unstarted.values() for i in range(t.index, t.index + t.turns)}
                lost = {i: phase for i, phase in leased.items() if i not in unused}
                if self.run is not None:
                    for index, phase in lost.items():
                        self.run.lose(index, phase, worker)
                if unstarted:
                    self.expiring.append((self.lease_end.get(worker, 0.0) + LEASE_GUARD_S, worker, unstarted))
                if worker not in self.gone or leased:
                    log.warning(
                        "loadlab: worker %s is gone; %d requests in flight on it are lost, %d unstarted "
                        "tickets of its stock will be leased to the other workers; the run goes on",
                        worker,
                        len(lost),
                        len(unused),
                    )
                self.gone.add(worker)
            self._expire()

    def _expire(self) -> None:
        """A missing worker's unstarted tickets whose lease has expired go back to the pool."""
        now = time.time()
        due = [e for e in self.expiring if e[0] <= now]
        if not due:
            return
        self.expiring = [e for e in self.expiring if e[0] > now]
        for _, worker, tickets in due:
            self.re_leased[worker] += len(tickets)
            for ticket in tickets.values():
                self.taken_from[ticket.index] = worker
                heapq.heappush(self.pool, ticket)
        self._serve()

    def _restore(self, worker: str) -> None:
        """A worker back before its lease expired keeps its unstarted tickets."""
        back = [e for e in self.expiring if e[1] == worker]
        if not back:
            return
        self.expiring = [e for e in self.expiring if e[1] != worker]
        for _, _, tickets in back:
            self.unstarted[worker].update(tickets)
            for t in tickets.values():
                for i in range(t.index, t.index + t.turns):
                    self.leases[worker][i] = t.phase

    def _on_ping(self, worker: str, ping: Ping) -> None:
        Pong(t0=ping.t0, t_master=time.time()).send(self.runner, client_id=worker)

    def _on_clock(self, worker: str, clock: ClockReport) -> None:
        self.clocks[worker] = clock.to_dict()
        offset = clock.clock_offset_s
        if abs(offset) > CLOCK_WARN_S:
            log.warning(
                "loadlab: worker %s's clock is %+.1f ms off the master's (round trip %.1f ms): cross-worker "
                "timelines blur by that much; synchronise clocks (NTP/chrony)",
                worker,
                offset * 1000,
                clock.rtt_s * 1000,
            )

    def _on_failed(self, worker: str, failed: Failed) -> None:
        self.failure = f"worker {worker}: {failed.error}"
        log.error("loadlab: %s", self.failure)
        self.environment.process_exit_code = exits.TARGET
        gevent.spawn(self.on_failure)

    def _on_drained(self, worker: str, drained: Drained) -> None:
        self.drained[worker] = drained.last_seq
        self.waits[worker] = (drained.takes, drained.ticket_wait_s, drained.empty_takes)
        if drained.calibration:
            self.calibration[worker] = drained.calibration

    def calibrations(self) -> list[dict[str, Any]]:
        """Each drained worker's self-calibration (a worker that died sent none)."""
        return [{"worker_id": w, **c} for w, c in sorted(self.calibration.items())]

    def drain(self) -> None:
        """Asks every live worker to stop its users and send its last records; waits for all of them (or
        DRAIN_TIMEOUT_S). Locust's own stop ordering fires the master's test_stop before workers' last
        batches arrive, hence this handshake."""
        if self.drain_done:
            return
        self.drain_done = True
        workers = {c.id for c in self.runner.clients.all if c.state != STATE_MISSING} - self.gone
        if not workers:
            return
        Drain().send(self.runner)
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while not workers <= set(self.drained) and time.monotonic() < deadline:
            gevent.sleep(0.05)
        for worker in sorted(workers - set(self.drained)):
            log.error(
                "loadlab: worker %s did not drain within %.0f s; see its spill file", worker, DRAIN_TIMEOUT_S
            )
        for worker, last in self.drained.items():
            if self.next_seq[worker] <= last:
                self.gaps[worker] += last + 1 - self.next_seq[worker]
                log.error("loadlab: worker %s: record batches up to %d never arrived", worker, last)
        log.info("loadlab: %s", self.lease_figures())

    def ticket_leases(self) -> TicketLeases:
        """The run's ticket leases: tickets, blocks, tickets leased again, requests returned unsent at the
        drain, and how long users waited for a measured ticket (the workers' own counts, at their drain)."""
        takes = sum(n for n, _, _ in self.waits.values())
        waited = sum(s for _, s, _ in self.waits.values())
        return TicketLeases(
            leased=self.leased,
            blocks=self.blocks,
            leased_again=sum(self.re_leased.values()),
            returned_unsent=self.returned,
            measured_takes=takes,
            empty_takes=sum(e for _, _, e in self.waits.values()),
            wait_ms_per_take=waited / takes * 1000 if takes else None,
        )

    def lease_figures(self) -> str:
        """``ticket_leases`` in one line (the master's log)."""
        t = self.ticket_leases()
        per_block = t.leased / t.blocks if t.blocks else 0.0
        wait = (f"{t.wait_ms_per_take:.3f} ms per measured ticket ({t.empty_takes} of {t.measured_takes} found "
                f"the stock empty)" if t.wait_ms_per_take is not None else "no measured ticket")  # fmt: skip
        return (
            f"tickets: {t.leased} leased in {t.blocks} blocks ({per_block:.1f} a block)"
            f"{f', {t.leased_again} of dead workers leased again' if t.leased_again else ''}"
            f"{f', {t.returned_unsent} requests returned unsent at the drain' if t.returned_unsent else ''}"
            f"; users waited {wait}"
        )
