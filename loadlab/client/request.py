"""One request from spec to record, without Locust: build the body, stream it, decode, fill the record."""

from __future__ import annotations

import time

from loadlab.client.protocol import META_KEY, build_body, class_headers, decode_stream, error_from_body
from loadlab.client.stream import Exchange, StreamingClient
from loadlab.records import (
    CANCELLED,
    CLOCK_KERNEL,
    CLOCK_MIXED,
    CLOCK_USER,
    HTTP_ERROR,
    OK,
    PROTOCOL_ERROR,
    REJECTED,
    RequestRecord,
)


def new_exchange() -> Exchange:
    return Exchange(t_send=time.perf_counter(), t_send_wall=time.time())


def send(
    client: StreamingClient, api: str, spec, renderer, model: str | None, rid: str, ex: Exchange, prompt=None
) -> None:
    """Streams one request into ``ex`` (the caller owns it, so a cancelled request still has its data).
    ``prompt``: a conversation turn's (``Dialogue.prompt(spec)``)."""
    path, body = build_body(api, spec, renderer, model, rid, prompt)
    keep_from = META_KEY if api == "generate" else None
    client.post_stream(path, body, ex, keep_from=keep_from, headers=class_headers(spec))


def coalesced_reads(times: list[float]) -> int:
    """Reads that completed more than one token event: the reader gives every line a read completes that
    read's time, so such events have equal times (two reads never do: their clocks tick in ns)."""
    n, prev, run = 0, None, False
    for t in times:
        if t == prev:
            if not run:
                n += 1
                run = True
        else:
            prev, run = t, False
    return n


def to_record(
    ex: Exchange, api: str, spec, phase: str, worker_id: str, user_id: int, cancelled=False, dialogue=None,
    tokenizer=None,
):  # fmt: skip
    """Turns a finished (or cancelled) exchange into the request's record. ``dialogue``: the conversation the
    request was a turn of (``loadlab.workload.Dialogue``): the record takes the length of the prompt sent,
    and the server's reply goes into the dialogue for the next turn. ``tokenizer``: the profile's
    ``target.tokenizer`` (loaded), which counts the chunks of a server that sends no count per chunk."""
    rec = RequestRecord(
        index=spec.index,
        phase=phase,
        api=api,
        worker_id=worker_id,
        user_id=user_id,
        t_send_wall=ex.t_send_wall,
        http_status=ex.status,
        input_len=spec.input_len if dialogue is None else dialogue.input_len,
        max_new_tokens=spec.max_new_tokens,
        prefix_group=spec.prefix_group,
        request_class=spec.request_class,
        served_by=ex.served_by,
        status_source=ex.status_source,
        session=spec.session,
        turn=spec.turn,
    )
    if ex.kernel_reads or ex.user_reads:
        both = ex.kernel_reads and ex.user_reads
        rec.receipt_clock = CLOCK_MIXED if both else (CLOCK_KERNEL if ex.kernel_reads else CLOCK_USER)
    t_end = ex.t_end if ex.t_end is not None else time.perf_counter()
    rec.e2e_ms = (t_end - ex.t_send) * 1000.0
    if ex.transport == HTTP_ERROR:
        # A 429 is a refusal for load (a full queue), not a broken server: an outcome of its own.
        rec.outcome = REJECTED if ex.status == 429 else HTTP_ERROR
        rec.error = error_from_body(ex.status, ex.body)
        return rec
    clean = ex.transport == OK and not cancelled
    want = dialogue is not None and not cancelled
    decoded = decode_stream(
        api, ex.lines, ex.times, ended_cleanly=clean, reply=want, last_whole=ex.last_whole,
        tokenizer=tokenizer,
    )  # fmt: skip
    if want:
        dialogue.reply(decoded.reply, decoded.output_tokens or 0)
    t0 = ex.t_send
    rec.arrival_ms = [(t - t0) * 1000.0 for t in decoded.arrival_times]
    rec.arrival_tokens = decoded.arrival_tokens
    rec.ttft_ms = rec.arrival_ms[0] if rec.arrival_ms else None
    rec.coalesced_reads = coalesced_reads(decoded.arrival_times)
    rec.tokens_per_event_exact = decoded.tokens_per_event_exact
    rec.arrival_tokens_from = decoded.arrival_tokens_from
    rec.server_id = decoded.server_id
    rec.prompt_tokens = decoded.prompt_tokens
    rec.output_tokens = decoded.output_tokens
    rec.cached_tokens = decoded.cached_tokens
    rec.num_retractions = decoded.num_retractions
    rec.server_queue_ms = None if decoded.server_queue_s is None else decoded.server_queue_s * 1000.0
    rec.finish_reason = decoded.finish_reason
    rec.outcome, rec.error = decoded.outcome, decoded.error
    if cancelled:
        rec.outcome, rec.error = CANCELLED, "the run stopped while the request was in flight"
    elif ex.transport != OK:
        # A transport failure (drop, timeout, connect) outranks what the partial stream said.
        rec.outcome, rec.error = ex.transport, ex.error
    elif rec.outcome == OK and rec.output_tokens is None:
        rec.outcome, rec.error = PROTOCOL_ERROR, "the server reported no completion token count"
    return rec
