"""Pieces the benchmarks share: the scripted server with known event times, and the machine line."""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path

from loadlab.target import ServerProcess


def start_scripted_server(work: Path, ttft_ms: float, gap_ms: float, *pin: str) -> tuple[ServerProcess, Path]:
    """`loadlab.sim.scripted` on a free port, logging each event's write time to ``work/server.jsonl``;
    ``pin`` prefixes the command (e.g. ``taskset -c 0``). Returns the started server and its log."""
    log = work / "server.jsonl"
    server = ServerProcess(
        [*pin, sys.executable, "-m", "loadlab.sim.scripted", "--port", "0", "--log", str(log),
         "--ttft-ms", str(ttft_ms), "--gap-ms", str(gap_ms)]
    )  # fmt: skip
    server.start()
    return server, log


def machine_line() -> str:
    return f"# {platform.node()} {os.cpu_count()} cores, python {platform.python_version()}, {time.ctime()}"
