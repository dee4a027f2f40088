"""SGLang's scheduling loop as a pure state machine: no asyncio, no HTTP, no wall clock.

A driver owns the clock. It calls ``add_request(req, now)`` when a request arrives, then repeatedly::

    it = sched.next_iteration(now)      # what the next forward pass does, and how long it takes
    if it is None: ...                  # idle: wait for the next arrival
    sched.complete(it, now + it.duration)   # apply its results at its end time

Two drivers exist: ``loadlab.sim.engine`` (the asyncio clock behind the HTTP server) and
``loadlab.virtual`` (a simulated clock with a client model, via ``loadlab.sim.clock``).

The rules follow SGLang 0.4-0.5 (``scheduler.py``, ``schedule_policy.py``, ``schedule_batch.py``) as
``shared/design/twin.md`` describes them:

- Each iteration: the requests whose prefill finished last time have joined the running batch; try to
  build a prefill batch; if one is built it runs and decode is skipped (prefill first); otherwise one
  decode step for every running request. With ``enable_mixed_chunk`` a prefill batch also carries one
  decode token for every running request.
- Admission (PrefillAdder): budget = free KV + evictable cache tokens - reserved, reserved = sum over
  running requests of min(max_new - generated, 4096) x new_token_ratio; a candidate needs its new prompt
  tokens + min(max_new - generated, 4096) < remaining budget. The pass stops at ``max_prefill_tokens``, the
  chunk budget (``chunked_prefill_size``) or ``max_running_requests``; a refusal for lack of tokens marks
  the batch full until a running request leaves (SGLang's ``batch_is_full``).
- Chunked prefill: one request at a time is cut to the remaining chunk budget; its computed part goes into
  the prefix cache and it continues first in the next prefill round.
- new_token_ratio: starts at min(0.7 x conservativeness, 1), floor 0.14 x start, decays linearly over 600
  decode steps, back to the start when idle.
- Retraction: when a decode step cannot get one KV token per request (after evicting the cache), running
  requests are retracted fewest-generated first (ties: longest prompt), always keeping one, until 20
  tokens per remaining request are free. Their private KV is freed, they go to the tail of the queue and
  later re-prefill prompt + generated tokens minus any cache hit. Then new_token_ratio = min(1, (sum
  generated + 20 n) / (sum max_new + 1)).
- Policies: fcfs, or lpm (longest cached prefix first, with SGLang's in-batch prefix deprioritisation),
  which falls back to fcfs above 128 waiting requests.
- Radix cache disabled + ignore_eos: SGLang's exact-reservation admission (``add_one_req_ignore_eos``).
- EOS (``eos_len_dist``, ``loadlab.sim.eos``): a request that does not ignore EOS stops at a length drawn
  from its prompt (``stop_len``), before max_new_tokens when the draw is shorter (finish reason ``stop``).
  Admission does not know that length in advance (SGLang cannot): a running request's reservation stays
  min(max_new - generated, 4096) x new_token_ratio until it leaves, and what it frees when it stops early is
  what the decayed new_token_ratio bets on.
- Priority scheduling (``enable_priority_scheduling``; SGLang 0.5's ``schedule_policy.py`` and
  ``Scheduler.get_new_batch_prefill``): a request without a priority gets the least preferred value there
  is; under fcfs the queue is sorted by (priority, time it last entered the queue), higher values first
  unless ``schedule_low_priority_values_first`` (lpm keeps its own order: SGLang sorts by priority only
  under fcfs). When the running slots are full, a waiting request may preempt running ones (least
  preferred first, ties: the latest queued) whose priority it beats by more than
  ``priority_scheduling_preemption_threshold``, as many as its tokens need; they go back to the queue as a
  retraction does, keeping their output. A full queue (``max_queued_requests``) drops its least preferred
  waiting request for a strictly better arrival. (Each prefill attempt then sorts the queue: linear when it
  is nearly sorted already; running requests are counted per priority, so that a full batch nobody may
  preempt costs a decode step nothing more.)

Per-step work is O(1) in the batch size for a decode step: the batch size, total context, private KV and
the reservation sum are running totals; a request's generated count is computed from the decode counter
when needed; finishing requests are found in a bucket keyed by the decode step they finish at. Token
times (for the virtual driver) are kept as one array of decode-step end times.
"""

from __future__ import annotations

import contextlib
import sys
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from loadlab.sim.cost import CLIP_MAX_NEW_TOKENS, CostModel, attention_pairs
from loadlab.sim.eos import parse_eos_dist
from loadlab.sim.radix import Node, RadixCache
from loadlab.sim.tokenize import END_OF_TURN

# SGLang's global_config defaults (python/sglang/global_config.py).
DEFAULT_INIT_NEW_TOKEN_RATIO = 0.7
DEFAULT_MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
DEFAULT_NEW_TOKEN_RATIO_DECAY_STEPS = 600
RETRACT_DECODE_STEPS = 20
LPM_FALLBACK_QUEUE = 128  # lpm becomes fcfs above this many waiting requests (schedule_policy.py)
IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD = 32
IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD = 32
IGNORE_EOS_RESERVE_TOKENS = 1
THROUGHPUT_WINDOW_S = 1.0

WAITING, PREFILL, RUNNING, DONE, ABORTED = range(5)
PREFILL_PASS, DECODE_PASS, MIXED_PASS = "prefill", "decode", "mixed"
_CONTINUE, _NO_TOKEN, _OTHER = range(3)


# SGLang's messages for the requests its scheduler refuses or drops with HTTP 503.
QUEUE_FULL_MESSAGE = "The request queue is full."
DISPLACED_MESSAGE = "The request is aborted by a higher priority request."
PRIORITY_DISABLED_MESSAGE = (
    "Using priority is disabled for this server. Please send a new request without a priority."
)


class UnavailableError(Exception):
    """SGLang refuses the request at admission with HTTP 503; the message is SGLang's."""


class QueueFullError(UnavailableError):
    """The waiting queue already holds ``max_queued_requests`` requests (none of them less preferred)."""

    def __init__(self, message: str = QUEUE_FULL_MESSAGE):
        super().__init__(message)


class PriorityDisabledError(UnavailableError):
    """A request with a priority, priority scheduling off and ``abort_on_priority_when_disabled`` on."""

    def __init__(self, message: str = PRIORITY_DISABLED_MESSAGE):
        super().__init__(message)


class RequestTooLargeError(ValueError):
    """The request can never be admitted: prompt + max_new_tokens do not fit the KV pool."""


@dataclass
class SchedulerConfig:
    max_running_requests: int = 2048
    max_queued_requests: int | None = None  # None: unbounded
    max_total_tokens: int = 440_000
    chunked_prefill_size: int = 8192  # <= 0: chunking off
    max_prefill_tokens: int = 16384
    schedule_policy: str = "fcfs"  # fcfs | lpm
    disable_radix_cache: bool = False
    stream_interval: int = 1
    schedule_conservativeness: float = 1.0
    enable_mixed_chunk: bool = False
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    priority_scheduling_preemption_threshold: int = 10
    abort_on_priority_when_disabled: bool = False
    eos_len_dist: str | None = None  # where the model stops (loadlab.sim.eos); None: never before max_new
    record_token_times: bool = False  # keep per-token times (virtual driver)


class Request:
    """One request inside the scheduler. Times are in the driver's clock."""

    __slots__ = (
        "already_computed",
        "arrival_time",
        "cached_tokens",
        "finish_d",
        "finish_reason",
        "finished_time",
        "first_token_time",
        "forward_entry_time",
        "gen",
        "handle",
        "ignore_eos",
        "internal",
        "join_d",
        "max_new",
        "node",
        "num_retractions",
        "output_ids",
        "pending_abort",
        "prefix_len",
        "priority",
        "priv",
        "prompt",
        "prompt_len",
        "queued_at",
        "rid",
        "state",
        "stop_len",
        "stream_interval",
        "times",
    )

    def __init__(
        self,
        rid: str,
        prompt: list[int],
        max_new: int,
        *,
        output_ids: Sequence[int] | None = None,
        ignore_eos: bool = True,
        stream_interval: int = 1,
        internal: bool = False,
        arrival_time: float = 0.0,
        priority: int | None = None,
    ):
        self.rid = rid
        self.prompt = prompt if type(prompt) is list else list(prompt)
        self.prompt_len = len(self.prompt)
        self.max_new = max_new  # what admission reserves for (SGLang's max_new_tokens)
        self.stop_len = max_new  # the tokens it will generate: fewer when the model stops at its EOS
        self.output_ids = output_ids
        self.ignore_eos = ignore_eos
        self.stream_interval = stream_interval
        self.internal = internal
        self.arrival_time = arrival_time
        self.priority = priority  # with priority scheduling, None becomes the least preferred value
        self.queued_at = arrival_time  # when it last entered the queue (SGLang's wait_queue_entry_time)
        self.state = WAITING
        self.gen = 0  # generated tokens (while running: at join time)
        self.join_d = 0  # decode counter when it joined the running batch
        self.finish_d = -1
        self.priv = 0  # KV tokens held outside the prefix cache (while running: at join time)
        self.prefix_len = 0  # tokens of this round's fill ids already in KV
        self.already_computed = 0  # SGLang's Req.already_computed (for cached_tokens)
        self.node: Node | None = None  # locked radix node
        self.cached_tokens = 0
        self.num_retractions = 0
        self.forward_entry_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.finish_reason: dict | None = None
        self.pending_abort: str | None = None
        self.times: array | None = None  # token times (doubles), when the scheduler records them
        self.handle: Any = None

    def fill_ids(self) -> list[int]:
        """Prompt + the tokens generated so far: what a (re-)prefill computes."""
        if self.gen == 0:
            return self.prompt
        out = self.output_ids
        if out is None or len(out) < self.gen:
            out = [-1 - (hash(self.rid) % 1_000_000_000)] * self.gen  # unique filler: never shared
        return self.prompt + list(out[: self.gen])

    def __repr__(self) -> str:
        return (
            f"<Request {self.rid} state={self.state} prompt={self.prompt_len} gen={self.gen}/{self.max_new}>"
        )


class Iteration:
    """One forward pass: built by ``next_iteration``, applied by ``complete``."""

    __slots__ = ("decode_bs", "duration", "finished", "kind", "new_tokens", "parts", "prefilled", "start")

    def __init__(self, kind: str, start: float, duration: float, parts, decode_bs: int, new_tokens: int):
        self.kind = kind
        self.start = start
        self.duration = duration
        self.parts: list[tuple[Request, int, int]] = parts  # (request, new tokens, tokens already in KV)
        self.decode_bs = decode_bs  # requests that decode one token in this pass
        self.new_tokens = new_tokens  # prefill tokens computed
        self.finished: list[Request] = []  # filled by complete()
        self.prefilled: list[Request] = []  # got a token from the prefill part and keep running

    def __repr__(self) -> str:
        return (
            f"<Iteration {self.kind} {self.duration * 1e3:.2f} ms parts={[(r.rid, n, p) for r, n, p in self.parts]}"
            f" decode_bs={self.decode_bs}>"
        )


class _Adder:
    """SGLang's PrefillAdder for one prefill attempt."""

    __slots__ = ("can_run", "cur_offset", "log_hit", "log_input", "new_chunked", "rem_chunk", "rem_input",
                 "total_offset", "parts")  # fmt: skip

    def __init__(self, rem_input: int, rem_chunk: int | None, mixed_tokens: int, reserved: float):
        self.rem_input = rem_input - mixed_tokens
        self.rem_chunk = None if rem_chunk is None else rem_chunk - mixed_tokens
        self.total_offset = mixed_tokens + reserved
        self.cur_offset = mixed_tokens
        self.can_run: list[Request] = []
        self.parts: list[tuple[Request, int, int]] = []
        self.new_chunked: Request | None = None
        self.log_hit = 0
        self.log_input = 0

    def update(self, prefix: int, extend: int, max_new_reserve: int) -> None:
        self.total_offset += extend + max_new_reserve
        self.cur_offset += extend
        self.rem_input -= extend
        if self.rem_chunk is not None:
            self.rem_chunk -= extend
        self.log_hit += prefix
        self.log_input += extend


class Scheduler:
    def __init__(self, config: SchedulerConfig | None = None, cost: CostModel | None = None):
        self.config = cfg = config or SchedulerConfig()
        self.cost = cost or CostModel()
        self.cache: RadixCache | None = None if cfg.disable_radix_cache else RadixCache()
        self.max_total = cfg.max_total_tokens
        self.chunk_size: int | None = cfg.chunked_prefill_size if cfg.chunked_prefill_size > 0 else None
        self.lpm = cfg.schedule_policy == "lpm" and self.cache is not None
        self.mixed = cfg.enable_mixed_chunk
        self.record_times = cfg.record_token_times
        # Priority scheduling. SGLang's priority_sign: sorting by priority x sign puts the preferred first.
        self.priority_on = cfg.enable_priority_scheduling
        self.priority_sign = 1 if cfg.schedule_low_priority_values_first else -1
        # The default priority, for a request without one: the least preferred value (_set_or_validate_priority).
        self.default_priority = sys.maxsize if cfg.schedule_low_priority_values_first else -sys.maxsize - 1
        self.preemption_threshold = cfg.priority_scheduling_preemption_threshold
        self.eos = parse_eos_dist(cfg.eos_len_dist) if cfg.eos_len_dist else None
        # new_token_ratio (scheduler.py)
        self.init_ratio = min(DEFAULT_INIT_NEW_TOKEN_RATIO * cfg.schedule_conservativeness, 1.0)
        self.min_ratio = min(self.init_ratio * DEFAULT_MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        self.ratio_decay = (self.init_ratio - self.min_ratio) / DEFAULT_NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = self.init_ratio
        # queues and batches
        self.waiting: deque[Request] = deque()
        self.running: dict[Request, None] = {}  # an ordered set
        self.chunked: Request | None = None
        self.batch_is_full = False
        self._inflight: Iteration | None = None
        self._in_flight_reqs: set[Request] = set()
        self._pending_aborts: list[Request] = []
        # running totals
        self.decode_steps = 0  # decode passes completed (D)
        self.decode_times = array("d")  # end time of decode pass d at index d - 1 (when recording)
        self._finish_at: dict[int, list[Request]] = {}
        self.sum_ctx = 0  # sum over running of prompt + generated
        self.private_used = 0  # KV tokens held outside the prefix cache
        self._rem_base = 0  # sum over small running of (max_new - gen at join + join_d)
        self._n_small = 0
        self._big: set[Request] = set()  # running requests that joined with more than CLIP tokens to go
        # Running requests per priority (with priority scheduling): the least preferred one in O(priorities),
        # so that a decode step with full slots stays O(1) in the batch size when nobody may preempt.
        self._running_priorities: dict[int, int] = {}
        # statistics
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_requests_total = 0
        self.num_aborted_requests_total = 0
        self.num_retractions_total = 0
        self.num_retracted_reqs = 0  # gauge: retracted since the last prefill batch (SGLang's stats)
        # Priority preemptions (not in SGLang's retraction metrics: it counts them only in each request's
        # retraction count, as the twin does in num_retractions).
        self.num_priority_preemptions_total = 0
        self.cache_hit_rate = 0.0
        self.forward_passes = 0
        self.last_gen_throughput = 0.0
        self._thr_t0: float | None = None
        self._thr_tokens = 0
        self.peak_used_tokens = 0

    # -- state queries ------------------------------------------------------------------------------------
    def generated(self, r: Request) -> int:
        """Tokens generated so far by ``r`` (computed from the decode counter while it runs)."""
        if r.state == RUNNING:
            return r.gen + self.decode_steps - r.join_d
        return r.gen

    @property
    def cache_size(self) -> int:
        return self.cache.size if self.cache is not None else 0

    @property
    def evictable(self) -> int:
        return self.cache.evictable_size if self.cache is not None else 0

    @property
    def free_tokens(self) -> int:
        return self.max_total - self.private_used - self.cache_size

    @property
    def used_tokens(self) -> int:
        """KV tokens in use: everything but free and evictable (SGLang's num_used_tokens)."""
        return self.private_used + (self.cache.protected_size if self.cache is not None else 0)

    @property
    def num_running(self) -> int:
        n = len(self.running)
        if self.chunked is not None:
            n += 1
        it = self._inflight
        if it is not None and it.kind != DECODE_PASS:
            n += sum(1 for r, _, _ in it.parts if r.state == PREFILL and r is not self.chunked)
        return n

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.running or self.chunked or self._inflight)

    def stats(self) -> dict:
        used = self.used_tokens
        total = self.max_total
        return {
            "num_running_reqs": self.num_running,
            "num_queue_reqs": len(self.waiting),
            "num_used_tokens": used,
            "token_usage": used / total if total else 0.0,
            "max_total_num_tokens": total,
            "gen_throughput": self.last_gen_throughput,
            "cache_hit_rate": self.cache_hit_rate,
            "cache_size_tokens": self.cache_size,
            "new_token_ratio": self.new_token_ratio,
            "num_retracted_reqs": self.num_retracted_reqs,
            "num_retractions_total": self.num_retractions_total,
            "num_priority_preemptions_total": self.num_priority_preemptions_total,
            "prompt_tokens_total": self.prompt_tokens_total,
            "cached_tokens_total": self.cached_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "num_requests_total": self.num_requests_total,
            "num_aborted_requests_total": self.num_aborted_requests_total,
            "evicted_tokens_total": self.cache.evicted_total if self.cache is not None else 0,
            "forward_passes": self.forward_passes,
            "peak_used_tokens": self.peak_used_tokens,
        }

    def load(self) -> dict:
        """What SGLang's ``get_load`` reports (scheduler.py): ``num_reqs``, requests running or waiting (each
        unfinished request once: the running batch, the chunked and prefilling ones, the waiting queue);
        ``num_waiting_reqs``, the waiting queue; ``num_tokens``, the KV tokens in use (as
        ``num_used_tokens``) plus the tokens of every waiting request (prompt and any output of a retracted
        one: SGLang's ``req.seqlen``)."""
        waiting = self.waiting
        return {
            "num_reqs": self.num_running + len(waiting),
            "num_waiting_reqs": len(waiting),
            "num_tokens": self.used_tokens + sum(r.prompt_len + r.gen for r in waiting),
        }

    # -- requests in and out ------------------------------------------------------------------------------
    def check_fits(self, prompt_len: int, max_new: int) -> None:
        """Raises RequestTooLargeError if prompt + max_new_tokens can never fit the KV pool."""
        if prompt_len + max_new >= self.max_total:
            raise RequestTooLargeError(
                f"The request needs {prompt_len + max_new} KV cache tokens ({prompt_len} input tokens + "
                f"{max_new} max_new_tokens), more than the server's max_total_num_tokens ({self.max_total}) "
                "allows."
            )

    def add_request(self, r: Request, now: float) -> Request | None:
        """Queues ``r`` (raises QueueFullError, PriorityDisabledError or RequestTooLargeError). Returns the
        waiting request ``r`` displaced from a full queue (now aborted; its driver must tell its client), if
        any."""
        self.check_fits(r.prompt_len, r.max_new)
        cfg = self.config
        if self.eos is not None and not r.ignore_eos and not r.internal:
            r.stop_len = min(r.max_new, self.eos.length(r.prompt))
        # SGLang's _set_or_validate_priority: a default when on; when off, ignored unless refused.
        if r.priority is None:
            if self.priority_on:
                r.priority = self.default_priority
        elif not self.priority_on and cfg.abort_on_priority_when_disabled and not r.internal:
            raise PriorityDisabledError()
        displaced = None
        limit = cfg.max_queued_requests
        if not r.internal and limit is not None and len(self.waiting) >= limit:
            displaced = self._displace(r, now)
        r.arrival_time = now
        r.queued_at = now
        r.state = WAITING
        if self.record_times and r.times is None:
            r.times = array("d")
        self.waiting.append(r)
        return displaced

    def _displace(self, r: Request, now: float) -> Request:
        """The queue is full (SGLang's _abort_on_queued_limit): without priority scheduling ``r`` is
        refused; with it, the least preferred waiting request (ties: the latest queued) is aborted instead
        if ``r`` is strictly preferred to it."""
        if not self.priority_on or not self.waiting:
            raise QueueFullError()
        sign = self.priority_sign
        worst = max(self.waiting, key=lambda w: (sign * w.priority, w.queued_at))
        if not sign * r.priority < sign * worst.priority:
            raise QueueFullError()
        self._do_abort(worst, now, DISPLACED_MESSAGE)
        assert worst.finish_reason is not None
        worst.finish_reason["status_code"] = 503  # SGLang's abort carries the HTTP status
        return worst

    def abort(self, r: Request, now: float, message: str = "client disconnected") -> bool:
        """Aborts ``r``. A request inside the forward pass in flight is aborted when the pass completes
        (its KV is in use until then). Returns True if it ended now."""
        if r.state >= DONE:
            return False
        if r in self._in_flight_reqs or (r.state == RUNNING and self._inflight is not None):
            if r.pending_abort is None:
                r.pending_abort = message
                self._pending_aborts.append(r)
            return False
        self._do_abort(r, now, message)
        return True

    def _do_abort(self, r: Request, now: float, message: str) -> None:
        if r.state == WAITING:
            with contextlib.suppress(ValueError):
                self.waiting.remove(r)
        elif r.state == PREFILL:
            if self.chunked is r:
                self.chunked = None
            self.private_used -= r.priv
            r.priv = 0
            self._unlock(r)
        elif r.state == RUNNING:
            self._leave_running(r)
            self.private_used -= r.priv
            r.priv = 0
            self._unlock(r)
            self.batch_is_full = False
        r.state = ABORTED
        r.finished_time = now
        r.finish_reason = {"type": "abort", "message": message}
        if not r.internal:
            self.num_aborted_requests_total += 1

    def flush_cache(self) -> bool:
        """Empties the prefix cache; refused (False) while requests are queued or running."""
        if not self.idle:
            return False
        if self.cache is not None:
            self.cache.reset()
        return True

    # -- the loop -------------------------------------------------------------------------------------------
    def next_iteration(self, now: float) -> Iteration | None:
        """Decides the next forward pass at time ``now``; None when there is nothing to run (idle)."""
        assert self._inflight is None, "complete() the previous iteration first"
        it = self._get_new_batch_prefill(now)
        if it is None:
            if self.running:
                it = self._decode_iteration(now)
            else:
                self.new_token_ratio = self.init_ratio  # idle: SGLang's on_idle
                self.batch_is_full = False
                return None
        self._inflight = it
        used = self.private_used + (self.cache.protected_size if self.cache is not None else 0)
        if used > self.peak_used_tokens:
            self.peak_used_tokens = used
        return it

    def complete(self, it: Iteration, end: float) -> Iteration:
        """Applies the results of ``it`` at time ``end``; returns it with ``finished`` and ``prefilled``."""
        assert it is self._inflight
        self._inflight = None
        self._in_flight_reqs.clear()
        if it.decode_bs:
            self._apply_decode(it, end)
        if it.parts:
            self._apply_prefill(it, end)
        self.forward_passes += 1
        if self._pending_aborts:
            for r in self._pending_aborts:
                msg = r.pending_abort
                r.pending_abort = None
                if r.state < DONE:
                    self._do_abort(r, end, msg or "aborted")
                    it.finished.append(r)
            self._pending_aborts.clear()
        return it

    # -- prefill ------------------------------------------------------------------------------------------
    def _reserved(self) -> float:
        """Sum over running of min(max_new - generated, CLIP) x new_token_ratio."""
        total = self._rem_base - self._n_small * self.decode_steps
        if self._big:
            d = self.decode_steps
            for r in self._big:
                total += min(r.max_new - (r.gen + d - r.join_d), CLIP_MAX_NEW_TOKENS)
        return total * self.new_token_ratio

    def _rem_total(self, a: _Adder) -> float:
        return self.free_tokens + self.evictable - a.total_offset

    def _budget_state(self, a: _Adder) -> int:
        avail = self.free_tokens + self.evictable
        if avail - a.total_offset <= 0 or avail - a.cur_offset <= 0:
            return _NO_TOKEN
        if a.rem_input <= 0 or (a.rem_chunk is not None and a.rem_chunk <= 0):
            return _OTHER
        return _CONTINUE

    def _match(self, r: Request, now: float) -> None:
        """SGLang's init_next_round_input: match the fill ids (all but the last token) in the cache."""
        cache = self.cache
        if cache is None:
            r.node = None
            r.prefix_len = 0
            return
        fill = r.fill_ids()
        node, matched = cache.match_prefix(fill[:-1] if len(fill) > 1 else [], now)
        r.node = node if node is not cache.root else None
        r.prefix_len = matched

    def _lock(self, r: Request) -> None:
        if r.node is not None and self.cache is not None:
            self.cache.lock(r.node)

    def _unlock(self, r: Request) -> None:
        if r.node is not None and self.cache is not None:
            self.cache.unlock(r.node)
        r.node = None

    def _get_new_batch_prefill(self, now: float) -> Iteration | None:
        cfg = self.config
        priority = self.priority_on
        if priority:
            self.batch_is_full = False  # SGLang resets it before every attempt, so that preemption may run
        if (self.batch_is_full or not self.waiting) and self.chunked is None:
            return None
        running_bs = len(self.running)
        if cfg.max_running_requests - running_bs <= 0 and self.chunked is None and not priority:
            self.batch_is_full = True
            return None
        if self.lpm:
            if 1 < len(self.waiting) <= LPM_FALLBACK_QUEUE:
                self._sort_lpm()
        elif priority and len(self.waiting) > 1:
            self._sort_priority()
        mixed_tokens = running_bs if self.mixed and running_bs else 0
        a = _Adder(cfg.max_prefill_tokens, self.chunk_size, mixed_tokens, self._reserved())
        chunked = self.chunked
        if chunked is not None:
            self._add_chunked(a, chunked)
        admitted = 0
        preempted: list[Request] = []
        for r in self.waiting:
            if len(a.can_run) >= cfg.max_running_requests - len(self.running):
                self.batch_is_full = True
                if not priority:
                    break
            # Once the slots were full in this pass, every further candidate has to preempt (SGLang keeps
            # batch_is_full set for the rest of the pass).
            if priority and self.batch_is_full and not self._preempt_for(a, r, now, preempted):
                break
            self._match(r, now)
            res = self._add_one(a, r)
            if a.can_run and a.can_run[-1] is r:
                admitted += 1
            if res != _CONTINUE:
                if res == _NO_TOKEN:
                    self.batch_is_full = True
                break
        if not a.can_run:
            # SGLang returns before re-queueing its preempted requests here (they would be lost); the twin
            # re-queues them. (Only a preempting request refused after all, and nothing else admitted.)
            self.waiting.extend(preempted)
            return None
        for _ in range(admitted):
            self.waiting.popleft()
        self.waiting.extend(preempted)  # after the pass's own requests left the queue, as SGLang does
        self.chunked = a.new_chunked
        # Allocate the new tokens (evicting unlocked cache entries if needed) and mark the requests.
        new_total = 0
        pairs = 0
        for r, n, prefix in a.parts:
            new_total += n
            pairs += attention_pairs(n, prefix)
            if r.state == WAITING:
                r.state = PREFILL
                if r.forward_entry_time is None:
                    r.forward_entry_time = now
            # SGLang's prepare_for_extend: cached_tokens += prefix - already_computed.
            r.cached_tokens += prefix - r.already_computed
            r.already_computed = prefix + n
            self._in_flight_reqs.add(r)
        self._allocate(new_total)
        self.private_used += new_total
        for r, n, _ in a.parts:
            r.priv += n
        if a.log_input + a.log_hit:
            self.cache_hit_rate = a.log_hit / (a.log_input + a.log_hit)
        self.num_retracted_reqs = 0  # SGLang resets this gauge when it logs a prefill batch
        decode_bs = 0
        if self.mixed and self.running:
            n = len(self.running)
            if self.free_tokens < n:
                self._allocate(n)
            if self.free_tokens >= n:
                decode_bs = n
                self.private_used += n
        if decode_bs:
            duration = self.cost.step_s(new_total + decode_bs, pairs, self.sum_ctx)
            kind = MIXED_PASS
        else:
            duration = self.cost.prefill_s(new_total, pairs)
            kind = PREFILL_PASS
        return Iteration(kind, now, duration, a.parts, decode_bs, new_total)

    def _add_chunked(self, a: _Adder, r: Request) -> None:
        """SGLang's add_chunked_req: the chunked request continues first."""
        extend = r.prompt_len + r.gen - r.prefix_len
        rem = a.rem_chunk if a.rem_chunk is not None else extend
        rem = min(rem, int(self._rem_total(a)))
        if rem <= 0:
            rem = a.rem_chunk if a.rem_chunk is not None else extend
            # SGLang allocates the chunk regardless; the twin never lets the pool go negative.
            rem = max(1, min(rem, self.free_tokens + self.evictable))
        truncated = extend > rem
        n = min(extend, rem)
        a.can_run.append(r)
        a.parts.append((r, n, r.prefix_len))
        a.update(0, n, 0 if truncated else min(r.max_new, CLIP_MAX_NEW_TOKENS))
        a.new_chunked = r if truncated else None

    def _add_one(self, a: _Adder, r: Request) -> int:
        """SGLang's add_one_req for one waiting request (already matched)."""
        if r.ignore_eos and self.cache is None:
            return self._add_one_ignore_eos(a, r)
        extend = r.prompt_len + r.gen - r.prefix_len
        total_tokens = extend + min(max(r.max_new - r.gen, 0), CLIP_MAX_NEW_TOKENS)
        if total_tokens >= self._rem_total(a):
            return _NO_TOKEN
        if extend >= a.rem_input and a.can_run:
            return _OTHER
        self._lock(r)
        if total_tokens >= self._rem_total(a):  # locking the prefix may have lowered the budget
            self._unlock(r)
            return _NO_TOKEN
        if a.rem_chunk is None or extend <= a.rem_chunk:
            a.can_run.append(r)
            a.parts.append((r, extend, r.prefix_len))
            a.update(r.prefix_len, extend, min(r.max_new, CLIP_MAX_NEW_TOKENS))
        else:
            trunc = a.rem_chunk
            if trunc <= 0:
                self._unlock(r)
                return _OTHER
            a.can_run.append(r)
            a.parts.append((r, trunc, r.prefix_len))
            a.new_chunked = r
            a.update(r.prefix_len, trunc, 0)
        return self._budget_state(a)

    def _add_one_ignore_eos(self, a: _Adder, r: Request) -> int:
        """SGLang's add_one_req_ignore_eos (radix cache disabled): admits only if, finishing requests in
        order of tokens left, memory never runs out."""
        extend = r.prompt_len + r.gen  # no cache: nothing is reused
        avail = self.free_tokens
        cur_rem = avail - a.cur_offset
        if extend > min(cur_rem, avail - a.total_offset):
            return _NO_TOKEN
        ratio = self.new_token_ratio
        states: list[tuple[float, int]] = []

        def add_state(x: Request, gen: int) -> None:
            left = x.max_new * (1.0 if x.ignore_eos else ratio) - gen
            if left > 0:
                states.append((left, x.prompt_len + gen))

        add_state(r, r.gen)
        d = self.decode_steps
        for x in self.running:
            add_state(x, x.gen + d - x.join_d)
        for x in a.can_run:
            add_state(x, x.gen)
        states.sort(key=lambda s: s[0])
        cur_rem -= extend
        freed = 0
        n = len(states)
        for i, (left, occupied) in enumerate(states):
            bs = n - i
            if cur_rem + freed - left * bs <= IGNORE_EOS_RESERVE_TOKENS * bs:
                return _NO_TOKEN
            freed += occupied
        if a.rem_chunk is None or extend <= a.rem_chunk:
            a.can_run.append(r)
            a.parts.append((r, extend, 0))
            a.update(0, extend, min(r.max_new, CLIP_MAX_NEW_TOKENS))
        else:
            if a.rem_chunk <= 0:
                return _OTHER
            trunc = a.rem_chunk
            a.can_run.append(r)
            a.parts.append((r, trunc, 0))
            a.new_chunked = r
            a.update(0, trunc, 0)
        return self._budget_state(a)

    def _sort_priority(self) -> None:
        """fcfs with priority scheduling: by priority (the preferred first), then by the time each request
        last entered the queue (SGLang's _sort_by_priority_and_fcfs; a stable sort, as Python's list.sort)."""
        sign = self.priority_sign
        self.waiting = deque(sorted(self.waiting, key=lambda r: (r.priority * sign, r.queued_at)))

    def _preempt_for(self, a: _Adder, r: Request, now: float, preempted: list[Request]) -> bool:
        """SGLang's PrefillAdder.preempt_to_schedule: the running requests, least preferred first (ties: the
        latest queued), are preempted while ``r`` beats each one's priority by more than the threshold,
        until their reservations cover what ``r`` needs beyond the remaining budget (its uncached tokens as
        last matched + min(max_new, 4096)). None is preempted unless that many can be. Returns whether ``r``
        may now be tried."""
        sign = self.priority_sign
        d = self.decode_steps
        ratio = self.new_token_ratio

        def offset(x: Request) -> float:  # x's reservation in the budget (SGLang's running-request offset)
            return min(x.max_new - (x.gen + d - x.join_d), CLIP_MAX_NEW_TOKENS) * ratio

        threshold = self.preemption_threshold
        if not self._running_priorities:
            return False
        worst = max(self._running_priorities, key=lambda p: p * sign)
        if (r.priority - worst) * -sign <= threshold:
            return False  # it beats no running request by enough (the common case: no sort)
        need = r.prompt_len + r.gen - r.prefix_len + min(r.max_new, CLIP_MAX_NEW_TOKENS) - self._rem_total(a)
        victims: list[tuple[Request, float]] = []
        for x in sorted(self.running, key=lambda x: (-sign * x.priority, -x.queued_at)):
            if (r.priority - x.priority) * -sign <= threshold:
                break
            off = offset(x)
            victims.append((x, off))
            need -= off
            if need <= 0:
                break
        if not victims or need > 0:
            return False
        remaining = len(self.running)
        for x, off in victims:
            a.total_offset -= off
            remaining -= 1
            self._release(x, now, remaining)
            preempted.append(x)
        self.num_priority_preemptions_total += len(victims)
        return True

    def _sort_lpm(self) -> None:
        """lpm: longest cached prefix first; requests whose prefix is not cached but shared with an earlier
        waiting request go last (SGLang's in-batch prefix caching)."""
        cache = self.cache
        assert cache is not None
        in_batch = RadixCache()
        keyed = []
        for i, r in enumerate(self.waiting):
            fill = r.fill_ids()
            prefix = cache.peek_prefix_len(fill)
            key: float = -prefix
            if prefix <= IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD:
                if in_batch.peek_prefix_len(fill) >= IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD:
                    key = float("inf")
                else:
                    in_batch.insert(fill, 0.0)
            keyed.append((key, i, r))
        keyed.sort(key=lambda k: (k[0], k[1]))
        self.waiting = deque(r for _, _, r in keyed)

    def _allocate(self, n: int) -> None:
        """Makes ``n`` tokens free if the cache can give them up (SGLang evicts before allocating)."""
        short = n - self.free_tokens
        if short > 0 and self.cache is not None:
            self.cache.evict(short)

    def _apply_prefill(self, it: Iteration, end: float) -> None:
        cache = self.cache
        gen_tokens = 0
        for r, n, prefix in it.parts:
            if r.state != PREFILL:
                continue
            computed = prefix + n
            fill_len = r.prompt_len + r.gen
            if cache is not None:
                # cache_unfinished_req: the computed tokens move into the tree; duplicates are freed.
                fill = r.fill_ids()
                node, _added = cache.insert(fill[:computed] if computed < fill_len else fill, end)
                self.private_used -= n
                r.priv -= n
                cache.lock(node)
                self._unlock(r)
                r.node = node
            r.prefix_len = computed
            if computed < fill_len:
                continue  # chunked: more passes to go
            # The prefill produced a token.
            r.gen += 1
            gen_tokens += 1
            if r.first_token_time is None:
                r.first_token_time = end
            if r.times is not None:
                r.times.append(end)
            if r.gen >= r.stop_len:
                self._finish(r, end)
                it.finished.append(r)
                self.batch_is_full = False
                continue
            self._join_running(r)
            it.prefilled.append(r)
        if gen_tokens:
            self._count_generated(gen_tokens, end)

    def _join_running(self, r: Request) -> None:
        d = self.decode_steps
        r.state = RUNNING
        r.join_d = d
        r.finish_d = d + r.stop_len - r.gen
        bucket = self._finish_at.get(r.finish_d)
        if bucket is None:
            self._finish_at[r.finish_d] = [r]
        else:
            bucket.append(r)
        self.running[r] = None
        self.sum_ctx += r.prompt_len + r.gen
        rem = r.max_new - r.gen
        if rem > CLIP_MAX_NEW_TOKENS:
            self._big.add(r)
        else:
            self._rem_base += rem + d
            self._n_small += 1
        if self.priority_on:
            self._running_priorities[r.priority] = self._running_priorities.get(r.priority, 0) + 1

    def _leave_running(self, r: Request) -> None:
        """Takes ``r`` out of the running batch, bringing its counters up to date."""
        if self.priority_on:
            left = self._running_priorities[r.priority] - 1
            if left:
                self._running_priorities[r.priority] = left
            else:
                del self._running_priorities[r.priority]
        d = self.decode_steps
        steps = d - r.join_d
        gen_join = r.gen
        r.gen += steps
        r.priv += steps
        del self.running[r]
        self.sum_ctx -= r.prompt_len + r.gen
        if r in self._big:
            self._big.discard(r)
        else:
            self._rem_base -= r.max_new - gen_join + r.join_d
            self._n_small -= 1
        if r.times is not None and steps:
            r.times.extend(self.decode_times[r.join_d : d])

    # -- decode ---------------------------------------------------------------------------------------------
    def _decode_iteration(self, now: float) -> Iteration:
        """SGLang's update_running_batch: check KV for one token per request (evict, else retract), then
        one decode step."""
        n = len(self.running)
        cache = self.cache
        if cache is not None:
            free = self.max_total - self.private_used - cache.evictable_size - cache.protected_size
            if free < n:
                cache.evict(n)  # check_decode_mem evicts the tokens required
                free = self.max_total - self.private_used - cache.evictable_size - cache.protected_size
        else:
            free = self.max_total - self.private_used
        if free < n:
            self._retract(now)
            self.batch_is_full = False
            n = len(self.running)
        else:
            ratio = self.new_token_ratio - self.ratio_decay
            self.new_token_ratio = ratio if ratio > self.min_ratio else self.min_ratio
        self.private_used += n
        return Iteration(DECODE_PASS, now, self.cost.decode_s(n, self.sum_ctx), [], n, 0)

    def _retract(self, now: float) -> None:
        d = self.decode_steps
        order = sorted(
            self.running, key=lambda r: (r.gen + d - r.join_d, -r.prompt_len), reverse=True
        )  # fewest generated (ties: longest prompt) at the end
        first = True
        retracted = 0
        while first or self.free_tokens < RETRACT_DECODE_STEPS * len(order):
            if len(order) == 1 and self.free_tokens >= 1:
                break  # always keep one (SGLang asserts it has room; if not, the twin retracts it too)
            first = False
            victim = order.pop()
            self._release(victim, now, len(order))
            self.waiting.append(victim)
            retracted += 1
            if not order:
                break
        self.num_retractions_total += retracted
        self.num_retracted_reqs += retracted
        if order:
            gen_sum = sum(r.gen + d - r.join_d for r in order)
            max_new_sum = sum(r.max_new for r in order)
            self.new_token_ratio = min(1.0, (gen_sum + RETRACT_DECODE_STEPS * len(order)) / (max_new_sum + 1))

    def _release(self, victim: Request, now: float, remaining: int) -> None:
        """A running request back to waiting, keeping its output (SGLang's release_req, for retraction and
        priority preemption alike): its private KV (the decode tokens; everything without a cache) is freed
        and its prefix unlocked, the cache gives up enough for 20 more steps of the ``remaining`` running
        requests, and it will re-prefill prompt + output minus the cache hit. The caller re-queues it."""
        self._leave_running(victim)
        self.private_used -= victim.priv
        victim.priv = 0
        self._unlock(victim)
        cache = self.cache
        if cache is not None:
            residual = RETRACT_DECODE_STEPS * remaining - self.free_tokens
            if residual > 0:
                cache.evict(residual)
        victim.state = WAITING
        victim.prefix_len = 0
        victim.already_computed = 0
        victim.num_retractions += 1  # SGLang's reset_for_retract counts both in retraction_count
        victim.queued_at = now

    def _apply_decode(self, it: Iteration, end: float) -> None:
        self.decode_steps += 1
        d = self.decode_steps
        n = it.decode_bs
        self.sum_ctx += n
        if self.record_times:
            self.decode_times.append(end)
        self._count_generated(n, end)
        bucket = self._finish_at.pop(d, None)
        if bucket:
            for r in bucket:
                if r.state == RUNNING and r.finish_d == d and r in self.running:
                    self._leave_running(r)
                    self._finish(r, end)
                    it.finished.append(r)
            self.batch_is_full = False

    def _finish(self, r: Request, end: float) -> None:
        """The request reached max_new_tokens, or its EOS: prompt + output go into the cache, its KV is
        released."""
        cache = self.cache
        if cache is not None:
            if r.output_ids is not None:
                ids = (r.prompt + list(r.output_ids[: r.gen]))[:-1]
                cache.insert(ids, end)
            self._unlock(r)
        self.private_used -= r.priv
        r.priv = 0
        r.state = DONE
        r.finished_time = end
        if r.stop_len < r.max_new:  # SGLang's FINISH_MATCHED_TOKEN: the model's end-of-turn token
            r.finish_reason = {"type": "stop", "matched": END_OF_TURN}
        else:
            r.finish_reason = {"type": "length", "length": r.max_new}
        if not r.internal:
            self.num_requests_total += 1
            self.prompt_tokens_total += r.prompt_len
            self.cached_tokens_total += r.cached_tokens

    def _count_generated(self, n: int, now: float) -> None:
        self.generation_tokens_total += n
        if self._thr_t0 is None:
            self._thr_t0 = now
        self._thr_tokens += n
        dt = now - self._thr_t0
        if dt >= THROUGHPUT_WINDOW_S:
            self.last_gen_throughput = self._thr_tokens / dt
            self._thr_t0 = now
            self._thr_tokens = 0


__all__ = [
    "ABORTED",
    "DECODE_PASS",
    "DONE",
    "MIXED_PASS",
    "PREFILL",
    "PREFILL_PASS",
    "RUNNING",
    "WAITING",
    "Iteration",
    "PriorityDisabledError",
    "QueueFullError",
    "Request",
    "RequestTooLargeError",
    "Scheduler",
    "SchedulerConfig",
    "UnavailableError",
]
