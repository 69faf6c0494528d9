"""Start N CPU processes that form one gloo process group on 127.0.0.1 (lessons 2 and 6).

`run_ranks(worker, world_size, *args)` starts `world_size` Python processes (from the fork server),
each joins a gloo group on a free local port, calls `worker(rank, world_size, *args)` and
hands its (picklable) result back; the results come back in rank order. Processes that do not
finish within `timeout_s` are killed and a TimeoutError is raised; a rank that fails raises in the
caller with that rank's error. On Windows, which has no fork server, the ranks are spawned (each
imports torch again). A rank whose port was taken in the meantime is retried on a new port.
"""

from __future__ import annotations

import datetime
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import socket
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from course_lib import validate
from course_lib.errors import UserError


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int, world_size: int, port: int, out_dir: str, timeout_s: float, worker: Callable, args: tuple, backend: str
) -> None:
    torch.set_num_threads(1)
    if sys.platform.startswith("linux"):  # the loopback interface's name there (macOS: lo0, found by gloo)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        result = worker(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


# imported once by the fork server, before any rank is forked from it
PRELOAD = [
    "torch",
    "torch.distributed.fsdp",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.qwen2.modeling_qwen2",
    "course_lib.sharding",
]


def run_ranks(
    worker: Callable, world_size: int, *args, timeout_s: float = 120.0, what: str = "processes", backend: str = "gloo"
) -> list:
    """`worker(rank, world_size, *args)` in `world_size` gloo processes; their results in rank order.

    `worker` must be importable by name (a module-level function); `backend` is torch.distributed's
    ("gloo" on CPU; "cuda:nccl,cpu:gloo" for one GPU per rank). The processes are forked from
    Python's fork server: a clean process started at the first call, which imports torch and
    transformers once (`PRELOAD`), so that each rank and each later call starts in a fraction of a
    second instead of importing them again; the caller's own state (threads, tensors) is never forked.
    """

    world_size = validate.positive_int("world_size", world_size)
    _check_sendable(worker, args)
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    if method == "forkserver":
        multiprocessing.forkserver.set_forkserver_preload(PRELOAD)
    for attempt in range(3):
        try:
            return _run_once(worker, world_size, args, timeout_s, what, backend, method)
        except mp.ProcessRaisedException as error:  # another process took the free port first: retry
            message = str(error).lower()
            if ("address already in use" not in message and "eaddrinuse" not in message) or attempt == 2:
                raise


def _run_once(
    worker: Callable, world_size: int, args: tuple, timeout_s: float, what: str, backend: str, method: str
) -> list:
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            _entry,
            args=(world_size, free_port(), out_dir, timeout_s, worker, args, backend),
            nprocs=world_size,
            join=False,
            start_method=method,
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=min(0.5, max(deadline - time.monotonic(), 0.001))):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the {world_size} {what} did not finish within {timeout_s:.0f} s")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join(5)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


def _check_sendable(worker: Callable, args: tuple) -> None:
    """ValueError, one line, for a function the ranks cannot import: defined in a notebook or a
    console (whose __main__ no new process can import), or not picklable at all (a lambda)."""
    main = sys.modules.get("__main__")
    for obj in (worker, *args):
        func = getattr(obj, "func", obj)  # functools.partial: the function it calls
        if (
            callable(func)
            and getattr(func, "__module__", None) == "__main__"
            and not os.path.isfile(getattr(main, "__file__", ""))
        ):
            raise UserError(
                f"{getattr(func, '__name__', func)!r} is defined in this notebook or console, which "
                "the rank processes cannot import: define it in a .py module (or use "
                "functools.partial of a library function, e.g. course_lib.checkpointing.tiny_decoder)"
            )
        try:
            pickle.dumps(obj)
        except (pickle.PicklingError, AttributeError, TypeError) as error:
            raise UserError(
                f"cannot send {obj!r} to the rank processes ({error}): use a module-level function "
                "or functools.partial of one"
            ) from None
