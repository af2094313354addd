"""A lab's lesson forecast on paper: its before / after / limit on a described machine, and whether it
shows.

The course's targets for a timed lab are after/before <= 0.8 (the fix moves the number) and after/limit
<= 1.25 (it comes near the lab's limit, e.g. lab 04's ideal GPipe or 1F1B pipeline for the same work).
`Forecast.shows()` applies them to numbers from labkit's own models, so that a lab's GPU defaults are chosen
on paper and a test can say, without a GPU, that the lesson will show on a `Cluster.preset(...)` node. The
notebook still measures; where its measurement misses a target it says that the lesson does not show on the
machine it ran on (`verdict`).

`pipeline_forecast` is lab 04's (1F1B split by layer count with few micro-batches vs split by cost with the
micro-batches the bubble target asks for): each layer's cost per micro-batch on paper (the blocks' and the
head's FLOPs, the cross-entropy's and the embedding gradient's bytes at `HBM_BYTES_PER_S`, each at least its
host dispatches), a send and a receive of the activations at every stage boundary, and the step from
`labkit.pipeline_plan` (`pipeline_step_time`, `balance`, `ideal_step_time` for the limit).

`layout_forecast` is lab 01's (tensor parallelism over every GPU against the planner's pick): the planner's
own predictions (`labkit.planner.plan`), whose compute, tp, pp and dp terms each pay at least their
operators' host dispatches (`Rates.dispatch_s`), so a launch-bound layer is not made faster by splitting it.

`bandwidth_forecast` is lab 00's (the all-reduce bus bandwidth of the sweep's smallest and largest message
against the link's bandwidth): the α-β ring model of `labkit.links`, busbw as nccl-tests defines it. Bandwidth
is higher-is-better, so its targets are the timed ones inverted (before/after <= 0.8, limit/after <= 1.25).
The ring model overstates NCCL's small-message time (NCCL's LL protocol and NVLS pay less than 2(n-1)
latencies), so the forecast's `before` is low; the lesson, small messages far below the link, is the same.

`job_forecast` is lab 05's and the capstone's (the course's training job with mistakes planted, fixed, and
clean): `job_step_s` models one optimizer step of any `labkit.course.training.TrainingJob` from its knobs,
part by part as the trainer runs them: the micro-batches' layer costs above, the in-loop tokenizer (its share
of a forward and backward, as `tokenizer_passes` sizes it), the gradient all-reduce left after backward (DDP's
last bucket, or one all-reduce per gradient), the optimizer, the held-out evaluation on the slowest rank, the
logged accuracy (local, or every rank's logits all-gathered). Each operator costs at least its host
dispatch: on a launch-bound GPU device work only hides under the host's time where the device has slack.

`overlap_forecast` is lab 03's (gradient all-reduce after backward vs buckets during backward): compute from
the model's FLOPs at a stated rate (`labkit.planner.forward_flops_per_token`, backward = 2x forward) with a
floor of one host dispatch per kernel (eager PyTorch is launch-bound on small layers), communication from the
α-β ring model (`labkit.links.collective_time_s`) per tensor or per bucket, in DDP's bucket order (parameters
in reverse, filled up to the cap; Li et al. 2020, "PyTorch Distributed", VLDB, section 3.2.3). Overlapped,
the buckets run under backward but not under forward, and the last bucket waits for the end of backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from labkit.cluster import Cluster
from labkit.links import Link, bus_bandwidth_factor, collective_time_s
from labkit.models import GPT, GPTConfig
from labkit.op_time import FP32_PEAK_TFLOPS  # the labs train in fp32 with TF32 off: this rate
from labkit.pipeline_plan import (
    balance,
    choose_micro_batches,
    ideal_step_time,
    pipeline_step_time,
    stage_costs,
)
from labkit.planner import DISPATCH_S, KERNELS_PER_BLOCK, Rates, forward_flops_per_token, plan

__all__ = [
    "DISPATCH_S",
    "FP32_PEAK_TFLOPS",
    "KERNELS_PER_BLOCK",
    "TARGETS",
    "Forecast",
    "JobKnobs",
    "bandwidth_forecast",
    "bucket_sizes",
    "bus_bandwidth_gb_s",
    "fp32_flops_per_s",
    "job_forecast",
    "job_step_s",
    "layout_forecast",
    "lesson_shows",
    "overlap_forecast",
    "pipeline_forecast",
    "verdict",
]

TARGET_RATIO = 0.8  # after / before at most: the fix moves the number
TARGET_TO_LIMIT = 1.25  # after / limit at most: near the lab's limit (its ideal for the same work)
# HBM bandwidth reached by the memory-bound kernels (softmax, the embedding's gradient): below an H100 SXM's
# 3.35 TB/s and an H200's 4.8 TB/s datasheet figures, an assumption
HBM_BYTES_PER_S = 3.0e12
FP32_EFFICIENCY = 0.7  # of that peak on large fp32 matmuls: an assumption, stated where it is used


def fp32_flops_per_s(gpu_name: str, efficiency: float = FP32_EFFICIENCY) -> float | None:
    """The fp32 matmul rate assumed for a GPU named `gpu_name` ("NVIDIA H100 80GB HBM3",
    "H200-SXM-141GB"), None for a GPU not in `FP32_PEAK_TFLOPS`."""
    peak = next((v for k, v in FP32_PEAK_TFLOPS.items() if k in gpu_name.upper()), None)
    return None if peak is None else peak * 1e12 * efficiency


# Which targets a lesson is held to: a time it shortens towards a limit; a bandwidth it raises towards the
# link; a planted mistake's share of the step, which the fix removes (the limit is the clean job, a reference
# rather than a bound: lab 05's fixed straggler still evaluates, shared out, which the clean job does not).
TARGETS = ("time", "bandwidth", "share")


# The two ratios each kind of target bounds, with their bounds
_BOUNDS = {
    "time": (("after/before", TARGET_RATIO), ("after/limit", TARGET_TO_LIMIT)),
    "bandwidth": (("before/after", TARGET_RATIO), ("limit/after", TARGET_TO_LIMIT)),
    "share": (("after/before", TARGET_RATIO), ("limit/before", TARGET_RATIO)),
}


def _ratios(before: float, after: float, limit: float, targets: str) -> tuple[dict[str, float], bool]:
    """The ratios a lesson's targets look at, and whether both are within their bounds."""
    if targets not in TARGETS:
        raise ValueError(f"targets={targets!r} must be one of {', '.join(TARGETS)}")
    values = {"before": before, "after": after, "limit": limit}
    ratios = {}
    for name, _ in _BOUNDS[targets]:
        top, bottom = name.split("/")
        ratios[name] = values[top] / values[bottom]
    return ratios, all(ratios[name] <= bound for name, bound in _BOUNDS[targets])


def _targets_text(targets: str) -> str:
    return " and ".join(f"{name} <= {bound}" for name, bound in _BOUNDS[targets])


def lesson_shows(before: float, after: float, limit: float, *, targets: str = "time") -> bool:
    """The course's targets: for a time after/before <= 0.8 and after/limit <= 1.25; for a bandwidth
    (higher is better) before/after <= 0.8 and limit/after <= 1.25; for a planted mistake's share of the step
    after/before <= 0.8 and limit/before <= 0.8 (it costs at least a fifth, and the fix takes it off)."""
    return _ratios(before, after, limit, targets)[1]


def verdict(
    before: float,
    after: float,
    limit: float,
    label: str,
    *,
    targets: str = "time",
    hint: str = "see the forecast above for sizes where it shows",
) -> str:
    """What a notebook prints under its measured numbers: the check, or that the lesson does not show here
    (then `hint`: where it would)."""
    ratios, shows = _ratios(before, after, limit, targets)
    numbers = ", ".join(f"{k} = {v:.2f}" for k, v in ratios.items()) + f" ({label})"
    if shows:
        return f"check passed: {numbers}"
    return (
        f"the lesson does not show on this machine: {numbers}; the course's targets are "
        f"{_targets_text(targets)}. The effect is too small (or too large to hide) at these sizes here: "
        f"{hint}"
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
    targets: str = "time"  # which of TARGETS the lesson is held to

    def __post_init__(self) -> None:
        _ratios(self.before, self.after, self.limit, self.targets)  # a bad `targets` raises here

    def shows(self) -> bool:
        """Whether the lesson shows: the course's targets (`lesson_shows`)."""
        return lesson_shows(self.before, self.after, self.limit, targets=self.targets)

    def __str__(self) -> str:
        terms = ", ".join(f"{k} {v:.3g} ms" for k, v in self.terms.items())
        verdict = "shows" if self.shows() else "does not show"
        note = f"; {self.note}" if self.note else ""
        u = self.unit
        values, _ = _ratios(self.before, self.after, self.limit, self.targets)
        ratios = ", ".join(f"{k} {v:.2f}" for k, v in values.items())
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
        targets="bandwidth",
    )


def layout_forecast(
    config: GPTConfig,
    cluster: Cluster,
    global_batch: int,
    micro_batch_sizes: tuple[int, ...],
    rates: Rates,
    *,
    where: str = "",
) -> Forecast:
    """Lab 01 on paper: tensor parallelism over every GPU of `cluster` (before) against the planner's pick
    (after), as the lab plans (fp32, Adam, no ZeRO, no checkpointing, its dp all-reduce after backward,
    `cluster.memory_gib` per GPU). The limit
    is the fastest layout the planner accepts, on paper the pick itself (the lab's limit is the fastest one
    measured), so only after/before tells here."""
    the_plan = plan(
        config,
        cluster,
        global_batch,
        precision="fp32",
        rates=rates,
        micro_batch_sizes=micro_batch_sizes,
        zero_stages=(0,),
        checkpointing=(False,),
        dp_overlap=False,  # the lab's runs all-reduce the gradients in one call after backward
    )
    tp_all = the_plan.candidate(1, cluster.world_size, 1)
    if tp_all.predicted_ms is None:
        raise ValueError(f"tensor parallelism over {cluster.world_size} GPUs: {tp_all.reason}")
    pick = the_plan.best
    return Forecast(
        "01_parallelism_choice",
        tp_all.predicted_ms,
        pick.predicted_ms,
        min(c.predicted_ms for c in the_plan.candidates if c.ok),
        where or f"{cluster.nodes} x {cluster.gpus_per_node} GPUs",
        {f"{tp_all.layout} {k}": v for k, v in tp_all.parts_ms.items() if v}
        | {f"{pick.layout} {k}": v for k, v in pick.parts_ms.items() if v},
        f"the pick: {pick.layout}",
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
    # One pass over every gradient (read and write, memory-bound, on the compute stream, so it overlaps
    # nothing): the naive loop makes one (the average, div_); the buckets three (labkit.parallel.data: the
    # copy in during backward, then the average and the copy back), as torch DDP's reducer does unless
    # gradient_as_bucket_view=True. On 2 NVLink ranks those two extra passes cost about what the all-reduce
    # they hide does, so the lesson needs more ranks there (issue 44: the simulated node measured 0.96)
    pass_s = 2 * sum(numels) * bytes_per_grad / HBM_BYTES_PER_S
    before_s = compute_s + per_tensor_s + pass_s
    after_s = max(compute_s + pass_s + times[-1], forward_s + pass_s + bucketed_s) + 2 * pass_s
    limit_s = max(compute_s + 3 * pass_s, bucketed_s)
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
            "a pass over the gradients": pass_s * 1e3,
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


def _forward_s(config: GPTConfig, tokens: int, flops_per_s: float) -> float:
    """One forward (evaluation: no backward) of `tokens`: its FLOPs, the logits written and read, at least
    its dispatches."""
    block_f, head_f = forward_flops_per_token(config)
    device = tokens * (config.n_layers * block_f + head_f) / flops_per_s
    device += 2 * tokens * config.vocab_size * 4 / HBM_BYTES_PER_S
    return max(device, (config.n_layers * KERNELS_PER_BLOCK / 3 + 2) * DISPATCH_S)


def _bytes_or_dispatch_s(nbytes: float, kernels: int) -> float:
    """A memory-bound piece of work: its bytes at HBM speed, at least its kernels' dispatches."""
    return max(nbytes / HBM_BYTES_PER_S, kernels * DISPATCH_S)


# An optimizer step per parameter: (4-byte passes over memory, foreach operator calls). SGD without momentum
# reads p and g and writes p; Adam reads p, g and both moments and writes p and the moments, in about a dozen
# foreach calls (torch/optim/adam.py, _multi_tensor_adam), AdamW one more for its decoupled decay. Each
# foreach call is counted as one dispatch: an assumption (a call launches a kernel per chunk of tensors).
_OPTIMIZER_COST = {"sgd": (3, 3), "adam": (7, 12), "adamw": (8, 13)}


class JobKnobs(Protocol):
    """The knobs of a training job this model reads (`labkit.course.training.TrainingJob` has them)."""

    global_batch: int
    micro_batch: int
    optimizer: str
    checkpointing: bool
    grad_sync: str
    bucket_cap_mb: float
    eval_samples: int
    eval_rank: int | None
    tokenize: str
    tokenizer_cost: float
    accuracy: str

    def accumulation(self, world_size: int) -> int: ...


def _grad_sync_s(job: JobKnobs, numels: list[int], world_size: int, link: Link) -> float:
    """After backward: DDP's last bucket (the others ran under backward) and every bucket's dispatch; the
    per-tensor loop's all-reduces one after another, each at least its dispatch."""
    if job.grad_sync == "none" or world_size == 1:
        return 0.0
    if job.grad_sync == "per_tensor":
        return sum(max(collective_time_s("all_reduce", 4 * n, world_size, link), DISPATCH_S) for n in numels)
    buckets = bucket_sizes(numels, job.bucket_cap_mb * 2**20, 4)
    last = collective_time_s("all_reduce", buckets[-1], world_size, link)
    return max(last, DISPATCH_S) + len(buckets) * DISPATCH_S


def job_step_s(
    config: GPTConfig, job: JobKnobs, world_size: int, link: Link, flops_per_s: float
) -> dict[str, float]:
    """One optimizer step of `job` on paper, on the slowest of `world_size` ranks whose slowest link is
    `link`: seconds per part, in the order `labkit.course.training.Trainer` runs them (module docstring)."""
    micro_tokens = job.micro_batch * config.seq_len
    numels = _param_numels(config)
    compute = job.accumulation(world_size) * sum(_layer_costs_s(config, micro_tokens, flops_per_s))
    if job.checkpointing:  # backward runs each block's forward again
        compute *= 4 / 3
    parts = {"forward and backward": compute}
    if job.tokenize == "in_loader":
        # `tokenizer_passes` sizes the tokenizer against one forward and backward of the rank's whole share
        # in one batch; on a launch-bound GPU that costs about one micro-batch, not the step's
        share_tokens = job.global_batch // world_size * config.seq_len
        parts["tokenizer in the loop"] = job.tokenizer_cost * sum(
            _layer_costs_s(config, share_tokens, flops_per_s)
        )
    parts["gradient all-reduce after backward"] = _grad_sync_s(job, numels, world_size, link)
    passes, kernels = _OPTIMIZER_COST[job.optimizer]
    parts["optimizer"] = _bytes_or_dispatch_s(passes * 4 * sum(numels), kernels)
    parts["optimizer"] += _bytes_or_dispatch_s(4 * sum(numels), 1)  # zero_grad(set_to_none=False)
    if job.eval_samples:
        rows = job.eval_samples if job.eval_rank is not None else -(-job.eval_samples // world_size)
        forwards = -(-rows // job.micro_batch)
        parts["evaluation"] = forwards * _forward_s(config, micro_tokens, flops_per_s)
    logits_bytes = micro_tokens * config.vocab_size * 4
    if job.accuracy == "local":  # scored here, two numbers all-reduced asynchronously
        parts["logged accuracy"] = _bytes_or_dispatch_s(logits_bytes, 4) + DISPATCH_S
    elif job.accuracy == "gathered":  # every rank's logits all-gathered, blocking, then scored
        gather = collective_time_s("all_gather", world_size * logits_bytes, world_size, link)
        parts["logged accuracy"] = max(gather, DISPATCH_S) + _bytes_or_dispatch_s(
            world_size * logits_bytes, 3
        )
    return parts


def job_forecast(
    config: GPTConfig,
    planted: JobKnobs,
    fixed: JobKnobs,
    clean: JobKnobs,
    world_size: int,
    link: Link,
    flops_per_s: float,
    *,
    lab: str = "05_unprofiled_run",
    where: str = "",
    note: str = "",
) -> Forecast:
    """Labs 05 and 06 on paper: the course's job with mistakes planted (before), fixed (after) and clean
    (limit), each step from `job_step_s`, on `world_size` ranks whose slowest link is `link`. Held to the
    "share" targets: the mistakes cost at least a fifth of the step and the fix takes most of it off. The
    terms are the planted job's parts that differ from the clean job's (ms)."""
    before, after, limit = (
        job_step_s(config, job, world_size, link, flops_per_s) for job in (planted, fixed, clean)
    )
    terms = {k: v * 1e3 for k, v in before.items() if abs(v - limit.get(k, 0.0)) > 1e-12}
    return Forecast(
        lab,
        sum(before.values()) * 1e3,
        sum(after.values()) * 1e3,
        sum(limit.values()) * 1e3,
        where or f"{world_size} ranks on {link.name or 'a link'}",
        {"clean step": sum(limit.values()) * 1e3, **terms},
        note,
        targets="share",
    )
