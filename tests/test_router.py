"""Two twins behind the real sglang-router (PyPI ``sglang-router``, a Rust binary): what a router needs of a
worker, and attribution through it. Skipped when ``sglang_router`` is not installed.

Everything listens on 127.0.0.1. At start the router tries to fetch a tokenizer from the model hub for the
workers' model name; offline that fails and it carries on.
"""

from __future__ import annotations

import http.client
import json
import sys
import time
from pathlib import Path

import orjson
import pytest
import yaml
from conftest import run_loadlab

from loadlab.procs import free_port, spawn, stop
from loadlab.testing.servers import start_twin

pytest.importorskip("sglang_router", reason="sglang-router is not installed (pip install sglang-router)")

OUTPUT_LEN = 48  # about 0.6 s per request: several scrapes of each worker during the run
MEASURED = 12


def _request(port: int, method: str, path: str, body=None, headers=None, timeout_s: float = 30.0):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        data = None if body is None else orjson.dumps(body)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, r.getheaders(), r.read()
    finally:
        conn.close()


def _header(headers: list[tuple[str, str]], name: str) -> list[str]:
    return [v for k, v in headers if k.lower() == name]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two twins (metrics on) and sglang-router in front of them, round robin; yields (router port, worker
    URLs)."""
    workers = [
        start_twin("--log-level", "warning", "--enable-metrics", "--enable-cache-report") for _ in range(2)
    ]
    port = free_port()
    log = tmp_path_factory.mktemp("router") / "router.log"
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *(w.url for w in workers), "--policy", "round_robin", "--log-level", "warn",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]  # fmt: skip
    with open(log, "wb") as sink:
        router = spawn(argv, stdout=sink, stderr=sink)
    try:
        # Ready when a request gets through to both workers (the router registers them in the background).
        deadline, seen = time.monotonic() + 60, set()
        body = {"input_ids": [11, 12, 13], "sampling_params": {"max_new_tokens": 1}, "stream": False}
        while seen != {w.url for w in workers}:
            assert router.poll() is None, f"sglang-router exited: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, (
                f"sglang-router never served both workers: {log.read_text()[-3000:]}"
            )
            try:
                status, headers, _ = _request(port, "POST", "/generate", body, timeout_s=5)
            except OSError:
                status = None
            if status == 200:
                seen.update(_header(headers, "x-loadlab-worker"))
            else:
                time.sleep(0.3)
        yield port, [w.url for w in workers]
    finally:
        stop(router)
        for w in workers:
            w.stop()


def test_worker_header_and_request_id_come_through_the_router(cluster):
    port, urls = cluster
    served = []
    for n in range(4):
        status, headers, raw = _request(
            port,
            "POST",
            "/generate",
            {"input_ids": list(range(100, 140)), "sampling_params": {"max_new_tokens": 5, "ignore_eos": True},
             "stream": True},
            headers={"X-Request-ID": f"attr-{n}"},
        )  # fmt: skip
        assert status == 200 and raw.endswith(b"data: [DONE]\n\n")
        (worker,) = _header(headers, "x-loadlab-worker")  # exactly one: the worker's, passed through
        served.append(worker)
        assert f"attr-{n}" in _header(headers, "x-request-id")
        events = [orjson.loads(b[6:]) for b in raw.split(b"\n\n") if b.startswith(b"data: {")]
        assert [e["meta_info"]["completion_tokens"] for e in events] == [1, 2, 3, 4, 5]
    assert sorted(served) == sorted(urls * 2)  # round robin: two each
    # What the router reads of each worker, straight from a worker.
    wport = int(urls[0].rsplit(":", 1)[1])
    status, headers, raw = _request(wport, "GET", "/get_load")
    assert status == 200 and _header(headers, "x-loadlab-worker") == [urls[0]]
    (load,) = json.loads(raw)
    assert load == {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}


@pytest.mark.parametrize("api", ["generate", "completions", "chat"])
def test_every_api_streams_through_the_router_attributed_to_its_worker(cluster, tmp_path, api):
    port, urls = cluster
    profile = {
        "name": f"router-{api}",
        "seed": 5,
        "target": {"api": api, "metrics_urls": urls, "metrics_interval_s": 0.25},
        "load": {"concurrency": 4},
        "requests": {"warmup": 0, "measured": MEASURED},
        "workload": {"kind": "random_prefix", "input_len": 64, "output_len": OUTPUT_LEN},
    }
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(profile))
    run = run_loadlab(path, f"http://127.0.0.1:{port}", tmp_path / "runs", timeout_s=150)
    assert run.returncode == 0, run.explain()
    df = run.records()
    assert len(df) == MEASURED and (df.outcome == "ok").all(), df[["outcome", "error"]].to_string()
    # The token streams came through intact: every token, counted by the server and carried by the events.
    assert (df.output_tokens == OUTPUT_LEN).all()
    assert all(sum(tokens) == OUTPUT_LEN for tokens in df.arrival_tokens)
    assert all(len(ms) == OUTPUT_LEN for ms in df.arrival_ms)  # stream_interval 1: one event per token
    # Each record names the worker that served it; round robin spreads them over both.
    assert set(df.served_by) == set(urls) and (df.status_source == "worker").all()
    counts = df.served_by.value_counts()
    assert abs(counts[urls[0]] - counts[urls[1]]) <= 2, counts
    summary = json.loads((run.run_dir / "summary.json").read_text())
    workers = {w["served_by"]: w for w in summary["workers"]}
    assert set(workers) == set(urls) and summary["unattributed_requests"] == 0
    assert sum(w["completed"] for w in workers.values()) == summary["completed"] == MEASURED
    for url in urls:
        assert workers[url]["completed"] == counts[url]
        assert workers[url]["total_output_tokens"] == counts[url] * OUTPUT_LEN
        # Scraped by its own URL (target.metrics_urls): the worker's own KV peak (4 x 112 of 440k tokens
        # at most).
        assert 0 <= workers[url]["peak_token_usage"] < 0.002
    assert max(w["peak_token_usage"] for w in workers.values()) > 0
    md = Path(run.run_dir / "summary.md").read_text()
    assert "## Per worker" in md and all(f"| {url} |" in md for url in urls)
