"""The seed's experiment on the twin, in virtual time: 5 limits x 3 repeats x 1200 requests (200 warm-up +
1000 measured) of 1024 in / 256 out on an A100-80GB with Llama-3.1-8B, under both load models.

    python bench/twin_sweep.py [--out DIR] [--mode closed|open|both]

Prints the wall time of each sweep (one core, every run writes a full run directory and its report) and
the seed's table (median of the 3 repeats per limit).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from loadlab.profile import validate_profile
from loadlab.sim.virtual import run_virtual

LIMITS = (32, 64, 128, 256, 512)
REPEATS = 3
LOADS = {
    "closed": ({"model": "closed", "concurrency": 32}, "32 requests held in flight (closed loop)"),
    "open": ({"model": "open", "rate": 32.0}, "open-loop arrivals at 32 requests/s (Poisson)"),
}


def sweep(mode: str, out: Path) -> tuple[float, list[dict]]:
    load, _ = LOADS[mode]
    rows = []
    t0 = time.perf_counter()
    for limit in LIMITS:
        runs = []
        for repeat in range(REPEATS):
            profile = validate_profile(
                {
                    "name": f"seed-{mode}-{limit}-r{repeat}",
                    "seed": repeat,
                    "workload": {"kind": "random_prefix", "input_len": 1024, "output_len": 256},
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
    args = ap.parse_args()
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="twin-sweep-"))
    for mode in ("closed", "open") if args.mode == "both" else (args.mode,):
        wall, rows = sweep(mode, out)
        print(
            f"## {LOADS[mode][1]}: {len(LIMITS)} limits x {REPEATS} repeats x 1200 requests in {wall:.1f} s\n"
        )
        print(table(rows) + "\n")


if __name__ == "__main__":
    main()
