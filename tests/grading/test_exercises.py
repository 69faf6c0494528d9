"""The exercise pipeline: generation from solutions/, protection of learners' work (docs/grading.md)."""

import csv
import difflib
import io
import json
import re
import shutil
import subprocess
import sys
import textwrap
import tokenize
from pathlib import Path

import nbformat
import pytest

from course_lib.course import colab_url
from course_lib.grading import (
    BEGIN,
    END,
    METADATA,
    jupyterlab_kernelspec,
    learner_fingerprint,
    make_exercise,
    protected_cells,
    set_kernelspec,
    strip_solutions,
    write_exercises,
)

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
COURSE_LIB = str(Path(sys.executable).parent / "course-lib")


def course_lib(*args, cwd=ROOT):
    return subprocess.run([COURSE_LIB, *args], capture_output=True, text=True, cwd=cwd)


def snapshot(folder: Path) -> dict:
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_strip_solutions_keeps_the_indentation_and_the_rest():
    source = f"def f(x):\n    y = 1\n    {BEGIN}\n    return x + y\n    {END}\n\nprint(f)"
    assert (
        strip_solutions(source)
        == "def f(x):\n    y = 1\n    # YOUR CODE HERE\n    raise NotImplementedError()\n\nprint(f)"
    )
    assert strip_solutions("x = 1") == "x = 1"


@pytest.mark.parametrize(
    "source, problem",
    [
        (f"{BEGIN}\nx = 1", f"{BEGIN} without {END}"),
        (f"x = 1\n{END}", f"{END} without {BEGIN}"),
        (f"{BEGIN}\n{BEGIN}\n{END}", "inside another solution block"),
    ],
)
def test_unbalanced_markers_are_clear_errors(source, problem):
    with pytest.raises(ValueError, match=problem):
        strip_solutions(source, "solutions/x.ipynb cell 3")


def test_make_exercise_has_stubs_no_outputs_its_own_badge_and_the_record_of_its_check_cells():
    solution = nbformat.read(SOLUTIONS[0], as_version=4)
    exercise = make_exercise(solution, f"solutions/{SOLUTIONS[0].name}", f"exercises/{SOLUTIONS[0].name}")
    code = [cell for cell in exercise.cells if cell.cell_type == "code"]
    assert all(cell.outputs == [] and cell.execution_count is None for cell in code)
    assert not any(BEGIN in cell.source or END in cell.source for cell in code)
    assert sum("raise NotImplementedError()" in cell.source for cell in code) >= 1
    assert colab_url(f"exercises/{SOLUTIONS[0].name}") in exercise.cells[0].source
    assert colab_url(f"solutions/{SOLUTIONS[0].name}") not in exercise.cells[0].source
    record = exercise.metadata[METADATA]
    assert record["exercise"] == SOLUTIONS[0].stem
    assert [cell["role"] for cell in record["cells"]][0] == "setup" and record["cells"][0]["id"] == code[0].id
    checks = [cell for cell in code if "checks.check_" in cell.source]
    assert [cell["id"] for cell in record["cells"][1:]] == [cell.id for cell in checks]
    assert exercise.metadata["kernelspec"] == jupyterlab_kernelspec()


def test_a_solution_without_an_exercise_is_an_error():
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")])
    with pytest.raises(ValueError, match="no ### BEGIN SOLUTION"):
        make_exercise(notebook, "solutions/x.ipynb", "exercises/x.ipynb")


def test_every_exercise_of_the_course_records_a_setup_cell_and_a_check_per_exercise():
    for solution in SOLUTIONS:
        cells = protected_cells(nbformat.read(solution, as_version=4), solution.name)
        assert cells[0]["role"] == "setup" and any(cell["role"] == "check" for cell in cells), solution.name


def test_exercises_folder_is_exactly_what_the_generator_makes(tmp_path):
    write_exercises(ROOT / "solutions", tmp_path / "exercises")
    generated = {p.name: p.read_text() for p in (tmp_path / "exercises").iterdir()}
    committed = {p.name: p.read_text() for p in (ROOT / "exercises").iterdir()}
    assert generated.keys() == committed.keys(), "run `course-lib make-exercises` and commit exercises/"
    for name in generated:
        assert generated[name] == committed[name], f"exercises/{name} is stale: run `course-lib make-exercises`"


def test_every_committed_notebook_has_the_kernel_spec_jupyterlab_writes():
    """Else opening a notebook in JupyterLab changes it (autosave rewrites the kernel spec)."""
    stale = [
        str(p.relative_to(ROOT))
        for folder in ("notebooks", "solutions", "exercises")
        for p in sorted((ROOT / folder).glob("*.ipynb"))
        if nbformat.read(p, as_version=4).metadata.get("kernelspec") != jupyterlab_kernelspec()
    ]
    assert not stale, f"run `course-lib kernelspec notebooks solutions` and `course-lib make-exercises`: {stale}"


def test_set_kernelspec_changes_the_kernel_spec_and_nothing_else(tmp_path):
    path = tmp_path / "x.ipynb"
    notebook = nbformat.read(SOLUTIONS[0], as_version=4)
    notebook.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    nbformat.write(notebook, path)
    assert set_kernelspec(path) and not set_kernelspec(path)
    notebook.metadata["kernelspec"] = jupyterlab_kernelspec()
    assert path.read_text() == nbformat.writes(notebook) + "\n"


@pytest.mark.parametrize(
    "damage, says",
    [
        (
            lambda folder: (folder / "b.ipynb").write_text("{ not json"),
            "b.ipynb: not a readable notebook (NotJSONError)",
        ),
        (
            lambda folder: (folder / "b.ipynb").write_text(
                json.dumps({"nbformat": 3, "nbformat_minor": 0, "metadata": {}, "worksheets": [{"cells": []}]})
            ),
            "b.ipynb: a notebook of nbformat 3, which rewriting would convert to 4",
        ),
        (lambda folder: [p.unlink() for p in folder.glob("*.ipynb")], "folder: no notebooks (.ipynb) in this folder"),
    ],
)
def test_kernelspec_refuses_what_it_would_damage_in_one_line_and_changes_nothing(tmp_path, damage, says):
    folder = tmp_path / "folder"
    folder.mkdir()
    notebook = nbformat.read(SOLUTIONS[0], as_version=4)
    notebook.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    nbformat.write(notebook, folder / "a.ipynb")
    damage(folder)
    before = snapshot(tmp_path)
    result = course_lib("kernelspec", "folder", cwd=tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and says in lines[0], result.stderr
    assert snapshot(tmp_path) == before


def test_an_exercise_torn_by_a_killed_write_is_named_so_and_nothing_is_written(tmp_path):
    """Not 'your work?': a learner's notebook saved by Jupyter is whole. --force writes it again."""
    shutil.copytree(ROOT / "solutions", tmp_path / "solutions")
    write_exercises(tmp_path / "solutions", tmp_path / "exercises")
    torn = tmp_path / "exercises" / SOLUTIONS[1].name
    torn.write_text(torn.read_text()[:1000])
    before = snapshot(tmp_path)
    result = course_lib("make-exercises", cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.strip() == (
        f"course-lib: error: exercises/{torn.name}: not a readable notebook (a write cut short?), so not what was "
        "generated nor a learner's work saved by Jupyter; nothing was written: move it away, or pass --force to "
        "write it again"
    )
    assert snapshot(tmp_path) == before
    assert course_lib("make-exercises", "--force", cwd=tmp_path).returncode == 0
    assert torn.read_text() == (ROOT / "exercises" / torn.name).read_text()
    assert not list((tmp_path / "exercises").glob(".*.writing"))  # written whole, through a temporary file


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


def test_an_exercise_only_opened_and_run_is_not_the_learners_work(tmp_path):
    """JupyterLab rewrites the metadata (kernel spec, language version) and a run adds outputs:
    neither is an edit, so a changed solution still updates the exercise."""
    shutil.copytree(ROOT / "solutions", tmp_path / "solutions")
    write_exercises(tmp_path / "solutions", tmp_path / "exercises")
    exercise = tmp_path / "exercises" / SOLUTIONS[0].name
    opened = nbformat.read(exercise, as_version=4)
    opened.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    opened.metadata["language_info"]["version"] = "3.12.1"
    opened.cells[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text="OK   python\n")]
    opened.cells[1].execution_count, opened.cells[1].metadata["scrolled"] = 1, True
    nbformat.write(opened, exercise)
    assert learner_fingerprint(opened) == learner_fingerprint(nbformat.read(ROOT / "exercises" / exercise.name, 4))

    solution = tmp_path / "solutions" / SOLUTIONS[0].name
    notebook = nbformat.read(solution, as_version=4)
    notebook.cells.append(nbformat.v4.new_markdown_cell("A new closing remark."))
    nbformat.write(notebook, solution)
    report = write_exercises(tmp_path / "solutions", tmp_path / "exercises")
    assert f"updated {exercise}" in report
    assert "A new closing remark." in exercise.read_text()
    manifest = json.loads((tmp_path / "exercises" / ".generated.json").read_text())
    assert set(manifest) == {p.name for p in SOLUTIONS}


def test_make_exercises_refuses_to_write_over_the_solutions(tmp_path):
    shutil.copytree(ROOT / "solutions", tmp_path / "s2")
    before = snapshot(tmp_path)
    for exercises in ("s2", "./s2/", str(tmp_path / "s2")):
        result = course_lib("make-exercises", "--solutions", "s2", "--exercises", exercises, "--force", cwd=tmp_path)
        assert result.returncode == 2 and "are the same folder" in result.stderr, result.stderr
    assert snapshot(tmp_path) == before


def test_a_broken_solution_stops_make_exercises_before_anything_is_written(tmp_path):
    shutil.copytree(ROOT / "solutions", tmp_path / "solutions")
    last = tmp_path / "solutions" / SOLUTIONS[-1].name
    last.write_text(last.read_text().replace(END, "", 1))  # an unfinished block in the last one
    result = course_lib("make-exercises", cwd=tmp_path)
    assert result.returncode == 2 and "without ### END SOLUTION; nothing was written" in result.stderr
    assert not (tmp_path / "exercises").exists()


def test_the_manifest_records_each_exercise_as_soon_as_it_is_written(tmp_path):
    """A run stopped by a write error keeps the record of what it wrote: the next run updates
    those exercises instead of keeping them as 'edited since generated'."""
    shutil.copytree(ROOT / "solutions", tmp_path / "solutions")
    (tmp_path / "exercises" / SOLUTIONS[2].name).mkdir(parents=True)  # the third cannot be written
    stopped = course_lib("make-exercises", cwd=tmp_path)
    assert stopped.returncode == 2 and f"exercises/{SOLUTIONS[2].name}: cannot write it" in stopped.stderr
    assert set(json.loads((tmp_path / "exercises" / ".generated.json").read_text())) == {p.name for p in SOLUTIONS[:2]}
    (tmp_path / "exercises" / SOLUTIONS[2].name).rmdir()
    again = course_lib("make-exercises", cwd=tmp_path)
    assert again.returncode == 0 and "kept" not in again.stdout, again.stdout


@pytest.mark.parametrize(
    "damage, says",
    [
        (lambda ex: (ex / ".generated.json").write_text("{ not json"), "cannot read the record of generated exercises"),
        (lambda ex: (ex / ".generated.json").write_text("[1, 2]"), "not a record of generated exercises"),
        (lambda ex: shutil.rmtree(ex) or ex.write_text("a file where the folder goes"), "cannot write it"),
    ],
)
def test_a_damaged_exercises_folder_is_one_clear_line_and_loses_nothing(tmp_path, damage, says):
    shutil.copytree(ROOT / "solutions", tmp_path / "solutions")
    write_exercises(tmp_path / "solutions", tmp_path / "exercises")
    exercise = tmp_path / "exercises" / SOLUTIONS[0].name
    exercise.write_text(exercise.read_text().replace("raise NotImplementedError()", "return 42", 1))
    damage(tmp_path / "exercises")
    before = snapshot(tmp_path)
    result = course_lib("make-exercises", cwd=tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and says in lines[0], result.stderr
    assert snapshot(tmp_path) == before


@pytest.mark.slow
@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_grading_passes_the_solution_and_fails_the_exercise_at_its_checks_only(tmp_path, solution):
    """An instructor's run: one folder per learner, one solved and one untouched; every notebook is
    graded once, each (notebook, exercise) is one CSV row, the untouched exercise fails only at its
    checks (no other cell fails), and no notebook is modified."""
    solved, unsolved = tmp_path / "submissions" / "ada", tmp_path / "submissions" / "bob"
    for folder, source in ((solved, solution), (unsolved, ROOT / "exercises" / solution.name)):
        folder.mkdir(parents=True)
        shutil.copy(source, folder)
    (solved / ".ipynb_checkpoints").mkdir()  # Jupyter's autosaves are not submissions
    shutil.copy(ROOT / "exercises" / solution.name, solved / ".ipynb_checkpoints" / "x-checkpoint.ipynb")
    before = snapshot(tmp_path)
    result = course_lib("grade", "submissions", "--csv", "grades.csv", "--jobs", "2", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    with open(tmp_path / "grades.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    labels = [
        cell["label"] for cell in protected_cells(nbformat.read(solution, as_version=4)) if cell["role"] == "check"
    ]
    expected = {(f"submissions/{learner}/{solution.name}", label) for learner in ("ada", "bob") for label in labels}
    assert {(row["notebook"], row["exercise"]) for row in rows} == expected and len(rows) == len(expected)
    for row in rows:
        if "/ada/" in row["notebook"]:
            assert row["result"] == "PASS" and row["detail"] == "" and row["check_cell"] == "", row
        else:
            assert row["result"] == "FAIL" and "NotImplementedError" in row["detail"], row
    assert f"2 notebooks graded: {len(labels)} of {2 * len(labels)} exercises passed" in result.stdout
    assert {p: data for p, data in snapshot(tmp_path).items() if p.suffix == ".ipynb"} == before


def normalized(source: str) -> list[str]:
    """The code's tokens, without comments, docstrings, magics or layout: what a copy keeps. Tokens, not
    characters: a one-line formula shares most of its characters with any other (`4 * batch * ...`)."""
    code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(textwrap.dedent(code)).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return code.split()
    return [
        token.string
        for token in tokens
        if token.type not in skip and not (token.type == tokenize.STRING and token.string.startswith(('"""', "'''")))
    ]


def answers(source: str) -> list[str]:
    """The solution blocks of a cell, markers left out."""
    return re.findall(rf"^[ \t]*{BEGIN}\n(.*?)^[ \t]*{END}", source, re.MULTILINE | re.DOTALL)


ANSWERS = [
    (solution, n)
    for solution in SOLUTIONS
    for n, cell in enumerate(nbformat.read(solution, 4).cells)
    if answers(cell.source)
]


@pytest.mark.parametrize(
    "solution, index", ANSWERS, ids=lambda value: value.stem if isinstance(value, Path) else f"cell {value}"
)
def test_no_exercise_answer_is_printed_by_its_lesson(solution, index):
    """An exercise that the lesson's code answers is transcription: at most 80% of an answer's code (its
    tokens, in order) may be found in any one code cell of the lesson."""
    lesson = [
        normalized(cell.source)
        for cell in nbformat.read(ROOT / "notebooks" / solution.name, 4).cells
        if cell.cell_type == "code"
    ]
    for answer in map(normalized, answers(nbformat.read(solution, 4).cells[index].source)):
        for n, code in enumerate(lesson):
            matcher = difflib.SequenceMatcher(None, answer, code, autojunk=False)
            copied = sum(block.size for block in matcher.get_matching_blocks()) / len(answer)
            assert copied <= 0.8, f"{copied:.0%} of this answer is in the lesson's code cell {n + 1}: transcription"


def _copied(answer: str, code: str) -> float:
    answer, code = normalized(answer), normalized(code)
    return sum(
        block.size for block in difflib.SequenceMatcher(None, answer, code, autojunk=False).get_matching_blocks()
    ) / len(answer)


def test_the_near_copy_measure_flags_a_renamed_copy_and_passes_a_generalisation():
    lesson = (
        "def train(model, batches, k):\n    for i, batch in enumerate(batches):\n        loss = model(batch) / k\n"
        "        loss.backward()\n        if (i + 1) % k == 0:\n            step()\n"
    )
    copy = lesson.replace("    ", "  ") + "# a comment\n"
    assert _copied(copy, lesson) == 1.0
    assert _copied("return 4 * batch * sum(widths[:-1])", "by_hand = 4 * batch * (d_in + hidden)") <= 0.8
