"""A notebook as JupyterLab saves it, so that opening and saving a committed notebook changes nothing
(CONTRIBUTING.md, "A notebook"): the kernel spec JupyterLab writes, adjacent stream outputs of one name
merged (JupyterLab's output area joins them when it opens a notebook), numbers as JavaScript writes
them (`3.0` becomes `3`), and no stale widget state (only the models an output shows, and theirs).

`course-lib kernelspec notebooks solutions` rewrites every notebook in those folders that way and
prints the ones it changed. Every notebook is read first: a folder without
notebooks, a notebook that cannot be read or one of an older format (which rewriting would convert) is
a one-line error, and nothing is written.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat

from course_lib.errors import UserError


def jupyterlab_kernelspec() -> dict:
    """{"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}, as ipykernel's
    kernel.json says (JupyterLab copies it into each notebook it saves)."""
    # off the import path: ipykernel imports IPython and zmq
    from ipykernel.kernelspec import KERNEL_NAME, get_kernel_dict

    spec = get_kernel_dict()
    return {"display_name": spec["display_name"], "language": spec["language"], "name": KERNEL_NAME}


WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def _js_number(text: str) -> int | float:
    """A JSON number as JavaScript's JSON.parse keeps it: no integer/float distinction (3.0 is 3)."""
    value = float(text)
    return int(value) if value.is_integer() and abs(value) < 1e21 else value


def _merged_streams(outputs: list[dict]) -> list[dict]:
    merged: list[dict] = []
    for output in outputs:
        last = merged[-1] if merged else None
        if (
            output["output_type"] == "stream"
            and last
            and last["output_type"] == "stream"
            and last["name"] == output["name"]
        ):
            last["text"] = "".join(last["text"]) + "".join(output["text"])
        else:
            merged.append(output)
    return merged


def shown_widget_models(notebook: dict) -> set[str]:
    """The widget models an output of `notebook` shows, and the models those refer to (children, layout,
    style), as far as its saved widget state holds them (lesson 1's planner)."""
    state = notebook.get("metadata", {}).get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    todo = [
        output["data"][WIDGET_VIEW]["model_id"]
        for cell in notebook["cells"]
        for output in cell.get("outputs", [])
        if WIDGET_VIEW in output.get("data", {})
    ]
    shown: set[str] = set()
    while todo:
        model = todo.pop()
        if model not in shown:
            shown.add(model)
            todo += re.findall(r"IPY_MODEL_(\w[\w-]*)", json.dumps(state.get(model, {})))
    return shown


def as_jupyterlab_saves(text: str) -> str:
    """The notebook file `text` as JupyterLab would save it after opening it, stale widget state dropped."""
    notebook = json.loads(text, parse_float=_js_number)
    notebook["metadata"]["kernelspec"] = jupyterlab_kernelspec()
    for cell in notebook["cells"]:
        if "outputs" in cell:
            cell["outputs"] = _merged_streams(cell["outputs"])
    widgets = notebook["metadata"].get("widgets", {}).get(WIDGET_STATE)
    if widgets is not None:
        shown = shown_widget_models(notebook)
        widgets["state"] = {model: value for model, value in widgets["state"].items() if model in shown}
        if not widgets["state"]:
            del notebook["metadata"]["widgets"]
    return nbformat.writes(nbformat.from_dict(notebook), version=nbformat.NO_CONVERT) + "\n"


def _read_notebook(path: Path) -> nbformat.NotebookNode:
    try:
        notebook = nbformat.reads(path.read_text(), as_version=nbformat.NO_CONVERT)
    except OSError as error:
        raise UserError(f"{path}: cannot read it ({error.strerror}); nothing was changed") from None
    except Exception as error:  # nbformat raises several kinds on a broken file
        raise UserError(f"{path}: not a readable notebook ({type(error).__name__}); nothing was changed") from None
    if notebook.get("nbformat") != 4:
        raise UserError(
            f"{path}: a notebook of nbformat {notebook.get('nbformat')}, which rewriting would convert "
            "to 4; open and save it in JupyterLab first; nothing was changed"
        )
    return notebook


def set_kernelspecs(folders: list[str]) -> list[Path]:
    """Write every notebook in `folders` as JupyterLab saves it, once all are read; the ones changed."""
    found = []
    for folder in map(Path, folders):
        if not folder.is_dir():
            raise UserError(f"{folder}: no such folder of notebooks")
        inside = sorted(folder.glob("*.ipynb"))
        if not inside:
            raise UserError(f"{folder}: no notebooks (.ipynb) in this folder")
        found += [(path, _read_notebook(path)) for path in inside]
    return [path for path, notebook in found if set_kernelspec(path, notebook)]


def set_kernelspec(path: Path, notebook: nbformat.NotebookNode | None = None) -> bool:
    """Write the notebook at `path` (read already: `notebook`) as JupyterLab saves it (`as_jupyterlab_saves`);
    True when the file changed."""
    text = nbformat.writes(_read_notebook(path) if notebook is None else notebook) + "\n"
    saved = as_jupyterlab_saves(text)
    if saved == path.read_text():
        return False
    path.write_text(saved)
    return True
