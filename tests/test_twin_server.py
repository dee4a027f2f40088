"""The twin (the simulated SGLang server), as a real subprocess spoken to over real HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import http.client
import itertools
import random
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import orjson
import pytest

from loadlab.cli import main as loadlab_main
from loadlab.cli import sim_parser
from loadlab.sim.engine import Engine, EngineConfig, prefill_pass_s
from loadlab.sim.radix import RadixCache
from loadlab.sim.settings import check_embedded_settings, settings_to_argv
from loadlab.testing.servers import TWIN, ServerProcess

REPO = Path(__file__).resolve().parents[1]
READY_URL = re.compile(r"^http://127\.0\.0\.1:(\d+)$")  # after the ready line's "loadlab-sim listening on "


# --------------------------------------------------------------------------------------------------------
# Process and HTTP helpers
# --------------------------------------------------------------------------------------------------------
class Twin(ServerProcess):
    """``loadlab sim --port 0 --log-level warning ARGS...``, started, with HTTP helpers."""

    def __init__(self, *args: str):
        super().__init__([*TWIN, "--port", "0", "--log-level", "warning", *args], start_timeout_s=20.0)
        self.start()
        assert READY_URL.match(self.url), self.url  # the ready line names the loopback address and port

    def stop(self) -> int:
        """SIGTERM; the exit code."""
        super().stop()
        return self.proc.returncode

    def request(self, method: str, path: str, body=None, headers=None) -> tuple[int, dict, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            data = body if isinstance(body, bytes | type(None)) else orjson.dumps(body)
            conn.request(
                method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})}
            )
            r = conn.getresponse()
            return r.status, dict(r.getheaders()), r.read()
        finally:
            conn.close()

    def get_json(self, path: str) -> dict:
        status, _, body = self.request("GET", path)
        assert status == 200, body
        return orjson.loads(body)

    def post_json(self, path: str, body) -> tuple[int, dict]:
        status, _, raw = self.request("POST", path, body)
        return status, orjson.loads(raw)

    def events(self, path: str, body: dict) -> list:
        """A streamed request's events in order: parsed JSON objects and the final '[DONE]'."""
        status, headers, raw = self.request("POST", path, body)
        assert status == 200, raw
        assert headers["Content-Type"].startswith("text/event-stream")
        assert raw.endswith(b"data: [DONE]\n\n")
        out = []
        for block in raw.decode("utf-8").split("\n\n"):
            if block:
                assert block.startswith("data: "), block
                payload = block[6:]
                out.append(payload if payload == "[DONE]" else orjson.loads(payload))
        return out

    def metric(self, name: str) -> float:
        status, _, raw = self.request("GET", "/metrics")
        assert status == 200
        total = 0.0
        for line in raw.decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total


@pytest.fixture(scope="module")
def twin():
    s = Twin("--enable-metrics", "--enable-cache-report")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def small():
    s = Twin(
        "--max-running-requests", "2", "--max-queued-requests", "1", "--stream-interval", "4",
        "--context-length", "4096", "--disable-radix-cache", "--served-model-name", "tiny",
    )  # fmt: skip
    yield s
    assert s.stop() == 0


_rng = random.Random(20261129)


def rand_ids(n: int) -> list[int]:
    return [_rng.randrange(1000, 129000) for _ in range(n)]


def rand_words(n: int) -> str:
    return " ".join(f"w{_rng.randrange(10**9)}" for _ in range(n))


def native(ids: list[int], max_new: int, stream: bool = True, **extra) -> dict:
    sp = {"max_new_tokens": max_new, "ignore_eos": True}
    return {"input_ids": ids, "sampling_params": sp, "stream": stream, **extra}


async def timed_stream(session: aiohttp.ClientSession, url: str, body: dict):
    """(send time, [(receipt time, event)]) with perf_counter times; the event is parsed JSON or '[DONE]'."""
    t_send = time.perf_counter()
    events = []
    async with session.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            t = time.perf_counter()
            if line.startswith(b"data: "):
                payload = line[6:].strip()
                events.append((t, "[DONE]" if payload == b"[DONE]" else orjson.loads(payload)))
    return t_send, events


def mean_gap(events) -> float:
    times = [t for t, e in events if e != "[DONE]"]
    return (times[-1] - times[0]) / (len(times) - 1)


# --------------------------------------------------------------------------------------------------------
# Endpoints other than generation
# --------------------------------------------------------------------------------------------------------
def test_health_models_and_info(twin, small):
    for path in ("/health", "/health_generate", "/ready"):
        assert twin.request("GET", path)[0] == 200
    models = twin.get_json("/v1/models")
    assert models["object"] == "list"
    assert models["data"][0]["id"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert models["data"][0]["owned_by"] == "sglang"
    assert models["data"][0]["max_model_len"] == 131072
    for path in ("/model_info", "/get_model_info"):
        info = twin.get_json(path)
        assert info["model_path"] == "meta-llama/Llama-3.1-8B-Instruct"
        assert info["served_model_name"] == "meta-llama/Llama-3.1-8B-Instruct"
        assert info["tokenizer_path"] == "meta-llama/Llama-3.1-8B-Instruct"
        assert info["is_generation"] is True
    assert small.get_json("/model_info")["served_model_name"] == "tiny"
    for path in ("/server_info", "/get_server_info"):
        info = twin.get_json(path)
        assert info["loadlab_sim"] is True
        assert info["version"].startswith("loadlab-sim ")
        assert info["max_running_requests"] == 2048  # SGLang's rule for 440k tokens at 131072 context
        assert info["chunked_prefill_size"] == 8192
        assert info["max_prefill_tokens"] == 16384
        assert info["schedule_policy"] == "fcfs"
        assert info["max_total_num_tokens"] == 440_000
        assert info["max_req_input_len"] == 131071
        assert info["enable_metrics"] is True and info["enable_cache_report"] is True
        assert info["port"] == twin.port
        state = info["internal_states"][0]
        assert "last_gen_throughput" in state
        assert state["memory_usage"]["token_capacity"] == 440_000
    info = small.get_json("/server_info")
    assert info["max_running_requests"] == 2
    assert info["max_queued_requests"] == 1
    assert info["stream_interval"] == 4
    assert info["context_length"] == 4096
    assert info["max_req_input_len"] == 4095
    assert info["disable_radix_cache"] is True


def test_metrics_names_and_counts(twin, small):
    status, headers, raw = twin.request("GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    text = raw.decode()
    for name in ("num_running_reqs", "num_queue_reqs", "token_usage", "num_used_tokens", "max_total_num_tokens",
                 "gen_throughput", "cache_hit_rate"):  # fmt: skip
        assert f"# TYPE sglang:{name} gauge" in text
    for name in (
        "prompt_tokens",
        "generation_tokens",
        "num_requests",
        "cached_tokens",
        "num_aborted_requests",
    ):
        assert re.search(rf"^# TYPE sglang:{name}(_total)? counter$", text, re.M)
        assert f"sglang:{name}_total{{" in text
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "queue_time_seconds"):  # fmt: skip
        assert f"# TYPE sglang:{name} histogram" in text
    assert 'model_name="meta-llama/Llama-3.1-8B-Instruct"' in text
    assert twin.metric("sglang:max_total_num_tokens") == 440_000

    before = {n: twin.metric(f"sglang:{n}") for n in ("generation_tokens_total", "prompt_tokens_total",
                                                       "num_requests_total")}  # fmt: skip
    ttft_before = twin.metric("sglang:time_to_first_token_seconds_count")
    itl_before = twin.metric("sglang:inter_token_latency_seconds_count")
    twin.events("/generate", native(rand_ids(37), 10))
    assert twin.metric("sglang:generation_tokens_total") - before["generation_tokens_total"] == 10
    assert twin.metric("sglang:prompt_tokens_total") - before["prompt_tokens_total"] == 37
    assert twin.metric("sglang:num_requests_total") - before["num_requests_total"] == 1
    assert twin.metric("sglang:time_to_first_token_seconds_count") - ttft_before == 1
    assert twin.metric("sglang:inter_token_latency_seconds_count") - itl_before == 9
    assert twin.metric("sglang:num_running_reqs") == 0
    assert small.request("GET", "/metrics")[0] == 404  # metrics are off there


# --------------------------------------------------------------------------------------------------------
# Native /generate
# --------------------------------------------------------------------------------------------------------
def test_generate_stream_shape(twin):
    events = twin.events(
        "/generate",
        {"text": "hello world and more", "sampling_params": {"max_new_tokens": 20, "ignore_eos": True},
         "stream": True, "rid": "my-rid-1"},
    )  # fmt: skip
    assert events[-1] == "[DONE]"
    events = events[:-1]
    assert [e["meta_info"]["completion_tokens"] for e in events] == list(range(1, 21))
    prev = ""
    for e in events:
        meta = e["meta_info"]
        assert meta["id"] == "my-rid-1"
        assert meta["prompt_tokens"] == 4
        assert meta["num_retractions"] == 0
        assert meta["cached_tokens"] >= 0
        assert len(e["output_ids"]) == meta["completion_tokens"]
        assert e["text"].startswith(prev) and len(e["text"]) > len(prev)  # cumulative text
        assert len(e["text"].split()) == meta["completion_tokens"]  # one word per token
        prev = e["text"]
        for key in ("queue_time", "forward_entry_time", "prefill_finished_time"):  # --enable-metrics
            assert isinstance(meta[key], float)
    for e in events[:-1]:
        assert e["meta_info"]["finish_reason"] is None
        assert "e2e_latency" not in e["meta_info"]
    last = events[-1]["meta_info"]
    assert last["finish_reason"] == {"type": "length", "length": 20}
    assert 0 < last["e2e_latency"] < 5
    for key in ("request_received_ts", "first_token_latency", "request_finished_ts", "decode_throughput"):
        assert key in last
    assert abs(last["request_received_ts"] - time.time()) < 60
    assert any(ord(c) > 127 for c in events[-1]["text"])  # multi-byte UTF-8 in the output


def test_generate_non_stream_and_ids(twin):
    status, obj = twin.post_json("/generate", native(rand_ids(50), 12, stream=False))
    assert status == 200
    meta = obj["meta_info"]
    assert re.fullmatch(r"[0-9a-f]{32}", meta["id"])
    assert meta["completion_tokens"] == 12 and len(obj["output_ids"]) == 12
    assert meta["prompt_tokens"] == 50
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert len(obj["text"].split()) == 12
    # Default max_new_tokens is 128; ignore_eos false also runs to the limit (the twin never emits EOS).
    status, obj = twin.post_json("/generate", {"input_ids": rand_ids(5)})
    assert status == 200 and obj["meta_info"]["completion_tokens"] == 128


def test_stream_interval_coalesces_tokens(twin, small):
    events = small.events("/generate", native(rand_ids(20), 17))[:-1]
    counts = [e["meta_info"]["completion_tokens"] for e in events]
    assert counts == [1, 5, 9, 13, 17]  # first token at once, then 4 at a time
    assert [len(e["output_ids"]) for e in events] == counts
    assert [len(e["text"].split()) for e in events] == counts
    # Per request, sampling_params.stream_interval overrides the server's.
    body = native(rand_ids(20), 7)
    body["sampling_params"]["stream_interval"] = 3
    events = twin.events("/generate", body)[:-1]
    assert [e["meta_info"]["completion_tokens"] for e in events] == [1, 4, 7]
    # OpenAI deltas carry several words per chunk too.
    chunks = small.events("/v1/completions", {"prompt": "a b c", "max_tokens": 9, "stream": True})[:-1]
    assert [len(c["choices"][0]["text"].split()) for c in chunks] == [1, 4, 4]


def test_a_slow_reader_gets_coalesced_events_and_loses_nothing():
    """Events are pushed to the socket as tokens are made; once a reader is 64 KiB behind (beyond what the
    kernel buffers: up to 4 MiB here), the stream waits for it instead, and tokens made meanwhile arrive
    together (cumulative native text, so nothing is lost)."""
    fast = Twin("--gpu", "h200")  # ~4.6 ms per token: ~800 tokens make the 4 MiB the kernel holds
    try:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", fast.port))
        conn = http.client.HTTPConnection("127.0.0.1", fast.port, timeout=30)
        conn.sock = sock
        conn.request("POST", "/generate", body=orjson.dumps(native(rand_ids(30), 1200)),
                     headers={"Content-Type": "application/json"})  # fmt: skip
        time.sleep(4.5)  # nothing is read meanwhile
        raw = conn.getresponse().read()
        conn.close()
    finally:
        fast.stop()
    events = [orjson.loads(b[6:]) for b in raw.split(b"\n\n") if b.startswith(b"data: {")]
    counts = [e["meta_info"]["completion_tokens"] for e in events]
    assert counts[-1] == 1200 and counts == sorted(set(counts))
    assert len(events) < 1200  # some tokens were coalesced ...
    assert max(b - a for a, b in itertools.pairwise(counts)) > 1
    for a, b in itertools.pairwise(events):  # ... and none lost: each text extends the one before
        assert b["text"].startswith(a["text"])
    assert len(events[-1]["text"].split()) == 1200 == len(events[-1]["output_ids"])


# --------------------------------------------------------------------------------------------------------
# OpenAI-compatible APIs
# --------------------------------------------------------------------------------------------------------
def test_completions_stream_shape(twin):
    events = twin.events(
        "/v1/completions",
        {"model": "whatever", "prompt": "one two three four five", "max_tokens": 10, "stream": True,
         "ignore_eos": True, "stream_options": {"include_usage": True}},
    )  # fmt: skip
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    assert len(chunks) == 10
    ids = {c["id"] for c in events[:-1]}
    assert len(ids) == 1 and ids.pop().startswith("cmpl-")
    for i, c in enumerate(chunks):
        assert c["object"] == "text_completion"
        assert c["model"] == "whatever"
        assert isinstance(c["created"], int)
        assert c["usage"] is None
        (choice,) = c["choices"]
        assert choice["index"] == 0 and choice["logprobs"] is None
        assert len(choice["text"].split()) == 1  # incremental deltas
        assert choice["finish_reason"] == (None if i < 9 else "length")
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["prompt_tokens"] == 5
    assert usage_chunk["usage"]["completion_tokens"] == 10
    assert usage_chunk["usage"]["total_tokens"] == 15
    assert usage_chunk["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # --enable-cache-report

    # continuous_usage_stats: cumulative usage on every chunk; no include_usage -> no usage chunk.
    events = twin.events(
        "/v1/completions",
        {
            "prompt": [11, 12, 13],
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"continuous_usage_stats": True},
        },
    )
    assert [e["usage"]["completion_tokens"] for e in events[:-1]] == [1, 2, 3, 4]
    assert all(e["choices"] for e in events[:-1])

    # Non-streaming, default max_tokens 16, model defaults to the served name.
    status, obj = twin.post_json("/v1/completions", {"prompt": "x y"})
    assert status == 200
    assert obj["object"] == "text_completion"
    assert obj["model"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert obj["usage"]["completion_tokens"] == 16
    assert obj["choices"][0]["finish_reason"] == "length"
    assert len(obj["choices"][0]["text"].split()) == 16


def test_chat_stream_shape(twin):
    messages = [{"role": "system", "content": "you are a b c"}, {"role": "user", "content": "hi there"}]
    events = twin.events(
        "/v1/chat/completions",
        {
            "model": "m",
            "messages": messages,
            "max_tokens": 6,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert events[-1] == "[DONE]"
    role, contents, finish, usage = events[0], events[1:7], events[7], events[8]
    assert len(events) == 10
    for c in events[:-1]:
        assert (
            c["object"] == "chat.completion.chunk" and c["id"].startswith("chatcmpl-") and c["model"] == "m"
        )
    assert role["choices"][0]["delta"]["role"] == "assistant"
    assert role["choices"][0]["delta"]["content"] == ""
    for c in contents:
        (choice,) = c["choices"]
        assert choice["finish_reason"] is None
        assert choice["delta"]["role"] is None
        assert len(choice["delta"]["content"].split()) == 1
    assert finish["choices"][0]["finish_reason"] == "length"
    assert finish["choices"][0]["delta"]["content"] is None
    assert usage["choices"] == []
    # 5 + 2 content words, 4 template tokens per message, 4 per conversation.
    assert usage["usage"] == {"prompt_tokens": 19, "total_tokens": 25, "completion_tokens": 6,
                              "prompt_tokens_details": {"cached_tokens": usage["usage"]["prompt_tokens_details"]
                                                        ["cached_tokens"]}, "reasoning_tokens": 0}  # fmt: skip
    # Without include_usage: no usage chunk, usage null everywhere.
    events = twin.events("/v1/chat/completions", {"messages": messages, "max_tokens": 3, "stream": True})
    assert len(events) == 1 + 3 + 1 + 1
    assert all(e["usage"] is None for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    # Non-streaming.
    status, obj = twin.post_json("/v1/chat/completions", {"messages": messages, "max_tokens": 5})
    assert status == 200 and obj["object"] == "chat.completion"
    assert obj["choices"][0]["message"]["role"] == "assistant"
    assert len(obj["choices"][0]["message"]["content"].split()) == 5
    assert obj["usage"]["completion_tokens"] == 5


async def _first_two_chat_chunks(url: str):
    async with aiohttp.ClientSession() as s:
        body = {"messages": [{"role": "user", "content": "q"}], "max_tokens": 2, "stream": True}
        _, events = await timed_stream(s, url + "/v1/chat/completions", body)
    return events


def test_chat_role_chunk_comes_with_first_token(twin):
    events = asyncio.run(_first_two_chat_chunks(twin.url))
    (t_role, role), (t_first, first) = events[0], events[1]
    assert role["choices"][0]["delta"]["role"] == "assistant"
    assert first["choices"][0]["delta"]["content"]
    assert t_first - t_role < 0.004  # one write, not one decode step apart


# --------------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------------
def test_error_formats(twin, small):
    status, _, raw = twin.request("POST", "/generate", b"{not json")
    assert status == 400 and "message" in orjson.loads(raw)["error"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        status, _, raw = twin.request("POST", path, b"{not json")
        err = orjson.loads(raw)
        assert status == 400
        assert err["object"] == "error" and err["type"] == "BadRequestError" and err["code"] == 400
    status, err = twin.post_json("/v1/completions", {"prompt": "a", "max_tokens": 0})
    assert status == 400 and err["message"] == "max_tokens must be positive"
    status, err = twin.post_json("/v1/completions", {"prompt": ""})
    assert status == 400 and err["type"] == "BadRequestError"
    status, err = twin.post_json("/v1/chat/completions", {"max_tokens": 3})
    assert status == 400 and err["type"] == "BadRequestError"
    status, err = twin.post_json("/generate", {"sampling_params": {"max_new_tokens": 3}})
    assert status == 400 and "input_ids" in err["error"]["message"]

    # Too long for the 4096-token context: streaming /generate reports it after the 200 headers.
    events = small.events("/generate", native(rand_ids(5000), 8))
    assert len(events) == 2 and events[1] == "[DONE]"
    error = events[0]["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    assert "context length" in error["message"]
    events = small.events("/generate", native(rand_ids(4000), 200))
    assert "maximum context length" in events[0]["error"]["message"]
    status, err = small.post_json("/generate", native(rand_ids(5000), 8, stream=False))
    assert status == 400 and "context length" in err["error"]["message"]
    status, err = small.post_json(
        "/v1/completions", {"prompt": rand_ids(5000), "max_tokens": 4, "stream": True}
    )
    assert status == 400 and err["object"] == "error" and err["code"] == 400
    assert "context length" in err["message"]


# --------------------------------------------------------------------------------------------------------
# What a router needs of a worker: its load, its name on every response, bodies a router re-serialised
# --------------------------------------------------------------------------------------------------------
def test_every_response_names_its_worker_and_echoes_the_request_id(twin, small):
    stream = {"stream": True, "max_tokens": 3, "ignore_eos": True}
    exchanges = [
        *(("GET", path, None) for path in (
            "/health", "/health_generate", "/ready", "/get_load", "/server_info", "/get_server_info",
            "/model_info", "/get_model_info", "/v1/models", "/metrics", "/flush_cache", "/no/such/path")),
        ("POST", "/flush_cache", None),
        ("PUT", "/generate", None),  # 405 from aiohttp itself
        ("POST", "/generate", native(rand_ids(20), 3)),
        ("POST", "/generate", native(rand_ids(20), 3, stream=False)),
        ("POST", "/generate", native(rand_ids(200_000), 3)),  # too long: an in-stream error after a 200
        ("POST", "/generate", b"{not json"),
        ("POST", "/v1/completions", {"prompt": "a b c", **stream}),
        ("POST", "/v1/completions", {"prompt": "a b c", "max_tokens": 0}),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}], **stream}),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}], "stream": False}),
        ("POST", "/v1/chat/completions", {"messages": []}),
    ]  # fmt: skip
    statuses = set()
    for server in (twin, small):
        for n, (method, path, body) in enumerate(exchanges):
            status, headers, _ = server.request(method, path, body, headers={"X-Request-ID": f"rq-{n}"})
            statuses.add(status)
            assert headers.get("x-loadlab-worker") == server.url, (method, path, status, headers)
            assert headers.get("x-request-id") == f"rq-{n}", (method, path, status, headers)
            status, headers, _ = server.request(method, path, body)  # no request id: none comes back
            assert headers.get("x-loadlab-worker") == server.url and "x-request-id" not in headers
    assert {200, 400, 404, 405} <= statuses  # small has no /metrics: 404 there


def test_the_worker_id_setting_names_the_worker():
    s = Twin("--worker-id", "district-a/worker-7")
    try:
        status, headers, _ = s.request("POST", "/generate", native(rand_ids(8), 2))
        assert status == 200 and headers["x-loadlab-worker"] == "district-a/worker-7"
        assert s.get_json("/server_info")["worker_id"] == "district-a/worker-7"
    finally:
        assert s.stop() == 0
    # Without the setting, /server_info shows the resolved default: the base URL.
    s = Twin()
    try:
        assert s.get_json("/server_info")["worker_id"] == s.url
    finally:
        assert s.stop() == 0
    assert check_embedded_settings({"worker_id": "w\r\nx: y"}).startswith(
        "worker_id: expected printable ASCII"
    )
    assert check_embedded_settings({"worker_id": "w-1"}) is None
    assert settings_to_argv({"worker_id": "w-1"}) == ["--worker-id", "w-1"]


def test_bodies_a_router_re_serialised_are_read_like_the_clients(twin):
    """sglang-router parses and re-serialises bodies: absent fields as null or defaults, the client's
    max_tokens as max_completion_tokens (chat), stream_options reduced to include_usage."""
    events = twin.events("/generate", {
        "model": None, "text": None, "input_ids": rand_ids(12), "rid": None, "stream": True,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True, "n": None,
                            "stop": None, "stream_interval": None, "min_new_tokens": None},
        "return_text_in_logprobs": False, "log_metrics": True, "return_hidden_states": False,
        "background": False, "no_logs": False, "return_bytes": False, "return_entropy": False,
        "return_logprob": None, "priority": None, "lora_path": None, "custom_labels": None,
    })  # fmt: skip
    assert events[-2]["meta_info"]["completion_tokens"] == 4
    for path, body in (
        ("/v1/completions", {"prompt": "a b c d", "max_completion_tokens": 5, "max_tokens": None}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a b c d", "name": None}],
                                  "max_completion_tokens": 5, "max_tokens": None, "logprobs": False,
                                  "continue_final_message": False, "separate_reasoning": True}),
    ):  # fmt: skip
        common = {"model": None, "stream": True, "n": None, "temperature": 0.0, "stop": None,
                  "stream_options": {"include_usage": True, "continuous_usage_stats": None},
                  "ignore_eos": True, "echo": False, "no_stop_trim": False, "skip_special_tokens": True,
                  "return_hidden_states": False, "rid": None, "user": None}  # fmt: skip
        events = twin.events(path, {**common, **body})
        usage = events[-2]["usage"]
        assert events[-2]["choices"] == [] and usage["completion_tokens"] == 5, (path, events)
        assert events[0]["model"] == "meta-llama/Llama-3.1-8B-Instruct"  # a null model: the served name


async def _queue_scenario(url: str):
    async with aiohttp.ClientSession() as s:
        # Like SGLang, the queue limit counts requests not yet scheduled, so space the arrivals out.
        a = asyncio.create_task(timed_stream(s, url + "/generate", native(rand_ids(16), 48)))
        await asyncio.sleep(0.05)
        b = asyncio.create_task(timed_stream(s, url + "/generate", native(rand_ids(16), 48)))
        await asyncio.sleep(0.1)  # both admitted: the two running slots are taken
        c = asyncio.create_task(timed_stream(s, url + "/generate", native(rand_ids(16), 8)))
        await asyncio.sleep(0.1)  # c waits in the queue, which holds one request
        async with s.get(url + "/server_info") as r:
            state = (await r.json())["internal_states"][0]
        async with s.get(url + "/get_load") as r:
            load = await r.json()
        refused = []
        for path, body in (
            ("/generate", native(rand_ids(16), 8)),
            ("/v1/completions", {"prompt": "a b", "max_tokens": 4, "stream": True}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}], "max_tokens": 4}),
        ):
            async with s.post(url + path, json=body) as r:
                refused.append((r.status, await r.json()))
        return state, load, refused, await a, await b, await c


def test_queue_full_and_running_limit(small):
    state, load, refused, a, b, c = asyncio.run(_queue_scenario(small.url))
    assert state["num_running_reqs"] == 2 and state["num_queue_reqs"] == 1
    # /get_load, as SGLang: a list with one entry per DP rank; two running + one waiting; the KV tokens of
    # the two running (no cache: their prompts and the tokens decoded so far) + the waiting one's prompt.
    assert [sorted(entry) for entry in load] == [["dp_rank", "num_reqs", "num_tokens", "num_waiting_reqs"]]
    assert load[0]["dp_rank"] == 0 and load[0]["num_reqs"] == 3 and load[0]["num_waiting_reqs"] == 1
    assert 3 * 16 + 2 <= load[0]["num_tokens"] <= 3 * 16 + 2 * 48
    for status, body in refused:
        assert status == 503
        assert body == {"object": "error", "message": "The request queue is full.",
                        "type": "ServiceUnavailableError", "param": None, "code": 503}  # fmt: skip
    a_end = a[1][-1][0]
    b_end = b[1][-1][0]
    c_send, c_events = c
    c_first = c_events[0][0]
    assert c_events[-2][1]["meta_info"]["completion_tokens"] == 8
    # The third request only starts when a running one finishes (~48 decode steps after they began).
    assert c_first > min(a_end, b_end) - 0.005
    assert c_first - min(a_end, b_end) < 0.1
    assert c_first - c_send > 0.25


# --------------------------------------------------------------------------------------------------------
# Prefix cache
# --------------------------------------------------------------------------------------------------------
def test_prefix_cache_hits_and_misses(twin, small):
    system = rand_words(1500)
    first = twin.post_json(
        "/generate", {"text": system + " first question here", "sampling_params": {"max_new_tokens": 2}}
    )
    second = twin.post_json(
        "/generate", {"text": system + " another one", "sampling_params": {"max_new_tokens": 2}}
    )
    assert first[1]["meta_info"]["cached_tokens"] == 0
    meta = second[1]["meta_info"]
    assert meta["prompt_tokens"] == 1502
    assert meta["cached_tokens"] == 1500
    # Unrelated prompts share nothing.
    for _ in range(3):
        status, obj = twin.post_json("/generate", native(rand_ids(1000), 2, stream=False))
        assert obj["meta_info"]["cached_tokens"] <= 1
    # A fully repeated prompt: all but the last token come from the cache.
    ids = rand_ids(300)
    twin.post_json("/generate", native(ids, 2, stream=False))
    assert twin.post_json("/generate", native(ids, 2, stream=False))[1]["meta_info"]["cached_tokens"] == 299
    # Chat: a shared system message is cached across users; cache-report shows it in usage.
    sys_msg = {"role": "system", "content": rand_words(800)}
    for q in ("what is up", "tell me more please"):
        status, obj = twin.post_json(
            "/v1/chat/completions", {"messages": [sys_msg, {"role": "user", "content": q}], "max_tokens": 2}
        )
    assert obj["usage"]["prompt_tokens_details"]["cached_tokens"] >= 800
    # A follow-up chat turn that repeats the reply hits the cache for the whole history but the last token.
    turn = [{"role": "user", "content": rand_words(30)}]
    first = twin.post_json("/v1/chat/completions", {"messages": turn, "max_tokens": 10})[1]
    turn += [first["choices"][0]["message"], {"role": "user", "content": "and then"}]
    turn[1] = {"role": "assistant", "content": turn[1]["content"]}
    second = twin.post_json("/v1/chat/completions", {"messages": turn, "max_tokens": 10})[1]
    # SGLang caches prompt + output minus the last output token (its KV was never computed).
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == first["usage"]["total_tokens"] - 1
    # With --disable-radix-cache nothing is cached.
    ids = rand_ids(300)
    small.post_json("/generate", native(ids, 2, stream=False))
    assert small.post_json("/generate", native(ids, 2, stream=False))[1]["meta_info"]["cached_tokens"] == 0


@pytest.mark.alone
def test_cached_prefix_skips_prefill_time(twin):
    prefix = rand_ids(4000)
    cold = twin.post_json("/generate", native(prefix + rand_ids(20), 1, stream=False))[1]["meta_info"]
    warm = twin.post_json("/generate", native(prefix + rand_ids(20), 1, stream=False))[1]["meta_info"]
    assert warm["cached_tokens"] == 4000
    assert cold["first_token_latency"] > 0.25  # ~4k tokens at ~13k tokens/s
    assert warm["first_token_latency"] < cold["first_token_latency"] / 5


def test_flush_cache(twin):
    ids = rand_ids(200)
    twin.post_json("/generate", native(ids, 2, stream=False))
    status, _, body = twin.request("POST", "/flush_cache")
    assert status == 200 and body.startswith(b"Cache flushed")
    assert twin.post_json("/generate", native(ids, 2, stream=False))[1]["meta_info"]["cached_tokens"] == 0
    assert twin.request("GET", "/flush_cache")[0] == 200

    async def flush_while_busy():
        async with aiohttp.ClientSession() as s:
            task = asyncio.create_task(timed_stream(s, twin.url + "/generate", native(rand_ids(10), 30)))
            await asyncio.sleep(0.1)
            async with s.post(twin.url + "/flush_cache") as r:
                status = r.status
            await task
            return status

    assert asyncio.run(flush_while_busy()) == 400


# --------------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------------
async def _timing(url: str):
    async with aiohttp.ClientSession() as s:
        gen = url + "/generate"
        t_send, cold = await timed_stream(s, gen, native(rand_ids(1024), 64))
        ttft = cold[0][0] - t_send
        single_gap = mean_gap(cold)
        prefix = rand_ids(2000)
        await timed_stream(s, gen, native(prefix + rand_ids(8), 2))  # warm the shared prefix
        _, one = await timed_stream(s, gen, native(prefix + rand_ids(48), 48))
        many = await asyncio.gather(
            *[timed_stream(s, gen, native(prefix + rand_ids(48), 48)) for _ in range(16)]
        )
        return ttft, single_gap, mean_gap(one), sorted(mean_gap(ev) for _, ev in many)


@pytest.mark.alone
def test_timing_single_and_batched(twin):
    ttft, gap_1024, gap_one, gaps_16 = asyncio.run(_timing(twin.url))
    assert 0.060 < ttft < 0.110  # twin.md: a 1024-token prompt on an idle A100 ~80 ms
    assert 0.010 < gap_1024 < 0.013  # ~10.9 ms per decode step at batch 1
    assert 0.010 < gap_one < 0.013
    median_16 = gaps_16[len(gaps_16) // 2]
    assert median_16 > gap_one + 0.0015  # batch 16 x ~2k context: ~14 ms per step
    assert median_16 < 0.020


async def _disconnect(url: str):
    seen = 0
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + "/generate", json=native(rand_ids(64), 2000)) as r,
    ):
        async for line in r.content:
            if line.startswith(b"data: {"):
                seen += 1
                if seen == 3:
                    break  # leave the block with the body unread: the connection is closed
    return seen


def test_client_disconnect_aborts_request(twin):
    aborted = twin.metric("sglang:num_aborted_requests_total")
    assert asyncio.run(_disconnect(twin.url)) == 3
    deadline = time.time() + 3
    while time.time() < deadline:
        if twin.metric("sglang:num_running_reqs") == 0 and twin.metric("sglang:num_used_tokens") == 0:
            break
        time.sleep(0.05)
    assert twin.metric("sglang:num_running_reqs") == 0
    assert twin.metric("sglang:num_used_tokens") == 0  # its KV freed
    assert twin.metric("sglang:num_aborted_requests_total") == aborted + 1


# --------------------------------------------------------------------------------------------------------
# Command line and embedded settings
# --------------------------------------------------------------------------------------------------------
def test_bad_flags_exit_2_without_traceback():
    for bad in (["--max-running-requests", "abc"], ["--no-such-flag"], ["--schedule-policy", "random"]):
        r = subprocess.run([sys.executable, "-m", "loadlab", "sim", *bad], capture_output=True, text=True,
                           cwd=REPO, timeout=30)  # fmt: skip
        assert r.returncode == 2
        assert "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("loadlab sim: error: ")
        assert r.stdout == ""
    assert loadlab_main(["sim", "--max-running-requests", "0"]) == 2


def test_sigterm_exits_cleanly():
    s = Twin()
    assert s.request("GET", "/health")[0] == 200
    assert s.stop() == 0


def test_check_embedded_settings_and_argv():
    assert check_embedded_settings({}) is None
    good = {"max_running_requests": 64, "enable_metrics": True, "disable_radix_cache": False,
            "mem_fraction_static": 0.85, "schedule_policy": "lpm", "chunked_prefill_size": -1}  # fmt: skip
    assert check_embedded_settings(good) is None
    assert check_embedded_settings({"foo_bar": 1}) == "unknown setting 'foo_bar'"
    assert check_embedded_settings({"max_running_requests": "abc"}) == (
        "max_running_requests: expected an integer, got 'abc'"
    )
    assert check_embedded_settings({"max_running_requests": 0}).startswith(
        "max_running_requests: must be at least 1"
    )
    assert check_embedded_settings({"max_running_requests": True}).startswith(
        "max_running_requests: expected an"
    )
    assert (
        check_embedded_settings({"enable_metrics": "yes"})
        == "enable_metrics: expected true or false, got 'yes'"
    )
    assert check_embedded_settings({"schedule_policy": "random"}).startswith(
        "schedule_policy: expected one of"
    )
    assert check_embedded_settings({"mem_fraction_static": 1.5}).startswith("mem_fraction_static:")
    assert "max_running_requests" in check_embedded_settings({"max-running-requests": 4})
    assert check_embedded_settings({"port": 30001}).startswith("port:")
    assert check_embedded_settings({"tokenizer": "/no/such/tokenizer.json"}).startswith(
        "tokenizer: no such file"
    )

    argv = settings_to_argv(good)
    assert argv == ["--max-running-requests", "64", "--enable-metrics", "--mem-fraction-static", "0.85",
                    "--schedule-policy", "lpm", "--chunked-prefill-size", "-1"]  # fmt: skip
    args = sim_parser().parse_args(argv)
    assert args.max_running_requests == 64 and args.enable_metrics and not args.disable_radix_cache
    assert args.chunked_prefill_size == -1 and args.mem_fraction_static == 0.85
    with pytest.raises(ValueError):
        settings_to_argv({"foo_bar": 1})


# --------------------------------------------------------------------------------------------------------
# The engine alone (pure Python on the event loop clock; no HTTP)
# --------------------------------------------------------------------------------------------------------
def test_radix_cache_match_insert_lock_evict():
    c = RadixCache()
    assert c.insert([1, 2, 3, 4], now=1.0)[1] == 4
    node, matched = c.match_prefix([1, 2, 9], now=2.0)  # splits [1, 2] | [3, 4]
    assert matched == 2
    assert c.insert([1, 2, 9, 9], now=3.0)[1] == 2
    assert c.size == 6 and c.evictable_size == 6
    c.lock(node)
    assert c.protected_size == 2 and c.evictable_size == 4
    assert c.evict(100) == 4  # both unlocked leaves go; the locked [1, 2] stays
    assert c.peek_prefix_len([1, 2, 3]) == 2
    c.unlock(node)
    assert c.evict(1) == 2 and c.size == 0
    # LRU: the least recently matched leaf is evicted first.
    c.insert([10, 11], now=1.0)
    c.insert([20, 21], now=2.0)
    c.match_prefix([10, 11], now=3.0)
    assert c.evict(2) == 2
    assert c.peek_prefix_len([10, 11]) == 2 and c.peek_prefix_len([20, 21]) == 0


async def _drain(h):
    steps = []
    async for step in h:
        steps.append((asyncio.get_running_loop().time(), step))
    return steps


async def _kv_limit():
    e = Engine(EngineConfig(max_total_tokens=900))
    await e.start()
    try:
        a = e.submit(list(range(5000, 5600)), 20)
        await asyncio.sleep(0.02)
        b = e.submit(list(range(7000, 7300)), 20)  # needs 320 tokens; only 280 are free while a runs
        await asyncio.gather(_drain(a), _drain(b))
        return a, b, e.stats()
    finally:
        await e.stop()


def test_engine_admission_waits_for_kv_room():
    a, b, stats = asyncio.run(_kv_limit())
    assert b.forward_entry_time >= a.finished_time
    assert b.completion_tokens == 20
    assert stats["evicted_tokens_total"] >= 20  # a's cached prompt + output made room for b
    assert stats["num_used_tokens"] == 0 and stats["num_running_reqs"] == 0


async def _chunked_prefill():
    e = Engine(EngineConfig(chunked_prefill_size=512))
    await e.start()
    try:
        runner = e.submit(list(range(100, 110)), 60)
        run_task = asyncio.create_task(_drain(runner))
        await asyncio.sleep(0.1)
        passes = e.forward_passes
        long = e.submit(list(range(20000, 21200)), 1)
        await _drain(long)
        passes = e.forward_passes - passes
        steps = await run_task
        return long, passes, steps
    finally:
        await e.stop()


def test_engine_chunked_prefill_stalls_decode():
    long, passes, steps = asyncio.run(_chunked_prefill())
    chunks = [(512, 0), (512, 512), (176, 1024)]
    expected = sum(prefill_pass_s([c]) for c in chunks)
    ttft = long.first_token_time - long.forward_entry_time
    assert expected - 0.006 < ttft < expected + 0.015
    assert passes >= 3
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(steps)]
    # The running request's stream pauses for the three prefill passes (prefill first, no mixed batches).
    assert max(gaps) > expected
    assert sorted(gaps)[len(gaps) // 2] < 0.013


async def _lpm():
    e = Engine(EngineConfig(max_running_requests=1, schedule_policy="lpm"))
    await e.start()
    try:
        shared = list(range(30000, 30400))
        await _drain(e.submit(shared + [1], 1))  # puts the shared prefix in the cache
        blocker = e.submit([5, 6, 7], 5)
        await asyncio.sleep(0.005)
        plain = e.submit(list(range(40000, 40400)), 1)
        cached = e.submit(shared + [2], 1)
        await asyncio.gather(_drain(blocker), _drain(plain), _drain(cached))
        return plain, cached
    finally:
        await e.stop()


def test_engine_lpm_prefers_cached_prefix():
    plain, cached = asyncio.run(_lpm())
    assert cached.cached_tokens == 400
    assert cached.forward_entry_time < plain.forward_entry_time  # arrived later, scheduled first


def test_tokenizer_file(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, ",": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    s = Twin("--tokenizer", str(path))
    try:
        status, obj = s.post_json(
            "/generate", {"text": "hello,world hello", "sampling_params": {"max_new_tokens": 2}}
        )
        assert status == 200 and obj["meta_info"]["prompt_tokens"] == 4  # hello , world hello
        assert s.get_json("/model_info")["tokenizer_path"] == str(path)
    finally:
        assert s.stop() == 0


def test_every_setting_of_the_table_is_a_field_of_twin_settings():
    import dataclasses

    from loadlab.sim.settings import SETTINGS, TwinSettings, resolve_settings

    fields = {f.name for f in dataclasses.fields(TwinSettings)}
    assert {s.name for s in SETTINGS} <= fields
    resolved = resolve_settings({"max_running_requests": 7, "enable_metrics": True})
    assert resolved.max_running_requests == 7 and resolved.enable_metrics and resolved.port == 30000
    # The argv round trip: a mapping -> flags -> the parser -> the same resolved settings.
    argv = settings_to_argv({"max_running_requests": 7, "enable_metrics": True})
    assert resolve_settings(sim_parser().parse_args(argv)) == resolved
