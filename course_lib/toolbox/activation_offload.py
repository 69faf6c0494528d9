"""Activation offloading: what autograd saves for backward is moved to host memory in forward and
back in backward (lesson 7, "activation offloading").

On CUDA this is `torch.autograd.graph.save_on_cpu(pin_memory=True)` (torch/autograd/graph.py): its
pack hook copies EVERY saved tensor to a pinned host buffer, the weights a matmul saves included,
and its unpack hook copies it back to the device when backward needs it. `HostOffload` does the same
with the host copy kept outside torch's storages (a NumPy buffer), so that on a CPU the live-storage
tracker of lesson 0 sees what the device would hold; it also counts the bytes each way. Transformers'
`activation_checkpointing_enable(offload=True)` wraps each checkpointed layer in `save_on_cpu`: only
the layers' inputs, which checkpointing keeps, travel.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from course_lib import validate
from course_lib.paging.policies import PCIE3_X16
from course_lib.validate import checked


@checked
class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """`save_on_cpu`'s hooks, with host memory that no torch storage holds (lesson 7).

    Inside `offload = HostOffload(model.parameters())`, `with offload:` every tensor autograd saves is
    copied out and the original released; backward gets a fresh device copy of it. `to_host` and
    `to_device` count the bytes copied each way (a tensor saved twice is copied twice, as save_on_cpu
    does), `weights_to_host` the part of `to_host` that copies the `weights` given (the parameters a
    matmul saves for its backward). On the meta device only shapes travel; on CUDA it is an unpinned,
    synchronous save_on_cpu.
    """

    def __init__(self, weights: Iterable[torch.Tensor] = ()) -> None:
        self.to_host = self.to_device = self.weights_to_host = 0
        self._weights = {w.untyped_storage()._cdata for w in weights}
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        nbytes = tensor.numel() * tensor.element_size()
        self.to_host += nbytes
        if tensor.untyped_storage()._cdata in self._weights:
            self.weights_to_host += nbytes
        data = None
        if tensor.device.type != "meta":
            data = tensor.detach().reshape(-1).view(torch.uint8).cpu().numpy().copy()
        return tensor.shape, tensor.dtype, tensor.device, data

    def _unpack(self, packed) -> torch.Tensor:
        shape, dtype, device, data = packed
        out = torch.empty(shape, dtype=dtype, device=device)
        self.to_device += out.numel() * out.element_size()
        if data is not None:
            out.view(-1).view(torch.uint8).copy_(torch.from_numpy(data))
        return out


@checked
def transfer_seconds(to_host: int, to_device: int, bandwidth: float = PCIE3_X16) -> float:
    """Predicted time of the copies of one step at `bandwidth` bytes/s each way, with no overlap
    (save_on_cpu copies on the compute stream): a lower bound, the link's theoretical rate (lesson 7).
    The default is the T4's PCIe 3.0 x16, 15.75 GB/s each way."""
    for value, name in ((to_host, "to_host (bytes)"), (to_device, "to_device (bytes)")):
        validate.finite(name, value, at_least=0)
    validate.positive("bandwidth (bytes per second)", bandwidth)
    return (to_host + to_device) / bandwidth
