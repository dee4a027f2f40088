"""Child processes: every server, scraper and Locust process loadlab starts goes through here.

A child runs in its own session (a terminal Ctrl-C reaches loadlab, which then stops it in order) and gets
SIGTERM when its parent dies (Linux ``PR_SET_PDEATHSIG``), so even a SIGKILLed load generator leaves no
server behind. ``stop`` ends a child, or its whole process group, politely first.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence


def die_with_parent() -> None:
    """In the child (``preexec_fn``): ask Linux to send SIGTERM when the parent dies. Elsewhere the child
    is only stopped by a clean exit."""
    try:
        import ctypes  # only in the child, between fork and exec

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def spawn(argv: Sequence[str], **popen_kwargs) -> subprocess.Popen:
    """Starts ``argv`` in its own session, tied to this process's life (see the module docstring)."""
    return subprocess.Popen(list(argv), preexec_fn=die_with_parent, start_new_session=True, **popen_kwargs)


def stop(proc: subprocess.Popen | None, timeout_s: float = 10.0, group: bool = False) -> None:
    """SIGTERM, then SIGKILL after ``timeout_s``. ``group``: the child's whole process group, also when
    the child itself already exited (an SGLang launcher killed for memory can leave scheduler processes
    holding the GPU and the port)."""
    if proc is None:
        return
    if group:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the group
        proc.wait()
        return
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ReadyLineProcess:
    """A server child that prints one ready line, ``<ready_prefix>URL``, on stdout when it listens (the
    twin and the scripted test server do), or ``ready_lines`` of them (a process serving several twins).
    ``start`` returns the (first) URL, ``urls`` has them all; the child's output is drained from then on
    (stderr kept for diagnosis, and echoed to this process's stderr after ``echo_prefix`` if one is given:
    every line, or with ``echo_if`` only the lines containing it) so it never blocks on a full pipe.
    ``launch`` and ``wait_ready`` are ``start`` in two halves, to start several children at once."""

    def __init__(self, argv: list[str], ready_prefix: str, start_timeout_s: float = 30.0,
                 ready_lines: int = 1, echo_prefix: str | None = None, echo_if: str | None = None,
                 env: dict[str, str | None] | None = None):  # fmt: skip
        """``env``: variables set for the child over this process's (None: removed), e.g. a secret that must
        not travel on its command line."""
        self.argv = argv
        self.env = env or {}
        self.ready_prefix = ready_prefix
        self.start_timeout_s = start_timeout_s
        self.ready_lines = ready_lines
        self.echo_prefix = echo_prefix
        self.echo_if = echo_if
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.urls: list[str] = []
        self.stderr_lines: list[str] = []
        self._ready: list[str] = []
        self._reader: threading.Thread | None = None

    def start(self) -> str:
        """The child's URL; raises ChildStartError (its last stderr line) when it does not become ready."""
        self.launch()
        return self.wait_ready()

    def launch(self) -> None:
        """Starts the child; its ready lines are read in the background until ``wait_ready``."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        env = {k: v for k, v in env.items() if v is not None}
        self.proc = spawn(self.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self._ready = []
        self._reader = threading.Thread(target=self._read_ready, daemon=True)
        self._reader.start()

    def _read_ready(self) -> None:
        for _ in range(self.ready_lines):
            line = self.proc.stdout.readline()
            self._ready.append(line)
            if not line.startswith(self.ready_prefix):
                return

    def wait_ready(self, timeout_s: float | None = None) -> str:
        """Waits (``start_timeout_s`` unless given) for the ready lines of a ``launch``ed child."""
        timeout_s = self.start_timeout_s if timeout_s is None else timeout_s
        self._reader.join(timeout_s)
        lines = [line.strip() for line in self._ready]
        if len(lines) < self.ready_lines or not all(line.startswith(self.ready_prefix) for line in lines):
            self.stop()
            err = (self.proc.stderr.read() or "").strip().splitlines() if self.proc.stderr else []
            raise ChildStartError(err[-1] if err else f"no ready line within {timeout_s:g} s")
        self.urls = [line[len(self.ready_prefix) :] for line in lines]
        self.url = self.urls[0]
        threading.Thread(target=_drain, args=(self.proc.stdout, None), daemon=True).start()
        threading.Thread(
            target=_drain,
            args=(self.proc.stderr, self.stderr_lines, self.echo_prefix, self.echo_if),
            daemon=True,
        ).start()
        return self.url

    def stop(self) -> None:
        stop(self.proc)


class ChildStartError(Exception):
    """A child server did not become ready; the message says why in one line."""


def _drain(
    stream, sink: list[str] | None, echo_prefix: str | None = None, echo_if: str | None = None
) -> None:
    try:
        for line in stream:
            if sink is not None:
                sink.append(line)
            if echo_prefix is not None and (echo_if is None or echo_if in line):
                sys.stderr.write(echo_prefix + line)
                sys.stderr.flush()
    except (OSError, ValueError):
        pass
