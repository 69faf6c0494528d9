"""The simulator: a trace run on a simulated GPU with unified memory (lesson 4, "the simulator").

What it models, and where each rule comes from (docs/references.md, "Lessons 4 and 5"):

- Ordinary allocations (weights, gradients, activations, unpaged optimizer state and the optimizer's
  temporaries) go through PyTorch's caching allocator: a request is rounded up to 512 bytes, and a
  new segment is 2 MiB for requests up to 1 MiB, 20 MiB up to 10 MiB, else the request rounded up to
  2 MiB (torch 2.13 c10/cuda/CUDACachingAllocator.cpp; the rules of `course_lib.caching_allocator`,
  whose best fit, splits and merges the simulator leaves out: any cached byte serves any request). They
  are never evicted: when they do not
  fit, the step runs out of memory. Freed blocks stay *reserved* until `empty_cache` (or until a
  `cudaMalloc` fails, when PyTorch releases its free cached blocks and retries).
- Paged optimizer state is managed memory (`cudaMallocManaged(..., cudaMemAttachHost)`). A first
  touch on the GPU populates it there without a transfer; bitsandbytes calls `cudaMemPrefetchAsync`
  for each parameter's state right before its update, then synchronizes.
- When the GPU is short of memory the driver evicts managed memory in 2 MB root chunks, chosen by
  allocation order (a chunk goes to the list's tail when it is made resident, not when it is read),
  not by an access LRU. An eviction copies the chunk to the host and is finished before the
  migration that needed the room starts, so the two are serial.
- Faults (a kernel touching non-resident managed memory) migrate pages of `Policy.granularity`; the
  density prefetcher grows a migration inside its 2 MB block (`policies.sweep_faults`). A prefetch
  migrates whole ranges without faults. Fault counts are illustrative: the driver services faults in
  batches, and the simulator gives them no time of their own unless `Hardware.fault_latency` is set.

Time is the sum of compute, migrations (host to device), evictions (device to host) and fault
overhead: bitsandbytes synchronizes after each parameter, so nothing overlaps. Every number it
prints is *simulated* from the inputs in `Hardware`.

The simulator works on chunks with numpy arrays and a heap of eviction runs: one event costs
O(chunks it touches), never a Python loop over 4 KB pages.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from course_lib import validate
from course_lib.measure import format_bytes
from course_lib.paging.policies import (
    ROOT_CHUNK,
    VA_BLOCK,
    Hardware,
    OutOfDeviceMemory,
    PagingError,
    Policy,
    block_bytes,
    segment_bytes,
    sweep_faults,
)
from course_lib.paging.results import PhaseStats, Segment, SimulationResult
from course_lib.paging.trace import OPS, Event, chunk_trace
from course_lib.validate import checked


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
            raise PagingError(
                f"device memory ({format_bytes(hardware.memory)}) is smaller than one page "
                f"({format_bytes(max(policy.eviction_unit, policy.granularity))})"
            )
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
        self.heap: list[tuple[int, int, str, int]] = []  # (key, seq, name, stamp)
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
            self.timeline.append(
                Segment(self.clock, self.clock + seconds, lane, event.step, event.phase, label, nbytes)
            )
        self.clock += seconds

    def _track_peak(self) -> None:
        self.peak_used = max(self.peak_used, self.reserved + self.resident)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def _oom(self, event: Event, name: str, requested: int, available: int, why: str) -> OutOfDeviceMemory:
        return OutOfDeviceMemory(
            f"step {event.step}, {event.phase or 'no phase'}: {name} needs {format_bytes(requested)} "
            f"but only {format_bytes(available)} of {format_bytes(self.hw.memory)} can be freed ({why})",
            step=event.step,
            phase=event.phase,
            name=name,
            requested=requested,
            available=available,
        )

    def _unknown(self, index: int, event: Event, name: str) -> PagingError:
        known = sorted(self.device) + sorted(self.managed)
        hint = (
            f" (allocated: {', '.join(known[:6])}{', ...' if len(known) > 6 else ''})"
            if known
            else " (nothing is allocated yet)"
        )
        return PagingError(
            f"event {index} ({event.op}, step {event.step}, {event.phase or 'no phase'}) "
            f"uses {name!r}, which is not allocated{hint}"
        )

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
        evictable = self.resident - sum(
            int(self.managed[n].unit_bytes[self.managed[n].resident].sum()) for n in protected if n in self.managed
        )
        if nbytes > free_bytes + evictable:
            raise self._oom(
                event,
                name,
                nbytes,
                free_bytes + evictable,
                "paged state cannot make room for itself: it would thrash inside one kernel",
            )
        self._evict(nbytes - free_bytes, protected, event)

    # ---- events ------------------------------------------------------------------------
    def _alloc_device(self, index: int, event: Event) -> None:
        name = event.names[0]
        n = block_bytes(event.nbytes)
        cached_free = self.reserved - self.live
        grow = (0 if n <= cached_free else segment_bytes(n)) if self.caching else n
        if self.reserved + grow > self.hw.memory and self.caching:
            # cudaMalloc failed: PyTorch frees its cached blocks and retries.
            self.reserved = self.live
            grow = segment_bytes(n)
        if self.reserved + grow > self.hw.memory:
            raise self._oom(event, name, n, self.hw.memory - self.reserved, "ordinary allocations are never paged")
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
                    raise PagingError(
                        f"event {index} (prefetch, step {event.step}): {name!r} is an ordinary "
                        "allocation; cudaMemPrefetchAsync needs managed memory"
                    )
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
                    self._segment(
                        event, "H2D", seconds, f"{'fault-in' if faulting else 'prefetch'} {tensor.name}", mig_bytes
                    )
                if policy.eviction == "allocation":
                    tensor.stamp[missing] = stamp
                    self._push_run(tensor, stamp)
            if policy.eviction != "allocation":
                tensor.stamp[:] = stamp
                self._push_run(tensor, stamp)
        self._track_peak()

    def _fault_count(self, tensor: _Managed, migrated: np.ndarray) -> int:
        """Faults of the update kernel sweeping the tensor's missing units in order: per 2 MB block, one
        per missing page, or fewer with the density prefetcher (`policies.sweep_faults`)."""
        policy = self.policy
        blocks = tensor.offsets // VA_BLOCK
        total = np.bincount(blocks, weights=tensor.unit_bytes)
        moved = np.bincount(blocks[migrated], weights=tensor.unit_bytes[migrated], minlength=len(total))
        faults = 0
        for block_bytes_, moved_bytes in zip(total.tolist(), moved.tolist()):
            if moved_bytes <= 0:
                continue
            leaves = -(-int(block_bytes_) // policy.granularity)
            missing = -(-int(moved_bytes) // policy.granularity)
            faults += sweep_faults(leaves, missing, policy.density_threshold) if policy.density_prefetch else missing
        return faults

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
                raise PagingError(f"event {index}: alloc of {name!r} needs a positive byte count, got {event.nbytes!r}")
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


def simulate(
    trace: Sequence[Event],
    hardware: Hardware | None = None,
    policy: Policy | None = None,
    *,
    caching_allocator: bool = True,
    record_timeline: bool = True,
) -> SimulationResult:
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
    trace = validate.non_empty("trace", trace, "events (paging.alloc, touch, free, ...)", error=PagingError)
    sim = _Simulator(hardware, policy, caching_allocator, record_timeline)
    oom = sim.run(trace)
    completed = {e.step for e in trace} if oom is None else set(range(oom.step))
    for key in [k for k in sim.phases if oom is not None and k[0] >= oom.step]:
        del sim.phases[key]
    return SimulationResult(
        hardware=hardware,
        policy=policy,
        phases=sim.phases,
        timeline=sim.timeline,
        oom=oom,
        bytes_in=sim.totals["in"],
        bytes_populated=sim.totals["populated"],
        bytes_out=sim.totals["out"],
        resident_bytes=sim.resident,
        freed_resident_bytes=sim.totals["freed"],
        peak_used=sim.peak_used,
        peak_reserved=sim.peak_reserved,
        steps_completed=len(completed),
    )


@checked(error=PagingError)
def chunk_migrations(
    accesses: Sequence[int], capacity_chunks: int, policy: str = "allocation", chunk_bytes: int = ROOT_CHUNK
) -> tuple[int, int]:
    """(bytes migrated in, bytes evicted) of a chunk access sequence on a device holding
    `capacity_chunks` chunks, by the simulator (lesson 4: what the exercise's answer must match). The first
    access of a chunk populates it on the device (no transfer): only re-fetches count as migrated."""
    if capacity_chunks < 1:
        raise PagingError(f"capacity must be at least one chunk, got {capacity_chunks}")
    hw = Hardware.t4().with_memory(capacity_chunks * chunk_bytes)
    pol = Policy(eviction_unit=chunk_bytes, eviction=policy)
    result = simulate(chunk_trace(accesses, chunk_bytes=chunk_bytes), hw, pol, record_timeline=False)
    return result.bytes_in, result.bytes_out
