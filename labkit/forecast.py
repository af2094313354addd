"""A lab's lesson forecast on paper: its before / after / limit on a described machine, and whether it
shows.

The course's targets for a timed lab are after/before <= 0.8 (the fix moves the number) and after/limit
<= 1.25 (it comes near what no schedule can beat). `Forecast.shows()` applies them to numbers from labkit's
own models, so that a lab's GPU defaults are chosen on paper and a test can say, without a GPU, that the
lesson will show on a `Cluster.preset(...)` node. The notebook still measures; where its measurement misses
a target it says that the lesson does not show on the machine it ran on (`verdict`).

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

from labkit.links import Link, collective_time_s
from labkit.models import GPT, GPTConfig
from labkit.planner import forward_flops_per_token

__all__ = [
    "DISPATCH_S",
    "FP32_PEAK_TFLOPS",
    "KERNELS_PER_BLOCK",
    "Forecast",
    "bucket_sizes",
    "fp32_flops_per_s",
    "lesson_shows",
    "overlap_forecast",
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
FP32_EFFICIENCY = 0.7  # of that peak on large fp32 matmuls: an assumption, stated where it is used


def fp32_flops_per_s(gpu_name: str, efficiency: float = FP32_EFFICIENCY) -> float | None:
    """The fp32 matmul rate assumed for a GPU named `gpu_name` ("NVIDIA H100 80GB HBM3",
    "H200-SXM-141GB"), None for a GPU not in `FP32_PEAK_TFLOPS`."""
    peak = next((v for k, v in FP32_PEAK_TFLOPS.items() if k in gpu_name.upper()), None)
    return None if peak is None else peak * 1e12 * efficiency


def lesson_shows(before: float, after: float, limit: float) -> bool:
    """The course's targets for a timed lab: after/before <= 0.8 and after/limit <= 1.25."""
    return after <= TARGET_RATIO * before and after <= TARGET_TO_LIMIT * limit


def verdict(before: float, after: float, limit: float, label: str) -> str:
    """What a notebook prints under its measured numbers: the check, or that the lesson does not show here."""
    ratio, to_limit = after / before, after / limit
    numbers = f"after/before = {ratio:.2f}, after/limit = {to_limit:.2f} ({label})"
    if lesson_shows(before, after, limit):
        return f"check passed: {numbers}"
    return (
        f"the lesson does not show on this machine: {numbers}; the course's targets are "
        f"after/before <= {TARGET_RATIO} and after/limit <= {TARGET_TO_LIMIT}. The effect is too small (or "
        "too large to hide) at these sizes here: see the forecast above for sizes where it shows"
    )


@dataclass(frozen=True)
class Forecast:
    """One lab's numbers on paper (ms), the terms behind them, and the machine they are for."""

    lab: str
    before: float
    after: float
    limit: float
    where: str
    terms: dict[str, float] = field(default_factory=dict)

    def shows(self) -> bool:
        """Whether the lesson shows: after/before <= 0.8 and after/limit <= 1.25."""
        return lesson_shows(self.before, self.after, self.limit)

    def __str__(self) -> str:
        terms = ", ".join(f"{k} {v:.2f} ms" for k, v in self.terms.items())
        verdict = "shows" if self.shows() else "does not show"
        return (
            f"{self.lab} on {self.where}: before {self.before:.2f} ms, after {self.after:.2f} ms, limit "
            f"{self.limit:.2f} ms (after/before {self.after / self.before:.2f}, after/limit "
            f"{self.after / self.limit:.2f}): the lesson {verdict} ({terms})"
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
