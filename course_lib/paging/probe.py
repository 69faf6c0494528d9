"""The real driver, probed (lesson 4, "see it on a GPU"): transfer rates of unified memory and the
order in which the driver evicts it. CUDA only; run it in a process of its own (`course_lib.isolate`),
because the managed memory it allocates through bitsandbytes is never freed.

Managed memory comes from bitsandbytes' `functional.get_paged` (`cudaMallocManaged`, a CPU tensor
over the pointer). Three ways to touch it, none of which is `prefetch_tensor` with `to_cpu` set
(that one ends the process, `course_lib.isolate`):
- `gpu_touch`: bitsandbytes' `fill` kernel writes the range on the GPU: pages fault in (no prefetch);
- `gpu_prefetch`: `prefetch_tensor` to the GPU (`cudaMemPrefetchAsync`, what the paged optimizers do);
- `host_read`: the CPU reads the range: pages resident on the GPU fault back to the host.
"""

from __future__ import annotations

import statistics
import time

import torch

from course_lib.device import synchronize
from course_lib.measure import MiB
from course_lib.paging.policies import PagingError
from course_lib.paging.virtual_gpu import VirtualGPU
from course_lib.validate import Count, checked

CHUNK = 2 * MiB


def managed_buffer(nbytes: int):
    """`nbytes` of managed memory as a uint8 CPU tensor over bitsandbytes' `cudaMallocManaged` pointer."""
    import bitsandbytes.functional as F  # off the import path: bitsandbytes loads its native library

    if not torch.cuda.is_available():
        raise RuntimeError("managed memory needs a CUDA GPU")
    return F.get_paged(int(nbytes), dtype=torch.uint8, device=torch.device("cuda", 0))


def _view(buffer, start: int, nbytes: int):
    view = buffer[start : start + nbytes]
    view.is_paged, view.page_deviceid = True, buffer.page_deviceid  # what bitsandbytes' kernels check
    return view


def gpu_touch(buffer, start: int = 0, nbytes: int | None = None) -> float:
    """Write the range on the GPU (bitsandbytes' fill kernel, faulting it in); seconds."""
    import bitsandbytes.functional as F  # off the import path: bitsandbytes loads its native library

    view = _view(buffer, start, buffer.numel() - start if nbytes is None else nbytes)
    synchronize()
    t = time.perf_counter()
    F.fill(view, 1)  # synchronizes: paged operations are asynchronous
    return time.perf_counter() - t


def gpu_prefetch(buffer, start: int = 0, nbytes: int | None = None) -> float:
    """`cudaMemPrefetchAsync` of the range to the GPU, then synchronize; seconds."""
    import bitsandbytes.functional as F  # off the import path: bitsandbytes loads its native library

    view = _view(buffer, start, buffer.numel() - start if nbytes is None else nbytes)
    synchronize()
    t = time.perf_counter()
    F.prefetch_tensor(view)
    synchronize()
    return time.perf_counter() - t


def host_read(buffer, start: int = 0, nbytes: int | None = None, stride: int = 4096) -> float:
    """Read one byte per `stride` of the range on the CPU; seconds. Pages on the GPU fault to the host."""
    array = buffer.numpy()
    end = buffer.numel() if nbytes is None else start + nbytes
    t = time.perf_counter()
    int(array[start:end:stride].sum())
    return time.perf_counter() - t


def measure_bandwidths(nbytes: int = 512 * MiB, repeats: int = 3) -> dict[str, float]:
    """Bytes per second, measured (lesson 4): pinned copies both ways; unified memory to the GPU by
    prefetch and by faults, and back to the host by CPU faults. bitsandbytes' docs put a prefetch at
    about half of the link."""
    if not torch.cuda.is_available():
        raise RuntimeError("measure_bandwidths needs a CUDA GPU")

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            synchronize()
            t = time.perf_counter()
            fn()
            synchronize()
            times.append(time.perf_counter() - t)
        return nbytes / min(times)

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    result = {
        "pinned_h2d": best(lambda: dev.copy_(host, non_blocking=True)),
        "pinned_d2h": best(lambda: host.copy_(dev, non_blocking=True)),
    }
    host = dev = None  # the buffers freed before empty_cache
    torch.cuda.empty_cache()
    paged = managed_buffer(nbytes)
    gpu_touch(paged)  # populated on the GPU
    prefetch, fault, back = [], [], []
    for _ in range(repeats):
        back.append(host_read(paged, stride=1 << 12))  # every 4 KB page back to the host
        prefetch.append(gpu_prefetch(paged))
        host_read(paged)
        fault.append(gpu_touch(paged))
    result["um_prefetch_h2d"] = nbytes / min(prefetch)
    result["um_fault_h2d"] = nbytes / min(fault)
    result["um_host_fault_d2h"] = nbytes / min(back)
    return result  # the managed buffer is never freed (bitsandbytes has no free): run this in its own process


@checked(error=PagingError)
def eviction_order(capacity_chunks: Count = 64, extra_chunks: int = 16) -> dict:
    """Which chunks the driver evicts, measured (lesson 4, "allocation order or LRU?").

    On a GPU made `capacity_chunks` 2 MB chunks big (`virtual_gpu.VirtualGPU`), the chunks of one managed
    buffer of `capacity_chunks + extra_chunks` are written on the GPU in order; chunk 0 is written
    again halfway (an LRU would now keep it), which forces about `extra_chunks` evictions at the end.
    A one-byte host read of each chunk then takes microseconds when the chunk is still on the GPU (it
    faults back) and far less when it was evicted to the host. Allocation order evicts chunks 0, 1, ...;
    LRU evicts 1, 2, ... and keeps 0."""
    n = capacity_chunks + extra_chunks
    gpu_touch(managed_buffer(CHUNK))  # load bitsandbytes' kernels before the GPU is made small
    with VirtualGPU(capacity_chunks * CHUNK):
        buffer = managed_buffer(n * CHUNK)
        for i in range(n):
            gpu_touch(buffer, i * CHUNK, CHUNK)
            if i == capacity_chunks // 2:
                gpu_touch(buffer, 0, CHUNK)
        synchronize()
        array = buffer.numpy()
        times = []
        for i in range(n):
            t = time.perf_counter_ns()
            int(array[i * CHUNK])
            times.append((time.perf_counter_ns() - t) / 1e3)
    cut = 0.5 * statistics.median(times[-extra_chunks:])  # the last chunks written are surely on the GPU
    evicted = [i for i, us in enumerate(times) if us < cut]
    verdict = (
        "no eviction seen"
        if not evicted
        else "allocation order"
        if evicted[:2] == [0, 1]
        else "LRU"
        if evicted[0] == 1
        else "neither (see read_us)"
    )
    return {
        "capacity_chunks": capacity_chunks,
        "extra_chunks": extra_chunks,
        "read_us": times,
        "evicted": evicted,
        "verdict": verdict,
    }
