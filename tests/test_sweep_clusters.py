"""Sweeps over clusters: the layout (the cluster file) and a district's setting as axes, each run on a fresh
cluster of real twins behind omni on 127.0.0.1; the SLO-first choice requiring every class to pass; the
axes checked before anything starts, in one line. docs/experiments.md, "Sweeps over clusters"."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from loadlab.analysis import compute_summary
from loadlab.cluster import READY_PREFIX
from loadlab.experiment import runner
from loadlab.experiment.aggregate import choose
from loadlab.experiment.spec import SweepError, load_sweep, run_sets
from loadlab.manifest import read_manifest
from loadlab.records import load_records

REPO = Path(__file__).resolve().parents[1]
SWEEPS = REPO / "tests" / "sweeps"
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def sweep(path: Path, out: Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "loadlab", "sweep", str(path), "--out", str(out)], env=ENV,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "sweep.json").read_text())


def served(run_dir: str) -> Counter:
    """(class, the district of the worker that served it) per measured request."""
    manifest = read_manifest(Path(run_dir))
    district = {w.url: w.district for w in manifest.target.cluster.workers}
    records = load_records(Path(run_dir))
    measured = records[records.phase == "measure"]
    assert (measured.outcome == "ok").all()
    return Counter((c, district[w]) for c, w in zip(measured.request_class, measured.served_by, strict=True))


def test_a_layout_sweep_runs_each_layout_on_its_own_fresh_cluster_and_requires_every_class(tmp_path):
    out = tmp_path / "layouts"
    state = sweep(SWEEPS / "cluster-layouts.yaml", out)
    assert len(state["runs"]) == 4  # 2 layouts x 2 repeats
    fronts = set()
    for key, run_dir in state["runs"].items():
        k = int(key.split("/")[0])
        manifest = read_manifest(Path(run_dir))
        cluster = manifest.target.cluster
        layout = ("split", "enlarge")[k]
        assert cluster.file == str(SWEEPS / "clusters" / f"{layout}.yaml") and cluster.name == layout
        fronts.add(cluster.front_url)
        # Every run started its cluster and warmed it up, the second repeat as well as the first.
        assert manifest.counts.warmup_finished == 4, key
        got = served(run_dir)
        if layout == "split":  # each class only on its district's worker
            assert set(got) == {("online", "online"), ("offline", "offline")}, got
        else:  # one pool: both classes on its workers
            assert {d for _, d in got} == {"pool"} and {c for c, _ in got} == {"online", "offline"}
            workers = Counter(load_records(Path(run_dir)).served_by)
            assert len(workers) == 2, workers
    assert len(fronts) == 4  # a fresh cluster for each run
    result = state["result"]
    rows = {r["config"]["target.cluster"]: r for r in result["rows"]}
    split, enlarge = rows["clusters/split.yaml"], rows["clusters/enlarge.yaml"]
    verdicts = {name: {c["name"]: c["pass"] for c in row["classes"]} for name, row in rows.items()}
    # Online runs one at a time on the split layout's online district: its TTFT P95 is far above 250 ms.
    assert verdicts == {
        "clusters/split.yaml": {"online": False, "offline": True},
        "clusters/enlarge.yaml": {"online": True, "offline": True},
    }
    online = next(c for c in split["classes"] if c["name"] == "online")
    assert online["objectives"][0]["median"] > 400 and online["runs_passed"] == 0 and online["runs"] == 2
    # The sweep's verdicts agree with each run's own (summary.json classes[].slo.pass).
    for key, run_dir in state["runs"].items():
        row = (split, enlarge)[int(key.split("/")[0])]
        own = {
            c["name"]: c["slo"]["pass"]
            for c in json.loads((Path(run_dir) / "summary.json").read_text())["classes"]
        }
        assert own == {c["name"]: c["pass"] for c in row["classes"]}
    assert result["choice"] == "target.cluster=clusters/enlarge.yaml"
    (rejected,) = result["rejected"]
    assert rejected["config"] == "target.cluster=clusters/split.yaml"
    assert (
        rejected["reasons"][0].startswith("class online: TTFT P95 ") and "> 250 ms" in rejected["reasons"][0]
    )
    assert result["knee"] is None and "a choice, not a quantity" in result["knee_note"]
    md = (out / "sweep.md").read_text()
    assert "| target.cluster | online TTFT P95 ms (SLO 250) | online output tok/s | online |" in md
    assert md.count("**FAIL**") == 1 and "every class its own SLO: online TTFT P95 < 250 ms" in md
    page = (out / "sweep.html").read_text()
    assert page.count("data:image/png;base64,") == 1 and "online TTFT P95 ms (SLO 250)" in page


def test_a_district_setting_axis_reaches_the_districts_worker(tmp_path):
    out = tmp_path / "limit"
    state = sweep(SWEEPS / "cluster-online-limit.yaml", out)
    peaks = {}
    for k, limit in enumerate((1, 4)):
        run_dir = Path(state["runs"][f"{k}/0"])
        cluster = read_manifest(run_dir).target.cluster
        assert cluster.overrides == {"districts.online.sglang.max_running_requests": limit}
        settings = {d.name: d.settings for d in cluster.districts}
        assert settings["online"]["max_running_requests"] == limit
        assert "max_running_requests" not in settings["offline"]  # the file's, untouched
        assert set(served(str(run_dir))) == {("online", "online"), ("offline", "offline")}
        # What the online worker itself reported running, from its own /metrics.
        (url,) = [w.url for w in cluster.workers if w.district == "online"]
        rows = [json.loads(line) for line in (run_dir / "server_metrics.jsonl").read_text().splitlines()]
        peaks[limit] = max(r["m"].get("sglang:num_running_reqs", 0) for r in rows if r.get("url") == url)
    # About 6 online requests in flight: the worker ran as many as its limit allowed, never more.
    assert peaks[1] == 1 and 2 <= peaks[4] <= 4, peaks
    rows = {
        r["config"]["cluster.districts.online.sglang.max_running_requests"]: r
        for r in state["result"]["rows"]
    }
    online = {limit: next(c for c in row["classes"] if c["name"] == "online") for limit, row in rows.items()}
    assert online[4]["objectives"][0]["median"] < online[1]["objectives"][0]["median"]


def test_loadlab_cluster_set_overrides_a_districts_worker(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "loadlab", "cluster", str(SWEEPS / "clusters" / "split.yaml"),
                             "--port", "0", "--set", "districts.online.sglang.max_running_requests=3",
                             "--set", "front.policy=round_robin"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert line.startswith(READY_PREFIX), line
        ready = json.loads(line.removeprefix(READY_PREFIX))
        assert ready["policy"] == "round_robin"
        limits = {}
        for w in ready["workers"]:
            with urllib.request.urlopen(w["url"] + "/server_info", timeout=10) as resp:
                limits[w["district"]] = json.load(resp)["max_running_requests"]
        assert limits["online"] == 3 and limits["offline"] != 3
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    bad = subprocess.run([sys.executable, "-m", "loadlab", "cluster", str(SWEEPS / "clusters" / "split.yaml"),
                          "--set", "districts.nope.workers=2"], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and bad.stdout == "" and bad.stderr.count("\n") == 1
    assert "--set districts.nope.workers: no district 'nope'" in bad.stderr


def test_cluster_overrides_in_virtual_time(tmp_path):
    profile = tmp_path / "p.yaml"
    profile.write_text(
        (SWEEPS / "cluster-profile.yaml")
        .read_text()
        .replace("clusters/split.yaml", str(SWEEPS / "clusters" / "split.yaml"))
        .replace(
            "metrics_interval_s: 0.05}",
            "metrics_interval_s: 0.05,\n  cluster_overrides: "
            "{districts: {online: {sglang: {max_running_requests: 2}}}}}",
        )  # fmt: skip
    )
    done = subprocess.run([sys.executable, "-m", "loadlab", "sim", "--virtual", str(profile), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    cluster = read_manifest(Path(done.stdout.strip().splitlines()[-1])).target.cluster
    assert cluster.overrides == {"districts.online.sglang.max_running_requests": 2}
    assert {d.name: d.settings.get("max_running_requests") for d in cluster.districts} == {
        "online": 2,
        "offline": None,
    }


BAD = [
    # (axes or other keys, fragment of the one line)
    ("axes: {cluster.districts.nope.sglang.max_running_requests: [8]}",
     "axes: cluster.districts.nope.sglang.max_running_requests=8: no district 'nope' in this cluster"),
    ("axes: {cluster.districts.online.sglang.max_runing_requests: [8]}",
     "axes: cluster.districts.online.sglang.max_runing_requests=8: unknown setting 'max_runing_requests'"),
    ("axes: {cluster.districts.online.sglang.max_running_requests: [8, lots]}",
     "axes: cluster.districts.online.sglang.max_running_requests=lots: expected an integer, got 'lots'"),
    ("axes: {cluster.districts.online.replicas: [2]}", "axes: cluster.districts.online.replicas=2: not a key of a district"),
    ("axes: {cluster.front.policy: [least_queue, cache_aware]}",
     "axes: cluster.front.policy=cache_aware: omni: expected one of"),
    ("axes: {cluster.frnt.policy: [x]}", "axes: cluster.frnt.policy=x: not a key of a cluster file"),
    ("axes: {target.cluster: [clusters/split.yaml, clusters/nope.yaml]}", "axes: target.cluster=clusters/nope.yaml: "),
    # A product of axes the cluster files cannot all take: enlarge has no district online.
    ("axes: {target.cluster: [clusters/split.yaml, clusters/enlarge.yaml], "
     "cluster.districts.online.workers: [1]}", "axes: cluster.districts.online.workers=1: no district 'online'"),
    ("set: [cluster.front.queue_size=0]\naxes: {load.concurrency: [4]}", "set: cluster.front.queue_size=0: "),
    # A configuration whose districts leave a class of the profile unserved (its runs would be refused).
    ("axes: {cluster.districts.offline.serves: [[offline], [batch]]}",
     "axes: cluster.districts.offline.serves=['batch']: "),
    ("axes: {cluster.front.policy: [round_robin]}\nlaunch: [loadlab, sim, --port, '{port}']",
     "axes: cluster.front.policy: the runs aim at the launched server"),
    ("set: [target.url=http://127.0.0.1:1]\naxes: {cluster.front.policy: [round_robin]}",
     "axes: cluster.front.policy=round_robin: the profile runs no cluster"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "fragment"), BAD, ids=[b[1][:48] for b in BAD])
def test_bad_cluster_axes_are_one_line_before_anything_starts(tmp_path, text, fragment):
    shutil.copy(SWEEPS / "cluster-profile.yaml", tmp_path)
    shutil.copytree(SWEEPS / "clusters", tmp_path / "clusters")
    path = tmp_path / "s.yaml"
    path.write_text(f"profile: cluster-profile.yaml\n{text}\n")
    with pytest.raises(SweepError) as e:
        load_sweep(path)
    message = str(e.value)
    assert message.startswith(f"{path}: ") and fragment in message and "\n" not in message, message


def test_every_repeat_warms_up_a_target_the_run_starts_and_only_the_first_a_launched_one(
    tmp_path, monkeypatch
):
    calls = []

    def fake_run(spec, out, k, r, config, url, extra, warm_up):
        calls.append((k, r, warm_up, run_sets(spec, config)))
        run = out / "runs" / f"c{k:02d}-r{r}"
        run.mkdir(parents=True)
        compute_summary(None, None).model_copy(update={"output_throughput": 100.0 * (k + 1)}).write(run)
        return run

    monkeypatch.setattr(runner, "_one_run", fake_run)
    spec = load_sweep(SWEEPS / "cluster-layouts.yaml")
    assert spec.fresh_target
    assert runner.run_sweep(spec, tmp_path / "a") == 0
    assert [(k, r, w) for k, r, w, _ in calls] == [(0, 0, True), (0, 1, True), (1, 0, True), (1, 1, True)]
    # The layout reaches the run as the profile's key, its path resolved as the profile resolves its own.
    assert calls[0][3] == [f"target.cluster={SWEEPS / 'clusters' / 'split.yaml'}"]
    calls.clear()
    limit = load_sweep(SWEEPS / "cluster-online-limit.yaml")
    assert runner.run_sweep(limit, tmp_path / "b") == 0
    assert calls[1][3] == ["target.cluster_overrides.districts.online.sglang.max_running_requests=4"]
    # A launched server (the seed's sweep) is warm after its first run.
    launched = load_sweep(SWEEPS / "short.yaml")
    assert not launched.fresh_target


def test_the_choice_requires_every_class_to_meet_its_own_slo():
    def row(name, thr, online_ttft, offline_ttft, failed=0):
        def cls(n, ttft, threshold):
            o = {"key": "ttft_p95_ms", "label": "TTFT P95", "threshold_ms": threshold, "median": ttft, "min": ttft,
                 "max": ttft, "pass": ttft <= threshold}  # fmt: skip
            return {"name": n, "objectives": [o], "failed": 0, "runs": 1, "runs_passed": int(o["pass"]),
                    "pass": o["pass"]}  # fmt: skip

        values = {
            "output tok/s": thr,
            "TTFT P95 ms": max(online_ttft, offline_ttft),
            "TPOT P95 ms": 20,
            "retractions": 0,
        }
        return {"config": {"target.cluster": name}, "repeats": 1, "failed": failed,
                "values": {k: {"median": v, "min": v, "max": v} for k, v in values.items()},
                "classes": [cls("online", online_ttft, 1500), cls("offline", offline_ttft, 30000)]}  # fmt: skip

    # The fastest layout fails the online class; the run as a whole meets the sweep's own SLO in both.
    rows = [row("split", 5500, 7343, 115), row("enlarge", 5000, 164, 146)]
    result = choose(rows, {"ttft_p95_ms": 60000})
    assert result["choice"] == "target.cluster=enlarge"
    assert result["rejected"] == [
        {"config": "target.cluster=split", "reasons": ["class online: TTFT P95 7343 ms > 1500 ms"]}
    ]
    # Every class passing, the overall SLO still applies; and so do failed requests.
    rows = [row("split", 5500, 700, 115), row("enlarge", 5000, 164, 146)]
    assert choose(rows, {"ttft_p95_ms": 500})["choice"] == "target.cluster=enlarge"
    assert choose(rows, {})["choice"] == "target.cluster=split"
    rows[0]["failed"], rows[0]["classes"][0]["failed"] = 3, 3
    result = choose(rows, {})
    assert result["choice"] == "target.cluster=enlarge"
    assert result["rejected"][0]["reasons"] == ["3 failed requests (online 3)"]
    # No class passing anywhere: no choice.
    assert choose([row("split", 5500, 7343, 115), row("enlarge", 5000, 2154, 146)], {})["choice"] is None


def test_overrides_make_a_new_validated_config_and_leave_the_file_s_alone(tmp_path):
    from loadlab.cluster.config import ClusterError, flatten_overrides, load_cluster
    from loadlab.profile import ProfileError, load_profile

    split = SWEEPS / "clusters" / "split.yaml"
    base = load_cluster(split)
    nested = {
        "districts": {"online": {"sglang": {"max_running_requests": 8}}},
        "front": {"policy": "round_robin"},
    }
    flat = flatten_overrides(nested)
    assert flat == {"districts.online.sglang.max_running_requests": 8, "front.policy": "round_robin"}
    new = load_cluster(split, overrides=nested)
    assert new == load_cluster(split, overrides=flat) and new != base
    assert new.districts[0].sglang == {"max_running_requests": 8} and new.front.policy == "round_robin"
    assert base.districts[0].sglang == {"max_running_requests": 1} and base.front.policy == "least_queue"
    assert new.districts[1] == base.districts[1] and new.front.poll_interval_s == 0.1  # the rest as it was
    # Another kind of front starts from that kind's defaults (the router has no poll interval).
    router = load_cluster(split, overrides={"front.kind": "router", "districts.online.serves": None,
                                            "districts.offline.serves": None})  # fmt: skip
    assert (router.front.kind, router.front.policy, router.front.poll_interval_s) == (
        "router",
        "cache_aware",
        None,
    )
    # An orientation fills in its knobs as in a file, the ones the file (or the overrides) set winning.
    oriented = load_cluster(split, overrides={"front.orientation": "throughput", "front.queue_size": 64})
    assert (oriented.front.orientation, oriented.front.policy) == ("throughput", "least_queue")  # the file's
    assert oriented.front.switch == "auto" and oriented.front.switch_after_waiting == 32  # the preset's
    assert oriented.front.queue_size == 64 and oriented.front.poll_interval_s == 0.1
    # One class's switch districts, checked against the districts.
    switched = load_cluster(split, overrides={"front.switch.online": ["offline"]})
    assert switched.switch_routes() == {"online": ["offline"]}
    with pytest.raises(ClusterError, match=r"override front\.switch\.online: "):
        load_cluster(split, overrides={"front.switch.online": ["nowhere"]})
    # A district's name may hold dots: the longest name the key starts with.
    dotted = tmp_path / "d.yaml"
    dotted.write_text("districts:\n  - name: a\n  - name: a.b\n")
    assert load_cluster(dotted, overrides={"districts.a.b.workers": 3}).districts[1].workers == 3
    with pytest.raises(ClusterError, match=r"d\.yaml: override districts\.c\.workers: no district 'c'"):
        load_cluster(dotted, overrides={"districts.c.workers": 3})
    # The profile key: only with a cluster, and gone with the cluster when --host replaces it.
    profile = SWEEPS / "cluster-profile.yaml"
    assert load_profile(
        profile, {"target.cluster_overrides.front.policy": "round_robin"}
    ).target.cluster_overrides
    replaced = load_profile(profile, {"target.url": "http://127.0.0.1:1"})
    assert replaced.target.cluster is None and replaced.target.cluster_overrides == {}
    with pytest.raises(ProfileError, match="target.cluster_overrides: only with target.cluster"):
        load_profile(
            profile, {"target.cluster": None, "target.cluster_overrides.front.policy": "round_robin"}
        )
