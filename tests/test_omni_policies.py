"""omni's policies, estimates and signal parsing as pure functions (no processes): each policy routes as
docs/cluster.md "The omni front" defines it."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from loadlab.cluster.policies import (
    PolicyParams,
    Snapshot,
    WorkerLoad,
    affinity_worker,
    choose,
    class_districts,
    in_flight_limit,
    next_in_line,
    prompt_prefix,
    switch_routes,
)
from loadlab.cluster.signals import combine, parse_get_load, parse_metrics


def workers(*loads: dict, **common) -> tuple[WorkerLoad, ...]:
    return tuple(
        WorkerLoad(index=i, name=f"http://w{i}", **{**common, **load}) for i, load in enumerate(loads)
    )


def test_estimates_correct_the_stale_poll_with_omnis_own_counts():
    # Polled: 2 running, 0 waiting with omni at 2 in flight; omni has sent 3 more since: 5 now.
    w = WorkerLoad(0, "w", running=2, waiting=0, in_flight=5, in_flight_at_poll=2, max_running=4)
    assert (w.total_est, w.running_est, w.waiting_est) == (5, 4, 1)
    # Saturated at the poll (requests waiting): new requests wait; finished ones free the queue first.
    w = WorkerLoad(0, "w", running=3, waiting=2, in_flight=3, in_flight_at_poll=5, max_running=8)
    assert (w.total_est, w.running_est, w.waiting_est) == (3, 3, 0)
    w = WorkerLoad(0, "w", running=3, waiting=2, in_flight=7, in_flight_at_poll=5, max_running=8)
    assert (w.total_est, w.running_est, w.waiting_est) == (7, 3, 4)
    # Load from elsewhere (not through omni) stays in the estimate.
    w = WorkerLoad(0, "w", running=6, waiting=0, in_flight=1, in_flight_at_poll=0)
    assert w.total_est == 7
    # omni's requests not yet at the worker when it answered: never fewer than omni's own.
    w = WorkerLoad(0, "w", running=1, waiting=0, in_flight=4, in_flight_at_poll=3)
    assert w.total_est == 4
    # Without any signal: omni's own count, split by max_running.
    w = WorkerLoad(0, "w", in_flight=6, max_running=4)
    assert (w.total_est, w.running_est, w.waiting_est) == (6, 4, 2)
    # KV: the polled usage plus the worker's usage per running request for each new running one.
    w = WorkerLoad(0, "w", running=2, waiting=0, token_usage=0.2, in_flight=3, in_flight_at_poll=2)
    assert w.kv_est(0.05) == pytest.approx(0.3)
    assert WorkerLoad(0, "w", running=0, waiting=0, token_usage=0.0, in_flight=2).kv_est(0.05) == 0.1


def test_round_robin_alternates_and_skips_workers_without_room():
    ws = workers({}, {}, {})
    cursor, order = 0, []
    for _ in range(7):
        i = choose("round_robin", Snapshot(ws, cursor=cursor), random.Random(0))
        order.append(i)
        cursor = i + 1
    assert order == [0, 1, 2, 0, 1, 2, 0]
    ws = workers({}, {"up": False}, {"limit": 1, "in_flight": 1}, {})
    assert choose("round_robin", Snapshot(ws, cursor=1), random.Random(0)) == 3
    assert choose("round_robin", Snapshot(ws, cursor=4), random.Random(0)) == 0


def test_nothing_with_room_means_wait():
    ws = workers({"limit": 2, "in_flight": 2}, {"up": False})
    for policy in ("round_robin", "power_of_two", "least_queue", "least_kv", "prefix"):
        assert choose(policy, Snapshot(ws, key=b"k"), random.Random(0)) is None


def test_the_switch_rule_own_districts_first_then_a_line_longer_than_the_threshold():
    full = Snapshot(tuple(WorkerLoad(i, f"w{i}", limit=2, in_flight=2) for i in range(2)))
    room = Snapshot((WorkerLoad(2, "w2", limit=4, in_flight=1), WorkerLoad(3, "w3", limit=4, in_flight=0)))
    own_room = Snapshot((WorkerLoad(0, "w0", limit=2, in_flight=1),))
    rng = random.Random(0)
    # Room at home: always home, whatever the line.
    assert next_in_line("least_queue", own_room, room, 9, 0, rng) == (0, False)
    # Home full: diverted (to the switch district's least busy) once more than N are in line.
    assert next_in_line("least_queue", full, room, 1, 0, rng) == (3, True)
    assert next_in_line("least_queue", full, room, 2, 2, rng) is None
    assert next_in_line("least_queue", full, room, 3, 2, rng) == (3, True)
    # No switch for this decision, or no room there either: it waits.
    assert next_in_line("least_queue", full, None, 5, 0, rng) is None
    assert next_in_line("least_queue", full, full, 5, 0, rng) is None
    # A down worker has no room: its district counts as full.
    down = Snapshot((WorkerLoad(0, "w0", up=False, limit=2),))
    assert next_in_line("round_robin", down, room, 1, 0, rng) == (2, True)


def test_switch_routes_auto_and_explicit():
    names = ["online", "offline", "rest"]
    pools = class_districts([("online", ["online"]), ("offline", ["offline"]), ("rest", None)])
    assert pools == {"online": ["online", "rest"], "offline": ["offline", "rest"], "default": ["rest"]}
    assert switch_routes(pools, names, "auto") == {"online": ["offline"], "offline": ["online"],
                                                   "default": ["online", "offline"]}  # fmt: skip
    assert switch_routes(pools, names, {"online": ["offline"]}) == {"online": ["offline"]}
    assert switch_routes(pools, names, None) == {}
    with pytest.raises(ValueError, match="online: district 'rest' already serves class 'online'"):
        switch_routes(pools, names, {"online": ["rest"]})


def test_in_flight_limit():
    assert in_flight_limit(64) == 64 and in_flight_limit(64, fraction=0.75) == 48
    assert in_flight_limit(1, fraction=0.5) == 1  # never below one
    assert in_flight_limit(64, fixed=3, fraction=0.5) == 3 and in_flight_limit(None, fraction=0.5) is None


def test_least_queue_fewest_waiting_then_running():
    ws = workers(
        {"running": 4, "waiting": 3},
        {"running": 8, "waiting": 0},
        {"running": 2, "waiting": 1},
        {"running": 5, "waiting": 0},
    )
    assert choose("least_queue", Snapshot(ws), random.Random(0)) == 3
    # Ties spread: omni's own in-flight count, then requests routed so far.
    ws = workers({"routed": 5}, {"routed": 3}, {"routed": 4})
    assert choose("least_queue", Snapshot(ws), random.Random(0)) == 1


def test_power_of_two_never_picks_the_heavier_of_its_pair():
    ws = workers({"running": 9, "waiting": 9}, {"running": 1, "waiting": 0}, {"running": 0, "waiting": 1})
    rng = random.Random(1)
    picks = Counter(choose("power_of_two", Snapshot(ws), rng) for _ in range(300))
    assert picks[0] == 0  # the loaded worker loses every pair it is in
    assert picks[1] > 50 and picks[2] > 50  # the two light ones split (1 vs 2 decided by the pairs)


def test_least_kv_lowest_usage():
    ws = workers(
        {"running": 4, "waiting": 0, "token_usage": 0.6},
        {"running": 4, "waiting": 0, "token_usage": 0.1},
        {"running": 1, "waiting": 0, "token_usage": 0.3},
    )
    assert choose("least_kv", Snapshot(ws), random.Random(0)) == 1
    # New requests since the poll raise the estimate: 1 is now above 2.
    ws = ws[:1] + (WorkerLoad(1, "http://w1", running=4, waiting=0, token_usage=0.1, in_flight=12),) + ws[2:]
    assert choose("least_kv", Snapshot(ws), random.Random(0)) == 2


def test_prefix_is_consistent_and_spreads_keys():
    ws = workers({}, {}, {})
    owners = {}
    for g in range(60):
        key = prompt_prefix("/generate", {"text": f"group {g} system prompt ... question {g}"}, 12)
        picks = {choose("prefix", Snapshot(ws, key=key), random.Random(0)) for _ in range(5)}
        assert len(picks) == 1
        owners[g] = picks.pop()
    assert set(owners.values()) == {0, 1, 2}
    # A worker going down moves only its own keys (rendezvous hashing).
    ws_down = workers({}, {"up": False}, {})
    for g, owner in owners.items():
        key = prompt_prefix("/generate", {"text": f"group {g} system prompt ... question {g}"}, 12)
        moved = choose("prefix", Snapshot(ws_down, key=key), random.Random(0))
        if owner != 1:
            assert moved == owner


def test_prefix_falls_back_to_least_queue_when_its_worker_is_far_busier():
    key = b"t:same prefix"
    base = workers({}, {}, {})
    owner = affinity_worker(Snapshot(base, key=key)).index
    params = PolicyParams(balance_abs=4, balance_rel=1.5)

    def with_owner_load(n: int) -> tuple[WorkerLoad, ...]:
        return tuple(WorkerLoad(w.index, w.name, in_flight=n if w.index == owner else 1) for w in base)

    # 5 vs 1: not more than 4 above the least: affinity holds.
    assert choose("prefix", Snapshot(with_owner_load(5), key=key), random.Random(0), params) == owner
    # 6 vs 1: more than 4 above and more than 1.5x: the least busy instead.
    assert choose("prefix", Snapshot(with_owner_load(6), key=key), random.Random(0), params) != owner
    # No key, or its worker at its limit: least_queue.
    full = tuple(WorkerLoad(w.index, w.name, limit=1, in_flight=1 if w.index == owner else 0) for w in base)
    assert choose("prefix", Snapshot(full, key=key), random.Random(0), params) != owner
    assert choose("prefix", Snapshot(workers({"in_flight": 2}, {}, {"in_flight": 1})), random.Random(0)) == 1


def test_prompt_prefix_reads_each_api():
    assert prompt_prefix("/generate", {"input_ids": list(range(10))}, 3) == b"i:0,1,2"
    assert prompt_prefix("/generate", {"text": "abcdef"}, 3) == b"t:abc"
    assert prompt_prefix("/generate", {"text": ["abcdef"]}, 4) == b"t:abcd"
    assert prompt_prefix("/v1/completions", {"prompt": "hello"}, 2) == b"t:he"
    assert prompt_prefix("/v1/completions", {"prompt": [[5, 6, 7]]}, 2) == b"i:5,6"
    chat = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    assert prompt_prefix("/v1/chat/completions", chat, 100) == b"t:system: be brief\nuser: hi\n"
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "abc"}]}]}
    assert prompt_prefix("/v1/chat/completions", parts, 7) == b"t:user: a"
    assert prompt_prefix("/generate", {"sampling_params": {}}, 3) is None
    assert prompt_prefix("/generate", [1, 2], 3) is None


def test_signals_from_get_load_and_metrics():
    body = b'[{"dp_rank": 0, "num_reqs": 7, "num_waiting_reqs": 3, "num_tokens": 900},' \
           b' {"dp_rank": 1, "num_reqs": 2, "num_waiting_reqs": 0, "num_tokens": 100}]'  # fmt: skip
    assert parse_get_load(body) == (6, 3, 1000)
    assert parse_get_load(b"not json") is None
    assert parse_get_load(b'[{"dp_rank": 0}]') is None
    page = (
        "# HELP sglang:num_running_reqs x\n# TYPE sglang:num_running_reqs gauge\n"
        'sglang:num_running_reqs{model_name="m",tp_rank="0"} 5.0\n'
        'sglang:num_running_reqs{model_name="m",tp_rank="1"} 2.0\n'
        "sglang:num_queue_reqs 4\n"
        'sglang:token_usage{model_name="m"} 0.25\n'
        'sglang:token_usage{model_name="m",dp="1"} 0.5\n'
        'sglang:num_running_reqs_other{a="b"} 100\n'
    )
    assert parse_metrics(page) == {"running": 7.0, "waiting": 4.0, "token_usage": 0.5}
    s = combine((6, 3, 1000), parse_metrics(page), 10_000)
    assert (s.running, s.waiting, s.token_usage, s.num_tokens, s.source) == (6, 3, 0.5, 1000, "get_load")
    s = combine(None, parse_metrics(page), None)
    assert (s.running, s.waiting, s.source) == (7, 4, "metrics")
    s = combine((1, 0, 2500), None, 10_000)  # no /metrics: usage from /get_load's tokens
    assert s.token_usage == 0.25
    assert combine(None, None, None).source == "none"
