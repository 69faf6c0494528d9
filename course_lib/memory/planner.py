"""The plan: the predicted bytes of one training step by category, and the notes that explain them
(lesson 1, "the planner")."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

import torch

from course_lib import checkpointing
from course_lib.measure import GiB, format_bytes
from course_lib.memory.gpus import CUDA_CONTEXT_BYTES, GPU, default_precision, fit_verdict, get_gpu
from course_lib.memory.setup import CATEGORIES, PlanError, Setup, itemsize
from course_lib.memory.states import ModelStates, model_states, optimizer_step_extra, target_match
from course_lib.memory.toolbox import toolbox_notes
from course_lib.memory.trace import trace_step
from course_lib.models import config_class_name, model_spec, ModelNotFound, ModelSpec, supported_attention


def korthikanti_bytes(batch: int, seq: int, hidden: int, heads: int, layers: int) -> int:
    """Korthikanti et al. 2022: activations of a transformer, sbh(34 + 5as/h) bytes per layer
    (16-bit, with dropout masks, 4h MLP, no recompute). Shown beside the traced value, not trusted:
    real implementations store more or less (lesson 3)."""
    return int(layers * seq * batch * hidden * (34 + 5 * heads * seq / hidden))


@dataclass
class Trick:
    """One step of "what makes it fit": the change, what it saves, the total after it."""

    name: str
    saves: int
    total_after: int
    fits_after: bool
    setup: Setup = field(repr=False)


@dataclass
class Plan:
    """Predicted memory of one training step, by category, in bytes (lesson 1).

    `bytes["total"]` is the predicted peak: the model states plus the most that the step
    (activations, temporaries of the backward pass and of the optimizer step) adds on top of them,
    plus the CUDA context on a GPU target. `activations_known` is False for a raw parameter count.
    """

    model: str
    setup: Setup
    n_params: int
    trainable_params: int
    bytes: dict[str, int]
    activations_known: bool
    detail: dict[str, int | float | str] = field(default_factory=dict)
    gpu: GPU | None = None
    tricks: list[Trick] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.bytes["total"]

    @property
    def fits(self) -> bool | None:
        return None if self.gpu is None else self.total <= self.gpu.memory_bytes

    def verdict(self) -> str:
        """One sentence: fits or not, and by how much."""
        return fit_verdict(self.total, self.gpu)

    def to_dict(self) -> dict:
        """Plain JSON-able numbers: bytes by category (integers), the setup, the verdict, the tricks."""
        return {
            "model": self.model, "n_params": self.n_params, "trainable_params": self.trainable_params,
            "setup": asdict(self.setup), "bytes": dict(self.bytes),
            "activations_known": self.activations_known, "detail": dict(self.detail),
            "gpu": None if self.gpu is None else {"name": self.gpu.name, "memory_bytes": self.gpu.memory_bytes},
            "fits": self.fits, "verdict": self.verdict(),
            "what_makes_it_fit": [{"trick": t.name, "saves_bytes": t.saves, "total_after": t.total_after,
                                   "fits_after": t.fits_after} for t in self.tricks],
            "notes": list(self.notes),
        }

    def rows(self) -> list[tuple[str, int]]:
        """(category, bytes); `sharding_buffers` (before the total) only in a plan with --gpus (lesson 6)."""
        shown = [c for c in CATEGORIES if c != "total"] + ["sharding_buffers"] * ("sharding_buffers" in self.bytes)
        return [(c, self.bytes[c]) for c in shown + ["total"]]

    def __str__(self) -> str:
        head = self.model if self.model.endswith("parameters") else f"{self.model}: {self.n_params:,} parameters"
        lines = [f"{head} ({self.trainable_params:,} trained), "
                 f"{self.setup.precision}, {self.setup.optimizer}"
                 + (f", LoRA r={self.setup.lora_rank}" if self.setup.lora_rank else "")
                 + (f" dropout {self.setup.lora_dropout:g}" if self.setup.lora_dropout else "")
                 + (f", {self.setup.quant}" if self.setup.quant != "none" else "")
                 + f", batch {self.setup.batch} x seq {self.setup.seq}"
                 + (f" x accum {self.setup.accum}" if self.setup.accum > 1 else "")
                 + (f", checkpointing {self.setup.checkpointing}" if self.setup.checkpointing != "none" else "")
                 + (f", {self.setup.gpus} GPUs, shard {self.setup.shard} (one GPU's share)"
                    if self.setup.gpus is not None else "")]
        for name, value in self.rows():
            unknown = name in ("activations", "sharding_buffers") and not self.activations_known
            shown = "unknown (no model shapes)" if unknown \
                else f"{value / GiB:10.2f} GiB"
            lines.append(f"  {name:<21} {shown}")
        if self.setup.gpus is not None:
            lines.append(f"  model states per GPU: {self.detail['paper_model_states'] / 1e9:.3f} GB as the ZeRO paper "
                         "counts them (10^9 bytes)" + (f"; FSDP2's zero2 stand-in shards the weights too: "
                                                       f"{self.detail['engine_model_states'] / 1e9:.3f} GB"
                                                       if self.setup.shard == "zero2" and self.activations_known else ""))
        lines.append(self.verdict())
        if self.tricks:
            lines.append("What makes it fit, in order (each on top of the ones before):")
            width = max(len(trick.name) for trick in self.tricks)
            for trick in self.tricks:
                lines.append(f"  {trick.name:<{width}} saves {trick.saves / GiB:7.2f} GiB -> "
                             f"{trick.total_after / GiB:7.2f} GiB{'  fits' if trick.fits_after else ''}")
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


def plan(model: str | ModelSpec | int | float, setup: Setup | None = None, *, gpu: str | GPU | None = None,
         suggest: bool = True, **options) -> Plan:
    """Predict the memory of one training step (lesson 1, "the planner").

    `model`: a bundled name ('llama-3.1-8b'), a config.json path, a ModelSpec, or a parameter count
    (then activations are unknown and counted as 0). `setup` or keyword options (see Setup).
    `gpu`: a catalog name; adds the CUDA context, a fit verdict and, when it does not fit, the
    tricks that make it fit. Without a setup or a precision, the precision is the GPU's, as
    `course-lib plan` picks it (mixed-fp16 on a T4).
    """
    if setup is None and "precision" not in options:  # the GPU's precision, as `course-lib plan` picks it
        options["precision"] = default_precision(get_gpu(gpu) if gpu is not None else None,
                                                 options.get("quant", "none"))
    setup = (setup or Setup())
    if options:
        unknown = set(options) - set(Setup.__dataclass_fields__)
        if unknown:
            raise PlanError(f"unknown option(s) {', '.join(sorted(unknown))}")
        setup = replace(setup, **options)
    setup.validate()
    card = get_gpu(gpu) if gpu is not None else None
    result = _plan(model, setup, card)
    if card is not None and suggest and not result.fits:
        from course_lib.memory.fit import what_makes_it_fit  # it plans each trick with _plan

        result.tricks = what_makes_it_fit(model, setup, card, result)
    return result


def _resolve(model) -> tuple[ModelSpec | None, int, str]:
    if isinstance(model, ModelSpec):
        return model, model.n_params, model.name
    if isinstance(model, (int, float)) and not isinstance(model, bool):
        if not math.isfinite(model) or model <= 0 or model != int(model):
            raise PlanError(f"--params must be a positive whole number of parameters, got {model!r}")
        return None, int(model), f"{int(model):,} parameters"
    spec = model_spec(model)
    return spec, spec.n_params, spec.name


def _plan(model, setup: Setup, card: GPU | None) -> Plan:
    spec, n_params, name = _resolve(model)
    warned = _check_setup_for(spec, name, setup)
    cuda = card is not None
    if setup.precision in ("bf16", "mixed-bf16") and card is not None and not card.bf16:
        raise PlanError(f"{card.name} (compute capability {card.compute_capability[0]}."
                        f"{card.compute_capability[1]}) has no bf16 hardware: use fp16 or mixed-fp16")
    if setup.quant != "none":
        import importlib.util

        if importlib.util.find_spec("bitsandbytes") is None:
            raise PlanError(f"--quant {setup.quant} needs bitsandbytes, which is not importable here: "
                            "pip install bitsandbytes") from None
    states = model_states(spec, setup, n_params, cuda=cuda)
    if setup.optimizer_in_backward:  # lesson 7: each gradient is freed in backward, right after its update
        states = replace(states, gradients=0)
    base = states.weights + states.optimizer_state + states.master_weights + states.quantization
    notes: list[str] = warned
    detail: dict[str, int | float | str] = {}
    temporaries = 0
    trace = trace_step(spec, setup, "cuda" if cuda else "cpu") if spec is not None else None
    if spec is None:
        extra = 0
        notes.append("activations unknown: only a parameter count was given (name a model or a config.json "
                     "for activations and the optimizer step's temporaries)")
    else:
        extra, detail = _step_extra(spec, setup, states, trace, "cuda" if cuda else "cpu")
        temporaries = detail.pop("optimizer_temporaries_over_activations")
        extra -= temporaries
        if detail["autocast_copies"]:
            notes.append(f"{setup.precision} autocast re-casts the fp32 frozen weights that prepare_model_for_kbit_training "
                         f"made (the output layer) at every call: {format_bytes(detail['autocast_copies'])} of 16-bit "
                         "copies live from its forward to its backward")
        if supported_attention(spec.config, setup.attention) != setup.attention:
            notes.append(f"attention: eager, because transformers' {config_class_name(spec.config).replace('Config', '')} "
                         f"does not support {setup.attention} (eager stores the s x s attention scores)")
        if setup.checkpointing != "none":
            notes.append(f"checkpointing {setup.checkpointing}: recomputes {detail['recompute_fraction']:.0%} "
                         "of one forward of the layers (lesson 3's cost model)")
    overhead = CUDA_CONTEXT_BYTES if cuda else 0
    total = base + states.gradients + extra + temporaries + overhead
    values = {"weights": states.weights, "gradients": states.gradients, "optimizer_state": states.optimizer_state,
              "master_weights": states.master_weights, "quantization": states.quantization,
              "activations": extra, "optimizer_temporaries": temporaries, "overhead": overhead, "total": total}
    if cuda:
        notes.append(f"overhead: CUDA context and libraries, about {format_bytes(CUDA_CONTEXT_BYTES)} "
                     "(300 to 700 MB, docs/references.md#pytorch-issue-28113-memory-used-when-cuda-starts), "
                     "not seen by torch.cuda.memory_allocated")
    if cuda and setup.optimizer == "adamw" and spec is not None and setup.gpus is None:  # one GPU: all of sqrt(v)
        notes.append("torch AdamW's default (foreach) step on CUDA makes sqrt(v) for all tensors at once: "
                     f"{format_bytes(states.trainable * states.state_itemsize)} more at the step "
                     f"(optimizer_temporaries: what it adds over the activations' peak); "
                     "fused=True (Trainer's adamw_torch_fused) avoids it")
    if spec is not None:
        notes.append("loop keep-outputs: the outputs (the logits) stay alive through backward, the step and the "
                     "next forward" if setup.loop == "keep-outputs" else "loop trainer: only the loss is kept; "
                     "`outputs = model(**batch); outputs.loss.backward()` keeps the logits too: --loop keep-outputs")
    if setup.optimizer.startswith("paged"):
        notes.append("paged optimizer: same bytes; under memory pressure the driver moves its state to CPU RAM "
                     "(lesson 4), at a cost in time")
    if spec is not None:
        more_notes, more_detail = toolbox_notes(setup, trace)
        notes += more_notes
        detail.update(more_detail)
    if setup.accum > 1:
        notes.append(f"effective batch {setup.batch * setup.accum} = micro-batch {setup.batch} x {setup.accum} "
                     "accumulation steps; gradients stay allocated during the micro-batches")
    if setup.gpus is not None:
        from course_lib.memory.sharded import sharded_values

        values, shard_detail, shard_notes = sharded_values(spec, setup, values, trace,
                                                           [math.prod(s) for s in states.trainable_shapes],
                                                           detail.get("optimizer_step_temporaries", 0))
        detail.update(shard_detail)
        notes += shard_notes
    return Plan(name, setup, n_params, states.trainable, values, spec is not None, detail, card, [], notes)


SHAPE_OPTIONS = ("batch", "seq", "checkpointing", "accum", "attention", "loop", "chunked_loss", "offload_activations",
                 "lora_dropout")


def _check_setup_for(spec: ModelSpec | None, name: str, setup: Setup) -> list[str]:
    """PlanError for a setup this model cannot have (options a bare count cannot use, a LoRA rank
    beyond every layer it adapts); a warning for a sequence beyond the model's positions (lesson 1)."""
    if spec is None:
        used = [f"--{option.replace('_', '-')}" for option in SHAPE_OPTIONS
                if getattr(setup, option) != getattr(Setup(), option)]
        if used:
            raise PlanError(f"{', '.join(used)} cannot change a plan from --params alone (no layer shapes, no "
                            "activations): name a model or a config.json to use them")
        return []
    if setup.lora_rank:
        widest = max((min(info.shape) for info in spec.params if target_match(info, setup.lora_targets)), default=0)
        if setup.lora_rank > widest > 0:
            raise PlanError(f"lora rank {setup.lora_rank} is above the rank of every layer it adapts (at most "
                            f"{widest}): a rank-r adapter costs r x (in + out) values per layer; use r <= {widest}")
    positions = getattr(spec.config, "max_position_embeddings", None)
    if isinstance(positions, int) and setup.seq > positions:
        return [f"WARNING: seq {setup.seq} is beyond {name}'s {positions} positions (max_position_embeddings): "
                "the model as configured cannot train on it; this plans it as if it could (for a longer context, "
                "raise max_position_embeddings in a saved config.json and give that path)"]
    return []


def checkpointing_changes(trace, setup: Setup):
    """Lesson 3's cost of the setup's checkpointing plan on this trace: (the plan's cost, the change of
    the bytes held through forward (<= 0))."""
    n = len(trace.saved)
    none = checkpointing.plan_cost(trace.saved, trace.inputs, [], output_bytes=trace.output)
    chosen = checkpointing.plan_cost(trace.saved, trace.inputs, checkpointing.named_plan(n, setup.checkpointing),
                                     output_bytes=trace.output)
    return chosen, chosen.forward_bytes - none.forward_bytes


def _step_extra(spec: ModelSpec, setup: Setup, states: ModelStates, trace, target: str) -> tuple[int, dict]:
    """The most a step adds on top of all model states (activations, temporaries), and details;
    `trace`: the setup's trace_step."""
    n = len(trace.saved)
    chosen, held_change = checkpointing_changes(trace, setup)
    segments = chosen.plan
    grads = states.gradients
    if setup.accum > 1:  # gradients of earlier micro-batches are live throughout; new ones are added in
        largest_grad = max(math.prod(s) for s in states.trainable_shapes) * states.grad_itemsize
        forward = grads + trace.forward_peak_without_grads + held_change
        head = grads + trace.head_backward_peak_without_grads + held_change + largest_grad
        layers = grads + layers_backward_peak(trace, segments, with_grads=False) + largest_grad
        tail = grads + trace.tail_backward_peak_without_grads + largest_grad
    else:
        forward = trace.forward_peak + held_change
        head = trace.head_backward_peak + held_change
        layers = layers_backward_peak(trace, segments, with_grads=True)
        tail = trace.tail_backward_peak  # after the layers' backward: none of their activations is left
    dequant = trace.dequant_transient
    copies = _autocast_copies(spec, setup)
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


def _autocast_copies(spec: ModelSpec, setup: Setup) -> int:
    """16-bit copies autocast makes of fp32 frozen weights (lesson 5, "what makes it fit"): after
    prepare_model_for_kbit_training the output layer is fp32; under a 16-bit autocast every call casts
    it, and the copy is saved for its backward (a frozen weight's cast is not cached)."""
    if not setup.prepare_kbit or setup.weight_dtype not in (torch.float16, torch.bfloat16):
        return 0
    output = [p for p in spec.params if p.is_lm_head]
    if not output and getattr(spec.config, "tie_word_embeddings", False):  # tied: the embedding is the output layer
        output = [p for p in spec.params if p.module == "embedding"][:1]
    return sum(p.numel for p in output) * itemsize(setup.weight_dtype)


def _parse_count(text: str) -> int:
    """'7e9', '7B', '1.5b', '124,439,808' -> a positive whole number of parameters."""
    from decimal import Decimal, InvalidOperation

    cleaned = str(text).strip().replace(",", "").replace("_", "")
    scale = {"k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}.get(cleaned[-1:].lower())
    try:  # decimal, not float: 1e30 is 10**30 exactly
        value = Decimal(cleaned[:-1]) * scale if scale else Decimal(cleaned)
    except InvalidOperation:
        raise PlanError(f"--params must be a number of parameters like 7e9 or 7B, got {text!r}") from None
    if not value.is_finite() or value < 1 or value != int(value):
        raise PlanError(f"--params must be a positive whole number of parameters, got {text!r}")
    return int(value)



def plan_from_cli(model: str | None, *, params: str | None = None, precision: str | None = None,
                  gpu: str | None = None, **options) -> Plan:
    """`course-lib plan`: a model name/config or --params, and the options (lesson 1)."""

    if (model is None) == (params is None):
        raise PlanError("give a model (bundled name or config.json) or --params N, not both"
                        if model is not None else "give a model (e.g. llama-3.1-8b, or a config.json) or --params N")
    card = get_gpu(gpu) if gpu is not None else None
    options = {key: value for key, value in options.items() if value is not None}
    precision = precision or default_precision(card, options.get("quant", "none"))
    try:
        target = _parse_count(params) if params is not None else model_spec(model)
    except ModelNotFound as error:
        raise PlanError(str(error)) from None
    return plan(target, Setup(precision=precision, **options), gpu=card)
