"""Capacity at SLO (`loadlab capacity`, a sweep's `capacity:`), sweeps in virtual time, the latency-aware
knee and the Pareto view, over-capacity rows, and the "choice made on throughput alone" finding."""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import numpy as np
import pytest
from test_analysis import colour_pixels, needs_chromium, render_or_skip

from loadlab.analysis import compute_summary
from loadlab.experiment import runner
from loadlab.experiment.aggregate import (
    COLUMNS,
    choose,
    latency_knee_index,
    pareto_front,
    summary_row,
)
from loadlab.experiment.render import render_md
from loadlab.experiment.search import next_step, outcome
from loadlab.experiment.spec import CapacitySpec, SweepError, load_sweep
from loadlab.experiment.twin import virtual_settings

REPO = Path(__file__).resolve().parents[1]
SHORT = (REPO / "tests" / "sweeps" / "short-profile.yaml").read_text()
SLO = {"ttft_p95_ms": 3000, "tpot_p95_ms": 100}


def cap(**kw) -> CapacitySpec:
    values = {"over": "load.rate", "start": 4, "tolerance": 0.05, "repeats": 3, "min": 0.5, "max": 1024}
    return CapacitySpec(**{**values, **kw})


def search(spec: CapacitySpec, passes, hint=None) -> tuple[dict, list[float]]:
    """Runs the pure search against ``passes(value, repeat) -> bool``; returns its outcome and the values
    run, in order."""
    points: dict[float, list[bool]] = {}
    order = []
    while (step := next_step(points, spec, hint)) is not None:
        runs = points.setdefault(step.value, [])
        runs.append(passes(step.value, len(runs)))
        order.append(step.value)
        assert len(order) < 200
    return outcome(points, spec, hint), order


# -- the search ----------------------------------------------------------------------------------------


def test_doubling_then_bisection_to_the_tolerance_then_repeats_at_the_boundary():
    found, order = search(cap(), lambda v, r: v <= 24.1)
    assert order[:4] == [4, 8, 16, 32]  # doubling until the first failure
    lo, hi = found["lo"], found["hi"]
    assert lo <= 24.1 < hi and hi <= lo * 1.05  # bisection to within 5%
    assert found["status"] == "found" and found["capacity"] == lo and found["done"]
    assert order.count(lo) == 3 and order.count(hi) == 3  # the boundary, 3 runs each
    assert found["confidence"] == f"passes 3/3 at {lo:g} req/s, fails 3/3 at {hi:g} req/s"
    # Bisection is geometric (the tolerance is relative): the first middle of 16..32 is 22.6.
    assert order[4] == 22.6


def test_a_repeat_that_turns_a_verdict_over_moves_the_bracket():
    # 12.3 passes once, then fails twice (as 512 at 32 req/s did in virtual time): the search goes below it.
    def passes(v, r):
        return v <= 12 or (v <= 12.5 and r == 0)

    found, order = search(cap(start=1), passes)
    assert found["lo"] <= 12 < found["hi"] and found["hi"] <= found["lo"] * 1.05
    assert 2 * sum(found["hi_runs"]) <= len(found["hi_runs"])  # the first failure fails by majority


def test_whole_numbers_for_concurrency_and_the_search_s_ends():
    found, order = search(cap(over="load.concurrency", start=8, min=1, max=512), lambda v, r: v <= 37)
    assert (found["lo"], found["hi"]) == (37, 38) and all(float(v).is_integer() for v in order)
    assert found["confidence"] == "passes 3/3 at 37 in flight, fails 3/3 at 38 in flight"
    # Nothing fails up to max: "at least"; nothing passes down to min: none.
    found, order = search(cap(max=64), lambda v, r: True)
    assert found["status"] == "at_least" and found["capacity"] == 64 and order[-1] == 64
    found, order = search(cap(min=0.5), lambda v, r: False)
    assert found["status"] == "none" and found["capacity"] is None and order == [4, 2, 1, 0.5]


def test_a_confirmation_starts_from_the_hint_and_needs_only_the_repeats_when_it_agrees():
    found, order = search(cap(), lambda v, r: v <= 12.1, hint=(12.1, 12.7))
    assert order[:2] == [12.1, 12.7] and len(order) == 6  # both ends, 3 runs each: nothing else
    assert found["lo"] == 12.1 and found["hi"] == 12.7
    # A hint end whose first run disagrees (12.7 passes once, as virtual time's 2/3 did) gets all its runs
    # before the search moves away from it: no detour up.
    found, order = search(cap(), lambda v, r: v <= 12.1 or (v <= 12.7 and r == 0), hint=(12.1, 12.7))
    assert order == [12.1, 12.7, 12.7, 12.1, 12.1, 12.7] and found["confidence"].endswith(
        "fails 2/3 at 12.7 req/s"
    )
    # A hint that is off: the search moves out from it in small steps and still ends within the tolerance.
    found, order = search(cap(), lambda v, r: v <= 10, hint=(12.1, 12.7))
    assert order[:4] == [12.1, 12.1, 12.1, 11.0]  # 12.1 fails: all its runs, then 10% down
    assert found["lo"] <= 10 < found["hi"] <= found["lo"] * 1.05


# -- the sweep file --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("capacity: {over: load.rate}\n", "capacity: over: load.rate: the runs are closed loop"),
        ("capacity: {over: load.speed}\n", "capacity: over: load.speed: load.rate (open loop)"),
        ("capacity: {start: 0}\n", "capacity: start: a positive integer"),
        ("capacity: {stat: 4}\n", "capacity: stat: unknown key"),
        ("capacity: {tolerance: 2}\n", "capacity: tolerance: "),
        ("capacity: {start: 8, max: 4}\n", "capacity: min <= start <= max"),
        ("capacity: [load.rate]\n", "capacity: a mapping"),
    ],
)
def test_bad_capacity_keys_get_one_line(tmp_path, text, fragment):
    (tmp_path / "short-profile.yaml").write_text(SHORT)
    path = tmp_path / "s.yaml"
    path.write_text("profile: short-profile.yaml\naxes: {requests.measured: [20, 24]}\n" + text)
    with pytest.raises(SweepError) as e:
        load_sweep(path)
    assert fragment in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)


def test_capacity_defaults_follow_the_load_model(tmp_path):
    (tmp_path / "short-profile.yaml").write_text(SHORT)
    path = tmp_path / "s.yaml"
    path.write_text("profile: short-profile.yaml\nrepeats: 2\naxes: {requests.measured: [20]}\n")
    assert load_sweep(path).capacity is None
    closed = load_sweep(path, capacity=True).capacity  # loadlab capacity: a search without the key
    assert (closed.over, closed.start, closed.repeats, closed.integer) == ("load.concurrency", 1, 2, True)
    path.write_text(path.read_text() + "set: [load.model=open, load.rate=8, load.concurrency=null]\n")
    opened = load_sweep(path, capacity=True).capacity
    assert opened.over == "load.rate" and opened.unit == "req/s" and opened.tolerance == 0.05
    # The key tunes `loadlab capacity`; `loadlab sweep` runs the file at its load (and its refine: stays
    # that command's).
    path.write_text(path.read_text() + "capacity: {start: 2, tolerance: 0.1}\nrefine: 1\n")
    path.write_text(path.read_text().replace("[20]", "[20, 24]"))
    assert load_sweep(path).capacity is None and load_sweep(path).refine == 1
    searched = load_sweep(path, capacity=True)
    assert (searched.capacity.start, searched.capacity.tolerance, searched.refine) == (2, 0.1, 0)


def test_virtual_time_reads_the_twin_s_launch_template_and_refuses_what_it_cannot_run(tmp_path):
    spec = load_sweep(REPO / "profiles" / "seed-batch-sweep-open.yaml")
    from loadlab.experiment.twin import run_profile

    config = {"max_running_requests": 64}
    settings = virtual_settings(spec, config, run_profile(spec, config, [], True))
    assert settings == {"gpu": "a100-80gb", "model": "llama-3.1-8b", "max_running_requests": 64,
                        "enable_metrics": True, "enable_cache_report": True}  # fmt: skip
    (tmp_path / "short-profile.yaml").write_text(SHORT)
    path = tmp_path / "s.yaml"
    # Real SGLang's template: its server axes must be twin settings by name.
    path.write_text("profile: short-profile.yaml\nlaunch: [python, -m, sglang.launch_server, --port, '{port}', "
                    "--chunk, '{chunk}']\naxes: {chunk: [512]}\n")  # fmt: skip
    with pytest.raises(
        SweepError, match=r"s.yaml: axes: chunk: in virtual time a server axis is a twin setting"
    ):
        runner.Sweep(load_sweep(path), tmp_path / "out", [], virtual=True)
    path.write_text(path.read_text().replace("chunk", "chunked_prefill_size"))
    spec = load_sweep(path)
    from loadlab.experiment.twin import check_virtual

    check_virtual(spec, spec.configurations())  # a twin setting by name: fine
    # The twin's template with a flag the twin does not have.
    path.write_text("profile: short-profile.yaml\nlaunch: [loadlab, sim, --port, '{port}', --max-running-requests, "
                    "'{max_running_requests}', --instances, '2']\naxes: {max_running_requests: [4]}\n")  # fmt: skip
    with pytest.raises(SweepError, match=r"launch: --instances: not a setting of the twin"):
        runner.Sweep(load_sweep(path), tmp_path / "out2", [], virtual=True)


# -- a search in virtual time, end to end ---------------------------------------------------------------

CAPACITY_SWEEP = """\
name: cap
profile: short-profile.yaml
repeats: 2
launch: [loadlab, sim, --port, "{port}", --gpu, a100-80gb, --max-running-requests, "{max_running_requests}"]
set: [load.model=open, load.rate=4, load.concurrency=null, requests.measured=60, requests.warmup=4]
axes:
  max_running_requests: [2, 8]
slo: {ttft_p95_ms: 400, tpot_p95_ms: 100}
capacity: {over: load.rate, start: 4, tolerance: 0.1}
"""


def test_a_capacity_search_in_virtual_time_resumes_after_ctrl_c_and_chooses_the_highest_capacity(
    tmp_path, monkeypatch
):
    (tmp_path / "short-profile.yaml").write_text(SHORT)
    path = tmp_path / "cap.yaml"
    path.write_text(CAPACITY_SWEEP)
    spec = load_sweep(path, capacity=True)
    whole = tmp_path / "whole"
    assert runner.run_sweep(spec, whole, virtual=True) == 0
    state = json.loads((whole / "sweep.json").read_text())
    rows = {r["config"]["max_running_requests"]: r for r in state["result"]["rows"]}
    small, large = rows[2]["capacity"], rows[8]["capacity"]
    assert small["status"] == large["status"] == "found" and small["done"] and large["done"]
    assert small["capacity"] < large["capacity"]  # a limit of 2 running serves less
    assert large["hi"] <= large["lo"] * 1.1 and len(large["lo_runs"]) == len(large["hi_runs"]) == 2
    assert state["result"]["choice"] == "max_running_requests=8"
    md = (whole / "sweep.md").read_text()
    assert "| 8 | **" in md and f"passes {sum(large['lo_runs'])}/2 at {large['lo']:g} req/s" in md
    assert "SLO-first choice (the highest capacity at SLO" in md
    import csv

    table = list(csv.DictReader((whole / "sweep.csv").open()))
    assert [float(r["capacity at SLO (req/s)"]) for r in table] == [small["capacity"], large["capacity"]]
    assert table[1]["confidence"] == large["confidence"] and table[1]["chosen"] == "True"
    # Repeat r ran with seed + r: not a copy of the first run.
    lo_runs = state["points"]["1"][f"{large['lo']:g}"]
    seeds = [json.loads((Path(d) / "manifest.json").read_text())["profile"]["seed"] for d in lo_runs]
    assert seeds == [6, 7]

    # Ctrl-C after five runs: they are kept, and the same command finishes the same search.
    real_run, count = runner.virtual_run, []

    def interrupted_run(*args, **kwargs):
        count.append(1)
        if len(count) == 5:
            os.kill(os.getpid(), signal.SIGINT)  # the handler only marks it: this run still finishes
        return real_run(*args, **kwargs)

    monkeypatch.setattr(runner, "virtual_run", interrupted_run)
    part = tmp_path / "part"
    assert runner.run_sweep(spec, part, virtual=True) == 130
    kept = json.loads((part / "sweep.json").read_text())["points"]
    assert sum(len(v) for p in kept.values() for v in p.values()) == 5
    assert "Incomplete" in (part / "sweep.md").read_text()
    assert runner.run_sweep(spec, part, virtual=True) == 0
    again = json.loads((part / "sweep.json").read_text())
    assert [r["capacity"]["capacity"] for r in again["result"]["rows"]] == [
        small["capacity"],
        large["capacity"],
    ]
    assert len(count) == sum(len(v) for p in again["points"].values() for v in p.values())
    # A directory holds one kind of sweep.
    with pytest.raises(SweepError, match="holds a virtual-time sweep"):
        runner.Sweep(spec, part, [])


def _write(run_dir: Path, **flat) -> Path:
    """A finished run's summary.json with these summary.json keys (p95_ttft_ms, ...)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    data = compute_summary(None, None).dump()
    data.update(flat)
    (run_dir / "summary.json").write_text(json.dumps(data))
    return run_dir


def test_a_real_time_confirmation_starts_from_virtual_time_s_bracket_for_the_best_and_its_neighbours(
    tmp_path, monkeypatch
):
    """Both searches with their runs replaced by summaries from a known curve: capacity = 3 x the limit in
    "virtual time", 5% more in "real time"."""
    (tmp_path / "short-profile.yaml").write_text(SHORT)
    path = tmp_path / "cap.yaml"
    # No launch template (the fake runs start nothing): the limit as the profile's twin setting.
    axis = "target.embedded.max_running_requests"
    text = CAPACITY_SWEEP.replace("  max_running_requests: [2, 8]", f"  {axis}: [2, 4, 8, 16]")
    path.write_text("\n".join(line for line in text.splitlines() if not line.startswith("launch")) + "\n")
    spec = load_sweep(path, capacity=True)
    calls = []

    def fake(scale):
        def run(out, name, config, sets, limit):
            rate = float(dict(s.split("=") for s in sets)["load.rate"])
            calls.append((name, limit, rate))
            ttft = 100 if rate <= 3 * limit * scale else 5000
            return _write(
                out / "runs" / name, output_throughput=100.0 * rate, p95_ttft_ms=ttft, p95_tpot_ms=10
            )

        return run

    virtual = fake(1.0)
    monkeypatch.setattr(runner, "virtual_run", lambda spec, out, name, config, sets, warm_up, html: virtual(
        out, name, config, sets, config[axis]))  # fmt: skip
    vdir = tmp_path / "virtual"
    assert runner.run_sweep(spec, vdir, virtual=True) == 0
    vstate = json.loads((vdir / "sweep.json").read_text())
    assert vstate["result"]["choice"] == f"{axis}=16"
    calls.clear()
    real = fake(1.05)

    def one_run(spec, out, k, r, config, url, extra, warm_up, name=None, sets=None):
        assert warm_up and url is None  # no launch in the test: the profile's target; every point warms up
        return real(out, name, config, sets, config[axis])

    monkeypatch.setattr(runner, "_one_run", one_run)
    rdir = tmp_path / "real"
    assert runner.run_sweep(spec, rdir, confirm=vdir) == 0
    state = json.loads((rdir / "sweep.json").read_text())
    assert state["confirm"]["configs"] == [2, 3]  # the best (16) and its one neighbour (8)
    assert {limit for _, limit, _ in calls} == {8, 16}
    v16 = vstate["result"]["rows"][3]["capacity"]
    first = [rate for _, limit, rate in calls if limit == 16][:2]
    assert first == [v16["lo"], v16["hi"]]  # started from virtual time's bracket
    confirmation = {c["config"]: c for c in state["result"]["confirmation"]}
    best = confirmation[f"{axis}=16"]
    assert best["best"] and 0 < best["difference"] < 0.15
    md = (rdir / "sweep.md").read_text()
    assert "Real time against virtual time" in md and f"| {axis}=16 (best) |" in md
    assert "| 2 | not run |" in md  # the configurations not confirmed


# -- what a sweep says ------------------------------------------------------------------------------------


def row(limit, thr, ttft, tpot, **extra):
    """A sweep row with these medians (the other columns empty)."""
    values = {"output tok/s": thr, "TTFT P95 ms": ttft, "TPOT P95 ms": tpot, "max running": limit,
              "retractions": 0}  # fmt: skip
    cells = {c: {"median": None, "min": None, "max": None} for c, *_ in COLUMNS}
    cells.update({k: {"median": v, "min": v, "max": v} for k, v in values.items()})
    return {"config": {"max_running_requests": limit}, "repeats": 1, "failed": 0, "values": cells, **extra}


def test_a_choice_made_on_throughput_alone_is_called_out_only_when_the_fastest_fails_the_slo():
    rows = [
        row(32, 1300, 900, 20),
        row(64, 2000, 1500, 30),
        row(128, 2200, 2800, 60),
        row(256, 2250, 5000, 90),
    ]
    findings = choose(rows, SLO)["findings"]
    said = [f for f in findings if "throughput alone" in f]
    assert said == ["a choice made on throughput alone would take max_running_requests=256 (the highest, 2250 "
                    "tok/s), which fails the SLO (TTFT P95 5000 ms > 3000 ms): the SLO-first choice is "
                    "max_running_requests=128 (2200 tok/s, 2% less throughput)"]  # fmt: skip
    # The fastest meets the SLO: nothing to say.
    passing = [row(32, 1300, 900, 20), row(64, 2000, 1500, 30), row(128, 2200, 2800, 60)]
    assert not any("throughput alone" in f for f in choose(passing, SLO)["findings"])
    # Nothing meets it: the finding says so instead of naming a choice.
    failing = [row(32, 1600, 118000, 18), row(512, 3200, 28000, 151)]
    said = [f for f in choose(failing, SLO)["findings"] if "throughput alone" in f]
    assert said and said[0].endswith("no configuration meets the SLO at this load")


def _summary(rate, over, ttft=40000.0, tpot=50.0, thr=2000.0, criteria=None):
    """A summary with an overload verdict (``criteria``: the ones that fired; default all when ``over``)."""
    s = compute_summary(None, None).dump()
    s.update(request_rate=rate, output_throughput=thr, p95_ttft_ms=ttft, p95_tpot_ms=tpot)
    fired = set(
        criteria
        if criteria is not None
        else ("offered_above_capacity", "ttft_growing", "in_flight_growing")
        if over
        else ()
    )
    s["overload"] = {"over_capacity": over, "offered_prompt_tokens_per_s": 32768.0,
                     "served_prompt_tokens_per_s": 13000.0 if over else 32000.0, "ttft_slope": 1.9 if over else 0.0,
                     "in_flight_growth_per_s": 20.0 if over else 0.1,
                     **{c: c in fired for c in ("offered_above_capacity", "ttft_growing", "in_flight_growing")}}  # fmt: skip
    return s


def test_open_loop_rows_state_over_capacity_with_the_evidence_and_only_when_the_runs_say_so():
    spec = load_sweep(REPO / "profiles" / "seed-batch-sweep-open.yaml")
    rows = [summary_row({"max_running_requests": m}, [_summary(32, True, tpot=t)])
            for m, t in ((32, 18), (64, 26), (128, 43))]  # fmt: skip
    assert [r["over_capacity"] for r in rows] == [1, 1, 1] and rows[0]["rate"] == 32
    result = {"rows": rows, **choose(rows, SLO)}
    said = [f for f in result["findings"] if f.startswith("over capacity")]
    assert said and said[0].startswith(
        "over capacity in every configuration (max_running_requests=32, max_running_requests=64, "
        "max_running_requests=128) at 32 req/s (3 of 3 runs)"
    )
    assert "no configuration can meet a TTFT SLO at this rate" in said[0]
    assert any("TPOT P95 grows (18.0 -> 43.0 ms)" in f for f in result["findings"])
    md = render_md(spec, result, complete=True)
    assert "| **yes** (1/1) |" in md
    assert (
        "- max_running_requests=32 at 32 req/s: 1 of 1 runs (offered above capacity 1, ttft growing 1, in flight "
        "growing 1); offered 32768 prompt tok/s against 13000" in md
    )
    # A row over capacity fails the SLO whatever its percentiles (they describe the run's length).
    assert "over capacity (arrivals outran the server" in result["rejected"][0]["reasons"][-1]
    # Runs that kept up: no finding, "no" in the column; summaries without a verdict: no column at all.
    kept_up = [summary_row({"max_running_requests": 32}, [_summary(4, False, ttft=90)])]
    result = {"rows": kept_up, **choose(kept_up, SLO)}
    assert not any(f.startswith("over capacity") for f in result["findings"]) and result["choice"]
    assert "| no (0/1) |" in render_md(spec, result, complete=True)
    # In-flight growth alone (it fires on Poisson noise near capacity): said in the row, but the run's TTFT
    # is not growing and the SLO is judged on its figures.
    noisy = [
        summary_row(
            {"max_running_requests": 256}, [_summary(11.6, True, ttft=179, criteria=["in_flight_growing"])]
        )
    ]
    result = {"rows": noisy, **choose(noisy, SLO)}
    assert result["choice"] == "max_running_requests=256" and noisy[0]["over_capacity"] == 1
    md = render_md(spec, result, complete=True)
    assert "1 of 1 runs (in flight growing 1)" in md and "| in flight growing (1/1) |" in md
    assert not any(f.startswith("over capacity") for f in result["findings"])
    bare = [summary_row({"max_running_requests": 32}, [compute_summary(None, None).dump()])]
    assert bare[0]["over_capacity"] is None
    assert "over capacity" not in render_md(spec, {"rows": bare, **choose(bare, SLO)}, complete=True)


def test_the_latency_aware_knee_and_the_pareto_front():
    # Throughput +50%, then +10% per doubling; TPOT +20%, then +60%: latency costs more from 64 on.
    rows = [
        row(32, 1000, 900, 20),
        row(64, 1500, 950, 24),
        row(128, 1650, 960, 38.4),
        row(256, 1700, 990, 60),
    ]
    assert latency_knee_index(rows) == 1
    # Per doubling: a refined point half a doubling away does not move it.
    refined = rows[:2] + [row(91, 1500 * math.sqrt(1.1), 955, 24 * math.sqrt(1.6))] + rows[2:]
    assert refined[latency_knee_index(refined)]["config"]["max_running_requests"] == 64
    # Every step pays: the last row.
    assert latency_knee_index([row(32, 1000, 900, 20), row(64, 1900, 910, 21)]) == 1
    # Pareto: 128 is beaten by 256 on both TTFT and throughput; 32 has the least TPOT.
    pareto = [row(32, 1000, 900, 20), row(128, 2000, 3000, 60), row(256, 2100, 2500, 90)]
    assert pareto_front(pareto, "TTFT P95 ms") == [0, 2]
    assert pareto_front(pareto, "TPOT P95 ms") == [0, 1, 2]
    result = choose(pareto, SLO)
    assert result["pareto"]["TTFT P95 ms"] == ["max_running_requests=32", "max_running_requests=256"]


@needs_chromium
def test_sweep_html_draws_the_pareto_view_the_latency_aware_knee_and_capacity(tmp_path):
    from loadlab.experiment.render import CAPACITY_COLOUR, LATENCY_KNEE_COLOUR, PARETO_COLOUR, render_html

    def rgb(colour: str) -> tuple[int, int, int]:
        return tuple(int(colour[i : i + 2], 16) for i in (1, 3, 5))

    spec = load_sweep(REPO / "profiles" / "seed-batch-sweep-open.yaml", capacity=True)
    found = {32: (5.9, 6.2), 64: (8.7, 9.1), 128: (10.8, 11.3), 256: (12.3, 12.8)}
    rows = []
    for (limit, thr, ttft, tpot), (lo, hi) in zip(
        ((32, 1500, 2000, 20), (64, 2180, 2250, 29), (128, 2640, 1640, 46), (256, 2890, 2390, 84)),
        found.values(),
        strict=True,
    ):
        r = row(limit, thr, ttft, tpot)
        r["capacity"] = {"capacity": lo, "lo": lo, "hi": hi, "status": "found", "done": True, "values_tried": 8,
                         "confidence": f"passes 3/3 at {lo} req/s, fails 3/3 at {hi} req/s", "why_none": None}  # fmt: skip
        rows.append(r)
    result = {"rows": rows, **choose(rows, SLO, spec.capacity)}
    assert (
        result["choice"] == "max_running_requests=256" and result["latency_knee"] == "max_running_requests=64"
    )
    page = tmp_path / "sweep.html"
    page.write_text(render_html(spec, result))
    shot = render_or_skip(page, tmp_path / "sweep.png")
    knee = np.nonzero(colour_pixels(shot, rgb(LATENCY_KNEE_COLOUR), tolerance=0.08).any(axis=1))[0]
    pareto = np.nonzero(colour_pixels(shot, rgb(PARETO_COLOUR), tolerance=0.08).any(axis=1))[0]
    capacity = colour_pixels(shot, rgb(CAPACITY_COLOUR), tolerance=0.08)
    assert knee.size > 100  # the latency-aware knee, drawn down each of the three curves' panels
    # The Pareto front (joined, marked) and the capacity line: in the second image, below the curves.
    assert pareto.size > 50 and pareto.min() > knee.max()
    assert capacity.sum() > 300 and np.nonzero(capacity.any(axis=1))[0].min() > knee.max()
    red = np.nonzero(colour_pixels(shot, (255, 0, 0), tolerance=0.1).any(axis=1))[0]
    assert (red > knee.max()).sum() > 100  # the SLO lines of the Pareto panels (vertical)


def test_with_slo_classes_a_run_passes_only_when_every_class_does():
    from loadlab.experiment.aggregate import run_reasons

    def klass(name, ttft, threshold):
        objective = {"key": "ttft_p95_ms", "metric": "ttft_ms", "percentile": 95, "threshold_ms": threshold,
                     "value_ms": ttft, "samples": 100, "passed": ttft <= threshold}  # fmt: skip
        return {"name": name, "output_throughput": 100.0, "p95_ttft_ms": ttft, "failed": 0,
                "slo": {"objectives": [objective], "pass": ttft <= threshold}}  # fmt: skip

    summary = compute_summary(None, None).dump()
    summary.update(
        p95_ttft_ms=900, p95_tpot_ms=20, classes=[klass("online", 400, 1500), klass("offline", 900, 30000)]
    )
    config = {"max_running_requests": 64}
    assert run_reasons(config, summary, SLO) == []
    summary["classes"][0] = klass("online", 1900, 1500)  # the run as a whole still meets the sweep's SLO
    assert run_reasons(config, summary, SLO) == ["class online: TTFT P95 1900 ms > 1500 ms"]
