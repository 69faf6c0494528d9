"""Lessons on CUDA: each notebook top to bottom in a fresh kernel on the GPU, with the outputs of its
`%%gpu_only` cells and every cell that failed (lessons 6 and 7's GPU cells have never run on one).

    python benchmarks/gpu_lessons.py [NOTEBOOK ...] [--cell-timeout 120] [--json PATH]   # default: lessons 7 and 6

Each notebook runs in a new kernel of this Python (course_lib.grading.run.run_notebook, the
grader's runner), started in the notebook's folder as on a learner's machine; nothing is written
back. benchmarks/gpu_check.sh runs it with a time budget, which its driver passes in
GPU_CHECK_PART_SECONDS: the notebooks are stopped 30 s before it (a kernel starting included), so that
what ran comes back; the JSON is rewritten, atomically, after each notebook. On a CPU it prints one
line.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_lesson(path: Path, cell_timeout: float, notebook_timeout: float) -> dict:
    """One notebook's run: seconds, why it stopped early (if it did), its failing cells and the
    `%%gpu_only` cells' first lines, errors and printed output."""
    import nbformat

    from course_lib.grading.run import run_notebook

    notebook = nbformat.read(path, as_version=4)
    start = time.monotonic()
    run = run_notebook(notebook, path.parent, cell_timeout, notebook_timeout)
    gpu_cells = []
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type == "code" and cell.source.lstrip().startswith("%%gpu_only"):
            printed = "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")
            gpu_cells.append(
                {
                    "cell": index,
                    "first_line": cell.source.lstrip().splitlines()[0][:200],
                    "error": run.errors.get(index, "did not run"),
                    "printed": printed[-2000:],
                }
            )
    return {
        "seconds": round(time.monotonic() - start, 1),
        "stopped": run.stopped.format(where=f"cell {run.stopped_at}") if run.stopped else "",
        "failed_cells": {str(i): error for i, error in run.errors.items() if error},
        "gpu_only_cells": gpu_cells,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "notebooks",
        nargs="*",
        type=Path,
        default=[Path("notebooks/07_the_rest_of_the_toolbox.ipynb"), Path("notebooks/06_sharding.ipynb")],
    )
    parser.add_argument("--cell-timeout", type=float, default=120.0)
    parser.add_argument("--notebook-timeout", type=float, default=600.0)
    parser.add_argument("--json", type=Path, default=None, help="write every result here")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print(
            "gpu_lessons.py needs a CUDA GPU (it runs the lessons' %%gpu_only cells); on a CPU the tests run the lessons"
        )
        return 0
    from results_io import write_json

    results: dict = {}
    deadline = time.monotonic() + float(os.environ.get("GPU_CHECK_PART_SECONDS", "inf")) - 30
    for path in args.notebooks:
        path = path if path.is_absolute() else ROOT / path
        left = min(args.notebook_timeout, deadline - time.monotonic())
        if left < 10:
            results[path.name] = {"stopped": "out of time before it started"}
            print(f"{path.name}: out of time before it started", flush=True)
            continue
        result = results[path.name] = run_lesson(path, args.cell_timeout, left)
        print(
            f"{path.name}: {result['seconds']} s, {len(result['failed_cells'])} failed cells"
            + (f", stopped: {result['stopped']}" if result["stopped"] else ""),
            flush=True,
        )
        for index, error in result["failed_cells"].items():
            print(f"  cell {index} failed: {error[:300]}")
        for cell in result["gpu_only_cells"]:
            print(
                f"  %%gpu_only cell {cell['cell']}: {cell['error'] or 'ran'}\n    "
                + "\n    ".join(cell["printed"].strip().splitlines()[-12:])
            )
        if args.json:
            write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
