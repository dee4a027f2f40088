"""Open loop in Locust: requests sent at their due times, client queueing recorded and reported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from loadlab.records import read_jsonl_records

PROFILE = """\
name: open
seed: 4
target: {{url: embedded, embedded: {{gpu: h100-80gb}}}}
load: {{model: open, rate: {rate}, arrival: constant, concurrency: {cap}}}
requests: {{warmup: 4, measured: 40}}
workload: {{kind: random_prefix, input_len: 64, output_len: 16}}
"""


def run(tmp_path: Path, rate: float, cap: int | str, *extra: str) -> tuple[list[dict], dict]:
    profile = tmp_path / "p.yaml"
    profile.write_text(PROFILE.format(rate=rate, cap=cap))
    return run_profile(tmp_path, profile, *extra)


def run_profile(tmp_path: Path, profile: Path, *extra: str) -> tuple[list[dict], dict]:
    done = subprocess.run([sys.executable, "-m", "loadlab", "run", str(profile), "--out", str(tmp_path), *extra],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    run_dir = Path(done.stdout.strip().splitlines()[-1])
    return read_jsonl_records(run_dir / "records.jsonl"), json.loads((run_dir / "summary.json").read_text())


@pytest.mark.alone
@pytest.mark.flaky(reruns=1, reruns_delay=2)  # send lateness in wall-clock ms on a shared 2-core machine
def test_sends_follow_the_arrival_schedule(tmp_path):
    # 50 ms apart; a request takes ~0.1 s: ~2 in flight. No cap: one user per request (4 + 40).
    rows, summary = run(tmp_path, rate=20, cap="null")
    measured = sorted((r for r in rows if r["phase"] == "measure"), key=lambda r: r["index"])
    due = np.array([r["t_scheduled_wall"] for r in measured])
    sent = np.array([r["t_send_wall"] for r in measured])
    assert np.allclose(np.diff(due), 0.05, atol=1e-6)  # constant arrivals at 20/s, in index order
    assert np.all(sent - due > -0.002) and np.median(sent - due) < 0.005  # sent on time, never early
    assert summary["load_model"] == "open loop, 20 req/s (constant), no cap on requests in flight"
    assert summary["request_rate"] == 20 and summary["max_client_queue_ms"] < 20


def test_a_cap_makes_requests_queue_in_the_client_and_the_report_shows_it(tmp_path):
    rows, summary = run(tmp_path, rate=50, cap=1)  # 50/s offered, ~10/s possible one at a time
    measured = [r for r in rows if r["phase"] == "measure"]
    queue = np.array([(r["t_send_wall"] - r["t_scheduled_wall"]) * 1000 for r in measured])
    assert queue.max() > 1000  # the 40th request waits ~3 s for its turn
    assert summary["p99_ttft_from_scheduled_ms"] > summary["p99_ttft_ms"] + 1000
    assert summary["median_client_queue_ms"] == pytest.approx(np.median(queue), rel=1e-6)


@pytest.mark.alone
def test_distributed_open_loop_sends_on_schedule_with_tickets_leased_just_before_due(tmp_path):
    # Two workers, 44 requests due 50 ms apart (2.2 s): the master hands a ticket over 0.5 s before it is
    # due (a dead worker must not hold minutes of future arrivals), and it still goes out on time.
    rows, summary = run(tmp_path, 20, "null", "--workers", "2")
    assert sorted(r["index"] for r in rows) == list(range(44))  # every index once
    assert len({r["worker_id"] for r in rows}) == 2
    measured = sorted((r for r in rows if r["phase"] == "measure"), key=lambda r: r["index"])
    due = np.array([r["t_scheduled_wall"] for r in measured])
    sent = np.array([r["t_send_wall"] for r in measured])
    # Due times are the master's, converted to each worker's clock with its offset estimate, whose error is at
    # most half its round trip (NTP's bound): consecutive dues on two workers differ by 50 ms within the sum.
    manifest = json.loads(next(tmp_path.glob("*/manifest.json")).read_text())
    rtts = [g["rtt_s"] for g in manifest["load_generators"] if g.get("rtt_s") is not None]
    assert len(rtts) == 2
    assert np.allclose(np.diff(due), 0.05, atol=max(1e-3, sum(rtts) / 2 + 1e-6))
    late = sent - due
    assert np.all(late > -0.005) and np.median(late) < 0.01, late  # workers' clocks are the master's here
    assert summary["measured_requests"] == 40 and summary["failed"] == 0


def _due_offsets(rows: list[dict]) -> dict[int, float]:
    """Each request's due time as an offset from its phase's first due time (each phase restarts the
    arrival clock: warm-up at the first ticket, measured when the warm-up barrier opens)."""
    first = {
        phase: min(r["t_scheduled_wall"] for r in rows if r["phase"] == phase)
        for phase in ("warmup", "measure")
    }
    return {r["index"]: r["t_scheduled_wall"] - first[r["phase"]] for r in rows}


def test_a_real_run_and_a_virtual_run_get_the_same_arrival_times(tmp_path):
    # One arrival generator for every driver: the same open-loop profile gets the same due times (as
    # offsets from each phase's start) in Locust against the twin and in `loadlab sim --virtual`.
    profile = tmp_path / "p.yaml"
    profile.write_text(PROFILE.format(rate=20, cap="null").replace("arrival: constant", "arrival: poisson"))
    real, _ = run_profile(tmp_path, profile)
    virtual = subprocess.run([sys.executable, "-m", "loadlab", "sim", "--virtual", str(profile), "--out", str(tmp_path)],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert virtual.returncode == 0, virtual.stderr[-2000:]
    rehearsed = read_jsonl_records(Path(virtual.stdout.strip().splitlines()[-1]) / "records.jsonl")
    a, b = _due_offsets(real), _due_offsets(rehearsed)
    assert sorted(a) == sorted(b) == list(range(44))
    gaps = np.diff(sorted(b.values()))
    assert gaps.std() > 0.2 * gaps.mean()  # Poisson, not evenly spaced: the sequence itself is compared
    # Exact up to the resolution of an epoch-seconds double (2.4e-7 s): 1 us.
    worst = max(abs(a[i] - b[i]) for i in a)
    assert worst < 1e-6, worst
