"""The real-time driver: the twin's scheduler (``loadlab.sim.scheduler``) on the asyncio clock.

Pure Python and asyncio, no HTTP. The server talks to it only through:

- ``Engine.submit(prompt_ids, max_new_tokens, ...) -> RequestHandle`` (raises ``UnavailableError`` (queue
  full, priority refused) or ``RequestTooLargeError``); ``async for step in handle`` yields ``Step(new_tokens, completion_tokens,
  finish_reason)`` (``finish_reason`` only on the last step); ``handle.abort()`` frees a request.
- ``Engine.stats()`` for /metrics and /server_info, ``Engine.load()`` for /get_load, ``Engine.flush_cache()``,
  ``start()``/``stop()``.

The loop asks the scheduler for the next forward pass, sleeps until the pass's end (timed from the previous
pass's intended end, so wake-up lateness does not accumulate), applies it, and wakes the streams that have
tokens to deliver (the first token at once, then whenever ``stream_interval`` tokens are unsent, and at
the end). A request runs to ``max_new_tokens`` (finish_reason ``length``) unless it does not ignore EOS and
the server has an ``eos_len_dist``: then it may stop sooner (``stop``; ``loadlab.sim.eos``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from loadlab.lateness import LatenessHistogram
from loadlab.sim.cost import CostModel, attention_pairs
from loadlab.sim.radix import RadixCache
from loadlab.sim.scheduler import (
    DONE,
    Iteration,
    PriorityDisabledError,
    QueueFullError,
    Request,
    RequestTooLargeError,
    Scheduler,
    SchedulerConfig,
    UnavailableError,
)

PRECISE_SLEEP_S = 0.0015  # the last part of a wait before a pass ends, slept without the event loop
LATE_TOLERANCE_S = (
    0.02  # a pass may start up to this late (a burst of writes, a GC pause) and keep model time
)

_DEFAULT_COST = CostModel()


def prefill_pass_s(parts: Sequence[tuple[int, int]]) -> float:
    """One prefill pass on the default preset; ``parts`` holds (new tokens, tokens already in KV)."""
    new = sum(n for n, _ in parts)
    return _DEFAULT_COST.prefill_s(new, sum(attention_pairs(n, p) for n, p in parts))


class Step(NamedTuple):
    new_tokens: int  # tokens produced since the previous step
    completion_tokens: int  # cumulative
    finish_reason: dict | None  # set on the last step only
    due: float  # loop time at which the newest of these tokens was produced (the end of its forward pass)


@dataclass
class EngineConfig(SchedulerConfig):
    gpu: str = "a100-80gb"
    model: str = "llama-3.1-8b"
    tp_size: int | None = None  # None: the model preset's default


class RequestHandle:
    """One submitted request. Async-iterate it for ``Step``s; ``abort()`` when the client goes away.

    Times are event-loop clock values (``loop.time()``); ``wall()`` turns one into a Unix timestamp.
    """

    __slots__ = ("_emit", "_encode", "_engine", "_final_yielded", "_prepared", "_prepared_ct", "_sent", "_waiter",
                 "req", "stream_interval")  # fmt: skip

    def __init__(self, engine: Engine, req: Request, stream_interval: int):
        self._engine = engine
        self.req = req
        self.stream_interval = stream_interval
        self._sent = 0
        self._final_yielded = False
        self._waiter: asyncio.Future | None = None
        self._encode: Callable[[Step], bytes] | None = None  # push mode (listen)
        self._emit: Callable[[Step, bytes], None] | None = None
        self._prepared: bytes | None = None  # the next step's payload, encoded while its pass ran
        self._prepared_ct = -1

    # Request state, read through.
    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def prompt_tokens(self) -> int:
        return self.req.prompt_len

    @property
    def max_new_tokens(self) -> int:
        return self.req.max_new

    @property
    def cached_tokens(self) -> int:
        return self.req.cached_tokens

    @property
    def num_retractions(self) -> int:
        return self.req.num_retractions

    @property
    def completion_tokens(self) -> int:
        return self._engine.scheduler.generated(self.req)

    @property
    def arrival_time(self) -> float:
        return self.req.arrival_time

    @property
    def forward_entry_time(self) -> float | None:
        return self.req.forward_entry_time

    @property
    def first_token_time(self) -> float | None:
        return self.req.first_token_time

    @property
    def finished_time(self) -> float | None:
        return self.req.finished_time

    @property
    def finish_reason(self) -> dict | None:
        return self.req.finish_reason

    @property
    def finished(self) -> bool:
        return self.req.state >= DONE

    def wall(self, loop_time: float | None) -> float | None:
        return None if loop_time is None else loop_time + self._engine.wall_offset

    def abort(self, message: str = "client disconnected") -> None:
        self._engine._abort(self, message)

    def listen(self, encode: Callable[[Step], bytes], emit: Callable[[Step, bytes], None]) -> None:
        """Push mode, instead of iterating: the engine loop calls ``emit(step, encode(step))`` synchronously
        as each step becomes ready, the last one with ``finish_reason`` set; no task switch per event.
        ``encode`` must be pure: the engine may call it early, while the pass that makes the step is still
        running, so that only the socket writes are left for the pass's end. Neither may call into the
        engine (abort from the awaiting task instead)."""
        self._encode = encode
        self._emit = emit
        if not self._final_yielded and self._ready():
            step = self._take()
            emit(step, encode(step))

    def unlisten(self) -> None:
        """Back to iterating (the push listener stops getting steps)."""
        self._encode = self._emit = None
        self._prepared = None

    def _prepare(self, completion_tokens: int) -> None:
        """Encodes the step this handle will have at ``completion_tokens``, if that is a mid-stream event."""
        sent = self._sent
        if (
            sent
            and completion_tokens - sent >= self.stream_interval
            and completion_tokens < self.req.stop_len
        ):
            assert self._encode is not None
            self._prepared = self._encode(Step(completion_tokens - sent, completion_tokens, None, 0.0))
            self._prepared_ct = completion_tokens

    def _ready(self) -> bool:
        if self.req.state >= DONE:
            return True
        ct = self.completion_tokens
        sent = self._sent
        return (sent == 0 and ct > 0) or (ct - sent >= self.stream_interval and ct > sent)

    def _take(self) -> Step:
        ct = self.completion_tokens
        new = ct - self._sent
        self._sent = ct
        due = self._engine.last_pass_end
        if self.req.state >= DONE:
            self._final_yielded = True
            return Step(new, ct, self.req.finish_reason, due)
        return Step(new, ct, None, due)

    def _notify(self) -> None:
        if self._final_yielded:
            return
        emit = self._emit
        if emit is not None:
            if self._ready():
                step = self._take()
                prepared = self._prepared
                if (
                    prepared is not None
                    and self._prepared_ct == step.completion_tokens
                    and step.finish_reason is None
                ):
                    payload = prepared
                else:
                    assert self._encode is not None
                    payload = self._encode(step)
                self._prepared = None
                emit(step, payload)
            return
        w = self._waiter
        if w is not None and not w.done() and self._ready():
            w.set_result(None)

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> Step:
        while True:
            if self._final_yielded:
                raise StopAsyncIteration
            if self._ready():
                return self._take()
            fut = asyncio.get_running_loop().create_future()
            self._waiter = fut
            try:
                await fut
            finally:
                self._waiter = None


class Engine:
    """Drives a ``Scheduler`` on the event-loop clock."""

    def __init__(self, config: EngineConfig | None = None, cost: CostModel | None = None):
        self.config = config = config or EngineConfig()
        self.cost = cost or CostModel(config.gpu, config.model, config.tp_size)
        self.scheduler = Scheduler(config, self.cost)
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._it: Iteration | None = None
        self.wall_offset = 0.0
        self.last_pass_end = 0.0
        self.pass_lateness = LatenessHistogram()  # when each pass's end was processed, against its schedule
        self.lateness = (
            LatenessHistogram()
        )  # when each event was written, against its pass's end (the server)
        self.late_passes = 0  # passes that started more than LATE_TOLERANCE_S late (the CPU fell behind)
        self.lost_s = 0.0  # model time given up to those late starts

    @property
    def cache(self) -> RadixCache | None:
        return self.scheduler.cache

    @property
    def forward_passes(self) -> int:
        return self.scheduler.forward_passes

    # -- lifecycle ------------------------------------------------------------------------------------
    async def start(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        self.wall_offset = time.time() - loop.time()
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="loadlab-sim-engine")
        self._task.add_done_callback(self._on_loop_done)

    def _on_loop_done(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:
            return
        logging.getLogger("loadlab.sim.engine").error("engine loop failed", exc_info=task.exception())
        self._abort_all("engine failure")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._abort_all("server shutting down")

    def _abort_all(self, message: str) -> None:
        sched = self.scheduler
        now = self._loop.time() if self._loop is not None else 0.0
        if self._it is not None:  # a pass was in flight: let it end now so its requests can be freed
            it, self._it = self._it, None
            with contextlib.suppress(AssertionError):
                sched.complete(it, now)
            self._deliver(it)
        reqs = list(sched.waiting) + list(sched.running)
        if sched.chunked is not None:
            reqs.append(sched.chunked)
        for r in reqs:
            sched.abort(r, now, message)
            if r.handle is not None:
                r.handle._notify()

    # -- the interface ----------------------------------------------------------------------------------
    def submit(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        *,
        ignore_eos: bool = True,
        stream_interval: int | None = None,
        rid: str | None = None,
        output_ids: Sequence[int] | None = None,
        internal: bool = False,
        priority: int | None = None,
    ) -> RequestHandle:
        """Queues a request. ``output_ids`` (the ids the request will generate, if the caller knows them)
        lets finished requests leave prompt + output in the prefix cache. ``internal`` requests (health
        checks) bypass the queue limit and are not counted in the statistics. ``ignore_eos``: SGLang's
        exact-reservation admission with the radix cache disabled; without it, the request stops at its
        EOS when the server draws one (``eos_len_dist``).
        ``priority``: the request's (SGLang's field; used with priority scheduling). A waiting request it
        displaces from a full queue ends at once, its stream told so."""
        assert self._wake is not None and self._loop is not None, "Engine.start() was not called"
        interval = stream_interval or self.config.stream_interval
        req = Request(
            rid or uuid.uuid4().hex,
            list(prompt_ids),
            max_new_tokens,
            output_ids=output_ids,
            ignore_eos=ignore_eos,
            stream_interval=interval,
            internal=internal,
            priority=priority,
        )
        displaced = self.scheduler.add_request(req, self._loop.time())
        handle = RequestHandle(self, req, interval)
        req.handle = handle
        if displaced is not None and displaced.handle is not None:
            displaced.handle._notify()
        self._wake.set()
        return handle

    def flush_cache(self) -> bool:
        """Empties the prefix cache; refused (False) while requests are queued or running."""
        return self.scheduler.flush_cache()

    def stats(self) -> dict:
        return self.scheduler.stats()

    def load(self) -> dict:
        """The scheduler's load as SGLang's ``/get_load`` reports it (``Scheduler.load``)."""
        return self.scheduler.load()

    def timing_stats(self) -> dict:
        """The server's own timing quality: how late passes ended and events were written, and the model
        time lost to a CPU that fell behind."""
        return {
            "pass_end_lateness_ms": self.pass_lateness.summary_ms(),
            "event_lateness_ms": self.lateness.summary_ms(),
            "late_passes": self.late_passes,
            "lost_model_time_s": round(self.lost_s, 4),
        }

    def _abort(self, h: RequestHandle, message: str) -> None:
        now = self._loop.time() if self._loop is not None else 0.0
        if self.scheduler.abort(h.req, now, message):
            h._notify()
        if self._wake is not None:
            self._wake.set()  # room may have opened for queued requests

    # -- the loop ---------------------------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        wake = self._wake
        assert wake is not None
        sched = self.scheduler
        t = loop.time()
        busy = False
        while True:
            now = loop.time()
            # Time the pass from the previous pass's intended end, so wake-up lateness does not drift;
            # beyond the tolerance the CPU has fallen behind the model and the lost time is counted.
            if not busy:
                t = now
            elif now - t > LATE_TOLERANCE_S:
                self.late_passes += 1
                self.lost_s += now - LATE_TOLERANCE_S - t
                t = now - LATE_TOLERANCE_S
            it = sched.next_iteration(t)
            if it is None:
                busy = False
                wake.clear()
                await wake.wait()
                continue
            self._it = it
            end = t + it.duration
            if it.decode_bs:
                self._prepare(it)
            delay = end - loop.time()
            # The event loop's timers wake up to 1 ms late (epoll rounds its timeout up to whole ms), so
            # wake a little early and finish with a precise sleep that holds the loop for under 1.5 ms.
            await asyncio.sleep(delay - PRECISE_SLEEP_S if delay > PRECISE_SLEEP_S else 0)
            rest = end - loop.time()
            if rest > 0:
                time.sleep(rest)
            self.pass_lateness.record(loop.time() - end)
            self._it = None
            sched.complete(it, end)
            self.last_pass_end = end
            self._deliver(it)
            t = end
            busy = True

    def _prepare(self, it: Iteration) -> None:
        """Encodes the events this decode pass will release while it runs (a pass's events go out in one
        burst at its end, so the cheaper each one is there, the less late the last one)."""
        generated = self.scheduler.generated
        for r in self.scheduler.running:
            h = r.handle
            if h is not None and h._emit is not None:
                h._prepare(generated(r) + 1)

    def _deliver(self, it: Iteration) -> None:
        for r in it.finished:
            if r.handle is not None:
                r.handle._notify()
        for r in it.prefilled:
            if r.handle is not None:
                r.handle._notify()
        if it.decode_bs:
            for r in self.scheduler.running:
                h = r.handle
                if h is not None and (h._waiter is not None or h._emit is not None):
                    h._notify()


__all__ = [
    "Engine",
    "EngineConfig",
    "PriorityDisabledError",
    "QueueFullError",
    "RequestHandle",
    "RequestTooLargeError",
    "Step",
    "UnavailableError",
    "prefill_pass_s",
]
