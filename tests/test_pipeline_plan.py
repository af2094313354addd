"""labkit.pipeline_plan: the exact balanced split (against brute force), the bubble formulas (against the
papers) and the micro-batch count chosen from the bubble and the memory."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from labkit.pipeline_plan import (
    balance,
    bubble_fraction,
    choose_micro_batches,
    ideal_step_time,
    in_flight,
    micro_batches_for_bubble,
    pipeline_step_time,
    split_evenly,
    stage_costs,
)


def _brute_force(costs, stages):
    """The smallest bottleneck over every way to cut n layers into `stages` non-empty runs."""
    n, best = len(costs), math.inf
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


@pytest.mark.parametrize("seed", range(200))
def test_balance_equals_brute_force_on_random_costs(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    stages = rng.randint(1, n)
    costs = [rng.choice([rng.uniform(0.1, 10), rng.randint(1, 5), 30.0]) for _ in range(n)]
    sizes = balance(costs, stages)
    assert len(sizes) == stages and all(s >= 1 for s in sizes) and sum(sizes) == n
    assert max(stage_costs(costs, sizes)) == pytest.approx(_brute_force(costs, stages))


def test_a_heavy_embedding_and_head_get_stages_of_their_own():
    # a large vocabulary: embedding and LM head cost as much as several blocks
    costs = [8.0] + [2.0] * 8 + [8.0]
    assert split_evenly(10, 4) == [3, 3, 2, 2]
    assert max(stage_costs(costs, split_evenly(10, 4))) == 12.0
    sizes = balance(costs, 4)
    assert max(stage_costs(costs, sizes)) == 8.0 and sizes[0] == 1 and sizes[-1] == 1


@pytest.mark.parametrize(
    "bad,match",
    [
        (([1.0, 2.0], 3), "more than the 2 layers"),
        (([1.0, 0.0], 1), r"costs\[1\]=0.0"),
        (([1.0, float("nan")], 1), r"costs\[1\]=nan"),
        (([1.0, -2.0], 1), r"costs\[1\]=-2.0"),
        (([], 1), "empty"),
        (([1.0], 0), "stages"),
    ],
)
def test_balance_refuses_bad_input_with_the_value_and_the_fix(bad, match):
    with pytest.raises(ValueError, match=match):
        balance(*bad)


def test_bubble_fraction_matches_narayanan_et_al():
    # Narayanan et al. 2021 (2.2): bubble overhead t_pb / t_id = (p-1)/m; interleaved (p-1)/(v m).
    for p, m in [(4, 8), (8, 32), (2, 1)]:
        f = bubble_fraction(p, m, "gpipe")
        assert f / (1 - f) == pytest.approx((p - 1) / m)  # idle over useful time
        assert bubble_fraction(p, m, "1f1b") == f  # 1F1B: same bubble as GPipe
    f = bubble_fraction(4, 8, "interleaved_1f1b", chunks=2)
    assert f / (1 - f) == pytest.approx(3 / (2 * 8))
    assert f < bubble_fraction(4, 8)
    with pytest.raises(ValueError, match="multiple of stages"):
        bubble_fraction(4, 6, "interleaved_1f1b", chunks=2)
    with pytest.raises(ValueError, match="chunks"):
        bubble_fraction(4, 8, "1f1b", chunks=2)
    with pytest.raises(ValueError, match="schedule"):
        bubble_fraction(4, 8, "zero_bubble")


def test_step_times_and_what_1f1b_saves():
    assert pipeline_step_time([1.0] * 4, 8) == ideal_step_time([1.0] * 4, 8) == 11.0  # (m + p - 1) x cost
    assert pipeline_step_time([3.0, 1.0], 4) == 4.0 + 3 * 3.0  # the slow stage sets the pace
    assert ideal_step_time([3.0, 1.0], 4) == 2.0 * 5
    assert [in_flight("gpipe", 4, 8, s) for s in range(4)] == [8, 8, 8, 8]
    assert [in_flight("1f1b", 4, 8, s) for s in range(4)] == [4, 3, 2, 1]


def test_micro_batches_for_a_bubble_target():
    for p, target in [(4, 0.2), (8, 0.1), (2, 0.5)]:
        m = micro_batches_for_bubble(p, target)
        assert bubble_fraction(p, m) <= target < bubble_fraction(p, max(1, m - 1)) or m == 1
    m = micro_batches_for_bubble(4, 0.1, "interleaved_1f1b", chunks=2)
    assert m % 4 == 0 and bubble_fraction(4, m, "interleaved_1f1b", 2) <= 0.1
    with pytest.raises(ValueError, match="max_bubble"):
        micro_batches_for_bubble(4, 1.5)


def test_choose_micro_batches_follows_the_bubble_and_the_memory():
    assert choose_micro_batches(4, 32, 0.3) == 8  # 3/11 = 27 % <= 30 %; 4 gives 43 %
    assert choose_micro_batches(4, 32, 0.01) == 32  # out of reach: one sequence per micro-batch
    assert choose_micro_batches(4, 32, 0.7) == 4  # m = 2 would do (3/5 = 60 %), but 1F1B needs m >= p
    assert choose_micro_batches(4, 32, 0.7, "gpipe") == 2
    # 1F1B holds p micro-batches on stage 0: 4 x (32/m) sequences of 1 MiB must fit 20 MiB -> m >= 8
    assert choose_micro_batches(4, 32, 0.5, activation_bytes_per_sample=2**20, memory_bytes=20 * 2**20) == 8
    with pytest.raises(ValueError, match=r"no micro-batch count fits.*32\.0 MiB"):  # GPipe: the whole batch
        choose_micro_batches(4, 32, 0.5, "gpipe", activation_bytes_per_sample=2**20, memory_bytes=20 * 2**20)
    with pytest.raises(ValueError, match="smaller than stages"):
        choose_micro_batches(4, 2)
