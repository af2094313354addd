"""How long one GPU takes for a matrix multiplication of a given shape: the planner's efficiency curve.

A GPU computes a GEMM's output in tiles, one thread block per tile, in waves of as many tiles as it has
SMs. NVIDIA's "Matrix Multiplication Background User's Guide" (Deep Learning Performance documentation,
"Dimension Quantization Effects") names what a small or oddly sized GEMM loses: *tile quantization* (the
last row and column of tiles are partly empty) and *wave quantization* (the last wave leaves SMs idle).
And a GEMM whose arithmetic intensity is below the GPU's FLOP:byte ratio waits on memory instead ("Math
and Memory Bounds"; the roofline of Williams et al. 2009). So

    gemm_s(m, n, k) = max(2·m·n·k / (flops_per_s · tiles' share · waves' share), bytes moved / HBM bandwidth)

where `flops_per_s` is what a large GEMM reaches (a datasheet peak times an efficiency, `labkit.planner`).
Splitting a layer over tensor-parallel ranks or shrinking the micro-batch makes each GEMM smaller, and
below a few waves of tiles that costs time the FLOPs alone do not show.

What the curve leaves out: cuBLAS chooses among several tile shapes and may split K (128 x 128 is the
guide's example and is used here, which overstates the loss of thin matmuls, for which cuBLAS picks smaller
tiles), L2 cache reuse, and clocks that fall under load. On the emulated cluster there is no curve
(`curve=None`): its rate is this CPU's, measured at one size (`labkit.calibrate`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from labkit import validate

__all__ = ["GemmCurve", "efficiency", "gemm_s", "quantization"]


@dataclass(frozen=True)
class GemmCurve:
    """One GPU's shape of efficiency: `sms` streaming multiprocessors, `memory_gb_s` of HBM bandwidth, and
    the output `tile` (elements per side) each thread block computes."""

    sms: int
    memory_gb_s: float
    tile: int = 128

    def __post_init__(self) -> None:
        validate.positive_int("GemmCurve sms", self.sms, "GemmCurve(sms=132, memory_gb_s=3350)")
        validate.positive_int("GemmCurve tile", self.tile, "GemmCurve(sms=132, memory_gb_s=3350, tile=128)")
        if not (isinstance(self.memory_gb_s, (int, float)) and self.memory_gb_s > 0):
            raise ValueError(
                f"GemmCurve memory_gb_s={self.memory_gb_s!r} must be a positive bandwidth in GB/s; "
                "e.g. GemmCurve(sms=132, memory_gb_s=3350) for an H100 SXM"
            )


def quantization(m: float, n: float, curve: GemmCurve) -> float:
    """The share of the SMs' tile slots an m x n output fills: tile quantization times wave quantization."""
    t = curve.tile
    tiles_m, tiles_n = math.ceil(m / t), math.ceil(n / t)
    tiles = tiles_m * tiles_n
    waves = math.ceil(tiles / curve.sms)
    return (m * n) / (tiles_m * t * tiles_n * t) * tiles / (waves * curve.sms)


def gemm_s(
    m: float, n: float, k: float, flops_per_s: float, curve: GemmCurve | None, bytes_per_element: int = 2
) -> float:
    """Seconds for one (m x k) @ (k x n) matrix multiplication (see the module docstring); with no curve,
    its FLOPs at `flops_per_s`."""
    flops = 2.0 * m * n * k
    if curve is None:
        return flops / flops_per_s
    math_s = flops / (flops_per_s * quantization(m, n, curve))
    memory_s = bytes_per_element * (m * k + k * n + m * n) / (curve.memory_gb_s * 1e9)
    return max(math_s, memory_s)


def efficiency(
    m: float, n: float, k: float, flops_per_s: float, curve: GemmCurve | None, bytes_per_element: int = 2
) -> float:
    """The share of `flops_per_s` one m x n x k matmul reaches under the curve (1 with no curve)."""
    return 2.0 * m * n * k / flops_per_s / gemm_s(m, n, k, flops_per_s, curve, bytes_per_element)

