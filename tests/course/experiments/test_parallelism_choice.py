"""labkit.course.experiments.parallelism_choice (lab 01's driver): every layout, trained on 8 emulated ranks
over two nodes, gives one process's gradients (and loss, where one rank computes it), sends bytes over the
links its groups cross; the step's speed is measured on the rank's timer (`measure_rates`)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from labkit import Cluster, launch
from labkit.cluster import GPU
from labkit.course.experiments import parallelism_choice
from labkit.course.experiments.parallelism_choice import layout_steps, measure_rates, summarize_layout
from labkit.course.training.reference import reference_gradients
from labkit.layout import Layout
from labkit.links import Link
from labkit.models import GPTConfig
from labkit.planner import Rates, forward_flops_per_token, plan

CONFIG = GPTConfig(n_layers=8, d_model=128, n_heads=8, vocab_size=1024, seq_len=64)


@pytest.mark.usefixtures("one_thread")
def test_every_layout_matches_one_process():
    cluster = Cluster.emulated(nodes=2, gpus_per_node=4, intra_node=Link(1.0, 20), inter_node=Link(0.1, 50))
    ref = reference_gradients(CONFIG, 16)  # one process, the whole batch
    for lay in (Layout(8, 1, 1), Layout(1, 8, 1), Layout(1, 1, 8), Layout(2, 2, 2), Layout(1, 4, 2)):
        s = summarize_layout(
            launch(
                layout_steps,
                CONFIG,
                lay,
                16,
                2,
                steps=1,
                warmup=0,
                reference=ref,
                world_size=8,
                cluster=cluster,
                timeout_s=60,
            )
        )
        assert s.grad_error < 1e-5, f"{lay}: gradients differ by {s.grad_error}"
        assert (s.loss_error is not None and s.loss_error < 1e-5) == (lay.dp == 1), (
            f"{lay}: loss {s.loss_error}"
        )
        assert s.step_ms > 0 and (s.link_bytes["inter"] > 0) == (lay.pp > 1 or lay.tp == 8 or lay.dp == 8)
    assert torch.get_num_threads() == 1


def test_zero3_is_a_layout_of_data_parallelism_alone():
    """FSDP (`layout_steps(..., zero3=True)`) shards over the data-parallel group: with tp or pp there is no
    such group of every rank, and it is refused before any rank starts. (Its gradients against one process
    and its memory are lab 01's notebook's, tests/labs/test_01_parallelism_choice.py.)"""
    for lay in (Layout(1, 2, 1), Layout(1, 1, 2), Layout(1, 1, 1)):
        with pytest.raises(ValueError, match="zero3=True shards the model over data parallelism alone"):
            parallelism_choice._LayoutRun(CONFIG, lay, 16, 2, 0, 1e-3, zero3=True)


def test_measure_rates_times_the_step_on_the_ranks_timer(monkeypatch):
    # labkit.machine.timer.clock, here a fake counter 10 ms per reading: forward + backward and Adam take
    # a tick each
    ticks = iter(range(10**6))
    monkeypatch.setattr(parallelism_choice.timer, "clock", lambda: next(ticks) * 0.010)
    config = GPTConfig(n_layers=1, d_model=16, n_heads=2, vocab_size=32, seq_len=8)
    rates = measure_rates(config, 2, repeats=1)
    block_f, head_f = forward_flops_per_token(config)
    flops = 3 * 2 * config.seq_len * (config.n_layers * block_f + head_f)
    assert rates.flops_per_s == pytest.approx(flops / 0.010)
    assert rates.optimizer_s_per_param == pytest.approx(0.010 / config.num_params())
    assert "measured on this CPU" in rates.source


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_the_default_memory_leaves_plain_data_parallelism_out_and_a_sharded_layout_in(ranks):
    # The lesson on paper, on the ranks at hand: planned as the lab plans (fp32, its micro-batches, ZeRO-0, no
    # checkpointing) in the default memory, plain data parallelism does not fit and some sharded layout does
    # (2 ranks: 70 % of plain data parallelism left none, and the script exited with "no layout fits").
    p = parallelism_choice.Params(world_size=ranks, nodes=1).resolve()
    link = Link(1.0, 0.0)
    cluster = Cluster.emulated(
        nodes=1, gpus_per_node=ranks, memory_gib=p.memory_mib / 1024, intra_node=link, inter_node=link
    )
    the_plan = plan(
        p.config(),
        cluster,
        p.global_batch,
        precision="fp32",
        rates=Rates(flops_per_s=1.0),
        micro_batch_sizes=tuple(p.micro_batches),
        zero_stages=(0,),
        checkpointing=(False,),
    )
    assert not the_plan.candidate(ranks, 1, 1).ok, the_plan.table()
    assert any(c.ok for c in the_plan.candidates if c.layout.dp < ranks), the_plan.table()


def _node_of(gpus: int) -> Cluster:
    """What Cluster.detect gives on a node of `gpus` H100s."""
    cards = tuple(GPU(i, "NVIDIA H100 80GB HBM3", 80.0) for i in range(gpus))
    return replace(Cluster.preset("dgx-h100"), kind="gpu", gpus_per_node=gpus, gpus=cards)


@pytest.mark.parametrize("gpus", [0, 4, 8])
def test_the_notebook_runs_on_a_node_with_a_gpu_per_rank_else_on_two_emulated_nodes(monkeypatch, gpus):
    """Lab 01's machine: cluster="auto" takes this node's GPUs when it has world_size of them (every rank on
    one node), else `nodes` emulated nodes; "cpu" always the emulated ones; each says why."""
    monkeypatch.setattr(Cluster, "detect", classmethod(lambda cls: _node_of(gpus)))
    m = parallelism_choice.Params(cluster="auto").machine()
    if gpus == 8:
        assert (m.kind, m.nodes, m.ranks) == ("gpu", 1, 8)
        assert m.cluster.reason.startswith("8 GPU(s) on this node, 8 asked: every rank on this one node")
        # fewer ranks than GPUs: the planner plans for the ranks' GPUs, not the node's
        fewer = parallelism_choice.Params(cluster="auto", world_size=4).machine()
        assert (fewer.kind, fewer.cluster.world_size, fewer.cluster.gpu_count) == ("gpu", 4, 8)
    else:
        assert (m.kind, m.nodes, m.cluster.gpus_per_node, m.ranks) == ("emulated", 2, 4, 8)
        why = "no GPU found" if gpus == 0 else "4 GPU(s) found, 8 ranks asked"
        assert m.cluster.reason == (
            f"{why}: 2 emulated node(s) x 4 GPUs, the link between nodes 10x slower than inside one "
            "(the lesson's)"
        )
    cpu = parallelism_choice.Params(cluster="cpu").machine()
    assert (cpu.kind, cpu.nodes) == ("emulated", 2) and cpu.cluster.reason.startswith("cluster='cpu': 2 emul")
    assert parallelism_choice.Params(cluster="cpu").inside_one_node() is None


def test_on_simulated_nodes_the_ranks_are_shared_as_emulated_and_one_node_holds_them_too():
    p = parallelism_choice.Params(cluster="sim:dgx-h100").resolve(on_gpu=True)
    m = p.machine()
    assert (m.kind, m.nodes, m.cluster.gpus_per_node, m.cluster.memory_gib) == ("simulated", 2, 4, 80)
    assert m.cluster.reason.startswith("sim:dgx-h100: 2 simulated node(s) x 4 GPUs sharing the 8 ranks")
    inside = p.inside_one_node()
    assert inside is not None and (inside.nodes, inside.gpus_per_node) == (1, 8)
    assert replace(p, world_size=16).inside_one_node() is None  # two full nodes: no one node holds them
