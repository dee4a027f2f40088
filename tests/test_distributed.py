"""Distributed runs: a real Locust master and real workers on 127.0.0.1 against the embedded twin.

Exact request counts across workers, warm-up before measured, a worker killed mid-run, the master killed
mid-run, clocks in the manifest.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from loadlab.procs import free_port
from loadlab.records import SPILL_DIR, read_jsonl_records, spill_name

REPO = Path(__file__).resolve().parents[1]
LOCUSTFILE = REPO / "loadlab" / "swarm" / "locustfile.py"
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
# Failure injection on a real cluster sharing 2 cores with everything else: one rerun on a miss. (Once, in
# a full-suite run under load, a cluster produced no records within 60 s; the logs now come with the error.)
CLUSTER_RERUN = pytest.mark.flaky(reruns=1)
MASTER_LOST_S = 4  # the killed-master test's workers' --master-lost-s

PROFILE = """\
name: dist
seed: 3
target:
  url: embedded
  embedded: {{gpu: h100-80gb}}
load: {{model: closed, concurrency: 8}}
requests: {{warmup: {warmup}, measured: {measured}}}
workload: {{kind: rag, input_len: 128, output_len: {output_len}, instruction_len: 16, question_len: 16,
           passages_per_prompt: 2, corpus_size: 200, zipf_s: 1.1}}
"""


def write_profile(tmp_path: Path, warmup: int, measured: int, output_len: int) -> Path:
    path = tmp_path / "profile.yaml"
    path.write_text(PROFILE.format(warmup=warmup, measured=measured, output_len=output_len))
    return path


def start_master(tmp_path: Path, profile: Path, port: int, workers: int = 2) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--master", "--headless", "--only-summary",
           "--expect-workers", str(workers), "--master-bind-host", "127.0.0.1", "--master-bind-port", str(port),
           "--profile-file", str(profile), "--out", str(tmp_path / "out"), "--run-name", "run"]  # fmt: skip
    return subprocess.Popen(cmd, cwd=tmp_path, env=ENV, stdout=open(tmp_path / "master.log", "wb"),  # noqa: SIM115
                            stderr=subprocess.STDOUT)  # fmt: skip


def start_worker(tmp_path: Path, port: int, out: str, n: int, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--worker", "--master-host", "127.0.0.1",
           "--master-port", str(port), "--out", str(tmp_path / out), *extra]  # fmt: skip
    return subprocess.Popen(cmd, cwd=tmp_path, env=ENV, stdout=open(tmp_path / f"worker{n}.log", "wb"),  # noqa: SIM115
                            stderr=subprocess.STDOUT)  # fmt: skip


def start_cluster(
    tmp_path: Path, measured: int, worker_out: str, *worker_extra: str
) -> tuple[subprocess.Popen, list]:
    """A master and 2 workers on a 64-token-output profile (4 warm-up requests)."""
    profile = write_profile(tmp_path, warmup=4, measured=measured, output_len=64)
    port = free_port()
    master = start_master(tmp_path, profile, port)
    return master, [start_worker(tmp_path, port, worker_out, n, *worker_extra) for n in range(2)]


def wait_for_records(path: Path, at_least: int, procs: list[subprocess.Popen], timeout: float = 60) -> None:
    """Waits until ``path`` holds ``at_least`` records; fails at once, with the logs, when a process of the
    cluster (master, workers) has exited instead (a cluster that cannot run never writes them)."""
    tmp_path = path.parents[2]  # <tmp>/out/run/records.jsonl
    deadline = time.monotonic() + timeout
    count = 0
    while time.monotonic() < deadline:
        count = len(read_jsonl_records(path)) if path.exists() else 0
        if count >= at_least:
            return
        exited = [f"{'master' if '--master' in p.args else 'worker'} {p.pid}: exit {p.returncode}"
                  for p in procs if p.poll() is not None]  # fmt: skip
        if exited:
            raise AssertionError(f"{exited} with {count} records in {path}\n{logs(tmp_path)}")
        time.sleep(0.1)
    raise AssertionError(f"{count} records (of {at_least}) in {path} after {timeout} s\n{logs(tmp_path)}")


def logs(tmp_path: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("*.log")))


def test_two_workers_send_every_index_once_with_warmup_first(tmp_path):
    profile = write_profile(tmp_path, warmup=8, measured=64, output_len=16)
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "loadlab", "run", str(profile), "--workers", "2", "--out", str(out),
         "--run-name", "run"],
        cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    run = out / "run"
    assert done.stdout.strip().splitlines()[-1] == str(run)
    rows = read_jsonl_records(run / "records.jsonl")
    assert sorted(r["index"] for r in rows) == list(range(72))  # no duplicate, no missing index
    assert all(r["outcome"] == "ok" for r in rows)
    assert {r["phase"] for r in rows if r["index"] < 8} == {"warmup"}
    assert {r["phase"] for r in rows if r["index"] >= 8} == {"measure"}
    # The warm-up barrier holds across workers: no measured request left before every warm-up ended.
    warmup_end = max(r["t_send_wall"] + r["e2e_ms"] / 1000 for r in rows if r["phase"] == "warmup")
    assert min(r["t_send_wall"] for r in rows if r["phase"] == "measure") >= warmup_end - 0.005
    workers = {r["worker_id"] for r in rows}
    assert len(workers) == 2
    manifest = json.loads((run / "manifest.json").read_text())
    gens = {g["worker_id"]: g for g in manifest["load_generators"]}
    assert set(gens) == workers
    for g in gens.values():  # same machine: the offset estimate is near zero and the round trip short
        assert abs(g["clock_offset_s"]) <= g["rtt_s"] / 2 + 0.005 and 0 < g["rtt_s"] < 1.0, g
        assert g["lost_in_flight"] == 0 and g["record_batches_missing"] == 0
    assert sum(g["records"] for g in gens.values()) == 72
    # The workers ping the master's clock as they start, while the master may still be starting its target:
    # its handlers are up before that, and a worker pings until it has its round trips.
    assert "Unknown message type" not in done.stderr, done.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["measured_requests"] == 64 and not summary["partial"] and summary["lost_in_flight"] == 0
    assert not (run / SPILL_DIR).exists()  # spills merged (nothing missing) and removed


@CLUSTER_RERUN
def test_a_killed_worker_costs_only_its_requests_in_flight(tmp_path):
    master, workers = start_cluster(tmp_path, measured=160, worker_out="worker-out")
    try:
        records = tmp_path / "out" / "run" / "records.jsonl"
        wait_for_records(records, 40, [master, *workers])
        victim = workers[0]
        victim.send_signal(signal.SIGKILL)
        victim.wait(5)
        assert master.wait(120) == 0, logs(tmp_path)
    finally:
        for p in [master, *workers]:
            if p.poll() is None:
                p.kill()
    run = tmp_path / "out" / "run"
    rows = read_jsonl_records(run / "records.jsonl")
    manifest = json.loads((run / "manifest.json").read_text())
    lost = manifest["lost_in_flight"]
    indices = [r["index"] for r in rows]
    assert len(indices) == len(set(indices))  # no duplicates
    assert sorted(indices + [x["index"] for x in lost]) == list(range(164))  # every index accounted for
    why = f"lost {lost}\nload generators {manifest.get('load_generators')}\n{logs(tmp_path)}"
    assert 1 <= len(lost) <= 8, why  # at most the users the dead worker had in flight
    assert manifest["counts"]["lost_in_flight"] == len(lost) and manifest["complete"] is True
    # Every request that completed on the killed worker is in the run's records.
    dead = {x["worker"] for x in lost}
    assert len(dead) == 1, why
    (dead_id,) = dead
    dead_rows = read_jsonl_records(tmp_path / "worker-out" / "run" / SPILL_DIR / spill_name(dead_id))
    assert dead_rows and {r["index"] for r in dead_rows} <= set(indices)
    assert {r["worker_id"] for r in dead_rows} == {dead_id}
    gens = {g["worker_id"]: g for g in manifest["load_generators"]}
    assert gens[dead_id]["gone"] is True and gens[dead_id]["lost_in_flight"] == len(lost)
    summary_md = (run / "summary.md").read_text()
    assert f"{len(lost)} requests lost in flight" in summary_md and dead_id in summary_md
    summary = json.loads((run / "summary.json").read_text())
    assert summary["lost_in_flight"] == len(lost) and not summary["partial"]


@CLUSTER_RERUN
def test_a_killed_master_stops_workers_and_spills_recover_every_record(tmp_path):
    # Same --out: spills in the run. The workers give up on a silent master after 4 s (the default is 10).
    lost = ("--master-lost-s", str(MASTER_LOST_S))
    master, workers = start_cluster(tmp_path, 400, "out", *lost)
    try:
        run = tmp_path / "out" / "run"
        wait_for_records(run / "records.jsonl", 30, [master, *workers])
        master.send_signal(signal.SIGKILL)
        master.wait(5)
        t_kill = time.monotonic()
        for w in workers:
            w.wait(30)
        stopped_after = time.monotonic() - t_kill
    finally:
        for p in [master, *workers]:
            if p.poll() is None:
                p.kill()
    # --master-lost-s (4 s; the last heartbeat up to 1 s before the kill) + the 1 s check + shutdown; the
    # default 10 s would be 9 s at least.
    assert stopped_after < MASTER_LOST_S + 5, logs(tmp_path)
    assert all(w.returncode == 1 for w in workers), logs(tmp_path)
    spilled = {}
    for path in (run / SPILL_DIR).glob("*.jsonl"):
        for r in read_jsonl_records(path):
            spilled[r["index"]] = r
    assert len(spilled) >= 30
    done = subprocess.run([sys.executable, "-m", "loadlab", "report", str(run)], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = read_jsonl_records(run / "records.jsonl")
    indices = [r["index"] for r in rows]
    assert len(indices) == len(set(indices))
    assert set(indices) == set(spilled)  # every completed request, once
    assert sum(1 for r in rows if r["outcome"] == "ok") == sum(
        1 for r in spilled.values() if r["outcome"] == "ok"
    )
    summary = json.loads((run / "summary.json").read_text())
    assert summary["partial"] is True and summary["measured_requests"] == sum(
        1 for r in spilled.values() if r["phase"] == "measure"
    )


@pytest.mark.parametrize("flag", [["--master-host", "127.0.0.1"]])
def test_master_host_needs_workers(tmp_path, flag):
    profile = write_profile(tmp_path, warmup=0, measured=1, output_len=4)
    done = subprocess.run([sys.executable, "-m", "loadlab", "run", str(profile), *flag], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert (
        done.returncode == 2
        and done.stderr.strip() == "loadlab: --master-host: only with --workers N (the workers to start)"
    )


def test_a_worker_that_cannot_reach_the_target_fails_the_run_loudly(tmp_path):
    """The master can reach the target when it starts; by the time the workers join it is gone."""
    from loadlab.target.embedded import EmbeddedServer

    server = EmbeddedServer({"gpu": "h100-80gb"})
    url = server.start()
    profile = write_profile(tmp_path, warmup=0, measured=8, output_len=4)
    port = free_port()
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--master", "--headless", "--expect-workers",
           "1", "--master-bind-host", "127.0.0.1", "--master-bind-port", str(port), "--profile-file",
           str(profile), "--host", url, "--out", str(tmp_path / "out"), "--run-name", "run",
           "--loglevel", "DEBUG"]  # fmt: skip
    master = subprocess.Popen(
        cmd, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[str] = []
    waiting = threading.Event()  # Locust's "Waiting for workers" (DEBUG for its first 5 s): init is over

    def read() -> None:
        for line in master.stdout:
            lines.append(line)
            if "Waiting for workers to be ready" in line:
                waiting.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    worker = None
    try:
        # The master has probed the target and waits for its worker.
        assert waiting.wait(60), "".join(lines)[-3000:]
        server.stop()
        worker = start_worker(tmp_path, port, "out", 0)
        status = master.wait(60)
        reader.join(10)
        output = "".join(lines)
    finally:
        for p in (master, worker):
            if p is not None and p.poll() is None:
                p.kill()
        server.stop()
    assert status == 3, output[-3000:]
    assert f"cannot reach {url}" in output or "cannot reach" in output, output[-3000:]
    errors = [line for line in output.splitlines() if "loadlab: worker" in line and "ERROR" in line]
    assert errors, output[-3000:]


@CLUSTER_RERUN
def test_ctrl_c_on_the_master_collects_every_workers_in_flight_requests(tmp_path):
    master, workers = start_cluster(tmp_path, measured=400, worker_out="worker-out")
    try:
        run = tmp_path / "out" / "run"
        wait_for_records(run / "records.jsonl", 30, [master, *workers])
        time.sleep(0.3)  # mid-wave: requests are in flight on both workers
        master.send_signal(signal.SIGINT)
        assert master.wait(60) == 1, logs(tmp_path)  # cut short
        for w in workers:
            w.wait(30)
    finally:
        for p in [master, *workers]:
            if p.poll() is None:
                p.kill()
    rows = read_jsonl_records(run / "records.jsonl")
    indices = [r["index"] for r in rows]
    assert len(indices) == len(set(indices))
    # Indices without a record below the last recorded one are tickets some worker's stock still held: its
    # users never started them, and it returned them at the drain (as tickets never taken in one process).
    returned = re.search(
        r"(\d+) requests returned unsent at the drain", (tmp_path / "master.log").read_text()
    )
    skipped = set(range(max(indices))) - set(indices)
    assert len(skipped) <= (int(returned[1]) if returned else 0), logs(tmp_path)
    cancelled = [r for r in rows if r["outcome"] == "cancelled"]
    assert cancelled, "the in-flight requests should be recorded as cancelled"
    assert len({r["worker_id"] for r in cancelled}) == 2  # both workers' last batches arrived
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["complete"] is False and manifest["counts"]["lost_in_flight"] == 0
    # Everything each worker spilled is in the run's records.
    spilled = {r["index"] for p in (tmp_path / "worker-out" / "run" / SPILL_DIR).glob("*.jsonl")
               for r in read_jsonl_records(p)}  # fmt: skip
    assert spilled == set(indices)
