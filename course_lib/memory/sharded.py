"""One GPU's share when N GPUs train together: ZeRO's stages on the engines that implement them
(lesson 6, "the planner shards").

`gpus=N, shard=...` plans one rank; the batch is that rank's micro-batch. Model states are
partitioned as ZeRO's paper counts them (Rajbhandari et al. 2020, Figure 1):

    none   DDP: weights, gradients, optimizer state and master weights on every GPU
    zero1  optimizer state and master weights / N
    zero2  gradients / N too
    zero3  weights / N too

With `--params` only, that is the whole prediction (the paper's arithmetic). With a model, the plan
adds what the real engine adds on top (`course_lib.sharding.engines` says which engine stands for
which stage), under `sharding_buffers`:

- none, zero1 (DDP; zero1 with ZeroRedundancyOptimizer): DDP's gradient buckets, one more copy of the
  gradients (torch/nn/parallel/distributed.py, gradient_as_bucket_view=False by default); zero1 splits
  the optimizer state by whole tensors, sorted-greedy (torch/distributed/optim/zero_redundancy_optimizer.py
  `_partition_parameters`): the plan is the rank with the largest share.
- zero2, zero3 (FSDP2): each parameter is cut along dim 0 into N padded chunks (`_fsdp_param.py`).
  The root's parameters (embeddings, final norm, output layer) stay gathered through forward and
  backward; forward peaks at the output layer and the loss, with the last layer's flat all-gather
  buffer still held (`_fsdp_collectives.py` foreach_all_gather); in backward zero3 holds the layer
  running and the next one prefetched, plus the running layer's unsharded gradients until its
  reduce-scatter; zero2 (reshard_after_forward=False) keeps every layer gathered from its forward
  to its backward and gathers nothing in backward. `benchmarks/sharding_accuracy.py` measures it.
  With a model, zero2's `weights` are FSDP2's shards and the gathered copies are `sharding_buffers`.
  Under mixed precision FSDP2 keeps fp32 shards of weights and gradients (no 16-bit shard); the
  categories stay the paper's (2 + 2 + 12 bytes per parameter), whose sum, 16/N, is the same.
"""

from __future__ import annotations

import math
import re

from course_lib.measure import format_bytes
from course_lib.memory.setup import PlanError, Setup, itemsize
from course_lib.models import ModelSpec

SHARDS = ("none", "zero1", "zero2", "zero3")
# what each stage divides by N, as the paper counts it
PARTITIONED = {"none": (), "zero1": ("optimizer_state", "master_weights"),
               "zero2": ("optimizer_state", "master_weights", "gradients"),
               "zero3": ("optimizer_state", "master_weights", "gradients", "weights")}
_LAYER = re.compile(r"^(.*?\.(?:layers|h)\.\d+)\.")


def validate(setup: Setup) -> None:
    """PlanError for gpus < 1, an unknown stage, or a stage without gpus (lesson 6)."""
    if setup.gpus is not None and (isinstance(setup.gpus, bool) or not isinstance(setup.gpus, int) or setup.gpus < 1):
        raise PlanError(f"gpus must be a positive integer (how many GPUs train together), got {setup.gpus!r}")
    if setup.shard not in SHARDS:
        raise PlanError(f"unknown shard stage {setup.shard!r}: use one of {', '.join(SHARDS)}")
    if setup.shard != "none" and setup.gpus is None:
        raise PlanError(f"--shard {setup.shard} needs --gpus N: how many GPUs share the model states")
    if setup.shard in ("zero2", "zero3") and setup.quant != "none":
        raise PlanError(f"--shard {setup.shard} with --quant {setup.quant}: FSDP of a 4-bit base is not modelled; "
                        "plan QLoRA on one GPU (no --gpus) or shard a 16-bit model")


def layer_and_root_numels(spec: ModelSpec) -> tuple[list[int], int]:
    """Parameters of each decoder layer (an FSDP2 group each) and of the rest (the root's group)."""
    layers: dict[str, int] = {}
    root = 0
    for info in spec.params:
        match = _LAYER.match(info.name)
        if match:
            layers[match.group(1)] = layers.get(match.group(1), 0) + info.numel
        else:
            root += info.numel
    return list(layers.values()), root


def fsdp_fraction(spec: ModelSpec, n: int) -> float:
    """The fraction of the parameters rank 0 holds under FSDP2: dim 0 cut in N chunks, padded."""
    local = sum(math.ceil(info.shape[0] / n) * info.numel // max(info.shape[0], 1) if info.shape else info.numel
                for info in spec.params)
    return local / spec.n_params


def zero1_shares(numels: list[int], n: int) -> list[int]:
    """Elements of optimizer state each rank owns under ZeroRedundancyOptimizer: largest tensor first,
    each to the rank with the fewest so far (torch's sorted-greedy partition)."""
    sizes = [0] * n
    for numel in sorted(numels, reverse=True):
        sizes[sizes.index(min(sizes))] += numel
    return sizes


def sharded_values(spec: ModelSpec | None, setup: Setup, values: dict, trace=None,
                   trainable: list[int] = ()) -> tuple[dict, dict, list[str]]:
    """One rank's bytes by category for `setup.gpus` GPUs at stage `setup.shard` (lesson 6).

    `values`: the single-GPU plan's bytes; `trace`: its meta-device trace (None with --params only);
    `trainable`: the trained tensors' sizes (ZeroRedundancyOptimizer partitions them)."""
    n, stage = setup.gpus, setup.shard
    out = dict(values)
    detail: dict = {"gpus": n, "shard": stage}
    notes = []
    if spec is None:  # the paper's arithmetic: model states only
        for category in PARTITIONED[stage]:
            out[category] = math.ceil(values[category] / n)
        out["sharding_buffers"] = 0
        out["total"] = sum(out[c] for c in ("weights", "gradients", "optimizer_state", "master_weights",
                                            "quantization", "overhead"))
        notes.append("sharding: model states only (the ZeRO paper's arithmetic); name a model for the buffers "
                     "the engines add and for activations")
        return out, detail, notes

    grads, weight_bytes = values["gradients"], values["weights"] + values["quantization"]
    if stage in ("none", "zero1"):
        buckets = grads  # DDP's buckets: one more copy of the gradients
        out["sharding_buffers"] = buckets
        if stage == "zero1":
            shares = zero1_shares(list(trainable), n)
            share = max(shares) / sum(shares)
            detail["zero1_rank_shares"] = [s / sum(shares) for s in shares]
            for category in ("optimizer_state", "master_weights"):
                out[category] = round(values[category] * share)
        saved = sum(values[c] - out[c] for c in ("optimizer_state", "master_weights"))
        out["total"] = values["total"] + buckets - saved
        notes.append(f"sharding {stage}: DDP's gradient buckets ({format_bytes(buckets)}) are a second copy of the "
                     "gradients")
        return out, detail, notes

    # FSDP2: shards of everything, plus the gathered layers and the unsharded gradients of one layer
    fraction = fsdp_fraction(spec, n)
    for category in ("weights", "gradients", "optimizer_state", "master_weights", "quantization"):
        out[category] = round(values[category] * fraction)
    layers, root = layer_and_root_numels(spec)
    per_param = weight_bytes / spec.n_params  # the dtype the layers compute in
    largest, root_bytes = max(layers) * per_param, root * per_param
    all_layers = sum(layers) * per_param
    grad_ratio = grads / max(weight_bytes, 1)  # gradient bytes per weight byte (1 for a full fine-tune)
    gathered = root_bytes + (all_layers if stage == "zero2" else 0)  # gathered throughout forward and backward
    prefetched = largest if stage == "zero3" else 0  # zero2 gathers nothing in backward
    states = sum(out[c] for c in ("weights", "optimizer_state", "master_weights", "quantization"))
    batch = 2 * setup.batch * setup.seq * 8
    from course_lib.memory.planner import checkpointing_changes

    _, held, changed = checkpointing_changes(trace, setup)  # lesson 3's plan, as for one GPU
    # forward peaks at the output layer and the loss: one layer's flat all-gather buffer is still held
    forward = states + batch + trace.forward_peak_without_grads + held + gathered + largest
    # backward at the output layer: the last layer prefetched (zero3)
    head = states + batch + trace.head_backward_peak_without_grads + held + gathered + prefetched
    # backward in the layers: the layer running and the next one prefetched (zero3), its unsharded gradients
    layers_peak = states + batch + trace.layer_backward_peak_without_grads + changed + gathered + 2 * prefetched \
        + largest * grad_ratio
    backward = max(head, layers_peak)
    forward_buffers = gathered + largest
    backward_buffers = gathered + max(prefetched, 2 * prefetched + largest * grad_ratio)
    step = states + out["gradients"] + batch + values["optimizer_temporaries"] * fraction
    peak = max(forward, backward, step)
    out["sharding_buffers"] = round(max(forward_buffers, backward_buffers))
    out["activations"] = max(0, round(peak - states - out["gradients"] - out["sharding_buffers"]))
    out["optimizer_temporaries"] = 0
    out["total"] = round(peak) + values["overhead"]
    detail.update(forward_peak=round(forward), backward_peak=round(backward), optimizer_step_peak=round(step))
    held_layers = "every layer stays gathered from its forward to its backward" if stage == "zero2" else \
        "two layers gathered at a time in backward, plus one layer of unsharded gradients"
    notes.append(f"sharding {stage} (FSDP2): root parameters {format_bytes(root_bytes)} gathered, one layer "
                 f"{format_bytes(largest)}; {held_layers}")
    return out, detail, notes


def offload_prediction(plan) -> dict[str, int]:
    """Bytes on the GPU, in CPU RAM and over PCIe per step for a zero3 plan under FSDP2's
    CPUOffloadPolicy (lesson 6, "offloading the shards"): the shards of weights, gradients and optimizer
    state move to CPU RAM and the optimizer step runs there; before each of a layer's two all-gathers
    its fp32 weight shard is copied to the GPU, and each gradient shard is copied back
    (torch/distributed/fsdp/_fully_shard/_fsdp_param.py `all_gather_inputs`, _fsdp_collectives.py
    `foreach_reduce`)."""
    if plan.setup.gpus is None or plan.setup.shard != "zero3":
        raise PlanError("offload_prediction takes a plan with gpus=N and shard='zero3'")
    b = plan.bytes
    shards = b["weights"] + b["gradients"] + b["optimizer_state"] + b["master_weights"]
    fp32_weights = b["master_weights"] or b["weights"] * 4 // itemsize(plan.setup.weight_dtype)
    fp32_grads = fp32_weights * plan.trainable_params // max(plan.n_params, 1)  # shards in the parameter's dtype
    return {"gpu": plan.total - shards, "cpu": shards, "pcie_per_step": 2 * fp32_weights + fp32_grads}
