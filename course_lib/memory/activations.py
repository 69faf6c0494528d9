"""The step's activations and temporaries over the model states, from the meta-device trace and lesson
3's cost model (lesson 1, "the planner"; lesson 3, "a cost model")."""

from __future__ import annotations

import math

import torch

from course_lib import checkpointing, validate
from course_lib.memory.setup import PlanError, Setup, itemsize
from course_lib.memory.states import ModelStates, optimizer_step_extra
from course_lib.models import ModelSpec


def korthikanti_bytes(batch: int, seq: int, hidden: int, heads: int, layers: int) -> int:
    """Korthikanti et al. 2022: activations of a transformer, sbh(34 + 5as/h) bytes per layer
    (16-bit, with dropout masks, 4h MLP, no recompute). Shown beside the traced value, not trusted:
    real implementations store more or less (lesson 3)."""
    batch, seq, hidden, heads, layers = (validate.positive_int(name, value, error=PlanError) for name, value in (
        ("batch", batch), ("seq", seq), ("hidden", hidden), ("heads", heads), ("layers", layers)))
    return int(layers * seq * batch * hidden * (34 + 5 * heads * seq / hidden))


def checkpointing_changes(trace, setup: Setup):
    """Lesson 3's cost of the setup's checkpointing plan on this trace: (the plan's cost, the change of
    the bytes held through forward (<= 0))."""
    n = len(trace.saved)
    none = checkpointing.plan_cost(trace.saved, trace.inputs, [], output_bytes=trace.output)
    chosen = checkpointing.plan_cost(trace.saved, trace.inputs, checkpointing.named_plan(n, setup.checkpointing),
                                     output_bytes=trace.output)
    return chosen, chosen.forward_bytes - none.forward_bytes


def step_extra(spec: ModelSpec, setup: Setup, states: ModelStates, trace, target: str) -> tuple[int, dict]:
    """The most a step adds on top of all model states (activations, temporaries), and details;
    `trace`: the setup's trace_step."""
    n = len(trace.saved)
    chosen, held_change = checkpointing_changes(trace, setup)
    segments = chosen.plan
    # amp: a checkpointed layer saves none of its weight copies, but autocast's cache holds them to the end
    # of the forward all the same (not in backward: the cache is cleared when the forward's autocast ends)
    cached = sum(sum(trace.autocast_cached[a:b]) for a, b in segments)
    grads = states.gradients
    if setup.accum > 1:  # gradients of earlier micro-batches are live throughout; new ones are added in
        largest_grad = max(math.prod(s) for s in states.trainable_shapes) * states.grad_itemsize
        forward = grads + trace.forward_peak_without_grads + held_change + cached
        head = grads + trace.head_backward_peak_without_grads + held_change + largest_grad
        layers = grads + layers_backward_peak(trace, segments, with_grads=False) + largest_grad
        tail = grads + trace.tail_backward_peak_without_grads + largest_grad
    else:
        forward = trace.forward_peak + held_change + cached
        head = trace.head_backward_peak + held_change
        layers = layers_backward_peak(trace, segments, with_grads=True)
        tail = trace.tail_backward_peak  # after the layers' backward: none of their activations is left
    dequant = trace.dequant_transient
    copies = autocast_copies(spec, setup)
    forward += trace.kept_outputs  # the previous step's outputs, until `outputs` is bound again
    # lesson 7's step in backward: no step after backward; the trace ran each update inside it
    step_temporaries = 0 if setup.optimizer_in_backward else optimizer_step_extra(
        setup.optimizer, states.trainable_shapes, states.state_itemsize, states.grad_itemsize, target == "cuda",
        setup.precision.startswith("mixed"))
    step = (0 if setup.optimizer_in_backward else grads + step_temporaries) + trace.kept_outputs
    batch = 2 * setup.batch * setup.seq * 8  # the int64 input ids and labels, live for the whole step
    activation_peak = max(forward + dequant + copies, head + dequant + copies, layers + dequant, tail) + batch
    peak = max(activation_peak, step + batch)
    config = spec.config
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", 0)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", 0)
    detail = {
        "saved_for_backward": sum(trace.saved) + trace.saved_outside,
        "saved_per_layer": round(sum(trace.saved) / max(n, 1)),
        "layer_input": trace.inputs[0] if n else 0,
        "batch": batch,
        "forward_peak": forward + dequant + copies + batch,
        "backward_peak": max(head + dequant + copies, layers + dequant, tail) + batch,
        "optimizer_step_peak": step + batch,
        "optimizer_step_temporaries": step_temporaries,
        "optimizer_temporaries_over_activations": max(0, step + batch - max(activation_peak, grads)),
        "autocast_copies": copies,
        "korthikanti_formula": korthikanti_bytes(setup.batch, setup.seq, hidden, heads, n) if hidden else 0,
        "recompute_fraction": chosen.recompute_fraction,
        "checkpoint_segments": " ".join(f"{a}-{b - 1}" for a, b in chosen.plan),
    }
    return max(peak - grads, 0), detail


def layers_backward_peak(trace, segments, *, with_grads: bool) -> int:
    """The peak of the decoder layers' backward under a checkpointing plan (lesson 3's cost model fed
    with each layer's traced backward climb: a recomputed layer's backward needs its temporaries as
    much as an unchecked one's; fed them, the cost model of no plan gives the traced peak to the byte).
    The turn (head_bytes=0) is below the last layer's backward, which holds the same and climbs from
    there. With no plan the traced peak itself is taken: under activation offloading (lesson 7) the
    saved bytes are not on the device, which the cost model cannot express."""
    if not segments:
        return trace.layer_backward_peak if with_grads else trace.layer_backward_peak_without_grads
    cost = checkpointing.plan_cost(
        trace.saved, trace.inputs, segments, output_bytes=trace.output, head_bytes=0,
        transient_bytes=trace.backward_climbs_with_grads if with_grads else trace.backward_climbs,
        grad_bytes=trace.layer_grads if with_grads else None, head_grad_bytes=trace.head_grads if with_grads else 0)
    return cost.peak_bytes


def autocast_copies(spec: ModelSpec, setup: Setup) -> int:
    """16-bit copies autocast makes of fp32 frozen weights (lesson 5, "what makes it fit"): after
    prepare_model_for_kbit_training the output layer is fp32; under a 16-bit autocast every call casts
    it, and the copy is saved for its backward (a frozen weight's cast is not cached)."""
    if not setup.prepare_kbit or setup.weight_dtype not in (torch.float16, torch.bfloat16):
        return 0
    output = [p for p in spec.params if p.is_lm_head]
    if not output and getattr(spec.config, "tie_word_embeddings", False):  # tied: the embedding is the output layer
        output = [p for p in spec.params if p.module == "embedding"][:1]
    return sum(p.numel for p in output) * itemsize(setup.weight_dtype)
