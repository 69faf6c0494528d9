"""Checks for the exercises of lesson 4 (paged optimizers): the learner's eviction policies are
compared with the simulator, `course_lib.paging`, on fixed and random chunk traces."""

from __future__ import annotations

import random

from course_lib.paging import MiB, chunk_migrations

__all__ = ["check_migrated_bytes", "check_mru"]

CHUNK = 2 * MiB


def _traces() -> list[tuple[list[int], int]]:
    """(accesses, capacity in chunks): the cases that tell policies apart, then random ones."""
    rng = random.Random(4)
    fixed = [([0, 1, 2], 3), ([0, 1, 2, 0], 2), ([0, 1, 0, 2, 0], 2), (list(range(5)) * 3, 4),
             ([0, 0, 0, 1, 1, 0], 1), ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], 3)]
    randoms = [([rng.randrange(8) for _ in range(rng.randrange(1, 40))], rng.randrange(1, 6)) for _ in range(60)]
    return fixed + randoms


def _call(fn, accesses, capacity, policy):
    got = fn(list(accesses), capacity, policy)
    assert got is not None, "your function returned None: return (bytes_in, bytes_out)"
    assert isinstance(got, tuple) and len(got) == 2, (
        f"return a pair (bytes_in, bytes_out), got {got!r}")
    return tuple(int(x) for x in got)


def _compare(fn, policy: str) -> None:
    for accesses, capacity in _traces():
        want = chunk_migrations(accesses, capacity, policy)
        got = _call(fn, accesses, capacity, policy)
        if got == want:
            continue
        case = f"accesses {accesses}, capacity {capacity} chunks, policy {policy!r}"
        if got[0] == want[0] + CHUNK * len(set(accesses)) and got[1] == want[1]:
            raise AssertionError(f"{case}: you count the first access of each chunk as a migration. A first "
                                 "touch populates the chunk on the GPU; nothing crosses the link")
        if got[0] % CHUNK or got[1] % CHUNK:
            raise AssertionError(f"{case}: count bytes in whole chunks of {CHUNK} bytes (2 MiB), got {got}")
        hint = {"allocation": "a chunk's place in the eviction order is set when it is brought in "
                              "(migrated or populated), not when it is used again; evict the oldest",
                "lru": "every access (also a hit) moves the chunk to the most-recently-used end; "
                       "evict the least recently used",
                "mru": "every access (also a hit) makes the chunk the most recent; evict the most recently "
                       "used chunk (not the one being brought in)"}[policy]
        raise AssertionError(f"{case}: the simulator migrates {want[0]} bytes in and evicts {want[1]}, you "
                             f"return {got}. Hint: {hint}. Evict only when all {capacity} chunks are taken")


def check_migrated_bytes(migrated_bytes) -> None:
    """Exercise 4.1: `migrated_bytes(accesses, capacity, policy)` for "allocation" and "lru"."""
    for policy in ("allocation", "lru"):
        _compare(migrated_bytes, policy)
    print(f"Correct: your allocation-order and LRU policies match the simulator on {len(_traces())} traces each.")
    cycle = list(range(10)) * 4
    for policy in ("allocation", "lru"):
        bytes_in, bytes_out = _call(migrated_bytes, cycle, 8, policy)
        print(f"The optimizer's cycle (10 chunks, room for 8, 4 steps) under {policy}: "
              f"{bytes_in // MiB} MiB in, {bytes_out // MiB} MiB out")


def check_mru(migrated_bytes) -> None:
    """Exercise 4.2: the same function also handles "mru", and beats LRU on an optimizer's cycle."""
    _compare(migrated_bytes, "mru")
    cycle = list(range(10)) * 4
    lru, mru = _call(migrated_bytes, cycle, 8, "lru"), _call(migrated_bytes, cycle, 8, "mru")
    assert mru[0] < lru[0], (
        f"on the optimizer's cycle (10 chunks, room for 8) MRU should migrate less than LRU: got {mru[0]} "
        f"vs {lru[0]} bytes")
    print(f"Correct: on a 10-chunk cycle with room for 8, LRU migrates {lru[0] // MiB} MiB, MRU "
          f"{mru[0] // MiB} MiB.")
