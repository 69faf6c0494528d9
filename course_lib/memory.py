"""The memory planner: predicted bytes of a training step by category, a GPU catalog, a fit verdict,
and "what makes it fit" (lesson 1, "the planner").

Model states (weights, gradients, optimizer state, fp32 master weights, quantization metadata) are
counted exactly, tensor by tensor, from the model's real parameter shapes (a meta-device build, see
`course_lib.models`), with each optimizer's real layout: torch AdamW's two moments and its step
counters, bitsandbytes' blockwise 8-bit state with its small-tensor fallback, Adafactor's factored
second moment, NF4's packed weights and block statistics.

Activations are not a formula. The planner runs one real training step of the Hugging Face
implementation on the meta device at the target size (shapes only, no memory) and records every
tensor it creates and frees: what each decoder layer saves for backward, the logits and loss
buffers, the gradients as they appear. A deep model is traced as two shallow copies of itself and
composed exactly (`course_lib.trace_compose`); traces are kept on disk (`course_lib.trace_cache`). Korthikanti et al.'s formula is
reported beside it. Checkpointing plans go through lesson 3's cost model
(`course_lib.checkpointing.plan_cost`), fed with the per-layer bytes of that trace, so the planner and
lesson 3 share one source of truth. `benchmarks/planner_accuracy.py` checks the predictions against
real training steps measured by `course_lib.measure`.
"""

from __future__ import annotations

import copy
import math
import re
import warnings
import weakref
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from course_lib import checkpointing
from course_lib.measure import GiB, MiB, format_bytes
from course_lib.models import build_model, model_spec, ModelNotFound, ModelSpec, ParamInfo, supported_attention

PRECISIONS = ("fp32", "bf16", "fp16", "mixed-bf16", "mixed-fp16")
OPTIMIZERS = ("sgd", "momentum", "adamw", "adamw8bit", "paged_adamw8bit", "paged_adamw32bit", "adafactor", "lion")
QUANTS = ("none", "nf4", "nf4-dq")
ATTENTIONS = ("sdpa", "eager")
LOOPS = ("trainer", "keep-outputs")
CATEGORIES = ("weights", "gradients", "optimizer_state", "master_weights", "quantization", "activations",
              "optimizer_temporaries", "overhead", "total")

# bitsandbytes 0.50.2 (optim/optimizer.py, Optimizer2State; docs/references.md): 8-bit blockwise
# state, 256 values per float32 absmax; tensors below 4096 elements keep 32-bit state; two 256-entry
# float32 quantization maps per optimizer.
BNB_BLOCK = 256
BNB_MIN_8BIT_SIZE = 4096
BNB_QMAPS_BYTES = 2 * 256 * 4
# NF4 (bitsandbytes quantize_4bit): two values per byte, a float32 absmax per 64 values and a
# 16-entry float32 code table per tensor; double quantization stores the absmax as uint8 in blocks of
# 256 with a float32 second level, a float32 offset and a 256-entry float32 code table.
NF4_BLOCK = 64
NF4_DQ_BLOCK = 256
# Memory a CUDA process uses outside PyTorch's allocator: the CUDA context and library handles
# (about 300 to 700 MB: PyTorch issues 28113 and 107667, docs/references.md). A mid value; measure
# yours with course_lib.measure on the GPU.
CUDA_CONTEXT_BYTES = 512 * MiB
DEFAULT_LORA_RANK = 16

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class PlanError(ValueError):
    """A setup the planner cannot plan: the message says what to change (lesson 1)."""


# ---------------------------------------------------------------------------------------------------
# The GPU catalog
# ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GPU:
    """A GPU as a training process sees it: the memory nvidia-smi reports as total (lesson 1)."""

    name: str
    memory_bytes: int
    compute_capability: tuple[int, int]
    note: str = ""

    @property
    def bf16(self) -> bool:
        """bf16 hardware: compute capability >= 8.0 (a T4 only emulates it; docs/references.md)."""
        return self.compute_capability >= (8, 0)


GPUS = {
    "t4": GPU("T4", 15360 * MiB, (7, 5), "16 GB card, 15360 MiB visible with ECC on (Colab)"),
    "l4": GPU("L4", 23034 * MiB, (8, 9), "24 GB card"),
    "a10g": GPU("A10G", 23028 * MiB, (8, 6), "24 GB card (AWS g5)"),
    "a100-40gb": GPU("A100 40GB", 40960 * MiB, (8, 0)),
    "a100-80gb": GPU("A100 80GB", 81920 * MiB, (8, 0)),
    "h100-80gb": GPU("H100 80GB", 81559 * MiB, (9, 0)),
    "h200": GPU("H200", 143771 * MiB, (9, 0), "141 GB card, 143771 MiB as nvidia-smi shows it"),
    "rtx3090": GPU("RTX 3090", 24576 * MiB, (8, 6)),
    "rtx4090": GPU("RTX 4090", 24564 * MiB, (8, 9)),
}
_GPU_ALIASES = {"a100": "a100-80gb", "h100": "h100-80gb", "a100-40": "a100-40gb", "a100-80": "a100-80gb",
                "3090": "rtx3090", "4090": "rtx4090", "rtx-3090": "rtx3090", "rtx-4090": "rtx4090",
                "colab": "t4"}


def get_gpu(name: str | GPU) -> GPU:
    """A catalog GPU by name ('t4', 'A100-80GB', 'rtx4090', ...); unknown names suggest close ones."""
    if isinstance(name, GPU):
        return name
    key = re.sub(r"[\s_]+", "-", str(name).strip().lower())
    key = _GPU_ALIASES.get(key, key)
    if key in GPUS:
        return GPUS[key]
    import difflib

    close = difflib.get_close_matches(key, list(GPUS) + list(_GPU_ALIASES), n=3, cutoff=0.4)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise PlanError(f"unknown GPU {name!r}: {hint}known: {', '.join(GPUS)}")


# ---------------------------------------------------------------------------------------------------
# The setup
# ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Setup:
    """How the model is trained (lesson 1). Sizes are per micro-batch; `accum` micro-batches make one
    optimizer step (effective batch = batch * accum).

    precision: "fp32"; "bf16"/"fp16" (pure: weights, gradients and torch optimizer state in 16 bits);
    "mixed-bf16"/"mixed-fp16" (16-bit weights and gradients, fp32 master weights and optimizer state).
    adam_state: None (torch's rule: state in the dtype of the parameter it updates) or "fp32".
    lora_rank > 0 trains LoRA adapters (fp32, peft's default) on `lora_targets` and freezes the base;
    quant "nf4"/"nf4-dq" stores the frozen linear layers in 4 bits (QLoRA; needs lora_rank > 0).
    prepare_kbit: peft's prepare_model_for_kbit_training, which upcasts every non-quantized
    parameter to fp32.
    loop: "trainer" keeps only the loss (the Trainer's loop); "keep-outputs" is the tutorials'
    `outputs = model(**batch); outputs.loss.backward()`: the outputs (the logits) stay alive through
    backward and the step, and into the next forward until `outputs` is bound again.
    """

    precision: str = "mixed-bf16"
    optimizer: str = "adamw"
    adam_state: str | None = None
    lora_rank: int = 0
    lora_targets: str | tuple[str, ...] = "all-linear"
    quant: str = "none"
    prepare_kbit: bool = False
    batch: int = 1
    seq: int = 512
    checkpointing: str = "none"
    accum: int = 1
    attention: str = "sdpa"
    loop: str = "trainer"

    def validate(self) -> Setup:
        """The setup itself, or PlanError naming the bad value."""
        for value, options, what in ((self.precision, PRECISIONS, "precision"),
                                     (self.optimizer, OPTIMIZERS, "optimizer"),
                                     (self.quant, QUANTS, "quant"), (self.attention, ATTENTIONS, "attention"),
                                     (self.loop, LOOPS, "loop")):
            if value not in options:
                raise PlanError(f"unknown {what} {value!r}: use one of {', '.join(options)}")
        for value, what in ((self.batch, "batch"), (self.seq, "seq"), (self.accum, "accum")):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"{what} must be a positive integer, got {value!r}")
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise PlanError(f"lora rank must be a positive integer (0: no LoRA), got {self.lora_rank!r}")
        if self.adam_state not in (None, "fp32"):
            raise PlanError(f"adam_state must be None (the parameter's dtype) or 'fp32', got {self.adam_state!r}")
        if self.quant != "none" and self.lora_rank == 0:
            raise PlanError(f"--quant {self.quant} freezes the base model: train adapters with --lora-rank R "
                            "(QLoRA); a 4-bit base cannot be fine-tuned directly")
        if self.lora_rank == 0 and self.lora_targets != "all-linear":
            raise PlanError(f"lora_targets {self.lora_targets!r} without a LoRA rank: give lora_rank R > 0")
        if self.adam_state is not None and self.optimizer not in ("adamw", "momentum", "adafactor"):
            raise PlanError(f"adam_state applies to torch's adamw, momentum and adafactor, not {self.optimizer!r} "
                            "(sgd keeps no state; bitsandbytes' optimizers choose their own)")
        if self.quant != "none" and self.precision.startswith("mixed"):
            raise PlanError(f"--quant {self.quant} with --precision {self.precision}: a 4-bit base has no fp32 "
                            f"master weights; use --precision {self.precision.split('-')[1]} (the compute dtype)")

        try:
            checkpointing.named_plan(4, self.checkpointing)
        except ValueError as error:
            raise PlanError(str(error)) from None
        return self

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype of the model's weights as stored on the device (the compute dtype for QLoRA)."""
        return _DTYPES[self.precision.split("-")[-1]]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ---------------------------------------------------------------------------------------------------
# Model states, exact
# ---------------------------------------------------------------------------------------------------

def _target_match(info: ParamInfo, targets: str | tuple[str, ...]) -> bool:
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
        if _target_match(info, setup.lora_targets):
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
    blocks = math.ceil(numel / NF4_BLOCK)
    packed = math.ceil(numel / 2)
    if not double_quant:
        return packed, blocks * 4 + 16 * 4
    return packed, blocks + 16 * 4 + 4 + math.ceil(blocks / NF4_DQ_BLOCK) * 4 + 256 * 4


def optimizer_state_bytes(optimizer: str, numels: Sequence[int], state_itemsize: int,
                          shapes: Sequence[tuple[int, ...]] | None = None, step_counters: bool = True) -> int:
    """Exact bytes of an optimizer's state for trainable tensors of these sizes (lesson 1).

    `state_itemsize`: bytes per element of torch optimizers' state (the parameter's dtype, or 4 for
    fp32 state). bitsandbytes' optimizers keep 32-bit state in fp32 whatever the parameter dtype.
    `step_counters`: torch AdamW and Adafactor keep a float32 step tensor per parameter (on the CPU
    unless capturable/fused: not GPU memory on a CUDA target).
    """
    steps = 4 * len(numels) if step_counters else 0
    if optimizer == "sgd":
        return 0
    if optimizer == "momentum":
        return sum(numels) * state_itemsize
    if optimizer == "adamw":
        return 2 * sum(numels) * state_itemsize + steps
    if optimizer in ("adamw8bit", "paged_adamw8bit"):
        total, any_8bit = 0, False
        for n in numels:
            if n < BNB_MIN_8BIT_SIZE:
                total += 8 * n
            else:
                any_8bit = True
                total += 2 * n + 2 * 4 * math.ceil(n / BNB_BLOCK)
        return total + (BNB_QMAPS_BYTES if any_8bit else 0)
    if optimizer == "paged_adamw32bit":
        return 8 * sum(numels)
    if optimizer == "lion":  # bitsandbytes Lion, 32-bit: one fp32 momentum
        return 4 * sum(numels)
    if optimizer == "adafactor":  # torch.optim.Adafactor: factored second moment for 2-D and up
        if shapes is None:
            raise PlanError("adafactor's state depends on tensor shapes: give a model, not only --params")
        total = 0
        for shape in shapes:
            if len(shape) >= 2:
                total += (math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]) * state_itemsize
            else:
                total += math.prod(shape) * state_itemsize
        return total + steps
    raise PlanError(f"unknown optimizer {optimizer!r}")


def _optimizer_step_extra(optimizer: str, shapes: Sequence[tuple[int, ...]], state_itemsize: int,
                          grad_itemsize: int, cuda: bool, mixed: bool) -> int:
    """Temporaries of one optimizer step beyond the state (lesson 1, "the step has a peak too").

    torch AdamW on the CPU (single-tensor): sqrt(v) and its division live together, 2 x the largest
    tensor; on CUDA the default foreach path makes sqrt(v) for all tensors at once, 1 x all of them.
    bitsandbytes' kernels update in place. Mixed precision converts each gradient to fp32 for the
    master update.
    """
    if not shapes:
        return 0
    numels = [math.prod(s) for s in shapes]
    largest = max(numels)
    extra = 0
    if optimizer == "adamw":
        extra = sum(numels) * state_itemsize if cuda else 2 * largest * state_itemsize
    elif optimizer == "adafactor":
        extra = max(math.prod(s) + 4 * s[-1] for s in shapes) * grad_itemsize
    if mixed:
        extra += 4 * largest
    return extra


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
    grad_itemsize: int = 4
    state_itemsize: int = 4


def model_states(spec: ModelSpec | None, setup: Setup, n_params: int | None = None,
                 cuda: bool = False) -> ModelStates:
    """Exact bytes of weights, gradients, optimizer state, master weights and quantization metadata
    (lesson 1). With `spec=None`, `n_params` parameters are treated as one full fine-tune."""
    wsize = _itemsize(setup.weight_dtype)
    mixed = setup.precision.startswith("mixed")
    torch_opt = setup.optimizer in ("adamw", "momentum", "adafactor")
    if spec is None:
        if setup.lora_rank or setup.quant != "none":
            raise PlanError("LoRA and quantization need the model's layer shapes: give a model name or "
                            "config.json, not only --params")
        if setup.optimizer == "adafactor":
            optimizer_state_bytes("adafactor", [n_params], 4)  # raises: shapes needed
        state_size = 4 if (mixed or setup.adam_state == "fp32" or not torch_opt) else wsize
        return ModelStates(
            weights=n_params * wsize, gradients=n_params * wsize,
            optimizer_state=optimizer_state_bytes(setup.optimizer, [n_params], state_size, step_counters=False),
            master_weights=4 * n_params if mixed else 0, quantization=0, trainable=n_params, frozen=0,
            grad_itemsize=wsize, state_itemsize=state_size)

    step_counters = not cuda
    if not setup.lora_rank:
        shapes = [p.shape for p in spec.params]
        numels = [p.numel for p in spec.params]
        state_size = 4 if (mixed or setup.adam_state == "fp32") else wsize
        return ModelStates(
            weights=sum(numels) * wsize, gradients=sum(numels) * wsize,
            optimizer_state=optimizer_state_bytes(setup.optimizer, numels, state_size, shapes, step_counters),
            master_weights=4 * sum(numels) if mixed else 0, quantization=0,
            trainable=sum(numels), frozen=0, trainable_shapes=shapes, grad_itemsize=wsize,
            state_itemsize=state_size)

    # LoRA / QLoRA: frozen base, fp32 adapters (peft upcasts 16-bit adapters to fp32 by default).
    lora = _lora_shapes(spec, setup)
    lora_numels = [math.prod(s) for s in lora]
    weights = quantization = 0
    base_size = 4 if setup.prepare_kbit else wsize
    for info in spec.params:
        if setup.quant != "none" and info.module == "linear" and not info.is_lm_head \
                and info.name.endswith(".weight"):
            packed, meta = nf4_bytes(info.numel, setup.quant == "nf4-dq")
            weights += packed
            quantization += meta
        else:
            weights += info.numel * base_size
    weights += 4 * sum(lora_numels)
    return ModelStates(
        weights=weights, gradients=4 * sum(lora_numels),
        optimizer_state=optimizer_state_bytes(setup.optimizer, lora_numels, 4, lora, step_counters),
        master_weights=0, quantization=quantization, trainable=sum(lora_numels), frozen=spec.n_params,
        trainable_shapes=lora, grad_itemsize=4, state_itemsize=4)


# ---------------------------------------------------------------------------------------------------
# Activations: a real training step traced on the meta device
# ---------------------------------------------------------------------------------------------------

class _MetaTracer(TorchDispatchMode):
    """Live bytes of every storage created inside the region, on any device including meta.

    Keyed by the storage's identity (meta storages all have address 0). Parameters are created
    before the region and are never counted. `grad_bytes` follows the gradients stored in `.grad`
    (post-accumulate-grad hooks), so that `current - grad_bytes` is what is live besides them.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.grad_bytes = 0
        self.phase = "forward"
        self.position: int | str = "pre"  # the decoder layer running ("pre"/"post": before/after them)
        self.peaks: dict[str, int] = {}
        self.peaks_without_grads: dict[str, int] = {}
        self.position_peaks: dict[tuple[str, int | str], tuple[int, int]] = {}
        self.known: set[int] = set()

    def exclude(self, tensor: torch.Tensor) -> None:
        """Never count this tensor's storage (a parameter, the batch), nor views of it."""
        self.known.add(tensor.untyped_storage()._cdata)

    def watch(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key, nbytes = storage._cdata, storage.nbytes()
        if not nbytes or key in self.live or key in self.known:
            return
        self.live[key] = nbytes
        weakref.finalize(storage, self._freed, key, nbytes)
        self._change(nbytes)

    def _freed(self, key: int, nbytes: int) -> None:
        if self.live.get(key) == nbytes:
            del self.live[key]
            self._change(-nbytes)

    def _change(self, delta: int) -> None:
        self.current += delta
        if self.current > self.peaks.get(self.phase, 0):
            self.peaks[self.phase] = self.current
        rest = self.current - self.grad_bytes
        if rest > self.peaks_without_grads.get(self.phase, 0):
            self.peaks_without_grads[self.phase] = rest
        where = (self.phase, self.position)
        old = self.position_peaks.get(where, (0, 0))
        if self.current > old[0] or rest > old[1]:
            self.position_peaks[where] = (max(old[0], self.current), max(old[1], rest))

    def set_phase(self, phase: str, position: int | str | None = None) -> None:
        self.phase = phase
        if position is not None:
            self.position = position
        self._change(0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self.watch(tensor)
        return out


@contextmanager
def _sdpa_as_on(target: str):
    """Make `F.scaled_dot_product_attention` on meta tensors allocate what the real kernel would.

    On meta it would take the math path (an s x s score matrix). On the CPU, torch picks its own
    kernel (asked here with small CPU tensors of the same kind); on CUDA the fused kernels (flash,
    memory-efficient) keep the output and a float32 log-sum-exp, like the CPU flash kernel used here.
    """
    original = torch.nn.functional.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if query.device.type != "meta":
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa)
        if target == "cuda" or _cpu_sdpa_backend(query, key, value, attn_mask, dropout_p, is_causal,
                                                   enable_gqa) == 1:
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale)[0]
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)

    # transformers looks for packed sequences in the position ids, a data-dependent test the meta
    # device cannot answer; a plain batch (positions 0 .. s-1 in every row) has none.
    from transformers import masking_utils

    find_packed = getattr(masking_utils, "find_packed_sequence_indices", None)
    torch.nn.functional.scaled_dot_product_attention = sdpa
    if find_packed is not None:
        masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original
        if find_packed is not None:
            masking_utils.find_packed_sequence_indices = find_packed


def _cpu_sdpa_backend(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa) -> int:
    """Which kernel torch's CPU SDPA would pick (0 math, 1 flash) for tensors of this kind."""
    def small(t):
        shape = list(t.shape)
        shape[0] = 1
        if len(shape) >= 2:
            shape[-2] = min(shape[-2], 8)
        return torch.zeros(shape, dtype=t.dtype, requires_grad=t.requires_grad)

    mask = None
    if attn_mask is not None:
        shape = [1] * (attn_mask.dim() - 2) + [min(query.shape[-2], 8), min(key.shape[-2], 8)]
        mask = torch.zeros(shape, dtype=attn_mask.dtype)
    with torch.no_grad():
        return int(torch._fused_sdp_choice(small(query), small(key), small(value), mask, dropout_p, is_causal,
                                           enable_gqa=enable_gqa))


def _decoder_layers(model: torch.nn.Module, n_layers: int | None) -> torch.nn.ModuleList:
    """The ModuleList of decoder layers (the one with n_layers entries holding the most parameters)."""
    best, best_size = None, -1
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) and (n_layers is None or len(module) == n_layers):
            size = sum(p.numel() for p in module.parameters())
            if size > best_size:
                best, best_size = module, size
    if best is None:
        raise PlanError(f"cannot find the decoder layers of {type(model).__name__}")
    return best


@dataclass(frozen=True)
class Trace:
    """What one meta-device training step of the real implementation allocated (lesson 1).

    Bytes beyond the parameters: `forward_peak`, `head_backward_peak` (loss, logits and output
    layer's backward, before the last decoder layer's), `layer_backward_peak` (the rest), each with
    the gradients produced so far, and the same without them (`*_without_grads`). `saved` and
    `inputs`: per decoder layer, what it saves for backward and the size of its input (lesson 3's
    cost model takes these), `output`: the last layer's output. `saved_outside`: saved outside the
    layers (embeddings, final norm, output layer, loss).
    """

    forward_peak: int
    head_backward_peak: int
    layer_backward_peak: int
    tail_backward_peak: int
    forward_peak_without_grads: int
    head_backward_peak_without_grads: int
    layer_backward_peak_without_grads: int
    tail_backward_peak_without_grads: int
    gradients: int
    saved: tuple[int, ...]
    inputs: tuple[int, ...]
    output: int
    saved_outside: int
    dequant_transient: int = 0
    kept_outputs: int = 0  # loop "keep-outputs": the outputs' bytes, alive from one forward to the next
    # (phase, layer index or "pre"/"post") -> (peak, peak without gradients): what
    # course_lib.trace_compose needs to compose a deep model's trace from shallow ones
    by_position: dict = field(default_factory=dict, compare=False, repr=False)


def _trace_key(spec: ModelSpec, setup: Setup, target: str) -> tuple:
    return (spec.config.to_json_string(use_diff=False), setup.precision, setup.lora_rank, str(setup.lora_targets), setup.quant != "none",
            setup.prepare_kbit, setup.batch, setup.seq, setup.attention, target, setup.loop)


_TRACES: dict[tuple, Trace] = {}


def trace_step(spec: ModelSpec, setup: Setup, target: str = "cpu") -> Trace:
    """Trace one forward + backward of the model on the meta device at the setup's size (lesson 1).

    The model is the Hugging Face implementation itself, built from the config; LoRA adapters come
    from peft; `use_cache=False` as in training. Frozen 4-bit layers are traced as frozen 16-bit
    layers (bitsandbytes saves nothing extra for them) plus one dequantized weight alive at a time.
    """
    key = _trace_key(spec, setup, target)
    if key not in _TRACES:
        from course_lib.trace_cache import cached_trace
        from course_lib.trace_compose import composed_trace

        _TRACES[key] = cached_trace(key, lambda: composed_trace(spec, setup, target, _trace)
                                    or _trace(spec, setup, target))
    return _TRACES[key]


def _build_traced_model(spec: ModelSpec, setup: Setup) -> torch.nn.Module:

    config = copy.deepcopy(spec.config)
    config.use_cache = False
    dtype = setup.weight_dtype
    model = build_model(config, "meta", dtype=dtype, attn_implementation=supported_attention(config, setup.attention))
    if setup.prepare_kbit:  # peft's prepare_model_for_kbit_training: non-quantized parameters to fp32
        for module in model.modules():
            if not (isinstance(module, torch.nn.Linear) and module is not model.get_output_embeddings()):
                for param in module.parameters(recurse=False):
                    param.data = param.data.float()
    model.train()
    if setup.lora_rank:
        from peft import LoraConfig, get_peft_model

        targets = setup.lora_targets if setup.lora_targets == "all-linear" else list(setup.lora_targets)
        with warnings.catch_warnings(), torch.device("meta"):  # adapters too: peft builds them on the CPU
            warnings.simplefilter("ignore")
            model = get_peft_model(model, LoraConfig(r=setup.lora_rank, lora_alpha=2 * setup.lora_rank,
                                                     target_modules=targets, lora_dropout=0.0,
                                                     init_lora_weights=False))  # values: none on meta
    return model


def _trace(spec: ModelSpec, setup: Setup, target: str) -> Trace:
    model = _build_traced_model(spec, setup)
    layers = _decoder_layers(model, spec.n_layers)
    tracer = _MetaTracer()
    param_keys = {p.untyped_storage()._cdata for p in model.parameters()}
    saved_by: dict[int, tuple[object, int]] = {}
    current = {"layer": None}
    inputs = [0] * len(layers)
    output = {"bytes": 0}

    def pack(tensor):
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key not in param_keys and key not in saved_by and storage.nbytes():
            saved_by[key] = (current["layer"], storage.nbytes())
        return tensor

    def pre_hook(index):
        def hook(module, args, kwargs):
            current["layer"] = index
            tracer.set_phase(tracer.phase, index)
            hidden = args[0] if args else kwargs.get("hidden_states")
            inputs[index] = hidden.untyped_storage().nbytes()
            if index == 0 and hidden.requires_grad:  # its gradient: the layers' backward is over
                hidden.register_hook(lambda grad: tracer.set_phase("tail_backward", "pre"))
        return hook

    def post_hook(index):
        def hook(module, args, result):
            current["layer"] = None
            hidden = result[0] if isinstance(result, (tuple, list)) else result
            if index == len(layers) - 1:
                tracer.set_phase(tracer.phase, "post")
                output["bytes"] = hidden.untyped_storage().nbytes()
                if hidden.requires_grad:
                    hidden.register_hook(lambda grad: tracer.set_phase("layer_backward", index))
            elif hidden.requires_grad:  # its gradient: layer index's backward starts
                hidden.register_hook(lambda grad: tracer.set_phase(tracer.phase, index))
        return hook

    handles = []
    for index, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(pre_hook(index), with_kwargs=True))
        handles.append(layer.register_forward_hook(post_hook(index)))

    def grad_hook(param):
        tracer.grad_bytes += param.grad.untyped_storage().nbytes()
        tracer.set_phase(tracer.phase)

    for param in model.parameters():
        if param.requires_grad:
            handles.append(param.register_post_accumulate_grad_hook(grad_hook))
    ids = torch.zeros(setup.batch, setup.seq, dtype=torch.long, device="meta")
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the trace is ours: keep transformers' advice off the user's screen
    for tensor in [ids, *model.parameters(), *model.buffers()]:
        tracer.exclude(tensor)
    try:
        with warnings.catch_warnings(), _sdpa_as_on(target):
            warnings.simplefilter("ignore")
            with tracer, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                outputs = model(input_ids=ids, labels=ids, use_cache=False)
                loss = outputs.loss
                kept = outputs.logits.untyped_storage().nbytes() if setup.loop == "keep-outputs" else 0
                if setup.loop == "trainer":
                    del outputs
                tracer.set_phase("head_backward")
                loss.backward()
                del loss
    except Exception as error:  # an architecture the meta device cannot run: say which
        reason = " ".join(str(error).split())[:300]
        raise PlanError(f"cannot trace a training step of {spec.name} on the meta device "
                        f"({type(error).__name__}: {reason}); plan with --params N instead") from None
    finally:
        hf_logging.set_verbosity(verbosity)
        for handle in handles:
            handle.remove()
    saved = [0] * len(layers)
    outside = 0
    for layer, nbytes in saved_by.values():
        if layer is None:
            outside += nbytes
        else:
            saved[layer] += nbytes
    dequant = 0
    if setup.quant != "none":  # bitsandbytes dequantizes one frozen weight at a time, forward and backward
        dequant = max(p.numel for p in spec.params if p.module == "linear" and not p.is_lm_head) \
            * _itemsize(setup.weight_dtype)
    peaks, rest = tracer.peaks, tracer.peaks_without_grads
    return Trace(
        forward_peak=peaks.get("forward", 0), head_backward_peak=peaks.get("head_backward", 0),
        layer_backward_peak=peaks.get("layer_backward", 0), tail_backward_peak=peaks.get("tail_backward", 0),
        forward_peak_without_grads=rest.get("forward", 0),
        head_backward_peak_without_grads=rest.get("head_backward", 0),
        layer_backward_peak_without_grads=rest.get("layer_backward", 0),
        tail_backward_peak_without_grads=rest.get("tail_backward", 0),
        gradients=tracer.grad_bytes, saved=tuple(saved), inputs=tuple(inputs), output=output["bytes"],
        saved_outside=outside, dequant_transient=dequant, kept_outputs=kept, by_position=dict(tracer.position_peaks))


def korthikanti_bytes(batch: int, seq: int, hidden: int, heads: int, layers: int) -> int:
    """Korthikanti et al. 2022: activations of a transformer, sbh(34 + 5as/h) bytes per layer
    (16-bit, with dropout masks, 4h MLP, no recompute). Shown beside the traced value, not trusted:
    real implementations store more or less (lesson 3)."""
    return int(layers * seq * batch * hidden * (34 + 5 * heads * seq / hidden))


# ---------------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------------

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
        if self.gpu is None:
            return f"predicted peak {format_bytes(self.total)} (give --gpu NAME for a fit verdict)"
        margin = self.gpu.memory_bytes - self.total
        if margin >= 0:
            return (f"fits on {self.gpu.name} ({format_bytes(self.gpu.memory_bytes)}): "
                    f"{format_bytes(margin)} to spare")
        return (f"does not fit on {self.gpu.name} ({format_bytes(self.gpu.memory_bytes)}): "
                f"{format_bytes(-margin)} over")

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
        return [(c, self.bytes[c]) for c in CATEGORIES]

    def __str__(self) -> str:
        head = self.model if self.model.endswith("parameters") else f"{self.model}: {self.n_params:,} parameters"
        lines = [f"{head} ({self.trainable_params:,} trained), "
                 f"{self.setup.precision}, {self.setup.optimizer}"
                 + (f", LoRA r={self.setup.lora_rank}" if self.setup.lora_rank else "")
                 + (f", {self.setup.quant}" if self.setup.quant != "none" else "")
                 + f", batch {self.setup.batch} x seq {self.setup.seq}"
                 + (f" x accum {self.setup.accum}" if self.setup.accum > 1 else "")
                 + (f", checkpointing {self.setup.checkpointing}" if self.setup.checkpointing != "none" else "")]
        for name, value in self.rows():
            shown = "unknown (no model shapes)" if name == "activations" and not self.activations_known \
                else f"{value / GiB:10.2f} GiB"
            lines.append(f"  {name:<21} {shown}")
        lines.append(self.verdict())
        if self.tricks:
            lines.append("What makes it fit, in order (each on top of the ones before):")
            for trick in self.tricks:
                lines.append(f"  {trick.name:<48} saves {trick.saves / GiB:7.2f} GiB -> "
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
    base = states.weights + states.optimizer_state + states.master_weights + states.quantization
    notes: list[str] = warned
    detail: dict[str, int | float | str] = {}
    temporaries = 0
    if spec is None:
        extra = 0
        notes.append("activations unknown: only a parameter count was given (name a model or a config.json "
                     "for activations and the optimizer step's temporaries)")
    else:
        extra, detail = _step_extra(spec, setup, states, "cuda" if cuda else "cpu")
        temporaries = detail.pop("optimizer_temporaries_over_activations")
        extra -= temporaries
        if detail["autocast_copies"]:
            notes.append(f"{setup.precision} autocast re-casts the fp32 frozen weights that prepare_model_for_kbit_training "
                         f"made (the output layer) at every call: {format_bytes(detail['autocast_copies'])} of 16-bit "
                         "copies live from its forward to its backward")
        if supported_attention(spec.config, setup.attention) != setup.attention:
            notes.append(f"attention: eager, because transformers' {type(spec.config).__name__.replace('Config', '')} "
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
    if cuda and setup.optimizer == "adamw" and spec is not None:
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
    if setup.accum > 1:
        notes.append(f"effective batch {setup.batch * setup.accum} = micro-batch {setup.batch} x {setup.accum} "
                     "accumulation steps; gradients stay allocated during the micro-batches")
    return Plan(name, setup, n_params, states.trainable, values, spec is not None, detail, card, [], notes)


SHAPE_OPTIONS = ("batch", "seq", "checkpointing", "accum", "attention", "loop")


def _check_setup_for(spec: ModelSpec | None, name: str, setup: Setup) -> list[str]:
    """PlanError for a setup this model cannot have (options a bare count cannot use, a LoRA rank
    beyond every layer it adapts); a warning for a sequence beyond the model's positions (lesson 1)."""
    if spec is None:
        used = [f"--{option}" for option in SHAPE_OPTIONS if getattr(setup, option) != getattr(Setup(), option)]
        if used:
            raise PlanError(f"{', '.join(used)} cannot change a plan from --params alone (no layer shapes, no "
                            "activations): name a model or a config.json to use them")
        return []
    if setup.lora_rank:
        widest = max((min(info.shape) for info in spec.params if _target_match(info, setup.lora_targets)), default=0)
        if setup.lora_rank > widest > 0:
            raise PlanError(f"lora rank {setup.lora_rank} is above the rank of every layer it adapts (at most "
                            f"{widest}): a rank-r adapter costs r x (in + out) values per layer; use r <= {widest}")
    positions = getattr(spec.config, "max_position_embeddings", None)
    if isinstance(positions, int) and setup.seq > positions:
        return [f"WARNING: seq {setup.seq} is beyond {name}'s {positions} positions (max_position_embeddings): "
                "the model as configured cannot train on it; this plans it as if it could (for a longer context, "
                "raise max_position_embeddings in a saved config.json and give that path)"]
    return []


def _step_extra(spec: ModelSpec, setup: Setup, states: ModelStates, target: str) -> tuple[int, dict]:
    """The most a step adds on top of all model states (activations, temporaries), and details."""

    trace = trace_step(spec, setup, target)
    n = len(trace.saved)
    none = checkpointing.plan_cost(trace.saved, trace.inputs, [], output_bytes=trace.output)
    segments = checkpointing.named_plan(n, setup.checkpointing)
    chosen = checkpointing.plan_cost(trace.saved, trace.inputs, segments, output_bytes=trace.output)
    held_change = chosen.forward_bytes - none.forward_bytes   # <= 0: what checkpointing drops
    peak_change = chosen.peak_bytes - none.peak_bytes
    grads = states.gradients
    if setup.accum > 1:  # gradients of earlier micro-batches are live throughout; new ones are added in
        largest_grad = max(math.prod(s) for s in states.trainable_shapes) * states.grad_itemsize
        forward = grads + trace.forward_peak_without_grads + held_change
        head = grads + trace.head_backward_peak_without_grads + held_change + largest_grad
        layers = grads + trace.layer_backward_peak_without_grads + peak_change + largest_grad
        tail = grads + trace.tail_backward_peak_without_grads + largest_grad
    else:
        forward = trace.forward_peak + held_change
        head = trace.head_backward_peak + held_change
        layers = trace.layer_backward_peak + peak_change
        tail = trace.tail_backward_peak  # after the layers' backward: none of their activations is left
    dequant = trace.dequant_transient
    copies = _autocast_copies(spec, setup)
    forward += trace.kept_outputs  # the previous step's outputs, until `outputs` is bound again
    step = grads + _optimizer_step_extra(setup.optimizer, states.trainable_shapes, states.state_itemsize,
                                         states.grad_itemsize, target == "cuda", setup.precision.startswith("mixed"))
    step += trace.kept_outputs
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
        "optimizer_temporaries_over_activations": max(0, step + batch - max(activation_peak, grads)),
        "autocast_copies": copies,
        "korthikanti_formula": korthikanti_bytes(setup.batch, setup.seq, hidden, heads, n) if hidden else 0,
        "recompute_fraction": chosen.recompute_fraction,
        "checkpoint_segments": " ".join(f"{a}-{b - 1}" for a, b in chosen.plan),
    }
    return max(peak - grads, 0), detail


def _autocast_copies(spec: ModelSpec, setup: Setup) -> int:
    """16-bit copies autocast makes of fp32 frozen weights (lesson 5, "what makes it fit"): after
    prepare_model_for_kbit_training the output layer is fp32; under a 16-bit autocast every call casts
    it, and the copy is saved for its backward (a frozen weight's cast is not cached)."""
    if not setup.prepare_kbit or setup.weight_dtype not in (torch.float16, torch.bfloat16):
        return 0
    output = [p for p in spec.params if p.is_lm_head]
    if not output and getattr(spec.config, "tie_word_embeddings", False):  # tied: the embedding is the output layer
        output = [p for p in spec.params if p.module == "embedding"][:1]
    return sum(p.numel for p in output) * _itemsize(setup.weight_dtype)


# ---------------------------------------------------------------------------------------------------
# What makes it fit
# ---------------------------------------------------------------------------------------------------

def _candidate_tricks(setup: Setup, card: GPU) -> list[tuple[str, Setup]]:
    """The tricks, cheapest in quality first: exact ones (time only), then approximations."""
    tricks = []
    if setup.checkpointing == "none":
        tricks.append(("activation checkpointing (every layer)", replace(setup, checkpointing="every-layer")))
    if setup.batch > 1:
        tricks.append((f"micro-batch 1 with gradient accumulation x{setup.batch * setup.accum}",
                       replace(setup, batch=1, accum=setup.batch * setup.accum)))
    if setup.optimizer in ("adamw", "paged_adamw32bit"):
        tricks.append(("8-bit AdamW (bitsandbytes)", replace(setup, optimizer="adamw8bit")))
    if not setup.lora_rank:
        precision = setup.precision.replace("mixed-", "")
        if precision == "bf16" and not card.bf16:
            precision = "fp16"
        tricks.append((f"LoRA r={DEFAULT_LORA_RANK} on all linear layers, frozen {precision} base",
                       replace(setup, lora_rank=DEFAULT_LORA_RANK, precision=precision)))
    if setup.quant == "none":  # as peft's QLoRA recipe does it: prepare_model_for_kbit_training included
        tricks.append(("QLoRA: NF4-DQ base + prepare_model_for_kbit_training",
                       replace(setup, quant="nf4-dq", prepare_kbit=True)))
    return tricks


def what_makes_it_fit(model, setup: Setup, gpu: str | GPU, current: Plan | None = None) -> list[Trick]:
    """The tricks, in order, each applied on top of the ones before, with the bytes each saves, until
    the step fits on `gpu` or no trick is left (lesson 1, "what makes it fit").

    At each round the first trick of the canonical order that lowers the predicted peak is taken: a
    trick that saves nothing now (checkpointing while the optimizer step is the peak) is tried again
    after the next one.
    """
    card = get_gpu(gpu)
    current = current or _plan(model, setup, card)
    tricks: list[Trick] = []
    state = setup
    while not current.fits:
        for name, nxt in _candidate_tricks(state, card):
            if nxt.quant != "none" and nxt.precision.startswith("mixed"):
                nxt = replace(nxt, precision=nxt.precision.replace("mixed-", ""))
            try:
                after = _plan(model, nxt, card)
            except PlanError:
                continue
            if current.total - after.total > current.total // 200:  # saves something worth saying (> 0.5%)
                tricks.append(Trick(name, current.total - after.total, after.total, bool(after.fits), nxt))
                state, current = nxt, after
                break
        else:
            break
    return tricks


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


def default_precision(gpu: GPU | None, quant: str = "none") -> str:
    """mixed-bf16, or mixed-fp16 on a GPU without bf16 hardware; the plain compute dtype for a 4-bit base."""
    half = "bf16" if gpu is None or gpu.bf16 else "fp16"
    return half if quant != "none" else f"mixed-{half}"


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
