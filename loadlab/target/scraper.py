"""Server metrics during a run: SGLang's Prometheus ``/metrics``, scraped at a fixed interval.

The scraper runs as its own process (``python -m loadlab.target.scraper``), never inside a load generator: parsing
a metrics page takes milliseconds of CPU, which would delay token timestamps. Each scrape is one flushed
JSON line in ``server_metrics.jsonl`` of the run directory: ``{"t": epoch s, "url": ..., "m": {name:
value}}`` with ``sglang:`` names (label sets summed for counters and histograms, the largest value taken
for gauges), or ``"error"`` when the page could not be read. The lines become the
seed's server-side columns (``loadlab.analysis.server_metrics`` reads the file); a target without
``/metrics`` leaves them unavailable, nothing else.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from loadlab.procs import spawn, stop
from loadlab.profile import API_KEY_ENV, auth_headers
from loadlab.records import DEFAULT_SCRAPE_INTERVAL_S, SERVER_METRICS

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


def scrape_once(url: str, timeout_s: float = 2.0, api_key: str | None = None) -> dict[str, Any]:
    line: dict[str, Any] = {"t": time.time(), "url": url}
    # SGLang leaves /metrics open with --api-key; a gateway in front may not: the key goes along.
    request = urllib.request.Request(url.rstrip("/") + "/metrics", headers=auth_headers(api_key))
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            line["m"] = parse_metrics(r.read().decode("utf-8", "replace"))
    except urllib.error.HTTPError as e:
        why = " (start SGLang with --enable-metrics)" if e.code == 404 else ""
        line["error"] = f"GET /metrics: HTTP {e.code}{why}"
    except (OSError, ValueError) as e:
        line["error"] = f"GET /metrics: {e}"
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadlab.target.scraper", description=__doc__.splitlines()[0]
    )
    parser.add_argument("urls", nargs="+", help="server base URLs")
    parser.add_argument("--out", required=True, help="JSONL file to append to")
    parser.add_argument("--interval", type=float, default=DEFAULT_SCRAPE_INTERVAL_S)
    args = parser.parse_args(argv)
    api_key = os.environ.get(API_KEY_ENV) or None  # the run's key, from its environment (never argv)
    # SIGTERM (the run's end) ends the wait for the next round at once, not after the rest of an interval.
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with open(args.out, "a") as f:
        next_t, round_no = time.monotonic(), 0
        while not stop.is_set():
            for url in args.urls:  # a round: every server once; the round number lines their series up
                f.write(json.dumps({**scrape_once(url, api_key=api_key), "round": round_no}) + "\n")
            f.flush()
            round_no += 1
            next_t += args.interval
            stop.wait(max(0.0, next_t - time.monotonic()))
    return 0


class Scraper:
    """The scraper process of a run (started by the process that owns the run directory)."""

    def __init__(
        self,
        urls: list[str],
        run_dir: Path,
        interval_s: float = DEFAULT_SCRAPE_INTERVAL_S,
        api_key: str | None = None,
    ):
        self.urls, self.out, self.api_key = urls, Path(run_dir) / SERVER_METRICS, api_key
        self.cmd = [sys.executable, "-m", "loadlab.target.scraper", *urls, "--out", str(self.out),
                    "--interval", str(interval_s)]  # fmt: skip
        # The run's key reaches the child in its environment under one name, whatever the profile named.
        self.env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
        if api_key:
            self.env[API_KEY_ENV] = api_key
        self.proc: subprocess.Popen | None = None

    def start(self) -> Scraper:
        self.proc = spawn(self.cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=self.env)
        return self

    def stop(self) -> None:
        stop(self.proc, timeout_s=5)
        self._round_if_none()

    def _round_if_none(self) -> None:
        """A run shorter than the process's start (its imports take ~0.6 s, seconds on a busy machine; SIGTERM
        before them kills it) would have no server figures at all: then one round is taken here, at the end."""
        rows = []
        with contextlib.suppress(FileNotFoundError), open(self.out) as f:  # the first round is enough to know
            for line in itertools.islice(f, len(self.urls)):
                with contextlib.suppress(ValueError):  # a line cut short by a SIGKILL mid-write
                    rows.append(json.loads(line))
        if {r.get("url") for r in rows} >= set(self.urls):
            return
        last = max((r["round"] for r in rows if isinstance(r.get("round"), int)), default=-1)
        with open(self.out, "a") as f:
            for url in self.urls:
                f.write(json.dumps({**scrape_once(url, api_key=self.api_key), "round": last + 1}) + "\n")


if __name__ == "__main__":
    sys.exit(main())
