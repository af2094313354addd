"""labkit.course.experiments.oom_batch (lab 02's driver): the data split it accumulates over, and `dp_train`
on 2 emulated ranks: accumulation with and without `no_sync` gives the big batch's gradient, DDP's all-reduces
are counted, the peak is the estimate's, the whole share in one micro-step needs more, and the batch
search leaves nothing behind."""

from __future__ import annotations

import pytest
import torch

import labkit
from labkit.batch import accumulation_steps
from labkit.course.experiments.oom_batch import DPResult, dp_train, max_micro_batch, rank_micro_batches
from labkit.course.training.reference import reference_gradients
from labkit.memory import estimate
from labkit.models import GPTConfig, synthetic_batch
from labkit.parallel.data import accumulate_with_no_sync, accumulate_without_no_sync

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

SMALL = GPTConfig(n_layers=2, d_model=64, n_heads=4, seq_len=64)


def test_rank_micro_batches_cover_the_global_batch_in_order() -> None:
    config = GPTConfig(n_layers=1, d_model=16, n_heads=2, seq_len=8, vocab_size=32)
    x, y = synthetic_batch(config, 24, seed=3, step=1)
    rows = [rank_micro_batches(config, 24, 4, rank, 3, step=1, seed=3) for rank in range(3)]
    assert all(len(r) == 2 and r[0][0].shape == (4, 8) for r in rows)
    assert torch.equal(torch.cat([mx for r in rows for mx, _ in r]), x)
    assert torch.equal(torch.cat([my for r in rows for _, my in r]), y)
    with pytest.raises(ValueError, match="rank=3"):
        rank_micro_batches(config, 24, 4, 3, 3)


def test_dp_train_needs_a_rank() -> None:
    with pytest.raises(ValueError, match=r"labkit\.launch"):
        dp_train(SMALL, 8, 4)


def _dp_worker(config: GPTConfig, global_batch: int, micro_batch: int) -> dict:
    # 0.1 MB buckets: this 0.45 MB model gets several once DDP has rebuilt them after step 1
    with_sync = dp_train(
        config,
        global_batch,
        micro_batch,
        accumulate=accumulate_with_no_sync,
        return_grads=True,
        breakdown=True,
        bucket_cap_mb=0.1,
    )
    without = dp_train(
        config,
        global_batch,
        micro_batch,
        accumulate=accumulate_without_no_sync,
        return_grads=True,
        bucket_cap_mb=0.1,
    )
    single = dp_train(config, global_batch, global_batch // 2)  # as first written: one micro-step
    budget = labkit.machine.emulate.active_budget()
    search = max_micro_batch(config, precision="autocast", checkpointing=True, limit=64)
    return {
        "with": with_sync,
        "without": without,
        "single": single,
        "search": search,
        "left": budget.allocated,
    }


def test_dp_train_accumulation_matches_the_big_batch_and_counts_allreduces() -> None:
    config = GPTConfig(n_layers=2, d_model=64, n_heads=4, seq_len=32, vocab_size=128)
    cluster = labkit.Cluster.emulated(gpus_per_node=2, memory_gib=8 / 1024)
    global_batch, micro = 16, 2
    out = labkit.launch(_dp_worker, config, global_batch, micro, world_size=2, cluster=cluster, timeout_s=120)
    reference = reference_gradients(config, global_batch).flat()
    steps = accumulation_steps(global_batch, micro, 2)
    for rank, result in enumerate(out):
        good, naive = result["with"], result["without"]
        assert isinstance(good, DPResult) and good.rank == rank and good.accumulation_steps == steps
        # the same gradient as the big batch, with or without no_sync
        assert (good.grads - reference).abs().max().item() < 1e-5
        assert (naive.grads - reference).abs().max().item() < 1e-5
        # one pass over the buckets per optimizer step with no_sync; one per micro-step without
        assert good.buckets > 1
        assert good.allreduce_calls == good.buckets
        assert naive.allreduce_calls == steps * naive.buckets
        assert naive.allreduce_bytes == steps * good.allreduce_bytes
        # DDP adds no memory to the estimate (gradients live in its buckets)
        est = estimate(model=config, precision="fp32", micro_batch=micro, keep_grads=True)
        assert abs(est.peak / good.peak_bytes - 1) < 0.10
        assert good.peak_source == "emulated budget" and good.breakdown is not None
        assert good.breakdown.peak == pytest.approx(good.peak_bytes, rel=0.02)
        assert naive.peak_bytes == pytest.approx(good.peak_bytes, rel=0.01)
        # the whole share in one micro-step needs more memory; the search leaves nothing behind
        assert result["single"].peak_bytes > good.peak_bytes
        assert result["search"].batch >= 1 and result["left"] < 2**20
