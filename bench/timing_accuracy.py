"""Benchmark: how exactly does loadlab's client time tokens? (not a test; results in bench/RESULTS.md)

Starts the scripted server (loadlab/testing/scripted.py: first event TTFT ms after the request, then one every
GAP ms, each write logged with its wall-clock time), runs `loadlab run` against it at several user counts,
joins records to the server log on server_id, and prints the client's TTFT and ITL error distribution:
  TTFT error = client TTFT - (server's first write - client send)
  ITL error  = client gap between events - server gap between the same writes

    python bench/timing_accuracy.py [--users 1 16 64] [--requests-per-user 4] [--tokens 32] [--gap-ms 20]
                                    [--scrape-every S]

--scrape-every S serves the live figures (--metrics-port) and scrapes /metrics every S seconds during each
run: what refreshing them costs the token timestamps.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

import numpy as np
from common import machine_line

from loadlab.procs import free_port
from loadlab.records import load_records
from loadlab.testing.scripted import read_log, timing_errors
from loadlab.testing.servers import start_scripted

REPO = Path(__file__).resolve().parents[1]
PROFILE = REPO / "tests" / "profiles" / "timing.yaml"


def stats(values) -> str:
    mags = np.abs(np.asarray(values, dtype=float))
    if not mags.size:
        return "n=0"
    p50, p95, p99 = np.percentile(mags, [50, 95, 99])
    return f"{p50:6.3f} {p95:6.3f} {p99:6.3f} {mags.max():7.3f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--requests-per-user", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--ttft-ms", type=float, default=100.0)
    parser.add_argument("--gap-ms", type=float, default=20.0)
    parser.add_argument("--case", default="normal", help="scripted case: normal, multi4, split, ...")
    parser.add_argument("--scrape-every", type=float, default=None, metavar="S",
                        help="serve --metrics-port and scrape it every S seconds during each run")  # fmt: skip
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="loadlab-bench-"))
    server = start_scripted(work / "server.jsonl", args.ttft_ms, args.gap_ms)
    log = server.log_path
    print(machine_line())
    print(f"# case {args.case}, TTFT {args.ttft_ms} ms, gap {args.gap_ms} ms, {args.tokens} tokens/request"
          + (f", /metrics scraped every {args.scrape_every} s" if args.scrape_every else ""))  # fmt: skip
    print("users events/s  |TTFT err| p50 p95 p99 max (ms)   |ITL err| p50 p95 p99 max (ms)   load")
    try:
        for users in args.users:
            measured = users * args.requests_per_user
            cmd = [sys.executable, "-m", "loadlab.cli", "run", str(PROFILE),
                   "--host", f"{server.url}/case/{args.case}", "--out", str(work / "runs"),
                   "--concurrency", str(users), "--warmup-requests", str(users),
                   "--num-requests", str(measured), "--output-len", str(args.tokens)]  # fmt: skip
            scrapes = None
            if args.scrape_every:
                port = free_port()
                cmd += ["--metrics-port", str(port), "--metrics-host", "127.0.0.1"]
                scrapes = Scrapes(f"http://127.0.0.1:{port}/metrics", args.scrape_every)
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
            if scrapes is not None:
                scrapes.stop()
            if proc.returncode != 0:
                print(proc.stderr[-2000:], file=sys.stderr)
                return 1
            records = load_records(Path(proc.stdout.strip().splitlines()[-1]))
            measure = records[records.phase == "measure"]
            ttft, itl, problems = timing_errors(measure, read_log(log))
            if problems:
                print(f"# {len(problems)} join problems, e.g. {problems[0]}", file=sys.stderr)
            rate = users * 1000.0 / args.gap_ms
            print(f"{users:5d} {rate:9.0f}   {stats(ttft)}      {stats(itl)}      {os.getloadavg()[0]:.2f}"
                  + (f"   ({scrapes.done} scrapes)" if scrapes else ""))  # fmt: skip
    finally:
        server.stop()
    return 0


class Scrapes:
    """GETs a URL every ``every`` seconds in a thread until stopped (failures while the run starts or ends
    are skipped)."""

    def __init__(self, url: str, every: float):
        self.url, self.every, self.done = url, every, 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stopped.wait(self.every):
            try:
                with urllib.request.urlopen(self.url, timeout=5) as resp:
                    resp.read()
                self.done += 1
            except OSError:
                pass

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()


if __name__ == "__main__":
    sys.exit(main())
