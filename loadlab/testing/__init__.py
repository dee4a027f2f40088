"""Test and benchmark support, not part of a run: the scripted server with exactly known event times
(``scripted``, an independent reference for the client's timing, on purpose sharing no wire code with the
twin) and the way to start a server child for a test."""

from __future__ import annotations

from loadlab.procs import ReadyLineProcess
from loadlab.sim import READY_PREFIX


class ServerProcess(ReadyLineProcess):
    """The twin (``python -m loadlab sim ...``) or the scripted server as a child; both print the twin's
    ready line. ``start()`` returns the URL."""

    def __init__(self, argv: list[str], start_timeout_s: float = 30.0):
        super().__init__(argv, READY_PREFIX, start_timeout_s)
