"""The capstone's two exercises checked on their own: each wrong rule for fit_memory and each wrong fix is
named, whatever mistakes the learner's seed dealt, and the right answers pass on several seeds."""

from __future__ import annotations

import dataclasses

import pytest

from labkit.course.experiments.capstone import _fit_memory, draw
from labkit.course.experiments.capstone_checks import CapstoneReport, _out_of_memory
from labkit.course.experiments.capstone_exercise_checks import (
    _RULES,
    _budgets,
    _largest,
    check_fit_memory,
    check_fix,
)
from labkit.course.training import MISTAKES, by_diagnosis
from labkit.errors import RankError
from labkit.memory import estimate

SEEDS = [0, 4]  # 0: the OOM, per-tensor all-reduce and data loading; 4: the OOM and a straggler


def fit_memory_by(
    headroom=0.9, keep=lambda m, s: m < s, ascending=False, divisors=True, unit=2**20, ranks=None
):
    """A learner's fit_memory, right with the defaults; each argument one way to get it wrong."""

    def fit_memory(job, model, memory_mib, world_size):
        share = job.global_batch // (ranks or world_size)
        ms = [d for d in range(1, share + 1) if share % d == 0 or not divisors]
        for m in ms if ascending else ms[::-1]:
            need = estimate(
                model=model, micro_batch=m, optimizer="adam", precision="fp32", keep_grads=keep(m, share)
            )
            if need.peak <= headroom * memory_mib * unit:
                return dataclasses.replace(job, micro_batch=m)
        raise ValueError("not even a micro-batch of 1 fits")

    return fit_memory


def _no_raise(job, model, memory_mib, world_size):
    try:
        return fit_memory_by()(job, model, memory_mib, world_size)
    except ValueError:
        return dataclasses.replace(job, micro_batch=1)


def _global_batch_cut(job, model, memory_mib, world_size):
    fitted = fit_memory_by()(job, model, memory_mib, world_size)
    return dataclasses.replace(fitted, global_batch=fitted.micro_batch * world_size)


WRONG_FITS = {
    "no headroom": (fit_memory_by(headroom=1.0), "no headroom"),
    "the smallest that fits": (fit_memory_by(ascending=True), "smallest micro-batch that fits"),
    "not a divisor": (fit_memory_by(divisors=False), "does not divide"),
    "keep_grads ignored": (fit_memory_by(keep=lambda m, s: False), "leaves out keep_grads"),
    "keep_grads always": (fit_memory_by(keep=lambda m, s: True), "even with one micro-batch"),
    "a world size of its own": (fit_memory_by(ranks=2), "world size of its own"),
    "bytes against MiB": (fit_memory_by(unit=1), "estimate(...).peak is in bytes"),
    "MiB against bytes": (fit_memory_by(unit=2**40), "whole share"),
    "nothing fits, no error": (_no_raise, "raise ValueError"),
    "the global batch cut": (_global_batch_cut, "job's contract"),
    "labkit's own": (lambda job, model, mib, ws: _fit_memory(job, model, mib, ws), "capstone._fit_memory"),
}


def test_every_wrong_rule_answers_the_budgets_differently():
    for world_size in (2, 4):
        budgets = _budgets(draw(0, world_size=world_size))
        right = [_largest(b.job, b.model, b.memory_mib, b.world_size) for b in budgets]
        vectors = {name: [rule(b) for b in budgets] for name, (rule, _) in _RULES.items()}
        assert all(v != right for v in vectors.values()), vectors
        assert len({tuple(v) for v in vectors.values()}) == len(vectors), vectors


@pytest.mark.parametrize("name", list(WRONG_FITS))
def test_a_wrong_fit_memory_is_named(name):
    fn, hint = WRONG_FITS[name]
    with pytest.raises(AssertionError) as info:
        check_fit_memory(fn, draw(0))
    assert hint in str(info.value), str(info.value)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("on_gpu", [False, True])
def test_the_right_fit_memory_passes(seed, on_gpu):
    assert check_fit_memory(fit_memory_by(), draw(seed, on_gpu=on_gpu)) == 8


_KNOBS = {
    "data_loading": {"tokenize": "ahead"},
    "straggler": {"eval_rank": None},
    "small_collectives": {"grad_sync": "ddp"},
    "sync_collective": {"accuracy": "local"},
}


def fix_by(knobs=None, start=None):
    """A learner's fix, right with the defaults; `knobs` per kind, `start(job)` the job it replaces."""

    def fix(job, finding):
        return dataclasses.replace(start(job) if start else job, **(knobs or _KNOBS)[finding.kind])

    return fix


def _with(kind, value):
    return {**_KNOBS, kind: value}


WRONG_FIXES = {
    # needs the capstone, bound in the test
    "starts again from the job as handed": (
        lambda cap: fix_by(start=lambda job: cap.job),
        "starts again from cap.job",
    ),
    "copies the clean job": (
        lambda cap: fix_by(start=lambda job: cap.clean),
        "cap.clean, the answer key",
    ),
    "every knob at once": (
        lambda cap: fix_by(
            knobs={k: {kk: v for d in _KNOBS.values() for kk, v in d.items()} for k in _KNOBS}
        ),
        "one fix per finding",
    ),
    "the evaluation moved to another rank": (
        lambda cap: fix_by(knobs=_with("straggler", {"eval_rank": 0})),
        "one rank still evaluates all of it",
    ),
    "the evaluation dropped": (
        lambda cap: fix_by(knobs=_with("straggler", {"eval_rank": None, "eval_samples": 0})),
        "set eval_samples to 0",
    ),
    "the metric dropped": (
        lambda cap: fix_by(knobs=_with("sync_collective", {"accuracy": "none"})),
        "left accuracy='none'",
    ),
    "two kinds swapped": (
        lambda cap: fix_by(
            knobs={**_KNOBS, "data_loading": {"accuracy": "local"}, "sync_collective": {"tokenize": "ahead"}}
        ),
        "unchanged. The finding measured that a large share of the step goes to loading data",
    ),
    "labkit's fixes": (
        lambda cap: lambda job, finding: by_diagnosis(finding.kind).fixed(job),
        "MISTAKES[...].fixed",
    ),
    "MISTAKES' right values": (
        lambda cap: (
            lambda job, finding: dataclasses.replace(
                job, **{by_diagnosis(finding.kind).knob: by_diagnosis(finding.kind).right}
            )
        ),
        "reads the right values from labkit.course.training.MISTAKES",
    ),
    "nothing returned": (lambda cap: lambda job, finding: None, "returned None"),
    "the job returned as it was": (
        lambda cap: lambda job, finding: job,
        "returned the job unchanged. The finding measured that",
    ),
    # issue 44: a knob of its own choosing is refused with the one the finding points to
    "a bigger bucket for per-tensor all-reduces": (
        lambda cap: fix_by(knobs=_with("small_collectives", {"bucket_cap_mb": 100.0})),
        "the knob that makes it is job.grad_sync (now 'per_tensor')",
    ),
}


@pytest.mark.parametrize("name", list(WRONG_FIXES))
def test_a_wrong_fix_is_named_on_a_seed_that_plants_nothing_of_its_kind(name):
    cap = draw(0)  # no straggler, no logging collective planted: the check plants them itself
    assert not {"straggler", "sync_logging"} & set(cap.planted)
    make, hint = WRONG_FIXES[name]
    with pytest.raises(AssertionError) as info:
        check_fix(make(cap), cap)
    assert hint in str(info.value), str(info.value)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("world_size", [2, 4])
def test_the_right_fix_passes(seed, world_size):
    cap = draw(seed, world_size=world_size)
    assert check_fix(fix_by(), cap) == 2 * 4
    assert check_fix(fix_by(knobs=_with("small_collectives", {"grad_sync": "overlapped"})), cap) == 8


def test_an_oom_after_the_memory_fix_says_a_later_fix_undid_it():
    cap = draw(0)
    err = RankError("rank 0 raised OutOfMemoryError", rank=0, kind="raised", exc_type="OutOfMemoryError")
    report = CapstoneReport([], [], "emulated", memory_mib=cap.memory_mib)
    undone = dataclasses.replace(cap.job, grad_sync="ddp", tokenize="ahead")
    assert "a fix after the memory fix undid it" in str(
        _out_of_memory(cap, set(cap.planted), undone, report, err)
    )
    report = CapstoneReport([], [], "emulated", memory_mib=cap.memory_mib)
    assert MISTAKES["oom_batch"].fix in str(_out_of_memory(cap, set(), cap.job, report, err))
