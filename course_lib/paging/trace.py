"""Traces: what a training step does to memory, event by event (lesson 4, "a trace").

A trace is a list of `Event`s (allocations, frees, kernels touching memory, prefetches, compute),
built by hand, from a model's shapes (`training_trace`), or from chunk numbers (`chunk_trace`, the
exercise's small world). `course_lib.paging.simulator` runs it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from course_lib import validate
from course_lib.paging.policies import (
    BNB_BLOCKSIZE,
    BNB_MIN_8BIT_SIZE,
    BNB_PAGED_MIN_NUMEL,
    OPTIMIZERS,
    ROOT_CHUNK,
    PagingError,
)
from course_lib.validate import checked

MAX_LAYERS = 10_000  # more decoder layers than any model has (the deepest have about a hundred)
OPS = ("alloc", "free", "touch", "prefetch", "compute", "empty_cache")


@dataclass(frozen=True)
class Event:
    """One thing a training step does to memory (lesson 4, "a trace").

    op: "alloc" (`names[0]`, `nbytes`, `managed`), "free" (`names[0]`), "touch" (a kernel reads or
    writes `names`; managed ones fault in when absent), "prefetch" (`cudaMemPrefetchAsync` of the
    managed `names` to the GPU), "compute" (`flops` and `device_bytes` of GPU work) or
    "empty_cache" (the caching allocator returns its free blocks).
    """

    op: str
    names: tuple[str, ...] = ()
    nbytes: int = 0
    managed: bool = False
    flops: float = 0.0
    device_bytes: float = 0.0
    step: int = 0
    phase: str = ""
    label: str = ""

    def __post_init__(self) -> None:
        """Each field checked once, here, for every way of making an event (`alloc`, `replace`, by hand):
        2.5 bytes or a name's letters would be a silent wrong simulation."""
        checked = {
            "op": validate.choice("op", self.op, OPS, error=PagingError),
            "names": validate.strings("names", self.names, error=PagingError) if self.names != () else (),
            "nbytes": validate.non_negative_int("nbytes", self.nbytes, error=PagingError),
            "managed": validate.strict_bool("managed", self.managed, error=PagingError),
            "flops": validate.finite("flops", self.flops, at_least=0, error=PagingError),
            "device_bytes": validate.finite("device_bytes", self.device_bytes, at_least=0, error=PagingError),
            "step": validate.non_negative_int("step", self.step, error=PagingError),
        }
        for name in ("phase", "label"):
            validate.instance(name, getattr(self, name), str, "a string", error=PagingError)
        for name, value in checked.items():
            object.__setattr__(self, name, value)


def alloc(name: str, nbytes: int, *, managed: bool = False, step: int = 0, phase: str = "") -> Event:
    """An allocation event: ordinary memory, or managed (paged) with `managed=True` (lesson 4)."""
    return Event("alloc", (name,), nbytes=nbytes, managed=managed, step=step, phase=phase)


def free(name: str, *, step: int = 0, phase: str = "") -> Event:
    """A free event (lesson 4)."""
    return Event("free", (name,), step=step, phase=phase)


def touch(*names: str, step: int = 0, phase: str = "") -> Event:
    """A kernel reading or writing `names`; absent managed memory faults in (lesson 4)."""
    return Event("touch", tuple(names), step=step, phase=phase)


def prefetch(*names: str, step: int = 0, phase: str = "") -> Event:
    """`cudaMemPrefetchAsync` of the managed `names` to the GPU (lesson 4)."""
    return Event("prefetch", tuple(names), step=step, phase=phase)


@checked(error=PagingError)
def compute(*, flops: float = 0.0, device_bytes: float = 0.0, step: int = 0, phase: str = "", label: str = "") -> Event:
    """GPU work: its time is the larger of flops / device_flops and bytes / device_bandwidth (lesson 4)."""
    return Event(
        "compute", (), flops=float(flops), device_bytes=float(device_bytes), step=step, phase=phase, label=label
    )


def empty_cache(*, step: int = 0, phase: str = "") -> Event:
    """`torch.cuda.empty_cache()`: the caching allocator returns its free blocks (lesson 4)."""
    return Event("empty_cache", (), step=step, phase=phase)


@checked(error=PagingError)
@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor: its name, element count, the layer it belongs to, whether it trains,
    and its bytes per element (lesson 4)."""

    name: str
    numel: int
    layer: int = 0
    trainable: bool = True
    dtype_bytes: int = 4


def transformer_params(
    n_layers: int,
    hidden: int,
    vocab: int,
    *,
    intermediate: int | None = None,
    lora_rank: int | None = None,
    frozen_dtype_bytes: int = 2,
) -> list[ParamSpec]:
    """The parameter tensors of a GPT-2-shaped decoder (tied embeddings), computed from its shape
    (lesson 4). With `lora_rank`, the base weights are frozen (`frozen_dtype_bytes` each) and each
    layer gets trainable fp32 LoRA factors on its attention projection (peft's default target)."""
    n_layers = validate.positive_int("n_layers", n_layers, maximum=MAX_LAYERS, error=PagingError)
    hidden, vocab = (
        validate.positive_int(name, value, error=PagingError) for name, value in (("hidden", hidden), ("vocab", vocab))
    )
    inter = intermediate or 4 * hidden
    frozen = lora_rank is not None
    base = {"trainable": not frozen, "dtype_bytes": frozen_dtype_bytes if frozen else 4}
    specs = [ParamSpec("wte", vocab * hidden, 0, **base), ParamSpec("wpe", 1024 * hidden, 0, **base)]
    for layer in range(n_layers):
        prefix = f"h.{layer}"
        shapes = [
            ("ln_1.weight", hidden),
            ("ln_1.bias", hidden),
            ("attn.c_attn.weight", hidden * 3 * hidden),
            ("attn.c_attn.bias", 3 * hidden),
            ("attn.c_proj.weight", hidden * hidden),
            ("attn.c_proj.bias", hidden),
            ("ln_2.weight", hidden),
            ("ln_2.bias", hidden),
            ("mlp.c_fc.weight", hidden * inter),
            ("mlp.c_fc.bias", inter),
            ("mlp.c_proj.weight", inter * hidden),
            ("mlp.c_proj.bias", hidden),
        ]
        specs += [ParamSpec(f"{prefix}.{n}", k, layer, **base) for n, k in shapes]
        if frozen:
            specs += [
                ParamSpec(f"{prefix}.attn.c_attn.lora_A", lora_rank * hidden, layer),
                ParamSpec(f"{prefix}.attn.c_attn.lora_B", 3 * hidden * lora_rank, layer),
            ]
    specs += [
        ParamSpec("ln_f.weight", hidden, n_layers - 1, **base),
        ParamSpec("ln_f.bias", hidden, n_layers - 1, **base),
    ]
    return specs


@checked(error=PagingError)
def params_from_module(module) -> list[ParamSpec]:
    """ParamSpecs read from a torch module's `named_parameters()`, also on the meta device (lesson 4).

    The layer of a parameter is the first integer in its name ("h.3.mlp..." is layer 3);
    parameters without one join the layer of the parameter before them (layer 0 at the start).
    """
    if not callable(getattr(module, "named_parameters", None)):
        raise PagingError(f"module must be a torch.nn.Module, got {module!r:.60} ({type(module).__name__})")
    specs, layer = [], 0
    for name, p in module.named_parameters():
        match = re.search(r"\.(\d+)\.", f".{name}.")
        if match:
            layer = int(match.group(1))
        specs.append(ParamSpec(name, int(p.numel()), layer, bool(p.requires_grad), p.element_size()))
    if not specs:
        raise PagingError("the module has no parameters")
    return specs


@checked(error=PagingError)
def activation_bytes_per_token(hidden: int, n_layers: int, bytes_per_value: int = 2) -> int:
    """Activations saved for backward per token: Korthikanti et al. 2022's 34*h bytes per layer in
    16-bit with flash attention (no s^2 term). Real layers store more (a Hugging Face GPT-2 layer
    60 to 114 sbh, lesson 3): calibrate with the planner or a measurement (lesson 4)."""
    return int(34 * hidden * n_layers * bytes_per_value // 2)


@checked(error=PagingError)
@dataclass(frozen=True)
class StateTensor:
    """One optimizer state tensor of a parameter: name, bytes, paged or not (lesson 4)."""

    name: str
    nbytes: int
    managed: bool


def optimizer_state(spec: ParamSpec, optimizer: str) -> list[StateTensor]:
    """The state tensors an optimizer allocates for one parameter, as bitsandbytes and torch do
    (lesson 4; bitsandbytes 0.50 optim/optimizer.py, lesson 1)."""
    if optimizer not in OPTIMIZERS:
        raise PagingError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    n = spec.numel
    if optimizer == "adamw":  # torch: exp_avg, exp_avg_sq in the parameter's dtype
        return [
            StateTensor(f"exp_avg:{spec.name}", n * spec.dtype_bytes, False),
            StateTensor(f"exp_avg_sq:{spec.name}", n * spec.dtype_bytes, False),
        ]
    paged = optimizer.startswith("paged") and n >= BNB_PAGED_MIN_NUMEL
    eight_bit = optimizer.endswith("8bit") and n >= BNB_MIN_8BIT_SIZE
    if eight_bit:
        blocks = math.ceil(n / BNB_BLOCKSIZE) * 4
        return [
            StateTensor(f"state1:{spec.name}", n, paged),
            StateTensor(f"state2:{spec.name}", n, paged),
            StateTensor(f"absmax1:{spec.name}", blocks, False),
            StateTensor(f"absmax2:{spec.name}", blocks, False),
        ]
    return [StateTensor(f"state1:{spec.name}", 4 * n, paged), StateTensor(f"state2:{spec.name}", 4 * n, paged)]


@checked(error=PagingError)
@dataclass(frozen=True)
class TrainingSetup:
    """What one training step holds (lesson 4): the parameters, the optimizer, bytes of a gradient
    per element, activations per token, and FLOPs per token (default 6 per parameter).

    The lesson-1 planner (`course_lib.planner`) can supply `activation_bytes_per_token` (and the
    parameter list); here they come from shapes or from a module's parameters.
    """

    params: tuple[ParamSpec, ...]
    optimizer: str = "paged_adamw_32bit"
    activation_bytes_per_token: int = 0
    grad_bytes: int = 4
    flops_per_token: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", tuple(self.params))
        if not self.params:
            raise PagingError("a training setup needs at least one parameter")
        if self.optimizer not in OPTIMIZERS:
            raise PagingError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.activation_bytes_per_token < 0:
            raise PagingError("activation_bytes_per_token must be >= 0")
        for spec in self.params:
            if spec.numel <= 0:
                raise PagingError(f"parameter {spec.name!r} has numel {spec.numel}: must be positive")

    @property
    def n_params(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def n_layers(self) -> int:
        return max(p.layer for p in self.params) + 1

    def with_optimizer(self, optimizer: str) -> TrainingSetup:
        return replace(self, optimizer=optimizer)

    def bytes_by_category(self, tokens: int = 0) -> dict[str, int]:
        """Weights, gradients, optimizer state (paged and ordinary) and activations, in bytes."""
        state = [s for p in self.params if p.trainable for s in optimizer_state(p, self.optimizer)]
        return {
            "weights": sum(p.numel * p.dtype_bytes for p in self.params),
            "gradients": sum(p.numel * self.grad_bytes for p in self.params if p.trainable),
            "optimizer state (paged)": sum(s.nbytes for s in state if s.managed),
            "optimizer state (ordinary)": sum(s.nbytes for s in state if not s.managed),
            "optimizer temporaries": self.optimizer_temporaries(),
            "activations": self.activation_bytes_per_token * tokens,
        }

    def optimizer_temporaries(self) -> int:
        """Bytes the optimizer step allocates and frees again: torch's foreach AdamW (the default on
        CUDA) computes `sqrt(exp_avg_sq)` for every parameter at once (`torch._foreach_sqrt`, torch
        2.13 optim/adam.py), one state-sized temporary; bitsandbytes updates each parameter in one
        fused kernel, with none."""
        if self.optimizer != "adamw":
            return 0
        return sum(p.numel * p.dtype_bytes for p in self.params if p.trainable)


@checked(error=PagingError)
def training_trace(
    setup: TrainingSetup,
    tokens_per_step: Sequence[int],
    *,
    empty_cache_after: Iterable[int] = (),
    use_prefetch: bool = True,
) -> list[Event]:
    """The memory events of `len(tokens_per_step)` training steps (lesson 4, "a trace").

    Step 0 allocates the weights. Each step: forward allocates each layer's activations; backward
    allocates each layer's gradients and frees its activations; the optimizer walks the trainable
    parameters in order and, like bitsandbytes, allocates state lazily (first step; paged state is
    filled by a kernel, which populates it on the GPU), prefetches the paged state, then updates
    (touch + compute); `zero_grad(set_to_none=True)` frees the gradients. torch's AdamW allocates
    every state tensor first and, each step, the foreach `sqrt(exp_avg_sq)` temporary, then updates. `empty_cache_after` lists the steps after
    which `torch.cuda.empty_cache()` runs. `use_prefetch=False` drops bitsandbytes' prefetch: the
    update kernel then faults the state in (plain unified memory).
    """
    if not tokens_per_step:
        raise PagingError("tokens_per_step must list at least one step")
    for tokens in tokens_per_step:
        if not isinstance(tokens, (int, np.integer)) or tokens < 0:
            raise PagingError(f"tokens per step must be non-negative integers, got {tokens!r}")
    flush = set(empty_cache_after)
    layers = setup.n_layers
    by_layer: list[list[ParamSpec]] = [[] for _ in range(layers)]
    for spec in setup.params:
        by_layer[spec.layer].append(spec)
    flops_per_token = setup.flops_per_token if setup.flops_per_token is not None else 6.0 * setup.n_params
    trainable = [p for p in setup.params if p.trainable]
    states = {p.name: optimizer_state(p, setup.optimizer) for p in trainable}
    events: list[Event] = []
    for spec in setup.params:
        events.append(alloc(f"param:{spec.name}", spec.numel * spec.dtype_bytes, step=0, phase="forward"))
    for step, tokens in enumerate(tokens_per_step):
        act = setup.activation_bytes_per_token * tokens
        per_layer = [act // layers + (1 if i < act % layers else 0) for i in range(layers)]
        fwd = flops_per_token * tokens / 3
        for layer in range(layers):
            kw = {"step": step, "phase": "forward"}
            if per_layer[layer]:
                events.append(alloc(f"act:{step}:{layer}", per_layer[layer], **kw))
            events.append(compute(flops=fwd / layers, label=f"forward layer {layer}", **kw))
        for layer in reversed(range(layers)):
            kw = {"step": step, "phase": "backward"}
            for spec in by_layer[layer]:
                if spec.trainable:
                    events.append(alloc(f"grad:{spec.name}", spec.numel * setup.grad_bytes, **kw))
            events.append(compute(flops=2 * fwd / layers, label=f"backward layer {layer}", **kw))
            if per_layer[layer]:
                events.append(free(f"act:{step}:{layer}", **kw))
        kw = {"step": step, "phase": "optimizer"}
        if setup.optimizer == "adamw":
            if step == 0:
                for spec in trainable:
                    for s in states[spec.name]:
                        events.append(alloc(s.name, s.nbytes, **kw))
            if setup.optimizer_temporaries():
                events.append(alloc(f"foreach_sqrt:{step}", setup.optimizer_temporaries(), **kw))
        for spec in trainable:
            tensors = states[spec.name]
            if step == 0 and setup.optimizer != "adamw":
                for s in tensors:
                    events.append(alloc(s.name, s.nbytes, managed=s.managed, **kw))
                managed = tuple(s.name for s in tensors if s.managed)
                if managed:
                    events.append(touch(*managed, **kw))  # F.fill(buff, 0): a kernel on the GPU
            managed = tuple(s.name for s in tensors if s.managed)
            if managed and use_prefetch:
                events.append(prefetch(*managed, **kw))
            events.append(touch(*(s.name for s in tensors), **kw))
            moved = spec.numel * (2 * spec.dtype_bytes + setup.grad_bytes) + 2 * sum(s.nbytes for s in tensors)
            events.append(compute(device_bytes=moved, label=f"update {spec.name}", **kw))
        if setup.optimizer_temporaries():
            events.append(free(f"foreach_sqrt:{step}", **kw))
        for spec in trainable:
            events.append(free(f"grad:{spec.name}", **kw))
        if step in flush:
            events.append(empty_cache(**kw))
    return events


@checked(error=PagingError)
def chunk_trace(
    accesses: Sequence[int], n_chunks: int | None = None, chunk_bytes: int = ROOT_CHUNK, *, use_prefetch: bool = True
) -> list[Event]:
    """A trace of managed chunks `0..n_chunks-1` (each `chunk_bytes`), accessed in the order given
    (lesson 4, exercise "allocation order vs LRU"). Each access is a prefetch (or a touch)."""
    accesses = [int(a) for a in accesses]
    n_chunks = n_chunks if n_chunks is not None else (max(accesses) + 1 if accesses else 0)
    events = [alloc(f"chunk{i}", chunk_bytes, managed=True) for i in range(n_chunks)]
    make = prefetch if use_prefetch else touch
    events += [make(f"chunk{a}", phase="optimizer") for a in accesses]
    return events
