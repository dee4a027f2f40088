"""The simulated SGLang engine: continuous batching with a prefix cache, on the wall clock.

Pure Python and asyncio, no HTTP. The server talks to it only through:

- ``Engine.submit(prompt_ids, max_new_tokens, ...) -> RequestHandle`` (raises ``QueueFullError`` or
  ``RequestTooLargeError``); ``async for step in handle`` yields ``Step(new_tokens, completion_tokens,
  finish_reason)`` (``finish_reason`` only on the last step); ``handle.abort()`` frees a request.
- ``Engine.stats()`` for /metrics and /server_info, ``Engine.flush_cache()``, ``start()``/``stop()``.

A later, scheduler-faithful engine can replace this one behind the same interface.

The model (simple on purpose; see docs/sim.md):

- Requests queue FCFS (or lpm: longest cached prefix first). Each iteration runs EITHER one prefill pass for
  newly admitted requests (prefill first, as SGLang does) OR one decode step that gives every running
  request one token. An iteration's tokens are delivered when its step time has passed.
- Admission needs a free running slot (``max_running_requests``) and KV room for the uncached prompt plus
  ``max_new_tokens`` (reserved up front, so there is never a retraction). Unlocked cache entries are
  evicted (LRU) to make room.
- Chunked prefill: at most ``chunked_prefill_size`` new tokens per pass; a longer prompt continues first in
  the next pass. ``max_prefill_tokens`` caps the new tokens of one pass as in SGLang.
- Prefix cache: a token-level radix tree (like SGLang's RadixCache) with lock counts and LRU eviction of
  unlocked leaves. A prompt is inserted when its prefill ends; prompt plus output when the request ends.
- The model never emits EOS: every request runs to ``max_new_tokens`` (finish_reason ``length``), whatever
  ``ignore_eos`` says.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

# ---------------------------------------------------------------------------------------------------------
# Cost model: A100-80GB SXM serving Llama-3.1-8B in bf16. Every number comes from
# shared/design/twin.md ("Cost of one forward pass"), which derives them from a roofline model and
# Vidur's A100 profile of Llama-3-8B.
# ---------------------------------------------------------------------------------------------------------
# Linear-layer time (ms) for a forward pass over N tokens, 32 layers summed (Vidur's profile, twin.md).
LINEAR_MS_POINTS: tuple[tuple[int, float], ...] = (
    (1, 9.7),
    (32, 10.9),
    (64, 11.2),
    (128, 13.2),
    (256, 19.5),
    (512, 34.6),
    (1024, 75.1),
    (2048, 146.0),
    (8192, 545.0),
)
# Fixed cost per forward pass (launch, sampling, scheduling). twin.md assumes ~0.5 ms; 1.15 ms makes the
# decode formula below reproduce twin.md's decode table (batch 1-256 x context 512-2048) within 0.5 ms in
# every cell (batch 1 at 1024: 10.9 ms; 32: 14.7; 128: 24.8 vs 24.7; 256: 41.5 vs 42.0).
STEP_OVERHEAD_S = 1.15e-3
# KV cache bytes per token: 32 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes (twin.md).
KV_BYTES_PER_TOKEN = 131072
# Effective HBM bandwidth of an A100-80GB SXM (twin.md: peak 2.04 TB/s, effective ~1.65 TB/s).
HBM_BYTES_PER_S = 1.65e12
# A decode step reads every running request's whole KV cache once.
KV_READ_S_PER_TOKEN = KV_BYTES_PER_TOKEN / HBM_BYTES_PER_S  # ~79 ns per token of context
# Prefill attention FLOPs per (query, key) pair: QK^T and PV, 2 FLOPs per multiply-add, 32 layers x 4096.
ATTN_FLOPS_PER_PAIR = 2 * 2 * 32 * 4096
# Effective FLOP rate for prefill attention (twin.md: 190-210 TFLOP/s effective on A100).
ATTN_FLOP_PER_S = 2.0e14
# KV capacity: ~440k tokens on an A100-80GB at mem_fraction_static 0.88 (twin.md, derived). Modelled as
# GPU memory x fraction - (weights + activations/graphs), the second term fixed so 0.88 gives 440k.
GPU_MEMORY_BYTES = 80 * 2**30
DEFAULT_MEM_FRACTION_STATIC = 0.88
NON_KV_BYTES = GPU_MEMORY_BYTES * DEFAULT_MEM_FRACTION_STATIC - 440_000 * KV_BYTES_PER_TOKEN
WEIGHT_BYTES = 16.06e9  # 8.03B parameters x 2 bytes


def linear_time_s(n_tokens: int) -> float:
    """Linear-layer time of a forward pass over ``n_tokens`` tokens (piecewise-linear in Vidur's table)."""
    pts = LINEAR_MS_POINTS
    if n_tokens <= pts[0][0]:
        return pts[0][1] * 1e-3
    for (n0, t0), (n1, t1) in itertools.pairwise(pts):
        if n_tokens <= n1:
            return (t0 + (t1 - t0) * (n_tokens - n0) / (n1 - n0)) * 1e-3
    n_last, t_last = pts[-1]
    return t_last * n_tokens / n_last * 1e-3


def decode_step_s(batch_size: int, total_context: int) -> float:
    """One decode step for ``batch_size`` requests holding ``total_context`` tokens of KV in all."""
    return STEP_OVERHEAD_S + linear_time_s(batch_size) + KV_READ_S_PER_TOKEN * total_context


def prefill_pass_s(parts: Sequence[tuple[int, int]]) -> float:
    """One prefill pass; ``parts`` holds (new tokens, tokens already in KV before them) per request."""
    new_total = 0
    pairs = 0
    for new, prefix in parts:
        new_total += new
        pairs += new * prefix + new * (new + 1) // 2
    return STEP_OVERHEAD_S + linear_time_s(new_total) + pairs * ATTN_FLOPS_PER_PAIR / ATTN_FLOP_PER_S


def kv_tokens_for(mem_fraction_static: float) -> int:
    """KV capacity in tokens for a memory fraction (0.88 -> 440,000)."""
    return max(0, int((GPU_MEMORY_BYTES * mem_fraction_static - NON_KV_BYTES) / KV_BYTES_PER_TOKEN))


def default_max_running_requests(kv_tokens: int, context_length: int) -> int:
    """SGLang's default when --max-running-requests is unset (twin.md)."""
    auto = min(max(int(kv_tokens / context_length * 512), 2048), 4096)
    return max(1, min(auto, kv_tokens // 2))


# ---------------------------------------------------------------------------------------------------------
# Prefix cache: a token-level radix tree.
# ---------------------------------------------------------------------------------------------------------
class _Node:
    __slots__ = ("children", "parent", "key", "lock_ref", "last_access")

    def __init__(self, key: list[int], parent: _Node | None, lock_ref: int, last_access: float):
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.key = key
        self.lock_ref = lock_ref
        self.last_access = last_access


def _common_len(key: list[int], ids: Sequence[int], start: int) -> int:
    n = min(len(key), len(ids) - start)
    i = 0
    while i < n and key[i] == ids[start + i]:
        i += 1
    return i


class RadixCache:
    """Token-level radix tree over token ids. Locked nodes (used by running requests) are never evicted;
    eviction removes the least recently used unlocked leaves."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.root = _Node([], None, 1, 0.0)
        self.evictable_size = 0
        self.protected_size = 0
        self.evicted_total = 0

    @property
    def size(self) -> int:
        return self.evictable_size + self.protected_size

    def peek_prefix_len(self, ids: Sequence[int]) -> int:
        """Length of the cached prefix of ``ids``, without changing the tree."""
        node = self.root
        i = 0
        n = len(ids)
        while i < n:
            child = node.children.get(ids[i])
            if child is None:
                break
            m = _common_len(child.key, ids, i)
            i += m
            if m < len(child.key):
                break
            node = child
        return i

    def match_prefix(self, ids: Sequence[int], now: float) -> tuple[_Node, int]:
        """The node ending the longest cached prefix of ``ids`` (split so it ends exactly there)."""
        node = self.root
        i = 0
        n = len(ids)
        while i < n:
            child = node.children.get(ids[i])
            if child is None:
                break
            key = child.key
            kl = len(key)
            if ids[i : i + kl] == key:
                child.last_access = now
                node = child
                i += kl
                continue
            m = _common_len(key, ids, i)
            node = self._split(child, m)
            node.last_access = now
            i += m
            break
        return node, i

    def insert(self, ids: list[int], now: float) -> tuple[_Node, int]:
        """Inserts ``ids``; returns the node ending them and how many tokens were new to the cache."""
        node = self.root
        i = 0
        n = len(ids)
        while i < n:
            child = node.children.get(ids[i])
            if child is None:
                leaf = _Node(ids[i:], node, 0, now)
                node.children[ids[i]] = leaf
                self.evictable_size += n - i
                return leaf, n - i
            key = child.key
            kl = len(key)
            if ids[i : i + kl] == key:
                child.last_access = now
                node = child
                i += kl
                continue
            m = _common_len(key, ids, i)
            node = self._split(child, m)
            node.last_access = now
            i += m
        return node, 0

    def _split(self, child: _Node, m: int) -> _Node:
        parent = child.parent
        assert parent is not None and 0 < m < len(child.key)
        new = _Node(child.key[:m], parent, child.lock_ref, child.last_access)
        new.children[child.key[m]] = child
        parent.children[new.key[0]] = new
        child.key = child.key[m:]
        child.parent = new
        return new

    def lock(self, node: _Node) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: _Node) -> None:
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node = node.parent  # type: ignore[assignment]

    def evict(self, num_tokens: int) -> int:
        """Frees at least ``num_tokens`` tokens if it can (LRU unlocked leaves first); returns freed."""
        if num_tokens <= 0 or self.evictable_size == 0:
            return 0
        tie = itertools.count()
        heap = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node.lock_ref == 0 and node is not self.root:
                heap.append((node.last_access, next(tie), node))
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            del parent.children[node.key[0]]
            freed += len(node.key)
            self.evictable_size -= len(node.key)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, next(tie), parent))
        self.evicted_total += freed
        return freed


# ---------------------------------------------------------------------------------------------------------
# Requests and the handle the server holds.
# ---------------------------------------------------------------------------------------------------------
class QueueFullError(Exception):
    """The waiting queue already holds ``max_queued_requests`` requests."""


class RequestTooLargeError(ValueError):
    """The request can never be admitted: prompt + max_new_tokens exceed the KV pool."""


class Step(NamedTuple):
    new_tokens: int  # tokens produced since the previous step
    completion_tokens: int  # cumulative
    finish_reason: dict | None  # set on the last step only


WAITING, PREFILL, RUNNING, DONE, ABORTED = range(5)


class RequestHandle:
    """One submitted request. Async-iterate it for ``Step``s; ``abort()`` when the client goes away.

    Times are event-loop clock values (``loop.time()``); ``wall()`` turns one into a Unix timestamp.
    """

    __slots__ = (
        "_computed",
        "_engine",
        "_final_yielded",
        "_node",
        "_priv",
        "_reserved",
        "_sent",
        "_waiter",
        "arrival_time",
        "cached_tokens",
        "completion_tokens",
        "finish_reason",
        "finished_time",
        "first_token_time",
        "forward_entry_time",
        "internal",
        "max_new_tokens",
        "output_ids",
        "prompt_ids",
        "prompt_tokens",
        "rid",
        "state",
        "stream_interval",
    )

    def __init__(
        self,
        engine: Engine,
        rid: str,
        prompt_ids: list[int],
        max_new_tokens: int,
        stream_interval: int,
        output_ids: Sequence[int] | None,
        internal: bool,
        now: float,
    ):
        self._engine = engine
        self.rid = rid
        self.prompt_ids = prompt_ids
        self.prompt_tokens = len(prompt_ids)
        self.max_new_tokens = max_new_tokens
        self.stream_interval = stream_interval
        self.output_ids = output_ids
        self.internal = internal
        self.state = WAITING
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.finish_reason: dict | None = None
        self.arrival_time = now
        self.forward_entry_time: float | None = None
        self.first_token_time: float | None = None  # end of the prefill (first token, or none if max_new=0)
        self.finished_time: float | None = None
        self._computed = 0  # prompt tokens whose KV exists (cached + prefilled)
        self._node: _Node | None = None  # locked cache node
        self._reserved = 0  # KV tokens reserved privately (outside the cache)
        self._priv = 0  # KV tokens actually used privately
        self._sent = 0
        self._final_yielded = False
        self._waiter: asyncio.Future | None = None

    @property
    def finished(self) -> bool:
        return self.state >= DONE

    def wall(self, loop_time: float | None) -> float | None:
        return None if loop_time is None else loop_time + self._engine.wall_offset

    def abort(self, message: str = "client disconnected") -> None:
        self._engine._abort(self, message)

    def _ready(self) -> bool:
        ct = self.completion_tokens
        return (
            self.state >= DONE
            or (self._sent == 0 and ct > 0)
            or (ct - self._sent >= self.stream_interval and ct > self._sent)
        )

    def _notify(self) -> None:
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
                ct = self.completion_tokens
                new = ct - self._sent
                self._sent = ct
                if self.state >= DONE:
                    self._final_yielded = True
                    return Step(new, ct, self.finish_reason)
                return Step(new, ct, None)
            fut = asyncio.get_running_loop().create_future()
            self._waiter = fut
            try:
                await fut
            finally:
                self._waiter = None


# ---------------------------------------------------------------------------------------------------------
# The engine.
# ---------------------------------------------------------------------------------------------------------
@dataclass
class EngineConfig:
    max_running_requests: int = 2048
    max_queued_requests: int | None = None  # None: unbounded
    max_total_tokens: int = 440_000
    chunked_prefill_size: int = 8192  # <= 0: chunking off
    max_prefill_tokens: int = 16384
    schedule_policy: str = "fcfs"  # fcfs | lpm
    disable_radix_cache: bool = False
    stream_interval: int = 1


LATE_TOLERANCE_S = 0.005  # a step may start up to this late and still be timed from its intended start
THROUGHPUT_WINDOW_S = 1.0
LPM_FALLBACK_QUEUE = 128  # SGLang falls back from lpm to fcfs above this many waiting requests


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.cache: RadixCache | None = None if config.disable_radix_cache else RadixCache()
        self._waiting: deque[RequestHandle] = deque()
        self._running: list[RequestHandle] = []
        self._prefilling: list[RequestHandle] = []  # admitted, prompt not yet fully computed
        self._chunked: RequestHandle | None = None
        self._private_reserved = 0
        self._private_used = 0
        self._sum_ctx = 0  # KV tokens held by running requests (prompt + generated)
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.wall_offset = 0.0
        # statistics
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_requests_total = 0
        self.num_aborted_requests_total = 0
        self.last_gen_throughput = 0.0
        self.cache_hit_rate = 0.0
        self.forward_passes = 0
        self._thr_t0 = 0.0
        self._thr_tokens = 0

    # -- lifecycle ------------------------------------------------------------------------------------
    async def start(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        self.wall_offset = time.time() - loop.time()
        self._wake = asyncio.Event()
        self._thr_t0 = loop.time()
        self._task = asyncio.create_task(self._run(), name="loadlab-sim-engine")
        self._task.add_done_callback(self._on_loop_done)

    def _on_loop_done(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:
            return
        logging.getLogger("loadlab.sim.engine").error("engine loop failed", exc_info=task.exception())
        for r in list(self._waiting) + self._prefilling + self._running:
            self._abort(r, "engine failure")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for r in list(self._waiting) + self._prefilling + self._running:
            self._abort(r, "server shutting down")

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
    ) -> RequestHandle:
        """Queues a request. ``output_ids`` (the ids the request will generate, if the caller knows them)
        lets finished requests leave prompt + output in the prefix cache. ``internal`` requests (health
        checks) bypass the queue limit and are not counted in the statistics. ``ignore_eos`` is accepted
        and has no effect: the model never emits EOS."""
        del ignore_eos
        cfg = self.config
        prompt = list(prompt_ids)
        if len(prompt) + max_new_tokens > cfg.max_total_tokens:
            raise RequestTooLargeError(
                f"The request needs {len(prompt) + max_new_tokens} KV cache tokens ({len(prompt)} input "
                f"tokens + {max_new_tokens} max_new_tokens), more than the server's max_total_num_tokens "
                f"({cfg.max_total_tokens})."
            )
        if (
            not internal
            and cfg.max_queued_requests is not None
            and len(self._waiting) >= cfg.max_queued_requests
        ):
            raise QueueFullError("The request queue is full.")
        assert self._wake is not None, "Engine.start() was not called"
        loop = asyncio.get_running_loop()
        handle = RequestHandle(
            self,
            rid or uuid.uuid4().hex,
            prompt,
            max_new_tokens,
            stream_interval or cfg.stream_interval,
            output_ids,
            internal,
            loop.time(),
        )
        self._waiting.append(handle)
        self._wake.set()
        return handle

    def flush_cache(self) -> bool:
        """Empties the prefix cache; refused (False) while requests are queued or running."""
        if self._waiting or self._running or self._prefilling:
            return False
        if self.cache is not None:
            self.cache.reset()
        return True

    def stats(self) -> dict:
        used = self._private_used + (self.cache.protected_size if self.cache is not None else 0)
        total = self.config.max_total_tokens
        return {
            "num_running_reqs": len(self._running) + len(self._prefilling),
            "num_queue_reqs": len(self._waiting),
            "num_used_tokens": used,
            "token_usage": used / total if total else 0.0,
            "max_total_num_tokens": total,
            "gen_throughput": self.last_gen_throughput,
            "cache_hit_rate": self.cache_hit_rate,
            "cache_size_tokens": self.cache.size if self.cache is not None else 0,
            "prompt_tokens_total": self.prompt_tokens_total,
            "cached_tokens_total": self.cached_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "num_requests_total": self.num_requests_total,
            "num_aborted_requests_total": self.num_aborted_requests_total,
            "evicted_tokens_total": self.cache.evicted_total if self.cache is not None else 0,
            "forward_passes": self.forward_passes,
        }

    # -- the loop ---------------------------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        wake = self._wake
        assert wake is not None
        t = loop.time()
        busy = False
        while True:
            if not (self._waiting or self._running or self._chunked):
                wake.clear()
                await wake.wait()
                busy = False
            now = loop.time()
            # Time the step from the previous step's intended end, so wake-up lateness does not drift.
            t = max(t, now - LATE_TOLERANCE_S) if busy else now
            parts = self._schedule_prefill(now)
            if parts:
                end = t + prefill_pass_s([(n, prefix) for _, n, prefix in parts])
                await self._sleep_until(loop, end)
                self._complete_prefill(parts, loop.time())
            elif self._running:
                end = t + decode_step_s(len(self._running), self._sum_ctx)
                await self._sleep_until(loop, end)
                self._complete_decode(loop.time())
            else:
                # Queued requests but none can be admitted and nothing runs: wait for a change.
                wake.clear()
                await wake.wait()
                busy = False
                continue
            self.forward_passes += 1
            t = end
            busy = True

    @staticmethod
    async def _sleep_until(loop: asyncio.AbstractEventLoop, end: float) -> None:
        delay = end - loop.time()
        await asyncio.sleep(delay if delay > 0 else 0)

    def _schedule_prefill(self, now: float) -> list[tuple[RequestHandle, int, int]]:
        cfg = self.config
        chunk_budget = cfg.chunked_prefill_size if cfg.chunked_prefill_size > 0 else 1 << 62
        input_budget = cfg.max_prefill_tokens
        parts: list[tuple[RequestHandle, int, int]] = []
        r = self._chunked
        if r is not None:
            remaining = r.prompt_tokens - r._computed
            n = min(remaining, chunk_budget)
            parts.append((r, n, r._computed))
            chunk_budget -= n
            input_budget -= n
            if n < remaining:
                return parts
            self._chunked = None
        if not self._waiting:
            return parts
        if len(self._running) + len(self._prefilling) >= cfg.max_running_requests:
            return parts
        if (
            cfg.schedule_policy == "lpm"
            and self.cache is not None
            and 1 < len(self._waiting) <= LPM_FALLBACK_QUEUE
        ):
            cache = self.cache
            order = sorted(self._waiting, key=lambda h: -cache.peek_prefix_len(h.prompt_ids[:-1]))
            self._waiting = deque(order)
        while self._waiting and chunk_budget > 0 and input_budget > 0:
            if len(self._running) + len(self._prefilling) >= cfg.max_running_requests:
                break
            r = self._waiting[0]
            node = None
            cached = 0
            if self.cache is not None and r.prompt_tokens > 1:
                # At least one prompt token is always computed (its logits give the first token).
                node, cached = self.cache.match_prefix(r.prompt_ids[:-1], now)
            extend = r.prompt_tokens - cached
            if parts and extend > input_budget:
                break
            need = extend + r.max_new_tokens
            if not self._reserve(need, node):
                break
            self._waiting.popleft()
            r._node = node
            r._reserved = need
            r.cached_tokens = cached
            r._computed = cached
            r.state = PREFILL
            r.forward_entry_time = now
            self._prefilling.append(r)
            n = min(extend, chunk_budget)
            parts.append((r, n, cached))
            chunk_budget -= n
            input_budget -= n
            if n < extend:
                self._chunked = r
                break
        return parts

    def _reserve(self, need: int, node: _Node | None) -> bool:
        """Reserves ``need`` private KV tokens, evicting unlocked cache entries if needed; locks ``node``."""
        cache = self.cache
        if cache is not None and node is not None:
            cache.lock(node)
        total = self.config.max_total_tokens
        free = total - self._private_reserved - (cache.size if cache is not None else 0)
        if need > free and cache is not None:
            cache.evict(need - free)
            free = total - self._private_reserved - cache.size
        if need > free:
            if cache is not None and node is not None:
                cache.unlock(node)
            return False
        self._private_reserved += need
        return True

    def _complete_prefill(self, parts: list[tuple[RequestHandle, int, int]], now: float) -> None:
        new_tokens = 0
        hit_tokens = 0
        for r, n, _ in parts:
            if r.state != PREFILL:
                continue  # aborted while the pass ran
            r._computed += n
            r._priv += n
            self._private_used += n
            new_tokens += n
            if r._computed < r.prompt_tokens:
                continue  # chunked: more passes to go
            hit_tokens += r.cached_tokens
            if not r.internal:
                self.prompt_tokens_total += r.prompt_tokens
                self.cached_tokens_total += r.cached_tokens
            self._prefilling.remove(r)
            cache = self.cache
            if cache is not None:
                node, added = cache.insert(r.prompt_ids, now)
                cache.lock(node)
                if r._node is not None:
                    cache.unlock(r._node)
                r._node = node
                # The newly cached tokens now live in the (locked) cache, not in private KV.
                r._reserved -= added
                self._private_reserved -= added
                r._priv -= added
                self._private_used -= added
            r.first_token_time = now
            if r.max_new_tokens == 0:
                self._finish(r, now)
                continue
            r.completion_tokens = 1
            r._priv += 1
            self._private_used += 1
            if not r.internal:
                self._count_generated(1, now)
            if r.completion_tokens >= r.max_new_tokens:
                self._finish(r, now)
                continue
            r.state = RUNNING
            self._running.append(r)
            self._sum_ctx += r.prompt_tokens + 1
            r._notify()
        if new_tokens + hit_tokens:
            self.cache_hit_rate = hit_tokens / (new_tokens + hit_tokens)

    def _complete_decode(self, now: float) -> None:
        running = self._running
        done = None
        for r in running:
            r.completion_tokens += 1
            r._priv += 1
            if r.completion_tokens >= r.max_new_tokens:
                if done is None:
                    done = []
                done.append(r)
            elif r._waiter is not None:
                r._notify()
        b = len(running)
        self._sum_ctx += b
        self._private_used += b
        self._count_generated(b, now)
        if done:
            self._running = [r for r in running if r.completion_tokens < r.max_new_tokens]
            for r in done:
                self._sum_ctx -= r.prompt_tokens + r.completion_tokens
                self._finish(r, now)

    def _count_generated(self, n: int, now: float) -> None:
        self.generation_tokens_total += n
        self._thr_tokens += n
        dt = now - self._thr_t0
        if dt >= THROUGHPUT_WINDOW_S:
            self.last_gen_throughput = self._thr_tokens / dt
            self._thr_t0 = now
            self._thr_tokens = 0

    def _release(self, r: RequestHandle, now: float, keep_output: bool) -> None:
        cache = self.cache
        if cache is not None:
            if keep_output and r.output_ids is not None and r.completion_tokens > 0 and r._node is not None:
                ids = r.prompt_ids + list(r.output_ids[: r.completion_tokens])
                cache.insert(ids, now)
            if r._node is not None:
                cache.unlock(r._node)
        r._node = None
        self._private_reserved -= r._reserved
        r._reserved = 0
        self._private_used -= r._priv
        r._priv = 0

    def _finish(self, r: RequestHandle, now: float) -> None:
        r.state = DONE
        r.finished_time = now
        r.finish_reason = {"type": "length", "length": r.max_new_tokens}
        self._release(r, now, keep_output=True)
        if not r.internal:
            self.num_requests_total += 1
        r._notify()

    def _abort(self, r: RequestHandle, message: str) -> None:
        if r.state >= DONE:
            return
        now = self._loop.time() if self._loop is not None else 0.0
        if r.state == WAITING:
            with contextlib.suppress(ValueError):
                self._waiting.remove(r)
        elif r.state == PREFILL:
            self._prefilling.remove(r)
            if self._chunked is r:
                self._chunked = None
        elif r.state == RUNNING:
            self._running.remove(r)
            self._sum_ctx -= r.prompt_tokens + r.completion_tokens
        r.state = ABORTED
        r.finished_time = now
        r.finish_reason = {"type": "abort", "message": message}
        self._release(r, now, keep_output=False)
        if not r.internal:
            self.num_aborted_requests_total += 1
        if self._wake is not None:
            self._wake.set()  # room may have opened for queued requests
        r._notify()
