"""Pipeline-parallel arithmetic: balanced stage splits and the bubble of an ideal schedule.

* `balance(costs, stages)`: the contiguous split of layers into stages that minimises the most
  expensive stage, exactly (dynamic programming), with the naive split by layer count,
  `split_evenly`, next to it;
* `bubble_fraction(stages, micro_batches, schedule, chunks)`: the idle fraction of an ideal
  pipeline step, and `pipeline_step_time` / `ideal_step_time` for measured stage costs;
* `micro_batches_for_bubble` and `in_flight`: how many micro-batches a bubble target needs and how
  many each schedule keeps alive at once (what activation memory bounds);
* `profile_layers(model, x, y)`: the measured forward + backward cost and saved activation bytes
  of each layer of a `labkit.models.GPT`, embedding and head included: the costs `balance` splits.

Formulas: Huang et al. 2019 (GPipe) and Narayanan et al. 2021 (*Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM*, section 2.2), whose bubble *overhead*
(p-1)/m (or (p-1)/(v·m) interleaved) is idle time over ideal time; this module's fraction is idle
time over the whole step, (p-1)/(m+p-1), the same quantity seen from the step. Lab 04 measures
what these predict with `torch.distributed.pipelining`.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from labkit import validate

__all__ = [
    "SCHEDULES",
    "LayerProfile",
    "balance",
    "bubble_fraction",
    "ideal_step_time",
    "in_flight",
    "micro_batches_for_bubble",
    "pipeline_step_time",
    "profile_layers",
    "split_evenly",
    "stage_costs",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def _check_costs(costs: Sequence[float], stages: int) -> list[float]:
    validate.positive_int("stages", stages, "balance(costs, stages=4)")
    values = list(costs)
    if not values:
        raise ValueError("costs is empty: pass one measured cost per layer, e.g. balance([3.0, 1.0, 1.0, 2.0], 2)")
    for i, c in enumerate(values):
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c <= 0:
            raise ValueError(f"costs[{i}]={c!r} must be a finite number > 0 (a layer's measured time); "
                             "e.g. the ms per micro-batch from labkit.pipeline's profile")
    if stages > len(values):
        raise ValueError(f"stages={stages} is more than the {len(values)} layers in costs: every stage needs at "
                         f"least one layer; use stages <= {len(values)} or split the model finer")
    return [float(c) for c in values]


def split_evenly(layers: int, stages: int) -> list[int]:
    """The naive split: the same number of layers per stage (the first stages take the remainder)."""
    validate.positive_int("layers", layers, "split_evenly(12, 4)")
    validate.positive_int("stages", stages, "split_evenly(12, stages=4)")
    if stages > layers:
        raise ValueError(f"stages={stages} is more than layers={layers}: use stages <= {layers}")
    return [layers // stages + (1 if s < layers % stages else 0) for s in range(stages)]


def stage_costs(costs: Sequence[float], sizes: Sequence[int]) -> list[float]:
    """The cost of each stage of a split (`sizes` consecutive layers each)."""
    if sum(sizes) != len(costs) or any(n <= 0 for n in sizes):
        raise ValueError(f"sizes={list(sizes)} must be positive and add up to the {len(costs)} layers")
    out, start = [], 0
    for n in sizes:
        out.append(float(sum(costs[start:start + n])))
        start += n
    return out


def balance(costs: Sequence[float], stages: int) -> list[int]:
    """Layers per stage for the contiguous split whose most expensive stage is cheapest.

    Exact: best[k][i] is the smallest bottleneck of the first i layers in k stages, the minimum
    over j of max(best[k-1][j], cost of layers j..i-1); O(stages · n²), instant for a model's layers.
    """
    c = _check_costs(costs, stages)
    n = len(c)
    prefix = [0.0]
    for x in c:
        prefix.append(prefix[-1] + x)
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):  # leave at least one layer per remaining stage
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    sizes, i = [], n
    for k in range(stages, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def _check_schedule(stages: int, micro_batches: int, schedule: str, chunks: int) -> None:
    validate.positive_int("stages", stages, "bubble_fraction(4, 8)")
    validate.positive_int("micro_batches", micro_batches, "bubble_fraction(4, micro_batches=8)")
    validate.one_of("schedule", schedule, SCHEDULES, 'bubble_fraction(4, 8, schedule="1f1b")')
    validate.positive_int("chunks", chunks, 'bubble_fraction(4, 8, "interleaved_1f1b", chunks=2)')
    if schedule != "interleaved_1f1b" and chunks != 1:
        raise ValueError(f"chunks={chunks} needs schedule='interleaved_1f1b' (GPipe and 1F1B hold one chunk per rank)")
    if schedule == "interleaved_1f1b" and micro_batches % stages:
        raise ValueError(f"micro_batches={micro_batches} must be a multiple of stages={stages} for the interleaved "
                         "schedule (Narayanan et al. 2021, section 2.2.2); e.g. micro_batches="
                         f"{stages * max(1, round(micro_batches / stages))}")


def bubble_fraction(stages: int, micro_batches: int, schedule: str = "1f1b", chunks: int = 1) -> float:
    """Idle fraction of an ideal pipeline step: (p-1)/(m+p-1) for GPipe and 1F1B (the same: 1F1B
    reorders the work, it does not shorten the fill and drain), (p-1)/(v·m+p-1) interleaved."""
    _check_schedule(stages, micro_batches, schedule, chunks)
    v = chunks if schedule == "interleaved_1f1b" else 1
    return (stages - 1) / (v * micro_batches + stages - 1)


def pipeline_step_time(costs_per_stage: Sequence[float], micro_batches: int) -> float:
    """Time of one GPipe or 1F1B step from each stage's cost per micro-batch (forward + backward):
    the first micro-batch crosses every stage, then the slowest stage sets the pace."""
    validate.positive_int("micro_batches", micro_batches, "pipeline_step_time(costs, micro_batches=8)")
    c = _check_costs(costs_per_stage, 1)
    return sum(c) + (micro_batches - 1) * max(c)


def ideal_step_time(costs_per_stage: Sequence[float], micro_batches: int) -> float:
    """The same work perfectly balanced: mean stage cost x (m + p - 1); no split beats it."""
    validate.positive_int("micro_batches", micro_batches, "ideal_step_time(costs, micro_batches=8)")
    c = _check_costs(costs_per_stage, 1)
    return sum(c) / len(c) * (micro_batches + len(c) - 1)


def micro_batches_for_bubble(stages: int, max_bubble: float, schedule: str = "1f1b", chunks: int = 1) -> int:
    """The fewest micro-batches whose ideal bubble fraction is at most `max_bubble` (0 < max_bubble < 1)."""
    validate.positive_int("stages", stages, "micro_batches_for_bubble(4, 0.2)")
    if not isinstance(max_bubble, (int, float)) or not 0 < max_bubble < 1:
        raise ValueError(f"max_bubble={max_bubble!r} must be a fraction between 0 and 1; e.g. 0.2 for 20 %")
    v = chunks if schedule == "interleaved_1f1b" else 1
    m = max(1, math.ceil((stages - 1) * (1 - max_bubble) / (max_bubble * v) - 1e-9))
    if schedule == "interleaved_1f1b":
        m = stages * math.ceil(m / stages)
    _check_schedule(stages, m, schedule, chunks)
    return m


def in_flight(schedule: str, stages: int, micro_batches: int, stage: int = 0) -> int:
    """Micro-batches whose activations a stage holds at once: all m under GPipe (every forward before
    any backward), at most p - stage under 1F1B, which is what 1F1B saves (not time)."""
    validate.one_of("schedule", schedule, ("gpipe", "1f1b"), 'in_flight("1f1b", 4, 8)')
    _check_schedule(stages, micro_batches, schedule, 1)
    if not 0 <= stage < stages:
        raise ValueError(f"stage={stage} must be between 0 and stages - 1 = {stages - 1}")
    return micro_batches if schedule == "gpipe" else min(micro_batches, stages - stage)


@dataclass(frozen=True)
class LayerProfile:
    """One layer's measured cost per micro-batch, and what autograd saves for its backward."""

    name: str
    forward_ms: float
    backward_ms: float
    activation_bytes: int

    @property
    def ms(self) -> float:
        return self.forward_ms + self.backward_ms


def _timer(device: torch.device) -> Callable[[], float]:
    """Seconds of compute: this thread's CPU time on the CPU (what the emulated cluster's virtual clock
    counts), wall time after a device synchronisation on a GPU (kernels run asynchronously)."""
    if device.type == "cuda":
        return lambda: (torch.cuda.synchronize(device), time.perf_counter())[1]
    return time.thread_time


def _saved_bytes(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Run fn and count the bytes of the tensors autograd saves for backward (each storage once)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta":
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def profile_layers(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *, repeats: int = 3) -> list[LayerProfile]:
    """Forward and backward cost (median of `repeats`) and saved activations of each layer of a GPT:
    "embedding" (token + position), "block i", and "head" (final norm, LM head and the loss).

    Each layer runs on its own, on the output of the layers before it, so one layer's time is not
    blurred by its neighbours; with a large vocabulary the head (and the embedding's gradient) weigh
    as much as several blocks, which a split by layer count ignores.
    """
    validate.positive_int("repeats", repeats, "profile_layers(model, x, y, repeats=3)")
    for name in ("tok_emb", "pos_emb", "blocks", "ln_f", "lm_head"):
        if not hasattr(model, name):
            raise TypeError(f"profile_layers needs a labkit.models.GPT (no .{name} on {type(model).__name__})")
    clock = _timer(x.device)
    pos = torch.arange(x.shape[1], device=x.device)

    def embedding(_: torch.Tensor | None) -> torch.Tensor:
        return model.tok_emb(x) + model.pos_emb(pos)

    def head(h: torch.Tensor) -> torch.Tensor:
        logits = model.lm_head(model.ln_f(h))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), y.reshape(-1))

    layers: list[tuple[str, Callable]] = [("embedding", embedding)]
    layers += [(f"block {i}", block) for i, block in enumerate(model.blocks)]
    layers.append(("head", head))
    out, h = [], None
    for name, layer in layers:
        inp = None if h is None else h.detach().requires_grad_(True)
        fwd, bwd, saved = [], [], 0
        for _ in range(repeats):
            model.zero_grad(set_to_none=True)
            t0 = clock()
            result, saved = _saved_bytes(lambda: layer(inp))
            t1 = clock()
            result.backward(torch.ones_like(result))
            t2 = clock()
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
        out.append(LayerProfile(name, statistics.median(fwd) * 1e3, statistics.median(bwd) * 1e3, saved))
        h = result.detach()
    model.zero_grad(set_to_none=True)
    return out
