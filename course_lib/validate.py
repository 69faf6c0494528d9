"""Argument checks at the public boundary of `course_lib` (docs/planner.md, "Bad input").

Each check returns the value, normalised (a whole float as an int, a single string as a one-item
tuple), or raises the library's error class (`UserError`, or the subclass passed as `error`) with one
line naming the argument, the value it got and what to give instead. `course-lib` prints that line
and exits with status 2; in Python it is the exception's message.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import functools
import inspect
import math
import numbers
import sys
import types
import typing
from collections.abc import Iterable, Sequence

from course_lib.errors import UserError, UserTypeError


def _shown(value) -> str:
    text = " ".join(repr(value).split())  # one line, whatever the repr
    return text if len(text) <= 60 else text[:57] + "..."


def _finite(value: numbers.Real) -> bool:
    """Whether a real number is finite (an int always is, however big: math.isfinite would overflow)."""
    return isinstance(value, numbers.Integral) or math.isfinite(value)


def _number(name: str, value, want: str, error: type[UserError]) -> float:
    """A real number (never a bool, a string or a tensor), or the error saying what to give."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise error(f"{name} must be {want}, got {_shown(value)} ({type(value).__name__})")
    if not _finite(value):
        raise error(f"{name} must be {want}, got {_shown(value)} (not a finite number)")
    return value


def integer(
    name: str, value, *, minimum: int | None = None, maximum: int | None = None, error: type[UserError] = UserError
) -> int:
    """A whole number (an int, or a float with no fraction) from `minimum` to `maximum`, as an int."""
    want = (
        "a whole number"
        + (f" >= {minimum}" if minimum is not None else "")
        + (f"{' and' if minimum is not None else ''} <= {maximum:,}" if maximum is not None else "")
    )
    number = _number(name, value, want, error)
    if number != int(number):
        raise error(f"{name} must be {want}, got {_shown(value)} (it has a fraction)")
    if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        raise error(f"{name} must be {want}, got {_shown(value)}")
    return int(number)


def positive_int(name: str, value, *, maximum: int | None = None, error: type[UserError] = UserError) -> int:
    """A whole number >= 1 (a count of items, steps, layers, ...), at most `maximum` when given."""
    return integer(name, value, minimum=1, maximum=maximum, error=error)


def non_negative_int(name: str, value, *, error: type[UserError] = UserError) -> int:
    """A whole number >= 0 (0 meaning none)."""
    return integer(name, value, minimum=0, error=error)


def finite(
    name: str,
    value,
    *,
    above: float | None = None,
    at_least: float | None = None,
    at_most: float | None = None,
    error: type[UserError] = UserError,
) -> float:
    """A finite real number within the bounds given (`above`: strictly)."""
    bounds = [
        f"above {above:g}" if above is not None else "",
        f">= {at_least:g}" if at_least is not None else "",
        f"<= {at_most:g}" if at_most is not None else "",
    ]
    bounds = [bound for bound in bounds if bound]
    want = "a finite number" + (" " + " and ".join(bounds) if bounds else "")
    number = _number(name, value, want, error)
    if (
        (above is not None and not number > above)
        or (at_least is not None and number < at_least)
        or (at_most is not None and number > at_most)
    ):
        raise error(f"{name} must be {want}, got {_shown(value)}")
    return number


def positive(name: str, value, *, error: type[UserError] = UserError) -> float:
    """A finite number above zero (a time, a rate, a size in bytes)."""
    return finite(name, value, above=0, error=error)


def probability(name: str, value, *, below_one: bool = False, error: type[UserError] = UserError) -> float:
    """A probability: from 0 to 1 (`below_one`: 1 excluded, as for a dropout)."""
    want = "a probability from 0 up to (not including) 1" if below_one else "a probability from 0 to 1"
    number = _number(name, value, want, error)
    if not 0 <= number <= 1 or (below_one and number == 1):
        raise error(f"{name} must be {want}, got {_shown(value)}")
    return number


def strict_bool(name: str, value, *, error: type[UserError] = UserError) -> bool:
    """True or False only: "no", "off", 0 and None are refused (a non-empty string would mean True)."""
    if not isinstance(value, bool):
        raise error(f"{name} must be True or False, got {_shown(value)} ({type(value).__name__})")
    return value


def non_empty(name: str, value: Iterable, what: str = "items", *, error: type[UserError] = UserError) -> list:
    """A sequence (or any iterable but a string) with at least one item, as a list."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise error(f"{name} must be a list of {what}, got {_shown(value)} ({type(value).__name__})")
    items = list(value)
    if not items:
        raise error(f"{name} is empty: give at least one of its {what}")
    return items


def whole_numbers(
    name: str,
    values,
    *,
    length: int | None = None,
    what: str = "byte counts",
    minimum: int | None = 0,
    error: type[UserError] = UserError,
) -> list[int]:
    """A list (or a tensor, or any iterable but a string) of whole numbers >= `minimum` (an int, or a float with no
    fraction: 2.5 bytes is refused, never rounded; `minimum` None: any sign), with `length` items when given
    (one per layer, say)."""
    if callable(getattr(values, "tolist", None)):  # a tensor or an array: its numbers
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable) or isinstance(values, dict):
        raise error(f"{name} must be a list of {what}, got {_shown(values)} ({type(values).__name__})")
    items = list(values)
    if length is not None and len(items) != length:
        raise error(f"{name} must have {length} {what}, got {len(items)}")
    return [integer(f"{name}[{index}]", item, minimum=minimum, error=error) for index, item in enumerate(items)]


def strings(name: str, value: str | Sequence[str], *, error: type[UserError] = UserError) -> tuple[str, ...]:
    """A string or a sequence of strings, as a tuple: a single string is one item, never its characters."""
    items = (value,) if isinstance(value, str) else value
    if not isinstance(items, Iterable) or isinstance(items, bytes):
        raise error(f"{name} must be a string or a list of strings, got {_shown(value)} ({type(value).__name__})")
    items = tuple(items)
    wrong = [item for item in items if not isinstance(item, str) or not item]
    if wrong or not items:
        raise error(f"{name} must be a string or a list of non-empty strings, got {_shown(value)}")
    return items


def choice(name: str, value, options: Sequence, *, error: type[UserError] = UserError):
    """One of `options`; an unknown string gets the closest ones ("did you mean")."""
    if isinstance(value, str) or value is None or isinstance(value, numbers.Number):
        if value in options:
            return value
    shown = ", ".join(repr(option) if not isinstance(option, str) else option for option in options)
    close = (
        difflib.get_close_matches(value, [o for o in options if isinstance(o, str)], n=3, cutoff=0.6)
        if isinstance(value, str)
        else []
    )
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    raise error(f"unknown {name} {_shown(value)}: {hint}use one of {shown}")


def choices(
    name: str, value: str | Sequence[str], options: Sequence[str], *, error: type[UserError] = UserError
) -> tuple[str, ...]:
    """One option or a list of them (`strings`, each one of `options`), as a tuple."""
    return tuple(choice(name, item, options, error=error) for item in strings(name, value, error=error))


def instance(name: str, value, kind: type | tuple[type, ...], what: str, *, error: type[UserError] = UserError):
    """`value` if it is a `kind`; else one line naming what to give (`what`, e.g. "a memory.Setup")."""
    if not isinstance(value, kind):
        raise error(f"{name} must be {what}, got {_shown(value)} ({type(value).__name__})")
    return value


def model_and_optimizer(model, optimizer=None, *, error: type[UserError] = UserError) -> None:
    """A torch module with parameters on a real device (not "meta": shapes only, no memory), and an
    optimizer (or None) that updates this model's parameters, not another's."""
    params = list(model.parameters()) if callable(getattr(model, "parameters", None)) else []
    if not params:
        raise error(f"model must be a torch.nn.Module with parameters, got {_shown(model)} ({type(model).__name__})")
    if any(p.device.type == "meta" for p in params):
        raise error(
            "model is on the meta device (shapes only, no memory to measure or train): build it on a "
            "real device, e.g. model.to_empty(device='cpu') then load or initialise its weights"
        )
    if optimizer is None:
        return
    if not all(callable(getattr(optimizer, method, None)) for method in ("step", "zero_grad")):
        raise error(f"optimizer must be a torch.optim.Optimizer, got {_shown(optimizer)} ({type(optimizer).__name__})")
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list):  # an optimizer of its own kind (toolbox.OptimizerInBackward): no groups to check
        return
    own = {id(p) for p in params}
    if any(id(p) not in own for group in groups for p in group["params"]):
        raise error(
            "optimizer updates parameters that are not this model's (built for another model?): build it "
            "from this model's parameters, e.g. torch.optim.AdamW(model.parameters())"
        )


def from_text(check, text: str, **options):
    """A command-line value: `text` read as a number (a whole one if it is), then checked by `check` (one of
    the checks above); ValueError with the check's words, for the parser to put after the flag's name."""
    value = text
    for kind in (int, float):
        try:
            value = kind(text)
            break
        except ValueError:
            pass
    try:
        return check("VALUE", value, **options)
    except UserError as error:
        raise ValueError(str(error).removeprefix("VALUE ")) from None


# ------------------------------------------------------------------ annotations as contracts

INT64 = 2**63  # a whole number goes to torch (a size, a seed) or counts bytes: within int64


@dataclasses.dataclass(frozen=True)
class AtLeast:
    """`Annotated` metadata: the number must be at least `minimum` (`Count`, `NonNegative`)."""

    minimum: int

    def wanted(self, value) -> str | None:
        return None if value >= self.minimum else f"a whole number >= {self.minimum}"


class DeviceName:
    """`Annotated` metadata: what `torch.device` takes ("cpu", "cuda:0", a torch.device)."""

    def wanted(self, value) -> str | None:
        import torch  # here: `course-lib --help` and the grader's parent process never load torch

        try:
            torch.device(value)
        except (RuntimeError, TypeError, ValueError):
            return "a device (a torch.device, or a name such as 'cpu' or 'cuda')"
        return None


Count = typing.Annotated[int, AtLeast(1)]  # a count or a size (items, steps, layers, features): >= 1
NonNegative = typing.Annotated[int, AtLeast(0)]  # a count that may be none, a byte count: >= 0
Device = typing.Annotated[object, DeviceName()]  # a torch.device or its name


LITERAL = "one of its options"  # what `_wanted` says of a value a Literal does not list


def _members(hint) -> tuple:
    """A union's members (Annotated unwrapped), or the hint alone."""
    if typing.get_origin(hint) is typing.Annotated:
        return _members(typing.get_args(hint)[0])
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return tuple(m for arg in typing.get_args(hint) for m in _members(arg))
    return (hint,)


def _wanted(value, hint, default_none: bool = False) -> str | None:
    """None if `value` is of the type `hint` annotates; else what it should be, in a few words. An int is
    never a bool or a float (2.0 included) and fits in int64; a float is finite (an int will do); a list is
    never a string."""
    if hint is typing.Any or isinstance(hint, (typing.TypeVar, str)):
        return None
    if value is None and (default_none or hint is type(None)):
        return None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Annotated:
        checks = [meta for meta in args[1:] if callable(getattr(meta, "wanted", None))]
        want = _wanted(value, args[0], default_none)
        if want is not None and args[0] is int and any(isinstance(meta, AtLeast) for meta in checks):
            return next(meta.wanted(-INT64) for meta in checks if isinstance(meta, AtLeast))  # its words
        if want is not None or (value is None and default_none):
            return want
        return next((want for meta in checks if (want := meta.wanted(value)) is not None), None)
    if origin in (typing.Union, types.UnionType):
        wants = [_wanted(value, arg, default_none) for arg in args]
        if None in wants or LITERAL in wants:  # a name a Literal does not list: `choice` says so
            return None if None in wants else LITERAL
        return " or ".join(dict.fromkeys(wants))
    if hint is type(None):
        return "None"
    if origin is typing.Literal:  # compared as what it is (numpy's 2 is 2), never a tensor's ==
        plain = str(value) if isinstance(value, str) else None
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            plain = int(value)
        if plain is not None and any(plain == arg and type(plain) is type(arg) for arg in args):
            return None
        return LITERAL if isinstance(value, str) else " or ".join(map(repr, args))
    if hint is bool:
        return None if isinstance(value, bool) else "True or False"
    if hint is int:
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return None if -INT64 <= value < INT64 else "an int within int64's range"
        return "an int (a whole number)"
    if hint is float:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and _finite(value)
        return None if ok else "a finite number"
    if hint is str:
        return None if isinstance(value, str) else "a string"
    container = origin or hint
    if container in (list, tuple, Sequence, collections.abc.MutableSequence, Iterable, collections.abc.Collection):
        if isinstance(value, (str, bytes)) or not isinstance(value, Iterable) or isinstance(value, dict):
            return "a list"
        indexed = isinstance(value, Sequence) or (hasattr(value, "__len__") and hasattr(value, "__getitem__"))
        if container in (Iterable, collections.abc.Collection) and not indexed:
            return None  # an iterator is not read here (it would be used up)
        if not indexed:
            return "a list (not an iterator, which would be used up)"
        if not args:
            return None
        if container is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(value) != len(args):
                return f"a tuple of {len(args)} items"
            pairs = zip(value, args)
        else:
            pairs = ((item, args[0]) for item in value)
        wrong = next((want for item, arg in pairs if (want := _wanted(item, arg)) is not None), None)
        return None if wrong is None else f"a list of items each {wrong}"
    if container in (dict, collections.abc.Mapping):
        if not isinstance(value, collections.abc.Mapping):
            return "a dict"
        if len(args) == 2:
            for key, item in value.items():
                if (wrong := _wanted(key, args[0])) is not None:
                    return f"a dict with keys each {wrong}"
                if (wrong := _wanted(item, args[1])) is not None:
                    return f"a dict with values each {wrong} (its {_shown(key)} is not)"
        return None
    if container is collections.abc.Callable:
        return None if callable(value) else "a callable (a function)"
    if isinstance(container, type):
        return None if isinstance(value, container) else f"a {container.__module__}.{container.__qualname__}"
    return None


def annotated(name: str, value, hint, *, default_none: bool = False, error: type[UserError] = UserTypeError):
    """`value` if it is of the type `hint` annotates (`_wanted`) and, where `name` says it holds bytes, not
    below zero; else one line naming what to give (a `Literal`'s as `choice` says it)."""
    want = _wanted(value, hint, default_none)
    if want is LITERAL:
        options = next(typing.get_args(arg) for arg in _members(hint) if typing.get_origin(arg) is typing.Literal)
        choice(name.rsplit(".", 1)[-1], value, options, error=error)
    if want is not None:
        raise error(f"{name} must be {want}, got {_shown(value)} ({type(value).__name__})")
    if "bytes" in name.rsplit(".", 1)[-1]:  # a byte count, or a list of them: never below zero
        counts = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(count, numbers.Real) and count < 0 for count in counts):
            raise error(f"{name} is a byte count: it must be non-negative (>= 0), got {_shown(value)}")
    return value


def type_hints(obj) -> dict[str, object]:
    """`obj`'s annotations resolved (`Annotated` kept), the ones that cannot be (a name imported for type checkers only) as
    strings (`_wanted` lets a string through)."""
    try:
        return typing.get_type_hints(obj, include_extras=True)
    except (NameError, TypeError):
        namespace = vars(sys.modules[obj.__module__])
        raw = {}
        for klass in reversed(obj.__mro__) if isinstance(obj, type) else (obj,):
            raw.update(getattr(klass, "__annotations__", {}))
        hints = {}
        for key, text in raw.items():
            try:
                hints[key] = eval(text, namespace) if isinstance(text, str) else text  # noqa: S307 (the module's own annotations)
            except Exception:  # noqa: BLE001 (unresolvable: not checked)
                hints[key] = str(text)
        return hints


def _speak_first(instance) -> None:
    """A refused dataclass's own `validate()`, if it has one, so that its words come first (planner.Setup's
    "more than a tensor can hold"); what it trips on instead of refusing is not its to say."""
    own = getattr(instance, "validate", None)
    if callable(own):
        try:
            own()
        except UserError:
            raise
        except Exception:  # noqa: BLE001,S110 (the annotation's refusal follows)
            pass


def checked(obj=None, *, error: type[UserError] = UserTypeError):
    """Decorator: a function or class refuses arguments, a dataclass fields, whose values are not of their
    annotated types (`annotated`), with one line naming the argument (docs/planner.md, "Bad input"), as an
    `error` (`@checked(error=PagingError)`: the package's own). A parameter whose default is None may be
    given None. A function's arguments are checked before it runs; a dataclass's fields after its own
    `__post_init__` (its own refusal, with its own words, comes first, and its `validate()` if it has one;
    then what it let through, as it stored it: a whole float it made an int is an int)."""
    if obj is None:
        return functools.partial(checked, error=error)
    function = obj.__init__ if isinstance(obj, type) else obj
    signature = inspect.signature(function)
    none_by_default = {name for name, p in signature.parameters.items() if p.default is None}
    variadic = {name for name, p in signature.parameters.items() if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    owner = f"{obj.__qualname__}." if isinstance(obj, type) else ""
    fields = dataclasses.is_dataclass(obj)
    resolved: dict[str, object] = {}

    def check(values: dict[str, object]) -> None:
        if "return" not in resolved:  # on the first call, when every name the annotations use is defined
            resolved.update(type_hints(obj if fields else function))
            resolved["return"] = None  # resolved: also for a function with no annotations
        for name, value in values.items():
            if name in resolved and name not in variadic:
                annotated(owner + name, value, resolved[name], default_none=name in none_by_default, error=error)

    @functools.wraps(function)
    def checking(*args, **kwargs):
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as mismatch:
            raise error(f"{obj.__qualname__}: {mismatch}") from None
        if not fields:
            check(bound.arguments)
            return function(*args, **kwargs)
        try:
            function(*args, **kwargs)
        except UserError:
            raise
        except Exception:  # its own code tripped on a bad value: say which, else let it show
            try:
                check(bound.arguments)
            except UserError as refused:
                raise refused from None
            raise
        self = bound.arguments.get(next(iter(signature.parameters)))
        try:
            check({field.name: getattr(self, field.name) for field in dataclasses.fields(obj) if field.init})
        except UserError as refused:
            _speak_first(self)
            raise refused from None
        return None

    if isinstance(obj, type):
        obj.__init__ = checking
        return obj
    return checking
