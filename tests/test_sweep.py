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

from loadlab.experiment.sweep import SweepError, choose, load_sweep, refine_configs

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
    # 2 limits x 2 repeats, then the refine step adds 8 between the knee (4 or 16) and its neighbour.
    assert final["refined"] == [{"max_running_requests": 8}]
    assert len(final["runs"]) == 6 and final["runs"]["0/0"] == first_run
    assert all((out / f"server-{k}.log").exists() for k in range(3))  # one server per limit
    result = final["result"]
    assert [r["config"]["max_running_requests"] for r in result["rows"]] == [4, 8, 16]
    rows = {r["config"]["max_running_requests"]: r for r in result["rows"]}
    assert all(r["repeats"] == 2 for r in rows.values()) and rows[8]["refined"] and not rows[4]["refined"]
    assert rows[8]["values"]["max running"]["median"] <= 8
    # 8 users: a limit of 4 binds (4 running at most), 16 never does.
    assert rows[4]["values"]["max running"]["median"] == 4
    assert rows[16]["values"]["max running"]["median"] <= 8
    assert any(" 16 never bound" in f for f in result["findings"]), result["findings"]
    assert result["choice"] is not None and result["knee"] is not None
    md = (out / "sweep.md").read_text()
    for column in ("output tok/s", "TTFT P50 ms", "TTFT P95 ms", "TPOT P95 ms", "mean queue delay ms",
                   "peak KV usage %"):  # fmt: skip
        assert column in md
    assert "SLO-first choice" in md and "Knee" in md and "Incomplete" not in md
    assert "Refined around the coarse sweep's knee: 8 added" in md
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


def test_refine_adds_values_on_a_log_scale_between_the_knee_and_its_neighbours():
    def row(limit, thr):
        return {"config": {"max_running_requests": limit}, "repeats": 1,
                "values": {"output tok/s": {"median": thr, "min": thr, "max": thr}}}  # fmt: skip

    rows = [row(32, 1000), row(64, 1500), row(128, 1550), row(256, 1560)]  # knee at 64 (128 adds 3%)
    added = [c["max_running_requests"] for c in refine_configs({"refine": 1}, rows)]
    assert added == [45, 91]  # 32*sqrt(2), 64*sqrt(2)
    added = [c["max_running_requests"] for c in refine_configs({"refine": 2}, rows)]
    assert added == [40, 51, 81, 102]
    # The knee at the first value refines upward only; values already swept are not added again.
    assert refine_configs({"refine": 1}, [row(32, 1000), row(64, 1010)]) == [{"max_running_requests": 45}]
    assert refine_configs({"refine": 3}, [row(1, 10), row(2, 10)]) == []


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
        (
            "profile: short-profile.yaml\naxes: {load.concurrency: [1, 4], load.rate: [1]}\nrefine: 1\n",
            "refine: needs a sweep over one axis",
        ),
        ("profile: short-profile.yaml\naxes: {load.concurrency: [4, 1]}\nrefine: 1\n", "needs increasing"),
        (
            "profile: short-profile.yaml\naxes: {load.concurrency: [1, 4]}\nrefine: yes\n",
            "refine: the number",
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
