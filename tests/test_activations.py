"""labkit.activations: Korthikanti et al. 2022's activation memory per layer, worked by hand and on GPT-3
175B. How `labkit.memory.estimate` uses it: tests/test_memory.py."""

from __future__ import annotations

import pytest

from labkit.activations import korthikanti_activation_bytes


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


def test_korthikanti_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="recompute"):
        korthikanti_activation_bytes(4, 2, 8, 2, recompute="some")
    with pytest.raises(ValueError, match="seq_len=0"):
        korthikanti_activation_bytes(0, 2, 8, 2)
