"""The meta-device step's recorder (lesson 1, "the planner"): lesson 0's live-storage tracker with the
allocation stream `caching_allocator.replay` takes and the peaks the planner needs, per phase and position."""

from __future__ import annotations

import torch

from course_lib.measure import LiveStorageTracker


class AllocationStream:
    """A mixin for `course_lib.measure.LiveStorageTracker`: every allocation (its bytes) and free (`~i`,
    the i-th allocation) of the region in order, as `caching_allocator.replay` takes them (lesson 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.stream: list[int] = []
        self.stream_index: dict = {}  # storage key -> its allocation's index
        self.allocations = 0

    def watch(self, tensor: torch.Tensor) -> None:
        fresh = isinstance(tensor, torch.Tensor) and self.storage_key(tensor, tensor.untyped_storage()) not in self.live
        super().watch(tensor)
        if fresh:
            key = self.storage_key(tensor, tensor.untyped_storage())
            if key is not None and self.live.get(key):
                self._stream_alloc(key, self.live[key])

    def _stream_alloc(self, key, nbytes: int) -> None:
        self.stream_index[key] = self.allocations
        self.allocations += 1
        self.stream.append(nbytes)

    def _stream_free(self, key) -> None:
        index = self.stream_index.pop(key, None)
        if index is not None:
            self.stream.append(~index)

    def _freed(self, key, nbytes: int) -> None:
        self._stream_free(key)
        super()._freed(key, nbytes)

    def _resized(self, key, nbytes: int) -> None:
        if nbytes != self.live[key]:  # a resize_ is a new block
            self._stream_free(key)
            if nbytes:
                self._stream_alloc(key, nbytes)
        super()._resized(key, nbytes)


class MetaTracer(AllocationStream, LiveStorageTracker):
    """Lesson 0's live-storage tracker on any device, the meta device included, with the peaks the
    planner needs.

    Keyed by the storage's identity (meta storages all have address 0). Parameters and the batch are
    excluded (`exclude`). `grad_bytes` follows the gradients stored in `.grad` (post-accumulate-grad
    hooks), so that `current - grad_bytes` is what is live besides them. Peaks are kept per phase
    and per position (the decoder layer running, or "pre"/"post": before/after them), each with the
    gradients live when it was first reached; phases are revisited, so a peak is never reset.
    """

    def __init__(self) -> None:
        super().__init__()
        self.grad_bytes = 0
        self.phase = "forward"
        self.position: int | str = "pre"
        self.peaks_without_grads: dict[str, int] = {}
        self.peak_grads: dict[str, int] = {}  # the gradients live at each phase's peak
        self.position_peaks: dict[tuple[str, int | str], tuple[int, int, int]] = {}
        self.known: set[int] = set()
        self.stream_marks: list[tuple[int, str, int | str]] = [
            (0, self.phase, self.position)
        ]  # planner.trace.deep_stream

    def exclude(self, tensor: torch.Tensor) -> None:
        """Never count this tensor's storage (a parameter, the batch), nor views of it."""
        self.known.add(tensor.untyped_storage()._cdata)

    def storage_key(self, tensor: torch.Tensor, storage: torch.UntypedStorage):
        key = storage._cdata
        return None if key in self.known else key

    def _record(self, delta: int) -> None:
        self.current += delta
        if self.current > self.phase_peaks.get(self.phase, 0):
            self.phase_peaks[self.phase] = self.current
            self.peak_grads[self.phase] = self.grad_bytes
        rest = self.current - self.grad_bytes
        if rest > self.peaks_without_grads.get(self.phase, 0):
            self.peaks_without_grads[self.phase] = rest
        where = (self.phase, self.position)
        old = self.position_peaks.get(where, (0, 0, 0))
        if self.current > old[0] or rest > old[1]:
            self.position_peaks[where] = (
                max(old[0], self.current),
                max(old[1], rest),
                self.grad_bytes if self.current > old[0] else old[2],
            )

    def set_phase(self, phase: str, position: int | str | None = None) -> None:
        self.phase = phase
        if position is not None:
            self.position = position
        if self.stream_marks[-1][1:] != (self.phase, self.position):  # the stream's entries from here on
            self.stream_marks.append((len(self.stream), self.phase, self.position))
        self._record(0)
