"""The files no submission may change while it is graded: the reference's notebooks and every
submission (docs/grading.md).

Each is read once, before any submission runs, and compared with what is on disk after each run. A run
that changed one is a FAIL for that submission ('it modified the reference'), and the file is put back
as it was read; a notebook that appeared in the reference folder is moved aside (load_references would
read it next time). Nothing is lost: what a file was changed to is kept beside it, in NAME.changed-while-
graded (an instructor who saved a solution while a class was graded finds it there).
"""

from __future__ import annotations

from pathlib import Path


class Watched:
    """The bytes of the reference folder's notebooks and of each submission, as read before any run."""

    def __init__(self, reference: Path, submissions: dict[Path, bytes]) -> None:
        self.reference = reference
        self.files = {path: path.read_bytes() for path in sorted(reference.glob("*.ipynb"))}
        self.files.update(submissions)

    def _reads_as_it_was(self, path: Path) -> bool:
        try:
            return path.read_bytes() == self.files[path]
        except OSError:
            return False

    def changed(self) -> list[Path]:
        """The watched files that differ from what was read (or are gone), and notebooks new in the
        reference folder."""
        new = [path for path in sorted(self.reference.glob("*.ipynb")) if path not in self.files]
        return [path for path in self.files if not self._reads_as_it_was(path)] + new

    def what(self, path: Path) -> str:
        """'the reference (PATH)' or 'a submission (PATH)'."""
        return f"the reference ({path})" if path.parent == self.reference else f"a submission ({path})"

    def put_back(self, paths: list[Path], by: str) -> list[str]:
        """Put each file back as it was read (move one that was new aside); a line for each."""
        lines = []
        for path in paths:
            aside = path.with_name(f"{path.name}.changed-while-graded")
            try:
                if path.exists():
                    path.replace(aside)
                if path in self.files:
                    path.write_bytes(self.files[path])
                    lines.append(
                        f"put back {path}: {by}'s code changed it while it was graded (what it was changed to: {aside})"
                    )
                else:
                    lines.append(
                        f"moved {path} to {aside}: {by}'s code wrote it into the reference folder while it was graded"
                    )
            except OSError as error:
                lines.append(
                    f"{path}: {by}'s code changed it while it was graded, and it cannot be put back "
                    f"({error.strerror}): restore it by hand"
                )
        return lines
