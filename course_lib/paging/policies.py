"""The simulated GPU and the driver's rules: `Hardware`, `Policy`, and the constants they rest on
(lesson 4, "what the driver really does").

Every figure here is an input of the simulator, not a measurement: the T4's from NVIDIA's T4
datasheet, the link efficiency from bitsandbytes' documentation, the driver's rules from nvidia-uvm
(docs/references.md, "Lessons 4 and 5"). `benchmarks/gpu_check.sh` measures them on a real GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from course_lib import validate
from course_lib.caching_allocator import MIN_BLOCK, round_size
from course_lib.caching_allocator import segment_size as segment_bytes  # noqa: F401 (course_lib.paging re-exports it)
from course_lib.errors import UserError
from course_lib.measure import GiB, KiB, MiB
from course_lib.validate import checked

GB = 10**9
VA_BLOCK = 2 * MiB  # UVM VA block: the driver's unit of fault servicing and prefetch growth
ROOT_CHUNK = 2 * MiB  # the driver's unit of eviction
GRANULARITIES = (4 * KiB, 64 * KiB, 2 * MiB)
EVICTION_POLICIES = ("allocation", "lru", "mru")
OPTIMIZERS = ("adamw", "adamw_32bit", "adamw_8bit", "paged_adamw_32bit", "paged_adamw_8bit")
BNB_PAGED_MIN_NUMEL = 100_000  # bitsandbytes pages only state tensors with numel >= 1e5
BNB_MIN_8BIT_SIZE = 4096  # smaller tensors keep 32-bit state in 8-bit optimizers
BNB_BLOCKSIZE = 256  # 8-bit blockwise state: one float32 absmax per 256 values
PCIE3_X16 = 15.75e9  # bytes/s each way, theoretical (the T4's link)
T4_FP32_FLOPS = 8.1e12  # the T4's fp32 peak (no TF32); its fp16 tensor cores reach 65e12
T4_MEMORY_BANDWIDTH = 320e9  # GDDR6

ALLOCATOR_ROUND = MIN_BLOCK  # torch's caching allocator: kMinBlockSize (course_lib.caching_allocator)


class PagingError(UserError):
    """Bad input to the simulator: a parameter out of range or a trace that makes no sense (lesson 4)."""


class OutOfDeviceMemory(RuntimeError):
    """The simulated step does not fit: ordinary allocations (or one parameter's paged state)
    exceed the device memory even after every evictable chunk has left (lesson 4, "why it still
    OOMs")."""

    def __init__(self, message: str, *, step: int, phase: str, name: str, requested: int, available: int) -> None:
        super().__init__(message)
        self.step, self.phase, self.name = step, phase, name
        self.requested, self.available = requested, available


def require_positive(name: str, value: float) -> None:
    validate.positive(name, value, error=PagingError)


def _share_of_the_link(prefetch_efficiency: float) -> None:
    """Unified-memory transfers move at most at the link's rate: a share above 0, at most 1."""
    validate.finite(
        "prefetch_efficiency (a share of the link's bandwidth)",
        prefetch_efficiency,
        above=0,
        at_most=1,
        error=PagingError,
    )


@checked(error=PagingError)
@dataclass(frozen=True)
class Hardware:
    """A GPU and its host link, as the simulator sees them (lesson 4, "the simulator").

    `memory` is what the process can use (the GPU's total minus the CUDA context). Bandwidths are
    effective bytes per second: `h2d_bandwidth` of a unified-memory migration (prefetch or fault),
    `d2h_bandwidth` of an eviction, `pinned_bandwidth` of a `cudaMemcpy` from pinned memory (manual
    offload). `cpu_adam_rate` is parameters per second of a fused AdamW step on the host.
    `fault_latency` is 0 by default: the driver services faults in batches, and the simulator has
    no time model for that (its fault counts are illustrative; set a latency to explore).
    """

    name: str
    memory: int
    h2d_bandwidth: float
    d2h_bandwidth: float
    device_bandwidth: float
    device_flops: float
    fault_latency: float = 0.0
    pinned_bandwidth: float = 0.8 * PCIE3_X16
    cpu_adam_rate: float = 5e8
    link_bandwidth: float = PCIE3_X16

    def __post_init__(self) -> None:
        if not isinstance(self.memory, (int, np.integer)) or isinstance(self.memory, bool) or self.memory <= 0:
            raise PagingError(f"memory must be a positive number of bytes, got {self.memory!r}")
        for name in (
            "h2d_bandwidth",
            "d2h_bandwidth",
            "device_bandwidth",
            "device_flops",
            "pinned_bandwidth",
            "cpu_adam_rate",
            "link_bandwidth",
        ):
            require_positive(name, getattr(self, name))
        if (
            not isinstance(self.fault_latency, (int, float))
            or not math.isfinite(self.fault_latency)
            or self.fault_latency < 0
        ):
            raise PagingError(f"fault_latency must be a non-negative number of seconds, got {self.fault_latency!r}")

    @classmethod
    def t4(cls, context: int = 500 * MiB, prefetch_efficiency: float = 0.5, flops: float = T4_FP32_FLOPS) -> Hardware:
        """A T4 on Colab, as inputs: 15360 MiB shown, minus the CUDA context (300 to 700 MB); 320 GB/s
        GDDR6; 8.1 TFLOP/s, its fp32 peak (the lesson's setups train in fp32; pass 65e12 for fp16
        tensor-core work); PCIe 3.0 x16 (15.75 GB/s each way) with unified-memory transfers at about
        half of it (bitsandbytes' docs). Assumed, with no source: pinned copies at 80% of the link,
        500 M parameters/s of host AdamW (lesson 4 measures your CPU's)."""
        context = validate.non_negative_int("context (bytes)", context, error=PagingError)
        _share_of_the_link(prefetch_efficiency)
        require_positive("flops", flops)
        return cls(
            name="T4 (PCIe 3.0 x16)",
            memory=15360 * MiB - context,
            h2d_bandwidth=prefetch_efficiency * PCIE3_X16,
            d2h_bandwidth=prefetch_efficiency * PCIE3_X16,
            device_bandwidth=T4_MEMORY_BANDWIDTH,
            device_flops=flops,
        )

    @classmethod
    def pcie3_x16(
        cls, memory: int = 16 * GiB, link_bandwidth: float = 16e9, prefetch_efficiency: float = 0.5
    ) -> Hardware:
        """The setting of bitsandbytes' documented estimate: PCIe 3.0 x16 "at 16 GB/s", unified
        memory at half of it. The 125 ms per GB evicted follows from these inputs (1/(16*0.5) s)."""
        _share_of_the_link(prefetch_efficiency)
        return cls(
            name="PCIe 3.0 x16 (bitsandbytes' estimate)",
            memory=memory,
            h2d_bandwidth=prefetch_efficiency * link_bandwidth,
            d2h_bandwidth=prefetch_efficiency * link_bandwidth,
            device_bandwidth=T4_MEMORY_BANDWIDTH,
            device_flops=T4_FP32_FLOPS,
            link_bandwidth=link_bandwidth,
            pinned_bandwidth=0.8 * link_bandwidth,
        )

    def with_memory(self, memory: int) -> Hardware:
        return replace(self, memory=int(memory))

    def scaled_link(self, factor: float) -> Hardware:
        """The same GPU behind a link `factor` times as fast (all host transfers scale)."""
        require_positive("factor", factor)
        return replace(
            self,
            h2d_bandwidth=self.h2d_bandwidth * factor,
            d2h_bandwidth=self.d2h_bandwidth * factor,
            pinned_bandwidth=self.pinned_bandwidth * factor,
            link_bandwidth=self.link_bandwidth * factor,
        )


@checked(error=PagingError)
@dataclass(frozen=True)
class Policy:
    """How the driver moves managed memory (lesson 4, "4 KB and LRU?").

    `granularity`: bytes a fault migrates at least (4 KB pages, 64 KB big pages, 2 MB blocks).
    `eviction_unit`: bytes evicted at once (the driver: 2 MB root chunks).
    `eviction`: "allocation" (the driver: a chunk goes to the tail when it is made resident), "lru"
    (moved to the tail on every access: the seed's claim) or "mru" (evict the most recently used:
    what a cyclic trace wants). `density_prefetch`: the driver's prefetcher (uvm_perf_prefetch.c)
    keeps a bitmap tree over each 2 MB block and, on a fault, grows the migration to the largest
    subregion of the tree that would then be more than `density_threshold` resident.
    """

    granularity: int = 64 * KiB
    eviction_unit: int = ROOT_CHUNK
    eviction: str = "allocation"
    density_prefetch: bool = True
    density_threshold: float = 0.51

    def __post_init__(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise PagingError(
                f"granularity must be one of 4 KiB, 64 KiB, 2 MiB ({GRANULARITIES}), got {self.granularity!r}"
            )
        if self.eviction_unit not in GRANULARITIES:
            raise PagingError(f"eviction_unit must be one of {GRANULARITIES}, got {self.eviction_unit!r}")
        if self.eviction not in EVICTION_POLICIES:
            raise PagingError(f"eviction must be one of {EVICTION_POLICIES}, got {self.eviction!r}")
        if not 0 < self.density_threshold <= 1:
            raise PagingError(f"density_threshold must be in (0, 1], got {self.density_threshold!r}")

    @classmethod
    def driver(cls) -> Policy:
        """What nvidia-uvm does: 64 KB big pages, the density prefetcher, 2 MB chunks in allocation order."""
        return cls()

    @classmethod
    def seed(cls) -> Policy:
        """The seed's model: 4 KB pages moved one by one, an LRU keeps hot pages resident."""
        return cls(granularity=4 * KiB, eviction_unit=4 * KiB, eviction="lru", density_prefetch=False)


def block_bytes(nbytes: int) -> int:
    """The bytes PyTorch's caching allocator hands out for a request of `nbytes` (lesson 4; its rules:
    `course_lib.caching_allocator`, which the planner's replay calls unchecked)."""
    return round_size(validate.non_negative_int("nbytes", nbytes, error=PagingError))


def sweep_faults(leaves: int, missing: int, threshold: float = 0.51) -> int:
    """Faults of a sequential sweep over one 2 MB block of `leaves` pages, of which the first
    `missing` are not resident, with the driver's density prefetcher (lesson 4): each fault makes its
    page resident, then grows the migration to the largest aligned power-of-two subregion of the
    block's bitmap tree that is more than `threshold` resident (counting the faulted page). A whole 2 MB block of 64 KB pages
    takes 6 faults, of 4 KB pages 17."""
    leaves = validate.positive_int("leaves (pages of the 2 MB block)", leaves, maximum=4096, error=PagingError)
    missing = validate.non_negative_int("missing", missing, error=PagingError)
    validate.probability("threshold", threshold, error=PagingError)
    if not 0 <= missing <= leaves:
        raise PagingError(f"missing must be between 0 and {leaves}, got {missing}")
    return _sweep_faults(int(leaves), int(missing), float(threshold))


_SWEEPS: dict[tuple[int, int, float], int] = {}


def _sweep_faults(leaves: int, missing: int, threshold: float) -> int:
    key = (leaves, missing, threshold)
    if key in _SWEEPS:
        return _SWEEPS[key]
    size = 1 << max(0, (leaves - 1).bit_length())
    resident = np.zeros(size, dtype=bool)
    resident[missing:leaves] = True
    faults, page = 0, 0
    while page < missing:
        if resident[page]:
            page += 1
            continue
        faults += 1
        resident[page] = True
        best, span = (page, 1), 2
        while span <= size:  # every level from the leaf to the root: the largest over the threshold wins
            start = page - page % span
            if resident[start : start + span].sum() > threshold * span:
                best = (start, span)
            span *= 2
        resident[best[0] : best[0] + best[1]] = True
        page += 1
    _SWEEPS[key] = faults
    return faults
