"""What a refresh of the live figures (the web UI's LLM tab, /metrics) costs as a run grows: synthetic
records (two SLO classes, four serving workers, one token per event) arrive in batches, as the records a
master receives between two 2 s polls; each refresh is timed as the web UI does it (queued records in,
every percentile, the tab's rows) and as a Prometheus scrape does it. At the end the live figures are
checked against the post-processor's summary of the same records (they must be equal).

    python bench/live_figures.py [--records 100000] [--tokens 64] [--batch 500]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
from common import machine_line

from loadlab.load import Tickets
from loadlab.profile import validate_profile
from loadlab.records import MEASURE, OK, TIMEOUT, RequestRecord
from loadlab.swarm.exporter import HISTOGRAMS, LiveCollector
from loadlab.swarm.live import LiveFigures
from loadlab.swarm.webui import table

CLASSES = ("interactive", "batch")
WORKERS = tuple(f"http://10.0.0.{i}:30000" for i in range(1, 5))


def records(n: int, tokens: int, seed: int = 0) -> list[RequestRecord]:
    rng = np.random.default_rng(seed)
    ttft = rng.lognormal(np.log(300.0), 0.6, n)
    gaps = rng.lognormal(np.log(20.0), 0.3, (n, tokens - 1))
    out = []
    for i in range(n):
        arrivals = np.concatenate([[ttft[i]], ttft[i] + np.cumsum(gaps[i])]).tolist()
        failed = i % 97 == 0
        out.append(
            RequestRecord(
                index=i, phase=MEASURE, api="generate", worker_id="bench", user_id=i % 500,
                t_send_wall=1.7e9 + i * 0.004, outcome=TIMEOUT if failed else OK,
                ttft_ms=None if failed else float(ttft[i]), e2e_ms=arrivals[-1] + 1.0,
                arrival_ms=[] if failed else arrivals, arrival_tokens=[] if failed else [1] * tokens,
                input_len=512, max_new_tokens=tokens, prompt_tokens=512,
                output_tokens=None if failed else tokens, served_by=WORKERS[i % len(WORKERS)],
                request_class=CLASSES[int(i % 4 == 0)],
            )
        )  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=500, help="records between two refreshes")
    args = parser.parse_args()
    print(machine_line())
    profile = validate_profile(
        {
            "name": "bench",
            "requests": {"warmup": 0, "measured": args.records},
            "workload": {"kind": "random_prefix", "input_len": 512, "output_len": args.tokens},
            "slo": {"ttft_p95_ms": 1000, "tpot_p95_ms": 50},
            "classes": [
                {"name": "interactive", "share": 0.75, "slo": {"ttft_p95_ms": 500}},
                {"name": "batch", "share": 0.25},
            ],
        }
    )
    recs = records(args.records, args.tokens)
    tickets = Tickets(0, args.records)
    with tempfile.TemporaryDirectory() as tmp:
        offloaded = [0.0]

        def offload(fn, *a):  # a Locust process runs these merges in a native thread: timed apart
            t = time.perf_counter()
            try:
                return fn(*a)
            finally:
                offloaded[0] += time.perf_counter() - t

        steps: list[float] = []

        def lane(fn, *a):  # a Locust process runs these steps in its users' CPU lane, one at a time
            t = time.perf_counter()
            try:
                return fn(*a)
            finally:
                steps.append((time.perf_counter() - t) * 1000)

        live = LiveFigures(profile, Path(tmp), tickets, lane=lane, offload=offload)
        collector = LiveCollector(None)
        collector.live = lambda: live  # no Locust environment here
        ui, loop, step, scrape = [], [], [], []
        marks = {args.records // 10, args.records // 2, args.records}
        print(f"{'records':>8} {'ITL samples':>12} {'refresh ms':>11} {'max':>7} {'on the loop':>12} {'max':>7} "
              f"{'scrape ms':>10} {'max':>7}")  # fmt: skip
        for start in range(0, args.records, args.batch):
            for rec in recs[start : start + args.batch]:
                live.add(rec)
                tickets.next_index += 1
                tickets.finished(rec.phase)
            offloaded[0] = 0.0
            steps.clear()
            t0 = time.perf_counter()
            live.lane(table, live.figures(now=1e12 + start))  # a new time: no cached snapshot
            t1 = time.perf_counter()
            list(collector.collect())
            t2 = time.perf_counter()
            ui.append((t1 - t0) * 1000)
            loop.append((t1 - t0 - offloaded[0]) * 1000)
            step.append(max(steps))
            scrape.append((t2 - t1) * 1000)
            done = min(start + args.batch, args.records)
            if any(start < m <= done for m in marks):
                cols = [f(x[-20:]) for x in (ui, loop, scrape) for f in (np.median, max)]
                print(f"{done:>8} {len(live.run.samples['itl_ms']):>12} " + " ".join(
                    f"{c:>{w}.2f}" for c, w in zip(cols, (11, 7, 12, 7, 10, 7), strict=True)))  # fmt: skip
        for name, x in (("refresh", ui), ("on the event loop", loop), ("its longest step", step),
                        ("scrape", scrape)):  # fmt: skip
            print(
                f"whole run, {name}: median {np.median(x):.2f} ms, P99 {np.percentile(x, 99):.2f} ms, max {max(x):.2f} ms"
            )
        check(live, recs)


def check(live: LiveFigures, recs: list[RequestRecord]) -> None:
    """The live figures against compute_summary over the same records."""
    import pandas as pd

    from loadlab.analysis import compute_summary

    frame = pd.DataFrame([{name: getattr(r, name) for name in r.__slots__} for r in recs])
    t0 = time.perf_counter()
    s = compute_summary(frame, None).dump()
    print(f"compute_summary over the same records: {time.perf_counter() - t0:.1f} s")
    f = live.figures(now=2e12)
    for metric in HISTOGRAMS:
        got = tuple(f["run"]["latencies"][metric])
        assert got == (s[f"median_{metric}"], s[f"p95_{metric}"], s[f"p99_{metric}"]), metric
    for c in s["classes"]:
        assert f["classes"][c["name"]]["latencies"]["ttft_ms"][1] == c["p95_ttft_ms"], c["name"]
    assert live.output_throughput() == s["output_throughput"]
    print("live figures equal summary.json's (P50/P95/P99 of the four metrics, per class, output tokens/s)")


if __name__ == "__main__":
    main()
