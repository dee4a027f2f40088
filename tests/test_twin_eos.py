"""Outputs that end early: without ignore_eos the twin stops each request at a length drawn from its
--eos-len-dist (a function of the prompt), and SGLang's admission sees the requests leave early."""

from __future__ import annotations

import http.client
import json
import math
import subprocess
from pathlib import Path

import numpy as np
import orjson
import pytest
import yaml
from conftest import LOADLAB, REPO

from loadlab.profile import ProfileError, load_profile, validate_profile
from loadlab.records import load_records
from loadlab.sim.clock import output_ids_for, run_requests
from loadlab.sim.cost import CostModel
from loadlab.sim.eos import parse_eos_dist
from loadlab.sim.scheduler import Request, Scheduler, SchedulerConfig
from loadlab.sim.settings import check_embedded_settings
from loadlab.sim.tokenize import END_OF_TURN
from loadlab.testing.servers import start_twin
from loadlab.virtual import simulate

N = 600


def prompts(n: int, length: int = 24) -> list[list[int]]:
    return [[1000 + (i * 7 + k * 13) % 128000 for k in range(length - 1)] + [5000 + i] for i in range(n)]


def lengths(dist: str, max_new: int, n: int = N) -> tuple[np.ndarray, list[dict]]:
    """The output lengths and finish reasons of n requests with distinct prompts, through the scheduler (on
    a virtual clock)."""
    sched = Scheduler(SchedulerConfig(eos_len_dist=dist), CostModel("h100-80gb"))
    reqs = [Request(f"r{i}", p, max_new, output_ids=output_ids_for(p, max_new), ignore_eos=False)
            for i, p in enumerate(prompts(n))]  # fmt: skip
    run_requests(sched, [(0.0, r) for r in reqs])
    return np.array([r.gen for r in reqs]), [r.finish_reason for r in reqs]


def within(sample: np.ndarray, mean: float, var: float) -> bool:
    """The sample mean within 4 standard errors of the distribution's mean."""
    return abs(sample.mean() - mean) <= 4 * math.sqrt(var / sample.size)


def test_uniform_lengths_follow_the_distribution():
    out, reasons = lengths("uniform:16-80", 200)
    lo, hi = 16, 80
    assert within(out, (lo + hi) / 2, ((hi - lo + 1) ** 2 - 1) / 12)
    assert out.min() == lo and out.max() == hi  # 600 draws over 65 values reach both ends
    assert all(r == {"type": "stop", "matched": END_OF_TURN} for r in reasons)


def test_exponential_lengths_follow_the_distribution_capped_at_max_new_tokens():
    mean, cap = 40.0, 120
    out, reasons = lengths(f"exponential:{mean}", cap)
    p = 1 / mean
    # min(L, cap) for L geometric on 1, 2, ...: mean (1 - (1 - p)^cap) / p; its variance is below L's.
    assert within(out, (1 - (1 - p) ** cap) / p, (1 - p) / p**2)
    assert out.min() == 1 and out.max() == cap
    capped = int((out == cap).sum())
    assert abs(capped - N * (1 - p) ** (cap - 1)) < 4 * math.sqrt(N * (1 - p) ** (cap - 1))  # P(L >= cap)
    assert sum(r["type"] == "length" for r in reasons) == capped


def test_fixed_lengths_and_ignore_eos():
    out, reasons = lengths("fixed:30", 64)
    assert set(out) == {30} and {r["type"] for r in reasons} == {"stop"}
    out, reasons = lengths("fixed:30", 20)
    assert set(out) == {20} and {r["type"] for r in reasons} == {"length"}  # max_new_tokens comes first
    # ignore_eos (what loadlab sends by default): the model never stops early, as in SGLang.
    sched = Scheduler(SchedulerConfig(eos_len_dist="fixed:3"), CostModel("h100-80gb"))
    r = Request("r", prompts(1)[0], 10, ignore_eos=True)
    run_requests(sched, [(0.0, r)])
    assert r.gen == 10 and r.finish_reason["type"] == "length"


@pytest.mark.parametrize(
    ("text", "problem"),
    [("normal:3", "KIND one of fixed, uniform, exponential"), ("uniform:9-3", "1 <= LOW <= HIGH"),
     ("exponential:0.5", "MEAN, a number of tokens >= 1"), ("fixed:x", "N, a whole number")],
)  # fmt: skip
def test_a_bad_distribution_is_one_line_naming_the_setting(tmp_path, text, problem):
    with pytest.raises(ValueError, match=problem):
        parse_eos_dist(text)
    assert problem in check_embedded_settings({"eos_len_dist": text})
    path = tmp_path / "p.yaml"
    path.write_text(f"target:\n  embedded:\n    eos_len_dist: {text}\nworkload: {{kind: rag}}\n")
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert str(info.value).startswith(f"{path}:3: target.embedded.eos_len_dist: ") and "\n" not in str(
        info.value
    )


def test_the_scheduler_admits_more_requests_when_outputs_end_early():
    # 200 requests of 256 + up to 1024 tokens at once on a 60k-token pool: admission reserves for
    # max_new_tokens either way (SGLang cannot know where EOS comes), so the first pass admits as many; but
    # requests that stop early free their KV and their reservation, and the queue drains much sooner.
    def run(ignore_eos: bool):
        sched = Scheduler(SchedulerConfig(max_total_tokens=60_000, eos_len_dist="exponential:128"),
                          CostModel("h100-80gb"))  # fmt: skip
        reqs = [Request(f"r{i}", p, 1024, output_ids=output_ids_for(p, 1024), ignore_eos=ignore_eos)
                for i, p in enumerate(prompts(200, 256))]  # fmt: skip
        admitted: list[int] = []
        run_requests(sched, [(0.0, r) for r in reqs], observe=lambda it, s: admitted.append(len(it.parts)))
        entry = np.array([r.forward_entry_time for r in reqs])
        return (
            admitted[0],
            int((entry <= 1.0).sum()),
            float(entry.mean()),
            sched.stats()["num_retractions_total"],
        )

    full, early = run(True), run(False)
    assert early == run(False)  # virtual time: exactly the same every time
    print(f"ignore_eos: {full}; EOS exponential:128: {early} (first pass, admitted by 1 s, mean admission s, "
          "retractions)")  # fmt: skip
    assert full[0] == early[0]  # the same first admission: the reservation does not know the EOS
    assert early[1] > 1.5 * full[1]  # admitted within the first second
    assert early[2] < full[2] / 4  # mean time to admission
    assert early[3] == 0 < full[3]  # full-length outputs outgrow the decayed reservation and get retracted


# ---------------------------------------------------------------- runs against the twin

EOS_PROFILE = """\
name: eos
seed: 3
target: {{url: embedded, api: {api}, embedded: {{gpu: h100-80gb, eos_len_dist: "uniform:4-40"}}}}
load: {{concurrency: 8}}
requests: {{warmup: 0, measured: {n}}}
workload: {{kind: random_prefix, input_len: 32, output_len: 32, ignore_eos: false}}
"""


def test_virtual_time_without_ignore_eos_follows_the_distribution():
    p = validate_profile(yaml.safe_load(EOS_PROFILE.format(api="generate", n=N)))
    records = simulate(p, p.target.embedded).records
    out = np.array([r.output_tokens for r in records])
    # uniform:4-40 capped at 32: P(L >= 32) = 9/37 of the requests run to max_new_tokens.
    assert out.min() == 4 and out.max() == 32
    capped = np.minimum(np.arange(4, 41), 32)
    assert within(out, capped.mean(), capped.var())
    stops = sum(r.finish_reason == "stop" for r in records)
    assert stops == int((out < 32).sum()) and abs(stops / N - 28 / 37) < 0.06


def test_a_run_against_the_twin_stops_where_virtual_time_does(tmp_path):
    path = tmp_path / "eos.yaml"
    path.write_text(EOS_PROFILE.format(api="generate", n=80))
    done = subprocess.run([*LOADLAB, "run", str(path), "--out", str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = Path(done.stdout.strip().splitlines()[-1])
    df = load_records(run_dir).sort_values("index")
    out = df.output_tokens.to_numpy()
    assert out.min() >= 4 and out.max() <= 32 and (out < 32).sum() > 40
    # The twin draws each length from the prompt: the HTTP run's are the virtual run's, request by request.
    virtual = {r.index: r for r in simulate(load_profile(path), {"gpu": "h100-80gb",
                                                                  "eos_len_dist": "uniform:4-40"}).records}  # fmt: skip
    assert list(out) == [virtual[i].output_tokens for i in df["index"]]
    assert list(df.finish_reason) == [virtual[i].finish_reason for i in df["index"]]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["short_outputs"] == int((out < 32).sum())
    assert (
        "Short outputs (fewer tokens than max_new_tokens): " + str(summary["short_outputs"])
        in (run_dir / "summary.md").read_text()
    )


def test_the_openai_apis_say_stop_and_name_the_eos_token():
    twin = start_twin("--eos-len-dist", "fixed:5", "--log-level", "warning")
    try:
        for path, body in [
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a b c"}], "max_tokens": 50}),
            ("/v1/completions", {"prompt": "a b c", "max_tokens": 50}),
        ]:
            for ignore in (False, True):
                conn = http.client.HTTPConnection("127.0.0.1", twin.port, timeout=30)
                conn.request("POST", path, body=orjson.dumps({**body, "ignore_eos": ignore}),
                             headers={"Content-Type": "application/json"})  # fmt: skip
                reply = orjson.loads(conn.getresponse().read())
                conn.close()
                choice = reply["choices"][0]
                if ignore:
                    assert reply["usage"]["completion_tokens"] == 50 and choice["finish_reason"] == "length"
                else:
                    assert reply["usage"]["completion_tokens"] == 5 and choice["finish_reason"] == "stop"
                    assert choice["matched_stop"] == END_OF_TURN
    finally:
        twin.stop()
