"""Virtual-time runs write the same run directory as a real run, and `loadlab sim --virtual` drives them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from loadlab.cli import main as loadlab_main
from loadlab.manifest import read_manifest
from loadlab.profile import validate_profile
from loadlab.records import RECORD_FIELDS, load_records
from loadlab.sim.settings import resolve_settings
from loadlab.virtual import FrontSpec, VirtualRun, run_virtual, simulate

REPO = Path(__file__).resolve().parents[1]


def rag_profile(**load):
    return validate_profile(
        {
            "name": "vt",
            "seed": 3,
            "workload": {"kind": "rag", "input_len": 512, "output_len": 32},
            "load": load or {"model": "closed", "concurrency": 6},
            "requests": {"warmup": 6, "measured": 40},
            "slo": {"ttft_p95_ms": 5000},
        }
    )


def test_run_directory_matches_a_real_run(tmp_path):
    p = rag_profile()
    run_dir = run_virtual(p, {"stream_interval": 4, "max_running_requests": 4}, tmp_path, "vt-run")
    assert run_dir == tmp_path / "vt-run"
    for name in ("records.jsonl", "records.parquet", "manifest.json", "summary.json", "summary.md"):
        assert (run_dir / name).exists(), name
    m = read_manifest(run_dir)
    assert m.target.virtual and m.target.url == "virtual"  # the one Manifest type a real run writes too
    assert m.virtual is True and m.complete is True
    assert m.sim["max_running_requests"] == 4 and m.sim["gpu"] == "a100-80gb"
    assert m.load.model == "closed" and m.load.concurrency == 6 and m.load.rate is None
    assert m.load.description
    assert m.counts.model_dump(exclude_none=True) == {"warmup_expected": 6, "measured_expected": 40, "warmup_finished": 6,
                           "measured_finished": 40, "records": 46, "outcomes": {"ok": 46}}  # fmt: skip
    assert m.virtual_stats.num_retractions_total == 0

    df = load_records(run_dir)
    assert list(df.columns) == list(RECORD_FIELDS)
    assert sorted(df[df.phase == "warmup"]["index"]) == list(range(6))
    assert sorted(df[df.phase == "measure"]["index"]) == list(range(6, 46))
    measure = df[df.phase == "measure"]
    assert (measure.outcome == "ok").all() and (measure.output_tokens == 32).all()
    assert (measure.prompt_tokens == 512).all() and (measure.input_len == 512).all()
    assert measure.cached_tokens.sum() > 0  # the rag instruction and popular passages are shared
    assert (measure.num_retractions == 0).all() and measure.server_id.str.startswith("vt-run-").all()
    for ms, toks, ttft, e2e in zip(measure.arrival_ms, measure.arrival_tokens, measure.ttft_ms, measure.e2e_ms,
                                   strict=True):  # fmt: skip
        assert list(toks) == [1] + [4] * 7 + [3]  # stream_interval 4: first at once, then 4 at a time
        assert ms[0] == ttft and ms[-1] == pytest.approx(e2e)
        assert all(b > a for a, b in zip(ms, ms[1:], strict=False))
    # Warm-up first: no measured request is sent before the last warm-up request ends.
    warm = df[df.phase == "warmup"]
    assert measure.t_send_wall.min() >= (warm.t_send_wall + warm.e2e_ms / 1000).max()

    s = json.loads((run_dir / "summary.json").read_text())
    assert s["completed"] == 40 and s["failed"] == 0
    assert s["load_model"] == "closed loop, 6 in flight"
    assert s["in_flight"]["max"] == 6  # exactly, also when one request is sent the instant another ends
    assert s["slo"]["pass"] is True
    # `loadlab report` recomputes it unchanged.
    (run_dir / "summary.json").unlink()
    assert loadlab_main(["report", str(run_dir)]) == 0
    assert json.loads((run_dir / "summary.json").read_text())["p95_ttft_ms"] == s["p95_ttft_ms"]


def test_open_loop_arrivals_and_queue_limit(tmp_path):
    vr = simulate(rag_profile(model="open", rate=20.0, arrival="constant"))
    sends = sorted(r.t_send_wall for r in vr.records if r.phase == "measure")
    assert np.diff(sends) == pytest.approx(0.05, abs=1e-6)  # constant spacing at 20 req/s (on a ~1 us grid)
    assert all(r.t_scheduled_wall == r.t_send_wall for r in vr.records)
    vr = simulate(rag_profile(model="open", rate=20.0))
    gaps = np.diff(sorted(r.t_send_wall for r in vr.records if r.phase == "measure"))
    assert 0.02 < gaps.mean() < 0.1 and gaps.std() > 0.5 * gaps.mean()  # Poisson: exponential gaps
    # An explicit concurrency caps an open loop: later arrivals wait client-side.
    vr = simulate(rag_profile(model="open", rate=200.0, concurrency=2))
    late = [r.t_send_wall - r.t_scheduled_wall for r in vr.records]
    assert max(late) > 0.5
    # The server's queue limit refuses arrivals beyond it with HTTP 503, recorded as failures.
    run_dir = run_virtual(rag_profile(model="open", rate=200.0), {"max_queued_requests": 2,
                                                                  "max_running_requests": 2}, tmp_path)  # fmt: skip
    df = load_records(run_dir)
    refused = df[df.outcome == "http_error"]
    assert len(refused) > 0 and (refused.http_status == 503).all()
    m = read_manifest(run_dir)
    assert m.load.model == "open" and m.load.rate == 200.0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["failures"] == {"http_error": int((refused.phase == "measure").sum())}
    assert summary["load_model"].startswith("open loop, 200 req/s")


def test_virtual_is_deterministic():
    a = simulate(rag_profile())
    b = simulate(rag_profile())
    assert [r.arrival_ms for r in a.records] == [r.arrival_ms for r in b.records]


def test_cli_virtual(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({
        "name": "cli-virtual", "workload": {"kind": "random_prefix", "input_len": 256, "output_len": 16},
        "target": {"embedded": {"max_running_requests": 8, "enable_metrics": True}},
        "load": {"model": "closed", "concurrency": 2}, "requests": {"warmup": 2, "measured": 10},
    }))  # fmt: skip
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "loadlab.cli", "sim", "--virtual", str(path), "--out", str(out), "--concurrency",
         "4", "--num-requests", "30", "--max-running-requests", "3", "--gpu", "h100-80gb"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    run_dir = Path(proc.stdout.strip().splitlines()[-1])
    assert run_dir.parent == out and "virtual run complete" in proc.stderr
    m = read_manifest(run_dir)
    assert m.sim["max_running_requests"] == 3  # the flag beats the profile's target.embedded
    assert m.sim["enable_metrics"] is True  # the rest of target.embedded applies
    assert m.sim["gpu"] == "h100-80gb" and m.counts.measured_finished == 30
    assert m.load.concurrency == 4 and m.profile["load"]["concurrency"] == 4
    assert m.command[:3] == ["loadlab", "sim", "--virtual"]
    proc = subprocess.run(
        [sys.executable, "-m", "loadlab.cli", "sim", "--virtual", str(path), "--out", str(out), "--rate", "50"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    m = read_manifest(Path(proc.stdout.strip().splitlines()[-1]))
    assert m.load.model_dump() == {"model": "open", "concurrency": None, "rate": 50.0, "arrival": "poisson", "users": 12,
                                   "speed": None, "description": "open loop, 50 req/s (poisson), no cap on requests in flight"}  # fmt: skip
    for bad in (["--virtual", str(tmp_path / "missing.yaml")], ["--rate", "3"], ["--virtual", str(path), "--rate", "0"],
                ["--virtual", str(path), "--model", "llama-3.1-70b", "--tp-size", "1"]):  # fmt: skip
        proc = subprocess.run([sys.executable, "-m", "loadlab.cli", "sim", *bad, "--out", str(out)], cwd=REPO,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert proc.returncode == 2, (bad, proc.stderr)
        assert proc.stderr.startswith("loadlab sim: error: ") and "Traceback" not in proc.stderr


def test_a_cluster_of_four_workers_serves_four_times_one_worker_in_virtual_time():
    # Below capacity a server's output rate is the offered rate x output length, whatever its speed: one
    # A100 at 2 req/s, four behind round robin at 8 req/s. Lightly loaded, a request's TTFT is about one
    # prefill on either (each worker sees a quarter of the arrivals), and round robin gives each worker
    # exactly every 4th request.
    def profile(rate: float, measured: int):
        return validate_profile({"name": "vt", "seed": 3, "workload": {"kind": "random_prefix", "input_len": 512,
                                 "output_len": 64}, "load": {"model": "open", "rate": rate},
                                 "requests": {"warmup": 8, "measured": measured}})  # fmt: skip

    single = simulate(profile(2.0, 200), {"max_running_requests": 64})
    cluster = simulate(
        profile(8.0, 800), [{"max_running_requests": 64}] * 4, front=FrontSpec(policy="round_robin")
    )

    def figures(vr, rate):
        m = [r for r in vr.records if r.phase == "measure"]
        start, end = min(r.t_scheduled_wall for r in m), max(r.t_scheduled_wall for r in m)
        offered = (len(m) - 1) / (end - start)  # the arrival process's own rate
        assert offered == pytest.approx(rate, rel=0.15)
        done = max(r.t_send_wall + r.e2e_ms / 1000 for r in m) - min(r.t_send_wall for r in m)
        return sum(r.output_tokens for r in m) / done, np.median([r.ttft_ms for r in m])

    (thr1, ttft1), (thr4, ttft4) = figures(single, 2.0), figures(cluster, 8.0)
    assert thr1 == pytest.approx(2.0 * 64, rel=0.15) and thr4 == pytest.approx(8.0 * 64, rel=0.15)
    assert thr4 == pytest.approx(4 * thr1, rel=0.1)
    assert ttft4 == pytest.approx(ttft1, rel=0.15)
    assert [w.routed for w in cluster.workers] == [(800 + 8) // 4] * 4
    assert cluster.stats()["workers"] == 4


def test_cache_aware_routing_finds_the_shared_prefixes_round_robin_scatters():
    # 64 groups of requests sharing a long system prompt, each group seen ~4 times, over 4 workers:
    # cache_aware sends a group back to the worker that has its prefix (design/twin.md effect 5), round
    # robin spreads each group over the workers, so each worker prefills each prefix again.
    p = validate_profile({"name": "vt", "seed": 1, "load": {"model": "closed", "concurrency": 16},
                          "workload": {"kind": "shared_prefix", "num_groups": 64, "group_order": "random", "system_prompt_len": 768,
                                       "question_len": 64, "output_len": 32},
                          "requests": {"warmup": 0, "measured": 256}})  # fmt: skip
    workers = [{"max_running_requests": 64}] * 4

    def figures(policy):
        m = [r for r in simulate(p, workers, front=FrontSpec(policy=policy)).records if r.phase == "measure"]
        return sum(r.cached_tokens for r in m) / sum(r.prompt_tokens for r in m), np.median(
            [r.ttft_ms for r in m]
        )

    (hit_rr, ttft_rr), (hit_ca, ttft_ca) = figures("round_robin"), figures("cache_aware")
    # Each of the 4 visits to a group: round robin lands on a cold worker for about half of them.
    assert hit_ca > hit_rr + 0.15, (hit_ca, hit_rr)
    assert ttft_ca < ttft_rr, (ttft_ca, ttft_rr)


def test_omni_policies_in_virtual_time_queue_at_the_front_and_balance():
    # omni with least_queue over two workers capped at 8 running: beyond 16 in flight requests wait in
    # omni's queue (not a worker's), each worker runs at most its cap, and the load splits evenly.
    p = validate_profile({"name": "vt", "seed": 2, "load": {"model": "closed", "concurrency": 40},
                          "workload": {"kind": "random_prefix", "input_len": 256, "output_len": 32},
                          "requests": {"warmup": 0, "measured": 400}})  # fmt: skip
    peak = [0, 0]
    vr = VirtualRun(p, [resolve_settings({"max_running_requests": 8})] * 2,
                    front=FrontSpec(kind="omni", policy="least_queue", poll_interval_s=0.5))  # fmt: skip
    original = vr._dispatch

    def watch(t, index, phase, due, spec, worker):
        original(t, index, phase, due, spec, worker)
        i = vr.workers.index(worker)
        peak[i] = max(peak[i], vr.front.in_flight[i])

    vr._dispatch = watch
    vr.run()
    assert len(vr.records) == 400 and all(r.outcome == "ok" for r in vr.records)
    assert peak == [8, 8]  # omni's limit per worker held, the other 24 users waited at the front
    assert all(len(w.sched.waiting) == 0 for w in vr.workers)
    assert abs(vr.workers[0].routed - vr.workers[1].routed) <= 0.1 * 400
    with pytest.raises(ValueError, match="omni: no policy 'cache_aware'"):
        simulate(p, [{}] * 2, front=FrontSpec(kind="omni", policy="cache_aware"))
