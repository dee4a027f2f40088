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
    twin and the scripted test server do). ``start`` returns the URL; the child's output is drained from
    then on (stderr kept for diagnosis) so it never blocks on a full pipe."""

    def __init__(self, argv: list[str], ready_prefix: str, start_timeout_s: float = 30.0):
        self.argv = argv
        self.ready_prefix = ready_prefix
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.stderr_lines: list[str] = []

    def start(self) -> str:
        """The child's URL; raises ChildStartError (its last stderr line) when it does not become ready."""
        self.proc = spawn(self.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
        ready: list[str] = []
        reader = threading.Thread(target=lambda: ready.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(self.start_timeout_s)
        line = ready[0].strip() if ready else ""
        if not line.startswith(self.ready_prefix):
            self.stop()
            err = (self.proc.stderr.read() or "").strip().splitlines() if self.proc.stderr else []
            raise ChildStartError(err[-1] if err else f"no ready line within {self.start_timeout_s:g} s")
        self.url = line[len(self.ready_prefix) :]
        threading.Thread(target=_drain, args=(self.proc.stdout, None), daemon=True).start()
        threading.Thread(target=_drain, args=(self.proc.stderr, self.stderr_lines), daemon=True).start()
        return self.url

    def stop(self) -> None:
        stop(self.proc)


class ChildStartError(Exception):
    """A child server did not become ready; the message says why in one line."""


def _drain(stream, sink: list[str] | None) -> None:
    try:
        for line in stream:
            if sink is not None:
                sink.append(line)
    except (OSError, ValueError):
        pass
