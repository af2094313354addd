"""labkit.course.experiments.imbalanced_pipeline (lab 04's driver): torch.distributed.pipelining over the
emulated cluster gives the model's gradients and loss under every schedule, with one forward and one backward
per micro-batch and a send at every boundary; the plans are checked; the summary's arithmetic (bubble,
imbalance, limit) is exact."""

from __future__ import annotations

import pytest

from labkit import Cluster, launch
from labkit.course.experiments.imbalanced_pipeline import (
    PipelinePlan,
    PipelineRankResult,
    layer_costs,
    pipeline_steps,
    summarize_pipeline,
)
from labkit.links import Link
from labkit.models import GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = GPTConfig(n_layers=4, d_model=16, n_heads=2, vocab_size=64, seq_len=8)


def _cluster(n: int) -> Cluster:
    link = Link(bandwidth_gb_s=1.0, latency_us=20)
    return Cluster.emulated(gpus_per_node=n, intra_node=link, inter_node=link)


def _plans() -> list[PipelinePlan]:
    return [
        PipelinePlan([3, 3], 2, "gpipe"),
        PipelinePlan([2, 4], 4, "1f1b"),
        PipelinePlan([2, 1, 1, 2], 2, "interleaved_1f1b"),
    ]


def test_pipelining_gives_the_models_gradients_under_every_schedule():
    per_rank = launch(
        pipeline_steps,
        CONFIG,
        _plans(),
        global_batch=4,
        steps=2,
        check=True,
        measure_memory=True,
        world_size=2,
        cluster=_cluster(2),
        timeout_s=60,
        deadline_s=120,
    )
    for i, (sizes, m, schedule) in enumerate((p.sizes, p.micro_batches, p.schedule) for p in _plans()):
        s = summarize_pipeline([rank[i] for rank in per_rank])
        assert s.grad_error < 1e-5 and s.loss_error < 1e-5, schedule
        assert (
            s.sizes == sizes
            and s.micro_batches == m
            and s.chunks == (2 if schedule.startswith("inter") else 1)
        )
        assert all(0 < b <= s.step_ms for b in s.busy_ms) and 0 < s.bubble < 1
        assert s.label == "emulated" and all(p is not None and p > 0 for p in s.peak_bytes)
        for spans in s.spans:  # one forward and one backward per micro-batch and chunk
            for kind in "FB":
                assert sorted(mb for k, _, mb, _, _ in spans if k == kind) == sorted(
                    list(range(m)) * s.chunks
                )
        assert sum(s.sends) == 2 * m * (len(sizes) - 1)  # every boundary, forward and backward


def _rank(busy: list[float], step: list[float], m: int = 4) -> PipelineRankResult:
    return PipelineRankResult(
        0, [0], [["block 0"]], "1f1b", m, step, [s - b for s, b in zip(step, busy)], [], 0, 0
    )


def test_summary_arithmetic_is_exact():
    # two ranks, two steps; busy = step - waited on the virtual clock
    results = [_rank([40.0, 44.0], [70.0, 80.0]), _rank([60.0, 60.0], [68.0, 76.0])]
    s = summarize_pipeline(results)
    assert s.steps_ms == [70.0, 80.0] and s.step_ms == 75.0
    # bubble per step: (70-40 + 70-60) / 140 = 2/7 and (80-44 + 80-60) / 160 = 0.35; median = mean of two
    assert s.bubble == pytest.approx((2 / 7 + 0.35) / 2)
    assert s.imbalance == pytest.approx((60 / 50 + 60 / 52) / 2)
    # limit per step: mean per-micro-batch cost x (m + p - 1) = (100/2/4) x 5 and (104/2/4) x 5
    assert s.limit_ms == pytest.approx((62.5 + 65.0) / 2)
    assert s.bubble_formula == pytest.approx(1 / 5)


def test_a_plan_is_checked_when_it_is_made():
    with pytest.raises(ValueError, match="micro_batches=0"):
        PipelinePlan([3, 3], 0)
    with pytest.raises(ValueError, match="schedule='zigzag'"):
        PipelinePlan([3, 3], 4, "zigzag")
    with pytest.raises(ValueError, match="needs at least one plan"):
        pipeline_steps(CONFIG, [])
    with pytest.raises(ValueError, match="needs the ranks' results"):
        summarize_pipeline([])


def _warmed_and_unwarmed(config: GPTConfig) -> tuple[list[float], list[float]]:
    from labkit.layer_profile import profile_layers
    from labkit.machine import runtime
    from labkit.models import seeded_model, synthetic_batch

    model = seeded_model(config, 0, runtime.device())
    x, y = synthetic_batch(config, 4, seed=0, device=runtime.device())
    warmed = profile_layers(model, x, y, repeats=3, warmup=1)
    return [p.ms for p in warmed], [p.ms for p in layer_costs(config, 4)]


def test_on_a_simulated_gpu_one_unwarmed_pass_gives_every_layers_cost():
    """layer_costs times one pass there, unwarmed: a simulated step repeats exactly (each operator's modelled
    time), so it is the median of warmed-up passes to the nanosecond, at a seventh of the work."""
    config = GPTConfig(n_layers=2, d_model=256, n_heads=4, vocab_size=4096, seq_len=32)
    node = Cluster.preset("dgx-h100").simulated()
    warmed, one = launch(_warmed_and_unwarmed, config, world_size=1, cluster=node)[0]
    assert one == pytest.approx(warmed, rel=1e-9) and all(ms > 0 for ms in one)
