"""A lab's lesson forecast on paper: its before / after / limit on a described machine, and whether it
shows.

The course's targets for a timed lab are after/before <= 0.8 (the fix moves the number) and after/limit
<= 1.25 (it comes near what no schedule can beat). `Forecast.shows()` applies them to numbers from labkit's
own models, so that a lab's GPU defaults are chosen on paper and a test can say, without a GPU, that the
lesson will show on a `Cluster.preset(...)` node. The notebook still measures; where its measurement misses
a target it says that the lesson does not show on the machine it ran on (`verdict`).

`pipeline_forecast` is lab 04's (1F1B split by layer count with few micro-batches vs split by cost with the
micro-batches the bubble target asks for): each layer's cost per micro-batch on paper (the blocks' and the
head's FLOPs, the cross-entropy's and the embedding gradient's bytes at `HBM_BYTES_PER_S`, each at least its
host dispatches), a send and a receive of the activations at every stage boundary, and the step from
`labkit.pipeline_plan` (`pipeline_step_time`, `balance`, `ideal_step_time` for the limit).

`bandwidth_forecast` is lab 00's (the all-reduce bus bandwidth of the sweep's smallest and largest message
against the link's bandwidth): the α-β ring model of `labkit.links`, busbw as nccl-tests defines it. Bandwidth
is higher-is-better, so its targets are the timed ones inverted (before/after <= 0.8, limit/after <= 1.25).
The ring model overstates NCCL's small-message time (NCCL's LL protocol and NVLS pay less than 2(n-1)
latencies), so the forecast's `before` is low; the lesson, small messages far below the link, is the same.

`overlap_forecast` is lab 03's (gradient all-reduce after backward vs buckets during backward): compute from
the model's FLOPs at a stated rate (`labkit.planner.forward_flops_per_token`, backward = 2x forward) with a
floor of one host dispatch per kernel (eager PyTorch is launch-bound on small layers), communication from the
α-β ring model (`labkit.links.collective_time_s`) per tensor or per bucket, in DDP's bucket order (parameters
in reverse, filled up to the cap; Li et al. 2020, "PyTorch Distributed", VLDB, section 3.2.3). Overlapped,
the buckets run under backward but not under forward, and the last bucket waits for the end of backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from labkit.links import Link, bus_bandwidth_factor, collective_time_s
from labkit.models import GPT, GPTConfig
from labkit.pipeline_plan import (
    balance,
    choose_micro_batches,
    ideal_step_time,
    pipeline_step_time,
    stage_costs,
)
from labkit.planner import forward_flops_per_token

__all__ = [
    "DISPATCH_S",
    "FP32_PEAK_TFLOPS",
    "KERNELS_PER_BLOCK",
    "Forecast",
    "bandwidth_forecast",
    "bucket_sizes",
    "bus_bandwidth_gb_s",
    "fp32_flops_per_s",
    "lesson_shows",
    "overlap_forecast",
    "pipeline_forecast",
    "verdict",
]

TARGET_RATIO = 0.8  # after / before at most: the fix moves the number
TARGET_TO_LIMIT = 1.25  # after / limit at most: near what no schedule beats
# Eager PyTorch spends some 10-20 us of host time per operator (dispatch and launch); a GPT block's forward
# and backward run about 30 of them. A step is never faster than the host can issue it.
DISPATCH_S = 15e-6
KERNELS_PER_BLOCK = 30
# Dense FP32 (not tensor-core) peak per GPU, TFLOP/s, from NVIDIA's datasheets: the labs train in fp32 with
# TF32 off (PyTorch's default for matmuls), so their matmuls run at this rate, not at the 16-bit peak.
FP32_PEAK_TFLOPS = {"H200": 67.0, "H100": 67.0, "A100": 19.5}
# HBM bandwidth reached by the memory-bound kernels (softmax, the embedding's gradient): below an H100 SXM's
# 3.35 TB/s and an H200's 4.8 TB/s datasheet figures, an assumption
HBM_BYTES_PER_S = 3.0e12
FP32_EFFICIENCY = 0.7  # of that peak on large fp32 matmuls: an assumption, stated where it is used


def fp32_flops_per_s(gpu_name: str, efficiency: float = FP32_EFFICIENCY) -> float | None:
    """The fp32 matmul rate assumed for a GPU named `gpu_name` ("NVIDIA H100 80GB HBM3",
    "H200-SXM-141GB"), None for a GPU not in `FP32_PEAK_TFLOPS`."""
    peak = next((v for k, v in FP32_PEAK_TFLOPS.items() if k in gpu_name.upper()), None)
    return None if peak is None else peak * 1e12 * efficiency


def lesson_shows(before: float, after: float, limit: float, *, higher_is_better: bool = False) -> bool:
    """The course's targets for a timed lab: after/before <= 0.8 and after/limit <= 1.25 (for a bandwidth,
    higher is better: before/after <= 0.8 and limit/after <= 1.25)."""
    if higher_is_better:
        return before <= TARGET_RATIO * after and limit <= TARGET_TO_LIMIT * after
    return after <= TARGET_RATIO * before and after <= TARGET_TO_LIMIT * limit


def verdict(before: float, after: float, limit: float, label: str, *, higher_is_better: bool = False) -> str:
    """What a notebook prints under its measured numbers: the check, or that the lesson does not show here."""
    if higher_is_better:
        numbers = f"before/after = {before / after:.2f}, limit/after = {limit / after:.2f} ({label})"
        targets = f"before/after <= {TARGET_RATIO} and limit/after <= {TARGET_TO_LIMIT}"
    else:
        numbers = f"after/before = {after / before:.2f}, after/limit = {after / limit:.2f} ({label})"
        targets = f"after/before <= {TARGET_RATIO} and after/limit <= {TARGET_TO_LIMIT}"
    if lesson_shows(before, after, limit, higher_is_better=higher_is_better):
        return f"check passed: {numbers}"
    return (
        f"the lesson does not show on this machine: {numbers}; the course's targets are {targets}. The "
        "effect is too small (or too large to hide) at these sizes here: see the forecast above for sizes "
        "where it shows"
    )


@dataclass(frozen=True)
class Forecast:
    """One lab's numbers on paper (in `unit`: ms, or GB/s for a bandwidth), the terms behind them (ms), and
    the machine they are for."""

    lab: str
    before: float
    after: float
    limit: float
    where: str
    terms: dict[str, float] = field(default_factory=dict)  # ms
    note: str = ""
    unit: str = "ms"
    higher_is_better: bool = False  # a bandwidth; a time is lower-is-better

    def shows(self) -> bool:
        """Whether the lesson shows: the course's targets (`lesson_shows`)."""
        return lesson_shows(self.before, self.after, self.limit, higher_is_better=self.higher_is_better)

    def __str__(self) -> str:
        terms = ", ".join(f"{k} {v:.3g} ms" for k, v in self.terms.items())
        verdict = "shows" if self.shows() else "does not show"
        note = f"; {self.note}" if self.note else ""
        u = self.unit
        ratios = (
            f"before/after {self.before / self.after:.2f}, limit/after {self.limit / self.after:.2f}"
            if self.higher_is_better
            else f"after/before {self.after / self.before:.2f}, after/limit {self.after / self.limit:.2f}"
        )
        return (
            f"{self.lab} on {self.where}: before {self.before:.4g} {u}, after {self.after:.4g} {u}, limit "
            f"{self.limit:.4g} {u} ({ratios}): the lesson {verdict} ({terms}{note})"
        )


def bus_bandwidth_gb_s(nbytes: int, world_size: int, link: Link) -> float:
    """The α-β ring model's all-reduce bus bandwidth (GB/s) of an `nbytes` message on `world_size` ranks."""
    seconds = collective_time_s("all_reduce", nbytes, world_size, link)
    return nbytes / seconds / 1e9 * bus_bandwidth_factor("all_reduce", world_size)


def bandwidth_forecast(sizes: list[int], world_size: int, link: Link, *, where: str = "") -> Forecast:
    """Lab 00 on paper: all-reduce bus bandwidth of the smallest and the largest of `sizes` (bytes) on
    `world_size` ranks over `link`, against the link's bandwidth."""
    small, large = min(sizes), max(sizes)
    def ms(n: int) -> float:
        return collective_time_s("all_reduce", n, world_size, link) * 1e3

    return Forecast(
        "00_cluster_tour",
        bus_bandwidth_gb_s(small, world_size, link),
        bus_bandwidth_gb_s(large, world_size, link),
        link.bandwidth_gb_s,
        where or f"{world_size} ranks on {link.name or 'a link'}",
        {f"all_reduce of {small} B": ms(small), f"all_reduce of {large} B": ms(large)},
        unit="GB/s",
        higher_is_better=True,
    )


def _param_numels(config: GPTConfig) -> list[int]:
    with torch.device("meta"):  # shapes only: nothing is allocated
        return [p.numel() for p in GPT(config).parameters()]


def bucket_sizes(numels: list[int], cap_bytes: float, bytes_per_grad: int) -> list[int]:
    """DDP's buckets in bytes: the gradients in reverse parameter order (about the order backward produces
    them), each bucket filled until the next gradient would pass `cap_bytes` (at least one gradient each)."""
    buckets: list[int] = []
    current = 0
    for n in reversed(numels):
        size = n * bytes_per_grad
        if current and current + size > cap_bytes:
            buckets.append(current)
            current = 0
        current += size
    if current:
        buckets.append(current)
    return buckets


def overlap_forecast(
    config: GPTConfig,
    micro_batch: int,
    world_size: int,
    link: Link,
    flops_per_s: float,
    *,
    bucket_cap_mb: float,
    bytes_per_grad: int = 4,
    where: str = "",
) -> Forecast:
    """Lab 03 on paper: one data-parallel step on `world_size` ranks whose slowest link is `link`."""
    block_f, head_f = forward_flops_per_token(config)
    tokens = micro_batch * config.seq_len
    forward_s = max(
        tokens * (config.n_layers * block_f + head_f) / flops_per_s,
        config.n_layers * KERNELS_PER_BLOCK / 3 * DISPATCH_S,
    )
    compute_s = 3 * forward_s  # backward does twice the forward's matmuls
    numels = _param_numels(config)
    per_tensor_s = sum(collective_time_s("all_reduce", n * bytes_per_grad, world_size, link) for n in numels)
    buckets = bucket_sizes(numels, bucket_cap_mb * 2**20, bytes_per_grad)
    times = [collective_time_s("all_reduce", b, world_size, link) for b in buckets]
    bucketed_s = sum(times)
    before_s = compute_s + per_tensor_s
    after_s = max(compute_s + times[-1], forward_s + bucketed_s)
    limit_s = max(compute_s, bucketed_s)
    return Forecast(
        "03_unoverlapped_comms",
        before_s * 1e3,
        after_s * 1e3,
        limit_s * 1e3,
        where or f"{world_size} ranks on {link.name or 'a link'}",
        {
            "compute": compute_s * 1e3,
            "per-tensor all-reduces": per_tensor_s * 1e3,
            f"{len(buckets)} buckets": bucketed_s * 1e3,
        },
    )


def _layer_costs_s(config: GPTConfig, tokens: int, flops_per_s: float) -> list[float]:
    """Forward + backward seconds of each layer (embedding, blocks, head) on a micro-batch of `tokens`."""
    block_f, head_f = forward_flops_per_token(config)
    floor = KERNELS_PER_BLOCK * DISPATCH_S
    embedding_grad = 2 * config.vocab_size * config.d_model * 4 / HBM_BYTES_PER_S  # zeroed, then added into
    softmax = 4 * tokens * config.vocab_size * 4 / HBM_BYTES_PER_S  # logits written, read, grad out and back
    block = max(3 * block_f * tokens / flops_per_s, floor)
    head = max(3 * head_f * tokens / flops_per_s + softmax, floor / 3)
    return [max(embedding_grad, floor / 10)] + [block] * config.n_layers + [head]


def _step_s(
    config: GPTConfig, sizes: list[int], micro_batches: int, tokens: int, link: Link, flops_per_s: float
) -> tuple[float, float, list[float]]:
    """(1F1B step, its balanced limit, per-stage cost) for a split: each stage but the last also sends its
    activations forward and receives their gradient back."""
    costs = _layer_costs_s(config, tokens, flops_per_s)
    hop = 2 * collective_time_s("send", tokens * config.d_model * 4, 2, link)
    per_stage = [c + (hop if s < len(sizes) - 1 else 0.0) for s, c in enumerate(stage_costs(costs, sizes))]
    return pipeline_step_time(per_stage, micro_batches), ideal_step_time(per_stage, micro_batches), per_stage


def pipeline_forecast(
    config: GPTConfig,
    stages: int,
    global_batch: int,
    few_micro_batches: int,
    link: Link,
    flops_per_s: float,
    *,
    max_bubble: float = 0.3,
    where: str = "",
) -> Forecast:
    """Lab 04 on paper: the naive run (layer count, `few_micro_batches`) vs the balanced one (the micro-batch
    count `choose_micro_batches` picks for `max_bubble`; activation memory is assumed to fit)."""
    m = choose_micro_batches(stages, global_batch, max_bubble, "1f1b")
    few_tokens = global_batch // few_micro_batches * config.seq_len
    tokens = global_batch // m * config.seq_len
    naive = [config.n_layers // stages + (1 if s < config.n_layers % stages else 0) for s in range(stages)]
    naive[0] += 1  # the embedding rides with the first stage, the head with the last (parallel.even_split)
    naive[-1] += 1
    before_s, _, naive_stages = _step_s(config, naive, few_micro_batches, few_tokens, link, flops_per_s)
    balanced = balance(_layer_costs_s(config, tokens, flops_per_s), stages)
    after_s, limit_s, _ = _step_s(config, balanced, m, tokens, link, flops_per_s)
    imbalance = max(naive_stages) / (sum(naive_stages) / stages)
    return Forecast(
        "04_imbalanced_pipeline",
        before_s * 1e3,
        after_s * 1e3,
        limit_s * 1e3,
        where or f"{stages} stages on {link.name or 'a link'}",
        {
            "naive slowest stage": max(naive_stages) * 1e3,
            "naive mean stage": sum(naive_stages) / stages * 1e3,
        },
        f"imbalance x{imbalance:.2f}; {few_micro_batches} -> {m} micro-batches",
    )
