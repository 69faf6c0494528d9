"""What the planner is asked: the training setup and its options (lesson 1, "the planner")."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from course_lib import checkpointing, validate
from course_lib.errors import UserError

PRECISIONS = (
    "fp32",
    "bf16",
    "fp16",
    "mixed-bf16",
    "mixed-fp16",
    "mixed-bf16-fp32grads",
    "mixed-fp16-fp32grads",
    "amp-bf16",
    "amp-fp16",
)
OPTIMIZERS = (
    "sgd",
    "momentum",
    "adamw",
    "adamw_fused",
    "adamw8bit",
    "paged_adamw8bit",
    "paged_adamw32bit",
    "adafactor",
    "lion",
)
QUANTS = ("none", "nf4", "nf4-dq")
ATTENTIONS = ("sdpa", "eager")
LOOPS = ("trainer", "keep-outputs", "outputs-until-step")
SHARDS = ("none", "zero1", "zero2", "zero3")  # lesson 6, `course_lib.planner.parallel.sharded`
FSDP_WRAPPINGS = ("blocks", "torchtitan")
FSDP_WRAP_FROM = (
    "cpu",
    "cpu-broadcast",
)  # Setup.fsdp_wrap_from, `course_lib.planner.parallel.fsdp_wrap`  # lesson 6, `course_lib.sharding.engines.fsdp_units`
FSDP_VERSIONS = (1, 2)  # accelerate's FSDP1 (FullyShardedDataParallel) and FSDP2 (fully_shard)
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


class PlanError(UserError):
    """A setup the planner cannot plan: the message says what to change (lesson 1)."""


INDEX_MAX = torch.iinfo(torch.int64).max  # the most elements a tensor's size can count


@dataclass(frozen=True)
class Setup:
    """How the model is trained (lesson 1). Sizes are per micro-batch; `accum` micro-batches make one
    optimizer step (effective batch = batch * accum).

    optimizer: torch's "adamw" (foreach on CUDA, single-tensor on a CPU), "adamw_fused" (fused=True, the
    Trainer's adamw_torch_fused: no step temporaries), bitsandbytes' 8-bit and paged ones, ...
    precision: "fp32"; "bf16"/"fp16" (pure: weights, gradients and torch optimizer state in 16 bits);
    "mixed-bf16"/"mixed-fp16": the master-copy recipe (ZeRO's and Megatron's): 16-bit weights and
    gradients, fp32 master weights and optimizer state (2 + 2 + 4 + 8 bytes a parameter with AdamW);
    "mixed-bf16-fp32grads"/"mixed-fp16-fp32grads": Megatron Core's two 16-bit rows (its distributed-optimizer
    table, non-distributed: 18 and 20 bytes a parameter with Adam): the backward accumulates the gradients
    into fp32 main gradients, the only gradients kept beside bf16 weights (2 + 4 + 4 + 8) and a copy beside
    the fp16 ones under fp16 (2 + 2 + 4 + 4 + 8); one GPU only;
    "amp-bf16"/"amp-fp16": the Trainer's mixed precision (bf16=True / fp16=True, torch.autocast; lesson 5's
    T4 recipe): fp32 weights, gradients and optimizer state, and autocast's 16-bit copies of the weights,
    cached through the forward and saved for backward (`course_lib.planner.trace.autocast`).
    adam_state: None (torch's rule: state in the dtype of the parameter it updates) or "fp32".
    lora_rank > 0 trains LoRA adapters (fp32, peft's default) on `lora_targets` and freezes the base;
    lora_dropout: peft's dropout on each adapter's input (0.0, peft's default; the QLoRA paper used
    0.05 and 0.1): a dropped copy of that input and, for backward, its mask (a byte a value on a GPU).
    autocast_adapter_dtype: peft's get_peft_model(autocast_adapter_dtype=True), its default since v0.11
    (pull request 1706): 16-bit adapters are upcast to fp32, and each adapter's input is cast to fp32;
    False keeps the adapters (their gradients and torch optimizer state) in the base's dtype, as peft did
    before (docs/references.md#peft-0212-peftmapping_funcpy-autocast_adapter_dtype).
    quant "nf4"/"nf4-dq" stores the frozen linear layers in 4 bits (QLoRA; needs lora_rank > 0).
    prepare_kbit: peft's prepare_model_for_kbit_training, which upcasts every non-quantized
    parameter to fp32.
    loop: "trainer" keeps only the loss (the Trainer's loop); "keep-outputs" is the tutorials'
    `outputs = model(**batch); outputs.loss.backward()`: the outputs (the logits) stay alive through
    backward and the step, and into the next forward until `outputs` is bound again; "outputs-until-step"
    releases them after the step (`output = None`, as Answer.AI's fsdp_qlora train.py does).
    legacy_causal_lm_loss: the loss as transformers computed it before 4.46 (LlamaForCausalLM.forward of
    v4.38 to v4.45, and the heads copied from it): the model upcasts the logits to fp32 and returns them,
    and copies the shifted logits for CrossEntropyLoss (`logits[..., :-1, :].contiguous()`); from 4.46 the
    logits stay in the model's dtype and the loss upcasts them (transformers pull requests 31292, 33902).
    empty_cache_each_step: the loop calls torch.cuda.empty_cache() after each step (peft's MetaMathQA
    run.py does): the segments nothing lives in go back to the driver, so the next step's blocks are cut
    from fresh segments, not from the last step's; it changes only the reserved memory on a GPU.
    gpus: None (one GPU, no data parallelism) or N GPUs training together, `batch` per GPU; shard:
    "none" (DDP), "zero1", "zero2" or "zero3" (lesson 6, `course_lib.planner.parallel.sharded`). Under zero2/zero3
    (FSDP2) the precision is MixedPrecisionPolicy's param_dtype (mixed-bf16: an fp32 model gathered in
    bf16); fsdp_wrapping "blocks" or "torchtitan" (`course_lib.sharding.engines`); fsdp_reduce_dtype
    None (the reduce-scatter in the compute dtype, FSDP2's default) or "fp32" (torchtitan's);
    fsdp_reshard_root: zero3 reshards the root after forward too (3P sent), False: FSDP2's default.
    fsdp_version: 2 (FSDP2, `course_lib.sharding.engines`) or 1: accelerate's FSDP1 (the Trainer's FSDP
    recipes: FullyShardedDataParallel, zero2 = SHARD_GRAD_OP, zero3 = FULL_SHARD, accelerate's default
    backward_prefetch NO_PREFETCH, LoRA's adapters each a unit of their own as the Trainer wraps them with
    peft's fsdp_auto_wrap_policy; `tests/test_fsdp1.py` measures it), with FSDP2's other options at theirs;
    fsdp_backward_prefetch (FSDP1 only): True is FullyShardedDataParallel's own default BACKWARD_PRE (the
    next unit gathered before the running one's gradients, as FSDP2 always does), False accelerate's.
    fsdp_wrap_from (FSDP1, or --shard none for FSDP1's NO_SHARD): None plans the step from an empty cache;
    "cpu": FullyShardedDataParallel moves a model on the CPU to the GPU unit by unit, flattens and shards it,
    and leaves blocks cached (`course_lib.planner.parallel.fsdp_wrap`); "cpu-broadcast": the same with
    sync_module_states (accelerate's cpu_ram_efficient_loading, Answer.AI's low_memory). It changes only the
    reserved memory on a GPU.
    Lesson 7: optimizer_in_backward steps each parameter in backward and frees its gradient there;
    chunked_loss=N computes the output layer and the loss N tokens at a time; offload_activations
    moves what autograd saves to host memory (torch's save_on_cpu).
    """

    precision: str = "mixed-bf16"
    optimizer: str = "adamw"
    adam_state: str | None = None
    lora_rank: int = 0
    lora_targets: str | tuple[str, ...] = "all-linear"
    lora_dropout: float = 0.0
    autocast_adapter_dtype: bool = True
    quant: str = "none"
    prepare_kbit: bool = False
    batch: int = 1
    seq: int = 512
    checkpointing: str = "none"
    accum: int = 1
    attention: str = "sdpa"
    loop: str = "trainer"
    legacy_causal_lm_loss: bool = False
    empty_cache_each_step: bool = False
    gpus: int | None = None
    shard: str = "none"
    fsdp_wrapping: str = "blocks"
    fsdp_reduce_dtype: str | None = None
    fsdp_reshard_root: bool = True
    fsdp_version: int = 2
    fsdp_backward_prefetch: bool = False
    fsdp_wrap_from: str | None = None
    optimizer_in_backward: bool = False
    chunked_loss: int | None = None
    offload_activations: bool = False

    def __post_init__(self) -> None:
        # a whole number of any type (2.0, numpy's) is its int, as course_lib.validate's checks return it;
        # validate() names what is wrong with the rest
        for name in ("batch", "seq", "accum", "lora_rank", "gpus", "chunked_loss"):
            try:
                object.__setattr__(self, name, validate.integer(name, getattr(self, name), error=PlanError))
            except PlanError:
                pass
        # one module name is one target (never its characters); a list becomes a tuple (hashable)
        if self.lora_targets != "all-linear" and isinstance(self.lora_targets, (str, list)):
            object.__setattr__(
                self, "lora_targets", validate.strings("lora_targets", self.lora_targets, error=PlanError)
            )

    def validate(self) -> Setup:
        """The setup itself, or PlanError naming the bad value."""
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
    def weight_dtype(self) -> torch.dtype:
        """The dtype of the model's weights as stored on the device (the compute dtype for QLoRA)."""
        return (
            torch.float32
            if self.autocast_dtype is not None
            else _DTYPES[self.precision.split("-")[self.precision.startswith("mixed")]]
        )

    @property
    def compute_name(self) -> str:
        """The dtype the model computes in, by name: "fp32", "bf16" or "fp16" (autocast's for amp-*)."""
        dtype = self.autocast_dtype or self.weight_dtype
        return next(name for name, value in _DTYPES.items() if value == dtype)

    @property
    def fp32_main_grads(self) -> bool:
        """Megatron's recipes: the optimizer reads fp32 main gradients (mixed-*-fp32grads)."""
        return self.precision.endswith("-fp32grads")

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype torch.autocast computes in ("amp-*" precisions), or None: no autocast."""
        return _DTYPES[self.precision[4:]] if self.precision.startswith("amp-") else None


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
    if setup.fsdp_reduce_dtype not in (None, "fp32"):
        raise PlanError(
            f"fsdp_reduce_dtype must be None (the compute dtype) or 'fp32', got {setup.fsdp_reduce_dtype!r}"
        )
    validate.strict_bool("fsdp_reshard_root", setup.fsdp_reshard_root, error=PlanError)
    if setup.fsdp_version not in FSDP_VERSIONS or isinstance(setup.fsdp_version, bool):
        raise PlanError(f"fsdp_version must be 1 (accelerate's FSDP1) or 2 (FSDP2), got {setup.fsdp_version!r}")
    if (setup.fsdp_wrapping, setup.fsdp_reduce_dtype, setup.fsdp_reshard_root, setup.fsdp_version) != (
        "blocks",
        None,
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
        None,
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


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
