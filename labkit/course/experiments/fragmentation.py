"""Lab 02's fragmentation section: an out-of-memory error while enough memory is free in total.

`fragment(limit_mib, fix=...)` replays, with real tensors, an allocation pattern that leaves the
caching allocator's free memory in holes too small for the next request:

1. a large temporary (e.g. a long sequence's logits) is allocated and freed: its segment stays
   cached, as the caching allocator keeps freed blocks for reuse (PyTorch docs, CUDA semantics,
   "Memory management");
2. smaller tensors are carved out of that cached block (best fit, split), and every other one is
   freed: free bytes in total are plenty, but in separate holes between live blocks;
3. a request larger than any hole needs a new segment, which the limit cannot hold, and no cached
   segment is entirely free to give back: `torch.OutOfMemoryError`.

On a GPU it runs on CUDA's allocator, capped at `limit_mib` above what the process already holds
(`labkit.machine.device_memory.memory_limit`); on the CPU, inside a `MemoryBudget` with the allocator model of
`labkit.machine.emulate.allocator`. The fixes are the allocator options of PYTORCH_CUDA_ALLOC_CONF
(`expandable_segments:True`, `max_split_size_mb`); `empty_cache()` is shown not to help. Each run
returns the allocator's numbers (net of what the process held before) and its segments.
"""

from __future__ import annotations

import gc
from typing import Any

import torch

from labkit import validate
from labkit.machine import _torch_compat as compat
from labkit.machine import device_memory, runtime
from labkit.machine.emulate import CachingAllocator, MemoryBudget

__all__ = ["ALLOCATOR_FIXES", "fragment"]

MiB = 2**20
# fix -> what it changes (PYTORCH_CUDA_ALLOC_CONF options from the PyTorch docs, "Optimizing memory usage
# with PYTORCH_CUDA_ALLOC_CONF").
ALLOCATOR_FIXES = {
    None: "as written",
    "empty_cache": "torch.cuda.empty_cache() first",
    "expandable_segments": "expandable_segments:True",
    "max_split_size": "max_split_size_mb:100",
}
# The pattern, in MiB: one temporary of TEMP, PIECES tensors of PIECE (every other one freed), then REQUEST.
TEMP, PIECE, PIECES, REQUEST = 160, 20, 8, 40


def _tensor(mib: int, device: torch.device) -> torch.Tensor:
    return torch.empty(mib * MiB // 4, dtype=torch.float32, device=device)


def _pattern(fix: str | None, device: torch.device, empty_cache) -> tuple[list[torch.Tensor], str | None]:
    """Run the allocations; return the tensors still alive and the OOM message (None if it fit)."""
    kept: list[torch.Tensor] = []
    try:
        temp = _tensor(TEMP, device)
        del temp  # cached, not returned
        pieces = [_tensor(PIECE, device) for _ in range(PIECES)]  # carved out of the cached block
        kept = pieces[1::2]
        del pieces  # every other piece is freed: holes of PIECE MiB between live ones
        gc.collect()
        if fix == "empty_cache":
            empty_cache()
        kept.append(_tensor(REQUEST, device))
        return kept, None
    except torch.OutOfMemoryError as err:
        return kept, str(err)


def _cuda_segments() -> list[dict[str, Any]]:
    """`torch.cuda.memory_snapshot()` in the shape of `CachingAllocator.segments()`."""
    out = []
    for seg in torch.cuda.memory_snapshot():
        offset, blocks = 0, []
        for b in seg["blocks"]:
            blocks.append((offset, b["size"], b["state"] == "active_allocated"))
            offset += b["size"]
        out.append(
            {
                "address": seg["address"],
                "pool": seg.get("segment_type", "large"),
                "expandable": bool(seg.get("is_expandable", False)),
                "size": seg["total_size"],
                "blocks": blocks,
            }
        )
    return out


def _stats(allocated: int, reserved: int, segments: list[dict[str, Any]]) -> dict[str, Any]:
    free_blocks = [n for s in segments for _, n, used in s["blocks"] if not used]
    return {
        "allocated_mib": allocated / MiB,
        "reserved_mib": reserved / MiB,
        "free_cached_mib": (reserved - allocated) / MiB,
        "largest_free_block_mib": max(free_blocks, default=0) / MiB,
        "segments": segments,
    }


def _on_cpu(limit_mib: int, fix: str | None) -> dict[str, Any]:
    allocator = CachingAllocator(
        limit_mib * MiB,
        expandable_segments=fix == "expandable_segments",
        max_split_size=100 * MiB if fix == "max_split_size" else None,
        device="the emulated GPU",
    )
    with MemoryBudget(limit_mib * MiB, allocator=allocator):
        kept, oom = _pattern(fix, torch.device("cpu"), allocator.empty_cache)
        result = _stats(allocator.allocated, allocator.reserved, allocator.segments())
        del kept
    return {**result, "oom": oom, "measured_by": "labkit's model of the caching allocator (emulated)"}


def _on_gpu(limit_mib: int, fix: str | None, device: torch.device) -> dict[str, Any]:
    settings = {"expandable_segments": "expandable_segments:True", "max_split_size": "max_split_size_mb:100"}
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    # what this process already holds (cuBLAS workspaces, earlier cells' tensors): not the pattern's
    base, base_allocated = torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)
    if fix in settings:
        compat.set_cuda_allocator_settings(settings[fix])
    try:
        with device_memory.memory_limit(limit_mib * MiB, device=device):
            kept, oom = _pattern(fix, device, torch.cuda.empty_cache)
            segments = [s for s in _cuda_segments() if s["pool"] == "large"]
            result = _stats(
                torch.cuda.memory_allocated(device) - base_allocated,
                torch.cuda.memory_reserved(device) - base,
                segments,
            )
            del kept
    finally:
        if fix in settings:
            # back to the defaults; max_split_size has no "unlimited" word: the largest value is (c10's
            # parseMaxSplitSize clamps to SIZE_MAX / MiB)
            compat.set_cuda_allocator_settings(
                "max_split_size_mb:17592186044415" if fix == "max_split_size" else "expandable_segments:False"
            )
        gc.collect()
        torch.cuda.empty_cache()
    return {**result, "oom": oom, "measured_by": "torch.cuda (the real caching allocator)"}


def fragment(
    limit_mib: int = 180, fix: str | None = None, *, device: torch.device | str | None = None
) -> dict[str, Any]:
    """Run the fragmenting pattern under `limit_mib` of memory, with one of `ALLOCATOR_FIXES`.

    Returns {"oom": the error message or None, "allocated_mib", "reserved_mib", "free_cached_mib",
    "largest_free_block_mib" (after the pattern, or at the failure), "segments" (per segment: size
    and blocks as (offset, size, allocated)), "fix", "what" (the fix in words), "measured_by"}.
    At the default 180 MiB the pattern as written fails with 80 MiB free in 20 MiB holes.
    """
    validate.one_of("fragment fix", fix, tuple(ALLOCATOR_FIXES), 'fragment(180, fix="expandable_segments")')
    validate.positive_int("fragment limit_mib", limit_mib, "fragment(180)")
    dev = torch.device(device) if device is not None else runtime.device()
    result = _on_gpu(limit_mib, fix, dev) if dev.type == "cuda" else _on_cpu(limit_mib, fix)
    return {**result, "fix": fix, "what": ALLOCATOR_FIXES[fix]}
