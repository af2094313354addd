"""Half-precision matmuls on an emulated rank: fp32 accumulation rounded once, as a GPU's tensor cores
compute them, and no widened copy counted against the rank's memory."""

from __future__ import annotations

import pytest
import torch

from labkit.machine.emulate import MemoryBudget
from labkit.machine.emulate.cpu_matmul import compute

aten = torch.ops.aten


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_matmul_is_the_fp32_product_rounded_once(dtype):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 96, generator=g).to(dtype), torch.randn(96, 32, generator=g).to(dtype)
    bias = torch.randn(32, generator=g).to(dtype)
    out = compute(aten.addmm.default, (bias, a, b), {})
    assert out.dtype == dtype
    assert torch.equal(out, torch.addmm(bias.float(), a.float(), b.float()).to(dtype))
    # the CPU's own half kernel gives the same product within the dtype's rounding
    assert torch.allclose(out.float(), torch.addmm(bias, a, b).float(), rtol=2e-2, atol=2e-2)


def test_batched_matmuls_keep_their_scalars():
    a, b = torch.randn(3, 8, 16).bfloat16(), torch.randn(3, 16, 4).bfloat16()
    c = torch.randn(3, 8, 4).bfloat16()
    out = compute(aten.baddbmm.default, (c, a, b), {"beta": 0.5, "alpha": 2.0})
    expected = torch.baddbmm(c.float(), a.float(), b.float(), beta=0.5, alpha=2.0).bfloat16()
    assert torch.equal(out, expected)
    assert torch.equal(compute(aten.bmm.default, (a, b), {}), torch.bmm(a.float(), b.float()).bfloat16())


def test_fp32_mixed_dtypes_and_other_operators_run_as_called():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    assert torch.equal(compute(aten.mm.default, (a, b), {}), a @ b)
    mixed = compute(aten.add.Tensor, (a.bfloat16(), b), {})
    assert mixed.dtype == torch.float32  # not a matmul: type promotion as usual


def test_a_budget_counts_the_product_not_the_widened_operands():
    a, b = torch.randn(256, 256).bfloat16(), torch.randn(256, 256).bfloat16()
    with MemoryBudget(2**30) as budget:
        out = a @ b
    assert out.dtype == torch.bfloat16
    assert budget.peak == out.numel() * out.element_size()  # 128 KiB; fp32 copies would add 768 KiB
