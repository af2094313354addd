"""Pipeline plans on paper: balanced stage splits, the bubble of an ideal schedule, the micro-batch count.

* `balance(costs, stages)`: the contiguous split of layers into stages that minimises the most
  expensive stage, exactly (dynamic programming), with the naive split by layer count,
  `split_evenly`, next to it;
* `bubble_fraction(stages, micro_batches, schedule, chunks)`: the idle fraction of an ideal
  pipeline step, and `pipeline_step_time` / `ideal_step_time` for measured stage costs;
* `micro_batches_for_bubble` and `in_flight`: how many micro-batches a bubble target needs and how
  many each schedule keeps alive at once (what activation memory bounds); `choose_micro_batches`
  puts the two together for a batch.

The costs `balance` splits are measured by `labkit.layer_profile.profile_layers`; the pipeline itself runs
in `labkit.parallel.pipeline`. Pure arithmetic: nothing here imports torch.

Formulas: Huang et al. 2019 (GPipe) and Narayanan et al. 2021 (*Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM*, section 2.2), whose bubble *overhead*
(p-1)/m (or (p-1)/(v·m) interleaved) is idle time over ideal time; this module's fraction is idle
time over the whole step, (p-1)/(m+p-1), the same quantity seen from the step. Lab 04 measures
what these predict with `torch.distributed.pipelining`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from labkit import validate

__all__ = [
    "SCHEDULES",
    "balance",
    "bubble_fraction",
    "choose_micro_batches",
    "ideal_step_time",
    "in_flight",
    "micro_batches_for_bubble",
    "pipeline_step_time",
    "split_evenly",
    "stage_costs",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def _check_costs(costs: Sequence[float], stages: int) -> list[float]:
    validate.positive_int("stages", stages, "balance(costs, stages=4)")
    values = list(costs)
    if not values:
        raise ValueError(
            "costs is empty: pass one measured cost per layer, e.g. balance([3.0, 1.0, 1.0, 2.0], 2)"
        )
    for i, c in enumerate(values):
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c <= 0:
            raise ValueError(
                f"costs[{i}]={c!r} must be a finite number > 0 (a layer's measured time); "
                "e.g. the ms per micro-batch from labkit.layer_profile.profile_layers"
            )
    if stages > len(values):
        raise ValueError(
            f"stages={stages} is more than the {len(values)} layers in costs: every stage needs at "
            f"least one layer; use stages <= {len(values)} or split the model finer"
        )
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
        out.append(float(sum(costs[start : start + n])))
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
        raise ValueError(
            f"chunks={chunks} needs schedule='interleaved_1f1b' (GPipe and 1F1B hold one chunk per rank)"
        )
    if schedule == "interleaved_1f1b" and micro_batches % stages:
        raise ValueError(
            f"micro_batches={micro_batches} must be a multiple of stages={stages} for the interleaved "
            "schedule (Narayanan et al. 2021, section 2.2.2); e.g. micro_batches="
            f"{stages * max(1, round(micro_batches / stages))}"
        )


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
    """The same work perfectly balanced: mean stage cost x (m + p - 1); no split beats it under GPipe or 1F1B
    (interleaving lowers the ideal to mean x (m + (p - 1) / v), Narayanan et al. 2021, section 2.2.2)."""
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


def choose_micro_batches(
    stages: int,
    global_batch: int,
    max_bubble: float = 0.3,
    schedule: str = "1f1b",
    *,
    activation_bytes_per_sample: float | None = None,
    memory_bytes: float | None = None,
) -> int:
    """The number of micro-batches for a batch of `global_batch` sequences on `stages` stages.

    The fewest m that divides the batch (equal micro-batches), is at least `stages` for 1F1B (torch
    requires it), and whose ideal bubble (p-1)/(m+p-1) is at most `max_bubble`; the most (one sequence
    each) when no m reaches the target. With `activation_bytes_per_sample` (what one sequence saves on
    the first stage, which holds the most) and `memory_bytes`, only an m whose micro-batches in flight
    fit: under 1F1B that is p micro-batches of batch/m sequences, so more micro-batches also save
    memory; under GPipe all m are in flight, the whole batch, whatever m is.
    """
    validate.positive_int("stages", stages, "choose_micro_batches(4, 16)")
    validate.positive_int("global_batch", global_batch, "choose_micro_batches(4, global_batch=16)")
    validate.one_of("schedule", schedule, ("gpipe", "1f1b"), 'choose_micro_batches(4, 16, schedule="1f1b")')
    if not isinstance(max_bubble, (int, float)) or not 0 < max_bubble < 1:
        raise ValueError(f"max_bubble={max_bubble!r} must be a fraction between 0 and 1; e.g. 0.3 for 30 %")
    low = stages if schedule == "1f1b" else 1
    options = [m for m in range(low, global_batch + 1) if global_batch % m == 0]
    if not options:
        raise ValueError(
            f"global_batch={global_batch} is smaller than stages={stages}: 1F1B needs at least one "
            f"micro-batch per stage; use global_batch >= {stages} or schedule='gpipe'"
        )
    if (activation_bytes_per_sample is None) != (memory_bytes is None):
        raise ValueError("give both activation_bytes_per_sample and memory_bytes, or neither")
    if memory_bytes is not None:
        fits = [
            m
            for m in options
            if in_flight(schedule, stages, m) * (global_batch // m) * activation_bytes_per_sample
            <= memory_bytes
        ]
        if not fits:
            need = (
                min(in_flight(schedule, stages, m) * (global_batch // m) for m in options)
                * activation_bytes_per_sample
            )
            raise ValueError(
                f"no micro-batch count fits: the first stage needs at least {need / 2**20:.1f} MiB of "
                f"activations, memory_bytes is {memory_bytes / 2**20:.1f} MiB. Use 1F1B, activation "
                "checkpointing, a smaller batch, or more stages"
            )
        options = fits
    for m in options:
        if bubble_fraction(stages, m, schedule) <= max_bubble:
            return m
    return options[-1]
