"""`course-lib repoint`: a fork's Colab badges, setup cells and links moved to course_lib/course.py's
REPOSITORY and BRANCH (README, "Start on Google Colab"), the one place a fork changes.

The address the files point at now is read from the lessons' and solutions' Open-in-Colab links (a
link in the README to another course's notebook is not the course's address); each file that names it is
rewritten in place (`course.repointed`: only the course's own addresses change), and exercises/ is made
again from the rewritten solutions, which never overwrites an exercise edited since it was generated.
"""

from __future__ import annotations

from pathlib import Path

from course_lib import course
from course_lib.errors import UserError
from course_lib.grading.write import write_exercises

# What names the course's address: the notebooks, the docs and the package's metadata.
FILES = ("notebooks/*.ipynb", "solutions/*.ipynb", "README.md", "CONTRIBUTING.md", "docs/*.md", "pyproject.toml")


def repoint(root: str | Path = ".") -> list[str]:
    """Rewrite the course's files under `root` to point at REPOSITORY and BRANCH; one line per file changed."""
    root = Path(root)
    if not (root / "solutions").is_dir():
        raise UserError(f"{root}: no solutions/ folder here; run it in the course's folder (or give that folder)")
    files = sorted(path for pattern in FILES for path in root.glob(pattern))
    texts = {path: path.read_text() for path in files}
    notebooks = [text for path, text in texts.items() if path.suffix == ".ipynb"]
    found = set().union(*map(course.course_addresses, notebooks)) - {(course.REPOSITORY, course.BRANCH)}
    if len(found) > 1:
        named = ", ".join(f"{repository}@{branch}" for repository, branch in sorted(found))
        raise UserError(
            f"the notebooks point at several addresses ({named}): make them agree by hand, then run it again"
        )
    if not found:
        return []
    (repository, branch), report = found.pop(), []
    for path, text in texts.items():
        if (new := course.repointed(text, repository, branch)) != text:
            path.write_text(new)
            report.append(f"now points at {course.REPOSITORY}@{course.BRANCH}: {path.relative_to(root)}")
    return report + write_exercises(root / "solutions", root / "exercises")
