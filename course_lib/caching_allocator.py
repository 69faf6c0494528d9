"""PyTorch's CUDA caching allocator as rules over a sequence of requests and frees: what
`torch.cuda.max_memory_allocated` and `max_memory_reserved` would show (lesson 1, "the planner";
lesson 4, "the simulator"). Every number it returns is *simulated*.

The rules, from c10/cuda/CUDACachingAllocator.cpp and c10/core/AllocatorConfig.h
(docs/references.md#torch-2130-c10cudacudacachingallocatorcpp-block-rounding), with the default
configuration (no PYTORCH_CUDA_ALLOC_CONF):

- a request is rounded up to a multiple of 512 bytes (kMinBlockSize);
- requests up to 1 MiB (kSmallSize) use the small pool, larger ones the large pool; each stream has
  its own blocks: a block freed on one stream is reused only by that stream;
- a request takes the smallest cached free block of its pool and stream that is big enough
  (best fit); with `max_split_size` set, a request below it never takes a block of that size or more,
  and a request at or above it takes a block at most 20 MiB bigger;
- a block bigger than the request is split: in the small pool when 512 bytes or more remain, in the
  large pool when the request is below `max_split_size` and more than 1 MiB remains (else the whole
  block is handed out, and counted as allocated);
- with no cached block, a new segment is made (cudaMalloc): 2 MiB for a small request, 20 MiB for a
  request under 10 MiB (kMinLargeAlloc), else the request rounded up to 2 MiB (kRoundLarge);
- a freed block is merged with its free neighbours in the segment and returns to its pool: nothing
  goes back to the driver, except by `empty_cache` or when a cudaMalloc fails: then every cached
  segment with nothing allocated in it is released and the cudaMalloc retried once; only if that
  fails too is it an out-of-memory error.

Not modelled: expandable segments (off by default), `garbage_collection_threshold` (off by default,
and only with a memory fraction set), `roundup_power2_divisions` (off by default), CUDA graphs'
private pools, and `record_stream` (a block used on another stream waits for it).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from course_lib.validate import checked

KiB, MiB = 1024, 1024 * 1024
MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 * MiB  # kSmallSize: the largest request of the small pool
SMALL_BUFFER = 2 * MiB  # kSmallBuffer: a small pool segment
LARGE_BUFFER = 20 * MiB  # kLargeBuffer: the segment of a large request under kMinLargeAlloc
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc
ROUND_LARGE = 2 * MiB  # kRoundLarge


def round_size(nbytes: int) -> int:
    """The bytes the allocator hands out for a request of `nbytes` (lessons 1 and 4)."""
    return max(MIN_BLOCK, -(-int(nbytes) // MIN_BLOCK) * MIN_BLOCK)


@checked
def segment_size(block: int) -> int:
    """The bytes a new cudaMalloc segment takes for a rounded request the cache cannot serve
    (`get_allocation_size`; lessons 1 and 4)."""
    if block <= SMALL_SIZE:
        return SMALL_BUFFER
    if block < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-block // ROUND_LARGE) * ROUND_LARGE


class AllocatorOutOfMemory(RuntimeError):
    """A cudaMalloc failed even after the cached segments were released (lessons 1 and 4)."""

    def __init__(self, requested: int, reserved: int, capacity: int) -> None:
        super().__init__(
            f"a new segment of {requested:,} bytes does not fit: {reserved:,} of {capacity:,} "
            "bytes reserved after releasing the cached segments"
        )
        self.requested, self.reserved, self.capacity = requested, reserved, capacity


class _Block:
    __slots__ = ("size", "offset", "segment", "stream", "small", "free", "prev", "next")

    def __init__(self, size: int, offset: int, segment: int, stream: int, small: bool) -> None:
        self.size, self.offset, self.segment, self.stream, self.small = size, offset, segment, stream, small
        self.free = False
        self.prev: _Block | None = None
        self.next: _Block | None = None

    def key(self) -> tuple[int, int, int, int]:
        return (self.stream, self.size, self.segment, self.offset)  # torch: stream, size, then address


@dataclass(frozen=True)
class AllocatorStats:
    """Bytes as `torch.cuda.memory_stats` counts them (lessons 1 and 4): allocated (blocks handed
    out), reserved (segments), and the peaks of both; `oom_retries`: cudaMalloc failures that freeing
    the cache fixed."""

    allocated: int
    reserved: int
    peak_allocated: int
    peak_reserved: int
    segments: int
    oom_retries: int


class CachingAllocator:
    """The caching allocator's rules (module docstring) on one device (lessons 1 and 4).

    `malloc(nbytes, stream)` returns a handle for `free(handle)`; `capacity` (bytes the allocator may
    reserve: the card's memory less what is used outside it) makes a cudaMalloc fail past it, and
    `max_split_size` is PYTORCH_CUDA_ALLOC_CONF's `max_split_size_mb` in bytes (None: unlimited)."""

    def __init__(self, capacity: int | None = None, max_split_size: int | None = None) -> None:
        self.capacity, self.max_split_size = capacity, max_split_size
        self.pools: dict[bool, list[tuple[int, int, int, int]]] = {True: [], False: []}  # small? -> free keys
        self.cached: dict[tuple[int, int, int, int], _Block] = {}
        self.live: dict[int, _Block] = {}
        self.segment_bytes: dict[int, int] = {}
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.oom_retries = 0
        self._next_handle = self._next_segment = 0

    # ---- the free lists ------------------------------------------------------------------
    def _insert(self, block: _Block) -> None:
        block.free = True
        key = block.key()
        self.cached[key] = block
        bisect.insort(self.pools[block.small], key)

    def _remove(self, block: _Block) -> None:
        key = block.key()
        pool = self.pools[block.small]
        del pool[bisect.bisect_left(pool, key)]
        del self.cached[key]
        block.free = False

    def _best_fit(self, size: int, stream: int, small: bool) -> _Block | None:
        pool = self.pools[small]
        index = bisect.bisect_left(pool, (stream, size, -1, -1))
        if index == len(pool) or pool[index][0] != stream:
            return None
        found = self.cached[pool[index]]
        limit = self.max_split_size
        if limit is not None and not small:
            if size < limit <= found.size:  # do not return an oversized block for a large request
                return None
            if size >= limit and found.size >= size + LARGE_BUFFER:
                return None
        return found

    def _should_split(self, block: _Block, size: int) -> bool:
        remaining = block.size - size
        if block.small:
            return remaining >= MIN_BLOCK
        return (self.max_split_size is None or size < self.max_split_size) and remaining > SMALL_SIZE

    # ---- segments --------------------------------------------------------------------------
    def _new_segment(self, size: int, stream: int, small: bool) -> _Block:
        grow = segment_size(size)
        if self.capacity is not None and self.reserved + grow > self.capacity:
            self.empty_cache()  # release_cached_blocks, then one retry
            if self.reserved + grow > self.capacity:
                raise AllocatorOutOfMemory(grow, self.reserved, self.capacity)
            self.oom_retries += 1
        segment = self._next_segment
        self._next_segment += 1
        self.segment_bytes[segment] = grow
        self.reserved += grow
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return _Block(grow, 0, segment, stream, small)

    def empty_cache(self) -> None:
        """Release every cached segment with nothing allocated in it (`torch.cuda.empty_cache`)."""
        for small in (True, False):
            for key in [k for k in self.pools[small] if self.cached[k].prev is None and self.cached[k].next is None]:
                block = self.cached[key]
                self._remove(block)
                self.reserved -= self.segment_bytes.pop(block.segment)

    # ---- requests --------------------------------------------------------------------------
    def malloc(self, nbytes: int, stream: int = 0) -> int:
        """Hand out a block for `nbytes` on `stream`; the handle frees it."""
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._best_fit(size, stream, small)
        if block is not None:
            self._remove(block)
        else:
            block = self._new_segment(size, stream, small)
        if self._should_split(block, size):
            rest = _Block(block.size - size, block.offset + size, block.segment, stream, small)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._insert(rest)
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        handle = self._next_handle
        self._next_handle += 1
        self.live[handle] = block
        return handle

    def free(self, handle: int) -> None:
        """Return the block to its pool, merged with its free neighbours."""
        block = self.live.pop(handle)
        self.allocated -= block.size
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._remove(neighbour)
                if neighbour is block.prev:
                    block.offset, block.prev = neighbour.offset, neighbour.prev
                    if neighbour.prev is not None:
                        neighbour.prev.next = block
                else:
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
                block.size += neighbour.size
        self._insert(block)

    def stats(self) -> AllocatorStats:
        return AllocatorStats(
            self.allocated,
            self.reserved,
            self.peak_allocated,
            self.peak_reserved,
            len(self.segment_bytes),
            self.oom_retries,
        )


EMPTY_CACHE = None  # a `replay` entry: torch.cuda.empty_cache() at that point


def replay(sizes: list[int | None], capacity: int | None = None) -> AllocatorStats:
    """Run a stream of allocations and frees through the allocator on one stream (lessons 1 and 4):
    a positive entry allocates that many bytes, a negative index entry `~i` frees the i-th allocation
    (`~i` is -i - 1), `EMPTY_CACHE` releases every cached segment with nothing allocated in it."""
    allocator = CachingAllocator(capacity)
    handles: list[int] = []
    for entry in sizes:
        if entry is EMPTY_CACHE:
            allocator.empty_cache()
        elif entry >= 0:
            handles.append(allocator.malloc(entry))
        else:
            allocator.free(handles[~entry])
    return allocator.stats()


def concatenated(*streams: list[int | None]) -> list[int | None]:
    """`replay` streams one after another on one allocator: each one's frees shifted past the allocations
    made before it (lesson 1, "the planner")."""
    out: list[int | None] = []
    made = 0
    for stream in streams:
        out += [entry if entry is EMPTY_CACHE or entry >= 0 else entry - made for entry in stream]
        made += sum(1 for entry in stream if entry is not EMPTY_CACHE and entry >= 0)
    return out


def stream_slack(stream: list[int], peak: int, empty_cache: bool = False) -> int:
    """What the caching allocator reserves beyond `peak` (the step's most live bytes) for the traced
    step run twice, what the first left alive (the gradients) freed in between as `zero_grad` does
    (lesson 1). `empty_cache`: the loop calls torch.cuda.empty_cache() after each step (peft's
    MetaMathQA run.py), with the gradients still alive, so the second step finds only the segments of
    what lives on."""
    return max(0, replay(two_steps(stream, empty_cache)).peak_reserved - peak)


def two_steps(stream: list[int], empty_cache: bool = False) -> list[int | None]:
    """The step's stream run twice as `stream_slack` replays it, ready for `caching_allocator.replay`."""
    made = sum(1 for entry in stream if entry >= 0)
    freed = {~entry for entry in stream if entry < 0}
    between = [~i for i in range(made) if i not in freed]  # what the first step left alive (the gradients)
    return concatenated(list(stream) + ([EMPTY_CACHE] if empty_cache else []) + between, stream)


def stream_slacks(stream: list[int], peak: int) -> dict[str, int]:
    """`Trace.allocator_slack` and `allocator_slack_emptied` of a step's stream: `stream_slack` with the
    cache kept between the two steps and emptied (lesson 1)."""
    return {"allocator_slack": stream_slack(stream, peak), "allocator_slack_emptied": stream_slack(stream, peak, True)}
