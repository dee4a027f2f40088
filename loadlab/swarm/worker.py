"""A Locust worker's side of a distributed run (the protocol: ``loadlab.swarm.messages``): remote tickets,
records spilled to a local file and shipped to the master, the clock offset, the master's heartbeat."""

from __future__ import annotations

import itertools
import logging
import os
import socket
import sys
import time
from pathlib import Path

import gevent
from gevent.event import AsyncResult, Event

from loadlab import exits
from loadlab.load import Ticket
from loadlab.manifest import MANIFEST, Manifest, write_manifest
from loadlab.profile import Profile, ProfileError, api_key_source, read_api_key, validate_profile
from loadlab.records import (
    CANCELLED,
    MEASURE,
    SPILL_DIR,
    RecordWriter,
    RequestRecord,
    spill_name,
)
from loadlab.swarm.calibration import ClientMonitor
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
from loadlab.swarm.options import DEFAULT_MASTER_LOST_S
from loadlab.target.probe import TargetError, probe
from loadlab.workload import build_workload
from loadlab.workload.text import Renderer

log = logging.getLogger("loadlab")
CLOCK_PINGS = 5


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
        WantTicket(id=request_id).send(self.runner)
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

    def __init__(self, agent: WorkerAgent, info: RunInfo, profile: Profile, api_key: str | None):
        runner = agent.environment.runner
        self.agent = agent
        self.run_id = info.run_id
        self.profile = profile
        # This worker's own: every load generator reads the key from its environment or file; the master
        # never sends it (Locust's master-worker channel is not encrypted).
        self.api_key = api_key
        self.api = self.profile.target.api
        self.model = info.model
        self.rid_prefix = info.rid_prefix
        self.worker_id = runner.client_id  # the id the master knows this worker by
        self.workload = build_workload(self.profile)
        self.renderer = Renderer(self.profile.target.tokenizer)
        self.tickets = RemoteTickets(runner)
        run_dir = Path(agent.out_root) / self.run_id
        (run_dir / SPILL_DIR).mkdir(parents=True, exist_ok=True)
        if not (run_dir / MANIFEST).exists():  # another host than the master's: make the spill reportable
            manifest = Manifest.model_validate({**info.manifest, "spill_of_worker": self.worker_id})
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
                RecordBatch.of(self.seq, batch).send(runner)
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
        listen(
            runner,
            {
                RunInfo: self._on_run,
                TicketReply: self._on_ticket,
                Drain: self._on_drain,
                Pong: self._on_pong,
            },
        )
        gevent.spawn(self._sync_clock)
        gevent.spawn(self._watch_master)

    def _on_run(self, _master: str, info: RunInfo) -> None:
        environment = self.environment
        try:
            label = f"the master's profile ({info.profile_path})"
            profile = validate_profile(info.profile, label=label)
            api_key = read_api_key(profile.target, label)
            probe(
                info.target_url, need_model=False, api_key=api_key, key_source=api_key_source(profile.target)
            )
            self.run = WorkerRun(self, info, profile, api_key)
        except (TargetError, ProfileError, OSError, ValueError) as e:
            self._fail(str(e))
            return
        environment.host = info.target_url
        environment.loadlab.run = self.run
        log.info(
            "loadlab: worker %s joins run %s against %s",
            self.run.worker_id,
            info.run_id,
            info.target_url,
        )

    def _fail(self, error: str) -> None:
        print(f"loadlab: worker {self.environment.runner.client_id}: {error}", file=sys.stderr, flush=True)
        Failed(error=error).send(self.environment.runner)
        self.environment.process_exit_code = exits.TARGET

    def _on_ticket(self, _master: str, reply: TicketReply) -> None:
        run = self.run
        if run is None:
            return
        ticket = reply.ticket(self.clock_offset_s)  # the due time on this worker's clock
        waiter = run.tickets.waiting.get(reply.id)
        if waiter is not None:
            waiter.set(ticket)
        elif ticket is not None:  # the user stopped while waiting: each index still needs its one record
            for index in range(ticket.index, ticket.index + ticket.turns):
                run.record(
                    RequestRecord(
                        index=index,
                        phase=ticket.phase,
                        api=run.api,
                        worker_id=run.worker_id,
                        user_id=-1,
                        t_send_wall=time.time(),
                        outcome=CANCELLED,
                        error="the run stopped before the request was sent",
                    )  # fmt: skip
                )

    def _on_drain(self, _master: str, _drain: Drain) -> None:
        gevent.spawn(self._drain)

    def _drain(self) -> None:
        runner = self.environment.runner
        calibration = self.run.monitor.stop() if self.run is not None else None
        runner.user_greenlets.kill(block=True, timeout=10)  # in-flight requests end as cancelled records
        run = self.run
        if run is None:
            Drained(last_seq=-1).send(runner)
            return
        while not run.flushed():
            gevent.sleep(0.01)
        Drained(last_seq=run.seq - 1, calibration=calibration).send(runner)

    def _sync_clock(self) -> None:
        """NTP-style: the master's clock minus ours at the midpoint of the fastest of a few round trips."""
        runner = self.environment.runner
        for _ in range(CLOCK_PINGS):
            Ping(t0=time.time()).send(runner)
            gevent.sleep(0.2)
        if not self._pongs:
            return
        t0, t_master, t1 = min(self._pongs, key=lambda p: p[2] - p[0])
        self.clock_offset_s = t_master - (t0 + t1) / 2
        ClockReport(
            clock_offset_s=t_master - (t0 + t1) / 2, rtt_s=t1 - t0, host=socket.gethostname(), pid=os.getpid()
        ).send(runner)

    def _on_pong(self, _master: str, pong: Pong) -> None:
        self._pongs.append((pong.t0, pong.t_master, time.time()))

    def _watch_master(self) -> None:
        """Locust waits 60 s for a silent master; a load generator should not run that long blind."""
        runner = self.environment.runner
        lost_s = getattr(self.environment.parsed_options, "master_lost_s", DEFAULT_MASTER_LOST_S)
        while True:
            gevent.sleep(1.0)
            last = runner.last_heartbeat_timestamp
            if last is None or time.time() - last < lost_s:
                continue
            where = f"; its records are in {self.run.spill.path}" if self.run is not None else ""
            log.error("loadlab: no heartbeat from the master for %g s: stopping%s", lost_s, where)
            runner.user_greenlets.kill(block=True, timeout=10)
            if self.run is not None:
                self.run.close()
            self.environment.process_exit_code = exits.PARTIAL
            runner.quit()
            return
