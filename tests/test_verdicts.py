"""Goodput, the overload verdict, the pitfalls as findings and the expected prefix-cache hits, against records
with known truth (built here) and the twin in virtual time. Each finding has a run that triggers it and one
that must not."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from test_analysis import decoding, make_manifest, rec, summarize

from loadlab.analysis import Summary
from loadlab.analysis.summary import Finding
from loadlab.experiment.aggregate import aggregate
from loadlab.experiment.spec import load_sweep
from loadlab.profile import load_profile, parse_set_option, validate_profile
from loadlab.records import RequestRecord
from loadlab.sim.cost import cost_model
from loadlab.virtual import run_virtual
from loadlab.workload import NUM_WORDS, build_workload

REPO = Path(__file__).resolve().parents[1]


def kinds(s: Summary) -> list[str]:
    return [f.kind for f in s.findings]


def finding(s: Summary, kind: str) -> Finding:
    return next(f for f in s.findings if f.kind == kind)


# ---------------------------------------------------------------------------------------------------
# Goodput

# Seven measured requests (sent 1 s apart) and a warm-up one, each with a known TTFT, TPOT and E2E. Events are
# one token each, ``step`` ms apart from the first at the TTFT, so TPOT = step and E2E = TTFT + (n - 1) * step.
GOODPUT_RECORDS = [
    rec(0, t=0, ttft=100.0, e2e=140.0, events=decoding(5, 100.0, 10.0)),  # TPOT 10: good
    rec(1, t=1, ttft=250.0, e2e=290.0, events=decoding(5, 250.0, 10.0)),  # TTFT 250 > 200
    rec(2, t=2, ttft=100.0, e2e=220.0, events=decoding(5, 100.0, 30.0)),  # TPOT 30 > 20
    rec(3, t=3, ttft=100.0, e2e=100.0, events=decoding(1, 100.0, 0.0)),  # one token: no TPOT, good
    rec(4, t=4, outcome="http_error", ttft=None, e2e=5.0, events=[]),  # failed: never good
    rec(5, t=5, ttft=150.0, e2e=210.0, events=decoding(5, 150.0, 15.0)),  # good (TTFT 150, TPOT 15)
    rec(6, t=6, ttft=100.0, e2e=860.0, events=decoding(41, 100.0, 19.0)),  # E2E 860 > 500
    rec(7, phase="warmup", t=-2, ttft=100.0, e2e=140.0, events=decoding(5, 100.0, 10.0)),  # excluded
]
GOODPUT_DURATION = 6.860  # the first measured send (t=0) to the last end (t=6 + 860 ms)


def test_goodput_against_hand_computed_values(tmp_path):
    slo = {"ttft_p95_ms": 200, "tpot_p95_ms": 20, "e2e_p95_ms": 500, "itl_p95_ms": 1}
    s = summarize(tmp_path, GOODPUT_RECORDS, make_manifest({"slo": slo}))
    assert s.duration == pytest.approx(GOODPUT_DURATION)
    # The ITL objective sets no per-request limit; the other three do, at their thresholds.
    assert s.goodput_limits == {"ttft_ms": 200.0, "tpot_ms": 20.0, "e2e_latency_ms": 500.0}
    # Good: requests 0, 3 and 5 of the seven measured; output tokens 5 + 1 + 5.
    assert s.good_requests == 3 and s.measured_requests == 7
    assert s.goodput_ratio == pytest.approx(3 / 7)
    assert s.request_goodput == pytest.approx(3 / GOODPUT_DURATION)
    assert s.output_goodput == pytest.approx(11 / GOODPUT_DURATION)
    assert Summary.read(tmp_path) == s
    md = (tmp_path / "summary.md").read_text()
    assert "## Goodput" in md and "TTFT <= 200 ms, TPOT <= 20 ms, E2E <= 500 ms" in md
    assert "3 of 7 measured (42.9%)" in md and f"{3 / GOODPUT_DURATION:.2f} req/s" in md

    # Two objectives on one metric: both limits hold, so the lower binds (request 5's TTFT 150 > 120).
    (tmp_path / "b").mkdir()
    s = summarize(tmp_path / "b", GOODPUT_RECORDS, make_manifest({"slo": {**slo, "ttft_p50_ms": 120}}))
    assert s.goodput_limits["ttft_ms"] == 120.0 and s.good_requests == 2
    assert s.output_goodput == pytest.approx(6 / GOODPUT_DURATION)

    # Without a per-request objective (none, or ITL only) goodput is null, and summary.md says why.
    for name, no_limits in (("c", {}), ("d", {"itl_p95_ms": 50})):
        (tmp_path / name).mkdir()
        s = summarize(tmp_path / name, GOODPUT_RECORDS, make_manifest({"slo": no_limits}))
        assert (s.goodput_limits, s.good_requests, s.goodput_ratio, s.request_goodput, s.output_goodput) == (
            None, None, None, None, None)  # fmt: skip
        assert "No per-request limits" in (tmp_path / name / "summary.md").read_text()


def _class_rec(index, cls, t, ttft, outcome="ok"):
    r = rec(index, t=t, ttft=ttft, e2e=ttft + 8.0, events=decoding(5, ttft, 2.0), outcome=outcome)
    if outcome != "ok":
        r.ttft_ms, r.arrival_ms, r.arrival_tokens, r.output_tokens = None, [], [], None
    r.request_class = cls
    return r


def test_goodput_per_class_uses_the_class_slo(tmp_path):
    # gold: TTFT 10..50 ms against its own 35 ms (3 good); bronze: TTFT 100, 300 and a failure against the
    # profile's 250 ms (1 good). Five tokens each. Sends at 0..7 s; the last ends at 7 s + 308 ms.
    gold = [_class_rec(i, "gold", t=i, ttft=10.0 * (i + 1)) for i in range(5)]
    bronze = [_class_rec(5, "bronze", 5, 100.0), _class_rec(6, "bronze", 7, 300.0),
              _class_rec(7, "bronze", 6, 0.0, outcome="http_error")]  # fmt: skip
    profile = {"slo": {"ttft_p95_ms": 250}, "classes": [
        {"name": "gold", "share": 0.6, "slo": {"ttft_p95_ms": 35}}, {"name": "bronze", "share": 0.4, "slo": None}]}  # fmt: skip
    s = summarize(tmp_path, gold + bronze, make_manifest(profile))
    duration = 7.308
    assert s.duration == pytest.approx(duration)
    g, b = s.classes
    assert g.goodput_limits == {"ttft_ms": 35.0} and b.goodput_limits == {"ttft_ms": 250.0}
    assert (g.good_requests, g.goodput_ratio) == (3, pytest.approx(3 / 5))
    assert (b.good_requests, b.goodput_ratio) == (1, pytest.approx(1 / 3))
    assert g.request_goodput == pytest.approx(3 / duration) and g.output_goodput == pytest.approx(
        15 / duration
    )
    assert b.output_goodput == pytest.approx(5 / duration)
    # The run as a whole judges each request by its own class's limits: gold's 3 and bronze's 1, of eight
    # measured (by the profile's 250 ms alone it would be 6: the gold requests between 35 and 50 ms too).
    assert (s.good_requests, s.goodput_ratio) == (4, pytest.approx(4 / 8))
    assert s.request_goodput == pytest.approx(4 / duration) and s.output_goodput == pytest.approx(
        20 / duration
    )
    assert Summary.read(tmp_path) == s
    md = (tmp_path / "summary.md").read_text()
    assert "- Class gold (TTFT <= 35 ms): 3 of 5 good (60.0%)" in md
    assert "- Class bronze (TTFT <= 250 ms): 1 of 3 good (33.3%)" in md


# ---------------------------------------------------------------------------------------------------
# The overload verdict, on a hand-made FIFO server: each request holds it for 1 s until its first token.


def fifo_records(n: int, gap_s: float, service_s: float = 1.0, prompt: int = 1000) -> list[RequestRecord]:
    """An open loop: request i due (and sent) at i * gap_s; a FIFO server gives it its first token
    ``service_s`` after the previous one's, or after its send when idle; the stream ends 10 ms later."""
    records, free = [], 0.0
    for i in range(n):
        due = i * gap_s
        first = max(due, free) + service_s
        free = first
        ttft = (first - due) * 1000.0
        r = rec(i, t=due, ttft=ttft, e2e=ttft + 10.0, events=[(ttft, 1), (ttft + 10.0, 1)], prompt=prompt)
        r.t_scheduled_wall = r.t_send_wall
        records.append(r)
    return records


def open_manifest(rate: float, **profile):
    return make_manifest(
        profile,
        load={
            "model": "open",
            "rate": rate,
            "arrival": "constant",
            "description": f"open loop, {rate} req/s",
        },
    )


def test_overload_verdict_on_a_server_four_times_too_slow(tmp_path):
    # Arrivals 4/s, service 1/s: the queue grows by 3 requests a second. Offered 4 x 1000 prompt tok/s; the
    # server is never idle from the first send to the last first token (41 s), taking in 41 x 1000 tokens.
    # Request i waits 1 + 0.75 i s for its first token, due at 0.25 i s: TTFT grows 3 ms per ms of arrivals
    # (offered / served - 1), on an exact line.
    n = 41
    s = summarize(tmp_path, fifo_records(n, 0.25), open_manifest(4.0), html=True)
    o = s.overload
    assert o.over_capacity and o.offered_above_capacity and o.ttft_growing and o.in_flight_growing
    assert o.arrival_rate == pytest.approx(4.0) and o.arrival_span_s == pytest.approx(10.0)
    assert o.offered_prompt_tokens_per_s == pytest.approx(4000.0)
    assert o.backlog_s == pytest.approx(41.0) and o.served_prompt_tokens_per_s == pytest.approx(1000.0)
    assert o.ttft_slope == pytest.approx(3.0) and o.ttft_slope_t is None  # exact fit
    assert o.ttft_slope_samples == 21  # due at 5 s or later: i = 20..40
    # In flight grows by arrivals - completions = 3/s; each quarter's mean is off by under one request.
    quarter = o.arrival_span_s / 4
    assert abs(o.in_flight_growth_per_s - 3.0) <= 2 / quarter
    assert kinds(s)[0] == "over_capacity"
    text = finding(s, "over_capacity").message
    for words in ("Over capacity", "TTFT grows with run length", "this run's length", "not a steady state",
                  "no server limit can meet a TTFT SLO at this rate", "offered 4000 prompt tok/s",
                  "against the 1000 prompt tok/s"):  # fmt: skip
        assert words in text, words
    md = (tmp_path / "summary.md").read_text()
    assert md.index("> **Over capacity**") < md.index("## Latency") and ": **over capacity**" in md
    page = (tmp_path / "report.html").read_text()
    assert page.index("<p class='finding' data-kind='over_capacity'><b>Over capacity</b>") < page.index(
        "<h2>"
    )
    assert Summary.read(tmp_path) == s


def test_no_overload_when_the_server_keeps_up(tmp_path):
    # Arrivals every 2 s, 1 s each: never a queue. Offered 500 prompt tok/s; the backlog is each request's own
    # second, so served reads the server's speed, 1000 tok/s; TTFT is flat at 1 s.
    s = summarize(tmp_path, fifo_records(41, 2.0), open_manifest(0.5))
    o = s.overload
    assert not (o.over_capacity or o.offered_above_capacity or o.ttft_growing or o.in_flight_growing)
    assert o.offered_prompt_tokens_per_s == pytest.approx(500.0)
    assert o.served_prompt_tokens_per_s == pytest.approx(1000.0) and o.backlog_s == pytest.approx(41.0)
    assert o.ttft_slope == pytest.approx(0.0, abs=1e-9) and abs(o.in_flight_growth_per_s) < 0.05 * 0.5
    assert "over_capacity" not in kinds(s)
    md = (tmp_path / "summary.md").read_text()
    assert "Over capacity" not in md and ": within capacity" in md
    # A closed loop has no verdict; nor has an open loop with too few arrivals to say.
    (tmp_path / "b").mkdir()
    closed = [
        rec(i, t=i * 2.0, ttft=1000.0, e2e=1010.0, events=[(1000.0, 1), (1010.0, 1)]) for i in range(41)
    ]
    assert summarize(tmp_path / "b", closed).overload is None
    (tmp_path / "c").mkdir()
    assert summarize(tmp_path / "c", fifo_records(19, 0.25), open_manifest(4.0)).overload is None


# The seed's open-loop sweep (profiles/seed-batch-sweep-open.yaml): its workload at 32 req/s on an A100 twin,
# in virtual time, at every limit it sweeps; few measured requests, which still show it.
SWEEP_FILE = REPO / "profiles" / "seed-batch-sweep-open.yaml"


def _seed_open_run(out: Path, rate: float, limit: int) -> Summary:
    sweep = yaml.safe_load(SWEEP_FILE.read_text())
    overrides = dict(parse_set_option(item) for item in sweep["set"])
    overrides |= {"load.rate": rate, "requests.measured": 120, "requests.warmup": 20}
    profile = load_profile(REPO / "profiles" / sweep["profile"], overrides)
    settings = {"gpu": "a100-80gb", "model": "llama-3.1-8b", "max_running_requests": limit}
    return Summary.read(run_virtual(profile, settings, out, f"r{rate:g}-l{limit}"))


def _prefill_bound(s: Summary) -> float:
    """The most prompt tokens/s the A100 twin can take in: its linear layers' peak speed over new tokens (any
    pass; attention and the pass overhead only add time), with the run's cached share of the prompt free."""
    cost = cost_model("a100-80gb", "llama-3.1-8b")
    peak = max(n / cost.linear_s(n) for n in (2**k for k in range(6, 16)))
    return peak / (1 - s.cached_token_ratio)


def test_the_seeds_open_sweep_at_32_per_s_is_over_capacity_at_every_limit(tmp_path):
    sweep = yaml.safe_load(SWEEP_FILE.read_text())
    assert sweep["set"].count("load.rate=32") == 1  # the rate this test stands for
    limits = sweep["axes"]["max_running_requests"]
    for limit in limits:
        s = _seed_open_run(tmp_path, 32, limit)
        o = s.overload
        # Offered: the realised rate x 1024 tokens, above all the twin's prefill can take in; what it took in
        # is within that bound.
        assert o.mean_prompt_tokens == 1024 and o.offered_prompt_tokens_per_s == pytest.approx(
            o.arrival_rate * 1024
        )
        assert 32 * 0.75 < o.arrival_rate < 32 * 1.25
        bound = _prefill_bound(s)
        assert o.served_prompt_tokens_per_s <= bound < o.offered_prompt_tokens_per_s, limit
        assert o.over_capacity and o.offered_above_capacity and o.in_flight_growing, limit
        assert "over_capacity" in kinds(s)
        md = (tmp_path / f"r32-l{limit}" / "summary.md").read_text()
        assert "> **Over capacity**" in md and "no server limit can meet a TTFT SLO at this rate" in md
    # The sweep's rows count those runs, and its findings say it for every limit.
    spec = load_sweep(SWEEP_FILE)
    runs = {f"{k}/0": str(tmp_path / f"r32-l{limit}") for k, limit in enumerate(limits)}
    result = aggregate(spec, [{"max_running_requests": v} for v in limits], runs)
    assert [row["over_capacity"] for row in result["rows"]] == [1] * len(limits)
    said = next(f for f in result["findings"] if f.startswith("over capacity in"))
    assert all(f"max_running_requests={v}" in said for v in limits) and "no configuration can meet" in said


def test_the_seeds_open_sweep_at_4_per_s_is_within_capacity(tmp_path):
    for limit in (32, 512):
        s = _seed_open_run(tmp_path, 4, limit)
        o = s.overload
        assert not o.over_capacity, limit
        assert o.offered_prompt_tokens_per_s < _prefill_bound(s) / 2
        assert abs(o.ttft_slope) < 0.05 and "over_capacity" not in kinds(s)
        assert "Over capacity" not in (tmp_path / f"r4-l{limit}" / "summary.md").read_text()


# ---------------------------------------------------------------------------------------------------
# No warm-up


def _closed(concurrency: int, **profile):
    return make_manifest({"load": {"concurrency": concurrency}, **profile})


def _waves(ttfts: list[float], users: int = 4, warmup: int = 0) -> list[RequestRecord]:
    """A closed loop of ``users``: request i is sent when request i - users ends (each 2 s long)."""
    records = [rec(1000 + k, phase="warmup", t=-3.0 - k * 0.001, ttft=50.0, e2e=60.0) for k in range(warmup)]
    for i, ttft in enumerate(ttfts):
        t = (i // users) * 2.0 + (i % users) * 0.001
        records.append(rec(i, t=t, ttft=ttft, e2e=1999.0, events=[(ttft, 1), (1999.0, 1)]))
    return records


def test_no_warmup_the_first_requests_ttft(tmp_path):
    # 60 requests, 4 users, no warm-up: the first 5 (5% of 60 is 3, at least 5) take 2 s to a first token,
    # the rest 100 ms.
    ttfts = [2000.0] * 5 + [100.0] * 55
    s = summarize(tmp_path, _waves(ttfts), _closed(4))
    f = finding(s, "no_warmup")
    assert f.evidence["first_median_ttft_ms"] == 2000.0 and f.evidence["rest_median_ttft_ms"] == 100.0
    assert f.evidence["first_requests"] == 5 and f.evidence["warmup_requests"] == 0
    assert f.message.startswith("No warm-up: the first 5 measured requests' median TTFT was 2000 ms")
    assert "> **No warm-up**" in (tmp_path / "summary.md").read_text()
    # A closed loop's first requests are sent at once: the message says that part may be the burst.
    assert "(the first 4 were also sent at once, as a closed loop starts" in f.message
    # Must not: a flat TTFT; the same data after any warm-up (it ran the first-use initialisation; a closed
    # loop's start is a burst either way); a rise under twice the rest.
    for name, records in (("flat", _waves([100.0] * 60)), ("warmed", _waves(ttfts, warmup=1)),
                          ("mild", _waves([190.0] * 5 + [100.0] * 55))):  # fmt: skip
        (tmp_path / name).mkdir()
        assert "no_warmup" not in kinds(summarize(tmp_path / name, records, _closed(4))), name


def _rag(measured: int, warmup: int, **more) -> object:
    return load_profile(REPO / "profiles" / "rag.yaml", {"requests.measured": measured, "requests.warmup": warmup,
                                                        **more})  # fmt: skip


def test_no_warmup_the_cache_hit_ratio_rising_in_virtual_time(tmp_path):
    # rag.yaml (Zipf-popular passages): without a warm-up the first tenth of the run finds an empty cache.
    cold = Summary.read(run_virtual(_rag(300, 0), {}, tmp_path, "cold"))
    f = finding(cold, "no_warmup")
    assert f.evidence["rest_cached_ratio"] - f.evidence["first_cached_ratio"] >= 0.05
    assert "cache-hit ratio rose" in f.message
    # The same requests (by count) after the seed's 200 warm-up requests: no finding.
    warm = Summary.read(run_virtual(_rag(300, 200), {}, tmp_path, "warm"))
    assert "no_warmup" not in kinds(warm) and warm.findings == []


# ---------------------------------------------------------------------------------------------------
# Load not locked


def test_load_not_locked(tmp_path):
    # Three requests overlap (sent 0.5 s apart, 2 s each) against a configured cap of 2.
    over = [rec(i, t=i * 0.5, ttft=100.0, e2e=2000.0) for i in range(3)]
    s = summarize(tmp_path, over, _closed(2))
    f = finding(s, "load_not_locked")
    assert f.evidence["in_flight_max"] == 3 and f.evidence["configured_concurrency"] == 2
    assert f.evidence["above_concurrency_s"] == pytest.approx(1.0)  # three in flight from 1 s to 2 s, of 3 s
    assert "up to 3 requests were in flight against a configured 2 (more for 33% of" in f.message
    # A closed loop of 8 that held two in flight, back to back for 20 s: mean 2 < 0.75 x 8.
    (tmp_path / "b").mkdir()
    two = [rec(i, t=(i // 2) * 2.0, ttft=100.0, e2e=2000.0) for i in range(20)]
    s = summarize(tmp_path / "b", two, _closed(8))
    f = finding(s, "load_not_locked")
    assert f.evidence["in_flight_mean"] == pytest.approx(2.0) and "held 2.0 requests in flight" in f.message
    # Must not: the same two back to back at a configured 2 (mean and max 2); nor with each send 2 ms before
    # the previous end (a wall clock slewing against the monotonic one): three in flight 0.2% of the time.
    (tmp_path / "c").mkdir()
    assert "load_not_locked" not in kinds(summarize(tmp_path / "c", two, _closed(2)))
    (tmp_path / "d").mkdir()
    slewed = [rec(i, t=(i // 2) * 1.998 + (i % 2) * 0.01, ttft=100.0, e2e=2000.0) for i in range(20)]
    s = summarize(tmp_path / "d", slewed, _closed(2))
    assert s.in_flight.max == 3 and "load_not_locked" not in kinds(s)


# ---------------------------------------------------------------------------------------------------
# KV reservation


def test_kv_reservation_in_virtual_time(tmp_path):
    # 32 rag requests of 1024 + 256 tokens in flight on a KV pool of 20 000 tokens: full, and retracting.
    s = Summary.read(run_virtual(_rag(60, 8), {"max_total_tokens": 20000}, tmp_path, "small-pool"))
    f = finding(s, "kv_reservation")
    assert f.evidence["peak_token_usage"] >= 0.9 and f.evidence["retractions"] > 0
    assert "--max-running-requests" in f.message
    # The default pool (440 000 tokens): far from full, no retraction.
    s = Summary.read(run_virtual(_rag(60, 8), {}, tmp_path, "default-pool"))
    assert "kv_reservation" not in kinds(s)


def test_kv_reservation_requests_refused_for_size(tmp_path):
    refused = rec(3, t=1.5, outcome="http_error", ttft=None, e2e=3.0, events=[])
    refused.http_status = 400
    refused.error = ("HTTP 400: The request needs 500000 KV cache tokens (499000 input tokens + 1000 "
                     "max_new_tokens), more than the server's max_total_num_tokens (440000) allows.")  # fmt: skip
    other = rec(4, t=2.0, outcome="http_error", ttft=None, e2e=3.0, events=[])
    other.http_status, other.error = 400, "HTTP 400: Either text or input_ids should be provided."
    ok = [rec(i, t=i * 2.0, ttft=100.0, e2e=1000.0) for i in range(3)]
    s = summarize(tmp_path, [*ok, refused, other], _closed(1))
    f = finding(s, "kv_reservation")
    assert f.evidence == {"peak_token_usage": None, "retractions": None, "refused_for_size": 1.0}
    (tmp_path / "b").mkdir()
    assert "kv_reservation" not in kinds(summarize(tmp_path / "b", [*ok, other], _closed(1)))


# ---------------------------------------------------------------------------------------------------
# Expected versus delivered prefix-cache hits


def _brute_force(workload, indices) -> np.ndarray:
    """The exact reusable prefix from the prompts themselves: the longest prefix of each prompt that an
    earlier prompt also starts with, at most its length - 1."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for i in indices:
        ids = workload.spec(i).input_ids
        n = 0
        while n < len(ids) and ids[: n + 1] in seen:
            n += 1
        out.append(min(n, len(ids) - 1))
        seen.update(ids[:d] for d in range(1, len(ids) + 1))
    return np.array(out)


@pytest.mark.parametrize(
    "workload, n",
    [
        ({"kind": "shared_prefix", "num_groups": 7, "system_prompt_len": 20, "question_len": 3}, 400),
        (
            {
                "kind": "shared_prefix",
                "num_groups": 7,
                "system_prompt_len": 20,
                "question_len": 1,
                "group_order": "random",
            },
            400,
        ),  # fmt: skip
        # Groups 1500 apart share their system prompt's first word; a single group's questions repeat their
        # first lead word from its 1501st request on (a one-word question: the whole prompt but its last token).
        (
            {"kind": "shared_prefix", "num_groups": NUM_WORDS + 3, "system_prompt_len": 3, "question_len": 2},
            NUM_WORDS + 100,
        ),  # fmt: skip
        (
            {"kind": "shared_prefix", "num_groups": 1, "system_prompt_len": 3, "question_len": 1},
            NUM_WORDS + 50,
        ),
        (
            {"kind": "shared_prefix", "num_groups": 1, "system_prompt_len": 3, "question_len": 3},
            NUM_WORDS + 50,
        ),
        # Beyond 1500 requests the first lead word repeats: one token shared from index 1500 on.
        ({"kind": "random_prefix", "input_len": 6}, NUM_WORDS + 300),
        ({"kind": "random_prefix", "input_len_range": [2, 3]}, NUM_WORDS + 300),
    ],
)
def test_reusable_prefix_is_exact(workload, n):
    w = build_workload(validate_profile({"seed": 5, "workload": {**workload, "output_len": 4}}))
    assert w.reusable_prefix(range(n)).tolist() == _brute_force(w, range(n)).tolist()


@pytest.mark.parametrize("ratio", [1.0, 0.4])
def test_reusable_prefix_of_bench_servings_shared_prefix_is_exact(ratio):
    """bench_serving's generated-shared-prefix in bulk (each round's shuffle, lengths drawn from their ranges
    by bulk_rng) against the prompts themselves, over several rounds."""
    w = build_workload(validate_profile({"seed": 11, "workload": {"kind": "generated-shared-prefix",
        "gsp_num_groups": 3, "gsp_prompts_per_group": 4, "gsp_system_prompt_len": 12, "gsp_question_len": 5,
        "gsp_output_len": 4, "gsp_range_ratio": ratio}}))  # fmt: skip
    assert w.reusable_prefix(range(150)).tolist() == _brute_force(w, range(150)).tolist()


def test_reusable_prefix_of_rag_misses_only_chance_coincidences():
    # Passages are random words: two different ones begin with the same word 1 time in 1500, which the
    # structural count leaves out. Never above the truth, and within 0.1% of all prompt tokens of it.
    w = build_workload(validate_profile({"seed": 5, "workload": {"kind": "rag", "input_len": 64, "output_len": 4,
        "instruction_len": 8, "question_len": 4, "passages_per_prompt": 3, "corpus_size": 50}}))  # fmt: skip
    fast, truth = w.reusable_prefix(range(600)), _brute_force(w, range(600))
    assert (fast <= truth).all() and truth.sum() - fast.sum() <= 0.001 * 600 * 64
    assert fast[0] == 0 and fast.sum() > 0.5 * 600 * 64  # the instruction and popular passages


@pytest.mark.parametrize(
    "k, corpus, zipf, seed",
    [(4, 1000, 1.1, 1), (1, 50, 0.5, -3), (5, 6, 2.0, 7), (3, 3, 1.0, 2), (2, 100_000, 1.2, 9)],
)
def test_rag_passages_drawn_in_bulk_are_each_requests_own(k, corpus, zipf, seed):
    """The RAG bound draws every request's passages at once (bulk_rng); a request whose first 2k picks hold
    fewer than k distinct passages (a tiny corpus, a steep Zipf) is drawn again alone. Either way the
    passages and the bound are those of each request's own generator, in a run's order and for scattered
    indices."""
    from loadlab.workload.generators import _SALT_RAG_REQUEST, _rng

    w = build_workload(validate_profile({"seed": seed, "workload": {"kind": "rag", "input_len": 256,
        "output_len": 4, "instruction_len": 16, "question_len": 16, "passages_per_prompt": k,
        "corpus_size": corpus, "zipf_s": zipf}}))  # fmt: skip
    for indices in (
        list(range(1500)),
        sorted(set(np.random.default_rng(1).integers(0, 2**32 - 1, 800).tolist())),
    ):
        own = [tuple(w.draw_passages(_rng(w._s, i, _SALT_RAG_REQUEST))) for i in indices]
        assert [tuple(row) for row in w.passages_of(np.array(indices)).tolist()] == own
        seen: set[tuple[int, ...]] = set()
        truth = []
        for n, pids in enumerate(own):  # the bound's definition, a request at a time
            depth = 0
            while depth < k and pids[: depth + 1] in seen:
                depth += 1
            truth.append(min(16 + depth * w.passage_len, 255) if n else 0)
            seen.update(pids[:d] for d in range(1, k + 1))
        assert w.reusable_prefix(indices).tolist() == truth


def test_rag_passages_in_chunks_equal_one_bulk_draw(monkeypatch):
    """Past a chunk's size the bulk draw goes a chunk at a time (its temporaries reused): the same passages
    and bound as one draw of every index, the chunks' edges anywhere."""
    from loadlab.workload import generators

    w = build_workload(validate_profile({"seed": 4, "workload": {"kind": "rag", "input_len": 256,
        "output_len": 4, "instruction_len": 16, "question_len": 16, "passages_per_prompt": 3,
        "corpus_size": 40, "zipf_s": 1.3}}))  # fmt: skip
    indices = np.arange(5000)
    whole, bound = w.passages_of(indices), w.reusable_prefix(indices)
    monkeypatch.setattr(generators, "_BULK_CHUNK", 333)
    assert np.array_equal(w.passages_of(indices), whole)
    assert np.array_equal(w.reusable_prefix(indices), bound) and bound[1:].min() >= 16


def test_bulk_first_draws_equal_numpys_generators():
    from loadlab.workload.bulk_rng import first_doubles

    rng = np.random.default_rng(2)
    indices = np.concatenate([np.arange(40), rng.integers(0, 2**32 - 1, 300), [2**32 - 1]])
    for prefix, suffix in (([123], [13]), ([2**64 - 5], [13]), ([0], [0]), ([7, 2**40], [1, 2, 3])):
        got = first_doubles(prefix, indices, suffix, 6)
        want = np.array([np.random.default_rng([*prefix, int(i), *suffix]).random(6) for i in indices])
        assert np.array_equal(got, want)


def test_bulk_integers_equal_numpys_generators():
    """``first_integers``: successive ``integers(low, high + 1)`` of each request's generator, rejections
    (a range just under 2^32 wide) and empty ranges included, indices above 2^32 drawn by numpy itself."""
    from loadlab.workload.bulk_rng import first_integers

    rng = np.random.default_rng(3)
    indices = np.concatenate([np.arange(300), rng.integers(0, 2**32 - 1, 300), [2**32 - 1, 2**32, 2**40]])
    for prefix, suffix, ranges in (
        ([7], [61], [(0, 9)]),
        ([2**63], [3], [(1, 1000), (5, 5), (3, 2**31)]),
        ([1], [2], [(0, 2**32 - 2), (10, 11), (0, 6)]),
        ([3], [4], [(0, 2)] * 9),
    ):
        got = first_integers(prefix, indices, suffix, ranges)
        gens = [np.random.default_rng([*prefix, int(i), *suffix]) for i in indices]
        want = np.array([[g.integers(low, high + 1) for low, high in ranges] for g in gens])
        assert np.array_equal(got, want)


def test_bulk_permutations_and_shuffled_rounds_equal_numpys():
    """``permutations`` (short ones in bulk, long ones by numpy) and ``shuffled`` (each index's place in its
    round's permutation) against numpy's generators, rejections and a two-word index included."""
    from loadlab.workload.bulk_rng import permutations
    from loadlab.workload.generators import shuffled

    indices = np.concatenate([np.arange(200), [2**32 - 1, 2**32 + 5]])
    for n in (1, 2, 3, 10, 255, 256, 300):
        want = np.array([np.random.default_rng([5, int(i), 71]).permutation(n) for i in indices])
        assert np.array_equal(permutations([5], indices, [71], n), want)
    for n in (10, 300):
        scattered = np.unique(np.random.default_rng(1).integers(0, 50 * n, 400))
        rounds, places = shuffled(scattered, n, [9], [71])
        want = [np.random.default_rng([9, int(i) // n, 71]).permutation(n)[int(i) % n] for i in scattered]
        assert np.array_equal(rounds, scattered // n) and places.tolist() == want


def test_reusable_prefix_with_classes_counts_each_workload_alone():
    base = {
        "kind": "shared_prefix",
        "num_groups": 3,
        "system_prompt_len": 10,
        "question_len": 2,
        "output_len": 2,
    }
    other = {"kind": "random_prefix", "input_len": 8, "output_len": 2}
    profile = validate_profile({"seed": 1, "workload": base, "requests": {"warmup": 0, "measured": 30},
                                "classes": [{"name": "a", "share": 0.5}, {"name": "b", "share": 0.5, "workload": other}]})  # fmt: skip
    w = build_workload(profile)
    shared = w.reusable_prefix(range(30))
    a = [i for i in range(30) if w.class_of(i) == "a"]
    # Class a's requests share system prompts among themselves only: a group's first a-request gets 0, every
    # later one 10; class b (random prefixes, under 1500 requests) shares nothing.
    groups_seen: set[int] = set()
    for i in a:
        assert shared[i] == (10 if i % 3 in groups_seen else 0)
        groups_seen.add(i % 3)
    assert all(shared[i] == 0 for i in range(30) if i not in a)


def test_reusable_prefix_costs_well_under_a_second_for_10k_requests():
    profile = _rag(10_000, 200)
    w = build_workload(profile)
    best = min(_timed(lambda: w.reusable_prefix(range(profile.total_requests))) for _ in range(3))
    print(f"reusable_prefix, rag 1024, {profile.total_requests} requests: {best:.3f} s")
    assert best < 1.0


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def test_expected_and_delivered_cache_hits_in_virtual_time(tmp_path):
    # One request at a time on a cache that never fills: the twin delivers exactly the bound, plus the chance
    # coincidences the bound leaves out (under 0.1% of the prompt tokens).
    s = Summary.read(run_virtual(_rag(60, 8, **{"load.concurrency": 1}), {}, tmp_path, "cache"))
    assert s.expected_cached_token_ratio > 0.25
    assert 0 <= s.cached_token_ratio - s.expected_cached_token_ratio <= 0.001
    assert "prefix_cache_mismatch" not in kinds(s)
    # At 32 in flight, requests that share a passage are often prefilled together, before it is cached: a few
    # points below the bound, still no finding.
    s = Summary.read(run_virtual(_rag(60, 8), {}, tmp_path, "cache-32"))
    assert -0.10 < s.cached_token_ratio - s.expected_cached_token_ratio <= 0.001
    assert "prefix_cache_mismatch" not in kinds(s)
    md = (tmp_path / "cache" / "summary.md").read_text()
    assert f"the workload allows at most {s.expected_cached_token_ratio * 100:.1f}%" in md
    # Without it: none delivered against the same bound, a finding naming the disabled cache.
    s = Summary.read(run_virtual(_rag(60, 8), {"disable_radix_cache": True}, tmp_path, "no-cache"))
    f = finding(s, "prefix_cache_mismatch")
    assert s.cached_token_ratio == 0 and f.evidence["expected_cached_token_ratio"] > 0.25
    assert (
        "--disable-radix-cache" in f.message
        and "> **Prefix cache**" in (tmp_path / "no-cache" / "summary.md").read_text()
    )


def test_expected_cache_hits_need_a_profile_that_validates(tmp_path):
    # The hand-made manifests of these tests have no workload: no bound, and no finding from it.
    records = [rec(i, t=i * 1.0, cached=60, prompt=100, input_len=100) for i in range(3)]  # back to back
    s = summarize(tmp_path, records, _closed(1))
    assert s.expected_cached_token_ratio is None and s.cached_token_ratio == 0.6 and s.findings == []
    # Only the prompts' sections need to: a cluster run's manifest names its front's URL beside the cluster
    # file, which a profile refuses, yet its workload says what the requests share. Three requests of one
    # shared_prefix group with a 60-token system prompt (and 40-token questions): 0 + 60 + 60 of 300.
    (tmp_path / "b").mkdir()
    profile = {"target": {"url": "http://127.0.0.1:9", "cluster": "c.yaml"},
               "workload": {"kind": "shared_prefix", "num_groups": 1, "system_prompt_len": 60, "question_len": 40}}  # fmt: skip
    s = summarize(tmp_path / "b", records, make_manifest(profile))
    assert s.expected_cached_token_ratio == pytest.approx(120 / 300)
    assert kinds(s) == ["prefix_cache_mismatch"]  # 60% against at most 40%
    assert "points above the bound" in finding(s, "prefix_cache_mismatch").message
