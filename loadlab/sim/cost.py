"""The twin's cost model: how long one forward pass takes, and how many KV tokens fit, per GPU and model.

Pure functions of a (GPU, model, tensor parallel) preset; no clock, no scheduling. Sources:

- twin.md: ``shared/design/twin.md`` ("Cost of one forward pass"): the roofline form, the A100 effective
  rates, Vidur's A100 linear-layer profile of Llama-3-8B, and the derived decode tables it checks against.
- Vendor spec sheets: NVIDIA A100 (80GB SXM), H100 SXM and H200 SXM datasheets for peak HBM bandwidth,
  dense BF16 tensor-core FLOP/s and NVLink bandwidth.
- Model configs: the ``config.json`` of meta-llama/Llama-3.1-8B and meta-llama/Llama-3.1-70B on Hugging
  Face (hidden size, layers, heads, KV heads, intermediate size, vocabulary, context length).

One pass over ``T`` tokens (``T`` = new prompt tokens of a prefill, or the batch size of a decode step):

    time = overhead + linear(T) + all_reduce(T)          (weights: read once per pass)
           + kv_tokens_read x KV bytes per token / tp / effective bandwidth     (decode attention)
           + attention pairs x 4 x layers x heads x head_dim / tp / effective FLOP rate   (prefill attention)

    linear(T) = max(weight bytes / tp / effective bandwidth, 2 x matmul params x T / tp / effective FLOP/s)

except for A100 + Llama-3.1-8B at tp 1, where linear(T) interpolates Vidur's measured profile (twin.md),
which keeps the calibration the simulated server has always had.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

MIB = 2**20
CLIP_MAX_NEW_TOKENS = 4096  # SGLang's CLIP_MAX_NEW_TOKENS(_ESTIMATION) (schedule_policy.py)


# ---------------------------------------------------------------------------------------------------------
# GPUs
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GPU:
    key: str
    name: str
    memory_bytes: int  # device memory as the driver reports it
    hbm_peak: float  # bytes/s, vendor spec sheet
    hbm_eff: float  # bytes/s, what a decode step achieves
    flops_peak: float  # dense BF16 FLOP/s, vendor spec sheet
    flops_eff: float  # FLOP/s achieved by large GEMMs / prefill attention
    nvlink: float  # bytes/s per direction, vendor spec sheet (used for tensor-parallel all-reduce)
    overhead_s: float  # fixed cost per forward pass (launch, sampling, scheduling)
    chunked_prefill_size: int  # SGLang's default --chunked-prefill-size for this memory size
    # SGLang's default --mem-fraction-static. None: SGLang 0.5's rule for this memory size and the tensor
    # parallel size (sglang_mem_fraction_static); the presets the twin was calibrated on keep 0.88.
    mem_fraction_static: float | None = None

    @property
    def memory_mib(self) -> float:
        return self.memory_bytes / MIB


GPUS: dict[str, GPU] = {
    "a100-80gb": GPU(
        key="a100-80gb",
        name="NVIDIA A100-SXM4-80GB",
        # nvidia-smi reports 81920 MiB.
        memory_bytes=81920 * MIB,
        # Spec sheet: HBM2e 2,039 GB/s; twin.md: effective ~1.65 TB/s.
        hbm_peak=2.039e12,
        hbm_eff=1.65e12,
        # Spec sheet: 312 TFLOP/s dense BF16; twin.md: 190-210 effective for the linear layers.
        flops_peak=312e12,
        flops_eff=200e12,
        # Spec sheet: NVLink 600 GB/s total, i.e. 300 GB/s each way.
        nvlink=300e9,
        # twin.md assumes ~0.5 ms; 1.15 ms makes Vidur's linear times + KV reads reproduce twin.md's A100
        # decode table (batch 1-256 x context 512-2048) within 0.5 ms in every cell (calibration fit).
        overhead_s=1.15e-3,
        # sglang-wire.md: 8192 on 60-160 GB GPUs.
        chunked_prefill_size=8192,
        # SGLang 0.4's default at tp 1: the point the twin's KV pool is calibrated at (twin.md's 440k tokens).
        mem_fraction_static=0.88,
    ),
    "h100-80gb": GPU(
        key="h100-80gb",
        name="NVIDIA H100 80GB HBM3 (SXM)",
        # nvidia-smi reports 81559 MiB.
        memory_bytes=81559 * MIB,
        # Spec sheet: HBM3 3.35 TB/s. Effective 3.0 TB/s (~90% of peak) with a 0.5 ms overhead reproduces
        # twin.md's derived H100 decode figures at context 1024 (5.8 / 7.3 / 8.8 / 11.9 ms at batch
        # 1 / 32 / 64 / 128) within 0.3 ms.
        hbm_peak=3.35e12,
        hbm_eff=3.0e12,
        # Spec sheet: 989 TFLOP/s dense BF16 (1979 with sparsity). Effective: the A100's ratio (200/312).
        flops_peak=989e12,
        flops_eff=989e12 * 200 / 312,
        # Spec sheet: NVLink 900 GB/s total, 450 GB/s each way.
        nvlink=450e9,
        # twin.md: ~0.5 ms (assumed).
        overhead_s=0.5e-3,
        chunked_prefill_size=8192,
        mem_fraction_static=0.88,
    ),
    "h200": GPU(
        key="h200",
        name="NVIDIA H200 (SXM, 141GB)",
        # Spec sheet: 141 GB; nvidia-smi reports 143771 MiB.
        memory_bytes=143771 * MIB,
        # Spec sheet: HBM3e 4.8 TB/s; effective at the H100's ratio (3.0 / 3.35).
        hbm_peak=4.8e12,
        hbm_eff=4.8e12 * 3.0 / 3.35,
        # Spec sheet: same tensor cores as the H100 (989 TFLOP/s dense BF16).
        flops_peak=989e12,
        flops_eff=989e12 * 200 / 312,
        nvlink=450e9,
        overhead_s=0.5e-3,
        # sglang-wire.md: 8192 on 60-160 GB GPUs.
        chunked_prefill_size=8192,
        mem_fraction_static=0.88,
    ),
    # The presets below take SGLang 0.5's defaults for their memory size (sglang_memory_defaults,
    # sglang_mem_fraction_static) and no calibration of their own: effective rates at the same fraction of
    # the spec sheet's peak as the calibrated preset of the nearest kind.
    "a100-40gb": GPU(
        key="a100-40gb",
        name="NVIDIA A100-SXM4-40GB",
        # nvidia-smi reports 40960 MiB.
        memory_bytes=40960 * MIB,
        # Spec sheet: HBM2 1,555 GB/s; effective at the A100-80GB's ratio (1.65 / 2.039).
        hbm_peak=1.555e12,
        hbm_eff=1.555e12 * 1.65 / 2.039,
        # The same chip as the A100-80GB: 312 TFLOP/s dense BF16, NVLink 600 GB/s total.
        flops_peak=312e12,
        flops_eff=200e12,
        nvlink=300e9,
        overhead_s=1.15e-3,  # the A100-80GB's fit (the same chip and software)
        chunked_prefill_size=4096,  # SGLang 0.5: 4096 on 35-60 GB GPUs
    ),
    "h100-pcie": GPU(
        key="h100-pcie",
        name="NVIDIA H100 PCIe",
        # Spec sheet: 80 GB HBM2e; nvidia-smi reports 81559 MiB.
        memory_bytes=81559 * MIB,
        # Spec sheet: 2.0 TB/s; effective at the H100 SXM's ratio (3.0 / 3.35).
        hbm_peak=2.0e12,
        hbm_eff=2.0e12 * 3.0 / 3.35,
        # Spec sheet: 756 TFLOP/s dense BF16 (1,513 with sparsity); effective at the A100's ratio (200 / 312).
        flops_peak=756e12,
        flops_eff=756e12 * 200 / 312,
        # Spec sheet: NVLink bridge 600 GB/s total (pairs of cards), 300 GB/s each way.
        nvlink=300e9,
        overhead_s=0.5e-3,  # the H100 SXM's (twin.md's ~0.5 ms assumption)
        chunked_prefill_size=8192,  # SGLang 0.5: 8192 on 60-90 GB GPUs
    ),
    "l40s": GPU(
        key="l40s",
        name="NVIDIA L40S",
        # Spec sheet: 48 GB GDDR6 with ECC; nvidia-smi reports 46068 MiB.
        memory_bytes=46068 * MIB,
        # Spec sheet: 864 GB/s; effective at the A100's ratio (1.65 / 2.039).
        hbm_peak=864e9,
        hbm_eff=864e9 * 1.65 / 2.039,
        # Spec sheet: 362.05 TFLOP/s dense BF16 (733 with sparsity); effective at the A100's ratio.
        flops_peak=362.05e12,
        flops_eff=362.05e12 * 200 / 312,
        # No NVLink: tensor parallelism goes over PCIe Gen4 x16, ~32 GB/s each way.
        nvlink=32e9,
        overhead_s=1.15e-3,  # assumed: the A100's fit (no measurement of an L40S)
        chunked_prefill_size=4096,  # SGLang 0.5: 4096 on 35-60 GB GPUs
    ),
}
GPU_ALIASES = {"a100": "a100-80gb", "h100": "h100-80gb", "h200-141gb": "h200", "a100-sxm4-40gb": "a100-40gb"}


def sglang_memory_defaults(memory_mib: float, tp: int) -> tuple[int, int]:
    """(chunked_prefill_size, cuda_graph_max_bs): SGLang 0.5's defaults for a CUDA GPU of this much memory
    (server_args.py, ``_handle_gpu_memory_settings``): larger GPUs are taken to be faster, so they get larger
    prefill chunks and CUDA graphs for larger batches."""
    small_tp = tp < 4
    if memory_mib < 20 * 1024:  # T4, RTX 4080
        return 2048, 8
    if memory_mib < 35 * 1024:  # A10, RTX 4090
        return 2048, 24 if small_tp else 80
    if memory_mib < 60 * 1024:  # A100-40GB, L40(S)
        return 4096, 32 if small_tp else 160
    if memory_mib < 160 * 1024:  # A100-80GB, H100, H200
        return 8192, 256 if small_tp else 512
    return 16384, 512  # B200, MI300


def sglang_mem_fraction_static(
    memory_mib: float, tp: int, chunked_prefill_size: int, max_prefill_tokens: int = 16384
) -> float:
    """SGLang 0.5's default --mem-fraction-static: the memory left after a reserve (MiB) for activations
    (1.5 per token of the largest prefill), CUDA graphs (2 per batch size of the largest graph), constant
    metadata (512) and tensor parallelism (1024 per 8 GPUs); on GPUs above 60 GB at least 10 GiB."""
    _, graph_bs = sglang_memory_defaults(memory_mib, tp)
    prefill = chunked_prefill_size if chunked_prefill_size > 0 else max_prefill_tokens
    reserve = 512 + max(prefill, 2048) * 1.5 + graph_bs * 2 + tp / 8 * 1024
    if memory_mib > 60 * 1024:
        reserve = max(reserve, 10 * 1024)
    return round((memory_mib - reserve) / memory_mib, 3)


# ---------------------------------------------------------------------------------------------------------
# Models (bf16 weights and KV cache)
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Model:
    key: str
    model_path: str  # the Hugging Face name the server reports by default
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    context_length: int
    default_tp: int
    dtype_bytes: int = 2  # bf16

    @property
    def layer_params(self) -> int:
        h, kv = self.hidden, self.kv_heads * self.head_dim
        attn = h * self.heads * self.head_dim * 2 + h * kv * 2  # q, o + k, v projections
        mlp = 3 * h * self.intermediate  # gate, up, down
        return attn + mlp + 2 * h  # + two RMSNorm weights

    @property
    def params(self) -> int:
        """All parameters: layers + input embedding + LM head (untied) + final norm."""
        return self.layers * self.layer_params + 2 * self.vocab * self.hidden + self.hidden

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a matrix multiply per token (the input embedding is a lookup)."""
        return self.params - self.vocab * self.hidden

    @property
    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes per token, whole model: layers x KV heads x head dim x 2 (K, V) x 2 bytes."""
        return self.layers * self.kv_heads * self.head_dim * 2 * self.dtype_bytes


MODELS: dict[str, Model] = {
    # config.json of meta-llama/Llama-3.1-8B: 32 layers, hidden 4096, 32 heads, 8 KV heads, head dim 128,
    # intermediate 14336, vocab 128256, max_position_embeddings 131072. 8.03B parameters; KV 131,072 B/token
    # (twin.md).
    "llama-3.1-8b": Model(
        key="llama-3.1-8b",
        model_path="meta-llama/Llama-3.1-8B-Instruct",
        layers=32,
        hidden=4096,
        heads=32,
        kv_heads=8,
        head_dim=128,
        intermediate=14336,
        vocab=128256,
        context_length=131072,
        default_tp=1,
    ),
    # config.json of meta-llama/Llama-3.1-70B: 80 layers, hidden 8192, 64 heads, 8 KV heads, head dim 128,
    # intermediate 28672, vocab 128256, context 131072. 70.6B parameters (141 GB in bf16: tensor parallel 4
    # or 8 on 80 GB GPUs); KV 327,680 B/token.
    "llama-3.1-70b": Model(
        key="llama-3.1-70b",
        model_path="meta-llama/Llama-3.1-70B-Instruct",
        layers=80,
        hidden=8192,
        heads=64,
        kv_heads=8,
        head_dim=128,
        intermediate=28672,
        vocab=128256,
        context_length=131072,
        default_tp=4,
    ),
}
MODEL_ALIASES = {"llama-3.1-8b-instruct": "llama-3.1-8b", "llama-3.1-70b-instruct": "llama-3.1-70b"}

# Linear-layer time (ms) of a forward pass over N tokens, 32 layers summed: Vidur's A100 profile of
# Llama-3-8B (twin.md). Used for A100 + Llama-3.1-8B at tp 1.
VIDUR_A100_LLAMA3_8B_LINEAR_MS: tuple[tuple[int, float], ...] = (
    (1, 9.7),
    (32, 10.9),
    (64, 11.2),
    (128, 13.2),
    (256, 19.5),
    (512, 34.6),
    (1024, 75.1),
    (2048, 146.0),
    (8192, 545.0),
)

# KV capacity. SGLang sizes the KV pool as GPU memory x mem_fraction_static minus what is already
# allocated (weights, CUDA context, ...). twin.md derives ~440,000 tokens for an A100-80GB at 0.88 with
# Llama-3.1-8B; the non-weight part of "already allocated" is fixed so that this holds, and applied to
# every preset (calibration fit: 1.86e9 bytes).
DEFAULT_MEM_FRACTION_STATIC = 0.88
_A100_8B = MODELS["llama-3.1-8b"]
RUNTIME_RESERVE_BYTES = (
    GPUS["a100-80gb"].memory_bytes * DEFAULT_MEM_FRACTION_STATIC
    - _A100_8B.weight_bytes
    - 440_000 * _A100_8B.kv_bytes_per_token
)

# Tensor parallelism: two all-reduces per layer (after attention and after the MLP) of T x hidden x 2 bytes.
# A ring all-reduce moves 2 (tp-1)/tp of the data over NVLink; the fixed latency per all-reduce is an
# assumption (small-message all-reduce on NVLink is ~5-20 us; not calibrated).
ALL_REDUCE_LATENCY_S = 8e-6


def resolve_gpu(name: str) -> GPU:
    key = GPU_ALIASES.get(name.lower(), name.lower())
    if key not in GPUS:
        raise ValueError(f"unknown GPU {name!r} (known: {', '.join(GPUS)})")
    return GPUS[key]


def resolve_model(name: str) -> Model:
    key = MODEL_ALIASES.get(name.lower(), name.lower())
    if key not in MODELS:
        raise ValueError(f"unknown model {name!r} (known: {', '.join(MODELS)})")
    return MODELS[key]


class CostModel:
    """Step times and KV capacity for one (GPU, model, tensor parallel) preset. All times in seconds."""

    def __init__(
        self, gpu: GPU | str = "a100-80gb", model: Model | str = "llama-3.1-8b", tp: int | None = None
    ):
        self.gpu = resolve_gpu(gpu) if isinstance(gpu, str) else gpu
        self.model = resolve_model(model) if isinstance(model, str) else model
        self.tp = tp or self.model.default_tp
        if self.tp < 1 or self.model.kv_heads % self.tp and self.tp % self.model.kv_heads:
            raise ValueError(f"tensor parallel size {self.tp} does not divide the model's KV heads")
        g, m, tp = self.gpu, self.model, self.tp
        self.overhead_s = g.overhead_s
        self.weight_bytes_per_gpu = m.weight_bytes / tp
        # KV heads are split over the GPUs (replicated when tp > KV heads).
        self.kv_bytes_per_token_per_gpu = m.kv_bytes_per_token * max(1, m.kv_heads // tp) / m.kv_heads
        self.kv_read_s_per_token = self.kv_bytes_per_token_per_gpu / g.hbm_eff
        # Prefill attention: QK^T and PV, 2 FLOPs per multiply-add, per (query, key) pair, over all layers.
        self.attn_s_per_pair = 4 * m.layers * m.heads * m.head_dim / tp / g.flops_eff
        self._weights_s = self.weight_bytes_per_gpu / g.hbm_eff
        self._flop_s_per_token = 2 * m.matmul_params / tp / g.flops_eff
        if tp > 1:
            self._ar_fixed_s = 2 * m.layers * ALL_REDUCE_LATENCY_S
            self._ar_s_per_token = 2 * m.layers * m.hidden * m.dtype_bytes * 2 * (tp - 1) / tp / g.nvlink
        else:
            self._ar_fixed_s = self._ar_s_per_token = 0.0
        self.profile = (
            VIDUR_A100_LLAMA3_8B_LINEAR_MS
            if (g.key == "a100-80gb" and m.key == "llama-3.1-8b" and tp == 1)
            else None
        )
        if self.profile is not None:
            self._pts_n = [n for n, _ in self.profile]
            self._pts_s = [t * 1e-3 for _, t in self.profile]
        self._linear_cache: dict[int, float] = {}

    @property
    def name(self) -> str:
        return f"{self.gpu.key} {self.model.key} tp{self.tp}"

    # -- linear layers ------------------------------------------------------------------------------------
    def _linear_uncached(self, n: int) -> float:
        if self.profile is None:
            linear = max(self._weights_s, self._flop_s_per_token * n)
        else:
            xs, ys = self._pts_n, self._pts_s
            if n <= xs[0]:
                linear = ys[0]
            elif n >= xs[-1]:
                linear = ys[-1] * n / xs[-1]
            else:
                i = bisect.bisect_left(xs, n)
                n0, n1, t0, t1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
                linear = t0 + (t1 - t0) * (n - n0) / (n1 - n0)
        if n > 0:
            linear += self._ar_fixed_s + self._ar_s_per_token * n
        return linear

    def linear_s(self, n_tokens: int) -> float:
        """Linear layers (+ tensor-parallel all-reduces) of one pass over ``n_tokens`` tokens."""
        t = self._linear_cache.get(n_tokens)
        if t is None:
            t = self._linear_cache[n_tokens] = self._linear_uncached(n_tokens)
        return t

    # -- passes -------------------------------------------------------------------------------------------
    def decode_s(self, batch: int, total_context: int) -> float:
        """One decode step for ``batch`` requests whose KV caches hold ``total_context`` tokens in all."""
        return self.overhead_s + self.linear_s(batch) + self.kv_read_s_per_token * total_context

    def prefill_s(self, new_tokens: int, attn_pairs: int) -> float:
        """One prefill pass over ``new_tokens`` new tokens with ``attn_pairs`` (query, key) pairs."""
        return self.overhead_s + self.linear_s(new_tokens) + self.attn_s_per_pair * attn_pairs

    def step_s(self, linear_tokens: int, attn_pairs: int, kv_tokens_read: int) -> float:
        """A general pass (mixed prefill + decode): tokens through the linear layers, prefill attention
        pairs, and KV tokens read by decoding requests."""
        return (
            self.overhead_s
            + self.linear_s(linear_tokens)
            + self.attn_s_per_pair * attn_pairs
            + self.kv_read_s_per_token * kv_tokens_read
        )

    # -- memory -------------------------------------------------------------------------------------------
    def default_mem_fraction_static(self, chunked_prefill_size: int | None = None) -> float:
        """SGLang's default --mem-fraction-static for this preset (and prefill chunk: the preset's default)."""
        g = self.gpu
        if g.mem_fraction_static is not None:
            return g.mem_fraction_static
        chunk = g.chunked_prefill_size if chunked_prefill_size is None else chunked_prefill_size
        return sglang_mem_fraction_static(g.memory_mib, self.tp, chunk)

    def kv_tokens(self, mem_fraction_static: float | None = None) -> int:
        """KV pool size in tokens: memory x fraction (default: SGLang's for the preset) - weights - runtime
        reserve, per GPU."""
        if mem_fraction_static is None:
            mem_fraction_static = self.default_mem_fraction_static()
        free = self.gpu.memory_bytes * mem_fraction_static - self.weight_bytes_per_gpu - RUNTIME_RESERVE_BYTES
        return max(0, int(free / self.kv_bytes_per_token_per_gpu))


@functools.lru_cache(maxsize=32)
def cost_model(gpu: str = "a100-80gb", model: str = "llama-3.1-8b", tp: int | None = None) -> CostModel:
    """A shared CostModel per preset (its step-time cache then serves every run)."""
    return CostModel(gpu, model, tp)


def attention_pairs(new_tokens: int, prefix_tokens: int) -> int:
    """(query, key) pairs of a causal prefill of ``new_tokens`` after ``prefix_tokens`` already in KV."""
    return new_tokens * prefix_tokens + new_tokens * (new_tokens + 1) // 2


def default_max_running_requests(kv_tokens: int, context_length: int) -> int:
    """SGLang's default when --max-running-requests is unset (twin.md): the request-slot pool
    min(clamp(kv / context x 512, 2048, 4096)), capped at half the KV pool."""
    auto = min(max(int(kv_tokens / context_length * 512), 2048), 4096)
    return max(1, min(auto, kv_tokens // 2))


__all__ = [
    "CLIP_MAX_NEW_TOKENS",
    "DEFAULT_MEM_FRACTION_STATIC",
    "GPUS",
    "GPU",
    "MODELS",
    "Model",
    "CostModel",
    "attention_pairs",
    "cost_model",
    "default_max_running_requests",
    "resolve_gpu",
    "resolve_model",
    "sglang_mem_fraction_static",
    "sglang_memory_defaults",
]
