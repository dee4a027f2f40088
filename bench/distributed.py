"""Benchmark: one process vs a master and N workers on this machine (not a test; results in bench/RESULTS.md)

Starts the scripted server once (loadlab/testing/scripted.py: first event TTFT ms after the request, then one
every GAP ms, each write logged with its wall-clock time), then for each (workers, users) runs
`loadlab run tests/profiles/timing.yaml` against it (workers 0 = one Locust process, N = `--workers N`: a
master plus N worker processes), and prints per run:

  events/s   streamed events the client received in the measured window (sum of events of the measured
             requests / (last measured arrival - first measured send)); "ideal" is what the closed loop
             would reach with a zero-cost client: users * tokens / (TTFT + (tokens - 1) * GAP)
  TTFT err   |client TTFT - (server's first write - client send)|, ms, P50/P95/P99/max
  ITL err    |client gap between events - server gap between the same writes|, ms, P50/P95/P99/max
  CPU        % of one core over the same measured window, from /proc/<pid>/stat (utime + stime) sampled
             every 0.1 s and interpolated at the window's ends: "client" = every Locust process of the run
             (the single process, or master + workers), "master" = the master alone (it runs no users),
             "server" = the scripted server. The `loadlab run` launcher only waits and is left out; so are
             start-up and the writing of the report. "rest" = the whole machine's busy CPU (/proc/stat)
             minus client and server: other sessions on a shared machine, the kernel's idle-side work,
             this script's sampler (a few %). Jiffies are 10 ms, so short windows carry a few % of noise.
  idle ms    median time a user spends between the end of one stream and its next send (bookkeeping,
             and with workers the ticket's round trip through the master): the reason events/s < ideal
  self-bound the run's own client timing error bound (summary.json client.error_bound_ms: the worst
             process's I/O-lateness probe P99), to set against the measured errors

    python bench/distributed.py [--workers 0 1 2] [--users 64 256] [--requests-per-user 6] [--tokens 64]
                                [--ttft-ms 50] [--gap-ms 10] [--repeats 1] [--keep]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import orjson
from common import MACHINE, CpuSampler, dist, finish, machine_line

from loadlab.records import load_records
from loadlab.testing.scripted import read_log, timing_errors
from loadlab.testing.servers import ServerProcess, start_scripted

REPO = Path(__file__).resolve().parents[1]
PROFILE = REPO / "tests" / "profiles" / "timing.yaml"
SAMPLE_S = 0.1


def idle_ms(measure) -> float:
    """Median time (ms) a user spent between the end of one measured stream and its next send: the
    client's own per-request bookkeeping and, distributed, the ticket's round trip through the master.
    While it lasts the user has nothing in flight, so it lowers the load a closed loop really offers."""
    gaps = []
    for _, g in measure.groupby(["worker_id", "user_id"]):
        g = g.sort_values("t_send_wall")
        ends = g.t_send_wall.to_numpy() + g.e2e_ms.to_numpy() / 1000.0
        gaps += list((g.t_send_wall.to_numpy()[1:] - ends[:-1]) * 1000.0)
    return float(np.median(gaps)) if gaps else float("nan")


def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def role(pid: int) -> str | None:
    """'single', 'master' or 'worker' for a Locust process of the run; None for anything else."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return None
    if b"locust" not in argv:
        return None
    if b"--master" in argv:
        return "master"
    if b"--worker" in argv:
        return "worker"
    return "single"


HEADER = (
    "workers users  ideal ev/s  events/s  idle ms   |TTFT err| p50 p95 p99 max   |ITL err| p50 p95 p99 max"
    "   client CPU  master CPU  server CPU  rest CPU  self-bound  records per process"
)


def line(workers: int, users: int, row: dict) -> str:
    nums = lambda xs: " ".join(f"{x:5.2f}" for x in xs[:3]) + f" {xs[3]:6.2f}"  # noqa: E731
    master = f"{row['master']:9.0f}%" if workers else f"{'-':>10}"
    return (
        f"{workers:7d} {users:5d} {row['ideal']:11,.0f} {row['events_s']:9,.0f} {row['idle']:8.1f}   {nums(row['ttft'])}"
        f"   {nums(row['itl'])}   {row['client']:9.0f}%  {master}  {row['server']:9.0f}%"
        f"  {row['rest']:7.0f}%  {row['bound']:10.2f}  {row['split']}"
    )


def one_run(args, server: ServerProcess, log: Path, out: Path, workers: int, users: int) -> dict:
    measured = users * args.requests_per_user
    cmd = [sys.executable, "-m", "loadlab.cli", "run", str(PROFILE),
           "--host", f"{server.url}/case/normal", "--out", str(out),
           "--concurrency", str(users), "--warmup-requests", str(users),
           "--num-requests", str(measured), "--output-len", str(args.tokens)]  # fmt: skip
    if workers:
        cmd += ["--workers", str(workers)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    sampler = CpuSampler(
        server.proc.pid, lambda: {p: role(p) or "other" for p in children(proc.pid)}, SAMPLE_S
    )
    stdout, stderr = proc.communicate()
    sampler.finish()
    if proc.returncode != 0:
        raise RuntimeError(f"loadlab run exited {proc.returncode}:\n{stderr[-2000:]}")
    run_dir = Path(stdout.strip().splitlines()[-1])
    records = load_records(run_dir)
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    measure = records[records.phase == "measure"]
    ttft, itl, problems = timing_errors(measure, read_log(log))
    if problems:
        print(f"# {len(problems)} join problems, e.g. {problems[0]}", file=sys.stderr)
    ok = measure[measure.outcome == "ok"]
    if len(ok) != measured:
        print(f"# only {len(ok)} of {measured} measured requests ok", file=sys.stderr)
    t0 = float(measure.t_send_wall.min())
    t1 = max(float(r.t_send_wall) + float(r.arrival_ms[-1]) / 1000.0 for r in ok.itertuples())
    span = t1 - t0
    client = 100.0 * sampler.role_used({"single", "master", "worker"}, t0, t1) / (t1 - t0)
    server_cpu = 100.0 * sampler.used(server.proc.pid, t0, t1) / span
    bound = (summary.get("client") or {}).get("error_bound_ms")
    return {
        "ideal": users * args.tokens * 1000.0 / (args.ttft_ms + (args.tokens - 1) * args.gap_ms),
        "events_s": sum(len(a) for a in ok.arrival_ms) / span,
        "idle": idle_ms(measure),
        "ttft": dist(ttft),
        "itl": dist(itl),
        "client": client,
        "master": 100.0 * sampler.role_used({"master"}, t0, t1) / (t1 - t0),
        "server": server_cpu,
        "rest": 100.0 * sampler.used(MACHINE, t0, t1) / span - client - server_cpu,
        "bound": float("nan") if bound is None else float(bound),
        "split": "/".join(str(n) for n in measure.groupby("worker_id").size()),
    }


def median_row(rows: list[dict]) -> dict:
    med = {k: float(np.median([r[k] for r in rows])) for k in rows[0] if k not in ("ttft", "itl", "split")}
    for k in ("ttft", "itl"):
        med[k] = list(np.median([r[k] for r in rows], axis=0))
    med["split"] = rows[0]["split"]
    return med


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2], help="0 = one process")
    parser.add_argument("--users", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--requests-per-user", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--ttft-ms", type=float, default=50.0)
    parser.add_argument("--gap-ms", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every row, interleaved; medians")
    parser.add_argument("--keep", action="store_true", help="keep the run directories and the server log")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="loadlab-bench-"))
    server = start_scripted(work / "server.jsonl", args.ttft_ms, args.gap_ms)
    log = server.log_path
    print(machine_line())
    print(f"# case normal, TTFT {args.ttft_ms} ms, gap {args.gap_ms} ms, {args.tokens} tokens/request, "
          f"{args.requests_per_user} measured requests/user (+1 warm-up); CPU in % of one core")  # fmt: skip
    print(HEADER)
    rows: dict[tuple[int, int], list[dict]] = {}
    try:
        for _ in range(args.repeats):
            for users in args.users:
                for workers in args.workers:
                    row = one_run(args, server, log, work / "runs", workers, users)
                    rows.setdefault((users, workers), []).append(row)
                    print(line(workers, users, row), flush=True)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    finally:
        finish(server, work, args.keep)
    if args.repeats > 1:
        print(f"# medians of {args.repeats} runs per row")
        print(HEADER)
        for (users, workers), runs in rows.items():
            print(line(workers, users, median_row(runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
