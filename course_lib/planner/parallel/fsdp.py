"""FSDP2's share of one rank, phase by phase: zero2 and zero3 as `course_lib.sharding.engines` runs them
(lesson 6, "the planner shards", "FSDP2 as people configure it").

Each parameter is cut along dim 0 into N padded chunks (torch 2.13 `_fsdp_param.py`); each group of
`fully_shard` (a decoder layer; under torchtitan's wrapping also the input embeddings and
`[norm, output]`; the root with what is left) is gathered for its forward and again for its backward
(zero3) or kept gathered from its forward to its backward (zero2), and its gradients are
reduce-scattered when its backward ends; the root's wait for the final backward callback
(`_fsdp_state.py` `_root_post_backward_final_callback`). What is alive at once, by phase:

- forward peaks at the output layer and the loss, with the last layer's flat all-gather buffer still
  held (`_fsdp_collectives.py` foreach_all_gather) and no gradient in the first micro-batch
  (zero_grad(set_to_none=True));
- in backward zero3 holds the layer running and the next one prefetched, the running layer's
  unsharded gradients and the shards reduced so far; at the tail one group's reduce-scatter input (its
  gradients in the reduce dtype: `post_backward` keeps `reduce_scatter_max_input_buffers` = 1 of them
  alive until the next group's reduce-scatter is issued), the largest of them counted;
- zero3 gathers the root again at the start of backward (its flat all-gather buffer beside the
  unsharded parameters, and beside the last layer's all-gather, which the root's `pre_backward`
  prefetches while the communication thread can still hold the root's buffer: the high runs);
  torchtitan's `[norm, output]` group also holds GPT-2's position embeddings, so it stays gathered
  through the layers' backward and holds no gradient of them at the head; the last reduce-scatter
  holds that group's unsharded gradients beside their copy in the reduce dtype;
- AdamW's step runs on the shards; its temporaries shrink with them.

The plan takes, phase by phase, the largest set that this scheduling lets be alive at once: an upper
bound. A measured peak moves from run to run below it (lesson 6, "the spread"), because the
collectives are asynchronous and a buffer is freed when its collective has finished. Not counted: gloo's
worker thread holding the root's flat all-gather buffer on into the output layer's backward, a thread
delayed on a loaded machine rather than FSDP2's schedule (seen on gloo: gpt2-6L and qwen2-3L, 4 ranks,
+1.9 and +2.0 MiB on some ranks in one of 5 starts).

FSDP + QLoRA (lesson 6): the packed 4-bit weights, stored in `bnb_4bit_quant_storage` elements (bf16),
are sharded and gathered like any 16-bit tensor; the quant_state is module state, whole on every rank;
the frozen base makes no gradient, so only the adapters' gradients are unsharded and reduce-scattered
(`unit_sizes` counts each group in bytes). `tests/sharding/test_fsdp_qlora.py` measures it on gloo.

`setup.fsdp_version == 1`: accelerate's FSDP1 (FullyShardedDataParallel; the Trainer's FSDP recipes). Its
flat parameter is gathered into itself (no separate all-gather buffer), the root stays gathered from
forward to backward (`_runtime_utils._post_forward_reshard` does not free the root's), and accelerate's default
backward_prefetch (NO_PREFETCH) gathers one layer at a time in backward; `setup.fsdp_backward_prefetch`
(BACKWARD_PRE, FullyShardedDataParallel's own default) gathers the next one before the running one's
backward. The Trainer wraps LoRA's adapters as units of their own (transformers/distributed/fsdp.py
`update_fsdp_plugin_peft`, peft's `fsdp_auto_wrap_policy`), so the frozen layers' flat parameters make no
gradient, as under FSDP2.
`tests/planner/test_fsdp1.py` measures it on gloo.

Mixed precision is `MixedPrecisionPolicy(param_dtype=16-bit)` on an fp32 model: the shards of the
weights and of the gradients are fp32 (they are the master weights: no 16-bit shard), the gathered
weights and the unsharded gradients 16-bit, the reduce-scatter in `setup.fsdp_reduce_dtype` (None:
the gradients' dtype, FSDP2's default; "fp32": torchtitan's).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from course_lib.measure import format_bytes
from course_lib.models import ModelSpec, ParamInfo
from course_lib.planner.config.setup import Setup, itemsize
from course_lib.planner.phases.activations import checkpointing_changes, layers_backward_peak, previous_outputs
from course_lib.planner.states.model_states import ModelStates, nf4_bytes, target_match


@dataclass(frozen=True)
class FSDPGroups:
    """Elements of each FSDP2 group (lesson 6): `layers` one per decoder layer; `root` what the root
    keeps; `embeddings` and `head` torchtitan's units; `head_side` the parameters outside the layers
    that run at the head (the final norm and an untied output layer), whatever group holds them."""

    layers: list[float]
    root: float
    embeddings: float
    head: float
    head_side: float


def layer_and_root_numels(
    spec: ModelSpec, size: Callable[[ParamInfo], float] = lambda info: info.numel
) -> tuple[list[float], float]:
    """Parameters of each decoder layer (an FSDP2 group each) and of the rest; `size`: what one
    parameter counts (its elements by default; `unit_sizes` gives its bytes)."""
    layers: dict[int, float] = {}
    root: float = 0
    for info in spec.params:  # info.layer: the decoder layer that layers.find_layer_stack finds
        if info.layer is None:
            root += size(info)
        else:
            layers[info.layer] = layers.get(info.layer, 0) + size(info)
    return list(layers.values()), root


def fsdp_groups(
    spec: ModelSpec, wrapping: str, size: Callable[[ParamInfo], float] = lambda info: info.numel
) -> FSDPGroups:
    """The groups `course_lib.sharding.engines.fsdp_units` makes: "blocks" leaves everything outside
    the layers to the root; "torchtitan" gives the input embeddings (the first embedding outside the
    layers) and the rest their own groups, and leaves tied embeddings (also the output layer) to the root.
    Each group counted in `size` (elements by default)."""
    layers, outside_numel = layer_and_root_numels(spec, size)
    outside = [info for info in spec.params if info.layer is None]
    embedding = next((size(info) for info in outside if info.module == "embedding"), 0)
    head_side = sum(size(info) for info in outside if info.is_lm_head or info.module != "embedding")
    if wrapping == "blocks":
        return FSDPGroups(layers, outside_numel, 0, 0, head_side)
    if not any(info.is_lm_head for info in spec.params):  # tied: the output layer is the input embeddings
        return FSDPGroups(layers, embedding, 0, outside_numel - embedding, head_side)
    return FSDPGroups(layers, 0, embedding, outside_numel - embedding, head_side)


def fsdp_fraction(spec: ModelSpec, n: int) -> float:
    """The fraction of the parameters rank 0 holds under FSDP2: dim 0 cut in N chunks, padded."""
    local = sum(
        math.ceil(info.shape[0] / n) * info.numel // max(info.shape[0], 1) if info.shape else info.numel
        for info in spec.params
    )
    return local / spec.n_params


def unit_sizes(spec: ModelSpec, setup: Setup, values: dict) -> tuple[Callable, Callable]:
    """(bytes of one base parameter as its group gathers it, bytes of its unsharded gradient), LoRA's
    adapters on it included (lesson 6, "FSDP + QLoRA").

    A full fine-tune gathers every parameter in the compute dtype and makes a gradient of the same size.
    Under LoRA the frozen base is gathered as stored and makes no gradient; each adapted layer adds its
    fp32 adapters (peft's default) to the gathered bytes and their fp32 gradients. A 4-bit base is
    stored packed in `bnb_4bit_quant_storage` elements (bitsandbytes 0.50 `Params4bit._quantize`: shape
    (numel / (2 * itemsize), 1)), which FSDP shards and gathers like any 16-bit tensor: two 4-bit values
    a byte. Its quant_state (absmax, nested absmax, code) is no parameter: each rank keeps all of it."""
    if not setup.lora_rank:
        per_param = (values["weights"] + values["quantization"]) / spec.n_params
        grad_ratio = values["gradients"] / max(values["weights"] + values["quantization"], 1)
        return (lambda info: info.numel * per_param), (lambda info: info.numel * per_param * grad_ratio)

    def adapters(info: ParamInfo) -> int:
        return setup.lora_rank * sum(info.shape) if target_match(info, setup.lora_targets) else 0

    return (lambda info: stored_bytes(info, setup) + 4 * adapters(info)), (lambda info: 4 * adapters(info))


def stored_bytes(info: ParamInfo, setup: Setup) -> int:
    """A frozen base parameter's bytes as stored on the GPU under LoRA: a 4-bit linear weight packed, the
    rest in the weights' dtype (fp32 after prepare_model_for_kbit_training)."""
    if setup.quant != "none" and info.module == "linear" and not info.is_lm_head and info.name.endswith(".weight"):
        return nf4_bytes(info.numel, setup.quant == "nf4-dq")[0]
    return info.numel * (4 if setup.prepare_kbit else itemsize(setup.weight_dtype))


def unshard_pool_extra(totals: dict[str, float], gathered: dict[str, float]) -> float:
    """What FSDP1's own CUDA stream adds to the reserve (lesson 6): `_runtime_utils._unshard` gathers each
    unit's flat parameter under `unshard_stream`, and the caching allocator keeps a pool of blocks per
    stream, so the gathered units and the rest of the step each reserve their own peak: the sum of the two
    peaks less the step's (`totals` and the `gathered` bytes by phase; a phase not named gathers none).
    Predicted: CPU has no streams to measure it on."""
    rest = max(total - gathered.get(name, 0) for name, total in totals.items())
    return max(0.0, rest + max(gathered.values()) - max(totals.values()))


def fsdp_values(
    spec: ModelSpec, setup: Setup, values: dict, trace, states: ModelStates, step_temporaries: int
) -> tuple[dict, dict, str]:
    """One rank's bytes by category under zero2/zero3 (the peak phase's), the details, and a note."""
    stage, zero3 = setup.shard, setup.shard == "zero3"
    out = dict(values)
    fraction = fsdp_fraction(spec, setup.gpus)
    for category in ("weights", "gradients", "optimizer_state", "master_weights"):
        out[category] = round(values[category] * fraction)
    # the 4-bit quant_state is module state, not a parameter: whole on every rank
    if setup.precision.startswith("mixed"):  # fp32 shards of the weights and the gradients, no 16-bit shard
        out["weights"], out["master_weights"] = round(4 * spec.n_params * fraction), 0
        out["gradients"] = round(4 * states.trainable * fraction)
    gradient_shards = out["gradients"]
    gathered, grad = unit_sizes(spec, setup, values)
    g = fsdp_groups(spec, setup.fsdp_wrapping)  # elements: the layers' share of the activations
    w = fsdp_groups(spec, setup.fsdp_wrapping, gathered)  # bytes as gathered
    gr = fsdp_groups(spec, setup.fsdp_wrapping, grad)  # bytes of the unsharded gradients
    all_grads = max(sum(gr.layers) + gr.root + gr.embeddings + gr.head, 1)
    largest, all_layers, largest_grads = max(w.layers), sum(w.layers), max(gr.layers)
    root, embeddings, head = w.root, w.embeddings, w.head
    blocks = setup.fsdp_wrapping == "blocks"
    # gathered from forward to the end of backward: the root, and under zero2 every group
    always = root + (0 if zero3 else all_layers + embeddings + head)
    running = largest if zero3 else 0  # zero2 gathers nothing in backward
    fsdp2 = setup.fsdp_version == 2
    # FSDP2 prefetches the next layer in backward, as FSDP1 does with BACKWARD_PRE (its own default);
    # accelerate's FSDP1 does not (backward_prefetch NO_PREFETCH)
    ahead = running if fsdp2 or setup.fsdp_backward_prefetch else 0
    # the trace's own gradients at the head and of all outside the layers, which the engine's buffers hold
    trace_head_grads = gr.head_side
    trace_root_grads = gr.root + gr.embeddings + gr.head
    # torchtitan's head group can hold an input-side parameter (GPT-2's position embeddings): the group stays
    # gathered through the layers' backward (measured on gloo)
    head_input = 0 if blocks else w.head - w.head_side
    # blocks: the root's gradients wait for the final callback; torchtitan: the head group's are
    # reduce-scattered after its backward, the embeddings' after theirs, at the tail
    held_head_grads = trace_head_grads if blocks else 0
    tail_grads = trace_root_grads if blocks else gr.root + gr.embeddings
    head_shards = 0 if blocks else gradient_shards * gr.head / all_grads
    mixed = setup.precision.startswith("mixed")
    reduce_size = 4 if setup.fsdp_reduce_dtype == "fp32" else states.grad_itemsize
    to_reduce = reduce_size / states.grad_itemsize
    # one group's reduce-scatter input, kept until the next group's reduce-scatter is issued
    reduce_input = max(largest_grads, gr.head) * to_reduce
    # the last reduce-scatter (the root's in the final callback; torchtitan's embeddings'): its unsharded
    # gradients beside their copy in the reduce dtype (`foreach_reduce_scatter_copy_in`); under mixed
    # precision the unsharded 16-bit gradients are still alive when the reduced shard is cast to fp32
    # (measured on gloo), a new gradient shard
    last = tail_grads
    new_shard = last * to_reduce / setup.gpus * 4 / reduce_size if mixed else 0
    # zero3 gathers the root again at the start of backward: its flat all-gather buffer lives beside the
    # unsharded parameters it is copied into (`foreach_all_gather_copy_out`), the forward's activations kept
    regather = root if zero3 and setup.fsdp_reshard_root and fsdp2 else 0  # FSDP1 keeps the root gathered
    # the overlap of the high runs (measured on gloo, the live storages at each rank's peak): FSDP2 frees an
    # all-gather's flat buffer in backward right after its copy-out, but gloo's worker thread drops its own
    # reference later; the root's `pre_backward` (`_fsdp_param_group.py`: unshard, wait_for_unshard,
    # _backward_prefetch) issues the last layer's all-gather while the root's buffer can still be alive:
    # "backward start" counts the prefetched layer (`ahead`) beside `regather`
    layer_shards = gradient_shards * sum(gr.layers) / all_grads  # the layers' reduced gradient shards
    model_states = sum(out[c] for c in ("weights", "optimizer_state", "master_weights", "quantization"))
    batch = 2 * setup.batch * setup.seq * 8
    dequant = trace.dequant_transient  # a 4-bit base: one gathered layer's weight dequantized per matmul
    chosen, held = checkpointing_changes(trace, setup)  # lesson 3's plan, as for one GPU
    layers_peak = layers_backward_peak(trace, chosen.plan, with_grads=False)
    share = max(g.layers) / sum(g.layers)
    above = chosen.forward_bytes * (1 - share)  # the other layers' activations, freed by the first layer's backward
    # with accumulation (each micro-batch reduce-scattered, FSDP2's default) every gradient shard is held
    # from the first micro-batch's backward to the step: all of them in every later micro-batch
    accumulated = gradient_shards if setup.accum > 1 else 0
    first_layer = not accumulated and layer_shards * (1 - share) > above
    # each phase as (activations, gradient shards, engine buffers) over the sharded weights and states
    # the gathered parameters by phase (FSDP1 gathers them under its own stream: `unshard_pool_extra`)
    gathered = {
        "forward": always + (head if zero3 else 0),
        "head backward": always + (head if zero3 else 0) + ahead,
        "layers backward": always + running + ahead + (head_input if zero3 else 0),
        "tail backward": always + (embeddings if zero3 else 0),
        "backward start": always + regather + ahead,
        "final reduce-scatter": 0,
        "optimizer step": 0,
    }
    phases = {
        # the output layer and the loss (the head group gathered), one layer's flat all-gather buffer still held
        "forward": (
            batch + trace.forward_peak_without_grads + dequant + held + previous_outputs(trace, setup),
            accumulated,
            gathered["forward"] + (largest if fsdp2 else 0),
        ),
        # backward at the output layer: the last layer prefetched (zero3); the trace with gradients holds
        # just the head's (the output layer's as a temporary until it is accumulated)
        "head backward": (
            batch + max(0, trace.head_backward_peak - trace_head_grads) + dequant + held,
            accumulated,
            gathered["head backward"] + trace_head_grads,
        ),
        # in the layers: the layer running and the next one prefetched (zero3), its unsharded gradients; the
        # last layer (first in backward) holds every layer's activations and no reduced gradients, the first
        # layer the reduced shards of all the others
        "layers backward": (
            batch + layers_peak + dequant - (above if first_layer else 0),
            max(accumulated, layer_shards * (1 - share) * first_layer + head_shards),
            gathered["layers backward"] + largest_grads + held_head_grads,
        ),
        # the embeddings' backward: every layer reduced (a group's reduce-scatter input still held: measured
        # on gloo, torchtitan's head group's is),
        # the embeddings regathered (zero3, torchtitan) and the gradients reduce-scattered last unsharded
        # (the trace counts the embeddings' new gradient as a temporary until it is accumulated)
        "tail backward": (
            batch + max(0, trace.tail_backward_peak_without_grads - (trace_root_grads - trace_head_grads)),
            max(accumulated, layer_shards + head_shards),
            gathered["tail backward"] + tail_grads + reduce_input,
        ),
        "backward start": (
            batch + chosen.forward_bytes + trace.saved_outside + trace.kept_outputs,
            accumulated,
            gathered["backward start"],
        ),
        # the last reduce-scatter, every other group reduced and resharded, no activation left
        "final reduce-scatter": (
            batch + trace.kept_outputs,
            max(accumulated, layer_shards + head_shards) + new_shard,
            gathered["final reduce-scatter"] + last * (1 + to_reduce),
        ),
        # AdamW's step on the shards: its temporaries scale with them
        "optimizer step": (batch + trace.kept_outputs, gradient_shards, gathered["optimizer step"]),
    }
    temporaries = round(step_temporaries * fraction)
    totals = {
        name: a + gs + b + (temporaries if name == "optimizer step" else 0) for name, (a, gs, b) in phases.items()
    }
    phase = max(totals, key=totals.get)
    activations, grad_shards, buffers = phases[phase]
    pools = 0 if fsdp2 else unshard_pool_extra(totals, gathered)
    out["activations"], out["gradients"] = round(activations), round(grad_shards)
    out["sharding_buffers"] = round(buffers)
    out["optimizer_temporaries"] = temporaries if phase == "optimizer step" else 0
    detail = dict(
        engine_model_states=model_states - out["quantization"] + gradient_shards,
        peak_phase=phase,
        forward_peak=round(model_states + totals["forward"]),
        backward_peak=round(model_states + max(totals[p] for p in phases if p not in ("forward", "optimizer step"))),
        optimizer_step_peak=round(model_states + totals["optimizer step"]),
        gradient_shards=gradient_shards,
        root_params=round(g.root),
        stream_pools_extra=round(pools),
        activations_by_phase={p: round(a) for p, (a, _, _) in phases.items()},
        buffers_by_phase={p: round(b) for p, (_, _, b) in phases.items()},
        on_gpu_under_offload=round(max(totals[p] - phases[p][1] for p in phases if p != "optimizer step")),
    )
    held_layers = (
        "every group stays gathered from its forward to its backward"
        if not zero3
        else f"{'two layers' if ahead else 'one layer'} gathered at a time in backward, one layer of unsharded "
        "gradients, a group's reduce-scatter input at the tail"
        + (
            "; overlapping at backward start: the root's "
            "flat all-gather buffer (gloo still holds it), its unsharded parameters and the last layer's all-gather, "
            "prefetched"
            if regather
            else ""
        )
    )
    wrapping = "each layer and the root" if blocks else "torchtitan's: embeddings, each layer, [norm, output], the root"
    prefetch = "BACKWARD_PRE prefetch" if setup.fsdp_backward_prefetch else "no backward prefetch (accelerate's)"
    engine = (
        "FSDP2"
        if fsdp2
        else (
            f"FSDP1: FullyShardedDataParallel, {'FULL_SHARD' if zero3 else 'SHARD_GRAD_OP'}, "
            f"{prefetch}, the root kept gathered"
            + (", each adapter a unit (the Trainer's peft wrap)" if setup.lora_rank else "")
        )
    )
    note = (
        f"sharding {stage} ({engine}{', a stand-in for ZeRO-2: reshard_after_forward=False' if not zero3 and fsdp2 else ''}; "
        f"wrapping {wrapping}): an upper bound, the most {engine[:5]}'s schedule lets be alive at once (a measured "
        f"peak moves from run to run below it): root parameters {format_bytes(root)} gathered throughout, one "
        f"layer {format_bytes(largest)}; {held_layers}; the peak: {phase}, whose categories are shown "
        "(gradients: the shards live then)"
        + (
            "; mixed precision: MixedPrecisionPolicy(param_dtype=16-bit) on an fp32 model, whose fp32 shards "
            "are the master weights (weights row)"
            if setup.precision.startswith("mixed")
            else ""
        )
        + (
            f"; a 4-bit base (bnb_4bit_quant_storage={setup.precision}, the compute dtype, so that FSDP can "
            f"shard it): the packed weights sharded and gathered a layer at a time, each rank keeping all the "
            f"quant_state ({format_bytes(out['quantization'])}: no parameter), only the adapters' gradients "
            "reduce-scattered"
            if setup.quant != "none"
            else ""
        )
        + (
            f"; with accum {setup.accum} each micro-batch is reduce-scattered (FSDP2's default) and every "
            f"gradient shard ({format_bytes(gradient_shards)}) is held from the first micro-batch to the step"
            if accumulated
            else ""
        )
    )
    return out, detail, note
