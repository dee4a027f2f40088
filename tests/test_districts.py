"""omni's districts over real processes on 127.0.0.1: three twins in two districts (``--district
NAME:CLASS=URL,...``), this process as the client. A request's class (the ``x-request-id-class`` header a
profile's ``classes[].carry.header`` sets) reaches only its district's workers (the twin's
``x-loadlab-worker`` header, a record's ``served_by``); each class has its own bounded queue (429
``queue_full`` naming the class while the other class is served); a class no district serves is a 400;
omni's /metrics count per class. docs/cluster.md "Districts and SLO classes"."""

from __future__ import annotations

import asyncio
import json
import subprocess
import urllib.request
from collections import Counter

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadlab.cluster.omni_process import OMNI, OmniProcess, omni_argv
from loadlab.testing.servers import started_twins

HEADER = "x-request-id-class"


@pytest.fixture(scope="module")
def twins():
    with started_twins(*[("--enable-metrics",)] * 3) as started:
        yield started


@pytest.fixture
def omni():
    procs: list[OmniProcess] = []

    def start(districts, policy="round_robin", queue_size=100, k=None) -> str:
        p = OmniProcess(omni_argv([], policy, 0.2, queue_size, k, districts=districts))
        procs.append(p)
        return p.start()

    yield start
    for p in procs:
        p.stop()


def body(text: str, max_new: int = 8) -> dict:
    return {"text": text, "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True}, "stream": True}


def send(url: str, requests: list[tuple[str | None, int]]) -> list[tuple[int, dict, bytes]]:
    """(class or None, max_new_tokens) each, all at once: (status, headers, body) each."""

    async def one(s, i, cls, max_new):
        headers = {HEADER: cls} if cls is not None else {}
        async with s.post(url + "/generate", json=body(f"req {i} {cls}", max_new), headers=headers) as r:
            return r.status, dict(r.headers), await r.read()

    async def main():
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(*(one(s, i, c, n) for i, (c, n) in enumerate(requests)))

    return asyncio.run(main())


def scrape(url: str) -> dict[tuple, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, *sorted(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}  # fmt: skip


def test_each_class_reaches_only_its_districts_workers(twins, omni):
    a, b, c = twins
    url = omni([("online", [a.url], ["online"]), ("offline", [b.url, c.url], ["offline"])])
    results = send(url, [("online", 4)] * 6 + [("offline", 4)] * 6)
    assert all(s == 200 for s, _, _ in results), results
    online = Counter(h["x-loadlab-worker"] for _, h, _ in results[:6])
    offline = Counter(h["x-loadlab-worker"] for _, h, _ in results[6:])
    assert online == {a.url: 6}, online
    assert offline == {b.url: 3, c.url: 3}, offline  # round robin inside the district
    m = scrape(url)
    assert m[("omni_class_requests_total", ("slo_class", "online"))] == 6
    assert m[("omni_class_routed_total", ("district", "online"), ("slo_class", "online"))] == 6
    assert m[("omni_class_routed_total", ("district", "offline"), ("slo_class", "offline"))] == 6
    assert ("omni_class_routed_total", ("district", "offline"), ("slo_class", "online")) not in m
    with urllib.request.urlopen(url + "/omni/workers", timeout=10) as r:
        view = json.loads(r.read())
    assert view["classes"] == {"online": ["online"], "offline": ["offline"]}
    assert [w["district"] for w in view["workers"]] == ["online", "offline", "offline"]

    # No district serves a request without a class, nor a class no district names: 400, omni's own answer.
    for (status, headers, raw), cls in zip(
        send(url, [(None, 4), ("batch", 4)]), (None, "batch"), strict=True
    ):
        assert status == 400 and headers["x-loadlab-front"] == "omni"
        err = json.loads(raw)
        assert err["reason"] == "unserved_class" and err["slo_class"] == cls
        assert "online serves online; offline serves offline" in err["message"]
    assert scrape(url)[("omni_rejects_total", ("reason", "unserved_class"))] == 2


def test_a_district_without_serves_takes_any_class_and_requests_without_one(twins, omni):
    a, b, _ = twins
    url = omni([("online", [a.url], ["online"]), ("rest", [b.url], None)])
    results = send(url, [(None, 4), ("batch", 4)] * 2 + [("online", 4)] * 4)
    assert all(s == 200 for s, _, _ in results)
    assert {h["x-loadlab-worker"] for _, h, _ in results[:4]} == {b.url}  # class default: only "rest"
    assert {h["x-loadlab-worker"] for _, h, _ in results[4:]} <= {a.url, b.url}  # online: both districts
    m = scrape(url)
    assert m[("omni_class_requests_total", ("slo_class", "default"))] == 4
    assert m[("omni_class_requests_total", ("slo_class", "online"))] == 4


def test_each_class_has_its_own_bounded_queue(twins, omni):
    a, b, c = twins
    # One request in flight per worker, one waiting per class.
    url = omni([("online", [a.url], ["online"]), ("offline", [b.url, c.url], ["offline"])], queue_size=1, k=1)
    results = send(url, [("online", 60)] * 4 + [("offline", 60)] * 3)
    online, offline = results[:4], results[4:]
    assert Counter(s for s, _, _ in online) == {200: 2, 429: 2}
    assert Counter(s for s, _, _ in offline) == {200: 3}  # 2 running + 1 waiting: its queue is its own
    for status, headers, raw in online:
        if status == 429:
            err = json.loads(raw)
            assert headers["x-loadlab-front"] == "omni"
            assert err["reason"] == "queue_full" and err["slo_class"] == "online" and err["waiting"] == 1
            assert "class 'online': the queue is full" in err["message"]
        else:
            assert headers["x-loadlab-worker"] == a.url
    m = scrape(url)
    assert m[("omni_class_rejects_total", ("reason", "queue_full"), ("slo_class", "online"))] == 2
    assert m[("omni_class_rejects_total", ("reason", "queue_full"), ("slo_class", "offline"))] == 0
    assert m[("omni_queue_wait_seconds_count", ("slo_class", "offline"))] == 1


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--district", "a=http://127.0.0.1:1", "http://127.0.0.1:2"], "not both"),
        (["--district", "a=http://127.0.0.1:1", "--district", "a=http://127.0.0.1:2"], "two districts"),
        (["--district", "a=http://127.0.0.1:1", "--district", "b=http://127.0.0.1:1"], "given twice"),
        (["--district", "a:x y=http://127.0.0.1:1"], "bad class name"),
        (["--district", "a:x"], "expected NAME[:CLASS,...]=URL"),
    ],
)
def test_bad_district_flags_are_one_line_and_exit_2(flags, message):
    p = subprocess.run([*OMNI, *flags], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and message in p.stderr, p.stderr


def test_cluster_file_serves_is_checked(tmp_path):
    from loadlab.cluster.config import ClusterError, load_cluster

    def load(text):
        p = tmp_path / "c.yaml"
        p.write_text(text)
        return load_cluster(p)

    ok = load("districts:\n  - name: a\n    serves: [online]\n  - name: b\nfront:\n  kind: omni\n")
    assert [d.serves for d in ok.districts] == [["online"], None]
    with pytest.raises(
        ClusterError, match=r"c.yaml:3: districts.0.serves: routing by class needs front kind"
    ):
        load("districts:\n  - name: a\n    serves: [online]\nfront:\n  kind: router\n")
    with pytest.raises(ClusterError, match="named twice"):
        load("districts:\n  - name: a\n    serves: [x, x]\nfront:\n  kind: omni\n")
    with pytest.raises(ClusterError, match="serves"):
        load("districts:\n  - name: a\n    serves: []\nfront:\n  kind: omni\n")


# -- the same on the virtual clock ------------------------------------------------------------------------
REPO = __import__("pathlib").Path(__file__).resolve().parent.parent


def _virtual(tmp_path, layout: str, cluster=None, measured: int = 150):
    from loadlab.profile import load_profile
    from loadlab.records import load_records
    from loadlab.virtual import run_virtual

    profile = load_profile(REPO / "profiles" / f"omni-{layout}.yaml")
    profile = profile.model_copy(update={"requests": profile.requests.model_copy(update={"warmup": 10,
                                                                                         "measured": measured})})  # fmt: skip
    run = run_virtual(profile, None, tmp_path, cluster=cluster or REPO / "clusters" / f"omni-{layout}.yaml")
    return run, load_records(run)


def _served(records) -> dict:
    rows = records[records.phase == "measure"].to_dict("records")
    return Counter((r["request_class"], None if r["served_by"] != r["served_by"] else r["served_by"],
                    int(r["http_status"])) for r in rows)  # fmt: skip


def test_virtual_split_routes_each_class_to_its_district_and_enlarge_spreads_both(tmp_path):
    _, split = _virtual(tmp_path, "split")
    got = _served(split)
    assert {(c, w) for c, w, _ in got} == {("online", "online-0"), ("offline", "offline-0")}, got
    assert {s for _, _, s in got} == {200}
    _, enlarge = _virtual(tmp_path, "enlarge")
    got = _served(enlarge)
    assert {(c, w) for c, w, _ in got} == {(c, f"pool-{i}") for c in ("online", "offline") for i in (0, 1)}, (
        got
    )


def test_virtual_class_no_district_serves_is_the_fronts_400(tmp_path):
    cluster = tmp_path / "c.yaml"
    cluster.write_text("districts:\n  - name: online\n    serves: [online]\nfront:\n  kind: omni\n")
    run, records = _virtual(tmp_path, "split", cluster, measured=60)
    got = _served(records)
    assert {(c, s) for c, _, s in got} == {("online", 200), ("offline", 400)}, got
    assert all(w is None for c, w, _ in got if c == "offline")
    summary = json.loads((run / "summary.json").read_text())
    assert {c["name"]: c["slo"]["pass"] for c in summary["classes"]}["offline"] is False


def test_virtual_a_full_class_queue_is_rejected_and_counted_per_class(tmp_path):
    # The split layout with omni's per-class queue bounded at 4, at 22 req/s: the online district (64
    # running) is saturated, so online arrivals beyond its queue get omni's 429, recorded as `rejected`
    # (not a timeout, not http_error) and counted in the online class alone.
    text = (
        (REPO / "clusters" / "omni-split.yaml")
        .read_text()
        .replace("  policy: least_queue", "  policy: least_queue\n  queue_size: 4")
    )
    cluster = tmp_path / "small-queue.yaml"
    cluster.write_text(text)
    from loadlab.analysis.summary import Summary

    run, records = _virtual(tmp_path, "split", cluster=cluster, measured=600)
    measured = records[records.phase == "measure"]
    rejected = measured[measured.outcome == "rejected"]
    assert (
        len(rejected) > 0
        and (rejected.http_status == 429).all()
        and (rejected.status_source == "front").all()
    )
    assert set(rejected.request_class) == {"online"}
    classes = {c.name: c for c in Summary.read(run).classes}
    assert classes["online"].failures.get("rejected") == len(rejected)
    assert "rejected" not in classes["offline"].failures
