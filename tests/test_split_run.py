"""Issue 13's acceptance in real time: a two-class profile run by `loadlab run` against an embedded split
cluster (two twins in two districts behind omni) reports both classes with their own SLO verdicts, the
per-class counts the profile asked for exactly, and every request served by its own district's worker."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pandas as pd
import yaml
from conftest import REPO

LOADLAB = [sys.executable, "-m", "loadlab.cli"]

CLUSTER = """\
name: tiny-split
districts:
  - name: online
    workers: 1
    sglang: {max_running_requests: 4}
    serves: [online]
  - name: offline
    workers: 1
    sglang: {max_running_requests: 16}
    serves: [offline]
front: {kind: omni, policy: least_queue}
"""

WARMUP, MEASURED = 4, 40
SHARES = {"online": 0.75, "offline": 0.25}


def _profile() -> dict:
    return {
        "name": "tiny-split",
        "seed": 3,
        "target": {"url": "embedded", "cluster": "cluster.yaml", "api": "generate"},
        "load": {"concurrency": 6},
        "requests": {"warmup": WARMUP, "measured": MEASURED},
        "workload": {"kind": "random_prefix", "input_len": 64, "output_len": 8},
        "classes": [
            # A TTFT under 1 us is out of any server's reach: this class must fail, the other must pass.
            {"name": "online", "share": SHARES["online"], "slo": {"ttft_p95_ms": 0.001},
             "carry": {"header": "x-request-id-class"}},
            {"name": "offline", "share": SHARES["offline"], "slo": {"ttft_p95_ms": 60000},
             "workload": {"kind": "random_prefix", "input_len": 128, "output_len": 24},
             "carry": {"header": "x-request-id-class"}},
        ],
    }  # fmt: skip


def test_two_classes_against_a_split_cluster_in_real_time(tmp_path):
    (tmp_path / "cluster.yaml").write_text(CLUSTER)
    profile = tmp_path / "split.yaml"
    profile.write_text(yaml.safe_dump(_profile(), sort_keys=False))
    proc = subprocess.run([*LOADLAB, "run", "--out", str(tmp_path / "out"), str(profile)], cwd=REPO,
                          capture_output=True, text=True, timeout=180)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = Path(proc.stdout.strip().splitlines()[-1])

    summary = json.loads((run_dir / "summary.json").read_text())
    classes = {c["name"]: c for c in summary["classes"]}
    assert set(classes) == {"online", "offline"}
    # Exact counts: 75 % and 25 % of 40 measured requests (largest remainder), all completed.
    assert {n: c["measured_requests"] for n, c in classes.items()} == {"online": 30, "offline": 10}
    assert {n: c["completed"] for n, c in classes.items()} == {"online": 30, "offline": 10}
    assert classes["online"]["slo"]["pass"] is False and classes["offline"]["slo"]["pass"] is True
    assert summary["slo"]["pass"] is False  # the overall verdict needs every class

    # Each class went to its own district's worker, and only there (served_by against the manifest).
    manifest = json.loads((run_dir / "manifest.json").read_text())
    district_of = {w["url"]: w["district"] for w in manifest["target"]["cluster"]["workers"]}
    records = pd.read_parquet(run_dir / "records.parquet")
    served = Counter(zip(records.request_class, records.served_by.map(district_of), strict=True))
    assert served == {("online", "online"): 30 + 3, ("offline", "offline"): 10 + 1}, served

    summary_md = (run_dir / "summary.md").read_text()
    assert "FAIL: class online" in summary_md and "PASS: class offline" in summary_md
