"""End to end against the embedded simulated server: real Locust, real server process, real files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_loadlab_many

from loadlab.manifest import read_manifest
from loadlab.records import load_records

REPO = Path(__file__).resolve().parents[1]
LOADLAB = [sys.executable, "-m", "loadlab.cli"]


def loadlab_run(tmp_path, *args, timeout=180):
    proc = subprocess.run(
        [sys.executable, "-m", "loadlab.cli", "run", *args, "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = Path(proc.stdout.strip().splitlines()[-1])
    assert run_dir.parent == tmp_path, proc.stdout[-2000:]
    return run_dir, proc


def test_main_command_writes_a_report(tmp_path):
    """The README's main command, as is, with the default profile (out dir redirected)."""
    proc = subprocess.run(
        [sys.executable, "-m", "locust", "-f", "locustfile.py", "--headless", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = list(tmp_path.iterdir())
    for name in ("summary.json", "summary.md", "records.parquet", "records.jsonl", "manifest.json"):
        assert (run_dir / name).exists(), name
    assert str(run_dir / "summary.md") in proc.stderr  # it says where the report is
    summary = json.loads((run_dir / "summary.json").read_text())
    manifest = read_manifest(run_dir)
    assert manifest.complete is True
    measured = manifest.profile["requests"]["measured"]
    assert summary["completed"] == measured and summary["failed"] == 0
    records = load_records(run_dir)
    measure = records[records.phase == "measure"]
    assert sorted(measure["index"]) == list(range(32, 32 + measured))  # warm-up indices 0..31 excluded
    # 16 users held in flight: the measured in-flight count stays near 16.
    assert summary["in_flight"]["max"] == 16
    assert 12 <= summary["in_flight"]["mean"] <= 16
    assert (measure.output_tokens == 64).all()
    assert summary["p99_ttft_ms"] >= summary["median_ttft_ms"] > 0
    # Every response named the embedded twin as the worker that served it: its base URL, the target's.
    assert (records.served_by == manifest.target.url).all() and (records.status_source == "worker").all()
    (worker,) = summary["workers"]
    assert worker["served_by"] == manifest.target.url and summary["unattributed_requests"] == 0
    assert worker["completed"] == summary["completed"] and worker["measured_requests"] == measured
    assert worker["output_throughput"] == pytest.approx(summary["output_throughput"])
    assert worker["p95_ttft_ms"] == summary["p95_ttft_ms"] and worker["p95_tpot_ms"] == summary["p95_tpot_ms"]
    # The last lines a user sees are loadlab's exact figures, after Locust's own (rounded) tables.
    tail = proc.stderr.rstrip("\n").splitlines()
    start = max(i for i, line in enumerate(tail) if "loadlab: exact result" in line)
    assert start > max(i for i, line in enumerate(tail) if "Response time percentiles" in line)
    block = tail[start:]
    assert block[-1] == "=" * 78 and block[-2] == f"report: {run_dir / 'summary.md'}"
    rows = {
        line.split()[0]: line.split()[1:]
        for line in block
        if line.split()[:1] in (["TTFT"], ["TPOT"], ["E2E"])
    }
    for row, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("E2E", "e2e_latency_ms")):
        p50, p95, p99 = (float(v) for v in rows[row][:3])
        assert (p50, p95, p99) == tuple(round(summary[f"{s}_{key}"], 2) for s in ("median", "p95", "p99")), (
            row
        )
    assert f"complete: {measured} measured, {measured} completed" in block[1]


APIS = ("generate", "completions", "chat")
COMMON = ["--concurrency", "8", "--warmup-requests", "8", "--num-requests", "24", "--output-len", "16"]
RAG = ["--concurrency", "8", "--warmup-requests", "4", "--num-requests", "16", "--output-len", "12"]


@pytest.fixture(scope="module")
def api_runs(tmp_path_factory):
    """The per-API runs below, all started at once (each its own `loadlab run` and embedded twin; nothing
    they assert depends on timing): for each API, a shared-prefix run, a random-prefix run and a RAG run."""
    out = tmp_path_factory.mktemp("api-runs")
    jobs = {}
    for api in APIS:
        groups = ["--set", "workload.num_groups=4"]  # the warm-up touches every group first
        jobs[("shared", api)] = ["profiles/shared-system-prompt.yaml", "--api", api, *COMMON, *groups]
        jobs[("random", api)] = ["profiles/random-prefix.yaml", "--api", api, *COMMON]
        jobs[("rag", api)] = ["profiles/rag.yaml", "--api", api, *RAG]
    argvs = {key: [*LOADLAB, "run", *args, "--out", str(out / "-".join(key))] for key, args in jobs.items()}
    return run_loadlab_many(argvs, timeout_s=300)


def run_dir_of(runs, kind: str, api: str) -> Path:
    run = runs[(kind, api)]
    assert run.returncode == 0, run.explain()
    assert run.run_dir.parent.name == f"{kind}-{api}", run.explain()
    return run.run_dir


@pytest.mark.parametrize("api", APIS)
def test_shared_prefix_hits_the_cache_and_random_prefix_does_not(api_runs, api):
    shared_dir, random_dir = run_dir_of(api_runs, "shared", api), run_dir_of(api_runs, "random", api)
    shared = json.loads((shared_dir / "summary.json").read_text())
    rand = json.loads((random_dir / "summary.json").read_text())
    assert shared["completed"] == 24 and rand["completed"] == 24
    # 2048 shared of 2176 prompt tokens: the server should report ~94% cached.
    assert shared["cached_token_ratio"] > 0.8, shared["cached_token_ratio"]
    assert rand["cached_token_ratio"] < 0.02, rand["cached_token_ratio"]
    records = load_records(shared_dir)
    assert (records.output_tokens == 16).all()
    assert records.server_id.notna().all()


@pytest.mark.parametrize("api", APIS)
def test_rag_profile_runs_on_every_api(api_runs, api):
    run_dir = run_dir_of(api_runs, "rag", api)
    records = load_records(run_dir)
    assert len(records) == 20 and (records.outcome == "ok").all()
    measure = records[records.phase == "measure"]
    assert (measure.output_tokens == 12).all()
    if api == "chat":  # the chat template adds tokens the server counts
        assert (measure.prompt_tokens >= 1024).all()
    else:
        assert (measure.prompt_tokens == 1024).all()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["slo"]["objectives"] and summary["slo"]["pass"] in (True, False)


def test_locust_users_flag_overrides_the_profile_concurrency(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "locust", "-f", "locustfile.py", "--headless", "-u", "4", "--out", str(tmp_path),
         "--num-requests", "24", "--warmup-requests", "4", "--output-len", "8"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = list(tmp_path.iterdir())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert read_manifest(run_dir).load.concurrency == 4
    assert summary["in_flight"]["max"] == 4 and summary["completed"] == 24
    # The report states the load that was applied, not the profile's 16.
    assert summary["max_concurrency"] == 4 and summary["load_model"] == "closed loop, 4 in flight"


def test_exact_text_lengths_with_a_tokenizer_file(tmp_path):
    """With the same local tokenizer.json on both sides, OpenAI text prompts have exactly the intended length."""
    tokenizers = pytest.importorskip("tokenizers")
    from loadlab.workload.words import WORDS

    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    tok.decoder = tokenizers.decoders.Metaspace()
    # A small vocabulary, so many table words split into several tokens and one-word-one-token is far off.
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=1200, special_tokens=["[UNK]"], show_progress=False)
    tok.train_from_iterator([" ".join(WORDS[i : i + 40]) for i in range(0, len(WORDS), 7)] * 3, trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    out = tmp_path / "runs"
    run_dir, _ = loadlab_run(
        out,
        "profiles/random-prefix.yaml",
        "--api", "completions", "--tokenizer", str(path), "--set", f"target.embedded.tokenizer={path}",
        "--concurrency", "4", "--warmup-requests", "0", "--num-requests", "12",
        "--input-len", "300", "--output-len", "4",
    )  # fmt: skip
    records = load_records(run_dir)
    assert (records.outcome == "ok").all()
    assert (records.prompt_tokens == 300).all(), records.prompt_tokens.tolist()
    # The check can fail: without the tokenizer the same prompts come out far longer.
    from loadlab.workload.text import Renderer

    plain = Renderer(None).text(list(range(0, 1500, 5)))
    assert len(tok.encode(plain).ids) > 400
