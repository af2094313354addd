"""Named phases of a training step (data loading, forward, logging, ...), visible in every trace.

`phase("data")` marks a region three ways at once: a `torch.profiler.record_function` named
"phase:data" (the host trace), an NVTX range on a GPU (what Nsight Systems shows), and, on the
emulated cluster's virtual clock, a span on the rank's device timeline (`device.py` writes it in
a lane of its own), so that `analyze.py` can say how long each phase took in the time the step is
measured in. PyTorch's own DataLoader already names its batches in host traces
("enumerate(DataLoader)#..."); `analyze` reads those too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch.profiler import record_function

from labkit.machine import runtime, timer

__all__ = ["PHASE_CATEGORY", "PHASE_PREFIX", "phase"]

PHASE_PREFIX = "phase:"
PHASE_CATEGORY = "labkit_phase"  # the device timeline's phase events (not compute, not comm)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark the work inside the block as phase `name` in the host trace, NVTX and the device timeline."""
    clock = timer.virtual_clock()
    nvtx = None
    if runtime.on_gpu():
        import torch

        nvtx = torch.cuda.nvtx
        nvtx.range_push(name)
    t0 = clock.now() if clock is not None else 0.0
    try:
        with record_function(PHASE_PREFIX + name):
            yield
    finally:
        if clock is not None:
            clock.log_phase(name, t0, clock.now())
        if nvtx is not None:
            nvtx.range_pop()
