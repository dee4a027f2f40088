"""`loadlab sweep`: relaunch per configuration, repeats and medians, knee and SLO choice, resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loadlab.experiment.sweep import SweepError, choose, load_sweep

REPO = Path(__file__).resolve().parents[1]
SWEEP = REPO / "tests" / "sweeps" / "short.yaml"
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def sweep_cmd(out: Path) -> list[str]:
    return [sys.executable, "-m", "loadlab", "sweep", str(SWEEP), "--out", str(out)]


def test_the_shortened_seed_sweep_end_to_end_with_an_interruption(tmp_path):
    out = tmp_path / "sweep"
    # Interrupt after the first finished run, as a terminal Ctrl-C does (the whole process group).
    proc = subprocess.Popen(sweep_cmd(out), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    state = out / "sweep.json"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if state.exists() and json.loads(state.read_text()).get("runs"):
            break
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    kept = json.loads(state.read_text())["runs"]
    assert 1 <= len(kept) < 4 and "Run the same command to resume" in err
    first_run = kept["0/0"]
    # Resume: the finished runs are kept, the rest are done.
    done = subprocess.run(sweep_cmd(out), env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    final = json.loads(state.read_text())
    assert len(final["runs"]) == 4 and final["runs"]["0/0"] == first_run
    assert (out / "server-0.log").exists() and (out / "server-1.log").exists()  # one server per limit
    result = final["result"]
    rows = {r["config"]["max_running_requests"]: r for r in result["rows"]}
    assert rows[4]["repeats"] == 2 and rows[16]["repeats"] == 2
    # 8 users: a limit of 4 binds (4 running at most), 16 never does.
    assert rows[4]["values"]["max running"]["median"] == 4
    assert rows[16]["values"]["max running"]["median"] <= 8
    assert any("max_running_requests at 16 never bound" in f for f in result["findings"])
    assert result["choice"] is not None and result["knee"] is not None
    md = (out / "sweep.md").read_text()
    for column in ("output tok/s", "TTFT P50 ms", "TTFT P95 ms", "TPOT P95 ms", "mean queue delay ms",
                   "peak KV usage %"):  # fmt: skip
        assert column in md
    assert "SLO-first choice" in md and "Knee" in md and "Incomplete" not in md
    page = (out / "sweep.html").read_text()
    assert page.count("data:image/png;base64,") == 1 and "SLO-first choice" in page


def test_choice_rejects_with_reasons_and_the_knee_is_where_throughput_stops_growing():
    def row(limit, thr, ttft, tpot):
        values = {"output tok/s": thr, "TTFT P95 ms": ttft, "TPOT P95 ms": tpot, "max running": limit,
                  "retractions": 0}  # fmt: skip
        return {"config": {"max_running_requests": limit}, "repeats": 3, "failed": 0,
                "values": {k: {"median": v, "min": v, "max": v} for k, v in values.items()}}  # fmt: skip

    rows = [
        row(32, 1300, 900, 20),
        row(64, 2000, 1500, 30),
        row(128, 2200, 2800, 60),
        row(256, 2250, 5000, 90),
    ]
    result = choose({"slo": {"ttft_p95_ms": 3000, "tpot_p95_ms": 100}}, rows)
    assert result["knee"] == "max_running_requests=128"  # 256 adds only 2%
    assert result["choice"] == "max_running_requests=128"  # the fastest that meets the SLO
    assert result["rejected"] == [
        {"config": "max_running_requests=256", "reasons": ["TTFT P95 5000 ms > 3000 ms"]}
    ]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("profile: short-profile.yaml\naxes: {max_running_requests: [4]}\n", "needs a launch template"),
        ("profile: short-profile.yaml\naxes: {load.concurrency: []}\n", "axes: a mapping of name"),
        ("profile: short-profile.yaml\naxes: {load.concurrency: [1]}\nrepeat: 2\n", "repeat: unknown key"),
        ("axes: {load.concurrency: [1]}\n", "profile: missing"),
        (
            "profile: short-profile.yaml\nlaunch: 'loadlab sim'\naxes: {load.concurrency: [1]}\n",
            "an argv list",
        ),
    ],
)
def test_bad_sweep_files_get_one_line(tmp_path, text, fragment):
    path = tmp_path / "s.yaml"
    path.write_text(text)
    (tmp_path / "short-profile.yaml").write_text(
        (REPO / "tests" / "sweeps" / "short-profile.yaml").read_text()
    )
    with pytest.raises(SweepError) as e:
        load_sweep(path)
    assert fragment in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)
