"""The parallelism planner: every layout that divides the cluster and fits its memory, with a predicted step.

`plan(model, cluster, global_batch)` enumerates dp x tp x pp layouts (`labkit.layout`), and for each
the micro-batch, ZeRO stage and activation checkpointing; it keeps what fits the GPU's memory
(`labkit.memory.estimate`, the stage with the highest peak, gradients kept through the step when there
are several micro-batches) and predicts a step from four terms:

* compute: the model's FLOPs (forward 2 per weight per token plus attention, backward twice that, a second
  forward with checkpointing; Narayanan et al. 2021, appendix) on the busiest stage, over tp, at `Rates`:
  on a described GPU each matmul of a block, forward and backward, at the efficiency its shape on one tp rank
  reaches (`labkit.gemm`: tile and wave quantization, memory-bound below the FLOP:byte ratio), so splitting a
  layer or shrinking the micro-batch can cost compute time as well as communication;
* tensor parallelism: Megatron's 2 all-reduces of the activations per block in forward and 2 in backward
  (Shoeybi et al. 2019), 2 more when checkpointing recomputes the forward, on the link the tp group crosses;
* the pipeline: 1F1B or GPipe take (m + p - 1) stage slots of one micro-batch (the bubble, Huang et al. 2019),
  each slot holding the stage's compute, its tp all-reduces and two point-to-point transfers;
* data parallelism: one all-reduce of the rank's gradients on the dp group's link (ZeRO-1/2: reduce-scatter
  + all-gather, the same bytes; ZeRO-3 gathers parameters twice more), and the optimizer step at
  `Rates.optimizer_s_per_param`. With `dp_overlap` (DDP's buckets, the default) the all-reduce, or ZeRO's
  reduce-scatter, runs under the last micro-batch's backward and only what does not fit under it, and at
  least the last bucket, is exposed (Li et al. 2020, section 3.2.3); ZeRO's all-gather of the updated
  parameters comes after the optimizer step and ZeRO-3's gathers are not overlapped here. Without it (a
  single all-reduce after backward, as lab 01's runs do) all of it is exposed.

Collective times are `labkit.links.collective_time_s` (α-β, ring) on the link each group's rings run at
(`Topology.rail_ring`: across nodes, over as many of a node's network ports as the group has ranks
there), so the planner and the emulated and simulated clusters share one model; on a described cluster
(`Cluster.preset`) compute is its peak FLOP/s times an efficiency, a stated assumption. `Plan.table()`
ranks the layouts and gives each rejected one its reason (does not fit, does not divide, tp crosses nodes).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from labkit import validate
from labkit.cluster import Cluster
from labkit.gemm import GemmCurve, gemm_s
from labkit.layout import Layout
from labkit.links import Link, Topology, collective_time_s
from labkit.memory import MemoryBreakdown, blocks_per_stage, check_model_parallel, estimate, stage_params
from labkit.models import GPTConfig
from labkit.op_time import DISPATCH_S  # the host's floor per operator; its home is the op time model

__all__ = [
    "DISPATCH_S",
    "KERNELS_PER_BLOCK",
    "Candidate",
    "Plan",
    "Rates",
    "forward_flops_per_token",
    "plan",
    "spearman",
    "stage_compute_s",
    "tp_comm_s",
]

_GIB = 2**30


# A GPT block's forward and backward run about 30 operators, each at least DISPATCH_S on a GPU.
KERNELS_PER_BLOCK = 30
# DDP's default bucket_cap_mb (torch.nn.parallel.DistributedDataParallel): the last bucket's all-reduce is
# what stays exposed after backward even when everything else hides under it.
DDP_BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class Rates:
    """How fast one GPU computes: `flops_per_s` on the model's large matmuls, its optimizer step per
    parameter, `dispatch_s`, the host's time per operator, below which no operator runs (0 where compute is
    synchronous, as on the emulated cluster, whose CPU time is the operator's own), and `curve`, how much
    less a smaller matmul reaches (`labkit.gemm`; None: every matmul at `flops_per_s`)."""

    flops_per_s: float
    optimizer_s_per_param: float = 0.0
    source: str = ""
    dispatch_s: float = 0.0
    curve: GemmCurve | None = None


def forward_flops_per_token(config: GPTConfig, seq_len: int | None = None) -> tuple[float, float]:
    """(per block, head) forward FLOPs per token: 2 per weight of each matmul, and attention's QK^T and AV
    (4·s·h per block at sequence length s, counted in full as Narayanan et al. 2021 do)."""
    s = config.seq_len if seq_len is None else seq_len
    d, f, v = config.d_model, config.ffn_dim, config.vocab_size
    qkv = d + 2 * config.kv_heads * config.head_dim
    return 2.0 * (d * qkv + d * d + 2 * d * f) + 4.0 * s * d, 2.0 * d * v


@dataclass
class Candidate:
    """One layout with its best options, its memory, its prediction (ms, split by term) and, if rejected,
    why."""

    layout: Layout
    micro_batch: int = 0
    micro_batches: int = 0  # per pipeline (1F1B's m), or accumulation steps when pp == 1
    zero_stage: int = 0
    checkpointing: bool = False
    memory: MemoryBreakdown | None = None
    predicted_ms: float | None = None
    parts_ms: dict[str, float] = field(default_factory=dict)
    links: dict[str, str] = field(default_factory=dict)
    reason: str = ""

    @property
    def ok(self) -> bool:
        return not self.reason

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def pp(self) -> int:
        return self.layout.pp

    def row(self) -> dict:
        mem = None if self.memory is None else round(self.memory.peak / _GIB, 3)
        return {
            "layout": str(self.layout),
            "dp": self.dp,
            "tp": self.tp,
            "pp": self.pp,
            "micro_batch": self.micro_batch,
            "micro_batches": self.micro_batches,
            "zero": self.zero_stage,
            "ckpt": self.checkpointing,
            "memory_gib": mem,
            "predicted_ms": None if self.predicted_ms is None else round(self.predicted_ms, 3),
            **{f"{k}_ms": round(v, 3) for k, v in self.parts_ms.items()},
            "links": ",".join(f"{k}:{v}" for k, v in self.links.items()),
            "reason": self.reason or "ok",
        }


@dataclass
class Plan:
    """Every layout, ranked: those that fit by predicted time, then the rejected ones with their reasons."""

    model: GPTConfig
    cluster: Cluster
    global_batch: int
    seq_len: int
    rates: Rates
    candidates: list[Candidate]
    memory_gib: float = 0.0  # per GPU
    headroom: float = 0.0  # the share of it kept free

    @property
    def best(self) -> Candidate:
        ok = [c for c in self.candidates if c.ok]
        if not ok:
            reasons = "; ".join(f"{c.layout}: {c.reason}" for c in self.candidates[:6])
            raise ValueError(
                f"no layout fits: {reasons}. Use more GPUs, a smaller model or global batch, ZeRO or "
                "activation checkpointing"
            )
        return ok[0]

    def candidate(self, dp: int, tp: int, pp: int) -> Candidate:
        for c in self.candidates:
            if (c.dp, c.tp, c.pp) == (dp, tp, pp):
                return c
        raise KeyError(f"dp{dp} x tp{tp} x pp{pp} is not a layout of this plan")

    def table(self, limit: int | None = None) -> str:
        """The ranked layouts as text: predicted ms and its terms, memory per GPU, options, reason."""
        cap = self.memory_gib
        head = (
            f"{'layout':<18}{'mb':>4}{'m':>5}{'zero':>5}{'ckpt':>5}{'mem/GPU':>11}{'pred ms':>10}"
            f"{'compute':>9}{'bubble':>8}{'tp':>8}{'pp':>7}{'dp+opt':>8}  links / reason"
        )
        lines = [
            f"plan for {self.cluster.nodes} x {self.cluster.gpus_per_node} GPUs of {_size(cap * _GIB)} "
            f"({self.headroom:.0%} kept free), global batch {self.global_batch}, seq {self.seq_len} "
            f"({self.cluster.label}; compute {self.rates.source})",
            head,
        ]
        for c in self.candidates[:limit]:
            mem = "-" if c.memory is None else _size(c.memory.peak)
            pred = "-" if c.predicted_ms is None else f"{c.predicted_ms:.1f}"
            p = c.parts_ms
            terms = "".join(
                f"{p[k]:>{w}.1f}" if k in p else f"{'-':>{w}}"
                for k, w in (("compute", 9), ("bubble", 8), ("tp", 8), ("pp", 7), ("dp", 8))
            )
            note = ",".join(f"{k}:{v}" for k, v in c.links.items()) if c.ok else c.reason
            lines.append(
                f"{c.layout!s:<18}{c.micro_batch or '-':>4}{c.micro_batches or '-':>5}{c.zero_stage:>5}"
                f"{'y' if c.checkpointing else 'n':>5}{mem:>11}{pred:>10}{terms}  {note}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _size(nbytes: float) -> str:
    return f"{nbytes / _GIB:.1f} GiB" if nbytes >= 4 * _GIB else f"{nbytes / 2**20:.1f} MiB"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _cluster_rates(cluster: Cluster, efficiency: float) -> Rates:
    if cluster.kind == "described":
        curve = None
        if cluster.sm_count and cluster.memory_gb_s:
            curve = GemmCurve(cluster.sm_count, cluster.memory_gb_s)
        return Rates(
            cluster.peak_tflops * 1e12 * efficiency,
            0.0,
            f"{cluster.peak_tflops:g} TFLOP/s peak x {efficiency:.0%} efficiency on large matmuls"
            + (f", less on small ones ({curve.sms} SMs, {curve.memory_gb_s:g} GB/s)" if curve else "")
            + ", optimizer not counted",
            DISPATCH_S,
            curve,
        )
    if cluster.is_emulated and cluster.cpu_gflops:
        return Rates(
            cluster.cpu_gflops * 1e9 * efficiency,
            0.0,
            f"this CPU's {cluster.cpu_gflops:.1f} GFLOP/s per core x {efficiency:.0%}",
        )
    raise ValueError(
        "no compute rate for this cluster: pass rates=labkit.planner.Rates(flops_per_s=...) "
        "(e.g. measured with labkit.course.experiments.parallelism_choice.measure_rates)"
    )


def tp_comm_s(
    config: GPTConfig,
    micro_batch: int,
    tp: int,
    link: Link,
    blocks: int | None = None,
    checkpointing: bool = False,
    seq_len: int | None = None,
    precision: str = "fp32",
) -> float:
    """Seconds of tensor-parallel all-reduces for one micro-batch through `blocks` blocks (default: all).

    Each block all-reduces its output activation (micro_batch x seq x d_model) twice in forward (g after
    attention and after the MLP) and twice in backward (f's gradient before each) (Shoeybi et al. 2019,
    figure 4); activation checkpointing repeats the forward's two. The tensor is the whole activation on
    every rank, not a 1/tp shard; each all-reduce is a ring over the tp group's link (`collective_time_s`).
    """
    seq = config.seq_len if seq_len is None else seq_len
    nbytes = micro_batch * seq * config.d_model * (4 if precision == "fp32" else 2)
    per_block = 6 if checkpointing else 4
    n = config.n_layers if blocks is None else blocks
    return n * per_block * collective_time_s("all_reduce", nbytes, tp, link)


def stage_compute_s(
    config: GPTConfig,
    tokens: int,
    tp: int,
    blocks: int,
    head: bool,
    rates: Rates,
    checkpointing: bool = False,
    seq_len: int | None = None,
    precision: str = "mixed",
) -> float:
    """Seconds of one stage's forward and backward for `tokens` tokens on one of its tp ranks.

    Each block's four matmuls (qkv, attention output, the MLP's two) and the head's, split over tp as
    Megatron splits them; backward runs two matmuls per forward one (the input's gradient, m x k, and the
    weight's, k x n), checkpointing a second forward. Each at `rates`' efficiency curve (`labkit.gemm`);
    attention's QK^T and AV (batched over heads, many tiles) at `rates.flops_per_s`. Without a curve this is
    the FLOPs of `forward_flops_per_token` at `rates.flops_per_s`.
    """
    s = config.seq_len if seq_len is None else seq_len
    d, f, v = config.d_model, config.ffn_dim, config.vocab_size
    qkv = d + 2 * config.kv_heads * config.head_dim
    elem = 4 if precision == "fp32" else 2
    forwards = 2 if checkpointing else 1

    def fwd_bwd(m: float, n: float, k: float) -> float:
        """One matmul's forward(s), then its input's gradient (m x k) and its weight's (k x n)."""
        shapes = [(m, n, k)] * forwards + [(m, k, n), (k, n, m)]
        return sum(gemm_s(*shape, rates.flops_per_s, rates.curve, elem) for shape in shapes)

    block = sum(fwd_bwd(tokens, n, k) for n, k in ((qkv / tp, d), (d, d / tp), (f / tp, d), (d, f / tp)))
    attention = (forwards + 2) * tokens * 4.0 * s * d / tp / rates.flops_per_s
    return blocks * (block + attention) + (fwd_bwd(tokens, v / tp, d) if head else 0.0)


def _dp_exposed_s(
    all_reduce_s: float, last_bucket_s: float, backward_s: float, zero: int, overlap: bool
) -> float:
    """What the dp group's communication adds to the step (see the module docstring)."""
    if zero >= 3 or not overlap:
        return all_reduce_s * (1.5 if zero >= 3 else 1.0)
    if zero >= 1:  # the reduce-scatter half hides under backward; the all-gather after the step does not
        return max(all_reduce_s / 2 - backward_s, last_bucket_s / 2) + all_reduce_s / 2
    return max(all_reduce_s - backward_s, last_bucket_s)


def _slowest_ring(topo: Topology, layout: Layout, kind: str) -> Link:
    """The slowest of the rings the `kind` groups of `layout` run (the first, among equals).

    A group is the ranks `start + i * stride`, so two groups whose starts lie at the same place in their
    nodes (`start % gpus_per_node`) spread over the nodes alike and run the same ring: one of each is timed,
    not all of them (a layout of 3,072 GPUs has up to 3,072 groups, and the planner tries hundreds).
    """
    first_of_each: dict[int, list[int]] = {}
    for group in layout.groups_of(kind):
        first_of_each.setdefault(group[0] % topo.gpus_per_node, group)
    return min((topo.rail_ring(g) for g in first_of_each.values()), key=lambda lk: lk.bandwidth_gb_s)


def _predict(
    c: Candidate,
    config: GPTConfig,
    cluster: Cluster,
    seq: int,
    rates: Rates,
    precision: str,
    dp_overlap: bool = True,
) -> None:
    """Fill `c.parts_ms` and `c.predicted_ms` (see the module docstring)."""
    topo = cluster.topology()
    pp, tp, dp = c.pp, c.tp, c.dp
    passes = 4.0 if c.checkpointing else 3.0  # forward + backward (2x), + a recomputed forward
    tokens = c.micro_batch * seq
    act_bytes = tokens * config.d_model * (4 if precision == "fp32" else 2)
    stage_blocks = blocks_per_stage(config, pp)
    slots = []
    for s, blocks in enumerate(stage_blocks):
        head = s == pp - 1
        work = stage_compute_s(config, tokens, tp, blocks, head, rates, c.checkpointing, seq, precision)
        kernels = passes / 3 * KERNELS_PER_BLOCK * blocks + (KERNELS_PER_BLOCK / 3 if s == pp - 1 else 0)
        slots.append(max(work, kernels * rates.dispatch_s))
    compute = max(slots)
    # each dimension's rings: inside a node its link, across nodes over the rails (labkit.links.Topology)
    link = {k: _slowest_ring(topo, c.layout, k) for k in c.links}
    tp_s = pp_s = dp_s = 0.0
    if tp > 1:
        tp_s = tp_comm_s(
            config, c.micro_batch, tp, link["tp"], max(stage_blocks), c.checkpointing, seq, precision
        )
        calls = max(stage_blocks) * (6 if c.checkpointing else 4)
        tp_s = max(tp_s, calls * rates.dispatch_s)
    if pp > 1:
        # Each micro-batch crosses every boundary twice (activation down, gradient back); a slot pays the
        # mean boundary's pair of transfers (a boundary inside a node is cheaper than the one between nodes).
        group = c.layout.groups_of("pp")[0]
        pairs = [topo.slowest_link([a, b]) for a, b in itertools.pairwise(group)]
        pp_s = 2 * sum(collective_time_s("send", act_bytes, 2, lk) for lk in pairs) / len(pairs)
        pp_s = max(pp_s, 2 * rates.dispatch_s)
    m = c.micro_batches
    slot = compute + tp_s + pp_s
    params = max(stage_params(config, tp, pp, s) for s in range(pp))  # the largest stage's dp group is last
    if dp > 1:
        grad_bytes = params * (4 if precision == "fp32" else 2)
        all_reduce = collective_time_s("all_reduce", grad_bytes, dp, link["dp"])
        last_bucket = collective_time_s("all_reduce", min(grad_bytes, DDP_BUCKET_BYTES), dp, link["dp"])
        backward = compute * (passes - 1) / passes  # the last micro-batch's backward (and recompute)
        dp_s = _dp_exposed_s(all_reduce, last_bucket, backward, c.zero_stage, dp_overlap)
        dp_s = max(dp_s, rates.dispatch_s)
    opt_params = params / dp if c.zero_stage >= 1 else params
    opt_s = opt_params * rates.optimizer_s_per_param
    c.parts_ms = {
        "compute": m * compute * 1e3,
        "bubble": (pp - 1) * slot * 1e3,
        "tp": m * tp_s * 1e3,
        "pp": m * pp_s * 1e3,
        "dp": (dp_s + opt_s) * 1e3,
    }
    c.predicted_ms = (m + pp - 1) * slot * 1e3 + (dp_s + opt_s) * 1e3


def plan(
    model: GPTConfig | str,
    cluster: Cluster,
    global_batch: int,
    seq_len: int | None = None,
    *,
    precision: str = "mixed",
    optimizer: str = "adam",
    memory_gib: float | None = None,
    zero_stages: tuple[int, ...] = (0, 1),
    checkpointing: tuple[bool, ...] = (False, True),
    micro_batch_sizes: tuple[int, ...] | None = None,
    rates: Rates | None = None,
    efficiency: float = 0.5,
    tp_across_nodes: bool = False,
    headroom: float = 0.1,
    dp_overlap: bool = True,
) -> Plan:
    """Rank every dp x tp x pp layout of `cluster` for `model` at `global_batch` sequences per step.

    `memory_gib`: per-GPU capacity (default the cluster's). `rates`: compute speed (default: the described
    cluster's peak x `efficiency`, or this CPU's calibration x `efficiency` on the emulated cluster).
    For each layout the fastest fitting option among `micro_batch_sizes` (default: every divisor of the
    per-replica batch), `zero_stages` and `checkpointing` is kept. A tp group that crosses nodes is
    rejected unless `tp_across_nodes` (it is still predicted, to show what it costs). `headroom`: the share
    of memory kept free for what `estimate` does not count, so a layout fits if its peak <= (1 - headroom) x
    cap: the CUDA context of each process (a few hundred MiB of kernels and driver state that
    `torch.cuda.memory_allocated` does not count: its docs; 287 MB with CUDA's lazy module loading, 667 MB
    without, in pytorch/pytorch#86509), NCCL's buffers (per channel and peer, `NCCL_BUFFSIZE`, 4 MiB by
    default, for its Simple protocol: NCCL docs, "Environment Variables"; `DEFAULT_BUFFSIZE` in src/init.cc),
    optimizer temporaries, and the caching allocator's rounding and fragmentation (lab 02).
    `dp_overlap`: the dp all-reduce runs in buckets under backward, as DDP runs it (False: after backward).
    """
    config = GPTConfig.preset(model) if isinstance(model, str) else model
    if not isinstance(config, GPTConfig):
        raise ValueError(f"model must be a GPTConfig or a preset name, got {type(model).__name__}")
    if not isinstance(cluster, Cluster):
        raise ValueError(
            f"cluster must be a labkit.Cluster (e.g. Cluster.preset('dgx-a100-80gb', nodes=2)), "
            f"got {cluster!r}"
        )
    validate.positive_int("global_batch", global_batch, "plan(model, cluster, global_batch=512)")
    seq = config.seq_len if seq_len is None else validate.positive_int("seq_len", seq_len, "seq_len=2048")
    cap = cluster.memory_gib if memory_gib is None else memory_gib
    if cap is None:
        raise ValueError(
            "the cluster has no memory capacity: pass memory_gib=80 (per GPU), or describe the "
            "cluster with one (Cluster.preset(...), Cluster.emulated(memory_gib=0.25))"
        )
    if not 0 <= headroom < 1:
        raise ValueError(
            f"headroom={headroom!r} must be a share of memory in [0, 1): e.g. headroom=0.1 keeps 10 % free"
        )
    rates = rates or _cluster_rates(cluster, efficiency)
    world, topo = cluster.world_size, cluster.topology()
    candidates = []
    for tp in _divisors(world):
        for pp in _divisors(world // tp):
            layout = Layout(world // tp // pp, tp, pp)
            candidates.append(
                _best_option(
                    layout,
                    config,
                    cluster,
                    topo,
                    global_batch,
                    seq,
                    precision,
                    optimizer,
                    cap * (1 - headroom),
                    zero_stages,
                    checkpointing,
                    micro_batch_sizes,
                    rates,
                    tp_across_nodes,
                    dp_overlap,
                )
            )
    candidates.sort(key=lambda c: (not c.ok, c.predicted_ms is None, c.predicted_ms or 0.0))
    return Plan(config, cluster, global_batch, seq, rates, candidates, cap, headroom)


def _why_not_divides(layout: Layout, config: GPTConfig, global_batch: int) -> str:
    """Why `layout` cannot split `config` or the global batch ("" when it can)."""
    try:
        check_model_parallel(config, layout.tp, layout.pp)
    except ValueError as exc:
        return f"does not divide: {exc}"
    if global_batch % layout.dp:
        return (
            f"does not divide: global batch {global_batch} over dp={layout.dp} replicas; use a global batch "
            f"that is a multiple of {layout.dp}"
        )
    return ""


def _best_option(
    layout: Layout,
    config: GPTConfig,
    cluster: Cluster,
    topo,
    global_batch: int,
    seq: int,
    precision: str,
    optimizer: str,
    cap: float,
    zero_stages,
    checkpointing,
    micro_batch_sizes,
    rates: Rates,
    tp_across_nodes: bool,
    dp_overlap: bool = True,
) -> Candidate:
    """The fastest fitting option of one layout, or the layout with the reason nothing works."""
    base = Candidate(layout, links=layout.links_crossed(topo))
    base.reason = _why_not_divides(layout, config, global_batch)
    if base.reason:
        return base
    per_replica = global_batch // layout.dp
    sizes = [b for b in (micro_batch_sizes or _divisors(per_replica)) if per_replica % b == 0]
    options = [
        (mb, per_replica // mb, zero, ckpt)
        for mb in sizes
        for zero in (zero_stages if layout.dp > 1 else (0,))
        for ckpt in checkpointing
        if layout.pp == 1 or per_replica // mb >= layout.pp
    ]  # 1F1B needs m >= p
    tried, smallest = [], None
    for mb, m, zero, ckpt in options:
        c = Candidate(layout, mb, m, zero, ckpt, links=base.links)
        # With m > 1 micro-batches the gradients live through the step (accumulation, and 1F1B's backwards of
        # early micro-batches before the last forward): keep_grads, as lab 02 measured.
        c.memory = estimate(
            model=config,
            dp=layout.dp,
            zero_stage=zero,
            precision=precision,
            optimizer=optimizer,
            micro_batch=mb,
            seq_len=seq,
            checkpointing=ckpt,
            keep_grads=m > 1,
            tp=layout.tp,
            pp=layout.pp,
            micro_batches=m,
            # torch.optim's for-each Adam on CUDA tensors (a GPU, described or simulated): one more copy of
            # the optimizer state during the step (estimate's docstring); a loop on the emulated cluster's
            foreach=cluster.kind != "emulated",
        )
        _predict(c, config, cluster, seq, rates, precision, dp_overlap)
        if smallest is None or c.memory.peak < smallest.memory.peak:
            smallest = c
        if c.memory.peak <= cap * _GIB:
            tried.append(c)
    if smallest is None:
        base.reason = (
            f"does not divide: pp={layout.pp} stages need at least {layout.pp} micro-batches of the "
            f"{per_replica} sequences per replica"
        )
        return base
    if not tried:
        smallest.reason = (
            f"does not fit: {_size(smallest.memory.peak)} > {_size(cap * _GIB)} usable per GPU even at "
            f"micro-batch {smallest.micro_batch}, ZeRO-{smallest.zero_stage}, checkpointing "
            f"{'on' if smallest.checkpointing else 'off'}; shard the model (tp, pp) or use more GPUs"
        )
        return smallest
    best = min(tried, key=lambda c: c.predicted_ms)
    if layout.tp > 1 and best.links.get("tp") == "inter" and not tp_across_nodes:
        best.reason = (
            f"tp group crosses nodes: {2 * config.n_layers * 2} all-reduces per micro-batch on the "
            f"inter-node link ({best.parts_ms['tp']:.1f} ms predicted); keep tp <= "
            f"{cluster.gpus_per_node} GPUs per node (Narayanan et al. 2021, section 3.2, takeaway #1)"
        )
    return best


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation of two equally long lists (ties get their average rank)."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"spearman needs two lists of the same length >= 2, got {len(a)} and {len(b)}")

    def ranks(x: list[float]) -> list[float]:
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return cov / var if var else 0.0
