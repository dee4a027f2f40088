"""A scripted SGLang-speaking streaming server with known timing, for testing the client's measurements.

Unlike the simulated engine this server does no scheduling at all: every request gets the same
deterministic script. The first event is written ``--ttft-ms`` after the request body was fully read,
then one event every ``--gap-ms``, against an absolute plan (no drift). It runs on raw asyncio streams
with TCP_NODELAY, so each event is exactly one socket write (or three, for the ``split`` case), and it
logs, per request, the wall-clock time right after each token-carrying event's last byte was handed to
the kernel. Joining that log with the client's records on ``server_id`` gives the client's timing
error per event.

    python -m loadlab.testing.scripted --port 0 --log server.jsonl [--ttft-ms 100] [--gap-ms 20]

prints ``loadlab-sim listening on http://127.0.0.1:PORT`` when ready. The behaviour is picked by a
path prefix, so a client only needs a different base URL: ``http://127.0.0.1:PORT/case/<name>/generate``
(``/v1/completions``, ``/v1/chat/completions``, ``/server_info``, ``/v1/models``, ``/health`` likewise).
A path without the prefix is the ``normal`` case. Cases joined by ``+`` (``/case/normal+split+crlf/``)
take turns, one generation request each, so one run can cover several; the log says which case each
request got. Cases (see ``CASES``):

  normal      one token per event
  multi4      four tokens per event (the last event carries the rest)
  multi4_endusage  multi4 from a server that ignores continuous_usage_stats but honours include_usage:
              OpenAI chunks carry no usage, the final usage chunk the total (native: like multi4)
  crlf        SSE lines end with \\r\\n (events with \\r\\n\\r\\n)
  comments    ``: ping`` comment lines before the first event and between events
  split       each event in three writes 3 ms apart; the first split falls inside a multi-byte
              UTF-8 character; the last byte goes out at the planned time
  error_event after 3 tokens ``data: {"error": {...}}`` then ``data: [DONE]`` (status 200)
  abort       after 3 tokens an event with finish_reason abort (native: {"type": "abort", ...})
  http_400    HTTP 400 with SGLang's JSON error body
  http_503    HTTP 503 "The request queue is full."
  drop        3 events, then the socket is closed without the chunked terminator
  stall       3 events, then silence for 30 s (then the connection is closed)
  garbage     a non-JSON data line after 2 events, then the rest of the stream
  badshape    valid JSON of the wrong shape after 2 events (choices: ["x"], meta_info: "x")
  notsse      HTTP 200 with a plain JSON body instead of an event stream
  nousage     OpenAI paths: no usage anywhere, whatever stream_options asks (native: like normal)
  worker      like normal, with the attribution headers a worker behind a front sends: x-loadlab-worker
              (twice: scripted-worker-1, then scripted-worker-2) and x-loadlab-front (the worker's wins)
  front_429   HTTP 429 that a front answers itself: x-loadlab-front, no x-loadlab-worker
  pairs       one token per event, the events two at a time in one socket write (at the second one's
              planned time; both logged with that write's time): one read brings both

The log (``--log``) gets one JSON line per request, flushed when the request ends:
``{"id", "case", "api", "rid", "status", "recv_wall", "write_wall": [...], "tokens": [...],
"max_buffered", "completed", "priority", "class_headers"}``; ``priority`` is the body's (null without
one), ``class_headers`` the request's ``x-request-id-...`` headers (the ones a router forwards), by lower-case
name. ``write_wall[j]`` / ``tokens[j]`` describe the j-th token-carrying event
(the one the client records as ``arrival_ms[j]`` / ``arrival_tokens[j]``): the time right after the
event's write (for ``split``, the write that completed the event's first data line); ``max_buffered`` is the
largest number of bytes asyncio still held after a write (0 means every write went straight to the
kernel, so every ``write_wall`` is exact).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import socket
import sys
import time
import uuid

import orjson

from loadlab.sim import READY_PREFIX  # the ready line the twin prints; the wire code is its own

MODEL = "scripted-model"
CASES = (
    "normal",
    "multi4",
    "multi4_endusage",
    "crlf",
    "comments",
    "split",
    "error_event",
    "abort",
    "http_400",
    "http_503",
    "drop",
    "stall",
    "garbage",
    "badshape",
    "notsse",
    "nousage",
    "worker",
    "front_429",
    "pairs",
)
# The attribution headers of the worker and front_429 cases (the names as in loadlab.sim, spelt here on
# purpose: this server shares no wire code with the twin).
WORKER_HEADERS = b"X-Loadlab-Worker: scripted-worker-1\r\nX-Loadlab-Worker: scripted-worker-2\r\nX-Loadlab-Front: scripted-front\r\n"
FRONT_HEADERS = b"X-Loadlab-Front: scripted-front\r\n"
STALL_S = 30.0
SPLIT_STEP_S = 0.003  # time between the three writes of one event in the split case
FAIL_AFTER = 3  # tokens (events) before error_event / abort / drop / stall
GARBAGE_AFTER = 2
TOKEN_TEXT = " tok"
SPLIT_TOKEN_TEXT = " 数é"  # multi-byte UTF-8, so a split can fall inside a character
MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 64 * 1024 * 1024

_ids = itertools.count()


class BadRequest(Exception):
    pass


class Server:
    def __init__(self, ttft_s: float, gap_s: float, log_path: str | None):
        self.ttft_s = ttft_s
        self.gap_s = gap_s
        self.log = open(log_path, "ab") if log_path else None  # noqa: SIM115 - open for the server's life
        self.tag = f"{os.getpid():x}"
        self.turns: dict[str, int] = {}  # mixed cases ("a+b+c"): requests seen so far

    # ---- connection and HTTP/1.1 framing -------------------------------------------------------

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                except asyncio.LimitOverrunError:
                    await self._send_simple(writer, 431, {"error": {"message": "headers too large"}}, False)
                    return
                try:
                    method, target, headers = _parse_head(head)
                    body = await _read_body(reader, headers)
                except BadRequest as e:
                    await self._send_simple(writer, 400, {"error": {"message": str(e)}}, False)
                    return
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                keep_alive = headers.get("connection", "").lower() != "close"
                keep_alive = await self.route(method, target, body, reader, writer, keep_alive, headers)
                if not keep_alive or writer.is_closing():
                    return
        except Exception as e:  # a bug here must not kill the server; say it on stderr
            print(f"scripted: connection error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        finally:
            writer.close()

    async def _send_simple(self, writer, status: int, payload, keep_alive: bool, extra: bytes = b"") -> None:
        body = payload if isinstance(payload, bytes) else orjson.dumps(payload)
        writer.write(_head(status, "application/json", len(body), keep_alive, extra) + body)
        with contextlib.suppress(ConnectionError):
            await writer.drain()

    async def route(self, method, target, body, reader, writer, keep_alive, headers=None) -> bool:
        """Answers one request; returns whether the connection stays open."""
        case, path = _split_case(target.split("?", 1)[0])
        names = case.split("+")
        if not all(name in CASES for name in names):
            await self._send_simple(writer, 404, {"error": {"message": f"unknown case {case!r}"}}, keep_alive)
            return keep_alive
        if len(names) > 1 and method == "POST":  # a mix: cases in turn, one per generation request
            turn = self.turns.get(case, 0)
            self.turns[case] = turn + 1
            case = names[turn % len(names)]
        elif len(names) > 1:
            case = names[0]
        if method == "GET":
            payload = self.get_payload(path, case)
            if payload is None:
                await self._send_simple(writer, 404, {"detail": "Not Found"}, keep_alive)
            else:
                await self._send_simple(writer, 200, payload, keep_alive)
            return keep_alive
        api = {"/generate": "generate", "/v1/completions": "completions", "/v1/chat/completions": "chat"}
        if method != "POST" or path not in api:
            await self._send_simple(writer, 404, {"detail": "Not Found"}, keep_alive)
            return keep_alive
        try:
            req = orjson.loads(body)
            if not isinstance(req, dict):
                raise ValueError("not an object")
        except ValueError:
            await self._send_simple(
                writer, 400, {"error": {"message": "body is not a JSON object"}}, keep_alive
            )
            return keep_alive
        if case == "notsse":
            await self._send_simple(writer, 200, {"text": "not a stream", "meta_info": {}}, keep_alive)
            return keep_alive
        exchange = Exchange(self, case, api[path], req, reader, writer)
        exchange.class_headers = {k: v for k, v in (headers or {}).items() if k.startswith("x-request-id-")}
        return await exchange.run(keep_alive)

    def get_payload(self, path: str, case: str):
        if path in ("/server_info", "/get_server_info"):
            return {
                "scripted": True,
                "case": case,
                "ttft_ms": self.ttft_s * 1000.0,
                "gap_ms": self.gap_s * 1000.0,
                "model_path": MODEL,
                "served_model_name": MODEL,
                "stream_interval": 4 if case.startswith("multi4") else 1,
                "max_running_requests": 4096,
                "max_total_num_tokens": 1 << 20,
                "max_req_input_len": 1 << 16,
                "version": "scripted",
                "internal_states": [{"last_gen_throughput": 0.0, "memory_usage": {}}],
            }
        if path in ("/model_info", "/get_model_info"):
            return {
                "model_path": MODEL,
                "served_model_name": MODEL,
                "tokenizer_path": None,
                "is_generation": True,
            }
        if path == "/v1/models":
            return {
                "object": "list",
                "data": [{"id": MODEL, "object": "model", "owned_by": "sglang", "max_model_len": 1 << 16}],
            }
        if path in ("/health", "/health_generate", "/ready"):
            return b""
        return None

    def write_log(self, entry: dict) -> None:
        if self.log is not None:
            self.log.write(orjson.dumps(entry) + b"\n")
            self.log.flush()  # readable while the server runs (a test joins a request's entry right after it)
            self.log.flush()


class Exchange:
    """One streaming request: the script for its case, written on an absolute timetable."""

    def __init__(self, server: Server, case: str, api: str, req: dict, reader, writer):
        self.server = server
        self.case = case
        self.api = api
        self.req = req
        self.reader = reader
        self.writer = writer
        self.transport = writer.transport
        self.loop = asyncio.get_running_loop()
        self.t0 = self.loop.time()
        self.recv_wall = time.time()
        n = next(_ids)
        prefix = {"generate": "", "completions": "cmpl-", "chat": "chatcmpl-"}[api]
        self.id = f"{prefix}{server.tag}{n:06x}{uuid.uuid4().hex[:12]}"
        self.write_wall: list[float] = []
        self.tokens: list[int] = []
        self.max_buffered = 0
        self.status = 200
        self.completed = False
        self.class_headers: dict[str, str] = {}
        self.eol = b"\r\n" if case == "crlf" else b"\n"
        self.token_text = SPLIT_TOKEN_TEXT if case == "split" else TOKEN_TEXT
        self.created = int(self.recv_wall)
        sp = req.get("sampling_params") or {}
        if api == "generate":
            self.n_out = int(sp.get("max_new_tokens", 128))
            if isinstance(req.get("input_ids"), list):
                self.n_in = len(req["input_ids"])
            else:
                self.n_in = len(str(req.get("text", "")).split())
        else:
            self.n_out = int(req.get("max_tokens") or req.get("max_completion_tokens") or 16)
            if api == "completions":
                self.n_in = len(str(req.get("prompt", "")).split())
            else:
                msgs = req.get("messages") or []
                self.n_in = sum(len(str(m.get("content", "")).split()) for m in msgs if isinstance(m, dict))
        opts = req.get("stream_options") or {}
        usage_ok = case != "nousage"
        self.include_usage = usage_ok and bool(opts.get("include_usage"))
        self.continuous_usage = (
            usage_ok and case != "multi4_endusage" and bool(opts.get("continuous_usage_stats"))
        )
        self.stream = bool(req.get("stream", False))

    # ---- the script ------------------------------------------------------------------------------

    def plan(self) -> list[int]:
        """Tokens carried by each planned event."""
        n = max(0, self.n_out)
        if self.case in ("multi4", "multi4_endusage"):
            return [4] * (n // 4) + ([n % 4] if n % 4 else [])
        return [1] * n

    async def run(self, keep_alive: bool) -> bool:
        try:
            if self.case in ("http_400", "http_503", "front_429"):
                self.status = int(self.case[-3:])
                extra = FRONT_HEADERS if self.case == "front_429" else b""
                await self.server._send_simple(self.writer, self.status, self.error_body(), keep_alive, extra)
                self.completed = True
                return keep_alive
            if not self.stream:
                return await self.run_unary(keep_alive)
            return await self.run_stream(keep_alive)
        finally:
            self.server.write_log(
                {
                    "id": self.id,
                    "case": self.case,
                    "api": self.api,
                    "rid": self.req.get("rid"),
                    "status": self.status,
                    "recv_wall": self.recv_wall,
                    "write_wall": self.write_wall,
                    "tokens": self.tokens,
                    "max_buffered": self.max_buffered,
                    "completed": self.completed,
                    "priority": self.req.get("priority"),
                    "class_headers": self.class_headers,
                }
            )

    def error_body(self) -> dict:
        if self.status == 429:
            return {"error": {"message": "scripted front: too many requests"}}
        if self.status == 503:
            message = "The request queue is full."
            if self.api == "generate":
                return {"error": {"message": message}}
            return {
                "object": "error",
                "message": message,
                "type": "Service Unavailable",
                "param": None,
                "code": 503,
            }
        message = "scripted bad request"
        if self.api == "generate":
            return {"error": {"message": message}}
        return {"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": 400}

    async def run_unary(self, keep_alive: bool) -> bool:
        """stream=false: waits for the whole plan, then answers with one JSON body."""
        plan = self.plan()
        await self.sleep_until(self.t0 + self.server.ttft_s + self.server.gap_s * max(0, len(plan) - 1))
        n = self.n_out
        text = self.token_text * n
        usage = {"prompt_tokens": self.n_in, "completion_tokens": n, "total_tokens": self.n_in + n}
        if self.api == "generate":
            body = {"text": text, "output_ids": list(range(1000, 1000 + n)), "meta_info": self.meta(n, True)}
        elif self.api == "completions":
            body = {
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": MODEL,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}],
                "usage": usage,
            }
        else:
            body = {
                "id": self.id,
                "object": "chat.completion",
                "created": self.created,
                "model": MODEL,
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                ],
                "usage": usage,
            }
        await self.server._send_simple(self.writer, 200, body, keep_alive)
        self.completed = True
        return keep_alive

    async def run_stream(self, keep_alive: bool) -> bool:
        head = (
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
            b"Transfer-Encoding: chunked\r\n"
            + (WORKER_HEADERS if self.case == "worker" else b"")
            + (b"Connection: keep-alive\r\n" if keep_alive else b"Connection: close\r\n")
            + b"\r\n"
        )
        if not self.write(head):
            return False
        plan = self.plan()
        ttft, gap = self.server.ttft_s, self.server.gap_s
        done = 0  # tokens sent so far
        case = self.case
        for k, n_tok in enumerate(plan):
            due = self.t0 + ttft + k * gap
            if case == "comments":
                before = self.t0 + ttft / 2 if k == 0 else due - gap / 2
                await self.sleep_until(before)
                if not self.write(_chunk(b": ping" + self.eol + self.eol)):
                    return False
            if k == FAIL_AFTER and case in ("error_event", "abort", "drop", "stall"):
                await self.sleep_until(due)
                return await self.fail(keep_alive, done)
            if k == GARBAGE_AFTER and case in ("garbage", "badshape"):
                await self.sleep_until(due - gap / 2)
                bad = b"this is not json {" if case == "garbage" else b'{"choices":["x"],"meta_info":"x"}'
                if not self.write(_chunk(self.sse(bad))):
                    return False
            last = k == len(plan) - 1
            payload = self.events(done, n_tok, last)
            done += n_tok
            if last:
                payload += self.tail()
            data = _chunk(payload)
            if last:
                data += b"0\r\n\r\n"
            if case == "pairs" and k % 2 == 0 and not last:  # held back, written with the next event
                held, held_tokens = data, n_tok
                continue
            if case == "pairs" and k % 2 == 1:
                data = held + data
                await self.sleep_until(due)
                written = time.time() if self.write(data) else None
                if written is None:
                    return False
                self.write_wall += [written, written]
                self.tokens += [held_tokens, n_tok]
                continue
            if case == "split":
                written = await self.write_split(data, due)
            else:
                await self.sleep_until(due)
                written = time.time() if self.write(data) else None
            if written is None:
                return False
            self.write_wall.append(written)
            self.tokens.append(n_tok)
        if not plan:  # max_new_tokens 0: just the end of the stream
            await self.sleep_until(self.t0 + ttft)
            if not self.write(_chunk(self.tail()) + b"0\r\n\r\n"):
                return False
        self.completed = True
        try:
            await self.writer.drain()
        except ConnectionError:
            return False
        return keep_alive

    async def fail(self, keep_alive: bool, done: int) -> bool:
        """The failure cases, at the planned time of the event after FAIL_AFTER tokens."""
        case = self.case
        if case == "error_event":
            err = {"error": {"message": "boom", "type": "invalid_request_error", "code": 400}}
            ok = self.write(_chunk(self.sse(orjson.dumps(err)) + self.sse(b"[DONE]")) + b"0\r\n\r\n")
            self.completed = ok
            return keep_alive and ok
        if case == "abort":
            payload = self.events(done, 0, True, abort=True) + self.tail()
            ok = self.write(_chunk(payload) + b"0\r\n\r\n")
            self.completed = ok
            return keep_alive and ok
        if case == "drop":
            with contextlib.suppress(ConnectionError):
                await self.writer.drain()
            self.completed = True
            self.transport.close()
            return False
        # stall: silent for STALL_S, or until the client goes away
        with contextlib.suppress(TimeoutError, ConnectionError):
            await asyncio.wait_for(self.reader.read(1), STALL_S)
        self.completed = True
        self.transport.close()
        return False

    # ---- event bodies ----------------------------------------------------------------------------

    def sse(self, data: bytes) -> bytes:
        return b"data: " + data + self.eol + self.eol

    def meta(self, completion: int, last: bool, abort: bool = False) -> dict:
        meta = {
            "id": self.id,
            "finish_reason": None,
            "prompt_tokens": self.n_in,
            "weight_version": "default",
            "completion_tokens": completion,
            "cached_tokens": 0,
            "num_retractions": 0,
        }
        if abort:
            meta["finish_reason"] = {
                "type": "abort",
                "message": "server aborted",
                "status_code": 500,
                "err_type": "InternalServerError",
            }
        elif last:
            meta["finish_reason"] = {"type": "length", "length": completion}
        if last:
            meta["e2e_latency"] = self.loop.time() - self.t0
        return meta

    def usage(self, completion: int) -> dict:
        return {
            "prompt_tokens": self.n_in,
            "completion_tokens": completion,
            "total_tokens": self.n_in + completion,
        }

    def events(self, done: int, n_tok: int, last: bool, abort: bool = False) -> bytes:
        """The SSE event(s) carrying tokens done+1 .. done+n_tok."""
        total = done + n_tok
        if self.api == "generate":
            event = {
                "text": self.token_text * total,
                "output_ids": list(range(1000, 1000 + total)),
                "meta_info": self.meta(total, last, abort),
            }
            return self.sse(orjson.dumps(event))
        finish = ("abort" if abort else "length") if last else None
        usage = self.usage(total) if self.continuous_usage else None
        delta_text = self.token_text * n_tok
        if self.api == "completions":
            chunk = {
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": MODEL,
                "choices": [
                    {
                        "index": 0,
                        "text": delta_text,
                        "logprobs": None,
                        "finish_reason": finish,
                        "matched_stop": None,
                    }
                ],
                "usage": usage,
            }
            return self.sse(orjson.dumps(chunk))
        out = b""
        if done == 0 and n_tok > 0:  # the role chunk goes with the first token, in the same write
            out += self.sse(orjson.dumps(self.chat_chunk({"role": "assistant", "content": ""}, None, usage)))
        if n_tok > 0:
            out += self.sse(orjson.dumps(self.chat_chunk({"content": delta_text}, None, usage)))
        if finish is not None:
            out += self.sse(orjson.dumps(self.chat_chunk({}, finish, None)))
        return out

    def chat_chunk(self, delta: dict, finish, usage) -> dict:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": MODEL,
            "choices": [
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, "matched_stop": None}
            ],
            "usage": usage,
        }

    def tail(self) -> bytes:
        """After the last token: the usage chunk (OpenAI, when asked for) and [DONE]."""
        out = b""
        if self.api != "generate" and self.include_usage:
            total = min(self.n_out, FAIL_AFTER) if self.case == "abort" else self.n_out
            obj = "text_completion" if self.api == "completions" else "chat.completion.chunk"
            chunk = {
                "id": self.id,
                "object": obj,
                "created": self.created,
                "model": MODEL,
                "choices": [],
                "usage": self.usage(total),
            }
            out += self.sse(orjson.dumps(chunk))
        return out + self.sse(b"[DONE]")

    # ---- timing and writes -----------------------------------------------------------------------

    async def sleep_until(self, when: float) -> None:
        delay = when - self.loop.time()
        if delay > 0:
            await asyncio.sleep(delay)

    def write(self, data: bytes) -> bool:
        """Hands ``data`` to the socket now; False when the client has gone."""
        if self.transport.is_closing():
            return False
        self.transport.write(data)
        buffered = self.transport.get_write_buffer_size()
        if buffered > self.max_buffered:
            self.max_buffered = buffered
        return True

    async def write_split(self, data: bytes, due: float) -> float | None:
        """Three writes SPLIT_STEP_S apart, the last at ``due``: the first cut falls inside the event's
        first multi-byte UTF-8 character, the second 3 bytes before the end of that character's line.
        Returns the wall time right after the write that completed the event's first data line (the
        line a client times: for chat's first event, the role chunk, which carries the first token's
        usage), or None when the client has gone."""
        first_mb = next((i for i, b in enumerate(data) if b >= 0x80), None)
        if first_mb is None:  # no multi-byte text (cannot happen with SPLIT_TOKEN_TEXT): thirds
            cut1, cut2 = len(data) // 3, 2 * len(data) // 3
        else:
            cut1 = first_mb + 1
            cut2 = max(cut1 + 1, data.index(self.eol, first_mb) - 3)
        start = data.find(b"data: ")
        first_line_end = data.index(self.eol, start) + len(self.eol) - 1 if start >= 0 else len(data) - 1
        parts = (data[:cut1], data[cut1:cut2], data[cut2:])
        ends = (cut1, cut2, len(data))
        line_done = None
        for i, part in enumerate(parts):
            await self.sleep_until(due - (2 - i) * SPLIT_STEP_S)
            if not self.write(part):
                return None
            if line_done is None and first_line_end < ends[i]:
                line_done = time.time()
        return line_done


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _head(status: int, content_type: str, length: int, keep_alive: bool, extra: bytes = b"") -> bytes:
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 429: "Too Many Requests",
              431: "Request Header Fields Too Large"}.get(status, "Service Unavailable" if status == 503 else "Error")  # fmt: skip
    return (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {length}\r\n".encode()
        + extra
        + f"Connection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n".encode()
    )


def _parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    try:
        lines = head.decode("latin-1").split("\r\n")
        method, target, _version = lines[0].split(" ", 2)
    except ValueError:
        raise BadRequest("malformed request line") from None
    headers = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise BadRequest(f"malformed header line {line!r}")
        headers[name.strip().lower()] = value.strip()
    return method.upper(), target, headers


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = bytearray()
        while True:
            size_line = await reader.readuntil(b"\r\n")
            try:
                size = int(size_line.split(b";")[0].strip(), 16)
            except ValueError:
                raise BadRequest("malformed chunk size") from None
            if size == 0:
                await reader.readuntil(b"\r\n")  # no trailers expected
                return bytes(body)
            body += await reader.readexactly(size)
            await reader.readexactly(2)
            if len(body) > MAX_BODY_BYTES:
                raise BadRequest("body too large")
    try:
        length = int(headers.get("content-length", "0"))
    except ValueError:
        raise BadRequest("bad Content-Length") from None
    if length < 0 or length > MAX_BODY_BYTES:
        raise BadRequest("bad Content-Length")
    return await reader.readexactly(length) if length else b""


def _split_case(path: str) -> tuple[str, str]:
    """'/case/drop/generate' -> ('drop', '/generate'); '/generate' -> ('normal', '/generate')."""
    if path.startswith("/case/"):
        name, _, rest = path[len("/case/") :].partition("/")
        return name, "/" + rest
    return "normal", path


async def serve(host: str, port: int, ttft_ms: float, gap_ms: float, log_path: str | None) -> None:
    server = Server(ttft_ms / 1000.0, gap_ms / 1000.0, log_path)
    srv = await asyncio.start_server(server.handle, host, port, limit=MAX_HEADER_BYTES, backlog=1024)
    bound = srv.sockets[0].getsockname()[1]
    print(f"{READY_PREFIX}http://{host}:{bound}", flush=True)
    async with srv:
        await srv.serve_forever()


def read_log(path) -> dict[str, dict]:
    """The server's per-request log (--log), keyed by request id (= the client's server_id)."""
    out = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                entry = orjson.loads(line)
                out[entry["id"]] = entry
    return out


def timing_errors(records, server_log: dict[str, dict]) -> tuple[list[float], list[float], list[str]]:
    """Per-request TTFT error and per-event ITL error (ms) of ok records against the server's log:
    TTFT error = ttft_ms - (write_wall[0] - t_send_wall) * 1000,
    ITL error  = (arrival_ms[j] - arrival_ms[j-1]) - (write_wall[j] - write_wall[j-1]) * 1000.
    Returns (ttft_errors, itl_errors, problems)."""
    ttft_err, itl_err, problems = [], [], []
    for rec in records.itertuples():
        if rec.outcome != "ok":
            continue
        entry = server_log.get(rec.server_id)
        if entry is None:
            problems.append(f"index {rec.index}: server_id {rec.server_id!r} not in the server log")
            continue
        arrivals = list(rec.arrival_ms)
        writes = entry["write_wall"]
        if list(rec.arrival_tokens) != entry["tokens"] or len(arrivals) != len(writes):
            problems.append(
                f"index {rec.index}: client saw tokens {list(rec.arrival_tokens)}, server wrote {entry['tokens']}"
            )
            continue
        ttft_err.append(rec.ttft_ms - (writes[0] - rec.t_send_wall) * 1000.0)
        for j in range(1, len(arrivals)):
            itl_err.append((arrivals[j] - arrivals[j - 1]) - (writes[j] - writes[j - 1]) * 1000.0)
    return ttft_err, itl_err, problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadlab.testing.scripted", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--host", default="127.0.0.1", help="listen address (loopback only by default)")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--log", default=None, metavar="PATH", help="per-request JSON lines log")
    parser.add_argument("--ttft-ms", type=float, default=100.0, help="request read -> first event")
    parser.add_argument("--gap-ms", type=float, default=20.0, help="time between events")
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.host, args.port, args.ttft_ms, args.gap_ms, args.log))
    return 0


if __name__ == "__main__":
    sys.exit(main())
