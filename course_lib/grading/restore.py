"""The notebook the grader runs: a learner's cells, with the setup and check cells from the instructor's
copy (docs/grading.md).

A submission is identified by the exercise named in its metadata (else by its file name, else by the
cell ids it shares with one exercise). Each protected cell (setup, checks) is then taken from the
reference: a learner's copy that was edited is replaced, one that was deleted is put back, one moved
out of its place (before its exercise, say) goes back to it. A check cell imports the checks afresh
first, so that whatever the learner's cells did to the module is gone.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from course_lib.errors import UserError
from course_lib.grading.generate import METADATA, make_exercise, source_hash

# Prepended to each restored check cell: only the standard library, so no learner's patch reaches it.
FRESH_CHECKS = (
    "import importlib, sys  # course-lib grade: the checks, imported afresh\n"
    "for _module in [m for m in sys.modules if m == 'course_lib.checks' or m.startswith('course_lib.checks.')]:\n"
    "    del sys.modules[_module]\n"
    "checks = importlib.import_module('course_lib.checks')\n"
)


def load_references(folder: Path) -> dict[str, nbformat.NotebookNode]:
    """The instructor's exercises, by name, from a folder of exercises or of solutions (an exercise is
    then made from each, exactly as `course-lib make-exercises` would)."""
    references = {}
    for path in sorted(folder.glob("*.ipynb")):
        try:
            notebook = nbformat.read(path, as_version=4)
            if METADATA not in notebook.metadata:
                notebook = make_exercise(notebook, f"solutions/{path.name}", f"exercises/{path.name}")
        except Exception as error:  # a broken file, no solution block, no check cell
            raise UserError(
                f"{path}: not a usable reference exercise ({error}); give --reference a folder "
                "of the course's exercises or solutions"
            ) from None
        by_id = {cell.get("id"): cell for cell in notebook.cells}
        for record in notebook.metadata[METADATA]["cells"]:
            cell = by_id.get(record["id"])
            if cell is None or source_hash(cell.source) != record["sha256"]:
                raise UserError(
                    f"{path}: {record['label']} differs from what the notebook records; "
                    "regenerate it with course-lib make-exercises"
                )
        references[notebook.metadata[METADATA]["exercise"]] = notebook
    if not references:
        raise UserError(
            f"{folder}: no notebooks to take the check cells from; give --reference the "
            "course's exercises/ or solutions/ folder"
        )
    return references


def identify(notebook: nbformat.NotebookNode, path: Path, references: dict) -> str | None:
    """The exercise a submission is: by its metadata, else its file name, else the cell ids it shares."""
    if recorded_exercise(notebook) in references:
        return recorded_exercise(notebook)
    if path.stem in references:
        return path.stem
    ids = {cell.get("id") for cell in notebook.cells} - {None}
    shared = {name: len(ids & {cell.get("id") for cell in ref.cells}) for name, ref in references.items()}
    best = max(shared, key=shared.get, default=None)
    return best if best and shared[best] and list(shared.values()).count(shared[best]) == 1 else None


LESSON = re.compile(r"(\d\d)_")  # a lesson's number, at the start of its notebook's name


def recorded_exercise(notebook: nbformat.NotebookNode) -> str | None:
    """The exercise a notebook's metadata says it is (make-exercises records it), if any."""
    named = notebook.metadata.get(METADATA, {})
    return named.get("exercise") if isinstance(named, dict) and isinstance(named.get("exercise"), str) else None


def wrong_lesson(notebook: nbformat.NotebookNode, path: Path) -> str:
    """Why a notebook is not the lesson its file name says ("" when it is, or when either says no lesson):
    e.g. lesson 0's exercise handed in as 07_the_rest_of_the_toolbox.ipynb."""
    recorded, named = LESSON.match(recorded_exercise(notebook) or ""), LESSON.match(path.name)
    if recorded and named and recorded.group(1) != named.group(1):
        return (
            f"the wrong lesson: this is {recorded_exercise(notebook)}'s exercise, handed in as lesson "
            f"{named.group(1)}'s; hand in lesson {named.group(1)}'s exercise (or grade it as what it is with "
            "--as-recorded)"
        )
    return ""


@dataclass
class Restored:
    """What runs: `notebook`; for each of its cells, where it comes from (`origin`: "cell N" of the
    learner's notebook, or a protected cell's label); what was restored and why."""

    notebook: nbformat.NotebookNode
    origin: list[str]
    records: list[dict]  # the protected cells, as the reference records them
    restored: dict[str, str] = field(default_factory=dict)  # cell id -> "deleted", "edited" or "moved"


def _stands_for(submission: nbformat.NotebookNode, protected: dict) -> list[str | None]:
    """For each cell of a submission, the id of the protected cell it is: by its id, else (a notebook
    saved without cell ids, or a copied cell) as an unchanged copy of one not found by id."""
    found = [cell.get("id") if cell.get("id") in protected else None for cell in submission.cells]
    missing = {record["sha256"]: key for key, record in protected.items() if key not in found}
    for i, cell in enumerate(submission.cells):
        if found[i] is None and cell.cell_type == "code":
            found[i] = missing.pop(source_hash(cell.source), None)
    return found


def restore(submission: nbformat.NotebookNode, reference: nbformat.NotebookNode) -> Restored:
    """The learner's cells with each protected cell from `reference`, in its place (module docstring)."""
    records = reference.metadata[METADATA]["cells"]
    protected = {record["id"]: record for record in records}
    stands_for = _stands_for(submission, protected)
    learner = [(f"cell {n}", cell) for n, (cell, key) in enumerate(zip(submission.cells, stands_for), 1) if key is None]
    at = {cell.get("id"): i for i, (_, cell) in enumerate(learner)}  # the learner's cells, by id
    where_now, before = {}, 0  # where each protected cell sits now: before which of the learner's cells
    for cell, key in zip(submission.cells, stands_for):
        if key is not None:
            where_now.setdefault(key, (before, cell))
        else:
            before += 1
    slots, restored = [], {}
    ids = [cell.get("id") for cell in reference.cells]
    for r, cell in enumerate(reference.cells):
        if cell.get("id") not in protected:
            continue
        after = [at[i] + 1 for i in reversed(ids[:r]) if i in at and i not in protected][:1]
        upto = [at[i] for i in ids[r + 1 :] if i in at and i not in protected][:1]
        lowest, highest = (after or [0])[0], (upto or [len(learner)])[0]
        slot, why = highest, []  # its place: after the learner's cells of its exercise, before the next's
        if cell.id not in where_now:
            why.append("deleted")
        else:
            now, theirs = where_now[cell.id]
            if theirs.cell_type != "code" or source_hash(theirs.source) != protected[cell.id]["sha256"]:
                why.append("edited")
            if lowest <= now <= highest:
                slot = now
            else:
                why.append("moved")
        if why:
            restored[cell.id] = " and ".join(why)
        slots.append((slot, r, cell))
    cells, origin = [], []
    for i, (name, learner_cell) in enumerate([*learner, (None, None)]):
        for _, _, cell in sorted((s for s in slots if s[0] == i), key=lambda s: s[1]):
            fresh = copy.deepcopy(cell)
            if protected[cell.id]["role"] == "check":
                fresh.source = FRESH_CHECKS + fresh.source
            cells.append(fresh)
            origin.append(protected[cell.id]["label"])
        if learner_cell is not None:
            cells.append(learner_cell)
            origin.append(name)
    notebook = copy.deepcopy(submission)
    notebook.cells = cells
    return Restored(notebook, origin, records, restored)
