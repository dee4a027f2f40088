"""Tickets leased in blocks (loadlab/swarm/master.py, worker.py): a real Locust master and real workers on
127.0.0.1 against the scripted server or the embedded twin.

Every index once and warm-up first with blocks, the barrier held across workers, a worker killed with a
stock of unstarted tickets in hand (they are leased again, not lost, and nothing is sent twice), open-loop
due times kept.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from loadlab.procs import free_port
from loadlab.records import read_jsonl_records
from loadlab.testing.servers import start_scripted

REPO = Path(__file__).resolve().parents[1]
LOCUSTFILE = REPO / "loadlab" / "swarm" / "locustfile.py"
TIMING = REPO / "tests" / "profiles" / "timing.yaml"
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
LEASE_LINE = re.compile(r"tickets: (\d+) leased in (\d+) blocks .*?(?:(\d+) of dead workers leased again)?"
                        r"(?:, \d+ requests returned unsent at the drain)?; "
                        r"users waited ([\d.]+) ms per measured ticket")  # fmt: skip
EMPTY_LINE = re.compile(r"\((\d+) of (\d+) found the stock empty\)")


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    server = start_scripted(tmp_path_factory.mktemp("scripted") / "server.jsonl", ttft_ms=5.0, gap_ms=2.0)
    yield server
    server.stop()


def loadlab_run(tmp_path: Path, url: str, *extra: str) -> tuple[Path, str]:
    done = subprocess.run(
        [sys.executable, "-m", "loadlab", "run", str(TIMING), "--host", f"{url}/case/normal",
         "--out", str(tmp_path / "out"), "--run-name", "run", "--output-len", "4", *extra],
        cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return Path(done.stdout.strip().splitlines()[-1]), done.stderr


def tickets_of(run: Path) -> dict:
    """The manifest's ticket leases (leased, blocks, leased_again, measured_takes, empty_takes, wait)."""
    return json.loads((run / "manifest.json").read_text())["tickets"]


def lease_line(log: str) -> tuple[int, int, int, float]:
    """The master's log line: (tickets leased, blocks, dead workers' tickets leased again, ms users waited
    per measured ticket)."""
    match = LEASE_LINE.search(log)
    assert match, log[-3000:]
    leased, blocks, again, wait = match.groups()
    return int(leased), int(blocks), int(again or 0), float(wait)


@pytest.mark.alone
def test_blocks_hand_out_every_index_once_warmup_first_behind_the_barrier(tmp_path, scripted):
    # 2 workers x 32 users, 64 warm-up and 640 measured requests of ~11 ms: blocks of several tickets.
    run, stderr = loadlab_run(tmp_path, scripted.url, "--workers", "2", "--concurrency", "64",
                              "--warmup-requests", "64", "--num-requests", "640")  # fmt: skip
    rows = read_jsonl_records(run / "records.jsonl")
    assert sorted(r["index"] for r in rows) == list(range(704))  # no duplicate, no missing index
    assert all(r["outcome"] == "ok" for r in rows)
    assert {r["phase"] for r in rows if r["index"] < 64} == {"warmup"}
    assert {r["phase"] for r in rows if r["index"] >= 64} == {"measure"}
    # The barrier: no measured request left before every warm-up request (on either worker) had ended,
    # although each worker held a stock of tickets.
    warmup_end = max(r["t_send_wall"] + r["e2e_ms"] / 1000 for r in rows if r["phase"] == "warmup")
    assert min(r["t_send_wall"] for r in rows if r["phase"] == "measure") >= warmup_end - 0.005
    assert len({r["worker_id"] for r in rows}) == 2
    tickets = tickets_of(run)
    assert tickets["leased"] == 704 and tickets["leased_again"] == 0 and tickets["returned_unsent"] == 0
    assert tickets["blocks"] <= 704 / 2, tickets  # leased in blocks, not one ticket a round trip
    # Users take from their stock (the figure the benchmark holds under 1 ms).
    assert tickets["wait_ms_per_take"] < 5.0, tickets
    # The stock covers a wave of all of a worker's users plus two round trips of takes: a take rarely finds
    # it empty (with a mark of at most the users, waves of users found it empty while an ask was out).
    takes, empty = tickets["measured_takes"], tickets["empty_takes"]
    assert takes >= 640 - 64 and empty <= 0.01 * takes, tickets
    # The master's log line says the same.
    assert lease_line(stderr) == (704, tickets["blocks"], 0, round(tickets["wait_ms_per_take"], 3))
    assert tuple(map(int, EMPTY_LINE.search(stderr).groups())) == (empty, takes)
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["complete"] and manifest["counts"]["lost_in_flight"] == 0


def start_master(tmp_path: Path, profile: Path, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--master", "--headless", "--only-summary",
           "--expect-workers", "2", "--master-bind-host", "127.0.0.1", "--master-bind-port", str(port),
           "--profile-file", str(profile), "--out", str(tmp_path / "out"), "--run-name", "run"]  # fmt: skip
    return subprocess.Popen(cmd, cwd=tmp_path, env=ENV, stdout=open(tmp_path / "master.log", "wb"),  # noqa: SIM115
                            stderr=subprocess.STDOUT)  # fmt: skip


def start_worker(tmp_path: Path, port: int, n: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--worker", "--master-host", "127.0.0.1",
           "--master-port", str(port), "--out", str(tmp_path / f"worker{n}-out")]  # fmt: skip
    return subprocess.Popen(cmd, cwd=tmp_path, env=ENV, stdout=open(tmp_path / f"worker{n}.log", "wb"),  # noqa: SIM115
                            stderr=subprocess.STDOUT)  # fmt: skip


KILL_PROFILE = """\
name: lease
seed: 5
target: {url: embedded, embedded: {gpu: h100-80gb}}
load: {model: closed, concurrency: 32}
requests: {warmup: 4, measured: 400}
workload: {kind: random_prefix, input_len: 64, output_len: 48}
"""


def logs(tmp_path: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("*.log")))


@pytest.mark.flaky(reruns=1)  # a real cluster on 2 shared cores
def test_a_killed_workers_unstarted_stock_is_leased_again_and_nothing_is_sent_twice(tmp_path):
    profile = tmp_path / "profile.yaml"
    profile.write_text(KILL_PROFILE)
    port = free_port()
    master = start_master(tmp_path, profile, port)
    workers = [start_worker(tmp_path, port, n) for n in range(2)]
    records = tmp_path / "out" / "run" / "records.jsonl"
    try:
        deadline = time.monotonic() + 90
        while not (records.exists() and len(read_jsonl_records(records)) >= 80):
            assert time.monotonic() < deadline and master.poll() is None, logs(tmp_path)
            time.sleep(0.1)
        workers[0].send_signal(signal.SIGKILL)  # 16 users streaming, a stock of tickets not yet started
        workers[0].wait(5)
        assert master.wait(150) == 0, logs(tmp_path)
    finally:
        for p in [master, *workers]:
            if p.poll() is None:
                p.kill()
    run = tmp_path / "out" / "run"
    rows = read_jsonl_records(run / "records.jsonl")
    manifest = json.loads((run / "manifest.json").read_text())
    lost = manifest["lost_in_flight"]
    indices = [r["index"] for r in rows]
    master_log = (tmp_path / "master.log").read_text()
    why = f"lost {lost}\n{logs(tmp_path)}"
    assert len(indices) == len(set(indices)), why  # nothing recorded twice
    assert "may be sent twice" not in master_log, why
    assert sorted(indices + [x["index"] for x in lost]) == list(range(404)), why  # every index accounted
    # Only requests its users had started are lost (at most one per user: 16); its unstarted stock went
    # to the surviving worker and was sent there.
    assert 1 <= len(lost) <= 16, why
    again = tickets_of(run)["leased_again"]
    (dead,) = {x["worker"] for x in lost}
    stated = re.search(rf"worker {re.escape(dead)} is gone; (\d+) requests in flight on it are lost, (\d+) "
                       "unstarted tickets", master_log)  # fmt: skip
    assert stated and int(stated[1]) == len(lost) and int(stated[2]) == again >= 1, why
    survivor_rows = [r for r in rows if r["worker_id"] != dead]
    assert len({r["worker_id"] for r in survivor_rows}) == 1
    assert manifest["complete"] is True and manifest["counts"]["lost_in_flight"] == len(lost)
    assert all(r["outcome"] == "ok" for r in rows), why


@pytest.mark.alone
def test_open_loop_blocks_keep_every_due_time(tmp_path, scripted):
    # 200 req/s for 2 s across 2 workers: several tickets a block, each still sent at its own due time.
    run, stderr = loadlab_run(tmp_path, scripted.url, "--workers", "2", "--concurrency", "64",
                              "--warmup-requests", "10", "--num-requests", "400", "--set", "load.model=open",
                              "--set", "load.rate=200", "--set", "load.arrival=constant")  # fmt: skip
    rows = read_jsonl_records(run / "records.jsonl")
    assert sorted(r["index"] for r in rows) == list(range(410))
    assert len({r["worker_id"] for r in rows}) == 2
    measured = sorted((r for r in rows if r["phase"] == "measure"), key=lambda r: r["index"])
    due = np.array([r["t_scheduled_wall"] for r in measured])
    sent = np.array([r["t_send_wall"] for r in measured])
    assert np.allclose(np.diff(due), 0.005, atol=1e-3)  # in index order, 5 ms apart, whichever worker
    late = sent - due
    assert np.all(late > -0.005) and np.median(late) < 0.005, np.percentile(late, [50, 95, 99])
    tickets = tickets_of(run)
    assert tickets["leased"] == 410 and tickets["blocks"] <= 410 / 2, tickets
