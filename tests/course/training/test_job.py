"""labkit.course.training.job: a `TrainingJob` refuses, with the value and the fix, knobs it cannot run with
on that many ranks; its accumulation keeps the global batch; `job_name` names a job by the knobs that
differ."""

from __future__ import annotations

import dataclasses

import pytest

from labkit.course.training.job import GRAD_SYNCS, TrainingJob, job_name


def test_the_default_job_runs_and_accumulates_to_its_global_batch():
    job = TrainingJob()
    job.check(2)
    assert job.accumulation(2) == 16 // (4 * 2)
    assert dataclasses.replace(job, micro_batch=8).accumulation(2) == 1
    assert set(GRAD_SYNCS) == {"ddp", "overlapped", "per_tensor", "none"}


@pytest.mark.parametrize(
    "knobs, match",
    [
        ({"micro_batch": 3}, r"micro_batch\(3\)"),
        ({"optimizer": "lion"}, r"optimizer='lion' must be one of 'sgd', 'adam', 'adamw'"),
        ({"lr": 0}, r"lr=0 must be a number > 0"),
        ({"precision": "fp8"}, r"precision='fp8'"),
        ({"grad_sync": "allreduce"}, r"grad_sync='allreduce' must be one of 'ddp'"),
        ({"bucket_cap_mb": -1}, r"bucket_cap_mb=-1"),
        ({"eval_samples": -1}, r"eval_samples=-1"),
        ({"tokenize": "lazy"}, r"tokenize='lazy'"),
        ({"tokenizer_cost": 0}, r"tokenizer_cost=0"),
        ({"accuracy": "global"}, r"accuracy='global'"),
        ({"loss_readout": "never"}, r"loss_readout='never'"),
        ({"seed": -1}, r"seed=-1"),
        ({"eval_rank": 2}, r"eval_rank=2 is not a rank of 2: None \(shared\) or 0..1"),
    ],
)
def test_a_knob_the_job_cannot_run_with_is_refused_with_the_fix(knobs, match):
    with pytest.raises(ValueError, match=match):
        TrainingJob(**knobs).check(2)


def test_a_job_is_named_by_the_knobs_that_differ():
    assert job_name(TrainingJob()) == "clean"
    assert job_name(TrainingJob(grad_sync="per_tensor", tokenize="in_loader")) == (
        "grad_sync-per_tensor_tokenize-in_loader"
    )
    base = TrainingJob(optimizer="sgd")
    assert job_name(TrainingJob(optimizer="sgd"), base) == "clean"
    assert job_name(TrainingJob(), base) == "optimizer-adamw"
