"""The capstone: the seed deals different jobs, its GPU's memory separates the mistakes, and the check says
which mistakes were found and fixed, failing with what is left (on real runs of the emulated cluster)."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter

import pytest
import torch

from labkit import Cluster, RankError, launch
from labkit.course.capstone import check_capstone, planted_by_knobs
from labkit.experiments.capstone import MISTAKES, TrainingJob, draw, job_name, train

CPU = Cluster.emulated(gpus_per_node=2)


def test_the_seed_deals_every_combination_and_hides_the_answer():
    dealt = Counter(draw(seed).planted for seed in range(300))
    combos = {c for k in (2, 3) for c in itertools.combinations(MISTAKES, k)}
    assert set(dealt) == combos  # all 20: every sitting can get a different job
    cap = draw(5)
    assert draw(5) == cap and "planted" not in repr(cap) and "clean=" not in repr(cap)
    for seed in range(40):
        cap = draw(seed)
        changed = {k for k, v in dataclasses.asdict(cap.job).items() if getattr(cap.clean, k) != v}
        knobs = {
            "oom_batch": "micro_batch",
            "per_tensor_allreduce": "grad_sync",
            "straggler": "eval_rank",
            "data_loading": "tokenize",
            "sync_logging": "accuracy",
        }
        assert changed == {knobs[m] for m in cap.planted}, seed
        assert planted_by_knobs(cap.job) == set(cap.planted) - {"oom_batch"}
        assert cap.job.global_batch == cap.clean.global_batch
    with pytest.raises(ValueError, match="data-parallel job; use 2 or more ranks"):
        draw(0, world_size=1)
    with pytest.raises(ValueError, match="eval_rank=3 is not a rank of 2"):
        TrainingJob(eval_rank=3).check(2)
    with pytest.raises(ValueError, match="micro_batch"):
        TrainingJob(global_batch=16, micro_batch=3).check(2)
    assert job_name(TrainingJob(grad_sync="per_tensor")) == "grad_sync-per_tensor"


def test_the_gpu_memory_fits_the_clean_job_and_its_logging_but_not_the_whole_batch(tmp_path):
    cap = draw(0)
    clean = cap.clean
    fits = [clean, dataclasses.replace(clean, accuracy="gathered"), dataclasses.replace(clean, eval_rank=0)]
    per_rank = launch(train, cap, fits, str(tmp_path), steps=1, trace_steps=1, world_size=2, cluster=CPU)
    peaks = [max(rank[i]["peak_mib"] for rank in per_rank) for i in range(len(fits))]
    assert all(0.5 * cap.memory_mib < p < 0.95 * cap.memory_mib for p in peaks), (peaks, cap.memory_mib)
    assert peaks[1] > peaks[0]  # the gathered logits take memory too
    with pytest.raises(RankError) as info:
        launch(
            train, cap, [dataclasses.replace(clean, micro_batch=8)], str(tmp_path), world_size=2, cluster=CPU
        )
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)


def test_the_check_names_what_is_left_and_passes_the_full_fix(tmp_path):
    cap = draw(0)  # oom_batch, per_tensor_allreduce, data_loading
    assert cap.planted == ("oom_batch", "per_tensor_allreduce", "data_loading")
    with pytest.raises(ValueError, match="not capstone mistakes"):
        check_capstone(cap, {"slow_disk"}, cap.job, cluster=CPU)

    with pytest.raises(AssertionError) as info:  # handed back as it came: it does not even run
        check_capstone(cap, set(), cap.job, cluster=CPU, trace_dir=tmp_path / "a")
    assert "runs out of memory (22.0 MiB per rank)" in str(info.value)

    # the data loading left as it was, and the contract changed
    half = dataclasses.replace(cap.job, micro_batch=4, grad_sync="ddp", global_batch=32)
    with pytest.raises(AssertionError) as info:
        check_capstone(
            cap,
            {"oom_batch", "per_tensor_allreduce", "straggler"},
            half,
            cluster=CPU,
            trace_dir=tmp_path / "b",
        )
    left = str(info.value).split("what is left:")[1]
    assert "data_loading is not fixed: the fixed job still plants it" in left
    assert "data_loading was planted and not named in found" in left
    assert "straggler is in found but was not planted" in left
    assert "global_batch is 32, the job's is 16" in left
    assert "oom_batch" not in left and "per_tensor_allreduce" not in left

    fixed = dataclasses.replace(half, tokenize="ahead", global_batch=16)
    report = check_capstone(cap, set(cap.planted), fixed, cluster=CPU, trace_dir=tmp_path / "d")
    assert report.passed and all(r["found"] and r["fixed"] for r in report.rows)
    assert [r["mistake"] for r in report.rows] == list(cap.planted)
    assert report.fixed_ms <= 1.2 * report.clean_ms and report.fixed_peak_mib <= cap.memory_mib
    assert report.findings == [] and "nothing: every planted mistake found and fixed" in str(report)
