"""What a Locust process prepares at init for every run it owns: the profile (with the command line's
overrides), the workload, the renderer and the target (started when it is the embedded twin or a cluster
of twins, probed)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from loadlab.cluster.config import check_classes
from loadlab.manifest import TargetInfo
from loadlab.profile import ProfileError, api_key_source, load_profile, read_api_key
from loadlab.swarm.options import OPEN_LOOP_MAX_USERS, overrides_from_options
from loadlab.target.cluster import EmbeddedCluster
from loadlab.target.embedded import EmbeddedServer
from loadlab.target.probe import TargetError, probe
from loadlab.workload import build_workload
from loadlab.workload.text import Renderer

log = logging.getLogger("loadlab")


class Session:
    """What init prepares for every run of this process: the profile, the workload and the target."""

    def __init__(self, environment):
        opts = environment.parsed_options
        self.environment = environment
        if opts.num_users is not None and opts.num_users < 1:
            raise ProfileError(f"-u/--users: must be at least 1 (got {opts.num_users})")
        check_out_dir(opts.out)
        self.profile_path = opts.profile_file
        self.profile = load_profile(self.profile_path, overrides_from_options(opts, environment.host))
        self.workload = build_workload(self.profile)
        self.renderer = Renderer(self.profile.target.tokenizer)  # a bad tokenizer file fails here
        target = self.profile.target
        # The target's API key, from the environment or a file (never the profile or the command line): a
        # variable or file the profile names that is missing fails here, before anything starts.
        self.api_key = read_api_key(target, self.profile_path)
        self.embedded: EmbeddedServer | EmbeddedCluster | None = None
        if target.url == "embedded":
            # A cluster file that does not load is bad input, like the profile (a ClusterError), and so are
            # classes its districts do not serve (a ProfileError): both before anything starts. The
            # profile's cluster_overrides are laid over the file (checked the same way).
            if target.cluster:
                self.embedded = EmbeddedCluster(target.cluster, target.cluster_overrides, self.api_key)
                for warning in check_classes(
                    self.profile, self.profile_path, self.embedded.config, target.cluster
                ):
                    log.warning(warning)
            else:
                self.embedded = EmbeddedServer(target.embedded, self.api_key)
            environment.host = self.embedded.start()
        else:
            environment.host = target.url
        try:
            self.use_target(environment.host)
        except TargetError:
            self.stop_embedded()
            raise
        # The profile's concurrency (closed loop; open loop's cap) applies unless Locust's -u was given.
        if opts.num_users is None:
            requests = self.profile.requests.warmup + self.profile.requests.measured
            opts.num_users = self.profile.load.concurrency or min(requests, OPEN_LOOP_MAX_USERS)
        if opts.spawn_rate is None:
            opts.spawn_rate = max(1, opts.num_users)  # all users within about a second

    def use_target(self, url: str) -> None:
        """Probes the target and remembers who it is (again when the web UI's Host field changes it)."""
        target = self.profile.target
        wait = self.environment.parsed_options.target_wait
        found = probe(url, need_model=target.api != "generate" and not target.model, wait_s=wait,
                      api_key=self.api_key, key_source=api_key_source(target))  # fmt: skip
        self.model = target.model or found["model"]
        ours = self.embedded is not None and url == self.embedded.url
        cluster = self.embedded if ours and isinstance(self.embedded, EmbeddedCluster) else None
        self.target_info = TargetInfo(
            url=url,
            embedded=ours,
            embedded_settings=target.embedded if self.embedded and not cluster else None,
            server_info=found["server_info"],
            cluster=cluster.info() if cluster else None,
        )

    def metrics_urls(self, url: str) -> list[str]:
        """The servers the scraper reads: the profile's metrics_urls, else a cluster's workers (when the run
        aims at its front), else the target."""
        target = self.profile.target
        if target.metrics_urls:
            return list(target.metrics_urls)
        if isinstance(self.embedded, EmbeddedCluster) and url == self.embedded.url:
            return self.embedded.worker_urls
        return [url]

    def stop_embedded(self) -> None:
        if self.embedded is not None:
            self.embedded.stop()


def check_out_dir(out: str) -> None:
    """--out must be a directory loadlab can write (created if missing); ProfileError otherwise."""
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ProfileError(f"--out {out}: cannot create the directory ({e.strerror})") from None
    if not os.access(out, os.W_OK):
        raise ProfileError(f"--out {out}: the directory is not writable")
