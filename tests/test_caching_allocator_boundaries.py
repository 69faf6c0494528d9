"""The caching allocator's rules exactly at each of their thresholds (course_lib.caching_allocator):
512 bytes left in a small block, a 1 MiB request, a request at `max_split_size`, a block exactly 20 MiB
bigger than it, and a new segment that fills the capacity exactly."""

from __future__ import annotations

import pytest

from course_lib.caching_allocator import (
    LARGE_BUFFER,
    MIN_BLOCK,
    SMALL_SIZE,
    AllocatorOutOfMemory,
    CachingAllocator,
    MiB,
    round_size,
    stream_slack,
)

LIMIT = 32 * MiB  # max_split_size in these tests


def test_an_empty_request_still_takes_the_minimum_block():
    assert round_size(0) == MIN_BLOCK


def test_a_small_block_is_split_when_exactly_512_bytes_remain():
    a = CachingAllocator()
    a.malloc(SMALL_SIZE)  # the first half of a 2 MiB small segment
    a.malloc(SMALL_SIZE - MIN_BLOCK)  # leaves exactly 512 bytes: split, those stay cached
    assert a.allocated == 2 * SMALL_SIZE - MIN_BLOCK


def test_a_1_mib_request_belongs_to_the_small_pool():
    a = CachingAllocator()
    a.malloc(SMALL_SIZE)
    assert a.allocated == SMALL_SIZE  # split in the small pool: the other 1 MiB stays cached
    a.malloc(SMALL_SIZE)
    assert a.reserved == 2 * MiB  # the second one takes that other half


def test_a_request_at_max_split_size_takes_a_bigger_block_whole():
    a = CachingAllocator(max_split_size=LIMIT)
    a.free(a.malloc(LIMIT + 8 * MiB))
    a.malloc(LIMIT)  # at the limit: the cached 40 MiB block (less than 20 MiB bigger), not split
    assert (a.reserved, a.allocated) == (LIMIT + 8 * MiB, LIMIT + 8 * MiB)


def test_a_request_below_max_split_size_never_takes_a_block_of_exactly_that_size():
    a = CachingAllocator(max_split_size=LIMIT)
    a.free(a.malloc(LIMIT))
    a.malloc(8 * MiB)  # the cached block is max_split_size itself: oversized, a new segment
    assert a.reserved == LIMIT + LARGE_BUFFER


def test_a_request_at_max_split_size_refuses_a_block_20_mib_bigger_or_more():
    for cached in (LIMIT + LARGE_BUFFER, 2 * LIMIT):  # exactly 20 MiB bigger, and well beyond
        a = CachingAllocator(max_split_size=LIMIT)
        a.free(a.malloc(cached))
        a.malloc(LIMIT)
        assert a.reserved == cached + LIMIT  # a new segment of its own size


def test_a_segment_that_fills_the_capacity_exactly_needs_no_release():
    a = CachingAllocator(capacity=12 * MiB)
    a.malloc(12 * MiB)
    assert (a.reserved, a.stats().oom_retries) == (12 * MiB, 0)


def test_after_the_release_a_segment_that_fills_the_capacity_exactly_fits():
    a = CachingAllocator(capacity=24 * MiB)
    a.free(a.malloc(20 * MiB))
    a.malloc(24 * MiB)  # 20 + 24 > 24: release the cached 20 MiB, then 24 == capacity fits
    assert (a.reserved, a.stats().oom_retries) == (24 * MiB, 1)
    with pytest.raises(AllocatorOutOfMemory):
        a.malloc(MIN_BLOCK)  # one byte past it does not


def test_the_slack_is_never_negative():
    assert stream_slack([MIN_BLOCK], peak=4 * MiB) == 0  # the step reserved 2 MiB, less than the peak
