"""Server children for the tests and the benchmarks: the twin (``python -m loadlab sim``) and the scripted
server (``python -m loadlab.testing.scripted``), each started on a free loopback port. Both print the twin's
ready line; ``prefix`` goes before the command (e.g. ``["taskset", "-c", "0"]`` to pin a benchmark's
server to a core)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from loadlab.procs import ReadyLineProcess
from loadlab.sim import READY_PREFIX
from loadlab.testing.scripted import read_log

TWIN = [sys.executable, "-m", "loadlab", "sim"]
SCRIPTED = [sys.executable, "-m", "loadlab.testing.scripted"]


class ServerProcess(ReadyLineProcess):
    """The twin or the scripted server (or any command printing the twin's ready line) as a child.
    ``start()`` returns the URL; ``port`` is its port once started."""

    def __init__(self, argv: Sequence[str], start_timeout_s: float = 30.0):
        super().__init__(list(argv), READY_PREFIX, start_timeout_s)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])


class ScriptedServer(ServerProcess):
    """The scripted server, logging each event's write time to ``log_path``: ``case_url`` is the base URL
    of one of its cases, ``log_entries()`` its per-request log so far."""

    def __init__(
        self,
        log_path: Path,
        ttft_ms: float = 100.0,
        gap_ms: float = 20.0,
        prefix: Sequence[str] = (),
        start_timeout_s: float = 30.0,
    ):
        self.log_path = Path(log_path)
        argv = [*prefix, *SCRIPTED, "--port", "0", "--log", str(self.log_path),
                "--ttft-ms", str(ttft_ms), "--gap-ms", str(gap_ms)]  # fmt: skip
        super().__init__(argv, start_timeout_s)

    def case_url(self, case: str) -> str:
        return f"{self.url}/case/{case}"

    def log_entries(self) -> dict[str, dict]:
        """The server's per-request log, keyed by request id (= the client's server_id)."""
        return read_log(self.log_path) if self.log_path.exists() else {}


def start_scripted(
    log_path: Path, ttft_ms: float = 100.0, gap_ms: float = 20.0, prefix: Sequence[str] = ()
) -> ScriptedServer:
    """The scripted server, started: first event ``ttft_ms`` after each request, then one every
    ``gap_ms``."""
    server = ScriptedServer(log_path, ttft_ms, gap_ms, prefix)
    server.start()
    return server


def start_twin(*flags: str, prefix: Sequence[str] = ()) -> ServerProcess:
    """``loadlab sim --port 0 FLAGS...``, started."""
    server = ServerProcess([*prefix, *TWIN, "--port", "0", *flags])
    server.start()
    return server


@contextlib.contextmanager
def started_twins(*flag_sets: Sequence[str]) -> Iterator[list[ServerProcess]]:
    """One twin per flag set, all stopped on exit (those already started too when a later one fails)."""
    started: list[ServerProcess] = []
    try:
        for flags in flag_sets:
            started.append(start_twin(*flags))
        yield started
    finally:
        for twin in started:
            twin.stop()
