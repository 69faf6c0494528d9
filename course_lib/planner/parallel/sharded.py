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
  `_partition_parameters`) and steps a local optimizer over this rank's partition, whose foreach
  temporaries are the partition's: the plan is the rank with the largest share.
- zero2, zero3 (FSDP2; "zero2" always means FSDP2 with reshard_after_forward=False, a stand-in for ZeRO-2
  that also shards the weights, which ZeRO-2 keeps whole): `course_lib.planner.parallel.fsdp`, phase by phase,
  an upper bound. The plan's categories are what is live in the phase that peaks
  (`detail["peak_phase"]`), and add up to the total. `benchmarks/sharding_accuracy.py` measures it.
"""

from __future__ import annotations

import math

from course_lib.measure import format_bytes
from course_lib.models import ModelSpec
from course_lib.planner.config.errors import PlanError
from course_lib.planner.config.setup import Setup, itemsize
from course_lib.planner.parallel.fsdp import fsdp_values
from course_lib.planner.states.model_states import ModelStates, optimizer_step_extra
from course_lib.validate import checked

# what each stage divides by N, as the paper counts it
PARTITIONED = {
    "none": (),
    "zero1": ("optimizer_state", "master_weights"),
    "zero2": ("optimizer_state", "master_weights", "gradients"),
    "zero3": ("optimizer_state", "master_weights", "gradients", "weights"),
}


def zero1_partition(shapes: list[tuple[int, ...]], n: int) -> list[list[tuple[int, ...]]]:
    """The trained tensors' shapes each rank owns under ZeroRedundancyOptimizer (lesson 6)."""
    return [[shapes[i] for i in part] for part in zero1_partition_indices(shapes, n)]


def zero1_partition_indices(shapes: list[tuple[int, ...]], n: int) -> list[list[int]]:
    """Which trained tensors (indices into `shapes`) each rank owns under ZeroRedundancyOptimizer: largest
    tensor first (a stable sort), each to the rank with the fewest elements so far (torch 2.13,
    zero_redundancy_optimizer.py `_partition_parameters`; lesson 6)."""
    parts: list[list[int]] = [[] for _ in range(n)]
    sizes = [0] * n
    for i in sorted(range(len(shapes)), key=lambda i: math.prod(shapes[i]), reverse=True):
        rank = sizes.index(min(sizes))
        parts[rank].append(i)
        sizes[rank] += math.prod(shapes[i])
    return parts


def sharded_values(
    spec: ModelSpec | None,
    setup: Setup,
    values: dict,
    trace=None,
    states: ModelStates | None = None,
    step_temporaries: int = 0,
    cuda: bool = False,
) -> tuple[dict, dict, list[str]]:
    """One rank's bytes by category for `setup.gpus` GPUs at stage `setup.shard` (lesson 6).

    `values`: the single-GPU plan's bytes; `trace`: its meta-device trace (None with --params only);
    `states`: the single-GPU model states (ZeroRedundancyOptimizer partitions their trained tensors);
    `step_temporaries`: what one GPU's optimizer step allocates over the model states; `cuda`: a GPU target."""
    n, stage = setup.gpus, setup.shard
    out = dict(values)
    paper = sum(
        math.ceil(values[c] / n) if c in PARTITIONED[stage] else values[c]
        for c in ("weights", "gradients", "optimizer_state", "master_weights")
    )
    detail: dict = {"gpus": n, "shard": stage, "paper_model_states": paper}
    notes = []
    if spec is None:  # the paper's arithmetic: model states only
        for category in PARTITIONED[stage]:
            out[category] = math.ceil(values[category] / n)
        out["sharding_buffers"] = 0
        notes.append(
            "sharding: model states only (the ZeRO paper's arithmetic); name a model for the buffers "
            "the engines add and for activations"
        )
        return _with_total(out), detail, notes

    if stage in ("none", "zero1"):
        buckets = values["gradients"]  # DDP's buckets: one more copy of the gradients
        out["sharding_buffers"] = buckets
        if stage == "zero1":
            _zero1_local(setup, values, out, detail, states, step_temporaries, cuda)
            notes.append(
                "sharding zero1 (ZeroRedundancyOptimizer): each rank steps a local optimizer over its "
                f"partition ({detail['zero1_rank_shares'][detail['zero1_rank']]:.1%} of the trained "
                "elements on the rank planned, the largest), so its state and the step's temporaries "
                f"are local: {format_bytes(detail['zero1_step_temporaries'])} of temporaries"
            )
        notes.append(
            f"sharding {stage}: DDP's gradient buckets ({format_bytes(buckets)}) are a second copy of the gradients"
        )
        return _with_total(out), detail, notes

    values, fsdp_detail, note = fsdp_values(spec, setup, values, trace, states, step_temporaries)
    detail.update(fsdp_detail)
    notes.append(note)
    return _with_total(values), detail, notes


def _zero1_local(
    setup: Setup, values: dict, out: dict, detail: dict, states: ModelStates, step_temporaries: int, cuda: bool
) -> None:
    """zero1's rank with the largest partition: its optimizer state, master weights and step temporaries.
    ZeroRedundancyOptimizer steps a local optimizer built over this rank's partition only
    (`_partition_parameters()[rank]`), so a foreach AdamW's sqrt(v) is that partition's, not the model's."""
    shapes, flags = list(states.trainable_shapes), states.full_state or (False,) * len(states.trainable_shapes)
    parts = zero1_partition_indices(shapes, setup.gpus)
    sizes = [sum(math.prod(shapes[i]) for i in part) for part in parts]
    rank = sizes.index(max(sizes))
    share = sizes[rank] / sum(sizes)
    for category in ("optimizer_state", "master_weights"):
        out[category] = round(values[category] * share)
    local = optimizer_step_extra(
        setup.optimizer,
        [shapes[i] for i in parts[rank]],
        states.state_itemsize,
        states.grad_itemsize,
        cuda,
        setup.precision.startswith("mixed"),
        [flags[i] for i in parts[rank]],
    )
    # the temporaries over the activations' peak shrink by what the local step does not make
    out["optimizer_temporaries"] = max(0, values["optimizer_temporaries"] - (step_temporaries - local))
    detail.update(
        zero1_rank_shares=[size / sum(sizes) for size in sizes], zero1_rank=rank, zero1_step_temporaries=local
    )


def _with_total(out: dict) -> dict:
    """The bytes by category with their total, the sum of the others."""
    return {**out, "total": sum(v for k, v in out.items() if k != "total")}


@checked(error=PlanError)
def offload_prediction(plan) -> dict[str, int]:
    """Bytes on the GPU, in CPU RAM and over PCIe per step for a zero3 plan under FSDP2's
    CPUOffloadPolicy (lesson 6, "offloading the shards"): the shards of weights, gradients and optimizer
    state move to CPU RAM and the optimizer step runs there; before each of a layer's two all-gathers
    its fp32 weight shard is copied to the GPU, and each gradient shard is copied back
    (torch/distributed/fsdp/_fully_shard/_fsdp_param.py `all_gather_inputs`, _fsdp_collectives.py
    `foreach_reduce`). With --params only, nothing is known to stay on the GPU."""
    if not hasattr(plan, "setup") or not hasattr(plan, "bytes"):
        raise PlanError(f"plan must be a planner.Plan (what planner.plan returns), got {type(plan).__name__}")
    if plan.setup.gpus is None or plan.setup.shard != "zero3":
        raise PlanError("offload_prediction takes a plan with gpus=N and shard='zero3'")
    b, d = plan.bytes, plan.detail
    shards = b["weights"] + d.get("gradient_shards", b["gradients"]) + b["optimizer_state"] + b["master_weights"]
    fp32_weights = b["master_weights"] or b["weights"] * 4 // itemsize(plan.setup.weight_dtype)
    fp32_grads = fp32_weights * plan.trainable_params // max(plan.n_params, 1)  # shards in the parameter's dtype
    # a root kept gathered from forward to backward (--no-fsdp-reshard-root) is copied once, not twice
    root_once = 0 if plan.setup.fsdp_reshard_root else 4 * d.get("root_params", 0) // plan.setup.gpus
    # on the GPU: the forward and backward peaks less the shards (the step's temporaries are on the CPU)
    return {
        "gpu": d.get("on_gpu_under_offload", 0) + b["overhead"],
        "cpu": shards,
        "pcie_per_step": 2 * fp32_weights - root_once + fp32_grads,
    }
