"""When bitsandbytes prefetches each parameter's paged state and when it updates it, on a real CUDA
GPU (lesson 4, "prefetch in a timeline")."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from course_lib.device import synchronize
from course_lib.errors import UserTypeError
from course_lib.paging.policies import PagingError
from course_lib.validate import checked


@checked(error=PagingError)
@dataclass
class TimelineEntry:
    """One parameter's prefetch or update inside `optimizer.step()`: seconds from the step's start (lesson 4)."""

    kind: str
    index: int
    start: float
    end: float
    state_bytes: int


class PrefetchTimeline:
    """Record when bitsandbytes prefetches each parameter's state and when it updates it
    (lesson 4, "prefetch in a timeline"). It wraps the optimizer's `prefetch_state` and
    `update_step` and synchronizes around each, so the times are what the GPU spent."""

    def __init__(self, optimizer) -> None:
        if not hasattr(optimizer, "prefetch_state") or not hasattr(optimizer, "update_step"):
            raise UserTypeError("PrefetchTimeline needs a bitsandbytes optimizer (prefetch_state, update_step)")
        self.optimizer = optimizer
        self.entries: list[TimelineEntry] = []
        self.t0 = time.perf_counter()
        self._index: dict[int, int] = {}
        prefetch, update = optimizer.prefetch_state, optimizer.update_step

        def timed(kind: str, fn: Callable, p: torch.Tensor, *args) -> None:
            synchronize()
            start = time.perf_counter()
            fn(p, *args) if kind == "prefetch" else fn(*args)
            synchronize()
            state = optimizer.state.get(p, {})
            nbytes = sum(
                t.numel() * t.element_size()
                for t in state.values()
                if isinstance(t, torch.Tensor) and getattr(t, "is_paged", False)
            )
            index = self._index.setdefault(id(p), len(self._index))
            self.entries.append(TimelineEntry(kind, index, start - self.t0, time.perf_counter() - self.t0, nbytes))

        optimizer.prefetch_state = lambda p: timed("prefetch", prefetch, p)
        optimizer.update_step = lambda group, p, gindex, pindex: timed("update", update, p, group, p, gindex, pindex)

    def start_step(self) -> None:
        self.entries.clear()
        self.t0 = time.perf_counter()
