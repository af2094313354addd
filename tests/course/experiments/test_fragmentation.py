"""labkit.course.experiments.fragmentation: an OOM with enough memory free in total, and its fixes
(emulated)."""

from __future__ import annotations

import pytest

from labkit.course.experiments.fragmentation import ALLOCATOR_FIXES, REQUEST, fragment


@pytest.mark.parametrize("fix", [None, "empty_cache"])
def test_the_pattern_fails_with_more_memory_free_than_the_request(fix):
    r = fragment(180, fix, device="cpu")
    assert r["oom"] is not None and "Tried to allocate 40.00 MiB" in r["oom"]
    # 80 MiB free in total, twice the request, but in 20 MiB holes between live blocks
    assert (
        r["free_cached_mib"] == 80.0 and r["free_cached_mib"] > REQUEST > r["largest_free_block_mib"] == 20.0
    )
    assert r["reserved_mib"] == 160.0 and r["allocated_mib"] == 80.0
    assert "expandable_segments:True" in r["oom"]
    (segment,) = r["segments"]
    assert [used for _, _, used in segment["blocks"]] == [False, True] * 4  # the holes, drawn


@pytest.mark.parametrize("fix", ["expandable_segments", "max_split_size"])
def test_the_allocator_options_fix_it(fix):
    r = fragment(180, fix, device="cpu")
    assert r["oom"] is None, r["oom"]
    assert r["allocated_mib"] == 4 * 20 + REQUEST and r["reserved_mib"] <= 180
    assert r["what"] == ALLOCATOR_FIXES[fix] and "emulated" in r["measured_by"]


def test_bad_arguments_say_what_to_pass():
    with pytest.raises(ValueError, match="fix"):
        fragment(180, "defrag", device="cpu")
    with pytest.raises(ValueError, match="limit_mib"):
        fragment(0, device="cpu")
