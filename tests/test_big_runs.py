"""Big runs (issue 17, part 5): the records written a row group at a time, the post-processor on flat
per-event arrays and exact order statistics by bracketing, each checked against a straightforward reference
(numpy per request on the raw records, np.percentile, a one-shot table), never against itself."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from loadlab.analysis import write_report
from loadlab.analysis.html import _in_flight_per_second, _median_per_second
from loadlab.analysis.itl import EventSource, RunEvents, itl_figures, scan_events, weighted_kth
from loadlab.analysis.metrics import compute_summary, counts_from, flight_steps, in_flight, record_events
from loadlab.analysis.stats import BRACKET_MIN, Events, lists_batch, order_statistics, quantiles
from loadlab.manifest import Counts, Manifest, TargetInfo, software_versions, write_manifest
from loadlab.records import (
    RECORD_FIELDS,
    RECORDS_CSV,
    RECORDS_JSONL,
    RECORDS_PARQUET,
    IndexSet,
    RecordWriter,
    RequestRecord,
    TableWriter,
    _arrow_table,
    _csv_table,
    _event_columns,
    load_records,
    read_ahead,
    read_jsonl_records,
    recorded_indices,
    write_parquet,
)

T0 = 1_700_000_000.0
CLASSES = ("interactive", "batch")


def make_records(n: int, seed: int = 0) -> list[RequestRecord]:
    """Records of every shape the reader meets: multi-token events, failures that keep what arrived, no
    events, no token counts (one per event), a ragged pair, zero-token and non-finite events."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        n_events = int(rng.integers(1, 40))
        tok = rng.choice([1, 1, 1, 2, 3], n_events).tolist()
        ms = (rng.uniform(50, 300) + np.cumsum(rng.lognormal(2.5, 0.5, n_events))).tolist()
        outcome = "ok"
        kind = i % 17
        if kind == 3:
            outcome, ms, tok = "timeout", ms[: n_events // 2], tok[: n_events // 2]
        elif kind == 5:
            outcome, ms, tok = "http_error", [], []
        elif kind == 7:
            tok = []  # no per-event counts
        elif kind == 9 and n_events > 2:
            tok = tok[:-1]  # ragged: cut to the shorter
        elif kind == 11 and n_events > 2:
            tok[1] = 0  # an event without a token
        elif kind == 13 and n_events > 2:
            ms[1] = math.nan  # JSON writes NaN as null; Parquet keeps it
        out.append(
            RequestRecord(
                index=i, phase="warmup" if i < n // 20 else "measure", api="generate", worker_id=f"w{i % 3}",
                user_id=i % 8, t_send_wall=T0 + i * 0.01, outcome=outcome,
                http_status=500 if outcome == "http_error" else 200,
                ttft_ms=ms[0] if ms and outcome == "ok" and not math.isnan(ms[0]) else None,
                e2e_ms=(ms[-1] + 1.0) if ms else 5.0, arrival_ms=ms, arrival_tokens=tok,
                input_len=100, max_new_tokens=64, prompt_tokens=100,
                output_tokens=int(sum(tok)) if outcome == "ok" and i % 19 else None,
                cached_tokens=50 if i % 2 else None, served_by=f"http://127.0.0.1:{30000 + i % 2}",
                request_class=CLASSES[i % 2] if i % 23 else None,
                t_scheduled_wall=T0 + i * 0.01 - 0.001,
            )
        )  # fmt: skip
    return out


def reference_itl(records: list[RequestRecord]) -> tuple[np.ndarray, np.ndarray]:
    """ITL per token and per event, request by request, as docs/metrics.md defines them."""
    per_token, per_event = [], []
    for r in records:
        ms = np.array(r.arrival_ms, dtype=float)
        tok = np.array(r.arrival_tokens, dtype=float) if r.arrival_tokens else np.ones(ms.size)
        n = min(ms.size, tok.size)
        ms, tok = ms[:n], tok[:n]
        keep = np.isfinite(ms) & (tok > 0)
        ms, tok = ms[keep], tok[keep].astype(int)
        for j in range(1, ms.size):
            gap = ms[j] - ms[j - 1]
            per_event.append(gap)
            per_token += [gap / tok[j]] * tok[j]
    return np.array(per_token), np.array(per_event)


def reference_tokens(r: RequestRecord) -> int:
    """The tokens a record's events carried (what counts when the server gave no total)."""
    ms = np.array(r.arrival_ms, dtype=float)
    tok = np.array(r.arrival_tokens, dtype=float) if r.arrival_tokens else np.ones(ms.size)
    n = min(ms.size, tok.size)
    keep = np.isfinite(ms[:n]) & (tok[:n] > 0)
    return int(tok[:n][keep].sum())


def run_dir_of(tmp_path, records: list[RequestRecord]):
    run = tmp_path / "run"
    run.mkdir()
    writer = RecordWriter(run)
    for r in records:
        writer.write(r)
    writer.close()
    warmup = sum(r.phase == "warmup" for r in records)
    write_manifest(
        run,
        Manifest(
            run_id="run", profile_path="p.yaml",
            profile={"name": "big", "slo": {"ttft_p95_ms": 400, "itl_p95_ms": 20},
                     "classes": [{"name": "interactive", "share": 0.5, "slo": {"itl_p95_ms": 15}},
                                 {"name": "batch", "share": 0.5}]},
            target=TargetInfo(url="http://127.0.0.1:1"), model=None,
            load={"model": "closed", "concurrency": 8, "description": "closed loop, 8 in flight"},
            started_wall=T0, ended_wall=T0 + 100, complete=True,
            counts=Counts(warmup_expected=warmup, measured_expected=len(records) - warmup),
            versions=software_versions(), command=[],
        ),
    )  # fmt: skip
    return run


def test_the_summary_equals_numpy_on_the_raw_records(tmp_path):
    records = make_records(3000)
    run = run_dir_of(tmp_path, records)
    write_parquet(run)
    summary = json.loads(write_report(run).model_dump_json())
    ok = [r for r in records if r.phase == "measure" and r.outcome == "ok"]
    itl, itl_event = reference_itl(ok)
    ttft = np.array([r.ttft_ms for r in ok if r.ttft_ms is not None])
    for stem, values in (("itl_ms", itl), ("itl_per_event_ms", itl_event), ("ttft_ms", ttft)):
        assert summary["samples"][stem] == values.size
        assert summary[f"mean_{stem}"] == pytest.approx(np.mean(values), rel=1e-12)
        assert summary[f"std_{stem}"] == pytest.approx(np.std(values), rel=1e-9)
        for q in (90, 95, 99):  # exact: the same order statistics, the same interpolation
            assert summary[f"p{q}_{stem}"] == np.percentile(values, q)
        assert summary[f"median_{stem}"] == np.percentile(values, 50)
        assert (summary[f"min_{stem}"], summary[f"max_{stem}"]) == (values.min(), values.max())
    for c in summary["classes"]:
        mine = [r for r in ok if r.request_class == c["name"]]
        itl_c, _ = reference_itl(mine)
        assert c["p95_itl_ms"] == np.percentile(itl_c, 95)
        assert c["samples"]["itl_ms"] == itl_c.size
        objective = next(o for o in c["slo"]["objectives"] if o["metric"] == "itl_ms")
        assert objective["value_ms"] == np.percentile(itl_c, 95)
    tokens = sum(r.output_tokens if r.output_tokens is not None else reference_tokens(r) for r in ok)
    assert summary["total_output_tokens"] == tokens


def test_arrow_columns_and_python_lists_give_the_same_summary(tmp_path):
    """The flat path (load_records(arrow=True): Arrow lists, categorical text) against the per-record lists
    of the JSONL and the numpy arrays of Parquet: every key the same, bit for bit."""
    records = make_records(1500, seed=1)
    run = run_dir_of(tmp_path, records)
    manifest = Manifest.model_validate_json((run / "manifest.json").read_text())
    from_lists = compute_summary(load_records(run), manifest).model_dump()  # JSONL: lists
    write_parquet(run)
    from_arrays = compute_summary(load_records(run), manifest).model_dump()  # Parquet: numpy arrays
    flat = load_records(run, arrow=True)
    from_arrow = compute_summary(flat, manifest).model_dump()
    assert from_arrow == from_arrays
    # NaN receipt times: JSON has no NaN (orjson writes null, which the list path drops per request).
    assert {k: v for k, v in from_arrow.items() if "itl" not in k} == {
        k: v for k, v in from_lists.items() if "itl" not in k
    }


def test_events_equal_the_per_request_definitions_on_any_subset():
    records = make_records(800, seed=2)
    ms = [r.arrival_ms for r in records]
    tok = [r.arrival_tokens for r in records]
    events = Events.of_lists(ms, tok)
    rng = np.random.default_rng(0)
    for rows in (None, rng.random(len(records)) < 0.5, np.zeros(len(records), dtype=bool)):
        chosen = records if rows is None else [r for r, keep in zip(records, rows, strict=True) if keep]
        pooled = events.pooled(rows)
        per_token, per_event = reference_itl(chosen)
        np.testing.assert_array_equal(pooled["itl_per_token"], per_token)
        np.testing.assert_array_equal(pooled["itl_per_event"], per_event)
        sums = [float(reference_tokens(r)) for r in chosen]
        np.testing.assert_array_equal(pooled["token_sum"], sums)


@pytest.mark.parametrize(
    "make",
    [
        lambda rng, n: rng.lognormal(3, 0.5, n),
        lambda rng, n: np.round(rng.lognormal(3, 0.5, n), 1),  # many ties
        lambda rng, n: np.sort(rng.random(n)),  # sorted: a strided subsample sees a ramp
        lambda rng, n: np.repeat(rng.random(n // 4096), 4096),  # long runs of one value
        lambda rng, n: np.concatenate([np.zeros(n - 3), [3.0, 1.0, 2.0]]),  # all but three equal
        lambda rng, n: np.concatenate([rng.normal(10, 1, n // 2), rng.normal(1e6, 1, n - n // 2)]),  # bimodal
        lambda rng, n: -rng.lognormal(3, 0.5, n),  # negative
    ],
)
def test_order_statistics_by_bracketing_are_numpys(make):
    rng = np.random.default_rng(3)
    values = make(rng, BRACKET_MIN + 12345)
    before = values.copy()
    qs = [0, 50, 90, 95, 99, 99.9, 100]
    assert np.array_equal(quantiles(values, qs), np.percentile(values, qs))
    ks = np.array([0, 1, values.size // 3, values.size - 2, values.size - 1])
    assert np.array_equal(order_statistics(values, ks), np.sort(values)[ks])
    assert np.array_equal(values, before)  # left as it was


def test_the_table_written_by_groups_is_the_one_shot_table(tmp_path):
    # (a NaN receipt time is NaN in a record and null in its JSON line: none here)
    records = [r for r in make_records(110, seed=4) if not any(map(math.isnan, r.arrival_ms))][:100]
    writer = TableWriter(tmp_path, rows=7)  # 15 groups
    for i, r in enumerate(records):
        writer.add(r if i % 3 else json.loads(r.to_json_line()))  # records and JSONL rows alike
        assert not (tmp_path / RECORDS_PARQUET).exists()  # named only once complete
    writer.close()
    rows = read_jsonl_records_of(records)
    one_shot = _arrow_table(rows, RECORD_FIELDS)
    written = pq.read_table(tmp_path / RECORDS_PARQUET)
    assert pq.ParquetFile(tmp_path / RECORDS_PARQUET).num_row_groups == 15
    assert written.equals(one_shot)
    pacsv.write_csv(_csv_table(one_shot, rows), tmp_path / "one-shot.csv")
    assert (tmp_path / RECORDS_CSV).read_bytes() == (tmp_path / "one-shot.csv").read_bytes()
    assert not list(tmp_path.glob(".*.partial"))


def read_jsonl_records_of(records):
    return [json.loads(r.to_json_line()) for r in records]


def test_an_empty_table_has_the_columns(tmp_path):
    TableWriter(tmp_path).close()
    table = pq.read_table(tmp_path / RECORDS_PARQUET)
    assert table.num_rows == 0 and table.column_names == list(RECORD_FIELDS)
    assert table.schema.field("arrival_ms").type == pa.list_(pa.float64())


def test_a_discarded_table_leaves_no_file(tmp_path):
    writer = TableWriter(tmp_path, rows=2)
    for r in make_records(5):
        writer.add(r)
    writer.discard()
    assert not list(tmp_path.iterdir())


def test_recorded_indices_read_each_lines_start(tmp_path):
    (tmp_path / RECORDS_JSONL).write_bytes(
        b"".join(r.to_json_line() for r in make_records(5))
        + b'{"phase": "measure", "index": 9}\n'  # written by hand: parsed whole
        + b'{"index":7,"phase":"mea'  # torn
    )
    have = recorded_indices(tmp_path)
    assert sorted(have) == [0, 1, 2, 3, 4, 9] and len(have) == 6
    assert 7 not in have and -1 not in have and "0" not in have
    assert [r["index"] for r in read_jsonl_records(tmp_path / RECORDS_JSONL)] == [0, 1, 2, 3, 4, 9]


def test_index_set():
    s = IndexSet([3, 1, 3])
    s.add(1_000_000)
    assert len(s) == 3 and 1_000_000 in s and 2 not in s and 10**7 not in s
    assert s.issuperset([1, 3]) and not s.issuperset([1, 2])
    with pytest.raises(ValueError):
        s.add(-1)


def test_the_timeline_helpers_equal_the_per_second_loops():
    rng = np.random.default_rng(5)
    s = rng.uniform(0, 50, 400)
    e = s + rng.exponential(3, 400)
    e[:5] = s[:5]  # zero length: nothing in flight
    span = int(np.ceil(e.max()))
    loop = [float(np.clip(np.minimum(e, b + 1) - np.maximum(s, b), 0, None).sum()) for b in range(span)]
    np.testing.assert_allclose(_in_flight_per_second(s, e, span), loop, rtol=1e-12, atol=1e-9)
    values = rng.normal(100, 10, 400)
    rows = rng.random(400) < 0.8
    second = np.floor(s)
    expected = [np.median(values[rows & (second == b)]) if (rows & (second == b)).any() else np.nan
                for b in range(span)]  # fmt: skip
    np.testing.assert_array_equal(_median_per_second(second, values, rows, span), expected)
    records = make_records(50, seed=6)
    thirds = [records[:17], records[17:30], records[30:]]  # three batches, as three row groups
    batches = [lists_batch([r.arrival_ms for r in b], [r.arrival_tokens for r in b]) for b in thirds]
    events = RunEvents.of_batches(batches, keep_times=True)
    t_send = np.array([r.t_send_wall for r in records])
    t0 = t_send.min()
    width = int(np.ceil(max(r.t_send_wall + r.e2e_ms / 1000 for r in records) - t0))
    tokens = np.zeros(width)
    for r in records:
        ms = np.array(r.arrival_ms, dtype=float)
        tok = np.array(r.arrival_tokens, dtype=float) if r.arrival_tokens else np.ones(ms.size)
        n = min(ms.size, tok.size)
        keep = np.isfinite(ms[:n]) & (tok[:n] > 0)
        at = ((r.t_send_wall - t0) + ms[:n][keep] / 1000).astype(int)
        np.add.at(tokens, np.clip(at, 0, width - 1), tok[:n][keep])
    np.testing.assert_array_equal(events.seconds((t_send, t0, width)), tokens)


def test_a_report_of_the_jsonl_alone_equals_the_parquets(tmp_path):
    """A killed run has records.jsonl only: the flat reader builds the same columns from it."""
    records = [r for r in make_records(400, seed=7) if not any(map(math.isnan, r.arrival_ms))]
    run = run_dir_of(tmp_path, records)
    from_jsonl = write_report(run, html=False).model_dump()
    write_parquet(run)
    from_parquet = write_report(run, html=False).model_dump()
    from_jsonl.pop("records_source"), from_parquet.pop("records_source")
    assert from_jsonl == from_parquet
    flat = load_records(run, arrow=True)
    kept = int(record_events(flat).lengths.sum())
    assert kept == sum(len(r.arrival_ms) for r in records) - sum(
        1 for r in records for t in (r.arrival_tokens or [1] * len(r.arrival_ms)) if t <= 0
    ) - sum(max(len(r.arrival_ms) - len(r.arrival_tokens), 0) for r in records if r.arrival_tokens)


# ---------------------------------------------------------------------------------------------------
# ITL of a run and its classes from the event chunks (itl.py), against numpy over the materialised samples


def _gaps(kind: str, rng, n: int) -> np.ndarray:
    if kind == "ties":  # coalesced reads (zero gaps) and a server's fixed step
        return rng.choice([0.0, 5.0, 5.0, 10.0], n)
    if kind == "negative":  # a clock that stepped back
        return rng.normal(1, 3, n)
    if kind == "tiny":  # below the buckets' floor (2^-20 ms) and far above it
        return np.concatenate([rng.random(n // 2) * 1e-9, rng.lognormal(2, 2, n - n // 2)])
    return rng.gamma(3, 2, n) * rng.choice([1, 1, 0], n)


@pytest.mark.parametrize("kind", ["gamma", "ties", "negative", "tiny"])
def test_itl_of_every_scope_equals_numpy_over_the_materialised_samples(kind):
    """Seven batches of events (as row groups), scopes that nest (the run and its classes) and one that is
    empty: counts, percentiles (to the last bit), mean and std of the per-token and per-event ITL equal
    numpy's over each scope's samples as ``pooled_events`` materialises them."""
    rng = np.random.default_rng(11)
    batches = []
    for _ in range(7):
        lengths = rng.integers(0, 12, int(rng.integers(1, 300)))
        ms = np.cumsum(_gaps(kind, rng, int(lengths.sum())))
        batches.append((ms, lengths, rng.choice([1, 1, 2, 3, 0, 4], ms.size), lengths))
    events = RunEvents.of_batches(batches)
    flat = Events(*(np.concatenate(column) for column in zip(*batches, strict=True)))
    klass, ok = rng.integers(0, 3, events.rows), rng.random(events.rows) < 0.8
    scopes = [ok, ok & (klass == 0), ok & (klass == 1), ok & (klass == 7)]
    qs = [50, 90, 95, 99, 99.9]
    for scope, figures in zip(scopes, itl_figures(events, scopes, qs), strict=True):
        pooled = flat.pooled(scope)
        for metric, key in (("itl_ms", "itl_per_token"), ("itl_per_event_ms", "itl_per_event")):
            samples, got = pooled[key], figures[metric]
            assert got.count == samples.size
            if not samples.size:
                assert got.mean is None and got.known == {}
                continue
            assert [got.known[float(q)] for q in [0, *qs, 100]] == np.percentile(
                samples, [0, *qs, 100]
            ).tolist()
            assert got.mean == pytest.approx(np.mean(samples), rel=1e-12, abs=1e-15)
            assert got.std == pytest.approx(np.std(samples), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("ties", [False, True])
def test_weighted_order_statistics_are_those_of_the_repeated_values(ties):
    """A gathered set larger than a sort's worth is split by its bits again (radix select), with weights."""
    rng = np.random.default_rng(12)
    values = rng.normal(0, 50, 300_000)
    values = np.round(values) if ties else values
    weights = rng.integers(1, 5, values.size)
    repeated = np.sort(np.repeat(values, weights))
    ranks = np.array([0, 1, repeated.size // 3, repeated.size // 2, repeated.size - 2, repeated.size - 1])
    assert np.array_equal(weighted_kth(values, weights, ranks), repeated[ranks])
    assert np.array_equal(weighted_kth(values, None, ranks[:3]), np.sort(values)[ranks[:3]])
    assert np.array_equal(weighted_kth(np.full(50_000, 2.5), None, np.array([0, 49_999])), [2.5, 2.5])


def test_a_plot_draw_is_uniform_over_the_tokens():
    """report.html draws a CDF line through a draw of the per-token samples: each event kept in proportion to
    its tokens, so the draw's quartiles are the samples' (within a draw's error)."""
    rng = np.random.default_rng(13)
    lengths = rng.integers(2, 40, 3000)
    ms = np.cumsum(rng.gamma(2, 3, int(lengths.sum())))
    tok = rng.choice([1, 4], ms.size, p=[0.5, 0.5])  # per token, the 4-token events are 4/5 of the samples
    events = RunEvents.of_batches([(ms, lengths, tok, lengths)])
    every = np.ones(events.rows, dtype=bool)
    pooled = itl_figures(events, [every], [25, 75])[0]["itl_ms"]
    drawn = pooled.draw(20_000)
    assert drawn.size == 20_000 and np.all(np.diff(drawn) >= 0)
    truth = Events(ms, lengths, tok, lengths).pooled()["itl_per_token"]
    for q in (25, 75):
        assert np.percentile(drawn, q) == pytest.approx(np.percentile(truth, q), rel=0.03)


def test_a_big_scans_plot_draws_and_timeline_come_from_what_it_read():
    """With a pilot (32 batches) the scan keeps no events: each scope's plot draw comes from a sample drawn as
    it reads (a small class whole, the run at a rate the pilot set) and is uniform over its events or tokens
    (quartiles within a draw's error of the truth); the tokens per second equal those counted from the kept
    events."""
    rng = np.random.default_rng(17)
    batches = []
    for b in range(32):
        lengths = rng.integers(2, 60, 400)
        ms = np.cumsum(rng.gamma(2, 3 + b / 8, int(lengths.sum())))
        batches.append((ms, lengths, rng.choice([1, 1, 2, 4], ms.size), lengths))
    source = EventSource.of(batches)
    rows = sum(source.sizes)
    small = np.zeros(rows, dtype=bool)
    small[rng.choice(rows, 40, replace=False)] = True  # a class of 40 requests: drawn whole
    scopes = [np.ones(rows, dtype=bool), small]
    t_send = np.sort(rng.uniform(0, 30, rows))
    timeline = (t_send, 0.0, 200)
    scanned = scan_events(source, scopes, [50], timeline)
    assert scanned.events.chunks == []  # nothing per event kept
    flat = Events(*(np.concatenate(column) for column in zip(*batches, strict=True)))
    for metric, key in (("itl_ms", "itl_per_token"), ("itl_per_event_ms", "itl_per_event")):
        truth = flat.pooled()[key]
        drawn = scanned.figures[0][metric].draw(20_000)
        assert drawn.size == 20_000 and np.all(np.diff(drawn) >= 0)
        assert set(drawn.tolist()) <= set(truth.tolist())
        for q in (25, 50, 75):
            assert np.percentile(drawn, q) == pytest.approx(np.percentile(truth, q), rel=0.03)
        few = flat.pooled(small)[key]
        drawn_small = scanned.figures[1][metric].draw(20_000)
        if metric == "itl_per_event_ms":  # the class's every event, once
            assert np.array_equal(drawn_small, np.sort(few))
        else:  # events kept in proportion to their tokens
            assert set(drawn_small.tolist()) <= set(few.tolist()) and drawn_small.size > few.size / 4
    kept = RunEvents.of_batches(batches, keep_times=True)
    np.testing.assert_allclose(scanned.events.seconds(timeline), kept.seconds(timeline), rtol=1e-12)
    assert scanned.events.seconds(timeline).sum() == pytest.approx(flat.tok.sum())


def test_records_parquet_stores_receipt_times_plainly():
    """Receipt times are full doubles: written without a dictionary or compression (read back ~2x faster);
    token counts keep both (a million records' counts in a few MB)."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        writer = TableWriter(Path(tmp), rows=64)
        for r in make_records(100, seed=14):
            writer.add(r)
        group = pq.ParquetFile(writer.close()).metadata.row_group(0)
        column = {group.column(i).path_in_schema: group.column(i) for i in range(group.num_columns)}
        ms, tok = column["arrival_ms.list.element"], column["arrival_tokens.list.element"]
        assert ms.compression == "UNCOMPRESSED" and "RLE_DICTIONARY" not in ms.encodings
        assert tok.compression == "SNAPPY" and "RLE_DICTIONARY" in tok.encodings


def test_read_ahead_hands_over_every_item_and_the_producers_error():
    assert list(read_ahead(iter(range(50)), depth=2)) == list(range(50))

    def failing():
        yield 1
        raise ValueError("row group 2: bad")

    got = []
    with pytest.raises(ValueError, match="row group 2"):
        for item in read_ahead(failing()):
            got.append(item)
    assert got == [1]
    first = next(iter(read_ahead(iter(range(10**6)), depth=2)))  # a consumer that stops early
    assert first == 0


def test_in_flight_equals_counting_at_every_moment():
    """The sweep (sorted starts and ends merged) against a direct count over every segment between distinct
    times, with ties (a start at another request's end), intervals outside the window and empty ones."""
    rng = np.random.default_rng(15)
    s = rng.integers(-5, 60, 3000).astype(float)
    e = s + rng.integers(0, 15, s.size)
    ws, we = 0.0, 50.0
    got = in_flight(s, e, ws, we)
    times = np.unique(np.concatenate([[ws, we], np.clip(s, ws, we), np.clip(e, ws, we)]))
    counts = np.array([np.count_nonzero((s <= t) & (t < e)) for t in times[:-1]])
    widths = np.diff(times)
    assert got["mean"] == pytest.approx(float(np.sum(counts * widths)) / (we - ws), rel=1e-12)
    assert (got["min"], got["max"]) == (int(counts.min()), int(counts.max()))
    # The same sweep says how long more than a cap were in flight (the load-not-locked finding).
    steps_counts, steps_lengths = flight_steps(s, e, ws, we)
    for cap in (3, int(counts.max()) - 1, int(counts.max())):
        above = float(np.sum(steps_lengths[steps_counts > cap]))
        assert above == pytest.approx(float(np.sum(widths[counts > cap])), rel=1e-12, abs=1e-12)
    assert float(np.sum(widths[counts > int(counts.max()) - 1])) > 0


def test_token_count_sources_counted_with_the_old_records_fallback():
    df = pd.DataFrame(
        {"arrival_tokens_from": pd.Categorical(["server", None, "spread", None, "server", "spread"])}
    )
    exact = np.array([True, True, False, False, True, False])
    rows = np.array([True, True, True, True, False, True])
    assert counts_from(df, rows, exact) == {"chunks": 1, "server": 2, "spread": 2}
    assert counts_from(df.drop(columns="arrival_tokens_from"), rows, exact) == {"chunks": 3, "server": 2}


@pytest.mark.parametrize("shape", ["steady", "drifting", "pilot_unlike_the_rest", "constant"])
@pytest.mark.parametrize(
    "tokens", [[1, 1, 2, 4], [1] * 9 + [3], [1]], ids=["half_multi", "few_multi", "ones"]
)
def test_the_one_pass_scan_and_its_fallback_give_numpys_figures(shape, tokens):
    """40 batches: a pilot of every 5th predicts where each order statistic lies and one pass gathers those
    buckets as it counts; where the pilot misleads (its batches unlike the others, ~1M events so that its
    margin is narrow), or where the records' sums of squares would cancel (a constant gap), a second pass
    takes the wanted buckets and the moments exactly. Either way, numpy's figures; with events of several
    tokens common, rare (their per-token buckets apart) or absent (the per-event buckets serve both)."""
    rng = np.random.default_rng(16)
    batches = []
    for b in range(40):
        lengths = rng.integers(0, 50, 500 if shape == "pilot_unlike_the_rest" else 60)
        n = int(lengths.sum())
        if shape == "constant":
            gaps = np.full(n, 7.25)
        else:  # a run that slows down; or the pilot's chunks (every 5th) 10x slower than the rest
            scale = {"steady": 2, "drifting": 2 + b / 10, "pilot_unlike_the_rest": 20 if b % 5 == 0 else 2}[
                shape
            ]
            gaps = rng.gamma(3, scale, n)
        batches.append((np.cumsum(gaps), lengths, rng.choice(tokens, n), lengths))
    source = EventSource.of(batches)
    rows = sum(source.sizes)
    flat = Events(*(np.concatenate(column) for column in zip(*batches, strict=True)))
    klass, ok = rng.integers(0, 3, rows), rng.random(rows) < 0.9
    scopes = [ok, ok & (klass == 0), ok & (klass == 1)]
    qs = [0.0, 50.0, 90.0, 95.0, 99.0, 99.9, 100.0]
    scanned = scan_events(source, scopes, qs)
    for metric, key in (("itl_per_event_ms", "itl_per_event"), ("itl_ms", "itl_per_token")):
        if shape in ("steady", "pilot_unlike_the_rest"):
            assert scanned.one_pass[metric] is (shape == "steady")
        if shape == "constant" and metric == "itl_per_event_ms":  # sums of squares would cancel
            assert scanned.one_pass[metric] is False
        for scope, figures in zip(scopes, scanned.figures, strict=True):
            samples, got = flat.pooled(scope)[key], figures[metric]
            assert got.count == samples.size
            assert [got.known[q] for q in qs] == np.percentile(samples, qs).tolist()
            assert got.mean == pytest.approx(np.mean(samples), rel=1e-12)
            assert got.std == pytest.approx(np.std(samples), rel=1e-9, abs=1e-12)


def test_row_groups_of_one_token_events_are_marked_and_read_without_their_counts(tmp_path, monkeypatch):
    """The writer marks the row groups whose every event carries one token (counts all 1 and one per receipt
    time, or none); their counts are not read again, and the reader's events equal a full read's. A mark the
    group's own statistics contradict (a count of 2) is not trusted."""
    import dataclasses

    from loadlab.records import event_batches, one_token_groups

    base = [r for r in make_records(200, seed=4) if len(r.arrival_ms) >= 2][:16]
    assert len(base) == 16

    def shaped(r, kind):
        n = len(r.arrival_ms)
        counts = {"ones": [1] * n, "none": [], "a_two": [1] * (n - 1) + [2], "ragged": [1] * (n - 1)}[kind]
        return dataclasses.replace(r, arrival_tokens=counts)

    kinds = ["ones", "none", "a_two", "ragged"]
    records = [shaped(r, kinds[i // 4]) for i, r in enumerate(base)]
    records[1] = dataclasses.replace(records[1], arrival_ms=[], arrival_tokens=[])  # a failure: no event

    def written(where):
        where.mkdir()
        writer = TableWriter(where, rows=4)
        for r in records:
            writer.add(r)
        writer.close()
        return where

    run = written(tmp_path / "marked")
    with pq.ParquetFile(run / RECORDS_PARQUET) as f:
        assert f.num_row_groups == 4 and one_token_groups(f) == {0, 1}
        full = [
            _event_columns(f.read_row_group(g, columns=["arrival_ms", "arrival_tokens"]), 4) for g in range(4)
        ]
    for got, want in zip(event_batches(run), full, strict=True):
        assert Events(*got).pooled().keys() == Events(*want).pooled().keys()
        for key, value in Events(*want).pooled().items():
            assert np.array_equal(Events(*got).pooled()[key], value, equal_nan=True), key
    assert [len(b[2]) for b in event_batches(run, groups=[0, 1])] == [
        int(sum(len(r.arrival_ms) for r in records[k : k + 4])) for k in (0, 4)
    ]

    # A writer that marked every group: the statistics overrule it where a count is 2; raggedness (counts
    # fewer than receipt times, all 1) they cannot see, which is why only the writer's own check marks.
    import loadlab.records as records_module

    monkeypatch.setattr(records_module, "_one_token_each", lambda table: True)
    with pq.ParquetFile(written(tmp_path / "forged") / RECORDS_PARQUET) as f:
        assert one_token_groups(f) == {0, 1, 3}
