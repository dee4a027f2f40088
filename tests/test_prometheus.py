"""Prometheus: a headless distributed run's master serves loadlab's live histograms on --metrics-port while
the run goes (scraped and parsed mid-run, checked against the final summary); a taken port is a one-line
error; the Grafana dashboard plots only metrics loadlab or SGLang export. (The exact equality of the
counts with summary.json at the end of a run: tests/test_web_ui.py, where the process stays up.)"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from loadlab.procs import free_port

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "deploy" / "grafana" / "loadlab.json"
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
PROFILE = """\
name: prom
seed: 4
target: {url: embedded, embedded: {gpu: h100-80gb, enable_metrics: true}}
load: {model: closed, concurrency: 8}
requests: {warmup: 4, measured: 96}
workload: {kind: random_prefix, input_len: 64, output_len: 48}
slo: {ttft_p95_ms: 5000}
"""


def scrape(url: str) -> dict[str, list]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def total(samples, name: str, **labels) -> float:
    return sum(
        s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_a_headless_masters_metrics_port_shows_the_live_histograms(tmp_path):
    profile = tmp_path / "prom.yaml"
    profile.write_text(PROFILE)
    port = free_port()
    cmd = [sys.executable, "-m", "loadlab", "run", str(profile), "--workers", "1", "--out", str(tmp_path / "out"),
           "--run-name", "run", "--metrics-port", str(port), "--metrics-host", "127.0.0.1"]  # fmt: skip
    log = tmp_path / "run.log"
    with open(log, "wb") as out:  # a file, not a pipe: nobody reads a pipe while the run goes
        proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=out, stderr=subprocess.STDOUT)
    scrapes = []
    deadline = time.monotonic() + 120
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                families = scrape(f"http://127.0.0.1:{port}/metrics")
            except OSError:  # not listening yet, or the run just ended
                time.sleep(0.2)
                continue
            if "loadlab_ttft_seconds" in families:
                scrapes.append(families)
            time.sleep(0.25)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert proc.returncode == 0, log.read_text()[-3000:]
    summary = json.loads((tmp_path / "out" / "run" / "summary.json").read_text())
    assert summary["completed"] == 96
    # Mid-run: a scrape with some, not all, measured requests done, parsed as histograms.
    counts = [total(f["loadlab_ttft_seconds"], "loadlab_ttft_seconds_count") for f in scrapes]
    assert any(0 < c < summary["samples"]["ttft_ms"] for c in counts), counts
    print(f"{len(scrapes)} scrapes during the run, TTFT counts {counts}")
    assert counts == sorted(counts) and max(counts) <= summary["samples"]["ttft_ms"]
    for families in scrapes:  # each scrape is consistent in itself and never ahead of the final summary
        ttft = families["loadlab_ttft_seconds"]
        ok = total(families["loadlab_requests"], "loadlab_requests_total", phase="measure", outcome="ok")
        assert total(ttft, "loadlab_ttft_seconds_count") == ok
        assert total(ttft, "loadlab_ttft_seconds_bucket", le="+Inf") == ok
        itl = total(families["loadlab_itl_seconds"], "loadlab_itl_seconds_count")
        assert itl <= summary["samples"]["itl_ms"]
        tokens = total(families["loadlab_output_tokens"], "loadlab_output_tokens_total")
        assert tokens <= summary["total_output_tokens"]
        assert 0 <= families["loadlab_requests_in_flight"][0].value <= 8
        (info,) = families["loadlab_run_info"]
        assert info.labels["run_id"] == "run" and info.labels["profile"] == "prom"


def test_a_taken_metrics_port_is_a_one_line_error(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "locust", "-f", "locustfile.py", "--headless", "--out", str(tmp_path),
             "--metrics-port", str(port), "--metrics-host", "127.0.0.1"],
            cwd=REPO, env=ENV, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"loadlab: --metrics-port: cannot listen on 127.0.0.1:{port} (Address already in use)"
    )
    assert not list(tmp_path.iterdir())  # it failed before any run (or embedded server) started


# -- the Grafana dashboard --------------------------------------------------------------------------------
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or",
                "unless", "le"}  # fmt: skip


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers that are not functions, keywords, label
    names or the contents of strings, label matchers and ranges."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring)\s*\([^)]*\)", "", expr)
    names = set()
    for m in re.finditer(r"(?<![\w:$.])([A-Za-z_:][\w:]*)(\s*\()?", expr):
        if m.group(2) is None and m.group(1) not in PROMQL_WORDS:
            names.add(m.group(1))
    return names


def exported_names() -> set[str]:
    """Every sample name loadlab's /metrics and the twin's (SGLang's names) can show."""
    from loadlab.sim.server import _Metrics
    from loadlab.swarm.exporter import METRIC_NAMES

    class Engine:  # the twin's metrics need only its counters and gauges
        def stats(self):
            keys = [n for n, _ in (*_Metrics.GAUGES, *_Metrics.COUNTERS)] + ["num_retractions_total"]
            return dict.fromkeys(keys, 0)

    sglang = {s.name for f in text_string_to_metric_families(_Metrics(Engine(), "m").render().decode())
              for s in f.samples}  # fmt: skip
    histograms = [n for n in METRIC_NAMES if n.endswith("_seconds")]
    ours = set(METRIC_NAMES) | {f"{n}_{suffix}" for n in histograms for suffix in ("bucket", "sum", "count")}
    return sglang | ours


def test_the_grafana_dashboard_plots_only_exported_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    known = exported_names()
    assert "sglang:time_to_first_token_seconds_bucket" in known and "loadlab_ttft_seconds_bucket" in known
    assert metric_names('sum by (le) (rate(a_b{x="y{z}"}[5m])) / on (i) b:c') == {"a_b", "b:c"}
    read: set[str] = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = metric_names(target["expr"])
            assert names, (panel["title"], target["expr"])
            assert names <= known, (panel["title"], names - known)
            read |= names
    # Beside SGLang's own: TTFT, running requests and KV usage at least.
    assert {
        "sglang:time_to_first_token_seconds_bucket",
        "sglang:num_running_reqs",
        "sglang:token_usage",
    } <= read
    assert {"loadlab_ttft_seconds_bucket", "loadlab_requests_in_flight", "loadlab_slo_attainment"} <= read


def test_every_metric_is_documented():
    from loadlab.swarm.exporter import METRIC_NAMES

    text = (REPO / "docs" / "web-ui.md").read_text()
    missing = [name for name in METRIC_NAMES if f"`{name}`" not in text]
    assert not missing, f"docs/web-ui.md does not document {missing}"
