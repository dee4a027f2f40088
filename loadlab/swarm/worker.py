"""A Locust worker's side of a distributed run (the protocol: ``loadlab.swarm.messages``): remote tickets,
records spilled to a local file and shipped to the master, the clock offset, the master's heartbeat."""

from __future__ import annotations

import itertools
import logging
import math
import os
import socket
import sys
import time
from collections import deque
from pathlib import Path

import gevent
from gevent import GreenletExit
from gevent.event import Event

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
from loadlab.swarm.options import DEFAULT_MASTER_LOST_S
from loadlab.target.probe import TargetError, probe
from loadlab.workload import build_workload
from loadlab.workload.text import Renderer

log = logging.getLogger("loadlab")
CLOCK_PINGS = 5  # round trips the clock estimate takes the fastest of
CLOCK_PINGS_MAX = 150  # pings sent at most (0.2 s apart) while the master is not answering yet


class RemoteTickets:
    """A worker's tickets: a small stock leased from the master in blocks, which users take from without a
    round trip. One ask is outstanding at a time; it goes out when the stock falls below its low-water mark
    (closed loop: a ticket for every user plus the takes of two round trips) and asks for twice the mark
    plus the users already waiting. In open loop the worker asks only
    for its waiting users, so a ticket always goes to a free user (it is handed over at most LEASE_AHEAD_S
    before it is due) and no ticket waits in the stock of a busy worker while another has free users.

    A ticket taken from the stock is reported to the master in the worker's next RecordBatch, and ``take``
    returns only once that batch is on the wire: a request never reaches the server before the master
    knows it may have."""

    EXPIRE_EVERY_S = 1.0

    def __init__(self, run: WorkerRun, runner, open_loop: bool):
        self.run = run
        self.runner = runner
        self.open_loop = open_loop
        self.stock: deque[tuple[Ticket, float]] = deque()  # (ticket, last start time on this worker's clock)
        self.ids = itertools.count()
        self.asking: int | None = None  # the outstanding ask's id
        self.asked_at = 0.0
        self.done = False  # the master has no ticket left and none can come back
        self.exhausted = False
        self.stopped = False  # the run is draining or over: nothing more is taken, the stock goes back
        self.waiting = 0  # users waiting for a ticket
        self.arrived = Event()  # replaced by a new one each time a block arrives (its waiters look again)
        self.measuring = False
        self.on_measure_start = None  # called once, with this worker's first measured ticket
        self.rtt_s = 0.010  # an ask's round trip (moving average)
        self.rate = 0.0  # tickets taken per second (moving average)
        self._window = (time.monotonic(), 0)
        self.takes = self.asks = 0
        self.measured_takes = 0
        self.empty_takes = 0  # of those, takes that found the stock empty (waited for a block)
        self.reports: dict[int, Event] = {}  # a ticket taken -> set once its start is reported to the master
        self.report_wait_s = 0.0  # time users waited for that before sending, in the measured phase
        self.ticket_wait_s = 0.0
        gevent.spawn(self._expire_loop)

    # -- users ------------------------------------------------------------------------------------------
    def take(self) -> Ticket | None:
        """The next ticket (waits while the stock is empty and more may come), or None: no ticket is left."""
        t0 = time.perf_counter()
        before_barrier = not self.measuring
        empty = False
        while True:
            ticket = self._pop()
            if ticket is not None:
                break
            if self.done or self.stopped:
                self.exhausted = True
                return None
            empty = True
            arrived = self.arrived
            self.waiting += 1
            try:
                self._refill()
                arrived.wait()
            finally:
                self.waiting -= 1
        # The master learns of this start before the request goes out (a dead worker's unstarted tickets
        # are leased again: a started one must never be): ``before_send`` waits for the report.
        self.reports[ticket.index] = self.run.note_started(ticket.index)
        try:
            self._refill()
        except GreenletExit:  # the user was stopped holding it: its indices still need their one record
            self.reports.pop(ticket.index, None)
            self.run.unsent(ticket)
            raise
        self._count(ticket, time.perf_counter() - t0, before_barrier, empty)
        return ticket

    def before_send(self, index: int) -> None:
        """Waits until the batch that reports ticket ``index`` as started is on the wire (usually long
        since: the user built its request meanwhile)."""
        reported = self.reports.pop(index, None)
        if reported is None or reported.is_set():
            return
        t0 = time.perf_counter()
        reported.wait()
        if self.measuring:
            self.report_wait_s += time.perf_counter() - t0

    def _pop(self) -> Ticket | None:
        expired = []
        ticket = None
        now = time.time()
        while self.stock:
            candidate, last_start = self.stock.popleft()
            if now < last_start:
                ticket = candidate
                break
            expired.append(candidate)
        if expired:
            self._give_back(expired)
        return ticket

    def _count(self, ticket: Ticket, waited_s: float, before_barrier: bool, empty: bool) -> None:
        self.takes += 1
        if ticket.phase == MEASURE:
            if not self.measuring:
                self.measuring = True
                self._window = (time.monotonic(), 0)  # the barrier's pause is no rate
                if self.on_measure_start is not None:
                    self.on_measure_start()
            if not before_barrier:
                self.measured_takes += 1
                self.ticket_wait_s += waited_s
                self.empty_takes += empty
        start, count = self._window
        now = time.monotonic()
        if now - start >= 0.25:
            self.rate = 0.5 * self.rate + 0.5 * (count + 1) / (now - start)
            self._window = (now, 0)
        else:
            self._window = (start, count + 1)

    # -- the master ---------------------------------------------------------------------------------------
    def marks(self) -> tuple[int, int]:
        """(low-water mark, refill): the stock to keep beyond the users waiting, and to ask up to. The mark
        is a ticket for every user (closed-loop users tend to finish in waves: all of them may come for
        their next ticket while an ask is out) plus the takes of two round trips (a busy machine's round
        trip is tens of ms, and varies); a refill is twice the mark, so each ask brings a block of at least
        the mark. Measured at 8 workers x 64 users on 2 shared cores: a mark of at most the users left
        waves of 10-40 users waiting up to 140 ms for a block (bench/RESULTS.md)."""
        if self.open_loop:
            return 0, 0
        users = max(1, self.runner.user_count)
        ahead = 2.0 * self.rate * self.rtt_s  # takes during two round trips
        low = users + math.ceil(ahead)
        return low, 2 * low

    def _refill(self) -> None:
        if self.asking is not None or self.done or self.stopped:
            return
        low, refill = self.marks()
        have = len(self.stock)
        if have >= low + self.waiting:
            return
        self.asking = next(self.ids)
        self.asked_at = time.monotonic()
        self.asks += 1
        WantTickets(id=self.asking, n=self.waiting + refill - have).send(self.runner)

    def on_block(self, block: TicketBlock, clock_offset_s: float) -> None:
        tickets = block.decoded(clock_offset_s)
        if block.id == self.asking:
            self.asking = None
            sample = min(time.monotonic() - self.asked_at, 0.25)  # a held ask (the barrier) is no round trip
            self.rtt_s = 0.8 * self.rtt_s + 0.2 * sample
        if block.done:
            self.done = True
        if self.stopped:
            self._give_back(tickets)
            return
        last_start = block.valid_until - clock_offset_s - LEASE_GUARD_S
        self.stock.extend((t, last_start) for t in tickets)
        arrived, self.arrived = self.arrived, Event()
        arrived.set()
        self._refill()  # users may have come to wait while the ask was out

    def stop(self) -> None:
        """The run is draining: no more takes; the stock goes back to the master."""
        self.stopped = True
        self._give_back([t for t, _ in self.stock])
        self.stock.clear()
        arrived, self.arrived = self.arrived, Event()
        arrived.set()

    def _give_back(self, tickets: list[Ticket]) -> None:
        if tickets:
            ReturnTickets(indices=[t.index for t in tickets]).send(self.runner)

    def _expire_loop(self) -> None:
        """Returns stock whose lease has expired even when no user takes from it (the users were stopped)."""
        while not self.stopped:
            gevent.sleep(self.EXPIRE_EVERY_S)
            now = time.time()
            expired = []
            while self.stock and self.stock[0][1] <= now:
                expired.append(self.stock.popleft()[0])
            self._give_back(expired)


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
        self.tickets = RemoteTickets(self, runner, open_loop=profile.load.model == "open")
        run_dir = Path(agent.out_root) / self.run_id
        (run_dir / SPILL_DIR).mkdir(parents=True, exist_ok=True)
        if not (run_dir / MANIFEST).exists():  # another host than the master's: make the spill reportable
            manifest = Manifest.model_validate({**info.manifest, "spill_of_worker": self.worker_id})
            write_manifest(run_dir, manifest)
        self.spill = RecordWriter(run_dir / SPILL_DIR, spill_name(self.worker_id))
        self.pending: list[RequestRecord] = []
        self.starts: list[int] = []  # tickets handed to users, not yet reported to the master
        self.next_flush = Event()  # set once the batch carrying the starts noted so far is on the wire
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

    def note_started(self, index: int) -> Event:
        """A user took ticket ``index``: it goes to the master in the next batch; the Event is set once that
        batch is on the wire."""
        self.starts.append(index)
        self.wake.set()
        return self.next_flush

    def _ship(self) -> None:
        """Sends every pending record, and every ticket started, as one batch as soon as there is any
        (batches form by themselves when records complete together; in a closed loop a user takes its next
        ticket right after its record, so the two travel together)."""
        runner = self.agent.environment.runner
        while True:
            self.wake.wait()
            self.wake.clear()
            while self.pending or self.starts:
                batch, self.pending = self.pending, []
                starts, self.starts = self.starts, []
                flushed, self.next_flush = self.next_flush, Event()
                self.shipping = True
                try:
                    RecordBatch.of(self.seq, batch, starts).send(runner)
                finally:
                    self.shipping = False
                    flushed.set()
                self.seq += 1

    def unsent(self, ticket: Ticket) -> None:
        """Records a ticket's every index as cancelled before it was sent."""
        for index in range(ticket.index, ticket.index + ticket.turns):
            self.record(
                RequestRecord(
                    index=index,
                    phase=ticket.phase,
                    api=self.api,
                    worker_id=self.worker_id,
                    user_id=-1,
                    t_send_wall=time.time(),
                    outcome=CANCELLED,
                    error="the run stopped before the request was sent",
                )  # fmt: skip
            )

    def flushed(self) -> bool:
        return not self.pending and not self.starts and not self.shipping

    def close(self) -> None:
        self.tickets.stopped = True
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
        self._clock_reported = False
        self.clock_offset_s = 0.0  # the master's clock minus this worker's (open-loop due times)
        listen(
            runner,
            {
                RunInfo: self._on_run,
                TicketBlock: self._on_tickets,
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

    def _on_tickets(self, _master: str, block: TicketBlock) -> None:
        run = self.run
        if run is None:  # cannot happen (the run comes first); the tickets must not stay out
            ReturnTickets(indices=[t[0] for t in block.tickets]).send(self.environment.runner)
            return
        run.tickets.on_block(block, self.clock_offset_s)  # due times on this worker's clock

    def _on_drain(self, _master: str, _drain: Drain) -> None:
        gevent.spawn(self._drain)

    def _drain(self) -> None:
        runner = self.environment.runner
        self._report_clock()  # before Drained: the master finalizes on it
        calibration = self.run.monitor.stop() if self.run is not None else None
        runner.user_greenlets.kill(block=True, timeout=10)  # in-flight requests end as cancelled records
        run = self.run
        if run is None:
            Drained(last_seq=-1).send(runner)
            return
        tickets = run.tickets
        tickets.stop()  # the unused stock goes back (the master counts it as never handed out)
        while not run.flushed():
            gevent.sleep(0.01)
        Drained(last_seq=run.seq - 1, calibration=calibration, takes=tickets.measured_takes,
                ticket_wait_s=tickets.ticket_wait_s + tickets.report_wait_s, asks=tickets.asks, empty_takes=tickets.empty_takes).send(runner)  # fmt: skip

    def _sync_clock(self) -> None:
        """NTP-style: the master's clock minus ours at the midpoint of the fastest of a few round trips."""
        runner = self.environment.runner
        # Until CLOCK_PINGS came back: a ping that reaches a master still starting (its target, say) is
        # dropped unanswered.
        for _ in range(CLOCK_PINGS_MAX):
            if len(self._pongs) >= CLOCK_PINGS or self._clock_reported:
                break
            Ping(t0=time.time()).send(runner)
            gevent.sleep(0.2)
        self._report_clock()

    def _report_clock(self) -> None:
        """Sends the estimate once, from the pongs so far (also from the drain: a run shorter than the
        pings still gets every worker's clock into its manifest)."""
        if self._clock_reported or not self._pongs:
            return
        self._clock_reported = True
        t0, t_master, t1 = min(self._pongs, key=lambda p: p[2] - p[0])
        self.clock_offset_s = t_master - (t0 + t1) / 2
        ClockReport(
            clock_offset_s=self.clock_offset_s, rtt_s=t1 - t0, host=socket.gethostname(), pid=os.getpid()
        ).send(self.environment.runner)

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
