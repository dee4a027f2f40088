"""Every ``loadlab`` command's argparse and dispatch: `run | report | compare | sweep | capacity | validate |
sim`.

`loadlab run` only arranges processes: it validates the profile, then runs Locust headless on
loadlab/swarm/locustfile.py (the same code as `locust -f locustfile.py`), and prints the run directory
as the last line of its output.
"""

from __future__ import annotations

# Each command imports the heavy parts it needs inside its function (pandas, pyarrow, numpy, gevent,
# aiohttp): `loadlab validate` and `loadlab sim` then start in a fraction of the time.
import argparse
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

from loadlab import exits
from loadlab.cliargs import OneLineParser, non_negative, positive
from loadlab.cluster.config import check_classes, is_cluster_file, load_cluster, load_target_cluster
from loadlab.manifest import MANIFEST, ManifestError, read_manifest, write_manifest
from loadlab.procs import free_port
from loadlab.profile import (
    CLI_OVERRIDES,
    CLUSTER_OVERRIDES,
    ProfileError,
    load_profile,
    parse_set_option,
    read_api_key,
)
from loadlab.records import (
    RECORDS_JSONL,
    RECORDS_PARQUET,
    SPILL_DIR,
    default_run_name,
    merge_spills,
    recorded_indices,
    unique_run_name,
    write_parquet,
)
from loadlab.sim import settings
from loadlab.sim.auth import API_KEY_ENV as SERVER_API_KEY_ENV
from loadlab.sim.auth import key_problem, server_api_key
from loadlab.sim.settings import BY_NAME, PROCESS_SETTINGS, resolve_settings
from loadlab.swarm.options import (
    PASSED_THROUGH,
    add_loadlab_arguments,
    overrides_from_options,
)
from loadlab.yamlconfig import ConfigError

LOCUSTFILE = Path(__file__).parent / "swarm" / "locustfile.py"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sim"]:  # the simulated server parses its own SGLang-style flags
        return _cmd_sim(argv[1:])
    # Everything after a bare `--` goes to Locust untouched.
    locust_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, locust_args = argv[:cut], argv[cut + 1 :]
    parser = _parser()
    args = parser.parse_args(argv)
    args.locust_args = locust_args
    try:
        return args.func(args)
    except (ConfigError, ManifestError) as e:
        print(f"loadlab: {e}", file=sys.stderr)
        return exits.BAD_INPUT


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="loadlab", description="Load testing for SGLang servers")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=OneLineParser)

    run = sub.add_parser("run", help="run a profile headless and write its report")
    run.add_argument("profile", help="profile YAML, e.g. profiles/rag.yaml")
    run.add_argument("--host", default=None, help="SGLang server URL (default: the profile's target)")
    run.add_argument("-t", "--run-time", default=None, help="upper bound on run time, e.g. 90s or 5m")
    run.add_argument(
        "--workers",
        type=positive(int),
        default=None,
        metavar="N",
        help="distributed: a Locust master and N worker processes on this machine (default: one process)",
    )
    run.add_argument(
        "--master-host",
        default=None,
        metavar="HOST",
        help="with --workers: start only the N workers, joining the master on HOST",
    )
    run.add_argument("--master-port", type=positive(int), default=None, metavar="PORT",
                     help="the master's port (default: a free one locally; 5557 with --master-host)")  # fmt: skip
    add_loadlab_arguments(run, locust=False)
    run.set_defaults(func=_cmd_run)

    report = sub.add_parser("report", help="(re)compute summary.json and summary.md for a run directory")
    report.add_argument("run_dir")
    report.set_defaults(func=_cmd_report)

    compare = sub.add_parser("compare", help="the figures that matter of two runs, side by side")
    compare.add_argument("run_a")
    compare.add_argument("run_b")
    compare.set_defaults(func=_cmd_compare)

    sweep = sub.add_parser("sweep", help="run a sweep file: configurations x repeats, relaunching the server")
    sweep.add_argument("sweep_file", help="sweep YAML, e.g. profiles/seed-batch-sweep.yaml")
    sweep.add_argument("--out", default=None, metavar="DIR",
                       help="sweep directory (default: reports/sweep-<name>[-virtual]); the same one resumes")  # fmt: skip
    sweep.add_argument("--virtual", action="store_true",
                       help="every run on the twin in virtual time, in this process (seconds, not minutes)")  # fmt: skip
    sweep.set_defaults(func=_cmd_sweep, capacity=False, confirm=None)

    capacity = sub.add_parser(
        "capacity", help="each configuration's capacity at SLO: the highest load at which the SLO holds"
    )
    capacity.add_argument(
        "sweep_file", help="sweep YAML (its axes, launch, set, slo); its capacity: key tunes the search"
    )
    capacity.add_argument("--out", default=None, metavar="DIR",
                          help="directory (default: reports/capacity-<name>[-virtual]); the same one resumes")  # fmt: skip
    how = capacity.add_mutually_exclusive_group()
    how.add_argument("--virtual", action="store_true", help="every run on the twin in virtual time")
    how.add_argument("--confirm", nargs="?", const="", default=None, metavar="DIR",
                     help="real time, for the virtual-time search's best configuration and its neighbours "
                     "only, each from its bracket there (default DIR: reports/capacity-<name>-virtual)")  # fmt: skip
    capacity.set_defaults(func=_cmd_sweep, capacity=True)

    cluster = sub.add_parser(
        "cluster", help="start a cluster file's workers (twins) and front; serve until SIGTERM or Ctrl-C"
    )
    cluster.add_argument("cluster_file", help="cluster YAML, e.g. clusters/four-a100.yaml")
    cluster.add_argument(
        "--host", default="127.0.0.1", help="address the front listens on (default: 127.0.0.1)"
    )
    cluster.add_argument("--port", type=non_negative(int), default=30000,
                         help="the front's port (0: a free one; default: 30000)")  # fmt: skip
    cluster.add_argument("--set", action="append", default=None, metavar="KEY=VALUE",
                         help="override a setting of the file, a district by its name (repeatable), e.g. "
                         "districts.online.sglang.max_running_requests=32, front.policy=round_robin")  # fmt: skip
    cluster.set_defaults(func=_cmd_cluster)

    validate = sub.add_parser("validate", help="check profiles, sweep and cluster files without sending load")
    validate.add_argument("profiles", nargs="+", metavar="FILE", help="profiles, sweep files, cluster files")
    validate.set_defaults(func=_cmd_validate)

    sub.add_parser("sim", help="the simulated SGLang server (loadlab sim --help)")
    return parser


def _cmd_run(args) -> int:
    from loadlab.workload import build_workload
    from loadlab.workload.text import Renderer

    profile = load_profile(args.profile, overrides_from_options(args, args.host))
    build_workload(profile)
    Renderer(profile.target.tokenizer)  # a bad tokenizer file is a profile error: fail before Locust starts
    read_api_key(profile.target, args.profile)  # a key variable or file the profile names must be there
    if profile.target.cluster:  # a bad cluster file or override of it, and classes its districts do not serve
        config = load_target_cluster(profile.target)
        check_classes(profile, args.profile, config, profile.target.cluster)  # Locust's init logs warnings
    if args.master_host is not None and args.workers is None:
        raise ProfileError("--master-host: only with --workers N (the workers to start)")
    if args.master_host is not None:
        return _run_workers(args)
    out = Path(args.out)
    run_name = unique_run_name(out, args.run_name or default_run_name(profile.name))
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--only-summary"]
    cmd += ["--profile-file", args.profile, "--out", str(out), "--run-name", run_name]
    workers: list[subprocess.Popen] = []
    if args.workers:
        port = args.master_port or free_port()
        cmd += ["--master", "--expect-workers", str(args.workers), "--master-bind-host", "127.0.0.1",
                "--master-bind-port", str(port)]  # fmt: skip
    for flag in CLI_OVERRIDES:  # the same loadlab options, passed on as given
        value = getattr(args, flag)
        if value is not None:
            cmd += ["--" + flag.replace("_", "-"), str(value)]
    for item in args.set or []:
        cmd += ["--set", item]
    for flag in PASSED_THROUGH:
        value = getattr(args, flag)
        if value is True:
            cmd.append("--" + flag.replace("_", "-"))
        elif value not in (None, False):
            cmd += ["--" + flag.replace("_", "-"), str(value)]
    if args.run_time:
        cmd += ["--run-time", args.run_time]
    cmd += args.locust_args
    # A terminal Ctrl-C reaches Locust too (same process group); Locust records the in-flight requests as
    # cancelled and finalizes the run, so this process only waits. (A no-op handler, not SIG_IGN: an
    # ignored signal would stay ignored in Locust across exec.)
    previous = signal.signal(signal.SIGINT, lambda *_: None)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        proc = subprocess.Popen(cmd, env=env)
        if args.workers:
            workers = [
                subprocess.Popen(_worker_cmd("127.0.0.1", port, out), env=env) for _ in range(args.workers)
            ]
        status = proc.wait()
        for worker in workers:  # they exit when the master quits; a stuck one is not left behind
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                worker.kill()
    finally:
        signal.signal(signal.SIGINT, previous)
    run_dir = out / run_name
    if not (run_dir / "manifest.json").exists():
        print(f"loadlab: the run did not start (locust exit status {status})", file=sys.stderr)
        return status or 1
    print(run_dir, flush=True)
    return status


def _worker_cmd(master_host: str, master_port: int, out: Path) -> list[str]:
    return [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--worker", "--master-host", master_host,
            "--master-port", str(master_port), "--out", str(out)]  # fmt: skip


def _run_workers(args) -> int:
    """Only workers, joining a master elsewhere (the master has the profile; workers get it from there)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = _worker_cmd(args.master_host, args.master_port or 5557, Path(args.out))
    previous = signal.signal(signal.SIGINT, lambda *_: None)
    try:
        procs = [subprocess.Popen(cmd, env=env) for _ in range(args.workers)]
        statuses = [p.wait() for p in procs]
    finally:
        signal.signal(signal.SIGINT, previous)
    return max(statuses)


def _cmd_report(args) -> int:
    from loadlab.analysis.report import write_report

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(f"loadlab: {run_dir}: not a directory", file=sys.stderr)
        return exits.BAD_INPUT
    if not any((run_dir / name).exists() for name in (RECORDS_PARQUET, RECORDS_JSONL, SPILL_DIR)):
        print(f"loadlab: {run_dir}: no records ({RECORDS_PARQUET} or {RECORDS_JSONL})", file=sys.stderr)
        return exits.BAD_INPUT
    if not (run_dir / MANIFEST).exists():
        print(f"loadlab: {run_dir}: warning: no {MANIFEST}; SLO and load model unknown", file=sys.stderr)
    # Only a distributed run's spill files can add records: the JSONL is read for its indices only then.
    spills = run_dir / SPILL_DIR
    recovered = merge_spills(run_dir, recorded_indices(run_dir)) if spills.is_dir() else []
    if recovered:  # a distributed run whose master died: the workers' spill files complete the records
        write_parquet(run_dir)
        manifest = read_manifest(run_dir)
        if manifest is not None:
            counts = manifest.counts
            counts.recovered_from_spills = (counts.recovered_from_spills or 0) + len(recovered)
            write_manifest(run_dir, manifest)
        print(
            f"loadlab: {run_dir}: {len(recovered)} records merged from workers' spill files", file=sys.stderr
        )
    write_report(run_dir)
    print(run_dir / "summary.md")
    return exits.OK


def _cmd_compare(args) -> int:
    # lazy, as the line above: the report stack (pandas, numpy, pydantic) loads only for this command
    from loadlab.analysis.compare import compare, load_summary, render
    from loadlab.analysis.summary import SummaryError

    dirs = [Path(args.run_a), Path(args.run_b)]
    for d in dirs:
        if not d.is_dir():
            print(f"loadlab: {d}: not a run directory", file=sys.stderr)
            return exits.BAD_INPUT
    try:
        a, b = (load_summary(d) for d in dirs)
    except SummaryError as e:
        print(f"loadlab: {e}", file=sys.stderr)
        return exits.BAD_INPUT
    print(render(dirs[0], dirs[1], a, b, compare(a, b)), end="")
    return exits.OK


def _cmd_sweep(args) -> int:
    from loadlab.experiment.runner import run_sweep
    from loadlab.experiment.spec import load_sweep
    from loadlab.target.probe import TargetError

    spec = load_sweep(args.sweep_file, capacity=args.capacity)
    kind = "capacity" if args.capacity else "sweep"
    out = Path(args.out or Path("reports") / f"{kind}-{spec.name}{'-virtual' if args.virtual else ''}")
    confirm = None
    if args.confirm is not None:
        confirm = Path(args.confirm or Path("reports") / f"capacity-{spec.name}-virtual")
    try:
        return run_sweep(spec, out, args.locust_args and ["--", *args.locust_args], args.virtual, confirm)
    except TargetError as e:
        print(f"loadlab sweep: {e}", file=sys.stderr)
        return exits.TARGET


def _cmd_cluster(args) -> int:
    from loadlab.cluster.launch import run_cluster

    # This format puts loadlab.cluster.ERROR_MARK in the launcher's error lines (a run echoes them).
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")
    overrides = dict(parse_set_option(item) for item in args.set or [])
    return run_cluster(args.cluster_file, args.host, args.port, overrides)


def _cmd_validate(args) -> int:
    from loadlab.experiment.spec import is_sweep_file, load_sweep

    for path in args.profiles:
        if is_cluster_file(path):
            c = load_cluster(path)
            districts = ", ".join(f"{d.name}: {d.workers} x {d.gpu} {d.model}" for d in c.districts)
            front = f"{c.front.kind} {c.front.policy}" if c.front.kind != "none" else "no front"
            if c.front.orientation:
                front += f", orientation {c.front.orientation}"
            routes = c.switch_routes() if c.front.kind == "omni" else {}
            if routes:  # what the switch resolved to (auto expanded)
                front += ", switch " + "; ".join(f"{k} -> {', '.join(v)}" for k, v in routes.items())
            print(f"{path}: ok (cluster {c.name}: {c.total_workers} workers ({districts}), {front})")
            continue
        if is_sweep_file(path):
            spec = load_sweep(path)
            n = len(spec.configurations())
            refine = f", then {spec.refine} more per side of the knee" if spec.refine else ""
            print(
                f"{path}: ok (sweep: {n} configurations x {spec.repeats} repeats of {spec.profile}{refine})"
            )
            try:  # what `loadlab capacity` would search (a file's capacity: key was checked above)
                cap = load_sweep(path, capacity=True).capacity
            except ConfigError:  # its defaults do not apply (the default load is an axis): no such search
                continue
            print(f"{path}: ok (loadlab capacity: {cap.over} from {cap.start:g} to within {cap.tolerance:.0%}, "
                  f"{cap.repeats} runs at the boundary, per configuration)")  # fmt: skip
            continue
        profile = load_profile(path)
        if profile.target.cluster:
            config = load_target_cluster(profile.target)
            for warning in check_classes(profile, path, config, profile.target.cluster):
                print(f"loadlab: warning: {warning}", file=sys.stderr)
        from loadlab.workload import build_workload  # numpy, and a dataset or trace read: only here

        source = build_workload(profile).source_info()  # a dataset's or trace's file is read and checked
        on = f", on cluster {profile.target.cluster}" if profile.target.cluster else ""
        classes = f", {len(profile.classes)} classes" if profile.classes else ""
        read = ""
        if source is not None:
            left = "".join(f", {n} {why}" for why, n in source.get("filtered", {}).items())
            read = (
                f", {source['entries']} of {source['entries_read']} {source['format']} prompts usable{left}"
            )
        print(f"{path}: ok ({profile.workload.kind}, {profile.total_requests} requests{classes}{on}{read})")
    return exits.OK


# ----------------------------------------------------------------------------------------------------------
# loadlab sim: the twin, as a server or in virtual time
SIM_PROG = "loadlab sim"
VIRTUAL_OPTIONS = (
    "out",
    "run_name",
    "concurrency",
    "rate",
    "arrival",
    "speed",
    "num_requests",
    "warmup_requests",
    "cluster",
)


def sim_parser(suppress_defaults: bool = False) -> argparse.ArgumentParser:
    """``loadlab sim``'s command line: the twin's settings (SGLang's flag names) and the virtual-time run.
    ``suppress_defaults``: unset flags stay out of the namespace (to tell which were given)."""
    p = OneLineParser(
        prog=SIM_PROG,
        description="Simulated SGLang server (SGLang's scheduler on a GPU cost model, prefix cache, SGLang's "
        "wire protocol). Flags use SGLang's launch-flag names. Prints 'loadlab-sim listening on "
        "http://HOST:PORT' when ready. With --virtual PROFILE it runs the profile against the twin in "
        "virtual time instead and prints the run directory.",
    )
    settings.add_arguments(p, suppress_defaults)
    # SGLang's flag, so a command line written for SGLang runs the twin; not a setting (never shown by
    # /server_info or recorded). The environment variable keeps the key out of ps.
    p.add_argument("--api-key", metavar="KEY", default=argparse.SUPPRESS if suppress_defaults else None,
                   help="require this API key as SGLang does (401 without it; /health, /ready and /metrics "
                   f"stay open); better: the environment variable {SERVER_API_KEY_ENV}, which keeps it off "
                   "the command line")  # fmt: skip
    p.add_argument("--instances", type=positive(int), default=argparse.SUPPRESS if suppress_defaults else 1,
                   metavar="N", help="serve N twins with these settings in this process, each on its own "
                   "port (port 0: free ports; else PORT, PORT+1, ...); one ready line each (default: 1)")  # fmt: skip
    v = p.add_argument_group("virtual time (loadlab sim --virtual PROFILE)")
    v.add_argument("--virtual", metavar="PROFILE", default=None,
                   help="run PROFILE against the twin on a simulated clock; writes a run directory")  # fmt: skip
    v.add_argument(
        "--out", metavar="DIR", default=None, help="directory that receives the run directory (reports)"
    )
    v.add_argument(
        "--run-name", metavar="NAME", default=None, help="run directory name (default: time-profile-virtual)"
    )
    load = v.add_mutually_exclusive_group()
    load.add_argument(
        "--concurrency", type=positive(int), default=None, help="closed loop: requests held in flight"
    )
    load.add_argument("--rate", type=positive(float), default=None, help="open loop: requests per second")
    v.add_argument("--arrival", choices=("poisson", "constant", "trace"), default=None,
                   help="open-loop arrival process (trace: a trace workload's own times)")  # fmt: skip
    v.add_argument("--speed", type=positive(float), default=None,
                   help="trace arrivals: replay this many times faster than the trace")  # fmt: skip
    v.add_argument("--cluster", metavar="CLUSTER", default=None,
                   help="a cluster file: its workers behind its front, on the virtual clock (default: the "
                   "profile's target.cluster; the flags above then apply to every worker)")  # fmt: skip
    v.add_argument("--num-requests", type=positive(int), default=None, help="measured requests")
    v.add_argument("--warmup-requests", type=non_negative(int), default=None, help="warm-up requests")
    return p


def _cmd_sim(argv: list[str]) -> int:
    parser = sim_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # bad flags (2) or --help (0); argparse has printed the message
        return e.code if isinstance(e.code, int) else exits.BAD_INPUT
    if args.virtual is not None and args.instances != 1:
        print(f"{SIM_PROG}: error: --instances: only when serving (not with --virtual)", file=sys.stderr)
        return exits.BAD_INPUT
    if args.virtual is not None and args.api_key is not None:
        print(f"{SIM_PROG}: error: --api-key: only when serving (not with --virtual)", file=sys.stderr)
        return exits.BAD_INPUT
    if args.virtual is None:
        given = [o for o in VIRTUAL_OPTIONS if getattr(args, o) is not None]
        if given:
            flags = ", ".join("--" + o.replace("_", "-") for o in given)
            print(f"{SIM_PROG}: error: {flags}: only with --virtual PROFILE (see --help)", file=sys.stderr)
            return exits.BAD_INPUT
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.virtual is not None:
        return _cmd_sim_virtual(args, argv)
    from loadlab.sim.serve import serve
    from loadlab.sim.tokenize import Tokenizer

    api_key = server_api_key(args.api_key)
    problem = api_key and key_problem(api_key)
    if problem:
        where = "--api-key" if args.api_key else SERVER_API_KEY_ENV
        print(f"{SIM_PROG}: error: {where}: {problem}", file=sys.stderr)
        return exits.BAD_INPUT
    try:
        settings = resolve_settings(args)
        tokenizer = Tokenizer(settings.tokenizer)
    except ValueError as e:
        print(f"{SIM_PROG}: error: {e}", file=sys.stderr)
        return exits.BAD_INPUT
    try:
        serve(settings, tokenizer, args.instances, api_key)
    except OSError as e:
        print(
            f"{SIM_PROG}: error: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr
        )
        return exits.PARTIAL
    return exits.OK


def _cmd_sim_virtual(args: argparse.Namespace, argv: list[str]) -> int:
    """``loadlab sim --virtual PROFILE``: the profile's settings (``target.embedded``) with the flags given
    on the command line on top; prints the run directory as the last line."""
    from loadlab.virtual import run_virtual

    explicit = vars(sim_parser(suppress_defaults=True).parse_args(argv))
    overrides: dict = {}
    if args.concurrency is not None:
        overrides.update({"load.model": "closed", "load.concurrency": args.concurrency, "load.rate": None})
    if args.rate is not None:
        overrides.update({"load.model": "open", "load.rate": args.rate, "load.concurrency": None})
    if args.arrival is not None:
        overrides["load.arrival"] = args.arrival
        if args.arrival == "trace":  # an open loop at the trace's times: no rate, no cap unless given
            overrides.update({"load.model": "open", "load.rate": None})
            overrides.setdefault("load.concurrency", None)
    if args.speed is not None:
        overrides["load.speed"] = args.speed
    if args.num_requests is not None:
        overrides["requests.measured"] = args.num_requests
    if args.warmup_requests is not None:
        overrides["requests.warmup"] = args.warmup_requests
    try:
        profile = load_profile(args.virtual, overrides)
    except ProfileError as e:
        print(f"{SIM_PROG}: error: {e}", file=sys.stderr)
        return exits.BAD_INPUT
    cluster = args.cluster or profile.target.cluster
    settings = {} if cluster else dict(profile.target.embedded)
    settings.update({k: v for k, v in explicit.items() if k in BY_NAME and k not in PROCESS_SETTINGS})
    try:
        # Here, not in run_virtual: it models the front's answer to an unserved class (a 400), which its
        # tests rely on; a user's run is refused up front, as a real run is. target.cluster_overrides
        # apply to the cluster that runs (--cluster stands for target.cluster).
        overrides = profile.target.cluster_overrides if cluster else None
        if cluster:
            config = load_cluster(cluster, overrides=overrides, source=f"{CLUSTER_OVERRIDES}.")
            for warning in check_classes(profile, args.virtual, config, cluster):
                print(f"{SIM_PROG}: warning: {warning}", file=sys.stderr)
        run_dir = run_virtual(
            profile, settings, args.out or "reports", args.run_name, profile_path=args.virtual,
            command=["loadlab", "sim", *argv], cluster=cluster,
            cluster_overrides=overrides,
        )  # fmt: skip
    except (ValueError, ConfigError) as e:
        print(f"{SIM_PROG}: error: {e}", file=sys.stderr)
        return exits.BAD_INPUT
    m = read_manifest(run_dir)
    ok, vs = m.counts.outcomes.get("ok", 0), m.virtual_stats
    print(
        f"loadlab sim: virtual run complete: {ok} ok / {m.counts.records} requests, "
        f"{vs.virtual_duration_s:.1f} s simulated in {vs.wall_s:.2f} s; "
        f"report {run_dir / 'summary.md'}",
        file=sys.stderr,
        flush=True,
    )
    print(run_dir, flush=True)
    return exits.OK


if __name__ == "__main__":
    sys.exit(main())
