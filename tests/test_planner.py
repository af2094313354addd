"""Lab 01's pieces without processes: layouts and their groups, model-parallel memory, described clusters, the
planner's rejections, its agreement with `labkit.memory.estimate`, and its choices on Megatron-LM's configurations;
then every layout trained on the emulated cluster against one process."""

from __future__ import annotations

import pytest
import torch

from labkit import Cluster, launch
from labkit.course.checks import check_layout_choice
from labkit.experiments.common import seeded_model
from labkit.experiments.parallelism_choice import layout_steps, reference_gradients, summarize_layout
from labkit.links import Link, collective_time_s
from labkit.memory import estimate, stage_params
from labkit.models import GPTConfig
from labkit.parallel.layout import Layout
from labkit.parallel.pipeline import GPTStage, even_split
from labkit.planner import Rates, plan, spearman, tp_comm_s

CONFIG = GPTConfig(n_layers=8, d_model=128, n_heads=8, vocab_size=1024, seq_len=64)
SMALL = GPTConfig(n_layers=4, d_model=32, n_heads=4, vocab_size=64, seq_len=8)
RATES = Rates(50e9, 5e-9, "fixed for the test")


def test_layout_numbers_tensor_parallel_first_and_finds_the_links():
    lay = Layout(dp=2, tp=2, pp=2)
    assert lay.groups_of("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.groups_of("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups_of("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.coords(6) == {"tp": 0, "dp": 1, "pp": 1} and lay.rank_of(0, 1, 1) == 6
    topo = Cluster.emulated(nodes=2, gpus_per_node=4).topology()
    assert lay.links_crossed(topo) == {"tp": "intra", "dp": "intra", "pp": "inter"}
    assert Layout(tp=8).links_crossed(topo) == {"tp": "inter"}
    with pytest.raises(ValueError, match="needs dp x tp x pp = 4 ranks, the world has 8"):
        Layout(dp=2, tp=2).check_world_size(8)


def test_model_parallel_memory_counts_what_each_rank_holds():
    model = seeded_model(SMALL)
    for pp in (1, 2, 4):
        sizes = even_split(SMALL, pp)
        starts = [sum(sizes[:k]) for k in range(pp + 1)]
        for s in range(pp):
            held = sum(p.numel() for p in GPTStage(model, starts[s], starts[s + 1]).parameters())
            assert stage_params(SMALL, 1, pp, s) == held
    # tp > 1: the estimate's count is what the tensor-parallel slicing rule keeps on a rank
    from labkit.parallel.tensor import shard_state

    for config in (
        SMALL,
        GPTConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, vocab_size=64, seq_len=8),
    ):
        full = dict(seeded_model(config).named_parameters())
        for tp in (2, 4) if config.kv_heads % 4 == 0 else (2,):
            kept = sum(t.numel() for t in shard_state(full, config, 0, tp).values())
            assert stage_params(config, tp) == kept, (config, tp)
    one = estimate(model=CONFIG, precision="fp32", micro_batch=4)
    assert estimate(model=CONFIG, precision="fp32", micro_batch=4, tp=1, pp=1) == one
    tp2 = estimate(model=CONFIG, precision="fp32", micro_batch=4, tp=2)
    assert tp2.params < one.params and tp2.activations < one.activations and "tp=2" in tp2.source
    # 1F1B: stage 0 holds p micro-batches of its L/p blocks, about one micro-batch of the whole model's blocks
    pp4 = estimate(model=CONFIG, precision="fp32", micro_batch=4, pp=4, micro_batches=8)
    assert "stage 0" in pp4.source and pp4.params < one.params
    with pytest.raises(ValueError, match="tensor parallel size 3 does not divide n_heads=8"):
        estimate(model=CONFIG, tp=3)
    with pytest.raises(ValueError, match="pp=9 pipeline stages for 8 blocks"):
        estimate(model=CONFIG, pp=9)


def test_a_described_cluster_is_planned_for_and_refused_by_launch():
    dgx = Cluster.preset("dgx-a100-80gb", nodes=192)
    assert dgx.world_size == 1536 and dgx.memory_gib == 80 and dgx.peak_tflops == 312
    assert dgx.intra_node.bandwidth_gb_s == 300 and dgx.inter_node.bandwidth_gb_s == 25
    assert Cluster.preset("dgx-h100").intra_node.bandwidth_gb_s == 450
    with pytest.raises(ValueError, match="only describes a machine.*labkit.planner.plan"):
        launch(print, world_size=8, cluster=dgx)
    with pytest.raises(ValueError, match="unknown cluster preset 'dgx-z'.*dgx-a100-80gb"):
        Cluster.preset("dgx-z")


def test_the_planner_rejects_with_the_values_and_matches_estimate():
    cluster = Cluster.emulated(nodes=2, gpus_per_node=4, memory_gib=28 / 1024)
    p = plan(
        CONFIG,
        cluster,
        32,
        precision="fp32",
        rates=RATES,
        micro_batch_sizes=(4, 8),
        zero_stages=(0,),
        checkpointing=(False,),
    )
    assert len(p.candidates) == 10 and p.best.ok
    dp8 = p.candidate(8, 1, 1)
    assert (
        dp8.reason.startswith("does not fit: 40.6 MiB > 25.2 MiB usable per GPU")
        and "shard the model" in dp8.reason
    )
    tp8 = p.candidate(1, 8, 1)
    assert tp8.reason.startswith("tp group crosses nodes") and tp8.predicted_ms > 10 * p.best.predicted_ms
    for c in p.candidates:  # the planner's memory is labkit.memory.estimate's
        assert c.memory == estimate(
            model=CONFIG,
            dp=c.dp,
            precision="fp32",
            micro_batch=c.micro_batch,
            tp=c.tp,
            pp=c.pp,
            micro_batches=c.micro_batches,
            keep_grads=c.micro_batches > 1,
        )
    odd = plan(
        GPTConfig(n_layers=2, d_model=24, n_heads=6, vocab_size=64, seq_len=8),
        Cluster.emulated(nodes=1, gpus_per_node=4, memory_gib=1.0),
        6,
        rates=RATES,
    )
    assert (
        "does not divide: tensor parallel size 4 does not divide n_heads=6" in odd.candidate(1, 4, 1).reason
    )
    assert "does not divide: global batch 6 over dp=4" in odd.candidate(4, 1, 1).reason
    assert "pp=4 pipeline stages for 2 blocks" in odd.candidate(1, 1, 4).reason
    assert "dp4" in plan(CONFIG, cluster, 32, precision="fp32", rates=RATES, memory_gib=1.0).table()
    with pytest.raises(ValueError, match="headroom=1.5"):
        plan(CONFIG, cluster, 32, rates=RATES, headroom=1.5)


def test_tp_comm_is_four_ring_all_reduces_per_block():
    link = Link(10.0, 5.0)
    nbytes = 4 * 64 * 128 * 4
    assert tp_comm_s(CONFIG, 4, 4, link) == 8 * 4 * collective_time_s("all_reduce", nbytes, 4, link)
    assert tp_comm_s(CONFIG, 4, 4, link, checkpointing=True) == 1.5 * tp_comm_s(CONFIG, 4, 4, link)
    assert spearman([1, 2, 3], [10, 20, 30]) == 1.0 and spearman([1, 2, 3], [3, 2, 1]) == -1.0


def test_megatron_configurations_keep_tensor_parallelism_inside_a_dgx_node():
    # Narayanan et al. 2021, Table 1: 18B on 256 GPUs (paper: tp 8), 76B on 1024 (tp 8, pp 4)
    for h, a, L, gpus, batch in ((6144, 48, 40, 256, 1024), (10240, 80, 60, 1024, 1792)):
        big = GPTConfig(n_layers=L, d_model=h, n_heads=a, vocab_size=51200, seq_len=2048)
        p = plan(
            big,
            Cluster.preset("dgx-a100-80gb", nodes=gpus // 8),
            batch,
            zero_stages=(0,),
            checkpointing=(True,),
            micro_batch_sizes=(1, 2, 4, 8),
        )
        assert 2 <= p.best.tp <= 8 and p.best.memory.peak <= 0.9 * 80 * 2**30
        assert p.candidate(gpus // 16, 16, 1).reason.startswith(("tp group crosses nodes", "does not"))


@pytest.mark.usefixtures("one_thread")
def test_every_layout_matches_one_process():
    cluster = Cluster.emulated(nodes=2, gpus_per_node=4, intra_node=Link(1.0, 20), inter_node=Link(0.1, 50))
    ref = reference_gradients(CONFIG, 16)
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


def test_the_layout_choice_check_names_each_mistake():
    # The two wrong answers the notebook's mutation tests do not run (they need no kernel): the same check.
    cluster = Cluster.emulated(nodes=2, gpus_per_node=4, memory_gib=28 / 1024)
    p = plan(
        CONFIG,
        cluster,
        32,
        precision="fp32",
        rates=RATES,
        micro_batch_sizes=(4, 8),
        zero_stages=(0,),
        checkpointing=(False,),
    )
    best = p.best
    reason = f"{best.layout}: {best.predicted_ms:.1f} ms, {best.memory.peak / 2**20:.1f} MiB per GPU"
    assert check_layout_choice((best.dp, best.tp, best.pp), reason, p) is best
    with pytest.raises(AssertionError, match="the product must be 8"):
        check_layout_choice((2, 2, 1), reason, p)
    with pytest.raises(AssertionError, match="quote the planner's predicted step"):
        check_layout_choice((best.dp, best.tp, best.pp), "pipelines across the nodes are best", p)
    with pytest.raises(AssertionError, match="quote the planner's memory per GPU"):
        check_layout_choice((best.dp, best.tp, best.pp), f"{best.predicted_ms:.1f} ms", p)
    with pytest.raises(AssertionError, match="a tuple of three whole numbers"):
        check_layout_choice([2, 1, 4], reason, p)
