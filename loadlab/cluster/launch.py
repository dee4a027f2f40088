"""``loadlab cluster CLUSTER.yaml``: the workers (twins on free loopback ports), then the front, one ready
line, then serve until SIGTERM or SIGINT.

1. Every worker process is started at once (``python -m loadlab sim --instances N``: one process serves
   ``workers_per_process`` twins of one district); each prints a ready line per twin, then each twin must
   answer ``GET /health``.
2. The front: sglang-router (``python -m sglang_router.launch_router``, ready when its ``/readiness``
   counts every worker healthy), loadlab's omni front (``python -m loadlab.cluster.omni``, ready when it
   prints ``loadlab-omni listening on URL``), or none.
3. One line on stdout, ``loadlab-cluster ready {json}`` (``READY_PREFIX``; see ``ready_info``), and
   nothing else on stdout: the children's output goes to stderr, each line after ``[district/i]`` or
   ``[omni]`` (the router's as it is).
4. SIGTERM or SIGINT stops every child (SIGTERM to all, then SIGKILL to any left after a few seconds) and
   exits 0. A worker process that dies does not end the cluster: its death is logged once on stderr and
   the front goes on with the workers left (how each front notices: docs/cluster.md, "When a worker
   dies"); a front that dies ends the cluster (exit 1), since nothing reaches the workers without it.
   Every child runs in its own session and gets SIGTERM when this process dies (``loadlab.procs.spawn``),
   so even a SIGKILLed launcher leaves no worker or front behind.
5. With ``LOADLAB_SERVER_API_KEY`` set, every worker and the front require that key (SGLang's ``--api-key``):
   the twins and omni read it from their environment, the router is given ``--api-key``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from loadlab import exits
from loadlab.cluster import READY_PREFIX
from loadlab.cluster.config import ClusterConfig, load_cluster, worker_settings
from loadlab.cluster.omni_process import READY_PREFIX as OMNI_READY_PREFIX
from loadlab.cluster.omni_process import omni_argv
from loadlab.procs import ChildStartError, ReadyLineProcess, free_port, spawn
from loadlab.procs import stop as stop_child
from loadlab.sim import READY_PREFIX as SIM_READY_PREFIX
from loadlab.sim.auth import API_KEY_ENV, key_problem, server_api_key
from loadlab.sim.settings import settings_to_argv

ROUTER_MODULE = "sglang_router.launch_router"
WORKER_HOST = "127.0.0.1"  # workers listen on loopback only; the front is what others reach
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0

log = logging.getLogger("loadlab.cluster")


class ClusterStartError(Exception):
    """A worker or the front did not start; the message says which and why, in one line."""


class _Stopped(Exception):
    """SIGTERM or SIGINT arrived."""


def _url(host: str, port: int) -> str:
    # A front bound to every address is reached on loopback from this machine.
    shown = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(host, host)
    shown = f"[{shown}]" if ":" in shown and not shown.startswith("[") else shown
    return f"http://{shown}:{port}"


def _get(url: str, timeout_s: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, b""


class Cluster:
    """The processes of one cluster file: ``start`` returns ``ready_info``; ``stop`` ends them all."""

    def __init__(
        self, config: ClusterConfig, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None
    ):
        self.config, self.host, self.port = config, host, port
        # Required by every worker and the front, as by SGLang's --api-key (None: an open cluster). The
        # twins and omni read it from their environment; only the router must be given it as a flag.
        self.api_key = api_key
        self.child_env = {API_KEY_ENV: api_key}
        self.worker_procs: list[ReadyLineProcess] = []
        self.workers: list[dict[str, str]] = []  # {"url", "district"}, in the file's order
        self.front_proc: subprocess.Popen | None = None
        self.front_url: str | None = None
        self.front_metrics_url: str | None = None

    @property
    def children(self) -> list[subprocess.Popen]:
        procs = [w.proc for w in self.worker_procs if w.proc is not None]
        return procs + ([self.front_proc] if self.front_proc is not None else [])

    def start(self) -> dict[str, Any]:
        self._check_front_available()
        self._start_workers()
        kind = self.config.front.kind
        if kind == "router":
            self._start_router()
        elif kind == "omni":
            self._start_omni()
        return self.ready_info()

    def ready_info(self) -> dict[str, Any]:
        """What the ready line says: the front's URL (null without one), the workers with their districts,
        the front's kind and policy, and where the front's own metrics are (the router's Prometheus port)."""
        front = self.config.front
        return {"name": self.config.name, "front": self.front_url, "kind": front.kind, "policy": front.policy,
                "front_metrics": self.front_metrics_url, "workers": self.workers}  # fmt: skip

    def _check_front_available(self) -> None:
        kind = self.config.front.kind
        if kind == "router" and importlib.util.find_spec("sglang_router") is None:
            raise ClusterStartError(
                "front kind router needs sglang-router: pip install 'loadlab[router]' (or sglang-router)"
            )

    def _start_workers(self) -> None:
        counts: dict[str, int] = {}
        for district, n in self.config.processes():
            first = counts.get(district.name, 0)
            counts[district.name] = first + n
            argv = [sys.executable, "-m", "loadlab", "sim", "--host", WORKER_HOST, "--port", "0",
                    "--instances", str(n), *settings_to_argv(worker_settings(district))]  # fmt: skip
            tag = f"{district.name}/{first}" if n == 1 else f"{district.name}/{first}-{first + n - 1}"
            proc = ReadyLineProcess(argv, SIM_READY_PREFIX, START_TIMEOUT_S, ready_lines=n,
                                    echo_prefix=f"[{tag}] ", env=self.child_env)  # fmt: skip
            self.worker_procs.append(proc)
            proc.launch()
        deadline = time.monotonic() + START_TIMEOUT_S
        for proc, (district, _) in zip(self.worker_procs, self.config.processes(), strict=True):
            try:
                proc.wait_ready(max(0.1, deadline - time.monotonic()))
            except ChildStartError as e:
                raise ClusterStartError(f"a worker of district {district.name} did not start: {e}") from None
            self.workers += [{"url": url, "district": district.name} for url in proc.urls]
        for worker in self.workers:
            self._wait_answers(worker["url"] + "/health", f"worker {worker['url']}", deadline)
        log.info("loadlab cluster: %d workers ready (%s)", len(self.workers),
                 ", ".join(f"{d.name}: {d.workers}" for d in self.config.districts))  # fmt: skip

    def _wait_answers(self, url: str, what: str, deadline: float, proc=None) -> bytes:
        """Waits until GET ``url`` answers 200; its body."""
        while True:
            if proc is not None and proc.poll() is not None:
                raise ClusterStartError(f"{what} exited with status {proc.returncode} (its log is above)")
            with contextlib.suppress(OSError):
                status, body = _get(url)
                if status == 200:
                    return body
            if time.monotonic() > deadline:
                raise ClusterStartError(f"{what} did not answer {url} within {START_TIMEOUT_S:g} s")
            time.sleep(0.1)

    def _start_router(self) -> None:
        port = self.port or free_port(self.host or "127.0.0.1")
        metrics_port = free_port()
        urls = [w["url"] for w in self.workers]
        argv = [sys.executable, "-m", ROUTER_MODULE, "--host", self.host, "--port", str(port),
                "--worker-urls", *urls, "--policy", self.config.front.policy,
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
                "--log-level", "warn"]  # fmt: skip
        if self.api_key:
            # The router's key for its own calls to the workers (health, discovery, load); it forwards the
            # client's Authorization with each request. A flag is the only way the router takes it.
            argv += ["--api-key", self.api_key]
        if self.config.front.poll_interval_s:  # its /get_load polls (power_of_two) and startup checks
            argv += ["--worker-startup-check-interval", f"{self.config.front.poll_interval_s:.0f}"]
        # The router's output goes to stderr (stdout carries only the ready line). HF_HUB_OFFLINE: it tries to
        # fetch a tokenizer from the model hub at start; a load test's front has no business leaving the host.
        env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
        self.front_proc = spawn(argv, stdout=sys.stderr, stderr=sys.stderr, stdin=subprocess.DEVNULL,
                                env={**env, "NO_COLOR": "1", "HF_HUB_OFFLINE": "1"})  # fmt: skip
        url = _url(self.host, port)
        deadline = time.monotonic() + START_TIMEOUT_S
        # /health answers before the router has registered its workers; /readiness counts them.
        while True:
            body = self._wait_answers(url + "/readiness", "the router", deadline, self.front_proc)
            with contextlib.suppress(ValueError, AttributeError):
                if json.loads(body).get("healthy_workers", 0) >= len(urls):
                    break
            if time.monotonic() > deadline:
                raise ClusterStartError(f"the router did not count {len(urls)} healthy workers in time")
            time.sleep(0.1)
        self.front_url, self.front_metrics_url = url, f"http://127.0.0.1:{metrics_port}"
        log.info("loadlab cluster: sglang-router (%s) on %s", self.config.front.policy, url)

    def _start_omni(self) -> None:
        front = self.config.front
        districts = [(d.name, [w["url"] for w in self.workers if w["district"] == d.name], d.serves)
                     for d in self.config.districts]  # fmt: skip
        # The knobs as resolved from the file (its orientation's preset under its own keys; auto expanded).
        argv = omni_argv([w["url"] for w in self.workers], policy=front.policy, poll_interval_s=front.poll_interval_s,
                         queue_size=front.queue_size, max_in_flight_per_worker=front.max_in_flight_per_worker,
                         host=self.host, port=self.port, districts=districts,
                         switch=self.config.switch_routes(), switch_after_waiting=front.switch_after_waiting,
                         in_flight_fraction=front.in_flight_fraction)  # fmt: skip
        proc = ReadyLineProcess(argv, OMNI_READY_PREFIX, START_TIMEOUT_S, echo_prefix="[omni] ",
                                env=self.child_env)  # fmt: skip
        try:
            # omni names the address it listens on (http://0.0.0.0:P with --host 0.0.0.0); the ready line says
            # where this machine reaches it, as for the router.
            self.front_url = _url(self.host, int(proc.start().rsplit(":", 1)[1]))
        except ChildStartError as e:
            raise ClusterStartError(f"the omni front did not start: {e}") from None
        finally:
            self.front_proc = proc.proc
        log.info("loadlab cluster: omni front (%s%s) on %s", front.policy,
                 f", orientation {front.orientation}" if front.orientation else "", self.front_url)  # fmt: skip

    def dead_workers(self) -> list[ReadyLineProcess]:
        """The worker processes that have exited (a worker killed mid-run: the front serves with the rest)."""
        return [w for w in self.worker_procs if w.proc is not None and w.proc.poll() is not None]

    def front_exited(self) -> str | None:
        """Why the front is gone, if it is (without it nothing reaches the workers)."""
        if self.front_proc is not None and self.front_proc.poll() is not None:
            return f"the front ({self.config.front.kind}) {_exit_words(self.front_proc.returncode)}"
        return None

    def worker_death(self, proc: ReadyLineProcess) -> str:
        """One line on a dead worker process: its workers (URL and district), how it ended, who is left."""
        mine = set(proc.urls)
        named = ", ".join(f"{w['url']} ({w['district']})" for w in self.workers if w["url"] in mine)
        dead = {url for w in self.dead_workers() for url in w.urls}
        left = sum(1 for w in self.workers if w["url"] not in dead)
        plural = "s" if len(mine) != 1 else ""
        return (f"worker{plural} {named or proc.argv[-1]} {_exit_words(proc.proc.returncode)}; "
                f"the cluster keeps serving with {left} of {len(self.workers)} workers")  # fmt: skip

    def stop(self) -> None:
        """SIGTERM to every child at once, then waits for each (SIGKILL after ``STOP_TIMEOUT_S``)."""
        children = self.children
        for proc in children:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
        for proc in children:
            stop_child(proc, STOP_TIMEOUT_S)


def _exit_words(returncode: int | None) -> str:
    """``exited with status 1``, ``was killed by SIGKILL``."""
    if returncode is not None and returncode < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-returncode).name}"
    return f"exited with status {returncode}"


def run_cluster(
    path: str | Path, host: str = "127.0.0.1", port: int = 0, overrides: dict[str, Any] | None = None
) -> int:
    """``loadlab cluster``: starts the cluster, prints the ready line, serves until SIGTERM or SIGINT.
    ``overrides``: ``--set`` settings laid over the file (districts by name). Raises ClusterError for a bad
    file or override (before anything starts)."""
    config = load_cluster(path, overrides=overrides, source="--set ")
    api_key = server_api_key()
    problem = api_key and key_problem(api_key)
    if problem:
        log.error("loadlab cluster: %s: %s", API_KEY_ENV, problem)
        return exits.BAD_INPUT
    cluster = Cluster(config, host, port, api_key)
    if api_key:
        log.info("loadlab cluster: every worker and the front require the API key from %s", API_KEY_ENV)
    if config.front.kind == "none" and port:
        log.warning("loadlab cluster: --port %d: this cluster has no front (front.kind: none)", port)

    def on_signal(signum, frame):
        raise _Stopped

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    status = exits.OK
    try:
        info = cluster.start()
        sys.stdout.write(READY_PREFIX + json.dumps(info) + "\n")
        sys.stdout.flush()
        reported: set[int] = set()  # worker processes whose death was logged (once each)
        while True:
            front_gone = cluster.front_exited()
            if front_gone:  # nothing reaches the workers any more
                log.error("loadlab cluster: %s; stopping the cluster", front_gone)
                status = exits.PARTIAL
                break
            for proc in cluster.dead_workers():  # a worker death never ends the cluster
                if id(proc) not in reported:
                    reported.add(id(proc))
                    log.error("loadlab cluster: %s", cluster.worker_death(proc))
            time.sleep(0.2)
    except _Stopped:
        log.info("loadlab cluster: stopping")
    except ClusterStartError as e:
        log.error("loadlab cluster: %s", e)
        status = exits.TARGET
    finally:
        for sig in previous:  # a second signal must not cut the clean-up short
            signal.signal(sig, lambda *_: None)
        cluster.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return status
