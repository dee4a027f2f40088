"""loadlab inside Locust: options, the run's life cycle, and the user class.

`locust -f locustfile.py` (the repo's thin locustfile imports this module) and `loadlab run` (which starts
Locust on this file) run exactly this code.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import signal
import sys

import gevent
from locust import events
from locust.runners import MasterRunner, WorkerRunner

from loadlab import exits
from loadlab.profile import ProfileError
from loadlab.swarm.calibration import ClientMonitor
from loadlab.swarm.context import LoadlabContext
from loadlab.swarm.exporter import MetricsServer, registry_for
from loadlab.swarm.live import LiveFigures
from loadlab.swarm.master import Coordinator
from loadlab.swarm.options import (
    add_loadlab_arguments,
)
from loadlab.swarm.run import Run
from loadlab.swarm.session import Session, check_out_dir
from loadlab.swarm.users import SGLangUser, off_the_clock
from loadlab.swarm.weblogin import WebLoginError, check_and_install
from loadlab.swarm.webui import install as install_llm_tab
from loadlab.swarm.worker import WorkerAgent
from loadlab.target.probe import TargetError
from loadlab.target.scraper import Scraper
from loadlab.yamlconfig import ConfigError

__all__ = ["SGLangUser"]

log = logging.getLogger("loadlab")


@events.init_command_line_parser.add_listener
def _add_options(parser, **_kw):
    add_loadlab_arguments(parser, locust=True)


def _fail(message: str, status: int) -> None:
    print(f"loadlab: {message}", file=sys.stderr, flush=True)
    sys.exit(status)


@events.init.add_listener
def _on_init(environment, runner, **_kw):
    environment.loadlab = context = LoadlabContext()  # every hook below reads it, even if init fails
    # Ctrl-C: raise KeyboardInterrupt in the main greenlet (Locust's shutdown path) from the hub, never
    # inside whichever user greenlet happens to be running when the signal arrives.
    main = gevent.getcurrent()
    gevent.signal_handler(signal.SIGINT, lambda: main.throw(KeyboardInterrupt()))
    if isinstance(runner, WorkerRunner):
        # A worker gets the resolved profile and the target from the master when a run starts.
        try:
            check_out_dir(environment.parsed_options.out)
        except ProfileError as e:
            _fail(str(e), exits.BAD_INPUT)
        context.agent = WorkerAgent(environment)
        if environment.parsed_options.metrics_port is not None:
            log.info(
                "loadlab: --metrics-port is served by the master (it holds the run's figures), not workers"
            )
        return
    if environment.web_ui is not None:  # before anything starts: an exposed UI needs a login
        try:
            check_and_install(environment.web_ui, environment.parsed_options)
        except WebLoginError as e:
            _fail(str(e), exits.BAD_INPUT)
    _show_live_figures(environment)  # first: a port that is taken fails before the target starts
    if isinstance(runner, MasterRunner):  # before the target starts: workers' first messages find it
        context.coordinator = Coordinator(environment, on_failure=lambda: end_run(environment))
    try:
        context.session = Session(environment)
    except ConfigError as e:  # the profile, or the cluster file it names
        _fail(str(e), exits.BAD_INPUT)
    except TargetError as e:
        _fail(str(e), exits.TARGET)
    if isinstance(runner, MasterRunner):
        # Users of a worker that dies are started again on the others (Locust's rebalancing).
        environment.parsed_options.enable_rebalancing = True


def _show_live_figures(environment) -> None:
    """The live figures' consumers in this process: the LLM tab and /metrics in the web UI, when there is
    one, and --metrics-port's own HTTP server (headless runs and masters have no web UI)."""
    context = environment.loadlab
    opts = environment.parsed_options
    if environment.web_ui is None and opts.metrics_port is None:
        return
    registry = registry_for(environment)
    if environment.web_ui is not None:
        install_llm_tab(environment, registry)
        context.web_ui = True
    if opts.metrics_port is not None:
        host = opts.metrics_host if opts.metrics_host is not None else opts.web_host
        host = "" if host == "*" else host  # Locust's spelling of all interfaces
        try:
            context.metrics_server = MetricsServer(registry, host, opts.metrics_port).start()
        except OSError as e:
            where = f"{host}:{opts.metrics_port}" if host else f"port {opts.metrics_port}"
            why = os.strerror(e.errno) if e.errno else str(e)
            _fail(f"--metrics-port: cannot listen on {where} ({why})", exits.BAD_INPUT)


@events.test_start.add_listener
def _on_test_start(environment, **_kw):
    context = environment.loadlab
    session = context.session
    if session is None:  # a worker: the run arrives from the master
        return
    opts = environment.parsed_options
    try:
        if environment.host != session.target_info.url:  # changed in the web UI
            session.use_target(environment.host)
        run = Run(
            session.profile,
            session.profile_path,
            session.workload,
            session.renderer,
            opts.out,
            opts.run_name,
            session.target_info,
            session.model,
            environment.runner.target_user_count or opts.num_users,
            sys.argv,
            api_key=session.api_key,
        )
    except (TargetError, OSError) as e:
        log.error("loadlab: cannot start the run: %s", e)
        context.run = None
        gevent.spawn(end_run, environment)
        return
    if context.shows_live:
        run.live = LiveFigures(
            session.profile, run.dir, run.tickets, lane=off_the_clock, offload=_in_a_thread
        )
    context.run = run
    run.on_refused = functools.partial(_refused, environment)
    target = session.profile.target
    run.scraper = Scraper(  # its own process: parsing costs CPU
        session.metrics_urls(environment.host), run.dir, target.metrics_interval_s, session.api_key
    ).start()
    _freeze_heap()
    run.client_limits = (opts.client_limit_ms, opts.client_limit_cpu)
    coordinator = context.coordinator
    if coordinator is not None:
        run.coordinator = coordinator
        coordinator.start_run(run, environment.host)
    else:
        run.monitor = ClientMonitor().start()
        run.tickets.on_measure_start = run.monitor.reset  # calibrate the measured phase only
    log.info("loadlab: run directory %s", run.dir)
    if run.live is not None:
        gevent.spawn(_keep_live_figures, run)
    gevent.spawn(_stop_when_done, environment, run)
    gevent.spawn(_show_progress, run)


def _in_a_thread(fn, *args):
    """Runs ``fn`` in a native thread of gevent's pool while this greenlet waits and the others run (for
    numpy work that releases the GIL)."""
    return gevent.get_hub().threadpool.apply(fn, args)


def _freeze_heap() -> None:
    """Python's full garbage collections walk every object, and a load generator has hundreds of thousands
    from its imports: a ~60 ms pause mid-run that delays every token timestamp behind it (the self-
    calibration probe caught it). Objects alive at the start are moved out of the collector's reach."""
    gc.collect()
    gc.freeze()


PROGRESS_EVERY_S = 10.0
LIVE_EVERY_S = 2.0  # the web UI's poll


def _keep_live_figures(run: Run) -> None:
    """Turns the records queued for the live figures into samples every 2 s, also while nobody looks (a
    closed browser tab): the queue stays short and each refresh small."""
    while not run.finalized:
        gevent.sleep(LIVE_EVERY_S)
        run.live.refresh()


def _show_progress(run: Run) -> None:
    """A progress line every few seconds on long runs: phase, counts, failures, time to go."""
    while not run.tickets.all_done.wait(PROGRESS_EVERY_S):
        if run.finalized:
            return
        log.info("loadlab: %s", run.progress())


def _stop_when_done(environment, run: Run) -> None:
    """Ends the run by itself once every measured request has finished (no -t needed)."""
    run.tickets.all_done.wait()
    run.stop_calibration()  # the measured phase is over: what follows (stopping, the report) is not timed
    end_run(environment)


def _refused(environment, message: str) -> None:
    """The target refused a request for its credentials (its 401 or 403): say so in one line and stop."""
    print(f"loadlab: {message}", file=sys.stderr, flush=True)
    environment.process_exit_code = exits.TARGET
    gevent.spawn(end_run, environment)


def end_run(environment) -> None:
    """The run is over (done, or it cannot go on): collect every worker's last records, then stop."""
    _drain(environment)
    if environment.parsed_options.headless:
        environment.runner.quit()
    else:
        environment.runner.stop()  # the web UI stays up for the next run


def _drain(environment) -> None:
    coordinator = environment.loadlab.coordinator
    if coordinator is not None:
        coordinator.drain()


@events.test_stop.add_listener
def _on_test_stop(environment, **_kw):
    context = environment.loadlab
    if context.session is not None and context.run is not None:
        _drain(environment)
        context.run.finalize()


def _print_result(run: Run, **_kw) -> None:
    """Locust's quit event, fired after it printed its own tables (rounded buckets, three pseudo-requests
    per request): the exact result comes last, so it is what a headless run leaves on the screen."""
    from loadlab.analysis.console import render_console  # the post-processor: only where a run finalized

    sys.stdout.flush()
    sys.stderr.write(render_console(run.summary, run.dir / "summary.md"))
    sys.stderr.flush()


@events.quitting.add_listener
def _on_quitting(environment, **_kw):
    context = environment.loadlab
    session = context.session
    if session is None:
        agent = context.agent
        if agent is not None and agent.run is not None:
            agent.run.close()
        return
    _drain(environment)
    # Locust fires quitting before it stops the users (Ctrl-C, SIGTERM): stop them first, so in-flight
    # requests are recorded as cancelled and test_stop finalizes the run with every record in it.
    if environment.runner is not None:
        environment.runner.stop()
    run = context.run
    if run is not None:
        run.finalize()
        if environment.parsed_options.headless and run.summary is not None:
            events.quit.add_listener(functools.partial(_print_result, run))
        # Failed requests are data, not a failed run: exit 0 when the run completed, 1 when it was cut short
        # (unless a worker already set the status: 3 when it could not reach the target).
        if environment.process_exit_code is None:
            environment.process_exit_code = exits.OK if run.complete else exits.PARTIAL
        client_bound = run.manifest.client is not None and run.manifest.client.client_bound
        if client_bound and environment.parsed_options.strict and environment.process_exit_code == 0:
            environment.process_exit_code = exits.CLIENT_BOUND
    session.stop_embedded()
