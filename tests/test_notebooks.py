"""The notebooks' shape: badge, setup cell, markers, executed lessons, clean exercises.

Running them is nbval's job: `pytest` collects notebooks/ and solutions/ with --nbval-lax
(see pyproject.toml), so every lesson and solution runs top to bottom in CI.
"""

import re
from pathlib import Path

import nbformat
import pytest
import torch

from course_lib.course import SETUP_CELL, colab_badge

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(
    p.relative_to(ROOT) for folder in ("notebooks", "solutions", "exercises") for p in (ROOT / folder).glob("*.ipynb")
)
MARKER = re.compile(r"NBVAL_\w+")


def read(path):
    return nbformat.read(ROOT / path, as_version=4)


def code_cells(path):
    return [cell for cell in read(path).cells if cell.cell_type == "code"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=str)
def test_starts_with_title_badge_and_setup_cell(path):
    cells = read(path).cells
    assert cells[0].cell_type == "markdown" and cells[0].source.startswith("# ")
    assert colab_badge(path.as_posix()) in cells[0].source, "the Colab badge must open this very notebook"
    assert cells[1].cell_type == "code" and cells[1].source == SETUP_CELL, "use course_lib.course.SETUP_CELL"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=str)
def test_markers_stand_on_their_own_line(path):
    for cell in code_cells(path):
        for number, line in enumerate(cell.source.splitlines()):
            if MARKER.search(line):
                assert re.fullmatch(r"# NBVAL_(CHECK_OUTPUT|SKIP|IGNORE_OUTPUT)", line.strip()), line
            if "%%gpu_only" in line:
                assert number == 0 and len(line.split()) > 1, (
                    "%%gpu_only goes on the first line, followed by what a GPU would show"
                )


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p.parts[0] != "exercises"], ids=str)
def test_lessons_and_solutions_are_committed_executed_without_errors(path):
    for cell in code_cells(path):
        assert cell.execution_count is not None, f"{path}: run it and commit it with its outputs"
        assert not any(out.output_type == "error" for out in cell.outputs), f"{path}: a cell failed"


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p.parts[0] == "exercises"], ids=str)
def test_exercises_ship_without_outputs(path):
    assert all(not cell.outputs and cell.execution_count is None for cell in code_cells(path))


def test_every_solution_has_its_lesson_and_the_readme_lists_them():
    lessons = {p.name for p in NOTEBOOKS if p.parts[0] == "notebooks"}
    assert lessons
    assert {p.name for p in NOTEBOOKS if p.parts[0] == "solutions"} <= lessons
    readme = (ROOT / "README.md").read_text()
    for name in lessons:
        assert f"notebooks/{name}" in readme, f"README's lesson list misses {name}"


def test_gpu_only_cells_skip_on_cpu_with_their_reason(capsys):
    if torch.cuda.is_available():
        pytest.skip("this asserts the CPU behaviour")
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "course_lib")
    result = shell.run_cell("%%gpu_only shows what the allocator reserves\nraise SystemExit('the body ran')")
    assert result.success
    assert capsys.readouterr().out.strip() == "Skipped on CPU (no CUDA GPU): shows what the allocator reserves"
