"""ITL when the server counts tokens only at the end (docs/metrics.md, "ITL when the server counts only at
the end"): the rules that give the chunks their tokens, and real `loadlab run` processes against the
scripted server's ``multi4_endusage`` case (4 tokens a chunk, the last the rest; ``continuous_usage_stats``
ignored, ``include_usage`` honoured) checked against the server's own write log:
  truth per token = (write_wall[j] - write_wall[j-1]) * 1000 / tokens[j], repeated tokens[j] times
(the scripted server's tokens[j] is what it put in write j), against loadlab's per-token ITL samples.
"""

from __future__ import annotations

import json
import re

import numpy as np
import orjson
import pytest
from conftest import TIMING_REPORT, percentile, run_loadlab

from loadlab.analysis.stats import itl_samples
from loadlab.client.protocol import count_chunks, decode_stream, reconcile_counts, spread_tokens
from loadlab.records import COUNTS_CHUNKS, COUNTS_SERVER, COUNTS_SPREAD, COUNTS_TOKENIZER

TOLERANCE_MS = 1.5  # the acceptance: ITL per token right within 1.5 ms, flagged estimated
GAP_MS = 20.0  # the session's scripted server: first event after 100 ms, then every 20 ms

# ---------------------------------------------------------------------------------------------------
# The rules, in isolation


@pytest.mark.parametrize(
    "total,chunks,expected",
    [
        (32, 8, [4] * 8),  # no remainder
        (30, 8, [4] * 7 + [2]),  # a short last chunk: exactly what a 4-a-chunk server sent
        (14, 4, [4, 4, 4, 2]),
        (9, 4, [3, 3, 2, 1]),  # the rest over the last chunks, one each at least
        (13, 4, [4, 4, 4, 1]),
        (5, 5, [1] * 5),
        (3, 5, [1, 1, 1, 0, 0]),  # fewer tokens than chunks: the first ones, the rest none
        (0, 3, [0, 0, 0]),
        (7, 1, [7]),
        (4, 0, []),
    ],
)
def test_spread_tokens(total, chunks, expected):
    got = spread_tokens(total, chunks)
    assert got == expected
    assert sum(got) == (total if chunks else 0)


def test_spread_tokens_sums_and_shape():
    for chunks in range(1, 40):
        for total in range(0, 200):
            got = spread_tokens(total, chunks)
            assert len(got) == chunks and sum(got) == total
            assert got == sorted(got, reverse=True)  # never more tokens after fewer
            if total >= chunks:
                assert min(got) >= 1 and max(got) == -(-total // chunks)


@pytest.mark.parametrize(
    "counts,total,expected",
    [
        ([4, 4, 4], 12, [4, 4, 4]),
        ([4, 4, 4], 13, [4, 4, 5]),  # an end-of-sequence token without text: the last chunk
        ([4, 4, 4], 10, [4, 4, 2]),  # merges across boundaries: off the last chunks
        ([4, 4, 4], 2, [1, 1, 0]),  # down to one each, then to none, the last first
        ([0, 3], 4, [0, 4]),
    ],
)
def test_reconcile_counts(counts, total, expected):
    got = reconcile_counts(counts, total)
    assert got == expected and sum(got) == total


class _Encoding:
    def __init__(self, offsets):
        self.offsets = offsets


class WordTokenizer:
    """A stand-in for a ``tokenizers.Tokenizer``: one token per whitespace-led word, with char offsets."""

    def encode(self, text: str, add_special_tokens: bool = False) -> _Encoding:
        assert add_special_tokens is False
        return _Encoding([(m.start(), m.end()) for m in re.finditer(r"\s*\S+", text)])


def test_count_chunks_by_last_character():
    tok = WordTokenizer()
    assert count_chunks(None, [" a b"]) is None
    assert count_chunks(tok, [" a b", " c", " d e f"]) == [2, 1, 3]
    # A word cut between chunks belongs to the chunk its last character came in; a chunk that completes no
    # token carries none.
    assert count_chunks(tok, [" a b", " c", "d", " e"]) == [2, 0, 1, 1]


# ---------------------------------------------------------------------------------------------------
# Decoding a stream that counts only at the end


def _completion(text: str, usage=None, finish=None) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return b"data: " + orjson.dumps({"id": "c1", "choices": [choice], "usage": usage}) + b"\n"


def _chat(delta: dict, usage=None, finish=None) -> bytes:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return b"data: " + orjson.dumps({"id": "c1", "choices": [choice], "usage": usage}) + b"\n"


def _usage(n: int) -> bytes:
    usage = {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}
    return b"data: " + orjson.dumps({"id": "c1", "choices": [], "usage": usage}) + b"\n"


DONE = b"data: [DONE]\n"


def _decode(api, lines, tokenizer=None):
    times = [0.1 * j for j in range(len(lines))]
    return decode_stream(api, lines, times, ended_cleanly=True, tokenizer=tokenizer), times


def test_final_count_is_spread_over_the_content_chunks():
    lines = [_completion(" a b c d"), b"\n", _completion(" e f g h"), _completion(" i j", finish="length"),
             _usage(10), DONE]  # fmt: skip
    d, times = _decode("completions", lines)
    assert d.outcome == "ok"
    assert d.arrival_tokens == [4, 4, 2] and d.output_tokens == 10 == sum(d.arrival_tokens)
    assert d.arrival_times == [times[0], times[2], times[3]]
    assert not d.tokens_per_event_exact and d.arrival_tokens_from == COUNTS_SPREAD


def test_chunks_without_text_carry_nothing():
    """Chat's role chunk, an empty content chunk and the finish chunk are no token-carrying events."""
    lines = [
        _chat({"role": "assistant", "content": ""}),
        _chat({"content": " a b c d"}),
        _chat({"content": ""}),
        _chat({"content": " e f g h"}),
        _chat({"content": " i"}),
        _chat({}, finish="length"),
        _usage(9),
        DONE,
    ]
    d, times = _decode("chat", lines)
    assert d.arrival_times == [times[1], times[3], times[4]]
    assert d.arrival_tokens == [3, 3, 3]  # the rule knows only the count: 9 over 3 chunks
    assert d.output_tokens == 9 and not d.tokens_per_event_exact
    # With a tokenizer: the chunks' own counts, which add up to the server's: exact.
    d, _ = _decode("chat", lines, WordTokenizer())
    assert d.arrival_tokens == [4, 4, 1] and d.output_tokens == 9
    assert d.tokens_per_event_exact and d.arrival_tokens_from == COUNTS_TOKENIZER


def test_tokenizer_counts_that_disagree_yield_to_the_final_count():
    lines = [_completion(" a b c d"), _completion(" e f g h", finish="stop"), _usage(9), DONE]  # + EOS
    d, _ = _decode("completions", lines, WordTokenizer())
    assert d.arrival_tokens == [4, 5] and d.output_tokens == 9
    assert not d.tokens_per_event_exact and d.arrival_tokens_from == COUNTS_TOKENIZER


def test_a_stream_without_usage_counts_one_per_chunk():
    lines = [_completion(" a b c d"), _completion(" e f g h"), _completion(" i j", finish="length"), DONE]
    d, _ = _decode("completions", lines)
    assert d.outcome == "ok" and d.arrival_tokens == [1, 1, 1] and d.output_tokens == 3
    assert not d.tokens_per_event_exact and d.arrival_tokens_from == COUNTS_CHUNKS
    d, _ = _decode("completions", lines, WordTokenizer())  # the tokenizer's counts, unchecked
    assert d.arrival_tokens == [4, 4, 2] and d.output_tokens == 10
    assert not d.tokens_per_event_exact and d.arrival_tokens_from == COUNTS_TOKENIZER


def test_server_counts_are_untouched():
    usage = lambda n: {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}  # noqa: E731
    lines = [_completion(" a b c d", usage(4)), _completion(" e f", usage(6), "length"), _usage(6), DONE]
    d, _ = _decode("completions", lines, WordTokenizer())
    assert d.arrival_tokens == [4, 2] and d.tokens_per_event_exact and d.arrival_tokens_from == COUNTS_SERVER
    native = [b"data: " + orjson.dumps({"text": "x", "meta_info": {"id": "g", "completion_tokens": n,
              "finish_reason": None if n < 8 else {"type": "length"}}}) + b"\n" for n in (4, 8)]  # fmt: skip
    d, _ = _decode("generate", [*native, DONE], WordTokenizer())
    assert d.arrival_tokens == [4, 4] and d.tokens_per_event_exact and d.arrival_tokens_from == COUNTS_SERVER


def test_mixed_counts_give_the_uncounted_chunks_the_rest():
    """Usage on some chunks only: their cumulative counts stand, the uncounted chunks share the rest."""
    usage = {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
    lines = [_completion(" a b c d", usage), _completion(" e f g h"), _completion(" i j", finish="length"),
             _usage(10), DONE]  # fmt: skip
    d, _ = _decode("completions", lines)
    assert d.arrival_tokens == [4, 3, 3] and sum(d.arrival_tokens) == d.output_tokens == 10
    assert not d.tokens_per_event_exact


# ---------------------------------------------------------------------------------------------------
# Truth: real runs against the scripted server


def _truth_per_token(entry: dict) -> np.ndarray:
    writes = np.asarray(entry["write_wall"], dtype=float) * 1000.0
    tokens = np.asarray(entry["tokens"], dtype=np.int64)
    return np.repeat(np.diff(writes) / tokens[1:], tokens[1:])


# (api, users, warm-up, measured, output tokens)
TRUTH_RUNS = [
    pytest.param("completions", 1, 1, 6, 30, id="completions-1user-remainder"),
    pytest.param("chat", 1, 1, 6, 30, id="chat-1user-remainder"),
    pytest.param("completions", 16, 8, 48, 32, id="completions-16users"),
    pytest.param("chat", 16, 8, 48, 32, id="chat-16users"),
]


# Wall-clock timing on a shared 2-core machine: one rerun absorbs a burst of outside load.
@pytest.mark.alone
@pytest.mark.flaky(reruns=1, reruns_delay=2)
@pytest.mark.parametrize("api,users,warmup,measured,output_len", TRUTH_RUNS)
def test_itl_per_token_against_the_server_when_it_counts_only_at_the_end(
    scripted_server, tmp_path, api, users, warmup, measured, output_len
):
    run = run_loadlab(
        "timing.yaml",
        scripted_server.case_url("multi4_endusage"),
        tmp_path,
        "--set",
        f"target.api={api}",
        "--concurrency",
        str(users),
        "--warmup-requests",
        str(warmup),
        "--num-requests",
        str(measured),
        "--output-len",
        str(output_len),
    )
    assert run.returncode == 0, run.explain()
    df = run.records()
    assert len(df) == warmup + measured
    assert (df.outcome == "ok").all(), df[df.outcome != "ok"][["index", "outcome", "error"]].to_string()
    meas = df[df.phase == "measure"]
    log = scripted_server.log_entries()

    errors, truth_all, client_all = [], [], []
    for rec in meas.itertuples():
        entry = log[rec.server_id]
        assert entry["case"] == "multi4_endusage" and entry["api"] == api and entry["completed"]
        assert entry["max_buffered"] == 0  # every write_wall is when the bytes left the server
        # Output tokens exact, the events' tokens add up to them, flagged estimated.
        assert rec.output_tokens == output_len
        assert sum(rec.arrival_tokens) == rec.output_tokens
        assert len(rec.arrival_ms) == len(entry["write_wall"])
        assert not rec.tokens_per_event_exact and rec.arrival_tokens_from == COUNTS_SPREAD
        assert rec.ttft_ms == rec.arrival_ms[0]
        truth = _truth_per_token(entry)
        mine, _ = itl_samples(rec.arrival_ms, rec.arrival_tokens)
        assert mine.size == truth.size, (list(rec.arrival_tokens), entry["tokens"])
        errors.append(mine - truth)
        truth_all.append(truth)
        client_all.append(mine)
    err = np.abs(np.concatenate(errors))
    truth_all, client_all = np.concatenate(truth_all), np.concatenate(client_all)

    summary = json.loads((run.run_dir / "summary.json").read_text())
    stats = {q: percentile(truth_all, q) for q in (50, 95, 99)}
    line = (
        f"{api} multi4_endusage at {users} user(s), {measured} requests x {output_len} tokens: "
        f"|ITL per token error| n={err.size} median {percentile(err, 50):.3f} P95 {percentile(err, 95):.3f} "
        f"max {err.max():.3f} ms; summary ITL P50/P95/P99 {summary['median_itl_ms']:.2f}/"
        f"{summary['p95_itl_ms']:.2f}/{summary['p99_itl_ms']:.2f} against the server's "
        f"{stats[50]:.2f}/{stats[95]:.2f}/{stats[99]:.2f} ms"
    )
    print(line)
    TIMING_REPORT.append(line)
    # Per sample, and the report's figures against the server's own distribution.
    assert percentile(err, 95) <= TOLERANCE_MS, line
    assert abs(summary["mean_itl_ms"] - truth_all.mean()) <= TOLERANCE_MS, line
    for key, q in (("median_itl_ms", 50), ("p95_itl_ms", 95), ("p99_itl_ms", 99)):
        assert abs(summary[key] - stats[q]) <= TOLERANCE_MS, (key, line)
    assert abs(summary["mean_itl_per_event_ms"] - GAP_MS) < 1.0  # the raw gaps are the server's cadence
    # Flagged estimated, everywhere the ITL is shown.
    assert summary["itl_estimated"] is True and summary["itl_estimated_ratio"] == 1.0
    assert summary["arrival_tokens_from"] == {COUNTS_SPREAD: measured}
    assert summary["total_output_tokens"] == measured * output_len
    md = (run.run_dir / "summary.md").read_text()
    assert "**ITL estimated**: the server sent token counts only at the end; 100% of requests" in md
    assert "| ITL (per token), estimated |" in md
    html = (run.run_dir / "report.html").read_text()
    assert "ITL estimated</b>: the server sent token counts only at the end; 100% of requests" in html
    assert "ITL (est.)" in run.stdout + run.stderr  # the console block


def test_native_api_is_never_estimated(scripted_server, tmp_path):
    """The same case on /generate: meta_info counts every event, so nothing is estimated."""
    run = run_loadlab(
        "timing.yaml",
        scripted_server.case_url("multi4_endusage"),
        tmp_path,
        "--warmup-requests",
        "1",
        "--num-requests",
        "3",
        "--output-len",
        "30",
    )
    assert run.returncode == 0, run.explain()
    df = run.records()
    assert (df.outcome == "ok").all()
    for rec in df.itertuples():
        assert rec.tokens_per_event_exact and rec.arrival_tokens_from == COUNTS_SERVER
        assert list(rec.arrival_tokens) == [4] * 7 + [2]
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert summary["itl_estimated"] is False and summary["itl_estimated_ratio"] == 0.0
    assert summary["arrival_tokens_from"] == {COUNTS_SERVER: 3}
    assert "ITL estimated" not in (run.run_dir / "summary.md").read_text()


# ---------------------------------------------------------------------------------------------------
# The run's figures say it: summary.json, summary.md, report.html, the console block, compare


def _records():
    from test_analysis import decoding, rec

    exact = [rec(i, t=0.1 * i, events=decoding(8, 100.0, 10.0), e2e=200.0) for i in range(2)]
    spread = rec(2, t=0.2, events=[(100.0, 4), (140.0, 4)], e2e=150.0, exact=False)
    spread.arrival_tokens_from = COUNTS_SPREAD
    old = rec(3, t=0.3, events=[(100.0, 1), (140.0, 1)], output=8, e2e=150.0, exact=False)
    old.arrival_tokens_from = None  # a record written before the field: inexact, so one per chunk
    return [*exact, spread, old]


def test_summary_marks_estimated_itl_everywhere(tmp_path):
    from test_analysis import summarize

    from loadlab.analysis.compare import compare, render
    from loadlab.analysis.console import render_console

    (tmp_path / "est").mkdir()
    (tmp_path / "plain").mkdir()
    s = summarize(tmp_path / "est", _records(), html=True)
    assert s.tokens_per_event_inexact == 2 and s.itl_estimated is True and s.itl_estimated_ratio == 0.5
    assert s.arrival_tokens_from == {COUNTS_CHUNKS: 1, COUNTS_SERVER: 2, COUNTS_SPREAD: 1}
    note = "ITL estimated: the server sent token counts only at the end (or none); 50% of requests (2 of 4"
    md = (tmp_path / "est" / "summary.md").read_text()
    assert "> **" + note.replace(": ", "**: ", 1) in md
    assert "| ITL (per token), estimated |" in md and "| TPOT (decode), estimated |" in md
    assert "| ITL (per event) |" in md and "| TPOT |" in md  # receipt times and the server's total: exact
    assert "the final count spread over the chunks: 1" in md
    html = (tmp_path / "est" / "report.html").read_text()
    assert "<p class='itl-counts' data-estimated='true'><b>ITL estimated</b>" in html
    console = render_console(s)
    assert "ITL (est.)" in console and note in console

    plain = summarize(tmp_path / "plain", _records()[:2])
    assert plain.itl_estimated is False and plain.itl_estimated_ratio == 0.0
    assert plain.arrival_tokens_from == {COUNTS_SERVER: 2}
    assert "ITL estimated" not in (tmp_path / "plain" / "summary.md").read_text()
    assert "ITL (est.)" not in render_console(plain) and "ITL (per token), estimated" not in render_console(
        plain
    )
    text = render(tmp_path / "plain", tmp_path / "est", plain, s, compare(plain, s))
    assert "note: B: " + note in text and "note: A:" not in text
    assert "ITL P95 (est. B)" in text


def test_tokenizer_counts_that_add_up_are_said_not_estimated(tmp_path):
    from test_analysis import decoding, rec, summarize

    r = rec(0, events=[(100.0, 4), (140.0, 4)], e2e=150.0)
    r.arrival_tokens_from = COUNTS_TOKENIZER
    s = summarize(tmp_path, [r, rec(1, t=0.1, events=decoding(8, 100.0, 10.0), e2e=200.0)])
    assert s.itl_estimated is False and s.arrival_tokens_from == {COUNTS_SERVER: 1, COUNTS_TOKENIZER: 1}
    md = (tmp_path / "summary.md").read_text()
    assert "> **ITL counted by the client**: the server sent token counts only at the end; each chunk's text " \
        "counted with target.tokenizer: 1 (50% of requests)" in md  # fmt: skip
    assert "ITL (per token), estimated" not in md


def test_a_summary_written_before_the_fields_still_says_it(tmp_path):
    from test_analysis import summarize

    from loadlab.analysis import Summary
    from loadlab.analysis.summary import itl_estimated, itl_notes

    s = summarize(tmp_path, _records())
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    old = {
        k: v
        for k, v in on_disk.items()
        if k not in ("itl_estimated", "itl_estimated_ratio", "arrival_tokens_from")
    }
    (tmp_path / "summary.json").write_text(json.dumps({**old, "version": 5, "schema": "loadlab.summary/5"}))
    back = Summary.read(tmp_path)
    assert back.itl_estimated is False and back.arrival_tokens_from == {}  # the defaults
    assert itl_estimated(back) and itl_notes(back)[0].startswith("ITL estimated: ")
    assert s.version == 6


def test_count_chunks_with_a_real_tokenizer():
    """A trained ``tokenizers`` BPE (no hub): chunks cut at word boundaries, with non-ASCII words, are counted
    as the tokenizer counts each chunk on its own (its offsets are characters, not UTF-8 bytes)."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    words = ["naïve", "café", "Grüße", "token", "stream", "日本語", "latency", "über"]
    corpus = [" ".join(words[i:] + words[:i]) for i in range(len(words))] * 20
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]"], show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    chunks = [" naïve café", " Grüße", " 日本語 token stream", " über latency", " café"]
    own = [len(tok.encode(c, add_special_tokens=False).ids) for c in chunks]
    assert sum(own) > len(chunks) * 2  # the small vocabulary splits words: the counts are not trivial
    assert count_chunks(tok, chunks) == own
