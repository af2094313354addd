"""Lab 01's driver: train the same GPT under a dp x tp x pp layout and measure its step and its traffic.

`layout_steps` runs on every rank (launch it with `labkit.launch` on world_size = dp x tp x pp): it creates
the layout's groups (`labkit.layout`, `labkit.parallel.groups`), builds the seeded GPT, splits its blocks over
the tp group (`labkit.parallel.tensor`), cuts it into pp stages run by 1F1B (`labkit.parallel.pipeline`), and
keeps only its own layers, so the emulated memory budget sees what a GPU would hold. Each step a replica
trains on its rows of the global batch in micro-batches (pipeline micro-batches, or gradient accumulation when
pp == 1), then one flat all-reduce averages the gradients over the dp group (not overlapped: lab 03 shows how
to hide it) and Adam steps. Every rank reports its step times on `labkit.machine.timer` (the virtual clock on
the emulated cluster), the bytes it put on each link class, and optionally its gradients and loss against one
process on the whole batch (`labkit.course.training.reference`). `summarize_layout` combines the ranks;
`measure_rates` times this machine on the model for the planner (`labkit.planner.Rates`)."""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from labkit.cluster import Cluster
from labkit.course.experiments.params import SIMULATED_CLUSTERS, LabParams, ParamError, gpt_param, param
from labkit.course.experiments.script import LabRecords, Meaning, Where, emulated_cluster, main
from labkit.course.training.reference import Reference, rank_rows
from labkit.layout import Layout
from labkit.links import Link, Topology, bus_bandwidth_factor
from labkit.machine import device_memory, runtime, timer
from labkit.machine.machine import Machine
from labkit.memory import estimate
from labkit.models import GPTConfig, seeded_model, synthetic_batch
from labkit.parallel.groups import RankGroups, make_groups
from labkit.parallel.pipeline import StageLog, clock_stages, even_split, make_schedule, pipeline_stages
from labkit.parallel.tensor import TPStats, shard_state, tensor_parallel
from labkit.planner import DISPATCH_S, Rates, forward_flops_per_token, plan, spearman

__all__ = [
    "LayoutRankResult",
    "LayoutSummary",
    "Params",
    "headline",
    "layout_steps",
    "measure_rates",
    "median_rates",
    "summarize_layout",
]


@dataclass
class LayoutRankResult:
    """What one rank measured under one layout. Times in ms; bytes per step."""

    rank: int
    layout: str
    coords: dict[str, int]
    steps_ms: list[float]
    link_bytes: dict[str, int]  # "intra" / "inter": bytes this rank sent per step (ring all-reduce: 2(n-1)/n)
    kind_bytes: dict[str, int]  # "tp" / "pp" / "dp": the same bytes by parallelism
    params: int  # parameters this rank holds
    peak_bytes: int | None = None  # peak live bytes over the run (emulated budget or CUDA allocator)
    grad_error: float | None = None  # largest |gradient - one process's| on this rank's parameters
    loss_error: float | None = None
    label: str = ""


@dataclass
class LayoutSummary:
    layout: str
    step_ms: float  # median over steps of the slowest rank's step
    steps_ms: list[float]
    link_bytes: dict[str, int] = field(default_factory=dict)  # summed over ranks, per step
    kind_bytes: dict[str, int] = field(default_factory=dict)
    peak_mib: float | None = None  # the largest rank's peak
    grad_error: float | None = None  # the largest over ranks
    loss_error: float | None = None  # the largest over the ranks that compute the loss (dp = 1 only)
    label: str = ""


def _dp_all_reduce(params: list[torch.Tensor], process_group: dist.ProcessGroup | None, dp: int) -> int:
    """Average the gradients over the dp group in one flat all-reduce; returns its bytes."""
    flat_grads = [p.grad.view(-1) for p in params if p.grad is not None]  # views: writing them writes .grad
    flat = torch.cat(flat_grads)
    dist.all_reduce(flat, group=process_group)
    flat.div_(dp)
    # One split, and the copies into the same views: on the simulated machine a view of a new shape or offset
    # is a new FakeTensor cache entry, each dearer than the copy it feeds
    for g, averaged in zip(flat_grads, flat.split([g.numel() for g in flat_grads])):
        g.copy_(averaged)
    return flat.numel() * flat.element_size()


def _topology() -> Topology:
    """The rank's topology: its cluster's, or under torchrun the node of LOCAL_WORLD_SIZE ranks (only which
    node a rank is on matters here)."""
    cluster = runtime.current_cluster()
    if cluster is not None:
        return cluster.topology()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    return Topology(max(1, per_node), Link(1.0, 0.0, "not modelled"), Link(1.0, 0.0, "not modelled"))


class _LayoutRun:
    """One layout on this rank: its groups, its shard of the seeded GPT (tp) and its stage (pp), Adam."""

    def __init__(
        self,
        config: GPTConfig,
        layout: Layout,
        global_batch: int,
        micro_batch: int,
        seed: int,
        lr: float,
        zero3: bool = False,
    ) -> None:
        if zero3 and (layout.tp > 1 or layout.pp > 1 or layout.dp == 1):
            raise ValueError(
                f"zero3=True shards the model over data parallelism alone, on 2 or more ranks; {layout} "
                "is not that: use Layout(dp=world_size)"
            )
        if global_batch % (layout.dp * micro_batch):
            raise ValueError(
                f"global_batch={global_batch} must split into dp={layout.dp} replicas of "
                f"micro-batches of {micro_batch}: use a multiple of {layout.dp * micro_batch}"
            )
        self.config, self.layout, self.global_batch, self.micro_batch, self.seed = (
            config,
            layout,
            global_batch,
            micro_batch,
            seed,
        )
        self.groups: RankGroups = make_groups(layout)
        self.m = global_batch // layout.dp // micro_batch
        self.dev = runtime.device()
        self.tp_stats = TPStats()
        model = seeded_model(config, seed, self.dev)
        if layout.tp > 1:
            tensor_parallel(model, self.groups.tp, self.tp_stats)
        self.zero3 = zero3
        self.whole_params = sum(p.numel() for p in model.parameters())
        if zero3:  # FSDP2: parameters, gradients and Adam's states sharded over the dp group (ZeRO-3)
            from labkit.parallel.fsdp import fully_sharded  # torch.distributed.fsdp: 0.8 s to import

            fully_sharded(model, self.groups.dp)
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.log: StageLog | None = None
        if layout.pp > 1:
            self.stages = pipeline_stages(model, even_split(config, layout.pp), self.groups.pp, self.dev)
            self.log = clock_stages(self.stages)
            self.schedule = make_schedule(self.stages, "1f1b", self.m)
            self.module = self.stages[0].submod  # only this stage's layers stay alive, as on a GPU
        else:
            self.module, self.schedule = model, None
        self.params = list(self.module.parameters())
        self.opt = torch.optim.Adam(self.params, lr=lr, **runtime.optimizer_options())

    def forward_backward(self, step: int) -> list[torch.Tensor]:
        """The replica's rows of global batch `step`, forward and backward in micro-batches; its losses."""
        c = self.groups.coords
        x, y = rank_rows(
            self.config,
            self.global_batch,
            c["dp"],
            self.layout.dp,
            step=step,
            seed=self.seed,
            device=self.dev,
        )
        losses: list = []
        if self.schedule is not None:
            kwargs = {"return_outputs": False}
            if self.stages[0].is_last:
                kwargs.update(target=y, losses=losses)
            args = (x,) if self.stages[0].is_first else ()
            self.schedule.step(*args, **kwargs)
            return losses
        for k in range(self.m):
            rows = slice(k * self.micro_batch, (k + 1) * self.micro_batch)
            loss = self.module(x[rows], y[rows]) / self.m
            loss.backward()
            losses.append(loss.detach() * self.m)
        return losses

    def errors(self, reference: Reference, losses: list) -> tuple[float, float | None]:
        """This rank's gradients (its shard of its layers) and loss against one process on the whole batch."""
        tp, c = self.layout.tp, self.groups.coords
        want = shard_state(reference.grads, self.config, c["tp"], tp) if tp > 1 else reference.grads
        error = 0.0
        if self.zero3:  # each rank holds shards: gather the whole gradients (a collective on every rank)
            from labkit.parallel.fsdp import full_gradients

            for name, g in full_gradients(self.module).items():
                error = max(error, (g - want[name].to(g.device)).abs().max().item())
            return error, None
        for p in self.params:  # a stage holds the GPT's own parameters: their names are the GPT's
            if p.grad is not None:
                error = max(error, (p.grad - want[self.names[id(p)]].to(p.grad.device)).abs().max().item())
        if not losses or self.layout.dp > 1:
            return error, None  # with dp > 1 a replica's loss is its rows' mean, not the global one
        mine = torch.stack([torch.as_tensor(v).float() for v in losses]).mean()
        return error, abs(mine.item() - reference.loss)

    def kind_bytes(self, dp_bytes: int) -> dict[str, int]:
        """Bytes each parallelism put on the wire in the last step (ring all-reduce: 2(n-1)/n of the
        buffer)."""
        tp, dp = self.layout.tp, self.layout.dp
        if self.zero3:
            # two all-gathers of the parameters (forward, backward) and a reduce-scatter of the gradients,
            # each (n-1)/n of the fp32 model per rank: 1.5 times an all-reduce's 2(n-1)/n (Rajbhandari et
            # al. 2020, section 7.2.2)
            dp_bytes = int(3 * self.whole_params * 4 * bus_bandwidth_factor("all_gather", dp))
            return {"tp": 0, "pp": 0, "dp": dp_bytes}
        return {
            "tp": int(self.tp_stats.bytes * (bus_bandwidth_factor("all_reduce", tp) if tp > 1 else 0)),
            "pp": self.log.sent_bytes if self.log is not None else 0,
            "dp": int(dp_bytes * (bus_bandwidth_factor("all_reduce", dp) if dp > 1 else 0)),
        }


def layout_steps(
    config: GPTConfig,
    layout: Layout,
    global_batch: int,
    micro_batch: int,
    *,
    steps: int = 3,
    warmup: int = 1,
    seed: int = 0,
    lr: float = 1e-3,
    reference: Reference | None = None,
    zero3: bool = False,
) -> LayoutRankResult:
    """Train `steps` + `warmup` steps under `layout` on this rank; see the module docstring.

    `reference`: `labkit.course.training.reference.reference_gradients(config, global_batch, seed=seed)`
    (computed once, by the caller), to compare this rank's first-step gradients and loss with. `zero3`: shard
    the model over the data-parallel ranks with FSDP2 (`labkit.parallel.fsdp`) instead of all-reducing whole
    gradients (a layout of data parallelism alone)."""
    run = _LayoutRun(config, layout, global_batch, micro_batch, seed, lr, zero3)
    cluster = runtime.current_cluster()
    result = LayoutRankResult(
        dist.get_rank(),
        f"{layout} (FSDP)" if zero3 else str(layout),
        run.groups.coords,
        [],
        {"intra": 0, "inter": 0},
        {},
        sum((p.to_local() if zero3 else p).numel() for p in run.params),  # FSDP: this rank's shards
        label=cluster.label if cluster else "",
    )
    device_memory.reset_peak_memory_stats()
    dp_bytes = 0
    for step in range(warmup + steps):
        run.tp_stats.all_reduces = run.tp_stats.bytes = 0
        if run.log is not None:
            run.log.clear()
        dist.barrier()  # a common start: the step ends with its slowest rank
        t0 = timer.clock()
        losses = run.forward_backward(step)
        dp_bytes = _dp_all_reduce(run.params, run.groups.dp, layout.dp) if layout.dp > 1 and not zero3 else 0
        checked = 0.0
        if reference is not None and step == 0:
            c0 = timer.clock()
            result.grad_error, result.loss_error = run.errors(reference, losses)
            checked = timer.clock() - c0  # the check is not part of the step
        run.opt.step()
        run.opt.zero_grad(set_to_none=True)
        if step >= warmup:
            result.steps_ms.append((timer.clock() - t0 - checked) * 1e3)
    result.kind_bytes = run.kind_bytes(dp_bytes)
    crossed = layout.links_crossed(_topology())
    for kind, nbytes in result.kind_bytes.items():
        if nbytes:
            result.link_bytes[crossed.get(kind, "intra")] += nbytes
    peak = device_memory.peak_bytes()
    result.peak_bytes = peak[0] if peak else None
    return result


def summarize_layout(results: list[LayoutRankResult]) -> LayoutSummary:
    """One layout from every rank: the step is its slowest rank's; bytes summed over ranks."""
    steps = [max(r.steps_ms[i] for r in results) for i in range(len(results[0].steps_ms))]
    links = {k: sum(r.link_bytes[k] for r in results) for k in ("intra", "inter")}
    kinds = {k: sum(r.kind_bytes[k] for r in results) for k in ("tp", "pp", "dp")}
    peaks = [r.peak_bytes for r in results if r.peak_bytes is not None]
    errors = [r.grad_error for r in results if r.grad_error is not None]
    losses = [r.loss_error for r in results if r.loss_error is not None]
    return LayoutSummary(
        results[0].layout,
        statistics.median(steps),
        steps,
        links,
        kinds,
        max(peaks) / 2**20 if peaks else None,
        max(errors) if errors else None,
        max(losses) if losses else None,
        results[0].label,
    )


def measure_rates(config: GPTConfig, micro_batch: int, repeats: int = 3, seed: int = 0) -> Rates:
    """This rank's speed on the model: its FLOP/s in forward + backward at `micro_batch`, and Adam's seconds
    per parameter, best of `repeats`, on the rank's timer (`labkit.machine.timer.clock`: CPU time on the
    virtual clock, the synchronised wall clock on a GPU). On a GPU also the host's time per operator
    (`labkit.planner.DISPATCH_S`, an assumption, not measured), the floor of a launch-bound layer: split over
    tp ranks, its 1/tp of the FLOPs still take every operator's dispatch."""
    dev = runtime.device()
    model = seeded_model(config, seed, dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, **runtime.optimizer_options())
    x, y = synthetic_batch(config, micro_batch, seed=seed, device=dev)
    block_f, head_f = forward_flops_per_token(config)
    flops = 3 * micro_batch * config.seq_len * (config.n_layers * block_f + head_f)
    best_fb = best_opt = float("inf")
    for _ in range(repeats + 1):  # the first round warms up (allocator, kernels, Adam's states)
        t0 = timer.clock()
        model(x, y).backward()
        t1 = timer.clock()
        opt.step()
        t2 = timer.clock()
        opt.zero_grad(set_to_none=False)
        best_fb, best_opt = min(best_fb, t1 - t0), min(best_opt, t2 - t1)
    n = config.num_params()
    simulated = runtime.on_simulated()
    cluster = runtime.current_cluster()
    if dev.type == "cuda":
        where = "this GPU"
    elif simulated and cluster:
        where = f"a {cluster.label}"
    else:
        where = "this CPU"
    return Rates(
        flops / best_fb,
        best_opt / n,
        f"measured on {where}: {flops / best_fb / 1e9:.1f} GFLOP/s in forward + backward at micro-batch "
        f"{micro_batch}, Adam {best_opt / n * 1e9:.2f} ns per parameter",
        # the host's time per operator: a GPU's and a simulated one's (which charges it to every operator)
        DISPATCH_S if dev.type == "cuda" or simulated else 0.0,
    )


def median_rates(per_rank: list[Rates]) -> Rates:
    """One `Rates` from every rank's `measure_rates` (run together, so they shared the cores as in a run); one
    rank's as it is."""
    if len(per_rank) == 1:
        return per_rank[0]
    flops = statistics.median(r.flops_per_s for r in per_rank)
    opt = statistics.median(r.optimizer_s_per_param for r in per_rank)
    return Rates(
        flops,
        opt,
        f"measured on {len(per_rank)} ranks at once: {flops / 1e9:.1f} GFLOP/s per rank in "
        f"forward + backward, Adam {opt * 1e9:.2f} ns per parameter (medians)",
        max(r.dispatch_s for r in per_rank),
    )


# ----------------------------------------------------------------- as a script
# (labkit.course.experiments.script)


@dataclass(frozen=True)
class Params(LabParams):
    """Lab 01's parameters."""

    cluster: str = param(
        "cpu",
        "cpu: `nodes` emulated nodes (the lesson's slow link between them); auto or gpu: this node's GPUs "
        "when it has world_size of them (one node), else cpu; sim:dgx-h100 (or another preset): `nodes` "
        "simulated nodes sharing the ranks",
        choices=("auto", "cpu", "gpu", *SIMULATED_CLUSTERS),
    )
    world_size: int = param(8, "GPUs in all (emulated: nodes x world_size / nodes)", minimum=1)
    nodes: int = param(
        2,
        "nodes sharing the ranks on the emulated cluster and on sim:... (on a GPU node: 1; under torchrun: "
        "its own)",
        minimum=1,
    )
    memory_mib: float | None = param(
        None,
        "memory of each GPU, MiB: the emulated budget, a cap on a real one (None: one in which plain data "
        "parallelism does not fit and a sharded layout does, by the planner's estimate)",
        minimum=0,
        strict=True,
        example=28,
    )
    n_layers: int = gpt_param("n_layers", 8)
    d_model: int = gpt_param("d_model", 128, "tensor parallelism splits it")
    n_heads: int | None = param(
        None,
        "attention heads, split by tensor parallelism (None: 8, or the ranks if more)",
        minimum=1,
        example=8,
    )
    vocab_size: int = gpt_param("vocab_size", 1024)
    seq_len: int = gpt_param("seq_len", 64)
    global_batch: int = param(32, "sequences per step, all replicas together", minimum=1)
    micro_batches: list[int] = param([4, 8], "micro-batch sizes the planner may choose", minimum=1)
    steps: int = param(2, "measured steps per layout (after one warm-up step)", minimum=1)
    table_1: bool = param(
        True,
        "also run Narayanan et al.'s Table 1 rows on a simulated DGX A100 (section 7: 20 s on 2 cores; the "
        "same on every cluster)",
    )

    LAB = "01_parallelism_choice"
    NOTEBOOK_SIMULATED = True  # its gradients are checked on the emulated cluster, the layouts run there
    RANKS_WHY = (
        "its mistake is tensor parallelism across the link between two nodes, which one machine lacks: 2 x 4 "
        "emulated by default; -p cluster auto runs its ranks on one node's GPUs (tp inside the node), "
        "torchrun across nodes its script"
    )
    TEST = {"cluster": "cpu", "steps": 1}
    SMOKE = {
        "n_layers": 2,
        "d_model": 32,
        "vocab_size": 256,
        "seq_len": 16,
        "global_batch": 8,
        "micro_batches": [2, 4],
        "steps": 1,
    }

    @classmethod
    def ranks_on(cls, gpus: int) -> int | None:
        # None on any machine: its default cluster is the emulated one whatever the GPUs (for_machine leaves
        # it alone), because the mistake is tensor parallelism across the link between two nodes, which one
        # machine does not have. Its 8 ranks (2 nodes x 4) are the lesson's; with cluster auto or gpu on a
        # node of world_size GPUs the notebook runs them there (Params.machine), where tp stays inside the
        # node; the script under torchrun takes torchrun's nodes
        return None

    def resolve(self, *, on_gpu: bool = False) -> Params:
        w = self.world_size
        p = self.gpu_sized(on_gpu)
        p = p if p.n_heads is not None else replace(p, n_heads=8 if 8 % w == 0 else w)
        why = f"the mistake, tensor parallelism over all {w} ranks, splits the heads and the width"
        p.check_multiple("n_heads", w, why)
        p.check_multiple("d_model", w, why)
        p.check_multiple(
            "d_model", p.n_heads, f"each of the n_heads={p.n_heads} heads gets d_model / n_heads"
        )
        if p.cluster.startswith("sim:"):  # the ranks on its simulated nodes, checked where the form is known
            p.simulated_machine(capped=False)
        m = p.micro_batches[0]
        p.check_multiple(
            "global_batch",
            w * m,
            f"the lesson's first run, plain data parallelism over all {w} ranks, gives each replica whole "
            f"micro-batches of micro_batches[0]={m}",
        )
        return p if p.memory_mib is not None else replace(p, memory_mib=_lesson_memory_mib(p))

    def for_nodes(self, nodes: int) -> Params:
        """Checked for `nodes` nodes sharing the ranks (the emulated cluster's; torchrun's)."""
        if self.world_size % nodes:
            raise ParamError(
                "world_size",
                self.world_size,
                f"a multiple of nodes={nodes}",
                nodes * max(1, self.world_size // nodes),
                why="every node holds as many GPUs",
            )
        return self

    def simulated_machine(self, *, capped: bool = True) -> Cluster:
        """`cluster="sim:<preset>"`: `nodes` of the preset's nodes sharing the ranks, as on the emulated
        cluster (the defaults: 4 GPUs on each of two DGX H100 nodes, as torchrun --nnodes 2 --nproc-per-node 4
        takes them), each GPU capped at `memory_mib` (unless not `capped`), as the emulated GPUs are, so that
        plain data parallelism does not fit the lab's small model there either."""
        self.for_nodes(self.nodes)
        preset = Cluster.preset(self.cluster.removeprefix("sim:"), nodes=self.nodes)
        per_node = self.world_size // self.nodes
        if per_node > preset.gpus_per_node:
            raise ParamError(
                "world_size",
                self.world_size,
                f"at most {preset.gpus_per_node} x nodes={self.nodes}",
                preset.gpus_per_node * self.nodes,
                why=f"a {preset.gpu_name} node holds {preset.gpus_per_node} GPUs",
            )
        machine = replace(preset.simulated(), gpus_per_node=per_node)
        return replace(machine, memory_gib=self.memory_mib / 1024) if capped else machine

    def inside_one_node(self) -> Cluster | None:
        """Every rank on one node of a simulated preset that holds them all, uncapped, to time the mistake
        without the link between nodes (a GPU can be launch-bound: waiting for the host, not the link);
        None elsewhere (one GPU node has no link between nodes; the emulated cluster's link always shows)."""
        if not self.cluster.startswith("sim:"):
            return None
        if self.world_size > Cluster.preset(self.cluster.removeprefix("sim:")).gpus_per_node:
            return None
        return replace(self, nodes=1).simulated_machine(capped=False)

    def machine(self) -> Machine:
        """Where the notebook runs, its reason saying why (`Machine.describe` prints it), without a memory
        cap (`Machine.limited(memory_mib)` adds it): `nodes` simulated nodes sharing the ranks for
        cluster="sim:<preset>" (`simulated_machine`); for "auto" or "gpu", this node's GPUs where it has
        world_size of them, every rank on this one node; else `nodes` emulated nodes sharing the ranks, the
        link between them the lesson's slow one."""
        if self.cluster.startswith("sim:"):
            simulated = self.simulated_machine(capped=False)
            why = (
                f"{self.cluster}: {self.nodes} simulated node(s) x {simulated.gpus_per_node} GPUs sharing "
                f"the {self.world_size} ranks, as on the emulated cluster"
            )
            return Machine(replace(simulated, reason=why), self.world_size)
        why = f"cluster={self.cluster!r}"
        if self.cluster in ("auto", "gpu"):
            here = Machine.resolve(self.cluster, self.world_size)
            if here.kind == "gpu":
                why = (
                    f"{here.cluster.gpu_count} GPU(s) on this node, {self.world_size} asked: every rank on "
                    "this one node (NCCL), so tensor parallelism over all of them stays on its links; the "
                    "mistake across two nodes runs under torchrun --nnodes 2"
                )
                # the ranks' node, as the planner plans for it: world_size of its GPUs
                node = replace(here.cluster, gpus_per_node=self.world_size, reason=why)
                return Machine(node, self.world_size)
            why = here.cluster.reason.split(" (")[0].removesuffix(": emulated cluster")  # "no GPU found"
        self.for_nodes(self.nodes)
        emulated = Cluster.emulated(nodes=self.nodes, gpus_per_node=self.world_size // self.nodes)
        slower = emulated.intra_node.bandwidth_gb_s / emulated.inter_node.bandwidth_gb_s
        why = (
            f"{why}: {self.nodes} emulated node(s) x {emulated.gpus_per_node} GPUs, the link between nodes "
            f"{slower:.0f}x slower than inside one (the lesson's)"
        )
        return Machine(replace(emulated, reason=why), self.world_size)


def _lesson_memory_mib(p: Params) -> float:
    """The default memory per GPU: one in which plain data parallelism does not fit and a sharded layout does,
    by the planner's own arithmetic at the smallest micro-batch (ZeRO-0, no checkpointing, as the lab plans).

    70 % of plain data parallelism's estimate (the lab's figure on 8 ranks), raised where that leaves no
    sharded layout room (2 ranks: sharding by 2 halves too little) to the geometric mean of the two peaks,
    plain and the sharded layout that needs least, over the planner's headroom: always between them."""
    w = p.world_size
    config = p.config()
    link = Link(1.0, 0.0)  # links do not change memory; given, so that nothing is calibrated
    roomy = Cluster.emulated(nodes=1, gpus_per_node=w, memory_gib=2.0**20, intra_node=link, inter_node=link)
    the_plan = plan(
        config,
        roomy,
        p.global_batch,
        precision="fp32",
        rates=Rates(flops_per_s=1.0),
        micro_batch_sizes=(min(p.micro_batches),),
        zero_stages=(0,),
        checkpointing=(False,),
    )
    peaks = {c.layout: c.memory.peak for c in the_plan.candidates if c.memory is not None}
    plain = peaks.pop(Layout(dp=w), None)
    sharded = min(peaks.values(), default=None)
    memory = 0.7 * estimate(
        model=config, dp=w, precision="fp32", optimizer="adam", micro_batch=p.micro_batches[0]
    ).peak
    if plain is not None and sharded is not None and sharded < plain:
        memory = max(memory, (plain * sharded) ** 0.5 / (1 - the_plan.headroom))
    return float(round(memory / 2**20))


def _described(w: Where, p: Params) -> Cluster:
    """The cluster the planner plans for: `memory_mib` per GPU (the emulated budget; on GPUs a planning limit,
    not enforced) and the links of these ranks (on CPUs under torchrun, the emulated cluster's, for the plan
    only)."""
    memory_gib = p.memory_mib / 1024
    if isinstance(w.cluster, Cluster):
        return replace(w.cluster, memory_gib=memory_gib)
    if w.on_gpu:
        return replace(Cluster.detect(), nodes=w.nodes, gpus_per_node=w.gpus_per_node, memory_gib=memory_gib)
    return Cluster.emulated(nodes=w.nodes, gpus_per_node=w.gpus_per_node, memory_gib=memory_gib)


def headline(w: Where, p: Params) -> LabRecords:
    """Lab 01's records: tensor parallelism over every rank (the mistake), the planner's pick, the best
    measured.

    The planner plans for these ranks with `memory_mib` per GPU and this machine's measured rates; every
    layout it accepts is measured, and the mistake.
    """
    if w.simulated:  # the notebook's simulated nodes: `nodes` of the preset's sharing the ranks
        machine = p.simulated_machine(capped=False)
        w = replace(w, cluster=machine, nodes=machine.nodes, gpus_per_node=machine.gpus_per_node)
    elif not w.torchrun:  # the notebook's emulated cluster: `nodes` nodes sharing the ranks
        p.for_nodes(p.nodes)
        w = emulated_cluster(w, nodes=p.nodes, gpus_per_node=w.world_size // p.nodes)
    config = p.config()

    runs: dict[tuple[Layout, int], LayoutSummary] = {}

    def run(layout: Layout, micro_batch: int) -> LayoutSummary:
        # the mistake is often one of the plan's candidates too, at the same micro-batch: measured once
        if (layout, micro_batch) not in runs:
            runs[layout, micro_batch] = measure(layout, micro_batch)
        return runs[layout, micro_batch]

    def measure(layout: Layout, micro_batch: int) -> LayoutSummary:
        return summarize_layout(
            w.launch(
                layout_steps,
                config,
                layout,
                p.global_batch,
                micro_batch,
                steps=p.steps,
                warmup=1,
                timeout_s=p.timeout_s,
                deadline_s=p.timeout_s * 3,
                alike=layout.pp == 1,  # without a pipeline every rank runs the same operators
            )
        )

    # every simulated GPU is the same described GPU and shares no core: one rank measures them all
    ranks = 1 if w.simulated else w.world_size
    rates = median_rates(
        w.launch(measure_rates, config, p.micro_batches[0], world_size=ranks, timeout_s=p.timeout_s)
    )
    the_plan = plan(
        config,
        _described(w, p),
        p.global_batch,
        precision="fp32",
        rates=rates,
        micro_batch_sizes=p.micro_batches,
        zero_stages=(0,),
        checkpointing=(False,),
        dp_overlap=False,  # the runs all-reduce the gradients in one call after backward (_dp_all_reduce)
    )
    pick = the_plan.best
    tp_all = Layout(tp=w.world_size)
    measured = {str(tp_all): run(tp_all, p.micro_batches[-1])}
    for c in the_plan.candidates:
        if c.ok:
            measured[str(c.layout)] = run(c.layout, c.micro_batch)
    predicted = {str(c.layout): c.predicted_ms for c in the_plan.candidates if str(c.layout) in measured}
    rows = [
        {
            "layout": name,
            "predicted_ms": predicted.get(name),
            "measured_ms": m.step_ms,
            "inter_MiB": m.link_bytes["inter"] / 2**20,
            "intra_MiB": m.link_bytes["intra"] / 2**20,
        }
        for name, m in measured.items()
    ]
    ranked = [r for r in rows if r["predicted_ms"] is not None]
    best = min(rows, key=lambda r: r["measured_ms"])
    return LabRecords(
        measured[str(tp_all)].step_ms,
        measured[str(pick.layout)].step_ms,
        best["measured_ms"],
        "ms",
        Meaning(
            before=f"step time of tensor parallelism over all {w.world_size} ranks of {w.nodes} node(s)",
            after=f"step time of the planner's pick, {pick.layout}",
            limit=f"the fastest layout measured, {best['layout']}",
        ),
        "step time of one model under data x tensor x pipeline layouts, predicted and measured",
        {
            "pick": str(pick.layout),
            "rates": rates.source,
            "spearman": spearman([r["predicted_ms"] for r in ranked], [r["measured_ms"] for r in ranked])
            if len(ranked) > 1
            else None,
            "sweep": rows,
            "plan": [c.row() for c in the_plan.candidates],
            "memory_mib": p.memory_mib,
        },
        nodes=w.nodes,
    )


if __name__ == "__main__":
    main(__spec__.name)
