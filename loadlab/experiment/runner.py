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
from loadlab.experiment.aggregate import aggregate, read_run_summary, refine_configs, run_reasons
from loadlab.experiment.render import render_csv, render_html, render_md
from loadlab.experiment.search import next_step, outcome, show
from loadlab.experiment.spec import SweepError, SweepSpec, label, run_sets
from loadlab.experiment.twin import check_virtual, virtual_run
from loadlab.procs import free_port
from loadlab.target.launch import LaunchedServer
from loadlab.target.probe import TargetError

SWEEP_STATE = "sweep.json"
SWEEP_MD = "sweep.md"
SWEEP_CSV = "sweep.csv"  # sweep.md's table as numbers, for a spreadsheet
SWEEP_HTML = "sweep.html"
# sweep.json's layout. 0: written before the layout had a version (the same keys as 1, without version).
# 2: 1 plus virtual, capacity_over, points, hints, confirm (all optional: 0 and 1 read as they were).
STATE_VERSION = 2


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
    virtual: bool = Field(
        False, description="every run in virtual time (--virtual); a directory holds one kind"
    )
    capacity_over: str | None = Field(
        None, description="a capacity search: the load it varies (capacity.over)"
    )
    points: dict[str, dict[str, list[str]]] = Field(
        default_factory=dict,
        description="a capacity search: k -> load value -> its finished runs' dirs, in repeat order",
    )
    hints: dict[str, tuple[float, float]] = Field(
        default_factory=dict,
        description="k -> the bracket a confirmation's search starts from (virtual time's last pass, first fail)",
    )
    confirm: dict[str, Any] | None = Field(
        None,
        description="a real-time confirmation: from (the virtual-time directory), configs (k searched), "
        "virtual (k -> its capacity there)",
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


def run_sweep(
    spec: SweepSpec,
    out: Path,
    extra_run_args: list[str] | None = None,
    virtual: bool = False,
    confirm: Path | None = None,
) -> int:
    """Runs (or resumes) the sweep into ``out``; returns 0 when complete, 130 when interrupted, 3 when a
    configuration failed (its server did not start or died, or a run failed). ``virtual``: every run in
    virtual time, in this process. ``confirm``: a capacity search in real time for the best configuration
    of the virtual-time search in that directory and its neighbours, each starting from its bracket there."""
    return Sweep(spec, out, extra_run_args or [], virtual, confirm).run()


class Sweep:
    """One sweep directory: the coarse configurations, then (with ``refine``) finer ones around the knee.
    Configuration k's repeat r is run "k/r" in ``sweep.json``; refined configurations are numbered after
    the coarse ones and kept in the state, so a resumed sweep refines the same way."""

    def __init__(
        self,
        spec: SweepSpec,
        out: Path,
        extra_run_args: list[str],
        virtual: bool = False,
        confirm: Path | None = None,
    ):
        self.spec, self.out, self.extra, self.virtual = spec, out, extra_run_args, virtual
        self.configs = spec.configurations()
        if virtual:
            if extra_run_args:
                raise SweepError(
                    f"{spec.file}: --virtual: no Locust arguments (after --): nothing runs Locust"
                )
            if confirm is not None:
                raise SweepError(f"{spec.file}: --confirm: confirms in real time; not with --virtual")
            check_virtual(spec, self.configs)  # every configuration's twin settings, before anything runs
        over = spec.capacity.over if spec.capacity else None
        state_path = out / SWEEP_STATE
        state = SweepState.read(state_path)
        if state is not None and state.configs != self.configs:
            raise SweepError(f"{out}: holds a different sweep (axes changed); use another --out")
        if state is not None and (state.runs or state.points) and state.virtual != virtual:
            kind = "virtual-time" if state.virtual else "real-time"
            raise SweepError(
                f"{out}: holds a {kind} sweep; use another --out (or {'' if state.virtual else 'no '}--virtual)"
            )
        if state is not None and (state.runs or state.points) and state.capacity_over != over:
            held = (
                f"a capacity search over {state.capacity_over}"
                if state.capacity_over
                else "a sweep at one load"
            )
            raise SweepError(f"{out}: holds {held}; use another --out")
        out.mkdir(parents=True, exist_ok=True)
        self.state_path = state_path
        state = state or SweepState(configs=self.configs)
        state.virtual, state.capacity_over = virtual, over
        if confirm is not None:
            _start_confirmation(state, spec, self.configs, Path(confirm))
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
        self.server: LaunchedServer | None = None  # the configuration's launched server, while it runs
        self.judged: dict[str, list[str]] = {}  # run dir -> why it failed the SLO (capacity search)

    def all_configs(self) -> list[dict[str, Any]]:
        return self.configs + (self.state.refined or [])

    def run(self) -> int:
        state, repeats = self.state, self.spec.repeats
        previous = signal.signal(signal.SIGINT, lambda *_: self.interrupted.append(1))
        try:
            if self.spec.capacity is not None:
                self._each_config(self._searched(), "", self._search)
            else:
                self._each_config(range(len(self.configs)), "", self._repeats)
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
                self._each_config(
                    range(len(self.configs), len(self.all_configs())), "refine: ", self._repeats
                )
        finally:
            signal.signal(signal.SIGINT, previous)
            self._save()
        configs = self.all_configs()
        if self.spec.capacity is not None:
            complete = not self.interrupted and all(self._found(k)["done"] or str(k) in state.failed
                                                    for k in self._searched())  # fmt: skip
            kept = f"{sum(len(v) for p in state.points.values() for v in p.values())} runs kept"
        else:
            complete = not self.interrupted and len(state.runs) == len(configs) * repeats
            kept = f"{len(state.runs)} of {len(configs) * repeats} runs kept"
        result = aggregate(self.spec, configs, state.runs, state.failed, state.points, state.hints)
        if state.confirm:
            result["confirmation"] = _confirmation(state, result, self.spec)
        (self.out / SWEEP_MD).write_text(render_md(self.spec, result, complete=complete))
        (self.out / SWEEP_CSV).write_text(render_csv(self.spec, result))
        (self.out / SWEEP_HTML).write_text(render_html(self.spec, result))
        state.result = result
        self._save()
        if self.interrupted:
            print(f"loadlab sweep: interrupted; {kept}. Run the same command to resume.", file=sys.stderr,
                  flush=True)  # fmt: skip
            return exits.INTERRUPTED
        if self.spec.capacity is not None:  # the answer, in a few lines: capacity per configuration
            for row in result["rows"]:
                found = row["capacity"]
                if found["values_tried"]:
                    print(f"loadlab capacity: {label(row['config'])}: {show(found['capacity'], self.spec.capacity)} "
                          f"at SLO ({found['confidence']})", file=sys.stderr, flush=True)  # fmt: skip
            print(f"loadlab capacity: SLO-first choice (the highest capacity at SLO): {result['choice'] or 'none'}",
                  file=sys.stderr, flush=True)  # fmt: skip
        print(self.out / SWEEP_MD, flush=True)
        if state.failed:
            print(f"loadlab sweep: {len(state.failed)} configuration(s) failed (see {SWEEP_MD}); the same "
                  "command tries them again", file=sys.stderr, flush=True)  # fmt: skip
            return exits.TARGET
        return exits.OK

    def _each_config(self, indices, stage: str, body) -> None:
        """``body(k, config, url, where)`` for each configuration k, its server launched for it (real time,
        with a launch template) and stopped after; a failure is recorded and the sweep goes on. ``body``
        returns True when it finished the configuration (an earlier failure is then over)."""
        configs = self.all_configs()
        for k in indices:
            config = configs[k]
            if self.interrupted or self._finished(k):
                continue
            command = "capacity" if self.spec.capacity else "sweep"
            where = f"loadlab {command}: {stage}configuration {k + 1}/{len(configs)} ({label(config)})"
            server = None
            try:
                url = None
                if self.spec.launch and not self.virtual:  # a fresh server per configuration
                    port = free_port()
                    fill = {**{a: str(v) for a, v in config.items() if "." not in a}, "port": str(port)}
                    url = self.spec.url.format(**fill)
                    argv = [a.format(**fill) for a in self.spec.launch]
                    server = LaunchedServer(
                        argv, url, self.spec.ready_timeout_s, self.out / f"server-{k}.log"
                    )
                    print(f"{where}: starting the server", file=sys.stderr, flush=True)
                    server.start(should_stop=lambda: bool(self.interrupted))
                self.server = server
                if body(k, config, url, where):
                    self.state.failed.pop(str(k), None)  # it ran to the end: an earlier failure is over
            except TargetError as e:
                if self.interrupted:  # a run cut short by Ctrl-C is not a failure, nor a finished run
                    continue
                if server is not None and server.proc.poll() is not None and "server exited" not in str(e):
                    e = TargetError(f"{e}; the server exited with status {server.proc.returncode}, see "
                                    f"{server.log_path}")  # fmt: skip
                # A configuration that fails (a server that does not start or dies: out of memory at a large
                # limit...) is reported in the table and the sweep goes on with the next one.
                self.state.failed[str(k)] = str(e)
                print(f"{where}: failed: {e}; going on", file=sys.stderr, flush=True)
            finally:
                self.server = None
                if server is not None:
                    server.stop()
                self._save()

    def _finished(self, k: int) -> bool:
        if self.spec.capacity is not None:
            return self._found(k)["done"]
        return all(f"{k}/{r}" in self.state.runs for r in range(self.spec.repeats))

    def _run(self, k: int, r: int, config: dict, url: str | None, warm_up: bool, name: str | None = None,
             sets: list[str] | None = None) -> Path:  # fmt: skip
        """One run, real (`loadlab run`) or virtual (in this process); checks the server lived through it."""
        if self.virtual:
            html = self.spec.capacity is None  # a search runs many: their report.html is `loadlab report`'s
            return virtual_run(
                self.spec, self.out, name or f"c{k:02d}-r{r}", config, sets or [], warm_up, html
            )
        if name is None and sets is None:  # a sweep at one load (tests replace _one_run with that signature)
            run_dir = _one_run(self.spec, self.out, k, r, config, url, self.extra, warm_up)
        else:
            run_dir = _one_run(
                self.spec, self.out, k, r, config, url, self.extra, warm_up, name=name, sets=sets
            )
        server = self.server
        if server is not None and server.proc.poll() is not None:  # it measured a dying server
            raise TargetError(f"the server exited with status {server.proc.returncode} during "
                              f"run {run_dir.name}; see {server.log_path}")  # fmt: skip
        return run_dir

    def _repeats(self, k: int, config: dict, url: str | None, where: str) -> bool:
        """A configuration at the sweep's load: its repeats still missing."""
        spec, state, repeats = self.spec, self.state, self.spec.repeats
        todo = [r for r in range(repeats) if f"{k}/{r}" not in state.runs]
        configs = self.all_configs()
        for r in todo:
            if self.interrupted:
                return False
            eta = ""
            if self.done_here:
                left = len(configs) * repeats - len(state.runs)
                eta = f", about {(time.monotonic() - self.started) / self.done_here * left:.0f} s to go"
            print(f"{where}, repeat {r + 1}/{repeats}{eta}", file=sys.stderr, flush=True)
            # The first run on a fresh server warms it up (also when a resumed sweep starts a
            # configuration at a later repeat); the next ones find it warm. A run that starts
            # its own target (the embedded twin, a cluster; every virtual run) has a fresh one every time.
            warm_up = r == todo[0] or spec.fresh_target or self.virtual
            # The twin in virtual time is deterministic: a repeat with the same seed would be a copy, so
            # repeat r runs with the seed + r (other arrivals and prompts), as a capacity search's do.
            sets = [f"seed={spec.seed + r}"] if self.virtual else None
            state.runs[f"{k}/{r}"] = str(self._run(k, r, config, url, warm_up, sets=sets))
            self.done_here += 1
            self._save()
        return True

    # -- capacity at SLO --------------------------------------------------------------------------------
    def _searched(self) -> list[int]:
        """The configurations a capacity search runs: all, or a confirmation's."""
        confirm = self.state.confirm
        return list(confirm["configs"]) if confirm else list(range(len(self.configs)))

    def _verdicts(self, k: int) -> dict[float, list[bool]]:
        """Configuration k's points: load value -> each finished run's verdict (it met the SLO)."""
        config = self.all_configs()[k]
        out: dict[float, list[bool]] = {}
        for value, run_dirs in self.state.points.get(str(k), {}).items():
            out[float(value)] = [not self._reasons(config, d) for d in run_dirs]
        return out

    def _reasons(self, config: dict, run_dir: str) -> list[str]:
        """Why one run failed the SLO (empty: it met it), judged once per run (summaries do not change)."""
        if run_dir not in self.judged:
            summary = read_run_summary(run_dir)
            self.judged[run_dir] = run_reasons(config, summary, self.spec.slo) if summary else ["no summary"]
        return self.judged[run_dir]

    def _found(self, k: int) -> dict[str, Any]:
        assert self.spec.capacity is not None
        return outcome(self._verdicts(k), self.spec.capacity, self.state.hints.get(str(k)))

    def _search(self, k: int, config: dict, url: str | None, where: str) -> bool:
        """Configuration k's capacity at SLO: the next load value, run, judged, kept; until the search is
        over (search.py) or Ctrl-C. Repeat r of a value runs with the seed + r (other arrivals and
        prompts: in virtual time a repeat with the same seed would be a copy). Every run warms the server
        up: each point starts as a virtual run does, from a fresh warm-up."""
        cap, state = self.spec.capacity, self.state
        assert cap is not None
        points = state.points.setdefault(str(k), {})
        hint = state.hints.get(str(k))
        while not self.interrupted:
            step = next_step(self._verdicts(k), cap, hint)
            if step is None:
                found = self._found(k)
                print(f"{where}: capacity at SLO: {show(found['capacity'], cap)} ({found['confidence']})",
                      file=sys.stderr, flush=True)  # fmt: skip
                return True
            key = value_key(step.value, cap.integer)
            r = len(points.get(key, []))
            name = f"c{k:02d}-{cap.over.rsplit('.', 1)[-1]}{key}-r{r}"
            print(f"{where}: {cap.over}={key} ({step.why}, run {r + 1}), {self.done_here} runs in "
                  f"{time.monotonic() - self.started:.0f} s", file=sys.stderr, flush=True)  # fmt: skip
            sets = [f"{cap.over}={key}", f"seed={self.spec.seed + r}"]
            run_dir = self._run(k, r, config, url, True, name=name, sets=sets)
            points.setdefault(key, []).append(str(run_dir))
            self.done_here += 1
            self._save()
            why = self._reasons(config, str(run_dir))
            print(f"{where}: {cap.over}={key}: {'FAIL: ' + '; '.join(why) if why else 'pass'}", file=sys.stderr,
                  flush=True)  # fmt: skip
        return False

    def _save(self) -> None:
        self.state.write(self.state_path)


def value_key(value: float, integer: bool) -> str:
    """A load value as sweep.json's key and the --set value: 48, 24.1."""
    return str(int(value)) if integer else f"{value:g}"


def _start_confirmation(state: SweepState, spec: SweepSpec, configs: list[dict], source: Path) -> None:
    """A real-time confirmation of the virtual-time search in ``source``: its best configuration and the
    ones next to it in the sweep's order, each search starting from its bracket there."""
    if spec.capacity is None:
        raise SweepError(f"{spec.file}: --confirm: only for a capacity search (loadlab capacity)")
    held = SweepState.read(source / SWEEP_STATE)
    if held is None or not held.virtual or held.capacity_over != spec.capacity.over or not held.result:
        raise SweepError(f"{source}: --confirm: not a finished virtual-time capacity search over "
                         f"{spec.capacity.over} (loadlab capacity {spec.file} --virtual)")  # fmt: skip
    if held.configs != configs:
        raise SweepError(f"{source}: --confirm: holds other configurations (axes changed)")
    if state.confirm is not None:
        if state.confirm["from"] != str(source):
            raise SweepError(
                f"{source}: --confirm: this directory confirms {state.confirm['from']}; use another --out"
            )
        return
    rows = {label(r["config"]): r for r in held.result["rows"]}
    best = held.result.get("choice")
    if best is None:
        raise SweepError(
            f"{source}: --confirm: no configuration met the SLO in virtual time: nothing to confirm"
        )
    k = next(i for i, c in enumerate(configs) if label(c) == best)
    chosen = [i for i in (k - 1, k, k + 1) if 0 <= i < len(configs)]
    virtual: dict[str, Any] = {}
    for i in chosen:
        found = rows[label(configs[i])].get("capacity") or {}
        virtual[str(i)] = {key: found.get(key) for key in ("capacity", "status", "lo", "hi", "confidence")}
        lo, hi = found.get("lo"), found.get("hi")
        if lo is not None or hi is not None:  # the bracket, or one end doubled/halved to make one
            state.hints[str(i)] = (lo if lo is not None else hi / 2, hi if hi is not None else lo * 2)
    state.confirm = {"from": str(source), "best": best, "configs": chosen, "virtual": virtual}


def _confirmation(state: SweepState, result: dict[str, Any], spec: SweepSpec) -> list[dict[str, Any]]:
    """Each confirmed configuration's capacity in virtual and in real time, and how far apart (real /
    virtual - 1)."""
    assert state.confirm is not None and spec.capacity is not None
    rows = {label(r["config"]): r for r in result["rows"]}
    out = []
    for k in state.confirm["configs"]:
        config = label(state.configs[k])
        seen = state.confirm["virtual"][str(k)]
        real = (rows[config].get("capacity") or {}) if config in rows else {}
        v, r = seen.get("capacity"), real.get("capacity")
        out.append({"config": config, "best": config == state.confirm["best"], "virtual": v, "real": r,
                    "difference": r / v - 1 if v and r else None, "virtual_confidence": seen.get("confidence"),
                    "real_confidence": real.get("confidence")})  # fmt: skip
    return out


def _one_run(
    spec: SweepSpec,
    out: Path,
    k: int,
    r: int,
    config: dict,
    url: str | None,
    extra: list[str],
    warm_up: bool,
    name: str | None = None,
    sets: list[str] | None = None,
) -> Path:
    """Configuration k's repeat r as a `loadlab run` subprocess (``name``: its run's name, default
    ``cKK-rR``; ``sets``: more --set items, last: a capacity search's load and seed); returns its run
    directory."""
    name = name or f"c{k:02d}-r{r}"
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
    for item in sets or []:
        cmd += ["--set", item]
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
