"""Faults: a worker that dies while a run goes.

The analysis of a death (from known rows): when a worker stopped answering its /metrics, what failed on it,
the failures a front answered itself, sums over the servers left. Then real processes: a profile on a
cluster of three twins behind each front (sglang-router round_robin, omni least_queue), one twin SIGKILLed
mid-run: the run completes, no record is lost, the requests in flight on the dead worker are failed records,
the later ones are served by the others, and the report names the dead worker and what it cost. And every
worker killed: the cluster and the run go on, the router's own errors are front failures."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import psutil
import pytest
from test_analysis import T0, decoding, make_run, rec

from loadlab.analysis import Summary, write_report
from loadlab.analysis.server_metrics import gauge_series, gone_from, outages, server_summary

REPO = Path(__file__).resolve().parents[1]
LOADLAB = [sys.executable, "-m", "loadlab"]

A, B, C = "http://127.0.0.1:1001", "http://127.0.0.1:1002", "http://127.0.0.1:1003"


# ----------------------------------------------------------------------------------------------------------
# The analysis of a death, from known rows


def _scrapes(n: int, down: dict[str, tuple[int, int | None]], urls=(A, B)) -> list[dict]:
    """Rounds 0..n-1 one second apart from T0; ``down``: url -> (first failed round, first good round
    again or None)."""
    rows = []
    for k in range(n):
        for j, url in enumerate(urls):
            first, back = down.get(url, (n, None))
            failing = first <= k and (back is None or k < back)
            row = {"t": T0 + k + 0.01 * j, "url": url, "round": k}
            if failing:
                row["error"] = "GET /metrics: <urlopen error [Errno 111] Connection refused>"
            else:
                row["m"] = {"sglang:num_running_reqs": 2.0 if url == A else 1.0, "sglang:token_usage": 0.1}
            rows.append(row)
    return rows


def test_outages_are_the_first_failed_scrape_after_a_good_one():
    rows = _scrapes(8, {A: (4, None), B: (2, 3)}, urls=(A, B, C))
    rows += [{"t": T0 + k, "url": "http://never", "round": k, "error": "refused"} for k in range(8)]
    found = outages(rows)
    assert found == {
        A: (T0 + 4, None),
        B: (T0 + 2 + 0.01, T0 + 3 + 0.01),
    }  # C never failed; "never" never answered
    assert outages([{**r, "url": r["url"] + "/"} for r in rows])[A] == (T0 + 4, None)  # same_server
    # Gone: failing from some point to the end (A), not a blip (B).
    assert gone_from(rows) == {A: T0 + 4}
    # Summed gauges: a round with B's blip is left out; from A's death on, the sum is over B and C.
    ts, running = gauge_series(rows, "sglang:num_running_reqs")
    assert ts == pytest.approx(
        [T0 + k + 0.01 * (k >= 4) for k in (0, 1, 3, 4, 5, 6, 7)]
    )  # each round's first value
    assert running == [4.0, 4.0, 4.0, 2.0, 2.0, 2.0, 2.0]
    assert server_summary(rows, T0, T0 + 8)["max_running"] == 4.0
    assert server_summary(rows, T0, T0 + 8)["mean_running"] == pytest.approx(20 / 7)


def _death_records() -> list:
    """A serves until it dies at T0 + 3.5 (two requests in flight there end dropped); B serves throughout;
    one request omni answered itself (502: A had accepted it but gave no response), one the router did
    (500, every retry failed), one 429 from the front; one never connected to the front."""
    records = [
        rec(i, t=i * 0.5, ttft=100, e2e=400, events=decoding(4, 100, 100), served_by=A) for i in range(6)
    ]
    records += [
        rec(6 + i, t=i * 0.5, ttft=100, e2e=400, events=decoding(4, 100, 100), served_by=B) for i in range(12)
    ]
    for i, t in ((18, 3.2), (19, 3.3)):  # in flight on A when it died: the stream broke off
        records.append(rec(i, t=t, outcome="dropped", ttft=100, e2e=300.0, events=[(100, 1)], served_by=A))
    for i, (t, status) in enumerate([(3.4, 502), (3.6, 500), (4.0, 429)]):
        r = rec(20 + i, t=t, outcome="http_error", ttft=None, e2e=2.0)
        r.http_status, r.status_source = status, "front"
        records.append(r)
    records.append(rec(23, t=4.2, outcome="connect_error", ttft=None, e2e=1.0))
    return records  # fmt: skip


def test_a_dead_worker_is_named_with_what_it_cost(tmp_path):
    run = make_run(tmp_path, _death_records())
    # A's scrape at T0 + 4 is the first to fail (it died at T0 + 3.5); B answers to the end.
    (run / "server_metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in _scrapes(7, {A: (4, None)}))
    )
    s = write_report(run, html=True)
    by = {w.served_by: w for w in s.workers}
    a, b = by[A], by[B]
    assert (a.unreachable_from, a.reachable_again_from) == (T0 + 4, None)
    assert a.unreachable_after_s == pytest.approx(4.0)  # from the first measured send, T0 + 0
    assert (a.measured_requests, a.completed, a.failed, a.failures) == (8, 6, 2, {"dropped": 2})
    assert (b.unreachable_from, b.unreachable_after_s, b.reachable_again_from) == (None, None, None)
    assert b.failed == 0
    # Front failures: answered by a front itself, in no worker's figures; the connect error is neither.
    assert s.failed == 6 and s.failures == {"connect_error": 1, "dropped": 2, "http_error": 3}
    assert (s.front_failed, s.front_failures) == (3, {"429": 1, "500": 1, "502": 1})
    assert s.unattributed_requests == 4
    # The servers' running requests: A + B before A's death, B alone after (not blanked).
    assert s.server.max_running == 3.0 and s.server.mean_running == pytest.approx((3 * 4 + 1 * 3) / 7)

    md = (run / "summary.md").read_text()
    assert (
        f"> **Worker {A} stopped answering at T+4.0 s** (T = the first measured send; its /metrics scrapes "
        "failed from then on) and never answered again; 2 measured request(s) failed on it (dropped: 2); "
        "6 completed on it." in md
    )
    assert B + " stopped" not in md
    front = "- Failed at the front (answered by the front itself, never by a worker): 3"
    assert f"{front} (HTTP 429: 1, HTTP 500: 1, HTTP 502: 1)" in md
    assert "stopped answering" in (run / "report.html").read_text()  # summary.md is in the page
    assert Summary.read(run) == s


def test_a_worker_that_died_in_the_warmup_or_came_back(tmp_path):
    # C died before the measured phase (it served only warm-up requests): it still has an entry. B had a
    # blip and answered again. A never failed.
    records = [rec(0, phase="warmup", t=-2.0, served_by=C)]
    records += [rec(1 + i, t=i * 0.5, served_by=[A, B][i % 2]) for i in range(8)]  # measured: T0 .. T0 + 4.5
    rows = _scrapes(6, {B: (2, 4), A: (6, None)}, urls=(A, B))
    rows += [{"t": T0 - 3 + k, "url": C, "round": -3 + k, **({"m": {}} if k == 0 else {"error": "refused"})}
             for k in range(9)]  # fmt: skip
    run = make_run(tmp_path, records)
    (run / "server_metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = write_report(run)
    by = {w.served_by: w for w in s.workers}
    assert sorted(by) == [A, B, C]
    assert by[A].unreachable_from is None
    assert (by[B].unreachable_from, by[B].reachable_again_from) == (T0 + 2.01, T0 + 4.01)
    c = by[C]
    assert (c.measured_requests, c.completed, c.failed) == (0, 0, 0)
    assert c.unreachable_from == T0 - 2 and c.unreachable_after_s == pytest.approx(-2.0)
    md = (run / "summary.md").read_text()
    assert f"Worker {C} stopped answering at T-2.0 s** " in md and "no measured request failed on it" in md
    assert f"Worker {B} stopped answering at T+2.0 s** " in md and "answered again at T+4.0 s" in md
    # A summary written before these fields read with them unknown.
    on_disk = json.loads((run / "summary.json").read_text())
    for w in on_disk["workers"]:
        for key in ("unreachable_from", "unreachable_after_s", "reachable_again_from"):
            del w[key]
    del on_disk["front_failed"], on_disk["front_failures"]
    (run / "summary.json").write_text(json.dumps(on_disk))
    old = Summary.read(run)
    assert old.front_failed is None and old.front_failures == {}
    assert all(w.unreachable_from is None for w in old.workers)


# ----------------------------------------------------------------------------------------------------------
# Real processes: a profile on three twins behind each front, a twin SIGKILLed mid-run

CLUSTER = """\
name: faults
districts:
  - name: main
    workers: 3
    sglang:
      max_running_requests: 64
front:
  kind: {kind}
  policy: {policy}
"""

PROFILE = """\
name: worker-killed
target:
  url: embedded
  cluster: cluster.yaml
  metrics_interval_s: 0.5
load:
  concurrency: 12
requests:
  warmup: 6
  measured: {measured}
workload:
  kind: random_prefix
  input_len: 64
  output_len: 64
"""
WARMUP, CONCURRENCY = 6, 12


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _listening_pid(root: int, port: int) -> int:
    """The process under ``root`` that listens on ``port`` (a worker's, from its URL)."""
    for proc in _descendants(root):
        try:
            if any(
                c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in proc.net_connections("tcp")
            ):
                return proc.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    raise AssertionError(f"no process under {root} listens on port {port}")


def _metrics(url: str) -> dict[tuple, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return {(s.name, *sorted(s.labels.items())): s.value for f in text_string_to_metric_families(text)
            for s in f.samples}  # fmt: skip


class FrontWatch:
    """Polls the front's view of one worker every 0.1 s from a thread: omni's ``/omni/workers`` (up,
    routed), or sglang-router's own metrics (its circuit breaker for the worker, the failed attempts on
    it, its retries). ``samples``: (epoch s when the view was read, view)."""

    def __init__(self, kind: str, front_url: str, router_metrics: str | None, worker: str):
        self.kind, self.front_url, self.router_metrics, self.worker = kind, front_url, router_metrics, worker
        self.samples: list[tuple[float, dict]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def view(self) -> dict:
        if self.kind == "omni":
            with urllib.request.urlopen(self.front_url + "/omni/workers", timeout=5) as r:
                state = next(w for w in json.load(r)["workers"] if w["url"] == self.worker)
            return {
                "routing": bool(state["up"]),
                "attempts": state["routed"],
                "why": state.get("down_reason"),
            }
        m = _metrics(self.router_metrics)
        me = ("worker", self.worker)
        return {"routing": m.get(("smg_worker_cb_state", me), 0) == 0,  # 0: closed, the worker gets requests
                "attempts": m.get(("smg_worker_cb_outcomes_total", ("outcome", "failure"), me), 0.0),
                "retries": sum(v for k, v in m.items() if k[0] == "smg_worker_retries_total")}  # fmt: skip

    def _run(self) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(OSError, ValueError, StopIteration):  # the front stopping at the end
                view = self.view()
                self.samples.append((time.time(), view))  # when it was read: a slow reply may show the kill
            time.sleep(0.1)

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(10)


def _start_run(tmp_path: Path, kind: str, policy: str, measured: int):
    (tmp_path / "cluster.yaml").write_text(CLUSTER.format(kind=kind, policy=policy))
    (tmp_path / "p.yaml").write_text(PROFILE.format(measured=measured))
    stderr = open(tmp_path / "run.stderr", "w")  # noqa: SIM115 - the child writes it until the end
    proc = subprocess.Popen([*LOADLAB, "run", str(tmp_path / "p.yaml"), "--out", str(tmp_path / "out")], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=stderr, text=True)  # fmt: skip
    return proc, stderr


def _wait_for_records(proc, tmp_path: Path, n: int, timeout_s: float = 120.0) -> Path:
    """The run directory once it holds ``n`` records."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, (tmp_path / "run.stderr").read_text()[-4000:]
        for records in (tmp_path / "out").glob("*/records.jsonl"):
            if (records.parent / "manifest.json").exists() and len(records.read_bytes().splitlines()) >= n:
                return records.parent
        time.sleep(0.1)
    raise AssertionError(f"fewer than {n} records after {timeout_s:g} s")


def _router_metrics_url(root: int, front_url: str) -> str:
    """sglang-router's own metrics: the other port its process listens on (it renames its process title, so
    its command line cannot tell)."""
    front_port = int(front_url.rsplit(":", 1)[1])
    proc = psutil.Process(_listening_pid(root, front_port))
    ports = {c.laddr.port for c in proc.net_connections("tcp") if c.status == psutil.CONN_LISTEN} - {
        front_port
    }
    assert len(ports) == 1, ports
    return f"http://127.0.0.1:{ports.pop()}"


@pytest.mark.parametrize("kind, policy", [("router", "round_robin"), ("omni", "least_queue")])
def test_a_worker_killed_mid_run(tmp_path, kind, policy):
    measured = 180  # ~12 s at 12 in flight on three A100 twins (64 tokens in ~0.75 s each)
    proc, stderr = _start_run(tmp_path, kind, policy, measured)
    watch = None
    try:
        run_dir = _wait_for_records(proc, tmp_path, WARMUP + measured // 3)  # a third of the way
        from loadlab.manifest import read_manifest

        cluster = read_manifest(run_dir).target.cluster
        workers = [w.url for w in cluster.workers]
        victim, others = workers[1], {workers[0], workers[2]}
        pid = _listening_pid(proc.pid, int(victim.rsplit(":", 1)[1]))
        metrics = _router_metrics_url(proc.pid, cluster.front_url) if kind == "router" else None
        watch = FrontWatch(kind, cluster.front_url, metrics, victim)
        deadline = time.monotonic() + 10  # a sample of the front's view before the kill
        while not watch.samples and time.monotonic() < deadline:
            time.sleep(0.02)
        t_kill = time.time()
        os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=240)
    finally:
        if watch is not None:
            watch.finish()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        stderr.close()
    log = (tmp_path / "run.stderr").read_text()
    assert proc.returncode == 0, log[-4000:]
    assert Path(out.strip().splitlines()[-1]) == run_dir

    # The run completed and nothing was lost: every ticket has exactly one record.
    from loadlab.manifest import read_manifest
    from loadlab.records import load_records

    manifest = read_manifest(run_dir)
    assert manifest.complete and manifest.counts.records == WARMUP + measured
    records = load_records(run_dir)
    assert sorted(records["index"]) == list(range(WARMUP + measured))
    # The launcher logged the death once (echoed into the run's log) and kept serving.
    deaths = [line for line in log.splitlines() if f"{victim} (main) was killed by SIGKILL" in line]
    assert len(deaths) == 1 and deaths[0].endswith("the cluster keeps serving with 2 of 3 workers"), log[
        -3000:
    ]

    # What was in flight on the victim failed, with its outcome; nothing else failed but a front's own answer.
    failed = records[records.outcome != "ok"]
    on_victim = failed[failed.served_by == victim]
    at_front = failed[failed.status_source == "front"]
    assert len(on_victim) + len(at_front) == len(failed), failed[["index", "outcome", "served_by", "error"]]
    assert 1 <= len(on_victim) <= CONCURRENCY and set(on_victim.outcome) <= {"dropped", "stream_error"}
    assert (on_victim.t_send_wall < t_kill).all()  # sent before the kill: in flight when it died
    assert (
        at_front.t_send_wall < t_kill + 1.0
    ).all()  # only around the kill (omni's 502: accepted, no answer)
    # Requests sent after the kill went to the others (the router retried the ones it sent to the dead
    # worker; omni re-routed them and marked it down) and all completed.
    after = records[records.t_send_wall > t_kill]
    assert len(after) > measured // 3 and (after.outcome == "ok").all()
    assert set(after.served_by) == others

    # The front's side: when it stopped routing there, and what it sent there meanwhile.
    before = [v for t, v in watch.samples if t < t_kill]
    assert before and before[-1]["routing"]
    stopped = [(t, v) for t, v in watch.samples if t >= t_kill and not v["routing"]]
    assert stopped, watch.samples[-3:]
    t_stopped, at_stop = stopped[0]
    attempts = [v["attempts"] for t, v in watch.samples if t >= t_stopped]
    assert max(attempts) == at_stop["attempts"]  # nothing more for the dead worker once it stopped routing
    if kind == "omni":  # down at its next poll (0.5 s) or at the first connection refused
        assert t_stopped - t_kill < 0.5 + 0.5
    else:  # the router: no health check within the run (60 s); its circuit opens after 10 failed attempts
        assert at_stop["attempts"] - before[-1]["attempts"] >= 10

    # The report names the dead worker and what it cost.
    summary = Summary.read(run_dir)
    by = {w.served_by: w for w in summary.workers}
    dead = by[victim]
    # Its next scrape (every 0.5 s) failed; a scrape's time is when it started, so one under way at the
    # kill may be the first failed.
    assert t_kill - 0.5 < dead.unreachable_from < t_kill + 0.5 + 1.0
    assert dead.reachable_again_from is None
    assert dead.failed == len(on_victim) and dead.failures == dict(Counter(on_victim.outcome))
    assert all(by[w].unreachable_from is None and by[w].failed == 0 for w in others)
    assert summary.front_failed == len(at_front) == sum(summary.front_failures.values())
    outcomes = ", ".join(f"{k}: {v}" for k, v in sorted(dead.failures.items()))
    md = (run_dir / "summary.md").read_text()
    assert f"> **Worker {victim} stopped answering at T+{dead.unreachable_after_s:.1f} s**" in md
    assert f"and never answered again; {dead.failed} measured request(s) failed on it ({outcomes})" in md
    print(
        f"\n{kind} {policy}: killed at T+{t_kill - (dead.unreachable_from - dead.unreachable_after_s):.1f} s; "
        f"failed on it {dead.failed} ({outcomes}), at the front {summary.front_failed} "
        f"{summary.front_failures}; it stopped routing there after {t_stopped - t_kill:.2f} s and "
        f"{at_stop['attempts'] - before[-1]['attempts']:g} attempts there"
        + (f" (retries {at_stop['retries'] - before[-1]['retries']:g})" if kind == "router" else "")
        + (f" ({at_stop['why']})" if kind == "omni" else "")
        + f"; unreachable_from {dead.unreachable_from - t_kill:+.2f} s after the kill; "
        f"{len(after)} requests after the kill, all ok, on {sorted(Counter(after.served_by).values())}"
    )


def test_the_launcher_serves_on_when_a_worker_dies_and_stops_when_the_front_does(tmp_path):
    from test_cluster import LaunchedCluster, _generate, _wait_gone

    (tmp_path / "c.yaml").write_text(CLUSTER.format(kind="router", policy="round_robin"))
    cluster = LaunchedCluster(tmp_path / "c.yaml")
    try:
        ready = cluster.ready
        urls = [w["url"] for w in ready["workers"]]
        children = {p.pid for p in _descendants(cluster.proc.pid)}
        os.kill(_listening_pid(cluster.proc.pid, int(urls[0].rsplit(":", 1)[1])), signal.SIGKILL)
        deadline = time.monotonic() + 10  # the launcher checks its children every 0.2 s and logs the death
        while (
            not any("was killed by SIGKILL" in line for line in cluster.stderr)
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        time.sleep(0.5)  # a few more checks after it logged
        assert cluster.proc.poll() is None  # still serving
        served = Counter(  # through the router, by the two left (it retries what it sends to the dead one)
            _generate(ready["front"], f"after the death {i}")["meta_info"]["completion_tokens"]
            for i in range(6)
        )
        assert served == {4: 6}
        deaths = [line for line in cluster.stderr if "was killed by SIGKILL" in line]
        line = f"worker {urls[0]} (main) was killed by SIGKILL; the cluster keeps serving with 2 of 3 workers"
        assert len(deaths) == 1 and line in deaths[0], deaths
        # Without its front nothing reaches the workers: the launcher stops them and exits 1.
        front = _listening_pid(cluster.proc.pid, int(ready["front"].rsplit(":", 1)[1]))
        os.kill(front, signal.SIGKILL)
        assert cluster.proc.wait(30) == 1
        assert any(
            "the front (router) was killed by SIGKILL; stopping the cluster" in line
            for line in cluster.stderr
        )
        assert _wait_gone(children, 15) == set()
    finally:
        cluster.kill()


def test_every_worker_killed_the_run_goes_on_and_the_routers_own_errors_are_front_failures(tmp_path):
    measured = 160
    proc, stderr = _start_run(tmp_path, "router", "round_robin", measured)
    try:
        run_dir = _wait_for_records(proc, tmp_path, WARMUP + measured // 8)  # early: most requests come after
        from loadlab.manifest import read_manifest

        workers = [w.url for w in read_manifest(run_dir).target.cluster.workers]
        pids = [_listening_pid(proc.pid, int(url.rsplit(":", 1)[1])) for url in workers]
        t_kill = time.time()
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        stderr.close()
    log = (tmp_path / "run.stderr").read_text()
    assert proc.returncode == 0, log[-4000:]  # failed requests are data: the run completed
    assert sum("was killed by SIGKILL" in line for line in log.splitlines()) == 3
    from loadlab.records import load_records

    records = load_records(run_dir)
    assert sorted(records["index"]) == list(range(WARMUP + measured))  # one record per ticket
    after = records[records.t_send_wall > t_kill + 0.05]
    assert len(after) > measured // 2
    # Every request after the kill failed at the router: its 500 (every retry failed) or its 503 (every
    # circuit open), marked x-smg-error-code, so status_source front, no worker named.
    assert (after.outcome == "http_error").all() and (after.status_source == "front").all()
    assert after.served_by.isna().all() and set(after.http_status) <= {500, 503}
    summary = Summary.read(run_dir)
    front = records[(records.status_source == "front") & (records.phase == "measure")]
    assert summary.front_failed == len(front) >= len(after)
    assert summary.front_failures == {str(k): v for k, v in sorted(Counter(front.http_status).items())}
    # (a scrape's time is when it started: one under way at the kill fails too)
    assert all(w.unreachable_from is not None and w.unreachable_from > t_kill - 0.5 for w in summary.workers)
    assert len(summary.workers) == 3
    md = (run_dir / "summary.md").read_text()
    assert sum(line.startswith("> **Worker ") for line in md.splitlines()) == 3
    assert (
        f"- Failed at the front (answered by the front itself, never by a worker): {len(front)} (HTTP " in md
    )
    end = (records.t_send_wall + records.e2e_ms / 1000).max()
    print(
        f"\nall killed: {len(after)} requests after the kill, front failures {summary.front_failures}; "
        f"the last ended {end - t_kill:.2f} s after the kill; unreachable_from "
        f"{[round(w.unreachable_from - t_kill, 2) for w in summary.workers if w.unreachable_from]}"
    )
