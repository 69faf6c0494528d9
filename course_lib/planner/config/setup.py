"""What the planner is asked: the training setup and its options (lesson 1, "the planner")."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from course_lib import checkpointing, validate
from course_lib.planner.config.errors import PlanError
from course_lib.planner.config.fields import (
    ATTENTIONS,
    FSDP_REDUCE_DTYPES,
    FSDP_VERSIONS,
    FSDP_WRAP_FROM,
    FSDP_WRAPPINGS,
    LOOPS,
    OPTIMIZERS,
    PRECISIONS,
    QUANTS,
    SHARDS,
    Activations,
    Adapters,
    Parallel,
    PrecisionOptions,
    Step,
)
from course_lib.planner.config.gpus import GPU
from course_lib.validate import checked

CATEGORIES = (
    "weights",
    "gradients",
    "optimizer_state",
    "master_weights",
    "quantization",
    "activations",
    "optimizer_temporaries",
    "overhead",
    "total",
)
DEFAULT_LORA_RANK = 16

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


INDEX_MAX = torch.iinfo(torch.int64).max  # the most elements a tensor's size can count


@checked(error=PlanError)
@dataclass(frozen=True)
class Setup(Parallel, Activations, Step, Adapters, PrecisionOptions):
    """How the model is trained (lesson 1): the fields of every group in `GROUPS`. Sizes are per
    micro-batch; `accum` micro-batches make one optimizer step. `Setup()` plans what `plan(model)` plans
    with no options; a precision left None is the GPU's (`for_gpu`)."""

    def __post_init__(self) -> None:
        # a whole number of any type (2.0, numpy's) is its int, as course_lib.validate's checks return it;
        # validate() names what is wrong with the rest
        for name in ("batch", "seq", "accum", "lora_rank", "gpus", "chunked_loss"):
            try:
                object.__setattr__(self, name, validate.integer(name, getattr(self, name), error=PlanError))
            except PlanError:
                pass
        if self.fsdp_reduce_dtype is None:  # None was the compute dtype's name before "compute"
            object.__setattr__(self, "fsdp_reduce_dtype", "compute")
        # one module name is one target (never its characters); a list becomes a tuple (hashable)
        if self.lora_targets != "all-linear" and isinstance(self.lora_targets, (str, list)):
            object.__setattr__(
                self, "lora_targets", validate.strings("lora_targets", self.lora_targets, error=PlanError)
            )

    def for_gpu(self, gpu: GPU | None) -> Setup:
        """This setup with its precision, if None, the one `gpu` runs (`default_precision`)."""
        if self.precision is not None:
            return self
        return replace(self, precision=default_precision(gpu, self.quant, self.gpus))

    def validate(self) -> Setup:
        """The setup itself, or PlanError naming the bad value (a precision left None: as with no GPU)."""
        if self.precision is None:
            self.for_gpu(None).validate()
            return self
        validate.strict_bool("prepare_kbit", self.prepare_kbit, error=PlanError)
        validate.strict_bool("legacy_causal_lm_loss", self.legacy_causal_lm_loss, error=PlanError)
        validate.strict_bool("empty_cache_each_step", self.empty_cache_each_step, error=PlanError)
        if self.lora_targets != "all-linear":
            validate.strings("lora_targets", self.lora_targets, error=PlanError)
        if self.prepare_kbit and self.lora_rank == 0:
            raise PlanError(
                "prepare_kbit with a full fine-tune (lora_rank 0): peft's prepare_model_for_kbit_training "
                "freezes every parameter, so nothing would train; give lora_rank R > 0, or prepare_kbit=False"
            )
        for value, options, what in (
            (self.precision, PRECISIONS, "precision"),
            (self.optimizer, OPTIMIZERS, "optimizer"),
            (self.quant, QUANTS, "quant"),
            (self.attention, ATTENTIONS, "attention"),
            (self.loop, LOOPS, "loop"),
        ):
            validate.choice(what, value, options, error=PlanError)
        for value, what in ((self.batch, "batch"), (self.seq, "seq"), (self.accum, "accum")):
            validate.positive_int(what, value, error=PlanError)
        if self.batch * self.seq > INDEX_MAX:
            raise PlanError(
                f"batch {self.batch:,} x seq {self.seq:,} tokens: more than a tensor can hold "
                f"({INDEX_MAX:,} elements, torch's int64 sizes)"
            )
        validate.non_negative_int("lora_rank (0: no LoRA)", self.lora_rank, error=PlanError)
        if self.adam_state not in (None, "fp32"):
            raise PlanError(f"adam_state must be None (the parameter's dtype) or 'fp32', got {self.adam_state!r}")
        if self.quant != "none" and self.lora_rank == 0:
            raise PlanError(
                f"--quant {self.quant} freezes the base model: train adapters with --lora-rank R "
                "(QLoRA); a 4-bit base cannot be fine-tuned directly"
            )
        if self.lora_rank == 0 and self.lora_targets != "all-linear":
            raise PlanError(f"lora_targets {self.lora_targets!r} without a LoRA rank: give lora_rank R > 0")
        validate.probability("lora_dropout", self.lora_dropout, below_one=True, error=PlanError)
        validate.strict_bool("autocast_adapter_dtype", self.autocast_adapter_dtype, error=PlanError)
        if self.lora_rank == 0 and self.lora_dropout:
            raise PlanError(f"lora dropout {self.lora_dropout} without a LoRA rank: give lora_rank R > 0")
        if self.adam_state is not None and self.optimizer not in ("adamw", "adamw_fused", "momentum", "adafactor"):
            raise PlanError(
                f"adam_state applies to torch's adamw, adamw_fused, momentum and adafactor, not {self.optimizer!r} "
                "(sgd keeps no state; bitsandbytes' optimizers choose their own)"
            )
        if self.quant != "none" and self.precision.startswith("mixed"):
            raise PlanError(
                f"--quant {self.quant} with --precision {self.precision}: a 4-bit base has no fp32 "
                f"master weights; use --precision {self.precision.split('-')[1]} (the compute dtype)"
            )
        if self.quant != "none" and self.autocast_dtype is not None:
            raise PlanError(
                f"--quant {self.quant} with --precision {self.precision}: a 4-bit base is planned in its "
                f"compute dtype; use --precision {self.precision.split('-')[1]}"
            )

        if self.fp32_main_grads and (self.gpus is not None or self.optimizer_in_backward):
            raise PlanError(
                f"--precision {self.precision} (Megatron Core's main gradients) is planned on one GPU "
                "with the step after backward: no --gpus, no optimizer_in_backward"
            )
        _validate_sharding(self)
        _validate_wrap(self)
        try:
            checkpointing.named_plan(4, self.checkpointing)
        except ValueError as error:
            raise PlanError(str(error)) from None
        _validate_toolbox(self)
        return self

    @property
    def _precision(self) -> str:
        return self.precision or default_precision(None, self.quant, self.gpus)

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype of the model's weights as stored on the device (the compute dtype for QLoRA)."""
        return (
            torch.float32
            if self.autocast_dtype is not None
            else _DTYPES[self._precision.split("-")[self._precision.startswith("mixed")]]
        )

    @property
    def compute_name(self) -> str:
        """The dtype the model computes in, by name: "fp32", "bf16" or "fp16" (autocast's for amp-*)."""
        dtype = self.autocast_dtype or self.weight_dtype
        return next(name for name, value in _DTYPES.items() if value == dtype)

    @property
    def fp32_main_grads(self) -> bool:
        """Megatron's recipes: the optimizer reads fp32 main gradients (mixed-*-fp32grads)."""
        return self._precision.endswith("-fp32grads")

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype torch.autocast computes in ("amp-*" precisions), or None: no autocast."""
        return _DTYPES[self._precision[4:]] if self._precision.startswith("amp-") else None


def _validate_sharding(setup: Setup) -> None:
    """PlanError for gpus < 1, an unknown stage, or a stage without gpus (lesson 6)."""
    if setup.gpus is not None:
        validate.positive_int("gpus (how many GPUs train together)", setup.gpus, error=PlanError)
    validate.choice("shard stage", setup.shard, SHARDS, error=PlanError)
    if setup.shard != "none" and setup.gpus is None:
        raise PlanError(f"--shard {setup.shard} needs --gpus N: how many GPUs share the model states")
    if setup.gpus is not None and setup.autocast_dtype is not None:
        raise PlanError(
            f"--precision {setup.precision} with --gpus {setup.gpus}: data parallelism and sharding "
            "are planned for the master-copy recipe (mixed-bf16, mixed-fp16) and pure precisions; "
            "plan autocast on one GPU (no --gpus)"
        )
    validate.choice("FSDP wrapping", setup.fsdp_wrapping, FSDP_WRAPPINGS, error=PlanError)
    validate.choice("fsdp_reduce_dtype", setup.fsdp_reduce_dtype, FSDP_REDUCE_DTYPES, error=PlanError)
    validate.strict_bool("fsdp_reshard_root", setup.fsdp_reshard_root, error=PlanError)
    if setup.fsdp_version not in FSDP_VERSIONS or isinstance(setup.fsdp_version, bool):
        raise PlanError(f"fsdp_version must be 1 (accelerate's FSDP1) or 2 (FSDP2), got {setup.fsdp_version!r}")
    if (setup.fsdp_wrapping, setup.fsdp_reduce_dtype, setup.fsdp_reshard_root, setup.fsdp_version) != (
        "blocks",
        "compute",
        True,
        2,
    ) and setup.shard not in ("zero2", "zero3"):
        raise PlanError(f"the --fsdp-* options configure FSDP: they need --shard zero2 or zero3, not {setup.shard}")
    validate.strict_bool("fsdp_backward_prefetch", setup.fsdp_backward_prefetch, error=PlanError)
    if setup.fsdp_backward_prefetch and setup.fsdp_version != 1:
        raise PlanError(
            "--fsdp-backward-prefetch configures FSDP1 (FSDP2 always prefetches the next layer in "
            "backward): add --fsdp-version 1 --shard zero2 or zero3, or leave it out"
        )
    if setup.fsdp_version == 1 and (setup.fsdp_wrapping, setup.fsdp_reduce_dtype, setup.fsdp_reshard_root) != (
        "blocks",
        "compute",
        True,
    ):
        raise PlanError(
            "--fsdp-wrapping, --fsdp-reduce-dtype and --no-fsdp-reshard-root configure FSDP2: "
            "FSDP1 is planned as accelerate runs it (each layer a unit, the root kept gathered)"
        )
    if setup.fsdp_version == 1 and setup.prepare_kbit:
        raise PlanError(
            "--fsdp-version 1 with prepare_kbit: FSDP1 flattens each unit into one parameter of one dtype "
            "(torch's _validate_tensors_to_flatten), and prepare_model_for_kbit_training's fp32 norms sit "
            "beside the 16-bit weights of each layer; plan FSDP2, or no prepare_kbit"
        )
    if setup.fsdp_version == 1 and setup.precision.startswith("mixed"):
        raise PlanError(
            f"--fsdp-version 1 with --precision {setup.precision}: FSDP1's MixedPrecision (a 16-bit copy "
            "of each shard before its all-gather) is not modelled; plan fp32, bf16 or fp16, or FSDP2"
        )


def _validate_wrap(setup: Setup) -> None:
    """PlanError, one line, for a wrap FSDP1 does not make (`fsdp_wrap_from`)."""
    if setup.fsdp_wrap_from is None:
        return
    validate.choice("fsdp_wrap_from", setup.fsdp_wrap_from, FSDP_WRAP_FROM, error=PlanError)
    if (setup.gpus or 1) < 2 or setup.shard == "zero1" or (setup.shard != "none" and setup.fsdp_version != 1):
        raise PlanError(
            f"--fsdp-wrap-from {setup.fsdp_wrap_from} is FSDP1's wrap: add --gpus N (N >= 2) with "
            "--fsdp-version 1 --shard zero2 or zero3, or --shard none for its NO_SHARD"
        )


def _validate_toolbox(setup: Setup) -> None:
    """PlanError, one line, for a bad value or a combination that cannot work (lesson 7)."""
    for name in ("optimizer_in_backward", "offload_activations"):
        validate.strict_bool(name, getattr(setup, name), error=PlanError)
    chunk = setup.chunked_loss
    if chunk is not None and setup.legacy_causal_lm_loss:
        raise PlanError(
            "chunked_loss with legacy_causal_lm_loss: the chunked loss replaces the model's own loss, "
            "whose transformers version the legacy option describes; choose one"
        )
    if chunk is not None:
        validate.positive_int("chunked_loss (tokens per chunk; None: the plain loss)", chunk, error=PlanError)
    if setup.optimizer_in_backward and setup.accum > 1:
        raise PlanError(
            f"optimizer_in_backward with accum {setup.accum}: each backward updates the weights and "
            "frees the gradients, so there is nothing to accumulate into (lesson 7); use accum 1"
        )
    if setup.optimizer_in_backward and setup.precision.endswith("fp16"):
        raise PlanError(
            f"optimizer_in_backward with --precision {setup.precision}: fp16 trains under GradScaler, whose "
            "skip-on-overflow becomes a partial update when each parameter steps inside backward "
            "(lesson 7); use bf16, or step after backward"
        )
    if setup.optimizer_in_backward and setup.gpus is not None:
        raise PlanError(
            f"optimizer_in_backward with --gpus {setup.gpus}: under DDP a post-accumulate-grad hook steps "
            "on the local, unaveraged gradient (torch's _apply_optimizer_in_backward moves the step into "
            "a comm hook); the planner does not model it: plan one GPU (lesson 7)"
        )
    used = [name for name in ("optimizer_in_backward", "chunked_loss", "offload_activations") if getattr(setup, name)]
    if used and setup.gpus is not None:
        raise PlanError(
            f"{used[0]} with --gpus {setup.gpus}: the planner does not model lesson 7's tricks under "
            "data parallelism or sharding; plan one GPU"
        )
    if setup.offload_activations and setup.checkpointing != "none":
        raise PlanError(
            "offload_activations with checkpointing: the planner models one of them at a time "
            "(transformers' activation_checkpointing_enable(offload=True) is not modelled)"
        )


@checked(error=PlanError)
def default_precision(gpu: GPU | None, quant: str = "none", gpus: int | None = None) -> str:
    """The precision a setup that names none is planned in (lesson 1, docs/planner.md's defaults): on a GPU
    target the Trainer's bf16=True, amp-bf16 (amp-fp16 on a GPU without bf16 hardware, lesson 5's T4
    recipe); without a GPU, or with --gpus (data parallelism and sharding are planned for it), the
    master-copy recipe, mixed-bf16 or mixed-fp16; the plain compute dtype for a 4-bit base."""
    half = "bf16" if gpu is None or gpu.bf16 else "fp16"
    if quant != "none":
        return half
    return f"amp-{half}" if gpu is not None and gpus is None else f"mixed-{half}"


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
