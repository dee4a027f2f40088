"""Benchmark: client CPU per streamed event, timing error and self-calibration, loadlab vs a naive Locust user
(not a test; results in bench/RESULTS.md)

Starts the scripted server (loadlab/testing/scripted.py: first event TTFT ms after the request, then one every
GAP ms, each write logged with its wall-clock time) pinned to one core, and for each user count runs, one
after the other on the other core (`taskset`):

  loadlab  `loadlab run tests/profiles/timing.yaml` (one Locust process: users users, users warm-up and
           N x users measured requests, N = max(--requests-per-user, --min-requests / users))
  naive    `locust -f bench/naive_locustfile.py`: a FastHttpUser per user reading the stream line by line,
           json.loads per event, a Locust request event per token event (1 warm-up + N measured requests
           per user)

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

At the end: every loadlab run's self-calibration verdict against its measured error (MISSED: measured P99
above the limit, not flagged; FALSE ALARM: flagged, measured P99 within it), the naive/loadlab ratio of
us/event per user count, and per kind the highest events/s at which both TTFT and ITL error P99 stay
<= 1 ms (and <= 2 ms). With --repeats R the rows run R rounds, interleaved, and the table of medians follows.

The floor (--floor-users): the same streams read without Locust, one reader per process on the client core,
for --floor-seconds: plain Python epoll + recv, gevent sockets, loadlab's StreamingClient (geventhttpclient
readline), and that plus json.loads per event (see floor_reader): what reading alone costs per event.

    python bench/client_cost.py [--users 16 64 128 256] [--gap-ms 10] [--ttft-ms GAP] [--tokens 64]
                                [--requests-per-user 6] [--min-requests 400] [--repeats 1]
                                [--kinds loadlab naive] [--floor-users 50 100] [--floor-seconds 5]
                                [--server-cpu 0] [--client-cpu 1] [--client-limit-ms MS]
                                [--client-limit-cpu F] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import orjson
import pandas as pd
from common import MACHINE, CpuSampler, dist, finish

from loadlab.records import load_records
from loadlab.testing.scripted import timing_errors
from loadlab.testing.servers import ServerProcess, start_scripted

REPO = Path(__file__).resolve().parents[1]
PROFILE = REPO / "tests" / "profiles" / "timing.yaml"
NAIVE = REPO / "bench" / "naive_locustfile.py"
SAMPLE_S = 0.05
# loadlab: the lean reader timed by the kernel (the default); loadlab-user: the lean reader timed in user
# space; loadlab-ghc: the geventhttpclient reader (user space, the reader before the lean one); naive: a
# FastHttpUser; bench_serving: SGLang's bench_serving (--bench-serving CMD, its own venv)
KINDS = ("loadlab", "loadlab-user", "loadlab-ghc", "naive", "bench_serving")
LOADLAB_SETS = {
    "loadlab": ["target.reader=lean", "target.receipt_clock=kernel"],
    "loadlab-user": ["target.reader=lean", "target.receipt_clock=user"],
    "loadlab-ghc": ["target.reader=geventhttpclient", "target.receipt_clock=user"],
}
BUSY = "while True: pass"


def num(value) -> float:
    return float("nan") if value is None else float(value)


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


class ServerLog:
    """The scripted server's log (read_log's format), read incrementally: it grows with every run."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.entries: dict[str, dict] = {}

    def read(self) -> dict[str, dict]:
        time.sleep(0.2)  # the server logs a request just after its last write
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        whole = data.rfind(b"\n") + 1  # complete lines only
        self.offset += whole
        for line in data[:whole].splitlines():
            if line.strip():
                entry = orjson.loads(line)
                self.entries[entry["id"]] = entry
        return self.entries


def pinned(cmd: list[str], cpu: str | None) -> list[str]:
    return ["taskset", "-c", cpu, *cmd] if cpu is not None else cmd


def per_user(args, users: int) -> int:
    """Measured requests per user: --requests-per-user, more when that gives under --min-requests."""
    return max(args.requests_per_user, -(-args.min_requests // users))


def run_loadlab(
    args, url: str, out: Path, users: int, kind: str = "loadlab"
) -> tuple[subprocess.Popen, callable]:
    cmd = [sys.executable, "-m", "loadlab", "run", str(PROFILE), "--host", f"{url}/case/normal",
           "--out", str(out), "--concurrency", str(users), "--warmup-requests", str(users),
           "--num-requests", str(per_user(args, users) * users), "--output-len", str(args.tokens)]  # fmt: skip
    for item in LOADLAB_SETS[kind]:
        cmd += ["--set", item]
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
        return load_records(run_dir), {**(summary.get("client") or {}), "receipt": summary.get("receipt")}

    return proc, collect


def run_naive(args, url: str, out: Path, users: int) -> tuple[subprocess.Popen, callable]:
    out.mkdir(parents=True, exist_ok=True)
    records_out = out / f"naive-{users}-{time.time_ns()}.jsonl"
    cmd = [sys.executable, "-m", "locust", "-f", str(NAIVE), "--headless", "--only-summary",
           "-u", str(users), "-r", str(users), "--host", f"{url}/case/normal", "-t", f"{args.timeout_s}s",
           "--records-out", str(records_out), "--requests-per-user", str(per_user(args, users)),
           "--warmup-per-user", "1", "--max-new-tokens", str(args.tokens)]  # fmt: skip
    proc = subprocess.Popen(
        pinned(cmd, args.client_cpu), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
    )

    def collect(_stdout: str) -> tuple[pd.DataFrame, dict]:
        rows = [orjson.loads(line) for line in records_out.read_bytes().splitlines() if line.strip()]
        return pd.DataFrame(rows), {}

    return proc, collect


def run_bench_serving(args, url: str, users: int) -> subprocess.Popen:
    """SGLang's bench_serving (--bench-serving: the command that runs it, in a venv of its own) at ``users``
    concurrency: the same request count and output length, random-ids prompts of 16 tokens (a local
    tokenizer, --bench-serving-tokenizer), the native /generate API, as fast as the concurrency allows."""
    n = per_user(args, users) * users
    cmd = [*args.bench_serving.split(), "--backend", "sglang", "--base-url", f"{url}/case/normal",
           "--dataset-name", "random-ids", "--tokenizer", args.bench_serving_tokenizer,
           "--model", "scripted-model", "--num-prompts", str(n), "--max-concurrency", str(users),
           "--random-input-len", "16", "--random-output-len", str(args.tokens), "--random-range-ratio", "1",
           "--disable-tqdm", "--warmup-requests", str(users)]  # fmt: skip
    return subprocess.Popen(
        pinned(cmd, args.client_cpu), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/tmp"
    )


def one_bench_serving(args, server: ServerProcess, log: ServerLog, users: int) -> dict:
    """bench_serving has no per-request ids to join: its events and window come from the server's log (the
    requests it received after it started; the window: from its first measured send + 1 s to its last
    write - 0.5 s, so start-up, warm-up and the tail are left out)."""
    before = set(log.read())
    started = time.time()
    proc = run_bench_serving(args, server.url, users)
    sampler = CpuSampler(server.proc.pid, lambda: {proc.pid: "client"}, SAMPLE_S)
    try:
        _stdout, stderr = proc.communicate(timeout=args.timeout_s + 120)
    finally:
        sampler.finish()
    if proc.returncode != 0:
        raise RuntimeError(f"bench_serving at {users} users exited {proc.returncode}:\n{stderr[-2000:]}")
    entries = [e for k, e in log.read().items() if k not in before and e["recv_wall"] >= started]
    recvs = sorted(e["recv_wall"] for e in entries)
    writes = np.sort(np.concatenate([np.asarray(e["write_wall"], dtype=float) for e in entries]))
    t0, t1 = recvs[min(users, len(recvs) - 1)] + 1.0, float(writes[-1]) - 0.5
    if t1 <= t0 + 1.0:
        raise RuntimeError(
            f"bench_serving at {users} users: a run too short to measure (raise --min-requests)"
        )
    events = int(np.count_nonzero((writes >= t0) & (writes <= t1)))
    client_s = sampler.role_used({"client"}, t0, t1)
    server_s = sampler.used(server.proc.pid, t0, t1)
    span = t1 - t0
    nan4 = [float("nan")] * 4
    return {
        "ideal": users * args.tokens * 1000.0 / (args.ttft_ms + (args.tokens - 1) * args.gap_ms),
        "events_s": events / span,
        "client": 100.0 * client_s / span,
        "us_event": 1e6 * client_s / max(events, 1),
        "server": 100.0 * server_s / span,
        "rest": 100.0 * sampler.used(MACHINE, t0, t1) / span - 100.0 * (client_s + server_s) / span,
        "ttft": nan4,
        "itl": nan4,
        "probe": float("nan"),
        "self_cpu": float("nan"),
        "bound": None,
        "coalesced": float("nan"),
        "kernel": float("nan"),
    }


def one_run(args, server: ServerProcess, log: ServerLog, out: Path, kind: str, users: int) -> dict:
    if kind == "bench_serving":
        return one_bench_serving(args, server, log, users)
    if kind == "naive":
        proc, collect = run_naive(args, server.url, out, users)
    else:
        proc, collect = run_loadlab(args, server.url, out, users, kind)
    sampler = CpuSampler(
        server.proc.pid,
        lambda: {p: "client" for p in [proc.pid, *descendants(proc.pid)] if is_locust(p)},
        SAMPLE_S,
    )
    try:
        stdout, stderr = proc.communicate(timeout=args.timeout_s + 60)
    finally:
        sampler.finish()
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} run at {users} users exited {proc.returncode}:\n{stderr[-2000:]}")
    records, client = collect(stdout)
    measure = records[records.phase == "measure"]
    ttft, itl, problems = timing_errors(measure, log.read())
    if problems:
        print(f"# {kind} {users}: {len(problems)} join problems, e.g. {problems[0]}", file=sys.stderr)
    ok = measure[measure.outcome == "ok"]
    expected = users * per_user(args, users)
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
    client_s = sampler.role_used({"client"}, t0, t1)
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
        # the lean reader: token events that shared a read with the one before (%), requests kernel-timed
        "coalesced": 100.0 * num((client.get("receipt") or {}).get("coalesced_event_fraction")),
        "kernel": 100.0 * num((client.get("receipt") or {}).get("kernel_fraction")),
    }


# ---- the floor: what reading the same streams costs without Locust, per reader ----------------------------

FLOOR_READERS = ("epoll", "gevent", "ghc", "lean", "ghc+json")


def floor_reader(name: str, url: str, users: int, seconds: float, tokens: int) -> dict:
    """Runs ``users`` closed-loop streams with one reader for ``seconds`` (after 2 s of warm-up) in this
    process and returns events/s and CPU per event. Readers, from the cheapest:
      epoll     plain Python: one selectors.EpollSelector loop, socket.recv per wake-up, events counted in the
                raw bytes (no HTTP parsing): the floor for a Python reader with one wake-up per event
      gevent    a greenlet per stream on gevent sockets, recv + count, no HTTP parsing
      ghc       loadlab's StreamingClient.post_stream (geventhttpclient, readline + perf_counter per line,
                per-recv idle timeout), no Locust, no decoding
      lean      the same on the lean reader (recvmsg per wake-up, kernel receipt times, httptools)
      ghc+json  the same plus json.loads of every event (what the naive user parses), still no Locust"""
    import resource

    split = urlsplit(url)
    body = orjson.dumps({"text": "x " * 16, "sampling_params": {"max_new_tokens": tokens}, "stream": True})
    request = (
        b"POST /case/normal/generate HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (split.netloc.encode(), len(body), body)
    )
    end = b"0\r\n\r\n"
    count = [0]
    if name == "epoll":
        import selectors
        import socket

        sel = selectors.EpollSelector()
        for _ in range(users):
            sock = socket.create_connection((split.hostname, split.port))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)
            sock.sendall(request)
            sel.register(sock, selectors.EVENT_READ, [b""])

        def wait(until: float) -> None:
            while time.time() < until:
                for key, _ in sel.select(0.1):
                    data = key.fileobj.recv(65536)
                    time.perf_counter()  # the receipt timestamp a client would take
                    count[0] += data.count(b"data: {")
                    key.data[0] = tail = (key.data[0] + data)[-5:]
                    if tail == end:
                        key.data[0] = b""
                        key.fileobj.sendall(request)
    else:
        import gevent
        from gevent import socket as gsocket

        from loadlab.client.protocol import META_KEY
        from loadlab.client.request import new_exchange
        from loadlab.client.stream import StreamingClient

        def raw_user() -> None:
            sock = gsocket.create_connection((split.hostname, split.port))
            sock.setsockopt(gsocket.IPPROTO_TCP, gsocket.TCP_NODELAY, 1)
            while True:
                sock.sendall(request)
                tail = b""
                while tail != end:
                    data = sock.recv(65536)
                    time.perf_counter()
                    count[0] += data.count(b"data: {")
                    tail = (tail + data)[-5:]

        stamps: list[float] = []  # receipt times of the events of finished streams (ghc readers)

        def ghc_user(parse: bool, reader: str = "geventhttpclient") -> None:
            client = StreamingClient(f"{url}/case/normal", 10.0, 30.0, 600.0, reader=reader)
            while True:
                ex = new_exchange()
                client.post_stream("/generate", body, ex, keep_from=None if parse else META_KEY)
                for line, t in zip(ex.lines, ex.times, strict=True):
                    # with keep_from a data line starts at "meta_info": (as in loadlab)
                    if len(line) > 2 and not line.startswith(b"data: [DONE]"):
                        stamps.append(t)
                        if parse:
                            json.loads(line[6:])

        target = {"gevent": raw_user, "ghc": lambda: ghc_user(False), "ghc+json": lambda: ghc_user(True),
                  "lean": lambda: ghc_user(False, "lean")}[name]  # fmt: skip
        for _ in range(users):
            gevent.spawn(target)

        def wait(until: float) -> None:
            gevent.sleep(until - time.time())

    wait(time.time() + 2.0)
    r0, n0, w0, p0 = resource.getrusage(resource.RUSAGE_SELF), count[0], time.time(), time.perf_counter()
    wait(w0 + seconds)
    r1, n1, w1, p1 = resource.getrusage(resource.RUSAGE_SELF), count[0], time.time(), time.perf_counter()
    if (
        name.startswith("ghc") or name == "lean"
    ):  # events are known when their stream ends: let the streams in flight finish
        wait(time.time() + 2.0)
        n0, n1 = 0, sum(1 for t in stamps if p0 <= t <= p1)
    events = max(n1 - n0, 1)
    user, sys_ = r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime
    return {
        "events_s": events / (w1 - w0),
        "cpu": 100.0 * (user + sys_) / (w1 - w0),
        "us_event": 1e6 * (user + sys_) / events,
        "user_us": 1e6 * user / events,
        "sys_us": 1e6 * sys_ / events,
    }


def run_floor(args, url: str, reader: str, users: int) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--floor-reader", reader, "--floor-url", url,
           "--floor-n", str(users), "--floor-seconds", str(args.floor_seconds), "--tokens", str(args.tokens)]  # fmt: skip
    proc = subprocess.run(pinned(cmd, args.client_cpu), capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"floor reader {reader} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return orjson.loads(proc.stdout.strip().splitlines()[-1])


HEADER = (
    "kind          users  ideal ev/s  events/s  client CPU  us/event  server CPU  rest CPU"
    "   |TTFT err| p50  p95  p99   max   |ITL err| p50  p95  p99   max   probe P99  self CPU  client-bound"
    "  kernel%  coalesced%"
)


def line(kind: str, users: int, row: dict) -> str:
    nums = lambda xs: " ".join(f"{x:5.2f}" for x in xs[:3]) + f" {xs[3]:6.2f}"  # noqa: E731
    flag = {True: "yes", False: "no", None: "-"}[row["bound"]]
    ours = kind.startswith("loadlab")
    probe = f"{row['probe']:9.2f}" if ours else f"{'-':>9}"
    self_cpu = f"{row['self_cpu']:8.2f}" if ours else f"{'-':>8}"
    receipt = f"  {row['kernel']:7.1f}  {row['coalesced']:10.3f}" if ours else f"  {'-':>7}  {'-':>10}"
    return (
        f"{kind:13} {users:5d} {row['ideal']:11,.0f} {row['events_s']:9,.0f} {row['client']:10.0f}%"
        f" {row['us_event']:9.1f} {row['server']:10.0f}% {row['rest']:8.0f}%"
        f"   {nums(row['ttft'])}   {nums(row['itl'])}   {probe}  {self_cpu}  {flag:>12}{receipt}"
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
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=["loadlab", "loadlab-ghc", "naive"])
    parser.add_argument("--requests-per-user", type=int, default=6)
    parser.add_argument("--min-requests", type=int, default=400, help="measured requests per run, at least")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--gap-ms", type=float, default=10.0)
    parser.add_argument("--ttft-ms", type=float, default=None, help="default: the gap")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every row, interleaved; medians")
    parser.add_argument("--server-cpu", default="0", help="core for the server ('' = not pinned)")
    parser.add_argument("--client-cpu", default="1", help="core for the client ('' = not pinned)")
    parser.add_argument("--client-limit-ms", type=float, default=None, help="passed to loadlab run")
    parser.add_argument("--client-limit-cpu", type=float, default=None, help="passed to loadlab run")
    parser.add_argument("--timeout-s", type=int, default=300, help="per run")
    parser.add_argument("--floor-users", type=int, nargs="*", default=[50, 100],
                        help="user counts for the reader floor (none: skip it)")  # fmt: skip
    parser.add_argument("--floor-seconds", type=float, default=5.0)
    parser.add_argument("--keep", action="store_true", help="keep the run directories and the server log")
    parser.add_argument("--busy", action="store_true",
                        help="one busy-loop process on the client core during the runs (a busy load generator)")  # fmt: skip
    parser.add_argument("--bench-serving", default=None, metavar="CMD",
                        help="the command that runs SGLang's bench_serving, e.g. '/tmp/bsvenv/bin/python "
                        "bench/bench_serving_shim.py' (its own venv; never a loadlab dependency)")  # fmt: skip
    parser.add_argument("--bench-serving-tokenizer", default=None, metavar="DIR",
                        help="a local tokenizer directory for bench_serving's random-ids prompts")  # fmt: skip
    parser.add_argument("--floor-reader", choices=FLOOR_READERS, help=argparse.SUPPRESS)
    parser.add_argument("--floor-url", help=argparse.SUPPRESS)
    parser.add_argument("--floor-n", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.floor_reader:  # one floor measurement, in its own (pinned) process
        result = floor_reader(
            args.floor_reader, args.floor_url, args.floor_n, args.floor_seconds, args.tokens
        )
        print(orjson.dumps(result).decode(), flush=True)
        os._exit(0)  # the readers' streams are still open: do not wait for them
    args.ttft_ms = args.gap_ms if args.ttft_ms is None else args.ttft_ms
    if not shutil.which("taskset") or (os.cpu_count() or 1) < 2:
        args.server_cpu = args.client_cpu = ""
    args.server_cpu, args.client_cpu = args.server_cpu or None, args.client_cpu or None
    if args.server_cpu is not None:
        os.sched_setaffinity(0, {int(args.server_cpu)})  # this script's sampler stays off the client's core

    work = Path(tempfile.mkdtemp(prefix="loadlab-bench-"))
    log = work / "server.jsonl"
    server = start_scripted(log, args.ttft_ms, args.gap_ms, prefix=pinned([], args.server_cpu))
    server_log = ServerLog(log)
    print(f"# {platform.node()} {os.cpu_count()} cores, python {platform.python_version()}, {time.ctime()}")
    print(f"# server on core {args.server_cpu}, client on core {args.client_cpu}; TTFT {args.ttft_ms} ms, "
          f"gap {args.gap_ms} ms, {args.tokens} tokens/request, max({args.requests_per_user}, "
          f"{args.min_requests} / users) measured requests/user (+1 warm-up); CPU in % of one core, errors in ms")  # fmt: skip
    print(HEADER, flush=True)
    rows: dict[tuple[str, int], list[dict]] = {}
    ratios: dict[int, list[float]] = {}
    started = time.time()
    busy = None
    if args.busy:
        busy = subprocess.Popen(pinned([sys.executable, "-c", BUSY], args.client_cpu))
        print(f"# a busy-loop process (pid {busy.pid}) shares the client core", flush=True)
    try:
        for _ in range(args.repeats):
            for users in args.users:
                pair = {}
                for kind in args.kinds:
                    row = one_run(args, server, server_log, work / "runs", kind, users)
                    rows.setdefault((kind, users), []).append(row)
                    pair[kind] = row
                    print(line(kind, users, row), flush=True)
                if "naive" in pair and "loadlab" in pair:
                    ratios.setdefault(users, []).append(
                        pair["naive"]["us_event"] / pair["loadlab"]["us_event"]
                    )
        if args.floor_users:
            print("# floor: the same streams read without Locust (one process, client core), per reader")
            print("reader    users  events/s  client CPU  us/event  (user  sys)")
            for users in args.floor_users:
                for reader in FLOOR_READERS:
                    f = run_floor(args, server.url, reader, users)
                    print(f"{reader:9} {users:5d} {f['events_s']:9,.0f} {f['cpu']:10.0f}% {f['us_event']:9.1f}"
                          f"  ({f['user_us']:4.1f} {f['sys_us']:4.1f})", flush=True)  # fmt: skip
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
        finish(server, work, args.keep)
    final = {key: median_row(runs) for key, runs in rows.items()}
    if args.repeats > 1:
        print(f"# medians of {args.repeats} rounds per row (client-bound: every round's verdict)")
        print(HEADER)
        for (kind, users), row in sorted(final.items(), key=lambda kv: (kv[0][1], KINDS.index(kv[0][0]))):
            print(line(kind, users, row) + (f"  {row['flags']}" if kind == "loadlab" else ""))
    runs = [(u, r) for (k, u), rs in rows.items() if k == "loadlab" for r in rs]
    if runs:
        limit = args.client_limit_ms if args.client_limit_ms is not None else 2.0
        print(f"# self-calibration, every loadlab run: load = events/s / ideal (< 90%: past capacity; >= 95% with"
              f" client CPU < 50%: well inside); measured = max(TTFT, ITL) error P99; check = the verdict"
              f" against the measured P99 and the {limit:g} ms limit")  # fmt: skip
        print("users  load  client CPU  measured P99  probe P99  self CPU  client-bound  regime        check")
        for users, r in sorted(runs, key=lambda ur: ur[0]):
            load = r["events_s"] / r["ideal"]
            regime = (
                "past capacity"
                if load < 0.9
                else ("well inside" if load >= 0.95 and r["client"] < 50 else "")
            )
            measured = max(r["ttft"][2], r["itl"][2])
            check = "ok"
            if r["bound"] and measured <= limit:
                check = "FALSE ALARM"
            elif not r["bound"] and measured > limit:
                check = "MISSED"
            flag = "yes" if r["bound"] else "no"
            print(
                f"{users:5d} {load:5.0%} {r['client']:10.0f}% {measured:13.2f} {r['probe']:10.2f}"
                f" {r['self_cpu']:9.2f}  {flag:>12}  {regime:13} {check}"
            )
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
