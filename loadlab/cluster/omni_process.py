"""The omni front as a child process: its command line and its ready line (no aiohttp here, so a launcher
can import this without the front's dependencies).

``python -m loadlab.cluster.omni --host H --port P --policy NAME --poll-interval-s S --queue-size N
[--max-in-flight-per-worker K | --in-flight-fraction F] [--switch CLASS=DISTRICT,... --switch-after-waiting N]
(WORKER_URL... | --district NAME[:CLASS,...]=URL,... ...)`` prints exactly one line, ``loadlab-omni listening on
http://HOST:PORT`` (``READY_PREFIX``; the real port, also with port 0), when it listens; SIGTERM or SIGINT
stops it (exit 0); a bad flag is one line on stderr and exit 2.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence

from loadlab.procs import ReadyLineProcess

READY_PREFIX = "loadlab-omni listening on "
OMNI = [sys.executable, "-m", "loadlab.cluster.omni"]


def omni_argv(
    workers: Sequence[str],
    policy: str = "round_robin",
    poll_interval_s: float = 1.0,
    queue_size: int = 100,
    max_in_flight_per_worker: int | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    extra: Sequence[str] = (),
    districts: Sequence[tuple[str, Sequence[str], Sequence[str] | None]] = (),
    switch: Mapping[str, Sequence[str]] | None = None,
    switch_after_waiting: int = 0,
    in_flight_fraction: float = 1.0,
) -> list[str]:
    """The front's command line (``extra``: further flags, e.g. ``["--prefix-len", "64"]``). ``districts``:
    (name, worker URLs, classes served or None for any) each, as ``--district NAME[:CLASS,...]=URL,...``
    instead of the positional ``workers``. ``switch``: {class: districts its overflow may go to}, as
    ``--switch CLASS=DISTRICT,...`` each, with ``--switch-after-waiting``."""
    argv = [*OMNI, "--host", host, "--port", str(port), "--policy", policy,
            "--poll-interval-s", f"{poll_interval_s:g}", "--queue-size", str(queue_size)]  # fmt: skip
    if max_in_flight_per_worker is not None:
        argv += ["--max-in-flight-per-worker", str(max_in_flight_per_worker)]
    if in_flight_fraction != 1.0:
        argv += ["--in-flight-fraction", f"{in_flight_fraction:g}"]
    for cls, targets in (switch or {}).items():
        argv += ["--switch", f"{cls}={','.join(targets)}"]
    if switch:
        argv += ["--switch-after-waiting", str(switch_after_waiting)]
    if districts:
        for name, urls, serves in districts:
            classes = "" if serves is None else ":" + ",".join(serves)
            argv += ["--district", f"{name}{classes}={','.join(urls)}"]
        return [*argv, *extra]
    return [*argv, *extra, "--", *workers]


class OmniProcess(ReadyLineProcess):
    """The front as a child: ``start()`` returns its URL once it listens."""

    def __init__(self, argv: Sequence[str], start_timeout_s: float = 30.0):
        super().__init__(list(argv), READY_PREFIX, start_timeout_s)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])
