"""The kernel spec JupyterLab writes into a notebook it saves, so that opening a committed notebook
changes nothing (CONTRIBUTING.md, "A notebook").

`course-lib kernelspec notebooks solutions` rewrites the kernel spec of every notebook in those
folders (metadata only) and prints the ones it changed.
"""

from __future__ import annotations

from pathlib import Path

import nbformat


def jupyterlab_kernelspec() -> dict:
    """{"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}, as ipykernel's
    kernel.json says (JupyterLab copies it into each notebook it saves)."""
    # off the import path: ipykernel imports IPython and zmq
    from ipykernel.kernelspec import KERNEL_NAME, get_kernel_dict

    spec = get_kernel_dict()
    return {"display_name": spec["display_name"], "language": spec["language"], "name": KERNEL_NAME}


def set_kernelspec(path: Path) -> bool:
    """Give the notebook at `path` JupyterLab's kernel spec; True when the file changed."""
    notebook = nbformat.read(path, as_version=4)
    if notebook.metadata.get("kernelspec") == jupyterlab_kernelspec():
        return False
    notebook.metadata["kernelspec"] = jupyterlab_kernelspec()
    path.write_text(nbformat.writes(notebook) + "\n")
    return True
