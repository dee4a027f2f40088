"""The live figures (loadlab/swarm/live.py) and their Prometheus page (exporter.py) against the
post-processor on the same records, without Locust: the percentile definition is numpy's to the last bit,
and the live figures of a finished run are summary.json's."""

from __future__ import annotations

import json

import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from loadlab.analysis import write_report
from loadlab.analysis.stats import SortedSamples, percentile, quantiles
from loadlab.load import Tickets
from loadlab.manifest import Manifest, write_manifest
from loadlab.profile import validate_profile
from loadlab.records import MEASURE, SERVER_METRICS, WARMUP, RecordWriter, RequestRecord
from loadlab.swarm.exporter import BUCKETS_S, HISTOGRAMS, LiveCollector, exposition
from loadlab.swarm.live import LiveFigures, ServerTail
from loadlab.swarm.webui import ms, shown, table

QS = [0, 1, 50, 90, 95, 99, 99.9, 100]


def test_quantiles_are_numpys_to_the_last_bit():
    rng = np.random.default_rng(3)
    for trial in range(600):
        n = int(rng.integers(1, 300))
        kind = trial % 3  # continuous, many ties, wide range with negatives
        a = (
            rng.lognormal(3, 1, n)
            if kind == 0
            else rng.integers(0, 8, n).astype(float)
            if kind == 1
            else rng.normal(0, 1e4, n)
        )
        qs = [*QS, float(rng.uniform(0, 100))]
        want = np.percentile(a, qs, method="linear")
        assert np.array_equal(quantiles(a, qs), want)
        assert percentile(a, qs[-1]) == np.percentile(a, qs[-1])
        # The same figures from sorted arrays built up in batches, the small one folded in or not.
        for fold_min in (2, 4096):
            s = SortedSamples()
            s.FOLD_MIN = fold_min
            for part in np.array_split(a, int(rng.integers(1, 7))):
                s.add(part, run=lambda fn, *args: fn(*args))
            assert np.array_equal(s.quantiles(qs), want)
            assert np.array_equal(s.kths(np.arange(n)), np.sort(a))
    assert quantiles([np.nan, np.inf], [50]) is None and SortedSamples().quantiles([50]) is None
    s = SortedSamples()
    s.add([3.0, 1.0, 2.0, 2.0])
    assert list(s.count_at_most([0, 2, 2.5, 9])) == [0, 3, 3, 4] and s.total == 8.0


PROFILE = {
    "name": "live",
    "requests": {"warmup": 2, "measured": 60},
    "workload": {"kind": "random_prefix", "input_len": 64, "output_len": 8},
    "slo": {"ttft_p95_ms": 300, "tpot_p95_ms": 40},
    "classes": [
        {"name": "interactive", "share": 0.5, "slo": {"ttft_p95_ms": 150}},
        {"name": "batch", "share": 0.5},
    ],
}


def records(n: int, seed: int = 5) -> list[RequestRecord]:
    """Warm-up and measured records over two classes and three workers, with failures, a multi-token
    event and a record without per-event counts (their fallbacks must match too)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        ttft = float(rng.uniform(20, 400))
        gaps = rng.uniform(5, 40, 7)
        arrivals = [ttft, *(ttft + np.cumsum(gaps)).tolist()]
        tokens = [1] * 8
        if i % 11 == 3:
            tokens[2] = 3
        failed = i % 13 == 5
        out.append(
            RequestRecord(
                index=i, phase=WARMUP if i < 2 else MEASURE, api="generate", worker_id="w", user_id=i,
                t_send_wall=1.7e9 + i * 0.1, outcome="timeout" if failed else "ok",
                ttft_ms=None if failed else ttft, e2e_ms=arrivals[-1] + 2.0,
                arrival_ms=[] if failed else arrivals,
                arrival_tokens=[] if failed or i % 17 == 9 else tokens,
                output_tokens=None if failed or i % 19 == 7 else sum(tokens), prompt_tokens=64,
                input_len=64, max_new_tokens=10, served_by=f"http://127.0.0.1:{3000 + i % 3}",
                request_class=("interactive", "batch")[i % 2],
                tokens_per_event_exact=i % 7 != 4,  # a server that counted only at the end: ITL estimated
            )
        )  # fmt: skip
    return out


def finished_run(tmp_path, recs):
    profile = validate_profile(PROFILE)
    tickets = Tickets(profile.requests.warmup, profile.requests.measured)
    live = LiveFigures(profile, tmp_path, tickets)
    writer = RecordWriter(tmp_path)
    for batch in (recs[:7], recs[7:30], recs[30:]):  # refreshed between batches, as a master would
        for rec in batch:
            tickets.next_index += 1
            tickets.finished(rec.phase)
            writer.write(rec)
            live.add(rec)
        live.figures(now=1.7e9 + len(batch))
    writer.close()
    manifest = {
        "run_id": tmp_path.name, "profile_path": "p.yaml", "profile": profile.model_dump(mode="json"),
        "target": {"url": "http://127.0.0.1:3000"}, "started_wall": 0.0, "complete": True,
        "load": {"model": "closed", "concurrency": 4, "description": "closed loop, 4 in flight"},
        "counts": {"warmup_expected": 2, "measured_expected": 60},
        "versions": {"loadlab": "0", "python": "3", "platform": "test"},
        "command": ["test"],
    }  # fmt: skip
    write_manifest(tmp_path, Manifest.model_validate(manifest))
    return live, write_report(tmp_path, html=False).dump()


def test_live_figures_of_a_finished_run_are_the_summarys(tmp_path):
    live, s = finished_run(tmp_path, records(62))
    f = live.figures(now=2e9)
    for metric in HISTOGRAMS:
        assert tuple(f["run"]["latencies"][metric]) == (
            s[f"median_{metric}"],
            s[f"p95_{metric}"],
            s[f"p99_{metric}"],
        ), metric
        assert f["run"]["samples"][metric] == s["samples"][metric]
    assert (f["run"]["completed"], f["run"]["failed"], f["run"]["failures"]) == (
        s["completed"],
        s["failed"],
        s["failures"],
    )
    assert f["run"]["output_tokens"] == s["total_output_tokens"]
    assert f["output_throughput"] == s["output_throughput"]
    for c in s["classes"]:
        mine = f["classes"][c["name"]]
        assert tuple(mine["latencies"]["ttft_ms"]) == (
            c["median_ttft_ms"],
            c["p95_ttft_ms"],
            c["p99_ttft_ms"],
        )
        assert mine["latencies"]["tpot_ms"][1] == c["p95_tpot_ms"]
        assert mine["output_tokens"] == c["total_output_tokens"] and mine["failures"] == c["failures"]
        assert f["slo"]["classes"][c["name"]] == c["slo"]
    for w in s["workers"]:
        mine = f["workers"][w["served_by"]]
        assert mine["latencies"]["ttft_ms"][1] == w["p95_ttft_ms"]
        assert mine["latencies"]["tpot_ms"][1] == w["p95_tpot_ms"]
        assert mine["completed"] == w["completed"]
    assert f["slo"]["run"] == s["slo"] | {
        "pass": f["slo"]["run"]["pass"]
    }  # summary's pass is the overall one
    assert f["slo"]["pass"] == s["slo"]["pass"]
    assert f["in_flight"] == 0 and f["measured"] == (60, 60) and f["warmup"] == (2, 2)

    # The tab shows them to 2 decimals, as summary.md does.
    rows = {(r["scope"], r["figure"]): r for r in table(f)}
    assert rows[("run", "TTFT (ms)")]["p95"] == ms(s["p95_ttft_ms"]) == f"{s['p95_ttft_ms']:.2f}"
    assert rows[("class interactive", "E2E (ms)")]["p99"] == ms(s["classes"][0]["p99_e2e_latency_ms"])
    assert rows[("run", "SLO verdict")]["value"] == ("PASS so far" if s["slo"]["pass"] else "FAIL so far")
    assert len({r["scope"] for r in rows.values() if r["scope"].startswith("worker ")}) == 3
    # ITL estimated where the server counted tokens only at the end: the same count as the summary's.
    assert f["run"]["itl_estimated"] == s["tokens_per_event_inexact"] > 0
    assert (
        f"estimated for {s['tokens_per_event_inexact']} of {s['completed']}"
        in rows[("run", "ITL (ms)")]["value"]
    )
    assert "estimated" not in rows[("run", "TTFT (ms)")]["value"]


def test_prometheus_page_counts_equal_the_summary(tmp_path):
    live, s = finished_run(tmp_path, records(62))
    collector = LiveCollector(None)
    collector.live = lambda: live  # no Locust environment here
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    page, _ = exposition(registry)
    families = {f.name: f for f in text_string_to_metric_families(page.decode())}
    for metric, (name, _doc) in HISTOGRAMS.items():
        family = families[name]
        assert family.type == "histogram"
        counts = {
            sample.labels["class"]: sample.value
            for sample in family.samples
            if sample.name == name + "_count"
        }
        assert counts == {c["name"]: c["samples"][metric] for c in s["classes"]}
        buckets = [x for x in family.samples if x.name == name + "_bucket" and x.labels["class"] == "batch"]
        assert [b.labels["le"] for b in buckets] == [f"{b:g}" for b in BUCKETS_S[metric]] + ["+Inf"]
        values = [b.value for b in buckets]
        assert values == sorted(values)  # cumulative
    requests = families["loadlab_requests"]
    measured = {}
    for sample in requests.samples:
        if sample.labels["phase"] == "measure":
            measured[sample.labels["outcome"]] = measured.get(sample.labels["outcome"], 0) + sample.value
    assert measured == {"ok": s["completed"], **s["failures"]}
    tokens = sum(x.value for x in families["loadlab_output_tokens"].samples if x.name.endswith("_total"))
    assert tokens == s["total_output_tokens"]
    passes = {x.labels["class"]: x.value for x in families["loadlab_slo_pass"].samples}
    assert passes[""] == float(
        s["slo"]["pass"] is not False and all(o["pass"] for o in s["slo"]["objectives"])
    )
    assert passes["interactive"] == float(s["classes"][0]["slo"]["pass"])
    attain = {
        (x.labels["class"], x.labels["objective"]): x.value
        for x in families["loadlab_slo_attainment"].samples
    }
    assert 0 <= attain[("interactive", "ttft_p95_ms")] <= 1
    assert families["loadlab_requests_in_flight"].samples[0].value == 0


def test_server_tail_reads_only_whole_new_lines(tmp_path):
    path = tmp_path / SERVER_METRICS
    tail = ServerTail(path)
    tail.read()  # no file yet
    assert tail.figures()["servers"] == 0
    a = {
        "t": 1.0,
        "url": "http://a",
        "round": 0,
        "m": {"sglang:num_running_reqs": 3, "sglang:token_usage": 0.2},
    }
    b = {"t": 1.1, "url": "http://b", "round": 0, "m": {"sglang:num_running_reqs": 4, "sglang:num_queue_reqs": 2,
                                                        "sglang:token_usage": 0.5}}  # fmt: skip
    line_b = json.dumps(b)
    path.write_text(json.dumps(a) + "\n" + line_b[:10])  # the scraper is writing b
    tail.read()
    assert tail.figures()["running"] == 3
    with open(path, "a") as f:
        f.write(
            line_b[10:]
            + "\n"
            + json.dumps({"t": 2.0, "url": "http://a", "round": 1, "error": "GET /metrics: x"})
        )
        f.write("\n")
    tail.read()
    got = tail.figures()
    assert got["running"] == 4 and got["queued"] == 2 and got["max_kv_usage"] == 0.5
    assert got["errors"] == {"http://a": "GET /metrics: x"} and got["scraped_at"] == 2.0


def test_in_flight_counts_only_due_tickets():
    from loadlab.load import Arrivals

    closed = Tickets(0, 10)
    closed.take()
    closed.take()
    closed.finished(MEASURE)
    assert closed.in_flight(0.0) == 1
    opened = Tickets(0, 10, Arrivals(rate=1.0, arrival="constant", seed=0))
    first = opened.take_ready(100.0)
    second = opened.take_ready(100.0)
    assert (first.due, second.due) == (100.0, pytest.approx(101.0))
    assert opened.in_flight(100.5) == 1 and opened.in_flight(101.5) == 2


def test_the_tab_shows_no_credentials():
    assert shown("http://user:s3cret@gpu-box:30000/x") == "http://gpu-box:30000/x"
    assert (
        shown("GET /metrics: <urlopen error https://a:b@h:1 refused>")
        == "GET /metrics: <urlopen error https://h:1 refused>"
    )
    assert shown("http://127.0.0.1:30000") == "http://127.0.0.1:30000"
