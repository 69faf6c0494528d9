"""The step's activations and temporaries over the model states, from the meta-device trace and lesson
3's cost model (lesson 1, "the planner"; lesson 3, "a cost model")."""

from __future__ import annotations

import math

import torch

from course_lib import checkpointing, validate
from course_lib.models import ModelSpec
from course_lib.planner.config.errors import PlanError
from course_lib.planner.config.setup import Setup, itemsize
from course_lib.planner.states.model_states import ModelStates, optimizer_step_extra


def korthikanti_bytes(batch: int, seq: int, hidden: int, heads: int, layers: int) -> int:
    """Korthikanti et al. 2022: activations of a transformer, sbh(34 + 5as/h) bytes per layer
    (16-bit, with dropout masks, 4h MLP, no recompute). Shown beside the traced value, not trusted:
    real implementations store more or less (lesson 3)."""
    batch, seq, hidden, heads, layers = (
        validate.positive_int(name, value, error=PlanError)
        for name, value in (("batch", batch), ("seq", seq), ("hidden", hidden), ("heads", heads), ("layers", layers))
    )
    return int(layers * seq * batch * hidden * (34 + 5 * heads * seq / hidden))


def checkpointing_changes(trace, setup: Setup):
    """Lesson 3's cost of the setup's checkpointing plan on this trace: (the plan's cost, the change of
    the bytes held through forward (<= 0))."""
    n = len(trace.saved)
    none = checkpointing.plan_cost(trace.saved, trace.inputs, [], output_bytes=trace.output)
    chosen = checkpointing.plan_cost(
        trace.saved, trace.inputs, checkpointing.named_plan(n, setup.checkpointing), output_bytes=trace.output
    )
    return chosen, chosen.forward_bytes - none.forward_bytes


PHASES = ("forward", "head backward", "layers backward", "tail backward", "optimizer step")


def previous_outputs(trace, setup: Setup) -> int:
    """The previous step's outputs, alive in this forward until `outputs` is bound again: the tutorials'
    loop ("keep-outputs"); nothing when the loop releases them after the step (lesson 1)."""
    return trace.kept_outputs if setup.loop == "keep-outputs" else 0


def step_phases(spec: ModelSpec, setup: Setup, states: ModelStates, trace, target: str) -> tuple[dict, dict]:
    """What each phase of the step holds at its peak on top of the weights, optimizer state, master
    weights and quantization (lesson 1, "the planner"): {phase: {"gradients": the parameter gradients
    live then, "activations": what is saved for backward, the forward's or backward's transients and the
    batch, "optimizer_temporaries": the optimizer step's own}}, and details; `trace`: the setup's
    trace_step. Under accumulation all gradients are live throughout, and the new micro-batch's
    gradient of a tensor, before it is added into `.grad`, is one of the backward's transients."""
    n = len(trace.saved)
    chosen, held_change = checkpointing_changes(trace, setup)
    segments = chosen.plan
    # amp: a checkpointed layer saves none of its weight copies, but autocast's cache holds them to the end
    # of the forward all the same (not in backward: the cache is cleared when the forward's autocast ends)
    cached = sum(sum(trace.autocast_cached[a:b]) for a, b in segments)
    grads = states.gradients
    dequant = trace.dequant_transient
    copies = autocast_copies(spec, setup)
    batch = 2 * setup.batch * setup.seq * 8  # the int64 input ids and labels, live for the whole step
    extra = batch + dequant  # in every phase but the step: the batch, and a dequantized 4-bit weight
    if setup.accum > 1:  # gradients of earlier micro-batches are live throughout; new ones are added in
        largest_grad = max(math.prod(s) for s in states.trainable_shapes) * states.grad_itemsize
        layers = layers_backward_peak(trace, segments, with_grads=False)
        live = {
            "forward": (grads, trace.forward_peak_without_grads + held_change + cached + copies),
            "head backward": (grads, trace.head_backward_peak_without_grads + held_change + largest_grad + copies),
            "layers backward": (grads, layers + largest_grad),
            "tail backward": (grads, trace.tail_backward_peak_without_grads + largest_grad - dequant),
        }
    else:
        layers, layer_grads = layers_backward_live(trace, segments)
        at = (trace.forward_peak_grads, trace.head_backward_peak_grads, layer_grads, trace.tail_backward_peak_grads)
        peaks = (
            trace.forward_peak + held_change + cached + copies,
            trace.head_backward_peak + held_change + copies,
            layers,
            trace.tail_backward_peak - dequant,
        )  # the tail: no 4-bit layer is left to run
        # the trace's gradients are the 16-bit ones the backward makes; Megatron keeps fp32 main gradients
        scale = states.gradients / trace.gradients if setup.fp32_main_grads and trace.gradients else 1
        live = {phase: (round(g * scale), peak - g) for phase, g, peak in zip(PHASES, at, peaks)}
    phases = {
        phase: {"gradients": g, "activations": a + extra, "optimizer_temporaries": 0} for phase, (g, a) in live.items()
    }
    phases["forward"]["activations"] += previous_outputs(trace, setup)
    # lesson 7's step in backward: no step after backward; the trace ran each update inside it
    step_temporaries = (
        0
        if setup.optimizer_in_backward
        else optimizer_step_extra(
            setup.optimizer,
            states.trainable_shapes,
            states.state_itemsize,
            states.grad_itemsize,
            target == "cuda",
            setup.precision.startswith("mixed") and not setup.fp32_main_grads,  # main gradients: already fp32
            states.full_state,
        )
    )
    phases["optimizer step"] = {
        "gradients": 0 if setup.optimizer_in_backward else grads,
        "activations": trace.kept_outputs + batch,
        "optimizer_temporaries": step_temporaries,
    }
    totals = {phase: sum(parts.values()) for phase, parts in phases.items()}
    config = spec.config
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", 0)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", 0)
    detail = {
        "saved_for_backward": sum(trace.saved) + trace.saved_outside,
        "saved_per_layer": round(sum(trace.saved) / max(n, 1)),
        "layer_input": trace.inputs[0] if n else 0,
        "batch": batch,
        "forward_peak": totals["forward"],
        "backward_peak": max(totals[phase] for phase in PHASES[1:4]),
        "optimizer_step_peak": totals["optimizer step"],
        "optimizer_step_temporaries": step_temporaries,
        "autocast_copies": copies,
        "korthikanti_formula": korthikanti_bytes(setup.batch, setup.seq, hidden, heads, n) if hidden else 0,
        "recompute_fraction": chosen.recompute_fraction,
        "checkpoint_segments": " ".join(f"{a}-{b - 1}" for a, b in chosen.plan),
    }
    return phases, detail


def layers_backward_live(trace, segments) -> tuple[int, int]:
    """The peak of the decoder layers' backward under a checkpointing plan, the gradients included, and
    the parameter gradients live at it (`layers_backward_peak`; the trace's own with no plan)."""
    if not segments:
        return trace.layer_backward_peak, trace.layer_backward_peak_grads
    cost = _layers_cost(trace, segments, with_grads=True)
    i = cost.peak_layer
    made = trace.head_grads + (0 if i is None else sum(trace.layer_grads[i + 1 :]) + trace.layer_peak_grads[i])
    return cost.peak_bytes, made


def layers_backward_peak(trace, segments, *, with_grads: bool) -> int:
    """The peak of the decoder layers' backward under a checkpointing plan (lesson 3's cost model fed with each layer's traced backward climb: a recomputed layer's
    backward needs its temporaries as much as an unchecked one's; fed them, the cost model of no plan
    gives the traced peak to the byte). The turn (head_bytes=0) is below the last layer's backward, which
    holds the same and climbs from there. With no plan the traced peak itself is taken: under activation
    offloading (lesson 7) the saved bytes are not on the device, which the cost model cannot express."""
    if not segments:
        return trace.layer_backward_peak if with_grads else trace.layer_backward_peak_without_grads
    return _layers_cost(trace, segments, with_grads=with_grads).peak_bytes


def _layers_cost(trace, segments, *, with_grads: bool):
    return checkpointing.plan_cost(
        trace.saved,
        trace.inputs,
        segments,
        output_bytes=trace.output,
        head_bytes=0,
        transient_bytes=trace.backward_climbs_with_grads if with_grads else trace.backward_climbs,
        grad_bytes=trace.layer_grads if with_grads else None,
        head_grad_bytes=trace.head_grads if with_grads else 0,
    )


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
