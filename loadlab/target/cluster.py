"""A cluster as a run's target: ``loadlab cluster FILE`` as a child process (a profile's ``target.cluster``),
started like the embedded twin; the run aims at its front."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from loadlab.cluster import ERROR_MARK, READY_PREFIX
from loadlab.cluster.config import flatten_overrides, load_cluster, worker_settings
from loadlab.manifest import ClusterDistrictInfo, ClusterInfo, ClusterWorkerInfo
from loadlab.procs import ChildStartError, ReadyLineProcess
from loadlab.profile import CLUSTER_OVERRIDES
from loadlab.sim.auth import API_KEY_ENV as SERVER_API_KEY_ENV
from loadlab.target.probe import TargetError

START_TIMEOUT_S = 120.0  # every worker, then the front


class EmbeddedCluster(ReadyLineProcess):
    """``loadlab cluster FILE --port 0``; ``start`` returns the URL a run aims at (the front, or the one
    worker of a cluster without a front); ``workers`` and ``info()`` say what was started. ``api_key``:
    the run's, which the cluster then requires (``loadlab cluster`` reads it from its environment)."""

    def __init__(self, path: str | Path, overrides: dict[str, Any] | None = None, api_key: str | None = None):
        self.path = str(path)
        # The profile's target.cluster_overrides: checked here (bad input, before anything starts) and
        # passed on as --set, so the launcher starts what this config says (and the manifest records).
        self.overrides = flatten_overrides(overrides or {})
        self.config = load_cluster(path, True, self.overrides, source=f"{CLUSTER_OVERRIDES}.")
        argv = [sys.executable, "-m", "loadlab", "cluster", self.path, "--host", "127.0.0.1", "--port", "0"]
        for key, value in self.overrides.items():
            argv += ["--set", f"{key}={json.dumps(value)}"]  # JSON is YAML: --set reads it back as it was
        # The launcher's errors reach the run's log (a worker that died mid-run: the cluster goes on without
        # it); the children's own chatter stays in stderr_lines.
        # The run's key, if any, secures every worker and the front (in the environment, never argv).
        super().__init__(argv, READY_PREFIX, START_TIMEOUT_S, echo_prefix="[cluster] ", echo_if=ERROR_MARK,
                         env={SERVER_API_KEY_ENV: api_key})  # fmt: skip
        self.ready: dict[str, Any] = {}

    def start(self) -> str:
        try:
            super().start()
        except ChildStartError as e:
            raise TargetError(f"cluster {self.path} did not start: {e}") from None
        self.ready = json.loads(self.url)
        self.url = self.ready["front"] or self.ready["workers"][0]["url"]
        return self.url

    @property
    def worker_urls(self) -> list[str]:
        return [w["url"] for w in self.ready.get("workers", [])]

    def info(self) -> ClusterInfo:
        """What the manifest records of the cluster."""
        front = self.config.front
        return ClusterInfo(
            file=self.path,
            name=self.config.name,
            front_kind=front.kind,
            policy=front.policy,
            front_url=self.ready.get("front"),
            workers=[ClusterWorkerInfo(**w) for w in self.ready.get("workers", [])],
            districts=[
                ClusterDistrictInfo(
                    name=d.name, workers=d.workers, settings=worker_settings(d), serves=d.serves
                )
                for d in self.config.districts
            ],
            workers_per_process=self.config.workers_per_process,
            front_settings=self.config.front_settings(),
            overrides=self.overrides or None,
        )
