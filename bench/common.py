"""Pieces the benchmarks share: the machine line, error distributions, CPU sampling, clean-up (the servers
themselves come from ``loadlab.testing.servers``)."""

from __future__ import annotations

import os
import platform
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from loadlab.testing.servers import ServerProcess

TICKS = os.sysconf("SC_CLK_TCK")
MACHINE = -1  # a CPU sampler's key for the whole machine


def machine_line() -> str:
    return f"# {platform.node()} {os.cpu_count()} cores, python {platform.python_version()}, {time.ctime()}"


def dist(values) -> list[float]:
    """P50, P95, P99 and max of |values|."""
    mags = np.abs(np.asarray(values, dtype=float))
    if not mags.size:
        return [float("nan")] * 4
    return [*np.percentile(mags, [50, 95, 99]), mags.max()]


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


class CpuSampler:
    """Samples, every ``interval_s`` in a thread, the CPU time of the server, of the whole machine
    (``MACHINE``) and of the processes ``discover()`` returns as {pid: role} (checked on every sample, so
    processes that start later are picked up)."""

    def __init__(self, server: int, discover: Callable[[], dict[int, str]], interval_s: float):
        self.discover = discover
        self.interval_s = interval_s
        self.roles: dict[int, str] = {}
        self.samples: dict[int, list[tuple[float, float]]] = {server: [], MACHINE: []}  # pid -> [(wall, s)]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            for pid, role in self.discover().items():
                if pid not in self.roles:
                    self.roles[pid] = role
                    self.samples.setdefault(pid, [])
            for pid, series in self.samples.items():
                now = time.time()
                cpu = machine_busy_seconds() if pid == MACHINE else cpu_seconds(pid)
                if cpu is not None:
                    series.append((now, cpu))
            self.stop.wait(self.interval_s)

    def finish(self) -> None:
        self.stop.set()
        self.thread.join()

    def used(self, pid: int, t0: float, t1: float) -> float:
        """CPU seconds of ``pid`` between wall times t0 and t1 (linear between samples)."""
        series = self.samples.get(pid) or []
        if len(series) < 2:
            return float("nan")
        walls, cpus = zip(*series, strict=True)
        return float(np.interp(t1, walls, cpus) - np.interp(t0, walls, cpus))

    def role_used(self, roles: set[str], t0: float, t1: float) -> float:
        """CPU seconds of every discovered process whose role is in ``roles``."""
        pids = [p for p, r in self.roles.items() if r in roles]
        return sum(self.used(p, t0, t1) for p in pids) if pids else float("nan")


def finish(server: ServerProcess, work: Path, keep: bool) -> None:
    """Stops the scripted server; removes the work directory unless asked to keep it."""
    import shutil

    server.stop()
    if keep:
        print(f"# runs and server log kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
