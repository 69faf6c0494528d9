"""The caching allocator's rules (course_lib.caching_allocator) against consequences derived by hand from
c10/cuda/CUDACachingAllocator.cpp: rounding, the two pools and their segments, best fit, splits, merges,
one pool per stream, and the release-and-retry of a failed cudaMalloc."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from course_lib.caching_allocator import (
    EMPTY_CACHE,
    AllocatorOutOfMemory,
    CachingAllocator,
    KiB,
    MiB,
    concatenated,
    replay,
    round_size,
    segment_size,
)


def test_a_tiny_request_reserves_one_small_segment():
    a = CachingAllocator()
    a.malloc(1 * KiB)
    assert (a.allocated, a.reserved) == (1 * KiB, 2 * MiB)
    a.malloc(1)  # rounded to 512 bytes, from the same segment
    assert (a.allocated, a.reserved) == (1 * KiB + 512, 2 * MiB)


def test_two_600_kib_requests_share_a_small_segment_and_a_third_needs_another():
    a = CachingAllocator()
    a.malloc(600 * KiB)
    a.malloc(600 * KiB)
    assert a.reserved == 2 * MiB
    a.malloc(1 * MiB)  # 2 MiB - 1200 KiB = 848 KiB left: too little
    assert a.reserved == 4 * MiB


def test_a_5_mib_request_gets_a_20_mib_segment_whose_rest_serves_the_next():
    a = CachingAllocator()
    a.malloc(5 * MiB)
    assert (a.allocated, a.reserved) == (5 * MiB, 20 * MiB)
    a.malloc(5 * MiB)
    a.malloc(5 * MiB)
    assert (a.allocated, a.reserved) == (15 * MiB, 20 * MiB)
    a.malloc(5 * MiB)  # the last 5 MiB of the segment, exactly
    assert (a.allocated, a.reserved, a.stats().segments) == (20 * MiB, 20 * MiB, 1)


def test_a_large_block_is_handed_out_whole_when_1_mib_or_less_would_remain():
    a = CachingAllocator()
    a.malloc(19 * MiB + 512)  # at least 10 MiB: rounded up to 2 MiB, a 20 MiB segment
    assert a.reserved == 20 * MiB and a.allocated == 20 * MiB  # 1 MiB - 512 remaining: not split


def test_large_requests_get_their_size_rounded_to_2_mib():
    a = CachingAllocator()
    a.malloc(12 * MiB)
    assert a.reserved == 12 * MiB
    a.malloc(10 * MiB + 1)
    assert a.reserved == 24 * MiB


def test_a_freed_block_is_reused_and_nothing_goes_back_to_the_driver():
    a = CachingAllocator()
    h = a.malloc(12 * MiB)
    a.free(h)
    assert (a.allocated, a.reserved) == (0, 12 * MiB)
    a.malloc(8 * MiB)  # best fit: the cached 12 MiB block, split (4 MiB remain)
    assert (a.allocated, a.reserved) == (8 * MiB, 12 * MiB)
    a.malloc(4 * MiB)
    assert a.reserved == 12 * MiB


def test_best_fit_takes_the_smallest_block_that_fits():
    a = CachingAllocator()
    big, small = a.malloc(40 * MiB), a.malloc(12 * MiB)
    a.free(big)
    a.free(small)
    a.malloc(11 * MiB)  # the 12 MiB block (1 MiB left: not split), not the 40 MiB one
    assert a.allocated == 12 * MiB
    a.malloc(30 * MiB)
    assert a.reserved == 52 * MiB


def test_freed_neighbours_merge_into_one_block():
    a = CachingAllocator()
    handles = [a.malloc(5 * MiB) for _ in range(4)]  # one 20 MiB segment
    for h in handles:
        a.free(h)
    a.malloc(18 * MiB)  # fits only if the four blocks merged back
    assert (a.reserved, a.stats().segments) == (20 * MiB, 1)


def test_each_stream_has_its_own_cached_blocks():
    a = CachingAllocator()
    a.free(a.malloc(12 * MiB, stream=0))
    a.malloc(12 * MiB, stream=1)
    assert a.reserved == 24 * MiB
    a.malloc(12 * MiB, stream=0)
    assert a.reserved == 24 * MiB


def test_a_failed_cudamalloc_releases_the_cached_segments_and_retries():
    a = CachingAllocator(capacity=30 * MiB)
    a.free(a.malloc(12 * MiB))
    a.malloc(16 * MiB)  # 12 cached + 16 = 28 <= 30: the cache stays
    assert a.reserved == 28 * MiB
    b = CachingAllocator(capacity=30 * MiB)
    b.free(b.malloc(20 * MiB))
    b.malloc(24 * MiB)  # 20 + 24 > 30: the cached 20 MiB goes back, then 24 MiB fits
    assert (b.reserved, b.stats().oom_retries) == (24 * MiB, 1)
    with pytest.raises(AllocatorOutOfMemory):
        b.malloc(8 * MiB)  # 24 allocated + a 20 MiB segment > 30, nothing cached to release


def test_a_partly_used_segment_is_not_released():
    a = CachingAllocator(capacity=40 * MiB)
    a.malloc(5 * MiB)
    a.free(a.malloc(5 * MiB))  # its segment still holds the first block
    with pytest.raises(AllocatorOutOfMemory):
        a.malloc(22 * MiB)
    a.empty_cache()
    assert a.reserved == 20 * MiB


def test_max_split_size_keeps_oversized_blocks_whole():
    a = CachingAllocator(max_split_size=32 * MiB)
    a.free(a.malloc(64 * MiB))
    a.malloc(8 * MiB)  # below max_split_size: never takes the 64 MiB block
    assert a.reserved == 84 * MiB
    a.malloc(50 * MiB)  # at or above it: takes a block at most 20 MiB bigger, whole
    assert a.reserved == 84 * MiB and a.allocated == 8 * MiB + 64 * MiB


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 30 * MiB), st.booleans()), min_size=1, max_size=40))
def test_reserved_covers_allocated_and_the_rules_hold(requests):
    """After any stream of requests and frees: reserved >= allocated >= what was asked, each block is
    the request rounded (or the whole block when the rest is too small to split), reserved is whole
    segments, and freeing everything then empty_cache gives every byte back."""
    a = CachingAllocator()
    live = []
    for nbytes, free_one in requests:
        live.append((a.malloc(nbytes), nbytes))
        if free_one and len(live) > 1:
            a.free(live.pop(0)[0])
        asked = sum(round_size(n) for _, n in live)
        assert a.reserved >= a.allocated >= asked
        assert a.peak_reserved >= a.reserved and a.peak_allocated >= a.allocated
    assert a.reserved == sum(a.segment_bytes.values())
    for handle, _ in live:
        a.free(handle)
    a.empty_cache()
    assert (a.allocated, a.reserved) == (0, 0)


def test_segment_sizes_at_each_boundary():
    assert [segment_size(round_size(n)) for n in (1, 1 * MiB, 1 * MiB + 1, 10 * MiB - 512, 10 * MiB, 10 * MiB + 1)] == [
        2 * MiB,
        2 * MiB,
        20 * MiB,
        20 * MiB,
        10 * MiB,
        12 * MiB,
    ]


def test_replay_frees_by_index():
    stats = replay([5 * MiB, ~0, 5 * MiB, 12 * MiB])  # the 12 MiB request takes the segment's other 15 MiB
    assert (stats.peak_allocated, stats.peak_reserved) == (17 * MiB, 20 * MiB)
    assert replay([5 * MiB, 16 * MiB]).peak_reserved == 36 * MiB


def test_replay_empties_the_cache_where_the_stream_says():
    assert replay([20 * MiB, ~0, 30 * MiB]).peak_reserved == 50 * MiB  # the 20 MiB segment stays cached
    emptied = replay([20 * MiB, 4 * MiB, ~0, EMPTY_CACHE, 30 * MiB])
    assert (emptied.peak_reserved, emptied.reserved) == (
        50 * MiB,
        20 * MiB + 30 * MiB,
    )  # the 4 MiB block's segment stays
    assert replay([20 * MiB, ~0, EMPTY_CACHE, 30 * MiB]).peak_reserved == 30 * MiB


def test_concatenated_streams_shift_frees_past_an_empty_allocation_too():
    # an empty request (0 bytes, torch.empty(0)) is an allocation: it counts among those made before
    assert concatenated([8, ~0], [0, ~0]) == [8, ~0, 0, ~1]
    assert concatenated([0], [0, 4, ~1, ~0]) == [0, 0, 4, ~2, ~1]
    assert concatenated([8, EMPTY_CACHE], [EMPTY_CACHE, 0, ~0]) == [8, EMPTY_CACHE, EMPTY_CACHE, 0, ~1]
