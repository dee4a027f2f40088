"""Nothing lost on failure: a load generator killed with SIGKILL leaves readable records and no orphan."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from loadlab.manifest import read_manifest
from loadlab.records import RECORDS_JSONL, read_jsonl_records

REPO = Path(__file__).resolve().parents[1]


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout
    return bool(state.strip()) and not state.strip().startswith("Z")


def test_sigkill_mid_run_leaves_a_reportable_partial_run(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "locust", "-f", "locustfile.py", "--headless", "--out", str(tmp_path),
         "--num-requests", "2000", "--warmup-requests", "0"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        records = None
        while time.monotonic() < deadline:
            dirs = list(tmp_path.iterdir())
            records = dirs[0] / RECORDS_JSONL if dirs else None
            if records and records.exists() and len(records.read_bytes().splitlines()) >= 20:
                break
            time.sleep(0.2)
        else:
            raise AssertionError("the run wrote no records in 60 s")
        server_pids = _children(proc.pid)
        assert server_pids, "the embedded server should be a child of the Locust process"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    run_dir = records.parent
    written = read_jsonl_records(records)
    assert len(written) >= 20
    assert len({r["index"] for r in written}) == len(written)  # each request once
    manifest = read_manifest(run_dir)
    assert manifest.complete is False  # the start-of-run manifest says so until the end rewrites it

    # The embedded server dies with its parent.
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in server_pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in server_pids), "orphaned embedded server"

    report = subprocess.run(
        [sys.executable, "-m", "loadlab.cli", "report", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert report.returncode == 0, report.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    ok = sum(1 for r in written if r["outcome"] == "ok" and r["phase"] == "measure")
    assert summary["completed"] == ok
    assert summary["partial"] is True
    assert "partial" in (run_dir / "summary.md").read_text().lower()


def _wait_for_records(tmp_path, count, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dirs = list(tmp_path.iterdir())
        records = dirs[0] / RECORDS_JSONL if dirs else None
        if records and records.exists() and len(records.read_bytes().splitlines()) >= count:
            # Closed-loop users finish in waves (identical requests decode in lockstep) and the records of
            # a wave land together: wait until the next wave is well in flight before signalling.
            time.sleep(0.4)
            return records.parent
        time.sleep(0.2)
    raise AssertionError(f"the run wrote fewer than {count} records in {timeout_s} s")


def _assert_cut_short_cleanly(run_dir, proc_stderr):
    assert "Traceback" not in proc_stderr, proc_stderr[-3000:]
    manifest = read_manifest(run_dir)
    assert manifest.complete is False
    written = read_jsonl_records(run_dir / RECORDS_JSONL)
    assert len({r["index"] for r in written}) == len(written)
    assert manifest.counts.records == len(written)
    outcomes = {r["outcome"] for r in written}
    assert "cancelled" in outcomes, outcomes  # the in-flight requests are recorded, not lost
    assert outcomes <= {"ok", "cancelled"}, outcomes  # and the server was not killed under them
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["partial"] is True
    assert summary["failures"].get("cancelled", 0) == sum(
        1 for r in written if r["outcome"] == "cancelled" and r["phase"] == "measure"
    )


def test_ctrl_c_on_loadlab_run_records_in_flight_requests_and_exits_1(tmp_path):
    """Ctrl-C in a terminal signals the whole foreground process group."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "loadlab.cli", "run", "profiles/default.yaml", "--out", str(tmp_path),
         "--num-requests", "2000", "--warmup-requests", "0"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        run_dir = _wait_for_records(tmp_path, 20)
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, stderr[-3000:]
    assert stdout.strip().splitlines()[-1] == str(run_dir)
    _assert_cut_short_cleanly(run_dir, stderr)


def test_sigterm_on_locust_records_in_flight_requests_and_exits_1(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "locust", "-f", "locustfile.py", "--headless", "--out", str(tmp_path),
         "--num-requests", "2000", "--warmup-requests", "0"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        run_dir = _wait_for_records(tmp_path, 20)
        server_pids = _children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, stderr[-3000:]
    _assert_cut_short_cleanly(run_dir, stderr)
    deadline = time.monotonic() + 1.0  # a second for the embedded server to go, as before
    while any(_alive(pid) for pid in server_pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in server_pids), "the embedded server outlived the run"
