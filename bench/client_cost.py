"""Benchmark: client CPU per streamed event, timing error and self-calibration, loadlab vs a naive Locust user
(not a test; results in bench/RESULTS.md)

Starts the scripted server (loadlab/sim/scripted.py: first event TTFT ms after the request, then one every
GAP ms, each write logged with its wall-clock time) pinned to one core, and for each user count runs, one
after the other on the other core (`taskset`):

  loadlab  `loadlab run tests/profiles/timing.yaml` (one Locust process: users users, users warm-up and
           requests-per-user x users measured requests)
  naive    `locust -f bench/naive_locustfile.py`: a FastHttpUser per user reading the stream line by line,
           json.loads per event, a Locust request event per token event (1 warm-up + requests-per-user
           measured requests per user)

Rows are interleaved (loadlab, naive, next user count), so each pair shares the machine's conditions. Per run:

  ideal ev/s  what a zero-cost client would receive: users * tokens * 1000 / (TTFT + (tokens - 1) * GAP)
              (= users * 1000 / GAP when TTFT = GAP, the default): the offered event rate per worker
  events/s    events received in the measured window: from the first measured send to the last
              measured arrival (events of any request that arrive in it, warm-up included)
  CPU %       the client process's CPU over the same window (% of one core; /proc/<pid>/task/*/schedstat,
              ns, sampled every 50 ms and interpolated at the window's ends); for loadlab the Locust process,
              not the `loadlab run` launcher that only waits
  us/event    client CPU seconds in the window / events in the window
  server %    the scripted server's CPU in the window; rest % = the machine's busy time (/proc/stat) minus
              client and server (other sessions on a shared machine, this script's sampler)
  TTFT err    |client TTFT - (server's first write - client send)|, ms, P50/P95/P99/max (measured, ok)
  ITL err     |client gap between events - server gap between the same writes|, ms, P50/P95/P99/max
  probe P99   loadlab only: the run's self-calibration (summary.json client.error_bound_ms, the I/O
              lateness probe's P99), its mean CPU (client.generators[0].cpu_mean) and its verdict
              (client.client_bound, with the default limits 2 ms / 0.85 unless --client-limit-* are given)

At the end: the naive/loadlab ratio of us/event per user count, and per kind the highest events/s at which
both TTFT and ITL error P99 stay <= 1 ms (and <= 2 ms).

    python bench/client_cost.py [--users 16 64 128 256] [--gap-ms 10] [--ttft-ms GAP] [--tokens 64]
                                [--requests-per-user 6] [--repeats 1] [--kinds loadlab naive]
                                [--server-cpu 0] [--client-cpu 1] [--keep]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import orjson
import pandas as pd

from loadlab.records import load_records
from loadlab.sim.scripted import read_log, timing_errors
from loadlab.target import ServerProcess

REPO = Path(__file__).resolve().parents[1]
PROFILE = REPO / "tests" / "profiles" / "timing.yaml"
NAIVE = REPO / "bench" / "naive_locustfile.py"
TICKS = os.sysconf("SC_CLK_TCK")
SAMPLE_S = 0.05
KINDS = ("loadlab", "naive")


def dist(values) -> list[float]:
    """P50, P95, P99 and max of |values|."""
    mags = np.abs(np.asarray(values, dtype=float))
    if not mags.size:
        return [float("nan")] * 4
    return [*np.percentile(mags, [50, 95, 99]), mags.max()]


def num(value) -> float:
    return float("nan") if value is None else float(value)


def cpu_seconds(pid: int) -> float | None:
    """CPU time of every live thread of ``pid`` (ns resolution, from schedstat), or None when it has gone."""
    total = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return total / 1e9


def machine_busy_seconds() -> float:
    """CPU seconds all cores have spent busy since boot (/proc/stat: everything but idle and iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / TICKS


def is_locust(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"locust" in f.read().split(b"\0")
    except OSError:
        return False


def descendants(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                for child in f.read().split():
                    out += [int(child), *descendants(int(child))]
    except OSError:
        pass
    return out


MACHINE = -1


class CpuSampler:
    """Samples the CPU time of the Locust process(es) at or below ``root``, of ``server`` and of the machine."""

    def __init__(self, root: int, server: int):
        self.root = root
        self.clients: set[int] = set()
        self.server = server
        self.samples: dict[int, list[tuple[float, float]]] = {server: [], MACHINE: []}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            for pid in [self.root, *descendants(self.root)]:
                if pid not in self.samples and is_locust(pid):
                    self.clients.add(pid)
                    self.samples[pid] = []
            for pid, series in self.samples.items():
                now = time.time()
                cpu = machine_busy_seconds() if pid == MACHINE else cpu_seconds(pid)
                if cpu is not None:
                    series.append((now, cpu))
            self.stop.wait(SAMPLE_S)

    def finish(self) -> None:
        self.stop.set()
        self.thread.join()

    def used(self, pid: int, t0: float, t1: float) -> float:
        series = self.samples.get(pid) or []
        if len(series) < 2:
            return float("nan")
        walls, cpus = zip(*series, strict=True)
        return float(np.interp(t1, walls, cpus) - np.interp(t0, walls, cpus))

    def client_used(self, t0: float, t1: float) -> float:
        return sum(self.used(p, t0, t1) for p in self.clients) if self.clients else float("nan")


def pinned(cmd: list[str], cpu: str | None) -> list[str]:
    return ["taskset", "-c", cpu, *cmd] if cpu is not None else cmd


def run_loadlab(args, url: str, out: Path, users: int) -> tuple[subprocess.Popen, callable]:
    cmd = [sys.executable, "-m", "loadlab", "run", str(PROFILE), "--host", f"{url}/case/normal",
           "--out", str(out), "--concurrency", str(users), "--warmup-requests", str(users),
           "--num-requests", str(args.requests_per_user * users), "--output-len", str(args.tokens)]  # fmt: skip
    if args.client_limit_ms is not None:
        cmd += ["--client-limit-ms", str(args.client_limit_ms)]
    if args.client_limit_cpu is not None:
        cmd += ["--client-limit-cpu", str(args.client_limit_cpu)]
    proc = subprocess.Popen(
        pinned(cmd, args.client_cpu), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
    )

    def collect(stdout: str) -> tuple[pd.DataFrame, dict]:
        run_dir = Path(stdout.strip().splitlines()[-1])
        summary = orjson.loads((run_dir / "summary.json").read_bytes())
        return load_records(run_dir), summary.get("client") or {}

    return proc, collect


def run_naive(args, url: str, out: Path, users: int) -> tuple[subprocess.Popen, callable]:
    out.mkdir(parents=True, exist_ok=True)
    records_out = out / f"naive-{users}-{time.time_ns()}.jsonl"
    cmd = [sys.executable, "-m", "locust", "-f", str(NAIVE), "--headless", "--only-summary",
           "-u", str(users), "-r", str(users), "--host", f"{url}/case/normal", "-t", f"{args.timeout_s}s",
           "--records-out", str(records_out), "--requests-per-user", str(args.requests_per_user),
           "--warmup-per-user", "1", "--max-new-tokens", str(args.tokens)]  # fmt: skip
    proc = subprocess.Popen(
        pinned(cmd, args.client_cpu), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
    )

    def collect(_stdout: str) -> tuple[pd.DataFrame, dict]:
        rows = [orjson.loads(line) for line in records_out.read_bytes().splitlines() if line.strip()]
        return pd.DataFrame(rows), {}

    return proc, collect


def one_run(args, server: ServerProcess, log: Path, out: Path, kind: str, users: int) -> dict:
    start = run_loadlab if kind == "loadlab" else run_naive
    proc, collect = start(args, server.url, out, users)
    sampler = CpuSampler(proc.pid, server.proc.pid)
    try:
        stdout, stderr = proc.communicate(timeout=args.timeout_s + 60)
    finally:
        sampler.finish()
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} run at {users} users exited {proc.returncode}:\n{stderr[-2000:]}")
    records, client = collect(stdout)
    measure = records[records.phase == "measure"]
    ttft, itl, problems = timing_errors(measure, read_log(log))
    if problems:
        print(f"# {kind} {users}: {len(problems)} join problems, e.g. {problems[0]}", file=sys.stderr)
    ok = measure[measure.outcome == "ok"]
    expected = users * args.requests_per_user
    if len(ok) != expected:
        print(f"# {kind} {users}: only {len(ok)} of {expected} measured requests ok", file=sys.stderr)
    # The measured window and every event (any phase) that arrived in it.
    t0 = float(measure.t_send_wall.min())
    t1 = max(float(r.t_send_wall) + float(r.arrival_ms[-1]) / 1000.0 for r in ok.itertuples())
    events = 0
    for r in records.itertuples():
        arrivals = float(r.t_send_wall) + np.asarray(r.arrival_ms, dtype=float) / 1000.0
        events += int(np.count_nonzero((arrivals >= t0) & (arrivals <= t1)))
    span = t1 - t0
    client_s = sampler.client_used(t0, t1)
    server_s = sampler.used(server.proc.pid, t0, t1)
    gens = client.get("generators") or [{}]
    return {
        "ideal": users * args.tokens * 1000.0 / (args.ttft_ms + (args.tokens - 1) * args.gap_ms),
        "events_s": events / span,
        "client": 100.0 * client_s / span,
        "us_event": 1e6 * client_s / max(events, 1),
        "server": 100.0 * server_s / span,
        "rest": 100.0 * sampler.used(MACHINE, t0, t1) / span - 100.0 * (client_s + server_s) / span,
        "ttft": dist(ttft),
        "itl": dist(itl),
        "probe": num(client.get("error_bound_ms")),
        "self_cpu": num(gens[0].get("cpu_mean")),
        "bound": client.get("client_bound"),
    }


HEADER = (
    "kind     users  ideal ev/s  events/s  client CPU  us/event  server CPU  rest CPU"
    "   |TTFT err| p50  p95  p99   max   |ITL err| p50  p95  p99   max   probe P99  self CPU  client-bound"
)


def line(kind: str, users: int, row: dict) -> str:
    nums = lambda xs: " ".join(f"{x:5.2f}" for x in xs[:3]) + f" {xs[3]:6.2f}"  # noqa: E731
    flag = {True: "yes", False: "no", None: "-"}[row["bound"]]
    probe = f"{row['probe']:9.2f}" if kind == "loadlab" else f"{'-':>9}"
    self_cpu = f"{row['self_cpu']:8.2f}" if kind == "loadlab" else f"{'-':>8}"
    return (
        f"{kind:8} {users:5d} {row['ideal']:11,.0f} {row['events_s']:9,.0f} {row['client']:10.0f}%"
        f" {row['us_event']:9.1f} {row['server']:10.0f}% {row['rest']:8.0f}%"
        f"   {nums(row['ttft'])}   {nums(row['itl'])}   {probe}  {self_cpu}  {flag:>12}"
    )


def median_row(rows: list[dict]) -> dict:
    med = {k: float(np.median([r[k] for r in rows])) for k in rows[0] if k not in ("ttft", "itl", "bound")}
    for k in ("ttft", "itl"):
        med[k] = list(np.median([r[k] for r in rows], axis=0))
    flags = [r["bound"] for r in rows]
    med["bound"] = None if flags[0] is None else (all(flags) if all(flags) or not any(flags) else None)
    med["flags"] = "/".join("-" if f is None else ("yes" if f else "no") for f in flags)
    return med


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, nargs="+", default=[16, 64, 128, 256])
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--requests-per-user", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--gap-ms", type=float, default=10.0)
    parser.add_argument("--ttft-ms", type=float, default=None, help="default: the gap")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every row, interleaved; medians")
    parser.add_argument("--server-cpu", default="0", help="core for the server ('' = not pinned)")
    parser.add_argument("--client-cpu", default="1", help="core for the client ('' = not pinned)")
    parser.add_argument("--client-limit-ms", type=float, default=None, help="passed to loadlab run")
    parser.add_argument("--client-limit-cpu", type=float, default=None, help="passed to loadlab run")
    parser.add_argument("--timeout-s", type=int, default=300, help="per run")
    parser.add_argument("--keep", action="store_true", help="keep the run directories and the server log")
    args = parser.parse_args()
    args.ttft_ms = args.gap_ms if args.ttft_ms is None else args.ttft_ms
    if not shutil.which("taskset") or (os.cpu_count() or 1) < 2:
        args.server_cpu = args.client_cpu = ""
    args.server_cpu, args.client_cpu = args.server_cpu or None, args.client_cpu or None
    if args.server_cpu is not None:
        os.sched_setaffinity(0, {int(args.server_cpu)})  # this script's sampler stays off the client's core

    work = Path(tempfile.mkdtemp(prefix="loadlab-bench-"))
    log = work / "server.jsonl"
    server = ServerProcess(
        pinned([sys.executable, "-m", "loadlab.sim.scripted", "--port", "0", "--log", str(log),
                "--ttft-ms", str(args.ttft_ms), "--gap-ms", str(args.gap_ms)], args.server_cpu)
    )  # fmt: skip
    server.start()
    print(f"# {platform.node()} {os.cpu_count()} cores, python {platform.python_version()}, {time.ctime()}")
    print(f"# server on core {args.server_cpu}, client on core {args.client_cpu}; TTFT {args.ttft_ms} ms, "
          f"gap {args.gap_ms} ms, {args.tokens} tokens/request, {args.requests_per_user} measured "
          f"requests/user (+1 warm-up); CPU in % of one core, errors in ms")  # fmt: skip
    print(HEADER, flush=True)
    rows: dict[tuple[str, int], list[dict]] = {}
    ratios: dict[int, list[float]] = {}
    started = time.time()
    try:
        for _ in range(args.repeats):
            for users in args.users:
                pair = {}
                for kind in args.kinds:
                    row = one_run(args, server, log, work / "runs", kind, users)
                    rows.setdefault((kind, users), []).append(row)
                    pair[kind] = row
                    print(line(kind, users, row), flush=True)
                if len(pair) == 2:
                    ratios.setdefault(users, []).append(pair["naive"]["us_event"] / pair["loadlab"]["us_event"])
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    finally:
        server.stop()
        if args.keep:
            print(f"# runs and server log kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    final = {key: median_row(runs) for key, runs in rows.items()}
    if args.repeats > 1:
        print(f"# medians of {args.repeats} rounds per row (client-bound: every round's verdict)")
        print(HEADER)
        for (kind, users), row in sorted(final.items(), key=lambda kv: (kv[0][1], KINDS.index(kv[0][0]))):
            print(line(kind, users, row) + (f"  {row['flags']}" if kind == "loadlab" else ""))
    if ratios:
        print("# CPU per event, naive / loadlab (per round): " + ", ".join(
            f"{u} users {'/'.join(f'{r:.1f}x' for r in rs)}" for u, rs in ratios.items()))  # fmt: skip
    for kind in args.kinds:
        for limit in (1.0, 2.0):
            good = [(r["events_s"], u) for (k, u), r in final.items()
                    if k == kind and r["ttft"][2] <= limit and r["itl"][2] <= limit]  # fmt: skip
            best = f"{max(good)[0]:,.0f} events/s ({max(good)[1]} users)" if good else "none of the rows"
            print(f"# {kind}: highest events/s with TTFT and ITL error P99 <= {limit:g} ms: {best}")
    print(f"# {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
