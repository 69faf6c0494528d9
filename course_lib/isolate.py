"""Run one measurement in a fresh Python process (lessons 4 and 5, "one process per row").

bitsandbytes never frees paged memory: `functional.get_paged` wraps a `cudaMallocManaged` pointer in
a CPU tensor and nothing ever calls `cudaFree` on it (bitsandbytes 0.50 functional.py). The only way
to give it back is to end the process. And `prefetch_tensor` with `to_cpu` set, the obvious way to
move it off the GPU, ends the process itself: it passes device -1 to `cprefetch`, whose
`cudaDeviceGetAttribute(..., -1)` fails inside `CUDA_CHECK_RETURN` (csrc/pythonInterface.cpp). So
every row that creates paged state runs in its own process, and a crash there (a CUDA error that
kills the process) is reported as that row's status instead of ending the caller.

`run(target, **kwargs)` calls `target` ("package.module:function") in a child with JSON-able keyword
arguments and returns its JSON-able dict, plus the child's process id under "pid".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from course_lib.errors import UserError

_MARK = "@@course_lib_isolated@@"
_CHILD = f"""
import importlib, json, os, sys
module, name = sys.argv[1].split(":")
kwargs = json.loads(sys.stdin.read())
result = getattr(importlib.import_module(module), name)(**kwargs)
print({_MARK!r} + json.dumps(dict(result, pid=os.getpid()), default=str), flush=True)
"""


def run(target: str, *, env: dict[str, str] | None = None, timeout: float | None = None, **kwargs) -> dict:
    """`target(**kwargs)` in a fresh process; its result dict with "pid" added (lessons 4 and 5).

    `env` adds environment variables for the child (e.g. PYTORCH_CUDA_ALLOC_CONF, read at the first
    CUDA call). A child that dies, times out or prints no result gives {"status": "crashed", ...}
    with its exit code and the last line it wrote to stderr."""
    if ":" not in target:
        raise UserError(f"target must be 'package.module:function', got {target!r}")
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, target],
            input=json.dumps(kwargs),
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **(env or {})},
        )
    except subprocess.TimeoutExpired:
        return {"status": "crashed", "error": f"timed out after {timeout} s", "returncode": None, "pid": None}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK) :])
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    return {
        "status": "crashed",
        "error": errors[-1] if errors else "no result and no error message",
        "returncode": done.returncode,
        "pid": None,
    }
