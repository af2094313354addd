"""labkit.parallel.pipeline: GPT stages chained are the whole model, the naive even split puts the embedding
first and the head last, stages map to ranks (interleaved too), schedules refuse what they cannot run, and
a `StageLog` starts each step empty. Pipelining over the emulated cluster, timed and checked against one
process: tests/course/experiments/test_imbalanced_pipeline.py."""

from __future__ import annotations

import pytest
import torch

from labkit.machine.timer import Mark
from labkit.models import GPTConfig, seeded_model, synthetic_batch
from labkit.parallel.pipeline import GPTStage, StageLog, even_split, layer_names, make_schedule, stage_of_rank

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = GPTConfig(n_layers=4, d_model=16, n_heads=2, vocab_size=64, seq_len=8)


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


def test_a_schedule_refuses_what_it_cannot_run():
    with pytest.raises(
        ValueError, match=r"schedule='zigzag' must be one of 'gpipe', '1f1b', 'interleaved_1f1b'"
    ):
        make_schedule([], "zigzag", 4)
    with pytest.raises(ValueError, match="micro_batches=0"):
        make_schedule([], "1f1b", 0)
    with pytest.raises(ValueError, match="schedule='gpipe' runs one stage per rank, this rank holds 2"):
        make_schedule([object(), object()], "gpipe", 4)


def test_a_stage_log_starts_each_step_empty():
    log = StageLog()
    log.spans.append(("F", 0, 0, Mark(), Mark()))
    log.sends, log.sent_bytes = 2, 512
    log.clear()
    assert (log.spans, log.sends, log.sent_bytes) == ([], 0, 0)
