"""labkit.measured_memory: `measure` (MemTracker's categories, gradient accumulation, nothing left alive),
`estimate_fake` (FakeTensors: a model too large for the machine) and `find_max_batch` (doubling then
bisection, freeing each failed step, letting other errors through)."""

from __future__ import annotations

import math
import weakref

import pytest
import torch

from labkit.measured_memory import BatchSearch, estimate_fake, find_max_batch, measure
from labkit.memory import estimate
from labkit.models import GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

SMALL = GPTConfig(n_layers=2, d_model=64, n_heads=4, seq_len=64)


def test_measure_supports_gradient_accumulation(lab_step) -> None:
    single = measure(*lab_step(SMALL, 4, "fp32", False, True))
    accumulated = measure(*lab_step(SMALL, 4, "fp32", False, True, accumulate=3))
    # the second micro-batch runs while the first one's gradients exist
    assert accumulated.peak > single.peak
    estimated = estimate(model=SMALL, precision="fp32", micro_batch=4, keep_grads=True)
    assert abs(estimated.peak / accumulated.peak - 1) < 0.10


def test_estimate_fake_matches_real_measurement(lab_step) -> None:
    step, model, optimizer = lab_step(SMALL, 8, "fp32", False, True)
    real = measure(step, model, optimizer)
    fake = estimate_fake(SMALL, 8)
    assert abs(fake.peak / real.peak - 1) < 0.01
    assert fake.params == real.params and fake.optimizer == real.optimizer


def test_estimate_fake_runs_a_model_too_large_for_the_machine() -> None:
    config = GPTConfig.preset("llama2-7b")
    fake = estimate_fake(config, 1, precision="bf16")
    estimated = estimate(model=config, precision="bf16", micro_batch=1)
    assert fake.peak > 50 * 2**30  # far beyond this machine's memory
    assert abs(estimated.peak / fake.peak - 1) < 0.05


def test_estimate_fake_rejects_unsupported_precision() -> None:
    with pytest.raises(ValueError, match="'mixed'"):
        estimate_fake(SMALL, 1, precision="mixed")
    with pytest.raises(ValueError, match="seq_len"):
        estimate_fake(SMALL, 1, seq_len=SMALL.seq_len + 1)


def test_measure_leaves_no_parameters_alive(lab_step) -> None:
    # MemTracker's ModTracker puts backward hooks whose closures hold autograd nodes: a cycle
    # through C++ that leaked every tracked step's parameters and gradients (torch 2.13).
    import gc

    step, model, optimizer = lab_step(SMALL, 2, "fp32", False, True)
    refs = [weakref.ref(p) for p in model.parameters()]
    measure(step, model, optimizer)
    del step, model, optimizer
    gc.collect()
    assert [r for r in refs if r() is not None] == []


# ---------------------------------------------------------------- batch-size finder


def _oom_above(threshold: int):
    calls: list[int] = []

    def step(micro_batch: int) -> None:
        calls.append(micro_batch)
        if micro_batch > threshold:
            raise torch.OutOfMemoryError(f"micro_batch {micro_batch} > {threshold}")

    return step, calls


def test_find_max_batch_doubles_then_bisects() -> None:
    step, calls = _oom_above(37)
    result = find_max_batch(step, limit=1024)
    assert isinstance(result, BatchSearch)
    assert result.batch == 37
    assert len(result.trials) == len(calls) <= 2 * math.log2(37) + 2
    assert [b for b, _ in result.trials] == calls
    assert all(fits == (b <= 37) for b, fits in result.trials)
    assert [b for b, _ in result.trials[:7]] == [1, 2, 4, 8, 16, 32, 64]
    assert not result.hit_limit


@pytest.mark.parametrize(
    "threshold, start, limit, expected",
    [
        (1, 1, 64, 1),
        (0, 1, 64, 0),  # nothing fits
        (5, 8, 64, 5),  # start too large: bisect below it
        (1000, 1, 48, 48),  # everything fits up to the limit
        (64, 1, 64, 64),
    ],
)
def test_find_max_batch_edges(threshold: int, start: int, limit: int, expected: int) -> None:
    step, _ = _oom_above(threshold)
    result = find_max_batch(step, start=start, limit=limit)
    assert result.batch == expected
    assert result.hit_limit == (expected == limit)


def test_find_max_batch_frees_the_failed_step() -> None:
    refs: list[weakref.ref] = []

    def step(micro_batch: int) -> None:
        activations = torch.empty(micro_batch, 1024)
        cycle: dict = {"activations": activations}
        cycle["self"] = cycle  # only gc.collect() can free this
        refs.append(weakref.ref(activations))
        del activations
        if micro_batch > 10:
            raise torch.OutOfMemoryError("emulated")

    result = find_max_batch(step, limit=64)
    assert result.batch == 10
    assert all(ref() is None for ref in refs)


def test_find_max_batch_lets_other_errors_through() -> None:
    def step(micro_batch: int) -> None:
        raise RuntimeError("a bug, not an OOM")

    with pytest.raises(RuntimeError, match="a bug"):
        find_max_batch(step)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"start": 0}, "start=0"),
        ({"limit": -1}, "limit=-1"),
        ({"start": 8, "limit": 4}, "start\\(8\\) > limit\\(4\\)"),
    ],
)
def test_find_max_batch_rejects_bad_input(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        find_max_batch(lambda b: None, **kwargs)
