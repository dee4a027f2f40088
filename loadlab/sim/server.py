"""The HTTP side of the simulated SGLang server: SGLang's wire protocol on aiohttp.

Endpoints and field names follow shared/design/sglang-wire.md (SGLang 0.5): native ``/generate``, the
OpenAI-compatible ``/v1/completions`` and ``/v1/chat/completions``, health, info, ``/get_load``,
``/flush_cache`` and Prometheus ``/metrics`` (``sglang:*`` names): everything a router (sglang-router)
calls on a worker. Every response, errors and streams included, carries ``x-loadlab-worker`` (the worker's
id) and echoes the request's ``x-request-id``. Bodies a router re-serialised (absent fields as nulls,
``max_completion_tokens`` for ``max_tokens``) are read like the client's own. Generation is delegated to
``loadlab.sim.engine.Engine`` through ``submit`` / the handle's async iterator / ``abort`` / ``stats`` /
``load`` only.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web

from loadlab.sim import REQUEST_ID_HEADER, SIM_VERSION, WORKER_HEADER
from loadlab.sim.auth import UNAUTHORIZED, authorized, needs_key
from loadlab.sim.engine import (
    Engine,
    RequestHandle,
    RequestTooLargeError,
    Step,
    UnavailableError,
)
from loadlab.sim.settings import TwinSettings, base_url
from loadlab.sim.tokenize import OUTPUT_IDS, OUTPUT_TEXTS, Tokenizer, output_start

SLOW_READER_BYTES = 64 * 1024  # unsent bytes at which a stream stops pushing and waits for its reader
NATIVE_DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # SGLang's (and OpenAI's) default
# Chat has no default length in SGLang (the model stops at EOS); the sim never emits EOS, so it uses this.
CHAT_DEFAULT_MAX_TOKENS = 128
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
DONE_EVENT = b"data: [DONE]\n\n"
JSON_CT = "application/json"
_NO_WAKE = 1 << 62  # stream interval for non-streaming requests: wake at the first token and the end


class BadRequest(Exception):
    """A request the server rejects; the message is the client-facing text."""


_dumps = orjson.dumps


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type=JSON_CT)


def _native_error(message: str, status: int = 400) -> web.Response:
    return _json({"error": {"message": message}}, status)


def _openai_error(message: str, status: int = 400, err_type: str = "BadRequestError") -> web.Response:
    return _json(
        {"object": "error", "message": message, "type": err_type, "param": None, "code": status}, status
    )


def _unavailable(message: str) -> web.Response:
    """SGLang's 503 for a request its scheduler refused or dropped (queue full, priority refused)."""
    return _openai_error(message, 503, "ServiceUnavailableError")


def _dropped(step: Step) -> web.Response | None:
    """A non-streamed request the scheduler aborted with an HTTP status (a higher-priority request took
    its place in a full queue) gets that status, as SGLang raises it; None for any other ending."""
    fr = step.finish_reason
    if fr is not None and fr.get("type") == "abort" and fr.get("status_code"):
        return _unavailable(str(fr.get("message", "")))
    return None


async def _read_json(request: web.Request) -> dict:
    raw = await request.read()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"Invalid JSON in the request body: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    return body


def _int_field(value: Any, name: str, default: int, minimum: int) -> int:
    if value is None:
        return default
    if type(value) is not int:
        raise BadRequest(f"{name} must be an integer, got {value!r}.")
    if value < minimum:
        if name == "max_tokens":
            raise BadRequest("max_tokens must be positive")
        raise BadRequest(f"{name} must be at least {minimum}, got {value}.")
    return value


def _priority_field(value: Any) -> int | None:
    """SGLang's request field ``priority`` (an integer; null or absent: none)."""
    if value is not None and type(value) is not int:
        raise BadRequest(f"priority must be an integer, got {value!r}.")
    return value


def _bool_field(value: Any, name: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false, got {value!r}.")
    return value


def _check_ids(ids: Any) -> list[int]:
    if not isinstance(ids, list):
        raise BadRequest("input_ids must be a list of integers.")
    if ids and isinstance(ids[0], list):
        if len(ids) != 1:
            raise BadRequest(
                "Batch requests (several prompts in one request) are not supported by loadlab-sim."
            )
        ids = ids[0]
    for i in ids:
        if type(i) is not int or i < 0:
            raise BadRequest("input_ids must be a list of non-negative integers.")
    return ids


async def _run_to_end(h: RequestHandle) -> Step:
    """Waits for a request's last step (non-streaming); aborts it if the wait is cancelled."""
    last = None
    try:
        async for step in h:
            last = step
    finally:
        if not h.finished:
            h.abort()
    assert last is not None
    return last


class _Output:
    """A request's deterministic output: token ids and text pieces (one word per token)."""

    __slots__ = ("ids", "texts")

    def __init__(self, prompt_ids: list[int], max_new: int):
        start = output_start(prompt_ids)
        reps = (start + max_new) // len(OUTPUT_IDS) + 1
        self.ids = (OUTPUT_IDS * reps)[start : start + max_new]
        self.texts = (OUTPUT_TEXTS * reps)[start : start + max_new]

    def text(self, a: int, b: int) -> str:
        return "".join(self.texts[a:b])


class _Metrics:
    """Prometheus metrics with SGLang's names, in a registry of their own."""

    TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
    ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06, 0.08,
                   0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0)  # fmt: skip
    E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 800)
    QUEUE_BUCKETS = (0.0, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
    TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                    0.4, 0.5, 0.75, 1.0, 2.5)  # fmt: skip

    GAUGES = (
        ("num_running_reqs", "The number of running requests."),
        ("num_queue_reqs", "The number of requests in the waiting queue."),
        ("token_usage", "The token usage (fraction of the KV pool in use)."),
        ("num_used_tokens", "The number of used KV tokens."),
        ("max_total_num_tokens", "Maximum total number of tokens in the KV cache pool."),
        ("gen_throughput", "The generation throughput (token/s)."),
        ("cache_hit_rate", "The prefix cache hit rate."),
        ("new_token_ratio", "The new token ratio."),
        ("num_retracted_reqs", "The number of retracted requests."),
    )
    COUNTERS = (
        ("prompt_tokens_total", "Number of prefill tokens processed."),
        ("generation_tokens_total", "Number of generation tokens processed."),
        ("num_requests_total", "Number of requests processed."),
        ("cached_tokens_total", "Number of cached prompt tokens."),
        ("num_aborted_requests_total", "Number of requests aborted."),
        ("evicted_tokens_total", "Number of tokens evicted from the prefix cache."),
        ("num_retracted_requests_total", "Total number of retracted requests."),
    )

    def __init__(self, engine: Engine, model_name: str):
        from prometheus_client import CollectorRegistry, Histogram
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        self.registry = CollectorRegistry(auto_describe=False)
        labels = {"model_name": model_name, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0"}
        keys = list(labels)
        values = list(labels.values())
        gauges, counters = self.GAUGES, self.COUNTERS

        class _EngineCollector:
            def collect(self):
                s = engine.stats()
                s["num_retracted_requests_total"] = s["num_retractions_total"]
                for name, doc in gauges:
                    g = GaugeMetricFamily(f"sglang:{name}", doc, labels=keys)
                    g.add_metric(values, s[name])
                    yield g
                for name, doc in counters:
                    c = CounterMetricFamily(f"sglang:{name}", doc, labels=keys)
                    c.add_metric(values, s[name])
                    yield c

        self.registry.register(_EngineCollector())
        hkeys = [*keys, "is_streaming"]

        def hist(name, doc, buckets):
            return Histogram(f"sglang:{name}", doc, hkeys, buckets=buckets, registry=self.registry)

        ttft = hist(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", self.TTFT_BUCKETS
        )
        itl = hist(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", self.ITL_BUCKETS
        )
        e2e = hist("e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds",
                   self.E2E_BUCKETS)  # fmt: skip
        queue = hist("queue_time_seconds", "Histogram of queueing time in seconds.", self.QUEUE_BUCKETS)
        tpot = hist("request_time_per_output_token_seconds", "Histogram of time per output token in seconds.",
                    self.TPOT_BUCKETS)  # fmt: skip
        self._children = {}
        for streaming in (True, False):
            lv = [*values, "true" if streaming else "false"]
            self._children[streaming] = tuple(h.labels(*lv) for h in (ttft, itl, e2e, queue, tpot))

    def first_token(self, streaming: bool, h: RequestHandle) -> None:
        ttft, _, _, queue, _ = self._children[streaming]
        if h.first_token_time is not None:
            ttft.observe(h.first_token_time - h.arrival_time)
        if h.forward_entry_time is not None:
            queue.observe(h.forward_entry_time - h.arrival_time)

    def inter_token(self, streaming: bool, gap: float, new_tokens: int) -> None:
        itl = self._children[streaming][1]
        per = gap / new_tokens
        for _ in range(new_tokens):
            itl.observe(per)

    def finished(self, streaming: bool, h: RequestHandle) -> None:
        _, _, e2e, _, tpot = self._children[streaming]
        if h.finished_time is None:
            return
        e2e.observe(h.finished_time - h.arrival_time)
        if h.first_token_time is not None and h.completion_tokens > 1:
            tpot.observe((h.finished_time - h.first_token_time) / (h.completion_tokens - 1))

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class SimServer:
    """Builds the aiohttp application. ``settings`` holds every resolved server argument, SGLang-named."""

    def __init__(
        self, settings: TwinSettings, engine: Engine, tokenizer: Tokenizer, api_key: str | None = None
    ):
        self.settings = settings
        self._api_key = api_key  # not a setting: /server_info and the manifest's sim settings never show it
        self.engine = engine
        self.tok = tokenizer
        self.model_name: str = settings.served_model_name
        self.context_length: int = settings.context_length
        self.cache_report: bool = settings.enable_cache_report
        self.enable_metrics: bool = settings.enable_metrics
        self.get_load_polls = 0
        self.metrics = _Metrics(engine, self.model_name) if self.enable_metrics else None
        self.worker_id: str = settings.worker_id or base_url(settings.host, settings.port)

    def build_app(self) -> web.Application:
        # The key check only when a key is set: an open twin pays nothing per request.
        middlewares = [self._check_key] if self._api_key else []
        app = web.Application(client_max_size=256 * 1024 * 1024, middlewares=middlewares)
        app.on_response_prepare.append(self._stamp)
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat_completions)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        r.add_get("/ready", self.ready)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        r.add_get("/v1/models", self.models)
        r.add_get("/get_load", self.get_load)
        r.add_route("GET", "/flush_cache", self.flush_cache)
        r.add_route("POST", "/flush_cache", self.flush_cache)
        r.add_get("/metrics", self.metrics_endpoint)
        return app

    @web.middleware
    async def _check_key(self, request: web.Request, handler) -> web.StreamResponse:
        """SGLang's ``--api-key``: 401 ``{"error": "Unauthorized"}`` without the key (``loadlab.sim.auth``)."""
        headers = request.headers
        if needs_key(request.method, request.path) and not authorized(
            headers.get("Authorization"), headers.get("x-api-key"), self._api_key
        ):
            return web.Response(body=UNAUTHORIZED, status=401, content_type=JSON_CT)
        return await handler(request)

    async def _stamp(self, request: web.Request, response: web.StreamResponse) -> None:
        """Just before any response's headers go out (a stream's too, an error's, aiohttp's own 404):
        who served it, and the request id the client or the router sent."""
        headers = response.headers
        headers[WORKER_HEADER] = self.worker_id
        rid = request.headers.get(REQUEST_ID_HEADER)
        if rid is not None:
            headers[REQUEST_ID_HEADER] = rid

    # -- validation ---------------------------------------------------------------------------------------
    def _validate_lengths(self, prompt_len: int, max_new: int) -> None:
        c = self.context_length
        if prompt_len == 0:
            raise BadRequest("The input is empty.")
        if prompt_len >= c:
            raise BadRequest(
                f"The input ({prompt_len} tokens) is longer than the model's context length ({c} tokens)."
            )
        if prompt_len + max_new > c:
            raise BadRequest(
                f"Requested token count exceeds the model's maximum context length of {c} tokens. You "
                f"requested a total of {prompt_len + max_new} tokens: {prompt_len} tokens from the input "
                f"messages and {max_new} tokens for the completion. Please reduce the number of tokens in "
                "the input messages or the completion to fit within the limit."
            )

    def _submit(self, prompt_ids, max_new, ignore_eos, stream_interval, rid, out: _Output,
                priority: int | None = None) -> RequestHandle:  # fmt: skip
        try:
            return self.engine.submit(
                prompt_ids,
                max_new,
                ignore_eos=ignore_eos,
                stream_interval=stream_interval,
                rid=rid,
                output_ids=out.ids,
                priority=priority,
            )
        except RequestTooLargeError as e:
            raise BadRequest(str(e)) from None

    # -- native /generate ---------------------------------------------------------------------------------
    def _native_request(self, body: dict) -> tuple[list[int], int, bool, int | None, str | None, int | None]:
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise BadRequest("Either text or input_ids should be provided.")
        if ids is not None:
            prompt = _check_ids(ids)
        else:
            if isinstance(text, list):
                if len(text) != 1:
                    raise BadRequest(
                        "Batch requests (several prompts in one request) are not supported by loadlab-sim."
                    )
                text = text[0]
            if not isinstance(text, str):
                raise BadRequest("text must be a string.")
            prompt = self.tok.encode(text)
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise BadRequest("sampling_params must be an object.")
        max_new = _int_field(sp.get("max_new_tokens"), "max_new_tokens", NATIVE_DEFAULT_MAX_NEW_TOKENS, 0)
        ignore_eos = _bool_field(sp.get("ignore_eos"), "ignore_eos")
        interval = sp.get("stream_interval")
        if interval is not None:
            interval = _int_field(interval, "stream_interval", 1, 1)
        if sp.get("n", 1) not in (1, None):
            raise BadRequest("n > 1 is not supported by loadlab-sim.")
        rid = body.get("rid")
        if isinstance(rid, list):
            rid = rid[0] if len(rid) == 1 else None
        if rid is not None and not isinstance(rid, str):
            raise BadRequest("rid must be a string.")
        priority = _priority_field(body.get("priority"))
        self._validate_lengths(len(prompt), max_new)
        return prompt, max_new, ignore_eos, interval, rid, priority

    def _meta(self, h: RequestHandle, ct: int, finish_reason, final: bool) -> dict:
        meta = {
            "id": h.rid,
            "finish_reason": finish_reason,
            "prompt_tokens": h.prompt_tokens,
            "weight_version": "default",
            "completion_tokens": ct,
            "cached_tokens": h.cached_tokens,
            "num_retractions": h.num_retractions,
        }
        if self.enable_metrics:
            fe = h.forward_entry_time
            meta["queue_time"] = None if fe is None else fe - h.arrival_time
            meta["forward_entry_time"] = h.wall(fe)
            meta["prefill_finished_time"] = h.wall(h.first_token_time)
        if final:
            end = h.finished_time if h.finished_time is not None else h.arrival_time
            meta["e2e_latency"] = end - h.arrival_time
            if self.enable_metrics:
                ft = h.first_token_time
                meta["request_received_ts"] = h.wall(h.arrival_time)
                meta["first_token_latency"] = None if ft is None else ft - h.arrival_time
                meta["request_finished_ts"] = h.wall(h.finished_time)
                decode_s = (end - ft) if ft is not None else 0.0
                meta["decode_throughput"] = (ct - 1) / decode_s if decode_s > 0 and ct > 1 else 0.0
        return meta

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await _read_json(request)
        except BadRequest as e:
            return _native_error(str(e))
        stream = body.get("stream") is True
        try:
            prompt, max_new, ignore_eos, interval, rid, priority = self._native_request(body)
            out = _Output(prompt, max_new)
            handle = self._submit(prompt, max_new, ignore_eos, interval if stream else _NO_WAKE, rid, out,
                                  priority)  # fmt: skip
        except UnavailableError as e:
            return _unavailable(str(e))
        except BadRequest as e:
            if not stream:
                return _native_error(str(e))
            # SGLang validates after the 200 headers of a stream: the error arrives as an event.
            resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
            await resp.prepare(request)
            err = {"error": {"message": str(e), "type": "invalid_request_error", "code": 400, "param": None}}
            await resp.write(b"data: " + _dumps(err) + b"\n\n" + DONE_EVENT)
            return resp
        if stream:
            return await self._native_stream(request, handle, out)
        step = await _run_to_end(handle)
        dropped = _dropped(step)
        if dropped is not None:
            return dropped
        ct = step.completion_tokens
        if self.metrics is not None:
            self.metrics.first_token(False, handle)
            self.metrics.finished(False, handle)
        obj = {
            "text": out.text(0, ct),
            "output_ids": out.ids[:ct],
            "meta_info": self._meta(handle, ct, step.finish_reason, True),
        }
        return _json(obj)

    async def _native_stream(
        self, request: web.Request, h: RequestHandle, out: _Output
    ) -> web.StreamResponse:
        def encode(step: Step) -> bytes:
            ct = step.completion_tokens
            final = step.finish_reason is not None
            obj = {
                "text": out.text(0, ct),
                "output_ids": out.ids[:ct],
                "meta_info": self._meta(h, ct, step.finish_reason, final),
            }
            payload = b"data: " + _dumps(obj) + b"\n\n"
            return payload + DONE_EVENT if final else payload

        return await self._stream(request, h, encode)

    async def _stream(
        self, request: web.Request, h: RequestHandle, encode: Callable[[Step], bytes]
    ) -> web.StreamResponse:
        """Streams a request's steps as server-sent events; ``encode(step)`` gives a step's bytes.

        The first event goes out through aiohttp, which sends the headers with it; later events are written
        to the transport straight from the engine loop (``RequestHandle.listen``), in aiohttp's framing,
        with no task switch per event: that is most of a streamed token's cost. Each write's lateness
        (against the end of the forward pass that made the token) goes into ``engine.lateness``.
        """
        resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
        metrics = self.metrics
        lateness = self.engine.lateness
        loop = asyncio.get_running_loop()
        last = 0.0

        def account(step: Step) -> None:
            nonlocal last
            now = loop.time()
            lateness.record(now - step.due)
            if metrics is not None:
                if last == 0.0:
                    metrics.first_token(True, h)
                elif step.new_tokens:
                    metrics.inter_token(True, now - last, step.new_tokens)
                if step.finish_reason is not None:
                    metrics.finished(True, h)
            last = now

        try:
            await resp.prepare(request)
            step = await h.__anext__()
            await resp.write(encode(step))
            account(step)
            if step.finish_reason is not None:
                return resp
            transport = request.transport
            chunked = resp.headers.get("Transfer-Encoding") == "chunked"  # set by prepare() on HTTP/1.1
            outcome: asyncio.Future[str] = loop.create_future()

            def emit(step: Step, payload: bytes) -> None:
                if outcome.done():
                    return
                if transport is None or transport.is_closing():
                    outcome.set_result("gone")  # the awaiting task aborts the request
                    return
                if payload:
                    transport.write(b"%x\r\n%b\r\n" % (len(payload), payload) if chunked else payload)
                account(step)
                if step.finish_reason is not None:
                    outcome.set_result("finished")
                elif transport.get_write_buffer_size() > SLOW_READER_BYTES:
                    h.unlisten()
                    outcome.set_result("slow reader")

            h.listen(encode, emit)
            if await outcome == "slow reader":
                # Back to awaiting each write: tokens produced meanwhile arrive together in the next event,
                # as SGLang drops a slow reader's intermediate chunks.
                async for step in h:
                    await resp.write(encode(step))
                    account(step)
        except ConnectionError:
            pass
        finally:
            if not h.finished:
                h.abort()
        return resp

    # -- OpenAI-compatible ----------------------------------------------------------------------------------
    def _openai_common(self, body: dict, default_max: int, chat: bool):
        # max_completion_tokens is OpenAI's newer name: sglang-router sends it for the client's max_tokens.
        max_tokens = body.get("max_completion_tokens")
        if max_tokens is None:
            max_tokens = body.get("max_tokens")
        max_new = _int_field(max_tokens, "max_tokens", default_max, 1)
        if body.get("n", 1) not in (1, None):
            raise BadRequest("n > 1 is not supported by loadlab-sim.")
        ignore_eos = _bool_field(body.get("ignore_eos"), "ignore_eos")
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise BadRequest("stream_options must be an object.")
        include_usage = _bool_field(opts.get("include_usage"), "stream_options.include_usage")
        continuous = _bool_field(opts.get("continuous_usage_stats"), "stream_options.continuous_usage_stats")
        model = body.get("model")
        if model is None:
            model = self.model_name
        elif not isinstance(model, str):
            raise BadRequest("model must be a string.")
        rid = body.get("rid")
        if rid is not None and not isinstance(rid, str):
            raise BadRequest("rid must be a string.")
        # priority: SGLang's completions request carries it to the scheduler; on chat the twin ignores it
        # (shared/design/omni.md names /generate and /v1/completions).
        priority = None if chat else _priority_field(body.get("priority"))
        return max_new, ignore_eos, include_usage, continuous, model, rid, priority

    def _completion_prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if not prompt:
            raise BadRequest("Prompt cannot be empty")
        if isinstance(prompt, str):
            return self.tok.encode(prompt)
        if isinstance(prompt, list) and all(type(i) is int for i in prompt):
            return prompt
        if isinstance(prompt, list):
            raise BadRequest(
                "Batch requests (several prompts in one request) are not supported by loadlab-sim."
            )
        raise BadRequest("prompt must be a string, a list of token ids, or a one-element list of either.")

    def _chat_prompt(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list.")
        for m in messages:
            if not isinstance(m, dict):
                raise BadRequest("each message must be an object with 'role' and 'content'.")
        try:
            return self.tok.encode_chat(messages)
        except ValueError as e:
            raise BadRequest(str(e)) from None

    def _usage(self, h: RequestHandle, ct: int, drop_none: bool) -> dict:
        u = {
            "prompt_tokens": h.prompt_tokens,
            "total_tokens": h.prompt_tokens + ct,
            "completion_tokens": ct,
            "prompt_tokens_details": {"cached_tokens": h.cached_tokens} if self.cache_report else None,
            "reasoning_tokens": 0,
        }
        if drop_none and u["prompt_tokens_details"] is None:
            del u["prompt_tokens_details"]
        return u

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=True)

    async def _openai(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await _read_json(request)
            stream = body.get("stream") is True
            prompt = self._chat_prompt(body) if chat else self._completion_prompt(body)
            default_max = CHAT_DEFAULT_MAX_TOKENS if chat else COMPLETIONS_DEFAULT_MAX_TOKENS
            max_new, ignore_eos, include_usage, continuous, model, rid, priority = self._openai_common(
                body, default_max, chat
            )
            self._validate_lengths(len(prompt), max_new)
            rid = rid or (("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex)
            out = _Output(prompt, max_new)
            handle = self._submit(prompt, max_new, ignore_eos, None if stream else _NO_WAKE, rid, out,
                                  priority)  # fmt: skip
        except BadRequest as e:
            return _openai_error(str(e))
        except UnavailableError as e:
            return _unavailable(str(e))
        created = int(time.time())
        if stream:
            return await self._openai_stream(
                request, handle, out, chat, model, created, include_usage, continuous
            )
        step = await _run_to_end(handle)
        dropped = _dropped(step)
        if dropped is not None:
            return dropped
        if self.metrics is not None:
            self.metrics.first_token(False, handle)
            self.metrics.finished(False, handle)
        ct = step.completion_tokens
        fr = step.finish_reason["type"] if step.finish_reason else None
        matched = step.finish_reason.get("matched") if step.finish_reason else None  # the EOS, on a stop
        text = out.text(0, ct)
        if chat:
            choice = {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": text,
                    "reasoning_content": None,
                    "tool_calls": None,
                },
                "logprobs": None,
                "finish_reason": fr,
                "matched_stop": matched,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": fr,
                "matched_stop": matched,
            }
        obj = {
            "id": handle.rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": self._usage(handle, ct, drop_none=False),
            "metadata": {"weight_version": "default"},
        }
        return _json(obj)

    async def _openai_stream(self, request, h: RequestHandle, out: _Output, chat: bool, model: str,
                             created: int, include_usage: bool, continuous: bool) -> web.StreamResponse:  # fmt: skip
        obj_name = "chat.completion.chunk" if chat else "text_completion"
        rid = h.rid

        def chunk(field: str, value: Any, finish_reason: str | None, usage: dict | None,
                  matched: int | None = None) -> bytes:  # fmt: skip
            choice = {"index": 0, field: value, "logprobs": None, "finish_reason": finish_reason,
                      "matched_stop": matched}  # fmt: skip
            return b"data: " + _dumps({"id": rid, "object": obj_name, "created": created, "model": model,
                                       "choices": [choice], "usage": usage}) + b"\n\n"  # fmt: skip

        def delta(content: str | None, role: str | None = None) -> dict:
            return {"role": role, "content": content, "reasoning_content": None, "tool_calls": None}

        def encode(step: Step) -> bytes:
            ct = step.completion_tokens
            text = out.text(ct - step.new_tokens, ct)
            usage = self._usage(h, ct, drop_none=False) if continuous else None
            fr = step.finish_reason["type"] if step.finish_reason is not None else None
            matched = step.finish_reason.get("matched") if step.finish_reason is not None else None
            payload = b""
            if chat:
                if step.new_tokens == ct:  # the first event opens with the assistant's role
                    payload += chunk("delta", delta("", "assistant"), None, usage)
                if text:
                    payload += chunk("delta", delta(text), None, usage)
                if fr is not None:
                    payload += chunk("delta", delta(None), fr, usage, matched)
            else:
                payload += chunk("text", text, fr, usage, matched)
            if fr is not None:
                if include_usage:
                    payload += b"data: " + _dumps({"id": rid, "object": obj_name, "created": created,
                                                   "model": model, "choices": [],
                                                   "usage": self._usage(h, ct, drop_none=True)}) + b"\n\n"  # fmt: skip
                payload += DONE_EVENT
            return payload

        return await self._stream(request, h, encode)

    # -- the rest -----------------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        h = self.engine.submit([0], 1, rid="HEALTH_CHECK_" + uuid.uuid4().hex, internal=True)
        try:
            async for _ in h:
                pass
        finally:
            if not h.finished:
                h.abort()
        return web.Response(status=200)

    async def ready(self, request: web.Request) -> web.Response:
        return _json({"status": "ready"})

    async def model_info(self, request: web.Request) -> web.Response:
        s = self.settings
        return _json(
            {
                "model_path": s.model_path,
                "served_model_name": self.model_name,
                "tokenizer_path": s.tokenizer_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
            }
        )

    def server_info_dict(self) -> dict:
        st = self.engine.stats()
        cost = self.engine.cost
        kv_gb = self.settings.max_total_num_tokens * cost.kv_bytes_per_token_per_gpu / 2**30
        info = self.settings.as_dict()
        info.update(
            version=SIM_VERSION,
            loadlab_sim=True,
            loadlab_sim_timing=self.engine.timing_stats(),
            loadlab_get_load_polls=self.get_load_polls,
            internal_states=[
                {
                    "last_gen_throughput": st["gen_throughput"],
                    "memory_usage": {
                        "weight": round(cost.weight_bytes_per_gpu / 2**30, 2),
                        "kvcache": round(kv_gb, 2),
                        "token_capacity": self.settings.max_total_num_tokens,
                        "graph": 0.0,
                    },
                    "num_running_reqs": st["num_running_reqs"],
                    "num_queue_reqs": st["num_queue_reqs"],
                    "token_usage": st["token_usage"],
                    "cache_hit_rate": st["cache_hit_rate"],
                    "new_token_ratio": st["new_token_ratio"],
                    "num_retractions_total": st["num_retractions_total"],
                    # loadlab's: SGLang counts a priority preemption only in the request's num_retractions
                    "num_priority_preemptions_total": st["num_priority_preemptions_total"],
                }
            ],
        )
        return info

    async def server_info(self, request: web.Request) -> web.Response:
        return _json(self.server_info_dict())

    async def models(self, request: web.Request) -> web.Response:
        return _json(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model_name,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": "sglang",
                        "root": self.settings.model_path,
                        "parent": None,
                        "max_model_len": self.context_length,
                    }
                ],
            }
        )

    async def get_load(self, request: web.Request) -> web.Response:
        """SGLang's ``/get_load``, one entry per DP rank (the twin has one): ``num_reqs`` running + waiting,
        ``num_waiting_reqs`` waiting, ``num_tokens`` KV tokens in use + the waiting requests' tokens. What
        sglang-router's power_of_two policy polls."""
        self.get_load_polls += 1  # /server_info shows it: a front that routes by load polls here
        return _json([{"dp_rank": 0, **self.engine.load()}])

    async def flush_cache(self, request: web.Request) -> web.Response:
        note = (
            "Please check backend logs for more details. (When there are running or waiting requests, "
            "the operation will not be performed.)\n"
        )
        if self.engine.flush_cache():
            return web.Response(text="Cache flushed.\n" + note, status=200)
        return web.Response(text="Cache not flushed.\n" + note, status=400)

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        if self.metrics is None:
            return web.Response(status=404, text="Metrics are off: start the server with --enable-metrics.\n")
        from prometheus_client import CONTENT_TYPE_LATEST

        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


__all__ = ["BadRequest", "SimServer"]
