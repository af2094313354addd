"""labkit.course.forecast: each lab's lesson on paper, on a described GPU node, at its GPU defaults (labs 00,
01, 03, 04, 05 and the capstone's timing; lab 02's memory on a card, and the capstone's, are replayed through
the caching-allocator model in tests/course/experiments/test_oom_batch_gpu.py and test_capstone_gpu.py).

The course's targets (after/before <= 0.8, after/limit <= 1.25; a bandwidth's inverted; a planted mistake's
share) are asserted on the forecast of each lab's GPU defaults on a DGX H100 (one node: two ranks and all
eight; lab 01 on one node and on two), and the review's findings are pinned: at the sizes the notebook used
to suggest for GPUs, fp32 compute (~80 ms) dwarfs NVLink's all-reduce (~2-3 ms), and nothing shows. Lab 01
keeps its emulated sizes on GPUs: with every operator at least its host dispatch (`Rates.dispatch_s`), tensor
parallelism over all the GPUs is 3x (one node) to 8x (two) the planner's pick. No GPU is needed: the numbers
come from the FLOP count, the datasheet rates, the host's dispatch floor and the link model."""

from __future__ import annotations

import dataclasses
import random

import pytest

from labkit import Cluster
from labkit.course.experiments.capstone import GPU_MODEL as CAPSTONE_GPU_MODEL
from labkit.course.experiments.capstone import Capstone
from labkit.course.experiments.capstone import Params as CapstoneParams
from labkit.course.experiments.capstone import clean_job as capstone_clean_job
from labkit.course.experiments.capstone import dealt as capstone_dealt
from labkit.course.experiments.capstone import draw as capstone_draw
from labkit.course.experiments.cluster_tour import Params as Lab00
from labkit.course.experiments.imbalanced_pipeline import Params as Lab04
from labkit.course.experiments.parallelism_choice import Params as Lab01
from labkit.course.experiments.unoverlapped_comms import Params as Lab03
from labkit.course.experiments.unprofiled_run import MYSTERY_KINDS, fixed_job, kinds_that_show, mystery_job
from labkit.course.experiments.unprofiled_run import Params as Lab05
from labkit.course.experiments.unprofiled_run import clean_job as lab05_clean_job
from labkit.course.forecast import (
    HBM_BYTES_PER_S,
    Forecast,
    bandwidth_forecast,
    bucket_sizes,
    fp32_flops_per_s,
    job_forecast,
    job_step_s,
    layout_forecast,
    lesson_shows,
    overlap_forecast,
    pipeline_forecast,
    verdict,
)
from labkit.course.training.mistakes import MISTAKES
from labkit.links import collective_time_s
from labkit.models import GPTConfig
from labkit.planner import DISPATCH_S, Rates

DGX = Cluster.preset("dgx-h100")


def _lab03(p: Lab03, ranks: int) -> Forecast:
    rate = fp32_flops_per_s(DGX.gpu_name)
    return overlap_forecast(
        p.config(),
        p.micro_batch,
        ranks,
        DGX.intra_node,
        rate,
        bucket_cap_mb=p.bucket_cap_mb,
        where="DGX H100",
    )


@pytest.mark.parametrize("ranks", [4, 8])
def test_lab_03s_gpu_defaults_show_the_lesson_on_one_dgx_h100_node(ranks):
    p = Lab03(world_size=ranks).resolve(on_gpu=True)
    assert (p.d_model, p.n_layers, p.micro_batch) == (2048, 8, 2)
    assert p.sweep_caps_mb == [1e-6, 25.0, 100.0, 400.0]  # a list field (a default factory) is sized too
    f = _lab03(p, ranks)
    assert f.shows(), str(f)
    assert f.after / f.before <= 0.8 and f.after / f.limit <= 1.25
    # communication is a real share of the step, not a rounding error
    assert f.terms["per-tensor all-reduces"] >= 0.3 * f.terms["compute"], str(f)


def test_lab_03_on_two_nvlink_ranks_does_not_show_the_lesson_as_the_simulated_node_measured():
    """Issue 44: on 2 simulated H100s the notebook measured after/before 0.96 where the forecast said 0.74.
    The forecast left out the passes over the gradients on the compute stream (the buckets copy them in,
    average and copy back: three passes to the naive loop's one); on 2 NVLink ranks the two extra passes
    cost about what the all-reduce they hide does, so forecast and measurement now agree: it does not show."""
    p = Lab03(world_size=2).resolve(on_gpu=True)
    f = _lab03(p, 2)
    assert not f.shows() and 0.8 < f.after / f.before < 0.95, str(f)
    grads = 4 * p.config().num_params()  # fp32 gradients
    one_pass_ms = 2 * grads / HBM_BYTES_PER_S * 1e3  # read and write
    assert f.terms["a pass over the gradients"] == pytest.approx(one_pass_ms)
    # the naive step pays one pass, the bucketed one three
    assert f.before == pytest.approx(f.terms["compute"] + f.terms["per-tensor all-reduces"] + one_pass_ms)
    assert f.limit == pytest.approx(f.terms["compute"] + 3 * one_pass_ms)


def test_the_old_gpu_suggestion_and_the_emulated_sizes_are_what_the_review_found():
    old = GPTConfig(n_layers=12, d_model=1024, n_heads=4, vocab_size=256, seq_len=512)
    f = overlap_forecast(old, 8, 8, DGX.intra_node, fp32_flops_per_s(DGX.gpu_name), bucket_cap_mb=25)
    assert not f.shows() and f.terms["compute"] > 60, str(f)  # ~86 ms of fp32 compute
    (buckets,) = [k for k in f.terms if k.endswith("buckets")]
    assert f.terms[buckets] < 0.1 * f.terms["compute"], str(f)  # against ~5 ms of bucketed all-reduce
    # off GPUs the emulated defaults stay: GPU sizes only where the ranks are GPUs
    assert Lab03().resolve(on_gpu=False).d_model == 128
    # a value the user set is kept on GPUs
    assert Lab03(d_model=512).resolve(on_gpu=True).d_model == 512


def test_the_pieces_of_the_forecast():
    # DDP's buckets: reverse order, filled to the cap, one oversized gradient alone
    assert bucket_sizes([1, 2, 3, 10], cap_bytes=20, bytes_per_grad=4) == [40, 20, 4]
    assert fp32_flops_per_s("NVIDIA H100 80GB HBM3") == pytest.approx(67e12 * 0.7)
    assert fp32_flops_per_s("Tesla T4") is None
    # a bucket cap below every gradient: one bucket per tensor, the same all-reduces as the per-tensor loop
    cfg = GPTConfig(n_layers=1, d_model=64, n_heads=4, vocab_size=64, seq_len=16)
    f = overlap_forecast(cfg, 1, 2, DGX.intra_node, 1e12, bucket_cap_mb=1e-6)
    (buckets,) = [k for k in f.terms if k.endswith("buckets")]
    assert f.terms[buckets] == pytest.approx(f.terms["per-tensor all-reduces"])
    assert collective_time_s("all_reduce", 4, 2, DGX.intra_node) > 0
    assert lesson_shows(100, 60, 55) and not lesson_shows(100, 90, 85) and not lesson_shows(100, 60, 40)
    assert verdict(100, 60, 55, "GPU").startswith("check passed: after/before = 0.60")
    assert "the lesson does not show on this machine" in verdict(100, 95, 90, "GPU")


def _lab04(p: Lab04) -> Forecast:
    return pipeline_forecast(
        p.config(),
        p.stages,
        p.global_batch,
        p.few_micro_batches,
        DGX.intra_node,
        fp32_flops_per_s(DGX.gpu_name),
    )


@pytest.mark.parametrize("stages", [4, 8])
def test_lab_04s_gpu_defaults_show_the_imbalance_and_its_fix_on_one_dgx_h100_node(stages):
    p = Lab04(stages=stages).resolve(on_gpu=True)
    assert (p.d_model, p.vocab_size, p.few_micro_batches) == (1024, 32768, stages)
    f = _lab04(p)
    assert f.shows(), str(f)
    # the imbalance is there to fix: the naive split's slowest stage well above the mean
    assert f.terms["naive slowest stage"] >= 1.3 * f.terms["naive mean stage"], str(f)


def test_lab_04_at_its_emulated_sizes_inverts_on_a_gpu_and_two_stages_are_too_few():
    # The review's finding: at d_model 64 every layer is launch-bound on a GPU, so the fix's extra
    # micro-batches only cost more (after > before); and at the GPU sizes 2 stages show too little
    f = _lab04(Lab04(stages=4).resolve(on_gpu=False))
    assert f.after > f.before and not f.shows(), str(f)
    assert not _lab04(Lab04(stages=2).resolve(on_gpu=True)).shows()


@pytest.mark.parametrize("ranks", [2, 8])
def test_lab_00s_gpu_sweep_reaches_the_link_on_one_dgx_h100_node_and_the_emulated_sweep_would_not(ranks):
    sizes = [int(k * 1024) for k in Lab00(world_size=ranks).resolve(on_gpu=True).sizes_kib]
    assert max(sizes) == 2**30  # to 1 GiB, as nccl-tests sweeps
    f = bandwidth_forecast(sizes, ranks, DGX.intra_node, where="DGX H100")
    assert f.shows() and f.targets == "bandwidth", str(f)
    assert f.before < 0.01 * f.after  # a 4 KiB all-reduce is latency-bound
    assert f.after <= f.limit  # the model never beats the link
    # the emulated sweep stops at 4 MiB, where NVLink's all-reduce is still half latency
    emulated = [int(k * 1024) for k in Lab00().resolve(on_gpu=False).sizes_kib]
    g = bandwidth_forecast(emulated, ranks, DGX.intra_node)
    assert not g.shows() and g.after < 0.6 * g.limit, str(g)


def test_a_bandwidth_is_higher_is_better():
    assert lesson_shows(10, 90, 100, targets="bandwidth")
    assert not lesson_shows(10, 70, 100, targets="bandwidth")  # far from the link
    assert not lesson_shows(85, 100, 100, targets="bandwidth")  # small messages as good as large
    assert verdict(10, 90, 100, "GPU", targets="bandwidth").startswith("check passed: before/after = 0.11")
    assert "limit/after <= 1.25" in verdict(10, 70, 100, "GPU", targets="bandwidth")


def _lab05(kind: str, ranks: int) -> Forecast:
    p = Lab05(world_size=ranks).resolve(on_gpu=True)
    clean = lab05_clean_job(p.micro_batch, ranks)
    planted = mystery_job(clean, kind, ranks)
    fixed = fixed_job(planted, MISTAKES[kind].diagnosed_as)
    rate = fp32_flops_per_s(DGX.gpu_name)
    return job_forecast(p.config(), planted, fixed, clean, ranks, DGX.intra_node, rate, where="DGX H100")


def test_lab_05_on_a_dgx_h100_node_draws_exactly_the_mistakes_whose_share_shows():
    timed = [k for k in MYSTERY_KINDS if k != "host_sync"]  # the host sync: kinds_that_show says why
    shows = {k: [_lab05(k, n).shows() for n in (2, 8)] for k in timed}
    assert kinds_that_show(on_gpu=True) == [k for k in timed if all(shows[k])], shows
    # the one left out, and why: the launch-bound step hides the all-gather of 4 MiB of logits
    f = _lab05("sync_logging", 2)
    assert f.after / f.before > 0.95 and f.terms["logged accuracy"] < 0.1, str(f)
    # the in-loop tokenizer costs its share of the step's compute on any machine
    assert _lab05("data_loading", 2).after / _lab05("data_loading", 2).before == pytest.approx(0.53, abs=0.02)


def test_a_jobs_step_on_paper_has_a_part_for_each_knob_that_costs_time():
    cfg = Lab05().resolve(on_gpu=True).config()
    clean = lab05_clean_job(8, 2)
    rate = fp32_flops_per_s(DGX.gpu_name)
    parts = job_step_s(cfg, clean, 2, DGX.intra_node, rate)
    assert list(parts) == ["forward and backward", "gradient all-reduce after backward", "optimizer"]
    straggler = job_step_s(cfg, mystery_job(clean, "straggler", 2), 2, DGX.intra_node, rate)
    fixed = fixed_job(mystery_job(clean, "straggler", 2), "straggler")
    shared = job_step_s(cfg, fixed, 2, DGX.intra_node, rate)
    assert straggler["evaluation"] == pytest.approx(2 * shared["evaluation"])  # all rows vs half of them
    # Adam reads and writes more than SGD; accumulation multiplies the compute, not the all-reduce
    adam = job_step_s(cfg, dataclasses.replace(clean, optimizer="adamw"), 2, DGX.intra_node, rate)
    assert adam["optimizer"] > parts["optimizer"]
    two = job_step_s(cfg, dataclasses.replace(clean, micro_batch=4), 2, DGX.intra_node, rate)
    assert two["gradient all-reduce after backward"] == parts["gradient all-reduce after backward"]
    assert two["forward and backward"] > 1.9 * parts["forward and backward"]  # launch-bound: twice the calls


def _capstone(cap: Capstone, ranks: int) -> Forecast:
    """The capstone on paper: the job as handed, its micro-batch set back to the clean job's (the memory fix),
    against every mistake fixed, which is the clean job."""
    as_run = dataclasses.replace(cap.job, micro_batch=cap.clean.micro_batch)
    rate = fp32_flops_per_s(DGX.gpu_name)
    return job_forecast(
        cap.model, as_run, cap.clean, cap.clean, ranks, DGX.intra_node, rate, lab="06_capstone",
        where="DGX H100", note=f"planted {', '.join(cap.planted)}",
    )


def _capstone_with(kind: str, ranks: int) -> Forecast:
    clean = capstone_clean_job(ranks)
    planted = MISTAKES[kind].plant(clean, ranks, random.Random(0))
    return _capstone(Capstone(0, ranks, CAPSTONE_GPU_MODEL, planted, 64.0, (kind,), clean), ranks)


@pytest.mark.parametrize("ranks", [2, 8])
def test_every_capstone_dealt_on_gpus_shows_its_mistakes_on_a_dgx_h100_node(ranks):
    # each timed mistake the capstone deals on GPUs costs a fifth of the clean job's step on its own ...
    timed = [k for k in capstone_dealt(on_gpu=True) if k != "oom_batch"]  # the OOM: test_capstone_gpu.py
    assert timed == ["straggler", "data_loading"]
    for kind in timed:
        f = _capstone_with(kind, ranks)
        assert f.shows(), str(f)
    # ... so every deal shows, whichever two or three it plants
    for seed in range(32):
        f = _capstone(capstone_draw(seed, world_size=ranks, on_gpu=True), ranks)
        assert f.shows(), str(f)


def test_the_capstone_on_gpus_leaves_out_the_per_tensor_all_reduce_because_on_two_ranks_it_costs_a_tenth():
    f = _capstone_with("per_tensor_allreduce", 2)
    assert 0.85 < f.after / f.before < 0.95, str(f)  # 29 dispatches against a launch-bound 3.8 ms step
    assert CapstoneParams().world_size == 2
    assert "per_tensor_allreduce" in capstone_dealt(on_gpu=False)
    assert "per_tensor_allreduce" in kinds_that_show(on_gpu=True)  # lab 05's shorter step still shows it


def test_the_share_targets():
    assert lesson_shows(100, 60, 60, targets="share") and not lesson_shows(100, 90, 60, targets="share")
    assert not lesson_shows(100, 70, 90, targets="share")  # the mistake was a tenth of the step
    with pytest.raises(ValueError, match="targets='speed' must be one of time, bandwidth, share"):
        lesson_shows(1, 1, 1, targets="speed")


def _lab01(nodes: int) -> Forecast:
    # the notebook's first run, plain data parallelism, gives every replica micro-batches of 4: 32 sequences
    # on each node's 8 GPUs (Params.resolve refuses fewer)
    p = Lab01(world_size=8 * nodes, nodes=nodes, global_batch=32 * nodes).resolve(on_gpu=True)
    dgx = dataclasses.replace(Cluster.preset("dgx-h100", nodes=nodes), memory_gib=p.memory_mib / 1024)
    rates = Rates(fp32_flops_per_s(DGX.gpu_name), 0.0, "fp32 on paper", DISPATCH_S)
    return layout_forecast(p.config(), dgx, p.global_batch, tuple(p.micro_batches), rates, where="DGX H100")


@pytest.mark.parametrize("nodes", [1, 2])
def test_lab_01s_defaults_show_on_dgx_h100_nodes_with_the_launch_floor(nodes):
    f = _lab01(nodes)
    assert f.shows(), str(f)
    assert f.after == f.limit  # on paper the pick is the fastest layout the planner accepts
    # tensor parallelism over both nodes pays most of its step in all-reduces over InfiniBand
    if nodes == 2:
        (tp,) = [v for k, v in f.terms.items() if k.startswith("dp1 x tp16 x pp1 tp")]
        assert tp > 0.5 * f.before, str(f)
