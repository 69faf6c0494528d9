"""Which memory each operator of a real training step touches (lesson 4, "the timing insight"):
measured on any device with a dispatch mode, not simulated.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from course_lib.measure import PHASES, dispatched_tensors
from course_lib.paging.policies import PagingError
from course_lib.validate import checked

TOUCH_CATEGORIES = ("weights", "gradients", "optimizer state", "activations and temporaries")


@checked(error=PagingError)
@dataclass(frozen=True)
class Touch:
    """One operator of a measured step touching one storage: its number, phase and category (lesson 4)."""

    index: int
    phase: str
    category: str
    nbytes: int


@checked(error=PagingError)
def measure_touches(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable) -> list[Touch]:
    """Run one training step (forward, backward, `optimizer.step()`) and record, for every
    operator, the storages it reads or writes and what they are (lesson 4, "when is the state
    touched?"). Run a step first so that the optimizer's lazily created state exists."""

    raw: list[tuple[int, str, int, int]] = []
    ids = itertools.count()
    live: dict[tuple[str, int], int] = {}  # address -> id of the storage living there now

    def uid(t) -> int:
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if key not in live:
            live[key] = next(ids)
            weakref.finalize(storage, live.pop, key, None)
        return live[key]

    class Recorder(TorchDispatchMode):
        phase = "forward"
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen = set()
            for t in dispatched_tensors((args, tuple((kwargs or {}).values()), out)):
                if t.device.type != "meta" and t.untyped_storage().nbytes():
                    ident = uid(t)
                    if ident not in seen:
                        seen.add(ident)
                        raw.append((self.count, self.phase, ident, t.untyped_storage().nbytes()))
            self.count += 1
            return out

    optimizer.zero_grad(set_to_none=True)
    params = list(model.parameters())
    recorder = Recorder()
    with recorder:
        for p in params:  # storages alive before the step get their ids first
            uid(p)
        for st in optimizer.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    uid(v)
        loss = loss_fn()
        recorder.phase = "backward"
        loss.backward()
        recorder.phase = "optimizer"
        optimizer.step()
        weights = {uid(p) for p in params}
        grads = {uid(p.grad) for p in params if p.grad is not None}
        state = {uid(v) for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)}

    def category(ident: int) -> str:
        if ident in state:
            return "optimizer state"
        if ident in weights:
            return "weights"
        if ident in grads:
            return "gradients"
        return "activations and temporaries"

    return [Touch(index, phase, category(ident), nbytes) for index, phase, ident, nbytes in raw]


@checked(error=PagingError)
def touch_summary(touches: Sequence[Touch]) -> dict[str, dict[str, int]]:
    """Operators per phase that touch each category (lesson 4)."""
    table = {phase: {cat: 0 for cat in TOUCH_CATEGORIES} for phase in PHASES}
    ops = {(t.index, t.phase, t.category) for t in touches}
    for _, phase, cat in ops:
        table[phase][cat] += 1
    return table
