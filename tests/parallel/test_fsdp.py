"""labkit.parallel.fsdp: FSDP2 (`fully_shard`) trains the lab GPT on the emulated cluster with one process's
gradients and after-step weights, and on a simulated DGX H100 runs a model that plain data parallelism cannot
hold, at the peak memory the planner predicts for it (`labkit.memory.estimate(zero_stage=3)`)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from labkit import Cluster, launch, memory, planner
from labkit.links import Link
from labkit.machine import device_memory
from labkit.models import GPTConfig, gpt_in, seeded_model, synthetic_batch
from labkit.parallel.fsdp import full_gradients, fully_sharded

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = GPTConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=64, seq_len=8)
BATCH = 2
# 5.5 billion parameters: 16 bytes each with mixed-precision Adam is 88 GB, more than an 80 GB H100 holds
LARGE = GPTConfig(n_layers=16, d_model=5120, n_heads=40, vocab_size=50304, seq_len=2048)


def _emulated(n: int) -> Cluster:
    link = Link(bandwidth_gb_s=1.0, latency_us=20)
    return Cluster.emulated(gpus_per_node=n, intra_node=link, inter_node=link)


def _fsdp_step(config: GPTConfig) -> dict:
    """On a rank: the seeded model sharded, one step on this rank's batch, the whole gradients and weights."""
    model = fully_sharded(seeded_model(config), None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = synthetic_batch(config, BATCH, seed=dist.get_rank())
    loss = model(x, y)
    loss.backward()
    grads = full_gradients(model)
    opt.step()
    weights = {n: p.full_tensor() for n, p in model.named_parameters()}
    sharded = {n: (p.to_local().numel(), p.numel()) for n, p in model.named_parameters()}
    return {"loss": loss.item(), "grads": grads, "weights": weights, "sharded": sharded}


def test_fully_sharded_gradients_equal_one_process_on_the_emulated_cluster() -> None:
    world = 2
    ranks = launch(_fsdp_step, SMALL, world_size=world, cluster=_emulated(world))
    # One process on the ranks' batches together: the mean loss, its gradients, one SGD step (not Adam: its
    # first step divides by |g| and turns rounding on near-zero gradients into whole steps).
    model = seeded_model(SMALL)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [synthetic_batch(SMALL, BATCH, seed=r) for r in range(world)]
    x, y = (torch.cat(parts) for parts in zip(*batches))
    model(x, y).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    for r in ranks:
        assert set(r["grads"]) == set(grads)
        for name, g in grads.items():
            torch.testing.assert_close(r["grads"][name], g, rtol=1e-5, atol=1e-6, msg=name)
        for name, p in model.named_parameters():
            torch.testing.assert_close(r["weights"][name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
    # Each rank holds half of every parameter with at least two rows (a shard of dim 0, padded when odd).
    shards = ranks[0]["sharded"]
    assert shards["blocks.0.mlp.fc.weight"] == (SMALL.ffn_dim * SMALL.d_model // world, SMALL.ffn_dim * 32)


def _second_step_peak(
    model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> dict:
    """Two training steps, the first making Adam's states: {"peak": the second's peak} or {"oom": ...}."""
    try:
        for _ in range(2):
            device_memory.reset_peak_memory_stats()
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
    except torch.OutOfMemoryError as e:
        return {"oom": str(e)}
    peak = device_memory.peak_bytes()
    return {"peak": peak[0] if peak else 0}


# 5.3 million parameters: 80 MiB of fp32 Adam states, more than the 64 MiB budget below holds whole
MID = GPTConfig(n_layers=4, d_model=256, n_heads=4, vocab_size=4096, seq_len=32)


def _budget_step(config: GPTConfig, plain: bool) -> dict:
    """On an emulated rank with a memory budget: fp32 Adam, FSDP2 or (`plain`) every rank holding the whole
    model; two steps; the second's peak, or the OOM."""
    model = seeded_model(config)
    if not plain:
        fully_sharded(model, None)
    x, y = synthetic_batch(config, BATCH, seed=dist.get_rank())
    return _second_step_peak(model, torch.optim.Adam(model.parameters()), x, y)


def test_on_the_emulated_cluster_fsdp_fits_a_budget_plain_data_parallelism_runs_out_of() -> None:
    """The emulated cluster's memory budget counts FSDP2's local shards (not a DTensor's global shape) and the
    gathered parameters it frees and refills in place (`UntypedStorage.resize_`), so the measured peak is the
    ZeRO-3 estimate's with its working set (two blocks and the root whole: 61.2 MiB measured, 61.3 estimated)
    and plain data parallelism's does not fit."""
    world, budget_gib = 2, 64 / 1024
    cluster = replace(_emulated(world), memory_gib=budget_gib)
    zero3 = memory.estimate(model=MID, dp=world, zero_stage=3, precision="fp32", micro_batch=BATCH)
    plain = memory.estimate(model=MID, dp=world, zero_stage=0, precision="fp32", micro_batch=BATCH)
    assert zero3.peak < budget_gib * 2**30 < plain.params + plain.grads + plain.optimizer
    for r in launch(_budget_step, MID, False, world_size=world, cluster=cluster):
        assert "oom" not in r, r
        assert abs(r["peak"] / zero3.peak - 1) < 0.03, (r["peak"] / 2**20, zero3.peak / 2**20)
    (oom, _) = launch(_budget_step, MID, True, world_size=world, cluster=cluster)
    assert "out of memory (emulated budget)" in oom["oom"]


def _large_step(config: GPTConfig, plain: bool) -> dict:
    """On a simulated H100: the model in fp32 (the master weights), FSDP2 with bf16 compute and fp32 reduction
    or (`plain`) every rank holding everything; two steps of Adam; the second step's peak."""
    model = gpt_in(config, torch.float32, checkpointing=True)
    if not plain:
        fully_sharded(model, None, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), foreach=True)  # what torch.optim picks for CUDA tensors
    x = torch.zeros(1, config.seq_len, dtype=torch.long)
    return _second_step_peak(model, opt, x, x)


def test_fsdp_runs_a_model_plain_data_parallelism_cannot_hold_on_a_simulated_h100() -> None:
    sim = Cluster.preset("dgx-h100").simulated()
    world = 2
    plain = memory.estimate(model=LARGE, dp=world, zero_stage=0, checkpointing=True, foreach=True)
    assert plain.params + plain.grads + plain.optimizer > 80 * 2**30  # states alone do not fit
    # the two ranks shard alike: one process stands for both (launch(alike=True): the same peaks and clocks)
    sharded = launch(_large_step, LARGE, False, world_size=world, cluster=sim, timeout_s=120, alike=True)
    # What the planner predicts for this layout on two such GPUs: ZeRO-3 (FSDP), checkpointing, micro-batch 1
    two_gpus = replace(Cluster.preset("dgx-h100"), gpus_per_node=world)
    plan = planner.plan(
        LARGE, two_gpus, global_batch=world, zero_stages=(3,), checkpointing=(True,), micro_batch_sizes=(1,)
    )
    (pick,) = [c for c in plan.candidates if c.layout.dp == world]
    assert pick.zero_stage == 3 and pick.ok
    for r in sharded:
        assert "oom" not in r, r
        # the peak is the optimizer step's (states, gradients, for-each temporaries: all sharded)
        assert abs(r["peak"] / pick.memory.peak - 1) < 0.10, (r["peak"] / 2**30, pick.memory.peak / 2**30)
    (oom, *_) = launch(_large_step, LARGE, True, world_size=1, cluster=sim, timeout_s=120)
    assert "out of memory" in oom["oom"]
