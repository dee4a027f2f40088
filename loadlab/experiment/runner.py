"""`loadlab sweep SWEEP.yaml`: the seed's method as one command.

For every configuration (the product of the axes): start the server from the launch template if a server
argument varies (argv, never a shell string; the same shape for `loadlab sim` and
`python -m sglang.launch_server`), wait until it answers, run the profile R times (the first repeat with
the profile's warm-up, the others on the warm server without), stop the server. Without a launch
template, a run whose profile targets the embedded twin or a cluster (`target.cluster`; cluster axes lay
settings over it) starts its own, fresh, and warms it up: every repeat. Progress is printed
(configuration k of n, repeat r, ETA). State is kept in `sweep.json` (`SweepState`) after every run, so an
interrupted sweep keeps its finished runs and `loadlab sweep` on the same directory resumes where it
stopped. At the end the runs are aggregated (`aggregate.py`) and written to `sweep.md` / `sweep.html`
(`render.py`) and into `sweep.json`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from loadlab import exits
from loadlab.experiment.aggregate import aggregate, refine_configs
from loadlab.experiment.render import render_csv, render_html, render_md
from loadlab.experiment.spec import SweepError, SweepSpec, label, run_sets
from loadlab.procs import free_port
from loadlab.target.launch import LaunchedServer
from loadlab.target.probe import TargetError

SWEEP_STATE = "sweep.json"
SWEEP_MD = "sweep.md"
SWEEP_CSV = "sweep.csv"  # sweep.md's table as numbers, for a spreadsheet
SWEEP_HTML = "sweep.html"
# sweep.json's layout. 0: written before the layout had a version (the same keys as 1, without version).
STATE_VERSION = 1


class SweepState(BaseModel):
    """`sweep.json`: what a sweep directory holds, read and written here only (`read`, `write`)."""

    model_config = ConfigDict(extra="forbid")

    version: int = Field(STATE_VERSION, description="the layout's version (STATE_VERSION when written)")
    spec: dict[str, Any] = Field(
        default_factory=dict, description="the sweep file as loaded (SweepSpec), for readers; not read back"
    )
    configs: list[dict[str, Any]] = Field(
        description="the coarse configurations; a directory refuses a sweep with other axes"
    )
    refined: list[dict[str, Any]] | None = Field(
        None, description="the configurations the refine step added (numbered after the coarse ones)"
    )
    refined_with: int | None = Field(None, description="the refine: value that chose `refined`")
    runs: dict[str, str] = Field(
        default_factory=dict, description='"k/r" (configuration k, repeat r) -> run dir, finished runs only'
    )
    failed: dict[str, str] = Field(
        default_factory=dict,
        description="k -> why configuration k failed (its server did not start or died, or a run failed)",
    )
    result: dict[str, Any] | None = Field(
        None, description="the aggregate (rows, knee, choice, findings), written when a session stops"
    )

    @classmethod
    def read(cls, path: Path) -> SweepState | None:
        """The state in ``path``, or None when there is none yet; an older layout is brought up to date."""
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise SweepError(f"{path}: not a sweep state file ({e}); use another --out") from None
        if isinstance(data, dict):
            data.setdefault("version", 0)
        try:
            state = cls.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "(top level)"
            raise SweepError(f"{path}: not a sweep state file ({where}: {err['msg']}); use another --out"
                             ) from None  # fmt: skip
        if state.version > STATE_VERSION:
            raise SweepError(
                f"{path}: written by a newer loadlab (version {state.version}); use another --out"
            )
        # Version 0 -> 1: the same keys; the next write records the version.
        state.version = STATE_VERSION
        return state

    def write(self, path: Path) -> None:
        """Writes the state atomically (a sweep killed while writing keeps the previous state)."""
        data = self.model_dump(exclude={"result"} if self.result is None else None)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2, default=str))
        os.replace(tmp, path)


def run_sweep(spec: SweepSpec, out: Path, extra_run_args: list[str] | None = None) -> int:
    """Runs (or resumes) the sweep into ``out``; returns 0 when complete, 130 when interrupted, 3 when a
    configuration failed (its server did not start or died, or a run failed)."""
    return Sweep(spec, out, extra_run_args or []).run()


class Sweep:
    """One sweep directory: the coarse configurations, then (with ``refine``) finer ones around the knee.
    Configuration k's repeat r is run "k/r" in ``sweep.json``; refined configurations are numbered after
    the coarse ones and kept in the state, so a resumed sweep refines the same way."""

    def __init__(self, spec: SweepSpec, out: Path, extra_run_args: list[str]):
        self.spec, self.out, self.extra = spec, out, extra_run_args
        out.mkdir(parents=True, exist_ok=True)
        self.state_path = out / SWEEP_STATE
        self.configs = spec.configurations()
        state = SweepState.read(self.state_path)
        if state is not None and state.configs != self.configs:
            raise SweepError(f"{out}: holds a different sweep (axes changed); use another --out")
        state = state or SweepState(configs=self.configs)
        state.spec = spec.model_dump(by_alias=True)
        state.result = None  # this session's result is written when it stops
        if state.refined is not None and state.refined_with != spec.refine:
            refined_runs = [key for key in state.runs if int(key.split("/")[0]) >= len(self.configs)]
            if refined_runs:
                raise SweepError(f"{out}: holds a sweep refined with refine: {state.refined_with}; use another "
                                 f"--out (or refine: {state.refined_with})")  # fmt: skip
            state.refined = None  # nothing refined has run yet: refine anew (or not at all)
            state.failed = {k: why for k, why in state.failed.items() if int(k) < len(self.configs)}
        self.state = state
        self.interrupted: list[int] = []
        self.started, self.done_here = time.monotonic(), 0

    def all_configs(self) -> list[dict[str, Any]]:
        return self.configs + (self.state.refined or [])

    def run(self) -> int:
        state, repeats = self.state, self.spec.repeats
        previous = signal.signal(signal.SIGINT, lambda *_: self.interrupted.append(1))
        try:
            self._run_configs(0, len(self.configs), "")
            coarse_done = all(str(k) in state.failed or all(f"{k}/{r}" in state.runs for r in range(repeats))
                              for k in range(len(self.configs)))  # fmt: skip
            if self.spec.refine and coarse_done and not self.interrupted:
                if state.refined is None:
                    coarse = aggregate(self.spec, self.configs, state.runs)
                    state.refined = refine_configs(coarse["rows"], self.spec.refine, self.spec.axes)
                    state.refined_with = self.spec.refine
                    self._save()
                    added = ", ".join(label(c) for c in state.refined) or "no value in between"
                    print(f"loadlab sweep: refining around the knee ({coarse['knee'] or 'none found'}): {added}",
                          file=sys.stderr, flush=True)  # fmt: skip
                self._run_configs(len(self.configs), len(self.all_configs()), "refine: ")
        finally:
            signal.signal(signal.SIGINT, previous)
            self._save()
        configs = self.all_configs()
        total = len(configs) * repeats
        complete = not self.interrupted and len(state.runs) == total
        result = aggregate(self.spec, configs, state.runs, state.failed)
        (self.out / SWEEP_MD).write_text(render_md(self.spec, result, complete=complete))
        (self.out / SWEEP_CSV).write_text(render_csv(self.spec, result))
        (self.out / SWEEP_HTML).write_text(render_html(self.spec, result))
        state.result = result
        self._save()
        if self.interrupted:
            print(f"loadlab sweep: interrupted; {len(state.runs)} of {total} runs kept. Run the same command "
                  "to resume.", file=sys.stderr, flush=True)  # fmt: skip
            return exits.INTERRUPTED
        print(self.out / SWEEP_MD, flush=True)
        if state.failed:
            print(f"loadlab sweep: {len(state.failed)} configuration(s) failed (see {SWEEP_MD}); the same "
                  "command tries them again", file=sys.stderr, flush=True)  # fmt: skip
            return exits.TARGET
        return exits.OK

    def _run_configs(self, first: int, stop: int, stage: str) -> None:
        configs = self.all_configs()
        spec, state, repeats = self.spec, self.state, self.spec.repeats
        for k in range(first, stop):
            config = configs[k]
            todo = [r for r in range(repeats) if f"{k}/{r}" not in state.runs]
            if not todo or self.interrupted:
                continue
            where = f"loadlab sweep: {stage}configuration {k + 1}/{len(configs)} ({label(config)})"
            server = None
            try:
                url = None
                if spec.launch:  # a fresh server per configuration
                    port = free_port()
                    fill = {**{a: str(v) for a, v in config.items() if "." not in a}, "port": str(port)}
                    url = spec.url.format(**fill)
                    argv = [a.format(**fill) for a in spec.launch]
                    server = LaunchedServer(argv, url, spec.ready_timeout_s, self.out / f"server-{k}.log")
                    print(f"{where}: starting the server", file=sys.stderr, flush=True)
                    server.start(should_stop=lambda: bool(self.interrupted))
                for r in todo:
                    if self.interrupted:
                        break
                    eta = ""
                    if self.done_here:
                        left = len(configs) * repeats - len(state.runs)
                        eta = (
                            f", about {(time.monotonic() - self.started) / self.done_here * left:.0f} s to go"
                        )
                    print(f"{where}, repeat {r + 1}/{repeats}{eta}", file=sys.stderr, flush=True)
                    # The first run on a fresh server warms it up (also when a resumed sweep starts a
                    # configuration at a later repeat); the next ones find it warm. A run that starts
                    # its own target (the embedded twin, a cluster) has a fresh one every time.
                    warm_up = r == todo[0] or spec.fresh_target
                    run_dir = _one_run(spec, self.out, k, r, config, url, self.extra, warm_up)
                    if server is not None and server.proc.poll() is not None:  # it measured a dying server
                        raise TargetError(f"the server exited with status {server.proc.returncode} during "
                                          f"run {run_dir.name}; see {server.log_path}")  # fmt: skip
                    state.runs[f"{k}/{r}"] = str(run_dir)
                    self.done_here += 1
                    self._save()
                else:
                    state.failed.pop(str(k), None)  # every repeat ran: an earlier failure is over
            except TargetError as e:
                if self.interrupted:  # a run cut short by Ctrl-C is not a failure, nor a finished run
                    continue
                if server is not None and server.proc.poll() is not None and "server exited" not in str(e):
                    e = TargetError(f"{e}; the server exited with status {server.proc.returncode}, see "
                                    f"{server.log_path}")  # fmt: skip
                # A configuration that fails (a server that does not start or dies: out of memory at a large
                # limit...) is reported in the table and the sweep goes on with the next one.
                state.failed[str(k)] = str(e)
                print(f"{where}: failed: {e}; going on", file=sys.stderr, flush=True)
            finally:
                if server is not None:
                    server.stop()
                self._save()

    def _save(self) -> None:
        self.state.write(self.state_path)


def _one_run(
    spec: SweepSpec, out: Path, k: int, r: int, config: dict, url: str | None, extra: list[str], warm_up: bool
) -> Path:
    """Configuration k's repeat r as a `loadlab run` subprocess; returns its run directory."""
    name = f"c{k:02d}-r{r}"
    cmd = [
        sys.executable,
        "-m",
        "loadlab",
        "run",
        spec.profile,
        "--out",
        str(out / "runs"),
        "--run-name",
        name,
    ]
    if url:
        cmd += ["--host", url]
    for item in run_sets(spec, config):  # set:, then the client and cluster axes, as the profile's keys
        cmd += ["--set", item]
    for key, value in spec.slo.items():
        cmd += ["--set", f"slo.{key}={value}"]
    if not warm_up:
        cmd += ["--warmup-requests", "0"]  # the server is warm: the first run on it warmed it
    cmd += extra
    # Ctrl-C reaches the run too (same process group): it records what was in flight and exits 1.
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode == exits.CLIENT_BOUND and lines:  # --strict: a finished run, flagged (a finding)
        return Path(lines[-1])
    if done.returncode == exits.BAD_INPUT:  # the same for every configuration: stop here
        raise SweepError(f"run {name}: loadlab run refused its input (exit status 2; the message is above)")
    if done.returncode != 0 or not lines:  # the caller tells a Ctrl-C from a failure
        raise TargetError(f"run {name} failed (exit status {done.returncode})")
    return Path(lines[-1])
