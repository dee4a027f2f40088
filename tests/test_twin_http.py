"""The twin over real HTTP on 127.0.0.1: calibration points on the wall clock, presets, retractions on the
wire and in /metrics, and agreement with the same requests in virtual time."""

from __future__ import annotations

import asyncio
import statistics
import time

import aiohttp
import orjson
import pytest

from loadlab.profile import validate_profile
from loadlab.sim.cost import CostModel, attention_pairs
from loadlab.target.embedded import EmbeddedServer
from loadlab.virtual import simulate
from loadlab.workload import build_workload


@pytest.fixture
def server(request):
    s = EmbeddedServer(request.param)
    s.start()
    yield s
    s.stop()


def body(ids: list[int], max_new: int) -> dict:
    return {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True},
        "stream": True,
    }


def unique(i: int, n: int) -> list[int]:
    return [100_000 + i] + [(i * 7919 + k) % 90_000 + 2000 for k in range(n - 1)]


async def stream(session, url: str, payload: dict):
    """(send time, [(receipt time, event)]) with perf_counter times."""
    t_send = time.perf_counter()
    events = []
    async with session.post(url + "/generate", json=payload) as r:
        assert r.status == 200
        async for line in r.content:
            if line.startswith(b"data: {"):
                events.append((time.perf_counter(), orjson.loads(line[6:])))
    return t_send, events


def mean_gap(events) -> float:
    return (events[-1][0] - events[0][0]) / (len(events) - 1)


async def _gather(url: str, payloads: list[dict]):
    async with aiohttp.ClientSession() as s:
        return await asyncio.gather(*[stream(s, url, p) for p in payloads])


@pytest.mark.alone
@pytest.mark.parametrize("server", [{"enable_metrics": True}], indirect=True)
def test_a100_batch_of_8_and_single_stream_over_http(server):
    ((t_send, events),) = asyncio.run(_gather(server.url, [body(unique(0, 1024), 64)]))
    assert (events[0][0] - t_send) * 1000 == pytest.approx(80, rel=0.25)  # + HTTP overhead
    assert 10.0 <= mean_gap(events) * 1000 <= 12.5
    many = asyncio.run(_gather(server.url, [body(unique(i, 32), 128) for i in range(1, 9)]))
    gaps = [mean_gap(ev) * 1000 for _, ev in many]
    assert statistics.median(gaps) == pytest.approx(12.3, rel=0.15)
    # The server's own timing: every event written is in the lateness histogram, most within a few ms.
    timing = orjson.loads(_get(server.url, "/server_info"))["loadlab_sim_timing"]
    written = len(events) + sum(len(ev) for _, ev in many)
    assert timing["event_lateness_ms"]["count"] == written
    assert timing["pass_end_lateness_ms"]["count"] >= 64 + 128  # at least one pass per token
    assert timing["event_lateness_ms"]["p50"] < 5.0 and timing["pass_end_lateness_ms"]["p50"] < 5.0


@pytest.mark.alone
@pytest.mark.parametrize("server", [{"gpu": "h100-80gb", "enable_metrics": True}], indirect=True)
def test_h100_preset_over_http(server):
    info = orjson.loads(_get(server.url, "/server_info"))
    assert info["gpu"] == "h100-80gb" and info["model"] == "llama-3.1-8b" and info["tp_size"] == 1
    assert info["max_total_num_tokens"] == CostModel("h100-80gb").kv_tokens()
    ((t_send, events),) = asyncio.run(_gather(server.url, [body(unique(0, 1024), 64)]))
    assert mean_gap(events) * 1000 < 7.4  # SGLang CI: > 135 tok/s single stream
    expected = CostModel("h100-80gb").prefill_s(1024, attention_pairs(1024, 0))
    assert events[0][0] - t_send == pytest.approx(expected, abs=0.01)


@pytest.mark.parametrize(
    "server", [{"gpu": "a100-80gb", "model": "llama-3.1-70b", "tp_size": 8}], indirect=True
)
def test_70b_preset_reports_itself(server):
    info = orjson.loads(_get(server.url, "/server_info"))
    assert info["model_path"] == "meta-llama/Llama-3.1-70B-Instruct" and info["tp_size"] == 8
    assert info["max_total_num_tokens"] == CostModel("a100-80gb", "llama-3.1-70b", 8).kv_tokens()
    models = orjson.loads(_get(server.url, "/v1/models"))
    assert models["data"][0]["id"] == "meta-llama/Llama-3.1-70B-Instruct"


def _get(url: str, path: str) -> bytes:
    import urllib.request

    with urllib.request.urlopen(url + path, timeout=10) as r:
        return r.read()


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


async def _staggered(url: str, n: int):
    async with aiohttp.ClientSession() as s:
        tasks = []
        for i in range(n):
            tasks.append(asyncio.create_task(stream(s, url, body(unique(i, 200), 300))))
            await asyncio.sleep(0.03)
        return await asyncio.gather(*tasks)


@pytest.mark.parametrize("server", [{"max_total_tokens": 4000, "enable_metrics": True}], indirect=True)
def test_retractions_on_the_wire_and_in_metrics(server):
    results = asyncio.run(_staggered(server.url, 12))
    finals = [ev[-1][1]["meta_info"] for _, ev in results]
    assert all(m["completion_tokens"] == 300 and m["finish_reason"]["type"] == "length" for m in finals)
    retracted = [m["num_retractions"] for m in finals]
    assert sum(retracted) >= 1
    # The stream of a retracted request pauses (re-queued, re-prefilled) and then goes on.
    longest = [max(b[0] - a[0] for a, b in zip(ev, ev[1:], strict=False)) for _, ev in results]
    assert max(longest) > 0.1
    text = _get(server.url, "/metrics").decode()
    assert "# TYPE sglang:num_retracted_reqs gauge" in text
    assert "# TYPE sglang:new_token_ratio gauge" in text
    assert _metric(text, "sglang:num_retracted_requests_total") == sum(retracted)
    assert 0 < _metric(text, "sglang:new_token_ratio") <= 1
    info = orjson.loads(_get(server.url, "/server_info"))
    assert info["internal_states"][0]["num_retractions_total"] == sum(retracted)


@pytest.mark.parametrize("server", [{"max_running_requests": 4}], indirect=True)
@pytest.mark.alone
def test_http_and_virtual_time_agree(server):
    """The same 16 requests, 4 in flight: over HTTP on the wall clock and in virtual time."""
    p = validate_profile({
        "name": "agree", "workload": {"kind": "random_prefix", "input_len": 600, "output_len": 48},
        "load": {"model": "closed", "concurrency": 4}, "requests": {"warmup": 0, "measured": 16},
    })  # fmt: skip
    virtual = simulate(p, {"max_running_requests": 4})
    wl = build_workload(p)

    async def closed_loop():
        queue = list(range(16))
        out = {}
        async with aiohttp.ClientSession() as s:

            async def user():
                while queue:
                    i = queue.pop(0)
                    spec = wl.spec(i)
                    out[i] = await stream(s, server.url, body(list(spec.input_ids), spec.max_new_tokens))

            await asyncio.gather(*[user() for _ in range(4)])
        return out

    real = asyncio.run(closed_loop())
    real_tpot = statistics.mean(mean_gap(ev) for _, ev in real.values())
    virt_tpot = statistics.mean(
        (r.arrival_ms[-1] - r.arrival_ms[0]) / 1000 / (len(r.arrival_ms) - 1) for r in virtual.records
    )
    assert real_tpot == pytest.approx(virt_tpot, rel=0.1)
    real_ttft = statistics.median(ev[0][0] - t for t, ev in real.values())
    virt_ttft = statistics.median(r.ttft_ms for r in virtual.records) / 1000
    assert real_ttft == pytest.approx(virt_ttft, rel=0.25)
