"""The simulated DGX H100 checked against published training runs: MosaicML's MPT benchmarks with FSDP.

MosaicML published the throughput of their MPT models trained with PyTorch FSDP (`FULL_SHARD`: ZeRO-3) on
8 to 64 H100 80 GB GPUs in bf16 (llm-foundry, `scripts/train/benchmarking/README.md`, table "H100 80GB
BF16": model, sequence length, GPUs, micro-batch, gradient accumulation, activation checkpointing, tokens per
second per GPU, parameter count). An MPT model is the lab GPT's shape: pre-LayerNorm blocks with biases, a
4x GELU MLP, tied input and output embeddings, vocabulary 50,368; its published parameter counts equal
`GPTConfig.num_params()` of the configs below exactly (tested), learned positions standing in for ALiBi.

`simulate` runs one row on `sim:dgx-h100`: eight simulated H100s, each with the lab GPT in fp32 (the master
weights) sharded by `labkit.parallel.fsdp.fully_sharded`, gathered and computing in bf16 with fp32 gradient
reduction (FSDP2's `MixedPrecisionPolicy`; Composer's "DEFAULT" mixed precision is the same in its current
releases, and older ones gathered fp32), full activation checkpointing where the row used it, every operator
timed on the described H100 (`labkit.op_time`) and every all-gather and reduce-scatter on the node's NVLink
by `labkit.links`. Each block is the same work, so a rank runs 3 and 4 blocks and the row's blocks are reached
along the line through the two (as `published_runs` does from 1 and 2; not from 1 here, because FSDP2 gathers
the next block while one computes, which a one-block model never does, nor from 2, below which the backward's
peak is not yet linear in the blocks). An iteration is the first micro-batch, then m - 1 more (FSDP2
reduce-scatters every micro-batch's gradients), then AdamW on the shards, one parameter at a time as
Composer's DecoupledAdamW (the rows' `decoupled_adamw`) updates them. On ranks without CUDA streams the
reduce-scatters are exposed (`labkit.parallel.fsdp`), where a GPU overlaps them. A GPU's peak is the larger of
the micro-batches' and the optimizer step's, each carried along its own line, counted from the sharded model
on: llm-foundry makes the model on the meta device, never whole on a GPU.

Which rows shaped the model and which were held out: the simulated GPU has one constant fitted end to end,
`labkit.op_time.SUSTAINED`, on the 1B, 7B and 30B rows (`FITTED`); the 760M, 3B and 13B rows were held out,
and so was Narayanan et al. 2021's Table 1 on A100s (`published_runs`). Simulated over published tokens per
second per GPU (`python -m labkit.course.experiments.published_fsdp_runs`): fitted 1.02, 0.97, 0.97; held
out 1.20, 1.12, 0.85. Every row's peak is under the 80 GB it ran in (40-69 GiB; the 30B row's 56 GiB is its
sharded model states, 16 bytes per parameter over 8 GPUs, at the optimizer step). Carried from 2 and 3 blocks
with one peak over all phases and a for-each AdamW, the 30B row peaked at 91.5 GiB. Neighbours:
`published_runs` (Megatron-LM's Table 1 on DGX A100).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from labkit.cluster import Cluster
from labkit.course.experiments.published_runs import carried_to_layers, step_parts_ms
from labkit.machine import device_memory, emulate, timer
from labkit.models import GPTConfig, gpt_in
from labkit.parallel.fsdp import fully_sharded

__all__ = ["FITTED", "ROWS", "MosaicRun", "SimulatedFSDPRun", "simulate", "table"]

VOCAB = 50368
GPUS = 8
# The rows labkit.op_time.SUSTAINED was fitted on; the others are held out
FITTED = ("1b", "7b", "30b")
# The blocks a rank simulates: the row's blocks are reached along the line through these two runs. Not 1:
# FSDP2 gathers the next block while one computes, which a one-block model never does; not 2: the backward's
# peak grows by 1.8 GiB from 2 to 3 blocks of the 30B row and by 0.66 GiB from each block on (3, 4, 5)
BLOCKS = (3, 4)
# MPT's published sizes (llm-foundry's yamls): layers, d_model, heads
SHAPES = {
    "760m": (24, 1536, 12),
    "1b": (24, 2048, 16),
    "3b": (32, 2560, 20),
    "7b": (32, 4096, 32),
    "13b": (40, 5120, 40),
    "30b": (48, 7168, 56),
}


@dataclass(frozen=True)
class MosaicRun:
    """One row of the H100 80GB BF16 table: the model, sequence, micro-batch, accumulation, checkpointing,
    tokens per second per GPU and parameters published."""

    name: str
    seq_len: int
    micro_batch: int
    grad_accum: int
    checkpointing: bool
    tokens_per_s_per_gpu: float
    num_params: int
    gpus: int = GPUS

    def config(self) -> GPTConfig:
        layers, d_model, heads = SHAPES[self.name]
        return GPTConfig(
            n_layers=layers,
            d_model=d_model,
            n_heads=heads,
            vocab_size=VOCAB,
            seq_len=self.seq_len,
            tie_embeddings=True,
        )


# llm-foundry, scripts/train/benchmarking/README.md, "H100 80GB BF16" (FULL_SHARD, amp_bf16, 8 GPUs):
# model, sequence length, micro-batch, gradient accumulation, activation checkpointing, T/s/GPU, parameters.
ROWS: tuple[MosaicRun, ...] = (
    MosaicRun("760m", 2048, 24, 2, False, 63147, 760470528),
    MosaicRun("1b", 2048, 14, 1, False, 45455, 1315950592),
    MosaicRun("3b", 4096, 5, 6, False, 20964, 2657080320),
    MosaicRun("7b", 2048, 6, 1, False, 10643, 6658859008),
    MosaicRun("13b", 2048, 2, 1, False, 4792, 12853954560),
    MosaicRun("30b", 2048, 3, 21, True, 2002, 29975214080),
)


@dataclass(frozen=True)
class SimulatedFSDPRun:
    """One row simulated: milliseconds per iteration and its parts, the peak memory of a GPU."""

    run: MosaicRun
    first_ms: float  # the first micro-batch's forward and backward, all-gathers and reduce-scatter included
    later_ms: float  # each later one's
    optimizer_ms: float
    peak_gib: float
    label: str
    # a later micro-batch's operators by kind (labkit.machine.emulate.OpTimes), and "comm"
    parts_ms: dict[str, float]

    @property
    def iteration_ms(self) -> float:
        return self.first_ms + (self.run.grad_accum - 1) * self.later_ms + self.optimizer_ms

    @property
    def tokens_per_s_per_gpu(self) -> float:
        tokens = self.run.micro_batch * self.run.grad_accum * self.run.seq_len  # each GPU's own sequences
        return tokens / (self.iteration_ms / 1e3)

    @property
    def ratio(self) -> float:
        """Simulated over published tokens per second per GPU (> 1: the simulation is optimistic)."""
        return self.tokens_per_s_per_gpu / self.run.tokens_per_s_per_gpu


def _rank(config: GPTConfig, micro_batch: int, checkpointing: bool) -> dict[str, float]:
    """On each simulated GPU: two micro-batches, then Adam on the shards; seconds and bytes."""
    model = gpt_in(config, torch.float32, checkpointing=checkpointing)
    fully_sharded(model, None, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # llm-foundry makes the model on the meta device (`init_device: meta`), never whole on a GPU as it is
    # here before sharding: the peaks start after it
    device_memory.reset_peak_memory_stats()
    # Composer's DecoupledAdamW (llm-foundry's `decoupled_adamw`) updates one parameter at a time, as torch's
    # single-tensor AdamW does: temporaries of one parameter, where the for-each one makes one of every shard
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    x = torch.zeros(micro_batch, config.seq_len, dtype=torch.long)
    device = emulate.active_simulated_device()
    marks = []
    for _ in range(2):  # the first micro-batch makes the gradients, the second accumulates into them
        marks.append(timer.clock())
        before = Counter(device.times.seconds)
        model(x, x).backward()
    marks.append(timer.clock())
    kinds = Counter(device.times.seconds)
    kinds.subtract(before)
    micro_batches_peak = device_memory.max_memory_allocated()
    device_memory.reset_peak_memory_stats()
    opt.step()
    marks.append(timer.clock())
    return {
        "first": marks[1] - marks[0],
        "later": marks[2] - marks[1],
        "optimizer": marks[3] - marks[2],
        # each linear in the blocks, their maximum not: carried apart, compared after (`simulate`)
        "micro_batches_peak_bytes": float(micro_batches_peak),
        "optimizer_peak_bytes": float(device_memory.max_memory_allocated()),
        **{f"{kind}_s": seconds for kind, seconds in kinds.items()},
    }


def simulate(run: MosaicRun, blocks: tuple[int, int] | None = BLOCKS) -> SimulatedFSDPRun:
    """`run`'s iteration on a simulated DGX H100 (module docstring). `blocks`: the two block counts simulated
    (None: every block of the row)."""
    if run.gpus != GPUS:
        raise ValueError(f"{run.name}: simulate runs one DGX H100 node ({GPUS} GPUs), got gpus={run.gpus}")
    node = Cluster.preset("dgx-h100").simulated()
    args = (run.micro_batch, run.checkpointing)
    ranks = carried_to_layers(_rank, run.config(), *args, world_size=run.gpus, cluster=node, blocks=blocks,
                              timeout_s=300)
    slowest, kinds = step_parts_ms(ranks, "comm")  # what waited for a collective
    return SimulatedFSDPRun(
        run,
        slowest["first"],
        slowest["later"],
        slowest["optimizer"],
        max(max(r["micro_batches_peak_bytes"], r["optimizer_peak_bytes"]) for r in ranks) / 2**30,
        node.label,
        kinds,
    )


def table(results: list[SimulatedFSDPRun]) -> str:
    """Published against simulated tokens per second per GPU, with the parts of a simulated iteration."""
    lines = [
        f"{'model':>5} {'row':>8} {'seq':>5} {'mb x m':>7} {'ckpt':>5} {'published':>9} {'simulated':>9} "
        f"{'ratio':>6}   {'micro-batch ms':>14} {'exposed comm':>12} {'optimizer':>9} {'GiB/GPU':>8}"
    ]
    for r in results:
        row = "fitted" if r.run.name in FITTED else "held out"
        lines.append(
            f"{r.run.name:>5} {row:>8} {r.run.seq_len:>5} {f'{r.run.micro_batch} x {r.run.grad_accum}':>7} "
            f"{'yes' if r.run.checkpointing else 'no':>5} {r.run.tokens_per_s_per_gpu:>9.0f} "
            f"{r.tokens_per_s_per_gpu:>9.0f} {r.ratio:>6.2f}   {r.later_ms:>14.1f} "
            f"{r.parts_ms.get('comm', 0.0):>12.1f} {r.optimizer_ms:>9.1f} {r.peak_gib:>8.1f}"
        )
    if results:
        lines.append(
            f"tokens per second per GPU; published: llm-foundry H100 80GB BF16; simulated: {results[0].label}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table([simulate(run) for run in ROWS]))
