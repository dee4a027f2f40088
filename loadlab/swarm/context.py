"""loadlab's state in one Locust process, attached once at init as ``environment.loadlab``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loadlab.swarm.exporter import MetricsServer
    from loadlab.swarm.master import Coordinator
    from loadlab.swarm.run import Run
    from loadlab.swarm.session import Session
    from loadlab.swarm.worker import WorkerAgent, WorkerRun


@dataclass
class LoadlabContext:
    """What loadlab's event hooks and users share through Locust's Environment. Which fields are set says
    what this process is: a one-process run (session), a master (session and coordinator) or a worker
    (agent)."""

    session: Session | None = None  # the profile, workload and target (one-process runs and masters)
    # The run the users take tickets from and record into: a Run (one process, or the master's), a WorkerRun
    # on a worker once the master's run reached it; None before the first run or when it could not start.
    run: Run | WorkerRun | None = None
    coordinator: Coordinator | None = None  # the master's side of a distributed run (masters only)
    agent: WorkerAgent | None = None  # the worker's side of a distributed run (workers only)
    # Who shows the live figures (loadlab.swarm.live): the web UI's LLM tab and /metrics, --metrics-port.
    web_ui: bool = False
    metrics_server: MetricsServer | None = None

    @property
    def shows_live(self) -> bool:
        return self.web_ui or self.metrics_server is not None
