"""Paged optimizers on CUDA unified memory: a simulator true to the driver (lesson 4).

What the simulator models, and where each rule comes from (FACTS.md, "Paging"):

- Ordinary allocations (weights, gradients, activations, unpaged optimizer state) go through
  PyTorch's caching allocator. They are never evicted: when they do not fit, the step runs out of
  memory. Freed blocks stay *reserved* by the allocator until `empty_cache` (or until a `cudaMalloc`
  fails, when PyTorch releases its free cached blocks and retries).
- Paged optimizer state is managed memory (`cudaMallocManaged(..., cudaMemAttachHost)`). A first
  touch on the GPU populates it there without a transfer; bitsandbytes calls `cudaMemPrefetchAsync`
  for each parameter's state right before its update, then synchronizes.
- When the GPU is short of memory the driver evicts managed memory in 2 MB root chunks, chosen by
  allocation order (a chunk goes to the list's tail when it is made resident, not when it is read),
  not by an access LRU. An eviction copies the chunk to the host (device to host) and is finished
  before the migration that needed the room starts, so the two are serial.
- Faults (a kernel touching non-resident managed memory) migrate big pages of 64 KB; the driver's
  density prefetcher grows a migration to the whole 2 MB VA block once more than 51% of it is
  resident. A prefetch migrates whole ranges without faults.

Time is the sum of compute, migrations (host to device), evictions (device to host) and fault
overhead: bitsandbytes synchronizes after each parameter, so nothing overlaps. Bandwidths and the
fault latency are parameters of `Hardware`; `Hardware.t4()` uses FACTS.md's T4 figures and
bitsandbytes' documented prefetch efficiency (about half of PCIe 3.0 x16).

The simulator works on chunks with numpy arrays and a heap of eviction runs: one event costs
O(chunks it touches), never a Python loop over 4 KB pages.
"""

from __future__ import annotations

import heapq
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from course_lib.measure import GiB, KiB, MiB, PHASES, format_bytes

GB = 10**9
VA_BLOCK = 2 * MiB          # UVM VA block: the driver's unit of fault servicing and prefetch growth
ROOT_CHUNK = 2 * MiB        # the driver's unit of eviction
GRANULARITIES = (4 * KiB, 64 * KiB, 2 * MiB)
EVICTION_POLICIES = ("allocation", "lru", "mru")
OPTIMIZERS = ("adamw", "adamw_8bit", "paged_adamw_32bit", "paged_adamw_8bit")
BNB_PAGED_MIN_NUMEL = 100_000     # bitsandbytes pages only state tensors with numel >= 1e5
BNB_MIN_8BIT_SIZE = 4096          # smaller tensors keep 32-bit state in 8-bit optimizers
BNB_BLOCKSIZE = 256               # 8-bit blockwise state: one float32 absmax per 256 values
PCIE3_X16 = 15.75e9               # bytes/s each way, theoretical (FACTS.md, "T4")


class PagingError(ValueError):
    """Bad input to the simulator: a parameter out of range or a trace that makes no sense (lesson 4)."""


class OutOfDeviceMemory(RuntimeError):
    """The simulated step does not fit: ordinary allocations (or one parameter's paged state)
    exceed the device memory even after every evictable chunk has left (lesson 4, "why it still
    OOMs")."""

    def __init__(self, message: str, *, step: int, phase: str, name: str, requested: int,
                 available: int) -> None:
        super().__init__(message)
        self.step, self.phase, self.name = step, phase, name
        self.requested, self.available = requested, available


def _positive(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise PagingError(f"{name} must be a positive finite number, got {value!r}")


# --------------------------------------------------------------------------------------------
# Hardware and policy
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Hardware:
    """A GPU and its host link, as the simulator sees them (lesson 4, "the simulator").

    `memory` is what the process can use (the GPU's total minus the CUDA context). Bandwidths are
    effective bytes per second: `h2d_bandwidth` of a unified-memory migration (prefetch or fault),
    `d2h_bandwidth` of an eviction, `pinned_bandwidth` of a `cudaMemcpy` from pinned memory (manual
    offload). `cpu_adam_rate` is parameters per second of a fused AdamW step on the host.
    """

    name: str
    memory: int
    h2d_bandwidth: float
    d2h_bandwidth: float
    device_bandwidth: float
    device_flops: float
    fault_latency: float = 20e-6
    pinned_bandwidth: float = 0.8 * PCIE3_X16
    cpu_adam_rate: float = 5e8
    link_bandwidth: float = PCIE3_X16

    def __post_init__(self) -> None:
        if not isinstance(self.memory, (int, np.integer)) or isinstance(self.memory, bool) or self.memory <= 0:
            raise PagingError(f"memory must be a positive number of bytes, got {self.memory!r}")
        for name in ("h2d_bandwidth", "d2h_bandwidth", "device_bandwidth", "device_flops",
                     "pinned_bandwidth", "cpu_adam_rate", "link_bandwidth"):
            _positive(name, getattr(self, name))
        if not isinstance(self.fault_latency, (int, float)) or not math.isfinite(self.fault_latency) \
                or self.fault_latency < 0:
            raise PagingError(f"fault_latency must be a non-negative number of seconds, got {self.fault_latency!r}")

    @classmethod
    def t4(cls, context: int = 500 * MiB, prefetch_efficiency: float = 0.5) -> Hardware:
        """A T4 on Colab: 15360 MiB shown, minus the CUDA context (300 to 700 MB); 320 GB/s GDDR6;
        PCIe 3.0 x16 (15.75 GB/s each way), unified-memory transfers at about half of it
        (bitsandbytes' docs). Assumed, not from FACTS.md: 25 TFLOP/s achieved fp16 (65 peak),
        20 us per fault, pinned copies at 80% of the link."""
        _positive("prefetch_efficiency", prefetch_efficiency)
        return cls(name="T4 (PCIe 3.0 x16)", memory=15360 * MiB - context,
                   h2d_bandwidth=prefetch_efficiency * PCIE3_X16,
                   d2h_bandwidth=prefetch_efficiency * PCIE3_X16,
                   device_bandwidth=320e9, device_flops=25e12)

    @classmethod
    def pcie3_x16(cls, memory: int = 16 * GiB, link_bandwidth: float = 16e9,
                  prefetch_efficiency: float = 0.5) -> Hardware:
        """The setting of bitsandbytes' documented estimate: PCIe 3.0 x16 "at 16 GB/s", unified
        memory at half of it, so 1 GB evicted per step costs 1/(16*0.5) s = 125 ms."""
        return cls(name="PCIe 3.0 x16 (bitsandbytes' estimate)", memory=memory,
                   h2d_bandwidth=prefetch_efficiency * link_bandwidth,
                   d2h_bandwidth=prefetch_efficiency * link_bandwidth,
                   device_bandwidth=320e9, device_flops=25e12, link_bandwidth=link_bandwidth,
                   pinned_bandwidth=0.8 * link_bandwidth)

    def with_memory(self, memory: int) -> Hardware:
        return replace(self, memory=int(memory))

    def scaled_link(self, factor: float) -> Hardware:
        """The same GPU behind a link `factor` times as fast (all host transfers scale)."""
        _positive("factor", factor)
        return replace(self, h2d_bandwidth=self.h2d_bandwidth * factor,
                       d2h_bandwidth=self.d2h_bandwidth * factor,
                       pinned_bandwidth=self.pinned_bandwidth * factor,
                       link_bandwidth=self.link_bandwidth * factor)


@dataclass(frozen=True)
class Policy:
    """How the driver moves managed memory (lesson 4, "4 KB and LRU?").

    `granularity`: bytes a fault migrates (4 KB pages, 64 KB big pages, 2 MB blocks).
    `eviction_unit`: bytes evicted at once (the driver: 2 MB root chunks).
    `eviction`: "allocation" (the driver: a chunk goes to the tail when made resident), "lru"
    (moved to the tail on every access: the seed's claim) or "mru" (evict the most recently used:
    what a cyclic trace wants). `density_prefetch`: the driver grows a fault's migration to the
    whole 2 MB block once more than `density_threshold` of it is resident.
    """

    granularity: int = 64 * KiB
    eviction_unit: int = ROOT_CHUNK
    eviction: str = "allocation"
    density_prefetch: bool = True
    density_threshold: float = 0.51

    def __post_init__(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise PagingError(f"granularity must be one of 4 KiB, 64 KiB, 2 MiB "
                              f"({GRANULARITIES}), got {self.granularity!r}")
        if self.eviction_unit not in GRANULARITIES:
            raise PagingError(f"eviction_unit must be one of {GRANULARITIES}, got {self.eviction_unit!r}")
        if self.eviction not in EVICTION_POLICIES:
            raise PagingError(f"eviction must be one of {EVICTION_POLICIES}, got {self.eviction!r}")
        if not 0 < self.density_threshold <= 1:
            raise PagingError(f"density_threshold must be in (0, 1], got {self.density_threshold!r}")

    @classmethod
    def driver(cls) -> Policy:
        """What nvidia-uvm does: 64 KB big pages, 2 MB density prefetch, 2 MB chunks in allocation order."""
        return cls()

    @classmethod
    def seed(cls) -> Policy:
        """The seed's model: 4 KB pages moved one by one, an LRU keeps hot pages resident."""
        return cls(granularity=4 * KiB, eviction_unit=4 * KiB, eviction="lru", density_prefetch=False)


# --------------------------------------------------------------------------------------------
# Traces
# --------------------------------------------------------------------------------------------

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


def alloc(name: str, nbytes: int, *, managed: bool = False, step: int = 0, phase: str = "") -> Event:
    """An allocation event: ordinary memory, or managed (paged) with `managed=True` (lesson 4)."""
    return Event("alloc", (name,), nbytes=int(nbytes), managed=managed, step=step, phase=phase)


def free(name: str, *, step: int = 0, phase: str = "") -> Event:
    """A free event (lesson 4)."""
    return Event("free", (name,), step=step, phase=phase)


def touch(*names: str, step: int = 0, phase: str = "") -> Event:
    """A kernel reading or writing `names`; absent managed memory faults in (lesson 4)."""
    return Event("touch", tuple(names), step=step, phase=phase)


def prefetch(*names: str, step: int = 0, phase: str = "") -> Event:
    """`cudaMemPrefetchAsync` of the managed `names` to the GPU (lesson 4)."""
    return Event("prefetch", tuple(names), step=step, phase=phase)


def compute(*, flops: float = 0.0, device_bytes: float = 0.0, step: int = 0, phase: str = "",
            label: str = "") -> Event:
    """GPU work: its time is the larger of flops / device_flops and bytes / device_bandwidth (lesson 4)."""
    return Event("compute", (), flops=float(flops), device_bytes=float(device_bytes), step=step,
                 phase=phase, label=label)


def empty_cache(*, step: int = 0, phase: str = "") -> Event:
    """`torch.cuda.empty_cache()`: the caching allocator returns its free blocks (lesson 4)."""
    return Event("empty_cache", (), step=step, phase=phase)


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor: its name, element count, the layer it belongs to, whether it trains,
    and its bytes per element (lesson 4)."""

    name: str
    numel: int
    layer: int = 0
    trainable: bool = True
    dtype_bytes: int = 4


def transformer_params(n_layers: int, hidden: int, vocab: int, *, intermediate: int | None = None,
                       lora_rank: int | None = None, frozen_dtype_bytes: int = 2) -> list[ParamSpec]:
    """The parameter tensors of a GPT-2-shaped decoder (tied embeddings), computed from its shape
    (lesson 4). With `lora_rank`, the base weights are frozen (`frozen_dtype_bytes` each) and each
    layer gets trainable fp32 LoRA factors on its attention projection (peft's default target)."""
    for name, value in (("n_layers", n_layers), ("hidden", hidden), ("vocab", vocab)):
        if not isinstance(value, int) or value <= 0:
            raise PagingError(f"{name} must be a positive integer, got {value!r}")
    inter = intermediate or 4 * hidden
    frozen = lora_rank is not None
    base = {"trainable": not frozen, "dtype_bytes": frozen_dtype_bytes if frozen else 4}
    specs = [ParamSpec("wte", vocab * hidden, 0, **base), ParamSpec("wpe", 1024 * hidden, 0, **base)]
    for layer in range(n_layers):
        prefix = f"h.{layer}"
        shapes = [("ln_1.weight", hidden), ("ln_1.bias", hidden),
                  ("attn.c_attn.weight", hidden * 3 * hidden), ("attn.c_attn.bias", 3 * hidden),
                  ("attn.c_proj.weight", hidden * hidden), ("attn.c_proj.bias", hidden),
                  ("ln_2.weight", hidden), ("ln_2.bias", hidden),
                  ("mlp.c_fc.weight", hidden * inter), ("mlp.c_fc.bias", inter),
                  ("mlp.c_proj.weight", inter * hidden), ("mlp.c_proj.bias", hidden)]
        specs += [ParamSpec(f"{prefix}.{n}", k, layer, **base) for n, k in shapes]
        if frozen:
            specs += [ParamSpec(f"{prefix}.attn.c_attn.lora_A", lora_rank * hidden, layer),
                      ParamSpec(f"{prefix}.attn.c_attn.lora_B", 3 * hidden * lora_rank, layer)]
    specs += [ParamSpec("ln_f.weight", hidden, n_layers - 1, **base),
              ParamSpec("ln_f.bias", hidden, n_layers - 1, **base)]
    return specs


def params_from_module(module) -> list[ParamSpec]:
    """ParamSpecs read from a torch module's `named_parameters()`, also on the meta device (lesson 4).

    The layer of a parameter is the first integer in its name ("h.3.mlp..." is layer 3);
    parameters without one join the layer of the parameter before them (layer 0 at the start).
    """
    specs, layer = [], 0
    for name, p in module.named_parameters():
        match = re.search(r"\.(\d+)\.", f".{name}.")
        if match:
            layer = int(match.group(1))
        specs.append(ParamSpec(name, int(p.numel()), layer, bool(p.requires_grad), p.element_size()))
    if not specs:
        raise PagingError("the module has no parameters")
    return specs


def activation_bytes_per_token(hidden: int, n_layers: int, bytes_per_value: int = 2) -> int:
    """Activations saved for backward per token: Korthikanti et al. 2022's 34*h bytes per layer in
    16-bit with flash attention (no s^2 term); FACTS.md warns that real layers store 60 to 114 sbh,
    so calibrate with the planner or a measurement (lesson 4)."""
    return int(34 * hidden * n_layers * bytes_per_value // 2)


@dataclass(frozen=True)
class StateTensor:
    """One optimizer state tensor of a parameter: name, bytes, paged or not (lesson 4)."""

    name: str
    nbytes: int
    managed: bool


def optimizer_state(spec: ParamSpec, optimizer: str) -> list[StateTensor]:
    """The state tensors an optimizer allocates for one parameter, as bitsandbytes and torch do
    (lesson 4; FACTS.md, "Adam memory arithmetic")."""
    if optimizer not in OPTIMIZERS:
        raise PagingError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    n = spec.numel
    if optimizer == "adamw":  # torch: exp_avg, exp_avg_sq in the parameter's dtype
        return [StateTensor(f"exp_avg:{spec.name}", n * spec.dtype_bytes, False),
                StateTensor(f"exp_avg_sq:{spec.name}", n * spec.dtype_bytes, False)]
    paged = optimizer.startswith("paged") and n >= BNB_PAGED_MIN_NUMEL
    eight_bit = optimizer.endswith("8bit") and n >= BNB_MIN_8BIT_SIZE
    if eight_bit:
        blocks = math.ceil(n / BNB_BLOCKSIZE) * 4
        return [StateTensor(f"state1:{spec.name}", n, paged), StateTensor(f"state2:{spec.name}", n, paged),
                StateTensor(f"absmax1:{spec.name}", blocks, False),
                StateTensor(f"absmax2:{spec.name}", blocks, False)]
    return [StateTensor(f"state1:{spec.name}", 4 * n, paged), StateTensor(f"state2:{spec.name}", 4 * n, paged)]


@dataclass(frozen=True)
class TrainingSetup:
    """What one training step holds (lesson 4): the parameters, the optimizer, bytes of a gradient
    per element, activations per token, and FLOPs per token (default 6 per parameter).

    The lesson-1 planner (`course_lib.memory`) can supply `activation_bytes_per_token` (and the
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
        return {"weights": sum(p.numel * p.dtype_bytes for p in self.params),
                "gradients": sum(p.numel * self.grad_bytes for p in self.params if p.trainable),
                "optimizer state (paged)": sum(s.nbytes for s in state if s.managed),
                "optimizer state (ordinary)": sum(s.nbytes for s in state if not s.managed),
                "activations": self.activation_bytes_per_token * tokens}


def training_trace(setup: TrainingSetup, tokens_per_step: Sequence[int], *,
                   empty_cache_after: Iterable[int] = (), use_prefetch: bool = True) -> list[Event]:
    """The memory events of `len(tokens_per_step)` training steps (lesson 4, "a trace").

    Step 0 allocates the weights. Each step: forward allocates each layer's activations; backward
    allocates each layer's gradients and frees its activations; the optimizer walks the trainable
    parameters in order and, like bitsandbytes, allocates state lazily (first step; paged state is
    filled by a kernel, which populates it on the GPU), prefetches the paged state, then updates
    (touch + compute); `zero_grad(set_to_none=True)` frees the gradients. torch's AdamW allocates
    every state tensor first and then updates (foreach). `empty_cache_after` lists the steps after
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
        if setup.optimizer == "adamw" and step == 0:
            for spec in trainable:
                for s in states[spec.name]:
                    events.append(alloc(s.name, s.nbytes, **kw))
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
        for spec in trainable:
            events.append(free(f"grad:{spec.name}", **kw))
        if step in flush:
            events.append(empty_cache(**kw))
    return events


# --------------------------------------------------------------------------------------------
# The simulator
# --------------------------------------------------------------------------------------------

@dataclass
class PhaseStats:
    """Time (seconds) and traffic (bytes) of one phase of one step (lesson 4)."""

    compute: float = 0.0
    h2d_time: float = 0.0
    d2h_time: float = 0.0
    fault_time: float = 0.0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    populated_bytes: int = 0
    faults: int = 0

    @property
    def total(self) -> float:
        return self.compute + self.h2d_time + self.d2h_time + self.fault_time

    def add(self, other: PhaseStats) -> None:
        for name in ("compute", "h2d_time", "d2h_time", "fault_time", "h2d_bytes", "d2h_bytes",
                     "populated_bytes", "faults"):
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass(frozen=True)
class Segment:
    """One bar of the timeline (lesson 4): [start, end) seconds in `lane` (compute, H2D, D2H, faults)."""

    start: float
    end: float
    lane: str
    step: int
    phase: str
    label: str
    nbytes: int = 0


@dataclass
class SimulationResult:
    """What `simulate` measured (lesson 4). Times in seconds, traffic in bytes."""

    hardware: Hardware
    policy: Policy
    phases: dict[tuple[int, str], PhaseStats]
    timeline: list[Segment]
    oom: OutOfDeviceMemory | None
    bytes_in: int               # migrated host to device
    bytes_populated: int        # first-touched on the device (no transfer)
    bytes_out: int              # evicted device to host
    resident_bytes: int         # managed bytes on the device at the end
    freed_resident_bytes: int   # managed bytes freed while on the device
    peak_used: int              # most device memory in use (reserved + resident managed)
    peak_reserved: int
    steps_completed: int

    @property
    def steps(self) -> list[int]:
        return sorted({step for step, _ in self.phases})

    def step_stats(self, step: int) -> PhaseStats:
        total = PhaseStats()
        for (s, _), stats in self.phases.items():
            if s == step:
                total.add(stats)
        return total

    def step_time(self, step: int) -> float:
        return self.step_stats(step).total

    def slowdown(self, step: int) -> float:
        """Step time over its compute time: 1.0 when paging costs nothing."""
        stats = self.step_stats(step)
        return stats.total / stats.compute if stats.compute else 1.0

    def conservation_error(self) -> int:
        """bytes in (migrated + populated) - (bytes out + resident + freed while resident): 0."""
        return (self.bytes_in + self.bytes_populated
                - self.bytes_out - self.resident_bytes - self.freed_resident_bytes)

    def table(self) -> str:
        """One line per step: time, compute, paging traffic and slowdown."""
        lines = [f"{'step':>4} {'time ms':>9} {'compute ms':>10} {'in (H2D)':>11} {'out (D2H)':>11} "
                 f"{'faults':>7} {'slowdown':>8}"]
        for step in self.steps:
            st = self.step_stats(step)
            lines.append(f"{step:>4} {1e3 * st.total:>9.1f} {1e3 * st.compute:>10.1f} "
                         f"{format_bytes(st.h2d_bytes):>11} {format_bytes(st.d2h_bytes):>11} "
                         f"{st.faults:>7} {self.slowdown(step):>7.2f}x")
        if self.oom is not None:
            lines.append(f"OUT OF MEMORY in step {self.oom.step} ({self.oom.phase}): {self.oom}")
        return "\n".join(lines)


class _Managed:
    """Residency of one managed allocation, one entry per eviction unit."""

    __slots__ = ("name", "nbytes", "unit_bytes", "resident", "populated", "stamp", "offsets")

    def __init__(self, name: str, nbytes: int, unit: int) -> None:
        n = max(1, -(-nbytes // unit))
        self.name, self.nbytes = name, nbytes
        self.unit_bytes = np.full(n, unit, dtype=np.int64)
        self.unit_bytes[-1] = nbytes - unit * (n - 1)
        self.offsets = np.arange(n, dtype=np.int64) * unit
        self.resident = np.zeros(n, dtype=bool)
        self.populated = np.zeros(n, dtype=bool)
        self.stamp = np.full(n, -1, dtype=np.int64)


class _Simulator:
    def __init__(self, hardware: Hardware, policy: Policy, caching_allocator: bool, record_timeline: bool):
        if hardware.memory < policy.eviction_unit or hardware.memory < policy.granularity:
            raise PagingError(f"device memory ({format_bytes(hardware.memory)}) is smaller than one page "
                              f"({format_bytes(max(policy.eviction_unit, policy.granularity))})")
        self.hw, self.policy = hardware, policy
        self.caching = caching_allocator
        self.record = record_timeline
        self.device: dict[str, int] = {}
        self.managed: dict[str, _Managed] = {}
        self.live = 0
        self.reserved = 0
        self.resident = 0
        self.clock = 0.0
        self.counter = 0
        self.heap: list[tuple[int, int, str, int]] = []   # (key, seq, name, stamp)
        self.phases: dict[tuple[int, str], PhaseStats] = {}
        self.timeline: list[Segment] = []
        self.totals = {"in": 0, "populated": 0, "out": 0, "freed": 0}
        self.peak_used = 0
        self.peak_reserved = 0

    # ---- bookkeeping -------------------------------------------------------------------
    def _stats(self, event: Event) -> PhaseStats:
        key = (event.step, event.phase)
        if key not in self.phases:
            self.phases[key] = PhaseStats()
        return self.phases[key]

    def _segment(self, event: Event, lane: str, seconds: float, label: str, nbytes: int = 0) -> None:
        if seconds <= 0:
            return
        if self.record:
            self.timeline.append(Segment(self.clock, self.clock + seconds, lane, event.step, event.phase,
                                         label, nbytes))
        self.clock += seconds

    def _track_peak(self) -> None:
        self.peak_used = max(self.peak_used, self.reserved + self.resident)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def _oom(self, event: Event, name: str, requested: int, available: int, why: str) -> OutOfDeviceMemory:
        return OutOfDeviceMemory(
            f"step {event.step}, {event.phase or 'no phase'}: {name} needs {format_bytes(requested)} "
            f"but only {format_bytes(available)} of {format_bytes(self.hw.memory)} can be freed ({why})",
            step=event.step, phase=event.phase, name=name, requested=requested, available=available)

    def _unknown(self, index: int, event: Event, name: str) -> PagingError:
        known = sorted(self.device) + sorted(self.managed)
        hint = f" (allocated: {', '.join(known[:6])}{', ...' if len(known) > 6 else ''})" if known else \
            " (nothing is allocated yet)"
        return PagingError(f"event {index} ({event.op}, step {event.step}, {event.phase or 'no phase'}) "
                           f"uses {name!r}, which is not allocated{hint}")

    # ---- eviction ----------------------------------------------------------------------
    def _push_run(self, tensor: _Managed, stamp: int) -> None:
        key = -stamp if self.policy.eviction == "mru" else stamp
        heapq.heappush(self.heap, (key, stamp, tensor.name, stamp))

    def _evict(self, need: int, protected: set[str], event: Event) -> int:
        """Evict at least `need` bytes of managed memory not in `protected`; return bytes evicted."""
        evicted, stash = 0, []
        newest_first = self.policy.eviction == "mru"
        while evicted < need and self.heap:
            run = heapq.heappop(self.heap)
            _, _, name, stamp = run
            tensor = self.managed.get(name)
            if tensor is None:
                continue
            mask = tensor.resident & (tensor.stamp == stamp)
            if not mask.any():
                continue
            if name in protected:
                stash.append(run)
                continue
            idx = np.flatnonzero(mask)
            if newest_first:
                idx = idx[::-1]
            sizes = tensor.unit_bytes[idx]
            cum = np.cumsum(sizes)
            take = int(np.searchsorted(cum, need - evicted, side="left")) + 1
            take = min(take, len(idx))
            chosen = idx[:take]
            tensor.resident[chosen] = False
            nbytes = int(cum[take - 1])
            evicted += nbytes
            if take < len(idx):
                heapq.heappush(self.heap, run)
        for run in stash:
            heapq.heappush(self.heap, run)
        if evicted:
            self.resident -= evicted
            self.totals["out"] += evicted
            stats = self._stats(event)
            stats.d2h_bytes += evicted
            seconds = evicted / self.hw.d2h_bandwidth
            stats.d2h_time += seconds
            self._segment(event, "D2H", seconds, "evict", evicted)
        return evicted

    def _make_room(self, nbytes: int, protected: set[str], event: Event, name: str) -> None:
        free_bytes = self.hw.memory - self.reserved - self.resident
        if nbytes <= free_bytes:
            return
        evictable = self.resident - sum(int(self.managed[n].unit_bytes[self.managed[n].resident].sum())
                                        for n in protected if n in self.managed)
        if nbytes > free_bytes + evictable:
            raise self._oom(event, name, nbytes, free_bytes + evictable,
                            "paged state cannot make room for itself: it would thrash inside one kernel")
        self._evict(nbytes - free_bytes, protected, event)

    # ---- events ------------------------------------------------------------------------
    def _alloc_device(self, index: int, event: Event) -> None:
        name, n = event.names[0], event.nbytes
        cached_free = self.reserved - self.live
        grow = max(0, n - cached_free) if self.caching else n
        if self.reserved + grow > self.hw.memory and self.caching:
            # cudaMalloc failed: PyTorch frees its cached blocks and retries.
            self.reserved = self.live
            grow = n
        if self.reserved + grow > self.hw.memory:
            raise self._oom(event, name, n, self.hw.memory - self.reserved,
                            "ordinary allocations are never paged")
        overflow = self.reserved + grow + self.resident - self.hw.memory
        if overflow > 0:
            self._evict(overflow, set(), event)
        self.reserved += grow
        self.live += n
        self.device[name] = n
        self._track_peak()

    def _migrate(self, index: int, event: Event, faulting: bool) -> None:
        names = event.names
        tensors = []
        for name in names:
            if name in self.managed:
                tensors.append(self.managed[name])
            elif name in self.device:
                if not faulting:
                    raise PagingError(f"event {index} (prefetch, step {event.step}): {name!r} is an ordinary "
                                      "allocation; cudaMemPrefetchAsync needs managed memory")
            else:
                raise self._unknown(index, event, name)
        protected = {t.name for t in tensors}
        need = sum(int(t.unit_bytes[~t.resident].sum()) for t in tensors)
        if need:
            self._make_room(need, protected, event, " + ".join(t.name for t in tensors))
        stats = self._stats(event)
        policy = self.policy
        for tensor in tensors:
            missing = ~tensor.resident
            self.counter += 1
            stamp = self.counter
            if missing.any():
                populated = missing & ~tensor.populated
                migrated = missing & tensor.populated
                pop_bytes = int(tensor.unit_bytes[populated].sum())
                mig_bytes = int(tensor.unit_bytes[migrated].sum())
                tensor.resident[missing] = True
                tensor.populated[missing] = True
                self.resident += pop_bytes + mig_bytes
                self.totals["populated"] += pop_bytes
                self.totals["in"] += mig_bytes
                stats.populated_bytes += pop_bytes
                if mig_bytes:
                    stats.h2d_bytes += mig_bytes
                    seconds = mig_bytes / self.hw.h2d_bandwidth
                    stats.h2d_time += seconds
                    if faulting:
                        faults = self._fault_count(tensor, migrated)
                        stats.faults += faults
                        fault_seconds = faults * self.hw.fault_latency
                        stats.fault_time += fault_seconds
                        self._segment(event, "faults", fault_seconds, f"{faults} faults {tensor.name}")
                    self._segment(event, "H2D", seconds,
                                  f"{'fault-in' if faulting else 'prefetch'} {tensor.name}", mig_bytes)
                if policy.eviction == "allocation":
                    tensor.stamp[missing] = stamp
                    self._push_run(tensor, stamp)
            if policy.eviction != "allocation":
                tensor.stamp[:] = stamp
                self._push_run(tensor, stamp)
        self._track_peak()

    def _fault_count(self, tensor: _Managed, migrated: np.ndarray) -> int:
        policy = self.policy
        blocks = tensor.offsets[migrated] // VA_BLOCK
        per_block = np.bincount(blocks, weights=tensor.unit_bytes[migrated])
        per_block = per_block[per_block > 0]
        faults = np.ceil(per_block / policy.granularity)
        if policy.density_prefetch:
            granules = VA_BLOCK // policy.granularity
            faults = np.minimum(faults, math.floor(policy.density_threshold * granules) + 1)
        return int(faults.sum())

    def run(self, events: Sequence[Event]) -> OutOfDeviceMemory | None:
        for index, event in enumerate(events):
            if not isinstance(event, Event):
                raise PagingError(f"event {index} is {type(event).__name__}, not a paging.Event")
            if event.op not in OPS:
                raise PagingError(f"event {index}: unknown op {event.op!r}; use one of {OPS}")
            try:
                self._apply(index, event)
            except OutOfDeviceMemory as oom:
                return oom
        return None

    def _apply(self, index: int, event: Event) -> None:
        op = event.op
        if op == "alloc":
            if len(event.names) != 1 or not event.names[0]:
                raise PagingError(f"event {index}: alloc needs exactly one name")
            name = event.names[0]
            if name in self.device or name in self.managed:
                raise PagingError(f"event {index}: {name!r} is allocated twice (free it first)")
            if not isinstance(event.nbytes, (int, np.integer)) or event.nbytes <= 0:
                raise PagingError(f"event {index}: alloc of {name!r} needs a positive byte count, "
                                  f"got {event.nbytes!r}")
            if event.managed:
                self.managed[name] = _Managed(name, int(event.nbytes), self.policy.eviction_unit)
            else:
                self._alloc_device(index, event)
        elif op == "free":
            name = event.names[0] if event.names else ""
            if name in self.device:
                n = self.device.pop(name)
                self.live -= n
                if not self.caching:
                    self.reserved -= n
            elif name in self.managed:
                tensor = self.managed.pop(name)
                nbytes = int(tensor.unit_bytes[tensor.resident].sum())
                self.resident -= nbytes
                self.totals["freed"] += nbytes
            else:
                raise self._unknown(index, event, name)
        elif op in ("touch", "prefetch"):
            if not event.names:
                raise PagingError(f"event {index}: {op} needs at least one name")
            self._migrate(index, event, faulting=(op == "touch"))
        elif op == "compute":
            if event.flops < 0 or event.device_bytes < 0:
                raise PagingError(f"event {index}: compute needs non-negative flops and device_bytes")
            seconds = max(event.flops / self.hw.device_flops, event.device_bytes / self.hw.device_bandwidth)
            self._stats(event).compute += seconds
            self._segment(event, "compute", seconds, event.label or "compute")
        elif op == "empty_cache":
            self.reserved = self.live


def simulate(trace: Sequence[Event], hardware: Hardware | None = None, policy: Policy | None = None, *,
             caching_allocator: bool = True, record_timeline: bool = True) -> SimulationResult:
    """Run a trace on a simulated GPU with unified memory (lesson 4, "the simulator").

    Raises `PagingError` for bad input (device smaller than one page, a trace that uses memory it
    never allocated). A step that does not fit stops the run: the result's `oom` says where.
    `caching_allocator=False` returns every freed block to the driver at once (no reserve).
    """
    hardware = hardware or Hardware.t4()
    policy = policy or Policy.driver()
    if not isinstance(hardware, Hardware):
        raise PagingError(f"hardware must be a paging.Hardware, got {type(hardware).__name__}")
    if not isinstance(policy, Policy):
        raise PagingError(f"policy must be a paging.Policy, got {type(policy).__name__}")
    trace = list(trace)
    sim = _Simulator(hardware, policy, caching_allocator, record_timeline)
    oom = sim.run(trace)
    completed = {e.step for e in trace} if oom is None else set(range(oom.step))
    for key in [k for k in sim.phases if oom is not None and k[0] >= oom.step]:
        del sim.phases[key]
    return SimulationResult(
        hardware=hardware, policy=policy, phases=sim.phases, timeline=sim.timeline, oom=oom,
        bytes_in=sim.totals["in"], bytes_populated=sim.totals["populated"], bytes_out=sim.totals["out"],
        resident_bytes=sim.resident, freed_resident_bytes=sim.totals["freed"],
        peak_used=sim.peak_used, peak_reserved=sim.peak_reserved, steps_completed=len(completed))


# --------------------------------------------------------------------------------------------
# Chunk traces: the exercise's small world
# --------------------------------------------------------------------------------------------

def chunk_trace(accesses: Sequence[int], n_chunks: int | None = None, chunk_bytes: int = ROOT_CHUNK,
                *, use_prefetch: bool = True) -> list[Event]:
    """A trace of managed chunks `0..n_chunks-1` (each `chunk_bytes`), accessed in the order given
    (lesson 4, exercise "allocation order vs LRU"). Each access is a prefetch (or a touch)."""
    accesses = [int(a) for a in accesses]
    n_chunks = n_chunks if n_chunks is not None else (max(accesses) + 1 if accesses else 0)
    events = [alloc(f"chunk{i}", chunk_bytes, managed=True) for i in range(n_chunks)]
    make = prefetch if use_prefetch else touch
    events += [make(f"chunk{a}", phase="optimizer") for a in accesses]
    return events


def chunk_migrations(accesses: Sequence[int], capacity_chunks: int, policy: str = "allocation",
                     chunk_bytes: int = ROOT_CHUNK) -> tuple[int, int]:
    """(bytes migrated in, bytes evicted) of a chunk access sequence on a device holding
    `capacity_chunks` chunks, by the simulator (lesson 4: what the exercise's answer must match). The first
    access of a chunk populates it on the device (no transfer): only re-fetches count as migrated."""
    if capacity_chunks < 1:
        raise PagingError(f"capacity must be at least one chunk, got {capacity_chunks}")
    hw = Hardware.t4().with_memory(capacity_chunks * chunk_bytes)
    pol = Policy(eviction_unit=chunk_bytes, eviction=policy)
    result = simulate(chunk_trace(accesses, chunk_bytes=chunk_bytes), hw, pol, record_timeline=False)
    return result.bytes_in, result.bytes_out


# --------------------------------------------------------------------------------------------
# Manual offload (torchao's CPUOffloadOptimizer, modelled)
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class OffloadResult:
    """One step with the optimizer on the CPU (lesson 4, "manual offload"). Seconds and bytes."""

    compute: float
    grad_copy_exposed: float
    cpu_step: float
    param_copy_exposed: float
    device_peak: int
    fits: bool

    @property
    def total(self) -> float:
        return self.compute + self.grad_copy_exposed + self.cpu_step + self.param_copy_exposed

    @property
    def slowdown(self) -> float:
        return self.total / self.compute if self.compute else 1.0


def simulate_offload(setup: TrainingSetup, tokens: int, hardware: Hardware | None = None, *,
                     offload_gradients: bool = True) -> OffloadResult:
    """A step of whole-tensor CPU offload of the optimizer (lesson 4), as torchao's `CPUOffloadOptimizer` does
    it: gradients copied to pinned host memory in post-accumulate-grad hooks (overlapping the rest
    of backward), the AdamW step on the CPU, parameters copied back (overlapping the next
    parameter's CPU step). The cost is paid every step, whether memory is short or not."""
    hw = hardware or Hardware.t4()
    cat = setup.bytes_by_category(tokens)
    trainable = [p for p in setup.params if p.trainable]
    flops_per_token = setup.flops_per_token if setup.flops_per_token is not None else 6.0 * setup.n_params
    forward = flops_per_token * tokens / 3 / hw.device_flops
    backward = 2 * forward
    grad_bytes = sum(p.numel * setup.grad_bytes for p in trainable)
    param_bytes = sum(p.numel * p.dtype_bytes for p in trainable)
    grad_copy = grad_bytes / hw.pinned_bandwidth
    exposed_grad = max(0.0, grad_copy - backward * (1 - 1 / max(1, setup.n_layers)))
    cpu_step = sum(p.numel for p in trainable) / hw.cpu_adam_rate
    largest = max((p.numel * p.dtype_bytes for p in trainable), default=0)
    exposed_param = max(0.0, param_bytes / hw.pinned_bandwidth - cpu_step) + largest / hw.pinned_bandwidth
    grads_on_device = 0 if offload_gradients else cat["gradients"]
    # With offloaded gradients, at most about one layer's gradients wait on the device for their copy.
    if offload_gradients:
        per_layer = [sum(p.numel for p in trainable if p.layer == layer) for layer in range(setup.n_layers)]
        grads_on_device = max(per_layer, default=0) * setup.grad_bytes
    peak = cat["weights"] + grads_on_device + cat["activations"]
    return OffloadResult(compute=forward + backward, grad_copy_exposed=exposed_grad, cpu_step=cpu_step,
                         param_copy_exposed=exposed_param, device_peak=peak, fits=peak <= hw.memory)


# --------------------------------------------------------------------------------------------
# The lesson's scenarios
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RegimeResult:
    """One regime: the paged run, the unpaged run of the same steps, and what they say (lesson 4)."""

    name: str
    paged: SimulationResult
    unpaged: SimulationResult
    setup: TrainingSetup
    tokens_per_step: tuple[int, ...]

    @property
    def worst_slowdown(self) -> float:
        return max(self.paged.slowdown(s) for s in self.paged.steps)

    @property
    def steady_slowdown(self) -> float:
        return self.paged.slowdown(self.paged.steps[-1])

    def summary(self) -> str:
        unpaged = ("runs out of memory in step "
                   f"{self.unpaged.oom.step}" if self.unpaged.oom else "fits")
        paged = "runs out of memory" if self.paged.oom else "completes"
        traffic = sum(self.paged.step_stats(s).h2d_bytes + self.paged.step_stats(s).d2h_bytes
                      for s in self.paged.steps)
        return (f"{self.name}: paged {paged}, worst step {self.worst_slowdown:.2f}x, last step "
                f"{self.steady_slowdown:.2f}x, paging traffic {format_bytes(traffic)}; unpaged {unpaged}")


def lesson_model(n_layers: int, hidden: int = 2048, vocab: int = 50257, **kw) -> list[ParamSpec]:
    """The decoder the lesson scales: GPT-2 shapes, `hidden` wide, `n_layers` deep."""
    return transformer_params(n_layers, hidden, vocab, **kw)


def regimes(hardware: Hardware | None = None, policy: Policy | None = None, *, steps: int = 4,
            tokens: int = 2048) -> dict[str, RegimeResult]:
    """The three regimes of lesson 4 on a T4-sized device (hardware defaults to `Hardware.t4()`):

    - "fits": a 0.6B-parameter model with paged 32-bit AdamW: nothing moves, slowdown 1.0;
    - "spike": the same model, one batch 6x longer: the paged run evicts state and survives, the
      unpaged run runs out of memory; the allocator keeps the spike's memory reserved, so the
      steps after it keep paging until `empty_cache` (run at the end of the spike step here);
    - "thrashing": a 1.1B-parameter model whose paged state does not fit: every step moves the
      whole state out and back, a several-fold slowdown.
    """
    hw = hardware or Hardware.t4()
    act = activation_bytes_per_token(2048, 1)  # per layer; scaled by depth below

    def setup(layers: int) -> TrainingSetup:
        return TrainingSetup(tuple(lesson_model(layers)), "paged_adamw_32bit",
                             activation_bytes_per_token=act * layers)

    out = {}
    cases = [("fits", 10, [tokens] * steps, ()),
             ("spike", 10, [tokens] * (steps // 2) + [6 * tokens] + [tokens] * (steps - steps // 2 - 1),
              (steps // 2,)),
             ("thrashing", 20, [tokens] * steps, ())]
    for name, layers, per_step, flush in cases:
        s = setup(layers)
        paged = simulate(training_trace(s, per_step, empty_cache_after=flush), hw, policy)
        unpaged = simulate(training_trace(s.with_optimizer("adamw"), per_step, empty_cache_after=flush),
                           hw, policy, record_timeline=False)
        out[name] = RegimeResult(name, paged, unpaged, s, tuple(per_step))
    return out


def evicted_per_step_cost(gigabytes: float = 1.0, hardware: Hardware | None = None,
                          policy: Policy | None = None, steps: int = 3) -> dict[str, float]:
    """Simulate a step that evicts `gigabytes` GB of paged state and brings it back (lesson 4,
    "125 ms per GB"): a model whose 32-bit paged state is `gigabytes` GB, on a device just too
    small for it, so every step moves it all. Returns the steady step's evicted GB and milliseconds
    per evicted GB of migrating it back (what bitsandbytes' estimate counts), of evicting it, and
    of both."""
    _positive("gigabytes", gigabytes)
    hw = hardware or Hardware.pcie3_x16()
    n_params = int(gigabytes * GB / 8)
    per_tensor = 4 * 2**20
    count = max(1, n_params // per_tensor)
    params = [ParamSpec(f"w{i}", n_params // count + (1 if i < n_params % count else 0), i) for i in range(count)]
    setup = TrainingSetup(tuple(params), "paged_adamw_32bit", activation_bytes_per_token=0)
    cat = setup.bytes_by_category()
    memory = cat["weights"] + cat["gradients"] + cat["optimizer state (paged)"] - 64 * MiB
    result = simulate(training_trace(setup, [1] * steps), hw.with_memory(memory), policy,
                      record_timeline=False)
    if result.oom is not None:
        raise result.oom
    last = result.step_stats(result.steps[-1])
    evicted = last.d2h_bytes / GB
    return {"evicted_gb": evicted, "ms_per_gb_in": 1e3 * last.h2d_time / evicted,
            "ms_per_gb_out": 1e3 * last.d2h_time / evicted,
            "ms_per_gb_total": 1e3 * (last.h2d_time + last.d2h_time + last.fault_time) / evicted,
            "bnb_estimate_ms_per_gb": 1e3 * GB / hw.h2d_bandwidth}


@dataclass(frozen=True)
class StrategyRow:
    """One model size under each way of handling optimizer state (lesson 4, "paging vs ...")."""

    n_params: int
    unpaged_fits: bool
    slowdown: dict[str, float | None]   # None: runs out of memory


def compare_strategies(layer_counts: Sequence[int] = (8, 12, 16, 20, 24, 28), hardware: Hardware | None = None,
                       tokens: int = 2048, steps: int = 3, lora_rank: int = 16) -> list[StrategyRow]:
    """Steady-step slowdown of paged 32-bit AdamW, paged 8-bit AdamW, manual CPU offload and LoRA
    (rank `lora_rank`, paged 32-bit state) for the lesson's decoder at several depths."""
    hw = hardware or Hardware.t4()
    act = activation_bytes_per_token(2048, 1)
    rows = []
    for layers in layer_counts:
        full = TrainingSetup(tuple(lesson_model(layers)), "paged_adamw_32bit", act * layers)
        lora = TrainingSetup(tuple(lesson_model(layers, lora_rank=lora_rank)), "paged_adamw_32bit", act * layers)
        slow: dict[str, float | None] = {}
        for label, setup in (("paged 32-bit", full), ("paged 8-bit", full.with_optimizer("paged_adamw_8bit")),
                             ("LoRA", lora)):
            result = simulate(training_trace(setup, [tokens] * steps), hw, record_timeline=False)
            slow[label] = None if result.oom else result.slowdown(result.steps[-1])
        offload = simulate_offload(full, tokens, hw)
        slow["CPU offload"] = offload.slowdown if offload.fits else None
        unpaged = simulate(training_trace(full.with_optimizer("adamw"), [tokens] * 2), hw, record_timeline=False)
        rows.append(StrategyRow(full.n_params, unpaged.oom is None, slow))
    return rows


def bnb_estimate_ms(evicted_gb: float, link_gb_per_s: float = 16.0, efficiency: float = 0.5) -> float:
    """bitsandbytes' documented estimate (lesson 4): evicting `evicted_gb` GB per step costs
    evicted_gb / (link * efficiency) seconds (1 GB on PCIe 3.0 x16: 125 ms)."""
    _positive("link_gb_per_s", link_gb_per_s)
    _positive("efficiency", efficiency)
    if evicted_gb < 0:
        raise PagingError(f"evicted_gb must be >= 0, got {evicted_gb}")
    return 1e3 * evicted_gb / (link_gb_per_s * efficiency)


# --------------------------------------------------------------------------------------------
# A measured trace: which memory each operator of a real step touches
# --------------------------------------------------------------------------------------------

TOUCH_CATEGORIES = ("weights", "gradients", "optimizer state", "activations and temporaries")


@dataclass(frozen=True)
class Touch:
    """One operator of a measured step touching one storage: its number, phase and category (lesson 4)."""

    index: int
    phase: str
    category: str
    nbytes: int


def measure_touches(model, optimizer, loss_fn) -> list[Touch]:
    """Run one training step (forward, backward, `optimizer.step()`) and record, for every
    operator, the storages it reads or writes and what they are (lesson 4, "when is the state
    touched?"). Run a step first so that the optimizer's lazily created state exists."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    import itertools
    import weakref

    raw: list[tuple[int, str, int, int]] = []
    ids = itertools.count()
    live: dict[tuple[str, int], int] = {}   # address -> id of the storage living there now

    def uid(t) -> int:
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if key not in live:
            live[key] = next(ids)
            weakref.finalize(storage, live.pop, key, None)
        return live[key]

    class Recorder(TorchDispatchMode):
        phase = "forward"
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen = set()
            for t in tree_flatten((args, kwargs or {}, out))[0]:
                if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.untyped_storage().nbytes():
                    ident = uid(t)
                    if ident not in seen:
                        seen.add(ident)
                        raw.append((self.count, self.phase, ident, t.untyped_storage().nbytes()))
            self.count += 1
            return out

    optimizer.zero_grad(set_to_none=True)
    params = list(model.parameters())
    recorder = Recorder()
    with recorder:
        for p in params:  # storages alive before the step get their ids first
            uid(p)
        for st in optimizer.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    uid(v)
        loss = loss_fn()
        recorder.phase = "backward"
        loss.backward()
        recorder.phase = "optimizer"
        optimizer.step()
        weights = {uid(p) for p in params}
        grads = {uid(p.grad) for p in params if p.grad is not None}
        state = {uid(v) for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)}

    def category(ident: int) -> str:
        if ident in state:
            return "optimizer state"
        if ident in weights:
            return "weights"
        if ident in grads:
            return "gradients"
        return "activations and temporaries"
    return [Touch(index, phase, category(ident), nbytes) for index, phase, ident, nbytes in raw]


def touch_summary(touches: Sequence[Touch]) -> dict[str, dict[str, int]]:
    """Operators per phase that touch each category (lesson 4)."""
    table = {phase: {cat: 0 for cat in TOUCH_CATEGORIES} for phase in PHASES}
    ops = {(t.index, t.phase, t.category) for t in touches}
    for _, phase, cat in ops:
        table[phase][cat] += 1
    return table
