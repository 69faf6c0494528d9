"""The prediction for one setup: the bytes of one training step by category, and the notes that
explain them (lesson 1, "the planner")."""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from decimal import Decimal
from functools import cached_property

from course_lib.course import wrapped
from course_lib.measure import GiB, format_bytes
from course_lib.models import ModelSpec, config_class_name, model_spec, supported_attention
from course_lib.planner.allocator.limit import at_the_limit
from course_lib.planner.allocator.reserved import Reserved, reserved_prediction, state_blocks
from course_lib.planner.config.errors import PlanError
from course_lib.planner.config.gpus import CUDA_CONTEXT_BYTES, GPU
from course_lib.planner.config.setup import CATEGORIES, Setup
from course_lib.planner.parallel.fsdp_wrap import after_wrap, wrap_extra
from course_lib.planner.parallel.sharded import sharded_values
from course_lib.planner.phases.activations import step_phases
from course_lib.planner.states.model_states import model_states, target_match
from course_lib.planner.trace.moe import unquantized_experts_note
from course_lib.planner.trace.step_trace import trace_request
from course_lib.planner.trace.toolbox import toolbox_notes
from course_lib.validate import checked

# the phases a chart draws (lesson 1), from those the planner computes (planner.phases.activations.PHASES)
STEP_PHASES = {
    "end of forward": ("forward",),
    "backward": ("head backward", "layers backward", "tail backward"),
    "optimizer step": ("optimizer step",),
}


@checked(error=PlanError)
@dataclass
class Trick:
    """One trick of "what makes it fit": its name, what it saves in the final setup, and the peak and
    setup with it and the tricks before it (lesson 1)."""

    name: str
    saves: int | None  # in the final setup; None: a later trick needs it
    total_after: int
    fits_after: bool
    setup: Setup = field(repr=False)


@checked(error=PlanError)
@dataclass
class Plan:
    """Predicted memory of one training step, by category, in bytes (lesson 1).

    `bytes["total"]` is the predicted peak, plus the CUDA context on a GPU target; the categories are
    what is live in the phase of the step that holds it (`detail["peak_phase"]`, each phase's in
    `detail["phases"]`): the weights, optimizer state, master weights and quantization metadata, the
    gradients made by then (`detail["all_gradients"]`: all of them), the activations (what is saved for
    backward, the forward's or backward's transients, the batch) and the optimizer step's temporaries.
    With --gpus, `planner.parallel.sharded` says what they are. `activations_known` is False for a raw parameter count.
    """

    model: str
    setup: Setup
    n_params: int
    trainable_params: int
    bytes: dict[str, int]
    activations_known: bool
    detail: dict[str, object] = field(default_factory=dict)
    gpu: GPU | None = None
    tricks: list[Trick] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    closing: str = ""  # when no trick makes it fit: where it would fit (planner.search.elsewhere)
    # on a GPU: what makes `oom_line` (the replays of the step's stream take time; a rejected trick never asks)
    make_oom_line: Callable[[], Reserved] | None = field(default=None, repr=False, compare=False)

    @cached_property
    def oom_line(self) -> Reserved | None:
        """On a GPU: allocated, reserved and nvidia-smi against CUDA's capacity; None without one."""
        return None if self.make_oom_line is None else self.make_oom_line()

    @property
    def reserved(self) -> int | None:
        """Predicted `torch.cuda.max_memory_reserved` on the GPU target (None without one), bytes."""
        return None if self.oom_line is None else self.oom_line.reserved

    @property
    def total(self) -> int:
        return self.bytes["total"]

    @property
    def fits(self) -> bool | None:
        """Whether the step fits on the plan's GPU (its OOM line: nvidia-smi's estimate against CUDA's
        capacity); None without a GPU."""
        return None if self.oom_line is None else self.oom_line.fits

    def verdict(self) -> str:
        """One sentence: fits or not, and by how much."""
        if self.oom_line is None:
            return f"predicted peak {format_bytes(self.total)} (give --gpu NAME for a fit verdict)"
        return self.oom_line.verdict(self.gpu)

    def to_dict(self) -> dict:
        """Plain JSON-able numbers: bytes by category (integers), the setup, the verdict, the tricks."""
        return {
            "model": self.model,
            "n_params": self.n_params,
            "trainable_params": self.trainable_params,
            "setup": asdict(self.setup),
            "bytes": dict(self.bytes),
            "activations_known": self.activations_known,
            "detail": dict(self.detail),
            "gpu": None if self.gpu is None else {"name": self.gpu.name, "memory_bytes": self.gpu.memory_bytes},
            "fits": self.fits,
            "verdict": self.verdict(),
            "what_makes_it_fit": [
                {"trick": t.name, "saves_bytes": t.saves, "total_after": t.total_after, "fits_after": t.fits_after}
                for t in self.tricks
            ],
            "closing": self.closing,
            "notes": list(self.notes),
            "reserved": None if self.oom_line is None else self.oom_line.to_dict(),
        }

    def by_phase(self) -> dict[str, dict[str, int]]:
        """What each phase of the step holds at its peak, by category (lesson 1, "one bar per recipe, one
        bar per phase"): the weights, optimizer state, master weights, quantization and overhead
        throughout, then the phase's own gradients, activations and optimizer temporaries (`detail["phases"]`; the backward: the
        largest of its parts). With --params only, the optimizer step alone; one GPU only."""
        if self.setup.gpus is not None:
            raise PlanError("by_phase() plans one GPU; a plan with --gpus names its peak phase in detail (lesson 6)")
        steady = {
            c: self.bytes[c] for c in ("weights", "quantization", "optimizer_state", "master_weights", "overhead")
        }
        phases = self.detail["phases"]
        out = {}
        for bar, parts in STEP_PHASES.items():
            found = [phases[part] for part in parts if part in phases]
            if found:
                out[bar] = {**steady, **max(found, key=lambda live: sum(live.values()))}
        return out

    def rows(self) -> list[tuple[str, int]]:
        """(category, bytes); `sharding_buffers` (before the total) only in a plan with --gpus (lesson 6)."""
        shown = [c for c in CATEGORIES if c != "total"] + ["sharding_buffers"] * ("sharding_buffers" in self.bytes)
        return [(c, self.bytes[c]) for c in shown + ["total"]]

    def __str__(self) -> str:
        head = self.model if self.model.endswith("parameters") else f"{self.model}: {self.n_params:,} parameters"
        lines = [
            f"{head} ({self.trainable_params:,} trained), "
            f"{self.setup.precision}, {self.setup.optimizer}"
            + (f", LoRA r={self.setup.lora_rank}" if self.setup.lora_rank else "")
            + (f" dropout {self.setup.lora_dropout:g}" if self.setup.lora_dropout else "")
            + (f", {self.setup.quant}" if self.setup.quant != "none" else "")
            + f", batch {self.setup.batch} x seq {self.setup.seq}"
            + (f" x accum {self.setup.accum}" if self.setup.accum > 1 else "")
            + (f", checkpointing {self.setup.checkpointing}" if self.setup.checkpointing != "none" else "")
            + (
                f", {self.setup.gpus} GPUs, shard {self.setup.shard} (one GPU's share)"
                if self.setup.gpus is not None
                else ""
            )
        ]
        for name, value in self.rows():
            unknown = name in ("activations", "sharding_buffers") and not self.activations_known
            shown = "unknown (no model shapes)" if unknown else f"{value / GiB:10.2f} GiB"
            lines.append(f"  {name:<21} {shown}")
        if self.setup.gpus is not None:
            lines.append(
                f"  model states per GPU: {self.detail['paper_model_states'] / 1e9:.3f} GB as the ZeRO paper "
                "counts them (10^9 bytes)"
                + (
                    f"; FSDP2's zero2 stand-in shards the weights too: "
                    f"{self.detail['engine_model_states'] / 1e9:.3f} GB"
                    if self.setup.shard == "zero2" and self.activations_known
                    else ""
                )
            )
        if self.oom_line is not None:
            lines.append(self.oom_line.line())
        lines.append(self.verdict())
        if self.tricks:
            lines.append(
                "What makes it fit (exact tricks tried before lossy ones, none the final setup can do without):\n"
                "the peak with each trick and those above it, and what it saves in the final setup"
            )
            width = max(len(trick.name) for trick in self.tricks)
            for trick in self.tricks:
                saves = "needed by a later trick" if trick.saves is None else f"saves {trick.saves / GiB:6.2f} GiB"
                lines.append(
                    f"  {trick.name:<{width}} -> {trick.total_after / GiB:7.2f} GiB"
                    f"{'  fits' if trick.fits_after else '      '}   {saves}"
                )
        if self.closing:
            lines.append(self.closing)
        lines += [note if note.startswith("warning: ") else f"note: {note}" for note in self.notes]
        return wrapped("\n".join(lines))


MAX_PARAMS = 10**15  # a thousand times the largest models trained: what is above is a typo


def _resolve(model) -> tuple[ModelSpec | None, int, str]:
    if isinstance(model, ModelSpec):
        return model, model.n_params, model.name
    if isinstance(model, (int, float)) and not isinstance(model, bool):
        if isinstance(model, float) and not math.isfinite(model) or model <= 0 or model != int(model):
            raise PlanError(f"--params must be a positive whole number of parameters, got {model!r}")
        if model > MAX_PARAMS:
            raise PlanError(
                f"--params {Decimal(model):.3e} is beyond any model (the largest trained have about 2e12 "
                f"parameters): give at most {MAX_PARAMS:.0e}"
            )
        return None, int(model), f"{int(model):,} parameters"
    spec = model_spec(model)
    return spec, spec.n_params, spec.name


def predict(model, setup: Setup, card: GPU | None) -> Plan:
    """The plan of one validated setup, without "what makes it fit" (`planner.plan` adds it)."""
    setup = setup.for_gpu(card)
    spec, n_params, name = _resolve(model)
    if setup.shard != "none" and setup.gpus > n_params:
        raise PlanError(
            f"--gpus {setup.gpus} with --shard {setup.shard}: more GPUs than the model's {n_params:,} "
            "parameters, so some GPUs would hold no shard at all; use at most as many GPUs as parameters"
        )
    warned = _check_setup_for(spec, name, setup)
    cuda = card is not None
    if setup.compute_name == "bf16" and card is not None and not card.bf16:
        raise PlanError(
            f"{card.name} (compute capability {card.compute_capability[0]}."
            f"{card.compute_capability[1]}) has no bf16 hardware: use "
            + ("amp-fp16" if setup.autocast_dtype is not None else "fp16 or mixed-fp16")
        )
    if setup.quant != "none":
        if importlib.util.find_spec("bitsandbytes") is None:
            raise PlanError(
                f"--quant {setup.quant} needs bitsandbytes, which is not importable here: pip install bitsandbytes"
            ) from None
    states = model_states(spec, setup, n_params, cuda=cuda)
    if setup.optimizer_in_backward:  # lesson 7: each gradient is freed in backward, right after its update
        states = replace(states, gradients=0)
    notes: list[str] = warned
    experts_note = unquantized_experts_note(spec, setup) if spec is not None else None
    if experts_note:  # first: the plan's weights are not what a QLoRA user expects
        notes.insert(0, experts_note)
    detail: dict = {}
    # with only a parameter count: the step holds the model states and nothing else known
    phases = {"optimizer step": {"gradients": states.gradients, "activations": 0, "optimizer_temporaries": 0}}
    step = trace_request(spec, setup, "cuda" if cuda else "cpu") if spec is not None else None
    trace = step.trace if step is not None else None
    if spec is None:
        notes.append(
            "activations unknown: only a parameter count was given (name a model or a config.json "
            "for activations and the optimizer step's temporaries)"
        )
    else:
        phases, detail = step_phases(spec, setup, states, trace, "cuda" if cuda else "cpu")
        if detail["autocast_copies"]:
            notes.append(
                f"{setup.precision} autocast re-casts the fp32 frozen weights that prepare_model_for_kbit_training "
                f"made (the output layer) at every call: {format_bytes(detail['autocast_copies'])} of 16-bit "
                "copies live from its forward to its backward"
            )
        if setup.autocast_dtype is not None:
            copies = sum(trace.autocast_cached) + trace.autocast_cached_outside
            notes.append(
                f"{setup.precision}: fp32 weights, gradients and optimizer state (no master copy); "
                f"torch.autocast computes in {setup.precision[4:]} and caches a copy of each trained weight "
                f"for the forward, saved for backward: {format_bytes(copies)} (in activations)"
            )
        if supported_attention(spec.config, setup.attention) != setup.attention:
            notes.append(
                f"attention: eager, because transformers' {config_class_name(spec.config).replace('Config', '')} "
                f"does not support {setup.attention} (eager stores the s x s attention scores)"
            )
        if setup.checkpointing != "none":
            notes.append(
                f"checkpointing {setup.checkpointing}: recomputes {detail['recompute_fraction']:.0%} "
                "of one forward of the layers (lesson 3's cost model)"
            )
    overhead = CUDA_CONTEXT_BYTES if cuda else 0
    peak_phase = max(phases, key=lambda phase: sum(phases[phase].values()))  # the first of equal peaks
    detail.update(phases=phases, all_gradients=states.gradients)
    if setup.gpus is None:
        detail["peak_phase"] = peak_phase
    live = phases[peak_phase] if setup.gpus is None else _over_all_gradients(phases, states.gradients)
    values = {
        "weights": states.weights,
        **live,
        "optimizer_state": states.optimizer_state,
        "master_weights": states.master_weights,
        "quantization": states.quantization,
        "overhead": overhead,
    }
    values = {category: values[category] for category in CATEGORIES if category != "total"}
    values["total"] = sum(values.values())
    if cuda:
        notes.append(
            f"overhead: CUDA context and libraries, about {format_bytes(CUDA_CONTEXT_BYTES)} "
            "(300 to 700 MB, docs/references.md#pytorch-issue-28113-memory-used-when-cuda-starts), "
            "not seen by torch.cuda.memory_allocated"
        )
    if (
        cuda
        and setup.optimizer == "adamw"
        and spec is not None
        and setup.gpus is None
        and not setup.optimizer_in_backward
    ):  # one GPU, one step of all tensors: all of sqrt(v) at once
        notes.append(
            "torch AdamW's default (foreach) step on CUDA makes sqrt(v) for all tensors at once: "
            f"{format_bytes(states.trainable * states.state_itemsize)} more at the step "
            "(in optimizer_temporaries when the step holds the peak); "
            "--optimizer adamw_fused (fused=True, the Trainer's adamw_torch_fused) avoids it"
        )
    if spec is not None and setup.loop != "trainer" and setup.chunked_loss is not None:
        notes.append(
            f"loop {setup.loop} with the chunked loss: the chunked loss makes no full logits, so the loop "
            "keeps none (the same bytes as --loop trainer)"
        )
    elif spec is not None:
        notes.append(
            {
                "keep-outputs": "loop keep-outputs: the outputs (the logits) stay alive through backward, the "
                "step and the next forward",
                "outputs-until-step": "loop outputs-until-step: the outputs (the logits) stay alive through "
                "backward and the step, released before the next forward",
                "trainer": "loop trainer: only the loss is kept; `outputs = model(**batch); "
                "outputs.loss.backward()` keeps the logits too: --loop keep-outputs",
            }[setup.loop]
        )
    if spec is not None and setup.legacy_causal_lm_loss:
        notes.append(
            "legacy causal-LM loss (transformers before 4.46): the model returns fp32 logits and the loss "
            "copies the shifted ones; from 4.46 the logits stay in the model's dtype"
        )
    if setup.fp32_main_grads:
        source = "docs/references.md#megatron-core-docs-distributed-optimizer"
        notes.append(
            f"{setup.precision}: Megatron Core's main gradients ({source}): the backward's gradients "
            "are added into fp32 ones"
            + (
                ", kept beside the fp16 gradients (gradients: 2 + 4 bytes a parameter)"
                if setup.compute_name == "fp16"
                else ", the only ones kept (4 bytes a parameter)"
            )
        )
    if setup.optimizer.startswith("paged"):
        notes.append(
            "paged optimizer: same bytes; under memory pressure the driver moves its state to CPU RAM "
            "(lesson 4), at a cost in time"
        )
    if spec is not None:
        more_notes, more_detail = toolbox_notes(setup, trace, card)
        notes += more_notes
        detail.update(more_detail)
    if setup.accum > 1:
        notes.append(
            f"effective batch {setup.batch * setup.accum} = micro-batch {setup.batch} x {setup.accum} "
            "accumulation steps; gradients stay allocated during the micro-batches"
        )
    if setup.gpus is not None:
        values, shard_detail, shard_notes = sharded_values(
            spec, setup, values, trace, states, detail.get("optimizer_step_temporaries", 0), cuda
        )
        detail.update(shard_detail)
        notes += shard_notes
    if spec is not None and setup.gpus is None:
        notes.append(
            f"the peak is the {peak_phase}'s: the categories are what is live then (gradients: those made "
            f"so far; activations: saved for backward, the transients and the batch); "
            f"{_phase_line(phases)}"
        )
    wrap = (
        wrap_extra(step, state_blocks(spec, setup, states, values))
        if cuda and step is not None and setup.fsdp_wrap_from is not None
        else 0
    )

    def oom_line() -> Reserved:  # made when first asked: "what makes it fit" asks only of the setups it keeps
        checkpointed = step.checkpointed_slack() if step is not None else None
        line = reserved_prediction(spec, setup, states, values, trace, card, detail, checkpointed, wrap)
        return at_the_limit(line, step)

    if setup.fsdp_wrap_from is not None and spec is not None:
        reserved, allocated = after_wrap(spec, setup)
        notes.append(
            f"FSDP1's wrap from the CPU ({setup.fsdp_wrap_from}) leaves {format_bytes(reserved)} reserved "
            f"before the first step, {format_bytes(reserved - allocated)} of it cached"
            + (
                f": the step's reserve {'+' if wrap >= 0 else '-'}{format_bytes(abs(wrap))} for it"
                if cuda
                else "; it changes only the reserved memory: give --gpu to see it"
            )
        )
    if setup.empty_cache_each_step:
        notes.append(
            "torch.cuda.empty_cache() after each step: the segments nothing lives in go back to the driver, "
            "so each step cuts its blocks from fresh ones; "
            + (
                "the reserved memory is one step's from them"
                if cuda
                else "it changes only the reserved memory: give --gpu to see it"
            )
        )
    return Plan(
        name,
        setup,
        n_params,
        states.trainable,
        values,
        spec is not None,
        detail,
        card,
        [],
        notes,
        make_oom_line=oom_line if cuda else None,
    )


def _over_all_gradients(phases: dict, gradients: int) -> dict[str, int]:
    """The step's categories as the sharded plans start from them (`planner.parallel.sharded`; lesson 6): all the
    gradients, then what the forward and backward rise above them ("activations"), then what the
    optimizer step rises above both ("optimizer_temporaries")."""
    step = sum(phases["optimizer step"].values())
    rest = max([gradients] + [sum(parts.values()) for phase, parts in phases.items() if phase != "optimizer step"])
    return {"gradients": gradients, "activations": rest - gradients, "optimizer_temporaries": max(0, step - rest)}


def _phase_line(phases: dict) -> str:
    """Each phase's peak over the weights, optimizer state, master weights and quantization (lesson 1)."""
    return "each phase's peak over the weights and states: " + ", ".join(
        f"{phase} {format_bytes(sum(parts.values()))}" for phase, parts in phases.items()
    )


SHAPE_OPTIONS = (
    "batch",
    "seq",
    "checkpointing",
    "accum",
    "attention",
    "loop",
    "chunked_loss",
    "offload_activations",
    "lora_dropout",
    "legacy_causal_lm_loss",
)


def _check_setup_for(spec: ModelSpec | None, name: str, setup: Setup) -> list[str]:
    """PlanError for a setup this model cannot have (options a bare count cannot use, a LoRA rank
    beyond every layer it adapts); a warning for a sequence beyond the model's positions (lesson 1)."""
    if spec is None:
        used = [
            f"--{option.replace('_', '-')}"
            for option in SHAPE_OPTIONS
            if getattr(setup, option) != getattr(Setup(), option)
        ]
        if used:
            raise PlanError(
                f"{', '.join(used)} cannot change a plan from --params alone (no layer shapes, no "
                "activations): name a model or a config.json to use them"
            )
        return []
    if setup.lora_rank:
        widest = max((min(info.shape) for info in spec.params if target_match(info, setup.lora_targets)), default=0)
        if setup.lora_rank > widest > 0:
            raise PlanError(
                f"lora rank {setup.lora_rank} is above the rank of every layer it adapts (at most "
                f"{widest}): a rank-r adapter costs r x (in + out) values per layer; use r <= {widest}"
            )
    positions = getattr(spec.config, "max_position_embeddings", None)
    learned = [
        info.name
        for info in spec.params
        if info.module == "embedding"
        and info.shape[0] == positions
        and positions != getattr(spec.config, "vocab_size", None)
    ]
    if isinstance(positions, int) and setup.seq > positions and learned:
        raise PlanError(
            f"seq {setup.seq} is beyond {name}'s {positions} learned positions ({learned[0]} has a row for "
            f"each of them, none for position {positions}): use --seq {positions} or less"
        )
    if isinstance(positions, int) and setup.seq > positions:
        return [
            f"WARNING: seq {setup.seq} is beyond {name}'s {positions} positions (max_position_embeddings): "
            "the model as configured cannot train on it; this plans it as if it could (for a longer context, "
            "raise max_position_embeddings in a saved config.json and give that path)"
        ]
    return []
