"""Locust master and workers: exact request counts, loss-free record collection, failures, clocks.

The master owns the run: the run directory, the one ``Tickets`` dispenser and the records. Workers run the
users. Messages (Locust's custom messages over its ZMQ connection, ordered per worker):

    master -> worker   loadlab_run      the run: id, resolved profile, target URL, model, manifest
    worker -> master   loadlab_want     a user needs a ticket (request id)
    master -> worker   loadlab_ticket   (index, phase) for that request id, or none left
    worker -> master   loadlab_records  a batch of records with the worker's next sequence number
    master -> worker   loadlab_drain    stop users, send every record, then answer loadlab_drained
    worker -> master   loadlab_drained  the last sequence number sent
    worker <-> master  loadlab_ping / loadlab_pong / loadlab_clock   clock offset estimate at connect
    worker -> master   loadlab_failed   the worker cannot run (e.g. cannot reach the target)

A ticket is leased to a worker only when one of its users is waiting for it, so the tickets a worker holds
are exactly its requests in flight (or one just handed over): when a worker goes missing, the master counts
those as lost in flight and the run goes on. In open loop a ticket is handed over LEASE_AHEAD_S before it is
due, not earlier, so a worker that dies loses its requests in flight and at most that much of the arrivals
still to come (its users would otherwise hold tickets due minutes later). Every record is also written to the worker's spill file as it
completes; the master merges spill files it can reach when it finalizes, and ``loadlab report`` merges them
into a run directory whose master died.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import gevent
import orjson
from gevent.event import AsyncResult, Event
from locust.runners import STATE_MISSING

from loadlab import exits
from loadlab.load import Ticket
from loadlab.manifest import MANIFEST, LoadGenerator, Manifest, write_manifest
from loadlab.profile import ProfileError, validate_profile
from loadlab.records import (
    CANCELLED,
    MEASURE,
    SPILL_DIR,
    RecordWriter,
    RequestRecord,
    spill_name,
)
from loadlab.swarm.calibration import ClientMonitor
from loadlab.target.probe import TargetError, probe
from loadlab.workload import build_workload
from loadlab.workload.text import Renderer

log = logging.getLogger("loadlab")
# Open loop: how long before its due time a ticket goes to a worker (covers the hop and clock offsets).
LEASE_AHEAD_S = 0.5

DRAIN_TIMEOUT_S = 30.0  # how long the master waits for workers to send their last records
MASTER_LOST_S = 10.0  # a worker with no heartbeat from its master for this long stops and exits
CLOCK_PINGS = 5
CLOCK_WARN_S = 0.010  # worker clock offsets above this blur a cross-host timeline: warn


# ----------------------------------------------------------------------------------------------------------
# Master
# ----------------------------------------------------------------------------------------------------------
class Coordinator:
    """The master's side: leases tickets, collects records, watches workers, drains them at the end."""

    def __init__(self, environment):
        self.environment = environment
        self.runner = environment.runner
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
        for name, handler in (
            ("loadlab_want", self._on_want),
            ("loadlab_records", self._on_records),
            ("loadlab_drained", self._on_drained),
            ("loadlab_ping", self._on_ping),
            ("loadlab_clock", self._on_clock),
            ("loadlab_failed", self._on_failed),
        ):
            self.runner.register_message(name, handler)
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
        self.runner.send_message(
            "loadlab_run",
            {
                "run_id": run.run_id,
                "rid_prefix": run.rid_prefix,
                "profile": run.manifest.profile,
                "profile_path": run.manifest.profile_path,
                "target_url": self.target_url,
                "model": run.model,
                "manifest": run.manifest.model_dump(mode="json"),
            },
            client_id=worker,
        )

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
    def _on_want(self, environment, msg, **_kw) -> None:
        run = self.run
        if run is not None and (
            run.tickets.warmup_done.is_set() or run.tickets.next_index < run.tickets.warmup
        ):
            self._lease(msg.node_id, msg.data["id"])  # cannot block: answer now (a round trip per request)
        else:
            gevent.spawn(self._lease, msg.node_id, msg.data["id"])  # waits at the warm-up barrier

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
            self.leases[worker][ticket.index] = ticket.phase
        self.runner.send_message(
            "loadlab_ticket",
            {"id": request_id, "index": None if ticket is None else ticket.index,
             "phase": None if ticket is None else ticket.phase, "due": None if ticket is None else ticket.due},
            client_id=worker,
        )  # fmt: skip

    # -- records ----------------------------------------------------------------------------------------
    def _on_records(self, environment, msg, **_kw) -> None:
        worker, seq = msg.node_id, msg.data["seq"]
        expected = self.next_seq[worker]
        if seq != expected:
            self.gaps[worker] += max(seq - expected, 0)
            log.error("loadlab: worker %s: record batches %d..%d never arrived", worker, expected, seq - 1)
        self.next_seq[worker] = seq + 1
        run = self.run
        for row in orjson.loads(msg.data["records"]):
            rec = RequestRecord(**row)
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

    def _on_ping(self, environment, msg, **_kw) -> None:
        self.runner.send_message("loadlab_pong", {"t0": msg.data["t0"], "t_master": time.time()}, msg.node_id)

    def _on_clock(self, environment, msg, **_kw) -> None:
        self.clocks[msg.node_id] = msg.data
        offset = msg.data["clock_offset_s"]
        if abs(offset) > CLOCK_WARN_S:
            log.warning(
                "loadlab: worker %s's clock is %+.1f ms off the master's (round trip %.1f ms): cross-worker "
                "timelines blur by that much; synchronise clocks (NTP/chrony)",
                msg.node_id,
                offset * 1000,
                msg.data["rtt_s"] * 1000,
            )

    def _on_failed(self, environment, msg, **_kw) -> None:
        self.failure = f"worker {msg.node_id}: {msg.data['error']}"
        log.error("loadlab: %s", self.failure)
        environment.process_exit_code = exits.TARGET
        from loadlab.swarm.locustfile import end_run

        gevent.spawn(end_run, environment)

    def _on_drained(self, environment, msg, **_kw) -> None:
        self.drained[msg.node_id] = msg.data["last_seq"]
        if msg.data.get("calibration"):
            self.calibration[msg.node_id] = msg.data["calibration"]

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
        self.runner.send_message("loadlab_drain", {})
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


# ----------------------------------------------------------------------------------------------------------
# Worker
# ----------------------------------------------------------------------------------------------------------
class RemoteTickets:
    """A worker's tickets: each one asked of the master when a user needs it."""

    def __init__(self, runner):
        self.runner = runner
        self.waiting: dict[int, AsyncResult] = {}
        self.ids = itertools.count()
        self.exhausted = False
        self.measuring = False
        self.on_measure_start = None  # called once, with this worker's first measured ticket

    def take(self) -> Ticket | None:
        if self.exhausted:
            return None
        request_id = next(self.ids)
        result = self.waiting[request_id] = AsyncResult()
        self.runner.send_message("loadlab_want", {"id": request_id})
        try:
            ticket = result.get()
        finally:
            self.waiting.pop(request_id, None)
        if ticket is None:
            self.exhausted = True
        elif ticket.phase == MEASURE and not self.measuring:
            self.measuring = True
            if self.on_measure_start is not None:
                self.on_measure_start()
        return ticket


class WorkerRun:
    """The users' view of the run on a worker: what ``Run`` is in one process, with remote tickets and
    records shipped to the master (and spilled to a local file as they complete)."""

    def __init__(self, agent: WorkerAgent, data: dict[str, Any]):
        runner = agent.environment.runner
        self.agent = agent
        self.run_id = data["run_id"]
        self.profile = validate_profile(
            data["profile"], label=f"the master's profile ({data['profile_path']})"
        )
        self.api = self.profile.target.api
        self.model = data["model"]
        self.rid_prefix = data["rid_prefix"]
        self.worker_id = runner.client_id  # the id the master knows this worker by
        self.workload = build_workload(self.profile)
        self.renderer = Renderer(self.profile.target.tokenizer)
        self.tickets = RemoteTickets(runner)
        run_dir = Path(agent.out_root) / self.run_id
        (run_dir / SPILL_DIR).mkdir(parents=True, exist_ok=True)
        if not (run_dir / MANIFEST).exists():  # another host than the master's: make the spill reportable
            manifest = Manifest.model_validate({**data["manifest"], "spill_of_worker": self.worker_id})
            write_manifest(run_dir, manifest)
        self.spill = RecordWriter(run_dir / SPILL_DIR, spill_name(self.worker_id))
        self.pending: list[RequestRecord] = []
        self.seq = 0
        self.wake = Event()
        self.shipping = False
        self.monitor = ClientMonitor().start()
        self.tickets.on_measure_start = self.monitor.reset  # calibrate the measured phase only
        gevent.spawn(self._ship)

    def record(self, rec: RequestRecord) -> None:
        self.spill.write(rec)
        self.pending.append(rec)
        self.wake.set()

    def _ship(self) -> None:
        """Sends every pending record as one batch as soon as there is any (batches form by themselves
        when records complete together)."""
        runner = self.agent.environment.runner
        while True:
            self.wake.wait()
            self.wake.clear()
            while self.pending:
                batch, self.pending = self.pending, []
                self.shipping = True
                runner.send_message("loadlab_records", {"seq": self.seq, "records": orjson.dumps(batch)})
                self.shipping = False
                self.seq += 1

    def flushed(self) -> bool:
        return not self.pending and not self.shipping

    def close(self) -> None:
        self.monitor.stop()
        self.spill.close()


class WorkerAgent:
    """The worker's side of the protocol, set up at init."""

    def __init__(self, environment):
        self.environment = environment
        runner = environment.runner
        self.out_root = environment.parsed_options.out  # the worker's own --out (the master's differs later)
        self.run: WorkerRun | None = None
        self._pongs: list[tuple[float, float, float]] = []
        self.clock_offset_s = 0.0  # the master's clock minus this worker's (open-loop due times)
        for name, handler in (
            ("loadlab_run", self._on_run),
            ("loadlab_ticket", self._on_ticket),
            ("loadlab_drain", self._on_drain),
            ("loadlab_pong", self._on_pong),
        ):
            runner.register_message(name, handler)
        gevent.spawn(self._sync_clock)
        gevent.spawn(self._watch_master)

    def _on_run(self, environment, msg, **_kw) -> None:
        data = msg.data
        try:
            probe(data["target_url"], need_model=False)
            self.run = WorkerRun(self, data)
        except (TargetError, ProfileError, OSError, ValueError) as e:
            self._fail(str(e))
            return
        environment.host = data["target_url"]
        environment.loadlab_run = self.run
        log.info(
            "loadlab: worker %s joins run %s against %s",
            self.run.worker_id,
            data["run_id"],
            data["target_url"],
        )

    def _fail(self, error: str) -> None:
        print(f"loadlab: worker {self.environment.runner.client_id}: {error}", file=sys.stderr, flush=True)
        self.environment.runner.send_message("loadlab_failed", {"error": error})
        self.environment.process_exit_code = exits.TARGET

    def _on_ticket(self, environment, msg, **_kw) -> None:
        run = self.run
        if run is None:
            return
        data = msg.data
        due = data.get("due")
        if due is not None:  # the master's clock, to this worker's
            due -= self.clock_offset_s
        ticket = None if data["index"] is None else Ticket(data["index"], data["phase"], due)
        waiter = run.tickets.waiting.get(data["id"])
        if waiter is not None:
            waiter.set(ticket)
        elif ticket is not None:  # the user stopped while waiting: the ticket still needs its one record
            run.record(
                RequestRecord(
                    index=ticket.index,
                    phase=ticket.phase,
                    api=run.api,
                    worker_id=run.worker_id,
                    user_id=-1,
                    t_send_wall=time.time(),
                    outcome=CANCELLED,
                    error="the run stopped before the request was sent",
                )  # fmt: skip
            )

    def _on_drain(self, environment, msg, **_kw) -> None:
        gevent.spawn(self._drain)

    def _drain(self) -> None:
        runner = self.environment.runner
        calibration = self.run.monitor.stop() if self.run is not None else None
        runner.user_greenlets.kill(block=True, timeout=10)  # in-flight requests end as cancelled records
        run = self.run
        if run is None:
            runner.send_message("loadlab_drained", {"last_seq": -1})
            return
        while not run.flushed():
            gevent.sleep(0.01)
        runner.send_message("loadlab_drained", {"last_seq": run.seq - 1, "calibration": calibration})

    def _sync_clock(self) -> None:
        """NTP-style: the master's clock minus ours at the midpoint of the fastest of a few round trips."""
        runner = self.environment.runner
        for _ in range(CLOCK_PINGS):
            runner.send_message("loadlab_ping", {"t0": time.time()})
            gevent.sleep(0.2)
        if not self._pongs:
            return
        t0, t_master, t1 = min(self._pongs, key=lambda p: p[2] - p[0])
        self.clock_offset_s = t_master - (t0 + t1) / 2
        runner.send_message(
            "loadlab_clock",
            {"clock_offset_s": t_master - (t0 + t1) / 2, "rtt_s": t1 - t0, "host": socket.gethostname(),
             "pid": os.getpid()},
        )  # fmt: skip

    def _on_pong(self, environment, msg, **_kw) -> None:
        self._pongs.append((msg.data["t0"], msg.data["t_master"], time.time()))

    def _watch_master(self) -> None:
        """Locust waits 60 s for a silent master; a load generator should not run that long blind."""
        runner = self.environment.runner
        while True:
            gevent.sleep(1.0)
            last = runner.last_heartbeat_timestamp
            if last is None or time.time() - last < MASTER_LOST_S:
                continue
            where = f"; its records are in {self.run.spill.path}" if self.run is not None else ""
            log.error("loadlab: no heartbeat from the master for %.0f s: stopping%s", MASTER_LOST_S, where)
            runner.user_greenlets.kill(block=True, timeout=10)
            if self.run is not None:
                self.run.close()
            self.environment.process_exit_code = 1
            runner.quit()
            return
