"""How long one operator takes on a described GPU: the simulated machine's per-operator time model.

An operator on a GPU is bound by one of three things (the roofline of Williams et al. 2009, "Roofline: an
insightful visual performance model", CACM 52(4), plus the host):

* its **FLOPs** at the GPU's peak for its dtype times the efficiency its kind reaches: a matmul at the
  efficiency of large matmuls, less for a small or oddly shaped one (tile and wave quantization, the
  planner's curve `labkit.gemm.quantization`, after NVIDIA's "Matrix Multiplication Background User's
  Guide"); attention (FlashAttention-style fused kernels) at its own efficiency;
* the **bytes** it reads and writes at the GPU's memory bandwidth times the share memory-bound kernels reach;
* the **host**: eager PyTorch spends some 10-20 µs dispatching and launching each operator, and a GPU step
  is never faster than the host issues it (`DISPATCH_S`, the planner's floor per operator).

    op_s = max(flops / (peak(dtype) · efficiency(kind, shape)), bytes / (bandwidth · memory_efficiency),
               DISPATCH_S)

The efficiencies are measurements, not hopes: on one H200 (torch 2.11, CUDA 13, bf16, CUDA events, mean of
20 runs, this project's device check of 2026-12-04) an 8192³ GEMM took 1.38 ms = 795 TFLOP/s, 80 % of the
989 TFLOP/s dense peak (4096-16384 shapes: 781-795); causal SDPA forward at 8 x 32 heads x 2048 x 128 reached
564 TFLOP/s (57 %), forward and backward together 2.25 ms, so backward's 2.5 times the forward's FLOPs ran at
40 %; a 16384 x 4096 layer norm 107 µs (2.5 TB/s read and written, 52 % of 4.8 TB/s) and a GELU
of the same size 90 µs (62 %). Other GPUs take the same shares of their datasheet figures, an assumption.

Isolated kernels are not a training step. A step runs for seconds at the card's power limit (its clocks fall
below those of a short benchmark), shares SMs with NCCL's kernels, and waits in launch and allocator gaps
that no single kernel shows. None of these is modelled one by one; together they are one fitted share,
`SUSTAINED`: every kernel takes 1 / SUSTAINED times its isolated time. It was fitted end to end, on published
training runs, not on kernels: MosaicML's MPT benchmarks with FSDP on 8 H100s (llm-foundry, "H100 80GB BF16",
`labkit.course.experiments.published_fsdp_runs`). Simulated with the share at 1, the 1B, 7B and 30B rows ran
1.28, 1.18 and 1.16 times faster than published; their geometric mean, 1.21, is 1 / SUSTAINED. Held out: the
760M, 3B and 13B rows (1.47, 1.36, 1.03 before the fit; 1.22, 1.13, 0.85 after), and Narayanan et al. 2021's
Table 1 on A100s (`published_runs`). Since carried from 3 and 4 blocks with a per-parameter AdamW (as the rows
ran), the fitted rows come out 1.02, 0.97, 0.97 and the held-out ones 1.20, 1.12, 0.85, the share not
refitted. What it still leaves out: L2 cache reuse between operators, cuBLAS's choice among tile shapes, a
model's size changing the share (small models lose more: the 760M row stays 1.20 optimistic).
The formulas run nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from labkit import validate
from labkit.gemm import GemmCurve, quantization

__all__ = [
    "DISPATCH_S",
    "FP32_PEAK_TFLOPS",
    "SUSTAINED",
    "GpuSpec",
    "attention_flops",
    "kernel_s",
    "matmul_s",
    "memory_s",
    "op_s",
    "split_k",
]

# Eager PyTorch spends some 10-20 µs of host time per operator (dispatch and launch); measured on the H200
# above: a tiny add 12.5 µs of host time and 12.9 µs of device time per operator in a loop. A step is never
# faster than the host can issue it: a small layer is launch-bound, and splitting it over tp ranks does not
# make it faster.
DISPATCH_S = 15e-6

# Dense FP32 (CUDA-core, not tensor-core) peak per GPU, TFLOP/s, from NVIDIA's datasheets: fp32 matmuls with
# TF32 off (PyTorch's default) run at this rate, not at the 16-bit peak.
FP32_PEAK_TFLOPS = {"H200": 67.0, "H100": 67.0, "A100": 19.5}

_MATMUL_EFFICIENCY = 0.80  # 795 / 989 TFLOP/s, an 8192^3 bf16 GEMM on the H200 (module docstring)
_ATTENTION_EFFICIENCY = 0.57  # 564 / 989 TFLOP/s, causal SDPA forward on the H200
_ATTENTION_BACKWARD_EFFICIENCY = 0.40  # 2.5 x 0.49 ms of forward work in 2.25 - 0.49 ms, x 0.57
_MEMORY_EFFICIENCY = 0.55  # layer norm 52 %, GELU 62 % of the H200's 4.8 TB/s
# The share of its isolated-kernel speed a GPU keeps through a training step: fitted on three published H100
# runs, the others held out (module docstring). 1 / 1.206, the geometric mean of (1.28, 1.18, 1.16).
SUSTAINED = 0.83


@dataclass(frozen=True)
class GpuSpec:
    """One described GPU: its datasheet peaks and the shares of them operators reach.

    `bf16_tflops`: dense 16-bit tensor-core peak; `fp32_tflops`: dense fp32 peak (TF32 off); `memory_gb_s`:
    HBM bandwidth; `sms`: streaming multiprocessors; `memory_gib`: the card's memory. The efficiencies default
    to the H200 measurements of the module docstring; `sustained` is the share of that speed kept through a
    training step (`SUSTAINED`, fitted; 1: isolated kernels).
    """

    name: str
    bf16_tflops: float
    fp32_tflops: float
    memory_gb_s: float
    sms: int
    memory_gib: float
    matmul_efficiency: float = _MATMUL_EFFICIENCY
    attention_efficiency: float = _ATTENTION_EFFICIENCY
    attention_backward_efficiency: float = _ATTENTION_BACKWARD_EFFICIENCY
    memory_efficiency: float = _MEMORY_EFFICIENCY
    dispatch_s: float = DISPATCH_S
    sustained: float = SUSTAINED

    def __post_init__(self) -> None:
        example = 'GpuSpec("H100", 989, 67, 3350, 132, 80)'
        for field in ("bf16_tflops", "fp32_tflops", "memory_gb_s", "memory_gib"):
            validate.positive_number(f"GpuSpec {field}", getattr(self, field), example)
        validate.positive_int("GpuSpec sms", self.sms, example)
        for field in (
            "matmul_efficiency",
            "attention_efficiency",
            "attention_backward_efficiency",
            "memory_efficiency",
            "sustained",
        ):
            value = getattr(self, field)
            if not (isinstance(value, (int, float)) and 0 < value <= 1):
                raise ValueError(f"GpuSpec {field}={value!r} must be a share in (0, 1], e.g. 0.8")
        if not (isinstance(self.dispatch_s, (int, float)) and self.dispatch_s >= 0):
            raise ValueError(f"GpuSpec dispatch_s={self.dispatch_s!r} must be >= 0 seconds, e.g. 15e-6")

    def peak_flops(self, element_bytes: int) -> float:
        """FLOP/s at the peak for operands of `element_bytes` bytes: 16-bit on tensor cores, else fp32."""
        return (self.bf16_tflops if element_bytes <= 2 else self.fp32_tflops) * 1e12

    @property
    def curve(self) -> GemmCurve:
        return GemmCurve(self.sms, self.memory_gb_s)


def memory_s(gpu: GpuSpec, nbytes: float) -> float:
    """Seconds to read and write `nbytes` at the bandwidth memory-bound kernels reach."""
    return nbytes / (gpu.memory_gb_s * 1e9 * gpu.memory_efficiency)


def split_k(m: int, n: int, k: int, batch: int, curve: GemmCurve) -> int:
    """Into how many slices of K a matmul's output tiles are split so that a small output fills the SMs.

    cuBLAS and CUTLASS split the reduction dimension when the output has fewer tiles than the GPU has SMs
    and K is deep ("split-K" / "sliced-K", CUTLASS's "Efficient GEMM in CUDA"; Hopper's stream-K): each
    thread block sums a slice of K and the partial sums are added at the end. A slice is at least one tile
    deep. Without it a thin output (256 tokens x 2048) would use 32 of an H100's 132 SMs."""
    tiles = batch * math.ceil(m / curve.tile) * math.ceil(n / curve.tile)
    if tiles >= curve.sms:
        return 1
    return max(1, min(curve.sms // tiles, math.ceil(k / curve.tile)))


def matmul_s(gpu: GpuSpec, m: int, n: int, k: int, batch: int = 1, element_bytes: int = 2) -> float:
    """Device seconds of `batch` (m x k) @ (k x n) matmuls: FLOPs at the large-matmul efficiency times the
    tiles' and waves' share (the batch's outputs stacked into one grid of tiles; a small output split along K,
    `split_k`), or the operands' bytes (and the split's fp32 partial sums), whichever is longer. No host
    floor (`op_s` adds it)."""
    flops = 2.0 * batch * m * n * k
    curve = gpu.curve
    splits = split_k(m, n, k, batch, curve)
    # the tiles' fill times the waves' fill of tiles x splits work units on the SMs
    tiles = batch * math.ceil(m / curve.tile) * math.ceil(n / curve.tile)
    fill = batch * m * n / (tiles * curve.tile**2)
    units = tiles * splits
    share = fill * units / (math.ceil(units / curve.sms) * curve.sms)
    if splits == 1:
        share = quantization(batch * m, n, curve)  # the planner's curve, unchanged
    rate = gpu.peak_flops(element_bytes) * gpu.matmul_efficiency * share
    nbytes = element_bytes * batch * (m * k + k * n + m * n)
    if splits > 1:
        nbytes += 2 * 4 * splits * batch * m * n  # each slice's partial sums written and read back in fp32
    return max(flops / rate, memory_s(gpu, nbytes))


def attention_flops(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int, causal: bool) -> float:
    """Forward FLOPs of softmax(Q Kᵀ) V: two matmuls of 2·q·kv·d each per head, half of them skipped under a
    causal mask (FlashAttention's counting, Dao 2023, "FlashAttention-2", section 4.1: the benchmark's FLOPs
    halve for causal). Backward is 2.5 times the forward (its five matmuls to the forward's two)."""
    flops = 4.0 * batch * heads * q_len * kv_len * head_dim
    return flops / 2 if causal else flops


def kernel_s(
    gpu: GpuSpec,
    *,
    nbytes: float,
    flops: float = 0.0,
    matmul: tuple[int, int, int, int] | None = None,
    attention: str | None = None,
    element_bytes: int = 2,
) -> float:
    """Device seconds of one operator's kernel: its compute (a `matmul` of (batch, m, n, k); `attention`
    "forward" or "backward": its FLOPs at that pass's attention efficiency; other FLOPs at the peak) or its
    `nbytes` of memory traffic, whichever is longer. The host's dispatch is not in it (`op_s`)."""
    if matmul is not None:
        batch, m, n, k = matmul
        device = matmul_s(gpu, m, n, k, batch, element_bytes)
    else:
        share = {
            None: 1.0, "forward": gpu.attention_efficiency, "backward": gpu.attention_backward_efficiency
        }[attention]
        device = flops / (gpu.peak_flops(element_bytes) * share) if flops else 0.0
        device = max(device, memory_s(gpu, nbytes))
    return device / gpu.sustained


def op_s(gpu: GpuSpec, **kernel: object) -> float:
    """Seconds one operator takes when operators run back to back: its kernel (`kernel_s`, same arguments),
    never less than the host's dispatch, which issues one operator per `DISPATCH_S` (the planner's floor).
    `SimulatedDevice` keeps the host's clock apart instead: a long kernel hides the next dispatches."""
    return max(kernel_s(gpu, **kernel), gpu.dispatch_s)  # type: ignore[arg-type]
