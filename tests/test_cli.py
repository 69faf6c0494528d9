"""Bad input to `course-lib`: one clear line on stderr, a non-zero exit, nothing written."""

import subprocess
import sys
from pathlib import Path

import pytest

COURSE_LIB = str(Path(sys.executable).parent / "course-lib")


def snapshot(folder: Path) -> dict:
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    "args, says",
    [
        (["grade", "missing.ipynb"], "missing.ipynb: no such file"),
        (["grade", "notes.txt"], "notes.txt: not a notebook (.ipynb)"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["grade", "empty"], "empty: no notebooks (.ipynb) in this folder"),
        (["grade", "empty", "--csv", "grades.ipynb"], "grades.ipynb: the gradebook is a .csv file"),
        (["grade"], "the following arguments are required: NOTEBOOK_OR_FOLDER"),
        (["make-exercises"], "no notebooks in solutions/"),
        (["kernelspec", "nowhere"], "nowhere: no such folder of notebooks"),
    ],
)
def test_bad_input_is_one_clear_line(tmp_path, args, says):
    (tmp_path / "notes.txt").write_text("not a notebook")
    (tmp_path / "empty" / ".ipynb_checkpoints").mkdir(parents=True)
    (tmp_path / "empty" / ".ipynb_checkpoints" / "old-checkpoint.ipynb").write_text("{}")
    before = snapshot(tmp_path)
    result = subprocess.run([COURSE_LIB, *args], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("course-lib: error: ") and says in lines[0], result.stderr
    assert snapshot(tmp_path) == before


def test_check_prints_ok_lines():
    result = subprocess.run([COURSE_LIB, "check"], capture_output=True, text=True)
    assert result.returncode == 0
    assert result.stdout.startswith("OK   python")
