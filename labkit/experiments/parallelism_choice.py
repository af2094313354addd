"""Lab 01's driver: train the same GPT under a dp x tp x pp layout and measure its step and its traffic.

`layout_steps` runs on every rank (launch it with `labkit.launch` on world_size = dp x tp x pp): it creates
the layout's groups (`labkit.parallel.layout`), builds the seeded GPT, splits its blocks over the tp group
(`labkit.parallel.tensor`), cuts it into pp stages run by 1F1B (`labkit.parallel.pipeline`), and keeps only
its own layers, so the emulated memory budget sees what a GPU would hold. Each step a replica trains on its
rows of the global batch in micro-batches (pipeline micro-batches, or gradient accumulation when pp == 1),
then one flat all-reduce averages the gradients over the dp group (not overlapped: lab 03 shows how to hide
it) and Adam steps. Every rank reports its step times on `labkit.runtime.clock` (the virtual clock on the
emulated cluster), the bytes it put on each link class, and optionally its gradients and loss against one
process on the whole batch. `summarize_layout` combines the ranks; `measure_rates` times this CPU on the
model for the planner (`labkit.planner.Rates`).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from labkit import runtime
from labkit.cluster import Cluster
from labkit.experiments.common import rank_rows, seeded_model
from labkit.experiments.script import Where, emulated_cluster, run_lab
from labkit.links import Link, Topology, bus_bandwidth_factor
from labkit.models import GPTConfig, synthetic_batch
from labkit.parallel.layout import Layout, make_groups
from labkit.parallel.pipeline import clock_stages, even_split, make_schedule, pipeline_stages
from labkit.parallel.tensor import TPStats, shard_state, tensor_parallel
from labkit.planner import Rates, forward_flops_per_token, plan, spearman

__all__ = [
    "DEFAULTS",
    "LayoutRankResult",
    "LayoutSummary",
    "headline",
    "layout_steps",
    "main",
    "measure_rates",
    "median_rates",
    "reference_gradients",
    "summarize_layout",
]


@dataclass
class LayoutRankResult:
    """What one rank measured under one layout. Times in ms; bytes per step."""

    rank: int
    layout: str
    coords: dict[str, int]
    step_ms: list[float]
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


def _dp_all_reduce(params: list[torch.Tensor], group: dist.ProcessGroup | None, dp: int) -> int:
    """Average the gradients over the dp group in one flat all-reduce; returns its bytes."""
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat.div_(dp)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    return flat.numel() * flat.element_size()


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
    reference: tuple[float, dict[str, torch.Tensor]] | None = None,
) -> LayoutRankResult:
    """Train `steps` + `warmup` steps under `layout` on this rank; see the module docstring.

    `reference`: `reference_gradients(config, global_batch, seed)` (computed once, by the caller), to
    compare this rank's first-step gradients and loss with."""
    groups = make_groups(layout)
    c = groups.coords
    if global_batch % (layout.dp * micro_batch):
        raise ValueError(
            f"global_batch={global_batch} must split into dp={layout.dp} replicas of micro-batches "
            f"of {micro_batch}: use a multiple of {layout.dp * micro_batch}"
        )
    m = global_batch // layout.dp // micro_batch
    dev = runtime.device()
    stats = TPStats()
    model = seeded_model(config, seed, dev)
    if layout.tp > 1:
        tensor_parallel(model, groups.tp, stats)
    names = {id(p): n for n, p in model.named_parameters()}
    sent = [0, 0]
    if layout.pp > 1:
        stages = pipeline_stages(model, even_split(config, layout.pp), groups.pp, dev)
        clock_stages(stages, [], sent)
        schedule = make_schedule(stages, "1f1b", m)
        module = stages[0].submod
        params = list(module.parameters())
        del model  # only this stage's layers stay alive, as on a GPU
    else:
        module, params, schedule = model, list(model.parameters()), None
    opt = torch.optim.Adam(params, lr=lr)
    cluster = runtime.current_cluster()
    if cluster is not None:
        topo = cluster.topology()
    else:  # a torchrun rank: its node holds LOCAL_WORLD_SIZE ranks; only which node a rank is on matters here
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        topo = Topology(max(1, per_node), Link(1.0, 0.0, "not modelled"), Link(1.0, 0.0, "not modelled"))
    crossed = layout.links_crossed(topo)
    result = LayoutRankResult(
        dist.get_rank(),
        str(layout),
        c,
        [],
        {"intra": 0, "inter": 0},
        {"tp": 0, "pp": 0, "dp": 0},
        sum(p.numel() for p in params),
        label=cluster.label if cluster else "",
    )
    runtime.reset_peak_memory_stats()
    dp_bytes = 0
    for step in range(warmup + steps):
        stats.all_reduces = stats.bytes = 0
        sent[0] = sent[1] = 0
        x, y = rank_rows(config, global_batch, c["dp"], layout.dp, step=step, seed=seed, device=dev)
        dist.barrier()  # a common start: the step ends with its slowest rank
        t0 = runtime.clock()
        losses: list = []
        if schedule is not None:
            kwargs = {"return_outputs": False}
            if stages[0].is_last:
                kwargs.update(target=y, losses=losses)
            if stages[0].is_first:
                schedule.step(x, **kwargs)
            else:
                schedule.step(**kwargs)
        else:
            for k in range(m):
                rows = slice(k * micro_batch, (k + 1) * micro_batch)
                loss = model(x[rows], y[rows]) / m
                loss.backward()
                losses.append(loss.detach() * m)
        dp_bytes = _dp_all_reduce(params, groups.dp, layout.dp) if layout.dp > 1 else 0
        checked = 0.0
        if reference is not None and step == 0:
            c0 = runtime.clock()
            result.grad_error, result.loss_error = _errors(
                config, reference, layout, c, module, names, losses
            )
            checked = runtime.clock() - c0  # the check is not part of the step
        opt.step()
        opt.zero_grad(set_to_none=True)
        ms = (runtime.clock() - t0 - checked) * 1e3
        if step >= warmup:
            result.step_ms.append(ms)
    kinds = {
        "tp": stats.bytes * (bus_bandwidth_factor("all_reduce", layout.tp) if layout.tp > 1 else 0),
        "pp": sent[1],
        "dp": dp_bytes * (bus_bandwidth_factor("all_reduce", layout.dp) if layout.dp > 1 else 0),
    }
    result.kind_bytes = {k: int(v) for k, v in kinds.items()}
    for kind, nbytes in result.kind_bytes.items():
        if nbytes:
            result.link_bytes[crossed.get(kind, "intra")] += nbytes
    peak = runtime.peak_bytes()
    result.peak_bytes = peak[0] if peak else None
    return result


def reference_gradients(
    config: GPTConfig, global_batch: int, seed: int = 0
) -> tuple[float, dict[str, torch.Tensor]]:
    """(loss, gradient per parameter name) of one process on the whole first global batch."""
    ref = seeded_model(config, seed)
    x, y = synthetic_batch(config, global_batch, seed=seed, step=0)
    loss = ref(x, y)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in ref.named_parameters()}


def _errors(
    config: GPTConfig,
    reference: tuple[float, dict[str, torch.Tensor]],
    layout: Layout,
    coords: dict,
    module: torch.nn.Module,
    names: dict,
    losses: list,
) -> tuple[float, float | None]:
    """This rank's gradients (its shard of its layers) and loss against one process on the whole batch."""
    ref_loss, full = reference
    want = shard_state(full, config, coords["tp"], layout.tp) if layout.tp > 1 else full
    error = 0.0
    for p in module.parameters():  # a stage holds the GPT's own parameters: their names are the GPT's
        if p.grad is not None:
            error = max(error, (p.grad - want[names[id(p)]].to(p.grad.device)).abs().max().item())
    if not losses or layout.dp > 1:
        return error, None  # with dp > 1 a replica's loss is its rows' mean, not the global one
    mine = torch.stack([torch.as_tensor(v).float() for v in losses]).mean()
    return error, abs(mine.item() - ref_loss)


def summarize_layout(results: list[LayoutRankResult]) -> LayoutSummary:
    """One layout from every rank: the step is its slowest rank's; bytes summed over ranks."""
    steps = [max(r.step_ms[i] for r in results) for i in range(len(results[0].step_ms))]
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
    """This rank's speed on the model: its FLOP/s in forward + backward at `micro_batch`, and Adam's seconds per
    parameter, best of `repeats`. Timed on `labkit.runtime.clock` inside a launched rank (CPU time on the
    virtual clock, the synchronised wall clock on a GPU), else on this thread's CPU time."""
    inside = runtime.current_cluster() is not None or dist.is_initialized()  # launched, or a torchrun rank
    timer = runtime.clock if inside else time.thread_time
    dev = runtime.device() if inside else torch.device("cpu")
    model = seeded_model(config, seed, dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = synthetic_batch(config, micro_batch, seed=seed, device=dev)
    block_f, head_f = forward_flops_per_token(config)
    flops = 3 * micro_batch * config.seq_len * (config.n_layers * block_f + head_f)
    best_fb = best_opt = float("inf")
    for _ in range(repeats + 1):  # the first round warms up (allocator, kernels, Adam's states)
        t0 = timer()
        model(x, y).backward()
        t1 = timer()
        opt.step()
        t2 = timer()
        opt.zero_grad(set_to_none=False)
        best_fb, best_opt = min(best_fb, t1 - t0), min(best_opt, t2 - t1)
    n = config.num_params()
    where = "this GPU" if dev.type == "cuda" else "this CPU"
    return Rates(
        flops / best_fb,
        best_opt / n,
        f"measured on {where}: {flops / best_fb / 1e9:.1f} GFLOP/s in forward + backward at micro-batch "
        f"{micro_batch}, Adam {best_opt / n * 1e9:.2f} ns per parameter",
    )


def median_rates(per_rank: list[Rates]) -> Rates:
    """One `Rates` from every rank's `measure_rates` (run together, so they shared the cores as in a run)."""
    flops = statistics.median(r.flops_per_s for r in per_rank)
    opt = statistics.median(r.optimizer_s_per_param for r in per_rank)
    return Rates(
        flops,
        opt,
        f"measured on {len(per_rank)} ranks at once: {flops / 1e9:.1f} GFLOP/s per rank in "
        f"forward + backward, Adam {opt * 1e9:.2f} ns per parameter (medians)",
    )


# ----------------------------------------------------------------- as a script (labkit.experiments.script)

DEFAULTS: dict = {
    "world_size": 8,
    "nodes": 2,
    "memory_mib": 28,
    "n_layers": 8,
    "d_model": 128,
    "n_heads": 8,
    "vocab_size": 1024,
    "seq_len": 64,
    "global_batch": 32,
    "micro_batches": [4, 8],
    "steps": 2,
    "timeout_s": 120,
}


def headline(
    w: Where,
    nodes: int,
    memory_mib: float,
    n_layers: int,
    d_model: int,
    n_heads: int,
    vocab_size: int,
    seq_len: int,
    global_batch: int,
    micro_batches: list[int],
    steps: int,
    timeout_s: float,
) -> dict:
    """Lab 01's records: tensor parallelism over every rank (the mistake), the planner's pick, the best measured.

    The planner plans for these ranks with `memory_mib` per GPU (the emulated budget; on GPUs a planning limit,
    not enforced) and this machine's measured rates; every layout it accepts is measured, and the mistake.
    """
    if not w.torchrun:  # the emulated cluster of the notebook: `nodes` nodes sharing the ranks
        if w.world_size % nodes:
            raise ValueError(
                f"--world-size {w.world_size} does not divide over nodes={nodes}; e.g. --world-size "
                f"{nodes * max(1, w.world_size // nodes)}"
            )
        w = emulated_cluster(w, nodes=nodes, gpus_per_node=w.world_size // nodes)
    if n_heads % w.world_size or d_model % w.world_size:
        raise ValueError(
            f"the mistake, tensor parallelism over all {w.world_size} ranks, splits the heads and the "
            f"width: n_heads={n_heads} and d_model={d_model} must divide by {w.world_size}; e.g. --set "
            f"n_heads {w.world_size} --set d_model {max(d_model // w.world_size, 8) * w.world_size}"
        )
    config = GPTConfig(
        n_layers=n_layers, d_model=d_model, n_heads=n_heads, vocab_size=vocab_size, seq_len=seq_len
    )
    if isinstance(w.cluster, Cluster):
        described = replace(w.cluster, memory_gib=memory_mib / 1024)
    elif w.on_gpu:
        described = replace(
            Cluster.detect(), nodes=w.nodes, gpus_per_node=w.gpus_per_node, memory_gib=memory_mib / 1024
        )
    else:  # torchrun on CPUs: the links this CPU's emulated cluster would model, for the plan only
        described = Cluster.emulated(
            nodes=w.nodes, gpus_per_node=w.gpus_per_node, memory_gib=memory_mib / 1024
        )

    def run(layout: Layout, micro_batch: int) -> LayoutSummary:
        return summarize_layout(
            w.launch(
                layout_steps,
                config,
                layout,
                global_batch,
                micro_batch,
                steps=steps,
                warmup=1,
                timeout_s=timeout_s,
                deadline_s=timeout_s * 3,
            )
        )

    rates = median_rates(w.launch(measure_rates, config, micro_batches[0], timeout_s=timeout_s))
    the_plan = plan(
        config,
        described,
        global_batch,
        precision="fp32",
        rates=rates,
        micro_batch_sizes=micro_batches,
        zero_stages=(0,),
        checkpointing=(False,),
    )
    pick = the_plan.best
    tp_all = Layout(tp=w.world_size)
    measured = {str(tp_all): run(tp_all, micro_batches[-1])}
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
    return {
        "before": measured[str(tp_all)].step_ms,
        "after": measured[str(pick.layout)].step_ms,
        "limit": best["measured_ms"],
        "unit": "ms",
        "meaning": {
            "before": f"step time of tensor parallelism over all {w.world_size} ranks of {w.nodes} node(s)",
            "after": f"step time of the planner's pick, {pick.layout}",
            "limit": f"the fastest layout measured, {best['layout']}",
        },
        "metric": "step time of one model under data x tensor x pipeline layouts, predicted and measured",
        "pick": str(pick.layout),
        "rates": rates.source,
        "spearman": spearman([r["predicted_ms"] for r in ranked], [r["measured_ms"] for r in ranked])
        if len(ranked) > 1
        else None,
        "sweep": rows,
        "plan": [c.row() for c in the_plan.candidates],
    }


def main(argv: list[str] | None = None) -> int:
    return run_lab("01_parallelism_choice", headline, DEFAULTS, argv)


if __name__ == "__main__":
    from labkit.experiments import (
        parallelism_choice,
    )  # by its own name, so launch pickles its functions by reference

    raise SystemExit(parallelism_choice.main())
