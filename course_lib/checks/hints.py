"""What every exercise check shares (CONTRIBUTING.md, "An exercise").

- `CheckFailed`: a wrong answer. Jupyter shows its hint as one short block: no traceback, so neither
  the check's source (which holds the other hints) nor this machine's paths.
- `hints_only(check)`: a check whose failed asserts become `CheckFailed`, the unanswered stub's
  NotImplementedError the one line "not done yet", and whose other errors (the learner's own code
  raising) show the learner's frames without the check's.
- `refuse_reference(*references)` and `refusing(answer, *references)`: refuse an answer that only calls
  the library's own implementation of what the exercise asks (a module or package, or named functions
  or classes), the very thing the check compares the answer with. Name `course_lib` itself to refuse a
  call into any of the library (where one answer is implemented in several places: lesson 1's 8-bit
  layout is in `course_lib.planner` and in `course_lib.paging.trace`); the checks' own code never counts.
"""

from __future__ import annotations

import functools
import inspect
import numbers
import sys
import threading
import types
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from course_lib import validate
from course_lib.course import wrapped
from course_lib.errors import NOT_DONE
from course_lib.validate import checked

__all__ = ["CheckFailed", "NOT_DONE", "hints_only", "refuse_reference", "refusing"]

_CHECKS_DIR = str(Path(__file__).resolve().parent)


class CheckFailed(AssertionError):
    """A wrong answer, with a hint that says what to look at."""

    def _render_traceback_(self) -> list[str]:  # IPython shows these lines instead of a traceback
        return [f"\x1b[31mNot yet:\x1b[0m {self}"]


def assert_byte_count(value, function: str) -> None:
    """Fail with a hint unless `value` is a whole number (an int, not a string, a float or a bool): the
    type is named, so that "168" is not shown as if it were the number 168 (lesson 0's exercises)."""
    assert value is not None, f"{function} returned None: return the number of bytes"
    assert isinstance(value, numbers.Integral) and not isinstance(value, bool), (
        f"{function} returned {value!r}, a {type(value).__name__}: return the number of bytes as an int"
    )


def passed(message: str) -> None:
    """Print a passed check's message, wrapped to the notebook's width (course_lib.course.TEXT_WIDTH)."""
    print(wrapped(message))


def _without_check_frames(traceback: types.TracebackType | None) -> types.TracebackType | None:
    """The traceback with the frames of course_lib.checks left out (the learner's frames stay)."""
    kept = []
    while traceback is not None:
        if not traceback.tb_frame.f_code.co_filename.startswith(_CHECKS_DIR):
            kept.append(traceback)
        traceback = traceback.tb_next
    chained = None
    for frame in reversed(kept):
        chained = types.TracebackType(chained, frame.tb_frame, frame.tb_lasti, frame.tb_lineno)
    return chained


@checked
def hints_only(check: Callable) -> Callable:
    """`check`, with a failed assert raised as `CheckFailed` and other errors without the check's frames."""

    @functools.wraps(check)
    def run(*args, **kwargs):
        __tracebackhide__ = True  # noqa: F841  IPython leaves this frame out of tracebacks
        try:
            return check(*args, **kwargs)
        except CheckFailed:
            raise
        except AssertionError as error:
            raise CheckFailed(str(error) or f"{check.__name__} failed") from None
        except NotImplementedError:  # the stub the exercise starts with: one line, not a traceback
            raise CheckFailed(NOT_DONE) from None
        except Exception as error:
            raise error.with_traceback(_without_check_frames(error.__traceback__)) from None

    return run


def _owner(modules: tuple[types.ModuleType, ...], filename: str) -> str | None:
    """The dotted name of the module whose code is in `filename`, when that is one of `modules` or lies
    in one of their packages; None for the code of course_lib.checks (the check running, not an answer)."""
    real = Path(filename).resolve()
    if Path(_CHECKS_DIR) in real.parents:
        return None
    for module in modules:
        path = Path(module.__file__).resolve()
        if real == path:
            return module.__name__
        if path.name == "__init__.py" and path.parent in real.parents:
            inner = real.relative_to(path.parent).with_suffix("").parts
            return ".".join((module.__name__, *(part for part in inner if part != "__init__")))
    return None


def _codes(reference) -> dict[types.CodeType, str]:
    """The code objects of a function (unwrapped) or of a class's methods, with the name to show."""
    if isinstance(reference, type):
        functions = [inspect.unwrap(f) for f in vars(reference).values() if isinstance(f, types.FunctionType)]
    else:
        functions = [inspect.unwrap(reference)]
    return {f.__code__: f"{f.__module__}.{f.__qualname__}" for f in functions}


@contextmanager
@checked
def refuse_reference(*references, instead: str = "work it out yourself"):
    """Run the learner's answer inside `with refuse_reference(course_lib.planner): ...`: if the answer
    called the library's reference that the check compares with (any function of a module or package
    named, or one of the functions or classes named), the check fails with a hint that says so. A call
    is seen however the function was imported, and in any thread the answer starts (a ThreadPoolExecutor,
    say); on Python 3.12 and later also in threads that were running already. A call made in another
    process (a subprocess, a multiprocessing pool) is not seen. `refuse_reference(course_lib)` refuses
    a call into any module of the library (course_lib.checks excepted)."""
    modules = tuple(r for r in references if isinstance(r, types.ModuleType))
    codes: dict[types.CodeType, str] = {}
    for reference in references:
        if not isinstance(reference, types.ModuleType):
            codes.update(_codes(reference))
    called: list[str] = []
    owners: dict[str, str | None] = {}  # by file name, so that each file is looked at once

    def watch(frame, event, arg):
        if event != "call" or called:
            return
        code = frame.f_code
        if code.co_filename == validate.__file__:  # `validate.checked`'s wrapper: a call of what it wraps
            wrapped = frame.f_locals.get("function") if code.co_name == "checking" else None
            if wrapped is None:
                return
            code = inspect.unwrap(wrapped).__code__
        if code in codes:
            called.append(codes[code])
            return
        if modules:
            if code.co_filename not in owners:
                owners[code.co_filename] = _owner(modules, code.co_filename)
            if owners[code.co_filename]:
                called.append(f"{owners[code.co_filename]}.{code.co_qualname}")

    previous, previous_for_new_threads = sys.getprofile(), threading.getprofile()
    # every thread (Python 3.12+), else this one and those started from now on
    watch_all = getattr(threading, "setprofile_all_threads", None)
    if watch_all:
        watch_all(watch)
    else:
        threading.setprofile(watch)
        sys.setprofile(watch)
    try:
        yield
    finally:
        if watch_all:
            watch_all(previous)
        else:
            sys.setprofile(previous)
        threading.setprofile(previous_for_new_threads)
        if called:  # also when the answer then raised: the refusal is the hint that matters
            raise CheckFailed(
                f"your answer calls {called[0]}, the course library's own answer, which is what "
                f"this check compares with: {instead}"
            )


@checked
def refusing(answer: Callable, *references, instead: str = "work it out yourself") -> Callable:
    """`answer`, each of whose calls runs inside `refuse_reference(*references, instead=instead)`: for
    checks that call the learner's function in many places."""

    @functools.wraps(answer)
    def run(*args, **kwargs):
        with refuse_reference(*references, instead=instead):
            return answer(*args, **kwargs)

    return run
