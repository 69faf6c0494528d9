"""A small GPU inside a big one, and giving cached memory back (lessons 4 and 5, "the real thing").

`VirtualGPU` makes a big GPU behave like a small one: a balloon of ordinary memory leaves `capacity`
bytes free (so unified memory is really short), and `torch.cuda.set_per_process_memory_fraction` caps
PyTorch's allocator at the same point.
"""

from __future__ import annotations

import gc

import torch

from course_lib.errors import UserError
from course_lib.measure import GiB, MiB


def release_cuda_memory() -> None:
    """Collect the garbage and return the caching allocator's cached blocks (lessons 4 and 5). Paged
    state is not given back by this or anything else in the process: run what creates it through
    `course_lib.isolate.run`."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class VirtualGPU:
    """Make the GPU look `capacity` bytes big for this process (lesson 4).

    A balloon of ordinary (unevictable) memory takes everything else, so unified memory really runs
    short at `capacity`; `torch.cuda.set_per_process_memory_fraction` caps PyTorch's allocator there
    too, so plain AdamW fails the way it would on the small GPU. `used()` is what nvidia-smi would
    show on the small GPU (everything in use on the device minus the balloon: context, PyTorch's
    reserve, resident managed memory).
    """

    def __init__(self, capacity: int, device: int = 0, chunk: int = 4 * GiB) -> None:
        if capacity <= 0:
            raise UserError(f"capacity must be positive, got {capacity}")
        if not torch.cuda.is_available():
            raise RuntimeError("VirtualGPU needs a CUDA GPU")
        self.capacity, self.device, self.chunk = int(capacity), torch.device("cuda", device), chunk
        self.balloon: list[torch.Tensor] = []
        self.balloon_bytes = 0

    def __enter__(self) -> VirtualGPU:
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        if free < self.capacity:
            raise RuntimeError(f"only {free / GiB:.2f} GiB free: cannot emulate {self.capacity / GiB:.2f} GiB")
        target = free - self.capacity
        while self.balloon_bytes < target:
            n = min(self.chunk, target - self.balloon_bytes)
            n -= n % (2 * MiB)
            if n <= 0:
                break
            self.balloon.append(torch.empty(n, dtype=torch.uint8, device=self.device))
            self.balloon_bytes += n
        reserved = torch.cuda.memory_reserved(self.device)
        torch.cuda.set_per_process_memory_fraction(min(1.0, (reserved + self.capacity) / total), self.device)
        self.total = total
        self.baseline = self.used()  # CUDA context and whatever else was there before
        self.outside_baseline = self.outside_allocator()
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.set_per_process_memory_fraction(1.0, self.device)
        self.balloon.clear()
        self.balloon_bytes = 0
        gc.collect()
        torch.cuda.empty_cache()

    def used(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free - self.balloon_bytes

    def reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device) - self.balloon_bytes

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) - self.balloon_bytes

    def outside_allocator(self) -> int:
        """Device memory in use that PyTorch's allocator did not reserve: the CUDA context, library
        modules, and resident managed (paged) memory."""
        return self.used() - self.reserved()
