"""What a run's expected prefix-cache hits cost at its end: each workload kind's cache-hit bound
(``WorkloadGenerator.reusable_prefix``, summary.json's ``expected_cached_token_ratio``) over N request indices.

Each shipped profile's workload is built and its bound computed for ``range(N)``, in a process of its own
pinned with ``taskset -c CORE`` (one thread: the summary computes it beside the event scan). ``--before REV``:
the same with that commit's tree (``git archive``, its own PYTHONPATH), alternately with this tree,
``--repeats`` times each; the bound's sum is printed so both trees can be seen to agree.

    python bench/cache_bound.py [--indices 1000000] [--profiles rag conversation ...] [--before REV]
        [--repeats 3] [--core 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from big_run import _unpack
from common import machine_line

HERE = Path(__file__).resolve().parent
PROFILES = [
    "rag", "shared-system-prompt", "bench-serving-gsp", "conversation", "dataset-jsonl", "dataset-sharegpt",
    "trace-replay", "random-prefix", "bench-serving-random",
]  # fmt: skip


def _measure(profile: str, n: int) -> dict:
    from loadlab.profile import load_profile
    from loadlab.workload import build_workload

    workload = build_workload(load_profile(str(HERE.parent / "profiles" / f"{profile}.yaml")))
    t = time.perf_counter()
    bound = workload.reusable_prefix(range(n))
    return {"seconds": time.perf_counter() - t, "sum": int(bound.sum())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--indices", type=int, default=1_000_000)
    parser.add_argument("--profiles", nargs="+", default=PROFILES)
    parser.add_argument("--before", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--core", default="1")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/loadlab-bound"))
    parser.add_argument("--one", nargs=2, metavar=("PROFILE", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(_measure(args.one[0], int(args.one[1]))))
        return
    print(machine_line())
    trees = {"after": None}
    if args.before:
        trees = {"before": _unpack(args.before, args.dir / "before-tree"), **trees}
    for profile in args.profiles:
        seconds: dict[str, list[float]] = {name: [] for name in trees}
        sums: dict[str, int] = {}
        for _ in range(args.repeats):
            for name, tree in trees.items():
                env = {**os.environ, "PYTHONPATH": str(tree or HERE.parent)}
                cmd = [
                    "taskset",
                    "-c",
                    args.core,
                    sys.executable,
                    __file__,
                    "--one",
                    profile,
                    str(args.indices),
                ]
                done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=HERE.parent)
                if done.returncode != 0:
                    sys.exit(f"{profile} ({name}) failed:\n{done.stderr}")
                result = json.loads(done.stdout.strip().splitlines()[-1])
                seconds[name].append(result["seconds"])
                sums[name] = result["sum"]
        line = " ".join(
            f"{name}={statistics.median(s):.2f}s [{min(s):.2f}-{max(s):.2f}]" for name, s in seconds.items()
        )
        agree = "" if len(set(sums.values())) == 1 else f" SUMS DIFFER {sums}"
        print(f"{profile:<22} {args.indices:>8} {line} sum={sums['after']}{agree}",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
