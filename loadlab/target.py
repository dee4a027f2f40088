"""The target server: starting the embedded simulated SGLang server, and asking a server who it is."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any
from urllib.parse import urljoin

import orjson
from geventhttpclient import URL, HTTPClient

READY_PREFIX = "loadlab-sim listening on "
START_TIMEOUT_S = 30.0
EXIT_TARGET = 3  # the process exit status when the target cannot be reached


class TargetError(Exception):
    """The target cannot be used; the message is the one line to print."""


class ServerProcess:
    """A server child process that prints ``loadlab-sim listening on URL`` when ready (the embedded
    server and the scripted test server both do)."""

    def __init__(self, argv: list[str], start_timeout_s: float = START_TIMEOUT_S):
        self.argv = argv
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.stderr_lines: list[str] = []

    def start(self) -> str:
        self.proc = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            preexec_fn=die_with_parent,
            start_new_session=True,  # a terminal Ctrl-C stops the load generator, which then stops the server
        )
        ready: list[str] = []
        reader = threading.Thread(target=lambda: ready.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(self.start_timeout_s)
        line = ready[0].strip() if ready else ""
        if not line.startswith(READY_PREFIX):
            self.stop()
            err = (self.proc.stderr.read() or "").strip().splitlines() if self.proc.stderr else []
            why = err[-1] if err else f"no ready line within {self.start_timeout_s:g} s"
            raise TargetError(f"server did not start: {why}")
        self.url = line[len(READY_PREFIX) :]
        # Drain the child's output so it never blocks on a full pipe; keep stderr for diagnosis.
        threading.Thread(target=_drain, args=(self.proc.stdout, None), daemon=True).start()
        threading.Thread(target=_drain, args=(self.proc.stderr, self.stderr_lines), daemon=True).start()
        return self.url

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


class EmbeddedServer(ServerProcess):
    """`loadlab sim` as a child process on a free loopback port."""

    def __init__(self, settings: dict[str, Any]):
        from loadlab.sim.cli import settings_to_argv

        argv = [sys.executable, "-m", "loadlab.sim", "--host", "127.0.0.1", "--port", "0"]
        super().__init__(argv + settings_to_argv(settings))


def die_with_parent() -> None:
    """In the child: ask Linux to send SIGTERM when the parent dies, so a killed load generator never
    leaves an orphaned server behind. Elsewhere the server is only stopped by a clean exit."""
    try:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _drain(stream, sink: list[str] | None) -> None:
    try:
        for line in stream:
            if sink is not None:
                sink.append(line)
    except (OSError, ValueError):
        pass


def get_json(base_url: str, path: str, timeout_s: float = 10.0) -> tuple[int, Any]:
    """GET base_url + path; returns (status, decoded JSON or None)."""
    url = URL(urljoin(base_url.rstrip("/") + "/", path.lstrip("/")))
    client = HTTPClient.from_url(url, connection_timeout=timeout_s, network_timeout=timeout_s)
    try:
        resp = client.get(url.request_uri)
        body = resp.read()
        try:
            return resp.status_code, orjson.loads(body)
        except orjson.JSONDecodeError:
            return resp.status_code, None
    finally:
        client.close()


def probe(base_url: str, need_model: bool, wait_s: float = 0.0) -> dict[str, Any]:
    """Checks the target answers and returns {"server_info": ..., "model": ...}.

    Raises TargetError with one line when it cannot be reached. ``wait_s`` retries connection errors for
    that long (a server that is still starting)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            info = _first_json(base_url, ("/server_info", "/get_server_info"))
            break
        except OSError as e:
            if time.monotonic() >= deadline:
                raise TargetError(f"cannot reach target {base_url}: {e.strerror or e}") from None
            time.sleep(0.5)
    model = None
    if need_model:
        status, models = get_json(base_url, "/v1/models")
        data = models.get("data") if isinstance(models, dict) else None
        if status != 200 or not data:
            raise TargetError(
                f"target {base_url}: GET /v1/models gave no model (HTTP {status}); set target.model or --model"
            )
        model = data[0].get("id")
    return {"server_info": info, "model": model}


def _first_json(base_url: str, paths: tuple[str, ...]) -> Any:
    for path in paths:
        status, data = get_json(base_url, path)
        if status == 200 and isinstance(data, dict):
            return data
    return None
