"""The fields of the planner's setup, in the groups a user thinks of a run in (lesson 1, "the planner";
docs/planner.md). Each field declares its default, its choices (its type) and its help (its `Doc`) once;
`course-lib plan`'s flags are generated from them (`course_lib.planner.config.command`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal, get_args

from typing_extensions import Doc
from tyro.conf import arg
from tyro.constructors import PrimitiveConstructorSpec

from course_lib import validate

# The choices of each field, declared once as its type (the CLI's choice lists are read from these)
Precision = Literal[
    "fp32",
    "bf16",
    "fp16",
    "mixed-bf16",
    "mixed-fp16",
    "mixed-bf16-fp32grads",
    "mixed-fp16-fp32grads",
    "amp-bf16",
    "amp-fp16",
]
Optimizer = Literal[
    "sgd",
    "momentum",
    "adamw",
    "adamw_fused",
    "adamw8bit",
    "paged_adamw8bit",
    "paged_adamw32bit",
    "adafactor",
    "lion",
]
Quant = Literal["none", "nf4", "nf4-dq"]
Attention = Literal["sdpa", "eager"]
Loop = Literal["trainer", "keep-outputs", "outputs-until-step"]
Shard = Literal["none", "zero1", "zero2", "zero3"]  # lesson 6, `course_lib.planner.parallel.sharded`
FsdpWrapping = Literal["blocks", "torchtitan"]
FsdpReduceDtype = Literal["compute", "fp32"]
FsdpWrapFrom = Literal["cpu", "cpu-broadcast"]  # `course_lib.planner.parallel.fsdp_wrap`
FsdpVersion = Literal[1, 2]  # accelerate's FSDP1 (FullyShardedDataParallel) and FSDP2 (fully_shard)

PRECISIONS = get_args(Precision)
OPTIMIZERS = get_args(Optimizer)
QUANTS = get_args(Quant)
ATTENTIONS = get_args(Attention)
LOOPS = get_args(Loop)
SHARDS = get_args(Shard)
FSDP_WRAPPINGS = get_args(FsdpWrapping)
FSDP_REDUCE_DTYPES = get_args(FsdpReduceDtype)
FSDP_WRAP_FROM = get_args(FsdpWrapFrom)
FSDP_VERSIONS = get_args(FsdpVersion)


def _targets_from_text(texts: list[str]) -> str | tuple[str, ...]:
    """--lora-targets: "all-linear", or module names separated by commas (peft's target_modules)."""
    names = tuple(name.strip() for name in texts[0].split(",") if name.strip())
    if not names:
        raise ValueError("give module names separated by commas (e.g. q_proj,v_proj) or all-linear")
    return "all-linear" if names == ("all-linear",) else names


# --lora-targets NAMES: one comma-separated argument, read as the CLI has always read it
_TARGETS = PrimitiveConstructorSpec(
    nargs=1,
    metavar="NAMES",
    instance_from_str=_targets_from_text,
    is_instance=lambda value: isinstance(value, (str, tuple)),
    str_from_instance=lambda value: [value if isinstance(value, str) else ",".join(value)],
)


def _checked(check, metavar: str, *, optional: bool = False, **options) -> PrimitiveConstructorSpec:
    """A flag's value, read and checked by `check` (course_lib.validate) as the parser reads it, so that a
    bad one is one line naming the flag; `optional`: "None" is None."""

    def read(texts: list[str]):
        return None if optional and texts[0] == "None" else validate.from_text(check, texts[0], **options)

    return PrimitiveConstructorSpec(
        nargs=1,
        metavar=metavar,
        instance_from_str=read,
        is_instance=lambda value: value is None or isinstance(value, (int, float)),
        str_from_instance=lambda value: [str(value)],
    )


# The setup is a tree of groups, the way a user thinks of a run; `Setup` inherits every group, so a field
# is read as `setup.lora_rank` and `Setup(lora_rank=16)` sets it. Each field declares its default, its
# choices (its type) and its help (the docstring under it) once: `course-lib plan --help` is generated from
# them (`course_lib.planner.config.command`). docs/planner.md has the table of defaults.


@dataclass(frozen=True)
class PrecisionOptions:
    """precision and optimizer"""

    precision: Annotated[
        Precision | None,
        Doc(
            "bf16/fp16: pure 16-bit (weights, gradients and torch optimizer state); mixed-*: 16-bit weights "
            "and gradients with an fp32 master copy and optimizer state (ZeRO's and Megatron's: 2 + 2 + 4 + 8"
            " bytes a parameter with AdamW); mixed-*-fp32grads: Megatron Core's fp32 main gradients, "
            "accumulated by the backward (18 and 20 bytes a parameter with Adam; one GPU); amp-*: the "
            "Trainer's bf16=True/fp16=True, fp32 weights, gradients and state with torch.autocast's 16-bit "
            "weight copies (`course_lib.planner.trace.autocast`). None: the GPU's (`gpus.default_precision`, "
            "docs/planner.md): amp-bf16 on a GPU target, amp-fp16 on one without bf16 (a T4); mixed-bf16 with"
            " no GPU or with --gpus; the compute dtype under --quant"
        ),
    ] = None
    optimizer: Annotated[
        Optimizer,
        Doc(
            "torch's adamw (foreach on CUDA, single-tensor on a CPU); adamw_fused (fused=True, the Trainer's "
            "adamw_torch_fused: no step temporaries); bitsandbytes' 8-bit and paged ones; sgd, momentum, "
            "adafactor, lion"
        ),
    ] = "adamw"
    adam_state: Annotated[
        Literal["fp32"] | None,
        Doc(
            "None: optimizer state in the dtype of the parameter it updates (torch's rule); fp32: always fp32"
            " (torch's adamw, adamw_fused, momentum, adafactor)"
        ),
    ] = None


@dataclass(frozen=True)
class Adapters:
    """adapters and quantization (LoRA, QLoRA)"""

    lora_rank: Annotated[
        int,
        _checked(validate.non_negative_int, "R"),
        Doc("train LoRA adapters of rank R (fp32, peft's default) and freeze the base; 0: a full fine-tune"),
    ] = 0
    lora_targets: Annotated[
        str | tuple[str, ...],
        _TARGETS,
        Doc(
            "modules that get adapters, comma-separated (peft's target_modules, e.g. q_proj,v_proj); "
            "all-linear: every linear layer but the output layer"
        ),
    ] = "all-linear"
    lora_dropout: Annotated[
        float,
        _checked(validate.probability, "P", below_one=True),
        Doc(
            "peft's dropout on each adapter's input (0.0, peft's default; the QLoRA paper used 0.05 and 0.1):"
            " a dropped copy of that input and, for backward, its mask"
        ),
    ] = 0.0
    autocast_adapter_dtype: Annotated[
        bool,
        Doc(
            "peft's get_peft_model(autocast_adapter_dtype=True), its default since 0.11 (pull request 1706): "
            "16-bit adapters upcast to fp32 and each adapter's input cast to fp32; no: adapters, their "
            "gradients and state in the base's dtype, as before "
            "(docs/references.md#peft-0212-peftmapping_funcpy-autocast_adapter_dtype)"
        ),
    ] = True
    quant: Annotated[
        Quant,
        Doc("nf4, nf4-dq: the frozen linear layers stored in 4 bits (QLoRA; needs a LoRA rank)"),
    ] = "none"
    prepare_kbit: Annotated[
        bool,
        Doc("peft's prepare_model_for_kbit_training: every non-quantized parameter upcast to fp32"),
    ] = False


@dataclass(frozen=True)
class Step:
    """the step: batch, sequence, loop"""

    batch: Annotated[
        int,
        _checked(validate.positive_int, "N"),
        Doc("micro-batch size (effective batch = batch x accum)"),
    ] = 1
    seq: Annotated[
        int,
        _checked(validate.positive_int, "TOKENS"),
        Doc("sequence length in tokens"),
    ] = 512
    accum: Annotated[
        int,
        _checked(validate.positive_int, "N"),
        Doc("gradient accumulation: micro-batches a step"),
    ] = 1
    attention: Annotated[
        Attention,
        Doc("the attention kernel"),
    ] = "sdpa"
    loop: Annotated[
        Loop,
        Doc(
            "trainer: only the loss is kept (the Trainer's loop); keep-outputs: the tutorials' `outputs = "
            "model(**batch); outputs.loss.backward()` keeps the logits alive through backward, the step and "
            "into the next forward; outputs-until-step: released after the step (`output = None`, Answer.AI's"
            " fsdp_qlora)"
        ),
    ] = "trainer"
    legacy_causal_lm_loss: Annotated[
        bool,
        Doc(
            "the loss as transformers computed it before 4.46 (LlamaForCausalLM.forward of 4.38 to 4.45): "
            "fp32 logits returned and the shifted logits copied; from 4.46 the logits stay in the model's "
            "dtype and the loss upcasts them (transformers pull requests 31292, 33902)"
        ),
    ] = False
    empty_cache_each_step: Annotated[
        bool,
        Doc(
            "the loop calls torch.cuda.empty_cache() after each step (peft's MetaMathQA run.py does): the "
            "next step's blocks come from fresh segments; it changes only the reserved memory"
        ),
    ] = False


@dataclass(frozen=True)
class Activations:
    """activations: checkpointing and lesson 7's tricks"""

    checkpointing: Annotated[
        str,
        arg(metavar="PLAN"),
        Doc("none, every-layer, sqrt, every-K (e.g. every-2) or hf-every-K (Hugging Face's every_n_layers=K)"),
    ] = "none"
    optimizer_in_backward: Annotated[
        bool,
        Doc("step each parameter in backward and free its gradient there (lesson 7; no accumulation)"),
    ] = False
    chunked_loss: Annotated[
        int | None,
        _checked(validate.positive_int, "TOKENS", optional=True),
        Doc(
            "the output layer and the loss computed TOKENS tokens at a time, recomputed in backward (lesson "
            "7); None: the plain loss"
        ),
    ] = None
    offload_activations: Annotated[
        bool,
        Doc("what autograd saves goes to host memory (torch's save_on_cpu, lesson 7)"),
    ] = False


@dataclass(frozen=True)
class Parallel:
    """GPUs training together (lesson 6)"""

    gpus: Annotated[
        int | None,
        _checked(validate.positive_int, "N", optional=True),
        Doc("N GPUs train together (data parallel), --batch per GPU; the plan is one GPU's share. None: one GPU"),
    ] = None
    shard: Annotated[
        Shard,
        Doc(
            "what the GPUs partition: none (DDP), zero1 (optimizer state), zero2 (+ gradients), zero3 (+ "
            "weights); zero2/zero3 are FSDP (`course_lib.planner.parallel.sharded`)"
        ),
    ] = "none"
    fsdp_version: Annotated[
        FsdpVersion,
        Doc(
            "2: FSDP2 (fully_shard, `course_lib.sharding.engines`); 1: accelerate's FSDP1, the Trainer's FSDP"
            " recipes (FullyShardedDataParallel: zero2 = SHARD_GRAD_OP, zero3 = FULL_SHARD, each layer a "
            "unit, LoRA's adapters units of their own as peft's fsdp_auto_wrap_policy makes them; "
            "tests/planner/test_fsdp1.py)"
        ),
    ] = 2
    fsdp_wrapping: Annotated[
        FsdpWrapping,
        Doc(
            "FSDP2: blocks (each decoder layer, then the root) or torchtitan (embeddings, each layer, [norm, "
            "output], then the root)"
        ),
    ] = "blocks"
    fsdp_reduce_dtype: Annotated[
        FsdpReduceDtype,
        Doc("FSDP2: the dtype the gradients are reduce-scattered in: compute (FSDP2's default) or fp32 (torchtitan's)"),
    ] = "compute"
    fsdp_reshard_root: Annotated[
        bool,
        Doc("FSDP2 zero3: reshard the root after forward too (3 P sent); no: keep it gathered (FSDP2's default)"),
    ] = True
    fsdp_backward_prefetch: Annotated[
        bool,
        Doc(
            "FSDP1: BACKWARD_PRE, FullyShardedDataParallel's own default (the next unit gathered before the "
            "running one's gradients, as FSDP2 always does); no: accelerate's NO_PREFETCH"
        ),
    ] = False
    fsdp_wrap_from: Annotated[
        FsdpWrapFrom | None,
        Doc(
            "FSDP1 (or --shard none, its NO_SHARD) wraps a model on the CPU, unit by unit, leaving blocks "
            "cached before the first step (`course_lib.planner.parallel.fsdp_wrap`); cpu-broadcast: with "
            "sync_module_states (accelerate's cpu_ram_efficient_loading). None: the step from an empty cache."
            " Changes only the reserved memory"
        ),
    ] = None


GROUPS = (PrecisionOptions, Adapters, Step, Activations, Parallel)
