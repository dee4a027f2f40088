"""Nothing lost on failure: a load generator killed with SIGKILL leaves readable records and no orphan."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from loadlab.records import RECORDS_JSONL, read_jsonl_records, read_manifest

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
    assert manifest["complete"] is False  # the start-of-run manifest says so until the end rewrites it

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
