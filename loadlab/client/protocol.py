"""SGLang's wire protocols without Locust: request bodies and decoding of a timed SSE stream.

The reader (``stream.py``) only timestamps and keeps raw lines; everything here runs after the stream
has ended, off the per-line path, and turns (lines, receipt times) into record fields.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

import orjson

from loadlab.profile import API_PATHS
from loadlab.records import (
    COUNTS_CHUNKS,
    COUNTS_SERVER,
    COUNTS_SPREAD,
    COUNTS_TOKENIZER,
    DROPPED,
    OK,
    PROTOCOL_ERROR,
    STREAM_ERROR,
)

MAX_ERROR_TEXT = 300


def build_body(api: str, spec, renderer, model: str | None, rid: str, prompt=None) -> tuple[str, bytes]:
    """Returns (path, JSON body) for one request spec on the given API. A class's carry goes in the body: its
    ``priority`` (SGLang's field; the profile refuses it with chat, where the router drops it) and its
    ``model`` in place of the run's. ``prompt``: a conversation turn's (``loadlab.workload.Prompt``: the
    session's history and the turn), in place of the spec's own tokens."""
    if api == "generate":
        # A conversation turn goes as its session's ids; a replayed prompt as its token ids when they are the
        # target's (counted by its tokenizer), else as its text, which the server tokenizes itself; a
        # generated prompt as rendered word ids.
        if prompt is not None:
            fields: dict = {"input_ids": prompt.fields["input_ids"]}
        elif spec.raw_ids:
            fields = {"input_ids": list(spec.input_ids)}
        elif spec.text is not None:
            fields = {"text": spec.text}
        else:
            fields = {"input_ids": renderer.token_ids(spec.input_ids)}
        body = {
            **fields,
            "sampling_params": {
                "max_new_tokens": spec.max_new_tokens,
                "ignore_eos": spec.ignore_eos,
                "temperature": 0.0,
            },
            "stream": True,
            "rid": rid,
        }
    else:
        body = {
            "model": spec.model if spec.model is not None else model,
            "max_tokens": spec.max_new_tokens,
            "ignore_eos": spec.ignore_eos,
            "temperature": 0.0,
            "stream": True,
            # continuous_usage_stats gives a cumulative token count on every chunk, so multi-token
            # chunks are counted exactly; include_usage adds the final totals chunk.
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        if prompt is not None:
            body.update(prompt.fields)  # a conversation turn: the session's history and the turn
        elif api == "chat" and spec.messages is not None:
            body["messages"] = [{"role": role, "content": content} for role, content in spec.messages]
        elif api == "completions" and spec.raw_ids and spec.text is None:
            body["prompt"] = list(spec.input_ids)  # a file's token ids: the completions API takes them as is
        else:
            text = spec.text if spec.text is not None else renderer.text(spec.input_ids)
            if api == "completions":
                body["prompt"] = text
            else:
                body["messages"] = [{"role": "user", "content": text}]
    if spec.priority is not None:
        body["priority"] = spec.priority
    return API_PATHS[api], orjson.dumps(body)


def class_headers(spec) -> dict[str, str] | None:
    """The request headers that carry a spec's class (``x-request-id-...: <class name>``), or None."""
    if spec.class_header is None or spec.request_class is None:
        return None
    return {spec.class_header: spec.request_class}


@dataclass(slots=True)
class Decoded:
    """What a finished stream says, as record fields."""

    outcome: str = OK
    error: str | None = None
    server_id: str | None = None
    arrival_times: list[float] = field(default_factory=list)  # receipt times of token-carrying events
    arrival_tokens: list[int] = field(default_factory=list)
    tokens_per_event_exact: bool = True
    arrival_tokens_from: str = COUNTS_SERVER  # where arrival_tokens came from (records.COUNTS_*)
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    num_retractions: int | None = None
    server_queue_s: float | None = None  # meta_info.queue_time (SGLang with --enable-metrics)
    finish_reason: str | None = None
    reply: list[int] | str | None = None  # with ``reply``: the output ids (native) or the text (OpenAI)


def decode_stream(
    api: str, lines: list[bytes], times: list[float], ended_cleanly: bool, reply: bool = False,
    last_whole: bytes | None = None, tokenizer=None,
) -> Decoded:  # fmt: skip
    """Decodes the raw SSE lines of one response. ``ended_cleanly``: the body ended without a transport
    error (a drop or timeout is already known to the caller, who overrides the outcome). ``reply``: also
    keep what the server answered (a conversation feeds it back): the OpenAI chunks' text, or on the native
    API the output ids of ``last_whole``, the last event as it arrived (the reader cuts the others).
    ``tokenizer`` (a ``tokenizers.Tokenizer``, the profile's ``target.tokenizer``): counts the text of
    OpenAI chunks that came without a token count (``count_chunks``)."""
    out = Decoded()
    decode_event = _decode_native if api == "generate" else _decode_openai
    state = _State(reply and api != "generate", tokenizer)
    saw_done = False
    for raw, t in zip(lines, times, strict=True):
        line = raw.rstrip(b"\r\n")
        if not line or line[:1] == b":":  # event separator or SSE comment
            continue
        if line.startswith(b"data:"):
            payload = line[5:].strip()
        elif line.startswith(META_KEY):
            payload = line  # a native event cut by the reader (see parse_event)
        else:
            continue  # other SSE fields (event:, id:, retry:) carry nothing we use
        if payload == b"[DONE]":
            saw_done = True
            continue
        try:
            event = parse_event(payload)
        except orjson.JSONDecodeError:
            out.outcome, out.error = PROTOCOL_ERROR, f"not JSON in a data line: {_clip(payload)}"
            return out
        if not isinstance(event, dict):
            out.outcome, out.error = PROTOCOL_ERROR, f"data line is not a JSON object: {_clip(payload)}"
            return out
        if "error" in event:
            out.outcome, out.error = STREAM_ERROR, _error_text(event["error"])
            state.finish(out)
            return out
        try:
            decode_event(event, t, state, out)
        except Exception as e:  # any shape we did not expect is the server's protocol error, not a crash
            out.outcome = PROTOCOL_ERROR
            out.error = f"unexpected event shape ({type(e).__name__}: {e}): {_clip(payload)}"
            return out
        if out.outcome != OK:
            state.finish(out)
            return out
    state.finish(out)
    if ended_cleanly and not saw_done and out.finish_reason is None:
        out.outcome, out.error = DROPPED, "stream ended without a finish_reason or [DONE]"
    if reply and api == "generate":
        out.reply = _native_output_ids(last_whole)
    return out


def _native_output_ids(line: bytes | None) -> list[int] | None:
    """The cumulative ``output_ids`` of a whole native event line (None when it has none)."""
    if not line:
        return None
    try:
        ids = parse_event(line.rstrip(b"\r\n").removeprefix(b"data:").strip()).get("output_ids")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return ids if isinstance(ids, list) and all(type(i) is int for i in ids) else None


META_KEY = b'"meta_info":'


def parse_event(payload: bytes) -> dict:
    """Parses one data payload. A native line may have been cut by the reader to start at its
    ``"meta_info":`` key (see ``StreamingClient.post_stream``): a quote followed by meta_info and a colon
    cannot occur inside a JSON string (the quote would be escaped), so the cut is at a top-level key and
    ``{`` + the rest is the same object without the cumulative text."""
    if payload.startswith(META_KEY):
        return orjson.loads(b"{" + payload)
    return orjson.loads(payload)


class _State:
    __slots__ = ("tokens", "uncounted", "uncounted_texts", "final_usage_tokens", "texts", "tokenizer")

    def __init__(self, reply: bool = False, tokenizer=None):
        self.tokens = 0  # tokens counted so far from the server's cumulative counters
        self.uncounted: list[int] = []  # OpenAI content chunks seen without a token count: their events
        self.uncounted_texts: list[str] = []  # and their text
        self.final_usage_tokens = None
        self.texts: list[str] | None = [] if reply else None  # the OpenAI chunks' text, when kept
        self.tokenizer = tokenizer

    def finish(self, out: Decoded) -> None:
        if self.texts is not None:
            out.reply = "".join(self.texts)
        if self.uncounted:
            self._count_uncounted(out)
        if self.final_usage_tokens is not None:
            out.output_tokens = self.final_usage_tokens
        elif out.output_tokens is None and out.arrival_tokens:
            out.output_tokens = sum(out.arrival_tokens)

    def _count_uncounted(self, out: Decoded) -> None:
        """The server counted some content chunks not at all (it ignored ``continuous_usage_stats``): give
        them tokens, from the tokenizer when there is one, else by spreading the server's final count
        (``spread_tokens``); without a final count, the tokenizer's counts or one per chunk. Events left
        with no token leave the lists (the time is part of the next gap)."""
        out.tokens_per_event_exact = False
        rest = None  # the final count less what the server counted itself
        if self.final_usage_tokens is not None:
            rest = max(0, self.final_usage_tokens - self.tokens)
        counts = count_chunks(self.tokenizer, self.uncounted_texts)
        if counts is not None:
            out.arrival_tokens_from = COUNTS_TOKENIZER
            if rest is not None:
                if sum(counts) == rest:
                    out.tokens_per_event_exact = True  # the tokenizer agrees with the server's total
                else:
                    counts = reconcile_counts(counts, rest)
        elif rest is not None:
            out.arrival_tokens_from = COUNTS_SPREAD
            counts = spread_tokens(rest, len(self.uncounted))
        else:
            out.arrival_tokens_from = COUNTS_CHUNKS
            counts = [1] * len(self.uncounted)
        for event, n in zip(self.uncounted, counts, strict=True):
            out.arrival_tokens[event] = n
        if 0 in counts:
            keep = [j for j, n in enumerate(out.arrival_tokens) if n > 0]
            out.arrival_times = [out.arrival_times[j] for j in keep]
            out.arrival_tokens = [out.arrival_tokens[j] for j in keep]


def spread_tokens(total: int, chunks: int) -> list[int]:
    """``total`` tokens over ``chunks`` content chunks that came without counts, in order. Servers send a
    fixed number of tokens a chunk (their stream interval) and a short last chunk, so each chunk gets
    ``ceil(total / chunks)`` tokens, from the first on, while the chunks after it can still have one each;
    the last chunks take the rest (``[4, 4, 4, 2]`` for 14 tokens over 4 chunks, ``[3, 3, 2, 1]`` for 9).
    Fewer tokens than chunks: one each to the first ``total``, none to the others. The sum is ``total``."""
    total = max(0, total)
    if total < chunks:
        return [1] * total + [0] * (chunks - total)
    if chunks == 0:
        return []
    size = -(-total // chunks)  # ceil
    counts, left = [], total
    for j in range(chunks):
        n = min(size, left - (chunks - 1 - j))  # at least 1: left >= chunks - j
        counts.append(n)
        left -= n
    return counts


def reconcile_counts(counts: list[int], total: int) -> list[int]:
    """The tokenizer's per-chunk ``counts`` made to sum to the server's ``total``: tokens the server counted
    beyond the text's (an end-of-sequence token has no text) go to the last chunk; tokens too many (merges
    across chunk boundaries) come off the last chunks, down to one each (then to none, the last first)."""
    out = list(counts)
    diff = total - sum(out)
    if diff > 0 and out:
        out[-1] += diff
    for floor in (1, 0):
        for j in range(len(out) - 1, -1, -1):
            if diff >= 0:
                break
            take = min(out[j] - floor, -diff)
            if take > 0:
                out[j] -= take
                diff += take
    return out


def count_chunks(tokenizer, texts: list[str]) -> list[int] | None:
    """Each chunk's text counted with ``tokenizer`` (without special tokens), or None without one.
    The text is encoded once, whole; a token belongs to the chunk its last character arrived in."""
    if tokenizer is None or not texts:
        return None
    enc = tokenizer.encode("".join(texts), add_special_tokens=False)
    ends = list(itertools.accumulate(len(t) for t in texts))
    counts = [0] * len(texts)
    for start, end in enc.offsets:
        counts[min(bisect.bisect_left(ends, max(end, start + 1)), len(texts) - 1)] += 1
    return counts


def _decode_native(event: dict, t: float, state: _State, out: Decoded) -> None:
    meta = event["meta_info"]
    completion = int(meta["completion_tokens"])
    new = completion - state.tokens
    if new > 0:
        out.arrival_times.append(t)
        out.arrival_tokens.append(new)
        state.tokens = completion
    out.output_tokens = completion
    out.server_id = meta.get("id", out.server_id)
    out.prompt_tokens = meta.get("prompt_tokens", out.prompt_tokens)
    out.cached_tokens = meta.get("cached_tokens", out.cached_tokens)
    out.num_retractions = meta.get("num_retractions", out.num_retractions)
    queue = meta.get("queue_time")  # seconds in the waiting queue, once the request was scheduled
    if isinstance(queue, int | float) and not isinstance(queue, bool):
        out.server_queue_s = float(queue)
    finish = meta.get("finish_reason")
    if finish is not None:
        kind = finish.get("type") if isinstance(finish, dict) else str(finish)
        out.finish_reason = kind
        if kind == "abort":
            out.outcome = STREAM_ERROR
            out.error = "aborted by server: " + _clip(str(finish.get("message", "")))


def _decode_openai(event: dict, t: float, state: _State, out: Decoded) -> None:
    out.server_id = event.get("id", out.server_id)
    usage = event.get("usage")
    choices = event.get("choices") or []
    content = ""
    if choices:
        choice = choices[0]
        delta = choice.get("delta")
        content = (delta.get("content") or "") if delta is not None else (choice.get("text") or "")
        finish = choice.get("finish_reason")
        if finish is not None:
            out.finish_reason = finish
            if finish == "abort":
                out.outcome, out.error = STREAM_ERROR, "aborted by server"
        if content and state.texts is not None:
            state.texts.append(content)
    if usage:
        completion = usage.get("completion_tokens")
        out.prompt_tokens = usage.get("prompt_tokens", out.prompt_tokens)
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            out.cached_tokens = details["cached_tokens"]
        if completion is not None:
            completion = int(completion)
            if not choices:  # the final usage-only chunk
                state.final_usage_tokens = completion
            new = completion - state.tokens
            if new > 0 and choices:
                out.arrival_times.append(t)
                out.arrival_tokens.append(new)
                state.tokens = completion
            return
    if content:
        # No token count on this chunk: the tokens are given when the stream has ended (_State.finish).
        state.uncounted.append(len(out.arrival_tokens))
        state.uncounted_texts.append(content)
        out.arrival_times.append(t)
        out.arrival_tokens.append(1)


def error_from_body(status: int, body: bytes) -> str:
    """One line describing an HTTP error response, from its JSON body where there is one."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return f"HTTP {status}: {_clip(body)}" if body else f"HTTP {status}"
    if isinstance(data, dict):
        detail = data.get("error", data.get("message", data.get("detail", data)))
        return f"HTTP {status}: {_error_text(detail)}"
    return f"HTTP {status}: {_clip(body)}"


def _error_text(err) -> str:
    if isinstance(err, dict):
        err = err.get("message", err)
    return _clip(err if isinstance(err, str) else orjson.dumps(err).decode())


def _clip(value) -> str:
    if isinstance(value, bytes | bytearray):
        value = bytes(value).decode("utf-8", "replace")
    value = str(value).replace("\n", " ")
    return value if len(value) <= MAX_ERROR_TEXT else value[:MAX_ERROR_TEXT] + "..."
