"""Exact memory accounting of one training step, by category, on CPU and CUDA (lesson 0).

Categories are counted from the tensors themselves, one storage once: parameters, gradients,
optimizer state (read from `optimizer.state`) and the tensors autograd saved for backward. On CUDA
the peak over forward, backward and the optimizer step comes from the caching allocator's
statistics. On a CPU two instruments run side by side: the PyTorch profiler's allocator events
(every allocation and free of the CPU allocator, those an operator makes inside itself included: the
true peak) and a live-storage tracker (every storage an operator returns, and when it is freed: what
each tensor is). Where they disagree, an operator allocated memory inside itself that no Python code
ever holds (bitsandbytes' fused 8-bit step, `torch.sort`'s scratch copy); `StepMemory` reports both.
"""

from __future__ import annotations

import html
import weakref
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from course_lib import validate
from course_lib.allocator_events import AllocatorEvents, profiler_peak  # noqa: F401  (lesson 0 imports it from here)
from course_lib.errors import UserError
from course_lib.validate import checked

KiB, MiB, GiB = 2**10, 2**20, 2**30
PHASES = ("forward", "backward", "optimizer")
AGREE_BYTES = 4 * KiB  # the tracker and the allocator events agree when they differ by no more


@checked
def format_bytes(n: int | float | None) -> str:
    """A byte count in the largest binary unit that keeps it >= 1 (GiB, MiB, KiB, B)."""
    if n is None:
        return "n/a"
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    """The (device, address) of the storage behind a tensor: what tells storages apart (lesson 0)."""
    storage = tensor.untyped_storage()
    return (str(tensor.device), storage.data_ptr())


def unique_storages(tensors: Iterable[torch.Tensor]) -> dict[tuple[str, int], int]:
    """Map each distinct storage (device, address) behind `tensors` to its size in bytes.

    Views, tied weights and slices share a storage and are counted once (lesson 0, "storage sharing").
    """
    found: dict[tuple[str, int], int] = {}
    for tensor in tensors:
        if tensor is None or not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            continue
        nbytes = tensor.untyped_storage().nbytes()
        if nbytes:
            found[storage_key(tensor)] = nbytes
    return found


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors`, each counted once (lesson 0)."""
    return sum(unique_storages(tensors).values())


def optimizer_state_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Every tensor held in `optimizer.state` (moments, step counters, quantization maps)."""
    if optimizer is None:
        return []
    return [value for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor)]


# `torch.tensor(data)` builds its tensor outside any operator, then passes it through one of these.
_LIFTS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default, torch.ops.aten.lift.default)


class LiveStorageTracker(TorchDispatchMode):
    """Live bytes of every storage created during a region, and the peak (lesson 0, "the CPU tracker").

    Every output of every operator is looked at once; a storage not seen before is added, and a weak
    reference finalizer subtracts it when it is freed. An output that shares a storage with one of the
    operator's inputs (a view, an in-place result) is no new storage: when it was alive before the
    region it is not counted, and when it changed size (`resize_`) the change is. Storages are told
    apart by the storage itself, which a resize keeps. `watch` adds storages that existed before the
    region (parameters, optimizer state, the batch) so that the totals are absolute. Leaving the
    `with` block stops the count: what is freed afterwards is not part of the region.

    What it cannot see: memory an operator allocates and frees inside itself (a custom op's
    temporaries, a sort's scratch copy). `measure_step` runs the profiler's allocator events beside it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict = {}  # storage_key -> bytes
        self.current = 0
        self.phase = "start"
        self.phase_peaks: dict[str, int] = {}
        self.timeline: list[tuple[str, int]] = []
        self._finalizers: list[weakref.finalize] = []

    def watch(self, tensor: torch.Tensor) -> None:
        """Count `tensor`'s storage until it is freed (once, however many tensors share it)."""
        if not isinstance(tensor, torch.Tensor):
            return
        storage = tensor.untyped_storage()
        key = self.storage_key(tensor, storage)
        nbytes = storage.nbytes()
        if key is None or key in self.live:
            return
        self.live[key] = nbytes  # an empty storage too: `resize_` may grow it
        self._finalizers.append(weakref.finalize(storage, self._freed, key, nbytes))
        if nbytes:
            self._record(nbytes)

    def storage_key(self, tensor: torch.Tensor, storage: torch.UntypedStorage):
        """What identifies the storage (the storage object itself, which `resize_` keeps while its
        address moves), or None for one not counted (meta tensors hold no memory)."""
        return None if tensor.device.type == "meta" else storage._cdata

    def _freed(self, key, nbytes: int) -> None:
        nbytes = self.live.pop(key, None)  # its size now: a resize may have changed it
        if nbytes:
            self._record(-nbytes)

    def _record(self, delta: int) -> None:
        self.current += delta
        self.timeline.append((self.phase, self.current))
        if self.current > self.phase_peaks.get(self.phase, 0):
            self.phase_peaks[self.phase] = self.current

    def set_phase(self, phase: str) -> None:
        """Start a new phase; its peak starts from the bytes live now."""
        self.phase = phase
        self.phase_peaks[phase] = self.current
        self.timeline.append((phase, self.current))

    @property
    def peak(self) -> int:
        return max(self.phase_peaks.values(), default=0)

    def __exit__(self, *exc):
        for finalizer in self._finalizers:
            finalizer.detach()
        self._finalizers.clear()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {self.storage_key(t, t.untyped_storage()) for t in dispatched_tensors((args, tuple(kwargs.values())))}
        out = func(*args, **kwargs)
        for tensor in dispatched_tensors((out,)):
            storage = tensor.untyped_storage()
            key = self.storage_key(tensor, storage)
            if key in self.live:
                self._resized(key, storage.nbytes())
            elif key not in inputs or func in _LIFTS:  # an input's storage not counted was alive before,
                self.watch(tensor)  # but for `torch.tensor(data)`'s, made just now
        return out

    def _resized(self, key, nbytes: int) -> None:
        change = nbytes - self.live[key]
        if change:
            self.live[key] = nbytes
            self._record(change)


def dispatched_tensors(values: Iterable, found: list | None = None) -> list[torch.Tensor]:
    """The tensors among an operator's arguments or results as `__torch_dispatch__` sees them: an aten
    schema holds tensors alone or in lists and tuples (`Tensor[]`, `Tensor?[]`), never in a dict or an
    object, so this walk finds what `torch.utils._pytree.tree_flatten` finds, in a fraction of its time
    (the planner's meta trace dispatches thousands of operators; lesson 1)."""
    found = [] if found is None else found
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            dispatched_tensors(value, found)
    return found


class PlainTextTable:
    """Mixin: IPython's plain-text view shows `str(self)`, a short table, not the dataclass fields.

    Notebooks saved to text (GitHub, nbval, a terminal) then show the same table as the HTML view
    (lesson 0); `repr()` stays the full dataclass repr for debugging. IPython takes the first of
    `_repr_pretty_` and `__repr__` it meets along the class's MRO, and `@dataclass` writes a `__repr__`
    into every subclass, so each subclass gets its own `_repr_pretty_`.
    """

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls._repr_pretty_ = PlainTextTable._show

    def _show(self, printer, cycle: bool) -> None:
        printer.text(str(self))


@dataclass
class StepMemory(PlainTextTable):
    """Memory of one training step by category, in bytes (lesson 0).

    `baseline` is what was live before the step (model, optimizer state, batch); `peak` the most
    live at any moment of the step, as the allocator sees it; `phase_peaks` the peak of each phase.
    On a CPU `tracked_peak` is the live-storage tracker's peak beside it: lower where an operator
    allocated inside itself (`inside_operators`). On CUDA `reserved` is what the caching allocator
    holds and `outside_pytorch` what the GPU uses beyond it (CUDA context, other processes):
    nvidia-smi shows reserved + outside_pytorch.
    """

    device: str
    method: str
    parameters: int
    gradients: int
    optimizer_state: int
    saved_for_backward: int
    baseline: int
    peak: int
    phase_peaks: dict[str, int]
    reserved: int | None = None
    outside_pytorch: int | None = None
    timeline: list[tuple[str, int]] = field(default_factory=list, repr=False)
    tracked_peak: int | None = None  # CPU: the live-storage tracker's peak (what operators return)
    tracked_phase_peaks: dict[str, int] | None = None

    @property
    def inside_operators(self) -> int:
        """CPU: bytes at the peak that no operator returned, allocated inside one (0 where the
        instruments agree to within `AGREE_BYTES`, or where only the tracker ran)."""
        if self.tracked_peak is None:
            return 0
        unseen = self.peak - self.tracked_peak
        return unseen if abs(unseen) > AGREE_BYTES else 0

    def rows(self) -> list[tuple[str, int | None]]:
        """(label, bytes) in display order."""
        rows = [
            ("parameters", self.parameters),
            ("gradients", self.gradients),
            ("optimizer state", self.optimizer_state),
            ("saved for backward", self.saved_for_backward),
            ("live before the step", self.baseline),
        ]
        rows += [(f"peak in {phase}", self.phase_peaks.get(phase)) for phase in PHASES if phase in self.phase_peaks]
        rows.append(("peak of the step", self.peak))
        if self.inside_operators:
            rows.append(("  of which inside operators", self.inside_operators))
        if self.reserved is not None:
            rows += [
                ("reserved by the allocator", self.reserved),
                ("outside PyTorch (context, other processes)", self.outside_pytorch),
            ]
        return rows

    def to_dict(self) -> dict:
        """Plain numbers (bytes), without the timeline."""
        data = asdict(self)
        data.pop("timeline")
        return data

    def __str__(self) -> str:
        width = max(len(label) for label, _ in self.rows())
        lines = [f"Memory of one training step on {self.device} ({self.method})"]
        lines += [f"  {label:<{width}}  {format_bytes(value):>11}" for label, value in self.rows()]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        body = "".join(
            f"<tr><td style='text-align:left'>{html.escape(label)}</td>"
            f"<td style='text-align:right'>{format_bytes(value)}</td></tr>"
            for label, value in self.rows()
        )
        caption = html.escape(f"One training step on {self.device} ({self.method})")
        return f"<table><caption>{caption}</caption><tr><th>category</th><th>memory</th></tr>{body}</table>"


class SavedTensorRecorder:
    """Bytes of the storages autograd saves for backward inside a `with` block (lesson 0).

    Storages of the `excluded` tensors (the model's parameters and buffers) are left out; each
    storage is counted once however many tensors share it.
    """

    def __init__(self, excluded: Iterable[torch.Tensor] = ()) -> None:
        self.excluded = set(unique_storages(excluded))
        self.saved: dict[tuple[str, int], int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        for key, nbytes in unique_storages([tensor]).items():
            if key not in self.excluded:
                self.saved[key] = nbytes
        return tensor

    @property
    def bytes(self) -> int:
        return sum(self.saved.values())

    def __enter__(self) -> SavedTensorRecorder:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def measure_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    loss_fn: Callable[[], torch.Tensor],
    inputs: Iterable[torch.Tensor] = (),
) -> StepMemory:
    """Run one training step and account for its memory by category (lesson 0).

    `loss_fn()` runs the forward pass and returns a scalar loss; `inputs` are the batch tensors it
    reads (counted in the baseline). Gradients are reset with `set_to_none=True` first, then forward,
    backward and `optimizer.step()` run (no step when `optimizer` is None).

    Tensors saved inside a non-reentrant checkpoint region are invisible to `saved_for_backward`
    (checkpointing installs its own hooks); the peak still counts them.
    """
    validate.model_and_optimizer(model, optimizer)
    device = next(model.parameters()).device
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    inputs = [t for t in tree_flatten(list(inputs))[0] if isinstance(t, torch.Tensor)]
    model_tensors = list(model.parameters()) + list(model.buffers())
    recorder = SavedTensorRecorder(model_tensors)
    baseline_tensors = model_tensors + optimizer_state_tensors(optimizer) + inputs
    if device.type == "cuda":
        peaks, reserved, outside, timeline, baseline = _run_on_cuda(device, model, optimizer, loss_fn, recorder)
        method = "CUDA caching allocator statistics"
        tracked = None
    else:
        baseline, tracked, allocator, timeline = _cpu_peaks(
            lambda begin: _run_phases(begin, optimizer, loss_fn, recorder), baseline_tensors
        )
        peaks, reserved, outside = allocator or tracked, None, None
        method = (
            "allocator events, the live-storage tracker beside"
            if allocator
            else "live-storage tracker (another profiler was running)"
        )
    return StepMemory(
        device=str(device),
        method=method,
        parameters=storage_bytes(model.parameters()),
        gradients=storage_bytes(p.grad for p in model.parameters()),
        optimizer_state=storage_bytes(optimizer_state_tensors(optimizer)),
        saved_for_backward=recorder.bytes,
        baseline=baseline,
        peak=max(peaks.values()),
        phase_peaks=dict(peaks),
        reserved=reserved,
        outside_pytorch=outside,
        timeline=timeline,
        tracked_peak=None if tracked is None else max(tracked.values()),
        tracked_phase_peaks=tracked,
    )


def peak_bytes(step: Callable[[], None], live: Iterable[torch.Tensor], device: torch.device) -> int:
    """Peak bytes while `step()` runs: a whole accumulation window, say, where `measure_step` covers
    one micro-batch (lessons 2 and 5).

    On CPU the live-storage tracker counts the `live` tensors (model, optimizer state, batch) and
    everything created during the step; on CUDA it is the caching allocator's peak, process-wide,
    plus the `live` tensors in unified memory (a paged optimizer's state, lesson 4: cudaMallocManaged,
    outside PyTorch's allocator), which occupy the GPU while the optimizer runs.
    """
    if device.type == "cuda":
        paged = storage_bytes(t for t in live if getattr(t, "is_paged", False))
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) + paged

    def run(begin):
        begin("step")
        step()

    _, tracked, allocator, _ = _cpu_peaks(run, live)
    return (allocator or tracked)["step"]


def _cpu_peaks(run: Callable[[Callable[[str], None]], None], live: Iterable[torch.Tensor]):
    """Run `run(begin)` (which calls `begin(phase)` as each phase starts) under both CPU instruments:
    (baseline, the tracker's phase peaks, the allocator events' phase peaks or None when another
    profiler is already running, the tracker's timeline). Both are absolute: the `live` tensors'
    storages count from the start (lesson 0)."""
    tracker = LiveStorageTracker()
    live = [t for t in live if isinstance(t, torch.Tensor)]
    for tensor in live:
        tracker.watch(tensor)
    baseline = tracker.current
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in live if t.device.type == "cpu"}
    events = AllocatorEvents()
    with events, tracker:

        def begin(phase: str) -> None:
            tracker.set_phase(phase)
            events.mark(phase)

        run(begin)
    tracked = {phase: peak for phase, peak in tracker.phase_peaks.items() if phase != "start"}
    return baseline, tracked, events.phase_peaks(baseline, held), tracker.timeline


def training_loss(loss_fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`loss_fn()`, the forward pass, if it returns a scalar tensor that requires grad; else a UserError
    (lessons 0 and 3: the loss whose backward is measured)."""
    loss = loss_fn()
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad):
        raise UserError("loss_fn must return a scalar tensor that requires grad (the training loss)")
    return loss


def _run_phases(begin: Callable[[str], None], optimizer, loss_fn, recorder: SavedTensorRecorder) -> None:
    begin("forward")
    with recorder:
        loss = training_loss(loss_fn)
    begin("backward")
    loss.backward()
    del loss
    if optimizer is not None:
        begin("optimizer")
        optimizer.step()


def _run_on_cuda(device, model, optimizer, loss_fn, recorder):
    peaks: dict[str, int] = {}
    current = {"phase": None}

    def begin(phase: str) -> None:
        torch.cuda.synchronize(device)
        if current["phase"] is not None:
            peaks[current["phase"]] = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        current["phase"] = phase

    torch.cuda.synchronize(device)
    baseline = torch.cuda.memory_allocated(device)
    _run_phases(begin, optimizer, loss_fn, recorder)
    begin("end")
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    return peaks, reserved, total - free - reserved, [], baseline
