"""The same users in Locust's web UI: TTFT / TPOT / E2E appear live, and a finished run writes its report;
the LLM tab's rows (in /stats/requests), the run's files and /metrics (on the web UI and --metrics-port)
equal the finished run's summary.json. tests/test_web_ui_browser.py clicks through the same in Chromium."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from loadlab.procs import free_port

REPO = Path(__file__).resolve().parents[1]


def _get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


def _wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_web_ui_shows_token_latencies_and_writes_the_report(tmp_path):
    port, metrics_port = free_port(), free_port()
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "locust", "-f", "locustfile.py",
            "--web-host", "127.0.0.1", "--web-port", str(port),
            "--metrics-port", str(metrics_port), "--metrics-host", "127.0.0.1",
            "--out", str(tmp_path), "--num-requests", "40", "--warmup-requests", "4", "--output-len", "16",
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:

        def ui_up():
            try:
                return _get_json(base + "/stats/requests")
            except OSError:
                return None

        _wait_for(ui_up, 30, "the web UI")
        llm = _get_json(base + "/stats/requests")["extended_stats"]
        assert llm == [{"key": "llm", "data": [{"scope": "run", "figure": "state", "p50": "", "p95": "", "p99": "",
                                                "value": "no run yet: press Start"}]}]  # fmt: skip
        assert _get(base + "/loadlab/files/summary.md") == (404, b"loadlab: no run yet: press Start\n")
        form = urllib.parse.urlencode({"user_count": 8, "spawn_rate": 8}).encode()
        with urllib.request.urlopen(base + "/swarm", data=form, timeout=5) as resp:
            assert json.loads(resp.read())["success"] is True

        def names_seen():
            stats = _get_json(base + "/stats/requests")["stats"]
            names = {s["name"] for s in stats if s["num_requests"] > 0}
            return names if {"TTFT", "TPOT", "E2E"} <= names else None

        _wait_for(names_seen, 60, "TTFT/TPOT/E2E in the live statistics")
        # The run ends by itself after 44 requests and the UI stays up, stopped.
        _wait_for(lambda: _get_json(base + "/stats/requests")["state"] == "stopped", 90, "the run to stop")
        (run_dir,) = list(tmp_path.iterdir())
        _wait_for(lambda: (run_dir / "summary.json").exists(), 30, "summary.json")
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["completed"] == 40 and summary["failed"] == 0
        e2e = [s for s in _get_json(base + "/stats/requests")["stats"] if s["name"] == "E2E"]
        assert sum(s["num_requests"] for s in e2e) == 44  # warm-up rows are listed apart, as "warm-up"
        check_llm_rows(base, summary)
        for name in ("summary.md", "report.html", "records.parquet"):
            assert _get(f"{base}/loadlab/files/{name}") == (200, (run_dir / name).read_bytes())
        assert _get(f"{base}/loadlab/files/manifest.json")[0] == 404  # only the three report files
        for url in (base + "/metrics", f"http://127.0.0.1:{metrics_port}/metrics"):
            check_metrics(url, summary)
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert "Traceback" not in proc.stderr.read()


def check_llm_rows(base: str, summary: dict) -> None:
    """The LLM tab's rows of the finished run: summary.json's figures to the displayed precision."""
    (tab,) = _get_json(base + "/stats/requests")["extended_stats"]
    rows = {(r["scope"], r["figure"]): r for r in tab["data"]}
    for label, stem in (
        ("TTFT", "ttft_ms"),
        ("TPOT", "tpot_ms"),
        ("ITL", "itl_ms"),
        ("E2E", "e2e_latency_ms"),
    ):
        row = rows[("run", f"{label} (ms)")]
        assert row["p50"] == f"{summary[f'median_{stem}']:.2f}"
        assert row["p95"] == f"{summary[f'p95_{stem}']:.2f}"
        assert row["p99"] == f"{summary[f'p99_{stem}']:.2f}"
        assert row["value"] == f"{summary['samples'][stem]} samples"
    assert rows[("run", "requests")]["value"] == f"40 measured: {summary['completed']} ok, 0 failed"
    assert rows[("run", "in flight")]["value"] == "0"
    assert rows[("run", "output tokens/s")]["value"].startswith(
        f"{summary['output_throughput']:.1f} over the run"
    )
    for o in summary["slo"]["objectives"]:
        word = "PASS" if o["pass"] else "FAIL"
        want = f"{word}: P95 {o['value_ms']:.2f} ms, limit {o['threshold_ms']:g} ms"
        assert rows[("run", f"SLO {o['key']}")]["value"] == want
    assert rows[("run", "SLO verdict")]["value"] == (
        "PASS so far" if summary["slo"]["pass"] else "FAIL so far"
    )
    assert rows[("server", "running / queued requests")]["value"].count("/") == 1


def check_metrics(url: str, summary: dict) -> None:
    """/metrics of the finished run: its counts are summary.json's."""
    status, body = _get(url)
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    for name, stem in (
        ("ttft", "ttft_ms"),
        ("tpot", "tpot_ms"),
        ("itl", "itl_ms"),
        ("e2e", "e2e_latency_ms"),
    ):
        family = families[f"loadlab_{name}_seconds"]
        assert family.type == "histogram"
        (count,) = [s.value for s in family.samples if s.name.endswith("_count")]
        assert count == summary["samples"][stem]
    by_outcome = {
        (s.labels["phase"], s.labels["outcome"]): s.value for s in families["loadlab_requests"].samples
    }
    assert by_outcome == {
        ("measure", "ok"): summary["completed"],
        ("warmup", "ok"): summary["warmup_requests"],
    }
    (tokens,) = families["loadlab_output_tokens"].samples
    assert tokens.value == summary["total_output_tokens"]
    attainment = {s.labels["objective"]: s.value for s in families["loadlab_slo_attainment"].samples}
    assert set(attainment) == {o["key"] for o in summary["slo"]["objectives"]}
    assert all(0 <= v <= 1 for v in attainment.values())
    (verdict,) = families["loadlab_slo_pass"].samples
    assert verdict.value == float(summary["slo"]["pass"])
