"""The client measures what the server did: real `loadlab run` processes against the scripted server.

The scripted server logs the wall-clock time right after each token-carrying event's last byte was
handed to the kernel; joining that log with the run's records on server_id gives, per request,
  TTFT error = ttft_ms - (write_wall[0] - t_send_wall) * 1000
  ITL error  = (arrival_ms[j] - arrival_ms[j-1]) - (write_wall[j] - write_wall[j-1]) * 1000
which must stay within 2 ms at P95, at 1 and at 64 users.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from conftest import TIMING_REPORT, describe_errors, percentile, run_loadlab, timing_errors

TOLERANCE_MS = 2.0
GAP_MS = 20.0  # the session's scripted server: first event after 100 ms, then every 20 ms

# (case, users, warm-up, measured, output tokens)
RUNS = [
    pytest.param("normal", 1, 2, 12, 24, id="normal-1user"),
    # 12 measured, as above: a P95 over 4 TTFTs is their largest, one descheduling of the scripted server
    # between its write and its clock read (~2 ms on the 2-core VM, the reference's error, not the client's)
    # failed it (TTFT P95 2.004 ms, n=4, with the kernel clock on).
    pytest.param("multi4", 1, 1, 12, 30, id="multi4-1user"),
    pytest.param("normal", 64, 64, 192, 24, id="normal-64users"),
    pytest.param("multi4", 64, 64, 192, 32, id="multi4-64users"),
]


# Wall-clock timing on a shared 2-core machine: one rerun absorbs a burst of outside load. A client that
# really mistimes (batched reads, parsing before the timestamp) is tens of ms off and fails both runs.
@pytest.mark.alone
@pytest.mark.flaky(reruns=1, reruns_delay=2)
@pytest.mark.parametrize("case,users,warmup,measured,output_len", RUNS)
def test_client_timing(scripted_server, tmp_path, case, users, warmup, measured, output_len):
    run = run_loadlab(
        "timing.yaml",
        scripted_server.case_url(case),
        tmp_path,
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
    assert run.run_dir is not None and run.run_dir.is_dir(), run.explain()
    manifest = run.manifest()
    assert manifest.complete is True
    df = run.records()

    # Exactly the requested records: every index once, warm-up first and marked as such.
    assert len(df) == warmup + measured
    assert df["index"].is_unique
    warm = df[df.phase == "warmup"]
    meas = df[df.phase == "measure"]
    assert sorted(warm["index"]) == list(range(warmup))
    assert sorted(meas["index"]) == list(range(warmup, warmup + measured))
    # The warm-up barrier: no measured request was sent before the last warm-up request ended.
    warm_end = (warm.t_send_wall + warm.e2e_ms / 1000.0).max()
    assert (meas.t_send_wall >= warm_end - 0.001).all()

    # Every request ok, with exact token counts.
    assert (df.outcome == "ok").all(), df[df.outcome != "ok"][["index", "outcome", "error"]].to_string()
    assert (df.http_status == 200).all()
    if sys.platform.startswith("linux"):  # the default clock: the kernel's receive timestamps
        assert (df.receipt_clock == "kernel").all(), df.receipt_clock.value_counts().to_dict()
    for rec in df.itertuples():
        tokens = list(rec.arrival_tokens)
        assert rec.max_new_tokens == output_len
        assert rec.output_tokens == output_len, rec
        assert sum(tokens) == rec.output_tokens
        assert len(rec.arrival_ms) == len(tokens)
        assert rec.tokens_per_event_exact
        assert rec.finish_reason == "length"
        if case == "multi4":
            assert all(t == 4 for t in tokens[:-1]) and 1 <= tokens[-1] <= 4, tokens
        else:
            assert tokens == [1] * output_len
        assert np.all(np.diff(rec.arrival_ms) > 0)
        assert rec.ttft_ms == rec.arrival_ms[0]

    # Join with the server's write times.
    log = scripted_server.log_entries()
    ttft_err, itl_err, problems = timing_errors(meas, log)
    assert not problems, problems[:5]
    assert len(ttft_err) == measured
    joined = [log[sid] for sid in meas.server_id]
    assert all(e["case"] == case and e["completed"] for e in joined)
    # Every write went straight to the kernel, so write_wall is when the bytes left the server.
    assert max(e["max_buffered"] for e in joined) == 0

    line = describe_errors(f"{case} at {users} user(s), {measured} requests", ttft_err, itl_err)
    print(line)
    TIMING_REPORT.append(line)
    ttft_p95 = percentile(np.abs(ttft_err), 95)
    itl_p95 = percentile(np.abs(itl_err), 95)
    assert ttft_p95 <= TOLERANCE_MS, line
    assert itl_p95 <= TOLERANCE_MS, line

    if case == "multi4" and output_len % 4 == 0:
        # ITL per token = event gap / tokens in the event: gap / 4 when every event carries 4 tokens.
        per_token = np.concatenate(
            [np.diff(r.arrival_ms) / np.asarray(r.arrival_tokens[1:], dtype=float) for r in meas.itertuples()]
        )
        assert abs(np.median(per_token) - GAP_MS / 4) < 0.5, np.median(per_token)
        assert abs(per_token.mean() - GAP_MS / 4) < 0.25, per_token.mean()
        # The report computes the same (per-token ITL from the records).
        summary = json.loads((run.run_dir / "summary.json").read_text())
        assert abs(summary["mean_itl_ms"] - GAP_MS / 4) < 0.25, summary["mean_itl_ms"]
        assert abs(summary["mean_itl_per_event_ms"] - GAP_MS) < 1.0
