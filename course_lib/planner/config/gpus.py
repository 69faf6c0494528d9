"""The GPU catalog, the CUDA context a process pays for and each GPU's precision
(lesson 1, "the planner")."""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

from course_lib.measure import MiB
from course_lib.planner.config.errors import PlanError
from course_lib.validate import checked

# Memory a CUDA process uses outside PyTorch's allocator: the CUDA context and library handles
# (about 300 to 700 MB: PyTorch issues 28113 and 107667, docs/references.md). A mid value; measure
# yours with course_lib.measure on the GPU.
CUDA_CONTEXT_BYTES = 512 * MiB


# A GPU's link to host memory, bytes/s each way, theoretical (PCI-SIG: 8, 16 and 32 GT/s a lane with
# 128b/130b encoding). The T4's datasheet "32 GB/s" is its PCIe 3.0 x16 counted both ways.
HOST_LINKS = {"PCIe 3.0 x16": 15.75e9, "PCIe 4.0 x16": 31.5e9, "PCIe 5.0 x16": 63.0e9}


@checked(error=PlanError)
@dataclass(frozen=True)
class GPU:
    """A GPU as a training process sees it: the memory nvidia-smi reports as total, what CUDA reports
    (the OOM line), and its link to host memory (lesson 1; lesson 7's activation offloading)."""

    name: str
    memory_bytes: int
    compute_capability: tuple[int, int]
    note: str = ""
    host_link: str = "PCIe 4.0 x16"
    # what CUDA reports as the card's memory (torch.cuda.get_device_properties(0).total_memory), below
    # nvidia-smi's total; None where no public figure was found, then the fit verdict uses nvidia-smi's
    # (docs/references.md#torchcudaget_device_properties-outputs-gpu-memory-as-cuda-reports-it)
    cuda_memory_bytes: int | None = None

    def __post_init__(self) -> None:  # (9, 0), also when given as a list (JSON's): compared as a tuple
        if isinstance(self.compute_capability, list):
            object.__setattr__(self, "compute_capability", tuple(self.compute_capability))

    @property
    def host_link_bytes_per_s(self) -> float:
        """The host link's theoretical rate, bytes/s each way."""
        return HOST_LINKS[self.host_link]

    @property
    def bf16(self) -> bool:
        """bf16 hardware: compute capability >= 8.0 (a T4 only emulates it; docs/references.md)."""
        return self.compute_capability >= (8, 0)


GPUS = {
    "t4": GPU(
        "T4",
        15360 * MiB,
        (7, 5),
        "16 GB card, 15360 MiB visible with ECC on (Colab)",
        "PCIe 3.0 x16",
        cuda_memory_bytes=15095 * MiB,
    ),
    "l4": GPU("L4", 23034 * MiB, (8, 9), "24 GB card", cuda_memory_bytes=22558 * MiB),
    "a10g": GPU("A10G", 23028 * MiB, (8, 6), "24 GB card (AWS g5)"),
    "a100-40gb": GPU("A100 40GB", 40960 * MiB, (8, 0), cuda_memory_bytes=40339 * MiB),
    "a100-80gb": GPU("A100 80GB", 81920 * MiB, (8, 0), cuda_memory_bytes=81152 * MiB),
    "h100-80gb": GPU("H100 80GB", 81559 * MiB, (9, 0), host_link="PCIe 5.0 x16", cuda_memory_bytes=81082 * MiB),
    "h200": GPU("H200", 143771 * MiB, (9, 0), "141 GB card, 143771 MiB as nvidia-smi shows it", "PCIe 5.0 x16"),
    "rtx3090": GPU("RTX 3090", 24576 * MiB, (8, 6), cuda_memory_bytes=24258 * MiB),
    "rtx4090": GPU("RTX 4090", 24564 * MiB, (8, 9), cuda_memory_bytes=24563 * MiB),
    "l40s": GPU("L40S", 46068 * MiB, (8, 9), "48 GB card"),
    "a6000": GPU("RTX A6000", 49140 * MiB, (8, 6), "48 GB card"),
    "v100-16gb": GPU("V100 16GB", 16160 * MiB, (7, 0), "16 GB card", "PCIe 3.0 x16"),
}
_GPU_ALIASES = {
    "a100": "a100-80gb",
    "h100": "h100-80gb",
    "a100-40": "a100-40gb",
    "a100-80": "a100-80gb",
    "3090": "rtx3090",
    "4090": "rtx4090",
    "rtx-3090": "rtx3090",
    "rtx-4090": "rtx4090",
    "colab": "t4",
}


def get_gpu(name: str | GPU) -> GPU:
    """A catalog GPU by name ('t4', 'A100-80GB', 'rtx4090', ...); unknown names suggest close ones."""
    if isinstance(name, GPU):
        return name
    key = re.sub(r"[\s_]+", "-", str(name).strip().lower())
    key = _GPU_ALIASES.get(key, key)
    if key in GPUS:
        return GPUS[key]

    close = difflib.get_close_matches(key, list(GPUS) + list(_GPU_ALIASES), n=3, cutoff=0.4)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise PlanError(f"unknown GPU {name!r}: {hint}known: {', '.join(GPUS)}")
