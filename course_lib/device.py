"""Device choice, Colab detection and the dtype policy (lesson 0, "Setup")."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from dataclasses import dataclass

import torch
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from course_lib.errors import UserError


def in_colab() -> bool:
    """True inside a Google Colab runtime (lesson 0, "Setup")."""
    return "google.colab" in sys.modules


def pick_device(prefer: str | None = None) -> torch.device:
    """The device the lessons run on: CUDA when present, else CPU (lesson 0, "Setup").

    `prefer="cpu"` forces the CPU; `prefer="cuda"` raises a clear error when no GPU is present.
    """
    if prefer not in (None, "cpu", "cuda"):
        raise UserError(f"unknown device {prefer!r}: use 'cpu', 'cuda' or None (pick automatically)")
    if prefer == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("no CUDA GPU is visible: run on CPU (prefer=None) or switch to a GPU runtime")
    if prefer == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda")


def synchronize() -> None:
    """Wait for the work queued on the GPU, so that a clock read after it is fair (lessons 4 and 5);
    nothing to wait for on a CPU."""
    if torch.cuda.is_available():  # also when only bitsandbytes has touched the GPU (lesson 4's probe)
        torch.cuda.synchronize()


def compute_capability(device: torch.device | None = None) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, None on CPU (lesson 0, "Setup")."""
    device = torch.device(device) if device is not None else pick_device()
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


@dataclass(frozen=True)
class DtypePolicy:
    """How to train on a device: parameter dtype, autocast dtype, whether to scale the loss."""

    param_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    grad_scaler: bool
    reason: str


def dtype_policy(device: torch.device | None = None) -> DtypePolicy:
    """Pick the training precision for a device (lesson 0, "Setup"; lesson 5 explains it): the
    policy for its compute capability, `policy_for_capability`."""
    device = torch.device(device) if device is not None else pick_device()
    return policy_for_capability(compute_capability(device))


def policy_for_capability(capability: tuple[int, int] | None) -> DtypePolicy:
    """The training precision for a compute capability; None is a CPU (lesson 5, "the T4 recipe").

    bf16 only at compute capability >= 8.0 (Ampere and newer). A T4 (7.5) has no bf16 hardware even
    when `torch.cuda.is_bf16_supported()` says True (emulation), so it gets fp16 autocast with fp32
    trainable parameters and a GradScaler. The CPU trains in fp32 so that every byte count is exact.
    Asking for (7, 5) on a larger GPU runs the T4's recipe there (benchmarks/gpu_qlora.py --as-t4).
    """
    if capability is None:
        return DtypePolicy(torch.float32, None, False, "CPU: fp32 throughout, exact and simple")
    if capability >= (8, 0):
        return DtypePolicy(
            torch.float32,
            torch.bfloat16,
            False,
            f"compute capability {capability[0]}.{capability[1]} >= 8.0: bf16 autocast",
        )
    return DtypePolicy(
        torch.float32,
        torch.float16,
        True,
        f"compute capability {capability[0]}.{capability[1]} < 8.0 has no bf16 hardware: "
        "fp16 autocast, fp32 trainable parameters, GradScaler",
    )


@dataclass(frozen=True)
class Check:
    """One line of the environment check."""

    ok: bool
    name: str
    detail: str

    def __str__(self) -> str:
        return f"{'OK  ' if self.ok else 'FAIL'} {self.name}: {self.detail}"


def _imported_but_changed(package: str, module_name: str) -> str | None:
    """The installed version when it differs from the one already imported in this process."""
    module = sys.modules.get(module_name)
    imported = getattr(module, "__version__", None) if module else None
    if imported is None:
        return None
    try:
        installed = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None
    # torch reports "2.11.0+cu128" while the metadata may say "2.11.0": compare the release part.
    if installed.split("+")[0] != str(imported).split("+")[0]:
        return f"{package} {imported} is imported but {installed} is installed"
    return None


def _installed_version(package: str) -> str | None:
    """The installed version of `package`, found without importing it (None when it is not installed):
    importing bitsandbytes starts torch.compile's machinery, and peft imports it, about 10 s of CPU
    that every setup cell paid. An install that is there but broken fails at the lesson's own import."""
    try:
        version = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None
    return version if package in sys.modules or importlib.util.find_spec(package) is not None else None


def declared_ranges() -> dict[str, SpecifierSet]:
    """The version range course_lib declares for each package it needs (pyproject.toml, read back from
    the installed package's metadata); empty when course_lib is not installed (lesson 0, "Setup")."""
    try:
        lines = importlib.metadata.requires("course-lib") or []
    except importlib.metadata.PackageNotFoundError:
        return {}
    ranges = {}
    for line in lines:
        requirement = Requirement(line)
        marker = requirement.marker
        if marker is None or ("extra" not in str(marker) and marker.evaluate()):
            ranges[requirement.name.lower()] = requirement.specifier
    return ranges


def _version_check(package: str, version: str, ranges: dict[str, SpecifierSet]) -> Check:
    wanted = ranges.get(package)
    if wanted is None or wanted.contains(Version(version), prereleases=True):
        return Check(True, package, version)
    return Check(
        False,
        package,
        f"{version}, but course_lib needs {package}{wanted}; run: pip install '{package}{wanted}', then restart",
    )


def environment_checks() -> list[Check]:
    """The checks behind `check_environment` (lesson 0, "Setup"): each package installed (not imported:
    `_installed_version`) and inside the range course_lib declares, the device, the precision, and whether a restart is needed."""
    checks = [Check(True, "python", sys.version.split()[0])]
    ranges = declared_ranges()
    if not ranges:
        checks.append(
            Check(
                False,
                "course-lib",
                "not installed, so its version ranges cannot be checked: "
                "run `pip install -e .` in the course folder (or the setup cell)",
            )
        )
    checks.append(_version_check("torch", torch.__version__, ranges))
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        major, minor = torch.cuda.get_device_capability()
        checks.append(Check(True, "CUDA", f"{name}, compute capability {major}.{minor}, CUDA {torch.version.cuda}"))
    else:
        checks.append(Check(True, "CUDA", "no GPU: running on CPU, GPU-only cells will be skipped"))
    policy = dtype_policy()
    checks.append(Check(True, "precision", policy.reason))
    for package in ("transformers", "accelerate", "peft", "bitsandbytes", "nbval"):
        if (version := _installed_version(package)) is None:
            checks.append(Check(False, package, f"not installed; run: pip install {package}"))
        else:
            checks.append(_version_check(package, version, ranges))
    changed = [
        msg
        for pkg, mod in (
            ("torch", "torch"),
            ("transformers", "transformers"),
            ("bitsandbytes", "bitsandbytes"),
            ("numpy", "numpy"),
        )
        if (msg := _imported_but_changed(pkg, mod))
    ]
    if changed:
        checks.append(
            Check(
                False,
                "restart",
                "; ".join(changed) + ": restart the runtime (Colab: Runtime > Restart session), then run again",
            )
        )
    else:
        checks.append(Check(True, "restart", "not needed"))
    return checks


def check_environment() -> bool:
    """Print one OK/FAIL line per requirement; True when all pass (lesson 0, "Setup")."""
    checks = environment_checks()
    for check in checks:
        print(check)
    return all(check.ok for check in checks)
