"""Pipeline parallelism: a GPT cut into stages of consecutive layers, run by `torch.distributed.pipelining`.

A GPT is a list of layers, `layer_names(config)`: "embedding" (token + position), "block 0" ..
"block L-1", and "head" (final norm and LM head; the loss is the schedule's `loss_fn` on the last
stage). A split is the number of consecutive layers in each stage (`labkit.pipeline_plan.balance` finds
the balanced one, `split_evenly` the naive one); `GPTStage` holds one stage's layers, and
`pipeline_stages` wraps them in `torch.distributed.pipelining.PipelineStage`s for a rank;
`make_schedule` picks GPipe (Huang et al. 2019: every forward, then every backward), 1F1B
(PipeDream-Flush: Narayanan, Phanishayee et al., ICML 2021, "Memory-Efficient Pipeline-Parallel DNN
Training"; one forward, one backward in the steady state) or
interleaved 1F1B (Narayanan et al. 2021, section 2.2: v chunks per rank, stage s on rank s mod p);
`clock_stages` records each forward and backward a stage runs on `labkit.machine.timer`, and what it sends.

The naive version is the usual default: the blocks divided equally over the stages, the embedding on
the first and the head on the last (`even_split`), which ignores what the layers cost. The process
group is passed explicitly; pipelining's point-to-point transfers go over it (gloo, NCCL, or the
emulated cluster's modelled link).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labkit import validate
from labkit.machine import _torch_compat as compat
from labkit.machine import runtime
from labkit.machine.timer import Mark
from labkit.models import GPT, GPTConfig, on_device

__all__ = [
    "SCHEDULE_CLASSES",
    "GPTStage",
    "StageLog",
    "clock_stages",
    "even_split",
    "gpt_loss",
    "layer_names",
    "make_schedule",
    "pipeline_stages",
    "stage_of_rank",
]

SCHEDULE_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
}


def layer_names(config: GPTConfig) -> list[str]:
    """The layers a pipeline split counts: embedding, each block, head."""
    return ["embedding"] + [f"block {i}" for i in range(config.n_layers)] + ["head"]


def even_split(config: GPTConfig, stages: int) -> list[int]:
    """The naive split: blocks shared out equally, the embedding added to the first stage and the head
    to the last (what a split "by layer count" gives when the embedding and head ride along)."""
    validate.positive_int("stages", stages, "even_split(config, stages=4)")
    n = config.n_layers
    if stages > n:
        raise ValueError(f"stages={stages} is more than the model's {n} blocks: use stages <= {n}")
    sizes = [n // stages + (1 if s < n % stages else 0) for s in range(stages)]
    sizes[0] += 1
    sizes[-1] += 1
    return sizes


def _check_split(config: GPTConfig, sizes: Sequence[int]) -> list[tuple[int, int]]:
    """[start, stop) of each stage in the layer list; refuses a split that does not cover it."""
    total = config.n_layers + 2
    if (
        not sizes
        or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes)
        or sum(sizes) != total
    ):
        raise ValueError(
            f"sizes={list(sizes)} must be positive whole numbers of layers adding up to the model's "
            f"{total} layers (embedding, {config.n_layers} blocks, head); e.g. "
            f"labkit.pipeline_plan.balance(costs, stages) or even_split(config, stages)"
        )
    bounds, start = [], 0
    for n in sizes:
        bounds.append((start, start + n))
        start += n
    return bounds


class GPTStage(nn.Module):
    """Layers [start, stop) of a GPT's layer list: the embedding if start == 0, blocks, the head if
    stop is the last layer. Holds the GPT's own modules (no copy), so gradients land on them."""

    def __init__(self, model: GPT, start: int, stop: int) -> None:
        super().__init__()
        n = model.config.n_layers
        if not 0 <= start < stop <= n + 2:
            raise ValueError(f"layers [{start}, {stop}) are not a range of the model's {n + 2} layers")
        self.start, self.stop = start, stop
        self.tok_emb = model.tok_emb if start == 0 else None
        self.pos_emb = model.pos_emb if start == 0 else None
        self.blocks = nn.ModuleList(model.blocks[max(start, 1) - 1 : min(stop, n + 1) - 1])
        self.ln_f = model.ln_f if stop == n + 2 else None
        self.lm_head = model.lm_head if stop == n + 2 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:
            positions = self.pos_emb  # None in a llama model: its positions are rotary, inside attention
            x = self.tok_emb(x)
            if positions is not None:
                x = x + positions(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        if self.lm_head is not None:
            x = self.lm_head(self.ln_f(x))
        return x


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The GPT's loss on the last stage's logits: mean cross-entropy over tokens, as `GPT.forward`."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def stage_of_rank(rank: int, world_size: int, n_stages: int) -> list[int]:
    """The stages a rank holds: one (its own) for GPipe and 1F1B, rank, rank + p, ... when each rank
    holds v = n_stages / p chunks (interleaved, Narayanan et al. 2021, figure 4)."""
    if n_stages % world_size:
        raise ValueError(
            f"{n_stages} stages do not divide over {world_size} ranks: use a multiple of {world_size}"
        )
    return list(range(rank, n_stages, world_size))


def pipeline_stages(
    model: GPT,
    sizes: Sequence[int],
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
) -> list:
    """This rank's `PipelineStage`s of `model` split as `sizes` (one per rank, or v per rank interleaved).

    Every rank builds the same full model (same seed) and keeps its stages' layers; the others are
    never used. `group` carries the point-to-point transfers (None: the default group).
    """
    from torch.distributed import pipelining

    bounds = _check_split(model.config, sizes)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    return [
        pipelining.PipelineStage(
            on_device(GPTStage(model, *bounds[s]), device), s, len(sizes), torch.device(device), group=group
        )
        for s in stage_of_rank(rank, world, len(sizes))
    ]


def make_schedule(
    stages: list,
    schedule: str,
    micro_batches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = gpt_loss,
):
    """A torch.distributed.pipelining schedule over this rank's stages ("gpipe", "1f1b" or
    "interleaved_1f1b"); gradients are averaged over micro-batches (`scale_grads=True`)."""
    from torch.distributed import pipelining

    validate.one_of("schedule", schedule, tuple(SCHEDULE_CLASSES), 'make_schedule(stages, "1f1b", 8)')
    validate.positive_int("micro_batches", micro_batches, 'make_schedule(stages, "1f1b", micro_batches=8)')
    cls = getattr(pipelining, SCHEDULE_CLASSES[schedule])
    if schedule == "interleaved_1f1b":
        return _simulable(cls(stages, n_microbatches=micro_batches, loss_fn=loss_fn))
    if len(stages) != 1:
        raise ValueError(
            f"schedule={schedule!r} runs one stage per rank, this rank holds {len(stages)}: use "
            "schedule='interleaved_1f1b' or one stage per rank"
        )
    world = stages[0].group_size
    if schedule == "1f1b" and micro_batches < world:
        raise ValueError(
            f"1F1B needs at least as many micro-batches as stages: micro_batches={micro_batches} < "
            f"{world}; use micro_batches >= {world} or schedule='gpipe'"
        )
    return _simulable(cls(stages[0], n_microbatches=micro_batches, loss_fn=loss_fn))


def _simulable(schedule: Any) -> Any:
    """On a simulated machine the schedule's warm-up vote runs on real tensors: its values pick the schedule's
    mode (`_torch_compat.real_warmup_vote`); the stages' work stays on FakeTensors."""
    if runtime.on_simulated():
        compat.real_warmup_vote(schedule)
    return schedule


@dataclass
class StageLog:
    """What this rank's stages did in a step: each forward and backward chunk as (kind "F"/"B", stage,
    micro-batch, start mark, end mark) on `labkit.machine.timer`, and the point-to-point sends (count,
    bytes)."""

    spans: list[tuple[str, int, int, Mark, Mark]] = field(default_factory=list)
    sends: int = 0
    sent_bytes: int = 0

    def clear(self) -> None:
        self.spans.clear()
        self.sends = self.sent_bytes = 0


def clock_stages(stages: list) -> StageLog:
    """Record each forward and backward chunk of `stages` (`labkit.machine.timer.Mark`s: CUDA events on a GPU,
    so the device is not stopped between chunks) and the bytes each sends, into the returned `StageLog`.

    torch.distributed.pipelining has no per-micro-batch hook; every schedule calls these public methods of the
    stage once per micro-batch (schedules.py: `forward_one_chunk`, `backward_one_chunk`, `get_*_send_ops`), so
    wrapping them on the instance times exactly the stage's own work, without the waits around it."""
    log = StageLog()
    for stage in stages:
        for kind, name in (("F", "forward_one_chunk"), ("B", "backward_one_chunk")):
            inner = getattr(stage, name)

            def timed(
                chunk: int,
                *args: Any,
                _inner: Callable = inner,
                _kind: str = kind,
                _s: int = stage.stage_index,
                **kwargs: Any,
            ) -> Any:
                start = Mark()
                out = _inner(chunk, *args, **kwargs)
                log.spans.append((_kind, _s, chunk, start, Mark()))
                return out

            setattr(stage, name, timed)
        for name in ("get_fwd_send_ops", "get_bwd_send_ops"):
            inner = getattr(stage, name)

            def counted(chunk: int, *args: Any, _inner: Callable = inner, **kwargs: Any) -> Any:
                ops = _inner(chunk, *args, **kwargs)
                log.sends += len(ops)
                log.sent_bytes += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
                return ops

            setattr(stage, name, counted)
    return log
