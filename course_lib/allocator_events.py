"""The PyTorch profiler's CPU allocator events over a block, with phase marks: every allocation and
free of the CPU allocator, those an operator makes inside itself included (lesson 0, "6. Checking the
instrument"). `course_lib.measure` runs them beside its live-storage tracker."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile, record_function


class AllocatorEvents:
    """The PyTorch profiler's CPU allocator events over a block, with phase marks (lesson 0): every
    allocation and free, those inside an operator included. Off (`phase_peaks` None) when another
    profiler is running: the profiler does not nest."""

    def __init__(self) -> None:
        self.profiler = None

    def __enter__(self) -> AllocatorEvents:
        if not torch._C._autograd._profiler_enabled():
            self.profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            with _native_stderr_silenced():  # its C++ side prints "USDT: profiler_start/stop"
                self.profiler.__enter__()
        return self

    def mark(self, phase: str) -> None:
        if self.profiler is not None:
            with record_function(f"{_MARK}{phase}"):
                pass

    def __exit__(self, *exc) -> None:
        if self.profiler is not None:
            with _native_stderr_silenced():
                self.profiler.__exit__(*exc)

    def phase_peaks(self, baseline: int, held: dict[int, int] | None = None) -> dict[str, int] | None:
        """Each phase's peak: the bytes live when it starts (from `baseline`) and the most after.

        Only blocks allocated inside the block are counted, and the `held` ones (address -> bytes:
        the storages in `baseline`) when freed: the CPU allocator also reports the frees of blocks a
        profiler saw allocated earlier (a previous step's logits), which `baseline` never counted."""
        if self.profiler is None:
            return None
        held = dict(held or {})
        events = []
        stack = list(self.profiler.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            stack.extend(node.children)
            if node.name.startswith(_MARK):
                events.append((node.start_time_ns, 1, node.name[len(_MARK) :], 0))
            elif str(node.tag).endswith("Allocation") and node.extra_fields.device.type == "cpu":
                events.append((node.start_time_ns, 0, node.extra_fields.ptr, node.extra_fields.alloc_size))
        current, phase, peaks, made = baseline, None, {}, {}
        for _, is_mark, key, size in sorted(events, key=lambda e: e[:2]):
            if is_mark:
                phase = key
                peaks[phase] = max(peaks.get(phase, 0), current)
                continue
            if size > 0:
                made[key] = size
                current += size
            else:
                current -= made.pop(key, None) or held.pop(key, 0)
            if phase is not None and current > peaks[phase]:
                peaks[phase] = current
        return peaks


_MARK = "course_lib.measure.phase:"


def profiler_peak(step: Callable[[], None]) -> int:
    """Peak CPU bytes of `step()` as the PyTorch profiler's allocator events see them, relative to
    what was allocated before `step` started (lesson 0): the instrument `measure_step` runs beside
    its live-storage tracker, on its own."""
    events = AllocatorEvents()
    with events:
        events.mark("step")
        step()
    peaks = events.phase_peaks(0)
    if peaks is None:
        raise RuntimeError("profiler_peak runs the PyTorch profiler, and another profiler is running")
    return peaks["step"]


@contextlib.contextmanager
def _native_stderr_silenced():
    """Send file descriptor 2 (C++ code's stderr) to /dev/null for the duration of the block."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
