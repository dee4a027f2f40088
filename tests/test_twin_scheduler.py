"""The twin's scheduler rules, one at a time, on a virtual clock (no asyncio, no HTTP)."""

from __future__ import annotations

import itertools

import pytest

from loadlab.sim.clock import run_requests, token_events
from loadlab.sim.cost import CostModel, attention_pairs
from loadlab.sim.radix import RadixCache
from loadlab.sim.scheduler import (
    ABORTED,
    DECODE_PASS,
    DONE,
    MIXED_PASS,
    PREFILL_PASS,
    QueueFullError,
    Request,
    RequestTooLargeError,
    Scheduler,
    SchedulerConfig,
)

COST = CostModel()
_ids = itertools.count(1)


def req(n_prompt: int, max_new: int, prompt: list[int] | None = None, **kw) -> Request:
    """A request with a prompt that shares nothing with any other (unless ``prompt`` is given)."""
    k = next(_ids)
    if prompt is None:
        prompt = [1_000_000 + k] + [(k * 7919 + i) % 100_000 + 2000 for i in range(n_prompt - 1)]
    out = [200_000 + (k * 31 + i) % 50_000 for i in range(max_new)]
    return Request(f"r{k}", prompt, max_new, output_ids=out, **kw)


def step(s: Scheduler, t: float):
    """One pass: decide at t, complete at its end. Returns (iteration, end)."""
    it = s.next_iteration(t)
    assert it is not None
    end = t + it.duration
    s.complete(it, end)
    return it, end


def assert_clean(s: Scheduler) -> None:
    """After every request ended: no private KV, nothing locked, nothing running."""
    assert s.idle
    assert s.private_used == 0
    assert s.cache is None or s.cache.protected_size == 0
    assert s.sum_ctx == 0 and s._rem_base == 0 and s._n_small == 0 and not s._big


# ---------------------------------------------------------------------------------------------------------
def test_prefill_runs_first_and_decode_waits():
    s = Scheduler(SchedulerConfig(), COST)
    a = req(100, 50)
    s.add_request(a, 0.0)
    it, t = step(s, 0.0)
    assert it.kind == PREFILL_PASS and it.parts == [(a, 100, 0)] and it.decode_bs == 0
    assert it.duration == pytest.approx(COST.prefill_s(100, attention_pairs(100, 0)))
    assert s.generated(a) == 1 and a.first_token_time == t
    it, t = step(s, t)
    assert it.kind == DECODE_PASS and it.decode_bs == 1 and s.generated(a) == 2
    assert it.duration == pytest.approx(COST.decode_s(1, 101))  # prompt + 1 generated token
    b = req(200, 10)
    s.add_request(b, t)
    it, t = step(s, t)
    # A waiting request is prefilled before the running one decodes again: a gets no token this pass.
    assert it.kind == PREFILL_PASS and [p[0] for p in it.parts] == [b]
    assert s.generated(a) == 2 and s.generated(b) == 1
    it, t = step(s, t)
    assert it.kind == DECODE_PASS and it.decode_bs == 2
    assert (s.generated(a), s.generated(b)) == (3, 2)


def test_chunked_prefill_budget_and_the_chunked_request_continues_first():
    s = Scheduler(SchedulerConfig(chunked_prefill_size=1024), COST)
    a = req(2500, 4)
    s.add_request(a, 0.0)
    it, t = step(s, 0.0)
    assert it.parts == [(a, 1024, 0)] and s.chunked is a
    assert it.duration == pytest.approx(COST.prefill_s(1024, attention_pairs(1024, 0)))
    b = req(300, 4)
    s.add_request(b, t)  # arrives while a is still being chunked
    it, t = step(s, t)
    assert it.parts == [(a, 1024, 1024)]  # a continues first and takes the whole chunk budget
    assert it.duration == pytest.approx(COST.prefill_s(1024, attention_pairs(1024, 1024)))
    assert a.first_token_time is None
    it, t = step(s, t)
    # The last chunk (452) leaves 572 of the budget: b fits behind it.
    assert it.parts == [(a, 452, 2048), (b, 300, 0)] and s.chunked is None
    assert a.first_token_time == t and b.first_token_time == t
    assert a.cached_tokens == 0  # its own earlier chunks are not cache hits
    run_requests(s, [])
    assert a.state == DONE and b.state == DONE
    assert_clean(s)


def test_max_prefill_tokens_bounds_one_pass():
    s = Scheduler(SchedulerConfig(chunked_prefill_size=-1, max_prefill_tokens=2000), COST)
    reqs = [req(900, 2) for _ in range(3)]
    for r in reqs:
        s.add_request(r, 0.0)
    it, _ = step(s, 0.0)
    assert [p[0] for p in it.parts] == reqs[:2]  # the third would pass the 2000-token budget


def test_max_running_requests_holds():
    s = Scheduler(SchedulerConfig(max_running_requests=4), COST)
    reqs = [req(64, 8 + i % 5) for i in range(20)]
    seen = []

    def observe(it, sched):
        prefilling = {p[0] for p in it.parts} - set(sched.running)
        seen.append(len(sched.running) + len(prefilling))

    run_requests(s, [(0.001 * i, r) for i, r in enumerate(reqs)], observe)
    assert max(seen) == 4
    assert all(r.state == DONE and r.gen == r.max_new for r in reqs)
    assert_clean(s)


class _Probe(Scheduler):
    """Records the running batch around every retraction."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.events = []

    def _retract(self, now):
        before = {r: (self.generated(r), r.prompt_len) for r in self.running}
        super()._retract(now)
        kept = list(self.running)
        gone = [r for r in before if r not in self.running]
        self.events.append((before, gone, kept, self.new_token_ratio, self.free_tokens))


def _retraction_run(fillers: int = 0, **cfg):
    s = _Probe(SchedulerConfig(max_total_tokens=6000, **cfg), COST)
    # Finished requests leave old (least recently used) entries in the cache.
    arrivals = [(0.0, req(500, 1)) for _ in range(fillers)]
    # Prompts of 100-400 tokens, outputs of 200-600: far more than 6000 tokens of KV in all.
    ignore_eos = cfg.get("ignore_eos", True)
    reqs = [req(100 + 50 * (i % 7), 200 + 100 * (i % 5), ignore_eos=ignore_eos) for i in range(40)]
    arrivals += [(1.0 + 0.02 * i, r) for i, r in enumerate(reqs)]
    parts = []
    run_requests(s, arrivals, lambda it, sched: parts.append(list(it.parts)))
    return s, reqs, parts


def _reprefills(s, parts):
    """(request, new tokens, cached prefix, generated when retracted) of every re-prefill."""
    gens = {}
    for before, gone, *_ in s.events:
        for r in gone:
            gens.setdefault(r, []).append(before[r][0])
    seen, out = set(), []
    for p in parts:
        for r, n, prefix in p:
            if r in seen and r in gens and gens[r]:
                out.append((r, n, prefix, gens[r].pop(0)))
            seen.add(r)
    assert not any(gens.values())  # every retracted request was prefilled again
    return out


def test_retraction_picks_fewest_generated_and_re_prefills():
    s, reqs, parts = _retraction_run()
    assert s.events, "the small pool must force retractions"
    tie_broken_by_prompt = False
    for before, gone, kept, ratio, free in s.events:
        assert gone and kept  # at least one retracted, at least one kept
        order = sorted(before, key=lambda r: (before[r][0], -before[r][1]))
        assert gone == order[: len(gone)]  # fewest generated first, ties: longest prompt first
        rest = order[len(gone)]
        if before[rest][0] == before[gone[-1]][0] and before[rest][1] < before[gone[-1]][1]:
            tie_broken_by_prompt = True
        # Enough room for 20 decode steps of the rest (or only one left).
        assert free >= 20 * len(kept) or len(kept) == 1
        gen = sum(before[r][0] for r in kept)
        assert ratio == pytest.approx(min(1.0, (gen + 20 * len(kept)) / (sum(r.max_new for r in kept) + 1)))
    assert tie_broken_by_prompt
    # A retracted request later prefills prompt + the tokens it had generated (minus any cache hit).
    for r, n, prefix, gen in _reprefills(s, parts):
        assert n + prefix == r.prompt_len + gen
    assert (
        sum(r.num_retractions for r in reqs)
        == s.num_retractions_total
        == sum(len(g) for _, g, *_ in s.events)
    )
    assert all(r.state == DONE and r.gen == r.max_new for r in reqs)
    assert all(not r.times for r in reqs)  # token times only when recording
    assert_clean(s)


def test_retracted_request_recomputes_only_what_the_cache_lost():
    s = Scheduler(SchedulerConfig(), COST)
    a, b = req(300, 50), req(200, 50)
    s.add_request(b, 0.0)
    _, t = step(s, 0.0)
    for _ in range(5):
        _, t = step(s, t)  # b is 6 tokens ahead
    s.add_request(a, t)
    for _ in range(11):
        _, t = step(s, t)  # a: prefill + 10 decode steps
    assert (s.generated(a), s.generated(b)) == (11, 16)
    s._retract(t)  # what a decode step does when it cannot get KV (plenty of room here: one victim)
    assert a.state == 0 and a.num_retractions == 1 and list(s.running) == [b]
    assert s.cache.evictable_size >= 300  # a's prompt is unlocked, still cached
    it, t = step(s, t)
    # a prefills its prompt + 11 generated tokens again; the prompt comes from the cache.
    assert it.parts == [(a, 11, 300)] and s.generated(a) == 12
    assert a.cached_tokens == 300  # SGLang counts the hit of every prefill round
    run_requests(s, [])
    assert a.gen == 50 and b.gen == 50
    assert_clean(s)


def test_disabled_cache_with_ignore_eos_reserves_exactly_and_never_retracts():
    s, reqs, _ = _retraction_run(disable_radix_cache=True)
    assert s.num_retractions_total == 0  # SGLang's add_one_req_ignore_eos
    assert all(r.state == DONE for r in reqs)
    s2 = _Probe(SchedulerConfig(max_total_tokens=6000, disable_radix_cache=True), COST)
    reqs = [req(100 + 50 * (i % 7), 200 + 100 * (i % 5), ignore_eos=False) for i in range(40)]
    run_requests(s2, [(0.02 * i, r) for i, r in enumerate(reqs)])
    assert s2.num_retractions_total > 0  # without ignore_eos the usual optimistic admission applies
    assert all(r.state == DONE and r.gen == r.max_new for r in reqs)
    assert_clean(s2)


def test_new_token_ratio_decays_per_decode_step_and_resets_when_idle():
    for conservativeness in (1.0, 0.5):
        s = Scheduler(SchedulerConfig(schedule_conservativeness=conservativeness), COST)
        start = min(0.7 * conservativeness, 1.0)
        floor = 0.14 * start
        assert s.new_token_ratio == pytest.approx(start)
        a = req(10, 700)
        s.add_request(a, 0.0)
        _, t = step(s, 0.0)  # prefill: no decay
        assert s.new_token_ratio == pytest.approx(start)
        for k in range(1, 700):
            _, t = step(s, t)
            if k in (1, 100, 599, 600, 650):
                assert s.new_token_ratio == pytest.approx(max(start - k * (start - floor) / 600, floor))
        assert a.state == DONE
        assert s.new_token_ratio == pytest.approx(floor)
        assert s.next_iteration(t) is None  # idle
        assert s.new_token_ratio == pytest.approx(start)


def _admission_order(policy: str, queue: list[Request], warm: list[Request]) -> list[Request]:
    s = Scheduler(SchedulerConfig(max_running_requests=1, schedule_policy=policy), COST)
    run_requests(s, [(0.0, r) for r in warm])
    blocker = req(5, 30)
    arrivals = [(1.0, blocker)] + [(1.001, r) for r in queue]
    run_requests(s, arrivals)
    assert all(r.state == DONE for r in queue)
    return sorted(queue, key=lambda r: r.forward_entry_time)


def test_lpm_prefers_the_longest_cached_prefix_and_falls_back_to_fcfs():
    shared = list(range(30000, 30400))
    warm = [req(401, 1, prompt=shared + [1])]
    plain0, cached, plain1 = req(400, 2), req(401, 2, prompt=shared + [2]), req(400, 2)
    assert _admission_order("lpm", [plain0, cached, plain1], warm)[0] is cached
    assert _admission_order("fcfs", [req(400, 2), req(401, 2, prompt=shared + [3])], warm)[1].prompt[-1] == 3
    assert cached.cached_tokens == 400
    # More than 128 waiting: lpm becomes fcfs.
    many = [req(20, 1) for _ in range(129)]
    late_cached = req(401, 1, prompt=shared + [4])
    order = _admission_order("lpm", many + [late_cached], warm)
    # fcfs while more than 128 wait (130, then 129), lpm again from 128 on: the cached one jumps ahead.
    assert order[:2] == many[:2] and order[2] is late_cached
    # In-batch prefix caching: a request sharing an uncached prefix with an earlier waiting one goes last.
    p = list(range(50000, 50100))
    x1, x2, y = req(101, 2, prompt=p + [1]), req(101, 2, prompt=p + [2]), req(50, 2)
    s = Scheduler(SchedulerConfig(schedule_policy="lpm"), COST)
    for r in (x1, x2, y):
        s.add_request(r, 0.0)
    s._sort_lpm()
    assert list(s.waiting) == [x1, y, x2]
    # One at a time, x2 then hits x1's prefix in the cache and goes before y.
    assert _admission_order(
        "lpm", [x1c := req(101, 2, prompt=p + [3]), y2 := req(50, 2), x2c := req(101, 2, prompt=p + [4])], []
    ) == [x1c, x2c, y2]
    assert x2c.cached_tokens == 100


def test_running_requests_lock_their_prefix_against_eviction():
    shared = list(range(70000, 70600))
    # While a runs, a newcomer needs room: unlocked entries go, a's locked prompt stays.
    s = Scheduler(SchedulerConfig(max_total_tokens=3000), COST)
    fillers = [req(700, 1) for _ in range(3)]
    run_requests(s, [(0.0, r) for r in fillers])
    assert s.cache.evictable_size >= 2000
    a = req(601, 400, prompt=shared + [9])
    s.add_request(a, 1.0)
    _, t = step(s, 1.0)
    assert s.cache.protected_size == 601
    b = req(800, 5)
    s.add_request(b, t)
    evicted = s.cache.evicted_total
    _, t = step(s, t)  # b's prefill needs room: fillers are evicted, a's locked prompt is not
    assert s.cache.evicted_total > evicted and b.first_token_time == t
    assert s.cache.peek_prefix_len(shared + [9]) == 601
    run_requests(s, [])
    assert_clean(s)


def test_mixed_chunk_decodes_the_running_batch_in_the_prefill_pass():
    s = Scheduler(SchedulerConfig(enable_mixed_chunk=True), COST)
    a = req(100, 20)
    s.add_request(a, 0.0)
    _, t = step(s, 0.0)
    _, t = step(s, t)
    b = req(300, 5)
    s.add_request(b, t)
    ctx = s.sum_ctx
    it, t = step(s, t)
    assert it.kind == MIXED_PASS and it.decode_bs == 1 and it.parts == [(b, 300, 0)]
    assert it.duration == pytest.approx(COST.step_s(301, attention_pairs(300, 0), ctx))
    assert s.generated(a) == 3 and s.generated(b) == 1
    run_requests(s, [])
    assert_clean(s)


def test_abort_in_flight_waits_for_the_pass_and_frees_kv():
    s = Scheduler(SchedulerConfig(), COST)
    a, w = req(100, 50), req(100, 50)
    s.add_request(a, 0.0)
    _, t = step(s, 0.0)
    it = s.next_iteration(t)
    s.add_request(w, t)
    assert s.abort(w, t) is True and w.state == ABORTED  # waiting: at once
    assert s.abort(a, t) is False and a.state < DONE  # in the pass: its KV is in use until the end
    s.complete(it, t + it.duration)
    assert a.state == ABORTED and a in it.finished and a.finish_reason["type"] == "abort"
    assert s.num_aborted_requests_total == 2
    assert_clean(s)


def test_queue_limit_and_requests_that_can_never_fit():
    s = Scheduler(SchedulerConfig(max_queued_requests=2, max_total_tokens=1000), COST)
    s.add_request(req(10, 5), 0.0)
    s.add_request(req(10, 5), 0.0)
    with pytest.raises(QueueFullError):
        s.add_request(req(10, 5), 0.0)
    with pytest.raises(RequestTooLargeError):
        Scheduler(SchedulerConfig(max_total_tokens=1000), COST).add_request(req(900, 100), 0.0)


def test_token_events_honour_stream_interval():
    times = [1.0 + 0.01 * i for i in range(10)]
    ms, toks = token_events(times, 0.5, 1)
    assert toks == [1] * 10 and ms[0] == pytest.approx(500.0) and ms[-1] == pytest.approx(590.0)
    ms, toks = token_events(times, 0.5, 4)
    assert toks == [1, 4, 4, 1]  # the first at once, then every 4, the rest at the end
    assert ms == pytest.approx([500.0, 540.0, 580.0, 590.0])
    assert sum(token_events(times[:9], 0.5, 4)[1]) == 9


def test_radix_cache_lru_eviction_respects_locks():
    c = RadixCache()
    c.insert([1, 2, 3, 4], now=1.0)
    node, matched = c.match_prefix([1, 2, 9], now=2.0)
    assert matched == 2
    c.insert([1, 2, 9, 9], now=3.0)
    c.lock(node)
    assert c.evict(100) == 4 and c.peek_prefix_len([1, 2]) == 2  # the locked [1, 2] stays
    c.unlock(node)
    assert c.evict(1) == 2 and c.size == 0
    for i, t in ((10, 1.0), (20, 2.0), (30, 3.0)):
        c.insert([i, i + 1], now=t)
    c.match_prefix([10, 11], now=4.0)  # touched: now the most recent
    assert c.evict(2) == 2 and c.peek_prefix_len([20, 21]) == 0
    assert c.evict(2) == 2 and c.peek_prefix_len([30, 31]) == 0 and c.peek_prefix_len([10, 11]) == 2


def test_lateness_histogram_quantiles_are_exact_to_the_bin():
    from loadlab.lateness import LatenessHistogram

    h = LatenessHistogram()
    for ms in range(1, 101):  # 1..100 ms, one sample each
        h.record(ms / 1000 - 0.00005)  # mid-bin, so each sample's bin edge is exactly its value
    h.record(-0.001)  # early counts as on time
    h.record(0.25)  # beyond the last bin: the overflow bin reports the max
    assert h.count == 102
    assert h.quantile(0.5) * 1000 == pytest.approx(50, abs=0.1)
    assert h.quantile(0.99) * 1000 == pytest.approx(100, abs=0.1)
    assert h.quantile(1.0) == pytest.approx(0.25)
    s = h.summary_ms()
    assert s["count"] == 102 and s["max"] == 250.0 and s["p90"] == pytest.approx(91, abs=0.11)


def test_load_counts_running_and_waiting_requests_and_tokens_as_sglang():
    """SGLang's get_load: num_reqs = running + waiting, num_waiting_reqs = waiting, num_tokens = KV tokens
    in use + every waiting request's tokens (prompt + output so far, for a retracted one)."""
    s = Scheduler(SchedulerConfig(max_running_requests=2, disable_radix_cache=True), COST)
    assert s.load() == {"num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
    a, b, c = req(300, 50), req(200, 50), req(120, 5)
    s.add_request(a, 0.0)
    s.add_request(b, 0.0)
    s.add_request(c, 0.0)
    # Nothing scheduled yet: all three wait, nothing is in the KV pool.
    assert s.load() == {"num_reqs": 3, "num_waiting_reqs": 3, "num_tokens": 300 + 200 + 120}
    _, t = step(s, 0.0)  # a and b prefill together (two running slots); c waits
    for _ in range(4):
        _, t = step(s, t)
    assert (s.generated(a), s.generated(b)) == (5, 5)
    used = s.stats()["num_used_tokens"]
    assert used == s.used_tokens > 500  # the two prompts and their decoded tokens hold KV
    assert s.load() == {"num_reqs": 3, "num_waiting_reqs": 1, "num_tokens": used + 120}
    s._retract(t)  # b (fewest generated; ties: the longer prompt goes) back to the queue with its tokens
    gone = a if a.state == 0 else b
    assert gone.state == 0 and gone.gen == 5
    used = s.used_tokens
    assert s.load() == {"num_reqs": 3, "num_waiting_reqs": 2, "num_tokens": used + 120 + gone.prompt_len + 5}
    run_requests(s, [])
    assert s.load() == {"num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
    assert_clean(s)
