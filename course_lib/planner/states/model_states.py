"""Model states, exact: weights, gradients, optimizer state, master weights and quantization
metadata, tensor by tensor from the model's real parameter shapes (lesson 1, "the planner")."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from course_lib import validate
from course_lib.models import ModelSpec, ParamInfo
from course_lib.paging.policies import BNB_MIN_8BIT_SIZE
from course_lib.planner.config.errors import PlanError
from course_lib.planner.config.fields import OPTIMIZERS
from course_lib.planner.config.setup import Setup, itemsize
from course_lib.validate import checked

# bitsandbytes 0.50.2 (optim/optimizer.py, Optimizer2State; docs/references.md): 8-bit blockwise
# state, 256 values per float32 absmax; tensors below 4096 elements keep 32-bit state; two 256-entry
# float32 quantization maps per optimizer.
BNB_BLOCK = 256
BNB_QMAPS_BYTES = 2 * 256 * 4
# NF4 (bitsandbytes quantize_4bit): two values per byte, a float32 absmax per 64 values and a
# 16-entry float32 code table per tensor; double quantization stores the absmax as uint8 in blocks of
# 256 with a float32 second level, a float32 offset and a 256-entry float32 code table.
NF4_BLOCK = 64
NF4_DQ_BLOCK = 256


def target_match(info: ParamInfo, targets: str | tuple[str, ...]) -> bool:
    """Whether a parameter's module gets LoRA adapters (peft's 'all-linear': every linear but the
    output layer)."""
    if info.module != "linear" or info.is_lm_head or not info.name.endswith(".weight"):
        return False
    if targets == "all-linear":
        return True
    names = (targets,) if isinstance(targets, str) else tuple(targets)
    module = info.name.rsplit(".", 2)[-2]
    return module in names


def _lora_shapes(spec: ModelSpec, setup: Setup) -> list[tuple[int, ...]]:
    shapes = []
    for info in spec.params:
        if target_match(info, setup.lora_targets):
            rows, cols = info.shape  # (out, in) for nn.Linear; (in, out) for GPT-2's Conv1D: same sum
            shapes += [(setup.lora_rank, cols), (rows, setup.lora_rank)]
    if setup.lora_rank and not shapes:
        raise PlanError(f"no linear layer matches the LoRA targets {setup.lora_targets!r}")
    return shapes


def nf4_bytes(numel: int, double_quant: bool) -> tuple[int, int]:
    """(packed weight bytes, quantization metadata bytes) of one tensor in bitsandbytes NF4 (lesson 1).

    Packed: two 4-bit values per byte. Metadata: a float32 absmax per 64 values and a 16-entry
    float32 code table; with double quantization the absmax is uint8 (blocks of 256 with a float32
    absmax each), plus a float32 offset and a 256-entry float32 code table.
    """
    numel = validate.non_negative_int("numel", numel, error=PlanError)
    validate.strict_bool("double_quant", double_quant, error=PlanError)
    blocks = math.ceil(numel / NF4_BLOCK)
    packed = math.ceil(numel / 2)
    if not double_quant:
        return packed, blocks * 4 + 16 * 4
    return packed, blocks + 16 * 4 + 4 + math.ceil(blocks / NF4_DQ_BLOCK) * 4 + 256 * 4


# transformers' Trainer (trainer.py, 5.24), with any bitsandbytes optimizer of optim_bits=8 (adamw_bnb_8bit,
# paged_adamw_8bit), registers optim_bits=32 for the weight of every nn.Embedding
# (GlobalOptimManager.register_module_override): a trained embedding keeps 32-bit state, 8 B/param.
# The planner plans the Trainer's optimizer (lesson 7, "lean optimizers").


def eight_bit_state(optimizer: str, numel: int, full_state: bool = False) -> bool:
    """Whether bitsandbytes keeps (and steps) this tensor's state in 8 bits: its 8-bit optimizers do, for
    `BNB_MIN_8BIT_SIZE` elements or more, but for a `full_state` tensor (the Trainer's embeddings)."""
    return optimizer in ("adamw8bit", "paged_adamw8bit") and numel >= BNB_MIN_8BIT_SIZE and not full_state


def state_tensor_bytes(
    optimizer: str, shape: Sequence[int], state_itemsize: int, full_state: bool = False
) -> list[int]:
    """The bytes of each state tensor an optimizer keeps for one trained tensor of `shape` (lesson 1),
    without the step counters and bitsandbytes' quantization maps (`optimizer_state_bytes` adds them).

    torch's SGD keeps none, momentum one buffer, AdamW two (in `state_itemsize`); bitsandbytes keeps
    32-bit state in fp32 (AdamW's two, Lion's one momentum) and 8-bit AdamW's two uint8 states with an
    fp32 absmax per block each, 32-bit below `BNB_MIN_8BIT_SIZE` elements or for a `full_state` tensor
    (an embedding the Trainer keeps in 32 bits: `ModelStates.full_state`). transformers' Adafactor (the
    Trainer's optim="adafactor"; lesson 7 measures it) keeps a row and a column statistic of a matrix
    and the full second moment of a vector. torch.optim.Adafactor is another layout in memory: its
    row_var/col_var/variance are made with p.grad.new_zeros, in the gradient's dtype."""
    n = math.prod(shape)
    if optimizer == "sgd":
        return []
    if optimizer == "momentum":
        return [n * state_itemsize]
    if optimizer in ("adamw", "adamw_fused"):
        return [n * state_itemsize] * 2
    if optimizer == "paged_adamw32bit":
        return [4 * n] * 2
    if optimizer == "lion":  # bitsandbytes Lion, 32-bit
        return [4 * n]
    if optimizer in ("adamw8bit", "paged_adamw8bit"):
        return [n, n] + [4 * math.ceil(n / BNB_BLOCK)] * 2 if eight_bit_state(optimizer, n, full_state) else [4 * n] * 2
    if optimizer == "adafactor":
        if len(shape) >= 2:
            return [math.prod(shape[:-1]) * state_itemsize, math.prod(shape[:-2]) * shape[-1] * state_itemsize]
        return [n * state_itemsize]
    raise PlanError(f"unknown optimizer {optimizer!r}")


def optimizer_state_bytes(
    optimizer: str,
    numels: Sequence[int],
    state_itemsize: int,
    shapes: Sequence[tuple[int, ...]] | None = None,
    step_counters: bool = True,
    per_tensor: bool = False,
    full_state: Sequence[bool] = (),
) -> int:
    """Exact bytes of an optimizer's state for trainable tensors of these sizes (lesson 1).

    `state_itemsize`: bytes per element of torch optimizers' state (the parameter's dtype, or 4 for
    fp32 state). bitsandbytes' optimizers keep 32-bit state in fp32 whatever the parameter dtype.
    `step_counters`: torch AdamW and Adafactor keep a float32 step tensor per parameter (on the CPU
    unless capturable/fused: not GPU memory on a CUDA target). `per_tensor`: one optimizer per tensor
    (lesson 7's step in backward): each bitsandbytes optimizer then has its own quantization maps.
    `full_state`: one flag per tensor, kept in 32 bits by an 8-bit optimizer (`ModelStates.full_state`).
    """
    if optimizer not in OPTIMIZERS:
        raise PlanError(f"unknown optimizer {optimizer!r}")
    if optimizer == "adafactor" and shapes is None:
        raise PlanError("adafactor's state depends on tensor shapes: give a model, not only --params")
    tensors = shapes if optimizer == "adafactor" else [(n,) for n in numels]
    flags = list(full_state) or [False] * len(numels)
    total = sum(sum(state_tensor_bytes(optimizer, shape, state_itemsize, full)) for shape, full in zip(tensors, flags))
    if optimizer in ("adamw", "adamw_fused") and step_counters:
        total += 4 * len(numels)
    if optimizer == "adafactor":  # an fp32 RMS scalar per tensor on the parameter's device
        total += 4 * len(numels)
    if optimizer in ("adamw8bit", "paged_adamw8bit"):
        eight_bit = sum(1 for n, full in zip(numels, flags) if eight_bit_state(optimizer, n, full))
        total += BNB_QMAPS_BYTES * (eight_bit if per_tensor else min(eight_bit, 1))
    return total


def optimizer_step_extra(
    optimizer: str,
    shapes: Sequence[tuple[int, ...]],
    state_itemsize: int,
    grad_itemsize: int,
    cuda: bool,
    mixed: bool,
    full_state: Sequence[bool] = (),
) -> int:
    """Temporaries of one optimizer step beyond the state (lesson 1, "the step has a peak too").

    torch AdamW on the CPU (single-tensor): sqrt(v) and its division live together, 2 x the largest
    tensor; on CUDA the default foreach path makes sqrt(v) for all tensors at once, 1 x all of them.
    Fused AdamW (`fused=True`) updates in place on either device (measured on a CPU: 12 B over the state).
    bitsandbytes' CUDA kernels update in place; its CPU kernels work on fp32 copies, one tensor at a time
    (`_bnb_cpu_step_bytes`; `full_state`, one flag per entry of `shapes`: a tensor an 8-bit optimizer keeps
    in 32 bits, the Trainer's embeddings, stepped by the 32-bit kernel). transformers' Adafactor (measured, lesson 7): the update
    and its negation in fp32, 8 bytes per value of the largest tensor, 16 for a 16-bit one (fp32 copies
    of its gradient and of itself). Mixed precision converts each gradient to fp32 for the master update.
    """
    if not shapes:
        return 0
    numels = [math.prod(s) for s in shapes]
    largest = max(numels)
    extra = 0
    if optimizer == "adamw":
        extra = sum(numels) * state_itemsize if cuda else 2 * largest * state_itemsize
    elif optimizer in ("adamw8bit", "paged_adamw8bit", "paged_adamw32bit") and not cuda:
        flags = list(full_state) or [False] * len(numels)
        extra = max(
            _bnb_cpu_step_bytes(n, grad_itemsize, eight_bit_state(optimizer, n, full)) for n, full in zip(numels, flags)
        )
    elif optimizer == "adafactor":  # update and its negation (fp32), plus fp32 copies of a 16-bit grad and param
        extra = max(
            4 * math.prod(s) * (2 if grad_itemsize == 4 else 4)
            + 4 * (math.prod(s[:-1]) + math.prod(s[:-2]) * s[-1] if len(s) >= 2 else 1)
            for s in shapes
        )
    if mixed:
        extra += 4 * largest
    return extra


def _bnb_cpu_step_bytes(n: int, grad_itemsize: int, eight_bit: bool) -> int:
    """The most bitsandbytes' CPU Adam kernels hold at once beyond one n-value tensor's state
    (bitsandbytes 0.50 backends/cpu/ops.py, lesson 0's "inside operators"). The 8-bit kernel
    (`_optimizer_update_8bit_blockwise_cpu`): both moments dequantized to fp32, the scaled gradient,
    and sqrt(v) with its division by the bias correction, 5 fp32 values a value; a 16-bit gradient and
    weight add their fp32 copies, 6. The 32-bit kernel (`_optimizer_update_32bit_cpu`, for tensors
    under 4096 values, paged_adamw32bit and the Trainer's 32-bit embeddings): the scaled gradient,
    sqrt(v) + eps and the update, 3; with a 16-bit gradient and weight, 4."""
    sixteen = grad_itemsize != 4
    if eight_bit:
        return (24 if sixteen else 20) * n
    return (16 if sixteen else 12) * n


@checked(error=PlanError)
@dataclass
class ModelStates:
    weights: int
    gradients: int
    optimizer_state: int
    master_weights: int
    quantization: int
    trainable: int
    frozen: int
    trainable_shapes: list[tuple[int, ...]] = field(repr=False, default_factory=list)
    # per trained tensor: an embedding, which the Trainer has bitsandbytes' 8-bit optimizers keep (and step)
    # in 32 bits
    full_state: tuple[bool, ...] = field(repr=False, default=())
    grad_itemsize: int = 4
    state_itemsize: int = 4


@checked(error=PlanError)
def model_states(spec: ModelSpec | None, setup: Setup, n_params: int | None = None, cuda: bool = False) -> ModelStates:
    """Exact bytes of weights, gradients, optimizer state, master weights and quantization metadata
    (lesson 1). With `spec=None`, `n_params` parameters are treated as one full fine-tune."""
    wsize = itemsize(setup.weight_dtype)
    mixed = setup.precision.startswith("mixed")
    # Megatron's main gradients: fp32 in place of 16-bit ones (bf16), or beside them (fp16)
    grad_size = {"mixed-bf16-fp32grads": 4, "mixed-fp16-fp32grads": 2 + 4}.get(setup.precision, wsize)
    read_size = 4 if setup.fp32_main_grads else wsize  # what the optimizer reads
    torch_opt = setup.optimizer in ("adamw", "adamw_fused", "momentum", "adafactor")

    def state_size(param_size: int, master: bool = mixed) -> int:
        """torch's rule, the parameter's dtype; fp32 beside fp32 master weights, with adam_state="fp32", and
        in transformers' Adafactor and bitsandbytes' optimizers, whatever the parameter's dtype."""
        fp32 = master or setup.adam_state == "fp32" or setup.optimizer == "adafactor" or not torch_opt
        return 4 if fp32 else param_size

    if spec is None:
        if setup.lora_rank or setup.quant != "none":
            raise PlanError(
                "LoRA and quantization need the model's layer shapes: give a model name or "
                "config.json, not only --params"
            )
        if setup.optimizer == "adafactor":
            optimizer_state_bytes("adafactor", [n_params], 4)  # raises: shapes needed
        return ModelStates(
            weights=n_params * wsize,
            gradients=n_params * grad_size,
            optimizer_state=optimizer_state_bytes(setup.optimizer, [n_params], state_size(wsize), step_counters=False),
            master_weights=4 * n_params if mixed else 0,
            quantization=0,
            trainable=n_params,
            frozen=0,
            grad_itemsize=read_size,
            state_itemsize=state_size(wsize),
        )

    step_counters = not cuda
    if not setup.lora_rank:
        shapes = [p.shape for p in spec.params]
        numels = [p.numel for p in spec.params]
        state_itemsize = state_size(wsize)
        full_state = tuple(p.module == "embedding" for p in spec.params)  # the Trainer's override, under 8-bit
        return ModelStates(
            weights=sum(numels) * wsize,
            gradients=sum(numels) * grad_size,
            optimizer_state=optimizer_state_bytes(
                setup.optimizer, numels, state_itemsize, shapes, step_counters, setup.optimizer_in_backward, full_state
            ),
            master_weights=4 * sum(numels) if mixed else 0,
            quantization=0,
            trainable=sum(numels),
            frozen=0,
            trainable_shapes=shapes,
            grad_itemsize=read_size,
            state_itemsize=state_itemsize,
            full_state=full_state,
        )

    # LoRA / QLoRA: frozen base, fp32 adapters (peft upcasts 16-bit adapters to fp32 by default);
    # autocast_adapter_dtype=False: adapters, gradients and torch optimizer state in the base's dtype.
    lora = _lora_shapes(spec, setup)
    adapter_size = 4 if setup.autocast_adapter_dtype else wsize
    adapter_state = state_size(adapter_size, master=False)  # LoRA keeps no master copy
    lora_numels = [math.prod(s) for s in lora]
    weights = quantization = 0
    base_size = 4 if setup.prepare_kbit else wsize
    for info in spec.params:
        if setup.quant != "none" and info.module == "linear" and not info.is_lm_head and info.name.endswith(".weight"):
            packed, meta = nf4_bytes(info.numel, setup.quant == "nf4-dq")
            weights += packed
            quantization += meta
        else:
            weights += info.numel * base_size
    weights += adapter_size * sum(lora_numels)
    return ModelStates(
        weights=weights,
        gradients=adapter_size * sum(lora_numels),
        optimizer_state=optimizer_state_bytes(
            setup.optimizer, lora_numels, adapter_state, lora, step_counters, setup.optimizer_in_backward
        ),
        master_weights=0,
        quantization=quantization,
        trainable=sum(lora_numels),
        frozen=spec.n_params,
        trainable_shapes=lora,
        grad_itemsize=adapter_size,
        state_itemsize=adapter_state,
    )
