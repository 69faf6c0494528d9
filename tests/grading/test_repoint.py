"""The Colab route (issue 47, item 8): every badge, setup cell and course link uses course_lib/course.py's
one configured address, and `course-lib repoint` moves a fork's files to its own (README, "A fork of the
course")."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from course_lib import course
from course_lib.errors import UserError
from course_lib.grading import repoint
from course_lib.grading.repoint import FILES

ROOT = Path(__file__).resolve().parents[2]
COURSE_LIB = str(Path(sys.executable).parent / "course-lib")


def course_files(root):
    return sorted(path for pattern in (*FILES, "exercises/*.ipynb") for path in root.glob(pattern))


def test_every_address_of_the_course_is_the_configured_one_and_names_a_file_that_exists():
    files = course_files(ROOT)
    assert {path.relative_to(ROOT).parts[0] for path in files} >= {"notebooks", "solutions", "exercises", "docs"}
    assert set().union(*(course.course_addresses(path.read_text()) for path in files)) == {
        (course.REPOSITORY, course.BRANCH)
    }
    name = course.REPOSITORY.split("/")[1]
    for path in files:
        text = path.read_text()
        # any link to a repository of this name, whoever its owner: a fork's leftovers are caught too
        for match in re.finditer(rf"(?<![\w.-])[\w.-]+/{re.escape(name)}(?![\w.-])(?P<rest>\S{{0,40}})", text):
            rest = match.group("rest")
            assert match.group(0).startswith(course.REPOSITORY), f"{path}: {match.group(0)}"
            assert rest.startswith((f"/blob/{course.BRANCH}/", f"@{course.BRANCH}", '"')), f"{path}: {match.group(0)}"
        for linked in re.findall(rf"{re.escape(course.REPOSITORY)}/blob/{course.BRANCH}/([^)#\s\"\\]+)", text):
            assert (ROOT / linked).is_file(), f"{path} links {linked}, which is not in the repository"
    assert f'Repository = "https://github.com/{course.REPOSITORY}"' in (ROOT / "pyproject.toml").read_text()


def copy_of_the_course(into: Path) -> Path:
    for path in course_files(ROOT) + [ROOT / "exercises" / ".generated.json"]:
        target = into / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, target)
    return into


def test_a_fork_points_every_file_at_itself_and_a_second_run_changes_nothing(tmp_path, monkeypatch):
    fork = copy_of_the_course(tmp_path / "fork")
    others = {
        path: len(re.findall(r"github\.com/(?:pytorch|huggingface)/", path.read_text())) for path in course_files(fork)
    }
    monkeypatch.setattr(course, "REPOSITORY", "someone/their-course")
    monkeypatch.setattr(course, "BRANCH", "dev")
    report = repoint(fork)
    assert any(line.endswith("README.md") for line in report) and any("solutions/" in line for line in report)
    for path in course_files(fork):
        text = path.read_text()
        assert "memory-tricks-course" not in text, path
        assert course.course_addresses(text) <= {("someone/their-course", "dev")}, path
        assert len(re.findall(r"github\.com/(?:pytorch|huggingface)/", text)) == others[path], path
    assert (
        "git+https://github.com/someone/their-course@dev" in (fork / "solutions/00_measuring_memory.ipynb").read_text()
    )
    assert course.colab_url("exercises/01_adam_memory.ipynb") in (fork / "exercises/01_adam_memory.ipynb").read_text()
    assert repoint(fork) == []


def test_an_edited_exercise_is_kept_and_said_so(tmp_path, monkeypatch):
    fork = copy_of_the_course(tmp_path / "fork")
    edited = fork / "exercises" / "01_adam_memory.ipynb"
    edited.write_text(edited.read_text().replace("raise NotImplementedError()", "return 0", 1))
    before = edited.read_text()
    monkeypatch.setattr(course, "REPOSITORY", "someone/their-course")
    assert any(line.startswith("kept") for line in repoint(fork))
    assert edited.read_text() == before


def test_two_old_addresses_or_no_course_here_are_one_line_and_nothing_is_written(tmp_path):
    fork = copy_of_the_course(tmp_path / "fork")
    for path, address in zip(sorted((fork / "solutions").glob("*.ipynb"))[:2], ("a/b/blob/x", "c/d/blob/y")):
        path.write_text(path.read_text().replace(f"{course.REPOSITORY}/blob/{course.BRANCH}", address))
    before = {path: path.read_bytes() for path in course_files(fork)}
    with pytest.raises(UserError, match="several addresses .*a/b@x, c/d@y"):
        repoint(fork)
    assert {path: path.read_bytes() for path in course_files(fork)} == before
    with pytest.raises(UserError, match="no solutions/ folder"):
        repoint(tmp_path)


def test_the_command_says_when_there_is_nothing_to_do(tmp_path):
    fork = copy_of_the_course(tmp_path / "fork")
    result = subprocess.run([COURSE_LIB, "repoint", str(fork)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith(f"every address already points at {course.REPOSITORY}@{course.BRANCH}")
