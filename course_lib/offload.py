"""Paged optimizers and manual offload on a real CUDA GPU (lesson 4, "the real thing").

- `CPUOffloadAdamW`: whole-tensor CPU offload of AdamW in the manner of torchao's
  `CPUOffloadOptimizer` (FACTS.md): gradients copied to pinned host memory in
  post-accumulate-grad hooks, the step on the CPU, parameters copied back. It runs on CPU too
  (there it is plain AdamW on fp32 copies), which is how it is tested.
- `VirtualGPU`: makes a big GPU behave like a small one: a balloon of ordinary memory leaves
  `capacity` bytes free (so unified memory is really short), and
  `torch.cuda.set_per_process_memory_fraction` caps PyTorch's allocator at the same point.
- `PrefetchTimeline`: records, per parameter, when bitsandbytes' prefetch and update ran.
- `paging_demo`: plain AdamW runs out of memory under the cap, bitsandbytes' PagedAdamW (32-bit and
  8-bit) completes; step times and memory (allocated, reserved, used as nvidia-smi shows it).

bitsandbytes never frees paged state (`cudaMallocManaged` without a `cudaFree`; the global page
manager keeps every buffer): `release_paged_state` moves it to the host so that it stops taking GPU
memory, but the host memory stays taken until the process ends.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from course_lib.checkpointing import mlp_stack
from course_lib.measure import GiB, MiB
from course_lib.paging import params_from_module, TrainingSetup

DEMO_OPTIMIZERS = ("adamw", "paged_adamw_32bit", "paged_adamw_8bit", "cpu_offload_adamw")


class CPUOffloadAdamW:
    """AdamW whose state (and an fp32 master copy of each parameter) lives in host memory
    (lesson 4, "manual offload").

    Each parameter's gradient is copied to a pinned host buffer as soon as backward has
    accumulated it (a post-accumulate-grad hook, on a side stream, overlapping the rest of
    backward); with `offload_gradients=True` the device gradient is freed at once. `step()` waits
    for each copy, runs a fused AdamW step on the host, and copies the parameter back
    asynchronously. GPU memory: weights (and activations) only; cost: the copies and the host step,
    paid every step. Gradient accumulation works (later backward passes add on the host).
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 *, offload_gradients: bool = True) -> None:
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("CPUOffloadAdamW got no parameters that require grad")
        if lr <= 0:
            raise ValueError(f"lr must be positive, got {lr}")
        self.offload_gradients = offload_gradients
        self.cuda = any(p.is_cuda for p in self.params)
        self.stream = torch.cuda.Stream() if self.cuda else None
        self.master: list[torch.nn.Parameter] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self.events: list[torch.cuda.Event | None] = [None] * len(self.params)
        self.ready = [False] * len(self.params)
        self.accumulated = [False] * len(self.params)
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._hooks = []
        for p in self.params:
            master = torch.nn.Parameter(torch.empty(p.shape, dtype=torch.float32, pin_memory=self.cuda))
            with torch.no_grad():
                master.copy_(p.detach())
            master.grad = torch.zeros(p.shape, dtype=torch.float32, pin_memory=self.cuda)
            self.master.append(master)
            self.optimizers.append(_host_adamw([master], lr, betas, eps, weight_decay))
            self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_ready))

    def _grad_ready(self, p: torch.Tensor) -> None:
        i = self._index[id(p)]
        self.ready[i] = True
        if not self.offload_gradients:
            return  # p.grad stays on the device and accumulates there; step() copies it
        grad, host = p.grad, self.master[i].grad
        if self.events[i] is not None:  # a later micro-batch: wait for the first copy, then add
            self.events[i].synchronize()
            self.events[i] = None
            host.add_(grad.detach().to("cpu", torch.float32))
        elif self.accumulated[i]:
            host.add_(grad.detach().to("cpu", torch.float32))
        elif self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                host.copy_(grad.detach(), non_blocking=True)
                grad.record_stream(self.stream)  # the block is not reused before the copy ends
                event = torch.cuda.Event()
                event.record(self.stream)
                self.events[i] = event
        else:
            host.copy_(grad.detach())
        self.accumulated[i] = True
        p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for i, p in enumerate(self.params):
            if not self.ready[i]:
                continue
            if self.events[i] is not None:
                self.events[i].synchronize()
                self.events[i] = None
            if not self.offload_gradients:
                self.master[i].grad.copy_(p.grad.detach())
            self.optimizers[i].step()
            if self.stream is not None:
                with torch.cuda.stream(self.stream):
                    p.copy_(self.master[i], non_blocking=True)
            else:
                p.copy_(self.master[i])
            self.ready[i] = self.accumulated[i] = False
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None if set_to_none else (p.grad.zero_() if p.grad is not None else None)

    def state_bytes(self) -> int:
        """Bytes of optimizer state on the host (exp_avg, exp_avg_sq, step counters)."""
        return sum(t.numel() * t.element_size() for opt in self.optimizers for state in opt.state.values()
                   for t in state.values() if isinstance(t, torch.Tensor))

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


def _host_adamw(params, lr, betas, eps, weight_decay) -> torch.optim.Optimizer:
    try:
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)
    except (RuntimeError, TypeError, ValueError):  # an older torch without fused CPU AdamW
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def make_optimizer(name: str, params: Sequence[torch.nn.Parameter], lr: float = 1e-4):
    """The optimizers the lesson compares, by name: "adamw" (torch), "paged_adamw_32bit",
    "paged_adamw_8bit", "adamw_8bit" (bitsandbytes), "cpu_offload_adamw" (this module)."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    if name == "cpu_offload_adamw":
        return CPUOffloadAdamW(params, lr=lr)
    import bitsandbytes as bnb

    makers = {"paged_adamw_32bit": bnb.optim.PagedAdamW32bit, "paged_adamw_8bit": bnb.optim.PagedAdamW8bit,
              "adamw_8bit": bnb.optim.AdamW8bit}
    if name not in makers:
        raise ValueError(f"unknown optimizer {name!r}: use one of {('adamw', 'cpu_offload_adamw', *makers)}")
    return makers[name](params, lr=lr)


def release_paged_state() -> int:
    """Move every paged buffer bitsandbytes ever allocated to the host and forget it (lesson 4); return its
    bytes. bitsandbytes never frees paged memory, so without this a second paged optimizer in the
    same process competes with the first one's state for GPU memory."""
    try:
        import bitsandbytes.functional as F
    except Exception:  # bitsandbytes missing or broken: nothing was paged
        return 0
    manager = F.GlobalPageManager.get_instance()
    total = 0
    if torch.cuda.is_available():
        for tensor in manager.paged_tensors:
            F.prefetch_tensor(tensor, to_cpu=True)
            total += tensor.numel() * tensor.element_size()
        torch.cuda.synchronize()
    manager.paged_tensors.clear()
    return total


def release_cuda_memory() -> None:
    """A clean GPU for the next run (lessons 4 and 5): collect the garbage, release the paged state
    bitsandbytes never frees, and return the caching allocator's cached blocks."""
    gc.collect()
    release_paged_state()
    torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------
# A small GPU inside a big one
# --------------------------------------------------------------------------------------------

class VirtualGPU:
    """Make the GPU look `capacity` bytes big for this process (lesson 4).

    A balloon of ordinary (unevictable) memory takes everything else, so unified memory really runs
    short at `capacity`; `torch.cuda.set_per_process_memory_fraction` caps PyTorch's allocator there
    too, so plain AdamW fails the way it would on the small GPU. `used()` is what nvidia-smi would
    show on the small GPU (everything in use on the device minus the balloon: context, PyTorch's
    reserve, resident managed memory).
    """

    def __init__(self, capacity: int, device: int = 0, chunk: int = 4 * GiB) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        if not torch.cuda.is_available():
            raise RuntimeError("VirtualGPU needs a CUDA GPU")
        self.capacity, self.device, self.chunk = int(capacity), torch.device("cuda", device), chunk
        self.balloon: list[torch.Tensor] = []
        self.balloon_bytes = 0

    def __enter__(self) -> VirtualGPU:
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        if free < self.capacity:
            raise RuntimeError(f"only {free / GiB:.2f} GiB free: cannot emulate {self.capacity / GiB:.2f} GiB")
        target = free - self.capacity
        while self.balloon_bytes < target:
            n = min(self.chunk, target - self.balloon_bytes)
            n -= n % (2 * MiB)
            if n <= 0:
                break
            self.balloon.append(torch.empty(n, dtype=torch.uint8, device=self.device))
            self.balloon_bytes += n
        reserved = torch.cuda.memory_reserved(self.device)
        torch.cuda.set_per_process_memory_fraction(min(1.0, (reserved + self.capacity) / total), self.device)
        self.total = total
        self.baseline = self.used()  # CUDA context and whatever else was there before
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.set_per_process_memory_fraction(1.0, self.device)
        self.balloon.clear()
        self.balloon_bytes = 0
        gc.collect()
        torch.cuda.empty_cache()

    def used(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free - self.balloon_bytes

    def reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device) - self.balloon_bytes

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) - self.balloon_bytes


# --------------------------------------------------------------------------------------------
# Timing what bitsandbytes does inside step()
# --------------------------------------------------------------------------------------------

@dataclass
class TimelineEntry:
    """One parameter's prefetch or update inside `optimizer.step()`: seconds from the step's start (lesson 4)."""

    kind: str
    index: int
    start: float
    end: float
    state_bytes: int


class PrefetchTimeline:
    """Record when bitsandbytes prefetches each parameter's state and when it updates it
    (lesson 4, "prefetch in a timeline"). It wraps the optimizer's `prefetch_state` and
    `update_step` and synchronizes around each, so the times are what the GPU spent."""

    def __init__(self, optimizer) -> None:
        if not hasattr(optimizer, "prefetch_state") or not hasattr(optimizer, "update_step"):
            raise TypeError("PrefetchTimeline needs a bitsandbytes optimizer (prefetch_state, update_step)")
        self.optimizer = optimizer
        self.entries: list[TimelineEntry] = []
        self.t0 = time.perf_counter()
        self._index: dict[int, int] = {}
        prefetch, update = optimizer.prefetch_state, optimizer.update_step

        def timed(kind: str, fn: Callable, p: torch.Tensor, *args) -> None:
            _sync()
            start = time.perf_counter()
            fn(p, *args) if kind == "prefetch" else fn(*args)
            _sync()
            state = optimizer.state.get(p, {})
            nbytes = sum(t.numel() * t.element_size() for t in state.values()
                         if isinstance(t, torch.Tensor) and getattr(t, "is_paged", False))
            index = self._index.setdefault(id(p), len(self._index))
            self.entries.append(TimelineEntry(kind, index, start - self.t0, time.perf_counter() - self.t0, nbytes))

        optimizer.prefetch_state = lambda p: timed("prefetch", prefetch, p)
        optimizer.update_step = lambda group, p, gindex, pindex: timed("update", update, p, group, p, gindex, pindex)

    def start_step(self) -> None:
        self.entries.clear()
        self.t0 = time.perf_counter()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# --------------------------------------------------------------------------------------------
# The demo
# --------------------------------------------------------------------------------------------

def mlp(hidden: int, layers: int, device: str | torch.device = "cpu") -> torch.nn.Sequential:
    """Lesson 3's `mlp_stack` of `layers` Linear(hidden, hidden) + ReLU in fp32, on `device`: parameters in
    a few big tensors, named by layer ("2.0.weight" is layer 2) for `params_from_module` (lesson 4)."""
    with torch.device(device):
        return mlp_stack(layers, hidden, "relu")


def mlp_setup(shape: dict[str, int], optimizer: str = "paged_adamw_32bit"):
    """The simulator's `TrainingSetup` for `mlp(**shape)` (lesson 4): its parameters by name and the
    activations it saves per token (one hidden-sized fp32 vector per layer, plus the input)."""

    params = params_from_module(mlp(shape["hidden"], shape["layers"], "meta"))
    return TrainingSetup(tuple(params), optimizer,
                         activation_bytes_per_token=(shape["layers"] + 1) * shape["hidden"] * 4)


def demo_shape(capacity: int) -> dict[str, int]:
    """A model for a `capacity`-byte GPU (lesson 4): weights + gradients take half of it, 32-bit Adam state
    another half (so plain AdamW cannot fit), 8-bit state an eighth, activations about 15%."""
    hidden = 4096 if capacity >= 3 * GiB else 2048
    per_layer = hidden * hidden + hidden
    layers = max(2, int(capacity / 2 / 8 / per_layer))
    tokens = max(64, int(0.15 * capacity / (layers * hidden * 4)))
    return {"hidden": hidden, "layers": layers, "tokens": tokens}


@dataclass
class StepRecord:
    """One measured training step: seconds by phase, bytes of memory after it (lesson 4)."""

    optimizer: str
    step: int
    tokens: int
    seconds: float
    forward: float
    backward: float
    optimizer_step: float
    allocated: int
    reserved: int
    used: int
    managed_resident: int = 0


@dataclass
class DemoRun:
    """One optimizer's run in the GPU demo: status, steps, prefetch timeline (lesson 4)."""

    optimizer: str
    status: str
    error: str = ""
    steps: list[StepRecord] = field(default_factory=list)
    timeline: list[TimelineEntry] = field(default_factory=list)
    state_bytes: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def run_training(optimizer_name: str, shape: dict[str, int], steps: int, gpu: VirtualGPU | None = None,
                 tokens_per_step: Sequence[int] | None = None, empty_cache_after: Iterable[int] = (),
                 seed: int = 0) -> DemoRun:
    """Train the demo MLP for `steps` steps with one optimizer; catch running out of memory (lesson 4)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(seed)
    tokens_per_step = list(tokens_per_step or [shape["tokens"]] * steps)
    flush = set(empty_cache_after)
    run = DemoRun(optimizer_name, "ok")
    model = opt = timeline = x = loss = None
    try:
        model = mlp(shape["hidden"], shape["layers"], device)
        opt = make_optimizer(optimizer_name, list(model.parameters()))
        if optimizer_name.startswith("paged"):
            timeline = PrefetchTimeline(opt)
        for step, tokens in enumerate(tokens_per_step):
            x = torch.randn(tokens, shape["hidden"], device=device)
            _sync()
            t0 = time.perf_counter()
            loss = model(x).pow(2).mean()
            _sync()
            t1 = time.perf_counter()
            loss.backward()
            _sync()
            t2 = time.perf_counter()
            if timeline is not None:
                timeline.start_step()
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync()
            t3 = time.perf_counter()
            del loss, x
            if step in flush and torch.cuda.is_available():
                torch.cuda.empty_cache()
            alloc = gpu.allocated() if gpu else (torch.cuda.memory_allocated() if device == "cuda" else 0)
            reserved = gpu.reserved() if gpu else (torch.cuda.memory_reserved() if device == "cuda" else 0)
            used = gpu.used() if gpu else 0
            managed = max(0, used - reserved - gpu.baseline) if gpu else 0
            run.steps.append(StepRecord(optimizer_name, step, tokens, t3 - t0, t1 - t0, t2 - t1, t3 - t2,
                                        alloc, reserved, used, managed))
        if timeline is not None:
            run.timeline = list(timeline.entries)
        if hasattr(opt, "state_bytes"):
            run.state_bytes = opt.state_bytes()
        else:
            run.state_bytes = sum(t.numel() * t.element_size() for s in opt.state.values()
                                  for t in s.values() if isinstance(t, torch.Tensor))
    except torch.cuda.OutOfMemoryError as error:
        run.status, run.error = "out of memory", str(error).splitlines()[0]
    finally:
        if isinstance(opt, CPUOffloadAdamW):
            opt.remove_hooks()
        model = opt = timeline = x = loss = None
        if torch.cuda.is_available():
            release_cuda_memory()
        else:
            gc.collect()
    return run


def paging_demo(capacity: int = 4 * GiB, steps: int = 5, optimizers: Sequence[str] = DEMO_OPTIMIZERS,
                shape: dict[str, int] | None = None) -> dict:
    """Plain AdamW vs bitsandbytes' paged AdamW (32- and 8-bit) vs manual offload on a GPU made to
    look `capacity` bytes big (lesson 4, "the real thing"). Needs CUDA."""
    if not torch.cuda.is_available():
        raise RuntimeError("paging_demo needs a CUDA GPU; on CPU use course_lib.paging (the simulator)")
    shape = shape or demo_shape(capacity)
    out = {"capacity": capacity, "shape": shape, "device": torch.cuda.get_device_name(), "runs": {}}
    with VirtualGPU(capacity) as gpu:
        out["used_at_start"] = gpu.used()
        for name in optimizers:
            out["runs"][name] = run_training(name, shape, steps, gpu).to_dict()
    return out


def measure_bandwidths(nbytes: int = 512 * MiB, repeats: int = 3) -> dict[str, float]:
    """Bytes per second (lesson 4) of pinned copies (both ways) and of unified-memory prefetches (both ways,
    through bitsandbytes' own paged buffers): the efficiency bitsandbytes' docs put at about half."""
    if not torch.cuda.is_available():
        raise RuntimeError("measure_bandwidths needs a CUDA GPU")
    import bitsandbytes.functional as F

    def best(fn: Callable[[], None]) -> float:
        times = []
        for _ in range(repeats):
            _sync()
            t = time.perf_counter()
            fn()
            _sync()
            times.append(time.perf_counter() - t)
        return nbytes / min(times)

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    result = {"pinned_h2d": best(lambda: dev.copy_(host, non_blocking=True)),
              "pinned_d2h": best(lambda: host.copy_(dev, non_blocking=True))}
    del host, dev
    paged = F.get_paged(nbytes, dtype=torch.uint8, device=torch.device("cuda", 0))
    F.fill(paged, 0)

    h2d, d2h = [], []
    for _ in range(repeats):
        F.prefetch_tensor(paged, to_cpu=True)
        _sync()
        t = time.perf_counter()
        F.prefetch_tensor(paged)
        _sync()
        h2d.append(time.perf_counter() - t)
        t = time.perf_counter()
        F.prefetch_tensor(paged, to_cpu=True)
        _sync()
        d2h.append(time.perf_counter() - t)
    result["um_prefetch_h2d"] = nbytes / min(h2d)
    result["um_prefetch_d2h"] = nbytes / min(d2h)
    return result  # the paged buffer is never freed (bitsandbytes has no free); it ends on the host


def runs_table(runs: dict[str, dict]) -> str:
    """One line per optimizer run (lesson 4; as `DemoRun.to_dict()`): status, median step time (steps after
    the first), phases of the last step, and memory after it: allocated, reserved, used as
    nvidia-smi would show it, and the managed (paged) memory resident on the GPU."""
    lines = [f"{'optimizer':<20} {'status':<14} {'step ms':>8} {'fwd':>6} {'bwd':>6} {'opt':>7} "
             f"{'allocated':>10} {'reserved':>10} {'used':>10} {'paged':>10}"]
    for name, run in runs.items():
        steps = run["steps"]
        if run["status"] != "ok" or not steps:
            lines.append(f"{name:<20} {run['status']:<14} {run['error'][:80]}")
            continue
        times = sorted(s["seconds"] for s in (steps[1:] or steps))
        median = times[len(times) // 2]
        last = steps[-1]
        lines.append(f"{name:<20} {run['status']:<14} {1e3 * median:>8.1f} {1e3 * last['forward']:>6.1f} "
                     f"{1e3 * last['backward']:>6.1f} {1e3 * last['optimizer_step']:>7.1f} "
                     f"{last['allocated'] / GiB:>8.2f}Gi {last['reserved'] / GiB:>8.2f}Gi "
                     f"{last['used'] / GiB:>8.2f}Gi {last['managed_resident'] / GiB:>8.2f}Gi")
    return "\n".join(lines)
