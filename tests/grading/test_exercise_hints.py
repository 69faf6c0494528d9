"""What a learner meets around each exercise (issue 47, item 7, "the lessons as a learner reads them"):
a hint they can open before grading, collapsed (a `<details>` markdown cell between the exercise's
heading and the code cell they fill in: JupyterLab and Colab render it closed), and, as the solution
notebook's last cell, what its checks verified, naming every exercise. The exercises are generated
from solutions/, so they must show the same; the tests below also prove that each rule can fail."""

import re
from pathlib import Path

import nbformat
import pytest

from course_lib.grading.generate import EXERCISE_HEADING

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
NOTEBOOKS = sorted(
    p.relative_to(ROOT) for folder in ("solutions", "exercises") for p in (ROOT / folder).glob("*.ipynb")
)
HINT = re.compile(r"\A<details><summary>Hint</summary>\n\n(.*\S.*)\n\n</details>\Z", re.DOTALL)
VERIFIED = "## What the checks verified"


def is_hint(cell) -> bool:
    """A markdown cell that is one collapsed hint, with some text in it."""
    found = HINT.match(cell.source) if cell.cell_type == "markdown" else None
    return bool(found and found.group(1).strip())


def exercises(notebook) -> list[tuple[str, int]]:
    """(name, cell index) of each exercise heading, "Exercise 3.2" for `### Exercise 3.2: ...`, found as
    the grader labels its checks (course_lib.grading.generate.EXERCISE_HEADING)."""
    found = []
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type == "markdown":
            for heading in EXERCISE_HEADING.finditer(cell.source):
                name = re.match(r"Exercise\s+\d+(\.\d+)*", heading.group(1))
                found.append((name.group(0) if name else heading.group(1), index))
    return found


def hint_problems(notebook) -> list[str]:
    """An exercise without a collapsed hint cell between its heading and its first code cell."""
    cells, problems = notebook.cells, []
    for name, index in exercises(notebook):
        code = next((i for i in range(index + 1, len(cells)) if cells[i].cell_type == "code"), len(cells))
        if not any(is_hint(cell) for cell in cells[index + 1 : code]):
            problems.append(
                f"{name} (cell {index}): no hint cell before its code cell {code}, of the form "
                "'<details><summary>Hint</summary>\\n\\n...\\n\\n</details>'"
            )
    return problems


def verified_problems(notebook) -> list[str]:
    """The notebook does not end with a markdown cell saying what its checks verified, naming each exercise."""
    last = notebook.cells[-1] if notebook.cells else None
    if last is None or last.cell_type != "markdown" or not last.source.startswith(VERIFIED):
        return [f"the last cell is not a markdown cell that starts with {VERIFIED!r}"]
    return [
        f"{VERIFIED!r} does not name {name}"
        for name, _ in exercises(notebook)
        if not re.search(rf"{re.escape(name)}(?![\d.]*\d)", last.source)
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=str)
def test_every_exercise_has_a_collapsed_hint_before_its_code_cell(path):
    notebook = nbformat.read(ROOT / path, as_version=4)
    assert exercises(notebook), f"{path}: no '### Exercise N.M' heading"
    problems = hint_problems(notebook)
    assert not problems, f"{path}: " + "; ".join(problems)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=str)
def test_every_notebook_ends_with_what_the_checks_verified_naming_each_exercise(path):
    problems = verified_problems(nbformat.read(ROOT / path, as_version=4))
    assert not problems, f"{path}: " + "; ".join(problems)


def _first_hint(notebook) -> int:
    return next(i for i, cell in enumerate(notebook.cells) if is_hint(cell))


def _without_first_hint(notebook):
    del notebook.cells[_first_hint(notebook)]


def _hint_shown_open(notebook):
    cell = notebook.cells[_first_hint(notebook)]
    cell.source = cell.source.replace("<details><summary>Hint</summary>\n\n", "Hint: ").replace("\n\n</details>", "")


def _hint_after_the_code_cell(notebook):
    index = _first_hint(notebook)
    notebook.cells.insert(index + 1, notebook.cells.pop(index))


def _empty_hint(notebook):
    notebook.cells[_first_hint(notebook)].source = "<details><summary>Hint</summary>\n\n \n\n</details>"


def _without_verified(notebook):
    notebook.cells.pop()


def _verified_not_last(notebook):
    notebook.cells.append(nbformat.v4.new_markdown_cell("A closing remark."))


def _verified_without_the_last_exercise(notebook):
    name = exercises(notebook)[-1][0]
    notebook.cells[-1].source = notebook.cells[-1].source.replace(name, "Exercise 9.9")


@pytest.mark.parametrize(
    "damage, rule, says",
    [
        (_without_first_hint, hint_problems, "no hint cell before its code cell"),
        (_hint_shown_open, hint_problems, "no hint cell before its code cell"),
        (_hint_after_the_code_cell, hint_problems, "no hint cell before its code cell"),
        (_empty_hint, hint_problems, "no hint cell before its code cell"),
        (_without_verified, verified_problems, "the last cell is not a markdown cell"),
        (_verified_not_last, verified_problems, "the last cell is not a markdown cell"),
        (_verified_without_the_last_exercise, verified_problems, "does not name Exercise"),
    ],
    ids=lambda value: value.__name__.strip("_") if callable(value) else None,
)
@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_a_broken_copy_of_a_solution_fails_the_rule(tmp_path, solution, damage, rule, says):
    notebook = nbformat.read(solution, as_version=4)
    assert rule(notebook) == []
    damage(notebook)
    nbformat.write(notebook, tmp_path / solution.name)
    problems = rule(nbformat.read(tmp_path / solution.name, as_version=4))
    assert len(problems) == 1 and says in problems[0], problems


def test_an_exercise_numbered_past_nine_is_not_named_by_its_prefix():
    """'Exercise 1.1' in the closing cell does not count for an exercise 1.10."""
    notebook = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_markdown_cell("### Exercise 1.10: late"),
            nbformat.v4.new_markdown_cell(f"{VERIFIED}\n\n- Exercise 1.1: something"),
        ]
    )
    assert verified_problems(notebook) == [f"{VERIFIED!r} does not name Exercise 1.10"]
