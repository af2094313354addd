"""A model of PyTorch's CUDA caching allocator, so an emulated GPU fragments like a real one.

`CachingAllocator` replays on a byte count (no memory is touched) the rules of
c10/cuda/CUDACachingAllocator.cpp: sizes rounded to 512 B; a small pool (<= 1 MiB, 2 MiB segments) and a large
pool (a 20 MiB segment under 10 MiB, else the size rounded to 2 MiB); best fit; split and merge inside a
segment; cached segments given back only when a new one would not fit or on `empty_cache()`; `max_split_size`;
`expandable_segments` (one segment per pool grown by mapping pages: 2 MiB in the small pool, 20 MiB in the
large one, as in the source). Its OOM reads like CUDA's. `budget.py` (`MemoryBudget(...,
allocator="caching")`) mallocs each tensor storage of a rank from it. Left out: streams and events (a free is
immediate), CUDA graph / MemPool pools, garbage_collection_threshold, roundup_power2_divisions,
max_non_split_rounding_mb and large_segment_size_mb (defaults used), memory fractions, memory of the driver or
other processes, and an expandable segment's address-space limit (none here). Not thread-safe."""

from __future__ import annotations

import bisect
from typing import Any

import torch

from labkit import validate

__all__ = ["CachingAllocator", "allocation_size", "format_size", "round_size"]

# The constants of CUDACachingAllocator.cpp, under their names there.
kMinBlockSize = 512  # all sizes are rounded to at least 512 bytes
kSmallSize = 1 << 20  # largest "small" allocation is 1 MiB
kSmallBuffer = 2 << 20  # "small" allocations are packed in 2 MiB segments
kMinLargeAlloc = 10 << 20  # allocations between 1 and 10 MiB may use kLargeBuffer
kLargeBuffer = 20 << 20  # "large" allocations may be packed in 20 MiB segments
kRoundLarge = 2 << 20  # round up large allocations to 2 MiB
_PAGE = {True: kSmallBuffer, False: kLargeBuffer}  # find_expandable_block: an expandable segment's page


def _up(n: int, step: int) -> int:
    return -(-n // step) * step


def round_size(nbytes: int) -> int:
    """`round_size`: up to a multiple of kMinBlockSize (512 B), at least 512."""
    return max(kMinBlockSize, _up(nbytes, kMinBlockSize))


def allocation_size(size: int) -> int:
    """`get_allocation_size`: the segment cudaMalloc'ed for a rounded size that no cached block fits."""
    if size <= kSmallSize:
        return kSmallBuffer
    return kLargeBuffer if size < kMinLargeAlloc else _up(size, kRoundLarge)


def format_size(nbytes: int) -> str:
    """c10's `format_size`: "1024 bytes", "1024.00 KiB", "20.00 MiB", "1.50 GiB"."""
    if nbytes <= 1024:
        return f"{nbytes} bytes"
    unit = 0 if nbytes <= 1 << 20 else 1 if nbytes <= 1 << 30 else 2
    return f"{nbytes / 2 ** (10 * unit + 10):.2f} {('KiB', 'MiB', 'GiB')[unit]}"


class _Block:
    """A `Block`: a range of a segment (a segment is its first block), allocated or free, mapped or not."""

    __slots__ = ("addr", "allocated", "expandable", "mapped", "next", "prev", "size", "small")

    def __init__(self, small: bool, expandable: bool, addr: int, size: int, mapped: bool = True) -> None:
        self.small, self.expandable, self.addr, self.size, self.mapped = small, expandable, addr, size, mapped
        self.allocated = False
        self.prev: _Block | None = None
        self.next: _Block | None = None

    def split(self, at: int) -> _Block:
        """Cut at offset `at`; returns the new block after the cut (mapped as this one)."""
        rest = _Block(self.small, self.expandable, self.addr + at, self.size - at, self.mapped)
        rest.prev, rest.next, self.size = self, self.next, at
        if self.next is not None:
            self.next.prev = rest
        self.next = rest
        return rest


class CachingAllocator:
    """PyTorch's CUDA caching allocator on `capacity_bytes` of emulated device memory.

    `malloc(n)` returns a handle (the block's address); `free(handle)` gives it back to the cache.
    `allocated`, `reserved` (and `peak_*`, reset by `reset_peak()`) are what `torch.cuda.memory_allocated` /
    `memory_reserved` would say: bytes in allocated blocks (rounded sizes), bytes in segments or mapped pages.
    """

    def __init__(
        self,
        capacity_bytes: int,
        *,
        expandable_segments: bool = False,
        max_split_size: int | None = None,
        device: str = "GPU 0",
    ) -> None:
        validate.positive_int(
            "CachingAllocator capacity_bytes", capacity_bytes, "CachingAllocator(256 * 2**20)"
        )
        validate.one_of("expandable_segments", expandable_segments, (False, True), "expandable_segments=True")
        # parseMaxSplitSize: max_split_size_mb >= kLargeBuffer / MiB.
        if (
            max_split_size is not None
            and validate.positive_int("max_split_size", max_split_size) < kLargeBuffer
        ):
            raise ValueError(
                f"max_split_size={max_split_size!r} must be >= {kLargeBuffer} (20 MiB, as "
                "max_split_size_mb in PYTORCH_CUDA_ALLOC_CONF); e.g. max_split_size=64 * 2**20"
            )
        self.capacity_bytes, self.device = int(capacity_bytes), device
        self.expandable_segments, self.max_split_size = bool(expandable_segments), max_split_size
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self._free: dict[bool, list[tuple[int, int, _Block]]] = {
            True: [],
            False: [],
        }  # sorted (size, addr, b)
        self._segments: list[_Block] = []  # cudaMalloc'ed segments (their first blocks)
        self._expandable: dict[bool, _Block] = {}  # small? -> that pool's expandable segment
        self._live: dict[int, _Block] = {}
        self._next_addr = 0

    def malloc(self, nbytes: int) -> int:
        """Allocate `nbytes`; returns a handle for `free`. Raises torch.OutOfMemoryError like CUDA."""
        validate.positive_int("malloc nbytes", nbytes, "allocator.malloc(4096)")
        size = round_size(nbytes)
        small = size <= kSmallSize  # get_pool
        block = self._get_free_block(small, size)
        if (
            block is None
        ):  # alloc_block, else release_available_cached_blocks, else release_cached_blocks, else OOM
            attempt = self._map_pages if self.expandable_segments else self._cuda_malloc
            block = attempt(small, size)
            if block is None and self._release_available_cached_blocks(small, size):
                block = attempt(small, size)
            if block is None:
                self.empty_cache()
                block = attempt(small, size)
            if block is None:
                raise self._oom(nbytes, size)
        rest = block.size - size  # alloc_found_block: split when should_split says so
        if (
            (rest >= kMinBlockSize)
            if small or self.expandable_segments
            else (self.max_split_size is None or size < self.max_split_size) and rest > kSmallSize
        ):
            self._insert_free(block.split(size))
        block.allocated = True
        self._live[block.addr] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block.addr

    def free(self, handle: int) -> None:
        """`free_block`: back to its pool's cache, merged with free neighbours; the segment stays."""
        block = self._live.pop(handle, None)
        if block is None:
            raise ValueError(
                f"handle={handle!r} must be a live allocation of this CachingAllocator (a "
                "value malloc() returned, freed once); e.g. h = alloc.malloc(n); alloc.free(h)"
            )
        block.allocated = False
        self.allocated -= block.size
        self._insert_free(self._merge(block))

    def empty_cache(self) -> None:
        """`release_cached_blocks`: free each entirely free segment, or unmap each page with no allocation."""
        for small in (False, True):
            for _, _, block in list(self._free[small]):
                if block.expandable:
                    self._unmap_block(block)
                elif block.prev is None and block.next is None:
                    self._release_segment(block)

    def reset_peak(self) -> None:
        """`resetPeakStats`: the peaks back to the current values."""
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    @property
    def free_cached(self) -> int:
        """Reserved but unallocated bytes."""
        return self.reserved - self.allocated

    @property
    def inactive_split(self) -> int:
        """Free bytes in split segments (memory_stats "inactive_split_bytes"; not expandable, as there)."""
        return sum(
            b.size
            for lst in self._free.values()
            for _, _, b in lst
            if not b.expandable and (b.prev is not None or b.next is not None)
        )

    @property
    def largest_free_block(self) -> int:
        """The largest free cached block (`cacheInfo`), 0 when none."""
        return max((lst[-1][0] for lst in self._free.values() if lst), default=0)

    def segments(self) -> list[dict[str, Any]]:
        """Per segment (an expandable one: per mapped range, as `snapshot()`): address, pool, size, blocks."""
        out = []
        for b in self._segments + list(self._expandable.values()):
            pool, expandable = "small" if b.small else "large", b.expandable
            while b is not None:
                base, blocks = b.addr, []
                while b is not None and b.mapped:
                    blocks.append((b.addr - base, b.size, b.allocated))
                    b = b.next
                if blocks:
                    out.append(
                        {
                            "address": base,
                            "pool": pool,
                            "expandable": expandable,
                            "size": sum(n for _, n, _ in blocks),
                            "blocks": blocks,
                        }
                    )
                b = b.next if b is not None else None
        return sorted(out, key=lambda seg: seg["address"])

    # ---------------------------------------------------------------- the source's private methods
    def _get_free_block(self, small: bool, size: int) -> _Block | None:
        free = self._free[small]
        i = bisect.bisect_left(free, (size,))  # best fit: the smallest block >= size, ties by address
        if i == len(free):
            return None

        def grow(b: _Block) -> int:  # expandable_size: a block counts with the unmapped range after it
            return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)

        while self.expandable_segments and i + 1 < len(free) and grow(free[i + 1][2]) < grow(free[i][2]):
            i += 1
        block, ms = free[i][2], self.max_split_size
        # No oversize block (>= max_split_size) for a request below it; an oversize one only within
        # kLargeBuffer (max_non_split_rounding_mb's default) of the request.
        if ms is not None and (size < ms <= block.size or (size >= ms and block.size >= size + kLargeBuffer)):
            return None
        del free[i]
        return block

    def _cuda_malloc(self, small: bool, size: int) -> _Block | None:
        """`alloc_block`: a new segment of allocation_size(size), if the device has room."""
        nbytes = allocation_size(size)
        if self.reserved + nbytes > self.capacity_bytes:
            return None
        self._segments.append(_Block(small, False, self._next_addr, nbytes))
        self._next_addr, self.reserved = self._next_addr + nbytes, self.reserved + nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return self._segments[-1]

    def _release_segment(self, head: _Block) -> None:  # release_block: cudaFree an entirely free segment
        self._remove_free(head)
        self._segments.remove(head)
        self.reserved -= head.size

    def _release_available_cached_blocks(self, small: bool, size: int) -> bool:
        """The smallest oversize cached block covering the request, else the largest ones until as many
        bytes."""
        ms = self.max_split_size
        if ms is None or self.expandable_segments:  # unset; expandable blocks are never released here
            return False
        free, key = self._free[small], max(size, ms)
        i = bisect.bisect_left(free, (key,))
        if i < len(free):
            self._release_segment(free[i][2])
            return True
        released = 0
        while free and released < key and free[-1][0] >= ms:
            released += free[-1][0]
            self._release_segment(free[-1][2])
        return released >= key

    def _map_pages(self, small: bool, size: int) -> _Block | None:
        """`try_allocate_expandable_block`: map the missing pages at the lowest address that fits."""
        if small not in self._expandable:  # one segment per pool, with "unbounded" address space
            self._expandable[small] = _Block(small, True, (2 + small) << 58, _PAGE[small] << 30, mapped=False)
        start, b = None, self._expandable[small]
        while start is None and b is not None:  # find_expandable_block: an unmapped block (or the free
            # one before it) from which free and unmapped blocks span `size`; the unmapped tail does
            c = b.prev if b.prev is not None and not b.prev.allocated else b
            span, d = 0, c
            while not b.mapped and span < size and d is not None and not d.allocated:
                span, d = span + d.size, d.next
            start, b = (c if span >= size else None), b.next
        assert start is not None
        block = start if start.mapped else self._map_block(start, min(size, start.size))
        while block is not None and block.size < size and block.next is not None:
            block = self._map_block(block.next, min(size - block.size, block.next.size))
        if block is not None:  # on a failure, the pages mapped so far stay mapped (and cached)
            self._remove_free(block)
        return block

    def _map_block(self, block: _Block, nbytes: int) -> _Block | None:
        """`map_block`: back the first `nbytes` (whole pages) of an unmapped block if the device has them."""
        n = _up(nbytes, _PAGE[block.small])
        if self.reserved + n > self.capacity_bytes:
            return None
        if n < block.size:
            block.split(n)  # the rest stays unmapped
        block.mapped, self.reserved = True, self.reserved + n
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        merged = self._merge(block)
        self._insert_free(merged)
        return merged

    def _unmap_block(self, block: _Block) -> None:
        """`unmap_block`: unmap the whole pages inside a free block; its ends stay mapped and free."""
        base, page = (2 + block.small) << 58, _PAGE[block.small]
        start, end = block.addr - base, block.addr - base + block.size
        lo, hi = _up(start, page), end // page * page
        if lo >= hi:
            return
        self._remove_free(block)
        hole = block.split(lo - start) if lo > start else block
        if hi < end:
            self._insert_free(hole.split(hi - lo))
        if hole is not block:
            self._insert_free(block)
        hole.mapped = False
        self._merge(hole)
        self.reserved -= hi - lo

    def _merge(self, block: _Block) -> _Block:
        """`try_merge_blocks` with both neighbours: free, and mapped alike."""
        for other in (block.prev, block.next):
            if other is not None and not other.allocated and other.mapped == block.mapped:
                if other.mapped:
                    self._remove_free(other)
                low, high = (other, block) if other is block.prev else (block, other)
                low.size, low.next = low.size + high.size, high.next
                if high.next is not None:
                    high.next.prev = low
                block = low
        return block

    def _insert_free(self, block: _Block) -> None:
        bisect.insort(self._free[block.small], (block.size, block.addr, block))

    def _remove_free(self, block: _Block) -> None:
        free = self._free[block.small]
        i = bisect.bisect_left(free, (block.size, block.addr))
        assert free[i][2] is block
        del free[i]

    def _oom(self, nbytes: int, size: int) -> torch.OutOfMemoryError:
        """malloc's OutOfMemoryError; the hint only when the cache holds the request's bytes, in pieces."""
        unallocated = self.reserved - self.allocated
        hint = (
            " If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
            if not self.expandable_segments and unallocated >= size
            else ""
        )
        return torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {format_size(allocation_size(size))}. {self.device} has "
            f"a total capacity of {format_size(self.capacity_bytes)} of which "
            f"{format_size(self.capacity_bytes - self.reserved)} is free. Of the allocated memory "
            f"{format_size(self.allocated)} is allocated by PyTorch, and {format_size(unallocated)} is "
            f"reserved by PyTorch but unallocated.{hint} Largest free cached block: "
            f"{format_size(self.largest_free_block)}; request: {format_size(nbytes)}, rounded to "
            f"{format_size(size)} (emulated caching allocator)"
        )
