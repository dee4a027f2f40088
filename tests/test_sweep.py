"""`loadlab sweep`: relaunch per configuration, repeats and medians, knee and SLO choice, resume."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loadlab.analysis import compute_summary
from loadlab.experiment import runner
from loadlab.experiment.aggregate import choose, knee_index, refine_configs
from loadlab.experiment.spec import SweepError, load_sweep
from loadlab.target.probe import TargetError

REPO = Path(__file__).resolve().parents[1]
SWEEP = REPO / "tests" / "sweeps" / "short.yaml"
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def write_summary(run_dir: Path, **values) -> None:
    """A finished run's summary.json with the given figures (an empty run's summary otherwise)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    compute_summary(None, None).model_copy(update=values).write(run_dir)


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
    assert page.count("data:image/png;base64,") == 2 and "SLO-first choice" in page  # curves, Pareto


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
    result = choose(rows, {"ttft_p95_ms": 3000, "tpot_p95_ms": 100})
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
    added = [c["max_running_requests"] for c in refine_configs(rows, 1)]
    assert added == [45, 91]  # 32*sqrt(2), 64*sqrt(2)
    added = [c["max_running_requests"] for c in refine_configs(rows, 2)]
    assert added == [40, 51, 81, 102]
    # The knee at the first value refines upward only; values already swept are not added again.
    assert refine_configs([row(32, 1000), row(64, 1010)], 1) == [{"max_running_requests": 45}]
    assert refine_configs([row(1, 10), row(2, 10)], 3) == []
    # An axis of whole floats is a count too (--set load.concurrency needs an integer).
    floats = [
        {**row(v, t), "config": {"load.concurrency": v}} for v, t in ((8.0, 100), (16.0, 200), (32.0, 201))
    ]
    assert refine_configs(floats, 1, {"load.concurrency": [8.0, 16.0, 32.0]}) == [
        {"load.concurrency": 11},
        {"load.concurrency": 23},
    ]


def test_the_knee_stays_put_when_refined_rows_come_in_between():
    def row(limit, thr):
        return {"config": {"max_running_requests": limit}, "repeats": 1,
                "values": {"output tok/s": {"median": thr, "min": thr, "max": thr}}}  # fmt: skip

    def curve(v):  # saturating throughput: each doubling pays less
        return 2000 * (1 - math.exp(-v / 60))

    coarse = [row(v, curve(v)) for v in (32, 64, 128, 256, 512)]
    knee = coarse[knee_index(coarse)]["config"]["max_running_requests"]
    assert knee == 256  # 512 adds < 5%; 256 over 128 adds ~ 12%
    for n in (1, 2, 3):  # with a per-step rule the knee fell to 181, 161, then 128 as points were added
        added = [c["max_running_requests"] for c in refine_configs(coarse, n, {})]
        fine = sorted(
            coarse + [row(v, curve(v)) for v in added], key=lambda r: r["config"]["max_running_requests"]
        )
        found = fine[knee_index(fine)]["config"]["max_running_requests"]
        assert 181 <= found <= 256, (n, found)


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
        (
            "profile: short-profile.yaml\naxes: {load.concurrency: [4, 1]}\nrefine: 1\n",
            "two or more increasing",
        ),
        ("profile: short-profile.yaml\naxes: {load.concurrency: [4]}\nrefine: 1\n", "two or more increasing"),
        (
            "profile: short-profile.yaml\nset: [requests.measurd=5]\naxes: {load.concurrency: [1]}\n",
            "measurd",
        ),
        ("profile: short-profile.yaml\naxes: {load.concurrency: [1, 0]}\n", "load.concurrency=0"),
        (
            "profile: short-profile.yaml\naxes: {load.concurrency: [1, 4]}\nrefine: yes\n",
            "refine: a whole number",
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


def test_resume_keeps_or_refuses_a_refine_stage(tmp_path, monkeypatch):
    """The sweep's state machine with the runs replaced by summaries from a known curve (the end-to-end
    test above runs real ones): refine after the coarse stage, resume after an interruption in it, and
    a changed `refine:` refused once refined runs exist."""
    (tmp_path / "short-profile.yaml").write_text(
        (REPO / "tests" / "sweeps" / "short-profile.yaml").read_text()
    )
    path = tmp_path / "s.yaml"
    calls, stop_at = [], []

    def fake_run(spec, out, k, r, config, url, extra, warm_up):
        if stop_at and len(calls) == stop_at[0]:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: the run stops early and exits non-zero
            raise TargetError(f"run c{k:02d}-r{r} failed (exit status 1)")
        calls.append(config["load.concurrency"])
        assert warm_up == (r == 0)  # one repeat each: every run is the first on its configuration
        run = out / "runs" / f"c{k:02d}-r{r}"
        run.mkdir(parents=True)
        thr = 2000 * (1 - math.exp(-config["load.concurrency"] / 6))
        write_summary(run, output_throughput=thr)
        return run

    monkeypatch.setattr(runner, "_one_run", fake_run)
    path.write_text(
        "profile: short-profile.yaml\naxes: {load.concurrency: [2, 4, 8, 16, 32, 64]}\nrefine: 1\n"
    )
    out = tmp_path / "out"
    stop_at.append(7)  # the six coarse runs, then one of the refine stage
    assert runner.run_sweep(load_sweep(path), out) == 130
    state = json.loads((out / "sweep.json").read_text())
    # Coarse knee at 32 (64 adds 0.5%, 32 over 16 adds 7%): one value each side, on a log scale.
    assert state["refined"] == [{"load.concurrency": 23}, {"load.concurrency": 45}]
    assert state["refined_with"] == 1
    assert len(state["runs"]) == 7
    stop_at.clear()
    assert runner.run_sweep(load_sweep(path), out) == 0  # resumes with the same refined values
    assert calls == [2, 4, 8, 16, 32, 64, 23, 45]
    result = json.loads((out / "sweep.json").read_text())["result"]
    assert [r["config"]["load.concurrency"] for r in result["rows"]] == [2, 4, 8, 16, 23, 32, 45, 64]
    # The finer grid places the knee within the refined span (23 to 32: +1.8% in half a doubling).
    assert result["knee"] in ("load.concurrency=23", "load.concurrency=32")
    path.write_text(path.read_text().replace("refine: 1", "refine: 2"))
    with pytest.raises(SweepError, match="refined with refine: 1"):
        runner.run_sweep(load_sweep(path), out)

    # Refined values chosen but none run yet (and a stale failure among them): a changed refine starts over.
    out2 = tmp_path / "out2"
    path.write_text(path.read_text().replace("refine: 2", "refine: 1"))
    calls.clear()
    stop_at.append(6)  # stopped right after the coarse stage
    assert runner.run_sweep(load_sweep(path), out2) == 130
    state = json.loads((out2 / "sweep.json").read_text())
    assert state["refined"] and state["refined_with"] == 1 and len(state["runs"]) == 6
    state["failed"] = {"6": "the server exited with status 1"}
    (out2 / "sweep.json").write_text(json.dumps(state))
    stop_at.clear()
    path.write_text(path.read_text().replace("refine: 1", "refine: 0"))
    assert runner.run_sweep(load_sweep(path), out2) == 0
    final = json.loads((out2 / "sweep.json").read_text())
    assert final["refined"] is None and final["failed"] == {} and len(final["runs"]) == 6


def test_a_configuration_whose_server_fails_is_reported_and_the_sweep_goes_on(tmp_path):
    (tmp_path / "short-profile.yaml").write_text(
        (REPO / "tests" / "sweeps" / "short-profile.yaml").read_text()
    )
    path = tmp_path / "s.yaml"
    # -1: the server refuses to start (as a real one that runs out of memory at a large limit would die).
    path.write_text(
        "profile: short-profile.yaml\n"
        'launch: [loadlab, sim, --port, "{port}", --gpu, h100-80gb, --max-running-requests, "{max_running_requests}"]\n'
        "axes: {max_running_requests: [-1, 8]}\n"
    )
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "loadlab", "sweep", str(path), "--out", str(out)], env=ENV,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 3, done.stderr[-2000:]
    assert (
        "configuration 1/2 (max_running_requests=-1): failed: the server exited with status 2" in done.stderr
    )
    state = json.loads((out / "sweep.json").read_text())
    assert list(state["runs"]) == ["1/0"] and list(state["failed"]) == ["0"]
    result = state["result"]
    assert result["choice"] == "max_running_requests=8"
    assert result["rejected"][0]["config"] == "max_running_requests=-1"
    assert "failed: the server exited with status 2; see" in result["rejected"][0]["reasons"][0]
    assert "rejected max_running_requests=-1: failed: the server exited" in (out / "sweep.md").read_text()
    # sweep.csv: sweep.md's table as numbers, for a spreadsheet (docs/experiments.md, "sweep.csv").
    import pandas as pd

    from loadlab.experiment.aggregate import COLUMNS

    csv = pd.read_csv(out / "sweep.csv")
    expected = ["max_running_requests"] + [f"{c}{s}" for c, *_ in COLUMNS for s in ("", " min", " max")]
    assert list(csv.columns) == [*expected, "repeats", "meets SLO", "rejected because", "chosen"]
    rows = {r["config"]["max_running_requests"]: r for r in result["rows"]}
    by_limit = csv.set_index("max_running_requests")
    assert list(by_limit.index) == [-1, 8] and list(by_limit["chosen"]) == [False, True]
    assert by_limit.loc[8, "meets SLO"] == True and by_limit.loc[-1, "meets SLO"] == False  # noqa: E712
    assert by_limit.loc[-1, "rejected because"].startswith("failed: the server exited with status 2")
    for column, *_ in COLUMNS:
        want = rows[8]["values"][column]["median"]
        got = by_limit.loc[8, column]
        assert (pd.isna(got) and want is None) or got == pytest.approx(want), column
    assert by_limit.loc[8, "repeats"] == 1


def test_the_choice_keeps_the_smaller_configuration_when_throughputs_tie():
    def row(limit, thr, lo, hi):
        values = {"output tok/s": (thr, lo, hi), "TTFT P95 ms": (900, 900, 900), "TPOT P95 ms": (20, 20, 20),
                  "max running": (32, 32, 32), "retractions": (0, 0, 0)}  # fmt: skip
        return {"config": {"max_running_requests": limit}, "repeats": 3, "failed": 0,
                "values": {k: {"median": m, "min": a, "max": b} for k, (m, a, b) in values.items()}}  # fmt: skip

    slo = {"ttft_p95_ms": 3000, "tpot_p95_ms": 100}
    # 32 in flight against larger limits: the same throughput up to noise; the best median is 128's.
    noise = [row(32, 1340, 1310, 1352), row(64, 1338, 1320, 1349), row(128, 1351, 1345, 1360)]
    result = choose(noise, slo)
    assert result["choice"] == "max_running_requests=32"
    assert "ties with max_running_requests=128" in result["choice_note"]
    # Runs the load generator flagged as client-bound are called out with their error bound.
    noise[1].update(client_bound=2, error_bound_ms=7.5)
    finding = choose(noise, slo)["findings"][-1]
    assert finding.startswith("2 of 9 runs were client-bound") and "up to 7.5 ms at P99" in finding
    # One outlier repeat does not make a slow configuration a tie (its median is outside the best's range).
    outlier = [row(32, 1000, 500, 1600), row(64, 1590, 1580, 1600)]
    assert choose(outlier, slo)["choice"] == "max_running_requests=64"
    # A real difference (ranges apart, > 1%) is not a tie.
    apart = [row(32, 1300, 1290, 1310), row(64, 1400, 1390, 1410)]
    result = choose(apart, slo)
    assert result["choice"] == "max_running_requests=64" and result["choice_note"] is None


def test_a_sweep_directory_written_before_state_versions_resumes(tmp_path, monkeypatch):
    """A sweep.json without `version` (the layout before it had one) resumes: its finished runs are kept,
    its failed configuration is tried again, and the next write records the version."""
    (tmp_path / "short-profile.yaml").write_text(
        (REPO / "tests" / "sweeps" / "short-profile.yaml").read_text()
    )
    path = tmp_path / "s.yaml"
    path.write_text("profile: short-profile.yaml\naxes: {load.concurrency: [2, 4, 8]}\n")
    out = tmp_path / "out"
    calls = []

    def fake_run(spec, out, k, r, config, url, extra, warm_up):
        calls.append(config["load.concurrency"])
        run = out / "runs" / f"c{k:02d}-r{r}"
        run.mkdir(parents=True)
        write_summary(run, output_throughput=100.0 * (k + 1))
        return run

    monkeypatch.setattr(runner, "_one_run", fake_run)
    first = out / "runs" / "c00-r0"
    first.mkdir(parents=True)
    write_summary(first, output_throughput=100.0)
    old = {  # as the sweep wrote it before sweep.json had a version
        "spec": {
            "name": "s",
            "file": str(path),
            "axes": {"load.concurrency": [2, 4, 8]},
            "repeats": 1,
            "set": [],
            "slo": {"ttft_p95_ms": 3000, "tpot_p95_ms": 100},
            "refine": 0,
        },  # fmt: skip
        "configs": [{"load.concurrency": 2}, {"load.concurrency": 4}, {"load.concurrency": 8}],
        "refined": None,
        "refined_with": None,
        "runs": {"0/0": str(first)},
        "failed": {"2": "the server exited with status 1; see server-2.log"},
    }
    (out / "sweep.json").write_text(json.dumps(old, indent=2))
    assert runner.run_sweep(load_sweep(path), out) == 0
    assert calls == [4, 8]  # 2 was finished; 8 had failed and is tried again
    final = json.loads((out / "sweep.json").read_text())
    assert final["version"] == runner.STATE_VERSION and final["failed"] == {}
    assert final["runs"]["0/0"] == str(first) and len(final["runs"]) == 3
    assert final["spec"]["set"] == [] and final["spec"]["profile"] == str(tmp_path / "short-profile.yaml")
    assert [r["values"]["output tok/s"]["median"] for r in final["result"]["rows"]] == [100.0, 200.0, 300.0]
    # A state this loadlab cannot read is one line, not a traceback; so is one from a newer layout.
    (out / "sweep.json").write_text(json.dumps({**final, "version": runner.STATE_VERSION + 1}))
    with pytest.raises(SweepError, match="written by a newer loadlab"):
        runner.run_sweep(load_sweep(path), out)
    (out / "sweep.json").write_text("{")
    with pytest.raises(SweepError, match="not a sweep state file"):
        runner.run_sweep(load_sweep(path), out)
