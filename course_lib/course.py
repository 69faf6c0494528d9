"""What every lesson notebook shares: the repository URL, the Colab badge, the setup cell and the
`%%gpu_only` cell magic (lesson 0, "Setup")."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

# The one place the repository is configured: badges and the Colab install read it from here.
REPOSITORY = "memory-tricks-course/memory-tricks"
BRANCH = "main"
PACKAGE_URL = f"git+https://github.com/{REPOSITORY}@{BRANCH}"
COLAB_BADGE_IMAGE = "https://colab.research.google.com/assets/colab-badge.svg"
# The glossary (docs/glossary.md) by its absolute address, so that a lesson's links work on Colab as in JupyterLab.
GLOSSARY_URL = f"https://github.com/{REPOSITORY}/blob/{BRANCH}/docs/glossary.md"

SETUP_CELL = f"""\
# Setup. On Google Colab: install bitsandbytes and course_lib (Colab's own torch is kept).
# Elsewhere (JupyterLab started by `make lab`) everything is installed already: nothing to do.
import subprocess, sys
if "google.colab" in sys.modules:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "bitsandbytes",
                    "course-lib @ {PACKAGE_URL}"], check=True)
%load_ext course_lib
from course_lib.device import check_environment
check_environment();"""


# Characters a text output may take: wider, a table's rows wrap in JupyterLab at 1280 px with the
# sidebar closed (tests/grading/test_notebook_saving.py).
TEXT_WIDTH = 110


def wrapped(text: str, indent: str = "  ") -> str:
    """`text` with each line longer than TEXT_WIDTH broken at spaces, its continuation lines indented."""
    return "\n".join(
        textwrap.fill(line, TEXT_WIDTH, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)
        if len(line) > TEXT_WIDTH
        else line
        for line in text.splitlines()
    )


def colab_url(path: str | Path) -> str:
    """The Open-in-Colab address of a notebook given by its path inside the repository."""
    return f"https://colab.research.google.com/github/{REPOSITORY}/blob/{BRANCH}/{Path(path).as_posix()}"


# The course's own address as its files write it: a Colab link, a GitHub file link, the pip install (no
# branch name with a slash: in a `blob/BRANCH/path` link it could not be told from the path).
COURSE_ADDRESS = re.compile(r"colab\.research\.google\.com/github/([\w.-]+/[\w.-]+)/blob/([\w.-]+)/")


def course_addresses(text: str) -> set[tuple[str, str]]:
    """The (repository, branch) pairs that `text`'s Open-in-Colab links point at."""
    return set(COURSE_ADDRESS.findall(text))


def repointed(text: str, repository: str, branch: str) -> str:
    """`text` with every address of the course at `repository` and `branch` (its Colab links, its GitHub
    file links, the setup cell's pip install, the project's URL) moved to REPOSITORY and BRANCH (README,
    "Start on Google Colab"). Other repositories' addresses are left as they are."""
    for old, new in (
        (f"google.com/github/{repository}/blob/{branch}/", f"google.com/github/{REPOSITORY}/blob/{BRANCH}/"),
        (f"github.com/{repository}/blob/{branch}/", f"github.com/{REPOSITORY}/blob/{BRANCH}/"),
        (f"github.com/{repository}@{branch}", f"github.com/{REPOSITORY}@{BRANCH}"),
        (f'"https://github.com/{repository}"', f'"https://github.com/{REPOSITORY}"'),
    ):
        text = text.replace(old, new)
    return text


def colab_badge(path: str | Path) -> str:
    """Markdown for the Open-in-Colab badge of the notebook at `path` (relative to the repository)."""
    return f"[![Open In Colab]({COLAB_BADGE_IMAGE})]({colab_url(path)})"


def gpu_only(line: str, cell: str) -> None:
    """`%%gpu_only WHAT A GPU WOULD SHOW`: run the cell on a CUDA GPU, skip it with a message on CPU.

    The line after the magic says what the cell demonstrates, so that a learner on a CPU still
    reads what a GPU would show.
    """
    import torch  # off the import path: torch takes a second to import
    from IPython import get_ipython  # off the import path: IPython: only inside a notebook

    reason = line.strip().strip("'\"") or "this cell needs a CUDA GPU"
    if not torch.cuda.is_available():
        print(wrapped(f"Skipped on CPU (no CUDA GPU): {reason}"))
        return
    result = get_ipython().run_cell(cell)
    result.raise_error()
