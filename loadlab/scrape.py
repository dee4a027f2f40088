"""Server metrics during a run: SGLang's Prometheus ``/metrics``, scraped at a fixed interval.

The scraper runs as its own process (``python -m loadlab.scrape``), never inside a load generator: parsing
a metrics page takes milliseconds of CPU, which would delay token timestamps. Each scrape is one flushed
JSON line in ``server_metrics.jsonl`` of the run directory: ``{"t": epoch s, "url": ..., "m": {name:
value}}`` with ``sglang:`` names (label sets summed for counters and histograms, the largest value taken
for gauges), or ``"error"`` when the page could not be read. ``server_summary`` turns the lines into the
seed's server-side columns; a target without ``/metrics`` leaves them unavailable, nothing else.
"""

from __future__ import annotations

import argparse
import itertools
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

SERVER_METRICS = "server_metrics.jsonl"
DEFAULT_INTERVAL_S = 1.0
GAUGES = (
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "sglang:token_usage",
    "sglang:num_used_tokens",
    "sglang:max_total_num_tokens",
    "sglang:gen_throughput",
    "sglang:cache_hit_rate",
    "sglang:num_retracted_reqs",
)
COUNTERS = (
    "sglang:prompt_tokens_total",
    "sglang:generation_tokens_total",
    "sglang:num_requests_total",
    "sglang:cached_tokens_total",
    "sglang:num_aborted_requests_total",
    "sglang:num_retracted_requests_total",
    "sglang:queue_time_seconds_sum",
    "sglang:queue_time_seconds_count",
    "sglang:time_to_first_token_seconds_sum",
    "sglang:time_to_first_token_seconds_count",
)


def parse_metrics(text: str) -> dict[str, float]:
    """The wanted ``sglang:`` samples of a Prometheus text page."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, value = sample.name, float(sample.value)
            if name in GAUGES:
                out[name] = max(out.get(name, value), value)
            elif name in COUNTERS:
                out[name] = out.get(name, 0.0) + value
    return out


def scrape_once(url: str, timeout_s: float = 2.0) -> dict[str, Any]:
    line: dict[str, Any] = {"t": time.time(), "url": url}
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout_s) as r:
            line["m"] = parse_metrics(r.read().decode("utf-8", "replace"))
    except urllib.error.HTTPError as e:
        why = " (start SGLang with --enable-metrics)" if e.code == 404 else ""
        line["error"] = f"GET /metrics: HTTP {e.code}{why}"
    except (OSError, ValueError) as e:
        line["error"] = f"GET /metrics: {e}"
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadlab.scrape", description=__doc__.splitlines()[0])
    parser.add_argument("urls", nargs="+", help="server base URLs")
    parser.add_argument("--out", required=True, help="JSONL file to append to")
    parser.add_argument("--interval", type=float, default=DEFAULT_INTERVAL_S)
    args = parser.parse_args(argv)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    with open(args.out, "a") as f:
        next_t, round_no = time.monotonic(), 0
        while not stop:
            for url in args.urls:  # a round: every server once; the round number lines their series up
                f.write(json.dumps({**scrape_once(url), "round": round_no}) + "\n")
            f.flush()
            round_no += 1
            next_t += args.interval
            time.sleep(max(0.0, next_t - time.monotonic()))
    return 0


class Scraper:
    """The scraper process of a run (started by the process that owns the run directory)."""

    def __init__(self, urls: list[str], run_dir: Path, interval_s: float = DEFAULT_INTERVAL_S):
        self.cmd = [sys.executable, "-m", "loadlab.scrape", *urls, "--out", str(Path(run_dir) / SERVER_METRICS),
                    "--interval", str(interval_s)]  # fmt: skip
        self.proc: subprocess.Popen | None = None

    def start(self) -> Scraper:
        from loadlab.target import die_with_parent

        self.proc = subprocess.Popen(self.cmd, preexec_fn=die_with_parent, start_new_session=True,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)  # fmt: skip
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def scrape_interval(rows: list[dict[str, Any]]) -> float:
    """The interval the rows were scraped at (the median gap between one server's scrapes),
    DEFAULT_INTERVAL_S with too few rows."""
    by_url: dict[str, list[float]] = {}
    for r in rows:
        if isinstance(r.get("t"), int | float):
            by_url.setdefault(r.get("url", ""), []).append(r["t"])
    gaps = sorted(b - a for t in by_url.values() for a, b in itertools.pairwise(sorted(t)))
    return gaps[len(gaps) // 2] if len(gaps) >= 2 else DEFAULT_INTERVAL_S


def read_server_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / SERVER_METRICS
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a torn last line
    return rows


def gauge_series(rows: list[dict[str, Any]], name: str) -> tuple[list[float], list[float]]:
    """A gauge per scrape round (at the round's first scrape), summed across the servers: the requests
    running or queued in a cluster are the sum of its servers'. A round where a server's value is missing
    (a failed scrape, the edge of a window) is left out rather than summed short."""
    servers = {r["url"] for r in rows if "m" in r}
    rounds: dict[Any, dict[str, tuple[float, float]]] = {}
    position: dict[str, int] = {}
    for r in rows:
        url = r.get("url")
        key = r.get("round")
        if key is None:  # written before rounds were numbered: the n-th scrape of each server
            key = position[url] = position.get(url, -1) + 1
        if "m" in r and name in r["m"]:
            rounds.setdefault(key, {})[url] = (r["t"], r["m"][name])
    whole = [by_url for _, by_url in sorted(rounds.items()) if set(by_url) == servers]
    return [min(t for t, _ in b.values()) for b in whole], [sum(v for _, v in b.values()) for b in whole]


def server_summary(rows: list[dict[str, Any]], start: float | None, end: float | None) -> dict[str, Any]:
    """The seed's server-side columns over [start, end] (the measured window, epoch s), per target URL
    summed or maxed across servers: mean queue delay, peak KV usage, running and queued requests,
    cache-hit rate, retractions. ``available`` is False when no scrape in the window had metrics."""
    good = [r for r in rows if "m" in r and (start is None or start <= r["t"] <= (end or r["t"]))]
    errors = sorted({r["error"] for r in rows if "error" in r})
    if not good:
        return {"available": False, "scrapes": 0, "errors": errors[:3]}
    by_url: dict[str, list[dict[str, Any]]] = {}
    for r in good:
        by_url.setdefault(r["url"], []).append(r["m"])

    def delta(name: str) -> float | None:
        total, seen = 0.0, False
        for series in by_url.values():
            values = [m[name] for m in series if name in m]
            if len(values) >= 2:
                total += values[-1] - values[0]
                seen = True
        return total if seen else None

    def gauge(name: str) -> list[float]:
        return gauge_series(good, name)[1]

    def stat(values: list[float], fn) -> float | None:
        return float(fn(values)) if values else None

    q_sum, q_count = delta("sglang:queue_time_seconds_sum"), delta("sglang:queue_time_seconds_count")
    cached, prompt = delta("sglang:cached_tokens_total"), delta("sglang:prompt_tokens_total")
    usage = [m["sglang:token_usage"] for s in by_url.values() for m in s if "sglang:token_usage" in m]
    running, queued = gauge("sglang:num_running_reqs"), gauge("sglang:num_queue_reqs")
    retracted = delta("sglang:num_retracted_requests_total")
    return {
        "available": True,
        "servers": len(by_url),
        "scrapes": len(good),
        "mean_queue_time_ms": q_sum / q_count * 1000.0 if q_sum is not None and q_count else None,
        "peak_token_usage": stat(usage, max),
        "mean_running": stat(running, lambda v: sum(v) / len(v)),
        "max_running": stat(running, max),
        "mean_queued": stat(queued, lambda v: sum(v) / len(v)),
        "max_queued": stat(queued, max),
        "cache_hit_rate": cached / prompt if cached is not None and prompt else None,
        "retractions": retracted,
        "errors": errors[:3],
    }


if __name__ == "__main__":
    sys.exit(main())
