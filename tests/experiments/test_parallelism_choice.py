"""labkit.experiments.parallelism_choice (lab 01's driver): every layout, trained on 8 emulated ranks over
two nodes, gives one process's gradients (and loss, where one rank computes it), sends bytes over the
links its groups cross; the step's speed is measured on the rank's timer (`measure_rates`)."""

from __future__ import annotations

import pytest
import torch

from labkit import Cluster, launch
from labkit.experiments import parallelism_choice
from labkit.experiments.parallelism_choice import layout_steps, measure_rates, summarize_layout
from labkit.layout import Layout
from labkit.links import Link
from labkit.models import GPTConfig
from labkit.planner import Rates, forward_flops_per_token, plan
from labkit.training.reference import reference_gradients

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


def test_measure_rates_times_the_step_on_the_ranks_timer(monkeypatch):
    # labkit.timer.clock, here a fake counter 10 ms per reading: forward + backward and Adam take a tick each
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
