"""A model of PyTorch's CUDA caching allocator, so an emulated GPU fragments like a real one.

`CachingAllocator` replays on a byte count (no memory is touched) the rules of
c10/cuda/CUDACachingAllocator.cpp: requests rounded to 512 B; a small pool (<= 1 MiB, 2 MiB
segments) and a large pool (a 20 MiB segment under 10 MiB, else the request rounded to 2 MiB);
best fit; splitting and merging inside a segment; cached segments given back only when a new one
would not fit or on `empty_cache()`; `max_split_size`; and `expandable_segments` (one segment per
pool, grown by mapping pages: 2 MiB in the small pool, 20 MiB in the large one, as in the source).
Its OOM reads like CUDA's. `budget.py` (`MemoryBudget(..., allocator="caching")`) mallocs every
tensor storage of a rank from it; `labkit.runtime` reads that budget. Left out: streams and events
(a free is immediate), CUDA graph / MemPool pools, garbage_collection_threshold,
roundup_power2_divisions, max_non_split_rounding_mb and large_segment_size_mb (defaults used),
memory fractions, driver and other processes' memory, and the address-space limit of an expandable
segment (unbounded here). Not thread-safe: `MemoryBudget` calls it under its lock.
"""

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
_VA_PAGES = 1 << 30  # address space of a model expandable segment, in pages ("unbounded")


def round_size(nbytes: int) -> int:
    """`round_size`: up to a multiple of kMinBlockSize (512 B), at least 512."""
    return max(kMinBlockSize, -(-nbytes // kMinBlockSize) * kMinBlockSize)


def allocation_size(size: int) -> int:
    """`get_allocation_size`: the segment cudaMalloc'ed for a rounded request no cached block fits."""
    if size <= kSmallSize:
        return kSmallBuffer
    return kLargeBuffer if size < kMinLargeAlloc else -(-size // kRoundLarge) * kRoundLarge


def format_size(nbytes: int) -> str:
    """c10's `format_size`: "1024 bytes", "1024.00 KiB", "20.00 MiB", "1.50 GiB"."""
    if nbytes <= 1024:
        return f"{nbytes} bytes"
    unit = 0 if nbytes <= 1 << 20 else 1 if nbytes <= 1 << 30 else 2
    return f"{nbytes / 2 ** (10 * unit + 10):.2f} {('KiB', 'MiB', 'GiB')[unit]}"


def _page(small: bool) -> int:
    return kSmallBuffer if small else kLargeBuffer  # find_expandable_block's segment_size


def _up(n: int, step: int) -> int:
    return -(-n // step) * step


class _Segment:
    __slots__ = ("small", "expandable", "head", "size")

    def __init__(self, small: bool, expandable: bool) -> None:
        self.small, self.expandable, self.size, self.head = small, expandable, 0, None


class _Block:
    """A `Block`: an address range of a segment; allocated or free; mapped or not (expandable)."""

    __slots__ = ("seg", "addr", "size", "allocated", "mapped", "prev", "next")

    def __init__(self, seg: _Segment, addr: int, size: int, mapped: bool = True) -> None:
        self.seg, self.addr, self.size, self.mapped, self.allocated = seg, addr, size, mapped, False
        self.prev: _Block | None = None
        self.next: _Block | None = None

    def link_after(self, other: _Block) -> None:
        other.prev, other.next = self, self.next
        if self.next is not None:
            self.next.prev = other
        self.next = other

    def unlink(self) -> None:
        if self.prev is not None:
            self.prev.next = self.next
        if self.next is not None:
            self.next.prev = self.prev


class CachingAllocator:
    """PyTorch's CUDA caching allocator on `capacity_bytes` of emulated device memory.

    `malloc(n)` returns a handle (the block's address); `free(handle)` gives it back to the cache.
    `allocated` / `reserved` (and `peak_*`, reset by `reset_peak()`) are what
    `torch.cuda.memory_allocated` / `memory_reserved` would report: bytes in allocated blocks
    (rounded sizes) and bytes in segments or mapped pages.
    """

    def __init__(self, capacity_bytes: int, *, expandable_segments: bool = False,
                 max_split_size: int | None = None, device: str = "GPU 0") -> None:
        validate.positive_int("CachingAllocator capacity_bytes", capacity_bytes, "CachingAllocator(256 * 2**20)")
        if not isinstance(expandable_segments, bool):
            raise ValueError(f"expandable_segments={expandable_segments!r} must be True or False; "
                             "e.g. CachingAllocator(n, expandable_segments=True)")
        # parseMaxSplitSize: max_split_size_mb >= kLargeBuffer / MiB.
        if max_split_size is not None and (validate.positive_int("max_split_size", max_split_size) < kLargeBuffer):
            raise ValueError(f"max_split_size={max_split_size!r} must be >= {kLargeBuffer} (20 MiB, as "
                             "max_split_size_mb in PYTORCH_CUDA_ALLOC_CONF); e.g. max_split_size=64 * 2**20")
        self.capacity_bytes, self.device = int(capacity_bytes), device
        self.expandable_segments, self.max_split_size = expandable_segments, max_split_size
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self._free: dict[bool, list[tuple[int, int, _Block]]] = {True: [], False: []}  # sorted (size, addr, block)
        self._segments: list[_Segment] = []  # cudaMalloc'ed segments
        self._expandable: dict[bool, _Segment] = {}  # small? -> that pool's expandable segment
        self._live: dict[int, _Block] = {}
        self._next_addr = 0

    def malloc(self, nbytes: int) -> int:
        """Allocate `nbytes`; returns a handle for `free`. Raises torch.OutOfMemoryError like CUDA."""
        validate.positive_int("malloc nbytes", nbytes, "allocator.malloc(4096)")
        size = round_size(nbytes)
        small = size <= kSmallSize  # get_pool
        block = self._get_free_block(small, size)
        if block is None:  # malloc: alloc_block, else release_available_cached_blocks (max_split_size
            # only) and retry, else release_cached_blocks and retry, else OOM.
            attempt = self._map_pages if self.expandable_segments else self._cuda_malloc
            block = attempt(small, size)
            if block is None and self.max_split_size is not None and not self.expandable_segments:
                block = attempt(small, size) if self._release_available_cached_blocks(small, size) else None
            if block is None:
                self.empty_cache()
                block = attempt(small, size)
            if block is None:
                raise self._oom(nbytes, size)
        rest = block.size - size  # alloc_found_block, split when should_split says so
        if ((rest >= kMinBlockSize) if small or self.expandable_segments else
                (self.max_split_size is None or size < self.max_split_size) and rest > kSmallSize):
            block.link_after(_Block(block.seg, block.addr + size, rest))
            block.size = size
            self._insert_free(block.next)  # type: ignore[arg-type]
        block.allocated = True
        self._live[block.addr] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block.addr

    def free(self, handle: int) -> None:
        """`free_block`: back to its pool's cache, merged with free neighbours; the segment stays."""
        block = self._live.pop(handle, None)
        if block is None:
            raise ValueError(f"handle={handle!r} must be a live allocation of this CachingAllocator (a "
                             "value malloc() returned, freed once); e.g. h = alloc.malloc(n); alloc.free(h)")
        block.allocated = False
        self.allocated -= block.size
        self._insert_free(self._merge(block))

    def empty_cache(self) -> None:
        """`release_cached_blocks`: give back each entirely free segment; with expandable segments,
        unmap each page that holds no allocated byte (`release_blocks`, `unmap_block`)."""
        for small in (False, True):
            for _, _, block in list(self._free[small]):
                if block.seg.expandable:
                    self._unmap_block(block)
                elif block.prev is None and block.next is None:
                    self._release_segment(block.seg)

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
        return sum(b.size for lst in self._free.values() for _, _, b in lst
                   if not b.seg.expandable and (b.prev is not None or b.next is not None))

    @property
    def largest_free_block(self) -> int:
        """The largest free cached block (`cacheInfo`), 0 when none."""
        return max((lst[-1][0] for lst in self._free.values() if lst), default=0)

    def segments(self) -> list[dict[str, Any]]:
        """By address, per segment (per mapped range of an expandable one, as `snapshot()` in the
        source): address, pool, expandable, size, and blocks as (offset, size, allocated)."""
        out = []
        for seg in self._segments + list(self._expandable.values()):
            b = seg.head
            while b is not None:
                if b.mapped:
                    base, blocks = b.addr, []
                    while b is not None and b.mapped:
                        blocks.append((b.addr - base, b.size, b.allocated))
                        b = b.next
                    out.append({"address": base, "pool": "small" if seg.small else "large", "blocks": blocks,
                                "expandable": seg.expandable, "size": sum(s for _, s, _ in blocks)})
                else:
                    b = b.next
        return sorted(out, key=lambda s: s["address"])

    # ---------------------------------------------------------------- the source's private methods
    def _get_free_block(self, small: bool, size: int) -> _Block | None:
        free = self._free[small]
        i = bisect.bisect_left(free, (size,))  # best fit: the smallest block >= size, ties by address
        if i == len(free):
            return None
        while self.expandable_segments and i + 1 < len(free) and _growable(free[i + 1][2]) < _growable(free[i][2]):
            i += 1  # a block before unmapped space counts as the size it could grow to
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
        seg = _Segment(small, expandable=False)
        seg.head, seg.size = _Block(seg, self._next_addr, nbytes), nbytes
        self._next_addr += nbytes
        self._segments.append(seg)
        self._add_reserved(nbytes)
        return seg.head

    def _release_segment(self, seg: _Segment) -> None:  # release_block: cudaFree a free segment
        self._remove_free(seg.head)
        self._segments.remove(seg)
        self.reserved -= seg.size

    def _release_available_cached_blocks(self, small: bool, size: int) -> bool:
        """The smallest oversize cached block that covers the request, else oversize blocks from the
        largest down until as many bytes are freed. (Oversize free blocks are never split.)"""
        free, key = self._free[small], max(size, self.max_split_size or 0)
        i = bisect.bisect_left(free, (key,))
        if i < len(free):
            self._release_segment(free[i][2].seg)
            return True
        released = 0
        while free and released < key and free[-1][0] >= (self.max_split_size or 0):
            released += free[-1][0]
            self._release_segment(free[-1][2].seg)
        return released >= key

    def _map_pages(self, small: bool, size: int) -> _Block | None:
        """`try_allocate_expandable_block`: at the lowest address where free and unmapped space span
        `size` (find_expandable_block), map the missing pages if the device has them; merge."""
        seg = self._expandable.get(small)
        if seg is None:
            seg = self._expandable[small] = _Segment(small, expandable=True)
            seg.head = _Block(seg, (2 + small) << 58, _page(small) * _VA_PAGES, mapped=False)
        start, b = None, seg.head
        while start is None:  # the unbounded unmapped tail always qualifies
            if not b.mapped:
                c = b.prev if b.prev is not None and not b.prev.allocated else b
                start = c if _span(c, size) >= size else None
            b = b.next
        need, covered, b = 0, 0, start
        while covered < size:
            step = b.size if b.mapped else _up(min(size - covered, b.size), _page(small))
            need, covered, b = need + (0 if b.mapped else step), covered + step, b.next
        if self.reserved + need > self.capacity_bytes:
            return None
        block = start if start.mapped else self._map_block(start, min(size, start.size))
        while block.size < size:
            block = self._map_block(block.next, min(size - block.size, block.next.size))
        self._remove_free(block)
        return block

    def _map_block(self, block: _Block, nbytes: int) -> _Block:
        """`map_block`: back the first `nbytes` (whole pages) of an unmapped block; merge; cache it."""
        n = _up(nbytes, _page(block.seg.small))
        if n < block.size:
            block.link_after(_Block(block.seg, block.addr + n, block.size - n, mapped=False))
            block.size = n
        block.mapped = True
        self._add_reserved(n)
        merged = self._merge(block)
        self._insert_free(merged)
        return merged

    def _unmap_block(self, block: _Block) -> None:
        """`unmap_block`: unmap the whole pages inside a free block; its ends stay mapped and free."""
        base, page = block.seg.head.addr, _page(block.seg.small)
        start, end = block.addr - base, block.addr - base + block.size
        lo, hi = _up(start, page), end // page * page
        if lo >= hi:
            return
        self._remove_free(block)
        if hi < end:
            block.link_after(_Block(block.seg, base + hi, end - hi))
            self._insert_free(block.next)
        hole = block
        if lo > start:
            hole = _Block(block.seg, base + lo, hi - lo)
            block.size = lo - start
            block.link_after(hole)
            self._insert_free(block)
        hole.size, hole.mapped = hi - lo, False
        self._merge(hole)
        self.reserved -= hi - lo

    def _merge(self, block: _Block) -> _Block:
        """`try_merge_blocks` with both neighbours: free, and mapped alike."""
        for other in (block.prev, block.next):
            if other is not None and not other.allocated and other.mapped == block.mapped:
                if other.mapped:
                    self._remove_free(other)
                low, high = (other, block) if other is block.prev else (block, other)
                low.size += high.size
                high.unlink()
                block = low
        return block

    def _insert_free(self, block: _Block) -> None:
        bisect.insort(self._free[block.seg.small], (block.size, block.addr, block))

    def _remove_free(self, block: _Block) -> None:
        free = self._free[block.seg.small]
        i = bisect.bisect_left(free, (block.size, block.addr))
        assert free[i][2] is block
        del free[i]

    def _add_reserved(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def _oom(self, nbytes: int, size: int) -> torch.OutOfMemoryError:
        """The message of malloc's TORCH_CHECK_WITH(OutOfMemoryError, ...), the hint only when the
        cache holds enough bytes for the request, in pieces."""
        unallocated = self.reserved - self.allocated
        hint = (" If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF="
                "expandable_segments:True to avoid fragmentation." if not self.expandable_segments
                and unallocated >= size else "")
        return torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {format_size(allocation_size(size))}. {self.device} has a "
            f"total capacity of {format_size(self.capacity_bytes)} of which "
            f"{format_size(self.capacity_bytes - self.reserved)} is free. Of the allocated memory "
            f"{format_size(self.allocated)} is allocated by PyTorch, and {format_size(unallocated)} is "
            f"reserved by PyTorch but unallocated.{hint} Largest free cached block: "
            f"{format_size(self.largest_free_block)}; request: {format_size(nbytes)}, rounded to "
            f"{format_size(size)} (emulated caching allocator)")


def _growable(block: _Block) -> int:
    """get_free_block's `expandable_size`: the block plus the unmapped range right after it."""
    nxt = block.next
    return block.size + (nxt.size if nxt is not None and not nxt.mapped else 0)


def _span(block: _Block | None, size: int) -> int:
    """find_expandable_block's `has_available_address_space`: free or unmapped bytes from `block`."""
    total = 0
    while total < size and block is not None and not block.allocated:
        total, block = total + block.size, block.next
    return total
