"""labkit.planner: its rejections with the values, its agreement with `labkit.memory.estimate`, the tensor-
parallel all-reduce time, and its choices on Megatron-LM's configurations. Layouts on paper:
tests/test_layout.py; every layout trained on the emulated cluster:
tests/course/experiments/test_parallelism_choice.py."""

from __future__ import annotations

import pytest

from labkit import Cluster
from labkit.links import Link, collective_time_s
from labkit.memory import estimate
from labkit.models import GPTConfig
from labkit.planner import (
    DISPATCH_S,
    KERNELS_PER_BLOCK,
    Rates,
    forward_flops_per_token,
    plan,
    spearman,
    stage_compute_s,
    tp_comm_s,
)

CONFIG = GPTConfig(n_layers=8, d_model=128, n_heads=8, vocab_size=1024, seq_len=64)
RATES = Rates(50e9, 5e-9, "fixed for the test")


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
    with pytest.raises(ValueError, match=r"headroom=1\.5"):
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


def test_a_launch_bound_layer_is_not_made_faster_by_tensor_parallelism():
    # On a GPU every operator costs at least its host dispatch (Rates.dispatch_s): at lab 01's sizes the
    # blocks are launch-bound, so tp=8's 1/8 of the FLOPs takes as long per micro-batch as all of them
    node = Cluster.preset("dgx-h100")
    args = dict(precision="fp32", micro_batch_sizes=(4,), zero_stages=(0,), checkpointing=(False,))
    no_floor = plan(CONFIG, node, 32, rates=Rates(47e12), **args)
    floor = plan(CONFIG, node, 32, rates=Rates(47e12, dispatch_s=DISPATCH_S), **args)

    def per_micro_batch(p, tp):
        c = p.candidate(8 // tp, tp, 1)
        return c.parts_ms["compute"] / c.micro_batches

    assert per_micro_batch(no_floor, 1) == pytest.approx(8 * per_micro_batch(no_floor, 8))
    assert per_micro_batch(floor, 8) == per_micro_batch(floor, 1)
    # the floor: 30 operators per block and a third of that for the head, 15 us each
    assert per_micro_batch(floor, 1) == pytest.approx((8 * KERNELS_PER_BLOCK + 10) * DISPATCH_S * 1e3)
    # and tp's 4 all-reduces per block each take at least a dispatch too
    assert floor.candidate(1, 8, 1).parts_ms["tp"] >= 8 * 4 * 4 * DISPATCH_S * 1e3 * 0.999
    # a described cluster's rates carry the floor; the emulated cluster's do not (its CPU time is the work)
    assert plan(CONFIG, node, 32, **args).rates.dispatch_s == DISPATCH_S


# Narayanan et al. 2021, Table 1 (heads, hidden, layers, tp, pp, GPUs, batch), vocabulary 51200, sequence 2048
TABLE_1 = {
    "1.7B": (24, 2304, 24, 1, 1, 32, 512),
    "3.6B": (32, 3072, 30, 2, 1, 64, 512),
    "7.5B": (32, 4096, 36, 4, 1, 128, 512),
    "18B": (48, 6144, 40, 8, 1, 256, 1024),
    "39B": (64, 8192, 48, 8, 2, 512, 1536),
}


def _table_1_plan(name: str, **kw):
    a, h, L, _, _, gpus, batch = TABLE_1[name]
    config = GPTConfig(n_layers=L, d_model=h, n_heads=a, vocab_size=51200, seq_len=2048)
    return plan(config, Cluster.preset("dgx-a100-80gb", nodes=gpus // 8), batch, **kw)


@pytest.mark.parametrize("name", list(TABLE_1))
def test_a_table_1_model_that_fits_without_model_parallelism_gets_none(name):
    # Takeaway #2 of Narayanan et al. 2021: model parallelism only as far as the model needs to fit, data
    # parallelism beyond. In the paper's setting (no ZeRO, recomputation on), a model whose plain
    # data-parallel layout fits is planned with none; one that does not keeps tp inside the 8-GPU node.
    p = _table_1_plan(name, zero_stages=(0,), checkpointing=(True,), micro_batch_sizes=(1, 2, 4, 8))
    gpus = TABLE_1[name][5]
    if p.candidate(gpus, 1, 1).ok:
        assert (p.best.tp, p.best.pp) == (1, 1), p.table()
    else:
        assert 2 <= p.best.tp * p.best.pp and p.best.tp <= 8
    assert name not in ("1.7B", "3.6B") or (p.best.tp, p.best.pp) == (1, 1)


def test_with_its_defaults_the_planner_gives_the_smallest_model_plain_data_parallelism():
    # it used to put tp=2 on the 1.7B model: every matmul at one efficiency, and the dp all-reduce exposed
    assert (_table_1_plan("1.7B").best.tp, _table_1_plan("1.7B").best.pp) == (1, 1)


def test_the_dp_all_reduce_hides_under_the_last_micro_batchs_backward():
    node = Cluster.preset("dgx-a100-80gb", nodes=4)
    args = dict(micro_batch_sizes=(8,), zero_stages=(0,), checkpointing=(False,))
    after = plan("gpt2-xl", node, 256, dp_overlap=False, **args).candidate(32, 1, 1)
    under = plan("gpt2-xl", node, 256, **args).candidate(32, 1, 1)
    grad_bytes = GPTConfig.preset("gpt2-xl").num_params() * 2
    rails = node.topology().rail_ring(list(range(32)))  # 4 nodes: rings over their 8 ports, 200 GB/s
    all_reduce = collective_time_s("all_reduce", grad_bytes, 32, rails)
    last_bucket = collective_time_s("all_reduce", 25 * 2**20, 32, rails)
    backward = under.parts_ms["compute"] / under.micro_batches * 2 / 3 / 1e3
    assert after.parts_ms["dp"] == pytest.approx(all_reduce * 1e3)
    assert under.parts_ms["dp"] == pytest.approx(max(all_reduce - backward, last_bucket) * 1e3)
    assert under.predicted_ms < after.predicted_ms


def test_without_a_curve_a_stage_costs_its_flops_at_the_rate():
    rates = Rates(1e12)
    block_f, head_f = forward_flops_per_token(CONFIG)
    tokens = 4 * CONFIG.seq_len
    for tp, ckpt in ((1, False), (4, True)):
        passes = 4 if ckpt else 3
        expected = tokens * passes * (2 * block_f + head_f) / tp / 1e12
        assert stage_compute_s(CONFIG, tokens, tp, 2, True, rates, ckpt) == pytest.approx(expected)
    # on a described GPU the small matmuls of a tp split cost more than their share of the FLOPs
    a100 = plan("gpt2", Cluster.preset("dgx-a100-80gb"), 8).rates
    one, eight = (stage_compute_s(GPTConfig.preset("gpt2"), 1024, tp, 12, True, a100) for tp in (1, 8))
    assert eight > one / 8 * 1.2
