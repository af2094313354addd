"""labkit.batch: micro-batches per optimizer step (the global batch is the contract), the sizes refused with
the values and the fix, and the micro-batch chosen from what fits."""

from __future__ import annotations

import pytest

from labkit.batch import accumulation_steps, choose_micro_batch


@pytest.mark.parametrize(
    "global_batch, micro_batch, world_size, steps",
    [(64, 4, 2, 8), (64, 32, 2, 1), (12, 3, 4, 1), (48, 2, 3, 8), (1, 1, 1, 1)],
)
def test_accumulation_steps(global_batch: int, micro_batch: int, world_size: int, steps: int) -> None:
    assert accumulation_steps(global_batch, micro_batch, world_size) == steps
    assert micro_batch * steps * world_size == global_batch


@pytest.mark.parametrize(
    "args, words",
    [
        (
            (64, 6, 2),
            [
                "global_batch(64)",
                "micro_batch(6)",
                "world_size(2) = 12",
                "divides global_batch / world_size = 32",
                "1, 2, 4, 8, 16, 32",
            ],
        ),
        ((65, 4, 2), ["global_batch(65)", "use global_batch=64 or 72"]),
        ((64, 64, 2), ["micro_batch(64) x world_size(2) = 128 > global_batch(64)", "1, 2, 4, 8, 16, 32"]),
        ((-8, 2, 2), ["global_batch=-8", "positive"]),
        ((64, 0, 2), ["micro_batch=0", "positive"]),
        ((64, 4, 0), ["world_size=0", "positive"]),
        ((64, 4.0, 2), ["micro_batch=4.0"]),
        ((64, True, 2), ["micro_batch=True"]),
    ],
)
def test_accumulation_steps_rejects_bad_sizes(args: tuple, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        accumulation_steps(*args)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(
    "global_batch, world_size, max_fit, expected",
    [(64, 2, 30, 16), (64, 2, 6, 4), (64, 2, 32, 32), (64, 2, 1000, 32), (48, 2, 5, 4), (64, 2, 1, 1)],
)
def test_choose_micro_batch(global_batch: int, world_size: int, max_fit: int, expected: int) -> None:
    micro = choose_micro_batch(global_batch, world_size, max_fit)
    assert micro == expected
    accumulation_steps(global_batch, micro, world_size)  # divides


def test_choose_micro_batch_rejects_nothing_fits_and_uneven_batches() -> None:
    with pytest.raises(ValueError, match=r"max_fit=0.*not even a micro-batch of 1"):
        choose_micro_batch(64, 2, 0)
    with pytest.raises(ValueError, match="global_batch\\(63\\)"):
        choose_micro_batch(63, 2, 8)
