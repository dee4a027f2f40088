"""Self-calibration: every run states its client timing error bound, and a starved client is flagged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
PROFILE = """\
name: calib
seed: 5
target: {url: embedded, embedded: {gpu: h100-80gb}}
load: {model: closed, concurrency: 8}
requests: {warmup: 8, measured: 80}
workload: {kind: random_prefix, input_len: 64, output_len: 24}
"""


def run(tmp_path: Path, locustfile: Path, *extra: str) -> tuple[int, dict, str]:
    profile = tmp_path / "p.yaml"
    profile.write_text(PROFILE)
    name = f"run{len(list(tmp_path.glob('out/*')))}"
    cmd = [sys.executable, "-m", "locust", "-f", str(locustfile), "--headless", "--only-summary",
           "--profile-file", str(profile), "--out", str(tmp_path / "out"), "--run-name", name, *extra]  # fmt: skip
    done = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)
    run_dir = tmp_path / "out" / name
    summary = (
        json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    )
    md = (run_dir / "summary.md").read_text() if (run_dir / "summary.md").exists() else ""
    return done.returncode, summary, md + done.stderr[-3000:]


def test_a_starved_client_is_flagged_and_strict_fails_it(tmp_path):
    code, summary, text = run(tmp_path, REPO / "tests" / "locustfiles" / "cpu_hog.py", "--strict",
                              "--client-limit-ms", "15")  # fmt: skip
    client = summary["client"]
    # The hog holds the process 40 ms at a time: I/O waits up to that long.
    assert client["client_bound"] is True and client["error_bound_ms"] > 15, text
    assert any("late (P99; limit 15 ms)" in r for r in client["reasons"])
    assert "**Client-bound**" in text and "Client timing error bound:" in text
    assert code == 4, text  # --strict: the run completed, but its figures are suspect


@pytest.mark.alone
def test_a_healthy_client_states_its_bound_and_is_not_flagged(tmp_path):
    code, summary, text = run(tmp_path, REPO / "locustfile.py", "--strict", "--client-limit-ms", "15")
    client = summary["client"]
    assert code == 0, text
    assert client["client_bound"] is False and client["reasons"] == []
    assert 0 <= client["error_bound_ms"] < 15
    (gen,) = client["generators"]
    assert 0 < gen["cpu_mean"] < 0.85 and gen["probe_lateness_p99_ms"] == client["error_bound_ms"]
    assert "Client timing error bound:" in text and "Client-bound" not in text
