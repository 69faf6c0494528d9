"""The exercise pipeline: generation from solutions/, protection of learners' work, grading (README)."""

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from course_lib.course import colab_url
from course_lib.exercises import (BEGIN, END, exercise_checks, make_exercise, run_nbval, strip_solutions,
                                  write_exercises)

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
COURSE_LIB = str(Path(sys.executable).parent / "course-lib")


def course_lib(*args, cwd=ROOT):
    return subprocess.run([COURSE_LIB, *args], capture_output=True, text=True, cwd=cwd)


def test_strip_solutions_keeps_the_indentation_and_the_rest():
    source = f"def f(x):\n    y = 1\n    {BEGIN}\n    return x + y\n    {END}\n\nprint(f)"
    assert strip_solutions(source) == "def f(x):\n    y = 1\n    # YOUR CODE HERE\n    raise NotImplementedError()\n\nprint(f)"
    assert strip_solutions("x = 1") == "x = 1"


@pytest.mark.parametrize("source, problem", [
    (f"{BEGIN}\nx = 1", f"{BEGIN} without {END}"),
    (f"x = 1\n{END}", f"{END} without {BEGIN}"),
    (f"{BEGIN}\n{BEGIN}\n{END}", "inside another solution block"),
])
def test_unbalanced_markers_are_clear_errors(source, problem):
    with pytest.raises(ValueError, match=problem):
        strip_solutions(source, "solutions/x.ipynb cell 3")


def test_make_exercise_has_stubs_no_outputs_and_its_own_badge():
    solution = nbformat.read(SOLUTIONS[0], as_version=4)
    exercise = make_exercise(solution, f"solutions/{SOLUTIONS[0].name}", f"exercises/{SOLUTIONS[0].name}")
    code = [cell for cell in exercise.cells if cell.cell_type == "code"]
    assert all(cell.outputs == [] and cell.execution_count is None for cell in code)
    assert not any(BEGIN in cell.source or END in cell.source for cell in code)
    assert sum("raise NotImplementedError()" in cell.source for cell in code) >= 1
    assert colab_url(f"exercises/{SOLUTIONS[0].name}") in exercise.cells[0].source
    assert colab_url(f"solutions/{SOLUTIONS[0].name}") not in exercise.cells[0].source


def test_a_solution_without_an_exercise_is_an_error():
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")])
    with pytest.raises(ValueError, match="no ### BEGIN SOLUTION"):
        make_exercise(notebook, "solutions/x.ipynb", "exercises/x.ipynb")


def test_exercises_folder_is_exactly_what_the_generator_makes(tmp_path):
    write_exercises(ROOT / "solutions", tmp_path / "exercises")
    generated = {p.name: p.read_text() for p in (tmp_path / "exercises").iterdir()}
    committed = {p.name: p.read_text() for p in (ROOT / "exercises").iterdir()}
    assert generated.keys() == committed.keys(), "run `course-lib make-exercises` and commit exercises/"
    for name in generated:
        assert generated[name] == committed[name], f"exercises/{name} is stale: run `course-lib make-exercises`"


def test_a_learners_edited_exercise_survives_regeneration(tmp_path):
    shutil.copytree(ROOT / "solutions", tmp_path / "solutions")
    assert course_lib("make-exercises", cwd=tmp_path).returncode == 0
    exercise = tmp_path / "exercises" / SOLUTIONS[0].name
    learners_work = exercise.read_text().replace("raise NotImplementedError()", "return 42", 1)
    exercise.write_text(learners_work)

    again = course_lib("make-exercises", cwd=tmp_path)
    assert again.returncode == 1 and f"kept exercises/{exercise.name}" in again.stdout
    assert exercise.read_text() == learners_work

    forced = course_lib("make-exercises", "--force", cwd=tmp_path)
    assert forced.returncode == 0 and exercise.read_text() != learners_work


def test_an_unedited_exercise_follows_its_solution(tmp_path):
    shutil.copytree(ROOT / "solutions", tmp_path / "solutions")
    write_exercises(tmp_path / "solutions", tmp_path / "exercises")
    solution = tmp_path / "solutions" / SOLUTIONS[0].name
    notebook = nbformat.read(solution, as_version=4)
    notebook.cells.append(nbformat.v4.new_markdown_cell("A new closing remark."))
    nbformat.write(notebook, solution)
    report = write_exercises(tmp_path / "solutions", tmp_path / "exercises")
    assert f"updated {tmp_path / 'exercises' / SOLUTIONS[0].name}" in report
    assert "A new closing remark." in (tmp_path / "exercises" / SOLUTIONS[0].name).read_text()
    manifest = json.loads((tmp_path / "exercises" / ".generated.json").read_text())
    assert set(manifest) == {p.name for p in SOLUTIONS}


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_unsolved_exercise_fails_only_at_its_check_cells(solution):
    exercise = ROOT / "exercises" / solution.name
    checks = exercise_checks(nbformat.read(exercise, as_version=4))
    assert checks, f"{exercise.name} has no check cell (checks.check_...)"
    failed = {result.index for result in run_nbval(exercise) if result.outcome == "failed"}
    assert failed == set(checks)


def test_grading_a_folder_of_submissions_passes_solutions_fails_exercises_and_writes_a_gradebook(tmp_path):
    """An instructor's run: one folder per learner, one solved and one untouched; every notebook is
    graded once, and each (notebook, exercise) is one row of the CSV gradebook."""
    solved, unsolved = tmp_path / "submissions" / "ada", tmp_path / "submissions" / "bob"
    shutil.copytree(ROOT / "solutions", solved)
    shutil.copytree(ROOT / "exercises", unsolved, ignore=shutil.ignore_patterns(".*"))
    (solved / ".ipynb_checkpoints").mkdir()  # Jupyter's autosaves are not submissions
    shutil.copy(ROOT / "exercises" / SOLUTIONS[0].name, solved / ".ipynb_checkpoints" / "x-checkpoint.ipynb")
    result = course_lib("grade", "submissions", "--csv", "grades.csv", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    with open(tmp_path / "grades.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    checks = {s.name: exercise_checks(nbformat.read(s, as_version=4)) for s in SOLUTIONS}
    expected = {(f"submissions/{learner}/{name}", label) for learner in ("ada", "bob")
                for name, labels in checks.items() for label in labels.values()}
    assert {(row["notebook"], row["exercise"]) for row in rows} == expected and len(rows) == len(expected)
    for row in rows:
        if "/ada/" in row["notebook"]:
            assert row["result"] == "PASS" and row["detail"] == "", row
        else:
            assert row["result"] == "FAIL" and "NotImplementedError" in row["detail"], row
    assert f"{2 * len(SOLUTIONS)} notebooks graded: {len(expected) // 2} of {len(expected)} checks passed" in result.stdout


def test_grading_does_not_modify_the_notebook():
    exercise = ROOT / "exercises" / SOLUTIONS[0].name
    before = exercise.read_bytes()
    course_lib("grade", str(exercise))
    assert exercise.read_bytes() == before
