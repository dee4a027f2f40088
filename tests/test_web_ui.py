"""The same users in Locust's web UI: TTFT / TPOT / E2E appear live, and a finished run writes its report."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

from loadlab.procs import free_port

REPO = Path(__file__).resolve().parents[1]


def _get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


def _wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def test_web_ui_shows_token_latencies_and_writes_the_report(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "locust", "-f", "locustfile.py",
            "--web-host", "127.0.0.1", "--web-port", str(port),
            "--out", str(tmp_path), "--num-requests", "40", "--warmup-requests", "4", "--output-len", "16",
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:

        def ui_up():
            try:
                return _get_json(base + "/stats/requests")
            except OSError:
                return None

        _wait_for(ui_up, 30, "the web UI")
        form = urllib.parse.urlencode({"user_count": 8, "spawn_rate": 8}).encode()
        with urllib.request.urlopen(base + "/swarm", data=form, timeout=5) as resp:
            assert json.loads(resp.read())["success"] is True

        def names_seen():
            stats = _get_json(base + "/stats/requests")["stats"]
            names = {s["name"] for s in stats if s["num_requests"] > 0}
            return names if {"TTFT", "TPOT", "E2E"} <= names else None

        _wait_for(names_seen, 60, "TTFT/TPOT/E2E in the live statistics")
        # The run ends by itself after 44 requests and the UI stays up, stopped.
        _wait_for(lambda: _get_json(base + "/stats/requests")["state"] == "stopped", 90, "the run to stop")
        (run_dir,) = list(tmp_path.iterdir())
        _wait_for(lambda: (run_dir / "summary.json").exists(), 30, "summary.json")
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["completed"] == 40 and summary["failed"] == 0
        e2e = [s for s in _get_json(base + "/stats/requests")["stats"] if s["name"] == "E2E"]
        assert sum(s["num_requests"] for s in e2e) == 44  # warm-up rows are listed apart, as "warm-up"
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert "Traceback" not in proc.stderr.read()
