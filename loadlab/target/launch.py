"""A server started from a sweep's launch template (argv, never a shell string): the twin or real SGLang,
ready when it answers ``/server_info``. Its output goes to a log file beside the sweep."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from loadlab.procs import spawn, stop
from loadlab.target.probe import TargetAuthError, TargetError, probe


class LaunchedServer:
    """A target started from the launch template for one configuration, ready when it answers."""

    def __init__(self, argv: list[str], url: str, ready_timeout_s: float, log_path: Path):
        self.argv, self.url, self.ready_timeout_s, self.log_path = argv, url, ready_timeout_s, log_path
        self.proc: subprocess.Popen | None = None

    def start(self, should_stop=lambda: False) -> None:
        argv = [sys.executable, "-m", "loadlab", *self.argv[1:]] if self.argv[0] == "loadlab" else self.argv
        with open(self.log_path, "ab") as log:
            self.proc = spawn(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise TargetError(
                    f"the server exited with status {self.proc.returncode}; see {self.log_path}"
                )
            if should_stop():  # Ctrl-C while a model loads (minutes for real SGLang)
                self.stop()
                raise TargetError("interrupted while the server was starting")
            try:
                probe(self.url, need_model=False, wait_s=0)
                return
            except TargetAuthError:
                return  # a secured server that answers is up; each run's own probe sends its key
            except TargetError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise TargetError(
                        f"the server did not answer at {self.url} within {self.ready_timeout_s:g} s"
                    ) from None
                time.sleep(0.5)

    def stop(self) -> None:
        """Stops the whole process group, also when its leader already died (an SGLang launcher killed for
        memory can leave scheduler processes holding the GPU and the port)."""
        stop(self.proc, timeout_s=30, group=True)
