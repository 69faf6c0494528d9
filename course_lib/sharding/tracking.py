"""What one rank holds and sends during a sharded training step (lesson 6).

- `RankTracker`: the live-storage tracker of lesson 0, plus FSDP2's storage resizes. FSDP2 frees an
  all-gathered parameter by resizing its storage to 0 bytes and allocates it again by resizing it back
  (`alloc_storage` / `free_storage` in torch/distributed/fsdp/_fully_shard/_fsdp_param.py); a resize is
  not an operator, so the plain tracker would never see these bytes go and come back.
- `CommCounter`: every collective the engine issues from Python (`torch.distributed.all_reduce`,
  `all_gather_single`, `reduce_scatter_single`, `broadcast`, ...), with the bytes each rank sends for
  it under the bandwidth-optimal (ring) algorithm: an all-gather or a reduce-scatter of a B-byte
  tensor sends (N-1)/N x B per rank, an all-reduce twice that, a broadcast (N-1)/N x B on average per
  rank (a pipelined chain). That is the volume the ZeRO paper counts (section 7). Gloo's own scratch
  buffers live in its worker threads, outside any tracker, as NCCL's live outside PyTorch's allocator.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from course_lib.measure import LiveStorageTracker
from course_lib.validate import checked


class RankTracker(LiveStorageTracker):
    """`LiveStorageTracker` that also follows FSDP2's `alloc_storage` / `free_storage` resizes (lesson 6)."""

    _PATCHED = ("_fsdp_param.alloc_storage", "_fsdp_param.free_storage", "_fsdp_param_group.alloc_storage")

    def watch(self, tensor: torch.Tensor) -> None:
        """As the plain tracker; a DTensor (FSDP2's sharded parameter) counts as its local shard."""
        if is_traceable_wrapper_subclass(tensor):
            for name in tensor.__tensor_flatten__()[0]:
                self.watch(getattr(tensor, name))
            return
        super().watch(tensor)

    def __enter__(self):
        # off the import path: torch.distributed.fsdp takes most of a second to import
        from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

        modules = {"_fsdp_param": _fsdp_param, "_fsdp_param_group": _fsdp_param_group}
        self._restore = []
        for dotted in self._PATCHED:
            module_name, name = dotted.split(".")
            module = modules[module_name]
            original = getattr(module, name)
            self._restore.append((module, name, original))
            setattr(module, name, self._alloc(original) if name == "alloc_storage" else self._free(original))
        return super().__enter__()

    def __exit__(self, *exc):
        for module, name, original in self._restore:
            setattr(module, name, original)
        return super().__exit__(*exc)

    def _alloc(self, original):
        def alloc_storage(tensor: torch.Tensor) -> None:
            original(tensor)
            self.watch(tensor)

        return alloc_storage

    def _free(self, original):
        def free_storage(tensor: torch.Tensor) -> None:
            storage = tensor.untyped_storage()
            key = self.storage_key(tensor, storage)
            if storage.nbytes() and key in self.live:
                self._record(-self.live.pop(key))
            original(tensor)

        return free_storage


# collective: (per-rank bytes sent as a multiple of (N-1)/N x B for a B-byte tensor, which argument
# holds that full-size tensor: the output of a gather, the input of a scatter)
_COLLECTIVES = {
    "all_reduce": (2, 0),
    "all_gather_single": (1, 0),
    "all_gather_into_tensor": (1, 0),
    "all_gather": (1, 0),
    "reduce_scatter_single": (1, 1),
    "reduce_scatter_tensor": (1, 1),
    "reduce_scatter": (1, 1),
    "broadcast": (1, 0),
}


@checked
@dataclass
class CommCounter:
    """Collectives issued and bytes each rank sends for them (ring algorithm), by collective (lesson 6)."""

    world_size: int
    calls: Counter = field(default_factory=Counter)
    sent: Counter = field(default_factory=Counter)

    @property
    def bytes_sent(self) -> int:
        return sum(self.sent.values())

    def _count(self, name: str, signature: inspect.Signature, args, kwargs) -> None:
        bound = signature.bind(*args, **kwargs).arguments
        ring_factor, full_arg = _COLLECTIVES[name]
        full = list(bound.values())[full_arg]
        tensors = full if isinstance(full, (list, tuple)) else [full]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        n = self.world_size
        self.calls[name] += 1
        self.sent[name] += ring_factor * nbytes * (n - 1) // n

    @contextlib.contextmanager
    def counting(self):
        """Count every collective issued through `torch.distributed` inside the block."""
        saved = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

        def wrap(name, original):
            signature = inspect.signature(original)

            def collective(*args, **kwargs):
                self._count(name, signature, args, kwargs)
                return original(*args, **kwargs)

            return collective

        for name, original in saved.items():
            setattr(dist, name, wrap(name, original))
        try:
            yield self
        finally:
            for name, original in saved.items():
                setattr(dist, name, original)
