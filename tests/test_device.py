"""course_lib.device: device choice, the dtype policy and the environment check (lesson 0)."""

import subprocess
import sys
import tomllib
import types
from pathlib import Path

import peft
import pytest
import torch
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from course_lib import device as dev


def test_pick_device_follows_cuda_availability():
    assert dev.pick_device().type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert dev.pick_device("cpu").type == "cpu"
    with pytest.raises(ValueError, match="unknown device"):
        dev.pick_device("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="asserts the CPU-only error")
def test_asking_for_cuda_without_a_gpu_says_what_to_do():
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        dev.pick_device("cuda")
    assert dev.compute_capability(torch.device("cpu")) is None


@pytest.mark.parametrize(
    "capability, autocast, scaler",
    [
        ((7, 5), torch.float16, True),  # T4: no bf16 hardware, whatever is_bf16_supported() says
        ((7, 0), torch.float16, True),  # V100
        ((8, 0), torch.bfloat16, False),  # A100
        ((9, 0), torch.bfloat16, False),  # H100
    ],
)
def test_dtype_policy_decides_bf16_by_compute_capability(monkeypatch, capability, autocast, scaler):
    monkeypatch.setattr(dev, "compute_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    policy = dev.dtype_policy(torch.device("cuda"))
    assert policy.autocast_dtype is autocast
    assert policy.grad_scaler is scaler
    assert policy.param_dtype is torch.float32  # trainable parameters stay fp32


def test_dtype_policy_on_cpu_is_plain_fp32():
    policy = dev.dtype_policy(torch.device("cpu"))
    assert (policy.param_dtype, policy.autocast_dtype, policy.grad_scaler) == (torch.float32, None, False)


def test_colab_detection(monkeypatch):
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    assert not dev.in_colab()
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    assert dev.in_colab()


def test_environment_check_prints_ok_lines(capsys):
    assert dev.check_environment()
    lines = capsys.readouterr().out.splitlines()
    assert lines and all(line.startswith(("OK  ", "FAIL")) for line in lines)
    assert any(line.startswith("OK   torch") for line in lines)
    assert any("restart: not needed" in line for line in lines)


def test_environment_check_asks_for_a_restart_after_an_upgrade(monkeypatch, capsys):
    stale = types.ModuleType("transformers")
    stale.__version__ = "0.0.1"  # what was imported before a pip install replaced it
    monkeypatch.setitem(sys.modules, "transformers", stale)
    assert not dev.check_environment()
    out = capsys.readouterr().out
    assert "FAIL restart" in out and "transformers 0.0.1 is imported" in out and "Restart session" in out


def test_missing_package_is_a_fail_line_with_the_fix(monkeypatch, capsys):
    real_version = dev.importlib.metadata.version

    def version_without_peft(name):
        if name == "peft":
            raise dev.importlib.metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(dev.importlib.metadata, "version", version_without_peft)
    assert not dev.check_environment()
    assert "FAIL peft: not installed; run: pip install peft" in capsys.readouterr().out


def test_metadata_without_the_module_is_not_installed(monkeypatch, capsys):
    real_find_spec = dev.importlib.util.find_spec
    monkeypatch.delitem(sys.modules, "nbval", raising=False)  # pytest's plugin: imported here
    monkeypatch.setattr(dev.importlib.util, "find_spec", lambda name: None if name == "nbval" else real_find_spec(name))
    assert not dev.check_environment()
    assert "FAIL nbval: not installed; run: pip install nbval" in capsys.readouterr().out


def test_the_check_imports_none_of_the_packages_it_checks():
    """Importing bitsandbytes starts torch.compile's machinery (seconds in every setup cell): the
    check reads the installed versions instead."""
    code = (
        "import sys\nfrom course_lib.device import check_environment\ncheck_environment()\n"
        "print(sorted(m for m in ('transformers', 'accelerate', 'peft', 'bitsandbytes', 'nbval') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[]", result.stdout


def test_a_version_outside_the_declared_range_is_a_fail_line_with_the_fix(monkeypatch, capsys):
    monkeypatch.setattr(dev, "declared_ranges", lambda: {"peft": SpecifierSet(">=99")})
    assert not dev.check_environment()
    out = capsys.readouterr().out
    assert f"FAIL peft: {peft.__version__}, but course_lib needs peft>=99; run: pip install 'peft>=99'" in out
    assert "OK   transformers" in out  # no declared range: installed is enough


def test_declared_ranges_are_pyprojects(monkeypatch, capsys):
    """What `course-lib check` enforces is what pyproject.toml declares (an install older than the
    pyproject fails here: reinstall with `make test`)."""
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    declared = {
        r.name.lower(): r.specifier
        for r in map(Requirement, project["dependencies"])
        if r.marker is None or r.marker.evaluate()
    }
    assert dev.declared_ranges() == declared
    assert {"torch", "transformers", "accelerate", "peft", "nbval"} <= set(declared)

    def not_installed(name):
        raise dev.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(dev.importlib.metadata, "requires", not_installed)
    assert not dev.check_environment()
    assert "FAIL course-lib: not installed" in capsys.readouterr().out
