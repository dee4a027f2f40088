"""The embedded target: the twin (``loadlab sim``) as a child process on a free loopback port."""

from __future__ import annotations

import sys
from typing import Any

from loadlab.procs import ChildStartError, ReadyLineProcess
from loadlab.sim import READY_PREFIX
from loadlab.sim.auth import API_KEY_ENV as SERVER_API_KEY_ENV
from loadlab.sim.settings import settings_to_argv
from loadlab.target.probe import TargetError


class EmbeddedServer(ReadyLineProcess):
    """``loadlab sim`` with a profile's ``target.embedded`` settings; ``start`` returns its URL. With the
    run's ``api_key`` it requires that key, as a secured SGLang would (given in its environment, never its
    command line); without one it is open."""

    def __init__(self, settings: dict[str, Any], api_key: str | None = None):
        argv = [sys.executable, "-m", "loadlab", "sim", "--host", "127.0.0.1", "--port", "0"]
        env = {SERVER_API_KEY_ENV: api_key}
        super().__init__(argv + settings_to_argv(settings), READY_PREFIX, env=env)

    def start(self) -> str:
        try:
            return super().start()
        except ChildStartError as e:
            raise TargetError(f"server did not start: {e}") from None
