"""Writes a realistic big run directory for the post-processing benchmarks: records.jsonl exactly as a run
writes it (each line ``RequestRecord.to_json_line()``, so byte for byte a real run's), and its manifest
(``complete: true``, a closed or open loop, two SLO classes, an SLO). Per request: 64-256 token-carrying
events (most one token, some two to four, as SGLang's stream coalesces), receipt times as perf_counter
differences give them (full doubles), mixed outcomes (timeouts and drops keep what arrived, HTTP errors
and rejections have none), four load-generator processes, four serving workers, 1% warm-up.

    python bench/make_big_run.py DIR [--records 1000000] [--seed 0] [--open-loop] [--one-token]

``--one-token``: every event carries one token (a server that streams a token a chunk, as SGLang does unless
its stream coalesces), the requests' lengths and gaps drawn as without it.

Not a benchmark: bench/big_run.py times what a run does with the directory.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from loadlab.load import describe_load
from loadlab.manifest import Counts, Manifest, TargetInfo, software_versions, write_manifest
from loadlab.profile import validate_profile
from loadlab.records import (
    DROPPED,
    HTTP_ERROR,
    MEASURE,
    OK,
    RECORDS_JSONL,
    REJECTED,
    TIMEOUT,
    WARMUP,
    RequestRecord,
)

CLASSES = ("interactive", "batch")
WORKERS = tuple(f"http://10.0.0.{i}:30000" for i in range(1, 5))
GENERATORS = tuple(f"bench-host_{i:032x}" for i in range(4))
USERS = 512
CHUNK = 20_000


def profile_for(records: int, open_loop: bool):
    warmup = records // 100
    load = {"model": "open", "rate": 800.0, "arrival": "poisson"} if open_loop else {"concurrency": USERS}
    return validate_profile(
        {
            "name": "bigrun",
            "requests": {"warmup": warmup, "measured": records - warmup},
            "load": load,
            "workload": {"kind": "random_prefix", "input_len": 512, "output_len": 256},
            "slo": {"ttft_p95_ms": 1000, "tpot_p95_ms": 50, "itl_p95_ms": 40},
            "classes": [
                {"name": "interactive", "share": 0.75, "slo": {"ttft_p95_ms": 500}},
                {"name": "batch", "share": 0.25},
            ],
        }
    )


def chunk_records(
    start: int, n: int, warmup: int, rng: np.random.Generator, open_loop: bool, one_token: bool = False
):
    """Records ``start`` .. ``start + n``: their fields drawn in bulk, each record then built as a run does."""
    idx = np.arange(start, start + n)
    out_len = rng.integers(64, 257, n)
    ttft = rng.lognormal(np.log(250.0), 0.6, n)
    # Per event: tokens (mostly 1) and the gap before it; a request's events until its output is complete.
    events_max = int(out_len.max())
    tok = rng.choice([1, 1, 1, 1, 1, 1, 1, 1, 2, 3, 4], size=(n, events_max))
    if one_token:
        tok[:] = 1
    gaps = rng.lognormal(np.log(18.0), 0.35, (n, events_max)) * tok
    kind = rng.random(n)
    t_send = 1.7e9 + idx * (1.0 / 800.0) + rng.random(n) * 0.001
    lateness = rng.exponential(0.0004, n)
    recs = []
    for row in range(n):
        i = int(idx[row])
        cum = np.cumsum(tok[row])
        n_events = int(np.searchsorted(cum, out_len[row])) + 1
        tokens = tok[row, :n_events].copy()
        tokens[-1] -= int(cum[n_events - 1] - out_len[row])  # the last event completes the output exactly
        arrival = ttft[row] + np.concatenate([[0.0], np.cumsum(gaps[row, 1:n_events])])
        outcome, error, status = OK, None, 200
        k = kind[row]
        if k < 0.006:  # a timeout after some events: keeps what arrived
            outcome, error = TIMEOUT, "no byte for 30.0 s"
            n_keep = n_events // 3
            tokens, arrival = tokens[:n_keep], arrival[:n_keep]
        elif k < 0.009:
            outcome, error = DROPPED, "the connection closed before the stream ended"
            n_keep = n_events // 2
            tokens, arrival = tokens[:n_keep], arrival[:n_keep]
        elif k < 0.012:
            outcome, error, status = HTTP_ERROR, "Internal Server Error", 500
            tokens, arrival = tokens[:0], arrival[:0]
        elif k < 0.014:
            outcome, error, status = REJECTED, "queue full for class interactive", 429
            tokens, arrival = tokens[:0], arrival[:0]
        arrival_ms = arrival.tolist()
        ok = outcome == OK
        e2e = (arrival_ms[-1] + 0.3) if arrival_ms else float(ttft[row] * 0.1)
        prompt = 512 + int(i % 7)
        cls = CLASSES[int(i % 4 == 0)]
        recs.append(
            RequestRecord(
                index=i, phase=WARMUP if i < warmup else MEASURE, api="generate",
                worker_id=GENERATORS[i % len(GENERATORS)], user_id=i % USERS, t_send_wall=float(t_send[row]),
                outcome=outcome, error=error, http_status=status, server_id=f"{i:032x}" if status == 200 else None,
                ttft_ms=arrival_ms[0] if arrival_ms else None, e2e_ms=e2e, arrival_ms=arrival_ms,
                arrival_tokens=tokens.tolist(), input_len=512, max_new_tokens=int(out_len[row]),
                prompt_tokens=prompt if status == 200 else None,
                output_tokens=int(out_len[row]) if ok else (int(tokens.sum()) if status == 200 else None),
                cached_tokens=(prompt // 2) if status == 200 else None, num_retractions=0 if ok else None,
                server_queue_ms=float(ttft[row] * 0.3) if status == 200 else None,
                finish_reason="length" if ok else None, prefix_group=None,
                t_scheduled_wall=float(t_send[row] - lateness[row]) if open_loop else None,
                served_by=WORKERS[i % len(WORKERS)] if status == 200 else None,
                status_source="worker" if status == 200 else ("front" if status == 429 else None),
                request_class=cls,
            )
        )  # fmt: skip
    return recs


def make_run(
    run_dir: Path, records: int, seed: int = 0, open_loop: bool = False, one_token: bool = False
) -> Path:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    profile = profile_for(records, open_loop)
    warmup = profile.requests.warmup
    rng = np.random.default_rng(seed)
    outcomes: dict[str, int] = {}
    with open(run_dir / RECORDS_JSONL, "wb") as f:
        for start in range(0, records, CHUNK):
            recs = chunk_records(start, min(CHUNK, records - start), warmup, rng, open_loop, one_token)
            f.write(b"".join(r.to_json_line() for r in recs))
            for r in recs:
                outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
    started = 1.7e9
    manifest = Manifest(
        run_id=run_dir.name,
        profile_path="bench/make_big_run.py",
        profile=profile.model_dump(mode="json"),
        target=TargetInfo(url="http://127.0.0.1:30000"),
        model=None,
        load=describe_load(profile, USERS),
        workload_source=None,
        started_wall=started,
        ended_wall=started + records / 800.0 + 1.0,
        complete=True,
        counts=Counts(
            warmup_expected=warmup,
            measured_expected=records - warmup,
            warmup_finished=warmup,
            measured_finished=records - warmup,
            records=records,
            outcomes=outcomes,
        ),  # fmt: skip
        versions=software_versions(),
        command=["bench/make_big_run.py", str(run_dir), "--records", str(records)],
    )
    write_manifest(run_dir, manifest)
    return run_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--open-loop", action="store_true", help="open loop: records carry their due times")
    parser.add_argument("--one-token", action="store_true", help="every event one token")
    args = parser.parse_args()
    t = time.perf_counter()
    make_run(args.dir, args.records, args.seed, args.open_loop, args.one_token)
    size = (args.dir / RECORDS_JSONL).stat().st_size
    print(
        f"{args.dir}: {args.records} records, {size / 1e9:.2f} GB, {time.perf_counter() - t:.1f} s",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
