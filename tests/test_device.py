"""course_lib.device: device choice, the dtype policy and the environment check (lesson 0)."""

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
    real_import = dev.importlib.import_module

    def import_without_peft(name):
        if name == "peft":
            raise ImportError("gone")
        return real_import(name)

    monkeypatch.setattr(dev.importlib, "import_module", import_without_peft)
    assert not dev.check_environment()
    assert "FAIL peft: not importable (ImportError: gone); run: pip install peft" in capsys.readouterr().out


def test_a_version_outside_the_declared_range_is_a_fail_line_with_the_fix(monkeypatch, capsys):
    monkeypatch.setattr(dev, "declared_ranges", lambda: {"peft": SpecifierSet(">=99")})
    assert not dev.check_environment()
    out = capsys.readouterr().out
    assert f"FAIL peft: {peft.__version__}, but course_lib needs peft>=99; run: pip install 'peft>=99'" in out
    assert "OK   transformers" in out  # no declared range: importable is enough


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
