"""Every way a stream can end, through real `loadlab run` processes against the scripted server.

The scripted server picks its behaviour from the URL (``/case/<name>``), and cases joined by ``+`` take
turns, one request each, so one run per API covers several cases; the server's log says which case each
request got (joined on server_id; HTTP errors carry no id, their status tells them apart, and so does the
plain-JSON reply). Every run must record every request exactly once, with the right outcome, and complete
with exit status 0.

* one mixed run per API, the three started together (their timing is not checked), with
  idle_timeout_s=1: the failures (stream error event, abort, drop, stall, a non-JSON data line, an
  unexpected event shape), HTTP 400/503, a 200 reply that is not an event stream (generate, chat), OpenAI
  streams without usage (ok, but tokens_per_event_exact false) and, on generate, the attribution headers
  (a worker's, a front's own 429, none); every request is one of the mix's cases, each case as often as
  the mix says;
* a run cut short by -t (started with them): `cancelled` records for the requests in flight, a partial
  manifest, exit 1;
* ok cases (plain, split inside a UTF-8 character, CRLF, SSE comments, 4 tokens per event): one run
  per API, one run at a time after the others, with exact tokens and TTFT / ITL within 2 ms of the
  server's write times at P95.
"""

from __future__ import annotations

import sys

import numpy as np
import pandas as pd
import pytest
from conftest import (
    TIMING_REPORT,
    describe_errors,
    loadlab_run_argv,
    percentile,
    run_loadlab,
    run_loadlab_many,
    timing_errors,
)

# Alone under xdist: the ok cases' timing, and every stream's strictly increasing arrival times (a scripted
# server that falls 20 ms behind writes two events in one read: equal times), in the module's runs too.
pytestmark = pytest.mark.alone

PROFILE = "failures.yaml"
OUTPUT_LEN = 12
TOLERANCE_MS = 2.0
FAIL_AFTER = 3  # the scripted server's error_event / abort / drop / stall come after 3 tokens
PER_CASE = 2  # requests per case in each mixed run (2 in flight)
APIS = ("generate", "completions", "chat")
EXPECTED = {
    "error_event": "stream_error",
    "abort": "stream_error",
    "drop": "dropped",
    "stall": "timeout",
    "garbage": "protocol_error",
    "badshape": "protocol_error",
}
FAILURE_MIX = tuple(EXPECTED)
HTTP_MIX = ("http_400", "http_503")
OK_MIX = ("normal", "split", "crlf", "comments", "multi4")
ATTRIBUTION_MIX = ("worker", "front_429", "normal")
# A run that -t cuts short: 3 in flight, each request needs 100 ms + 1500 x 20 ms = 30 s.
CANCEL_OPTIONS = ["--output-len", "1500", "--concurrency", "3", "--num-requests", "6", "-t", "2s"]


def _mix(cases: tuple[str, ...], api: str) -> str:
    """A mixed case name, rotated per API so that runs going at the same time keep separate turns."""
    k = APIS.index(api) % len(cases)
    return "+".join(cases[k:] + cases[:k])


def _options(api: str, n: int, *extra: str) -> list[str]:
    return ["--api", api, "--num-requests", str(n), "--output-len", str(OUTPUT_LEN), *extra]


# Each API's mixed run: its cases, each PER_CASE times.
MIXES = {
    "generate": FAILURE_MIX + HTTP_MIX + ("notsse",) + ATTRIBUTION_MIX,
    "completions": FAILURE_MIX + HTTP_MIX + ("nousage",),
    "chat": FAILURE_MIX + HTTP_MIX + ("notsse", "nousage"),
}
# The cases whose reply carries no server id the log knows, by HTTP status.
NO_ID = {400: "http_400", 503: "http_503", 429: "front_429", 200: "notsse"}


@pytest.fixture(scope="module")
def runs(scripted_server, tmp_path_factory):
    """Starts every mixed run and the -t run at once and waits for all of them."""
    out = tmp_path_factory.mktemp("failure-runs")
    url = scripted_server.case_url
    jobs = {}
    for api, cases in MIXES.items():
        opts = _options(api, PER_CASE * len(cases), "--set", "target.idle_timeout_s=1")
        jobs[api] = loadlab_run_argv(PROFILE, url(_mix(cases, api)), out / api, *opts)
    opts = ["--api", "generate", *CANCEL_OPTIONS]
    jobs["cancel"] = loadlab_run_argv(PROFILE, url("normal"), out / "cancel", *opts)
    return run_loadlab_many(jobs, timeout_s=150)


def _mixed(runs, scripted_server, api):
    """An API's mixed run: its records, each with the case it got (``case``), and the server's log; every
    request is one of the mix's cases, each case PER_CASE times."""
    cases = MIXES[api]
    df = _checked_records(runs[api], PER_CASE * len(cases))
    assert (df.api == api).all()
    assert df.server_id.dropna().is_unique
    log = scripted_server.log_entries()
    df["case"] = [log[sid]["case"] if sid in log else NO_ID.get(status)
                  for sid, status in zip(df.server_id, df.http_status, strict=True)]  # fmt: skip
    assert sorted(df.case, key=str) == sorted(cases * PER_CASE), df[["index", "case", "outcome", "error"]]
    return df, log


def _checked_records(run, expected_count):
    """The run ended normally and recorded every request exactly once."""
    assert run.returncode == 0, run.explain()
    assert run.run_dir is not None and run.run_dir.is_dir(), run.explain()
    manifest = run.manifest()
    assert manifest.complete is True, manifest
    assert manifest.counts.records == expected_count
    df = run.records()
    assert len(df) == expected_count, df[["index", "outcome", "error"]].to_string()
    assert sorted(df["index"]) == list(range(expected_count))
    assert (df.phase == "measure").all()
    return df


@pytest.mark.parametrize("api", APIS)
def test_stream_failures(runs, scripted_server, api):
    df, log = _mixed(runs, scripted_server, api)
    df = df[df.case.isin(FAILURE_MIX)]
    assert sorted(df.case) == sorted(FAILURE_MIX * PER_CASE)
    for rec in df.itertuples():
        assert rec.outcome == EXPECTED[rec.case], (rec.case, rec.outcome, rec.error)
        CHECKS[rec.outcome](rec, rec.case, api, log)


@pytest.mark.parametrize("api", APIS)
def test_http_errors(runs, scripted_server, api):
    df, _ = _mixed(runs, scripted_server, api)
    df = df[df.case.isin(HTTP_MIX)]
    assert (df.outcome == "http_error").all(), df[["index", "outcome", "error"]].to_string()
    assert sorted(df.http_status) == sorted([400, 503] * PER_CASE)
    for rec in df.itertuples():
        _http_error(rec, f"http_{rec.http_status}", api, None)


@pytest.mark.parametrize("api", ["generate", "chat"])
def test_reply_that_is_not_an_event_stream(runs, scripted_server, api):
    df, _ = _mixed(runs, scripted_server, api)
    df = df[df.case == "notsse"]
    assert len(df) == PER_CASE
    assert (df.outcome == "protocol_error").all(), df[["index", "outcome", "error"]].to_string()
    assert df.error.str.contains("text/event-stream").all()
    assert (df.http_status == 200).all()


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_openai_stream_without_usage(runs, scripted_server, api):
    df, log = _mixed(runs, scripted_server, api)
    df = df[df.case == "nousage"]
    assert len(df) == PER_CASE
    assert (df.outcome == "ok").all(), df[["index", "outcome", "error"]].to_string()
    for rec in df.itertuples():
        _ok(rec, "nousage", api, log)


@pytest.mark.flaky(reruns=1, reruns_delay=2)  # wall-clock timing on a shared machine: see test_client_timing
@pytest.mark.parametrize("api", APIS)
def test_ok_cases_exact_tokens_and_timing(runs, scripted_server, tmp_path, api):
    """normal, split, crlf, comments and multi4 in turn, in one run on a quiet machine (after `runs`)."""
    n = PER_CASE * len(OK_MIX)
    run = run_loadlab(
        PROFILE,
        scripted_server.case_url("+".join(OK_MIX)),
        tmp_path,
        *("--api", api, "--num-requests", str(n), "--output-len", str(OUTPUT_LEN)),
    )
    df = _checked_records(run, n)
    assert (df.outcome == "ok").all(), df[df.outcome != "ok"][["index", "outcome", "error"]].to_string()
    log = scripted_server.log_entries()
    cases = [log[sid]["case"] if sid in log else None for sid in df.server_id]
    assert sorted(cases) == sorted(OK_MIX * PER_CASE), cases
    for rec, case in zip(df.itertuples(), cases, strict=True):
        _ok(rec, case, api, log)
    ttft_err, itl_err, problems = timing_errors(df, log)
    assert not problems, problems
    assert len(ttft_err) == n
    line = describe_errors(f"{api}, {'/'.join(OK_MIX)} ({n} requests, 2 in flight)", ttft_err, itl_err)
    TIMING_REPORT.append(line)
    assert percentile(np.abs(ttft_err), 95) <= TOLERANCE_MS, line
    assert percentile(np.abs(itl_err), 95) <= TOLERANCE_MS, line


def _ok(rec, case, api, log):
    assert rec.http_status == 200
    assert pd.isna(rec.error)
    assert rec.max_new_tokens == OUTPUT_LEN
    assert rec.output_tokens == OUTPUT_LEN
    tokens = list(rec.arrival_tokens)
    assert sum(tokens) == OUTPUT_LEN
    assert len(rec.arrival_ms) == len(tokens)
    assert np.all(np.diff(rec.arrival_ms) > 0)
    assert rec.finish_reason == "length"
    if sys.platform.startswith("linux"):  # the truth on every API with the default clock, the kernel's
        assert rec.receipt_clock == "kernel", rec.receipt_clock
    assert rec.server_id in log, rec.server_id
    entry = log[rec.server_id]
    assert entry["case"] == case and entry["api"] == api and entry["completed"]
    if case == "nousage":
        # No token counts from the server: one token per content chunk, and the record says so.
        assert not rec.tokens_per_event_exact
        assert pd.isna(rec.prompt_tokens)
        return
    assert bool(rec.tokens_per_event_exact)
    assert tokens == entry["tokens"]
    if case == "multi4":
        assert tokens == [4, 4, 4]
    else:
        assert tokens == [1] * OUTPUT_LEN
    assert rec.prompt_tokens == rec.input_len


def _stream_error(rec, case, api, log):
    assert rec.http_status == 200
    assert sum(rec.arrival_tokens) == FAIL_AFTER
    if case == "error_event":
        assert "boom" in rec.error
    else:
        assert rec.finish_reason == "abort"
        assert "abort" in rec.error
        if api == "generate":
            assert "server aborted" in rec.error  # the server's message reaches the record


def _http_error(rec, case, api, log):
    status = int(case[-3:])
    assert rec.http_status == status
    message = "The request queue is full." if status == 503 else "scripted bad request"
    assert message in rec.error, rec.error
    assert len(rec.arrival_ms) == 0 and pd.isna(rec.ttft_ms)


def _dropped(rec, case, api, log):
    assert rec.http_status == 200
    assert sum(rec.arrival_tokens) == FAIL_AFTER
    assert rec.error


def _timeout(rec, case, api, log):
    assert rec.http_status == 200
    assert sum(rec.arrival_tokens) == FAIL_AFTER
    assert "idle" in rec.error, rec.error
    # 100 ms to the first token, 2 more 20 ms apart, then 1 s of silence.
    assert 1100 <= rec.e2e_ms <= 5000, rec.e2e_ms


def _protocol_error(rec, case, api, log):
    assert rec.http_status == 200
    assert ("not JSON" if case == "garbage" else "unexpected event shape") in rec.error, rec.error
    assert sum(rec.arrival_tokens) == 2  # the scripted bad line comes after 2 tokens


CHECKS = {
    "ok": _ok,
    "stream_error": _stream_error,
    "http_error": _http_error,
    "dropped": _dropped,
    "timeout": _timeout,
    "protocol_error": _protocol_error,
}


def test_attribution_headers_become_served_by_and_status_source(runs, scripted_server):
    """A worker's header names the server (the first value when sent twice; it outranks a front's), a
    front's own answer is the front's, and a server that sends neither leaves both null."""
    df, _ = _mixed(runs, scripted_server, "generate")
    df = df[df.case.isin(ATTRIBUTION_MIX)]
    assert sorted(df.case) == sorted(ATTRIBUTION_MIX * PER_CASE)
    for rec in df.itertuples():
        if rec.case == "worker":
            assert (rec.outcome, rec.served_by, rec.status_source) == ("ok", "scripted-worker-1", "worker")
        elif rec.case == "front_429":
            assert (rec.outcome, rec.http_status) == ("rejected", 429), (
                rec
            )  # refused for load, its own outcome
            assert pd.isna(rec.served_by) and rec.status_source == "front"
            assert "too many requests" in rec.error
        else:
            assert rec.outcome == "ok" and pd.isna(rec.served_by) and pd.isna(rec.status_source)


def test_run_time_limit_cancels_in_flight_requests(runs):
    run = runs["cancel"]
    assert run.returncode == 1, run.explain()
    assert run.run_dir is not None and run.run_dir.is_dir(), run.explain()
    manifest = run.manifest()
    assert manifest.complete is False
    # The run stopped at -t (2 s after the test started), not when the 30 s requests would have ended.
    assert manifest.ended_wall - manifest.started_wall < 20, manifest
    df = run.records()
    # The three requests in flight when -t ran out are recorded as cancelled, with what they received.
    assert len(df) == 3, df[["index", "outcome", "error"]].to_string()
    assert manifest.counts.records == 3
    assert sorted(df["index"]) == [0, 1, 2]
    assert (df.outcome == "cancelled").all(), df[["index", "outcome", "error"]].to_string()
    for rec in df.itertuples():
        assert rec.http_status == 200
        assert 10 <= sum(rec.arrival_tokens) < 500  # about 2 s of 20 ms tokens
        assert rec.output_tokens == sum(rec.arrival_tokens)
        assert rec.e2e_ms < 15000
