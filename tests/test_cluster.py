"""Clusters: the cluster file's one-line errors, `loadlab cluster` with real twins behind the real
sglang-router (each worker serves, nothing is left behind), and a profile's `target.cluster` end to end."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from loadlab.cluster import READY_PREFIX
from loadlab.cluster.config import ClusterError, load_cluster
from loadlab.profile import ProfileError, load_profile

REPO = Path(__file__).resolve().parents[1]
CLUSTERS = sorted((REPO / "clusters").glob("*.yaml"))
LOADLAB = [sys.executable, "-m", "loadlab"]

GOOD = """\
name: c
districts:
  - name: online
    workers: 2
    gpu: a100-80gb
    sglang:
      max_running_requests: 64
front:
  kind: router
  policy: round_robin
"""


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("path", CLUSTERS, ids=[p.name for p in CLUSTERS])
def test_shipped_cluster_files_are_valid(path):
    config = load_cluster(path)
    assert config.total_workers >= 2 and config.front.kind in ("router", "omni")


def test_the_shipped_clusters_are_the_ones_described():
    four = load_cluster(REPO / "clusters" / "four-a100.yaml")
    assert [(d.workers, d.gpu, d.model) for d in four.districts] == [(4, "a100-80gb", "llama-3.1-8b")]
    two = load_cluster(REPO / "clusters" / "online-offline.yaml")
    assert [d.sglang["max_running_requests"] for d in two.districts] == [64, 256]


def test_defaults(tmp_path):
    config = load_cluster(write(tmp_path, "districts:\n  - name: a\n", "my-cluster.yaml"))
    assert config.name == "my-cluster" and config.front.kind == "router"
    assert config.front.policy == "cache_aware" and config.total_workers == 1
    assert config.front.poll_interval_s is None and config.front_settings() == {"policy": "cache_aware"}
    polled = load_cluster(write(tmp_path, "districts:\n  - name: a\nfront:\n  poll_interval_s: 2\n"))
    assert polled.front_settings() == {"policy": "cache_aware", "poll_interval_s": 2}
    omni = load_cluster(write(tmp_path, "districts:\n  - name: a\nfront:\n  kind: omni\n"))
    assert (omni.front.policy, omni.front.poll_interval_s, omni.front.queue_size) == (
        "least_queue",
        0.5,
        1024,
    )
    assert (
        load_cluster(write(tmp_path, "districts:\n  - name: a\nfront:\n  kind: none\n")).front.policy is None
    )


def test_processes_group_a_districts_workers(tmp_path):
    text = GOOD.replace("workers: 2", "workers: 5") + "workers_per_process: 2\n"
    config = load_cluster(write(tmp_path, text))
    assert [(d.name, n) for d, n in config.processes()] == [("online", 2), ("online", 2), ("online", 1)]


# (cluster text, expected line or None, fragments that must appear)
BAD = {
    "unknown top-level key": (GOOD + "extra: 1\n", 11, ["extra", "unknown key"]),
    "unknown district key": (GOOD.replace("    workers: 2", "    workers: 2\n    replicas: 3"), 5,
                             ["districts.0.replicas", "unknown key"]),
    "sglang bad value": (GOOD.replace("max_running_requests: 64", "max_running_requests: lots"), 7,
                         ["districts.0.sglang.max_running_requests", "expected an integer", "'lots'"]),
    "sglang unknown setting": (GOOD.replace("max_running_requests: 64", "max_batch_size: 64"), 7,
                               ["districts.0.sglang.max_batch_size", "unknown setting"]),
    "sglang dashes": (GOOD.replace("max_running_requests: 64", "max-running-requests: 64"), 7,
                      ["districts.0.sglang.max-running-requests", "write it as 'max_running_requests'"]),
    "sglang gpu": (GOOD.replace("max_running_requests: 64", "gpu: h100-80gb"), 7,
                   ["districts.0.sglang.gpu", "a key of the district"]),
    "sglang port": (GOOD.replace("max_running_requests: 64", "port: 30001"), 7,
                    ["districts.0.sglang.port", "set by loadlab cluster"]),
    "sglang no room for the KV cache": (
        GOOD.replace("    gpu: a100-80gb", "    model: llama-3.1-70b").replace(
            "max_running_requests: 64", "tp_size: 1"), 6, ["districts.0.sglang", "no memory for the KV cache"]),
    "zero workers": (GOOD.replace("workers: 2", "workers: 0"), 4, ["districts.0.workers", "greater than 0"]),
    "workers not a number": (GOOD.replace("workers: 2", "workers: two"), 4, ["districts.0.workers", "'two'"]),
    "unknown gpu": (GOOD.replace("gpu: a100-80gb", "gpu: v100"), 5, ["districts.0.gpu", "'v100'"]),
    "duplicate district": (GOOD.replace("front:", "  - name: online\nfront:"), 8,
                           ["districts.1.name", "also district 0's name"]),
    "no districts": ("name: c\n", None, ["districts", "required key is missing"]),
    "empty districts": ("districts: []\n", 1, ["districts", "at least 1"]),
    "unknown front kind": (GOOD.replace("kind: router", "kind: nginx"), 9, ["front.kind", "'nginx'"]),
    "policy of another front": (GOOD.replace("round_robin", "least_kv"), 10,
                                ["front.policy", "router: expected one of cache_aware, round_robin, power_of_two"]),
    "policy without a front": (GOOD.replace("kind: router", "kind: none"), 10, ["front.policy", "no policy"]),
    "omni option on the router": (GOOD + "  queue_size: 8\n", 11, ["front.queue_size", "only for kind: omni"]),
    "router poll not whole seconds": (GOOD + "  poll_interval_s: 0.5\n", 11,
                                      ["front.poll_interval_s", "router: whole seconds", "got 0.5"]),
    "poll without a front": (GOOD.replace("kind: router\n  policy: round_robin", "kind: none\n  poll_interval_s: 1"),
                             10, ["front.poll_interval_s", "polls nothing"]),
    "zero workers per process": (GOOD + "workers_per_process: 0\n", 11, ["workers_per_process", "greater than 0"]),
    "duplicate key": (GOOD.replace("    workers: 2", "    workers: 2\n    workers: 3"), 5,
                      ["districts.0.workers", "duplicate key (first at line 4)"]),
    "invalid yaml": ("districts: [unclosed\nname: c\n", 2, ["not valid YAML"]),
    "empty file": ("", None, ["cluster is empty"]),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_cluster_file_gives_one_line(tmp_path, case):
    text, line, fragments = BAD[case]
    path = write(tmp_path, text)
    with pytest.raises(ClusterError) as info:
        load_cluster(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(str(path) + (f":{line}:" if line else ":")), message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_a_target_needs_one_url(tmp_path):
    path = write(tmp_path, GOOD.replace("kind: router\n  policy: round_robin", "kind: none"))
    assert load_cluster(path).total_workers == 2
    with pytest.raises(ClusterError, match=r"c\.yaml:9: front\.kind: a run aims at one URL"):
        load_cluster(path, as_target=True)
    one = write(tmp_path, "districts:\n  - name: a\nfront:\n  kind: none\n", "one.yaml")
    assert load_cluster(one, as_target=True).front.kind == "none"


PROFILE = """\
name: on-a-cluster
target:
  url: embedded
  cluster: clusters/two.yaml
load:
  concurrency: 8
requests:
  warmup: 4
  measured: 40
workload:
  kind: random_prefix
  input_len: 64
  output_len: 16
"""


def test_profile_cluster_path_is_relative_to_the_profile(tmp_path):
    (tmp_path / "profiles").mkdir()
    path = write(tmp_path / "profiles", PROFILE, "p.yaml")
    assert load_profile(path).target.cluster == str(tmp_path / "profiles" / "clusters" / "two.yaml")
    # A server on the command line replaces the cluster, as it replaces the embedded twin.
    replaced = load_profile(path, {"target.url": "http://127.0.0.1:1"})
    assert replaced.target.cluster is None and replaced.target.url == "http://127.0.0.1:1"


@pytest.mark.parametrize(
    "change, fragment",
    [
        (("url: embedded", "url: http://127.0.0.1:1"), "target.cluster: only with url: embedded"),
        (("  url: embedded\n", "  url: embedded\n  embedded:\n    max_running_requests: 8\n"),
         "target.cluster: the cluster file sets its workers' settings"),
    ],
)  # fmt: skip
def test_profile_cluster_errors(tmp_path, change, fragment):
    path = write(tmp_path, PROFILE.replace(*change), "p.yaml")
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert str(info.value).startswith(f"{path}:") and fragment in str(info.value), str(info.value)


def test_validate_reads_cluster_files_and_a_profiles_cluster(tmp_path):
    (tmp_path / "clusters").mkdir()
    write(tmp_path / "clusters", GOOD, "two.yaml")
    profile = write(tmp_path, PROFILE, "p.yaml")
    proc = subprocess.run([*LOADLAB, "validate", str(REPO / "clusters" / "four-a100.yaml"), str(profile)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "four-a100.yaml: ok (cluster four-a100: 4 workers" in proc.stdout
    assert "on cluster" in proc.stdout
    write(tmp_path / "clusters", GOOD.replace("workers: 2", "workers: -2"), "two.yaml")
    proc = subprocess.run([*LOADLAB, "validate", str(profile)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"loadlab: {tmp_path / 'clusters' / 'two.yaml'}:4: districts.0.workers: "
        "Input should be greater than 0 (got -2)"
    )


# ----------------------------------------------------------------------------------------------------------
# Real processes: twins behind sglang-router.


def _children(pid: int) -> set[int]:
    """Every descendant of ``pid``."""
    return {p.pid for p in psutil.Process(pid).children(recursive=True)}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pids: set[int], timeout_s: float) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = {p for p in pids if _alive(p)}
        if not left:
            return set()
        time.sleep(0.1)
    return {p for p in pids if _alive(p)}


class LaunchedCluster:
    """`loadlab cluster FILE --port 0` as a child; ``ready`` is its ready line's JSON."""

    def __init__(self, path: Path):
        self.proc = subprocess.Popen([*LOADLAB, "cluster", str(path), "--port", "0"], cwd=REPO,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        self.stderr: list[str] = []
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(90)
        assert line and line[0].startswith(READY_PREFIX), (line, "".join(self.stderr)[-3000:])
        self.ready = json.loads(line[0][len(READY_PREFIX) :])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _generate(url: str, text: str) -> dict:
    body = json.dumps({"text": text, "sampling_params": {"max_new_tokens": 4}}).encode()
    req = urllib.request.Request(url + "/generate", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.load(resp)


def _requests_served(worker_url: str) -> float:
    with urllib.request.urlopen(worker_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("sglang:num_requests_total"))  # fmt: skip


@pytest.mark.parametrize("workers_per_process", [1, 2])
def test_cluster_of_two_behind_the_router_round_robin(tmp_path, workers_per_process):
    """Both workers serve through the router; SIGTERM leaves no process behind."""
    path = write(tmp_path, GOOD + f"workers_per_process: {workers_per_process}\n")
    cluster = LaunchedCluster(path)
    try:
        ready = cluster.ready
        assert ready["kind"] == "router" and ready["policy"] == "round_robin" and ready["name"] == "c"
        assert [w["district"] for w in ready["workers"]] == ["online", "online"]
        urls = [w["url"] for w in ready["workers"]]
        assert len(set(urls)) == 2 and ready["front"] not in urls
        for i in range(8):
            out = _generate(ready["front"], f"question {i} about the cluster")
            assert out["meta_info"]["completion_tokens"] == 4
        served = [_requests_served(url) for url in urls]
        assert sum(served) == 8 and min(served) >= 2, served  # round robin: both serve, about half each
        pids = _children(cluster.proc.pid)
        assert len(pids) == 3 - (workers_per_process == 2), pids  # worker processes and the router
        cluster.proc.send_signal(signal.SIGTERM)
        assert cluster.proc.wait(30) == 0, "".join(cluster.stderr)[-3000:]
        assert _wait_gone(pids, 15) == set()
    finally:
        cluster.kill()
    assert not any(line.startswith(READY_PREFIX) for line in cluster.proc.stdout)  # one ready line only


def test_a_sigkilled_launcher_leaves_nothing_behind(tmp_path):
    cluster = LaunchedCluster(write(tmp_path, GOOD))
    try:
        pids = _children(cluster.proc.pid)
        assert len(pids) == 3
    finally:
        cluster.kill()  # SIGKILL: no clean-up in the launcher; the children die with it
    assert _wait_gone(pids, 20) == set()


def test_a_bad_cluster_file_exits_2_with_one_line(tmp_path):
    path = write(tmp_path, GOOD.replace("kind: router", "kind: nginx"))
    proc = subprocess.run([*LOADLAB, "cluster", str(path), "--port", "0"], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().startswith(f"loadlab: {path}:9: front.kind:"), proc.stderr


def test_profile_on_a_cluster_runs_end_to_end_through_the_router(tmp_path):
    (tmp_path / "clusters").mkdir()
    write(tmp_path / "clusters", GOOD, "two.yaml")
    profile = write(tmp_path, PROFILE, "p.yaml")
    proc = subprocess.run([*LOADLAB, "run", str(profile), "--out", str(tmp_path / "out")], cwd=REPO,
                          capture_output=True, text=True, timeout=180)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_dir = Path(proc.stdout.strip().splitlines()[-1])
    from loadlab.manifest import read_manifest
    from loadlab.records import load_records

    manifest = read_manifest(run_dir)
    assert manifest.complete and manifest.counts.outcomes == {"ok": 44}
    records = load_records(run_dir)
    measured = records[records.phase == "measure"]
    assert len(measured) == 40 and (measured.outcome == "ok").all() and (measured.output_tokens == 16).all()
    target = manifest.target
    cluster = target.cluster
    assert target.embedded and cluster is not None
    assert (cluster.front_kind, cluster.policy, cluster.name) == ("router", "round_robin", "c")
    assert target.url == cluster.front_url
    assert [w.district for w in cluster.workers] == ["online", "online"]
    assert cluster.districts[0].settings["max_running_requests"] == 64
    # metrics_urls default to the workers: both were scraped, and both served.
    scraped: dict[str, float] = {}
    for line in (run_dir / "server_metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        scraped[row["url"]] = max(
            scraped.get(row["url"], 0.0), row["m"].get("sglang:num_requests_total", 0.0)
        )
    assert set(scraped) == {w.url for w in cluster.workers}
    assert all(n > 0 for n in scraped.values()), scraped


FOUR = """\
name: four
districts:
  - name: main
    workers: 4
    sglang:
      max_running_requests: 64
front:
  kind: {kind}
  policy: {policy}
"""


@pytest.mark.parametrize("kind, policy", [("router", "cache_aware"), ("omni", "least_queue")])
def test_four_a100s_through_each_front_account_for_every_request(tmp_path, kind, policy):
    # The acceptance case: a profile on a cluster of four simulated A100s, through sglang-router and
    # through omni: every measured request is attributed to the worker that served it.
    (tmp_path / "clusters").mkdir()
    write(tmp_path / "clusters", FOUR.format(kind=kind, policy=policy), "two.yaml")
    profile = write(tmp_path, PROFILE.replace("concurrency: 8", "concurrency: 16"), "p.yaml")
    proc = subprocess.run([*LOADLAB, "run", str(profile), "--out", str(tmp_path / "out")], cwd=REPO,
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_dir = Path(proc.stdout.strip().splitlines()[-1])
    from loadlab.analysis.summary import Summary
    from loadlab.manifest import read_manifest

    manifest, summary = read_manifest(run_dir), Summary.read(run_dir)
    workers = [w.url for w in manifest.target.cluster.workers]
    assert manifest.target.cluster.front_kind == kind and len(workers) == 4
    assert summary.completed == 40 and summary.failed == 0
    assert (
        sum(w.completed for w in summary.workers) == summary.completed and summary.unattributed_requests == 0
    )
    assert {w.served_by for w in summary.workers} <= set(workers)
    assert len(summary.workers) >= 3  # 16 in flight over four workers: (nearly) all of them serve
    assert all(w.peak_token_usage is not None for w in summary.workers)  # each worker's own /metrics


def test_a_cluster_without_a_front(tmp_path):
    cluster = LaunchedCluster(
        write(tmp_path, "districts:\n  - name: solo\nfront:\n  kind: none\n", "solo.yaml")
    )
    try:
        ready = cluster.ready
        assert ready["front"] is None and ready["policy"] is None and ready["kind"] == "none"
        (worker,) = ready["workers"]
        assert _generate(worker["url"], "straight to the worker")["meta_info"]["completion_tokens"] == 4
        cluster.proc.send_signal(signal.SIGINT)
        assert cluster.proc.wait(30) == 0
    finally:
        cluster.kill()


def test_power_of_two_through_the_real_router_polls_the_workers_get_load(tmp_path):
    # sglang-router's power_of_two takes its load signal from each worker's GET /get_load, every
    # front.poll_interval_s (its --worker-startup-check-interval; the router's default is 30 s); the twins
    # count the polls they answer (/server_info loadlab_get_load_polls). At 1 s, two polls of each worker
    # come within seconds (at the default the second would take a minute).
    text = GOOD.replace("policy: round_robin", "policy: power_of_two\n  poll_interval_s: 1")
    cluster = LaunchedCluster(write(tmp_path, text))
    try:
        urls = [w["url"] for w in cluster.ready["workers"]]
        deadline, polls = time.monotonic() + 20, [0] * len(urls)
        while min(polls) < 2 and time.monotonic() < deadline:
            time.sleep(0.25)
            for i, url in enumerate(urls):
                with urllib.request.urlopen(url + "/server_info", timeout=10) as resp:
                    polls[i] = json.load(resp)["loadlab_get_load_polls"]
        assert min(polls) >= 2, (polls, "".join(cluster.stderr)[-2000:])
        assert _generate(cluster.ready["front"], "hello power of two")["meta_info"]["completion_tokens"] == 4
    finally:
        cluster.kill()


def test_a_profile_on_a_cluster_in_virtual_time(tmp_path):
    # loadlab sim --virtual simulates the profile's target.cluster: the districts' workers behind its front
    # on the virtual clock, attributed per worker like a real run.
    (tmp_path / "clusters").mkdir()
    write(tmp_path / "clusters", GOOD.replace("workers: 2", "workers: 3"), "two.yaml")
    profile = write(tmp_path, PROFILE, "p.yaml")
    proc = subprocess.run([*LOADLAB, "sim", "--virtual", str(profile), "--out", str(tmp_path / "out")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = Path(proc.stdout.strip().splitlines()[-1])
    from loadlab.analysis.summary import Summary
    from loadlab.manifest import read_manifest

    manifest, summary = read_manifest(run_dir), Summary.read(run_dir)
    assert [w.url for w in manifest.target.cluster.workers] == ["online-0", "online-1", "online-2"]
    assert manifest.virtual_stats.workers == 3 and manifest.target.cluster.policy == "round_robin"
    # Round robin over 44 requests: 15/15/14, and each worker's requests accounted for.
    assert sorted(w.measured_requests for w in summary.workers) == [13, 13, 14]
    assert sum(w.completed for w in summary.workers) == summary.completed == 40
    bad = subprocess.run([*LOADLAB, "sim", "--virtual", str(profile), "--cluster", str(tmp_path / "none.yaml")],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
