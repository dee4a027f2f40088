"""The twin in virtual time: the same scheduler as the server, on a simulated clock, with a client model.

``run_virtual(profile, sim_settings, out_root)`` runs a profile's requests (``build_workload(profile)``,
token ids as the native API sends them; a conversation's turns with their session's history, the twin's
replies fed back) against the twin and writes the same run directory a real run writes:
``records.jsonl`` / ``records.parquet`` (one ``RequestRecord`` per request, times from the simulated
clock), ``manifest.json`` (a ``Manifest`` as ``loadlab run`` writes it, plus ``virtual: true``, the twin's
settings and ``virtual_stats``) and ``summary.json`` / ``summary.md``. ``loadlab report`` works on it unchanged.

Client models (``profile.load``):

- closed loop: ``concurrency`` requests in flight; a new one is sent the moment one finishes. A
  conversation's user holds a whole session: its next turn goes out ``think_time_s`` after a reply ends.
- open loop: requests arrive at ``rate`` per second (Poisson or constant spacing: ``loadlab.load``'s
  arrivals, the same due times as a real run), whatever the server does; with an explicit ``concurrency`` at most that many are in flight
  (later arrivals wait client-side, as bench_serving's ``--max-concurrency``; ``t_scheduled_wall`` is when
  a send was due). A conversation's sessions arrive at ``rate``, and the cap counts sessions.

Warm-up then measured, as a real run: indices ``0..warmup-1`` are warm-up; measured requests are sent only
once every warm-up request has finished (the open-loop arrival clock starts again at that moment).

Token events honour ``stream_interval`` as the server does: the first token at once, then one event per
``stream_interval`` tokens, and the rest at the end. There is no network and no client overhead: a
request's send time is its arrival time at the server.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import random
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadlab.analysis.report import write_report
from loadlab.cluster.config import flatten_overrides, load_cluster, worker_settings
from loadlab.cluster.policies import (
    DEFAULT_CLASS,
    Snapshot,
    WorkerLoad,
    class_districts,
    class_of,
    in_flight_limit,
    next_in_line,
)
from loadlab.cluster.policies import POLICIES as OMNI_POLICIES
from loadlab.load import describe_load, tickets_for
from loadlab.manifest import (
    ClusterDistrictInfo,
    ClusterInfo,
    ClusterWorkerInfo,
    Counts,
    Manifest,
    TargetInfo,
    VirtualStats,
    software_versions,
    write_manifest,
)
from loadlab.profile import CLUSTER_OVERRIDES, Profile
from loadlab.records import (
    HTTP_ERROR,
    MEASURE,
    OK,
    REJECTED,
    STATUS_FRONT,
    STATUS_WORKER,
    STREAM_ERROR,
    RequestRecord,
    default_run_name,
    unique_run_name,
    write_records,
)
from loadlab.sim import SIM_VERSION
from loadlab.sim.clock import output_ids_for, quantize, token_events
from loadlab.sim.cost import cost_model
from loadlab.sim.radix import RadixCache
from loadlab.sim.scheduler import DONE, Request, RequestTooLargeError, Scheduler, UnavailableError
from loadlab.sim.settings import TwinSettings, engine_config, resolve_settings
from loadlab.workload import Dialogue, build_workload, get_renderer, workload_source

WORKER_ID = "virtual"


class _Spec:
    """A request spec as the twin needs it: the prompt the native API would send (a conversation's turn: with
    the session's history, ``loadlab.workload.Dialogue``), the deterministic output ids."""

    __slots__ = (
        "ignore_eos",
        "input_len",
        "max_new_tokens",
        "output_ids",
        "prefix_group",
        "prompt",
        "request_class",
        "priority",
        "session",
        "turn",
    )

    def __init__(self, spec, prompt: list[int]):
        self.prompt = prompt
        self.input_len = len(self.prompt)
        self.max_new_tokens = spec.max_new_tokens
        self.prefix_group = spec.prefix_group
        self.request_class = spec.request_class
        self.priority = spec.priority
        self.ignore_eos = spec.ignore_eos
        self.session = spec.session
        self.turn = spec.turn
        self.output_ids = output_ids_for(self.prompt, self.max_new_tokens)


class _Specs:
    """``build_workload(profile).spec(i)``, converted once and kept: a sweep that runs the same profile at
    several settings generates each request only once per process. The prompt is rendered as the native API
    sends it (``Renderer.token_ids``), so the twin sees the ids it sees over HTTP: the same outputs and, with
    ``--eos-len-dist``, the same lengths, request by request."""

    def __init__(self, profile: Profile):
        self.workload = build_workload(profile)
        self.renderer = get_renderer(profile.target.tokenizer)
        self._cache: dict[int, _Spec] = {}
        self._raw: dict[int, Any] = {}

    def get(self, index: int) -> _Spec:
        s = self._cache.get(index)
        if s is None:
            spec = self.workload.spec(index)
            s = self._cache[index] = _Spec(spec, self._native_ids(spec))
        return s

    def _native_ids(self, spec) -> list[int]:
        """The ids the twin sees over HTTP: a replayed prompt's own (the target's token ids, or its text as the
        twin tokenizes it: ``spec.input_ids`` as counted), a generated prompt's word ids rendered as the native
        API sends them."""
        if spec.raw_ids or spec.text is not None or spec.messages is not None:
            return list(spec.input_ids)
        return self.renderer.token_ids(spec.input_ids)

    def raw(self, index: int):
        """``workload.spec(index)`` itself (kept)."""
        spec = self._raw.get(index)
        if spec is None:
            spec = self._raw[index] = self.workload.spec(index)
        return spec

    def turn(self, index: int, dialogue: Dialogue) -> _Spec:
        """A conversation's turn, with its session's history (not kept: it depends on the replies)."""
        spec = self.raw(index)
        return _Spec(spec, dialogue.prompt(spec).fields["input_ids"])


_SPECS: dict[str, _Specs] = {}


def _specs_for(profile: Profile) -> _Specs:
    # Everything build_workload reads: the classes too (their shares, workloads and carry: two profiles with
    # the same workload but other classes must not share specs).
    # The prompts are rendered by the target's tokenizer; a dataset's prompts also depend on the tokenizer
    # that counts them and the API they are sent on.
    key = json.dumps([profile.model_dump(mode="json", include={"seed", "workload", "classes", "requests"}),
                      profile.target.tokenizer, profile.target.api], sort_keys=True)  # fmt: skip
    specs = _SPECS.get(key)
    if specs is None:
        while len(_SPECS) >= 4:
            _SPECS.pop(next(iter(_SPECS)))
        specs = _SPECS[key] = _Specs(profile)
    return specs


class _Worker:
    """One simulated GPU of a virtual run: its scheduler, and the pass it is running (if any)."""

    __slots__ = ("cost", "end", "it", "name", "routed", "sched", "settings")

    def __init__(self, name: str, settings: TwinSettings):
        self.name = name
        self.settings = settings
        cfg = engine_config(settings, record_token_times=True)
        self.cost = cost_model(cfg.gpu, cfg.model, cfg.tp_size)
        self.sched = Scheduler(cfg, self.cost)
        self.it = None  # the pass in progress
        self.end = 0.0  # when it ends
        self.routed = 0  # requests the front sent here

    @property
    def load(self) -> int:
        """Requests on the worker (running or waiting): what a front counts."""
        return len(self.sched.running) + len(self.sched.waiting)


class VirtualRun:
    """One simulation: one or more schedulers (a cluster's workers behind a front policy), a workload and a
    client model, on one simulated clock."""

    def __init__(
        self,
        profile: Profile,
        settings: TwinSettings | list[TwinSettings],
        run_id: str = "virtual",
        epoch: float = 0.0,
        front: FrontSpec | None = None,
        names: list[str] | None = None,
    ):
        self.profile = profile
        many = settings if isinstance(settings, list) else [settings]
        names = names or ([f"virtual-{i}" for i in range(len(many))] if len(many) > 1 else [WORKER_ID])
        self.workers = [_Worker(name, s) for name, s in zip(names, many, strict=True)]
        self.settings = many[0]
        self.front = make_front(front or FrontSpec(), self.workers, profile.seed)
        # The front's queues, one per class it serves: (index, phase, t, due) each.
        self._front_queues: dict[str, deque[tuple[int, str, float, float | None]]] = {}
        self.specs = _specs_for(profile)
        self.run_id = run_id
        self.epoch = epoch
        self.api = profile.target.api
        load = profile.load
        self.open_loop = load.model == "open"
        self.cap = load.concurrency  # None: an open loop without a cap
        # The real run's tickets and arrivals, on the virtual clock: the same indices, phases and due times.
        self.tickets = tickets_for(profile, self.specs.workload)  # a trace's arrivals come from its workload
        self.records: list[RequestRecord] = []
        self.outcomes: dict[str, int] = {}
        self.queue_delays_ms: list[float] = []
        # Tickets being served: from the first send to the last turn's end (a conversation's session holds its
        # user while it thinks, as in Locust); the open loop's cap counts them.
        self.holding = 0
        self._ends: dict[int, int] = {}  # a ticket's index in progress -> the end of its ticket
        self.conversation = profile.conversation
        self._turns = profile.session_turns
        self._dialogues: dict[int, Dialogue] = {}  # a session in progress -> its history
        self._live: dict[int, _Spec] = {}  # a conversation's turn in progress -> its spec, with its history
        self._heap: list[tuple[float, int, int, str, float | None]] = []  # (send, seq, index, phase, due)
        self._seq = 0
        # Open loop over the concurrency cap: (index, phase, due) waiting client-side.
        self._waiting_sends: deque[tuple[int, str, float]] = deque()
        self._free_slots: list[int] = []
        self._slot_of: dict[int, int] = {}
        self.t = 0.0
        self.measure_start: float | None = None

    # -- the client ---------------------------------------------------------------------------------------
    def _push(self, t: float, index: int, phase: str, due: float | None) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, index, phase, due))

    def _schedule_open(self, now: float) -> None:
        """Open loop: every ticket available now is pushed at its due time."""
        while (ticket := self.tickets.take_ready(now)) is not None:
            self._ends[ticket.index] = ticket.index + ticket.turns
            self._push(max(ticket.due, now), ticket.index, ticket.phase, ticket.due)

    def start(self) -> None:
        if self.tickets.warmup == 0:
            self.measure_start = 0.0
        if self.open_loop:
            self._schedule_open(0.0)
        else:
            self._free_slots = list(range(self.cap or 1))[::-1]
            self._fill_slots(0.0)

    def _fill_slots(self, now: float) -> None:
        while self._free_slots:
            ticket = self.tickets.take_ready(now)
            if ticket is None:
                return
            self._slot_of[ticket.index] = self._free_slots.pop()
            self._ends[ticket.index] = ticket.index + ticket.turns
            self._push(now, ticket.index, ticket.phase, None)

    def _spec(self, index: int) -> _Spec:
        """The spec of a request being sent; a conversation's turn has its session's history."""
        if not self.conversation:
            return self.specs.get(index)
        live = self._live.get(index)
        if live is None:
            session = index // self._turns
            dialogue = self._dialogues.get(session)
            if dialogue is None:
                dialogue = self._dialogues[session] = Dialogue("generate", self.specs.renderer)
            live = self._live[index] = self.specs.turn(index, dialogue)
        return live

    def _send(self, t: float, index: int, phase: str, due: float | None) -> None:
        # A ticket starts at a session's first turn (a multiple of turns); its later turns never wait for the
        # cap: the session holds its user until its last turn ends.
        if index % self._turns == 0:
            if self.open_loop and self.cap is not None and self.holding >= self.cap:
                self._waiting_sends.append((index, phase, due if due is not None else t))
                return
            self.holding += 1
        spec = self._spec(index)
        cls = self.front.queue_key(spec)
        if cls is None:  # no district serves its class: the front's 400
            self._record_rejected(
                index, phase, t, due, spec, 400, f"no district serves class {spec.request_class!r}"
            )
            self._on_done(t, index, phase)
            return
        queue = self._front_queues.setdefault(cls, deque())
        # First in line (nothing of its class waiting) it may take room now, its own districts' or by the
        # switch rule a switch district's; behind others it joins the line (its own districts have no room
        # then: the queue is drained whenever room appears), and the line's head may switch (as omni).
        first = not queue
        chosen = self.front.choose(spec, t, in_line=len(queue) + 1, switch=first)
        if chosen is None:  # no worker has room: the request waits at the front, or is refused
            entry = (index, phase, t, due)
            queue.append(entry)
            if not first and self.front.switches(cls):
                self._drain_class(cls, t, switch=True)
            if len(queue) > self.front.queue_size:
                queue.remove(entry)
                self._record_rejected(index, phase, t, due, spec, 429,
                                      f"class {cls!r}: the front's queue is full ({len(queue)} waiting)")  # fmt: skip
                self._on_done(t, index, phase)
            return
        self._dispatch(t, index, phase, due, spec, self.workers[chosen])

    def _dispatch(self, t: float, index: int, phase: str, due: float | None, spec, worker: _Worker) -> None:
        worker.routed += 1
        req = Request(
            f"{self.run_id}-{index}",
            spec.prompt,
            spec.max_new_tokens,
            output_ids=spec.output_ids,
            ignore_eos=spec.ignore_eos,
            stream_interval=worker.settings.stream_interval,
            priority=spec.priority,  # the body's priority field (the profile's classes[].carry.priority)
        )
        req.handle = (index, phase, t, due, spec, worker)
        try:
            displaced = worker.sched.add_request(req, t)
        except (UnavailableError, RequestTooLargeError) as e:
            status = 503 if isinstance(e, UnavailableError) else 400
            self._record_failure(index, phase, t, due, spec, status, str(e), worker)
            self.front.finished(self.workers.index(worker))
            self._on_done(t, index, phase)
            return
        if displaced is not None:  # a higher-priority request took its place in the worker's full queue
            self._record_dropped(displaced, t)

    def _drain_front_queue(self, now: float) -> None:
        """A worker has room again: each class's waiting requests go out in order while they can, every
        class to its own districts first, then by the switch (as omni's ``_pump``)."""
        for cls in self._front_queues:
            self._drain_class(cls, now, switch=False)
        for cls in self._front_queues:
            if self.front.switches(cls):
                self._drain_class(cls, now, switch=True)

    def _drain_class(self, cls: str, now: float, switch: bool) -> None:
        queue = self._front_queues[cls]
        while queue:
            index, phase, t, due = queue[0]
            spec = self._spec(index)
            chosen = self.front.choose(spec, now, in_line=len(queue), switch=switch)
            if chosen is None:
                break
            queue.popleft()
            self._dispatch(t, index, phase, due, spec, self.workers[chosen])

    def _on_done(self, t: float, index: int, phase: str) -> None:
        opened = self.tickets.finished(phase)
        if opened:
            self.measure_start = t
            for w in self.workers:
                w.sched.peak_used_tokens = w.sched.used_tokens
        self._live.pop(index, None)
        end = self._ends.pop(index, index + 1)
        if index + 1 < end:  # the session's next turn, by the same user, once it has thought
            nxt = index + 1
            self._ends[nxt] = end
            if index in self._slot_of:
                self._slot_of[nxt] = self._slot_of.pop(index)
            think = self.specs.raw(nxt).think_time_s
            self._push(t + quantize(think) if think else t, nxt, phase, None)
            return
        self._dialogues.pop(index // self._turns, None)
        self.holding -= 1
        if self.open_loop:
            if self._waiting_sends and (self.cap is None or self.holding < self.cap):
                i, ph, due = self._waiting_sends.popleft()
                self._push(t, i, ph, due)
            self._schedule_open(t)
        else:
            slot = self._slot_of.pop(index, 0)
            self._free_slots.append(slot)
            self._fill_slots(t)

    # -- records ------------------------------------------------------------------------------------------
    def _write(self, rec: RequestRecord) -> None:
        self.outcomes[rec.outcome] = self.outcomes.get(rec.outcome, 0) + 1
        self.records.append(rec)

    def _request_record(self, index, phase, t_send: float, due, spec, **fields) -> RequestRecord:
        """A record with what every request has: who sent what, and when (virtual seconds -> wall)."""
        return RequestRecord(
            index=index,
            phase=phase,
            api=self.api,
            worker_id=WORKER_ID,
            user_id=self._slot_of.get(index, 0),
            t_send_wall=self.epoch + t_send,
            input_len=spec.input_len,
            max_new_tokens=spec.max_new_tokens,
            prefix_group=spec.prefix_group,
            request_class=spec.request_class,
            t_scheduled_wall=None if due is None else self.epoch + due,
            session=spec.session,
            turn=spec.turn,
            **fields,
        )

    def _record_rejected(self, index, phase, t, due, spec, status: int, message: str) -> None:
        """The front's own answer (as omni answers): 429 its class's queue is full, 400 no district serves
        its class."""
        outcome = REJECTED if status == 429 else HTTP_ERROR  # a refusal for load, as the client records it
        self._write(self._request_record(index, phase, t, due, spec, outcome=outcome, http_status=status,
                                         error=f"HTTP {status}: {message}", e2e_ms=0.0,
                                         status_source=STATUS_FRONT))  # fmt: skip

    def _record_failure(self, index, phase, t, due, spec, status: int, message: str, worker: _Worker) -> None:
        self._write(self._request_record(index, phase, t, due, spec, outcome=HTTP_ERROR, http_status=status,
                                         error=f"HTTP {status}: {message}", e2e_ms=0.0, served_by=worker.name,
                                         status_source=STATUS_WORKER))  # fmt: skip

    def _record_dropped(self, r: Request, t: float) -> None:
        """A request the worker aborted while it waited: its stream (already answered 200) ends with the
        abort, as the client records it."""
        index, phase, t_send, due, spec, worker = r.handle
        message = (r.finish_reason or {}).get("message", "")
        self._write(self._request_record(index, phase, t_send, due, spec, outcome=STREAM_ERROR, http_status=200,
                                         error=f"aborted by server: {message}", e2e_ms=(t - t_send) * 1000.0,
                                         server_id=r.rid, served_by=worker.name,
                                         status_source=STATUS_WORKER))  # fmt: skip
        self.front.finished(self.workers.index(worker))
        self._on_done(t, index, phase)

    def _record(self, r: Request) -> None:
        index, phase, t_send, due, spec, worker = r.handle
        times = r.times if r.times is not None else []
        ms, toks = token_events(times, t_send, worker.settings.stream_interval)
        queue_ms = None if r.forward_entry_time is None else (r.forward_entry_time - t_send) * 1000.0
        if queue_ms is not None and phase == MEASURE:
            self.queue_delays_ms.append(queue_ms)
        self._write(
            self._request_record(
                index,
                phase,
                t_send,
                due,
                spec,
                outcome=OK,
                http_status=200,
                server_id=r.rid,
                ttft_ms=ms[0] if ms else None,
                e2e_ms=(r.finished_time - t_send) * 1000.0,
                arrival_ms=ms,
                arrival_tokens=toks,
                prompt_tokens=r.prompt_len,
                output_tokens=r.gen,
                cached_tokens=r.cached_tokens,
                num_retractions=r.num_retractions,
                server_queue_ms=queue_ms,
                finish_reason=(r.finish_reason or {}).get("type"),
                served_by=worker.name,
                status_source=STATUS_WORKER,
            )
        )
        if self.conversation:  # the reply, into the session's history for its next turn
            self._dialogues[index // self._turns].reply(list(r.output_ids[: r.gen]), r.gen)

    # -- the clock ------------------------------------------------------------------------------------------
    def run(self) -> None:
        """Events in time order: sends (a send at the moment a pass ends goes first, as it would reach the
        server's queue before the scheduler's next decision), then idle workers start their next pass, then
        the earliest pass end. One worker runs exactly the single-scheduler loop of earlier versions."""
        heap, workers = self._heap, self.workers
        self.start()
        now = 0.0
        while True:
            while heap and heap[0][0] <= now:
                send, _, index, phase, due = heapq.heappop(heap)
                self._send(send, index, phase, due)
            for w in workers:
                if w.it is None:
                    w.it = w.sched.next_iteration(now)
                    if w.it is not None:
                        w.end = now + quantize(w.it.duration)
            busy = [w for w in workers if w.it is not None]
            if not busy:
                if heap:
                    now = heap[0][0]
                    continue
                if self.tickets.done and not self._waiting_sends and not any(self._front_queues.values()):
                    break
                raise RuntimeError("virtual run stalled: requests remain but nothing can run")
            first = min(busy, key=lambda w: w.end)
            if heap and heap[0][0] <= first.end:  # arrivals during a pass wait in its queue
                now = heap[0][0]
                continue
            now, it = first.end, first.it
            first.sched.complete(it, now)
            first.it = None
            for r in it.finished:
                self.front.finished(self.workers.index(r.handle[5]))
                if r.state == DONE:
                    self._record(r)
                self._on_done(now, r.handle[0], r.handle[1])
            if any(self._front_queues.values()):
                self._drain_front_queue(now)
        self.t = now

    def stats(self) -> dict[str, Any]:
        """The simulation's own figures, summed over the workers (peaks: the busiest worker's)."""
        per = [(w, w.sched.stats()) for w in self.workers]
        delays = self.queue_delays_ms
        measured = self.measure_start is not None
        peak = max(w.sched.peak_used_tokens for w in self.workers) if measured else None
        usage = (
            max(w.sched.peak_used_tokens / s["max_total_num_tokens"] for w, s in per) if measured else None
        )
        return {
            "virtual_duration_s": self.t,
            "measure_start_s": self.measure_start,
            "forward_passes": sum(s["forward_passes"] for _, s in per),
            "num_retractions_total": sum(s["num_retractions_total"] for _, s in per),
            "num_priority_preemptions_total": sum(s["num_priority_preemptions_total"] for _, s in per),
            "evicted_tokens_total": sum(s["evicted_tokens_total"] for _, s in per),
            "peak_used_tokens_measured": peak,
            "peak_token_usage_measured": usage,
            "mean_queue_delay_ms": sum(delays) / len(delays) if delays else None,
            "max_total_num_tokens": sum(s["max_total_num_tokens"] for _, s in per),
            "cost_model": ", ".join(sorted({w.cost.name for w in self.workers})),
            "workers": len(self.workers),
            "switched": self.front.switched_counts(),
        }


# -- the front ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FrontSpec:
    """Which front a virtual cluster has: ``router`` (approximations of sglang-router's policies:
    round_robin, power_of_two, cache_aware) or ``omni`` (omni's own policies, ``loadlab.cluster.policies``,
    on signals polled every ``poll_interval_s`` of virtual time, with its bounded queue)."""

    kind: str = "router"
    policy: str = "round_robin"
    poll_interval_s: float = 0.5
    queue_size: int = 1024
    # omni: the most requests in flight per worker (its --max-in-flight-per-worker); None: each worker's
    # max_running_requests
    max_in_flight_per_worker: int | None = None
    # omni: (district name, its workers, the classes it serves or None for any), in the workers' order;
    # empty: one district of every worker serving any class
    districts: tuple[tuple[str, int, tuple[str, ...] | None], ...] = ()
    # omni's switch: (class, the districts its overflow may go to) each; policies.next_in_line's rule
    switch: tuple[tuple[str, tuple[str, ...]], ...] = ()
    switch_after_waiting: int = 0
    in_flight_fraction: float = 1.0  # omni's limit per worker: this much of its max_running_requests


class _Front:
    """A front's decisions on the virtual clock: ``choose(spec, now, in_line, switch)`` is the worker's
    index, or None when no worker may take the request now (it waits at the front); ``finished(i)`` when one
    ends on worker i."""

    queue_size = 0  # a router-like front has no queue of its own: it always chooses

    def __init__(self, workers: list[_Worker], seed: int):
        self.workers = workers

    def choose(self, spec, now: float, in_line: int = 1, switch: bool = False) -> int | None:
        """``in_line``: requests of its class in line at the front, counting this one; ``switch``: this
        decision may divert it by the switch rule (omni's; other fronts have none)."""
        raise NotImplementedError

    def queue_key(self, spec) -> str | None:
        """The front queue a request waits in (its class), None when no worker may ever serve it."""
        return DEFAULT_CLASS

    def finished(self, i: int) -> None:
        pass

    def switches(self, cls: str) -> bool:
        """The class has switch districts."""
        return False

    def switched_counts(self) -> dict[str, dict[str, int]] | None:
        """Requests the switch diverted, by class and district (None: no switch)."""
        return None


class _RoundRobin(_Front):
    def __init__(self, workers, seed):
        super().__init__(workers, seed)
        self.turn = itertools.count()

    def choose(self, spec, now, in_line=1, switch=False):
        return next(self.turn) % len(self.workers)


class _PowerOfTwo(_Front):
    """Two random workers, the one with fewer requests wins (the router polls /get_load, by default every
    30 s, and falls back to its own counts; here the workers' live counts)."""

    def __init__(self, workers, seed):
        super().__init__(workers, seed)
        self.rng = random.Random(f"loadlab-virtual-power-of-two-{seed}")  # salt: never change

    def choose(self, spec, now, in_line=1, switch=False):
        if len(self.workers) == 1:
            return 0
        a, b = self.rng.sample(range(len(self.workers)), 2)
        return a if self.workers[a].load <= self.workers[b].load else b


class _CacheAware(_Front):
    """An approximation of sglang-router's cache_aware (shared/design/omni.md): a prefix tree per worker of
    the prompts the front sent there (token ids here, the router keeps text), never the workers' own
    caches. Imbalanced (most minus least in flight > 64 and most > 1.5 x least): the least loaded; else the
    best match if it covers > 30% of the prompt; else the least loaded. The trees are not evicted."""

    ABS_THRESHOLD, REL_THRESHOLD, CACHE_THRESHOLD = 64, 1.5, 0.3  # the router's defaults

    def __init__(self, workers, seed):
        super().__init__(workers, seed)
        self.trees = [RadixCache() for _ in workers]

    def choose(self, spec, now, in_line=1, switch=False):
        loads = [w.load for w in self.workers]
        least = min(range(len(loads)), key=loads.__getitem__)
        if max(loads) - min(loads) > self.ABS_THRESHOLD and max(loads) > self.REL_THRESHOLD * min(loads):
            chosen = least
        else:
            matched = [tree.peek_prefix_len(spec.prompt) for tree in self.trees]
            best = max(range(len(matched)), key=matched.__getitem__)
            chosen = best if matched[best] > self.CACHE_THRESHOLD * len(spec.prompt) else least
        self.trees[chosen].insert(spec.prompt, 0.0)
        return chosen


class _Omni(_Front):
    """omni's policies (the real front's own functions) on what omni would know: each worker's signals as
    polled at the last multiple of ``poll_interval_s`` (stale, as in life) and omni's exact in-flight
    counts; at most ``max_in_flight_per_worker``, else ``max_running_requests`` times ``in_flight_fraction``,
    in flight per worker; the rest
    waits in omni's queue or, by the switch rule, goes to a switch district (``policies.next_in_line``)."""

    def __init__(self, workers, seed, spec: FrontSpec):
        super().__init__(workers, seed)
        self.policy, self.interval, self.queue_size = spec.policy, spec.poll_interval_s, spec.queue_size
        self.rng = random.Random(f"loadlab-virtual-omni-{seed}")  # salt: never change
        self.in_flight = [0] * len(workers)
        self.routed = [0] * len(workers)
        self.polled: list[tuple[int, int, float, int]] = []  # (running, waiting, token_usage, in flight)
        self.next_poll = 0.0
        districts = spec.districts or ((DEFAULT_CLASS, len(workers), None),)
        if sum(n for _, n, _ in districts) != len(workers):
            raise ValueError(
                f"omni: the districts have {sum(n for _, n, _ in districts)} workers, not {len(workers)}"
            )
        of = [name for name, n, _ in districts for _ in range(n)]
        self.pools = class_districts([(name, serves) for name, _, serves in districts])
        # Each class's workers (indices) and round-robin cursor: as the real omni's SloClass.
        self.members = {c: [i for i, d in enumerate(of) if d in ds] for c, ds in self.pools.items()}
        self.cursors = dict.fromkeys(self.pools, 0)
        # The switch: each class's switch districts' workers, their own cursor, what was diverted where.
        self.switch_after = spec.switch_after_waiting
        self.spill = {c: [i for i, d in enumerate(of) if d in ds] for c, ds in spec.switch}
        self.spill_cursors = dict.fromkeys(self.spill, 0)
        self.switched = {c: dict.fromkeys(ds, 0) for c, ds in spec.switch}
        self.district_of = of
        self.limits = [in_flight_limit(w.settings.max_running_requests, spec.max_in_flight_per_worker,
                                       spec.in_flight_fraction) for w in workers]  # fmt: skip

    def queue_key(self, spec) -> str | None:
        return class_of(self.pools, spec.request_class)

    def _poll(self, now: float) -> None:
        if now < self.next_poll and self.polled:
            return
        self.polled = [(len(w.sched.running), len(w.sched.waiting), w.sched.used_tokens / w.sched.max_total,
                        self.in_flight[i]) for i, w in enumerate(self.workers)]  # fmt: skip
        self.next_poll = (math.floor(now / self.interval) + 1) * self.interval

    def _loads(self, members: list[int]) -> tuple[WorkerLoad, ...]:
        return tuple(
            WorkerLoad(index=i, name=w.name, in_flight=self.in_flight[i], limit=self.limits[i],
                       routed=self.routed[i], running=run, waiting=wait, token_usage=usage,
                       in_flight_at_poll=at_poll, max_running=w.settings.max_running_requests)
            for i, (w, (run, wait, usage, at_poll)) in ((i, (self.workers[i], self.polled[i])) for i in members)
        )  # fmt: skip

    def choose(self, spec, now, in_line=1, switch=False):
        cls = self.queue_key(spec)
        if cls is None:
            return None
        self._poll(now)
        key = b"i:" + ",".join(map(str, spec.prompt[:OMNI_PREFIX_LEN])).encode()
        own = Snapshot(workers=self._loads(self.members[cls]), key=key, cursor=self.cursors[cls])
        spill = None
        if switch and cls in self.spill:
            spill = Snapshot(workers=self._loads(self.spill[cls]), key=key, cursor=self.spill_cursors[cls])
        got = next_in_line(self.policy, own, spill, in_line, self.switch_after, self.rng)
        if got is None:
            return None
        chosen, switched = got
        if switched:
            self.spill_cursors[cls] = chosen + 1
            self.switched[cls][self.district_of[chosen]] += 1
        else:
            self.cursors[cls] = chosen + 1
        self.in_flight[chosen] += 1
        self.routed[chosen] += 1
        return chosen

    def finished(self, i: int) -> None:
        self.in_flight[i] -= 1

    def switches(self, cls: str) -> bool:
        return cls in self.spill

    def switched_counts(self) -> dict[str, dict[str, int]] | None:
        return {c: dict(n) for c, n in self.switched.items()} if self.spill else None


OMNI_PREFIX_LEN = 256  # omni's --prefix-len default: the prefix policy's key
ROUTER_POLICIES = {"round_robin": _RoundRobin, "power_of_two": _PowerOfTwo, "cache_aware": _CacheAware}


def make_front(spec: FrontSpec, workers: list[_Worker], seed: int) -> _Front:
    if spec.kind == "omni":
        if spec.policy not in OMNI_POLICIES:
            raise ValueError(f"omni: no policy {spec.policy!r} (one of {', '.join(OMNI_POLICIES)})")
        return _Omni(workers, seed, spec)
    if spec.policy not in ROUTER_POLICIES:
        raise ValueError(f"router: no policy {spec.policy!r} (one of {', '.join(ROUTER_POLICIES)})")
    return ROUTER_POLICIES[spec.policy](workers, seed)


def simulate(
    profile: Profile,
    sim_settings: dict[str, Any] | list[dict[str, Any]] | None = None,
    front: FrontSpec | None = None,
) -> VirtualRun:
    """Runs a profile in virtual time without writing anything; ``.records`` holds the records. A list of
    settings is a cluster: one worker each, behind ``front``."""
    if isinstance(sim_settings, list):
        vr = VirtualRun(profile, [resolve_settings(dict(s)) for s in sim_settings], front=front)
    else:
        vr = VirtualRun(profile, resolve_settings(dict(sim_settings or {})))
    vr.run()
    return vr


def run_virtual(
    profile: Profile,
    sim_settings: dict[str, Any] | None,
    out_root: str | Path,
    run_name: str | None = None,
    *,
    profile_path: str | None = None,
    command: list[str] | None = None,
    cluster: str | Path | None = None,
    cluster_overrides: dict[str, Any] | None = None,
    html: bool = True,
) -> Path:
    """Runs ``profile`` against the twin in virtual time and writes a complete run directory; returns it.

    ``sim_settings`` are server settings under SGLang's names (``max_running_requests``, ``gpu``, ...),
    as in a profile's ``target.embedded``; unset ones take the server's defaults. ``cluster``: a cluster
    file instead (its districts' workers behind its front; ``sim_settings`` then apply to every worker),
    with ``cluster_overrides`` laid over it (a profile's ``target.cluster_overrides``). ``html``: False
    leaves report.html out (about a second of plotting; `loadlab report RUN` draws it)."""
    wall0 = time.perf_counter()
    overrides = flatten_overrides(cluster_overrides or {})
    config = (
        load_cluster(cluster, overrides=overrides, source=f"{CLUSTER_OVERRIDES}.")
        if cluster is not None
        else None
    )
    if config is None:
        names, many, front, cluster_info = None, [resolve_settings(dict(sim_settings or {}))], None, None
    else:
        names, many, front, cluster_info = _cluster_workers(config, str(cluster), sim_settings or {})
        cluster_info.overrides = overrides or None
    settings = many[0]
    out_root = Path(out_root)
    out_root.mkdir(parents=True, exist_ok=True)
    run_dir = out_root / unique_run_name(out_root, run_name or default_run_name(profile.name, "-virtual"))
    run_dir.mkdir(parents=True)
    epoch = math.floor(time.time())  # an integer epoch: epoch + virtual time stays exact (sim.clock)
    shown = settings.shown()
    requests = profile.requests
    manifest = Manifest(
        run_id=run_dir.name,
        profile_path=profile_path,
        profile=profile.model_dump(mode="json"),
        target=TargetInfo(
            url="virtual",
            virtual=True,
            embedded_settings=dict(sim_settings or {}),
            server_info=dict(shown, version=f"{SIM_VERSION} (virtual time)", loadlab_sim=True),
            cluster=cluster_info,
        ),
        model=settings.served_model_name,
        # One "user" per request in flight: the cap, or every request when there is none.
        load=describe_load(profile, profile.load.concurrency or requests.warmup + requests.measured),
        workload_source=workload_source(_specs_for(profile).workload),
        virtual=True,
        sim=shown,
        started_wall=epoch,
        counts=Counts(warmup_expected=requests.warmup, measured_expected=requests.measured),
        versions=software_versions(),
        command=command if command is not None else list(sys.argv),
    )
    write_manifest(run_dir, manifest)
    vr = VirtualRun(profile, many, run_dir.name, float(epoch), front=front, names=names)
    vr.run()
    write_records(run_dir, vr.records)
    t = vr.tickets
    manifest.ended_wall = epoch + vr.t
    manifest.complete = t.done
    manifest.counts = manifest.counts.model_copy(
        update=dict(warmup_finished=t.warmup_finished, measured_finished=t.measured_finished,
                    records=len(vr.records), outcomes=vr.outcomes)
    )  # fmt: skip
    manifest.virtual_stats = VirtualStats(**vr.stats(), wall_s=time.perf_counter() - wall0)
    write_manifest(run_dir, manifest)
    write_report(run_dir, html=html)
    return run_dir


def _cluster_workers(config, path: str, overrides: dict[str, Any]):
    """A cluster file's workers for the virtual clock: names ``district-i``, resolved settings (the
    district's, with ``overrides`` on top), the front, and what the manifest records of the cluster."""
    names, many, workers, districts, routes = [], [], [], [], []
    for d in config.districts:
        routes.append((d.name, d.workers, None if d.serves is None else tuple(d.serves)))
        district_settings = {**worker_settings(d), **overrides}
        districts.append(
            ClusterDistrictInfo(name=d.name, workers=d.workers, settings=district_settings, serves=d.serves)
        )
        for i in range(d.workers):
            names.append(f"{d.name}-{i}")
            many.append(resolve_settings(district_settings))
            workers.append(ClusterWorkerInfo(url=names[-1], district=d.name))
    f = config.front
    if f.kind == "none" and len(many) > 1:
        raise ValueError(f"{path}: front kind none: a virtual run needs a front for {len(many)} workers")
    omni = f.kind == "omni"
    front = FrontSpec(kind="omni" if omni else "router", policy=f.policy or "round_robin",
                      poll_interval_s=f.poll_interval_s or 0.5, queue_size=f.queue_size or 1024,
                      max_in_flight_per_worker=f.max_in_flight_per_worker,
                      districts=tuple(routes) if omni else (),
                      switch=tuple((c, tuple(ds)) for c, ds in config.switch_routes().items()) if omni else (),
                      switch_after_waiting=f.switch_after_waiting or 0,
                      in_flight_fraction=f.in_flight_fraction or 1.0)  # fmt: skip
    info = ClusterInfo(file=path, name=config.name, front_kind=f.kind, policy=f.policy, front_url=None,
                       workers=workers, districts=districts, workers_per_process=config.workers_per_process,
                       front_settings=config.front_settings())  # fmt: skip
    return names, many, front, info


__all__ = ["run_virtual", "simulate"]
