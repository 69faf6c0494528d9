"""Exercises from solutions, and grading with nbval (README, "Exercises and grading").

solutions/ is the single source: each answer sits between `### BEGIN SOLUTION` and
`### END SOLUTION` lines. `write_exercises` turns every solution notebook into an exercise (stubs, no
outputs, the Colab badge pointing at the exercise) and never overwrites an exercise that was edited
since it was generated. `grade` runs notebooks (or every notebook under a folder of submissions)
under nbval (lax) without modifying them, reports each exercise's check cell and can write a CSV
gradebook.
"""

from __future__ import annotations

import copy
import csv
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

import nbformat

from course_lib.cli import UserError
from course_lib.course import colab_url

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
STUB = ("# YOUR CODE HERE", "raise NotImplementedError()")
MANIFEST = ".generated.json"
CHECK_CALL = re.compile(r"\bchecks\.(check_\w+)\(")
EXERCISE_HEADING = re.compile(r"^#+\s*(Exercise\s+[^\n]*)", re.MULTILINE)
ANSI = re.compile(r"(?:\x1b|#x1B)\[[0-9;]*m")  # junit XML writes ESC as "#x1B"


def strip_solutions(source: str, where: str = "cell") -> str:
    """Replace each solution block, markers included, by the stub at the block's indentation."""
    out, inside, found = [], False, False
    for line in source.splitlines():
        marker = line.strip()
        if marker == BEGIN:
            if inside:
                raise ValueError(f"{where}: {BEGIN} inside another solution block")
            inside, found = True, True
            indent = line[: len(line) - len(line.lstrip())]
            out += [indent + stub for stub in STUB]
        elif marker == END:
            if not inside:
                raise ValueError(f"{where}: {END} without {BEGIN}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{where}: {BEGIN} without {END}")
    return "\n".join(out) if found else source


def make_exercise(solution: nbformat.NotebookNode, solution_path: str, exercise_path: str) -> nbformat.NotebookNode:
    """The exercise notebook generated from a solved one (paths relative to the repository)."""
    exercise = copy.deepcopy(solution)
    exercise.metadata.pop("widgets", None)
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
        raise ValueError(f"{solution_path}: no {BEGIN} ... {END} block, so no exercise to make")
    return exercise


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def write_exercises(solutions_dir: str | Path = "solutions", exercises_dir: str | Path = "exercises",
                    force: bool = False) -> list[str]:
    """Write exercises/NN_x.ipynb for every solutions/NN_x.ipynb; return one line per notebook.

    An exercise is overwritten only when it is still exactly what was generated last time (its hash
    is in exercises/.generated.json) or with `force=True`: a learner's edits are never lost.
    """
    solutions_dir, exercises_dir = Path(solutions_dir), Path(exercises_dir)
    solved = sorted(solutions_dir.glob("*.ipynb"))
    if not solved:
        raise UserError(f"no notebooks in {solutions_dir}/: run this from the course's root folder")
    exercises_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = exercises_dir / MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    report = []
    for path in solved:
        target = exercises_dir / path.name
        try:
            exercise = make_exercise(nbformat.read(path, as_version=4), f"{solutions_dir.name}/{path.name}",
                                     f"{exercises_dir.name}/{path.name}")
        except ValueError as error:
            raise UserError(str(error)) from None
        text = nbformat.writes(exercise) + "\n"
        current = target.read_text() if target.exists() else None
        if current == text:
            report.append(f"unchanged {target}")
        elif current is None or force or manifest.get(path.name) == _sha256(current):
            target.write_text(text)
            report.append(f"{'wrote' if current is None else 'updated'} {target}")
        else:
            report.append(f"kept {target}: it was edited since it was generated (your work?); "
                          "move it away or pass --force to overwrite it")
            continue
        manifest[path.name] = _sha256(text)
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return report


@dataclass
class CellResult:
    """The outcome of one code cell under nbval: 'passed', 'failed' or 'skipped'."""

    index: int
    outcome: str
    message: str


def run_nbval(path: Path) -> list[CellResult]:
    """Run one notebook under `pytest --nbval-lax` in this Python environment; results per code cell.

    The notebook is read, never written; pytest's cache is off so nothing is left behind.
    """
    with tempfile.TemporaryDirectory() as tmp:
        junit, config = Path(tmp) / "results.xml", Path(tmp) / "pytest.ini"
        config.write_text("[pytest]\n")  # keeps the course's own pytest settings out of grading
        subprocess.run([sys.executable, "-m", "pytest", "--nbval-lax", "--nbval-current-env",
                        "-p", "no:cacheprovider", "-q", "--no-header", f"--junitxml={junit}",
                        "--rootdir", tmp, "-c", str(config), str(path.resolve())],
                       capture_output=True, text=True, cwd=tmp)
        if not junit.exists():
            raise UserError(f"{path}: nbval could not run this notebook")
        tree = ElementTree.parse(junit)
    results = []
    for case in tree.iter("testcase"):
        match = re.fullmatch(r"Cell (\d+)", case.get("name", ""))
        if not match:
            continue
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = "failed", _error_line(child.text or child.get("message", ""))
            elif child.tag == "skipped":
                outcome = "skipped"
        results.append(CellResult(int(match.group(1)), outcome, message))
    return results


def _error_line(traceback: str) -> str:
    """The last 'SomeError: message' line of an nbval traceback, without colour codes."""
    lines = [line.strip() for line in ANSI.sub("", traceback).splitlines()]
    errors = [line for line in lines if re.match(r"^[A-Za-z_.]*(Error|Exception|Interrupt)\b", line)]
    if not errors:
        return lines[-1] if lines else "failed"
    last = errors[-1]
    if last.startswith("NotImplementedError"):
        return "not done yet: the exercise still raises NotImplementedError"
    return last


def _load_notebook(path: Path) -> nbformat.NotebookNode:
    if not path.exists():
        raise UserError(f"{path}: no such file; give the path of a notebook, e.g. exercises/00_measuring_memory.ipynb")
    if path.suffix != ".ipynb":
        raise UserError(f"{path}: not a notebook (.ipynb); give the path of a notebook to grade")
    try:
        return nbformat.read(path, as_version=4)
    except Exception as error:  # nbformat raises several kinds on a broken file
        raise UserError(f"{path}: not a readable notebook ({type(error).__name__}); "
                        "re-download it or regenerate it with course-lib make-exercises") from None


def exercise_checks(notebook: nbformat.NotebookNode) -> dict[int, str]:
    """Map code-cell number (as nbval counts) to a label for each check cell of a notebook."""
    labels, heading, code_index = {}, None, 0
    for cell in notebook.cells:
        if cell.cell_type == "markdown" and (found := EXERCISE_HEADING.search(cell.source)):
            heading = found.group(1).strip()
        elif cell.cell_type == "code":
            call = CHECK_CALL.search(cell.source)
            if call:
                labels[code_index] = f"{heading} ({call.group(1)})" if heading else call.group(1)
            code_index += 1
    return labels


def notebooks_to_grade(paths: list[str]) -> list[Path]:
    """Each notebook named, and every notebook under each folder named (a class's submissions, one
    folder per learner, say), in order; Jupyter's .ipynb_checkpoints copies are skipped."""
    found = []
    for path in map(Path, paths):
        if path.is_dir():
            inside = sorted(p for p in path.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
            if not inside:
                raise UserError(f"{path}: no notebooks (.ipynb) in this folder")
            found += inside
        else:
            found.append(path)
    return found


def grade(paths: list[str], csv_path: str | None = None) -> int:
    """Grade notebooks and folders of notebooks: print PASS/FAIL per exercise with the check's hint,
    and write one CSV row per exercise to `csv_path` when given (a gradebook); 0 only when all pass."""
    if csv_path is not None and Path(csv_path).suffix == ".ipynb":
        raise UserError(f"{csv_path}: the gradebook is a .csv file, not a notebook")
    notebooks = [(path, _load_notebook(path)) for path in notebooks_to_grade(paths)]  # all read first
    rows = []  # (notebook, exercise, PASS/FAIL, detail)
    for path, notebook in notebooks:
        print(f"Grading {path}")
        checks = exercise_checks(notebook)
        results = {result.index: result for result in run_nbval(path)}
        graded = []
        for index, label in checks.items():
            result = results.get(index)
            if result is None or result.outcome == "skipped":
                graded.append((path, label, "FAIL", "did not run"))
            elif result.outcome == "failed":
                graded.append((path, label, "FAIL", result.message))
            else:
                graded.append((path, label, "PASS", ""))
        others = [r for i, r in sorted(results.items()) if i not in checks and r.outcome == "failed"]
        graded += [(path, f"code cell {r.index} (not a check)", "FAIL", r.message) for r in others]
        for _, label, outcome, detail in graded:
            print(f"  {outcome}  {label}" + (f": {detail}" if detail else ""))
        rows += graded
        passed = sum(1 for i in checks if i in results and results[i].outcome == "passed")
        print(f"  {passed} of {len(checks)} exercises passed" + (f"; {len(others)} other cells failed" if others else ""))
    if len(notebooks) > 1:
        passed = sum(1 for row in rows if row[2] == "PASS")
        print(f"{len(notebooks)} notebooks graded: {passed} of {len(rows)} checks passed")
    if csv_path is not None:
        with open(csv_path, "w", newline="") as file:
            writer = csv.writer(file)
            writer.writerow(["notebook", "exercise", "result", "detail"])
            writer.writerows((str(path), label, outcome, detail) for path, label, outcome, detail in rows)
        print(f"gradebook: {csv_path}")
    return 0 if all(row[2] == "PASS" for row in rows) else 1
