"""The twin against published SGLang measurements: every profile in bench/published/ in virtual time, each
next to the figures its source published; prints the Markdown table of docs/twin.md ("Against published
measurements"). A few seconds of one core.

    python bench/published.py [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROFILES = ROOT / "bench" / "published"

V060 = "sglang `benchmark/benchmark_vllm_060/README.md` (SGLang v0.3.0, Sept 2024)"
I2097 = "; full block in sgl-project/sglang#2097"
ACCEL = (
    "AccelMark `results/community/nvidia_a100_sxm4_40gbx1_suite_A_nvidia_sglang_c43a8309_958afbbd` (May 2026)"
)

# (profile, setup, {summary key: published value}, source). Keys are loadlab summary.json keys, named as in
# bench_serving's output; only figures the source prints are listed.
ROWS: list[tuple[str, str, dict[str, float], str]] = [
    ("v060-a100-sharegpt-rps4", "A100-80GB, 8B, SGLang 0.3.0; ShareGPT, 1200 prompts, 4 req/s",
     {"median_ttft_ms": 31.98, "median_tpot_ms": 13.17, "median_itl_ms": 11.93, "output_throughput": 748.92},
     V060 + I2097),
    ("v060-a100-sharegpt-rps8", "A100-80GB, 8B, SGLang 0.3.0; ShareGPT, 2400 prompts, 8 req/s",
     {"median_ttft_ms": 35.68, "median_tpot_ms": 17.85, "median_itl_ms": 14.41}, V060),
    ("v060-a100-sharegpt-offline", "A100-80GB, 8B, SGLang 0.3.0; ShareGPT, 5000 prompts, rate inf",
     {"request_throughput": 22.03, "output_throughput": 4281.51}, V060),
    ("pr1060-h100-random-8192-8", "H100 (assumed), 8B, SGLang main Aug 2024, triton attention; random 8192/8, "
     "ratio 0, 1000 prompts, rate inf",
     {"duration": 146.91, "input_throughput": 27670.26, "median_ttft_ms": 72622.70},
     "sgl-project/sglang#1060 (comment, 2024-08-13)"),
    ("accelmark-a100-40gb-offline", "A100-40GB, Llama-3-8B, SGLang 0.5.6; 100 prompts at once, max 512 out",
     {"output_throughput": 3146.66}, ACCEL),
    ("accelmark-a100-40gb-interactive", "A100-40GB, Llama-3-8B, SGLang 0.5.6; 150 requests one at a time",
     {"median_ttft_ms": 32.52, "median_tpot_ms": 12.93}, ACCEL),
    ("accelmark-a100-40gb-qps5", "A100-40GB, Llama-3-8B, SGLang 0.5.6; 300 requests, Poisson 5 req/s",
     {"median_ttft_ms": 43.91, "median_tpot_ms": 15.63}, ACCEL),
    ("accelmark-a100-40gb-qps25", "A100-40GB, Llama-3-8B, SGLang 0.5.6; 300 requests, Poisson 25 req/s",
     {"median_ttft_ms": 52.85, "median_tpot_ms": 36.16}, ACCEL),
]  # fmt: skip

LABELS = {"median_ttft_ms": "TTFT p50 (ms)", "median_tpot_ms": "TPOT p50 (ms)", "median_itl_ms": "ITL p50 (ms)",
          "output_throughput": "output tok/s", "request_throughput": "req/s", "input_throughput": "input tok/s",
          "duration": "duration (s)"}  # fmt: skip


def run(profile: Path, out: Path) -> dict:
    argv = [sys.executable, "-m", "loadlab", "sim", "--virtual", str(profile), "--out", str(out),
            "--run-name", profile.stem]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        sys.exit(f"{profile.name}: {done.stderr.strip()}")
    return json.loads((out / profile.stem / "summary.json").read_text())


def fmt(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.2f}" if abs(x) < 100 else f"{x:.1f}"


def table(out: Path) -> tuple[list[str], int]:
    lines = ["| workload (setup) | figure | published | twin | twin / published | source |",
             "|---|---|---:|---:|---:|---|"]  # fmt: skip
    off = 0
    for name, setup, published, source in ROWS:
        summary = run(PROFILES / f"{name}.yaml", out)
        for i, (key, value) in enumerate(published.items()):
            twin = float(summary[key])
            ratio = twin / value
            flag = "**" if abs(ratio - 1) > 0.15 else ""
            off += bool(flag)
            head = f"`{name}`: {setup}" if i == 0 else ""
            lines.append(f"| {head} | {LABELS[key]} | {fmt(value)} | {fmt(twin)} | {flag}{ratio:.2f}{flag} "
                         f"| {source if i == 0 else ''} |")  # fmt: skip
    return lines, off


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--keep", type=Path, help="write the run directories here (default: a temporary directory)"
    )
    args = p.parse_args()
    if args.keep:
        lines, off = table(args.keep)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            lines, off = table(Path(tmp))
    print("\n".join(lines))
    print(f"\n{off} figure(s) off by more than 15% (in bold)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
