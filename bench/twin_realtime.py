"""Benchmark: how many streamed tokens/s can the real-time twin serve on one core, and how late are they?

Starts `loadlab sim` pinned to one core (taskset) and, pinned to the other core, a lean closed-loop client
(asyncio sockets, one request in flight per connection, events counted in the raw bytes, no JSON parsing)
so the client is never the bottleneck. For each concurrency it measures, over a steady window:

- delivered tokens/s (events received by the client; stream_interval 1, so one token per event);
- the server's CPU use (utime + stime from /proc) over the window;
- the server's own event lateness (write time minus the end of the forward pass that made the token),
  from /server_info's `loadlab_sim_timing` (whole run, ramp-up included);
- passes that started late and the model time lost to them (the CPU fell behind the model).

    taskset -c 1 python bench/twin_realtime.py [--concurrency 128 256 512 768] [--api generate completions]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import sys
import time
import urllib.request
from urllib.parse import urlsplit

from loadlab.testing.servers import start_twin

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime


def request_bytes(api: str, host: str, port: int, input_len: int, output_len: int, user: int) -> bytes:
    # Distinct prompts per user (no prefix sharing) as token ids, so the server does no tokenizing work.
    ids = [1000 + (user * 7919 + i) % 30000 for i in range(input_len)]
    if api == "generate":
        path = "/generate"
        body = {"input_ids": ids, "stream": True,
                "sampling_params": {"max_new_tokens": output_len, "ignore_eos": True}}  # fmt: skip
    else:
        path = "/v1/completions"
        body = {
            "model": "default",
            "prompt": ids,
            "max_tokens": output_len,
            "stream": True,
            "ignore_eos": True,
        }
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + data


class Counter:
    events = 0
    requests = 0


async def user(host: str, port: int, requests: list[bytes], stop_at: float, counter: Counter) -> None:
    n = 0
    while time.monotonic() < stop_at:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(requests[n % len(requests)])
        n += 1
        tail = b""
        while True:
            data = await reader.read(65536)
            if not data:
                break
            # Count "data: " markers, including one split across two reads.
            chunk = tail + data
            counter.events += chunk.count(b"data: ") - tail.count(b"data: ")
            tail = chunk[-5:]
        counter.events -= 1  # the final "data: [DONE]"
        counter.requests += 1
        writer.close()


async def drive(url: str, api: str, concurrency: int, input_len: int, output_len: int,
                warmup_s: float, window_s: float, pid: int) -> dict:  # fmt: skip
    parts = urlsplit(url)
    host, port = parts.hostname, parts.port
    counter = Counter()
    stop_at = time.monotonic() + warmup_s + window_s + 30
    # Output lengths vary (0.5x to 1.5x), as in real traffic, so that users do not finish in lockstep
    # waves (a wave of hundreds of new requests at one instant is a burst no real server sees).
    rng = random.Random(0)
    tasks = []
    for u in range(concurrency):
        lengths = [rng.randint(output_len // 2, output_len * 3 // 2) for _ in range(16)]
        requests = [request_bytes(api, host, port, input_len, n, u) for n in lengths]
        tasks.append(asyncio.create_task(user(host, port, requests, stop_at, counter)))
    await asyncio.sleep(warmup_s)
    e0, c0, m0, t0 = counter.events, cpu_seconds(pid), time.process_time(), time.monotonic()
    await asyncio.sleep(window_s)
    e1, c1, m1, t1 = counter.events, cpu_seconds(pid), time.process_time(), time.monotonic()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {
        "tokens_per_s": (e1 - e0) / (t1 - t0),
        "server_cpu": (c1 - c0) / (t1 - t0),
        "client_cpu": (m1 - m0) / (t1 - t0),
    }


def server_timing(url: str) -> dict:
    with urllib.request.urlopen(url + "/server_info", timeout=10) as r:
        info = json.load(r)
    return info["loadlab_sim_timing"] | {"running": info["internal_states"][0]["num_running_reqs"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[32, 64, 96, 128, 256, 384])
    parser.add_argument(
        "--api", nargs="+", choices=["generate", "completions"], default=["generate", "completions"]
    )
    parser.add_argument("--gpu", default="h100-80gb")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--warmup-s", type=float, default=4.0)
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--server-core", type=int, default=0)
    args = parser.parse_args()

    pin = ["taskset", "-c", str(args.server_core)] if shutil.which("taskset") else []
    print(f"# {platform.node()} {os.cpu_count()} cores, python {platform.python_version()}, {time.ctime()}")
    print(f"# server pinned to core {args.server_core if pin else '(unpinned)'}; client pid {os.getpid()} "
          f"on cores {sorted(os.sched_getaffinity(0))}; {args.gpu}, {args.input_len} in / {args.output_len} out")  # fmt: skip
    print("                                        pass-end lateness (ms)      token write lateness (ms)")
    print("api          users tokens/s server client   p50   p90   p99    max     p50   p90   p99    max"
          "  late passes lost s")  # fmt: skip
    for api in args.api:
        for c in args.concurrency:
            server = start_twin("--gpu", args.gpu, "--max-running-requests", str(max(c, 1)),
                                "--log-level", "warning", prefix=pin)  # fmt: skip
            url = server.url
            try:
                got = asyncio.run(drive(url, api, c, args.input_len, args.output_len,
                                        args.warmup_s, args.window_s, server.proc.pid))  # fmt: skip
                timing = server_timing(url)
            finally:
                server.stop()
            row = f"{api:<12} {c:5d} {got['tokens_per_s']:8.0f} {got['server_cpu']:6.0%} {got['client_cpu']:6.0%}"
            for key in ("pass_end_lateness_ms", "event_lateness_ms"):
                lat = timing[key]
                row += f"  {lat['p50']:5.2f} {lat['p90']:5.2f} {lat['p99']:5.2f} {lat['max']:6.2f}"
            print(f"{row} {timing['late_passes']:12d} {timing['lost_model_time_s']:6.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
