"""The kernel spec JupyterLab writes into a notebook it saves, so that opening a committed notebook
changes nothing (CONTRIBUTING.md, "A notebook").

`course-lib kernelspec notebooks solutions` rewrites the kernel spec of every notebook in those
folders (metadata only) and prints the ones it changed. Every notebook is read first: a folder without
notebooks, a notebook that cannot be read or one of an older format (which rewriting would convert) is
a one-line error, and nothing is written.
"""

from __future__ import annotations

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


def _read_notebook(path: Path) -> nbformat.NotebookNode:
    try:
        notebook = nbformat.reads(path.read_text(), as_version=nbformat.NO_CONVERT)
    except OSError as error:
        raise UserError(f"{path}: cannot read it ({error.strerror}); nothing was changed") from None
    except Exception as error:  # nbformat raises several kinds on a broken file
        raise UserError(f"{path}: not a readable notebook ({type(error).__name__}); nothing was changed") from None
    if notebook.get("nbformat") != 4:
        raise UserError(f"{path}: a notebook of nbformat {notebook.get('nbformat')}, which rewriting would convert "
                        "to 4; open and save it in JupyterLab first; nothing was changed")
    return notebook


def set_kernelspecs(folders: list[str]) -> list[Path]:
    """Give every notebook in `folders` JupyterLab's kernel spec, once all are read; the ones changed."""
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
    """Give the notebook at `path` (read already: `notebook`) JupyterLab's kernel spec; True when the file
    changed."""
    notebook = _read_notebook(path) if notebook is None else notebook
    if notebook.metadata.get("kernelspec") == jupyterlab_kernelspec():
        return False
    notebook.metadata["kernelspec"] = jupyterlab_kernelspec()
    path.write_text(nbformat.writes(notebook) + "\n")
    return True
