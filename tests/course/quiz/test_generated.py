"""labkit.course.quiz.generated: each generated answer equals the paper's formula written out here (not
through labkit), for many seeds."""

from __future__ import annotations

import math

import pytest

from labkit.course import quiz


def _expected(q: quiz.Question) -> float:
    """Each generated answer from the formula as its source writes it (not through labkit)."""
    p = q.params
    if q.id == "pipeline-gen-bubble":  # Huang et al. 2019
        return 100 * (p["p"] - 1) / (p["m"] + p["p"] - 1)
    if q.id == "cluster-gen-ring":  # Thakur et al. 2005: 2(n-1) steps of nbytes/n
        return 2 * (p["n"] - 1) * (p["mib"] * 2**20 / p["n"]) / (p["bw"] * 1e9) * 1e3
    if q.id == "cluster-gen-busbw":  # nccl-tests PERFORMANCE.md
        return p["algbw"] * 2 * (p["n"] - 1) / p["n"]
    if q.id == "memory-gen-accumulation":
        return p["global_batch"] / (p["micro"] * p["ranks"])
    if q.id == "memory-gen-zero":  # ZeRO, Figure 1: 2 + 2 + 12 bytes, sharded by stage over N_d
        n, d, k = p["billions"] * 1e9, p["gpus"], p["zero_stage"]
        return (
            2 * n / (d if k >= 3 else 1) + 2 * n / (d if k >= 2 else 1) + 12 * n / (d if k >= 1 else 1)
        ) / 2**30
    if q.id == "memory-gen-activations":  # Korthikanti et al. 2022, Table 2
        s, b, h, a, t = p["s"], p["b"], p["h"], p["a"], p["t"]
        return s * b * h * (10 + 24 / t + 5 * a * s / (h * t)) / 2**30
    if q.id == "parallelism-gen-tp":  # Shoeybi et al. 2019: 4 all-reduces of b·s·h per layer
        t = p["tp"]
        return p["layers"] * 4 * 2 * (t - 1) / t * p["mb"] * p["seq"] * p["h"] * 2 / (p["bw"] * 1e9) * 1e3
    raise AssertionError(f"no formula for {q.id}")


@pytest.mark.parametrize("seed", range(12))
def test_generated_answers_equal_the_formulas(seed):
    generated = [q for q in quiz.bank(seed=seed) if q.kind == "numeric"]
    assert len(generated) >= 7
    for q in generated:
        assert math.isclose(q.answer, _expected(q), rel_tol=1e-3), (q.id, q.params, q.answer)
