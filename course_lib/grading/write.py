"""`course-lib make-exercises`: write exercises/ from solutions/ and never lose a learner's work.

exercises/.generated.json (the manifest) records, for each exercise, the fingerprint of what was
generated (each cell's type and source). An exercise whose cells still have that fingerprint is
regenerated; one a learner changed is kept unless `force=True`. Every solution is turned into its
exercise before anything is written, and the manifest is saved after each exercise written. Each file
is written whole or not at all (a temporary file renamed over it), so a killed run tears none; an
exercise that is not a readable notebook (torn by an older version's killed write, say) stops the run
before anything is written, unless `force=True`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import nbformat

from course_lib.errors import UserError
from course_lib.grading.generate import learner_fingerprint, make_exercise

MANIFEST = ".generated.json"


def _read_manifest(path: Path) -> dict[str, str]:
    try:
        manifest = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError) as error:
        raise UserError(
            f"{path}: cannot read the record of generated exercises ({error}); move it away, "
            "then every existing exercise is kept as possibly edited"
        ) from None
    if not isinstance(manifest, dict) or not all(isinstance(v, str) for v in manifest.values()):
        raise UserError(
            f"{path}: not a record of generated exercises; move it away, then every existing "
            "exercise is kept as possibly edited"
        )
    return manifest


def _generated(current: str, recorded: str | None) -> bool:
    """Whether the exercise text `current` is what was generated (by its fingerprint, or by the hash of
    the whole file that manifests written before fingerprints recorded)."""
    if recorded is None:
        return False
    if recorded == hashlib.sha256(current.encode()).hexdigest():
        return True
    try:
        return recorded == learner_fingerprint(nbformat.reads(current, as_version=4))
    except Exception:  # nbformat raises several kinds on a broken file: not what was generated
        return False


def _write_whole(path: Path, text: str) -> None:
    """Write `path` whole or not at all: a temporary file beside it, renamed over it."""
    temporary = path.with_name(f".{path.name}.writing")
    temporary.write_text(text)
    try:
        os.replace(temporary, path)
    except OSError as error:  # a folder where the file goes, say: report the file, leave nothing behind
        temporary.unlink()
        raise OSError(error.errno, error.strerror, str(path)) from None


def _readable(text: str) -> bool:
    try:
        nbformat.reads(text, as_version=4)
        return True
    except Exception:  # nbformat raises several kinds on a broken file
        return False


def _exercises_from(solved: list[Path], solutions_dir: Path, exercises_dir: Path) -> dict[Path, nbformat.NotebookNode]:
    """Every exercise, made in memory: one broken solution stops the run before anything is written."""
    made = {}
    for path in solved:
        try:
            solution = nbformat.read(path, as_version=4)
        except OSError as error:
            raise UserError(f"{path}: cannot read it ({error.strerror})") from None
        except Exception as error:  # nbformat raises several kinds on a broken file
            raise UserError(f"{path}: not a readable notebook ({type(error).__name__}); nothing was written") from None
        try:
            made[exercises_dir / path.name] = make_exercise(
                solution, f"{solutions_dir.name}/{path.name}", f"{exercises_dir.name}/{path.name}"
            )
        except ValueError as error:
            raise UserError(f"{error}; nothing was written") from None
    return made


def write_exercises(
    solutions_dir: str | Path = "solutions", exercises_dir: str | Path = "exercises", force: bool = False
) -> list[str]:
    """Write exercises/NN_x.ipynb for every solutions/NN_x.ipynb; return one line per notebook.

    An exercise is overwritten only when its cells are still what was generated last time (the
    manifest's fingerprint) or with `force=True`: a learner's edits are never lost.
    """
    solutions_dir, exercises_dir = Path(solutions_dir), Path(exercises_dir)
    if solutions_dir.resolve() == exercises_dir.resolve():
        raise UserError(
            f"{solutions_dir} and {exercises_dir} are the same folder: the exercises would replace "
            "the solutions; give another --exercises folder"
        )
    solved = sorted(solutions_dir.glob("*.ipynb"))
    if not solved:
        raise UserError(f"no notebooks in {solutions_dir}/: run this from the course's root folder")
    made = _exercises_from(solved, solutions_dir, exercises_dir)
    manifest_path = exercises_dir / MANIFEST
    manifest = _read_manifest(manifest_path)
    report = []
    for target in made:
        if not force and target.is_file() and not _readable(target.read_text(errors="replace")):
            raise UserError(
                f"{target}: not a readable notebook (a write cut short?), so not what was generated nor "
                "a learner's work saved by Jupyter; nothing was written: move it away, or pass --force "
                "to write it again"
            )
    try:
        exercises_dir.mkdir(parents=True, exist_ok=True)
        for target, exercise in made.items():
            text = nbformat.writes(exercise) + "\n"
            current = target.read_text() if target.exists() else None
            if current == text:
                report.append(f"unchanged {target}")
            elif current is None or force or _generated(current, manifest.get(target.name)):
                _write_whole(target, text)
                report.append(f"{'wrote' if current is None else 'updated'} {target}")
            else:
                report.append(
                    f"kept {target}: it was edited since it was generated (your work?); "
                    "move it away or pass --force to overwrite it"
                )
                continue
            if manifest.get(target.name) != (fingerprint := learner_fingerprint(exercise)):
                manifest[target.name] = fingerprint
                _write_whole(manifest_path, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    except OSError as error:
        raise UserError(f"{error.filename or exercises_dir}: cannot write it ({error.strerror})") from None
    return report
