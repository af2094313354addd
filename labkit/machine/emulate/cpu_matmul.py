"""Half-precision matmuls on an emulated rank, computed the way a GPU computes them: fp32 accumulation.

Under bf16 autocast a rank's linear layers run as `mm`, `addmm`, `bmm` and `baddbmm` on bf16 tensors. A GPU
runs those on its tensor cores: bf16 operands, products summed in fp32, the result rounded to bf16 once
(cuBLAS's `CUBLAS_COMPUTE_32F` for bf16 GEMMs; PyTorch's notes, "Reduced Precision Reduction in FP16 and BF16
GEMMs", on the split-K exception). A CPU without bf16 units runs them in a slow fallback kernel instead:
on this project's 2-core CI machine (AMD EPYC, no AVX512-BF16) a 4096 x 128 x 512 matmul took 410 ms in
bf16 against 11 ms in fp32, and a forward and backward of lab 02's model under autocast 2.8 s against 0.3 s.
The emulated clock counts CPU time, so that fallback also made a bf16 step look ten times slower than an
fp32 one, where a GPU makes it faster.

`compute` runs such a matmul as the GPU does: the operands (exact in fp32) are widened, multiplied in
fp32 and the result is rounded to their dtype. Only the four matmuls with every tensor operand a CPU tensor
of one half dtype are rerouted; everything else runs as called. The widened copies are temporaries of the
operator, not tensors of the rank, so a memory budget that calls `compute` never counts them (on a GPU the
accumulator lives in registers).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["compute"]

_aten = torch.ops.aten
_MATMULS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default}
_HALF = {torch.bfloat16, torch.float16}


def _half_dtype(args: tuple) -> torch.dtype | None:
    """The one half dtype of the operator's tensor arguments, all on the CPU; else None."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1 or any(t.device.type != "cpu" for t in tensors):
        return None
    (dtype,) = dtypes
    return dtype if dtype in _HALF else None


def compute(func: Any, args: tuple, kwargs: dict) -> Any:
    """`func(*args, **kwargs)`, with a half-precision CPU matmul accumulated in fp32 and rounded once."""
    dtype = _half_dtype(args) if func in _MATMULS else None
    if dtype is None:
        return func(*args, **kwargs)
    wide = tuple(a.float() if isinstance(a, torch.Tensor) else a for a in args)
    return func(*wide, **kwargs).to(dtype)
