"""Paged optimizers and manual offload on a real CUDA GPU: the demo (lesson 4, "the real thing").

`paging_demo`: plain AdamW runs out of memory; bitsandbytes' AdamW8bit (unpaged) and PagedAdamW
(32-bit and 8-bit) complete, as does CPU offload (`cpu_offload.CPUOffloadAdamW`); step times and
memory (allocated, reserved, used as nvidia-smi shows it, and what lies outside PyTorch's allocator),
on a GPU made small by `virtual_gpu.VirtualGPU`, with `timeline.PrefetchTimeline` for the paged rows.
`demo_margins` and `demo_claims` check with the simulator that every outcome is clear of the capacity.

bitsandbytes never frees paged state and cannot move it off the GPU without ending the process
(`course_lib.isolate`): every demo row runs in its own process.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from course_lib import isolate, validate
from course_lib.checkpointing import mlp_stack
from course_lib.device import synchronize
from course_lib.errors import UserError
from course_lib.measure import GiB
from course_lib.paging.cpu_offload import CPUOffloadAdamW
from course_lib.paging.policies import OPTIMIZERS, Hardware, PagingError
from course_lib.paging.regimes import simulate_offload
from course_lib.paging.simulator import simulate
from course_lib.paging.timeline import PrefetchTimeline, TimelineEntry
from course_lib.paging.trace import TrainingSetup, params_from_module, training_trace
from course_lib.paging.virtual_gpu import VirtualGPU, release_cuda_memory
from course_lib.validate import Count, Device, checked

MARGIN_OPTIMIZERS = (*OPTIMIZERS, "cpu_offload_adamw")  # the simulator's, and the manual offload
DEMO_OPTIMIZERS = ("adamw", "adamw_8bit", "paged_adamw_32bit", "paged_adamw_8bit", "cpu_offload_adamw")
MARGIN = 0.15  # every OOM / no-OOM outcome of the demo is at least this far from the capacity


@checked(error=PagingError)
def make_optimizer(name: str, params: Sequence[torch.nn.Parameter], lr: float = 1e-4):
    """The optimizers the lesson compares, by name: "adamw" (torch, foreach on CUDA), "paged_adamw_32bit",
    "paged_adamw_8bit", "adamw_32bit", "adamw_8bit" (bitsandbytes), "cpu_offload_adamw" (lesson 4)."""
    params = validate.non_empty("params", params, "parameters to optimize", error=PagingError)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    if name == "cpu_offload_adamw":
        return CPUOffloadAdamW(params, lr=lr)
    import bitsandbytes as bnb  # imported only when asked for: it loads its CUDA library

    makers = {
        "paged_adamw_32bit": bnb.optim.PagedAdamW32bit,
        "paged_adamw_8bit": bnb.optim.PagedAdamW8bit,
        "adamw_32bit": bnb.optim.AdamW32bit,
        "adamw_8bit": bnb.optim.AdamW8bit,
    }
    if name not in makers:
        raise UserError(f"unknown optimizer {name!r}: use one of {('adamw', 'cpu_offload_adamw', *makers)}")
    return makers[name](params, lr=lr)


@checked(error=PagingError)
def mlp(hidden: Count, layers: int, device: Device = "cpu") -> torch.nn.Sequential:
    """Lesson 3's `mlp_stack` of `layers` Linear(hidden, hidden) + ReLU in fp32, on `device`: parameters in
    a few big tensors, named by layer ("2.0.weight" is layer 2) for `params_from_module` (lesson 4)."""
    with torch.device(device):
        return mlp_stack(layers, hidden, "relu")


@checked(error=PagingError)
def mlp_setup(shape: dict[str, int], optimizer: str = "paged_adamw_32bit"):
    """The simulator's `TrainingSetup` for `mlp(**shape)` (lesson 4): its parameters by name and the
    activations it saves per token (one hidden-sized fp32 vector per layer, plus the input)."""

    params = params_from_module(mlp(shape["hidden"], shape["layers"], "meta"))
    return TrainingSetup(
        tuple(params), optimizer, activation_bytes_per_token=(shape["layers"] + 1) * shape["hidden"] * 4
    )


@checked(error=PagingError)
def demo_shape(capacity: int) -> dict[str, int]:
    """A model for a `capacity`-byte GPU (lesson 4): fp32 weights 30% of it, gradients as much, 32-bit
    Adam state twice that (so neither plain AdamW nor the paged state fits), 8-bit state about 15%,
    activations 8%. `demo_margins` checks that every outcome is clear of the capacity by `MARGIN`."""
    hidden = 4096 if capacity >= 3 * GiB else 2048
    per_layer = hidden * hidden + hidden
    layers = max(2, round(0.297 * capacity / 4 / per_layer))
    tokens = max(64, int(0.08 * capacity / ((layers + 1) * hidden * 4)))
    return {"hidden": hidden, "layers": layers, "tokens": tokens}


@checked(error=PagingError)
def demo_margins(
    capacity: int,
    shape: dict[str, int] | None = None,
    optimizers: str | Sequence[str] = DEMO_OPTIMIZERS,
    tokens: int | None = None,
) -> dict[str, dict[str, float]]:
    """What each demo row needs over `capacity`, simulated on an unbounded device (lesson 4): "ordinary"
    is PyTorch's peak reserve (blocks rounded, foreach temporaries), "total" adds the resident paged
    state, "activations" is their share. Whether the allocator reuses the activations' freed blocks
    for later requests depends on their sizes, so a claim must hold either way (`demo_claims`)."""
    capacity = validate.positive_int("capacity", capacity)
    optimizers = validate.choices("optimizers", optimizers, MARGIN_OPTIMIZERS)  # never a name's letters
    shape = shape or demo_shape(capacity)
    tokens = shape["tokens"] if tokens is None else validate.positive_int("tokens", tokens)
    huge = Hardware.t4().with_memory(1 << 50)
    out = {}
    for name in optimizers:
        setup = mlp_setup(shape, "adamw" if name == "cpu_offload_adamw" else name)
        activations = setup.bytes_by_category(tokens)["activations"]
        if name == "cpu_offload_adamw":
            ordinary = total = simulate_offload(setup, tokens, huge).device_peak
        else:
            r = simulate(training_trace(setup, [tokens] * 2), huge, record_timeline=False)
            ordinary, total = r.peak_reserved, r.peak_used
        out[name] = {"ordinary": ordinary / capacity, "total": total / capacity, "activations": activations / capacity}
    return out


@checked(error=PagingError)
def demo_claims(margins: dict[str, dict[str, float]]) -> dict[str, bool]:
    """The demo's claims, each true by at least `MARGIN` whether or not freed activation blocks are
    reused (lesson 4): plain AdamW runs out of memory; every other row completes; paged 32-bit state
    pages; the 8-bit rows move nothing."""
    low, high = 1 - MARGIN, 1 + MARGIN
    worst = {name: m["ordinary"] + m["activations"] for name, m in margins.items()}  # no reuse
    claims = {"adamw runs out of memory": margins["adamw"]["ordinary"] >= high}
    for name in DEMO_OPTIMIZERS[1:]:
        claims[f"{name} completes"] = worst[name] <= low
    claims["paged_adamw_32bit pages"] = margins["paged_adamw_32bit"]["total"] >= high
    for name in ("adamw_8bit", "paged_adamw_8bit"):
        claims[f"{name} moves nothing"] = margins[name]["total"] + margins[name]["activations"] <= low
    return claims


@checked(error=PagingError)
def spike_plan(capacity: int, shape: dict[str, int] | None = None) -> dict:
    """The spike experiment for the demo model of a `capacity`-byte GPU (lesson 4, "a transient spike"):
    a GPU 1.5 times as big, two normal steps, one 11 times longer, three normal ones. Compared with
    bitsandbytes' unpaged 32-bit AdamW (the same state, no foreach temporaries), so that paging is the
    only difference. The claims, simulated, each clear by `MARGIN`: unpaged fits the normal steps and
    runs out of memory at the spike; paged survives it by evicting state."""
    shape = shape or demo_shape(capacity)
    big, t = int(1.5 * capacity), shape["tokens"]
    pair = ("adamw_32bit", "paged_adamw_32bit")
    normal = demo_margins(big, shape, pair)
    spike = demo_margins(big, shape, pair, tokens=11 * t)
    low, high = 1 - MARGIN, 1 + MARGIN
    claims = {
        "unpaged fits the normal steps": normal["adamw_32bit"]["ordinary"] + normal["adamw_32bit"]["activations"]
        <= low,
        "unpaged runs out of memory at the spike": spike["adamw_32bit"]["ordinary"] >= high,
        "paged survives the spike": spike["paged_adamw_32bit"]["ordinary"] <= low,
        "paged evicts state at the spike": spike["paged_adamw_32bit"]["total"] >= high,
    }
    return {
        "capacity": big,
        "tokens": [t, t, 11 * t, t, t, t],
        "spike_step": 2,
        "claims": claims,
        "margins": {"normal": normal, "spike": spike},
    }


@checked(error=PagingError)
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
    outside_allocator: int = 0  # growth since the warm-up of device memory PyTorch did not reserve


@checked(error=PagingError)
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


def run_training(
    optimizer_name: str,
    shape: dict[str, int],
    steps: int,
    gpu: VirtualGPU | None = None,
    tokens_per_step: Sequence[int] | None = None,
    empty_cache_after: Iterable[int] = (),
    seed: int = 0,
) -> DemoRun:
    """Train the demo MLP for `steps` steps with one optimizer; catch running out of memory (lesson 4)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(seed)
    tokens_per_step = list(tokens_per_step or [shape["tokens"]] * steps)
    flush = set(empty_cache_after)
    run = DemoRun(optimizer_name, "ok")
    model = opt = timeline = x = loss = None  # noqa: F841 (an OOM mid-step leaves x and loss bound: drop them before release_cuda_memory)
    try:
        model = mlp(shape["hidden"], shape["layers"], device)
        opt = make_optimizer(optimizer_name, list(model.parameters()))
        if optimizer_name.startswith("paged"):
            timeline = PrefetchTimeline(opt)
        for step, tokens in enumerate(tokens_per_step):
            x = torch.randn(tokens, shape["hidden"], device=device)
            synchronize()
            t0 = time.perf_counter()
            loss = model(x).pow(2).mean()
            synchronize()
            t1 = time.perf_counter()
            loss.backward()
            synchronize()
            t2 = time.perf_counter()
            if timeline is not None:
                timeline.start_step()
            opt.step()
            opt.zero_grad(set_to_none=True)
            synchronize()
            t3 = time.perf_counter()
            del loss, x
            if step in flush and torch.cuda.is_available():
                torch.cuda.empty_cache()
            alloc = gpu.allocated() if gpu else (torch.cuda.memory_allocated() if device == "cuda" else 0)
            reserved = gpu.reserved() if gpu else (torch.cuda.memory_reserved() if device == "cuda" else 0)
            used = gpu.used() if gpu else 0
            outside = gpu.outside_allocator() - gpu.outside_baseline if gpu else 0
            run.steps.append(
                StepRecord(
                    optimizer_name, step, tokens, t3 - t0, t1 - t0, t2 - t1, t3 - t2, alloc, reserved, used, outside
                )
            )
        if timeline is not None:
            run.timeline = list(timeline.entries)
        if hasattr(opt, "state_bytes"):
            run.state_bytes = opt.state_bytes()
        else:
            run.state_bytes = sum(
                t.numel() * t.element_size()
                for s in opt.state.values()
                for t in s.values()
                if isinstance(t, torch.Tensor)
            )
    except torch.cuda.OutOfMemoryError as error:
        run.status, run.error = "out of memory", str(error).splitlines()[0]
    finally:
        if isinstance(opt, CPUOffloadAdamW):
            opt.remove_hooks()
        model = opt = timeline = x = loss = None  # noqa: F841 (an OOM mid-step leaves x and loss bound: drop them before release_cuda_memory)
        release_cuda_memory()
    return run


def warm_up(device: torch.device) -> None:
    """Load what the demo's first step would load lazily (cuBLAS, the foreach kernels, bitsandbytes'
    CUDA library) on tensors too small to be paged, so that memory measured after it is the run's own
    (lesson 4)."""
    model = mlp(64, 2, device)
    for name in ("adamw", "adamw_8bit", "paged_adamw_8bit"):
        opt = make_optimizer(name, list(model.parameters()))  # 64 x 64 < 1e5 elements: never paged
        model(torch.randn(8, 64, device=device)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    del model, opt
    synchronize()
    release_cuda_memory()


@checked(error=PagingError)
def demo_row(
    optimizer: str,
    shape: dict[str, int],
    steps: int,
    capacity: int | None = None,
    tokens_per_step: Sequence[int] | None = None,
    empty_cache_after: Sequence[int] = (),
) -> dict:
    """One row of the demo, meant to run in its own process (`isolate.run`, lesson 4): on CUDA, warm up,
    make the GPU `capacity` bytes big, train; the paged column is what lies outside the allocator
    after the run minus what lay there after the warm-up. On a CPU: just train."""
    if not torch.cuda.is_available():
        return run_training(optimizer, shape, steps, None, tokens_per_step, empty_cache_after).to_dict()
    warm_up(torch.device("cuda"))
    with VirtualGPU(capacity or 4 * GiB) as gpu:
        run = run_training(optimizer, shape, steps, gpu, tokens_per_step, empty_cache_after).to_dict()
        return {
            **run,
            "capacity": gpu.capacity,
            "outside_allocator_after_warm_up": gpu.outside_baseline,
            "device": torch.cuda.get_device_name(),
        }


def isolated_runs(rows: Sequence[dict], timeout: float | None = None) -> list[dict]:
    """`demo_row(**row)` for each row, each in a fresh process (lesson 4): paged state is never freed, so
    no row sees another's. Each result carries its process id ("pid")."""
    return [isolate.run("course_lib.paging.demo:demo_row", timeout=timeout, **row) for row in rows]


def paging_demo(
    capacity: int = 4 * GiB,
    steps: int = 5,
    optimizers: Sequence[str] = DEMO_OPTIMIZERS,
    shape: dict[str, int] | None = None,
) -> dict:
    """Plain AdamW vs bitsandbytes' AdamW8bit, PagedAdamW (32- and 8-bit) and manual offload on a GPU
    made to look `capacity` bytes big (lesson 4, "the real thing"), one process per optimizer. Needs
    CUDA; this process itself never touches the GPU."""
    capacity, steps = validate.positive_int("capacity", capacity), validate.positive_int("steps", steps)
    optimizers = validate.choices("optimizers", optimizers, DEMO_OPTIMIZERS)
    if not torch.cuda.is_available():
        raise RuntimeError("paging_demo needs a CUDA GPU; on CPU use course_lib.paging (the simulator)")
    shape = shape or demo_shape(capacity)
    rows = isolated_runs(
        [{"optimizer": name, "shape": shape, "steps": steps, "capacity": capacity} for name in optimizers]
    )
    return {
        "capacity": capacity,
        "shape": shape,
        "runs": dict(zip(optimizers, rows)),
        "margins": demo_margins(capacity, shape),
    }


@checked(error=PagingError)
def runs_table(runs: dict[str, dict]) -> str:
    """One line per optimizer run (lesson 4; as `demo_row` returns them), measured: status, median step
    time (steps after the first), phases of the last step, and memory after it: allocated, reserved,
    used as nvidia-smi would show it on the small GPU, and "outside": what grew outside PyTorch's
    allocator since the warm-up. For a paged row that is its resident paged state; for the unpaged
    rows it is the noise floor the paged rows are read against."""
    lines = [
        f"{'optimizer':<20} {'status':<14} {'step ms':>8} {'fwd':>6} {'bwd':>6} {'opt':>7} "
        f"{'allocated':>10} {'reserved':>10} {'used':>10} {'outside':>10}"
    ]
    for name, run in runs.items():
        steps = run.get("steps") or []
        if run.get("status") != "ok" or not steps:
            lines.append(f"{name:<20} {run.get('status', '?'):<14} {str(run.get('error', ''))[:80]}")
            continue
        times = sorted(s["seconds"] for s in (steps[1:] or steps))
        median = times[len(times) // 2]
        last = steps[-1]
        lines.append(
            f"{name:<20} {run['status']:<14} {1e3 * median:>8.1f} {1e3 * last['forward']:>6.1f} "
            f"{1e3 * last['backward']:>6.1f} {1e3 * last['optimizer_step']:>7.1f} "
            f"{last['allocated'] / GiB:>8.2f}Gi {last['reserved'] / GiB:>8.2f}Gi "
            f"{last['used'] / GiB:>8.2f}Gi {last['outside_allocator'] / GiB:>8.2f}Gi"
        )
    return "\n".join(lines)
