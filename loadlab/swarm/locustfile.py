"""loadlab inside Locust: options, the run's life cycle, and the user class.

`locust -f locustfile.py` (the repo's thin locustfile imports this module) and `loadlab run` (which starts
Locust on this file) run exactly this code.
"""

from __future__ import annotations

import logging
import sys

import gevent
from locust import events
from locust.runners import MasterRunner, WorkerRunner

from loadlab.profile import ProfileError, load_profile
from loadlab.swarm.options import add_loadlab_arguments, overrides_from_options
from loadlab.swarm.run import Run
from loadlab.swarm.users import SGLangUser
from loadlab.target import EmbeddedServer, TargetError, probe
from loadlab.workload import build_workload
from loadlab.workload.text import Renderer

__all__ = ["SGLangUser"]

log = logging.getLogger("loadlab")

EXIT_BAD_INPUT = 2
EXIT_TARGET = 3


@events.init_command_line_parser.add_listener
def _add_options(parser, **_kw):
    add_loadlab_arguments(parser, locust=True)


def _fail(message: str, status: int) -> None:
    print(f"loadlab: {message}", file=sys.stderr, flush=True)
    sys.exit(status)


class _Session:
    """What init prepares for every run of this process: the profile and the target."""

    def __init__(self, environment):
        opts = environment.parsed_options
        self.environment = environment
        self.profile_path = opts.profile_file
        self.profile = load_profile(self.profile_path, overrides_from_options(opts, environment.host))
        self.workload = build_workload(self.profile)
        self.renderer = Renderer(self.profile.target.tokenizer)  # a bad tokenizer file fails here
        self.embedded: EmbeddedServer | None = None
        target = self.profile.target
        if target.url == "embedded":
            self.embedded = EmbeddedServer(target.embedded)
            environment.host = self.embedded.start()
        else:
            environment.host = target.url
        try:
            found = probe(environment.host, need_model=target.api != "generate" and not target.model)
        except TargetError:
            self.stop_embedded()
            raise
        self.model = target.model or found["model"]
        self.target_info = {
            "url": environment.host,
            "embedded": self.embedded is not None,
            "embedded_settings": target.embedded if self.embedded else None,
            "server_info": found["server_info"],
        }
        # The profile's concurrency applies unless Locust's -u was given.
        if opts.num_users is None:
            opts.num_users = self.profile.load.concurrency
        if opts.spawn_rate is None:
            opts.spawn_rate = max(1, opts.num_users)  # all users within about a second
        self.run: Run | None = None

    def stop_embedded(self) -> None:
        if self.embedded is not None:
            self.embedded.stop()


@events.init.add_listener
def _on_init(environment, runner, **_kw):
    if isinstance(runner, MasterRunner | WorkerRunner):
        _fail("distributed mode (--master/--worker) is not supported yet; run one process", EXIT_BAD_INPUT)
    try:
        environment.loadlab_session = _Session(environment)
    except ProfileError as e:
        _fail(str(e), EXIT_BAD_INPUT)
    except TargetError as e:
        _fail(str(e), EXIT_TARGET)


@events.test_start.add_listener
def _on_test_start(environment, **_kw):
    session = environment.loadlab_session
    run = Run(
        session.profile,
        session.profile_path,
        session.workload,
        session.renderer,
        environment.parsed_options.out,
        environment.parsed_options.run_name,
        session.target_info,
        session.model,
        environment.runner.target_user_count or environment.parsed_options.num_users,
        sys.argv,
    )
    session.run = environment.loadlab_run = run
    log.info("loadlab: run directory %s", run.dir)
    gevent.spawn(_stop_when_done, environment, run)
    gevent.spawn(_show_progress, run)


PROGRESS_EVERY_S = 10.0


def _show_progress(run: Run) -> None:
    """A progress line every few seconds on long runs: phase, counts, failures, ETA."""
    while not run.tickets.all_done.wait(PROGRESS_EVERY_S):
        if run.finalized:
            return
        log.info("loadlab: %s", run.progress())


def _stop_when_done(environment, run: Run) -> None:
    """Ends the run by itself once every measured request has finished (no -t needed)."""
    run.tickets.all_done.wait()
    if environment.parsed_options.headless:
        environment.runner.quit()
    else:
        environment.runner.stop()  # the web UI stays up for the next run


@events.test_stop.add_listener
def _on_test_stop(environment, **_kw):
    session = getattr(environment, "loadlab_session", None)
    if session is not None and session.run is not None:
        session.run.finalize()


@events.quitting.add_listener
def _on_quitting(environment, **_kw):
    session = getattr(environment, "loadlab_session", None)
    if session is None:
        return
    run = session.run
    if run is not None:
        run.finalize()
        # Failed requests are data, not a failed run: exit 0 when the run completed, 1 when it was cut short.
        environment.process_exit_code = 0 if run.complete else 1
    session.stop_embedded()
