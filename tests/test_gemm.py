"""labkit.gemm: tile and wave quantization as NVIDIA's matrix-multiplication guide defines them, the roofline
below the FLOP:byte ratio, and no curve on the emulated cluster."""

from __future__ import annotations

import pytest

from labkit.gemm import GemmCurve, efficiency, gemm_s, quantization

A100 = GemmCurve(108, 2039.0)  # SMs and HBM GB/s (labkit.cluster's preset)
RATE = 156e12  # half of the A100's 312 TFLOP/s dense bf16


def test_a_full_wave_of_full_tiles_loses_nothing():
    assert quantization(128 * 12, 128 * 9, A100) == 1.0  # 108 tiles: one wave on 108 SMs


def test_tile_and_wave_quantization_by_hand():
    # 1024 x 1728: 8 x 14 = 112 tiles, the last column of tiles 64 of 128 wide (1728 = 13.5 x 128); 112 tiles
    # on 108 SMs take 2 waves, the second with 4 tiles
    tile_share = (1024 * 1728) / (8 * 128 * 14 * 128)
    assert tile_share == pytest.approx(1728 / 1792)
    assert quantization(1024, 1728, A100) == pytest.approx(tile_share * 112 / 216)


def test_a_matmul_below_the_flop_per_byte_ratio_is_bound_by_memory():
    # 8192 x 8192 x 64: 2·m·n·k FLOPs over 2 bytes x (m·k + k·n + m·n) is 63 FLOP/byte, under the A100's
    # 156 TFLOP/s / 2,039 GB/s = 77: the time is the bytes over the bandwidth
    m, n, k = 8192, 8192, 64
    memory_s = 2 * (m * k + k * n + m * n) / 2039e9
    assert gemm_s(m, n, k, RATE, A100) == pytest.approx(memory_s)
    assert efficiency(m, n, k, RATE, A100) == pytest.approx(2 * m * n * k / RATE / memory_s)
    assert efficiency(m, n, k, RATE, A100) < 0.85


def test_a_few_tokens_fill_a_fraction_of_the_tiles():
    # 64 tokens through a 4096 x 16384 matrix: 128-wide tiles half full, 128 tiles in 2 waves on 108 SMs
    # (cuBLAS would pick a smaller tile here: the curve is pessimistic for such thin matmuls)
    assert efficiency(64, 16384, 4096, RATE, A100) == pytest.approx(0.5 * 128 / 216)


def test_splitting_over_tp_costs_efficiency_where_the_matmul_gets_small():
    # the 7.5B model's first MLP matmul (d 4096, ffn 16384) at 1024 tokens
    shares = [efficiency(1024, 16384 / tp, 4096, RATE, A100) for tp in (1, 2, 4, 8)]
    assert shares[0] > 0.9 and shares == sorted(shares, reverse=True) and shares[-1] < 0.65
    assert efficiency(16384, 16384 / 8, 4096, RATE, A100) == pytest.approx(1.0, abs=0.02)


def test_without_a_curve_every_matmul_runs_at_the_rate():
    assert gemm_s(10, 20, 30, 1e9, None) == 2 * 10 * 20 * 30 / 1e9
    assert efficiency(1, 1, 1, 1e9, None) == 1.0


def test_a_curve_is_checked():
    with pytest.raises(ValueError, match="memory_gb_s"):
        GemmCurve(132, 0)
    with pytest.raises(ValueError, match="sms"):
        GemmCurve(0, 3350)
