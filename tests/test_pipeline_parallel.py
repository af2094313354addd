"""Pipeline parallelism: GPT stages equal the whole model, torch.distributed.pipelining runs over the emulated
cluster with the model's gradients, and lab 04's summary arithmetic (bubble, imbalance, limit) is exact."""

from __future__ import annotations

import matplotlib
import pytest
import torch

from labkit import Cluster, launch
from labkit.experiments.common import seeded_model
from labkit.experiments.imbalanced_pipeline import PipelineRankResult, pipeline_steps, summarize_pipeline
from labkit.links import Link
from labkit.models import GPTConfig, synthetic_batch
from labkit.parallel.pipeline import GPTStage, even_split, layer_names, stage_of_rank
from labkit.pipeline import choose_micro_batches, profile_layers

matplotlib.use("Agg")
pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = GPTConfig(n_layers=4, d_model=16, n_heads=2, vocab_size=64, seq_len=8)


def _cluster(n: int) -> Cluster:
    link = Link(bandwidth_gb_s=1.0, latency_us=20)
    return Cluster.emulated(gpus_per_node=n, intra_node=link, inter_node=link)


@pytest.mark.parametrize("sizes", [[6], [1, 4, 1], [2, 2, 2], [3, 3], [1, 1, 1, 1, 1, 1]])
def test_stages_chained_are_the_whole_model(sizes):
    model = seeded_model(CONFIG)
    x, _ = synthetic_batch(CONFIG, 3)
    h, start = x, 0
    for n in sizes:
        h = GPTStage(model, start, start + n)(h)
        start += n
    torch.testing.assert_close(h, model(x))


def test_even_split_puts_the_embedding_first_and_the_head_last():
    assert layer_names(CONFIG) == ["embedding", "block 0", "block 1", "block 2", "block 3", "head"]
    assert even_split(CONFIG, 2) == [3, 3] and even_split(CONFIG, 4) == [2, 1, 1, 2]
    assert even_split(GPTConfig(n_layers=24), 4) == [7, 6, 6, 7]
    with pytest.raises(ValueError, match="stages=5 is more than the model's 4 blocks"):
        even_split(CONFIG, 5)
    assert stage_of_rank(1, 4, 8) == [1, 5]
    with pytest.raises(ValueError, match="do not divide"):
        stage_of_rank(0, 4, 6)


def test_choose_micro_batches_follows_the_bubble_and_the_memory():
    assert choose_micro_batches(4, 32, 0.3) == 8  # 3/11 = 27 % <= 30 %; 4 gives 43 %
    assert choose_micro_batches(4, 32, 0.01) == 32  # out of reach: one sequence per micro-batch
    assert choose_micro_batches(4, 32, 0.7) == 4  # m = 2 would do (3/5 = 60 %), but 1F1B needs m >= p
    assert choose_micro_batches(4, 32, 0.7, "gpipe") == 2
    # 1F1B holds p micro-batches on stage 0: 4 x (32/m) sequences of 1 MiB must fit 20 MiB -> m >= 8
    assert choose_micro_batches(4, 32, 0.5, activation_bytes_per_sample=2**20, memory_bytes=20 * 2**20) == 8
    with pytest.raises(ValueError, match="no micro-batch count fits.*32.0 MiB"):  # GPipe: the whole batch
        choose_micro_batches(4, 32, 0.5, "gpipe", activation_bytes_per_sample=2**20, memory_bytes=20 * 2**20)
    with pytest.raises(ValueError, match="smaller than stages"):
        choose_micro_batches(4, 2)


def test_profile_layers_names_every_layer_and_the_heavy_head():
    config = GPTConfig(n_layers=3, d_model=16, n_heads=2, vocab_size=2048, seq_len=16)
    prof = profile_layers(seeded_model(config), *synthetic_batch(config, 2), repeats=2)
    assert [p.name for p in prof] == layer_names(config)
    assert all(p.forward_ms > 0 and p.backward_ms > 0 for p in prof)
    # the head keeps its 2 x 16 x 2048 logits for the loss: far more than a block saves
    assert prof[-1].activation_bytes > 2 * 16 * 2048 * 4 > prof[1].activation_bytes


def _plans():
    return [([3, 3], 2, "gpipe"), ([2, 4], 4, "1f1b"), ([2, 1, 1, 2], 2, "interleaved_1f1b")]


def test_pipelining_gives_the_models_gradients_under_every_schedule():
    per_rank = launch(
        pipeline_steps,
        CONFIG,
        _plans(),
        batch_size=4,
        steps=2,
        check=True,
        measure_memory=True,
        world_size=2,
        cluster=_cluster(2),
        timeout_s=60,
        deadline_s=120,
    )
    for i, (sizes, m, schedule) in enumerate(_plans()):
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
    assert s.steps == [70.0, 80.0] and s.step_ms == 75.0
    # bubble per step: (70-40 + 70-60) / 140 = 2/7 and (80-44 + 80-60) / 160 = 0.35; median = mean of two
    assert s.bubble == pytest.approx((2 / 7 + 0.35) / 2)
    assert s.imbalance == pytest.approx((60 / 50 + 60 / 52) / 2)
    # limit per step: mean per-micro-batch cost x (m + p - 1) = (100/2/4) x 5 and (104/2/4) x 5
    assert s.limit_ms == pytest.approx((62.5 + 65.0) / 2)
    assert s.bubble_formula == pytest.approx(1 / 5)


def test_plot_pipeline_draws_every_rank():
    from labkit.trace import plot_pipeline

    spans = [[("F", 0, 0, 0.0, 1.0), ("B", 0, 0, 3.0, 5.0)], [("F", 1, 0, 1.0, 2.0), ("B", 1, 0, 2.0, 3.0)]]
    fig = plot_pipeline(spans, 5.0)
    assert len(fig.axes[0].get_yticks()) == 2
    with pytest.raises(ValueError, match="no ranks"):
        plot_pipeline([])
