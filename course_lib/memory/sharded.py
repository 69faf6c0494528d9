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
- zero2, zero3 (FSDP2; zero2 is a stand-in: FSDP2 with reshard_after_forward=False also shards the
  weights, which ZeRO-2 keeps whole): each parameter is cut along dim 0 into N padded chunks
  (`_fsdp_param.py`). The root's parameters (embeddings, final norm, output layer) stay gathered
  through forward and backward, and their unsharded gradients wait for the root's reduce-scatter in
  the final backward callback (`_fsdp_state.py` `_root_post_backward_final_callback`). Forward peaks
  at the output layer and the loss, with the last layer's flat all-gather buffer still held
  (`_fsdp_collectives.py` foreach_all_gather) and no gradient (each step starts with
  zero_grad(set_to_none=True)); in backward zero3 holds the layer running and the next one prefetched,
  plus the running layer's unsharded gradients until its reduce-scatter and the shards reduced so far;
  zero2 keeps every layer gathered from its forward to its backward and gathers nothing in backward;
  AdamW's step runs on the shards, its temporaries shrink with them.
  The plan's categories are what is live in the phase that peaks (`detail["peak_phase"]`), and add up
  to the total; `detail` keeps each phase's peak and activations. Under mixed precision FSDP2 keeps fp32
  shards of weights and gradients (no 16-bit shard); the categories stay the paper's (2 + 2 + 12 bytes
  per parameter), whose sum, 16/N, is the same. `benchmarks/sharding_accuracy.py` measures it.
"""

from __future__ import annotations

import math

from course_lib.measure import format_bytes
from course_lib.memory.activations import checkpointing_changes, layers_backward_peak
from course_lib.memory.setup import PlanError, Setup, itemsize
from course_lib.models import ModelSpec

# what each stage divides by N, as the paper counts it
PARTITIONED = {"none": (), "zero1": ("optimizer_state", "master_weights"),
               "zero2": ("optimizer_state", "master_weights", "gradients"),
               "zero3": ("optimizer_state", "master_weights", "gradients", "weights")}


def layer_and_root_numels(spec: ModelSpec) -> tuple[list[int], int]:
    """Parameters of each decoder layer (an FSDP2 group each) and of the rest (the root's group)."""
    layers: dict[int, int] = {}
    root = 0
    for info in spec.params:  # info.layer: the decoder layer that layers.find_layer_stack finds
        if info.layer is None:
            root += info.numel
        else:
            layers[info.layer] = layers.get(info.layer, 0) + info.numel
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
                   trainable: list[int] = (), step_temporaries: int = 0) -> tuple[dict, dict, list[str]]:
    """One rank's bytes by category for `setup.gpus` GPUs at stage `setup.shard` (lesson 6).

    `values`: the single-GPU plan's bytes; `trace`: its meta-device trace (None with --params only);
    `trainable`: the trained tensors' sizes (ZeroRedundancyOptimizer partitions them);
    `step_temporaries`: what one GPU's optimizer step allocates over the model states."""
    n, stage = setup.gpus, setup.shard
    out = dict(values)
    paper = sum(math.ceil(values[c] / n) if c in PARTITIONED[stage] else values[c]
                for c in ("weights", "gradients", "optimizer_state", "master_weights"))
    detail: dict = {"gpus": n, "shard": stage, "paper_model_states": paper}
    notes = []
    if spec is None:  # the paper's arithmetic: model states only
        for category in PARTITIONED[stage]:
            out[category] = math.ceil(values[category] / n)
        out["sharding_buffers"] = 0
        notes.append("sharding: model states only (the ZeRO paper's arithmetic); name a model for the buffers "
                     "the engines add and for activations")
        return _with_total(out), detail, notes

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
        notes.append(f"sharding {stage}: DDP's gradient buckets ({format_bytes(buckets)}) are a second copy of the "
                     "gradients")
        return _with_total(out), detail, notes

    # FSDP2: shards of everything, plus the gathered layers and the unsharded gradients before reduce-scatter
    fraction = fsdp_fraction(spec, n)
    for category in ("weights", "gradients", "optimizer_state", "master_weights", "quantization"):
        out[category] = round(values[category] * fraction)
    gradient_shards = out["gradients"]
    layers, root = layer_and_root_numels(spec)
    per_param = weight_bytes / spec.n_params  # the dtype the layers compute in
    largest, root_bytes = max(layers) * per_param, root * per_param
    all_layers = sum(layers) * per_param
    grad_ratio = grads / max(weight_bytes, 1)  # gradient bytes per weight byte (1 for a full fine-tune)
    gathered = root_bytes + (all_layers if stage == "zero2" else 0)  # gathered throughout forward and backward
    prefetched = largest if stage == "zero3" else 0  # zero2 gathers nothing in backward
    # the root's unsharded gradients wait for its reduce-scatter in the final backward callback
    # (_fsdp_state.py `_root_post_backward_final_callback`): the output layer's and final norm's from the
    # head on, the input embeddings' from the tail on
    root_grads = root_bytes * grad_ratio
    head_root_grads = sum(info.numel for info in spec.params if info.layer is None
                          and (info.is_lm_head or info.module != "embedding")) * per_param * grad_ratio
    layer_shards = gradient_shards * sum(layers) / spec.n_params  # the layers' reduced gradient shards
    states = sum(out[c] for c in ("weights", "optimizer_state", "master_weights", "quantization"))
    batch = 2 * setup.batch * setup.seq * 8
    chosen, held = checkpointing_changes(trace, setup)  # lesson 3's plan, as for one GPU
    layers_peak = layers_backward_peak(trace, chosen.plan, with_grads=False)
    share = max(layers) / sum(layers)
    above = chosen.forward_bytes * (1 - share)  # the other layers' activations, freed by the first layer's backward
    first_layer = layer_shards * (1 - share) > above
    # each phase as (activations, gradient shards, engine buffers) over the sharded weights and states;
    # zero_grad(set_to_none=True) leaves no gradient in forward
    phases = {
        # the output layer and the loss, one layer's flat all-gather buffer still held
        "forward": (batch + trace.forward_peak_without_grads + held + trace.kept_outputs, 0, gathered + largest),
        # backward at the output layer: the last layer prefetched (zero3); the trace with gradients holds
        # just the root's (the output layer's as a temporary until it is accumulated)
        "head backward": (batch + max(0, trace.head_backward_peak - head_root_grads) + held, 0,
                          gathered + prefetched + head_root_grads),
        # in the layers: the layer running and the next one prefetched (zero3), its unsharded gradients;
        # the last layer (first in backward) holds every layer's activations and no reduced gradients,
        # the first layer the reduced gradient shards of all the others and only its own activations
        "layers backward": (batch + layers_peak - (above if first_layer else 0), layer_shards * (1 - share) * first_layer,
                            gathered + 2 * prefetched + largest * grad_ratio + head_root_grads),
        # the embeddings' backward: every layer reduced, all the root's gradients unsharded (the trace
        # counts the embeddings' new gradient as a temporary until it is accumulated)
        "tail backward": (batch + max(0, trace.tail_backward_peak_without_grads - (root_grads - head_root_grads)),
                          layer_shards, gathered + root_grads),
        # AdamW's step on the shards: its temporaries scale with them
        "optimizer step": (batch + trace.kept_outputs, gradient_shards, 0),
    }
    temporaries = round(step_temporaries * fraction)
    totals = {name: a + g + b + (temporaries if name == "optimizer step" else 0)
              for name, (a, g, b) in phases.items()}
    phase = max(totals, key=totals.get)
    activations, grad_shards, buffers = phases[phase]
    out["activations"], out["gradients"] = round(activations), round(grad_shards)
    out["sharding_buffers"] = round(buffers)
    out["optimizer_temporaries"] = temporaries if phase == "optimizer step" else 0
    forward = states + totals["forward"]
    backward = states + max(totals[p] for p in ("head backward", "layers backward", "tail backward"))
    detail.update(engine_model_states=states - out["quantization"] + gradient_shards,
                  peak_phase=phase, forward_peak=round(forward), backward_peak=round(backward),
                  optimizer_step_peak=round(states + totals["optimizer step"]),
                  gradient_shards=gradient_shards,
                  activations_by_phase={p: round(a) for p, (a, _, _) in phases.items()},
                  on_gpu_under_offload=round(max(totals[p] - phases[p][1] for p in phases if p != "optimizer step")))
    held_layers = "every layer stays gathered from its forward to its backward" if stage == "zero2" else \
        "two layers gathered at a time in backward, plus one layer of unsharded gradients"
    notes.append(f"sharding {stage} (FSDP2{', a stand-in for ZeRO-2: reshard_after_forward=False' if stage == 'zero2' else ''}): "
                 f"root parameters {format_bytes(root_bytes)} gathered and their gradients unsharded until the end "
                 f"of backward, one layer {format_bytes(largest)}; {held_layers}; the peak: {phase}, whose "
                 "categories are shown (gradients: the shards live then)")
    return _with_total(out), detail, notes


def _with_total(out: dict) -> dict:
    """The bytes by category with their total, the sum of the others."""
    return {**out, "total": sum(v for k, v in out.items() if k != "total")}


def offload_prediction(plan) -> dict[str, int]:
    """Bytes on the GPU, in CPU RAM and over PCIe per step for a zero3 plan under FSDP2's
    CPUOffloadPolicy (lesson 6, "offloading the shards"): the shards of weights, gradients and optimizer
    state move to CPU RAM and the optimizer step runs there; before each of a layer's two all-gathers
    its fp32 weight shard is copied to the GPU, and each gradient shard is copied back
    (torch/distributed/fsdp/_fully_shard/_fsdp_param.py `all_gather_inputs`, _fsdp_collectives.py
    `foreach_reduce`). With --params only, nothing is known to stay on the GPU."""
    if plan.setup.gpus is None or plan.setup.shard != "zero3":
        raise PlanError("offload_prediction takes a plan with gpus=N and shard='zero3'")
    b, d = plan.bytes, plan.detail
    shards = b["weights"] + d.get("gradient_shards", b["gradients"]) + b["optimizer_state"] + b["master_weights"]
    fp32_weights = b["master_weights"] or b["weights"] * 4 // itemsize(plan.setup.weight_dtype)
    fp32_grads = fp32_weights * plan.trainable_params // max(plan.n_params, 1)  # shards in the parameter's dtype
    # on the GPU: the forward and backward peaks less the shards (the step's temporaries are on the CPU)
    return {"gpu": d.get("on_gpu_under_offload", 0) + b["overhead"], "cpu": shards,
            "pcie_per_step": 2 * fp32_weights + fp32_grads}
