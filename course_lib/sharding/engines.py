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

FSDP2 as people configure it (`FSDPOptions`):
- wrapping: "blocks" (the course's: `fully_shard` on each decoder layer, then the root, which then
  holds the embeddings, the final norm and the output layer as one unit whose gradients are
  reduce-scattered last) or "torchtitan" (torchtitan's llama recipe: the input embeddings, each block
  and `[norm, output]` as units of their own, the last one never resharded after forward, then the root);
- `MixedPrecisionPolicy(param_dtype, reduce_dtype)`: the dtype of the gathered weights (and so of the
  compute and the unsharded gradients) and of the reduce-scatter; the shards stay in the model's dtype;
- reshard_root: zero3 reshards the root after forward too (the course's default: 3P sent); FSDP2's own
  default (`reshard_after_forward=None` on the root) keeps the root gathered from forward to backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.device_mesh import init_device_mesh

from course_lib.errors import UserError
from course_lib.layers import find_layer_stack
from course_lib.validate import Count, Device, checked

ENGINES = {
    "none": "DDP",
    "zero1": "DDP + ZeroRedundancyOptimizer",
    "zero2": "FSDP2, reshard_after_forward=False",
    "zero3": "FSDP2, reshard_after_forward=True",
}
STAGES = tuple(ENGINES)
WRAPPINGS = ("blocks", "torchtitan")


@checked
@dataclass(frozen=True)
class FSDPOptions:
    """How FSDP2 is configured for zero2 and zero3 (lesson 6, "FSDP2 as people configure it").
    param_dtype / reduce_dtype: MixedPrecisionPolicy's (None: the model's own dtype)."""

    wrapping: str = "blocks"
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    reshard_root: bool = True

    def __post_init__(self):
        if self.wrapping not in WRAPPINGS:
            raise UserError(f"unknown wrapping {self.wrapping!r}: use one of {', '.join(WRAPPINGS)}")


def fsdp_units(model: nn.Module, wrapping: str) -> list[list[nn.Module]]:
    """The modules of each `fully_shard` call before the root's, in order (lesson 6): every decoder
    layer for "blocks"; for "torchtitan" the input embeddings first (left to the root when the output
    layer is tied to them), then the layers, then every other module that holds parameters of its own
    (the final norm, the output layer, GPT-2's position embeddings) as one group."""
    layers = list(find_layer_stack(model))  # the decoder layers, found as lesson 3 finds them
    units = [[layer] for layer in layers]
    if wrapping == "blocks":
        return units
    embeddings, output = model.get_input_embeddings(), model.get_output_embeddings()
    tied = output is not None and output.weight is embeddings.weight  # then the embeddings stay with the root
    inside = {id(p) for layer in layers for p in layer.parameters()} | {id(embeddings.weight)}
    rest = [
        m for m in model.modules() if m is not model and any(id(p) not in inside for p in m.parameters(recurse=False))
    ]
    return ([] if tied else [[embeddings]]) + units + ([rest] if rest else [])


@checked
def wrap(
    model: nn.Module,
    stage: str,
    world_size: Count,
    lr: float = 1e-3,
    *,
    device: Device = "cpu",
    offload_policy=None,
    fsdp: FSDPOptions = FSDPOptions(),
):
    """(the model to train, its optimizer) for `stage` (one of ENGINES) in a running process group.

    The optimizer is torch's AdamW (foreach step, its default) in every stage (lesson 6). For FSDP2,
    `device` is the mesh's device type, `offload_policy` (e.g. CPUOffloadPolicy()) is passed on, and
    `fsdp` says how it is wrapped and in which dtypes it gathers and reduces."""
    if stage not in ENGINES:
        raise UserError(f"unknown stage {stage!r}: use one of {', '.join(ENGINES)}")
    if not dist.is_initialized():
        raise UserError("wrap runs in a process group: call it in a rank's worker (run_ranks starts them)")
    if stage in ("none", "zero1"):
        # off the import path: torch.distributed.optim takes most of a second to import
        from torch.distributed.optim import ZeroRedundancyOptimizer

        ddp = nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(dist.group.WORLD, allreduce_hook)  # torch's default all-reduce, from Python: counted
        if stage == "none":
            return ddp, torch.optim.AdamW(ddp.parameters(), lr=lr)
        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=lr)
    # off the import path: torch.distributed.fsdp takes most of a second to import
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    options = dict(
        mesh=init_device_mesh(device, (world_size,)),
        reshard_after_forward=stage == "zero3",
        mp_policy=MixedPrecisionPolicy(param_dtype=fsdp.param_dtype, reduce_dtype=fsdp.reduce_dtype),
    )
    if offload_policy is not None:
        options["offload_policy"] = offload_policy
    for unit in fsdp_units(model, fsdp.wrapping):
        if len(unit) > 1:  # torchtitan's [norm, output]: not resharded, it is gathered again at once in backward
            fully_shard(unit, **{**options, "reshard_after_forward": False})
        else:
            fully_shard(unit[0], **options)
    fully_shard(model, **{**options, "reshard_after_forward": stage == "zero3" and fsdp.reshard_root})
    return model, torch.optim.AdamW(model.parameters(), lr=lr)
