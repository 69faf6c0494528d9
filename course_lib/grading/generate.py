"""An exercise from a solved notebook (docs/grading.md).

Each answer sits between `### BEGIN SOLUTION` and `### END SOLUTION` lines; the exercise has the stub
instead, no outputs, the Colab badge pointing at the exercise, the kernel spec JupyterLab writes, and,
in its metadata, which exercise it is and the cells the grader restores from the instructor's copy:
the setup cell and each check cell, by cell id and the hash of its source.
"""

from __future__ import annotations

import copy
import hashlib
import re
from pathlib import Path

import nbformat

from course_lib.course import colab_url
from course_lib.errors import UserError
from course_lib.grading.kernelspec import jupyterlab_kernelspec

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
STUB = ("# YOUR CODE HERE", "raise NotImplementedError()")
METADATA = "course_lib"  # the key of the exercise's record in the notebook's metadata
CHECK_CALL = re.compile(r"\bchecks\.(check_\w+)\(")
EXERCISE_HEADING = re.compile(r"^#+\s*(Exercise\s+[^\n]*)", re.MULTILINE)


def source_hash(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


def strip_solutions(source: str, where: str = "cell") -> str:
    """Replace each solution block, markers included, by the stub at the block's indentation."""
    out, inside, found = [], False, False
    for line in source.splitlines():
        marker = line.strip()
        if marker == BEGIN:
            if inside:
                raise UserError(f"{where}: {BEGIN} inside another solution block")
            inside, found = True, True
            indent = line[: len(line) - len(line.lstrip())]
            out += [indent + stub for stub in STUB]
        elif marker == END:
            if not inside:
                raise UserError(f"{where}: {END} without {BEGIN}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise UserError(f"{where}: {BEGIN} without {END}")
    return "\n".join(out) if found else source


def protected_cells(notebook: nbformat.NotebookNode, where: str = "notebook") -> list[dict]:
    """The cells a grader takes from the instructor's copy: the setup cell (the first code cell) and
    each check cell (a code cell calling `checks.check_...`), labelled by the exercise heading above."""
    cells, heading, first = [], None, True
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type == "markdown" and (found := EXERCISE_HEADING.search(cell.source)):
            heading = found.group(1).strip()
        elif cell.cell_type == "code":
            if call := CHECK_CALL.search(cell.source):
                role, label = "check", f"{heading} ({call.group(1)})" if heading else call.group(1)
            elif first:
                role, label = "setup", "the setup cell"
            else:
                continue
            first = False
            if not cell.get("id"):
                raise UserError(f"{where} cell {index}: no cell id; save the notebook with JupyterLab 3 or later")
            cells.append({"id": cell.id, "role": role, "label": label, "sha256": source_hash(cell.source)})
    return cells


def make_exercise(solution: nbformat.NotebookNode, solution_path: str, exercise_path: str) -> nbformat.NotebookNode:
    """The exercise notebook generated from a solved one (paths relative to the repository)."""
    exercise = copy.deepcopy(solution)
    exercise.metadata.pop("widgets", None)
    exercise.metadata["kernelspec"] = jupyterlab_kernelspec()
    stubs = 0
    for index, cell in enumerate(exercise.cells):
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code":
            stripped = strip_solutions(cell.source, f"{solution_path} cell {index}")
            stubs += stripped != cell.source
            cell.source, cell.outputs, cell.execution_count = stripped, [], None
        elif cell.cell_type == "markdown":
            cell.source = cell.source.replace(colab_url(solution_path), colab_url(exercise_path))
    if not stubs:
        raise UserError(f"{solution_path}: no {BEGIN} ... {END} block, so no exercise to make")
    checks = protected_cells(exercise, solution_path)
    if not any(cell["role"] == "check" for cell in checks):
        raise UserError(f"{solution_path}: no check cell (a code cell calling checks.check_...) to grade it by")
    exercise.metadata[METADATA] = {"exercise": Path(exercise_path).stem, "cells": checks}
    return exercise


def learner_fingerprint(notebook: nbformat.NotebookNode) -> str:
    """A hash of what a learner writes: each cell's type and source, in order. Metadata, outputs and
    execution counts are left out, so opening, running or saving a notebook does not change it."""
    return source_hash("\x00".join(f"{cell.cell_type}\x01{cell.source}" for cell in notebook.cells))
