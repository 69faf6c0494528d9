"""Run a notebook top to bottom in a fresh kernel, in a folder of its own, under time limits.

nbclient (the engine of `jupyter nbconvert --execute`) runs the cells: it gives each cell's outcome by
index, a per-cell timeout that can follow a per-notebook deadline, and it notices within a second
that the kernel died. The kernel is this very Python's (as nbval's --nbval-current-env), whatever
kernels are installed elsewhere. A kernel that does not start (no reply to kernel_info in time, or it
died first: a busy machine, a port another process took) is told apart from one that dies running the
notebook's code: none of the notebook's code ran, so the grader may start it again (grade.py).

Nothing the notebook starts outlives its run. On Linux the process that runs kernels becomes a child
subreaper (prctl PR_SET_CHILD_SUBREAPER): a process the notebook's code starts, even one in a session of
its own whose parent exited, is re-parented to it rather than to init; once the notebook ends, every such
process and every descendant of its kernel is killed. Elsewhere only the kernel's descendants still
attached to it when the notebook ends are found and killed: one that detached (a double fork) escapes.
"""

from __future__ import annotations

import ctypes
import math
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import psutil
from ipykernel.kernelspec import RESOURCES, get_kernel_dict
from jupyter_client import AsyncKernelManager
from jupyter_client.kernelspec import KernelSpec
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

from course_lib.errors import NOT_DONE

PR_SET_CHILD_SUBREAPER = 36  # from <linux/prctl.h>


def become_subreaper() -> bool:
    """Make this process the child subreaper of its descendants (Linux); False where it cannot be one."""
    if not sys.platform.startswith("linux"):
        return False
    return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def _new_children(children_before: set[int]) -> list[psutil.Process]:
    """This process's children that are not in `children_before` (pids)."""
    return [child for child in psutil.Process().children() if child.pid not in children_before]


def _descendants(process: psutil.Process) -> list[psutil.Process]:
    try:
        return process.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _kill(processes: list[psutil.Process]) -> None:
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(processes, timeout=10)  # reaps those that are this process's children


def _kill_descendants(children_before: set[int]) -> None:
    """Kill every process started since this process had the children `children_before`: a killed
    process's own children are then re-parented here (a subreaper), so look again, a few rounds at most."""
    for _ in range(10):
        found = [p for child in _new_children(children_before) for p in [child, *_descendants(child)]]
        if not found:
            return
        _kill(found)


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
        return NOT_DONE
    text = " ".join(str(evalue).split())
    return text if ename == "CheckFailed" else f"{ename}: {text}" if text else ename


def run_notebook(
    notebook: nbformat.NotebookNode,
    folder: Path,
    cell_timeout: float,
    notebook_timeout: float,
    startup_timeout: int = 120,
) -> NotebookRun:
    """Run `notebook`'s code cells in a new kernel started in `folder`, which has `startup_timeout`
    seconds to reply; each cell may take `cell_timeout` seconds and all of them `notebook_timeout`.
    The notebook's outputs are filled in. Every process its code started is killed when it ends (module
    docstring)."""
    become_subreaper()
    children_before = {child.pid for child in psutil.Process().children()}
    deadline = math.inf  # set once the kernel is up: the limits are the notebook's code's

    def limit(cell) -> int:
        return max(1, math.ceil(min(cell_timeout, deadline - time.monotonic())))

    client = NotebookClient(
        notebook,
        timeout_func=limit,
        kernel_name="python3",
        kernel_manager_class=_ThisPythonsKernel,
        resources={"metadata": {"path": str(folder)}},
        force_raise_errors=True,
        shutdown_kernel="immediate",
        startup_timeout=startup_timeout,
    )
    run = NotebookRun(started=False)
    try:
        with client.setup_kernel(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL):
            try:
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
            finally:  # the kernel's descendants, while they are still its (the kernel is shut down next)
                _kill([p for kernel in _new_children(children_before) for p in _descendants(kernel)])
    except CellTimeoutError:
        whole = deadline - time.monotonic() < 1
        run.stopped = (
            f"timed out: the notebook ran past its {notebook_timeout:g} s limit, in {{where}}"
            if whole
            else f"timed out: {{where}} ran past the {cell_timeout:g} s limit of a cell"
        )
    except DeadKernelError:
        run.stopped = "kernel died in {where} (its code exited Python, crashed it or ran out of memory)"
    except Exception as error:  # before the kernel is up: it did not start (nbclient says why)
        if run.started:
            raise
        run.stopped = f"the grader could not start a kernel ({' '.join(str(error).split()) or type(error).__name__})"
    finally:
        _kill_descendants(children_before)
    return run
