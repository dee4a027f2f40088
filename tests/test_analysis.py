"""The post-processor against records with known truth: every expected value is worked out by hand or
by numpy on the known samples, never by the code under test."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import typing
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from pydantic import BaseModel, ValidationError

from loadlab.analysis import Summary, SummaryError, compute_summary, metrics, write_report
from loadlab.analysis.metrics import in_flight, itl_samples, pooled_events, token_events
from loadlab.analysis.summary import LATENCY_STEMS, SUMMARY_JSON, LatencyStats, Samples
from loadlab.manifest import Manifest, write_manifest
from loadlab.records import RecordWriter, RequestRecord, write_parquet

T0 = 1_700_000_000.0
STATS = ("mean", "median", "std", "p90", "p95", "p99", "min", "max")


def rec(
    index: int,
    *,
    phase: str = "measure",
    outcome: str = "ok",
    t: float = 0.0,
    ttft: float | None = 100.0,
    e2e: float | None = 1000.0,
    events: list[tuple[float, int]] | None = None,
    output: int | None = None,
    prompt: int | None = 100,
    cached: int | None = None,
    input_len: int = 100,
    max_new: int = 0,
    exact: bool = True,
    served_by: str | None = None,
) -> RequestRecord:
    """A record sent at T0 + t seconds. ``events`` are (offset ms, tokens); by default one 1-token event
    at the TTFT. ``output`` defaults to the tokens in the events."""
    if events is None:
        events = [(ttft, 1)] if ttft is not None else []
    if output is None and outcome == "ok":
        output = sum(tok for _, tok in events)
    return RequestRecord(
        index=index,
        phase=phase,
        api="generate",
        worker_id="w0",
        user_id=index,
        t_send_wall=T0 + t,
        outcome=outcome,
        ttft_ms=ttft,
        e2e_ms=e2e,
        arrival_ms=[float(ms) for ms, _ in events],
        arrival_tokens=[int(tok) for _, tok in events],
        tokens_per_event_exact=exact,
        input_len=input_len,
        max_new_tokens=max_new,
        prompt_tokens=prompt,
        output_tokens=output,
        cached_tokens=cached,
        served_by=served_by,
        status_source="worker" if served_by is not None else None,
    )


def make_manifest(profile: dict | None = None, **fields) -> Manifest:
    """A run manifest with what these tests set; the rest as a closed-loop run would have it."""
    profile = {"name": "p", **(profile or {})}
    concurrency = (profile.get("load") or {}).get("concurrency", 1)
    base = {
        "run_id": "r1",
        "complete": True,
        "profile": profile,
        "target": {"url": "http://127.0.0.1:30000"},
        "load": {
            "model": "closed",
            "concurrency": concurrency,
            "description": f"closed loop, {concurrency} in flight",
        },
        "started_wall": 0.0,
        "counts": {"warmup_expected": 0, "measured_expected": 0},
        "versions": {"loadlab": "0", "python": "3", "platform": "test"},
        "command": ["test"],
    }
    return Manifest.model_validate({**base, **fields})


def make_run(tmp_path, records, manifest=None, parquet=False):
    writer = RecordWriter(tmp_path)
    for r in records:
        writer.write(r)
    writer.close()
    write_manifest(tmp_path, manifest if manifest is not None else make_manifest())
    if parquet:
        write_parquet(tmp_path)
    return tmp_path


def summarize(tmp_path, records, manifest=None, parquet=False, html=False):
    return write_report(make_run(tmp_path, records, manifest, parquet), html=html)


def decoding(n: int, ttft: float, step: float) -> list[tuple[float, int]]:
    """n one-token events: the first at ttft, then one every step ms."""
    return [(ttft + k * step, 1) for k in range(n)]


# ---------------------------------------------------------------------------------------------------


def test_percentiles_are_exact_numpy_and_use_bench_serving_keys(tmp_path):
    rng = np.random.default_rng(7)
    ttfts = rng.uniform(20, 400, 37).round(3)
    e2es = ttfts + rng.uniform(500, 3000, 37).round(3)
    records = [
        rec(i, t=i * 0.5, ttft=float(a), e2e=float(b), events=decoding(5, float(a), 10.0))
        for i, (a, b) in enumerate(zip(ttfts, e2es, strict=True))
    ]
    s = summarize(tmp_path, records)
    for stats, truth in ((s.ttft_ms, ttfts), (s.e2e_latency_ms, e2es)):
        assert stats.mean == pytest.approx(np.mean(truth))
        assert stats.median == pytest.approx(np.median(truth))
        assert stats.std == pytest.approx(np.std(truth))
        for p in (90, 95, 99):
            assert getattr(stats, f"p{p}") == pytest.approx(np.percentile(truth, p))
        assert stats.min == pytest.approx(truth.min())
        assert stats.max == pytest.approx(truth.max())
    # p99 of 37 samples lies strictly between the two largest: linear interpolation, not nearest rank.
    top = np.sort(ttfts)[-2:]
    assert top[0] < s.ttft_ms.p99 < top[1]
    for key in (
        "duration",
        "completed",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "input_throughput",
        "output_throughput",
        "concurrency",
    ):
        assert key in s.dump()
    for stem in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):  # bench_serving's flat keys on disk
        for stat in STATS:
            assert f"{stat}_{stem}" in s.dump()
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk == s.dump() and on_disk["version"] == 6
    assert Summary.read(tmp_path) == s


def test_tpot_bench_serving_formula_and_decode_variant(tmp_path):
    # 11 tokens: a first event of 4 tokens at 100 ms, then 7 single-token events; E2E 1100 ms.
    events = [(100.0, 4)] + [(100.0 + 125.0 * k, 1) for k in range(1, 8)]
    records = [
        rec(0, ttft=100.0, e2e=1100.0, events=events),  # output 11
        rec(1, ttft=50.0, e2e=60.0, events=[(50.0, 1)]),  # output 1: no TPOT
        rec(2, ttft=200.0, e2e=1200.0, events=decoding(5, 200.0, 250.0)),  # output 5
    ]
    s = summarize(tmp_path, records)
    tpots = [1000.0 / 10, 1000.0 / 4]
    assert s.samples.tpot_ms == 2
    assert s.tpot_ms.mean == pytest.approx(np.mean(tpots))
    assert s.tpot_ms.max == pytest.approx(250.0)
    assert s.tpot_ms.min == pytest.approx(100.0)
    # Decode variant: divide by tokens after the first event (11 - 4 = 7, 5 - 1 = 4).
    decode = [1000.0 / 7, 1000.0 / 4]
    assert s.samples.tpot_decode_ms == 2
    assert s.tpot_decode_ms.mean == pytest.approx(np.mean(decode))
    assert s.tpot_decode_ms.min == pytest.approx(1000.0 / 7)
    for stat in ("mean", "median", "p90", "p95", "p99"):
        assert f"{stat}_tpot_decode_ms" in s.dump()


def test_itl_is_per_token_with_multi_token_events():
    per_token, per_event = itl_samples([100.0, 180.0, 200.0], [1, 4, 1])
    assert per_token.tolist() == [20.0, 20.0, 20.0, 20.0, 20.0]
    assert per_event.tolist() == [80.0, 20.0]
    # Parquet gives numpy arrays; events that carry no token are not token-carrying events.
    per_token, per_event = itl_samples(np.array([10.0, 20.0, 25.0, 40.0]), np.array([1, 2, 0, 3]))
    assert per_token.tolist() == pytest.approx([5.0, 5.0, 20 / 3, 20 / 3, 20 / 3])
    assert per_event.tolist() == [10.0, 20.0]


def test_pooled_events_match_per_request_definition():
    rng = np.random.default_rng(11)
    ms_rows, tok_rows = [], []
    for k in range(60):
        n = int(rng.integers(0, 8))
        ms = np.cumsum(rng.uniform(1, 50, n))
        tok = rng.integers(0, 4, n)  # zero-token events must be skipped
        if k % 10 == 3:
            tok = []  # no per-event counts: one token each
        elif k % 10 == 5:
            tok = tok[: max(n - 1, 0)]  # ragged
        elif k % 10 == 7:
            ms, tok = None, None
        ms_rows.append(ms if k % 2 else (None if ms is None else ms.tolist()))
        tok_rows.append(tok if k % 2 else (None if tok is None else list(tok)))
    pooled = pooled_events(ms_rows, tok_rows)
    per_token = [itl_samples(m, t)[0] for m, t in zip(ms_rows, tok_rows, strict=True)]
    per_event = [itl_samples(m, t)[1] for m, t in zip(ms_rows, tok_rows, strict=True)]
    assert pooled["itl_per_token"] == pytest.approx(np.concatenate(per_token))
    assert pooled["itl_per_event"] == pytest.approx(np.concatenate(per_event))
    for row, (m, t) in enumerate(zip(ms_rows, tok_rows, strict=True)):
        _, tok = token_events(m, t)
        assert pooled["token_sum"][row] == tok.sum()
        if tok.size:
            assert pooled["first_tokens"][row] == tok[0]
        else:
            assert np.isnan(pooled["first_tokens"][row])


def test_itl_pooled_over_requests(tmp_path):
    records = [
        rec(0, ttft=100.0, e2e=210.0, events=[(100.0, 1), (180.0, 4), (200.0, 1)]),
        rec(1, ttft=50.0, e2e=200.0, events=[(50.0, 2), (80.0, 1), (140.0, 3)]),
    ]
    s = summarize(tmp_path, records)
    pooled = [20.0] * 5 + [30.0] + [20.0] * 3
    events = [80.0, 20.0, 30.0, 60.0]
    assert s.samples.itl_ms == 9
    assert s.itl_ms.mean == pytest.approx(np.mean(pooled))
    assert s.itl_ms.p90 == pytest.approx(np.percentile(pooled, 90))
    assert s.samples.itl_per_event_ms == 4
    assert s.itl_per_event_ms.mean == pytest.approx(np.mean(events))
    assert s.itl_per_event_ms.max == pytest.approx(80.0)


def test_warmup_excluded(tmp_path):
    records = [rec(i, phase="warmup", t=i, ttft=5000.0, e2e=9000.0) for i in range(3)]
    records += [rec(10 + i, t=10 + i, ttft=100.0 + i, e2e=500.0) for i in range(4)]
    s = summarize(tmp_path, records)
    assert s.warmup_requests == 3
    assert s.measured_requests == 4
    assert s.completed == 4
    assert s.ttft_ms.max == pytest.approx(103.0)
    assert s.e2e_latency_ms.max == pytest.approx(500.0)
    # The window starts at the first measured send (t=10), ends at the last measured end (13.5 s).
    assert s.duration == pytest.approx(3.5)


def test_failures_counted_by_kind_and_excluded_from_latency(tmp_path):
    records = [
        rec(0, t=0, ttft=100.0, e2e=1000.0),
        rec(1, t=0, ttft=120.0, e2e=1000.0),
        rec(2, outcome="http_error", t=1, ttft=None, e2e=5.0, prompt=None),
        rec(3, outcome="http_error", t=1, ttft=None, e2e=7.0, prompt=None),
        rec(4, outcome="timeout", t=0, ttft=9000.0, e2e=20000.0, events=[(9000.0, 1)]),
        rec(5, phase="warmup", outcome="dropped", t=-5, ttft=None, e2e=10.0),
    ]
    s = summarize(tmp_path, records)
    assert s.completed == 2
    assert s.failed == 3
    assert s.failures == {"http_error": 2, "timeout": 1}
    assert s.samples.ttft_ms == 2
    assert s.ttft_ms.max == pytest.approx(120.0)
    assert s.e2e_latency_ms.max == pytest.approx(1000.0)
    assert s.samples.itl_ms == 0 and s.itl_ms.mean is None
    # The timed-out request still bounds the measured window: 0 .. 20 s.
    assert s.duration == pytest.approx(20.0)
    assert s.request_throughput == pytest.approx(2 / 20.0)
    assert s.slo.failed_requests == 3


def test_in_flight_sweep_hand_made_schedule():
    # A [0,10), B [5,15): 1 then 2 then 1 over [0,15).
    r = in_flight([0.0, 5.0], [10.0, 15.0], 0.0, 15.0)
    assert r == {"mean": pytest.approx(20 / 15), "min": 1, "max": 2}
    # Touching intervals never overlap; a gap counts 0 in flight.
    r = in_flight([0.0, 4.0, 8.0], [4.0, 6.0, 10.0], 0.0, 10.0)
    assert r == {"mean": pytest.approx(8 / 10), "min": 0, "max": 1}
    # Intervals are clipped to the window.
    r = in_flight([-10.0], [20.0], 0.0, 10.0)
    assert r == {"mean": pytest.approx(1.0), "min": 1, "max": 1}


def test_in_flight_includes_warmup_and_failures(tmp_path):
    records = [
        rec(0, t=0, ttft=100.0, e2e=10000.0),  # A: [0, 10)
        rec(1, t=5, ttft=100.0, e2e=10000.0),  # B: [5, 15)
        rec(2, phase="warmup", t=-5, ttft=100.0, e2e=8000.0),  # W: [-5, 3)
    ]
    s = summarize(tmp_path, records)
    assert s.duration == pytest.approx(15.0)
    # [0,3): 2, [3,5): 1, [5,10): 2, [10,15): 1
    assert s.in_flight.mean == pytest.approx((2 * 3 + 1 * 2 + 2 * 5 + 1 * 5) / 15)
    assert s.in_flight.min == 1
    assert s.in_flight.max == 2
    # bench_serving's concurrency: completed measured E2E / duration, warm-up not included.
    assert s.concurrency == pytest.approx(20 / 15)

    failing = records + [rec(3, outcome="stream_error", t=2, ttft=None, e2e=2000.0)]  # [2, 4)
    s = compute_summary(_df(failing), None)
    assert s.in_flight.max == 3  # [2,3): A, W, failing
    assert s.concurrency == pytest.approx(20 / 15)


def _df(records):
    return pd.DataFrame([dataclasses.asdict(r) for r in records])


def test_throughput_and_token_totals(tmp_path):
    records = [
        rec(0, t=0, ttft=100.0, e2e=2000.0, events=decoding(10, 100.0, 100.0), prompt=300),
        rec(1, t=1, ttft=100.0, e2e=3000.0, events=decoding(20, 100.0, 100.0), prompt=None, input_len=250),
        rec(2, outcome="http_error", t=1, ttft=None, e2e=1.0, prompt=None, input_len=999),
    ]
    s = summarize(tmp_path, records)
    assert s.duration == pytest.approx(4.0)
    assert s.total_input_tokens == 550  # server count, then the intended length for request 1
    assert s.input_tokens_fallback == 1
    assert s.total_output_tokens == 30
    assert s.request_throughput == pytest.approx(2 / 4)
    assert s.input_throughput == pytest.approx(550 / 4)
    assert s.output_throughput == pytest.approx(30 / 4)
    assert s.total_throughput == pytest.approx(580 / 4)


def test_cached_token_ratio(tmp_path):
    records = [
        rec(0, prompt=100, cached=50),
        rec(1, prompt=300, cached=0),
        rec(2, prompt=200, cached=None),  # not reported: left out of both sums
        rec(3, outcome="timeout", prompt=1000, cached=1000),  # failed: left out
    ]
    s = summarize(tmp_path, records)
    assert s.cached_token_ratio == pytest.approx(50 / 400)
    assert s.cached_tokens_reported == 2

    s = compute_summary(_df([rec(0, cached=None)]), None)
    assert s.cached_token_ratio is None
    assert s.cached_tokens_reported == 0


def test_slo_pass_and_fail(tmp_path):
    ttfts = [100.0, 200.0, 300.0, 400.0, 500.0]
    records = [rec(i, t=i, ttft=t, e2e=1000.0) for i, t in enumerate(ttfts)]
    p95 = float(np.percentile(ttfts, 95))  # 480
    manifest = make_manifest({"slo": {"ttft_p95_ms": 490.0, "e2e_p95_ms": 999.0, "itl_p95_ms": None}})
    s = summarize(tmp_path, records, manifest)
    objectives = {o.metric: o for o in s.slo.objectives}
    assert set(objectives) == {"ttft_ms", "e2e_latency_ms"}
    assert objectives["ttft_ms"].value_ms == pytest.approx(p95)
    assert objectives["ttft_ms"].percentile == 95
    assert objectives["ttft_ms"].passed is True
    assert objectives["e2e_latency_ms"].passed is False
    assert s.slo.passed is False

    manifest.profile["slo"] = {"ttft_p95_ms": 470.0}
    assert compute_summary(_df(records), manifest).slo.passed is False
    manifest.profile["slo"] = {"ttft_p95_ms": 480.0}
    assert compute_summary(_df(records), manifest).slo.passed is True

    # An objective with no samples fails: every output is one token, so there is no TPOT.
    manifest.profile["slo"] = {"ttft_p95_ms": 1e6, "tpot_p95_ms": 1e6}
    s = compute_summary(_df(records), manifest)
    tpot = next(o for o in s.slo.objectives if o.metric == "tpot_ms")
    assert tpot.value_ms is None and tpot.passed is False
    assert s.slo.passed is False

    s = compute_summary(_df(records), None)
    assert s.slo.objectives == [] and s.slo.passed is None


def test_short_outputs_and_inexact_token_counts(tmp_path):
    records = [
        rec(0, events=decoding(8, 100.0, 10.0), max_new=8),
        rec(1, events=decoding(5, 100.0, 10.0), max_new=8, exact=False),
        rec(2, events=decoding(3, 100.0, 10.0), max_new=8),
        rec(3, outcome="timeout", output=2, max_new=8, exact=False),  # failed: neither
    ]
    s = summarize(tmp_path, records)
    assert s.short_outputs == 2
    assert s.tokens_per_event_inexact == 1


def test_empty_and_all_failed_runs(tmp_path):
    (tmp_path / "empty").mkdir()
    s = summarize(
        tmp_path / "empty",
        [],
        make_manifest(complete=False, counts={"warmup_expected": 0, "measured_expected": 10}),
    )
    assert s.completed == 0 and s.failed == 0 and s.measured_requests == 0
    assert s.duration is None and s.request_throughput is None
    assert s.ttft_ms.mean is None and s.itl_ms.p99 is None
    assert s.partial is True and s.expected_measured == 10
    assert "Partial run" in (tmp_path / "empty" / "summary.md").read_text()

    (tmp_path / "failed").mkdir()
    records = [rec(i, outcome="connect_error", t=i, ttft=None, e2e=None, prompt=None) for i in range(3)]
    s = summarize(tmp_path / "failed", records)
    assert s.failed == 3 and s.failures == {"connect_error": 3}
    assert s.completed == 0 and s.total_output_tokens == 0
    assert s.duration == pytest.approx(2.0)  # sends only: no e2e
    assert s.request_throughput == 0.0
    assert s.e2e_latency_ms.mean is None
    assert s.cached_token_ratio is None

    (tmp_path / "none").mkdir()
    write_manifest(tmp_path / "none", make_manifest())
    s = write_report(tmp_path / "none")  # no records file at all (killed before any request)
    assert s.measured_requests == 0 and s.records_source is None


def test_null_columns_and_missing_columns():
    df = pd.DataFrame({"phase": ["measure"], "outcome": ["ok"], "ttft_ms": [None], "e2e_ms": [None]})
    s = compute_summary(df, None)
    assert s.completed == 1 and s.ttft_ms.mean is None and s.duration is None
    json.dumps(s.dump(), allow_nan=False)


def test_parquet_gives_the_same_summary_as_jsonl(tmp_path):
    rng = np.random.default_rng(3)
    records = []
    for i in range(40):
        ttft = float(rng.uniform(50, 300))
        events = [(ttft, int(rng.integers(1, 5)))]
        for _ in range(int(rng.integers(0, 12))):
            events.append((events[-1][0] + float(rng.uniform(5, 60)), int(rng.integers(1, 4))))
        outcome = "ok" if i % 7 else "stream_error"
        records.append(
            rec(
                i,
                phase="warmup" if i < 5 else "measure",
                outcome=outcome,
                t=i * 0.3,
                ttft=ttft,
                e2e=events[-1][0] + 5.0,
                events=events,
                cached=int(rng.integers(0, 100)) if i % 3 else None,
                prompt=100 if i % 5 else None,
                max_new=20,
            )
        )
    manifest = make_manifest({"slo": {"itl_p95_ms": 30.0}})
    run = make_run(tmp_path, records, manifest)
    from_jsonl = write_report(run)
    write_parquet(run)
    from_parquet = write_report(run)
    assert from_jsonl.records_source == "records.jsonl"
    assert from_parquet.records_source == "records.parquet"
    assert from_parquet == from_jsonl.model_copy(update={"records_source": "records.parquet"})
    assert from_jsonl.samples.itl_ms > 0 and from_jsonl.failed > 0


def test_markdown_view(tmp_path):
    manifest = make_manifest(
        {
            "name": "rag",
            "load": {"model": "closed", "concurrency": 32},
            "slo": {"ttft_p95_ms": 1000.0, "e2e_p95_ms": 10.0},
        },
        run_id="run-42",
        complete=False,
    )
    records = [rec(0), rec(1, outcome="timeout")]
    s = summarize(tmp_path, records, manifest)
    assert s.load_model == "closed loop, 32 in flight"
    assert s.max_concurrency == 32
    md = (tmp_path / "summary.md").read_text()
    assert "run-42" in md and "rag" in md
    assert "closed loop, 32 in flight" in md
    assert "http://127.0.0.1:30000" in md
    assert "| TTFT |" in md and "| E2E |" in md
    assert "PASS: P95 ttft_ms" in md and "FAIL: P95 e2e_latency_ms" in md
    assert "timeout: 1" in md
    assert "Partial run" in md


def test_open_loop_latency_also_counted_from_the_due_time(tmp_path):
    """A request due at T but sent later (queued in the client) must not look faster than it was."""
    records = []
    for i in range(10):
        r = rec(i, t=i * 1.0, ttft=100.0, e2e=500.0)
        r.t_scheduled_wall = r.t_send_wall - i * 0.010  # request i waited i x 10 ms in the client
        records.append(r)
    s = summarize(tmp_path, records)
    queue = np.arange(10) * 10.0
    assert s.client_queue_ms.median == pytest.approx(np.percentile(queue, 50))
    assert s.ttft_from_scheduled_ms.p99 == pytest.approx(np.percentile(100.0 + queue, 99))
    assert s.e2e_from_scheduled_ms.max == pytest.approx(590.0)
    assert s.ttft_ms.p99 == pytest.approx(100.0)  # from the actual send: unchanged
    md = (tmp_path / "summary.md").read_text()
    assert "TTFT from due time" in md and "Client queue (send - due)" in md
    # A closed-loop run schedules nothing: no such rows.
    closed_dir = tmp_path / "closed"
    closed_dir.mkdir()
    closed = summarize(closed_dir, [rec(i, t=i) for i in range(3)])
    assert closed.ttft_from_scheduled_ms is None and closed.samples.ttft_from_scheduled_ms is None
    assert (
        "p99_ttft_from_scheduled_ms" not in closed.dump()
        and "client_queue_ms" not in closed.dump()["samples"]
    )
    assert "TTFT from due time" not in (closed_dir / "summary.md").read_text()


def test_compare_calls_out_the_changes_that_matter():
    from loadlab.analysis.compare import compare, render

    base = compute_summary(_df([rec(0)]), None).dump()

    def summary(**flat):  # summary.json's keys over a one-request run's
        return Summary.model_validate({**base, **flat})

    server = {**base["server"], "peak_token_usage": 0.5}
    bound = {"error_bound_ms": 2.0, "client_bound": True, "reasons": ["w0: 90% CPU (mean; limit 65%)"],
             "limits": {"lateness_p99_ms": 5.0, "cpu_mean": 0.65}, "generators": []}  # fmt: skip
    a = summary(output_throughput=1000.0, p95_ttft_ms=500.0, p95_tpot_ms=20.0, failed=0,
                load_model="closed loop, 32 in flight", server=server)  # fmt: skip
    b = summary(output_throughput=1200.0, p95_ttft_ms=800.0, p95_tpot_ms=20.5, failed=3,
                load_model="closed loop, 64 in flight", server=server, client=bound)  # fmt: skip
    rows = {r["figure"]: r for r in compare(a, b)}
    assert rows["output throughput"]["verdict"] == "better" and rows["output throughput"]["change"] == 0.2
    assert rows["TTFT P95"]["verdict"] == "worse" and rows["TTFT P95"]["change"] == pytest.approx(0.6)
    assert rows["TPOT P95"]["verdict"] == ""  # +2.5%: not notable
    assert rows["failed requests"]["change"] is None  # from zero: no ratio
    text = render("A", "B", a, b, list(rows.values()))
    assert "load_model differs" in text and "B was client-bound" in text
    assert "Changes of 5% or more: output throughput better, TTFT P95 worse" in text


def test_report_html_is_self_contained_with_its_plots(tmp_path):
    import base64
    import re

    records = [
        rec(i, t=i * 0.5, ttft=100.0 + i, e2e=1000.0, events=decoding(10, 100.0 + i, 90.0)) for i in range(20)
    ]
    summarize(tmp_path, records, html=True)
    page = (tmp_path / "report.html").read_text()
    images = re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", page)
    assert len(images) == 2  # the latency CDFs and the timeline, embedded: no file beside it is needed
    for b64 in images:
        png = base64.b64decode(b64)
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "Latency CDFs" in page and "Timeline" in page and "loadlab report" in page
    assert 'src="http' not in page and "src='http" not in page


def colour_pixels(png, rgb: tuple[int, int, int], tolerance: float = 0.06) -> np.ndarray:
    import matplotlib.image

    image = matplotlib.image.imread(png)[:, :, :3]
    return np.all(np.abs(image - np.array(rgb) / 255) < tolerance, axis=2)


PLOT_BLUE = (31, 119, 180)  # matplotlib's first line colour
needs_chromium = pytest.mark.skipif(
    not (shutil.which("chromium") or shutil.which("chromium-browser")),
    reason="no chromium (.ci/run installs it: apt-get install chromium)",
)


def render_or_skip(page, png):
    from loadlab.analysis.html import RenderError, screenshot

    try:
        return screenshot(page, png)
    except RenderError as e:  # Chromium is there but cannot start here (a container without /dev/shm...)
        pytest.skip(str(e))


@needs_chromium
def test_report_html_renders_with_its_plots_and_the_warm_up_shaded(tmp_path):

    records = [
        rec(i, phase="warmup", t=i * 0.5, ttft=150.0, events=decoding(10, 150.0, 90.0)) for i in range(10)
    ]
    records += [
        rec(10 + i, t=5 + i * 0.5, ttft=100.0 + i, events=decoding(10, 100.0 + i, 90.0)) for i in range(30)
    ]
    summarize(tmp_path, records, html=True)
    shot = render_or_skip(tmp_path / "report.html", tmp_path / "report.png")
    blue = colour_pixels(shot, PLOT_BLUE)
    rows = np.nonzero(blue.any(axis=1))[0]
    # Lines drawn in both images (the CDF row at the top, the timeline below it): a page whose images do
    # not decode shows none.
    assert blue.sum() > 2000 and rows.max() - rows.min() > 600
    # The warm-up span (orange at 15% on white), 5 of the 20 s across the four timeline panels.
    assert colour_pixels(shot, (255, 243, 217), tolerance=0.03).sum() > 20_000


@needs_chromium
def test_sweep_html_renders_its_curves_and_slo_lines(tmp_path):
    from loadlab.experiment.aggregate import COLUMNS, choose
    from loadlab.experiment.render import render_html
    from loadlab.experiment.spec import SweepSpec

    def row(limit, thr, ttft, tpot):
        values = {"output tok/s": thr, "TTFT P95 ms": ttft, "TPOT P95 ms": tpot, "max running": 32}
        cells = {c: {"median": None, "min": None, "max": None} for c, *_ in COLUMNS}
        cells.update({k: {"median": v, "min": v * 0.9, "max": v * 1.1} for k, v in values.items()})
        return {"config": {"max_running_requests": limit}, "repeats": 3, "failed": 0, "values": cells}

    rows = [
        row(32, 1300, 900, 20),
        row(64, 2000, 1500, 30),
        row(128, 2200, 2800, 60),
        row(256, 2250, 5000, 90),
    ]
    spec = SweepSpec(
        name="s",
        file="s.yaml",
        profile="p.yaml",
        repeats=3,
        axes={"max_running_requests": [32, 64, 128, 256]},
        slo={"ttft_p95_ms": 3000, "tpot_p95_ms": 100},
    )
    page = tmp_path / "sweep.html"
    page.write_text(render_html(spec, {"rows": rows, **choose(rows, spec.slo)}))
    shot = render_or_skip(page, tmp_path / "sweep.png")
    assert colour_pixels(shot, PLOT_BLUE).sum() > 1000  # the three curves
    assert colour_pixels(shot, (255, 0, 0), tolerance=0.1).sum() > 300  # the two SLO lines


def test_server_queue_time_from_meta_info_stands_in_for_metrics(tmp_path):
    records = [rec(i, t=i * 0.5, events=decoding(5, 100.0, 10.0)) for i in range(4)]
    for r, queue in zip(records, (10.0, 20.0, 30.0, 100.0), strict=True):
        r.server_queue_ms = queue
    s = summarize(tmp_path, records)
    assert s.server_queue_ms.mean == 40.0 and s.server_queue_ms.median == 25.0
    # No /metrics scraped: the mean queue delay column comes from the events, and says so.
    assert s.server.mean_queue_time_ms == 40.0 and s.server.queue_time_source == "meta_info"
    md = (tmp_path / "summary.md").read_text()
    assert "Mean queue delay (from meta_info.queue_time): 40.00 ms" in md
    assert "| Server queue (meta_info) | 4 | 40.00 | 25.00 |" in md


# ---------------------------------------------------------------------------------------------------
# summary.json: the model is the contract, and docs/metrics.md documents all of it

METRICS_MD = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"


def _models_in(annotation, in_list=False):
    """(model, inside a list) for each summary model an annotation holds: X, X | None, list[X]."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation, in_list
    elif typing.get_origin(annotation) is list:
        yield from _models_in(typing.get_args(annotation)[0], True)
    else:  # a union (X | None); dict, Literal and plain types hold no model
        for arg in typing.get_args(annotation):
            yield from _models_in(arg, in_list)


def _is_latency(field) -> bool:
    return any(model is LatencyStats for model, _ in _models_in(field.annotation))


def _documented_fields() -> dict[str, list[str]]:
    """What each ### part of the doc's "summary.json fields" must list: the JSON names of its model's
    fields. Found by walking Summary and every model nested in it; the latency metrics (flat
    <stat>_<X> keys on disk) are under "Latency statistics"."""
    parts: dict[str, list[str]] = {"Latency statistics": [*LatencyStats.model_fields, *LATENCY_STEMS]}

    def walk(model, path):
        parts["Top level" if not path else f"`{path}`"] = [
            field.alias or name for name, field in model.model_fields.items() if not _is_latency(field)
        ]
        for name, field in model.model_fields.items():
            for sub, in_list in _models_in(field.annotation):
                if sub is not LatencyStats:
                    walk(
                        sub, ".".join(p for p in (path, field.alias or name) if p) + ("[]" if in_list else "")
                    )

    walk(Summary, "")
    return parts


def _doc_tables() -> dict[str, list[str]]:
    """The names in the first column of the tables of each ### part of "## summary.json fields"."""
    text = METRICS_MD.read_text()
    assert "\n## summary.json fields\n" in text, "docs/metrics.md has no '## summary.json fields' section"
    section = text.split("\n## summary.json fields\n", 1)[1].split("\n## ", 1)[0]
    tables = {}
    for part in section.split("\n### ")[1:]:
        heading, _, body = part.partition("\n")
        tables[heading.strip()] = re.findall(r"^\| `([^`]+)` \|", body, flags=re.MULTILINE)
    return tables


def test_every_summary_field_is_documented():
    expected, tables = _documented_fields(), _doc_tables()
    assert len(expected) == 19  # Summary, the latency statistics and the seventeen nested models
    for part, names in expected.items():
        assert part in tables, f"docs/metrics.md, summary.json fields: no '### {part}'"
        missing = [n for n in names if n not in tables[part]]
        assert not missing, f"docs/metrics.md, summary.json fields, {part}: not documented: {missing}"
        stale = [n for n in tables[part] if n not in names]
        assert not stale, f"docs/metrics.md, summary.json fields, {part}: not in the model: {stale}"
    assert set(tables) == set(expected), "docs/metrics.md, summary.json fields: a part for no model"
    for model in set(_walk_models(Summary)):  # and described in the model itself
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name}: no description"


def _walk_models(model):
    yield model
    for field in model.model_fields.values():
        for sub, _ in _models_in(field.annotation):
            yield from _walk_models(sub)


def test_summary_json_is_checked_against_the_model(tmp_path, monkeypatch):
    records = []
    for i in range(6):
        r = rec(i, t=i * 0.5, events=decoding(4, 100.0, 10.0))
        r.t_scheduled_wall = r.t_send_wall - 0.001 * i  # open loop: the due-time metrics are there
        records.append(r)
    s = summarize(tmp_path, records, make_manifest({"slo": {"ttfx_p9_ms": 1}}))
    on_disk = json.loads((tmp_path / SUMMARY_JSON).read_text())
    assert Summary.read(tmp_path) == s and s.dump() == on_disk
    assert on_disk["version"] == 6 and on_disk["schema"] == "loadlab.summary/6"
    assert s.client_queue_ms is not None and "p99_client_queue_ms" in on_disk
    assert "server_queue_ms" not in on_disk["samples"] and "mean_server_queue_ms" not in on_disk
    assert on_disk["slo"]["unrecognized"] == ["ttfx_p9_ms"] and "peak_token_usage" not in on_disk["server"]
    assert set(Samples.model_fields) == set(LATENCY_STEMS)

    # Unknown keys (at the top, inside a part, a statistic nobody computes), missing keys, half a metric
    # and NaN are all errors.
    missing = dict(on_disk)
    del missing["duration"]
    half = dict(on_disk)
    del half["p99_itl_ms"]
    for bad in (
        {**on_disk, "p42_ttft_ms": 1.0},
        {**on_disk, "server": {**on_disk["server"], "gpu": "H100"}},
        {**on_disk, "slo": {**on_disk["slo"], "objectives": [{"key": "x"}]}},
        missing,
        half,
        {**on_disk, "mean_server_queue_ms": 1.0},  # one statistic of a metric without samples
        {**on_disk, "duration": float("nan")},
    ):
        with pytest.raises(ValidationError):
            Summary.model_validate(bad)
    # compute_summary builds the model the same way: a key it starts to produce without the model
    # knowing it fails at once.
    monkeypatch.setattr(metrics, "PERCENTILES", (90, 95, 99, 99.9))
    with pytest.raises(ValidationError, match="p99.9_ttft_ms"):
        compute_summary(_df(records), None)
    monkeypatch.undo()

    # Summary.read says what is wrong in one line; a newer version is refused; version 1 (no workers) and
    # a summary written before the version key read as version 2, the added fields at their defaults.
    path = tmp_path / SUMMARY_JSON
    path.write_text(json.dumps({**on_disk, "surprise": 1}))
    with pytest.raises(SummaryError, match=r"surprise: Extra inputs are not permitted.*loadlab report"):
        Summary.read(tmp_path)
    path.write_text(json.dumps({**on_disk, "version": 7}))
    with pytest.raises(SummaryError, match="summary version 7; this loadlab reads versions 1, 2, 3, 4, 5, 6"):
        Summary.read(tmp_path)
    added_in_2 = ("workers", "unattributed_requests", "classes")
    version_1 = {k: v for k, v in on_disk.items() if k not in added_in_2}
    path.write_text(json.dumps({**version_1, "version": 1, "schema": "loadlab.summary/1"}))
    assert Summary.read(tmp_path) == s.model_copy(update={"workers": [], "unattributed_requests": None})
    path.write_text(json.dumps({k: v for k, v in version_1.items() if k not in ("version", "schema")}))
    assert Summary.read(tmp_path).workers == []
    version_2 = {k: v for k, v in on_disk.items() if k != "classes"}
    path.write_text(json.dumps({**version_2, "version": 2, "schema": "loadlab.summary/2"}))
    assert Summary.read(tmp_path) == s and s.classes == []
    # Version 3, before goodput, the overload verdict, findings and the expected cache hits: all at their
    # defaults (this run has no SLO and too few arrivals for a verdict: its own values are the defaults but
    # for the finding that 2 were in flight against a configured 1).
    added_in_4 = ("goodput_limits", "good_requests", "goodput_ratio", "request_goodput", "output_goodput",
                  "overload", "expected_cached_token_ratio", "findings")  # fmt: skip
    version_3 = {k: v for k, v in on_disk.items() if k not in added_in_4}
    path.write_text(json.dumps({**version_3, "version": 3, "schema": "loadlab.summary/3"}))
    old = Summary.read(tmp_path)
    assert [f.kind for f in s.findings] == ["load_not_locked"]
    assert old == s.model_copy(update={"findings": []}) and old.goodput_ratio is None
    # Version 4, before conversations: no sessions, no turns (this run has none either).
    version_4 = {k: v for k, v in on_disk.items() if k not in ("sessions", "turns")}
    path.write_text(json.dumps({**version_4, "version": 4, "schema": "loadlab.summary/4"}))
    assert Summary.read(tmp_path) == s and s.turns == [] and s.sessions is None
    path.unlink()
    with pytest.raises(SummaryError, match="no such file"):
        Summary.read(tmp_path)


def test_client_calibration_from_the_manifest(tmp_path):
    from loadlab.lateness import LatenessHistogram
    from loadlab.swarm.calibration import verdict  # gevent: only this test needs it

    probe = LatenessHistogram()
    for ms in (0.2, 0.4, 9.0):
        probe.record(ms / 1000)
    generators = [
        {"worker_id": "h:1", "probe_lateness_ms": probe.summary_ms(), "cpu_mean": 0.9, "cpu_max": 1.0},
        {"worker_id": "h:2", "probe_lateness_ms": LatenessHistogram().summary_ms(), "cpu_mean": None,
         "cpu_max": None, "seconds": 3.0},
    ]  # fmt: skip
    manifest = make_manifest(client=verdict(generators, 5.0, 0.65))
    s = summarize(tmp_path, [rec(0)], manifest)
    assert s.client.client_bound and len(s.client.reasons) == 2
    assert s.client.limits.lateness_p99_ms == 5.0 and s.client.generators[0].cpu_mean == 0.9
    assert s.client.error_bound_ms == s.client.generators[0].probe_lateness_p99_ms > 5.0
    md = (tmp_path / "summary.md").read_text()
    assert "worst of 2); CPU 90% of a core" in md and "**Client-bound**" in md
    assert "include the load generator's own delay" in md and "taken by the kernel" not in md
    assert Summary.read(tmp_path) == s
    # Timed by the kernel: the events' times are exact on a busy client; its sends were what it delayed.
    kernel = tmp_path / "kernel"
    kernel.mkdir()
    s = summarize(kernel, [dataclasses.replace(rec(0), receipt_clock="kernel")], manifest)
    md = (kernel / "summary.md").read_text()
    assert s.receipt.clock == "kernel" and "**Client-bound**" in md
    assert "taken by the kernel, so TTFT, ITL and E2E stay exact" in md and "own delay" not in md


# ---------------------------------------------------------------------------------------------------
# Per worker: records that name the worker that served them (served_by), and each worker's own /metrics

A, B, C = "http://127.0.0.1:1001", "http://127.0.0.1:1002", "district-c/w3"


def _cluster_records() -> list[RequestRecord]:
    """Three known workers (A and B scraped, C not), failures on two, and measured requests that name no
    worker: one completed behind a server that sends no header, one the front answered itself (429), one
    that never got a response."""
    records = [
        # A: four completed, 10 tokens each at known TTFTs and E2Es, cached 50 of 100 prompt tokens
        *(rec(i, t=i * 0.5, ttft=ttft, e2e=e2e, events=decoding(10, ttft, (e2e - ttft) / 9), cached=50,
              served_by=A) for i, (ttft, e2e) in enumerate([(100, 1000), (200, 1100), (300, 2100), (400, 1300)])),
        rec(4, t=2.0, outcome="http_error", ttft=None, e2e=5.0, served_by=A),  # A's own 503
        # B: two completed (5 tokens; cached reported by one), one timeout, one stream error
        rec(5, t=0.2, ttft=50, e2e=450, events=decoding(5, 50, 100), cached=10, prompt=200, served_by=B),
        rec(6, t=0.7, ttft=150, e2e=550, events=decoding(5, 150, 100), cached=None, served_by=B),
        rec(7, t=1.1, outcome="timeout", ttft=None, e2e=3000.0, served_by=B),
        rec(8, t=1.2, outcome="stream_error", ttft=80, e2e=90.0, events=[(80, 1)], served_by=B),
        # C: one completed, 3 tokens
        rec(9, t=0.3, ttft=60, e2e=260, events=decoding(3, 60, 100), served_by=C),
        # no worker named
        rec(10, t=0.4, ttft=70, e2e=470, events=decoding(4, 70, 100)),
        rec(11, t=0.6, outcome="http_error", ttft=None, e2e=2.0),
        rec(12, t=0.8, outcome="connect_error", ttft=None, e2e=1.0),
        # warm-up on A: not in any figure
        rec(13, phase="warmup", t=-3.0, ttft=5000, e2e=6000, events=decoding(10, 5000, 100), served_by=A),
    ]  # fmt: skip
    records[11].status_source = "front"
    return records


def _cluster_scrapes() -> list[dict]:
    """A and B scraped every second over the run (B's URL with a trailing slash), C never; one A scrape
    long after the measured window, with a higher KV usage that must not count."""
    rows = []
    for k in range(-1, 6):
        t = T0 + k
        rows.append({"t": t, "url": A, "round": k, "m": {"sglang:token_usage": [0.1, 0.2, 0.7, 0.4, 0.3, 0.2, 0.1][k + 1],
                                                          "sglang:num_running_reqs": 2, "sglang:num_queue_reqs": 1}})  # fmt: skip
        rows.append({"t": t + 0.01, "url": B + "/", "round": k, "m": {"sglang:token_usage": 0.05 * (k + 1),
                                                                     "sglang:num_running_reqs": 1}})  # fmt: skip
    rows.append({"t": T0 + 60, "url": A, "round": 60, "m": {"sglang:token_usage": 0.99}})
    rows.append({"t": T0 + 1, "url": "http://127.0.0.1:9999", "round": 0, "error": "connection refused"})
    return rows


def test_the_timelines_kv_panel_is_the_servers_mean_and_highest_not_each_server_again(tmp_path):
    """With several servers each one's KV line is the per-worker figure's; the run's timeline shows the mean
    and the fullest server per scrape round (a round without every server's value left out)."""
    import matplotlib

    matplotlib.use("Agg")
    from loadlab.analysis.html import _timeline
    from loadlab.records import load_records

    run = make_run(tmp_path, _cluster_records())
    rows = _cluster_scrapes()
    fig = _timeline(load_records(run), rows)
    kv = {line.get_label(): line for line in fig.axes[3].lines}
    assert set(kv) == {"mean of 2 servers", "highest of 2 servers"}
    a_usage = [0.1, 0.2, 0.7, 0.4, 0.3, 0.2, 0.1]  # A's rounds -1..5 (its round 60 alone: left out)
    b_usage = [0.05 * (k + 1) for k in range(-1, 6)]
    assert kv["mean of 2 servers"].get_ydata() == pytest.approx(
        [50 * (a + b) for a, b in zip(a_usage, b_usage, strict=True)]
    )
    assert kv["highest of 2 servers"].get_ydata() == pytest.approx(
        [100 * max(a, b) for a, b in zip(a_usage, b_usage, strict=True)]
    )
    first_send = min(r.t_send_wall for r in _cluster_records())
    assert kv["mean of 2 servers"].get_xdata() == pytest.approx([T0 + k - first_send for k in range(-1, 6)])
    # One server: its own line, unlabelled, in percent.
    fig = _timeline(load_records(run), [r for r in rows if r.get("url") == A and r["round"] != 60])
    (line,) = fig.axes[3].lines
    assert line.get_ydata() == pytest.approx([100 * a for a in a_usage])


def test_per_worker_figures_against_hand_computed_values(tmp_path):
    records = _cluster_records()
    run = make_run(tmp_path, records)
    (run / "server_metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _cluster_scrapes()))
    s = write_report(run)
    # The measured window, by hand: first send T0 + 0.0 (request 0), last end T0 + 1.1 + 3.0 (B's timeout).
    duration = 1.1 + 3.0
    assert s.duration == pytest.approx(duration)
    by = {w.served_by: w for w in s.workers}
    assert [w.served_by for w in s.workers] == sorted([A, B, C])  # sorted ids; no entry for "no worker"
    assert s.unattributed_requests == 3

    a, b, c = by[A], by[B], by[C]
    assert (a.measured_requests, a.completed, a.failed, a.failures) == (5, 4, 1, {"http_error": 1})
    assert (b.measured_requests, b.completed, b.failed) == (4, 2, 2)
    assert b.failures == {"stream_error": 1, "timeout": 1}
    assert (c.measured_requests, c.completed, c.failed, c.failures) == (1, 1, 0, {})
    assert (a.total_output_tokens, b.total_output_tokens, c.total_output_tokens) == (40, 10, 3)
    assert a.output_throughput == pytest.approx(40 / duration)
    assert b.output_throughput == pytest.approx(10 / duration)
    assert c.output_throughput == pytest.approx(3 / duration)
    # TTFT percentiles: numpy on the known TTFTs (linear interpolation).
    assert a.median_ttft_ms == pytest.approx(250.0)  # between 200 and 300
    assert a.p95_ttft_ms == pytest.approx(200 + 0.85 * 100 + 100)  # rank 2.85 of [100, 200, 300, 400]
    assert b.median_ttft_ms == pytest.approx(100.0) and b.p95_ttft_ms == pytest.approx(50 + 0.95 * 100)
    assert c.median_ttft_ms == c.p95_ttft_ms == 60.0
    # TPOT = (E2E - TTFT) / (10 - 1) per A request: 100, 100, 200, 100 -> P95 at rank 2.85 of the sorted.
    assert a.p95_tpot_ms == pytest.approx(100 + 0.85 * 100)
    assert b.p95_tpot_ms == pytest.approx(100.0) and c.p95_tpot_ms == pytest.approx(100.0)
    # Cached ratio: A 4 x 50 / 4 x 100; B only the request reporting both, 10 / 200; C reports none.
    assert (a.cached_token_ratio, a.cached_tokens_reported) == (0.5, 4)
    assert (b.cached_token_ratio, b.cached_tokens_reported) == (pytest.approx(0.05), 1)
    assert (c.cached_token_ratio, c.cached_tokens_reported) == (None, 0)
    # Peak KV from each worker's own rows inside the window (+- one scrape interval): A's 0.7, not the
    # 0.99 a minute later; B's URL matched without its trailing slash; C not scraped.
    assert a.peak_token_usage == 0.7
    assert b.peak_token_usage == pytest.approx(0.05 * 6)  # its scrape at T0 + 5 is within T0 + 4.1 + 1
    assert c.peak_token_usage is None

    # The parts add up: attributed + unattributed = the run's counts; the throughputs sum likewise.
    assert sum(w.measured_requests for w in s.workers) + s.unattributed_requests == s.measured_requests == 13
    assert sum(w.completed for w in s.workers) + 1 == s.completed == 8  # request 10 named no worker
    assert sum(w.failed for w in s.workers) + 2 == s.failed
    assert sum(w.total_output_tokens for w in s.workers) + 4 == s.total_output_tokens

    # summary.md: the table, and how many named no worker; it reads back identical.
    md = (run / "summary.md").read_text()
    assert "## Per worker" in md
    assert f"| {A} | 5 | 4 | 1 | {40 / duration:.2f} | 250.00 | 385.00 | 185.00 | 50.0% | 70.0% |" in md
    assert f"| {C} | 1 | 1 | 0 | {3 / duration:.2f} | 60.00 | 60.00 | 100.00 | n/a | n/a |" in md
    assert "3 measured request(s) named no worker" in md
    assert Summary.read(run) == s


def test_every_request_attributed_the_workers_add_up_to_the_run(tmp_path):
    rng = np.random.default_rng(11)
    records = []
    for i in range(60):
        ttft = float(rng.uniform(50, 400))
        n = int(rng.integers(2, 30))
        outcome = "ok" if i % 9 else "timeout"
        records.append(rec(i, t=i * 0.05, ttft=ttft, e2e=ttft + n * 20.0, events=decoding(n, ttft, 20.0),
                           outcome=outcome, cached=int(rng.integers(0, 100)), served_by=[A, B, C][i % 3]))  # fmt: skip
    s = summarize(tmp_path, records)
    assert s.unattributed_requests == 0 and len(s.workers) == 3
    assert sum(w.completed for w in s.workers) == s.completed
    assert sum(w.failed for w in s.workers) == s.failed
    assert sum(w.total_output_tokens for w in s.workers) == s.total_output_tokens
    assert sum(w.output_throughput for w in s.workers) == pytest.approx(s.output_throughput)
    for w in s.workers:  # each worker's TTFT P95, from its own records by numpy
        own = [r.ttft_ms for r in records if r.served_by == w.served_by and r.outcome == "ok"]
        assert w.p95_ttft_ms == pytest.approx(float(np.percentile(own, 95)))


def test_no_worker_named_no_workers_entry_and_no_table(tmp_path):
    s = summarize(tmp_path, [rec(0), rec(1, t=0.5)])
    assert s.workers == [] and s.unattributed_requests == 2
    assert "Per worker" not in (tmp_path / "summary.md").read_text()
    on_disk = json.loads((tmp_path / SUMMARY_JSON).read_text())
    assert on_disk["workers"] == [] and on_disk["unattributed_requests"] == 2
    # A summary written before attribution (no such keys) still reads, as "not known".
    old = {k: v for k, v in on_disk.items() if k not in ("workers", "unattributed_requests")}
    (tmp_path / SUMMARY_JSON).write_text(json.dumps(old))
    back = Summary.read(tmp_path)
    assert back.workers == [] and back.unattributed_requests is None


def test_report_html_has_a_per_worker_timeline_for_a_cluster(tmp_path):
    import base64
    import re

    run = make_run(tmp_path, _cluster_records())
    (run / "server_metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _cluster_scrapes()))
    write_report(run, html=True)
    page = (run / "report.html").read_text()
    images = re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", page)
    assert len(images) == 3 and "<h2>Per worker</h2>" in page  # CDFs, the timeline, then per worker
    assert base64.b64decode(images[2])[:8] == b"\x89PNG\r\n\x1a\n"
