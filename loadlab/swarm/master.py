"""The Locust master's side of a distributed run (the protocol: ``loadlab.swarm.messages``)."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import gevent
from locust.runners import STATE_MISSING

from loadlab import exits
from loadlab.load import Ticket
from loadlab.manifest import LoadGenerator
from loadlab.swarm.messages import (
    ClockReport,
    Drain,
    Drained,
    Failed,
    Ping,
    Pong,
    RecordBatch,
    RunInfo,
    TicketReply,
    WantTicket,
    listen,
)

log = logging.getLogger("loadlab")
# Open loop: how long before its due time a ticket goes to a worker (covers the hop and clock offsets).
LEASE_AHEAD_S = 0.5

DRAIN_TIMEOUT_S = 30.0  # how long the master waits for workers to send their last records
CLOCK_WARN_S = 0.010  # worker clock offsets above this blur a cross-host timeline: warn


class Coordinator:
    """The master's side: leases tickets, collects records, watches workers, drains them at the end."""

    def __init__(self, environment, on_failure: Callable[[], None]):
        self.environment = environment
        self.runner = environment.runner
        self.on_failure = on_failure  # ends the run when a worker cannot run (in its own greenlet)
        self.run = None  # loadlab.swarm.run.Run, set by start_run
        self.leases: dict[str, dict[int, str]] = defaultdict(dict)  # worker -> {index: phase}
        self.next_seq: dict[str, int] = defaultdict(int)
        self.gaps: dict[str, int] = defaultdict(int)  # batches that never arrived, per worker
        self.records_from: dict[str, int] = defaultdict(int)
        self.clocks: dict[str, dict[str, Any]] = {}
        self.gone: set[str] = set()
        self.drained: dict[str, int] = {}
        self.calibration: dict[str, dict[str, Any]] = {}  # worker -> its ClientMonitor summary
        self.drain_done = False
        self.failure: str | None = None
        listen(
            self.runner,
            {
                WantTicket: self._on_want,
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
        run.manifest.load_generators = self.load_generators()
        self._send_run(None)

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
    def _on_want(self, worker: str, want: WantTicket) -> None:
        run = self.run
        if run is not None and (
            run.tickets.warmup_done.is_set() or run.tickets.next_index < run.tickets.warmup
        ):
            self._lease(worker, want.id)  # cannot block: answer now (a round trip per request)
        else:
            gevent.spawn(self._lease, worker, want.id)  # waits at the warm-up barrier

    def _lease(self, worker: str, request_id: int) -> None:
        run = self.run
        # No new leases once the run is draining: a ticket could reach a worker after its last batch.
        active = run is not None and not run.finalized and not self.drain_done
        ticket = run.tickets.take() if active else None  # may wait at the warm-up barrier
        if ticket is not None and ticket.due is not None and ticket.due - LEASE_AHEAD_S > time.time():
            gevent.spawn(
                self._deliver_when_due, worker, request_id, ticket
            )  # the message handler must not wait
            return
        self._deliver(worker, request_id, ticket)

    def _deliver_when_due(self, worker: str, request_id: int, ticket: Ticket) -> None:
        gevent.sleep(max(0.0, ticket.due - LEASE_AHEAD_S - time.time()))
        self._deliver(worker, request_id, ticket)

    def _deliver(self, worker: str, request_id: int, ticket: Ticket | None) -> None:
        if ticket is not None and (self.drain_done or self.run is None or self.run.finalized):
            ticket = None
        if ticket is not None:  # leased even to a missing worker: lost if it stays missing, kept if it heals
            for index in range(ticket.index, ticket.index + ticket.turns):  # a session's every turn
                self.leases[worker][index] = ticket.phase
        TicketReply.of(request_id, ticket).send(self.runner, client_id=worker)

    # -- records ----------------------------------------------------------------------------------------
    def _on_records(self, worker: str, batch: RecordBatch) -> None:
        seq = batch.seq
        expected = self.next_seq[worker]
        if seq != expected:
            self.gaps[worker] += max(seq - expected, 0)
            log.error("loadlab: worker %s: record batches %d..%d never arrived", worker, expected, seq - 1)
        self.next_seq[worker] = seq + 1
        run = self.run
        for rec in batch.decoded():
            self.leases[worker].pop(rec.index, None)
            self.records_from[worker] += 1
            if run is not None:
                run.record(rec)

    # -- workers ----------------------------------------------------------------------------------------
    def _watch_workers(self) -> None:
        """A worker Locust marks missing (no heartbeat for ~4 s) or that left: its leases are lost in flight."""
        while True:
            gevent.sleep(1.0)
            for worker in list(self.leases):
                node = self.runner.clients.get(worker)
                if node is not None and node.state != STATE_MISSING:
                    self.gone.discard(worker)  # back (a stalled machine): its late records are recovered
                    continue
                leased = self.leases.pop(worker)
                if node is None and not leased:  # it quit cleanly with nothing in flight
                    continue
                if self.run is not None:
                    for index, phase in leased.items():
                        self.run.lose(index, phase, worker)
                if worker not in self.gone or leased:
                    log.warning(
                        "loadlab: worker %s is gone; %d requests in flight on it are lost, the run goes on",
                        worker,
                        len(leased),
                    )
                self.gone.add(worker)

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
