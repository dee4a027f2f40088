"""omni over real processes on 127.0.0.1: twins (``loadlab sim``) or the scripted server as workers, omni
(``python -m loadlab.cluster.omni``) in front, this process as the client. Each policy routes as
docs/cluster.md "The omni front" defines it; streams pass through byte for byte and on time; the bounded
queue answers 429, no healthy worker 503; a killed worker is left out after the next poll; omni's own
/metrics count what was sent."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import statistics
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import Counter

import aiohttp
import pytest
from conftest import TIMING_REPORT
from prometheus_client.parser import text_string_to_metric_families

from loadlab.cluster.omni_process import OMNI, READY_PREFIX, OmniProcess, omni_argv
from loadlab.procs import free_port
from loadlab.testing.servers import start_scripted, start_twin, started_twins

POLL_S = 0.2


# -- helpers ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def twins():
    """Three twins with metrics: A runs at most 2 requests at once (more wait in its queue), C has a small
    KV pool (60k tokens), B is the default."""
    flags = (("--max-running-requests", "2"), (), ("--max-total-tokens", "60000"))
    with started_twins(*[("--enable-metrics", *f) for f in flags]) as started:
        yield started


@pytest.fixture
def omni():
    """Starts omni processes: ``omni(workers, policy, ...)`` -> its URL; all are stopped at the end."""
    procs: list[OmniProcess] = []

    def start(workers, policy="round_robin", queue_size=100, k=None, *extra, poll_s=POLL_S) -> str:
        p = OmniProcess(omni_argv([w.url if hasattr(w, "url") else w for w in workers], policy, poll_s,
                                  queue_size, k, extra=extra))  # fmt: skip
        procs.append(p)
        return p.start()

    yield start
    for p in procs:
        p.stop()


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def routed(omni_url: str) -> list[int]:
    return [w["routed"] for w in get_json(omni_url + "/omni/workers")["workers"]]


def scrape(url: str) -> dict[tuple, float]:
    """A Prometheus page as {(sample name, sorted labels...): value}."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, *sorted(s.labels.items()))] = s.value
    return out


def twin_gauge(twin, name: str) -> float:
    return sum(v for k, v in scrape(twin.url).items() if k[0] == f"sglang:{name}")


def wait_for(check, timeout_s: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def native(text: str, max_new: int = 8, stream: bool = True, **extra) -> dict:
    return {"text": text, "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True},
            "stream": stream, **extra}  # fmt: skip


async def post(session, url: str, body: dict | bytes, path: str = "/generate", headers=None):
    """(status, headers, body bytes) of one request."""
    kw = {"data": body} if isinstance(body, bytes) else {"json": body}
    async with session.post(url + path, headers=headers, **kw) as r:
        return r.status, r.headers, await r.read()


def run_requests(url: str, bodies: list[tuple[str, dict]], concurrency: int) -> list[tuple]:
    """Sends (path, body) pairs with at most ``concurrency`` at once; their (status, headers, body)."""

    async def main():
        sem = asyncio.Semaphore(concurrency)
        async with aiohttp.ClientSession() as s:

            async def one(path, body):
                async with sem:
                    return await post(s, url, body, path)

            return await asyncio.gather(*(one(p, b) for p, b in bodies))

    return asyncio.run(main())


class Background:
    """Long requests sent straight to a worker (not through omni) from a thread, until ``stop()``."""

    def __init__(self, url: str, bodies: list[dict]):
        self.loop = asyncio.new_event_loop()
        self.tasks: list[asyncio.Task] = []
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.session = asyncio.run_coroutine_threadsafe(self._session(), self.loop).result()
        for b in bodies:
            asyncio.run_coroutine_threadsafe(post(self.session, url, b), self.loop)

    async def _session(self):
        return aiohttp.ClientSession()

    def stop(self):
        async def close():
            for t in asyncio.all_tasks():
                if t is not asyncio.current_task():
                    t.cancel()
            await self.session.close()

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def wait_idle(twin):
    wait_for(lambda: twin_gauge(twin, "num_running_reqs") + twin_gauge(twin, "num_queue_reqs") == 0,
             what=f"{twin.url} idle")  # fmt: skip


# -- policies ---------------------------------------------------------------------------------------------
def test_round_robin_alternates_and_metrics_count_what_was_sent(twins, omni):
    url = omni(twins, "round_robin")
    before = [twin_gauge(t, "num_requests_total") for t in twins]
    apis = [
        ("/generate", native("one two three")),
        ("/v1/completions", {"prompt": "one two", "max_tokens": 5, "stream": True, "ignore_eos": True}),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 5,
                "stream": True,
                "ignore_eos": True,
            },
        ),  # fmt: skip
        ("/generate", native("four five", stream=False)),
    ]
    order = []
    for i in range(12):
        path, body = apis[i % len(apis)]
        was = routed(url)
        ((status, _, _),) = run_requests(url, [(path, body)], 1)
        assert status == 200
        now = routed(url)
        order.append([j for j in range(3) if now[j] != was[j]])
    assert order == [[0], [1], [2]] * 4
    m = scrape(url)
    assert m[("omni_requests_total", ("endpoint", "/generate"))] == 6
    assert m[("omni_requests_total", ("endpoint", "/v1/completions"))] == 3
    assert m[("omni_requests_total", ("endpoint", "/v1/chat/completions"))] == 3
    for i, t in enumerate(twins):
        assert m[("omni_requests_routed_total", ("worker", t.url))] == 4
        assert m[("omni_worker_responses_total", ("code", "200"), ("worker", t.url))] == 4
        assert m[("omni_requests_in_flight", ("worker", t.url))] == 0
        assert m[("omni_worker_up", ("worker", t.url))] == 1
        # The workers' own counts agree with omni's.
        assert twin_gauge(t, "num_requests_total") - before[i] == 4
    assert m[("omni_queue_length", ("slo_class", "default"))] == 0
    assert sum(v for k, v in m.items() if k[0] == "omni_rejects_total") == 0
    # The per-worker limit defaults to each worker's max_running_requests.
    assert [w["limit"] for w in get_json(url + "/omni/workers")["workers"]] == [2, 2048, 2048]


@pytest.mark.parametrize("policy", ["least_queue", "power_of_two"])
def test_load_aware_policies_avoid_a_worker_made_busy(twins, omni, policy):
    a = twins[0]
    url = omni(twins, policy)
    # 6 long requests straight to A (not through omni): 2 run, 4 wait in A's queue.
    busy = Background(a.url, [native(f"long {i} words", max_new=600) for i in range(6)])
    try:
        wait_for(lambda: twin_gauge(a, "num_queue_reqs") == 4, what="A's queue")
        wait_for(lambda: get_json(url + "/omni/workers")["workers"][0]["signals"]["waiting"] == 4,
                 what="omni's poll of A")  # fmt: skip
        bodies = [("/generate", native(f"short {i}", max_new=8)) for i in range(16)]
        results = run_requests(url, bodies, concurrency=4)
        assert all(s == 200 for s, _, _ in results)
        counts = routed(url)
        assert counts[0] == 0, counts
        assert counts[1] > 0 and counts[2] > 0, counts
    finally:
        busy.stop()
    wait_idle(a)


def test_least_kv_avoids_the_worker_with_the_fullest_kv_pool(twins, omni):
    c = twins[2]
    url = omni(twins, "least_kv")
    # 3 long prompts straight to C (KV pool 60k tokens): about half its pool in use.
    busy = Background(c.url, [{"input_ids": [1000 + i] * 8000, "sampling_params": {"max_new_tokens": 600,
                               "ignore_eos": True}, "stream": True} for i in range(3)])  # fmt: skip
    try:
        wait_for(lambda: twin_gauge(c, "token_usage") > 0.3, what="C's KV usage")
        wait_for(lambda: (get_json(url + "/omni/workers")["workers"][2]["signals"]["token_usage"] or 0) > 0.3,
                 what="omni's poll of C")  # fmt: skip
        bodies = [("/generate", native(f"short {i}", max_new=8)) for i in range(12)]
        assert all(s == 200 for s, _, _ in run_requests(url, bodies, concurrency=2))
        counts = routed(url)
        assert counts[2] == 0, counts
        assert counts[0] > 0 and counts[1] > 0, counts
    finally:
        busy.stop()
    wait_idle(c)


def test_prefix_sends_a_prefix_to_one_worker_and_falls_back_when_it_is_far_busier(twins, omni):
    url = omni(twins, "prefix", 100, 100, "--prefix-len", "40", "--prefix-balance-abs", "2")
    owners: dict[int, set[int]] = {}
    for g in range(10):
        for q in range(3):
            text = f"group{g:02d} shared system prompt of the group, then ... question {q} of group {g}"
            was = routed(url)
            ((status, _, _),) = run_requests(url, [("/generate", native(text))], 1)
            assert status == 200
            now = routed(url)
            owners.setdefault(g, set()).update(j for j in range(3) if now[j] != was[j])
    assert all(len(ws) == 1 for ws in owners.values()), owners
    assert len(set.union(*owners.values())) >= 2, owners  # different prefixes spread
    # 12 concurrent requests of one group: the owner takes them until it is more than 2 requests (and 1.5x)
    # busier than the least busy worker, then least_queue spreads the rest.
    (owner,) = owners[0]
    was = routed(url)
    text = "group00 shared system prompt of the group, then ... another question"
    results = run_requests(url, [("/generate", native(text, max_new=100))] * 12, concurrency=12)
    assert all(s == 200 for s, _, _ in results)
    got = [n - w for n, w in zip(routed(url), was, strict=True)]
    assert got[owner] == max(got) and got[owner] < 12, got
    assert all(n > 0 for n in got), got


# -- the queue and omni's own answers --------------------------------------------------------------------
def test_bounded_queue_answers_429_beyond_its_size(twins, omni):
    b, c = twins[1], twins[2]
    url = omni([b, c], "round_robin", 2, 1)  # queue 2, one request in flight per worker

    async def timed(session, i):
        t0 = time.monotonic()
        async with session.post(url + "/generate", json=native(f"q {i}", max_new=50)) as r:
            first = await r.content.readline()
            ttft = time.monotonic() - t0
            return r.status, r.headers, first + await r.read(), ttft

    async def main():
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(*(timed(s, i) for i in range(6)))

    results = asyncio.run(main())
    codes = Counter(r[0] for r in results)
    assert codes == {200: 4, 429: 2}, codes
    for status, headers, body, _ in results:
        if status == 429:
            assert headers["x-loadlab-front"] == "omni"
            err = json.loads(body)
            assert err["reason"] == "queue_full" and err["waiting"] == 2 and err["code"] == 429
            assert "queue is full (2 waiting" in err["message"]
        else:
            assert "x-loadlab-front" not in headers  # the worker's own response
    # Two ran at once; the two queued started only when those ended (~50 tokens later).
    ttfts = sorted(r[3] for r in results if r[0] == 200)
    assert ttfts[2] > ttfts[1] + 0.3, ttfts
    m = scrape(url)
    assert m[("omni_rejects_total", ("reason", "queue_full"))] == 2
    assert m[("omni_queue_wait_seconds_count", ("slo_class", "default"))] == 2
    assert sum(m[("omni_requests_routed_total", ("worker", t.url))] for t in (b, c)) == 4


def test_clients_that_go_away_free_their_place_in_the_queue_and_at_the_worker(twins, omni):
    b = twins[1]
    url = omni([b], "round_robin", 5, 1)

    async def main():
        async with aiohttp.ClientSession() as s:
            tasks = [asyncio.create_task(post(s, url, native(f"leave {i}", max_new=500))) for i in range(3)]
            state = await asyncio.to_thread(
                wait_for, lambda: get_json(url + "/omni/workers")["queues"]["default"] == 2, 10, "2 queued"
            )
            assert state
            assert get_json(url + "/omni/workers")["workers"][0]["in_flight"] == 1
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())
    wait_for(lambda: get_json(url + "/omni/workers")["queues"]["default"] == 0, 10, "the queue emptied")
    wait_for(lambda: get_json(url + "/omni/workers")["workers"][0]["in_flight"] == 0, 10, "nothing in flight")
    wait_idle(b)  # the worker's connection was closed, so the twin aborted the stream
    ((status, _, _),) = run_requests(url, [("/generate", native("after"))], 1)
    assert status == 200


def test_no_healthy_worker_is_503(omni):
    dead = f"http://127.0.0.1:{free_port()}"
    url = omni([dead], "least_queue")

    async def main():
        async with aiohttp.ClientSession() as s:
            gen = await post(s, url, native("x"))
            async with s.get(url + "/health") as r:
                health = (r.status, r.headers, await r.read())
            async with s.get(url + "/v1/models") as r:
                models = (r.status, r.headers, await r.read())
            return gen, health, models

    gen, health, models = asyncio.run(main())
    for status, headers, _ in (gen, health, models):
        assert status == 503 and headers["x-loadlab-front"] == "omni"
    err = json.loads(gen[2])
    assert err["reason"] == "no_healthy_worker" and dead in err["message"]
    assert json.loads(health[2])["workers_up"] == 0
    assert scrape(url)[("omni_worker_up", ("worker", dead))] == 0


def test_a_killed_worker_gets_no_requests_after_the_next_poll_and_returns_when_polls_succeed(omni):
    port = free_port()
    twins = [start_twin("--enable-metrics"), start_twin("--enable-metrics"),
             start_twin("--enable-metrics", "--port", str(port))]  # fmt: skip
    try:
        url = omni(twins, "round_robin")
        victim = twins[2]
        outcomes: list[tuple[float, str]] = []  # (start time, "ok" or an error)
        stop = threading.Event()

        def load():
            async def user(s):
                while not stop.is_set():
                    t0 = time.monotonic()
                    try:
                        status, _, body = await post(s, url, native("keep going", max_new=20))
                        ok = status == 200 and body.rstrip().endswith(b"data: [DONE]")
                        outcomes.append((t0, "ok" if ok else f"HTTP {status}"))
                    except aiohttp.ClientError as e:
                        outcomes.append((t0, type(e).__name__))

            async def main():
                async with aiohttp.ClientSession() as s:
                    await asyncio.gather(*(user(s) for _ in range(3)))

            asyncio.run(main())

        runner = threading.Thread(target=load)
        runner.start()
        time.sleep(1.0)
        victim.proc.kill()  # SIGKILL: a crashed worker
        victim.proc.wait()
        t_kill = time.monotonic()
        wait_for(lambda: not get_json(url + "/omni/workers")["workers"][2]["up"], 5, "the victim marked down")
        after_poll = routed(url)[2]
        time.sleep(1.5)
        assert routed(url)[2] == after_poll  # nothing more for the dead worker
        late = [o for t, o in outcomes if t > t_kill + 2 * POLL_S]
        assert len(late) >= 5 and all(o == "ok" for o in late), Counter(late)
        early_failures = [o for t, o in outcomes if t <= t_kill + 2 * POLL_S and o != "ok"]
        assert len(early_failures) <= 3, early_failures  # at most those in flight at the victim
        state = get_json(url + "/omni/workers")["workers"][2]
        assert not state["up"] and "poll failed" in state["down_reason"]
        assert scrape(url)[("omni_worker_up", ("worker", victim.url))] == 0
        # The worker comes back on its port: the next successful poll puts it back in the rotation.
        twins[2] = start_twin("--enable-metrics", "--port", str(port))
        wait_for(lambda: get_json(url + "/omni/workers")["workers"][2]["up"], 10, "the worker back up")
        wait_for(lambda: routed(url)[2] > after_poll, 5, "requests for the returned worker")
        stop.set()
        runner.join(30)
        assert all(o == "ok" for t, o in outcomes if t > t_kill + 2 * POLL_S)
    finally:
        stop.set()
        for t in twins:
            t.stop()


# -- what passes through ----------------------------------------------------------------------------------
VARYING = re.compile(rb'("id":"[^"]*"|"e2e_latency":[-0-9.e]+|"created":[0-9]+)')


def _normalized(body: bytes) -> bytes:
    return VARYING.sub(lambda m: m.group(0).split(b":", 1)[0] + b":X", body)


def test_streams_are_byte_identical_to_direct(tmp_path, omni):
    server = start_scripted(tmp_path / "scripted.jsonl", ttft_ms=20, gap_ms=5)
    try:
        cases = "normal+crlf+comments+split+multi4"
        worker = server.case_url(cases)
        url = omni([worker])
        requests = [
            ("/generate", native("a b c", max_new=12)),
            ("/generate", native("a b c", max_new=6, stream=False)),
            (
                "/v1/completions",
                {"prompt": "a b", "max_tokens": 9, "stream": True, "stream_options": {"include_usage": True}},
            ),  # fmt: skip
            (
                "/v1/chat/completions",
                {
                    "messages": [{"role": "user", "content": "a"}],
                    "max_tokens": 7,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            ),  # fmt: skip
        ]
        for path, body in requests:
            # Cases take turns per request on the same case path: 5 through omni, then the same 5 direct.
            via = run_requests(url, [(path, body)] * 5, 1)
            direct = run_requests(worker, [(path, body)] * 5, 1)
            for (s1, h1, b1), (s2, h2, b2) in zip(via, direct, strict=True):
                assert s1 == s2 == 200
                assert h1["Content-Type"] == h2["Content-Type"]
                assert "x-loadlab-front" not in h1
                assert _normalized(b1) == _normalized(b2)
                assert b1.count(b"\r\n") == b2.count(b"\r\n")
        # A worker's own error passes through as it is (no x-loadlab-front: it is not omni's).
        url_503 = omni([server.case_url("http_503")])
        ((s1, h1, b1),) = run_requests(url_503, [("/generate", native("a"))], 1)
        ((s2, _, b2),) = run_requests(server.case_url("http_503"), [("/generate", native("a"))], 1)
        assert s1 == s2 == 503 and b1 == b2 and "x-loadlab-front" not in h1
        # A worker that drops a stream: the client sees it dropped through omni too.
        url_drop = omni([server.case_url("drop")])
        with pytest.raises(aiohttp.ClientPayloadError):
            run_requests(url_drop, [("/generate", native("a"))], 1)
    finally:
        server.stop()


@pytest.mark.alone
@pytest.mark.flaky(reruns=1, reruns_delay=2)  # wall-clock timing on a shared machine
def test_events_are_not_delayed(tmp_path, omni):
    """Per event, the client's receipt time minus the scripted server's write time, through omni and
    direct: omni adds well under a millisecond (figures in the assertion message)."""
    server = start_scripted(tmp_path / "scripted.jsonl", ttft_ms=50, gap_ms=10)
    try:
        url = omni([server.url], poll_s=0.5)

        async def stream(s, base, rid):
            arrivals = []
            async with s.post(base + "/generate", json=native("a b", max_new=40, rid=rid)) as r:
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        arrivals.append(time.time())
            return rid, arrivals

        def delays(base, tag) -> list[float]:
            async def main():
                async with aiohttp.ClientSession() as s:
                    return await asyncio.gather(*(stream(s, base, f"{tag}-{i}") for i in range(8)))

            out = asyncio.run(main())
            time.sleep(0.1)
            log = {e["rid"]: e for e in server.log_entries().values()}
            d = []
            for rid, arrivals in out:
                writes = log[rid]["write_wall"]
                assert len(writes) == len(arrivals) == 40
                d += [(a - w) * 1000 for a, w in zip(arrivals, writes, strict=True)]
            return sorted(d)

        direct, via = delays(server.url, "direct"), delays(url, "omni")
        p90 = lambda d: d[int(0.9 * len(d))]  # noqa: E731
        note = (f"direct median {statistics.median(direct):.3f} P90 {p90(direct):.3f} ms; through omni "
                f"median {statistics.median(via):.3f} P90 {p90(via):.3f} max {via[-1]:.3f} ms")  # fmt: skip
        TIMING_REPORT.append(f"omni pass-through, per event (8 streams x 40 events): {note}")
        assert statistics.median(via) < statistics.median(direct) + 2.0, note
        assert p90(via) < p90(direct) + 5.0, note
    finally:
        server.stop()


class _EchoWorker:
    """A plain aiohttp worker in a thread: /generate answers with the headers and body it received, and
    response headers of its own (hop-by-hop ones among them); /server_info says max_running_requests 3."""

    def __init__(self):
        from aiohttp import web

        async def generate(request):
            body = await request.read()
            echo = {"headers": dict(request.headers), "body": body.decode()}
            resp = web.json_response(echo)
            resp.headers["X-Loadlab-Worker"] = "echo-1"
            resp.headers["Keep-Alive"] = "timeout=5"
            resp.headers["X-Hop"] = "dropped"
            resp.headers["Connection"] = "keep-alive, X-Hop"
            resp.headers.add("Set-Cookie", "a=1")
            resp.headers.add("Set-Cookie", "b=2")
            return resp

        async def info(request):
            return web.json_response({"max_running_requests": 3, "model_path": "echo"})

        app = web.Application()
        app.router.add_post("/generate", generate)
        app.router.add_get("/server_info", info)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_headers_and_body_pass_as_the_real_router_passes_them(omni):
    echo = _EchoWorker()
    try:
        url = omni([echo.url], "least_queue")
        raw = b'{"text":  "spaced   as sent",\n "stream": false}'
        sent = {"Authorization": "Bearer t", "X-Request-Id": "r1", "X-Request-Id-Extra": "r2",
                "traceparent": "00-abc-def-01", "X-Other": "no", "Cookie": "c=1",
                "Content-Type": "application/json"}  # fmt: skip

        async def main():
            async with aiohttp.ClientSession() as s:
                return await post(s, url, raw, headers=sent)

        status, headers, body = asyncio.run(main())
        assert status == 200
        echo_out = json.loads(body)
        assert echo_out["body"].encode() == raw  # the body bytes unchanged
        got = {k.lower(): v for k, v in echo_out["headers"].items()}
        for k in ("authorization", "x-request-id", "x-request-id-extra", "traceparent", "content-type"):
            assert got[k] == sent[{h.lower(): h for h in sent}[k]]
        assert "x-other" not in got and "cookie" not in got
        assert headers["X-Loadlab-Worker"] == "echo-1"  # the worker's own header reaches the client
        assert headers.getall("Set-Cookie") == ["a=1", "b=2"]
        assert "Keep-Alive" not in headers and "X-Hop" not in headers  # hop-by-hop removed
        assert "x-loadlab-front" not in headers
        # The worker's /get_load and /metrics are 404: no load signal, but the worker is up, and its
        # limit comes from /server_info.
        (w,) = get_json(url + "/omni/workers")["workers"]
        assert w["up"] and w["limit"] == 3 and w["signals"]["source"] == "none"
    finally:
        echo.stop()


def test_info_endpoints_come_from_a_worker_and_flush_cache_fans_out(twins, omni):
    url = omni(twins[1:])
    direct = get_json(twins[1].url + "/model_info")
    assert get_json(url + "/model_info") == direct
    assert (
        get_json(url + "/v1/models")["data"][0]["id"]
        == get_json(twins[1].url + "/v1/models")["data"][0]["id"]
    )
    assert get_json(url + "/server_info")["max_running_requests"] == 2048
    req = urllib.request.Request(url + "/flush_cache", method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
        assert r.status == 200 and r.headers["x-loadlab-front"] == "omni"
    assert all(t.url in text for t in twins[1:]) and text.count("Cache flushed") == 2
    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        assert r.status == 200 and json.loads(r.read())["workers_up"] == 2
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(url + "/nope", timeout=10)
    assert e.value.code == 404 and e.value.headers["x-loadlab-front"] == "omni"


# -- the process ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--policy", "nope", "http://127.0.0.1:1"], "invalid choice"),
        ([], "the following arguments are required"),
        (["ftp://x"], "expected a worker URL"),
        (["--queue-size", "-1", "http://127.0.0.1:1"], "expected an integer >= 0"),
        (["--port", "70000", "http://127.0.0.1:1"], "expected a port"),
        (["--poll-interval-s", "0", "http://127.0.0.1:1"], "expected a positive number"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(flags, message):
    p = subprocess.run([*OMNI, *flags], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and message in p.stderr, p.stderr
    assert p.stdout == ""


def test_ready_line_real_port_and_sigterm_exits_0(twins):
    p = subprocess.Popen(omni_argv([twins[1].url]), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line.startswith(READY_PREFIX)
        port = int(line.strip().rsplit(":", 1)[1])
        assert port > 0
        assert get_json(f"http://127.0.0.1:{port}/health")["workers_up"] == 1
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=15)
        assert p.returncode == 0, err
        assert out == ""  # exactly one line on stdout
    finally:
        if p.poll() is None:
            p.kill()
