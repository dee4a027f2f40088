"""The twin's calibration points (tolerances from shared/design/twin.md), at the cost-model level and through
the scheduler on a virtual clock. The same points over real HTTP are in test_twin_http.py."""

from __future__ import annotations

import statistics

import pytest

from loadlab.sim.clock import run_requests
from loadlab.sim.cost import GPUS, MODELS, CostModel, attention_pairs, default_max_running_requests
from loadlab.sim.scheduler import Request, Scheduler, SchedulerConfig
from loadlab.sim.settings import resolve_settings

A100 = CostModel("a100-80gb", "llama-3.1-8b")
H100 = CostModel("h100-80gb", "llama-3.1-8b")

# twin.md's derived A100 decode table (ms): context -> batch -> step.
A100_DECODE_TABLE = {
    512: {1: 10.9, 32: 13.4, 64: 15.0, 128: 19.5, 256: 31.6},
    1024: {1: 10.9, 32: 14.7, 64: 17.6, 128: 24.7, 256: 42.0},
    2048: {1: 11.0, 32: 17.3, 64: 22.8, 128: 35.1, 256: 62.8},
}
H100_DECODE_1024 = {1: 5.8, 32: 7.3, 64: 8.8, 128: 11.9, 256: 19.1}  # twin.md (derived, unverified)


def ms(seconds: float) -> float:
    return seconds * 1000.0


# ---------------------------------------------------------------------------------------------------------
# The cost model
# ---------------------------------------------------------------------------------------------------------
def test_a100_8b_calibration_points():
    # Single stream ITL 10-12.5 ms (vLLM's ~10.2 ms scaled to the 80 GB part; twin.md's 10.9 ms).
    for ctx in (128, 1024, 2048):
        assert 10.0 <= ms(A100.decode_s(1, ctx)) <= 12.5
    # A 1024-token prompt on an idle server: ~80 ms (+-20%), i.e. ~13k prefill tokens/s.
    assert ms(A100.prefill_s(1024, attention_pairs(1024, 0))) == pytest.approx(80, rel=0.20)
    # vLLM dashboard: batch 8, 32 in / 128 out: ~12.3 ms per step (+-15%); mean context ~96 tokens.
    assert ms(A100.decode_s(8, 8 * 96)) == pytest.approx(12.3, rel=0.15)
    # KV capacity ~440k tokens at mem_fraction_static 0.88.
    assert A100.kv_tokens(0.88) == pytest.approx(440_000, rel=0.01)
    # An 8192-token chunk: up to ~0.55 s (twin.md, effect 2).
    assert A100.prefill_s(8192, attention_pairs(8192, 0)) == pytest.approx(0.55, rel=0.20)


def test_a100_decode_table_within_15_percent():
    for ctx, row in A100_DECODE_TABLE.items():
        for batch, expected in row.items():
            assert ms(A100.decode_s(batch, batch * ctx)) == pytest.approx(expected, rel=0.15), (ctx, batch)


def test_h100_faster_than_sglang_ci_floor():
    # SGLang CI: single stream > 135 tok/s on H100, i.e. < 7.4 ms per token.
    assert ms(H100.decode_s(1, 1024)) < 7.4
    for batch, expected in H100_DECODE_1024.items():
        assert ms(H100.decode_s(batch, batch * 1024)) == pytest.approx(expected, rel=0.15), batch
    # SGLang CI at 1 req/s: median TTFT < 80 ms for short prompts.
    assert ms(H100.prefill_s(1024, attention_pairs(1024, 0))) < 80


def test_presets_and_memory():
    assert {"a100-80gb", "h100-80gb", "h200"} <= set(GPUS)
    assert {"llama-3.1-8b", "llama-3.1-70b"} <= set(MODELS)
    m8, m70 = MODELS["llama-3.1-8b"], MODELS["llama-3.1-70b"]
    assert m8.params == pytest.approx(8.03e9, rel=0.01) and m70.params == pytest.approx(70.6e9, rel=0.01)
    assert m8.kv_bytes_per_token == 131_072 and m70.kv_bytes_per_token == 327_680
    for gpu in GPUS:
        for tp in (4, 8):
            c = CostModel(gpu, "llama-3.1-70b", tp)
            assert c.kv_tokens() > 200_000
            # Bigger tensor parallelism: less weight per GPU, faster steps, more KV room.
            if tp == 8:
                c4 = CostModel(gpu, "llama-3.1-70b", 4)
                assert c.decode_s(1, 1024) < c4.decode_s(1, 1024) and c.kv_tokens() > c4.kv_tokens()
        h = CostModel(gpu)
        assert h.kv_tokens(0.5) < h.kv_tokens(0.88)
    assert CostModel("h200").decode_s(1, 1024) < H100.decode_s(1, 1024)  # more bandwidth
    assert CostModel("h200").kv_tokens() > 1.9 * A100.kv_tokens()  # 141 GB vs 80 GB, the same weights
    # The 70B model does not fit one 80 GB GPU.
    with pytest.raises(ValueError, match="no memory for the KV cache"):
        resolve_settings({"model": "llama-3.1-70b", "tp_size": 1})
    s = resolve_settings({"gpu": "h100-80gb", "model": "llama-3.1-70b"})
    assert s.tp_size == 4 and s.model_path == "meta-llama/Llama-3.1-70B-Instruct"
    assert s.max_total_num_tokens == CostModel("h100-80gb", "llama-3.1-70b", 4).kv_tokens()
    # SGLang's default max_running_requests rule (twin.md).
    assert default_max_running_requests(440_000, 131_072) == 2048
    assert default_max_running_requests(3000, 131_072) == 1500
    assert resolve_settings({"max_total_tokens": 12345}).max_total_num_tokens == 12345


# ---------------------------------------------------------------------------------------------------------
# Through the scheduler, on a virtual clock
# ---------------------------------------------------------------------------------------------------------
def _request(i: int, n_prompt: int, max_new: int) -> Request:
    prompt = [10_000 + i] + [(i * 131 + k) % 90_000 + 2000 for k in range(n_prompt - 1)]
    return Request(f"c{i}", prompt, max_new, output_ids=[5000 + k for k in range(max_new)])


def _gaps(r: Request) -> list[float]:
    return [b - a for a, b in zip(r.times, r.times[1:], strict=False)]


@pytest.mark.parametrize("gpu", ["a100-80gb", "h100-80gb"])
def test_scheduler_single_stream_and_idle_ttft(gpu):
    s = Scheduler(SchedulerConfig(record_token_times=True), CostModel(gpu))
    r = _request(1, 1024, 64)
    run_requests(s, [(0.0, r)])
    ttft, itl = ms(r.first_token_time), ms(statistics.mean(_gaps(r)))
    if gpu == "a100-80gb":
        assert ttft == pytest.approx(80, rel=0.20)
        assert 10.0 <= itl <= 12.5
    else:
        assert itl < 7.4 and ttft < 80


def test_scheduler_batch_of_8_step():
    s = Scheduler(SchedulerConfig(record_token_times=True), A100)
    reqs = [_request(i, 32, 128) for i in range(8)]
    run_requests(s, [(0.0, r) for r in reqs])
    steps = [g for r in reqs for g in _gaps(r)]
    assert ms(statistics.median(steps)) == pytest.approx(12.3, rel=0.15)
    assert all(len(r.times) == 128 for r in reqs)
