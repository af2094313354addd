"""labkit.experiments.unoverlapped_comms_checks (lab 03's exercise checks): the exercise's base class leaves
exactly the hook and the flush to the learner; driven with the hooks in a shuffled order on 2 emulated
ranks, the reference passes the check, and a flush written as buckets fill up is named by it. Every wrong
answer's hint, in a notebook: the exercise mutation tests."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from labkit import launch
from labkit.experiments.unoverlapped_comms_checks import (
    HookDrill,
    OverlappedDDPExercise,
    check_overlapped_ddp,
    drive_hooks_shuffled,
)
from labkit.parallel.data import OverlappedDDP


class _AsTheyFill(OverlappedDDP):
    """The classic mistake: a bucket flushed as soon as it is complete, whatever its index."""

    def on_grad_ready(self, param):
        bucket = self.bucket_of[id(param)]
        bucket.pending -= 1
        if bucket.pending == 0:
            self.flush(bucket)
            self.next_bucket += 1


def _drills() -> dict:
    out = {"reference": drive_hooks_shuffled(OverlappedDDP), "mistake": drive_hooks_shuffled(_AsTheyFill)}
    try:
        drive_hooks_shuffled(OverlappedDDPExercise)
        out["stub"] = ""
    except NotImplementedError as exc:
        out["stub"] = str(exc)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def drills() -> list[dict]:
    return launch(_drills, world_size=2, cluster="cpu", timeout_s=60)


def test_the_reference_passes_the_check(drills):
    results = [d["reference"] for d in drills]
    assert all(isinstance(r, HookDrill) and r.buckets > 2 for r in results)
    assert [r.rank for r in results] == [0, 1]
    assert all(r.flushed == list(range(r.buckets)) and r.values == [1.5] for r in results)  # mean of 1 and 2
    check_overlapped_ddp(results, 2)


def test_a_flush_as_buckets_fill_up_is_named(drills):
    results = [d["mistake"] for d in drills]
    assert all(r.values == [] for r in results)  # stopped before its out-of-order collective was issued
    with pytest.raises(AssertionError, match="Flush buckets in index order, never as they fill up"):
        check_overlapped_ddp(results, 2)


def test_the_exercise_leaves_the_hook_to_the_learner(drills):
    assert all("on_grad_ready(param) is yours to write in your subclass" in d["stub"] for d in drills)


def test_gradients_averaged_twice_or_never_are_named():
    twice = [HookDrill([0, 1], 2, [0.75], r) for r in range(2)]
    with pytest.raises(AssertionError, match="divided by the world size twice"):
        check_overlapped_ddp(twice, 2)
    never = [HookDrill([0, 1], 2, [float(r + 1)], r) for r in range(2)]
    with pytest.raises(AssertionError, match="unchanged after finish_gradient_synchronization"):
        check_overlapped_ddp(never, 2)
    again = [HookDrill([0, 0, 1], 2, [1.5], r) for r in range(2)]
    with pytest.raises(AssertionError, match="bucket 0 was flushed again"):
        check_overlapped_ddp(again, 2)
