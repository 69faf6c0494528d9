"""Which real engine configuration stands for which ZeRO stage (lesson 6, "four stages, three engines").

ZeRO (Rajbhandari et al. 2020) names what each GPU keeps of the model states; PyTorch ships engines
that keep exactly, or nearly, that:

- "none":  `DistributedDataParallel`: every rank holds all weights, gradients and optimizer state,
           plus DDP's gradient buckets (a second copy of the gradients, `gradient_as_bucket_view=False`,
           the default), all-reduced in backward.
- "zero1": DDP + `torch.distributed.optim.ZeroRedundancyOptimizer` (torch's implementation of ZeRO's
           optimizer-state partitioning): gradients all-reduced and kept whole, each rank keeps the
           AdamW state of its share of the parameters (whole tensors, sorted-greedy: not an exact 1/N)
           and broadcasts the parameters it updated.
- "zero2": FSDP2 (`fully_shard` on each decoder layer and on the root) with
           `reshard_after_forward=False`: gradients reduce-scattered layer by layer and optimizer state
           sharded, as in ZeRO-2; the parameters are gathered once in forward and kept whole until
           each layer's backward ends (ZeRO-2 keeps them whole all the time; FSDP2 frees them after
           backward, so the optimizer step sees only shards). FSDP1 named it SHARD_GRAD_OP.
- "zero3": FSDP2 with `reshard_after_forward=True` on every group, the root too: parameters,
           gradients and optimizer state sharded; each layer's parameters are all-gathered in forward,
           freed, and all-gathered again in backward (FSDP1's FULL_SHARD).

"zero3" with FSDP2's `CPUOffloadPolicy` (the shards in CPU memory, the optimizer step on the CPU,
ZeRO-Offload's split) only means something with a GPU: `measuring.measure_offload_on_cuda`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.device_mesh import init_device_mesh

from course_lib.layers import find_layer_stack

ENGINES = {
    "none": "DDP",
    "zero1": "DDP + ZeroRedundancyOptimizer",
    "zero2": "FSDP2, reshard_after_forward=False",
    "zero3": "FSDP2, reshard_after_forward=True",
}
STAGES = tuple(ENGINES)


def wrap(model: nn.Module, stage: str, world_size: int, lr: float = 1e-3, *, device: str = "cpu",
         offload_policy=None):
    """(the model to train, its optimizer) for `stage` (one of ENGINES) in a running process group.

    The optimizer is torch's AdamW (foreach step, its default) in every stage (lesson 6). For FSDP2,
    `device` is the mesh's device type and `offload_policy` (e.g. CPUOffloadPolicy()) is passed on."""
    if stage not in ENGINES:
        raise ValueError(f"unknown stage {stage!r}: use one of {', '.join(ENGINES)}")
    if stage in ("none", "zero1"):
        # off the import path: torch.distributed.optim takes most of a second to import
        from torch.distributed.optim import ZeroRedundancyOptimizer

        ddp = nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(dist.group.WORLD, allreduce_hook)  # torch's default all-reduce, from Python: counted
        if stage == "none":
            return ddp, torch.optim.AdamW(ddp.parameters(), lr=lr)
        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=lr)
    # off the import path: torch.distributed.fsdp takes most of a second to import
    from torch.distributed.fsdp import fully_shard

    options = dict(mesh=init_device_mesh(device, (world_size,)), reshard_after_forward=stage == "zero3")
    if offload_policy is not None:
        options["offload_policy"] = offload_policy
    for layer in find_layer_stack(model):  # the decoder layers, found as lesson 3 finds them
        fully_shard(layer, **options)
    fully_shard(model, **options)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)
