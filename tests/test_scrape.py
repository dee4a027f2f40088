"""Server metrics during a run: /metrics parsing, the seed's server-side columns, and a real run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loadlab.analysis.server_metrics import gauge_series, scrape_interval, server_summary
from loadlab.target.scraper import parse_metrics

PAGE = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",tp_rank="0"} 12.0
sglang:num_running_reqs{model_name="m",tp_rank="1"} 12.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m",tp_rank="0"} 0.25
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="m"} 1000.0
# TYPE sglang:queue_time_seconds histogram
sglang:queue_time_seconds_bucket{model_name="m",le="0.1",is_streaming="true"} 3.0
sglang:queue_time_seconds_bucket{model_name="m",le="+Inf",is_streaming="true"} 4.0
sglang:queue_time_seconds_sum{model_name="m",is_streaming="true"} 0.5
sglang:queue_time_seconds_count{model_name="m",is_streaming="true"} 4.0
sglang:queue_time_seconds_sum{model_name="m",is_streaming="false"} 0.1
sglang:queue_time_seconds_count{model_name="m",is_streaming="false"} 1.0
# TYPE other_metric gauge
other_metric 5.0
"""


def test_parse_keeps_sglang_names_max_of_gauges_sum_of_counters():
    m = parse_metrics(PAGE)
    assert m["sglang:num_running_reqs"] == 12.0  # ranks report the same batch: not 24
    assert m["sglang:token_usage"] == 0.25
    assert m["sglang:prompt_tokens_total"] == 1000.0
    assert m["sglang:queue_time_seconds_sum"] == pytest.approx(0.6)  # streaming + not
    assert m["sglang:queue_time_seconds_count"] == 5.0
    assert "other_metric" not in m


def row(t, **m):
    names = {
        "running": "sglang:num_running_reqs",
        "queued": "sglang:num_queue_reqs",
        "usage": "sglang:token_usage",
        "qsum": "sglang:queue_time_seconds_sum",
        "qcount": "sglang:queue_time_seconds_count",
        "prompt": "sglang:prompt_tokens_total",
        "cached": "sglang:cached_tokens_total",
        "retracted": "sglang:num_retracted_requests_total",
    }
    return {"t": t, "url": "http://s", "m": {names[k]: float(v) for k, v in m.items()}}


def test_server_summary_over_the_window():
    rows = [
        row(0, running=1, queued=0, usage=0.1, qsum=0, qcount=0, prompt=0, cached=0, retracted=0),
        row(10, running=4, queued=2, usage=0.5, qsum=1.0, qcount=10, prompt=1000, cached=0, retracted=0),
        row(11, running=8, queued=6, usage=0.9, qsum=3.0, qcount=20, prompt=2000, cached=600, retracted=3),
        row(12, running=6, queued=0, usage=0.7, qsum=4.0, qcount=30, prompt=3000, cached=1200, retracted=5),
        row(30, running=0, queued=0, usage=1.0, qsum=9.0, qcount=31, prompt=9000, cached=1200, retracted=9),
    ]
    s = server_summary(rows, 10, 12)  # the scrapes at 0 and 30 are outside the window
    assert s["available"] and s["scrapes"] == 3
    assert s["mean_queue_time_ms"] == pytest.approx((4.0 - 1.0) / (30 - 10) * 1000)
    assert s["peak_token_usage"] == 0.9
    assert s["mean_running"] == pytest.approx(6.0) and s["max_running"] == 8
    assert s["mean_queued"] == pytest.approx(8 / 3) and s["max_queued"] == 6
    assert s["cache_hit_rate"] == pytest.approx(1200 / 2000)
    assert s["retractions"] == 5
    errors = [
        {"t": 11, "url": "http://s", "error": "GET /metrics: HTTP 404 (start SGLang with --enable-metrics)"}
    ]
    none = server_summary(errors, 10, 12)
    assert none["available"] is False and "enable-metrics" in none["errors"][0]


PROFILE = """\
name: scrape
seed: 2
target: {{url: embedded, embedded: {{gpu: h100-80gb, enable_metrics: {metrics}, max_running_requests: 4}}}}
load: {{model: closed, concurrency: 8}}
requests: {{warmup: 0, measured: 96}}
workload: {{kind: random_prefix, input_len: 64, output_len: 48}}
"""


@pytest.mark.parametrize("metrics", [True, False])
def test_a_run_reports_the_servers_side(tmp_path, metrics):
    profile = tmp_path / "p.yaml"
    profile.write_text(PROFILE.format(metrics=str(metrics).lower()))
    # Without /metrics only the 404 is checked: 24 requests are enough (the first scrape is at the start).
    fewer = [] if metrics else ["--num-requests", "24"]
    done = subprocess.run([sys.executable, "-m", "loadlab", "run", str(profile), "--out", str(tmp_path), *fewer],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    run = Path(done.stdout.strip().splitlines()[-1])
    server = json.loads((run / "summary.json").read_text())["server"]
    md = (run / "summary.md").read_text()
    if not metrics:
        assert server["available"] is False and "enable-metrics" in server["errors"][0]
        assert "Unavailable: GET /metrics: HTTP 404" in md
        return
    # 8 users against a server that runs at most 4: the limit binds and the rest queue.
    assert server["available"] and server["max_running"] == 4 and server["max_queued"] >= 1
    assert server["mean_queue_time_ms"] > 0 and 0 < server["peak_token_usage"] < 0.05
    # Each request's own queue time (meta_info.queue_time) agrees with /metrics' histogram, within what
    # the scrapes at the window's edges miss (counters are differenced between the first and last scrape).
    summary = json.loads((run / "summary.json").read_text())
    assert summary["samples"]["server_queue_ms"] == 96 and server["queue_time_source"] == "metrics"
    assert summary["mean_server_queue_ms"] == pytest.approx(server["mean_queue_time_ms"], rel=0.1)
    assert "| Server queue (meta_info) | 96 |" in md
    assert "Mean queue delay:" in md and "Running requests: mean" in md


def test_a_cluster_is_summed_per_scrape_round():
    a = [row(t, running=r) for t, r in ((0.0, 3), (1.0, 5), (2.0, 2))]
    b = [{**row(t + 0.01, running=r), "url": "http://other"} for t, r in ((0.0, 4), (1.0, 4), (2.0, 8))]
    times, running = gauge_series(a + b, "sglang:num_running_reqs")
    assert times == [0.0, 1.0, 2.0] and running == [7, 9, 10]
    s = server_summary(a + b, None, None)
    assert s["servers"] == 2 and s["max_running"] == 10 and s["mean_running"] == pytest.approx(26 / 3)
    # Numbered rounds: a failed scrape of b leaves its round out instead of shifting b's later values.
    a = [{**row(t, running=t), "round": t} for t in range(5)]
    b = [{**row(t + 0.01, running=10 * t), "url": "http://other", "round": t} for t in range(5)]
    b[1] = {"t": 1.01, "url": "http://other", "error": "GET /metrics: timed out", "round": 1}
    times, running = gauge_series(a + b, "sglang:num_running_reqs")
    assert times == [0, 2, 3, 4] and running == [0, 22, 33, 44]
    # The scrape interval is one server's: two servers scraped 10 ms apart each second read 1 s, not 10 ms.
    assert scrape_interval(a + b) == pytest.approx(1.0)


def test_metrics_urls_scrapes_every_server_listed(tmp_path):
    from loadlab.procs import free_port
    from loadlab.target.launch import LaunchedServer

    servers = []
    try:
        for name in ("a", "b"):  # b gets no traffic: its series is there, at zero
            port = free_port()
            argv = ["loadlab", "sim", "--port", str(port), "--gpu", "h100-80gb", "--max-running-requests", "4",
                    "--enable-metrics"]  # fmt: skip
            server = LaunchedServer(argv, f"http://127.0.0.1:{port}", 60, tmp_path / f"{name}.log")
            servers.append(server)
            server.start()
        urls = [s.url for s in servers]
        profile = tmp_path / "p.yaml"
        profile.write_text(
            PROFILE.format(metrics="true").replace(
                "url: embedded, embedded: {gpu: h100-80gb, enable_metrics: true, max_running_requests: 4}",
                f"url: '{urls[0]}', metrics_urls: {json.dumps(urls)}, metrics_interval_s: 0.1",
            )  # fmt: skip
        )
        # 8 users on a server that runs 4: 4 running from the first wave on; 32 requests are 4 waves.
        done = subprocess.run([sys.executable, "-m", "loadlab", "run", str(profile), "--out", str(tmp_path),
                               "--num-requests", "32"], capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
    finally:
        for server in servers:
            server.stop()
    run = Path(done.stdout.strip().splitlines()[-1])
    lines = [json.loads(line) for line in (run / "server_metrics.jsonl").read_text().splitlines()]
    assert {line["url"] for line in lines} == set(urls)
    server = json.loads((run / "summary.json").read_text())["server"]
    # 8 users on server a (at most 4 running) and none on b: the sum per round peaks at 4.
    assert server["servers"] == 2 and server["max_running"] == 4


def test_a_run_shorter_than_the_scrapers_start_still_has_a_round(tmp_path):
    """The scraper process needs its imports before its first round (~0.6 s, seconds on a busy machine): a
    run that ends sooner stopped it with nothing written (a 1.7 s cluster run in CI had no server figures).
    Its stop then takes the round itself; a scraper that wrote its rounds gets none added."""
    import time

    from loadlab.records import SERVER_METRICS
    from loadlab.target.scraper import Scraper
    from loadlab.testing.servers import started_twins

    with started_twins(["--enable-metrics"], ["--enable-metrics"]) as twins:
        urls = [t.url for t in twins]
        early = tmp_path / "early"
        early.mkdir()
        Scraper(urls, early).start().stop()  # SIGTERM during its imports
        rows = [json.loads(line) for line in (early / SERVER_METRICS).read_text().splitlines()]
        assert [(r["url"], r["round"]) for r in rows] == [(u, 0) for u in urls]
        assert all("sglang:num_running_reqs" in r["m"] for r in rows)

        late = tmp_path / "late"
        late.mkdir()
        scraper = Scraper(urls, late, interval_s=0.2).start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len((late / SERVER_METRICS).read_text().splitlines() if
                                                  (late / SERVER_METRICS).exists() else []) < 2 * len(urls):  # fmt: skip
            time.sleep(0.05)
        scraper.stop()
        rows = [json.loads(line) for line in (late / SERVER_METRICS).read_text().splitlines()]
        rounds = [r["round"] for r in rows]
        assert len(rows) >= 2 * len(urls) and rounds == sorted(rounds)  # the child's rounds only, in order
        assert all(rounds.count(k) == len(urls) for k in set(rounds))
