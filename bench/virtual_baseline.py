"""The shipped profiles in virtual time (seed 0), closed loop as shipped and open loop at a fixed rate: every
run's summary.json copied to OUT/<profile>-<closed|open>.json. Run it before and after a change, then
`python bench/virtual_baseline.py --compare BEFORE AFTER`: which summary keys differ.

    python bench/virtual_baseline.py OUT [--rate 8]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROFILES = ("default", "compose", "rag", "random-prefix", "shared-system-prompt")
# Keys that hold where and when the run happened, not what it measured.
VOLATILE = {"run_id", "run_dir", "started_wall", "ended_wall", "wall_s", "records_source"}


def run_all(out: Path, rate: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in PROFILES:
            for model, extra in (("closed", []), ("open", ["--rate", str(rate)])):
                argv = [sys.executable, "-m", "loadlab", "sim", "--virtual", str(ROOT / "profiles" / f"{name}.yaml"),
                        "--out", tmp, "--run-name", f"{name}-{model}", *extra]  # fmt: skip
                subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
                shutil.copy(Path(tmp) / f"{name}-{model}" / "summary.json", out / f"{name}-{model}.json")
                print(f"{name}-{model}", flush=True)


def diff(a, b, path=""):
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k in VOLATILE:
                continue
            yield from diff(a.get(k), b.get(k), f"{path}.{k}" if path else k)
    elif a != b:
        yield path, a, b


def compare(before: Path, after: Path) -> int:
    changed = 0
    for f in sorted(before.glob("*.json")):
        a, b = json.loads(f.read_text()), json.loads((after / f.name).read_text())
        rows = list(diff(a, b))
        changed += bool(rows)
        print(f"{f.stem}: {'identical' if not rows else f'{len(rows)} keys differ'}")
        for key, x, y in rows:
            print(f"  {key}: {x!r} -> {y!r}")
    return changed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?")
    p.add_argument("--rate", type=float, default=8.0)
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = p.parse_args()
    if args.compare:
        compare(Path(args.compare[0]), Path(args.compare[1]))
        return 0
    run_all(Path(args.out), args.rate)
    return 0


if __name__ == "__main__":
    sys.exit(main())
