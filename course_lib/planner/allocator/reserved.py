"""Reserved memory and the OOM line: what PyTorch's caching allocator reserves for the planned step
(`torch.cuda.max_memory_reserved`), what nvidia-smi would show, and whether that fits in what CUDA
reports as the card's memory (lesson 1, "the planner").

The allocated bytes are the plan's (the categories, less the CUDA context). Beyond them the allocator
reserves (docs/references.md#torch-2130-c10cudacudacachingallocatorcpp-block-rounding and
docs/references.md#pytorch-atensrcatencudacublashandlepoolcpp-cublas-workspaces):
- the segments' rounding of the model states, replayed tensor by tensor through
  `course_lib.caching_allocator` (weights as loaded, the cuBLAS workspaces, master weights, optimizer
  state as the first step makes it);
- the step's own: the traced step's allocations and frees replayed twice (`caching_allocator.stream_slack`, kept in the
  trace; for a deep model from the stream `planner.trace.deep_stream` builds), the cache emptied in between
  where the loop calls torch.cuda.empty_cache() after each step (`Setup.empty_cache_each_step`); under
  checkpointing the checkpointed step's own (`step_trace.StepTrace.checkpointed_slack`), with offloaded
  activations the plain step's scaled down with them;
- the cuBLAS and cuBLASLt workspaces, which torch allocates through the caching allocator, one of each
  per (handle, stream): the main thread's handle (forward, optimizer step) and the autograd engine's
  device thread's (backward);
- under FSDP1, the unshard stream's own pool: the gathered units reserve their peak apart from the rest
  of the step (`course_lib.planner.parallel.fsdp.unshard_pool_extra`). FSDP2's all-gather and reduce-scatter
  streams are not modelled (a sharded figure is a lower bound).
Outside the allocator, nvidia-smi also counts the CUDA context (a typical figure, `CUDA_CONTEXT_BYTES`)
and paged optimizer state (managed memory, resident when there is room). Every figure is predicted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from course_lib.cache import memo
from course_lib.caching_allocator import replay
from course_lib.measure import format_bytes
from course_lib.planner.config.errors import PlanError
from course_lib.planner.config.gpus import CUDA_CONTEXT_BYTES, GPU
from course_lib.planner.states.model_states import state_tensor_bytes
from course_lib.validate import checked

# aten/src/ATen/cuda/CublasHandlePool.cpp (docs/references.md, the anchor above): CUBLAS_WORKSPACE_CONFIG's
# default ":4096:2:16:8" (2 x 4096 KiB + 8 x 16 KiB), 32 MiB on compute capability 9.0; CUBLASLT_WORKSPACE_SIZE's
# default 1024 KiB (at most the cuBLAS workspace).
CUBLAS_WORKSPACE = 2 * 4096 * 1024 + 8 * 16 * 1024
CUBLAS_WORKSPACE_SM90 = 8 * 4096 * 1024
CUBLASLT_WORKSPACE = 1024 * 1024
CUBLAS_HANDLES = 2  # the main thread's and the autograd engine's CUDA device thread's (handles are per thread)


@checked(error=PlanError)
def cublas_workspaces(gpu: GPU) -> list[int]:
    """The bytes of each cuBLAS and cuBLASLt workspace a training step allocates on `gpu` (lesson 1)."""
    cublas = CUBLAS_WORKSPACE_SM90 if gpu.compute_capability == (9, 0) else CUBLAS_WORKSPACE
    return [cublas, min(CUBLASLT_WORKSPACE, cublas)] * CUBLAS_HANDLES


def _split(total: int, shares: list[int]) -> list[int]:
    """`total` bytes as one tensor per entry of `shares`, each in proportion to it."""
    count = sum(shares)
    return [total * n // count for n in shares] if total > 0 and count else []


def _states_slack(sizes: tuple[int, ...]) -> int:
    """What the segments of the model states' tensors, made in this order, reserve beyond their bytes; kept
    for the process (`cache.memo`): the fit search's candidates share their states."""
    return memo("states-slack", sizes, lambda: replay(list(sizes)).peak_reserved - sum(sizes))


@checked(error=PlanError)
@dataclass(frozen=True)
class Reserved:
    """The OOM line of a plan (lesson 1): `allocated` (max_memory_allocated: the plan's categories
    without the context) and `reserved` (max_memory_reserved), the cuBLAS workspaces inside it, and
    what lies outside the allocator (the CUDA context; paged optimizer state), all predicted, against
    `capacity`, what CUDA reports as the card's memory."""

    allocated: int
    reserved: int
    workspaces: int
    context: int
    managed: int
    capacity: int
    capacity_sourced: bool
    held: int = 0  # the allocations, the model states' segments and the workspaces: what no release gives back
    retries: bool = False  # fits only as the allocator frees its cache and retries (`limit.at_the_limit`)

    @property
    def nvidia_smi(self) -> int:
        """What nvidia-smi would show for the process: reserved, the context, resident paged state."""
        return self.reserved + self.context + self.managed

    @property
    def fits(self) -> bool:
        return self.nvidia_smi <= self.capacity

    def line(self) -> str:
        """One line (<= 110 characters): allocated, reserved, and nvidia-smi's estimate."""
        managed = f" + paged {self.managed / 2**30:.2f}" if self.managed else ""
        return (
            f"predicted: allocated {self.allocated / 2**30:.2f} GiB, reserved {self.reserved / 2**30:.2f} GiB; "
            f"+ context {self.context / 2**30:.2f}{managed} = nvidia-smi {self.nvidia_smi / 2**30:.2f} GiB"
        )

    def verdict(self, gpu: GPU) -> str:
        """Fits or not against CUDA's capacity, and by how much."""
        seen = "CUDA's" if self.capacity_sourced else "nvidia-smi's"  # what CUDA reports, or nvidia-smi's total
        head = f"{gpu.name} ({seen} {format_bytes(self.capacity)})"
        if self.retries:
            return (
                f"fits on {head} at its limit: the caching allocator frees its cache and retries (slower steps), "
                f"{format_bytes(self.capacity - self.held - self.context - self.managed)} above what it holds"
            )
        margin = self.capacity - self.nvidia_smi
        return (
            f"fits on {head}: {format_bytes(margin)} to spare"
            if margin >= 0
            else f"does not fit on {head}: {format_bytes(-margin)} over"
        )

    def to_dict(self) -> dict:
        return {
            "allocated_bytes": self.allocated,
            "reserved_bytes": self.reserved,
            "workspace_bytes": self.workspaces,
            "context_bytes": self.context,
            "managed_bytes": self.managed,
            "nvidia_smi_bytes": self.nvidia_smi,
            "cuda_capacity_bytes": self.capacity,
            "cuda_capacity_sourced": self.capacity_sourced,
            "fits": self.fits,
            "allocator_retries": self.retries,
        }


def _numels(spec, states) -> list[int]:
    return [p.numel for p in spec.params] if spec is not None else [states.trainable + states.frozen]


def _trained_shapes(spec, states) -> list[tuple[int, ...]]:
    return [tuple(shape) for shape in states.trainable_shapes] or [(n,) for n in _numels(spec, states)]


def state_blocks(spec, setup, states, values: dict[str, int]) -> list[int]:
    """The optimizer state's blocks in the caching allocator: the state tensors of each trained tensor
    (32-bit for the Trainer's embeddings under 8-bit), the plan's optimizer_state bytes split among them;
    none for a paged optimizer (managed memory)."""
    if setup.optimizer.startswith("paged"):
        return []
    shapes = _trained_shapes(spec, states)
    full_state = states.full_state or (False,) * len(shapes)
    state = [
        size
        for shape, full in zip(shapes, full_state)
        for size in state_tensor_bytes(setup.optimizer, shape, states.state_itemsize, full)
    ]
    return _split(values["optimizer_state"], state)


def reserved_prediction(
    spec,
    setup,
    states,
    values: dict[str, int],
    trace,
    gpu: GPU,
    detail: dict | None = None,
    checkpointed: int | None = None,
    wrap: int = 0,
) -> Reserved:
    """The OOM line of one planned step on `gpu` (lesson 1): `values` are the plan's bytes by category
    (one GPU's share under --gpus), `states` its model states, `trace` its meta-device trace (None for a
    bare parameter count: then the step adds no slack), `detail` the plan's (FSDP1's stream pool),
    `checkpointed` the slack of the step as its checkpointing plan runs it (`step_trace.StepTrace.checkpointed_slack`),
    which replaces the plain step's, `wrap` what FSDP1's wrap from the CPU leaves cached adds to it
    (`fsdp_wrap.wrap_extra`)."""
    allocated = values["total"] - values["overhead"]
    paged = setup.optimizer.startswith("paged")
    managed = values["optimizer_state"] if paged else 0  # cudaMallocManaged: outside the caching allocator
    numels = _numels(spec, states)
    trained = [max(1, math.prod(shape)) for shape in _trained_shapes(spec, states)]
    workspaces = cublas_workspaces(gpu)
    sizes = (
        _split(values["weights"], numels)
        + workspaces
        + _split(values["quantization"], numels)
        + _split(values["master_weights"], trained)
        + state_blocks(spec, setup, states, values)
    )
    held = allocated - managed + _states_slack(tuple(sizes)) + sum(workspaces)
    slack = wrap
    if checkpointed is not None:
        slack += checkpointed
    elif trace is not None:  # the plain step's; with offloaded activations scaled down with what stays on the GPU
        peak = max(trace.forward_peak, trace.head_backward_peak, trace.layer_backward_peak, trace.tail_backward_peak)
        step = values["activations"] + values["gradients"]
        plain = trace.allocator_slack_emptied if setup.empty_cache_each_step else trace.allocator_slack
        slack += plain if peak <= step else plain * step // max(1, peak)
    slack += detail.get("stream_pools_extra", 0) if detail else 0  # FSDP1's unshard stream's pool
    capacity = gpu.cuda_memory_bytes or gpu.memory_bytes
    context = values["overhead"] or CUDA_CONTEXT_BYTES
    reserved = held + max(0, slack)  # the wrap's cache can hold the step's blocks: never below what is held
    return Reserved(
        allocated, reserved, sum(workspaces), context, managed, capacity, gpu.cuda_memory_bytes is not None, held
    )
