"""The seed's experiment on the twin, in virtual time: 5 limits x 3 repeats x 1200 requests (200 warm-up +
1000 measured) of 1024 in / 256 out (unique prompts, or rag.yaml's) on an A100-80GB with Llama-3.1-8B,
under both load models.

    python bench/twin_sweep.py [--out DIR] [--mode closed|open|both] [--rates 32 8 ...] [--workload rag]

Prints the wall time of each sweep (one core, every run writes a full run directory and its report) and
the seed's table (median of the 3 repeats per limit). `--rates` runs the open-loop sweep at each arrival
rate; `--workload rag` uses profiles/rag.yaml's workload (shared instruction, Zipf-popular passages)
instead of prompts that share nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import yaml

from loadlab.profile import validate_profile
from loadlab.virtual import run_virtual

LIMITS = (32, 64, 128, 256, 512)
REPEATS = 3
LOADS = {
    "closed": ({"model": "closed", "concurrency": 32}, "32 requests held in flight (closed loop)"),
    "open": ({"model": "open", "rate": 32.0}, "open-loop arrivals at 32 requests/s (Poisson)"),
}


RANDOM = {"kind": "random_prefix", "input_len": 1024, "output_len": 256}


def sweep(mode: str, out: Path, rate: float = 32.0, workload: dict | None = None) -> tuple[float, list[dict]]:
    load = {**LOADS[mode][0], "rate": rate} if mode == "open" else LOADS[mode][0]
    rows = []
    t0 = time.perf_counter()
    for limit in LIMITS:
        runs = []
        for repeat in range(REPEATS):
            profile = validate_profile(
                {
                    "name": f"seed-{mode}{load.get('rate', '')}-{limit}-r{repeat}",
                    "seed": repeat,
                    "workload": workload or RANDOM,
                    "load": load,
                    "requests": {"warmup": 200, "measured": 1000},
                }
            )
            run_dir = run_virtual(profile, {"max_running_requests": limit}, out, profile.name)
            s = json.loads((run_dir / "summary.json").read_text())
            v = json.loads((run_dir / "manifest.json").read_text())["virtual_stats"]
            runs.append(
                {
                    "throughput": s["output_throughput"],
                    "ttft_p50": s["median_ttft_ms"],
                    "ttft_p95": s["p95_ttft_ms"],
                    "tpot_p95": s["p95_tpot_ms"],
                    "queue_ms": v["mean_queue_delay_ms"],
                    "peak_kv": v["peak_token_usage_measured"],
                    "retractions": v["num_retractions_total"],
                }
            )
        rows.append({"limit": limit, **{k: statistics.median(r[k] for r in runs) for k in runs[0]}})
    return time.perf_counter() - t0, rows


def table(rows: list[dict]) -> str:
    lines = [
        "| max_running_requests | throughput (tok/s) | TTFT P50 (ms) | TTFT P95 (ms) | TPOT P95 (ms) "
        "| mean queue delay (ms) | peak KV usage | retractions |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['limit']} | {r['throughput']:.0f} | {r['ttft_p50']:.0f} | {r['ttft_p95']:.0f} | "
            f"{r['tpot_p95']:.1f} | {r['queue_ms']:.0f} | {r['peak_kv']:.0%} | {r['retractions']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="where the run directories go (default: a temporary dir)")
    ap.add_argument("--mode", choices=("closed", "open", "both"), default="both")
    ap.add_argument("--rates", type=float, nargs="+", default=[32.0], help="open-loop arrival rates (req/s)")
    ap.add_argument("--workload", choices=("random", "rag"), default="random")
    args = ap.parse_args()
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="twin-sweep-"))
    workload = None
    if args.workload == "rag":
        workload = yaml.safe_load((Path(__file__).parents[1] / "profiles" / "rag.yaml").read_text())[
            "workload"
        ]
    for mode in ("closed", "open") if args.mode == "both" else (args.mode,):
        for rate in args.rates if mode == "open" else [None]:
            wall, rows = sweep(mode, out, rate or 32.0, workload)
            title = (
                LOADS[mode][1].replace("32 requests/s", f"{rate:g} requests/s") if rate else LOADS[mode][1]
            )
            print(f"## {title}, {args.workload} prompts: {len(LIMITS)} limits x {REPEATS} repeats x 1200 "
                  f"requests in {wall:.1f} s\n")  # fmt: skip
            print(table(rows) + "\n")


if __name__ == "__main__":
    main()
