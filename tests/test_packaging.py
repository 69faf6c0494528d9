"""Packaging: Colab's stack is accepted, dev pins torch, environment.yml matches pyproject (README)."""

import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
REQUIREMENTS = [Requirement(r) for r in PROJECT["dependencies"]] + [
    Requirement(r) for extra in PROJECT["optional-dependencies"].values() for r in extra
]
CONDA_NAMES = {"torch": "pytorch"}  # conda-forge's name where it differs from PyPI's

# Google Colab's preinstalled stack (docs/references.md, "Google Colab GPU runtime") and this machine's pinned torch.
COLAB = {"torch": "2.11.0", "transformers": "5.15.0", "accelerate": "1.14.0", "peft": "0.20.0"}


def by_name():
    return {r.name: r for r in REQUIREMENTS}


@pytest.mark.parametrize("package, version", sorted(COLAB.items()))
def test_colab_preinstalled_versions_are_accepted(package, version):
    assert by_name()[package].specifier.contains(version), f"installing on Colab would replace its {package}"


def test_python_range_covers_colab_and_this_machine():
    for version in ("3.11", "3.13"):
        assert Version(version) in SpecifierSet(PROJECT["requires-python"])


def test_dev_constraints_pin_the_cpu_torch_and_versions_the_ranges_accept():
    pins = dict(re.findall(r"^([\w-]+)==(\S+)", (ROOT / "constraints.txt").read_text(), re.MULTILINE))
    assert pins["torch"] == "2.13.0"
    requirements = by_name()
    assert set(requirements) <= set(pins), "pin every dependency the suite runs with"
    for name, version in pins.items():
        assert requirements[name].specifier.contains(version), f"constraints.txt pins {name} outside its range"


def test_the_floors_run_pins_the_lowest_versions_the_ranges_admit():
    """make test runs the lessons on constraints-floors.txt too: transformers, accelerate and peft at
    pyproject.toml's floors (Colab's), and this machine's CPU torch."""
    pins = dict(re.findall(r"^([\w-]+)==(\S+)", (ROOT / "constraints-floors.txt").read_text(), re.MULTILINE))
    assert pins["torch"] == "2.13.0"
    requirements = by_name()
    for name in ("transformers", "accelerate", "peft"):
        floors = [Version(s.version) for s in requirements[name].specifier if s.operator == ">="]
        assert floors == [Version(pins[name])], (
            f"constraints-floors.txt pins {name} {pins[name]}, not its floor {floors}"
        )
        assert pins[name] == COLAB[name]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^test: .*\n(\t.*\n)*\t\$\(MAKE\) test-floors$", makefile, re.MULTILINE)
    assert re.search(r"^FLOORS_TESTS := notebooks ", makefile, re.MULTILINE)


def test_environment_yml_lists_the_same_packages_and_bounds():
    environment = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda = {}
    for entry in environment["dependencies"]:
        if isinstance(entry, str) and entry not in ("pip",):
            name, spec = re.fullmatch(r"([\w-]+)(.*)", entry).groups()
            conda[name] = spec
    pip_section = next(e["pip"] for e in environment["dependencies"] if isinstance(e, dict))
    assert pip_section == ["-e ."]
    assert conda.pop("python") == PROJECT["requires-python"]
    expected = {CONDA_NAMES.get(r.name, r.name): str(r.specifier) for r in REQUIREMENTS}
    assert conda == expected


def test_readme_gives_the_two_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    assert "make lab" in readme and "make test" in readme
    assert re.search(r"^make test$", (ROOT / ".ci" / "run").read_text(), re.MULTILINE)


def test_the_wheel_colab_installs_carries_every_module_and_config(tmp_path):
    """Colab installs course_lib from git as a wheel, not in editable mode: nothing may be left out."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    wheel = next(tmp_path.glob("course_lib-*.whl"))
    packed = set(zipfile.ZipFile(wheel).namelist())
    source = {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "course_lib").rglob("*")
        if p.suffix in (".py", ".json") and "__pycache__" not in p.parts
    }
    assert source and source <= packed, sorted(source - packed)
