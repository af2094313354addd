"""labkit.activations: Korthikanti et al. 2022's activation memory per layer, worked by hand and on GPT-3
175B, with and without selective recomputation (and what that recomputation costs in FLOPs). How
`labkit.memory.estimate` uses it: tests/test_memory.py."""

from __future__ import annotations

import pytest

from labkit.activations import korthikanti_activation_bytes
from labkit.models import GPTConfig
from labkit.planner import forward_flops_per_token


def test_korthikanti_formula_by_hand() -> None:
    # s=4, b=2, h=8, a=2, L=3:  s*b*h = 64
    # none:      per layer 34*64 + 5*a*s*s*b = 2176 + 5*2*16*2 = 2176 + 320 = 2496; x3 = 7488
    # selective: 34*64 = 2176 per layer; x3 = 6528
    # full:      2*64 = 128 per layer; x3 = 384
    args = {"seq_len": 4, "micro_batch": 2, "d_model": 8, "n_heads": 2, "n_layers": 3}
    assert korthikanti_activation_bytes(**args) == 7488
    assert korthikanti_activation_bytes(**args, recompute="selective") == 6528
    assert korthikanti_activation_bytes(**args, recompute="full") == 384


def test_korthikanti_gpt3_layer() -> None:
    # One GPT-3 175B layer, s=2048, b=1: sbh(34 + 5as/h) = 2048*12288*(34 + 5*96*2048/12288).
    expected = 2048 * 12288 * (34 + 80)
    assert korthikanti_activation_bytes(2048, 1, 12288, 96) == expected


def test_korthikanti_selective_recomputation_on_gpt3() -> None:
    # Korthikanti et al. 2022, section 5: recomputing only QK^T, softmax, dropout and attention over V drops
    # the 5as/h term. GPT-3 175B (a=96, s=2048, h=12288): 5as/h = 80 of 34 + 80 = 114 bytes per s*b*h, so
    # selective recomputation keeps 34/114 of a layer's activations: 70 % less.
    s, h, a = 2048, 12288, 96
    none = korthikanti_activation_bytes(s, 1, h, a)
    selective = korthikanti_activation_bytes(s, 1, h, a, recompute="selective")
    assert selective == 34 * s * h
    assert round(1 - selective / none, 2) == 0.70
    # Table 2, tp = 8, no sequence parallelism: sbh(10 + 24/t + 5as/(ht)); selective: sbh(10 + 24/t)
    assert korthikanti_activation_bytes(s, 1, h, a, tp=8) == s * h * (10 + 3 + 10)
    assert korthikanti_activation_bytes(s, 1, h, a, recompute="selective", tp=8) == s * h * (10 + 3)


def test_selective_recomputation_costs_a_few_percent_of_the_forward() -> None:
    # What selective recomputation runs again per token and layer: QK^T and attention over V, 4·s·h FLOPs,
    # against the layer's forward, 24·h² + 4·s·h with f = 4h (Narayanan et al. 2021, the planner's count).
    # GPT-3 175B: 4·2048 / (24·12288 + 4·2048) = 2.7 %; MT-NLG 530B (h = 20480): 1.6 %, the paper's section 5
    # figures. Over a training step (forward + backward, about three forwards) that is under 1 %.
    for h, a, share in [(12288, 96, 0.027), (20480, 128, 0.016)]:
        config = GPTConfig(n_layers=1, d_model=h, n_heads=a, seq_len=2048)
        per_block, _ = forward_flops_per_token(config)
        assert per_block == 24 * h * h + 4 * 2048 * h
        assert round(4 * 2048 * h / per_block, 3) == share


def test_korthikanti_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="recompute"):
        korthikanti_activation_bytes(4, 2, 8, 2, recompute="some")
    with pytest.raises(ValueError, match="seq_len=0"):
        korthikanti_activation_bytes(0, 2, 8, 2)
