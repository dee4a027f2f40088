"""SGLang's priority scheduling in the twin (docs/twin.md, "Priority scheduling"): the scheduler on a
virtual clock for the exact rules, then the real-time twin over HTTP, a cluster file's workers and omni, and
the omni-priority layout in virtual time."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import urllib.request
from collections import Counter
from pathlib import Path

import aiohttp
import pytest

from loadlab.cluster import READY_PREFIX as CLUSTER_READY
from loadlab.cluster.config import ClusterError, load_cluster, worker_settings
from loadlab.profile import load_profile
from loadlab.records import load_records
from loadlab.sim.clock import run_requests
from loadlab.sim.cost import CostModel
from loadlab.sim.scheduler import (
    ABORTED,
    DECODE_PASS,
    DISPLACED_MESSAGE,
    DONE,
    PREFILL_PASS,
    PRIORITY_DISABLED_MESSAGE,
    WAITING,
    PriorityDisabledError,
    QueueFullError,
    Request,
    Scheduler,
    SchedulerConfig,
)
from loadlab.sim.settings import check_embedded_settings, settings_to_argv
from loadlab.testing.servers import start_twin
from loadlab.virtual import run_virtual, simulate

REPO = Path(__file__).resolve().parents[1]
COST = CostModel()


def req(k: int, n_prompt: int, max_new: int, priority: int | None = None, prompt: list[int] | None = None):
    """Request ``r{k}``: a prompt sharing nothing with another's (unless given), its output ids known."""
    if prompt is None:
        prompt = [1_000_000 + k] + [(k * 7919 + i) % 100_000 + 2000 for i in range(n_prompt - 1)]
    return Request(f"r{k}", prompt, max_new, output_ids=[300_000 + k * 1000 + i for i in range(max_new)],
                   priority=priority)  # fmt: skip


def admitted_order(cfg: SchedulerConfig, arrivals: list[tuple[float, Request]]) -> list[str]:
    """The order in which requests were first prefilled, running to the end."""
    s = Scheduler(cfg, COST)
    seen: list[str] = []

    def observe(it, sched):
        seen.extend(r.rid for r, _, _ in it.parts if r.rid not in seen)

    run_requests(s, arrivals, observe)
    assert all(r.state == DONE and r.gen == r.max_new for _, r in arrivals)
    return seen


def step(s: Scheduler, t: float):
    """One pass decided at t and completed at its end: (iteration, end)."""
    it = s.next_iteration(t)
    assert it is not None
    end = t + it.duration
    s.complete(it, end)
    return it, end


PRIORITIES = [0, 5, 20, 5, None, 20]  # r0 .. r5, all at once, one running slot


# -- ordering ------------------------------------------------------------------------------------------------
def test_higher_priority_first_fcfs_within_a_priority_and_none_last():
    arrivals = [(0.0, req(i, 64, 4, p)) for i, p in enumerate(PRIORITIES)]
    cfg = SchedulerConfig(max_running_requests=1, enable_priority_scheduling=True)
    # 20s in arrival order, then the 5s in arrival order, then 0; no priority: SGLang's least preferred value.
    assert admitted_order(cfg, arrivals) == ["r2", "r5", "r1", "r3", "r0", "r4"]


def test_fcfs_within_a_priority_is_by_the_time_each_entered_the_queue():
    # The same priority, later arrivals first in the list: the queue order is their arrival times'.
    arrivals = [(0.03, req(10, 64, 4, 7)), (0.01, req(11, 64, 4, 7)), (0.0, req(12, 64, 30, 0)),
                (0.02, req(13, 64, 4, 7))]  # fmt: skip
    cfg = SchedulerConfig(max_running_requests=1, enable_priority_scheduling=True)
    assert admitted_order(cfg, arrivals) == ["r12", "r11", "r13", "r10"]


def test_low_priority_values_first_flips_the_order():
    arrivals = [(0.0, req(20 + i, 64, 4, p)) for i, p in enumerate(PRIORITIES)]
    cfg = SchedulerConfig(max_running_requests=1, enable_priority_scheduling=True,
                          schedule_low_priority_values_first=True)  # fmt: skip
    assert admitted_order(cfg, arrivals) == ["r20", "r21", "r23", "r22", "r25", "r24"]


def test_without_the_flag_priority_is_ignored_or_refused_when_asked():
    arrivals = [(0.0, req(30 + i, 64, 4, p)) for i, p in enumerate(PRIORITIES)]
    assert admitted_order(SchedulerConfig(max_running_requests=1), arrivals) == [
        f"r{30 + i}" for i in range(6)
    ]
    s = Scheduler(SchedulerConfig(abort_on_priority_when_disabled=True), COST)
    with pytest.raises(PriorityDisabledError) as e:
        s.add_request(req(40, 8, 2, 0), 0.0)
    assert str(e.value) == PRIORITY_DISABLED_MESSAGE
    assert s.add_request(req(41, 8, 2), 0.0) is None and len(s.waiting) == 1  # no priority: accepted


def test_lpm_keeps_its_own_order_under_priority_scheduling():
    # SGLang sorts by priority only under fcfs: with lpm the longest cached prefix goes first whatever the
    # priorities (preemption still uses them).
    shared = [7_000_000 + i for i in range(400)]
    first = req(50, 0, 2, 0, prompt=shared + [1])
    low_cached = req(51, 0, 2, 0, prompt=shared + [2])
    high = req(52, 300, 2, 5)
    cfg = SchedulerConfig(max_running_requests=1, enable_priority_scheduling=True, schedule_policy="lpm")
    order = admitted_order(cfg, [(0.0, first), (0.01, high), (0.01, low_cached)])
    assert order == ["r50", "r51", "r52"]
    cfg = SchedulerConfig(max_running_requests=1, enable_priority_scheduling=True)
    order = admitted_order(cfg, [(0.0, req(53, 0, 2, 0, prompt=shared + [1])), (0.01, req(54, 300, 2, 5)),
                                 (0.01, req(55, 0, 2, 0, prompt=shared + [2]))])  # fmt: skip
    assert order == ["r53", "r54", "r55"]


# -- preemption -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("threshold, preempts", [(10, False), (9, True)])
def test_preemption_only_beyond_the_threshold_and_the_preempted_request_completes(threshold, preempts):
    s = Scheduler(SchedulerConfig(max_running_requests=1, enable_priority_scheduling=True,
                                  priority_scheduling_preemption_threshold=threshold,
                                  record_token_times=True), COST)  # fmt: skip
    low, ten, high = req(60, 50, 40, 0), req(61, 50, 5, 10), req(62, 50, 5, 11)
    s.add_request(low, 0.0)
    it, t = step(s, 0.0)
    assert it.kind == PREFILL_PASS and s.generated(low) == 1
    for _ in range(9):
        it, t = step(s, t)
    assert s.generated(low) == 10
    s.add_request(ten, t)  # beats low by 10: preempts only if that is more than the threshold
    it, t = step(s, t)
    if not preempts:
        assert it.kind == DECODE_PASS and s.generated(low) == 11 and ten.state == WAITING
        s.add_request(high, t)  # beats low by 11
        it, t = step(s, t)
        newcomer, kept = high, 11
    else:
        newcomer, kept = ten, 10
    assert it.kind == PREFILL_PASS and [(r.rid, n, p) for r, n, p in it.parts] == [(newcomer.rid, 50, 0)]
    assert low.state == WAITING and low.num_retractions == 1 and low.gen == kept  # its output is kept
    assert s.num_priority_preemptions_total == 1 and s.num_retractions_total == 0  # not a KV retraction
    resumed = []
    while not s.idle:
        it, t = step(s, t)
        resumed.extend((r.rid, n, p) for r, n, p in it.parts if r is low)
    # It re-prefills its output on top of its cached prompt, then finishes with every token.
    assert resumed == [(low.rid, kept, 50)]
    assert low.state == DONE and low.gen == 40 and len(low.times) == 40
    assert low.finished_time > ten.finished_time and low.finished_time > newcomer.finished_time
    assert s._running_priorities == {} and s.private_used == 0 and s.cache.protected_size == 0
    assert s.num_priority_preemptions_total == 1


def test_preemption_needs_the_preempted_reservations_to_cover_the_newcomer():
    # A 300-token prompt with 50 to go does not fit a 400-token pool beside the running request even if it
    # were preempted (its reservation is too small): no preemption, the newcomer waits for the slot.
    s = Scheduler(SchedulerConfig(max_running_requests=1, max_total_tokens=400,
                                  enable_priority_scheduling=True), COST)  # fmt: skip
    low, high = req(70, 50, 60, 0), req(71, 300, 50, 100)
    order = []
    run_requests(s, [(0.0, low), (0.05, high)], lambda it, sched: order.extend(r.rid for r, _, _ in it.parts))
    assert order == ["r70", "r71"] and s.num_priority_preemptions_total == 0
    assert low.num_retractions == 0 and high.first_token_time > low.finished_time


def test_lowest_priority_and_latest_queued_are_preempted_first():
    s = Scheduler(SchedulerConfig(max_running_requests=3, enable_priority_scheduling=True), COST)
    a, b, c = req(80, 40, 100, 0), req(81, 40, 100, 0), req(82, 40, 100, 5)
    for i, r in enumerate((a, b, c)):
        s.add_request(r, 0.001 * i)
    _, t = step(s, 0.01)
    assert set(s.running) == {a, b, c}
    high = req(83, 40, 4, 50)
    s.add_request(high, t)
    it, t = step(s, t)
    # Both 0s are below 50 by more than 10; b entered the queue after a, so b goes; one is enough.
    assert [r for r, _, _ in it.parts] == [high] and b.state == WAITING and a.state != WAITING
    assert (a.num_retractions, b.num_retractions, c.num_retractions) == (0, 1, 0)


def test_a_full_queue_drops_its_least_preferred_for_a_strictly_better_arrival():
    s = Scheduler(SchedulerConfig(max_running_requests=1, max_queued_requests=2,
                                  enable_priority_scheduling=True), COST)  # fmt: skip
    w1, w2 = req(90, 8, 2, 0), req(91, 8, 2, 0)
    assert s.add_request(w1, 0.0) is None and s.add_request(w2, 0.1) is None
    with pytest.raises(QueueFullError):
        s.add_request(req(92, 8, 2, 0), 0.2)  # not strictly better than the least preferred (0)
    better = req(93, 8, 2, 1)
    assert s.add_request(better, 0.3) is w2  # the latest queued of the least preferred
    assert w2.state == ABORTED and w2.finish_reason == {"type": "abort", "message": DISPLACED_MESSAGE,
                                                        "status_code": 503}  # fmt: skip
    assert list(s.waiting) == [w1, better]
    off = Scheduler(SchedulerConfig(max_queued_requests=1), COST)
    off.add_request(req(94, 8, 2, 0), 0.0)
    with pytest.raises(QueueFullError):
        off.add_request(req(95, 8, 2, 100), 0.0)  # without priority scheduling: refused, whatever it says


# -- settings, one-line errors ------------------------------------------------------------------------------
def test_settings_and_their_one_line_errors():
    good = {"enable_priority_scheduling": True, "schedule_low_priority_values_first": False,
            "priority_scheduling_preemption_threshold": 0, "abort_on_priority_when_disabled": True}  # fmt: skip
    assert check_embedded_settings(good) is None
    assert settings_to_argv(good) == ["--enable-priority-scheduling", "--priority-scheduling-preemption-threshold",
                                      "0", "--abort-on-priority-when-disabled"]  # fmt: skip
    assert check_embedded_settings({"enable_priority_scheduling": "yes"}) == (
        "enable_priority_scheduling: expected true or false, got 'yes'"
    )
    assert check_embedded_settings({"priority_scheduling_preemption_threshold": 2.5}) == (
        "priority_scheduling_preemption_threshold: expected an integer, got 2.5"
    )
    r = subprocess.run([sys.executable, "-m", "loadlab", "sim", "--priority-scheduling-preemption-threshold",
                        "ten"], capture_output=True, text=True, cwd=REPO, timeout=30)  # fmt: skip
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == ("loadlab sim: error: argument --priority-scheduling-preemption-threshold: expected an "
                        "integer, got 'ten' (see loadlab sim --help)\n")  # fmt: skip


def test_cluster_files_pass_the_settings_and_omnis_limit(tmp_path):
    config = load_cluster(REPO / "clusters" / "omni-priority.yaml")
    (pool,) = config.districts
    assert "--enable-priority-scheduling" in settings_to_argv(worker_settings(pool))
    assert config.front.max_in_flight_per_worker == 1024
    bad = tmp_path / "c.yaml"
    bad.write_text("districts:\n  - name: a\n    sglang:\n      enable_priority_scheduling: 1\n")
    with pytest.raises(ClusterError) as e:
        load_cluster(bad)
    assert str(e.value) == (f"{bad}:4: districts.0.sglang.enable_priority_scheduling: expected true or false, "
                            "got 1")  # fmt: skip
    bad.write_text("districts:\n  - name: a\nfront:\n  kind: router\n  max_in_flight_per_worker: 8\n")
    with pytest.raises(ClusterError) as e:
        load_cluster(bad)
    assert "\n" not in str(e.value) and "front.max_in_flight_per_worker" in str(e.value)
    assert "only for kind: omni" in str(e.value)


# -- real time, over HTTP ---------------------------------------------------------------------------------
def test_real_time_twin_serves_the_high_priority_request_sent_last_first():
    twin = start_twin("--enable-priority-scheduling", "--max-running-requests", "1", "--gpu", "h100-80gb",
                      "--enable-metrics", "--log-level", "warning")  # fmt: skip
    try:
        asyncio.run(_burst(twin.url))
        with urllib.request.urlopen(twin.url + "/server_info", timeout=10) as resp:
            info = json.load(resp)
        assert info["enable_priority_scheduling"] is True
        assert info["priority_scheduling_preemption_threshold"] == 10
        assert info["internal_states"][0]["num_priority_preemptions_total"] == 1
        with urllib.request.urlopen(twin.url + "/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        # As SGLang: a priority preemption is not a KV retraction in /metrics, only in num_retractions.
        assert [
            ln for ln in metrics.splitlines() if ln.startswith("sglang:num_retracted_requests_total")
        ] == [
            'sglang:num_retracted_requests_total{engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",'
            'pp_rank="0",tp_rank="0"} 0.0'
        ]
    finally:
        twin.stop()


async def _burst(url: str) -> None:
    """A (priority 0, 150 tokens) runs; L1, L2 (priority 0) then H (20) arrive while it does. H preempts A
    and ends first; L1 and L2 follow in arrival order, then A (queued again after them), with all its
    tokens and one retraction."""
    finished: list[str] = []
    metas: dict[str, dict] = {}

    async def one(s, name, priority, max_new, started=None):
        body = {"text": f"request {name} of the burst", "stream": True, "rid": name,
                "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True}}  # fmt: skip
        if priority is not None:
            body["priority"] = priority
        async with s.post(url + "/generate", json=body) as r:
            assert r.status == 200
            async for line in r.content:
                if started is not None and not started.is_set():
                    started.set()
                if line.startswith(b"data: {"):
                    metas[name] = json.loads(line[6:])["meta_info"]
        finished.append(name)

    async with aiohttp.ClientSession() as s:
        started = asyncio.Event()
        a = asyncio.create_task(one(s, "A", 0, 150, started))
        await asyncio.wait_for(started.wait(), 10)
        tasks = [a]
        for name, priority in (("L1", 0), ("L2", 0), ("H", 20)):
            tasks.append(asyncio.create_task(one(s, name, priority, 12)))
            await asyncio.sleep(0.03)
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert finished == ["H", "L1", "L2", "A"]
    assert metas["A"]["num_retractions"] == 1 and metas["A"]["completion_tokens"] == 150
    assert metas["A"]["finish_reason"] == {"type": "length", "length": 150}
    assert [metas[n]["num_retractions"] for n in ("L1", "L2", "H")] == [0, 0, 0]


def test_real_time_full_queue_drops_the_least_preferred_waiting_request():
    twin = start_twin("--enable-priority-scheduling", "--max-running-requests", "1", "--max-queued-requests",
                      "1", "--gpu", "h100-80gb", "--log-level", "warning")  # fmt: skip
    try:
        asyncio.run(_full_queue(twin.url))
    finally:
        twin.stop()


async def _full_queue(url: str) -> None:
    """A (0) runs, the queue holds one: B (0, not streamed) waits; C (5, streamed) takes its place (B: 503);
    D (0) is refused (C is preferred); E (9) takes C's place (C's stream ends with the abort). Nobody beats
    A by more than 10: A and E finish."""
    out: dict[str, tuple[int, object]] = {}

    async def one(s, name, priority, max_new, stream, started=None):
        body = {"text": f"request {name}", "stream": stream, "priority": priority,
                "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True}}  # fmt: skip
        async with s.post(url + "/generate", json=body) as r:
            if not stream:
                out[name] = (r.status, await r.json())
                return
            last = None
            async for line in r.content:
                if started is not None:
                    started.set()
                if line.startswith(b"data: {"):
                    last = json.loads(line[6:])["meta_info"]
            out[name] = (r.status, last)

    async with aiohttp.ClientSession() as s:
        started = asyncio.Event()
        tasks = [asyncio.create_task(one(s, "A", 0, 60, True, started))]
        await asyncio.wait_for(started.wait(), 10)
        for name, priority, stream in (("B", 0, False), ("C", 5, True), ("D", 0, False), ("E", 9, False)):
            tasks.append(asyncio.create_task(one(s, name, priority, 4, stream)))
            await asyncio.sleep(0.03)
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
    status, body = out["B"]
    assert (status, body["message"], body["type"]) == (503, DISPLACED_MESSAGE, "ServiceUnavailableError")
    assert out["C"] == (200, {**out["C"][1], "completion_tokens": 0,
                              "finish_reason": {"type": "abort", "message": DISPLACED_MESSAGE, "status_code": 503}})  # fmt: skip
    assert (out["D"][0], out["D"][1]["message"]) == (503, "The request queue is full.")
    assert out["E"][0] == 200 and out["E"][1]["meta_info"]["completion_tokens"] == 4
    assert out["A"][0] == 200 and out["A"][1]["completion_tokens"] == 60


def test_real_time_priority_field_is_checked_and_refused_when_asked():
    twin = start_twin("--abort-on-priority-when-disabled", "--log-level", "warning")
    try:

        def post(path, body):
            req = urllib.request.Request(twin.url + path, json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})  # fmt: skip
            try:
                with urllib.request.urlopen(req, timeout=30) as resp:
                    return resp.status, json.load(resp)
            except urllib.error.HTTPError as e:
                return e.code, json.load(e)

        gen = {"text": "hello there", "sampling_params": {"max_new_tokens": 2}}
        assert post("/generate", gen)[0] == 200
        status, out = post("/generate", {**gen, "priority": 3})
        assert (status, out["message"], out["type"]) == (
            503,
            PRIORITY_DISABLED_MESSAGE,
            "ServiceUnavailableError",
        )
        status, out = post("/v1/completions", {"prompt": "hello there", "max_tokens": 2, "priority": 3})
        assert (status, out["message"]) == (503, PRIORITY_DISABLED_MESSAGE)
        status, out = post("/generate", {**gen, "priority": "high"})
        assert (status, out["error"]["message"]) == (400, "priority must be an integer, got 'high'.")
    finally:
        twin.stop()


def test_a_cluster_files_workers_and_omni_run_with_priority():
    proc = subprocess.Popen([sys.executable, "-m", "loadlab", "cluster", "clusters/omni-priority.yaml", "--port",
                             "0"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    try:
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(90)
        assert line and line[0].startswith(CLUSTER_READY), line
        ready = json.loads(line[0][len(CLUSTER_READY) :])
        with urllib.request.urlopen(ready["front"] + "/omni/workers", timeout=10) as resp:
            view = json.load(resp)
        assert [w["limit"] for w in view["workers"]] == [1024, 1024]
        for w in ready["workers"]:
            with urllib.request.urlopen(w["url"] + "/server_info", timeout=10) as resp:
                assert json.load(resp)["enable_priority_scheduling"] is True
        body = json.dumps({"text": "an online question", "priority": 20,
                           "sampling_params": {"max_new_tokens": 3}}).encode()  # fmt: skip
        req = urllib.request.Request(ready["front"] + "/generate", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert json.load(resp)["meta_info"]["completion_tokens"] == 3
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


# -- the priority layout in virtual time ------------------------------------------------------------------
def _layout(tmp_path: Path, cluster: Path, rate: float = 32):
    """profiles/omni-priority.yaml at ``rate`` on ``cluster``: (manifest, measured records)."""
    profile = load_profile(REPO / "profiles" / "omni-priority.yaml")
    profile = profile.model_copy(update={"load": profile.load.model_copy(update={"rate": rate})})
    run = run_virtual(profile, None, tmp_path, cluster=cluster)
    records = load_records(run)
    return json.loads((run / "manifest.json").read_text()), records[records.phase == "measure"]


def test_virtual_priority_layout_preempts_offline_for_online(tmp_path):
    # At 32 req/s (above what the pool serves within the online SLO without priorities, docs/omni.md).
    manifest, measured = _layout(tmp_path, REPO / "clusters" / "omni-priority.yaml")
    assert len(measured) == 1200 and set(measured.outcome) == {"ok"}
    assert (measured.output_tokens == measured.max_new_tokens).all()  # preempted requests lose no token
    stats = manifest["virtual_stats"]
    assert (stats["num_priority_preemptions_total"], stats["num_retractions_total"]) == (177, 0)
    # The preemptions are in the records' num_retractions (meta_info's), all of offline requests.
    measured_preempted = measured[measured.num_retractions > 0]
    assert set(measured_preempted.request_class) == {"offline"}
    online = measured[measured.request_class == "online"].ttft_ms.quantile(0.95)
    # The same cluster without priority scheduling: no preemption, and online waits behind offline.
    plain = tmp_path / "plain.yaml"
    plain.write_text((REPO / "clusters" / "omni-priority.yaml").read_text().replace(
        "      enable_priority_scheduling: true\n", ""))  # fmt: skip
    manifest, measured = _layout(tmp_path, plain)
    assert manifest["virtual_stats"]["num_priority_preemptions_total"] == 0
    assert (measured.num_retractions == 0).all()
    assert online < 1500 < measured[measured.request_class == "online"].ttft_ms.quantile(0.95)


def test_virtual_full_queue_drops_batch_requests_for_interactive_ones():
    # profiles/two-classes.yaml (interactive priority 10, batch 0) at 10 req/s on one small twin: 4 running,
    # 8 waiting at most. With priority scheduling an interactive arrival takes a waiting batch request's
    # place (its stream ends with SGLang's abort, recorded as stream_error); without, the arrival is refused.
    profile = load_profile(REPO / "profiles" / "two-classes.yaml")
    profile = profile.model_copy(update={"requests": profile.requests.model_copy(update={"warmup": 0, "measured": 60}),
                                         "load": profile.load.model_copy(update={"model": "open", "rate": 10.0,
                                                                                 "concurrency": None})})  # fmt: skip
    full, dropped = "HTTP 503: The request queue is full.", f"aborted by server: {DISPLACED_MESSAGE}"

    def outcomes(priority: bool) -> dict:
        settings = {
            "enable_priority_scheduling": priority,
            "max_running_requests": 4,
            "max_queued_requests": 8,
        }
        return dict(
            Counter((r.request_class, r.outcome, r.error) for r in simulate(profile, settings).records)
        )

    assert outcomes(True) == {("interactive", "ok", None): 20, ("interactive", "http_error", full): 25,
                              ("batch", "ok", None): 2, ("batch", "http_error", full): 7,
                              ("batch", "stream_error", dropped): 6}  # fmt: skip
    assert outcomes(False) == {("interactive", "ok", None): 13, ("interactive", "http_error", full): 32,
                               ("batch", "ok", None): 5, ("batch", "http_error", full): 10}  # fmt: skip
