"""The whole public API of course_lib, fuzzed (issue 46): every function and class a package exports in
`__all__` (a new one is fuzzed the day it is exported), each parameter in turn given hostile values of
its kind (read from its annotation and its name) while the others keep a plausible value; and every option
of every `course-lib` subcommand (`cli_cases`).

A call must end in a one-line `UserError` raised by course_lib, or in a result without NaN, infinity or a
negative byte count; never an exception from torch, numpy or Python itself, never past its time budget;
and a value no call may accept (REFUSED: 2.5 for a whole number, a number for a name) must be refused.
Used by tests/test_fuzz_api.py; `python tests/fuzz_api.py` prints every call that ends otherwise.
"""

from __future__ import annotations

import argparse
import collections.abc
import contextlib
import dataclasses
import importlib
import inspect
import io
import math
import numbers
import pkgutil
import re
import signal
import time
import types
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

import course_lib
from course_lib.errors import UserError
from course_lib.validate import type_hints

BUDGET_S = 20  # one call's time budget (a valid call that trains a tiny model takes a second or two)

# What the fuzzer does not call, and why: each entry is a reason a call cannot be made on a CPU in a test
# (it needs CUDA, spawns processes or runs notebooks), not a failure it hides.
NOT_CALLED = {
    "course_lib.paging.measure_bandwidths": "times CUDA copies",
    "course_lib.paging.warm_up": "warms a CUDA device up",
    "course_lib.paging.release_cuda_memory": "empties CUDA's cache",
    "course_lib.paging.VirtualGPU": "maps CUDA managed memory",
    "course_lib.paging.eviction_order": "maps CUDA managed memory",
    "course_lib.paging.isolated_runs": "spawns a process per row",
    "course_lib.paging.paging_demo": "spawns a process per optimizer",
    "course_lib.paging.run_training": "needs CUDA managed memory",
    "course_lib.qlora.emulate_t4": "needs CUDA",
    "course_lib.qlora.matmul_rates": "times 4096-square matmuls for seconds",
    "course_lib.qlora.isolated_rows": "spawns a process per row",
    "course_lib.qlora.measure_row": "runs in a process of its own",
    "course_lib.qlora.train_row": "runs in a process of its own",
    "course_lib.qlora.expandable_row": "runs in a process of its own",
    "course_lib.qlora.expandable_segments_effect": "spawns processes",
    "course_lib.sharding.run_ranks": "spawns processes",
    "course_lib.sharding.measure_offload_on_cuda": "needs CUDA",
    "course_lib.sharding.free_port": "opens a socket",
    "course_lib.accumulation.trainer_cross_check": "trains with the Trainer for seconds",
}


@dataclass(frozen=True)
class Exported:
    name: str  # course_lib.package.name
    obj: Callable
    signature: inspect.Signature


def is_fuzzed(obj) -> bool:
    """A callable export that is not an exception class or a type alias (`list[tuple[int, int]]`)."""
    alias = isinstance(obj, (types.GenericAlias, types.UnionType)) or typing.get_origin(obj) is not None
    return callable(obj) and not alias and not (inspect.isclass(obj) and issubclass(obj, BaseException))


def exported() -> list[Exported]:
    """Every callable in a course_lib package's `__all__`, once (by the first package that exports it),
    but exception classes."""
    seen: set[int] = set()
    found = []
    for info in sorted(pkgutil.walk_packages(course_lib.__path__, "course_lib."), key=lambda i: i.name):
        module = importlib.import_module(info.name)
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if not is_fuzzed(obj) or id(obj) in seen:
                continue
            seen.add(id(obj))
            try:
                signature = inspect.signature(obj)
            except (TypeError, ValueError):
                continue
            plain_class = isinstance(obj, type) and not dataclasses.is_dataclass(obj)
            hints = type_hints(obj.__init__ if plain_class else obj)
            resolved = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in signature.parameters.values()]
            signature = signature.replace(parameters=resolved)
            found.append(Exported(f"{info.name}.{name}", obj, signature))
    return found


# ------------------------------------------------------------------ plausible values, by name then kind


def _tiny_stack() -> torch.nn.Module:
    return torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(3)])


PLAUSIBLE_BY_NAME: dict[str, Callable[[], object]] = {
    "saved_bytes": lambda: [400, 400, 400, 400],
    "input_bytes": lambda: [100, 100, 100, 100],
    "accesses": lambda: [0, 1, 2, 1, 0],
    "counts": lambda: [3, 2],
    "numels": lambda: [10, 20],
    "layer_counts": lambda: [2, 4],
    "micro_batches": lambda: [4, 2],
    "tokens_per_step": lambda: [16, 16],
    "stages": lambda: ("none", "zero3"),
    "mistakes": lambda: (),
    "optimizers": lambda: ("adamw",),
    "model": _tiny_stack,
    "layers": lambda: 2,
    "plan": lambda: [(0, 2)],
    "capacity": lambda: 2**30,
    "budget_bytes": lambda: 10**6,
    "nbytes": lambda: 4096,
    "block": lambda: 4096,
    "name": lambda: "adamw",
    "optimizer_name": lambda: "adamw",
    "mistake": lambda: "no_zero_grad",
    "stage": lambda: "zero1",
    "spec": lambda: "lrl",
    "labels": lambda: torch.randint(0, 10, (1, 4)),
    "input_ids": lambda: torch.randint(0, 10, (1, 4)),
    "hidden": lambda: torch.randn(1, 4, 8),
    "weight": lambda: torch.randn(10, 8),
    "batch": lambda: (torch.randn(4, 4), torch.randn(4, 4)),
    "batches": lambda: [(torch.randn(2, 4), torch.randn(2, 4))] * 2,
    "calibration_batches": lambda: [(torch.randn(2, 4), torch.randn(2, 4))],
    "stack": lambda: torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3)),
}
# Where a function needs a value of its own: a causal language model for the chunked loss.
PLAUSIBLE_FOR: dict[str, dict[str, Callable[[], object]]] = {
    **{
        f"course_lib.toolbox.{name}": {"model": lambda: _tiny_causal_lm()}
        for name in ("chunked_causal_lm_loss", "hidden_states_and_head")
    },
    "course_lib.checkpointing.assert_gradients_flow": {"batch": lambda: torch.randn(2, 4)},
    # sizes that train in milliseconds, for the calls that are not refused
    "course_lib.accumulation.measure_accumulation_cost": {
        "effective_batch": lambda: 4,
        "micro_batches": lambda: (4, 1),
        "width": lambda: 8,
        "depth": lambda: 1,
        "seq_len": lambda: 4,
        "repeats": lambda: 1,
    },
    "course_lib.paging.compare_strategies": {"layer_counts": lambda: (8,), "steps": lambda: 1},
}


def _tiny_causal_lm() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from course_lib.accumulation import tiny_causal_lm_config

    return AutoModelForCausalLM.from_config(tiny_causal_lm_config(vocab_size=10))


def plausible(parameter: inspect.Parameter, function: str = "") -> object:
    """A value the parameter could well be given: the function's own, its default, else one by its name,
    else by its kind."""
    if parameter.name in PLAUSIBLE_FOR.get(function, {}):
        return PLAUSIBLE_FOR[function][parameter.name]()
    if parameter.default is not inspect.Parameter.empty:
        return parameter.default
    if parameter.name in PLAUSIBLE_BY_NAME:
        return PLAUSIBLE_BY_NAME[parameter.name]()
    kind = kind_of(parameter)
    return {
        "int": 2,
        "float": 0.5,
        "bool": True,
        "str": "x",
        "sequence": [1, 2],
        "tensor": torch.randn(2, 4),
        "module": _tiny_stack(),
        "callable": lambda *args, **kwargs: None,
    }.get(kind)


SEQUENCES = (list, tuple, collections.abc.Sequence, collections.abc.Iterable)


def kind_of(parameter: inspect.Parameter) -> str:
    """The parameter's kind from its annotation, resolved by `exported` (`Annotated` and None stripped);
    an annotation that could not be resolved is read as text."""
    hint = parameter.annotation
    while True:
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if origin is typing.Annotated:
            hint = args[0]
        elif origin in (typing.Union, types.UnionType):  # the broadest: a float over an int, a list over a str
            listed = [arg for arg in args if (typing.get_origin(arg) or arg) in SEQUENCES]
            number = float in args or numbers.Real in args
            hint = float if number else (listed or [arg for arg in args if arg is not type(None)])[0]
        else:
            break
    origin = typing.get_origin(hint) or hint
    if origin in SEQUENCES:
        return "sequence"
    if origin is collections.abc.Callable:
        return "callable"
    if isinstance(origin, type):
        for kind, klass in (("bool", bool), ("int", int), ("float", float), ("str", str)):
            if origin is klass:
                return kind
        if issubclass(origin, torch.Tensor):
            return "tensor"
        if issubclass(origin, torch.nn.Module):
            return "module"
        return "other"
    text = str(hint).replace("typing.", "")
    if text.startswith(("Sequence", "list", "tuple", "Iterable")):
        return "sequence"
    for kind, mark in (("tensor", "Tensor"), ("module", "Module"), ("callable", "Callable")):
        if text.split(" | ")[0].strip("'").endswith(mark):
            return kind
    return "other"


HOSTILE: dict[str, list[object]] = {  # the values of each kind a user gets wrong
    "int": [True, 2.5, -1, 0, math.nan, math.inf, 10**40, "2", None],
    "float": [math.nan, math.inf, -1.0, 1e400, "0.5", True, None],
    "bool": [1, "yes", None],
    "str": [3, "", "no such name", ["a"], None],
    "sequence": ["abc", [], [None], [2.5], [-1], [math.nan], 7],
    "tensor": ["tensor", None, torch.zeros(()), torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4, device="meta")],
    "module": ["model", None, torch.nn.ReLU()],
    "callable": ["f", None, 3],
    "other": ["x", None, 3, math.nan],
}
# Of those, the ones no call may accept: a bool or a fraction for a whole number, a string for a number,
# a number for a string, a list for one value, None where the annotation does not allow it (a result
# would be a silent wrong answer: 2.5 bytes rounded, True counted as 1, a name's letters iterated).
REFUSED: dict[str, list[object]] = {
    "int": [True, 2.5, math.nan, math.inf, "2", None],
    "float": [math.nan, "0.5", True, None],
    "bool": [1, "yes", None],
    "str": [3, ["a"], None],
    "sequence": [7, [None]],
    "tensor": ["tensor", None],
    "module": ["model", None],
    "callable": ["f", 3, None],
    "other": [],
}


def _admits_none(hint) -> bool:
    if isinstance(hint, str):
        return "None" in hint
    if typing.get_origin(hint) is typing.Annotated:
        return _admits_none(typing.get_args(hint)[0])
    return hint is None or hint is type(None) or type(None) in typing.get_args(hint)


def must_refuse(parameter: inspect.Parameter, value) -> bool:
    """Whether every call must refuse `value` for `parameter` (REFUSED; None only where the annotation has
    no None)."""
    if value is None and (parameter.default is None or _admits_none(parameter.annotation)):
        return False
    return any(
        value is refused or (type(value) is type(refused) and value == refused)
        for refused in REFUSED[kind_of(parameter)]
    ) or (isinstance(value, float) and math.isnan(value) and kind_of(parameter) in ("int", "float"))


def describe(value) -> str:
    """The value in one short line (a tensor by its shape, dtype and device)."""
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)}:{str(value.dtype).removeprefix('torch.')}:{value.device.type}"
    if isinstance(value, torch.nn.Module):
        return f"{type(value).__name__}()"
    return " ".join(repr(value).split())[:40]


def hostile(parameter: inspect.Parameter, others: dict[str, object]) -> Iterator[tuple[str, object]]:
    """(what it is, value): the parameter's hostile values; a sequence also one element short of another
    sequence given beside it, a tensor one shorter than another tensor (two inputs that must have the same
    length)."""
    kind = kind_of(parameter)
    for value in HOSTILE[kind]:
        yield describe(value), value
    mine = others.get(parameter.name)
    if kind == "tensor" and isinstance(mine, torch.Tensor) and mine.dim():
        dim = next((d for d, size in enumerate(mine.shape) if size > 1), 0)
        for other, value in others.items():
            if other != parameter.name and isinstance(value, torch.Tensor):
                yield f"one shorter in dim {dim} than {other}", mine.narrow(dim, 0, max(mine.shape[dim] - 1, 0))
                break
    if kind == "sequence":
        for other, value in others.items():
            if other != parameter.name and isinstance(value, (list, tuple)) and len(value) > 1:
                mine = others.get(parameter.name)
                if isinstance(mine, (list, tuple)) and len(mine) == len(value):
                    yield f"one shorter than {other}", list(mine)[:-1]


# ------------------------------------------------------------------ one call, judged


class _OverBudget(Exception):
    pass


@contextmanager
def _budget(seconds: int):
    def expired(signum, frame):
        raise _OverBudget

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _bad_numbers(value, depth: int = 0, where: str = "result") -> str | None:
    """Where the result holds NaN, infinity or a negative byte count, or None."""
    if depth > 3:
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return f"{where} is {value}"
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0 and "bytes" in where.lower():
        return f"{where} is {value}"
    if isinstance(value, dict):
        items = [(str(key), item) for key, item in value.items()]
    elif isinstance(value, (list, tuple)):
        items = [(str(index), item) for index, item in enumerate(value[:50])]
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [(field.name, getattr(value, field.name, None)) for field in dataclasses.fields(value)]
    else:
        return None
    for key, item in items:
        found = _bad_numbers(item, depth + 1, f"{where}.{key}")
        if found:
            return found
    return None


def _reports_by_assertion(function: str) -> bool:
    """An exercise check (course_lib.checks) and an `assert_...` report a failure as an AssertionError."""
    return function.startswith("course_lib.checks.") or function.rsplit(".", 1)[-1].startswith("assert_")


def judge(call: Callable[[], object], refuse: bool = False, fails: type[Exception] | None = None) -> str | None:
    """None when `call()` ends well (a one-line UserError, or one of `fails` with a one-line message, or a
    result with sound numbers; only an error where `refuse`); else what went wrong, in one line."""
    start, ending_well = time.perf_counter(), (UserError,) if fails is None else (UserError, fails)
    try:
        with _budget(BUDGET_S):
            result = call()
    except _OverBudget:
        return f"ran past its budget of {BUDGET_S} s"
    except ending_well as error:
        message = str(error)
        if not message or "\n" in message or len(message) > 600:
            return f"a UserError of {message.count(chr(10)) + 1} lines, {len(message)} characters"
        return None
    except Exception as error:  # noqa: BLE001 (what the fuzzer looks for)
        return f"{type(error).__name__}: {' '.join(str(error).split())[:160]}"
    if time.perf_counter() - start > BUDGET_S:
        return f"ran past its budget of {BUDGET_S} s"
    if refuse:
        return "accepted it"
    return _bad_numbers(result)


@dataclass(frozen=True)
class Case:
    function: str
    parameter: str
    value: str  # what the hostile value is
    outcome: str | None  # None: ended well

    @property
    def key(self) -> str:
        """The case in one line: function(parameter=value)."""
        return f"{self.function}({self.parameter}={self.value})"


def cases(function: Exported) -> Iterator[Case]:
    """Each parameter of `function` given each of its hostile values, the others plausible; a function
    without parameters called once."""
    parameters = [p for p in function.signature.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if not [p for p in parameters if p.name not in ("self", "cls")]:
        yield Case(function.name, "", "no arguments", judge(function.obj))
        return
    for parameter in parameters:
        if parameter.name in ("self", "cls"):
            continue
        base = {p.name: plausible(p, function.name) for p in parameters}
        for what, value in hostile(parameter, base):
            arguments = {**{p.name: plausible(p, function.name) for p in parameters}, parameter.name: value}
            positional = [arguments.pop(p.name) for p in parameters if p.kind is p.POSITIONAL_ONLY]
            fails = AssertionError if _reports_by_assertion(function.name) else None
            outcome = judge(lambda: function.obj(*positional, **arguments), must_refuse(parameter, value), fails)
            yield Case(function.name, parameter.name, what, outcome)


def fuzz(functions: list[Exported] | None = None) -> tuple[int, list[Case]]:
    """(how many calls were made, the cases that ended badly) over every exported function but those
    NOT_CALLED."""
    tried, bad = 0, []
    for function in functions or exported():
        if function.name in NOT_CALLED:
            continue
        for case in cases(function):
            tried += 1
            if case.outcome is not None:
                bad.append(case)
    return tried, bad


# ------------------------------------------------------------------ the command line, every subcommand

# What each subcommand needs beside the option under test, chosen so that no call does real work: a plan of
# a parameter count (no trace), a notebook and folders that do not exist (in the fuzzer's own folder).
CLI_BASE = {
    "check": [],
    "make-exercises": [],
    "grade": ["no-such-notebook.ipynb"],
    "kernelspec": ["no-such-folder"],
    "repoint": ["no-such-folder"],
    "plan": ["--params", "7e9"],
}
CLI_HOSTILE = ["nan", "inf", "1e400", "-1", "0", "2.5", "", "abc", "9" * 400, "--"]


def cli_options() -> dict[str, list[str]]:
    """Each subcommand's options (`--flag`), read from its parser (`plan`'s from its generated --help)."""
    from course_lib.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    options = {}
    for name, sub in commands.choices.items():
        options[name] = sorted({flag for action in sub._actions for flag in action.option_strings} - {"-h"})  # noqa: SLF001
    help_text = run_cli(["plan", "--help"])[1]
    options["plan"] = sorted(set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]+", help_text)) - {"--help"})
    assert set(options) == set(CLI_BASE), f"a subcommand the fuzzer does not know: {set(options) ^ set(CLI_BASE)}"
    return options


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `course-lib ARGV`, in this process."""
    from course_lib.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as exit_:
            status = exit_.code if isinstance(exit_.code, int) else 1
    return status, out.getvalue(), err.getvalue()


def cli_cases() -> Iterator[Case]:
    """Each option of each subcommand given each hostile value (and the subcommand an argument it has not):
    an exit status 0, or 2 with one error line on stderr (after any warning), never a traceback."""
    for command, flags in cli_options().items():
        for flag in [*flags, "--no-such-option"]:
            for value in CLI_HOSTILE:
                argv = [command, *CLI_BASE[command], flag, value]

                def call(argv=argv):
                    status, _, err = run_cli(argv)
                    lines = err.strip().splitlines()  # a warning may come first; the error is one line, the last
                    errors = [line for line in lines if line.startswith("course-lib: error:")]
                    ended = errors == lines[-1:] if status == 2 else not errors
                    if status not in (0, 2) or "Traceback" in err or not ended:
                        raise AssertionError(f"exit {status}, stderr {' | '.join(lines)[-200:]!r}")

                outcome = judge(call)
                yield Case(f"course-lib {command}", flag, describe(value), outcome)


if __name__ == "__main__":
    import os
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("only", nargs="*", help="fuzz only the functions whose name starts so")
    args = parser.parse_args()
    os.chdir(tempfile.mkdtemp())  # nothing a call writes lands in the repository
    chosen = [f for f in exported() if not args.only or any(f.name.startswith(o) for o in args.only)]
    start = time.perf_counter()
    tried, bad = fuzz(chosen)
    if not args.only:
        commands = list(cli_cases())
        tried, bad = tried + len(commands), bad + [case for case in commands if case.outcome is not None]
    for case in bad:
        print(f"{case.key}: {case.outcome}")
    functions = len([f for f in chosen if f.name not in NOT_CALLED])
    print(f"{functions} functions, {tried} calls, {len(bad)} ended badly, {time.perf_counter() - start:.0f} s")
