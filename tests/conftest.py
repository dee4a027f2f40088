"""Shared fixtures for the real-process tests: servers started as subprocesses on 127.0.0.1, and
`loadlab run` as a subprocess whose last stdout line is the run directory."""

from __future__ import annotations

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


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if TIMING_REPORT:
        terminalreporter.section("client timing error against the scripted server's write times")
        for line in TIMING_REPORT:
            terminalreporter.write_line(line)
