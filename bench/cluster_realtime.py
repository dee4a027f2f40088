"""Benchmark: four real-time A100 twins as a cluster on this machine: how many streamed tokens/s do they
sustain, and how late are they, with 1, 2 or 4 twins per process (`workers_per_process`)?

For each setting it writes a cluster file (4 x A100-80GB, Llama-3.1-8B, `max_running_requests` = users
per worker), starts `loadlab cluster FILE --port 0` (pinned with taskset to `--cluster-cores`, every
child inheriting it), and drives it with the lean closed-loop client of `twin_realtime.py` (asyncio
sockets, events counted in the raw bytes, one request in flight per connection), pinned to
`--client-cores`. With `--front router` the client talks to sglang-router (round_robin); with `--front
none` it spreads its users over the workers itself (the twins alone). Over a steady window it reports:

- delivered tokens/s (events received; stream_interval 1) against the model's (the same load on the
  twins' scheduler in virtual time: what a cluster that keeps the model's pace delivers);
- CPU of the cluster's processes (workers and front) and of the client, % of one core;
- the twins' own lateness from each worker's `/server_info` `loadlab_sim_timing` (whole run): pass ends
  against their schedule and token writes against their pass's end (the worst worker's P50 / P99), the
  passes that started late, and the model time lost to them (summed over the workers).

    python bench/cluster_realtime.py [--per-process 1 2 4] [--users-per-worker 32 64 96]
        [--cluster-cores 0] [--client-cores 1] [--front router|none] [--rounds 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil
from common import cpu_seconds, machine_line  # noqa: E402
from twin_realtime import Counter, request_bytes, user  # noqa: E402

from loadlab.cluster import READY_PREFIX  # noqa: E402

WORKERS = 4


def cluster_file(directory: Path, per_process: int, users_per_worker: int, front: str, gpu: str) -> Path:
    path = directory / f"bench-{per_process}.yaml"
    front_block = (
        "front:\n  kind: router\n  policy: round_robin\n" if front == "router" else "front:\n  kind: none\n"
    )
    path.write_text(
        f"name: bench\ndistricts:\n  - name: main\n    workers: {WORKERS}\n    gpu: {gpu}\n"
        f"    sglang:\n      max_running_requests: {users_per_worker}\n      log_level: warning\n"
        f"{front_block}workers_per_process: {per_process}\n"
    )
    return path


class Cluster:
    def __init__(self, path: Path, cores: str | None):
        pin = ["taskset", "-c", cores] if cores and shutil.which("taskset") else []
        argv = [*pin, sys.executable, "-m", "loadlab", "cluster", str(path), "--port", "0"]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith(READY_PREFIX):
            self.stop()
            raise RuntimeError(f"the cluster did not start: {line!r}")
        self.ready = json.loads(line[len(READY_PREFIX) :])

    def pids(self) -> list[int]:
        """The launcher and its descendants (workers and front)."""
        return sorted(
            [self.proc.pid, *(p.pid for p in psutil.Process(self.proc.pid).children(recursive=True))]
        )

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def cluster_cpu(pids: list[int]) -> float:
    return sum(cpu_seconds(p) or 0.0 for p in pids)


def is_front(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"sglang" in f.read()  # the router retitles itself sglang::router
    except OSError:
        return False


async def drive(targets: list[str], users: int, input_len: int, output_len: int, warmup_s: float,
                window_s: float, pids: list[int]) -> dict:  # fmt: skip
    counter = Counter()
    front = [p for p in pids if is_front(p)]
    stop_at = time.monotonic() + warmup_s + window_s + 30
    rng = random.Random(0)
    tasks = []
    for u in range(users):
        parts = urlsplit(targets[u % len(targets)])
        lengths = [rng.randint(output_len // 2, output_len * 3 // 2) for _ in range(16)]
        requests = [request_bytes("generate", parts.hostname, parts.port, input_len, n, u) for n in lengths]
        tasks.append(asyncio.create_task(user(parts.hostname, parts.port, requests, stop_at, counter)))
    await asyncio.sleep(warmup_s)
    e0, c0, f0 = counter.events, cluster_cpu(pids), cluster_cpu(front)
    m0, t0 = time.process_time(), time.monotonic()
    await asyncio.sleep(window_s)
    e1, c1, f1 = counter.events, cluster_cpu(pids), cluster_cpu(front)
    m1, t1 = time.process_time(), time.monotonic()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"tokens_per_s": (e1 - e0) / (t1 - t0), "cluster_cpu": (c1 - c0) / (t1 - t0),
            "front_cpu": (f1 - f0) / (t1 - t0), "client_cpu": (m1 - m0) / (t1 - t0)}  # fmt: skip


def timing(url: str) -> dict:
    with urllib.request.urlopen(url + "/server_info", timeout=10) as r:
        return json.load(r)["loadlab_sim_timing"]


def model_tokens_per_s(users_per_worker: int, input_len: int, output_len: int, gpu: str, warm: float,
                      window: float) -> float:  # fmt: skip
    """The same closed loop on one twin's scheduler in virtual time (a finished request is replaced at
    once), times the workers: the cluster's tokens/s at the model's pace, with no CPU limit."""
    from loadlab.sim.cost import CostModel
    from loadlab.sim.scheduler import Request, Scheduler, SchedulerConfig

    sched = Scheduler(SchedulerConfig(max_running_requests=users_per_worker), CostModel(gpu))
    rng = random.Random(0)
    lengths = {u: [rng.randint(output_len // 2, output_len * 3 // 2) for _ in range(16)]
               for u in range(users_per_worker)}  # fmt: skip
    sent = dict.fromkeys(range(users_per_worker), 0)

    def send(u: int, now: float) -> None:
        prompt = [1000 + (u * 7919 + i) % 30000 for i in range(input_len)]
        sched.add_request(Request(f"{u}-{sent[u]}", prompt, lengths[u][sent[u] % 16]), now)
        sent[u] += 1

    for u in range(users_per_worker):
        send(u, 0.0)
    t, tokens = 0.0, 0
    while t < warm + window:
        it = sched.next_iteration(t)
        end = t + it.duration
        sched.complete(it, end)
        if t >= warm:
            tokens += it.decode_bs + len(it.prefilled)  # one token per decoding request, one per prefill
        for r in it.finished:
            send(int(r.rid.split("-")[0]), end)
        t = end
    return WORKERS * tokens / (t - warm)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-process", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--users-per-worker", type=int, nargs="+", default=[32, 64, 96])
    parser.add_argument("--front", choices=["router", "none"], default="router")
    parser.add_argument("--gpu", default="a100-80gb")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--warmup-s", type=float, default=4.0)
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--cluster-cores", default="0", help="taskset list for the cluster ('' = unpinned)")
    parser.add_argument("--client-cores", default="1", help="taskset list for the client ('' = unpinned)")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the whole grid, interleaved")
    args = parser.parse_args()

    if args.client_cores:
        os.sched_setaffinity(0, {int(c) for c in args.client_cores.split(",")})
    print(machine_line())
    print(f"# {WORKERS} x {args.gpu} llama-3.1-8b twins, front {args.front}; cluster on cores "
          f"{args.cluster_cores or '(unpinned)'}, client on {sorted(os.sched_getaffinity(0))}; "
          f"{args.input_len} in / {args.output_len // 2}-{args.output_len * 3 // 2} out, /generate")  # fmt: skip
    print("                                                    pass-end (ms)  token write (ms)")
    print(
        "per-proc users tokens/s  model  cluster front client  p50    p99     p50    p99   late passes lost s"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for upw in args.users_per_worker:
                for k in args.per_process:
                    path = cluster_file(Path(tmp), k, upw, args.front, args.gpu)
                    cluster = Cluster(path, args.cluster_cores)
                    try:
                        workers = [w["url"] for w in cluster.ready["workers"]]
                        targets = [cluster.ready["front"]] if cluster.ready["front"] else workers
                        got = asyncio.run(drive(targets, upw * WORKERS, args.input_len, args.output_len,
                                                args.warmup_s, args.window_s, cluster.pids()))  # fmt: skip
                        timings = [timing(url) for url in workers]
                    finally:
                        cluster.stop()
                    model = model_tokens_per_s(upw, args.input_len, args.output_len, args.gpu, args.warmup_s,
                                               args.window_s)  # fmt: skip
                    worst = {key: {q: max(t[key][q] for t in timings) for q in ("p50", "p99")}
                             for key in ("pass_end_lateness_ms", "event_lateness_ms")}  # fmt: skip
                    late = sum(t["late_passes"] for t in timings)
                    lost = sum(t["lost_model_time_s"] for t in timings)
                    pe, ev = worst["pass_end_lateness_ms"], worst["event_lateness_ms"]
                    print(f"{k:8d} {upw * WORKERS:5d} {got['tokens_per_s']:8.0f} {model:6.0f} "
                          f"{got['cluster_cpu']:6.0%} {got['front_cpu']:5.0%} {got['client_cpu']:6.0%}  "
                          f"{pe['p50']:5.2f} {pe['p99']:6.2f}"
                          f"  {ev['p50']:5.2f} {ev['p99']:6.2f} {late:11d} {lost:6.2f}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
