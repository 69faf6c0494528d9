"""Run a notebook top to bottom in a fresh kernel, in a folder of its own, under time limits.

nbclient (the engine of `jupyter nbconvert --execute`) runs the cells: it gives each cell's outcome by
index, a per-cell timeout that can follow a per-notebook deadline, and it notices within a second
that the kernel died. The kernel is this very Python's (as nbval's --nbval-current-env), whatever
kernels are installed elsewhere. A kernel that does not start (no reply to kernel_info in time, or it
died first: a busy machine, a port another process took) is told apart from one that dies running the
notebook's code: none of the notebook's code ran, so the grader may start it again (grade.py).
"""

from __future__ import annotations

import math
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from ipykernel.kernelspec import RESOURCES, get_kernel_dict
from jupyter_client import AsyncKernelManager
from jupyter_client.kernelspec import KernelSpec
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError


class _ThisPythonsKernel(AsyncKernelManager):
    """A kernel of the Python that runs the grader, with the packages it has."""

    @property
    def kernel_spec(self) -> KernelSpec:
        return KernelSpec(resource_dir=RESOURCES, **get_kernel_dict())


@dataclass
class NotebookRun:
    """Each code cell that ran, by its index: "" when it passed, else its error in one line; and, when
    the run stopped early, at which cell and why ("timed out: {where} ..." or "kernel died in {where}
    ...", with {where} to fill in with that cell's name). `started` is False when the kernel did not
    start (`stopped` then says why, and no cell ran)."""

    errors: dict[int, str] = field(default_factory=dict)
    stopped: str = ""
    stopped_at: int | None = None
    started: bool = True


def _one_line(ename: str, evalue: str) -> str:
    if ename == "NotImplementedError":
        return "not done yet: the exercise still raises NotImplementedError"
    text = " ".join(str(evalue).split())
    return text if ename == "CheckFailed" else f"{ename}: {text}" if text else ename


def run_notebook(notebook: nbformat.NotebookNode, folder: Path, cell_timeout: float,
                 notebook_timeout: float, startup_timeout: int = 120) -> NotebookRun:
    """Run `notebook`'s code cells in a new kernel started in `folder`, which has `startup_timeout`
    seconds to reply; each cell may take `cell_timeout` seconds and all of them `notebook_timeout`.
    The notebook's outputs are filled in."""
    deadline = math.inf  # set once the kernel is up: the limits are the notebook's code's

    def limit(cell) -> int:
        return max(1, math.ceil(min(cell_timeout, deadline - time.monotonic())))

    client = NotebookClient(notebook, timeout_func=limit, kernel_name="python3", kernel_manager_class=_ThisPythonsKernel,
                            resources={"metadata": {"path": str(folder)}}, force_raise_errors=True,
                            shutdown_kernel="immediate", startup_timeout=startup_timeout)
    run = NotebookRun(started=False)
    try:
        with client.setup_kernel(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL):
            run.started, deadline = True, time.monotonic() + notebook_timeout
            for index, cell in enumerate(notebook.cells):
                if cell.cell_type != "code":
                    continue
                run.stopped_at = index
                try:
                    client.execute_cell(cell, index)
                    run.errors[index] = ""
                except CellExecutionError as error:
                    run.errors[index] = _one_line(error.ename, error.evalue)
            run.stopped_at = None
    except CellTimeoutError:
        whole = deadline - time.monotonic() < 1
        run.stopped = (f"timed out: the notebook ran past its {notebook_timeout:g} s limit, in {{where}}" if whole
                       else f"timed out: {{where}} ran past the {cell_timeout:g} s limit of a cell")
    except DeadKernelError:
        run.stopped = "kernel died in {where} (its code exited Python, crashed it or ran out of memory)"
    except Exception as error:  # before the kernel is up: it did not start (nbclient says why)
        if run.started:
            raise
        run.stopped = f"the grader could not start a kernel ({' '.join(str(error).split()) or type(error).__name__})"
    return run
