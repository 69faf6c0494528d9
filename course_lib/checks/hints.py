"""What every exercise check shares (CONTRIBUTING.md, "An exercise").

- `CheckFailed`: a wrong answer. Jupyter shows its hint as one short block: no traceback, so neither
  the check's source (which holds the other hints) nor this machine's paths.
- `hints_only(check)`: a check whose failed asserts become `CheckFailed`, and whose other errors (the
  learner's own code raising) show the learner's frames without the check's.
- `refuse_reference(*modules)`: refuses an answer that only calls the library's own implementation of
  what the exercise asks, the very thing the check compares the answer with.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

__all__ = ["CheckFailed", "hints_only", "refuse_reference"]

_CHECKS_DIR = str(Path(__file__).resolve().parent)


class CheckFailed(AssertionError):
    """A wrong answer, with a hint that says what to look at."""

    def _render_traceback_(self) -> list[str]:  # IPython shows these lines instead of a traceback
        return [f"\x1b[31mNot yet:\x1b[0m {self}"]


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
        except Exception as error:
            raise error.with_traceback(_without_check_frames(error.__traceback__)) from None

    return run


def _owner(modules: tuple[types.ModuleType, ...], filename: str) -> str | None:
    """The name of the module (or package: any file under its folder) whose code is in `filename`."""
    real = Path(filename).resolve()
    for module in modules:
        path = Path(module.__file__).resolve()
        if real == path or (path.name == "__init__.py" and path.parent in real.parents):
            return module.__name__
    return None


@contextmanager
def refuse_reference(*modules: types.ModuleType, instead: str = "work it out yourself"):
    """Run the learner's answer inside `with refuse_reference(course_lib.memory): ...`: if the answer
    called any function of those modules (the library's reference that the check compares with), the
    check fails with a hint that says so. A call is seen however the function was imported."""
    called: list[str] = []
    owners: dict[str, str | None] = {}  # by file name, so that each file is looked at once

    def watch(frame, event, arg):
        if event != "call" or called:
            return
        filename = frame.f_code.co_filename
        if filename not in owners:
            owners[filename] = _owner(modules, filename)
        if owners[filename]:
            called.append(f"{owners[filename]}.{frame.f_code.co_qualname}")

    previous = sys.getprofile()
    sys.setprofile(watch)
    try:
        yield
    finally:
        sys.setprofile(previous)
    if called:
        raise CheckFailed(f"your answer calls {called[0]}, the course library's own answer, which is what "
                          f"this check compares with: {instead}")
