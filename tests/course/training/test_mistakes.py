"""labkit.course.training.mistakes: the one table of the course's mistakes. For every row: planting it changes
its knob (only), the job then plants it (`planted_in`, `planted_by_knobs`), the fix sets the knob right and
plants it no more, and `by_diagnosis` finds it by the kind `labkit.trace.diagnose` calls it; the OOM,
which only a measurement shows, is planted but never told by the knobs, and has no single fix."""

from __future__ import annotations

import dataclasses
import random

import pytest

from labkit.course.experiments.registry import LABS
from labkit.course.training.job import TrainingJob
from labkit.course.training.mistakes import (
    MISTAKES,
    Mistake,
    by_diagnosis,
    held_out_samples,
    planted_by_knobs,
)
from labkit.trace.diagnose import KINDS

WORLD = 2
CLEAN = TrainingJob(global_batch=16, micro_batch=4, accuracy="none")


def _changed(a: TrainingJob, b: TrainingJob) -> set[str]:
    return {k for k, v in dataclasses.asdict(a).items() if getattr(b, k) != v}


def test_the_table_is_keyed_by_name_and_each_row_names_a_lab_a_knob_and_a_diagnosis():
    assert list(MISTAKES) == [
        "oom_batch",
        "per_tensor_allreduce",
        "straggler",
        "data_loading",
        "sync_logging",
        "host_sync",
    ]
    fields = {f.name for f in dataclasses.fields(TrainingJob)}
    for name, m in MISTAKES.items():
        assert isinstance(m, Mistake) and m.name == name and m.lab in LABS and m.knob in fields
        assert m.fix and m.shows
        assert m.diagnosed_as is None or m.diagnosed_as in KINDS
    diagnosed = [m.diagnosed_as for m in MISTAKES.values() if m.diagnosed_as is not None]
    assert len(diagnosed) == len(set(diagnosed)) == len(MISTAKES) - 1  # all but the OOM, each its own kind
    assert planted_by_knobs(CLEAN) == set()


@pytest.mark.parametrize("name", list(MISTAKES))
def test_planting_then_fixing_each_mistake(name):
    m = MISTAKES[name]
    planted = m.plant(CLEAN, WORLD, random.Random(0))
    planted.check(WORLD)  # a job that runs
    assert planted.global_batch == CLEAN.global_batch  # the job's contract is kept
    if name == "oom_batch":
        assert not m.by_knob and planted.micro_batch == CLEAN.global_batch // WORLD
        assert _changed(CLEAN, planted) == {"micro_batch"}
        assert not m.planted_in(planted) and planted_by_knobs(planted) == set()  # only a measurement tells
        with pytest.raises(ValueError, match="oom_batch: keep global_batch; take a smaller micro_batch"):
            m.fixed(planted)
        return
    assert m.by_knob and m.planted_in(planted) and not m.planted_in(CLEAN)
    assert planted_by_knobs(planted) == {name}
    if name == "straggler":  # one rank evaluates the whole held-out batch
        assert _changed(CLEAN, planted) == {"eval_rank", "eval_samples"}
        assert 0 <= planted.eval_rank < WORLD and planted.eval_samples == held_out_samples(CLEAN, WORLD)
    else:
        assert _changed(CLEAN, planted) == {m.knob} and getattr(planted, m.knob) == m.wrong
    fixed = m.fixed(planted)
    fixed.check(WORLD)
    assert getattr(fixed, m.knob) == m.right and _changed(planted, fixed) == {m.knob}
    assert not m.planted_in(fixed) and planted_by_knobs(fixed) == set()
    assert by_diagnosis(m.diagnosed_as) is m


def test_mistakes_combine_and_each_fix_removes_only_its_own():
    rng = random.Random(3)
    job = CLEAN
    names = ["per_tensor_allreduce", "straggler", "data_loading", "sync_logging", "host_sync"]
    for name in names:
        job = MISTAKES[name].plant(job, WORLD, rng)
    assert planted_by_knobs(job) == set(names)
    job = MISTAKES["data_loading"].fixed(job)
    assert planted_by_knobs(job) == set(names) - {"data_loading"}


def test_a_straggler_keeps_a_held_out_batch_the_job_already_has_and_its_rank_comes_from_the_rng():
    evaluated = dataclasses.replace(CLEAN, eval_samples=6)
    planted = MISTAKES["straggler"].plant(evaluated, WORLD, random.Random(0))
    assert planted.eval_samples == 6
    ranks = {MISTAKES["straggler"].plant(CLEAN, 4, random.Random(s)).eval_rank for s in range(40)}
    assert ranks == {0, 1, 2, 3}
    assert held_out_samples(CLEAN, 4) == 4 * (16 // 4)


def test_kinds_no_knob_plants_have_no_mistake():
    assert by_diagnosis("none") is None and by_diagnosis("a kind nobody uses") is None
