"""Routing policies on a cluster, in real time and in virtual time, side by side: for each cluster file,
`loadlab run PROFILE` against it (the twins and the real front started for the run) and `loadlab sim
--virtual PROFILE --cluster FILE`; the cached-token ratio, TTFT P50/P95, output tokens/s and requests per
worker of each.

    python bench/cluster_policies.py [--profile profiles/cluster-cache-aware.yaml]
        [--clusters clusters/four-a100.yaml clusters/four-a100-round-robin.yaml] [--out DIR]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from common import machine_line

from loadlab.analysis.summary import Summary

ROOT = Path(__file__).resolve().parent.parent


def run(argv: list[str]) -> Path:
    done = subprocess.run([sys.executable, "-m", "loadlab", *argv], capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"loadlab {' '.join(argv)}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def row(label: str, run_dir: Path) -> str:
    s = Summary.read(run_dir)
    per = "/".join(str(w.completed) for w in s.workers)
    return (f"| {label} | {s.cached_token_ratio:.3f} | {s.ttft_ms.median:.1f} | {s.ttft_ms.p95:.1f} | "
            f"{s.output_throughput:.0f} | {per} |")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", default="profiles/cluster-cache-aware.yaml")
    p.add_argument(
        "--clusters", nargs="+", default=["clusters/four-a100.yaml", "clusters/four-a100-round-robin.yaml"]
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="cluster-policies-"))
    print(machine_line())
    print(f"# {args.profile}; runs in {out}")
    print(
        "| cluster, clock | cached-token ratio | TTFT P50 ms | TTFT P95 ms | output tok/s | completed per worker |"
    )
    print("|---|---:|---:|---:|---:|---|")
    for cluster in args.clusters:
        name = Path(cluster).stem
        real = run(["run", args.profile, "--set", f"target.cluster={ROOT / cluster}", "--out", str(out),
                    "--run-name", f"{name}-real"])  # fmt: skip
        print(row(f"{name}, real time", real), flush=True)
        virtual = run(["sim", "--virtual", args.profile, "--cluster", cluster, "--out", str(out),
                       "--run-name", f"{name}-virtual"])  # fmt: skip
        print(row(f"{name}, virtual time", virtual), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
