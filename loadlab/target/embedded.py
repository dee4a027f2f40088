"""The embedded target: the twin (``loadlab sim``) as a child process on a free loopback port."""

from __future__ import annotations

import sys
from typing import Any

from loadlab.procs import ChildStartError, ReadyLineProcess
from loadlab.sim import READY_PREFIX
from loadlab.sim.settings import settings_to_argv
from loadlab.target.probe import TargetError


class EmbeddedServer(ReadyLineProcess):
    """``loadlab sim`` with a profile's ``target.embedded`` settings; ``start`` returns its URL."""

    def __init__(self, settings: dict[str, Any]):
        argv = [sys.executable, "-m", "loadlab", "sim", "--host", "127.0.0.1", "--port", "0"]
        super().__init__(argv + settings_to_argv(settings), READY_PREFIX)

    def start(self) -> str:
        try:
            return super().start()
        except ChildStartError as e:
            raise TargetError(f"server did not start: {e}") from None
