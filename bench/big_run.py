"""Big runs, analysed: what a run of N records costs at its end and on the way (issue 17, part 5).

Each step runs in a process of its own (its peak RSS is its own), pinned with ``taskset -c CORE``:

- ``master``: a ``Run`` (the process that owns a run: one-process runs and a distributed run's master) is
  fed N records through ``Run.record`` as its users or workers hand them over (records.jsonl, and
  records.parquet / records.csv a row group at a time in a native thread), then ``Run.finalize``: the last
  row group, the manifest, summary.json, summary.md and report.html. Records per second through
  ``Run.record``, the finalize's time, the process's peak RSS.
- ``convert``: records.jsonl -> records.parquet and records.csv (``write_parquet``: what ``loadlab report``
  does after merging workers' spill files, or for a run that wrote no Parquet).
- ``summary``: ``write_report(html=False)`` on the run directory: records.parquet -> summary.json and
  summary.md (what ``loadlab report`` and a run's end compute).
- ``html``: the same with report.html.

The records are ``bench/make_big_run.py``'s (64-256 tokens each, mixed outcomes, two SLO classes, four
workers), written once per size into ``--dir`` and reused.

``--cores``: the CPUs each step may use (``taskset -c``: ``1`` one core, ``0,1`` both). ``--before REV``:
each step also runs with that commit's tree (``git archive``; its own PYTHONPATH), alternately with this
tree, ``--repeats`` times each, on the same files (records.parquet as this tree writes it). ``--one-token``:
records whose every event carries one token (``make_big_run.py --one-token``, in their own directories).
``--workload PROFILE``: the same records analysed as that profile's workload at their lengths (the manifest's
``workload`` replaced by the profile's, in a work directory of its own): summary.json's cache-hit bound
(``expected_cached_token_ratio``) is then that workload's, computed over every index as for a real run.

    python bench/big_run.py [--records 100000 1000000] [--dir /tmp/loadlab-bigrun] [--cores 1]
        [--steps master convert summary html] [--before REV] [--repeats 1] [--one-token] [--workload PROFILE]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common import machine_line

HERE = Path(__file__).resolve().parent


def _step(kind: str, run_dir: Path) -> dict:
    """One step in this process; returns its figures: wall seconds, CPU seconds in user space and in the
    kernel (page faults are most of the latter on a VM whose memory is costly to touch), minor faults."""
    t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    if kind == "convert":
        from loadlab.records import write_parquet

        write_parquet(run_dir)
    elif kind in ("summary", "html"):
        from loadlab.analysis.report import write_report

        # the imports are not the report's
        t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        write_report(run_dir, html=kind == "html")
    elif kind == "master":
        return _master(run_dir)
    r = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "seconds": time.perf_counter() - t0,
        "user_s": r.ru_utime - r0.ru_utime,
        "sys_s": r.ru_stime - r0.ru_stime,
        "minor_faults": r.ru_minflt - r0.ru_minflt,
        "peak_rss_mb": _peak_mb(),
    }


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _master(src: Path) -> dict:
    """A Run fed the records of ``src`` (read ahead, in batches as a master decodes them), then finalized."""
    from gevent import monkey

    monkey.patch_all()
    import gevent
    import orjson

    from loadlab.manifest import TargetInfo, read_manifest
    from loadlab.profile import validate_profile
    from loadlab.records import RECORDS_JSONL, RequestRecord
    from loadlab.swarm.run import Run
    from loadlab.workload import build_workload

    manifest = read_manifest(src)
    profile = validate_profile(manifest.profile)
    out = src.parent / "master-out"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    run = Run(profile, "bench", build_workload(profile), None, str(out), "run", TargetInfo(url="http://127.0.0.1:9"),
              None, 512, ["bench/big_run.py"])  # fmt: skip
    base = _peak_mb()
    fed = 0
    busy = 0.0
    t_all = time.perf_counter()
    with open(src / RECORDS_JSONL, "rb") as f:
        while True:
            lines = f.readlines(4 << 20)  # ~1500 records: a few workers' batches
            if not lines:
                break
            records = [RequestRecord(**orjson.loads(line)) for line in lines]
            t = time.perf_counter()
            for rec in records:
                run.tickets.next_index = max(run.tickets.next_index, rec.index + 1)
                run.record(rec)
            busy += time.perf_counter() - t
            fed += len(records)
            gevent.sleep(0)  # the greenlets that write row groups get their turn, as in a Locust process
    feed = time.perf_counter() - t_all
    peak_fed = _peak_mb()
    t = time.perf_counter()
    run.finalize()
    return {
        "records": fed,
        "record_us": busy / fed * 1e6,
        "feed_seconds": feed,
        "rss_before_mb": base,
        "peak_rss_fed_mb": peak_fed,
        "finalize_seconds": time.perf_counter() - t,
        "peak_rss_mb": _peak_mb(),
        "run_dir": str(run.dir),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/loadlab-bigrun"))
    parser.add_argument("--cores", default="1")
    parser.add_argument("--steps", nargs="+", default=["master", "convert", "summary", "html"])
    parser.add_argument("--before", default=None)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--one-token", action="store_true", help="records whose every event is one token")
    parser.add_argument("--workload", type=Path, default=None, help="analyse as this profile's workload")
    parser.add_argument("--step", nargs=2, metavar=("KIND", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step:
        print(json.dumps(_step(args.step[0], Path(args.step[1]))))
        return
    print(machine_line())
    trees = {"after": None}
    if args.before:
        trees = {"before": _unpack(args.before, args.dir / "before-tree"), **trees}
    for n in args.records:
        suffix = "-one" if args.one_token else ""
        src = args.dir / f"r{n}{suffix}"
        if not (src / "manifest.json").exists():
            make = [sys.executable, str(HERE / "make_big_run.py"), str(src), "--records", str(n)]
            subprocess.run(make + (["--one-token"] if args.one_token else []), check=True)
        work = args.dir / (f"w{n}{suffix}" + (f"-{args.workload.stem}" if args.workload else ""))
        for kind in args.steps:
            if kind == "convert" or (kind in ("summary", "html") and not (work / "records.parquet").exists()):
                shutil.rmtree(work, ignore_errors=True)
                work.mkdir(parents=True)
                (work / "records.jsonl").symlink_to(src / "records.jsonl")
                if args.workload is None:
                    (work / "manifest.json").symlink_to(src / "manifest.json")
                else:
                    _with_workload(src, work, args.workload)
                if kind != "convert":
                    _run("convert", work, args.cores, None)
            for _ in range(args.repeats):
                for name, tree in trees.items():
                    result = _run(kind, src if kind == "master" else work, args.cores, tree)
                    print(f"{n:>8} {kind:<8} {name:<6} " + " ".join(f"{k}={_fmt(v)}" for k, v in result.items()),
                          flush=True)  # fmt: skip


def _with_workload(src: Path, work: Path, profile_path: Path) -> None:
    """``src``'s manifest in ``work`` with the workload (and its seed) of the profile at ``profile_path``, at the
    records' own prompt and output lengths (so the bound is a share of the prompts the records sent)."""
    from loadlab.manifest import read_manifest, write_manifest
    from loadlab.profile import load_profile

    manifest = read_manifest(src)
    profile = load_profile(profile_path)
    lengths = {k: manifest.profile["workload"][k] for k in ("input_len", "output_len")}
    workload = {**profile.workload.model_dump(mode="json"), **lengths}
    manifest.profile = {**manifest.profile, "seed": profile.seed, "workload": workload}
    write_manifest(work, manifest)


def _unpack(rev: str, into: Path) -> Path:
    """The tree of ``rev`` (the repository's work trees and refs untouched)."""
    shutil.rmtree(into, ignore_errors=True)
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev], cwd=HERE.parent, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def _run(kind: str, run_dir: Path, cores: str, tree: Path | None) -> dict:
    script = (tree / "bench" / "big_run.py") if tree else Path(__file__)
    cmd = ["taskset", "-c", cores, sys.executable, str(script), "--step", kind, str(run_dir)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if tree:
        env["PYTHONPATH"] = str(tree)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree or None)
    if done.returncode != 0:
        sys.exit(f"{kind} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _fmt(v) -> str:
    return f"{v:.2f}" if isinstance(v, float) else str(v)


if __name__ == "__main__":
    main()
