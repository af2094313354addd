"""Lab 01, checked against a published run: Narayanan et al. 2021, Table 1, on a simulated DGX A100.

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM" (SC
2021), Table 1, trained GPT models of 1.7 to 1008 billion parameters on DGX A100 nodes (8 x A100 80 GB, NVLink
3 and NVSwitch inside, eight 200 Gb/s InfiniBand ports out), sequence 2048, vocabulary 51,200, 16-bit mixed
precision with activation recomputation, and reported the teraFLOP/s each GPU achieved, counting FLOPs with
their equation (3):

    F = 96 · B · s · l · h² · (1 + s / (6h) + V / (16 · l · h))   per iteration of B sequences

(forward, backward and the recomputed forward of every matmul, attention included, the LM head once).

`simulate` runs a row's configuration on a simulated DGX A100 (`Cluster.preset("dgx-a100-80gb").simulated()`):
one data-parallel replica's tensor-parallel ranks, the lab GPT at the row's size in 16-bit with activation
checkpointing, `labkit.parallel.tensor_parallel` over the tp group (its all-reduces on the simulated NVLink),
every operator timed on the described A100 (`labkit.op_time`). Every block of a row is the same work, so a
replica runs `BLOCKS` = (1, 2) blocks, not the row's 24-40, and each time, byte count and peak is carried to
the row's blocks along the line through those two runs (the whole model's to float rounding, tested). The rest
is scaled by formulas, each said where it is used: the iteration's m = B / (dp · micro_batch) micro-batches
are the first one's time plus m - 1 times the second's (each later micro-batch is the same work, accumulating
into the gradients); the data-parallel all-reduce of the 16-bit gradients over the dp ranks is the links' α-β
time of rings over the nodes' eight 200 Gb/s rails (`labkit.links.Topology.rail_ring`), exposed after the
backward pass as Megatron-LM's training step of the time ran it; the optimizer is Adam on fp32 master weights,
simulated. Rows with pipeline parallelism (pp > 1) are not simulated here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from labkit.cluster import Cluster
from labkit.layout import Layout
from labkit.links import collective_time_s
from labkit.machine import device_memory, emulate, launcher, timer
from labkit.measured_memory import free_memory
from labkit.models import GPTConfig, gpt_in
from labkit.parallel.tensor import tensor_parallel
from labkit.parallel.vocab import vocab_parallel

__all__ = [
    "TABLE_1",
    "PublishedRun",
    "SimulatedRun",
    "carried_to_layers",
    "megatron_flops",
    "simulate",
    "step_parts_ms",
    "table",
]

SEQ_LEN = 2048
VOCAB = 51200
# The blocks a replica simulates: the row's blocks are reached along the line through these two runs
BLOCKS = (1, 2)


@dataclass(frozen=True)
class PublishedRun:
    """One row of Narayanan et al. 2021, Table 1: the model, its layout, the teraFLOP/s per GPU reported."""

    name: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops_per_gpu: float

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    def config(self) -> GPTConfig:
        return GPTConfig(
            n_layers=self.layers, d_model=self.hidden, n_heads=self.heads, vocab_size=VOCAB, seq_len=SEQ_LEN
        )


# Narayanan et al. 2021, Table 1 (weak scaling on DGX A100 nodes): name, attention heads, hidden size, layers,
# tensor-parallel size, pipeline-parallel size, GPUs, batch size, achieved teraFLOP/s per GPU.
TABLE_1: tuple[PublishedRun, ...] = (
    PublishedRun("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    PublishedRun("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    PublishedRun("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    PublishedRun("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    PublishedRun("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    PublishedRun("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    PublishedRun("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    PublishedRun("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    PublishedRun("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    PublishedRun("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
)


def megatron_flops(run: PublishedRun) -> float:
    """FLOPs of one iteration by the paper's equation (3), recomputation included."""
    b, s, h, layers, v = run.batch, SEQ_LEN, run.hidden, run.layers, VOCAB
    return 96.0 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))


@dataclass(frozen=True)
class SimulatedRun:
    """One row simulated: milliseconds of its parts per iteration, the peak memory of a GPU, the result."""

    run: PublishedRun
    micro_batch: int
    first_ms: float  # the first micro-batch's forward and backward (tp all-reduces included)
    later_ms: float  # each later one's (accumulating into the gradients)
    dp_ms: float  # the data-parallel all-reduce of the gradients, by the α-β model
    optimizer_ms: float
    peak_gib: float
    label: str
    # a later micro-batch's operators by kind (labkit.machine.emulate.OpTimes), and "tp"
    parts_ms: dict[str, float]

    @property
    def micro_batches(self) -> int:
        return self.run.batch // (self.run.dp * self.micro_batch)

    @property
    def iteration_ms(self) -> float:
        return self.first_ms + (self.micro_batches - 1) * self.later_ms + self.dp_ms + self.optimizer_ms

    @property
    def tflops_per_gpu(self) -> float:
        return megatron_flops(self.run) / (self.iteration_ms / 1e3) / self.run.gpus / 1e12

    @property
    def ratio(self) -> float:
        """Simulated over published teraFLOP/s per GPU."""
        return self.tflops_per_gpu / self.run.tflops_per_gpu


def _replica(config: GPTConfig, micro_batch: int) -> dict[str, float]:
    """On each tensor-parallel rank of one replica: two micro-batches, then the optimizer; in seconds."""
    model = gpt_in(config, torch.bfloat16, checkpointing=True)  # 16-bit, like the paper's fp16
    if dist.get_world_size() > 1:
        tensor_parallel(model, None)
        vocab_parallel(model, None)  # Megatron-LM splits the embedding, head and loss over the vocabulary
    params = list(model.parameters())
    master = [torch.empty(p.shape, dtype=torch.float32) for p in params]  # fp32 master weights
    opt = torch.optim.Adam(master, fused=True)  # one kernel per step, as apex's FusedAdam in Megatron-LM
    x = torch.zeros(micro_batch, config.seq_len, dtype=torch.long)
    device = emulate.active_simulated_device()
    marks = []
    dist.barrier()
    for _ in range(2):  # the first micro-batch makes the gradients, the second accumulates into them
        marks.append(timer.clock())
        before = Counter(device.times.seconds)
        model(x, x).backward()
    marks.append(timer.clock())
    kinds = Counter(device.times.seconds)
    kinds.subtract(before)  # the second micro-batch's operators by kind
    for m, p in zip(master, params):
        m.grad = p.grad.float()
    opt.step()
    with torch.no_grad():
        for m, p in zip(master, params):
            p.copy_(m)
    marks.append(timer.clock())
    peak = device_memory.peak_bytes()
    return {
        "first": marks[1] - marks[0],
        "later": marks[2] - marks[1],
        "optimizer": marks[3] - marks[2],
        "grad_bytes": float(sum(p.numel() * p.element_size() for p in params)),
        "peak_bytes": float(peak[0] if peak else 0),
        **{f"{kind}_s": seconds for kind, seconds in kinds.items()},
    }


def _in_turn(
    fn: Callable[..., dict[str, float]], configs: list[GPTConfig], *args: object
) -> list[dict[str, float]]:
    """On a rank: `fn(c, *args)` for each of `configs` in turn, each from what the one before left (its
    garbage collected) and with the memory peak started again."""
    results = []
    for c in configs:
        free_memory()
        device_memory.reset_peak_memory_stats()
        results.append(fn(c, *args))
    return results


def carried_to_layers(
    fn: Callable[..., dict[str, float]],
    config: GPTConfig,
    *args: object,
    world_size: int,
    cluster: Cluster,
    blocks: tuple[int, int] | None,
    timeout_s: float = 30.0,
) -> list[dict[str, float]]:
    """Each rank's `fn(config, *args)` measures at `config`'s blocks: simulated whole (`blocks` None, or a
    model no deeper than them), or carried along the line through runs with `blocks` blocks (each block is the
    same work: times, bytes and peaks are linear in the blocks). Both block counts run in one launch, one
    after the other on each rank (`_in_turn`), the second on the rank's warm caches (its imports,
    FakeTensorMode's cache of operators' outputs) rather than on a new process's cold ones. One
    process stands for all ranks (`labkit.launch`'s alike): each row's ranks (tensor parallelism inside one
    node, or FSDP over it) run the same operators."""
    if blocks is None or config.n_layers <= max(blocks):
        configs = [config]
    else:
        configs = [replace(config, n_layers=n) for n in blocks]
    per_rank = launcher.launch(
        _in_turn, fn, configs, *args, world_size=world_size, cluster=cluster, timeout_s=timeout_s, alike=True
    )
    if len(configs) == 1:
        return [runs[0] for runs in per_rank]
    few, more = ([runs[i] for runs in per_rank] for i in range(2))
    share = (config.n_layers - blocks[0]) / (blocks[1] - blocks[0])
    return [
        {k: a.get(k, 0.0) + share * (b.get(k, 0.0) - a.get(k, 0.0)) for k in {**a, **b}}
        for a, b in zip(few, more)
    ]


def step_parts_ms(ranks: list[dict[str, float]], rest: str) -> tuple[dict[str, float], dict[str, float]]:
    """From each rank's seconds: the slowest rank's first and later micro-batch and optimizer step, and a
    later micro-batch's operators by kind on rank 0, with what no operator took named `rest` (collectives);
    in ms."""
    slowest = {k: max(r[k] for r in ranks) * 1e3 for k in ("first", "later", "optimizer")}
    kinds = {k.removesuffix("_s"): v * 1e3 for k, v in ranks[0].items() if k.endswith("_s")}
    kinds[rest] = slowest["later"] - sum(kinds.values())
    return slowest, kinds


def simulate(
    run: PublishedRun,
    micro_batch: int = 1,
    preset: str = "dgx-a100-80gb",
    blocks: tuple[int, int] | None = BLOCKS,
) -> SimulatedRun:
    """`run`'s iteration on a simulated `preset` node (module docstring); pp = 1 rows only. `blocks`: the
    two block counts simulated (None: every block of the row)."""
    if run.pp != 1:
        raise ValueError(
            f"{run.name} uses pipeline parallelism (pp={run.pp}); simulate a row with pp=1, e.g. TABLE_1[0]"
        )
    if run.batch % (run.dp * micro_batch):
        raise ValueError(
            f"batch {run.batch} does not split into dp={run.dp} replicas of micro-batches of {micro_batch}"
        )
    node = Cluster.preset(preset).simulated()
    ranks = carried_to_layers(
        _replica, run.config(), micro_batch, world_size=run.tp, cluster=node, blocks=blocks
    )
    slowest, kinds = step_parts_ms(ranks, "tp")  # the rest of the micro-batch: tp all-reduces
    nodes = Cluster.preset(preset, nodes=-(-run.gpus // node.gpus_per_node))
    dp_group = Layout(dp=run.dp, tp=run.tp).groups_of("dp")[0]  # across nodes: rings over the rails
    link = nodes.topology().rail_ring(dp_group)
    dp_s = collective_time_s("all_reduce", int(ranks[0]["grad_bytes"]), run.dp, link) if run.dp > 1 else 0.0
    return SimulatedRun(
        run,
        micro_batch,
        slowest["first"],
        slowest["later"],
        dp_s * 1e3,
        slowest["optimizer"],
        max(r["peak_bytes"] for r in ranks) / 2**30,
        node.label,
        kinds,
    )


def table(results: list[SimulatedRun]) -> str:
    """The comparison as text: the paper's teraFLOP/s per GPU next to the simulated, and the parts."""
    lines = [
        f"{'model':>6} {'tp':>3} {'dp':>4} {'mb x m':>7} {'paper':>6} {'simulated':>10} {'ratio':>6}   "
        f"{'micro-batch ms':>14} {'dp all-reduce':>13} {'optimizer':>9} {'GiB/GPU':>8}"
    ]
    for r in results:
        lines.append(
            f"{r.run.name:>6} {r.run.tp:>3} {r.run.dp:>4} {f'{r.micro_batch} x {r.micro_batches}':>7} "
            f"{r.run.tflops_per_gpu:>6.0f} {r.tflops_per_gpu:>10.0f} {r.ratio:>6.2f}   {r.later_ms:>14.1f} "
            f"{r.dp_ms:>13.1f} {r.optimizer_ms:>9.1f} {r.peak_gib:>8.1f}"
        )
    if results:
        lines.append(f"teraFLOP/s per GPU by the paper's equation (3); simulated: {results[0].label}")
    return "\n".join(lines)
