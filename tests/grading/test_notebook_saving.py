"""What a learner's JupyterLab does to a committed notebook: opening and saving one changes nothing, its
saved widget state holds exactly the models its outputs show, and no text output is wider than a
laptop's notebook column (the issue "the course as a learner sees it"; the real browser's run is
tests/browser_check.py, `make browser-test`). And what a learner reads: no markdown cell is a wall of text
or holds a table wider than that column, and none says "seed" for the popular texts the course corrects
(issue 47, "the lessons as a learner reads them")."""

import json
import re
from pathlib import Path

import nbformat
import pytest

from course_lib.grading import as_jupyterlab_saves, shown_widget_models
from course_lib.grading.kernelspec import WIDGET_STATE

ROOT = Path(__file__).resolve().parents[2]
EXECUTED = sorted(p.relative_to(ROOT) for folder in ("notebooks", "solutions") for p in (ROOT / folder).glob("*.ipynb"))
ALL = sorted(EXECUTED + [p.relative_to(ROOT) for p in (ROOT / "exercises").glob("*.ipynb")])
WIDTH = 110  # characters: a text table wider than this wraps its rows at 1280 px with the sidebar closed
WORDS = 250  # words in one markdown cell: one idea a cell, next to the cell that measures it
SEED = re.compile(r"\bseed(s|'s)?\b", re.IGNORECASE)
RANDOM_SEED = ("seed and an offset", "random seed")  # the RNG's seed, the only sense a lesson may use


def _save_cases():
    for path in ALL:
        yield pytest.param(path, id=path.as_posix())


@pytest.mark.parametrize("path", list(_save_cases()))
def test_open_and_save_in_jupyterlab_changes_nothing(path):
    text = (ROOT / path).read_text()
    assert as_jupyterlab_saves(text) == text, (
        f"{path}: run `course-lib kernelspec` (notebooks as JupyterLab saves them)"
    )


@pytest.mark.parametrize("path", ALL, ids=str)
def test_saved_widget_state_holds_exactly_the_models_shown(path):
    notebook = json.loads((ROOT / path).read_text())
    state = notebook["metadata"].get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    assert set(state) == shown_widget_models(notebook), f"{path}: stale or missing widget state"


def test_the_normaliser_merges_streams_drops_stale_widgets_and_writes_numbers_as_javascript():
    notebook = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("print(1); print(2)", execution_count=1)
    cell.outputs = [
        nbformat.v4.new_output("stream", name="stdout", text="1\n"),
        nbformat.v4.new_output("stream", name="stdout", text="2\n"),
    ]
    notebook.cells = [cell]
    notebook.metadata["widgets"] = {
        WIDGET_STATE: {"state": {"stale": {"state": {"max": 3.0}}}, "version_major": 2, "version_minor": 0}
    }
    saved = json.loads(as_jupyterlab_saves(nbformat.writes(notebook)))
    assert [o["text"] for o in saved["cells"][0]["outputs"]] == [["1\n", "2\n"]]
    assert "widgets" not in saved["metadata"]
    assert json.loads(
        as_jupyterlab_saves('{"cells": [], "metadata": {"x": 3.0, "y": 0.5}, "nbformat": 4, "nbformat_minor": 5}')
    )["metadata"] | {"kernelspec": None} == {"x": 3, "y": 0.5, "kernelspec": None}


@pytest.mark.parametrize("path", EXECUTED, ids=str)
def test_no_text_output_is_wider_than_a_laptops_notebook_column(path):
    wide = []
    for index, cell in enumerate(nbformat.read(ROOT / path, as_version=4).cells):
        for output in cell.get("outputs", []):
            text = (
                output.get("text", "")
                if output.output_type == "stream"
                else output.get("data", {}).get("text/plain", "")
                if "text/html" not in output.get("data", {})
                else ""
            )
            width = max((len(line) for line in text.splitlines()), default=0)
            if width > WIDTH:
                wide.append(f"cell {index}: {width} characters")
    assert not wide, f"{path}: text wider than {WIDTH} characters: {', '.join(wide)}"


def _markdown_cells(path):
    for index, cell in enumerate(nbformat.read(ROOT / path, as_version=4).cells):
        if cell.cell_type == "markdown":
            yield index, cell.source


@pytest.mark.parametrize("path", ALL, ids=str)
def test_no_markdown_cell_is_a_wall_of_text_or_a_wide_table(path):
    problems = []
    for index, source in _markdown_cells(path):
        words = len(source.split())
        if words > WORDS:
            problems.append(f"cell {index}: {words} words (split it at an idea's boundary)")
        rows = [len(line) for line in source.splitlines() if line.startswith("|") and len(line) > WIDTH]
        if rows:
            problems.append(f"cell {index}: {len(rows)} table rows wider than {WIDTH} characters (widest {max(rows)})")
    assert not problems, f"{path}: at most {WORDS} words a markdown cell, table rows of {WIDTH}: {'; '.join(problems)}"


@pytest.mark.parametrize("path", ALL, ids=str)
def test_no_markdown_cell_says_seed_but_for_a_random_number_generator(path):
    found = []
    for index, source in _markdown_cells(path):
        text = source
        for phrase in RANDOM_SEED:
            text = re.sub(re.escape(phrase), "", text, flags=re.IGNORECASE)
        found += [f"cell {index}: {match.group(0)!r}" for match in SEED.finditer(text)]
    assert not found, (
        f"{path}: name the text a claim comes from (docs/references.md) or say 'popular guides', "
        f"not 'the seed': {', '.join(found)}"
    )
