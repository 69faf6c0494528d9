"""Checks for the exercises of lesson 4 (paged optimizers): the learner's eviction policies are
compared with the simulator, `course_lib.paging`, on fixed and random chunk traces; a trace where
allocation order beats LRU, and a prediction of the step after a spike, are checked on the simulator."""

from __future__ import annotations

import random
from collections.abc import Callable

from course_lib import paging
from course_lib.checks.hints import passed, refusing
from course_lib.paging import MiB, chunk_migrations
from course_lib.validate import checked

__all__ = ["check_allocation_order_wins", "check_migrated_bytes", "check_mru", "check_step3_prediction", "spike_trace"]

CHUNK = 2 * MiB


def _traces() -> list[tuple[list[int], int]]:
    """(accesses, capacity in chunks): the cases that tell policies apart, then random ones."""
    rng = random.Random(4)
    fixed = [
        ([0, 1, 2], 3),
        ([0, 1, 2, 0], 2),
        ([0, 1, 0, 2, 0], 2),
        (list(range(5)) * 3, 4),
        ([0, 0, 0, 1, 1, 0], 1),
        ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], 3),
    ]
    randoms = [([rng.randrange(8) for _ in range(rng.randrange(1, 40))], rng.randrange(1, 6)) for _ in range(60)]
    return fixed + randoms


def _refusing(answer):
    """The answer, refused if it calls the simulator it is compared with (or this module's own answers)."""
    return refusing(
        answer,
        paging.simulate,
        paging.chunk_migrations,
        paging.chunk_trace,
        spike_trace,
        _step3_in,
        instead="work it out yourself (an OrderedDict is enough)",
    )


def _call(fn, accesses, capacity, policy):
    got = fn(list(accesses), capacity, policy)
    assert got is not None, "your function returned None: return (bytes_in, bytes_out)"
    assert isinstance(got, tuple) and len(got) == 2, f"return a pair (bytes_in, bytes_out), got {got!r}"
    return tuple(int(x) for x in got)


def _compare(fn, policy: str) -> None:
    for accesses, capacity in _traces():
        want = chunk_migrations(accesses, capacity, policy)
        got = _call(fn, accesses, capacity, policy)
        if got == want:
            continue
        case = f"accesses {accesses}, capacity {capacity} chunks, policy {policy!r}"
        if got[0] == want[0] + CHUNK * len(set(accesses)) and got[1] == want[1]:
            raise AssertionError(
                f"{case}: you count the first access of each chunk as a migration. A first "
                "touch populates the chunk on the GPU; nothing crosses the link"
            )
        if got[0] % CHUNK or got[1] % CHUNK:
            raise AssertionError(f"{case}: count bytes in whole chunks of {CHUNK} bytes (2 MiB), got {got}")
        hint = {
            "allocation": "a chunk's place in the eviction order is set when it is brought in "
            "(migrated or populated), not when it is used again; evict the oldest",
            "lru": "every access (also a hit) moves the chunk to the most-recently-used end; "
            "evict the least recently used",
            "mru": "every access (also a hit) makes the chunk the most recent; evict the most recently "
            "used chunk (not the one being brought in)",
        }[policy]
        raise AssertionError(
            f"{case}: the simulator migrates {want[0]} bytes in and evicts {want[1]}, you "
            f"return {got}. Hint: {hint}. Evict only when all {capacity} chunks are taken"
        )


@checked
def check_migrated_bytes(migrated_bytes: Callable) -> None:
    """Exercise 4.1: `migrated_bytes(accesses, capacity, policy)` for "allocation" and "lru"."""
    migrated_bytes = _refusing(migrated_bytes)
    for policy in ("allocation", "lru"):
        _compare(migrated_bytes, policy)
    passed(f"Correct: your allocation-order and LRU policies match the simulator on {len(_traces())} traces each.")
    cycle = list(range(10)) * 4
    for policy in ("allocation", "lru"):
        bytes_in, bytes_out = _call(migrated_bytes, cycle, 8, policy)
        print(
            f"The optimizer's cycle (10 chunks, room for 8, 4 steps) under {policy}: "
            f"{bytes_in // MiB} MiB in, {bytes_out // MiB} MiB out"
        )


@checked
def check_mru(migrated_bytes: Callable) -> None:
    """Exercise 4.2: the same function also handles "mru", and beats LRU on an optimizer's cycle."""
    migrated_bytes = _refusing(migrated_bytes)
    _compare(migrated_bytes, "mru")
    cycle = list(range(10)) * 4
    lru, mru = _call(migrated_bytes, cycle, 8, "lru"), _call(migrated_bytes, cycle, 8, "mru")
    assert mru[0] < lru[0], (
        f"on the optimizer's cycle (10 chunks, room for 8) MRU should migrate less than LRU: got {mru[0]} "
        f"vs {lru[0]} bytes"
    )
    passed(f"Correct: on a 10-chunk cycle with room for 8, LRU migrates {lru[0] // MiB} MiB, MRU {mru[0] // MiB} MiB.")


@checked
def check_allocation_order_wins(trace_for: Callable) -> None:
    """Exercise 4.3: `trace_for(capacity)` returns chunk accesses on which allocation order migrates
    fewer bytes than LRU, for every capacity from 2 to 8 chunks."""
    for capacity in range(2, 9):
        accesses = trace_for(capacity)
        assert accesses is not None, "trace_for returned None: return a list of chunk numbers"
        accesses = [int(a) for a in accesses]
        assert accesses and min(accesses) >= 0, "return a non-empty list of chunk numbers >= 0"
        alloc_in, _ = chunk_migrations(accesses, capacity, "allocation")
        lru_in, _ = chunk_migrations(accesses, capacity, "lru")
        assert alloc_in < lru_in, (
            f"capacity {capacity}: on {accesses[:20]}{'...' if len(accesses) > 20 else ''} allocation order migrates "
            f"{alloc_in // MiB} MiB, LRU {lru_in // MiB} MiB. Hint: under LRU, using a resident chunk again protects "
            "it; make the chunk that LRU then evicts instead be the one you need next"
        )
        if capacity == 2:
            shown = f"{accesses}: allocation {alloc_in // MiB} MiB, LRU {lru_in // MiB} MiB"
    passed(
        f"Correct: for capacities 2 to 8, allocation order migrates less than LRU on your traces. On capacity 2: "
        f"{shown}. The optimizer's cycle near the edge "
        "is this case (lesson 4, the cliff): chunks used again are not the ones needed next."
    )


@checked
def spike_trace(empty_cache_after_spike: bool) -> list:
    """Exercise 4.4's world (lesson 4): a 32 MiB GPU; 8 MiB of ordinary weights; eight 2 MiB chunks of
    paged state, prefetched in order 0..7 in every step; in step 2 a 16 MiB activation is allocated
    and freed before the optimizer; optionally `torch.cuda.empty_cache()` at the end of step 2."""
    events = [paging.alloc("weights", 8 * MiB)]
    events += [paging.alloc(f"s{i}", 2 * MiB, managed=True) for i in range(8)]
    for step in range(4):
        if step == 2:
            events += [
                paging.alloc("activation", 16 * MiB, step=step, phase="forward"),
                paging.free("activation", step=step, phase="backward"),
            ]
        events += [paging.prefetch(f"s{i}", step=step, phase="optimizer") for i in range(8)]
        if step == 2 and empty_cache_after_spike:
            events.append(paging.empty_cache(step=step, phase="optimizer"))
    return events


def _step3_in(empty_cache_after_spike: bool) -> int:
    result = paging.simulate(spike_trace(empty_cache_after_spike), paging.Hardware.t4().with_memory(32 * MiB))
    return result.step_stats(3).h2d_bytes


@checked
def check_step3_prediction(predict: Callable) -> None:
    """Exercise 4.4: `predict()` returns {"with empty_cache": bytes, "without empty_cache": bytes}, the
    bytes of paged state migrated back in step 3 of `spike_trace`."""
    predict = _refusing(predict)
    got = predict()
    assert isinstance(got, dict) and set(got) == {"with empty_cache", "without empty_cache"}, (
        'return a dict {"with empty_cache": bytes, "without empty_cache": bytes}'
    )
    want = {"with empty_cache": _step3_in(True), "without empty_cache": _step3_in(False)}
    hints = {
        "with empty_cache": "after empty_cache the allocator holds only the weights: how many chunks were "
        "left out at the end of step 2, and is there room for them now?",
        "without empty_cache": "the allocator keeps the activation's 16 MiB reserved: the state has 8 MiB of "
        "room for 16 MiB, and each prefetch evicts the chunk made resident longest ago",
    }
    for key in want:
        assert int(got[key]) == want[key], (
            f"{key}: you predict {int(got[key]) // MiB} MiB migrated in step 3. Hint: {hints[key]}"
        )
    passed(
        f"Correct: step 3 migrates {want['with empty_cache'] // MiB} MiB with empty_cache after the spike and "
        f"{want['without empty_cache'] // MiB} MiB without: the allocator's reserve decides (lesson 4)."
    )
