"""What a learner's JupyterLab does to a committed notebook: opening and saving one changes nothing, its
saved widget state holds exactly the models its outputs show, and no text output is wider than a
laptop's notebook column (the issue "the course as a learner sees it"; the real browser's run is
tests/browser_check.py, `make browser-test`)."""

import json
from pathlib import Path

import nbformat
import pytest

from course_lib.grading import as_jupyterlab_saves, shown_widget_models
from course_lib.grading.kernelspec import WIDGET_STATE

ROOT = Path(__file__).resolve().parents[2]
EXECUTED = sorted(p.relative_to(ROOT) for folder in ("notebooks", "solutions") for p in (ROOT / folder).glob("*.ipynb"))
ALL = sorted(EXECUTED + [p.relative_to(ROOT) for p in (ROOT / "exercises").glob("*.ipynb")])
WIDTH = 110  # characters: a text table wider than this wraps its rows at 1280 px with the sidebar closed


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
