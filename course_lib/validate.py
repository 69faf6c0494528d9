"""Argument checks at the public boundary of `course_lib` (docs/planner.md, "Bad input").

Each check returns the value, normalised (a whole float as an int, a single string as a one-item
tuple), or raises the library's error class (`UserError`, or the subclass passed as `error`) with one
line naming the argument, the value it got and what to give instead. `course-lib` prints that line
and exits with status 2; in Python it is the exception's message.
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Iterable, Sequence

from course_lib.errors import UserError


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _number(name: str, value, want: str, error: type[UserError]) -> float:
    """A real number (never a bool, a string or a tensor), or the error saying what to give."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise error(f"{name} must be {want}, got {_shown(value)} ({type(value).__name__})")
    if not math.isfinite(value):
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
