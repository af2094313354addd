"""labkit.machine.emulate.allocator: the model of CUDA's caching allocator, worked by hand.

Each test names the rule of c10/cuda/CUDACachingAllocator.cpp it checks; the numbers are
worked out on paper from those rules (and, where marked, match the PyTorch devlog "When does
fragmentation occur in the CUDA caching allocator?", 2026-06-01).
"""

from __future__ import annotations

import pytest
import torch

from labkit.machine.emulate import CachingAllocator
from labkit.machine.emulate.allocator import allocation_size, format_size, round_size

KiB, MiB = 2**10, 2**20


def _blocks(alloc: CachingAllocator, i: int = 0) -> list[tuple[float, float, bool]]:
    """Segment i's blocks as (offset MiB, size MiB, allocated)."""
    return [(o / MiB, s / MiB, a) for o, s, a in alloc.segments()[i]["blocks"]]


# ------------------------------------------------------------------ sizes, pools, segments


def test_sizes_round_up_to_512_bytes():
    # round_size: multiples of kMinBlockSize (512 B), at least 512.
    assert (round_size(1), round_size(512), round_size(513)) == (512, 512, 1024)
    a = CachingAllocator(2**30)
    a.malloc(1)
    assert a.allocated == 512
    a.malloc(513)
    assert a.allocated == 512 + 1024


def test_a_small_request_is_packed_in_a_2_mib_segment():
    # get_pool: <= kSmallSize (1 MiB) is small; get_allocation_size: kSmallBuffer (2 MiB);
    # should_split in the small pool: a remainder >= 512 B is split off and cached.
    a = CachingAllocator(2**30)
    a.malloc(KiB)
    assert (a.allocated, a.reserved) == (KiB, 2 * MiB)
    assert a.segments() == [
        {
            "address": 0,
            "pool": "small",
            "expandable": False,
            "size": 2 * MiB,
            "blocks": [(0, KiB, True), (KiB, 2 * MiB - KiB, False)],
        }
    ]
    assert a.inactive_split == a.free_cached == a.largest_free_block == 2 * MiB - KiB


def test_a_3_mib_request_reserves_20_mib_whose_remainder_serves_a_5_mib_one():
    # kMinLargeAlloc: a large request under 10 MiB gets a kLargeBuffer (20 MiB) segment;
    # the 17 MiB remainder (> kSmallSize) is split off; best fit then serves 5 MiB from it.
    a = CachingAllocator(2**30)
    a.malloc(3 * MiB)
    assert (a.allocated, a.reserved) == (3 * MiB, 20 * MiB)
    assert _blocks(a) == [(0, 3, True), (3, 17, False)]
    a.malloc(5 * MiB)
    assert (a.allocated, a.reserved) == (8 * MiB, 20 * MiB)
    assert _blocks(a) == [(0, 3, True), (3, 5, True), (8, 12, False)]
    assert allocation_size(round_size(3 * MiB)) == 20 * MiB


def test_a_12_mib_request_reserves_exactly_12_mib():
    # kRoundLarge: from 10 MiB on, the segment is the request rounded up to 2 MiB.
    a = CachingAllocator(2**30)
    a.malloc(12 * MiB)
    assert (a.allocated, a.reserved) == (12 * MiB, 12 * MiB)
    # 11 MiB + 1 B rounds to a 12 MiB segment; the remainder (< 1 MiB) is not > kSmallSize, so
    # it is not split: the whole block counts as allocated (memory_allocated counts block sizes).
    a.malloc(11 * MiB + 1)
    assert (a.allocated, a.reserved) == (24 * MiB, 24 * MiB)
    assert _blocks(a, 1) == [(0, 12, True)]


def test_best_fit_takes_the_smallest_large_enough_block_then_the_lowest_address():
    # get_free_block: lower_bound in a set ordered by (size, address).
    a = CachingAllocator(2**30)
    h14, h12, h12b = a.malloc(14 * MiB), a.malloc(12 * MiB), a.malloc(12 * MiB)
    for h in (h14, h12, h12b):
        a.free(h)
    assert a.malloc(11 * MiB) == h12  # 12 fits better than 14; of the two 12s, the lower address
    assert a.malloc(12 * MiB) == h12b
    assert a.malloc(13 * MiB) == h14
    assert a.reserved == 38 * MiB  # no new segment


def test_free_merges_with_free_neighbours_of_its_segment():
    # free_block -> try_merge_blocks with prev and next when they are free.
    a = CachingAllocator(2**30)
    h = [a.malloc(4 * MiB) for _ in range(3)]
    assert _blocks(a) == [(0, 4, True), (4, 4, True), (8, 4, True), (12, 8, False)]
    a.free(h[1])
    assert _blocks(a) == [(0, 4, True), (4, 4, False), (8, 4, True), (12, 8, False)]
    assert a.inactive_split == 12 * MiB and a.largest_free_block == 8 * MiB
    a.free(h[0])
    assert _blocks(a) == [(0, 8, False), (8, 4, True), (12, 8, False)]
    a.free(h[2])
    assert _blocks(a) == [(0, 20, False)]
    assert a.inactive_split == 0  # one block again: not split


def test_free_keeps_the_segment_and_empty_cache_releases_only_entirely_free_ones():
    # Segments are given back only by release_cached_blocks (empty_cache, or before an OOM).
    a = CachingAllocator(2**30)
    keep, gone = a.malloc(3 * MiB), a.malloc(18 * MiB)  # 18 MiB does not fit the 17 MiB remainder
    a.free(gone)
    assert (a.allocated, a.reserved) == (3 * MiB, 38 * MiB)
    a.empty_cache()  # the 18 MiB segment is entirely free; the 20 MiB one holds `keep`
    assert (a.allocated, a.reserved) == (3 * MiB, 20 * MiB)
    a.free(keep)
    a.empty_cache()
    assert (a.reserved, a.segments()) == (0, [])


def test_a_new_segment_that_does_not_fit_first_releases_the_free_cached_ones():
    # malloc: alloc_block fails -> release_cached_blocks -> alloc_block again.
    a = CachingAllocator(40 * MiB)
    a.free(a.malloc(30 * MiB))
    a.malloc(34 * MiB)  # 30 + 34 > 40: the free 30 MiB segment goes back first
    assert (a.allocated, a.reserved, a.peak_reserved) == (34 * MiB, 34 * MiB, 34 * MiB)


def test_peaks_and_reset_peak():
    # increase_stat keeps the peak; resetPeakStats sets it to the current value.
    a = CachingAllocator(2**30)
    a.free(a.malloc(12 * MiB))
    a.malloc(KiB)
    assert (a.peak_allocated, a.peak_reserved) == (12 * MiB, 14 * MiB)
    a.reset_peak()
    assert (a.peak_allocated, a.peak_reserved) == (KiB, 14 * MiB)


# ------------------------------------------------------------------ fragmentation


def _every_other(a: CachingAllocator) -> None:
    """One 160 MiB block, freed (cached); 8 x 20 MiB carved from it; every other one freed."""
    a.free(a.malloc(160 * MiB))
    handles = [a.malloc(20 * MiB) for _ in range(8)]
    for h in handles[::2]:
        a.free(h)


def test_fragmentation_oom_has_enough_free_bytes_but_no_block_large_enough():
    a = CachingAllocator(160 * MiB)
    _every_other(a)
    assert (a.allocated, a.reserved, a.free_cached, a.largest_free_block) == (
        80 * MiB,
        160 * MiB,
        80 * MiB,
        20 * MiB,
    )
    assert a.inactive_split == 80 * MiB  # free, but in a split segment: release_cached_blocks can't free it
    with pytest.raises(torch.OutOfMemoryError) as info:
        a.malloc(40 * MiB)  # 80 MiB free in the cache, largest piece 20 MiB, the device full
    msg = str(info.value)
    assert (
        "Tried to allocate 40.00 MiB. GPU 0 has a total capacity of 160.00 MiB of which 0 bytes is free"
        in msg
    )
    assert "80.00 MiB is allocated by PyTorch, and 80.00 MiB is reserved by PyTorch but unallocated" in msg
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in msg
    assert "Largest free cached block: 20.00 MiB" in msg and "(emulated caching allocator)" in msg
    assert (a.allocated, a.reserved) == (80 * MiB, 160 * MiB)  # nothing changed


def test_expandable_segments_serve_the_same_sequence():
    # release_cached_blocks -> unmap_block: each freed 20 MiB block is one whole large-pool page
    # (kLargeBuffer); the 40 MiB request then maps two pages at the end of the segment.
    a = CachingAllocator(160 * MiB, expandable_segments=True)
    _every_other(a)
    assert (a.allocated, a.reserved, a.largest_free_block) == (80 * MiB, 160 * MiB, 20 * MiB)
    assert a.inactive_split == 0  # memory_stats leaves expandable segments out of it
    a.malloc(40 * MiB)
    assert (a.allocated, a.reserved, a.peak_reserved) == (120 * MiB, 120 * MiB, 160 * MiB)
    # segments() reports the mapped ranges: the pages at 0, 40, 80, 120 MiB were unmapped.
    assert [(s["address"] - a.segments()[0]["address"]) // MiB for s in a.segments()] == [0, 40, 80, 120]
    assert [s["size"] // MiB for s in a.segments()] == [20, 20, 20, 60]


def test_expandable_segments_only_return_pages_that_hold_no_allocation():
    # Ten 4 MiB blocks, every other one freed: free 4 MiB pieces never cover a whole 20 MiB page,
    # so expandable segments cannot help here either (and the message does not suggest them).
    for expandable in (False, True):
        a = CachingAllocator(40 * MiB, expandable_segments=expandable)
        handles = [a.malloc(4 * MiB) for _ in range(10)]
        for h in handles[::2]:
            a.free(h)
        assert (a.allocated, a.reserved, a.largest_free_block) == (20 * MiB, 40 * MiB, 4 * MiB)
        with pytest.raises(torch.OutOfMemoryError) as info:
            a.malloc(8 * MiB)
        assert "Tried to allocate 20.00 MiB" in str(info.value)  # allocation_size, as CUDA reports it
        assert ("expandable_segments:True" in str(info.value)) == (not expandable)


def test_expandable_pages_match_the_devlog():
    # 8 x 16 MiB in 20 MiB pages map 7 pages (140 MiB); freed, they merge into one block that
    # serves 4 x 32 MiB without mapping more. The small pool maps 2 MiB pages.
    a = CachingAllocator(2**30, expandable_segments=True)
    handles = [a.malloc(16 * MiB) for _ in range(8)]
    assert a.reserved == 140 * MiB
    for h in handles:
        a.free(h)
    assert _blocks(a) == [(0, 140, False)]
    for _ in range(4):
        a.malloc(32 * MiB)
    assert (a.allocated, a.reserved) == (128 * MiB, 140 * MiB)
    a.malloc(KiB)
    assert a.reserved == 142 * MiB


def test_allocation_order_matters_without_expandable_segments():
    # The devlog's two orders: segments never merge, so small-then-large reserves twice as much.
    small_first = CachingAllocator(2**30)
    for h in [small_first.malloc(16 * MiB) for _ in range(8)]:
        small_first.free(h)
    for _ in range(4):
        small_first.malloc(32 * MiB)
    large_first = CachingAllocator(2**30)
    for h in [large_first.malloc(32 * MiB) for _ in range(4)]:
        large_first.free(h)
    for _ in range(8):
        large_first.malloc(16 * MiB)
    assert (small_first.reserved, large_first.reserved) == (256 * MiB, 128 * MiB)


# ------------------------------------------------------------------ max_split_size


def test_max_split_size_blocks_are_not_split_nor_used_for_smaller_requests():
    plain, capped = CachingAllocator(2**30), CachingAllocator(2**30, max_split_size=32 * MiB)
    for a in (plain, capped):
        a.free(a.malloc(40 * MiB))
        a.malloc(24 * MiB)
    # get_free_block: no oversize (>= 32 MiB) block for a request below max_split_size.
    assert (plain.reserved, capped.reserved) == (40 * MiB, 64 * MiB)
    assert _blocks(plain) == [(0, 24, True), (24, 16, False)]
    for a in (plain, capped):
        a.free(a.malloc(40 * MiB))
    plain.malloc(36 * MiB)
    capped.malloc(36 * MiB)
    # should_split: a request >= max_split_size takes its block whole (allocated counts 40 MiB).
    assert (plain.allocated, capped.allocated) == (24 * MiB + 36 * MiB, 24 * MiB + 40 * MiB)


def test_max_split_size_oversize_blocks_serve_within_20_mib_and_are_released_first():
    a = CachingAllocator(80 * MiB, max_split_size=32 * MiB)
    a.free(a.malloc(60 * MiB))
    # get_free_block: 60 >= 36 + kLargeBuffer, so the cached 60 MiB block is not used; a new 36 MiB
    # segment does not fit (60 + 36 > 80); release_available_cached_blocks frees the 60 MiB one.
    a.malloc(36 * MiB)
    assert (a.allocated, a.reserved, a.peak_reserved) == (36 * MiB, 36 * MiB, 60 * MiB)
    b = CachingAllocator(2**30, max_split_size=32 * MiB)
    h = b.malloc(50 * MiB)
    b.free(h)
    assert b.malloc(36 * MiB) == h  # 50 < 36 + 20: within the rounding the source allows


# ------------------------------------------------------------------ arguments and messages


def test_arguments_are_checked_with_the_fix():
    with pytest.raises(ValueError, match=r"capacity_bytes=0 must be a positive whole number"):
        CachingAllocator(0)
    with pytest.raises(ValueError, match=r"max_split_size=10485760 must be >= 20971520"):
        CachingAllocator(2**30, max_split_size=10 * MiB)
    with pytest.raises(ValueError, match=r"expandable_segments='yes' must be one of False, True"):
        CachingAllocator(2**30, expandable_segments="yes")  # type: ignore[arg-type]
    a = CachingAllocator(2**30)
    with pytest.raises(ValueError, match=r"malloc nbytes=0"):
        a.malloc(0)
    h = a.malloc(KiB)
    a.free(h)
    with pytest.raises(ValueError, match=r"must be a live allocation"):
        a.free(h)


def test_oom_without_a_fragmented_cache_does_not_suggest_expandable_segments():
    a = CachingAllocator(32 * MiB)
    with pytest.raises(torch.OutOfMemoryError) as info:
        a.malloc(40 * MiB)
    msg = str(info.value)
    assert "Tried to allocate 40.00 MiB" in msg and "of which 32.00 MiB is free" in msg
    assert "0 bytes is reserved by PyTorch but unallocated" in msg and "expandable_segments" not in msg
    assert [format_size(n) for n in (1024, 1025, MiB, 20 * MiB, 3 * 2**29)] == [
        "1024 bytes",
        "1.00 KiB",
        "1024.00 KiB",
        "20.00 MiB",
        "1.50 GiB",
    ]
