"""Every function and class that a course_lib package exports, fuzzed (tests/fuzz_api.py, issue 46): each
call ends in a one-line UserError or a sound result, and a value no call may accept is refused."""

from __future__ import annotations

import importlib
import pkgutil

import pytest
from fuzz_api import CLI_BASE, NOT_CALLED, cases, cli_cases, exported, is_fuzzed

import course_lib

FUNCTIONS = {function.name: function for function in exported()}


@pytest.mark.parametrize("name", sorted(set(FUNCTIONS) - set(NOT_CALLED)))
def test_each_exported_function_ends_well(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing a call writes lands in the repository
    tried = list(cases(FUNCTIONS[name]))
    bad = {case.key: case.outcome for case in tried if case.outcome is not None}
    assert tried
    assert not bad, f"{len(bad)} of {len(tried)} calls end badly: {bad}"


def test_the_fuzzer_knows_every_export():
    """Every callable in a package's `__all__` is fuzzed or named in NOT_CALLED with its reason."""
    exports = set()
    for info in pkgutil.walk_packages(course_lib.__path__, "course_lib."):
        module = importlib.import_module(info.name)
        for name in getattr(module, "__all__", ()):
            if is_fuzzed(getattr(module, name)):
                exports.add(getattr(module, name))
    assert exports == {function.obj for function in FUNCTIONS.values()}
    assert set(NOT_CALLED) <= set(FUNCTIONS) and len(FUNCTIONS) >= 200


@pytest.fixture(scope="module")
def command_cases(tmp_path_factory):
    """Every subcommand's options, each given each hostile value, run once for the tests below."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path_factory.mktemp("cli"))  # the folders and files named do not exist there
        return list(cli_cases())


@pytest.mark.parametrize("command", sorted(CLI_BASE))
def test_each_subcommand_ends_in_a_result_or_one_line(command, command_cases):
    tried = [case for case in command_cases if case.function == f"course-lib {command}"]
    bad = {case.key: case.outcome for case in tried if case.outcome is not None}
    assert {case.parameter for case in tried} > {"--no-such-option"}  # its own options were tried too
    assert not bad, f"{len(bad)} of {len(tried)} command lines end badly: {bad}"
