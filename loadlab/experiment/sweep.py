"""`loadlab sweep SWEEP.yaml`: the seed's method as one command.

For every configuration (the product of the axes): start the server from the launch template if a server
argument varies (argv, never a shell string; the same shape for `loadlab sim` and
`python -m sglang.launch_server`), wait until it answers, run the profile R times (the first repeat with
the profile's warm-up, the others on the warm server without), stop the server. Progress is printed
(configuration k of n, repeat r, ETA). State is kept in `sweep.json` after every run, so an interrupted
sweep keeps its finished runs and `loadlab sweep` on the same directory resumes where it stopped. At the
end: the median of the repeats with their spread per configuration, the knee, the SLO-first choice with a
reason for every rejected configuration, plain-language findings, written to `sweep.md` / `sweep.json`.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from loadlab import exits
from loadlab.procs import free_port
from loadlab.profile import ProfileError, load_profile, parse_set_option
from loadlab.target.launch import LaunchedServer
from loadlab.target.probe import TargetError

SWEEP_STATE = "sweep.json"
SWEEP_MD = "sweep.md"
SWEEP_HTML = "sweep.html"
KNEE_GAIN = 0.05  # the knee: the first configuration after which the next adds less than 5% throughput
TIE_GAIN = 0.01  # throughputs this close are a tie for the SLO-first choice (the earlier one is kept)

# The seed's table: (column, summary path, scale, digits)
COLUMNS = (
    ("output tok/s", ("output_throughput",), 1, 0),
    ("TTFT P50 ms", ("median_ttft_ms",), 1, 0),
    ("TTFT P95 ms", ("p95_ttft_ms",), 1, 0),
    ("TPOT P95 ms", ("p95_tpot_ms",), 1, 1),
    ("mean queue delay ms", ("server", "mean_queue_time_ms"), 1, 0),
    ("peak KV usage %", ("server", "peak_token_usage"), 100, 0),
    ("in flight (mean)", ("in_flight", "mean"), 1, 1),
    ("max running", ("server", "max_running"), 1, 0),
    ("retractions", ("server", "retractions"), 1, 0),
)


class SweepError(ProfileError):
    """A bad sweep file: one line, like a profile error."""


def is_sweep_file(path: str | Path) -> bool:
    """A sweep file has axes; a profile does not (an unreadable file is left to the profile loader)."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and "axes" in data


def load_sweep(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise SweepError(f"{path}: cannot read the sweep file: {e}") from None
    if not isinstance(data, dict):
        raise SweepError(f"{path}: a sweep file is a mapping (profile, axes, ...)")
    known = {"name", "profile", "axes", "repeats", "launch", "url", "ready_timeout_s", "set", "slo", "refine"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise SweepError(f"{path}: {unknown[0]}: unknown key (known: {', '.join(sorted(known))})")
    if "profile" not in data:
        raise SweepError(f"{path}: profile: missing (the base profile, e.g. profiles/rag.yaml)")
    axes = data.get("axes")
    if not isinstance(axes, dict) or not axes or not all(isinstance(v, list) and v for v in axes.values()):
        raise SweepError(f"{path}: axes: a mapping of name -> non-empty list of values")
    launch = data.get("launch")
    if launch is not None and not (
        isinstance(launch, list) and all(isinstance(a, str | int | float) for a in launch)
    ):
        raise SweepError(f"{path}: launch: an argv list (strings), never a shell string")
    server_axes = [a for a in axes if "." not in a]
    if server_axes and launch is None:
        raise SweepError(
            f"{path}: axes: {server_axes[0]}: a server argument needs a launch template (launch:)"
        )
    for axis in server_axes:
        if not any("{" + axis + "}" in str(a) for a in launch):
            raise SweepError(f"{path}: axes: {axis}: not a {{{axis}}} placeholder in launch")
    repeats = data.get("repeats", 1)
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise SweepError(f"{path}: repeats: a positive integer (got {repeats!r})")
    refine = data.get("refine") or 0
    if not isinstance(refine, int) or isinstance(refine, bool) or refine < 0:
        raise SweepError(f"{path}: refine: a whole number >= 0 of values to add on each side of the knee "
                         f"(got {refine!r})")  # fmt: skip
    if refine:
        (axis, values), *others = axes.items()
        if others:
            raise SweepError(f"{path}: refine: needs a sweep over one axis (this one has {len(axes)})")
        if (
            len(values) < 2
            or not all(_is_number(v) for v in values)
            or any(b <= a for a, b in itertools.pairwise(values))
        ):
            raise SweepError(f"{path}: refine: axes: {axis}: needs two or more increasing numbers")
    base = (
        (path.parent / data["profile"]) if not Path(data["profile"]).is_absolute() else Path(data["profile"])
    )
    if not base.exists() and Path(data["profile"]).exists():
        base = Path(data["profile"])
    profile = load_profile(base)  # a bad base profile fails here, with its own file:line message
    # Every configuration's overrides (set: and the client axes) checked now, not after a server started.
    sets = dict(parse_set_option(str(item)) for item in data.get("set") or [])
    for config in configurations({a: v for a, v in axes.items() if "." in a}):
        try:
            load_profile(base, {**sets, **config})
        except ProfileError as e:
            raise SweepError(f"{path}: set/axes {label({**sets, **config})}: {e}") from None
    return {
        "name": data.get("name") or path.stem,
        "file": str(path),
        "profile": str(base),
        "axes": axes,
        "repeats": repeats,
        "launch": [str(a) for a in launch] if launch else None,
        "url": data.get("url", "http://127.0.0.1:{port}"),
        "ready_timeout_s": float(data.get("ready_timeout_s", 600)),
        "set": [str(s) for s in data.get("set") or []],
        "slo": data.get("slo") or profile.slo.model_dump(exclude_none=True),
        "warmup": profile.requests.warmup,
        "refine": refine,
    }


def configurations(axes: dict[str, list]) -> list[dict[str, Any]]:
    names = list(axes)
    return [dict(zip(names, values, strict=True)) for values in itertools.product(*(axes[n] for n in names))]


def label(config: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in config.items())


def run_sweep(spec: dict[str, Any], out: Path, extra_run_args: list[str] | None = None) -> int:
    """Runs (or resumes) the sweep into ``out``; returns 0 when complete, 130 when interrupted, 3 when a
    configuration failed (its server did not start or died, or a run failed)."""
    return Sweep(spec, out, extra_run_args or []).run()


class Sweep:
    """One sweep directory: the coarse configurations, then (with ``refine``) finer ones around the knee.
    Configuration k's repeat r is run "k/r" in ``sweep.json``; refined configurations are numbered after
    the coarse ones and kept in the state, so a resumed sweep refines the same way."""

    def __init__(self, spec: dict[str, Any], out: Path, extra_run_args: list[str]):
        self.spec, self.out, self.extra = spec, out, extra_run_args
        out.mkdir(parents=True, exist_ok=True)
        self.state_path = out / SWEEP_STATE
        state = json.loads(self.state_path.read_text()) if self.state_path.exists() else {}
        self.configs = configurations(spec["axes"])
        if state and state.get("configs") != self.configs:
            raise SweepError(f"{out}: holds a different sweep (axes changed); use another --out")
        self.runs: dict[str, str] = state.get("runs", {})  # "k/r" -> run dir, finished runs only
        # Configurations whose server or run failed (e.g. out of memory at a large limit): reason, by k.
        self.failed: dict[str, str] = state.get("failed", {})
        self.refined: list[dict] | None = state.get("refined")
        self.refined_with = state.get("refined_with")
        if self.refined is not None and self.refined_with != spec["refine"]:
            refined_runs = [key for key in self.runs if int(key.split("/")[0]) >= len(self.configs)]
            if refined_runs:
                raise SweepError(f"{out}: holds a sweep refined with refine: {self.refined_with}; use another "
                                 f"--out (or refine: {self.refined_with})")  # fmt: skip
            self.refined = None  # nothing refined has run yet: refine anew (or not at all)
            self.failed = {k: why for k, why in self.failed.items() if int(k) < len(self.configs)}
        self.interrupted: list[int] = []
        self.started, self.done_here = time.monotonic(), 0

    def all_configs(self) -> list[dict[str, Any]]:
        return self.configs + (self.refined or [])

    def run(self) -> int:
        previous = signal.signal(signal.SIGINT, lambda *_: self.interrupted.append(1))
        try:
            self._run_configs(0, len(self.configs), "")
            coarse_done = all(str(k) in self.failed or all(f"{k}/{r}" in self.runs for r in range(self.spec["repeats"]))
                              for k in range(len(self.configs)))  # fmt: skip
            if self.spec["refine"] and coarse_done and not self.interrupted:
                if self.refined is None:
                    coarse = aggregate(self.spec, self.configs, self.runs)
                    self.refined, self.refined_with = (
                        refine_configs(self.spec, coarse["rows"]),
                        self.spec["refine"],
                    )
                    self._save()
                    added = ", ".join(label(c) for c in self.refined) or "no value in between"
                    print(f"loadlab sweep: refining around the knee ({coarse['knee'] or 'none found'}): {added}",
                          file=sys.stderr, flush=True)  # fmt: skip
                self._run_configs(len(self.configs), len(self.all_configs()), "refine: ")
        finally:
            signal.signal(signal.SIGINT, previous)
            self._save()
        configs = self.all_configs()
        total = len(configs) * self.spec["repeats"]
        complete = not self.interrupted and len(self.runs) == total
        result = aggregate(self.spec, configs, self.runs, self.failed)
        (self.out / SWEEP_MD).write_text(render(self.spec, result, complete=complete))
        (self.out / SWEEP_HTML).write_text(render_html(self.spec, result))
        state = json.loads(self.state_path.read_text())
        state["result"] = result
        self.state_path.write_text(json.dumps(state, indent=2, default=str))
        if self.interrupted:
            print(f"loadlab sweep: interrupted; {len(self.runs)} of {total} runs kept. Run the same command "
                  "to resume.", file=sys.stderr, flush=True)  # fmt: skip
            return exits.INTERRUPTED
        print(self.out / SWEEP_MD, flush=True)
        if self.failed:
            print(f"loadlab sweep: {len(self.failed)} configuration(s) failed (see {SWEEP_MD}); the same command "
                  "tries them again", file=sys.stderr, flush=True)  # fmt: skip
            return exits.TARGET
        return 0

    def _run_configs(self, first: int, stop: int, stage: str) -> None:
        configs = self.all_configs()
        spec, repeats = self.spec, self.spec["repeats"]
        for k in range(first, stop):
            config = configs[k]
            todo = [r for r in range(repeats) if f"{k}/{r}" not in self.runs]
            if not todo or self.interrupted:
                continue
            where = f"loadlab sweep: {stage}configuration {k + 1}/{len(configs)} ({label(config)})"
            server = None
            try:
                url = None
                if spec["launch"]:  # a fresh server per configuration
                    port = free_port()
                    fill = {**{a: str(v) for a, v in config.items() if "." not in a}, "port": str(port)}
                    url = spec["url"].format(**fill)
                    argv = [a.format(**fill) for a in spec["launch"]]
                    server = LaunchedServer(argv, url, spec["ready_timeout_s"], self.out / f"server-{k}.log")
                    print(f"{where}: starting the server", file=sys.stderr, flush=True)
                    server.start(should_stop=lambda: bool(self.interrupted))
                for r in todo:
                    if self.interrupted:
                        break
                    eta = ""
                    if self.done_here:
                        left = len(configs) * repeats - len(self.runs)
                        eta = (
                            f", about {(time.monotonic() - self.started) / self.done_here * left:.0f} s to go"
                        )
                    print(f"{where}, repeat {r + 1}/{repeats}{eta}", file=sys.stderr, flush=True)
                    # The first run on a fresh server warms it up (also when a resumed sweep starts a
                    # configuration at a later repeat); the next ones find it warm.
                    warm_up = r == todo[0]
                    run_dir = _one_run(spec, self.out, k, r, config, url, self.extra, warm_up)
                    if server is not None and server.proc.poll() is not None:  # it measured a dying server
                        raise TargetError(f"the server exited with status {server.proc.returncode} during "
                                          f"run {run_dir.name}; see {server.log_path}")  # fmt: skip
                    self.runs[f"{k}/{r}"] = str(run_dir)
                    self.done_here += 1
                    self._save()
                else:
                    self.failed.pop(str(k), None)  # every repeat ran: an earlier failure is over
            except TargetError as e:
                if self.interrupted:  # a run cut short by Ctrl-C is not a failure, nor a finished run
                    continue
                if server is not None and server.proc.poll() is not None and "server exited" not in str(e):
                    e = TargetError(f"{e}; the server exited with status {server.proc.returncode}, see "
                                    f"{server.log_path}")  # fmt: skip
                # A configuration that fails (a server that does not start or dies: out of memory at a large
                # limit...) is reported in the table and the sweep goes on with the next one.
                self.failed[str(k)] = str(e)
                print(f"{where}: failed: {e}; going on", file=sys.stderr, flush=True)
            finally:
                if server is not None:
                    server.stop()
                self._save()

    def _save(self) -> None:
        tmp = self.state_path.with_suffix(".tmp")
        state = {"spec": self.spec, "configs": self.configs, "refined": self.refined,
                 "refined_with": self.refined_with, "runs": self.runs, "failed": self.failed}  # fmt: skip
        tmp.write_text(json.dumps(state, indent=2, default=str))
        os.replace(tmp, self.state_path)


def _one_run(
    spec, out: Path, k: int, r: int, config: dict, url: str | None, extra: list[str], warm_up: bool
) -> Path:
    name = f"c{k:02d}-r{r}"
    cmd = [
        sys.executable,
        "-m",
        "loadlab",
        "run",
        spec["profile"],
        "--out",
        str(out / "runs"),
        "--run-name",
        name,
    ]
    if url:
        cmd += ["--host", url]
    for item in spec["set"]:
        cmd += ["--set", item]
    for axis, value in config.items():
        if "." in axis:
            cmd += ["--set", f"{axis}={value}"]
    for key, value in spec["slo"].items():
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


def _get(d: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(d, dict):
            return None
        d = d.get(key)
    return d


def aggregate(spec: dict[str, Any], configs: list[dict], runs: dict[str, str],
              failed: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    coarse = configurations(spec["axes"])
    rows = []
    for k, config in enumerate(configs):
        summaries = []
        for r in range(spec["repeats"]):
            run_dir = runs.get(f"{k}/{r}")
            if run_dir and (Path(run_dir) / "summary.json").exists():
                summaries.append(json.loads((Path(run_dir) / "summary.json").read_text()))
        row: dict[str, Any] = {"config": config, "repeats": len(summaries), "values": {}}
        for column, path, scale, _ in COLUMNS:
            values = [v * scale for s in summaries if isinstance(v := _get(s, path), int | float)]
            row["values"][column] = {
                "median": statistics.median(values) if values else None,
                "min": min(values) if values else None,
                "max": max(values) if values else None,
            }
        row["failed"] = sum(int(s.get("failed") or 0) for s in summaries)
        # The load generator's own timing quality: runs it flagged, and its worst error bound (P99, ms).
        clients = [s.get("client") or {} for s in summaries]
        row["client_bound"] = sum(bool(c.get("client_bound")) for c in clients)
        bounds = [c["error_bound_ms"] for c in clients if isinstance(c.get("error_bound_ms"), int | float)]
        row["error_bound_ms"] = max(bounds) if bounds else None
        row["refined"] = config not in coarse
        row["error"] = (failed or {}).get(str(k))
        rows.append(row)
    if any(row["refined"] for row in rows):  # one numeric axis: refined values go between the coarse ones
        rows.sort(key=lambda row: next(iter(row["config"].values())))
    return {"rows": rows, **choose(spec, rows)}


def refine_configs(spec: dict[str, Any], rows: list[dict]) -> list[dict[str, Any]]:
    """``spec["refine"]`` more values of the (only) axis on each side of the knee, up to its neighbours:
    evenly spaced on a log scale for positive values (limits and loads are swept in doublings), rounded
    for an integer axis; values already swept are skipped."""
    done = [r for r in rows if r["repeats"]]
    knee = knee_index(done)
    if knee is None:
        return []
    axis = next(iter(done[0]["config"]))
    values = [r["config"][axis] for r in done]
    swept = set(spec.get("axes", {}).get(axis, [])) | set(values)
    integer = all(float(v).is_integer() for v in swept)  # 8.0, 16.0 are counts too: --set needs integers
    added: list[float] = []
    for lo, hi in ((knee - 1, knee), (knee, knee + 1)):
        if lo < 0 or hi >= len(values):
            continue
        a, b, n = values[lo], values[hi], spec["refine"]
        for i in range(1, n + 1):
            f = i / (n + 1)
            v = a * (b / a) ** f if a > 0 else a + (b - a) * f
            v = round(v) if integer else float(f"{v:.6g}")
            if a < v < b and v not in swept and v not in added:
                added.append(v)
    return [{axis: v} for v in added]


def _median(row: dict, column: str) -> float | None:
    return row["values"][column]["median"]


def knee_index(rows: list[dict]) -> int | None:
    """The first row after which the next adds less than KNEE_GAIN throughput (rows in sweep order). Along
    one axis of positive numbers the gain is taken per doubling of the value, so the knee does not move
    when a refine step puts more rows in between (coarse sweeps double: the same rule there)."""
    thr = [_median(r, "output tok/s") for r in rows]
    values = [next(iter(r["config"].values())) if len(r["config"]) == 1 else None for r in rows]
    scaled = all(_is_number(v) and v > 0 for v in values)
    for i, t in enumerate(thr):
        nxt = thr[i + 1] if i + 1 < len(thr) else None
        if t is None:
            continue
        if nxt is None:
            return i
        gain = nxt / t if t > 0 else float("inf")
        if scaled and values[i + 1] > values[i]:
            gain **= 1 / math.log2(values[i + 1] / values[i])
        if gain < 1 + KNEE_GAIN:
            return i
    return None


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _highest_throughput(rows: list[dict]) -> tuple[dict | None, str | None]:
    """The row with the highest median throughput; but where earlier rows (smaller limits or loads) tie
    with it, the first of them: a tie is within TIE_GAIN or within the repeats' spread (ranges overlap).
    With the limit unable to bind (32 in flight against 32..512) the rows differ by noise only, and the
    smaller limit is the honest answer, not whichever won the noise."""
    rows = [r for r in rows if _median(r, "output tok/s") is not None]
    if not rows:
        return None, None
    best = max(rows, key=lambda r: _median(r, "output tok/s"))
    top, low = _median(best, "output tok/s"), best["values"]["output tok/s"]["min"]

    def ties(r: dict) -> bool:
        median, high = _median(r, "output tok/s"), r["values"]["output tok/s"]["max"]
        if median >= top * (1 - TIE_GAIN):
            return True
        # Within the repeats' spread: each median inside the other's range, and never more than the knee's
        # gain apart (one outlier repeat must not make a slow configuration a tie).
        spread = high is not None and low is not None and median >= low and top <= high
        return spread and r["repeats"] > 1 and best["repeats"] > 1 and median >= top * (1 - KNEE_GAIN)

    first = next(r for r in rows if ties(r))
    if first is best:
        return best, None
    return first, (f"{label(first['config'])} ties with {label(best['config'])} on throughput ("
                   f"{_median(first, 'output tok/s'):.0f} vs {top:.0f} tok/s, within {TIE_GAIN:.0%} or the "
                   "repeats' spread): the earlier configuration is kept")  # fmt: skip


def choose(spec: dict[str, Any], rows: list[dict]) -> dict[str, Any]:
    """The knee along the sweep's order and the SLO-first choice, with reasons and findings."""
    done = [r for r in rows if r["repeats"]]
    k = knee_index(done)
    knee = label(done[k]["config"]) if k is not None else None
    slo = spec.get("slo") or {}
    limits = {"TTFT P95 ms": slo.get("ttft_p95_ms"), "TPOT P95 ms": slo.get("tpot_p95_ms")}
    rejected, passing = [], []
    for r in rows:
        if r.get("error"):  # the server or a run failed: the reason is the finding (e.g. out of memory)
            rejected.append((r, [f"failed: {r['error']}"]))
            continue
        if not r["repeats"]:
            continue
        reasons = []
        for column, limit in limits.items():
            value = _median(r, column)
            if limit is not None and (value is None or value > limit):
                reasons.append(f"{column.replace(' ms', '')} {value:.0f} ms > {limit:g} ms" if value is not None
                               else f"no {column}")  # fmt: skip
        if r["failed"]:
            reasons.append(f"{r['failed']} failed requests")
        (rejected if reasons else passing).append((r, reasons))
    choice, choice_note = _highest_throughput([r for r, _ in passing])
    findings = []
    server_axes = [a for a in (done[0]["config"] if done else {}) if "." not in a]
    for axis in server_axes:
        never_bound = []
        for r in done:
            limit, running = r["config"][axis], _median(r, "max running")
            if isinstance(limit, int | float) and running is not None and running < limit:
                never_bound.append(limit)
        if never_bound and "running" in axis:
            peak = max(_median(r, "max running") or 0 for r in done)
            findings.append(f"{axis} at {', '.join(str(v) for v in never_bound)} never bound: at most "
                            f"{peak:.0f} requests were ever running, below the limit")  # fmt: skip
    if k is not None and len(done) > 1 and k == len(done) - 1 and not any(r.get("error") for r in rows):
        findings.append(f"throughput still grew up to {knee}: the knee may lie beyond the sweep")
    failing = [r for r in done if r["failed"]]
    if failing:
        findings.append(f"requests failed in {', '.join(label(r['config']) for r in failing)} (kinds in each run's "
                        "summary.md; e.g. timeouts while queued): the latency columns cover completed requests "
                        "only, so there they read low")  # fmt: skip
    flagged = [r for r in done if r.get("client_bound")]
    if flagged:
        runs = sum(r["client_bound"] for r in flagged)
        bounds = [r["error_bound_ms"] for r in flagged if r.get("error_bound_ms") is not None]
        worst = f"timing error bound up to {max(bounds):.1f} ms at P99, " if bounds else ""
        findings.append(f"{runs} of {sum(r['repeats'] for r in done)} runs were client-bound ({worst}in "
                        f"{', '.join(label(r['config']) for r in flagged)}): their latencies include the load "
                        "generator's own delay (summary.md says why); rerun on a quieter machine or with more "
                        "workers")  # fmt: skip
    first_retract = next((r for r in done if (_median(r, "retractions") or 0) > 0), None)
    if first_retract is not None:
        findings.append(
            f"retractions appear from {label(first_retract['config'])}: the KV pool ran out during decode"
        )
    return {
        "knee": knee,
        "choice": label(choice["config"]) if choice else None,
        "choice_note": choice_note,
        "slo": slo,
        "rejected": [{"config": label(r["config"]), "reasons": why} for r, why in rejected],
        "findings": findings,
    }


def render_html(spec: dict[str, Any], result: dict[str, Any]) -> str:
    """The sweep's curves along its configurations: throughput, TTFT P95 and TPOT P95 (medians, with the
    repeats' range), the SLO lines and the knee marked; plus the table of sweep.md."""
    import html

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from loadlab.analysis.html import png_base64

    rows = [r for r in result["rows"] if r["repeats"]]
    labels = [label(r["config"]) for r in rows]
    axis_names = list(spec["axes"])
    # One axis: its values on the x axis, its name below; several: each configuration's label.
    ticks = [str(r["config"][axis_names[0]]) for r in rows] if len(axis_names) == 1 else labels
    values = [r["config"][axis_names[0]] for r in rows]
    # One axis of positive numbers (limits, loads): at their values on a log scale, so refined points sit
    # where they belong; otherwise one slot per configuration.
    log_x = len(axis_names) == 1 and bool(rows) and all(_is_number(v) and v > 0 for v in values)
    x = values if log_x else list(range(len(rows)))
    slo = result.get("slo") or {}
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    for ax, column, limit in zip(axes, ("output tok/s", "TTFT P95 ms", "TPOT P95 ms"),
                                 (None, slo.get("ttft_p95_ms"), slo.get("tpot_p95_ms")), strict=True):  # fmt: skip
        med = [r["values"][column]["median"] for r in rows]
        lo = [r["values"][column]["min"] for r in rows]
        hi = [r["values"][column]["max"] for r in rows]
        ax.plot(x, [m if m is not None else float("nan") for m in med], marker="o")
        ax.fill_between(x, [v if v is not None else float("nan") for v in lo],
                        [v if v is not None else float("nan") for v in hi], alpha=0.2)  # fmt: skip
        if limit is not None:
            ax.axhline(limit, color="red", ls="--", lw=1, label=f"SLO {limit:g}")
        if result.get("knee") in labels:
            ax.axvline(x[labels.index(result["knee"])], color="grey", ls=":", lw=1, label="knee")
        if result.get("choice") in labels and med[labels.index(result["choice"])] is not None:
            i = labels.index(result["choice"])
            ax.plot([x[i]], [med[i]], marker="*", ms=16, color="green", ls="none", label="SLO-first choice")
        ax.legend(fontsize=8)
        ax.set_ylim(bottom=0)  # small differences stay small
        ax.set_title(column)
        if log_x:
            ax.set_xscale("log")
            ax.minorticks_off()
        ax.set_xticks(x, ticks, rotation=0 if len(axis_names) == 1 else 30, ha="center" if len(axis_names) == 1
                      else "right", fontsize=8)  # fmt: skip
        if len(axis_names) == 1:
            ax.set_xlabel(axis_names[0])
        ax.grid(alpha=0.3)
    image = png_base64(fig)
    plt.close(fig)
    title = html.escape(f"loadlab sweep: {spec['name']}")
    table = html.escape(render(spec, result, complete=True))
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title><style>"
            "body{font-family:sans-serif}pre{white-space:pre-wrap;background:#f6f6f6;padding:1em}</style>"
            f"</head><body><h1>{title}</h1>"
            f"<img alt='sweep curves' style='max-width:100%' src='data:image/png;base64,{image}'>"
            f"<pre>{table}</pre></body></html>\n")  # fmt: skip


def render(spec: dict[str, Any], result: dict[str, Any], complete: bool) -> str:
    lines = [f"# loadlab sweep: {spec['name']}", ""]
    failed = [label(r["config"]) for r in result["rows"] if r.get("error")]
    if failed:
        lines += [
            f"> **Failed**: {', '.join(failed)} (reasons below). Run the same command to try again.",
            "",
        ]
    elif not complete:
        lines += ["> **Incomplete**: interrupted; the table holds the finished runs. Run the same command to "
                  "resume.", ""]  # fmt: skip
    lines += [f"Profile `{spec['profile']}`, {spec['repeats']} repeat(s) per configuration; each cell is the "
              "median of the repeats with their range in brackets.", ""]  # fmt: skip
    axis_names = list(spec["axes"])
    header = axis_names + [c for c, *_ in COLUMNS]
    lines += ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for row in result["rows"]:
        cells = [str(row["config"][a]) for a in axis_names]
        for column, _, _, digits in COLUMNS:
            v = row["values"][column]
            if v["median"] is None:
                cells.append("n/a")
            elif v["min"] == v["max"]:
                cells.append(f"{v['median']:.{digits}f}")
            else:
                cells.append(f"{v['median']:.{digits}f} [{v['min']:.{digits}f}-{v['max']:.{digits}f}]")
        lines.append("| " + " | ".join(cells) + " |")
    slo = result.get("slo") or {}
    lines += [
        "",
        f"- Knee (the next configuration adds < {KNEE_GAIN:.0%} throughput): {result['knee'] or 'n/a'}",
    ]
    slo_text = ", ".join(f"{k} < {v:g}" for k, v in slo.items()) or "none"
    lines.append(
        f"- SLO-first choice (highest throughput meeting {slo_text}): {result['choice'] or 'none meets it'}"
    )
    if result.get("choice_note"):
        lines.append(f"  - {result['choice_note']}")
    refined = [
        str(next(iter(r["config"].values()))) for r in result["rows"] if r.get("refined") and r["repeats"]
    ]
    if refined:
        lines.append(f"- Refined around the coarse sweep's knee: {', '.join(refined)} added")
    for item in result["rejected"]:
        lines.append(f"  - rejected {item['config']}: {'; '.join(item['reasons'])}")
    for finding in result["findings"]:
        lines.append(f"- {finding}")
    return "\n".join(lines) + "\n"
