"""Shared fixtures for the real-process tests: servers started as subprocesses on 127.0.0.1, and
`loadlab run` as a subprocess whose last stdout line is the run directory.

With pytest-xdist installed (the test extra) the whole suite runs on two workers, a file at a time each
(``--dist loadfile``: a file's module fixtures start once); ``-n 0`` runs it in this process, and a command
naming files or tests runs them in this process unless it gives ``-n``. A test marked
``alone`` (wall-clock timing in milliseconds: a client's timestamps against a server's write times, send
lateness, a twin's real-time pace, a client's self-calibration) runs while the other worker waits between two
tests: the machine has 2 cores, and those tolerances were set for a machine running one test at a time."""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loadlab.testing.scripted import timing_errors  # noqa: F401 - for the tests
from loadlab.testing.servers import start_scripted

REPO = Path(__file__).resolve().parent.parent
PROFILES = Path(__file__).resolve().parent / "profiles"
LOADLAB = [sys.executable, "-m", "loadlab.cli"]


# -- pytest-xdist: two workers, the tests marked `alone` run alone ----------------------------------------
WORKERS = 2  # pytest-xdist's, when it is installed and no -n is given: this machine's 2 cores


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """The whole suite (no file or test named on the command line) on two xdist workers, a file each at a
    time, unless -n says otherwise (or xdist is not installed)."""
    if not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput"):
        return
    whole_suite = not config.option.file_or_dir
    if whole_suite and config.option.numprocesses is None and not config.option.collectonly:
        config.option.numprocesses = WORKERS
        if config.option.dist == "no":
            config.option.dist = "loadfile"
            config.option.loadscopereorder = False  # files in collection order (LONGEST_FIRST below)


# The longest files first (a full run's figures), so that the two workers end together: loadfile hands out
# files in collection order as workers free up.
LONGEST_FIRST = ("test_sweep_clusters.py", "test_sweep.py", "test_end_to_end.py", "test_api_key.py",
                 "test_cluster.py", "test_faults.py", "test_distributed.py", "test_compose.py", "test_classes.py",
                 "test_omni.py")  # fmt: skip


def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):  # the same order on every worker (xdist checks)
        rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest as collected


def pytest_configure(config):
    config.addinivalue_line("markers", "alone: runs while no other test runs (wall-clock timing in ms)")


@contextlib.contextmanager
def _machine_share(lock_dir: Path, alone: bool):
    """A shared hold on the machine, or the only one (``alone``). Everyone queues at the gate first, so a
    test waiting to run alone is not passed over by the other worker's next tests."""
    with open(lock_dir / "gate.lock", "a") as gate, open(lock_dir / "machine.lock", "a") as machine:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(machine, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(machine, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under xdist, each test (its setup, module fixtures included, and teardown) holds its share of the
    machine; a test marked ``alone`` holds all of it."""
    if not hasattr(item.config, "workerinput"):
        yield
        return
    lock_dir = Path(item.config.option.basetemp).parent  # a worker's is <the run's basetemp>/<worker id>
    with _machine_share(lock_dir, item.get_closest_marker("alone") is not None):
        yield


@pytest.fixture(scope="session")
def scripted_server(tmp_path_factory):
    """One scripted server for the session: first event 100 ms after the request, then every 20 ms."""
    server = start_scripted(tmp_path_factory.mktemp("scripted") / "server.jsonl", 100.0, 20.0)
    yield server
    server.stop()


class LoadlabRun:
    """A finished `loadlab run` subprocess."""

    def __init__(self, argv: list[str], proc: subprocess.CompletedProcess | None, elapsed_s: float):
        self.argv = argv
        self.returncode = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr
        self.elapsed_s = elapsed_s
        lines = [line for line in self.stdout.splitlines() if line.strip()]
        self.run_dir = Path(lines[-1].strip()) if lines else None

    def explain(self) -> str:
        return (
            f"loadlab run exit {self.returncode} after {self.elapsed_s:.1f} s\nargv: {self.argv}\n"
            f"stdout:\n{self.stdout[-3000:]}\nstderr:\n{self.stderr[-5000:]}"
        )

    def records(self):
        from loadlab.records import load_records

        return load_records(self.run_dir)

    def manifest(self):
        from loadlab.manifest import read_manifest

        return read_manifest(self.run_dir)


def loadlab_run_argv(profile: str | Path, host: str, out: Path, *options: str) -> list[str]:
    """`loadlab run` argv against ``host`` writing under ``out``."""
    profile = Path(profile)
    if not profile.is_absolute() and not profile.exists():
        profile = PROFILES / profile
    return [*LOADLAB, "run", "--host", host, "--out", str(out), *options, str(profile)]


def run_loadlab(profile, host: str, out: Path, *options: str, timeout_s: float = 120.0) -> LoadlabRun:
    """Runs `loadlab run` to completion and returns it (``run_dir`` = the last stdout line)."""
    argv = loadlab_run_argv(profile, host, out, *options)
    t0 = time.monotonic()
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    return LoadlabRun(argv, proc, time.monotonic() - t0)


def run_loadlab_many(jobs: dict[str, list[str]], timeout_s: float = 120.0) -> dict[str, LoadlabRun]:
    """Runs several `loadlab run` argvs at the same time; returns {name: LoadlabRun}."""
    started = {}
    for name, argv in jobs.items():
        proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started[name] = (argv, proc, time.monotonic())
    out = {}
    deadline = time.monotonic() + timeout_s
    for name, (argv, proc, t0) in started.items():
        try:
            stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        done = subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)
        out[name] = LoadlabRun(argv, done, time.monotonic() - t0)
    return out


def percentile(values, q: float) -> float:
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else float("nan")


def describe_errors(label: str, ttft_err, itl_err) -> str:
    def stats(values) -> str:
        mags = [abs(v) for v in values]
        return (
            f"n={len(values)} median {percentile(mags, 50):.3f} P95 {percentile(mags, 95):.3f} "
            f"max {max(mags, default=float('nan')):.3f} ms (signed median {percentile(values, 50):+.3f})"
        )

    load = os.getloadavg()[0]  # other work on the machine shows up in the tails
    return f"{label}: |TTFT error| {stats(ttft_err)}; |ITL error| {stats(itl_err)}; load {load:.2f}"


# Timing figures collected by the tests, printed at the end of the session (also without -s).
TIMING_REPORT: list[str] = []


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: the controller prints its figures
        workeroutput["timing_report"] = list(TIMING_REPORT)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    TIMING_REPORT.extend(getattr(node, "workeroutput", {}).get("timing_report", []))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if TIMING_REPORT:
        terminalreporter.section("client timing error against the scripted server's write times")
        for line in TIMING_REPORT:
            terminalreporter.write_line(line)
