"""The OOM line at the card's limit (lesson 1, "the planner"): where the reserve the step would make does not
fit on the card but its allocations might. Predicted: a CPU has no caching allocator.

When cudaMalloc fails, PyTorch's caching allocator frees every cached segment nothing lives in
(`release_cached_blocks`) and tries again; only if that fails too does it raise OutOfMemoryError
(docs/references.md, the caching allocator's entry). So a step whose reserve would pass the card still runs
(slower: each retry synchronises the device), and its max_memory_reserved stops near the card's memory.
What decides is the step's own stream: replayed through `course_lib.caching_allocator` with the room the
rest of the plan leaves it, it either finds its blocks after the releases or runs out.
"""

from __future__ import annotations

from dataclasses import replace

from course_lib.caching_allocator import AllocatorOutOfMemory, replay, two_steps
from course_lib.planner.allocator.reserved import Reserved
from course_lib.planner.trace.deep_stream import live_peak
from course_lib.planner.trace.step_trace import StepTrace


def at_the_limit(line: Reserved, step: StepTrace | None) -> Reserved:
    """`line` as it is where its reserve fits (or nothing would: the allocations alone pass the card, or there
    is no traced step); else the step's stream replayed twice with the room left beside what the plan holds
    outside it, the cache released and retried where it runs out: fits with `retries` and the reserve capped
    at the card's memory, or the line as it was (does not fit)."""
    if line.fits or step is None or line.held + line.context + line.managed > line.capacity:
        return line
    room = line.capacity - line.context - line.managed - line.held  # beside what the plan holds
    empty = step.setup.empty_cache_each_step
    if not step.answer(
        "limit", ("limit", step.setup.checkpointing, empty, room), lambda: _runs(step.stream(), room, empty)
    ):
        return line
    return replace(line, reserved=line.capacity - line.context - line.managed, retries=True)


def _runs(stream: list[int], room: int, empty_cache: bool) -> bool:
    """Whether the step's stream, replayed twice, finds its blocks in `room` bytes beside its own live
    peak (which the plan's held bytes already count), the cache released and retried where it runs out."""
    try:
        replay(two_steps(stream, empty_cache), capacity=room + live_peak(stream))
    except AllocatorOutOfMemory:
        return False
    return True
