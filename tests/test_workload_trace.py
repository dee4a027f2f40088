"""The trace kind: Mooncake-style traces replayed at their own times (scaled by a speed), with prompts that
share exactly the blocks the trace's hash ids say they share, in virtual time and once in real time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from loadlab.load import Tickets, TraceArrivals, arrivals_for
from loadlab.profile import ProfileError, load_profile, validate_profile
from loadlab.records import read_jsonl_records
from loadlab.virtual import simulate
from loadlab.workload import build_workload, workload_source
from loadlab.workload.datasets import common_prefix
from loadlab.workload.trace import read_trace, repeated_shares

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "profiles" / "data" / "mooncake-sample.jsonl"
TRACE_PROFILE = REPO / "profiles" / "trace-replay.yaml"


def write_trace(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def trace_workload(path: Path, n: int | None = None, **load):
    profile = {"workload": {"kind": "trace", "path": str(path)}, "load": load or {"model": "closed"}}
    if n is not None:
        profile["requests"] = {"warmup": 0, "measured": n}
    return build_workload(validate_profile(profile))


def line(ts, n_in, n_out, ids):
    return {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}


def test_equal_hash_ids_share_their_blocks_exactly(tmp_path):
    f = write_trace(tmp_path / "t.jsonl", [
        line(0, 1200, 10, [1, 2, 3]),
        line(500, 1100, 12, [1, 2, 4]),      # shares blocks 1, 2 (1024 tokens) with the first
        line(900, 600, 3, [5, 6]),           # shares nothing
        line(1500, 1700, 3, [1, 2]),         # blocks 1, 2, then 676 tokens of its own (fewer ids than blocks)
    ])  # fmt: skip
    w = trace_workload(f)
    s = [w.spec(i) for i in range(5)]
    assert [x.input_len for x in s[:4]] == [1200, 1100, 600, 1700]
    assert [x.max_new_tokens for x in s[:4]] == [10, 12, 3, 3]
    assert common_prefix(s[0].input_ids, s[1].input_ids) == 1024
    assert (
        common_prefix(s[0].input_ids, s[3].input_ids) == 1024
        and common_prefix(s[1].input_ids, s[3].input_ids) == 1024
    )
    assert common_prefix(s[0].input_ids, s[2].input_ids) <= 1  # by chance only (1 in len(WORDS))
    assert s[4].input_ids == s[0].input_ids  # a run longer than the trace starts it again
    # A partial block is the first tokens of its id's block: block 3 of line 1 is 176 of block 3's tokens.
    assert w.reusable_prefix(range(4)).tolist() == [0, 1024, 0, 1024]
    assert w.arrival_times_s() == [0.0, 0.5, 0.9, 1.5]
    src = workload_source(w)
    assert (src.format, src.entries, src.trace_span_s) == ("mooncake", 4, 1.5)
    assert src.repeated_block_share == pytest.approx(4 / 10)  # [1, 2] in line 1, [1, 2] in line 3
    assert src.repeated_token_share == pytest.approx(2048 / 4600)


@pytest.mark.parametrize("lines", [200, 30])
def test_the_structural_bound_is_the_prompts_own(tmp_path, lines):
    # reusable_prefix reads the hash ids; compare with the longest prefix each prompt really shares. A trace
    # of 30 lines is replayed 2.5 times (a line's later replays share its blocks, not its own tail), in a
    # run's order and a subset with gaps.
    path = write_trace(tmp_path / "t.jsonl", SAMPLE.read_text().splitlines()[:lines])
    w = trace_workload(path)
    for indices in (list(range(75 if lines == 30 else 80)), [i for i in range(75) if i % 4 != 1]):
        specs = [w.spec(i) for i in indices]
        brute = [0] + [min(max(common_prefix(s.input_ids, e.input_ids) for e in specs[:i]), s.input_len - 1)
                       for i, s in enumerate(specs) if i]  # fmt: skip
        got = w.reusable_prefix(indices).tolist()
        # The structure knows no chance agreement of a token or two after a shared prefix.
        assert all(0 <= b - g <= 2 for g, b in zip(got, brute, strict=True)), list(
            zip(got, brute, strict=True)
        )
        assert sum(got) > 0.5 * sum(s.input_len for s in specs)


@pytest.mark.parametrize(("row", "message"), [
    ({"timestamp": 0, "input_length": 5, "hash_ids": []}, r"t.jsonl:2: output_length: missing: a trace line needs"),
    (line("soon", 5, 1, []), r"t.jsonl:2: timestamp: must be a number of milliseconds, got 'soon'"),
    (line(-5, 5, 1, []), r"t.jsonl:2: timestamp: -5 is before line 1's 0: .*must be time order"),
    (line(9, 0, 1, []), r"t.jsonl:2: input_length: must be a positive integer \(tokens\), got 0"),
    (line(9, 5, 1.5, []), r"t.jsonl:2: output_length: must be a positive integer"),
    (line(9, 600, 1, [1, "a"]), r"t.jsonl:2: hash_ids: must be a list of integers"),
    (line(9, 600, 1, [1, 2, 3]), r"t.jsonl:2: hash_ids: 3 blocks, but input_length 600 fills only 2 of block_size 512"),
    ("[1]", r"t.jsonl:2: \(line\): expected a JSON object, got list"),
])  # fmt: skip
def test_a_bad_trace_line_is_one_line_with_its_number(tmp_path, row, message):
    f = write_trace(tmp_path / "t.jsonl", [line(0, 10, 1, [1]), row])
    with pytest.raises(ProfileError, match=message) as e:
        read_trace(str(f), 512)
    assert "\n" not in str(e.value)


def test_trace_arrivals_in_the_profile(tmp_path):
    write_trace(tmp_path / "t.jsonl", [line(0, 10, 1, [1]), line(20, 10, 1, [1])])
    p = tmp_path / "p.yaml"

    def fails(text: str, message: str) -> None:
        p.write_text(text)
        with pytest.raises(ProfileError, match=message):
            build_workload(load_profile(p))

    trace = "workload: {kind: trace, path: t.jsonl}\n"
    fails("load: {model: open, arrival: trace}\nworkload: {kind: random_prefix}\n",
          r"p.yaml:1: load.arrival: trace arrivals need a trace workload \(kind: trace\), not random_prefix")  # fmt: skip
    fails("load: {model: open, arrival: trace, rate: 3}\n" + trace, r"p.yaml:1: load: arrival: trace sends at the "
          r"trace's own times: drop rate")  # fmt: skip
    fails("load: {model: closed, arrival: trace}\n" + trace, r"load: arrival: trace is an open-loop arrival")
    fails("load: {model: open, rate: 3, speed: 2}\n" + trace, r"load: speed applies to arrival: trace only")
    fails("load: {model: open, arrival: trace}\n" + trace, r"t.jsonl: requests: 100 requests .* at the trace's "
          r"times, but the trace has 2 lines")  # fmt: skip
    p.write_text(
        "load: {model: open, arrival: trace, speed: 4}\nrequests: {warmup: 0, measured: 2}\n" + trace
    )
    prof = load_profile(p)
    assert prof.workload.path == str(tmp_path / "t.jsonl") and prof.load.concurrency is None
    done = subprocess.run([sys.executable, "-m", "loadlab", "validate", str(p)], capture_output=True, text=True,
                          cwd=REPO, timeout=60)  # fmt: skip
    assert done.returncode == 0 and "(trace, 2 requests, 2 of 2 mooncake prompts usable)" in done.stdout


def test_due_times_are_the_traces_scaled_by_speed_each_phase_from_its_start():
    times = [0.0, 0.25, 0.5, 2.0, 2.125, 3.0]
    t = Tickets(2, 4, TraceArrivals(times, speed=2.0))
    warm = [t.take_ready(100.0), t.take_ready(100.0)]
    assert [w.due for w in warm] == [100.0, 100.125]
    assert t.take_ready(101.0) is None  # the warm-up barrier
    t.finished("warmup"), t.finished("warmup")
    measured = [t.take_ready(107.0) for _ in range(4)]
    # The measured phase starts when the barrier opens: its first request (line 2) at once, then the trace.
    assert [m.due - 107.0 for m in measured] == [0.0, 0.75, 0.8125, 1.25]
    prof = validate_profile({"workload": {"kind": "trace", "path": str(SAMPLE)}, "requests": {"measured": 3},
                             "load": {"model": "open", "arrival": "trace"}})  # fmt: skip
    assert isinstance(arrivals_for(prof, build_workload(prof)), TraceArrivals)


def test_virtual_replay_at_the_traces_times_and_the_twins_cache_hits_match_its_reuse():
    prof = load_profile(TRACE_PROFILE)
    w = build_workload(prof)
    vr = simulate(prof, prof.target.embedded)
    records = sorted(vr.records, key=lambda r: r.index)
    assert [r.index for r in records] == list(range(200)) and all(r.outcome == "ok" for r in records)
    due = np.array([r.t_scheduled_wall for r in records])
    want = np.array(w.arrival_times_s()[:200]) / prof.load.speed
    assert np.abs((due - due[0]) - want).max() < 1e-6  # the trace's times, exactly (the virtual grid)
    assert all(r.t_send_wall == r.t_scheduled_wall for r in records)  # no client in virtual time
    assert [r.input_len for r in records] == [t.input_length for t in w.lines[:200]]
    assert [r.output_tokens for r in records] == [t.output_length for t in w.lines[:200]]
    cached = sum(r.cached_tokens for r in records) / sum(r.prompt_tokens for r in records)
    blocks, tokens = repeated_shares(w.lines[:200], 512)
    print(f"trace: {blocks:.1%} of blocks repeated ({tokens:.1%} of tokens); the twin cached {cached:.1%}")
    assert abs(cached - blocks) < 0.05 and abs(cached - tokens) < 0.02


@pytest.mark.alone
def test_real_time_replay_reports_the_send_time_error(tmp_path):
    # The first 30 lines (~16 s of trace) at 4x speed against the embedded twin.
    done = subprocess.run([sys.executable, "-m", "loadlab", "run", str(TRACE_PROFILE), "--out", str(tmp_path),
                           "--num-requests", "30", "--set", "load.speed=4"], capture_output=True, text=True,
                          cwd=REPO, timeout=180, env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = Path(done.stdout.strip().splitlines()[-1])
    rows = sorted(read_jsonl_records(run_dir / "records.jsonl"), key=lambda r: r["index"])
    assert [r["index"] for r in rows] == list(range(30)) and all(r["outcome"] == "ok" for r in rows)
    due = np.array([r["t_scheduled_wall"] for r in rows])
    sent = np.array([r["t_send_wall"] for r in rows])
    times = build_workload(load_profile(TRACE_PROFILE)).arrival_times_s()[:30]
    assert np.abs((due - due[0]) - np.array(times) / 4).max() < 1e-3  # the trace's times / speed
    late = (sent - due) * 1000
    summary = json.loads((run_dir / "summary.json").read_text())
    print(f"send time - due time: median {np.median(late):.2f} ms, max {late.max():.2f} ms")
    assert np.all(late > -2) and np.median(late) < 10
    assert summary["max_client_queue_ms"] == pytest.approx(late.max(), abs=0.01)  # the report states it
    assert "Client queue (send - due)" in (run_dir / "summary.md").read_text()
    assert summary["load_model"].startswith("open loop, at the trace's own times x4 speed")
    # The cache sees the trace's reuse in real time too.
    assert abs(summary["cached_token_ratio"] - summary["expected_cached_token_ratio"]) < 0.05


def test_the_generator_script_makes_the_shipped_trace(tmp_path):
    out = tmp_path / "t.jsonl"
    done = subprocess.run([sys.executable, "bench/make_trace.py", str(out)], capture_output=True, text=True,
                          cwd=REPO, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert out.read_text() == SAMPLE.read_text()
    lines = read_trace(str(SAMPLE), 512)
    assert len(lines) == 200 and len({h for t in lines for h in t.hash_ids}) < sum(
        len(t.hash_ids) for t in lines
    )
