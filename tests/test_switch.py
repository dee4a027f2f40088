"""omni's switch and the orientation presets (docs/omni.md "The switch", "Orientations").

Real processes on 127.0.0.1: two twins in two districts (``online`` held to 2 running requests, ``offline``
to 4), omni in front with or without ``--switch online=offline``, this process as the client; then the same
burst on the virtual clock (the same rule, ``policies.next_in_line``), the cluster file's keys and their one-line
errors, and the presets against the table in docs/omni.md."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
import urllib.request
from collections import Counter
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadlab.cluster.config import ORIENTATIONS, ClusterError, load_cluster
from loadlab.cluster.omni_process import OMNI, OmniProcess, omni_argv
from loadlab.testing.servers import started_twins

REPO = Path(__file__).resolve().parents[1]
HEADER = "x-request-id-class"
ONLINE_MAX, OFFLINE_MAX = 2, 4  # the twins' max_running_requests: omni's in-flight limit for each
BURST = 6
# (switch, switch_after_waiting) -> where a burst of 6 long online requests is served, how many omni
# diverted, how many waited in its queue. No switch: all 6 on online, 4 wait. After 0: online's 2 slots,
# then the offline district's 4 with room, none waits. After 2: the 3rd and 4th wait; the 5th and 6th each
# make the line longer than 2, so its head (the 3rd, then the 4th: the class keeps its order) is diverted;
# the 5th and 6th wait for online's own slots: 4 waited (diverting the arrivals instead would make it 2).
CASES = {
    "no switch": (False, 0, {"online": 6}, 0, 4),
    "switch at once": (True, 0, {"online": 2, "offline": 4}, 4, 0),
    "switch after 2 waiting": (True, 2, {"online": 4, "offline": 2}, 2, 4),
}


# -- real processes ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def twins():
    flags = [
        ("--enable-metrics", "--max-running-requests", str(limit)) for limit in (ONLINE_MAX, OFFLINE_MAX)
    ]
    with started_twins(*flags) as started:
        yield started


@pytest.fixture
def omni():
    procs: list[OmniProcess] = []

    def start(districts, switch=None, after=0, queue_size=100, policy="least_queue", k=None) -> str:
        argv = omni_argv([], policy, 0.2, queue_size, k, districts=districts, switch=switch,
                         switch_after_waiting=after)  # fmt: skip
        p = OmniProcess(argv)
        procs.append(p)
        return p.start()

    yield start
    for p in procs:
        p.stop()


def body(text: str, max_new: int) -> dict:
    return {"text": text, "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True}, "stream": True}


async def _post(s, url: str, cls: str, text: str, max_new: int):
    async with s.post(url + "/generate", json=body(text, max_new), headers={HEADER: cls}) as r:
        return r.status, dict(r.headers), await r.read()


def send(url: str, requests: list[tuple[str, int]]) -> list[tuple[int, dict, bytes]]:
    """(class, max_new_tokens) each, all at once: (status, headers, body) each."""

    async def main():
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(
                *(_post(s, url, c, f"req {i} {c}", n) for i, (c, n) in enumerate(requests))
            )

    return asyncio.run(main())


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def scrape(url: str) -> dict[tuple, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, *sorted(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}  # fmt: skip


def wait_for(check, timeout_s: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def districts_of(online, offline) -> list:
    return [("online", [online.url], ["online"]), ("offline", [offline.url], ["offline"])]


@pytest.mark.parametrize("case", list(CASES))
def test_a_burst_that_saturates_online_overflows_to_offline_only_with_the_switch(twins, omni, case):
    switch, after, expected, diverted, waited = CASES[case]
    online, offline = twins
    url = omni(districts_of(online, offline), {"online": ["offline"]} if switch else None, after)
    results = send(url, [("online", 60)] * BURST)
    assert all(s == 200 for s, _, _ in results), results
    # served_by, from the worker's own header: the diverted requests show up on the offline district's twin
    served = Counter(
        {online.url: "online", offline.url: "offline"}[h["x-loadlab-worker"]] for _, h, _ in results
    )
    assert served == expected, served
    m = scrape(url)
    key = ("omni_class_switched_total", ("district", "offline"), ("slo_class", "online"))
    assert m.get(key, 0) == diverted
    assert (
        m[("omni_class_routed_total", ("district", "online"), ("slo_class", "online"))] == expected["online"]
    )
    assert m[("omni_queue_wait_seconds_count", ("slo_class", "online"))] == waited
    view = get_json(url + "/omni/workers")
    if switch:
        assert view["switch"] == {"online": {"to": ["offline"], "after_waiting": after,
                                             "switched": {"offline": diverted}}}  # fmt: skip
    else:
        assert view["switch"] == {} and key not in m


def test_a_districts_own_waiting_requests_take_its_room_before_a_diverted_one(twins, omni):
    # One request in flight per worker (k=1); both districts full, each class with one request waiting.
    # The offline slot frees first (40 tokens against online's 150): offline's own waiting request takes
    # it, not online's overflow (online is omni's first class), which then waits for online's own slot;
    # the offline request (250 tokens) still holds the offline slot when online's frees.
    online, offline = twins
    url = omni(districts_of(online, offline), {"online": ["offline"]}, k=1)

    async def main():
        state = lambda: get_json(url + "/omni/workers")  # noqa: E731
        until = asyncio.to_thread
        async with aiohttp.ClientSession() as s:
            busy_on = asyncio.create_task(_post(s, url, "online", "long online", 150))
            await until(wait_for, lambda: state()["workers"][0]["in_flight"] == 1, 10, "online full")
            busy_off = asyncio.create_task(_post(s, url, "offline", "short offline", 40))
            await until(wait_for, lambda: state()["workers"][1]["in_flight"] == 1, 10, "offline full")
            waiting_off = asyncio.create_task(_post(s, url, "offline", "waiting offline", 250))
            waiting_on = asyncio.create_task(_post(s, url, "online", "waiting online", 10))
            await until(
                wait_for, lambda: state()["queues"] == {"online": 1, "offline": 1}, 10, "both waiting"
            )
            return await asyncio.gather(busy_on, busy_off, waiting_off, waiting_on)

    results = asyncio.run(main())
    assert [r[0] for r in results] == [200] * 4
    assert [r[1]["x-loadlab-worker"] for r in results] == [online.url, offline.url, offline.url, online.url]
    assert get_json(url + "/omni/workers")["switch"]["online"]["switched"] == {"offline": 0}


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--switch", "online=nowhere"],
            "--switch online=nowhere: no district 'nowhere' (districts: online, offline)",
        ),
        (["--switch", "online=online"], "district 'online' already serves class 'online'"),
        (["--switch", "batch=offline"], "no district serves class 'batch'"),
        (["--switch", "online"], "expected CLASS=DISTRICT,..."),
        (["--switch", "online=offline", "--switch", "online=offline"], "--switch online: given twice"),
        (
            ["--switch", "online=offline", "--switch-after-waiting", "9", "--queue-size", "8"],
            "exceeds --queue-size 8",
        ),
    ],
)
def test_bad_switch_flags_are_one_line_and_exit_2(flags, message):
    districts = [
        "--district",
        "online:online=http://127.0.0.1:1",
        "--district",
        "offline:offline=http://127.0.0.1:2",
    ]
    p = subprocess.run([*OMNI, *districts, *flags], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and message in p.stderr, p.stderr


# -- the same burst on the virtual clock ------------------------------------------------------------------
BURST_PROFILE = """\
name: burst
seed: 0
target:
  url: embedded
  cluster: c.yaml
  api: generate
load:
  model: open
  rate: 1000
  arrival: constant
requests:
  warmup: 0
  measured: 6
workload:
  kind: random_prefix
  input_len: 64
  output_len: 60
classes:
  - name: online
    share: 1.0
    carry:
      header: x-request-id-class
"""


def burst_cluster(switch: bool, after: int) -> str:
    text = f"""\
districts:
  - name: online
    sglang: {{max_running_requests: {ONLINE_MAX}}}
    serves: [online]
  - name: offline
    sglang: {{max_running_requests: {OFFLINE_MAX}}}
    serves: [offline]
front:
  kind: omni
  policy: least_queue
"""
    return text + (f"  switch: {{online: [offline]}}\n  switch_after_waiting: {after}\n" if switch else "")


def _virtual(tmp_path: Path, profile_text: str, cluster_text: str | None, cluster_path: Path | None = None):
    from loadlab.manifest import read_manifest
    from loadlab.profile import load_profile
    from loadlab.records import load_records
    from loadlab.virtual import run_virtual

    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "p.yaml").write_text(profile_text)
    if cluster_text is not None:
        cluster_path = tmp_path / "c.yaml"
        cluster_path.write_text(cluster_text)
    run = run_virtual(load_profile(tmp_path / "p.yaml"), None, tmp_path / "out", cluster=cluster_path)
    return read_manifest(run), load_records(run)


@pytest.mark.parametrize("case", list(CASES))
def test_the_same_burst_in_virtual_time_gives_the_same_counts(tmp_path, case):
    switch, after, expected, diverted, _ = CASES[case]
    manifest, records = _virtual(tmp_path, BURST_PROFILE, burst_cluster(switch, after))
    assert (records.http_status == 200).all()
    assert Counter(records.served_by.str.removesuffix("-0")) == expected
    assert manifest.virtual_stats.switched == ({"online": {"offline": diverted}} if switch else None)
    settings = manifest.target.cluster.front_settings
    assert settings["switch"] == ({"online": ["offline"]} if switch else {})
    assert settings["switch_after_waiting"] == after


def test_split_with_the_switch_in_virtual_time_diverts_online_overflow_only(tmp_path):
    # omni-split at 22 req/s saturates its online district (docs/omni.md): with the switch, online requests
    # also run on offline-0, exactly as many as the switch counted; offline requests never leave their
    # district; without it (omni-split) no online request reaches offline-0. The same traffic: the two
    # profiles differ in their cluster only.
    from loadlab.profile import load_profile

    def short(name: str) -> str:
        text = (REPO / "profiles" / f"{name}.yaml").read_text()
        text = text.replace("warmup: 100", "warmup: 10").replace("measured: 1200", "measured: 400")
        return text.replace("../clusters/", str(REPO / "clusters") + "/")

    a, b = (
        load_profile(REPO / "profiles" / "omni-split.yaml"),
        load_profile(REPO / "profiles" / "omni-split-switch.yaml"),
    )
    assert a.model_dump(exclude={"name", "description", "target"}) == b.model_dump(
        exclude={"name", "description", "target"}
    )
    assert a.target.model_dump(exclude={"cluster"}) == b.target.model_dump(exclude={"cluster"})
    split_manifest, split = _virtual(
        tmp_path / "split", short("omni-split"), None, REPO / "clusters" / "omni-split.yaml"
    )
    manifest, switched = _virtual(tmp_path / "switch", short("omni-split-switch"), None,
                                  REPO / "clusters" / "omni-split-switch.yaml")  # fmt: skip
    assert split_manifest.virtual_stats.switched is None
    assert set(zip(split.request_class, split.served_by, strict=True)) == {
        ("online", "online-0"),
        ("offline", "offline-0"),
    }
    got = Counter(zip(switched.request_class, switched.served_by, strict=True))
    assert set(got) == {("online", "online-0"), ("online", "offline-0"), ("offline", "offline-0")}, got
    assert got[("online", "offline-0")] == manifest.virtual_stats.switched["online"]["offline"] > 0
    assert len(switched) == len(split) == 410 and (switched.http_status == 200).all()


def test_in_virtual_time_a_diverted_request_never_takes_room_its_districts_own_class_waits_for(
    tmp_path, monkeypatch
):
    # omni-split-switch at 22 req/s fills the offline district too, so both classes wait at the front at
    # times; every online request sent to offline-0 must find no offline request waiting (own classes first).
    from loadlab import virtual

    seen = {"diverted": 0, "while_offline_waits": 0, "offline_waiting_max": 0}
    dispatch = virtual.VirtualRun._dispatch

    def watched(self, t, index, phase, due, spec, worker):
        waiting = len(self._front_queues.get("offline", ()))
        seen["offline_waiting_max"] = max(seen["offline_waiting_max"], waiting)
        if spec.request_class == "online" and worker.name == "offline-0":
            seen["diverted"] += 1
            seen["while_offline_waits"] += len(self._front_queues.get("offline", ())) > 0
        return dispatch(self, t, index, phase, due, spec, worker)

    monkeypatch.setattr(virtual.VirtualRun, "_dispatch", watched)
    text = (
        REPO / "profiles" / "omni-split-switch.yaml"
    ).read_text()  # 1200 measured: the offline queue forms late
    manifest, _ = _virtual(tmp_path, text.replace("../clusters/", str(REPO / "clusters") + "/"), None,
                           REPO / "clusters" / "omni-split-switch.yaml")  # fmt: skip
    assert seen["diverted"] == manifest.virtual_stats.switched["online"]["offline"] > 0
    assert seen["while_offline_waits"] == 0
    assert seen["offline_waiting_max"] > 10  # the case arose: offline requests did wait at the front


# -- the cluster file -------------------------------------------------------------------------------------
TWO = """\
districts:
  - name: online
    serves: [online]
  - name: offline
    serves: [offline]
front:
  kind: omni
"""


def load(tmp_path: Path, text: str):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return load_cluster(path)


def test_switch_keys_resolve(tmp_path):
    config = load(tmp_path, TWO + "  switch: {online: offline}\n")  # one district alone is a list of one
    assert config.switch_routes() == {"online": ["offline"]} and config.front.switch_after_waiting == 0
    assert load(tmp_path, TWO + "  switch: auto\n").switch_routes() == {
        "online": ["offline"],
        "offline": ["online"],
    }
    assert load(tmp_path, TWO + "  switch: false\n").switch_routes() == {}
    assert load(tmp_path, TWO).switch_routes() == {}
    # auto on a pool serving every class has nothing to divert to: no switch, no error
    assert (
        load(tmp_path, "districts:\n  - name: pool\nfront:\n  kind: omni\n  switch: auto\n").switch_routes()
        == {}
    )


# (file text, line, the error's text after "c.yaml:LINE: ")
BAD = {
    "unknown district": (TWO + "  switch: {online: [nowhere]}\n", 8,
                         "front.switch.online: no district 'nowhere' (districts: online, offline)"),
    "already serves": (TWO + "  switch: {online: [online]}\n", 8, "front.switch.online: district 'online' already "
                       "serves class 'online': a switch diverts to districts that do not"),
    "a pool serving any class": (TWO.replace("  - name: offline\n    serves: [offline]\n", "  - name: rest\n")
                                 + "  switch: {online: [rest]}\n", 7,
                                 "front.switch.online: district 'rest' already serves class 'online'"),
    "unknown class": (TWO + "  switch: {batch: [offline]}\n", 8,
                      "front.switch.batch: no district serves class 'batch', so it has nothing to switch from "
                      "(classes: online, offline)"),
    "twice": (TWO + "  switch: {online: [offline, offline]}\n", 8, "front.switch.online: district 'offline' is named twice"),
    "empty list": (TWO + "  switch: {online: []}\n", 8, "front.switch.online: expected at least one district"),
    "bad shape": (TWO + "  switch: yes\n", 8, "front.switch: expected auto, false or a mapping of class to districts"),
    "negative": (TWO + "  switch: auto\n  switch_after_waiting: -1\n", 9, "front.switch_after_waiting: Input should be "
                 "greater than or equal to 0"),
    "beyond the queue": (TWO + "  switch: auto\n  queue_size: 8\n  switch_after_waiting: 9\n", 10,
                         "front.switch_after_waiting: the switch waits for more than 9 requests in line, but the "
                         "queue holds 8"),
    "router": (TWO.replace("kind: omni", "kind: router") .replace("    serves: [online]\n", "").replace(
        "    serves: [offline]\n", "") + "  switch: auto\n", 6, "front.switch: only for kind: omni (this front is router)"),
    "unknown orientation": (TWO + "  orientation: speed\n", 8,
                            "front.orientation: expected one of throughput, latency, stability, cost, got 'speed'"),
    "orientation on the router": ("districts:\n  - name: a\nfront:\n  kind: router\n  orientation: latency\n", 5,
                                  "front.orientation: only for kind: omni (this front is router)"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
def test_switch_and_orientation_mistakes_are_one_line(tmp_path, case):
    text, line, expected = BAD[case]
    with pytest.raises(ClusterError) as info:
        load(tmp_path, text)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{tmp_path / 'c.yaml'}:{line}: {expected}"), message


# -- orientations -----------------------------------------------------------------------------------------
KNOBS = ("policy", "poll_interval_s", "queue_size", "in_flight_fraction", "switch", "switch_after_waiting")


def documented_presets() -> dict[str, dict]:
    """docs/omni.md's orientation table: {name: {knob: value}} (values as YAML would read them)."""
    import yaml

    text = (REPO / "docs" / "omni.md").read_text()
    section = text[text.index("## Orientations") :]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    head = [c.strip().strip("`") for c in rows[0].strip("|").split("|")]
    out = {}
    for row in rows[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        m = re.fullmatch(r"`(\w+)`", cells[0])
        if not m:
            break
        out[m.group(1)] = {k: yaml.safe_load(v.strip("`")) for k, v in zip(head[1:], cells[1:], strict=False)
                           if k in KNOBS}  # fmt: skip
    return out


def test_each_orientation_resolves_to_the_documented_knobs_and_keys_set_win(tmp_path):
    documented = documented_presets()
    assert list(documented) == list(ORIENTATIONS) == ["throughput", "latency", "stability", "cost"]
    for name, knobs in documented.items():
        assert set(knobs) == set(KNOBS) == set(ORIENTATIONS[name]), name
        front = load(tmp_path, TWO + f"  orientation: {name}\n").front
        got = {k: getattr(front, k) for k in knobs}
        got["switch"] = got["switch"] or False
        assert got == knobs, (name, got, knobs)
        assert front.orientation == name
    # A key the file sets wins over its orientation's.
    front = load(
        tmp_path, TWO + "  orientation: stability\n  queue_size: 5\n  switch: {online: [offline]}\n"
    ).front
    assert (front.policy, front.queue_size, front.switch) == ("least_kv", 5, {"online": ["offline"]})
    front = load(tmp_path, TWO + "  orientation: latency\n  switch: false\n  policy: round_robin\n").front
    assert (front.switch, front.policy, front.poll_interval_s) == (None, "round_robin", 0.1)


def test_the_launcher_passes_an_orientations_knobs_to_omni(tmp_path):
    from test_cluster import LaunchedCluster

    path = tmp_path / "c.yaml"
    path.write_text(TWO + "  orientation: latency\n  queue_size: 7\n")
    cluster = LaunchedCluster(path)
    try:
        assert cluster.ready["policy"] == "least_queue"
        view = get_json(cluster.ready["front"] + "/omni/workers")
        assert view["settings"] == {"policy": "least_queue", "poll_interval_s": 0.1, "queue_size": 7,
                                    "max_in_flight_per_worker": None, "in_flight_fraction": 0.75,
                                    "switch_after_waiting": 0}  # fmt: skip
        # the window: 3/4 of each twin's max_running_requests (the default 256 here... as /server_info says)
        limits = [w["limit"] for w in view["workers"]]
        assert limits == [int(w["max_running_requests"] * 0.75) for w in view["workers"]], limits
        assert view["switch"] == {
            "online": {"to": ["offline"], "after_waiting": 0, "switched": {"offline": 0}},
            "offline": {"to": ["online"], "after_waiting": 0, "switched": {"online": 0}},
        }
    finally:
        cluster.kill()
