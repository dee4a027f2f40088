"""Self-calibration: every load-generator process measures how late it handles I/O, and its CPU use.

A token's timestamp is taken when its greenlet gets to run after the socket became readable; if the
process is busy (other users' bookkeeping, too many streams for one core, a CPU hog), that is late, and
every latency the run reports is off by as much. So each process runs a probe the way a network event
arrives: a plain OS thread (not a greenlet) writes to a pipe every ``PROBE_INTERVAL_S`` the time the probe
was due; a greenlet reads it like any socket and records how long it waited (``LatenessHistogram``). The
probe's P99 is the run's client timing error bound. CPU use (process CPU time over wall time, per second)
says why.

A process is "client-bound" when the probe's P99 or its mean CPU passes the limits (``--client-limit-ms``,
``--client-limit-cpu``): its figures describe the load generator as much as the server; add workers.
"""

from __future__ import annotations

import os
import struct
import time
from typing import Any

import gevent
from gevent import os as gevent_os
from gevent.monkey import get_original

from loadlab.lateness import LatenessHistogram

PROBE_INTERVAL_S = 0.01
CPU_SAMPLE_S = 1.0

_real_sleep = get_original("time", "sleep")
_start_thread = get_original("_thread", "start_new_thread")
_STAMP = struct.Struct("d")


class ClientMonitor:
    """The probe and the CPU sampler of one load-generator process."""

    def __init__(self) -> None:
        self.lateness = LatenessHistogram()
        self.cpu_samples: list[float] = []
        self._read_fd, self._write_fd = os.pipe()
        gevent_os.make_nonblocking(self._read_fd)
        self._stopped = False
        self._greenlets: list[gevent.Greenlet] = []
        self.started_wall = time.time()
        self._cpu0 = self._cpu_mark = time.process_time()
        self._wall0 = self._wall_mark = time.monotonic()

    def reset(self) -> None:
        """Starts measuring afresh (when the measured phase begins: warm-up has start-up costs)."""
        self.lateness = LatenessHistogram()
        self.cpu_samples = []
        self._cpu0 = self._cpu_mark = time.process_time()
        self._wall0 = self._wall_mark = time.monotonic()

    def start(self) -> ClientMonitor:
        _start_thread(self._probe_thread, ())
        self._greenlets = [gevent.spawn(self._read_probes), gevent.spawn(self._sample_cpu)]
        return self

    def _probe_thread(self) -> None:
        # Each probe carries the time it was due, not when this thread got to run: a process that is off
        # the CPU or waiting for the GIL delays a token that has arrived just the same, so that counts too.
        fd = self._write_fd
        due = time.perf_counter()
        try:
            while not self._stopped:
                due += PROBE_INTERVAL_S
                now = time.perf_counter()
                if due > now:
                    _real_sleep(due - now)
                elif now - due > 1.0:  # stalled for over a second: one late probe says it, then resume
                    due = now
                os.write(fd, _STAMP.pack(due))
        except OSError:
            pass  # the reading end closed: the monitor stopped
        finally:
            os.close(fd)  # here, not in stop(): the number must not be reused while this thread may write

    def _read_probes(self) -> None:
        fd = self._read_fd
        size = _STAMP.size
        buf = b""
        while True:
            chunk = gevent_os.nb_read(fd, 4096)
            now = time.perf_counter()
            if not chunk:
                return
            buf += chunk
            whole = len(buf) - len(buf) % size
            for (sent,) in _STAMP.iter_unpack(buf[:whole]):
                self.lateness.record(now - sent)
            buf = buf[whole:]

    def _sample_cpu(self) -> None:
        while True:
            gevent.sleep(CPU_SAMPLE_S)
            cpu, wall = time.process_time(), time.monotonic()
            self.cpu_samples.append((cpu - self._cpu_mark) / max(wall - self._wall_mark, 1e-9))
            self._cpu_mark, self._wall_mark = cpu, wall

    def summary(self) -> dict[str, Any]:
        """What the process measured so far: probe lateness (ms) and CPU (fraction of one core)."""
        wall = time.monotonic() - self._wall0
        return {
            "probe_lateness_ms": self.lateness.summary_ms(),
            "cpu_mean": round((time.process_time() - self._cpu0) / max(wall, 1e-9), 3),
            "cpu_max": round(max(self.cpu_samples), 3) if self.cpu_samples else None,
            "seconds": round(wall, 1),
        }

    def stop(self) -> dict[str, Any]:
        summary = self.summary()
        if not self._stopped:
            self._stopped = True
            gevent.killall(self._greenlets)
            os.close(self._read_fd)
        return summary


def verdict(generators: list[dict[str, Any]], limit_ms: float, limit_cpu: float) -> dict[str, Any]:
    """The run's client timing error bound (worst process's probe P99) and whether it is client-bound,
    with the reasons, from each process's summary (with its ``worker_id``)."""
    reasons = []
    bound = None
    for g in generators:
        p99 = (g.get("probe_lateness_ms") or {}).get("p99")
        who = g.get("worker_id", "the load generator")
        if p99 is not None:
            bound = p99 if bound is None else max(bound, p99)
            if p99 > limit_ms:
                reasons.append(f"{who}: I/O handled up to {p99:g} ms late (P99; limit {limit_ms:g} ms)")
        cpu = g.get("cpu_mean")
        if cpu is not None and cpu > limit_cpu:
            reasons.append(f"{who}: {cpu:.0%} CPU (mean; limit {limit_cpu:.0%})")
    return {
        "error_bound_ms": bound,
        "client_bound": bool(reasons),
        "reasons": reasons,
        "limits": {"lateness_p99_ms": limit_ms, "cpu_mean": limit_cpu},
        "generators": generators,
    }
