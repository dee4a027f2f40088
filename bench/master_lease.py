"""Benchmark: the master's ticket leasing, earlier code (e.g. one round trip per request, or other block
sizing) and this tree's, side by side on one fast server (not a test; results in bench/RESULTS.md).

Starts the scripted server once (loadlab/testing/scripted.py; first event TTFT ms after the request, then one
every GAP ms) and runs `loadlab run tests/profiles/timing.yaml --workers W` with `users` users in all (`users`
warm-up requests, `requests` measured), alternately with each code tree: each `--before` revision's tree (by
default the merge base with main) unpacked with `git archive` (named by the revision as given, or "before"
when it is the default), and "after", this tree.
Each run's processes import only their own tree (PYTHONPATH, working directory). Per run it prints:

  req/s        measured requests / (last measured end - first measured send): requests through the master
  master CPU   % of one core over that window (the master runs no users: tickets, records, heartbeats)
  us/req       master CPU per measured request; 1e6 / us/req is what the master alone could sustain
  idle ms      a user's time between the end of one measured stream and its next send, median and mean
               (bookkeeping in the CPU lane, and the ticket's round trip through the master when it has one)
  wait ms      block leasing only: the time users waited for a measured ticket, per ticket (the workers' own
               count, the master's "tickets: ..." line); with one round trip per request (97da415 and
               before) every ticket costs a round trip and this is blank (idle includes it)
  empty        block leasing only: % of those measured tickets for which the user found its stock empty
  blocks       block leasing only: ticket blocks the master sent, and tickets per block
  tail ms      the last measured end of the run minus the earliest worker's last measured end (how long
               a worker had nothing left while others finished: the cost of stocks at the end)
  client CPU   % of one core, every Locust process (master and workers)

    python bench/master_lease.py [--before REV [REV ...]] [--workers 8] [--users 512] [--requests 4096]
                                 [--tokens 4] [--ttft-ms 2] [--gap-ms 1] [--repeats 3] [--keep]
                                 [--master-core N]

``--master-core N``: the master pinned to core N and every other process (the server, the CLI, the workers)
to the other cores, as in a deployment where the master has a machine of its own (``taskset``'s affinity,
set as each process appears: within 0.1 s of its start).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from common import CpuSampler, finish, machine_line
from distributed import children, role

from loadlab.records import load_records
from loadlab.testing.servers import ServerProcess, start_scripted

REPO = Path(__file__).resolve().parents[1]
SAMPLE_S = 0.1
LEASE_LINE = re.compile(r"tickets: (\d+) leased in (\d+) blocks .*users waited ([\d.]+) ms per measured ticket "
                        r"\((\d+) of (\d+) found the stock empty\)")  # fmt: skip


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True).stdout.strip()


def unpack(rev: str, into: Path) -> Path:
    """The tree of ``rev`` (without touching the repository's work trees or refs)."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev], cwd=REPO, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def user_gaps_ms(measure) -> np.ndarray:
    gaps = []
    for _, g in measure.groupby(["worker_id", "user_id"]):
        g = g.sort_values("t_send_wall")
        ends = g.t_send_wall.to_numpy() + g.e2e_ms.to_numpy() / 1000.0
        gaps.append((g.t_send_wall.to_numpy()[1:] - ends[:-1]) * 1000.0)
    return np.concatenate(gaps) if gaps else np.array([np.nan])


def one_run(args, tree: Path, server: ServerProcess, out: Path) -> dict:
    cmd = [sys.executable, "-m", "loadlab.cli", "run", str(tree / "tests" / "profiles" / "timing.yaml"),
           "--host", f"{server.url}/case/normal", "--out", str(out), "--workers", str(args.workers),
           "--concurrency", str(args.users), "--warmup-requests", str(args.users),
           "--num-requests", str(args.requests), "--output-len", str(args.tokens)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tree, env=env)
    pinned: set[int] = set()

    def roles() -> dict[int, str]:
        found = {p: role(p) or "other" for p in children(proc.pid)}
        if args.master_core is not None:  # the master on its core, every other process of the run on the rest
            for pid, kind in found.items():
                if pid not in pinned:
                    pinned.add(pid)
                    with contextlib.suppress(OSError):
                        os.sched_setaffinity(pid, {args.master_core} if kind == "master" else args.rest)
        return found

    sampler = CpuSampler(server.proc.pid, roles, SAMPLE_S)
    stdout, stderr = proc.communicate()
    sampler.finish()
    if proc.returncode != 0:
        raise RuntimeError(f"loadlab run exited {proc.returncode}:\n{stderr[-3000:]}")
    run_dir = Path(stdout.strip().splitlines()[-1])
    records = load_records(run_dir)
    measure = records[records.phase == "measure"]
    ok = measure[measure.outcome == "ok"]
    if len(ok) != args.requests:
        print(f"# only {len(ok)} of {args.requests} measured requests ok", file=sys.stderr)
    t0 = float(measure.t_send_wall.min())
    t1 = float((measure.t_send_wall + measure.e2e_ms.fillna(0) / 1000.0).max())
    span = t1 - t0
    master_s = sampler.role_used({"master"}, t0, t1)
    gaps = user_gaps_ms(measure)
    ends = (measure.t_send_wall + measure.e2e_ms.fillna(0) / 1000.0).groupby(measure.worker_id).max()
    row = {
        "rps": len(measure) / span,
        "master": 100.0 * master_s / span,
        "us_per_req": 1e6 * master_s / len(measure),
        "idle_p50": float(np.median(gaps)),
        "idle_mean": float(np.mean(gaps)),
        "tail": 1000.0 * float(ends.max() - ends.min()),
        "client": 100.0 * sampler.role_used({"single", "master", "worker"}, t0, t1) / span,
        "wait": float("nan"),
        "blocks": float("nan"),
        "per_block": float("nan"),
        "empty": float("nan"),
    }
    match = LEASE_LINE.search(stderr)
    if match:
        leased, blocks, wait = int(match[1]), int(match[2]), float(match[3])
        row.update(
            wait=wait, blocks=blocks, per_block=leased / blocks, empty=100.0 * int(match[4]) / int(match[5])
        )
    return row


HEADER = (
    "code      req/s  master CPU  us/req  idle ms p50    mean   wait ms  empty  blocks  tickets/block  tail ms"
    "  client CPU"
)


def line(name: str, r: dict) -> str:
    return (f"{name:8} {r['rps']:6.0f} {r['master']:10.0f}% {r['us_per_req']:7.0f} {r['idle_p50']:12.2f}"
            f" {r['idle_mean']:7.2f} {r['wait']:9.3f} {r['empty']:5.1f}% {r['blocks']:7.0f} {r['per_block']:14.1f}"
            f" {r['tail']:8.0f} {r['client']:10.0f}%")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--before",
        nargs="+",
        default=None,
        help="the commits to compare with (default: merge base with main)",
    )
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--users", type=int, default=512, help="users in all (spread over the workers)")
    parser.add_argument("--requests", type=int, default=4096, help="measured requests per run")
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--ttft-ms", type=float, default=2.0)
    parser.add_argument("--gap-ms", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of before and after, interleaved")
    parser.add_argument("--keep", action="store_true", help="keep the run directories and the trees")
    parser.add_argument(
        "--master-core",
        type=int,
        default=None,
        help="pin the master to this core and the server, the CLI and the workers to the others",
    )
    args = parser.parse_args()
    args.rest = set(range(os.cpu_count() or 1)) - (
        {args.master_core} if args.master_core is not None else set()
    )

    if args.before:
        befores = {rev[:8]: rev for rev in args.before}
    else:
        befores = {"before": git("merge-base", "HEAD", "main")}
    work = Path(tempfile.mkdtemp(prefix="loadlab-lease-"))
    trees = {name: unpack(rev, work / f"tree{i}") for i, (name, rev) in enumerate(befores.items())}
    trees["after"] = REPO
    server = start_scripted(work / "server.jsonl", args.ttft_ms, args.gap_ms)
    if args.master_core is not None:
        os.sched_setaffinity(server.proc.pid, args.rest)
        os.sched_setaffinity(0, args.rest)  # this process, and the run's CLI that it starts
    print(machine_line())
    revs = ", ".join(f"{name} = {git('rev-parse', '--short=12', rev)}" for name, rev in befores.items())
    print(f"# {revs}, after = this tree; {args.workers} workers x {args.users // args.workers} "
          f"users; scripted server TTFT {args.ttft_ms} ms, gap {args.gap_ms} ms, {args.tokens} tokens/request; "
          f"{args.requests} measured requests per run (+{args.users} warm-up); CPU in % of one core")  # fmt: skip
    print(HEADER)
    rows: dict[str, list[dict]] = {name: [] for name in trees}
    try:
        for _ in range(args.repeats):
            for name, tree in trees.items():
                row = one_run(args, tree, server, work / "runs" / name)
                rows[name].append(row)
                print(line(name, row), flush=True)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    finally:
        finish(server, work, args.keep)
    print(f"# medians of {args.repeats} runs")
    print(HEADER)
    for name, runs in rows.items():
        print(line(name, {k: float(np.median([r[k] for r in runs])) for k in runs[0]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
