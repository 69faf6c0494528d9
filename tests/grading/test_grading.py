"""`course-lib grade`: check cells from the instructor's copy, time limits, isolated submissions
(docs/grading.md). The runs use lesson 1's exercise, the quickest, and a short --timeout."""

import csv
import importlib
import shutil
import socket
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import nbformat
import psutil
import pytest

import course_lib.layers
from course_lib.checks import CheckFailed, refuse_reference
from course_lib.grading import METADATA, identify, load_references, make_exercise, restore, run_notebook
from course_lib.grading import run as runner
from course_lib.grading.restore import FRESH_CHECKS

grading = importlib.import_module("course_lib.grading.grade")  # the module: the package's `grade` is its function

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
EXERCISE = ROOT / "exercises" / "01_adam_memory.ipynb"
COURSE_LIB = str(Path(sys.executable).parent / "course-lib")


def exercise():
    return nbformat.read(EXERCISE, as_version=4)


def reference():
    return load_references(ROOT / "solutions")[EXERCISE.stem]


def ids(notebook):
    return [cell.id for cell in notebook.cells]


def check_cells(notebook):
    return [cell for cell in notebook.cells if "checks.check_" in cell.source]


def check_indices(notebook):
    return [i for i, cell in enumerate(notebook.cells) if "checks.check_" in cell.source]


def answer_index(notebook):
    """The first cell a learner fills in (exercise 1.1's): after its heading and its hint."""
    return next(i for i, cell in enumerate(notebook.cells) if "raise NotImplementedError()" in cell.source)


# --- which cells run: the learner's, with the setup and check cells from the reference -------------


def test_an_untouched_exercise_runs_as_it_is_with_fresh_checks():
    restored = restore(exercise(), reference())
    assert restored.restored == {} and ids(restored.notebook) == ids(exercise())
    for cell, original in zip(restored.notebook.cells, exercise().cells):
        fresh = FRESH_CHECKS if "checks.check_" in original.source else ""
        assert cell.source == fresh + original.source
    answer = answer_index(exercise())
    assert restored.origin[answer] == f"cell {answer + 1}" and restored.origin[answer + 1].startswith("Exercise 1.1")


def test_deleted_edited_and_moved_check_cells_are_restored_in_their_place():
    submission = exercise()
    first, second = check_cells(submission)
    second.source = "# " + second.source.replace("\n", "\n# ")  # commented out
    submission.cells.remove(first)  # deleted
    setup = submission.cells.pop(1)
    submission.cells.append(setup)  # moved to the end
    restored = restore(submission, reference())
    assert restored.restored == {first.id: "deleted", second.id: "edited", setup.id: "moved"}
    assert ids(restored.notebook) == ids(exercise())
    second_at = check_indices(exercise())[1]
    assert restored.notebook.cells[second_at].source == FRESH_CHECKS + check_cells(exercise())[1].source


def test_a_check_cell_turned_into_markdown_is_restored_as_code():
    submission = exercise()
    check_cells(submission)[0].cell_type = "markdown"
    restored = restore(submission, reference())
    first_at = check_indices(exercise())[0]
    assert list(restored.restored.values()) == ["edited"] and restored.notebook.cells[first_at].cell_type == "code"


def test_the_learners_own_cells_keep_their_order_around_the_checks():
    """A helper cell between an answer and its check stays before the check: not 'moved'."""
    submission = exercise()
    first_at = check_indices(submission)[0]
    submission.cells.insert(first_at, nbformat.v4.new_code_cell("helper = 1"))
    submission.cells.insert(0, nbformat.v4.new_markdown_cell("my notes"))
    restored = restore(submission, reference())
    assert restored.restored == {} and ids(restored.notebook) == ids(submission)
    assert restored.origin[first_at + 1] == f"cell {first_at + 2}"


def test_a_check_moved_before_its_exercise_goes_back_after_it():
    submission = exercise()
    check = submission.cells.pop(check_indices(submission)[0])
    submission.cells.insert(2, check)  # above the exercise's heading and answer
    restored = restore(submission, reference())
    assert restored.restored == {check.id: "moved"} and ids(restored.notebook) == ids(exercise())


def test_a_notebook_saved_without_cell_ids_keeps_its_unchanged_checks_in_place():
    """Older Jupyter and some hosted notebooks drop cell ids: an unchanged check is still recognised."""
    submission = exercise()
    for cell in submission.cells:
        del cell["id"]
    submission.cells.remove(check_cells(submission)[0])
    restored = restore(submission, reference())
    assert list(restored.restored.values()) == ["deleted"] and len(restored.notebook.cells) == len(exercise().cells)
    second_at = check_indices(exercise())[1] - 1  # one cell earlier: the first check was removed
    assert restored.origin[second_at].startswith("Exercise 1.2")  # the unchanged check, in its place
    assert restored.origin[-1].startswith("Exercise 1.1")  # without cell ids, a deleted check comes last


def test_a_submission_is_identified_by_metadata_then_file_name_then_cell_ids():
    references = load_references(ROOT / "solutions")
    renamed = Path("ada (1).ipynb")
    assert identify(exercise(), renamed, references) == EXERCISE.stem
    anonymous = exercise()
    del anonymous.metadata[METADATA]
    assert identify(anonymous, EXERCISE, references) == EXERCISE.stem
    assert identify(anonymous, renamed, references) == EXERCISE.stem  # by its cell ids
    stranger = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")])
    assert identify(stranger, renamed, references) is None


def test_the_reference_made_from_solutions_is_the_committed_exercise():
    assert reference() == make_exercise(
        nbformat.read(ROOT / "solutions" / EXERCISE.name, as_version=4),
        f"solutions/{EXERCISE.name}",
        f"exercises/{EXERCISE.name}",
    )
    assert load_references(ROOT / "exercises")[EXERCISE.stem] == exercise()


def test_a_notebook_past_its_own_limit_stops_there_though_each_cell_is_within_its_limit(tmp_path):
    cells = [nbformat.v4.new_code_cell("import time\ntime.sleep(2)") for _ in range(4)]
    run = run_notebook(nbformat.v4.new_notebook(cells=cells), tmp_path, cell_timeout=60, notebook_timeout=5)
    assert run.stopped.startswith("timed out: the notebook ran past its 5 s limit") and run.stopped_at in (1, 2, 3)
    assert set(run.errors.values()) == {""} and len(run.errors) == run.stopped_at


# --- the issue's table, graded as a class folder ------------------------------------------------------


def variant(folder: Path, edit=None, source: Path = EXERCISE) -> Path:
    notebook = nbformat.read(source, as_version=4)
    if edit:
        edit(notebook)
    folder.mkdir(parents=True)
    nbformat.write(notebook, folder / EXERCISE.name)
    return folder / EXERCISE.name


def append_to_answer(code):
    def edit(notebook):
        notebook.cells[answer_index(notebook)].source += "\n" + code

    return edit


def deleted_and_commented(notebook):
    first, second = check_cells(notebook)
    notebook.cells.remove(first)
    second.source = "\n".join("# " + line for line in second.source.splitlines())


def patched_and_wrapped(notebook):
    patch = "from course_lib import checks\nchecks.check_model_state_bytes = lambda *a: print('Correct!')"
    notebook.cells[answer_index(notebook)].source += "\n" + patch
    second = check_cells(notebook)[1]
    second.source = (
        "try:\n" + "".join(f"    {line}\n" for line in second.source.splitlines()) + "except Exception:\n    pass"
    )


@pytest.mark.slow
def test_every_way_of_cheating_in_the_issue_fails_and_no_submission_reaches_another(tmp_path):
    """One class run: each submission is FAIL with a one-line reason (the loop under --timeout, the dead
    kernel at once, a wrong answer with its hint and no traceback, a notebook that is not an exercise or
    not a notebook at all); A's write to B's file reaches nothing, and C's, by its absolute path, changes
    neither B's grade nor, in the end, B's file, and is C's FAIL: C ran beside another notebook, so it and
    those that ended after it are graded again, alone, to find which one wrote it. (The honest solutions
    pass: test_exercises.py.) The loop
    sleeps, to spare a shared CPU; --timeout leaves room for the setup cell's imports on a busy machine."""
    class_dir = tmp_path / "class"
    solved = (ROOT / "solutions" / EXERCISE.name).read_text()
    notebooks = {
        "deleted_and_commented": variant(class_dir / "deleted_and_commented", deleted_and_commented),
        "patched_and_wrapped": variant(class_dir / "patched_and_wrapped", patched_and_wrapped),
        "loops": variant(class_dir / "loops", append_to_answer("import time\nwhile True:\n    time.sleep(1)")),
        "dies": variant(class_dir / "dies", append_to_answer("import os\nos._exit(0)")),
        "a_cheat": variant(
            class_dir / "a_cheat", append_to_answer(f"open('../b_victim/{EXERCISE.name}', 'w').write({solved!r})")
        ),
        "b_victim": variant(class_dir / "b_victim"),
        "c_cheat": variant(
            class_dir / "c_cheat",
            append_to_answer(  # by its absolute path, this time
                f"open({str(class_dir / 'b_victim' / EXERCISE.name)!r}, 'w').write({solved!r})"
            ),
        ),
        "wrong": variant(
            class_dir / "wrong",
            lambda nb: setattr(
                nb.cells[answer_index(nb)],
                "source",
                nb.cells[answer_index(nb)].source.replace("raise NotImplementedError()", "return 16 * n_params"),
            ),
        ),
    }
    (class_dir / "stranger").mkdir()
    nbformat.write(
        nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")]), class_dir / "stranger" / "x.ipynb"
    )
    (class_dir / "corrupt").mkdir()
    (class_dir / "corrupt" / EXERCISE.name).write_text("{ not json")
    before = {path: path.read_bytes() for path in class_dir.rglob("*.ipynb")}
    result = subprocess.run(
        [COURSE_LIB, "grade", "class", "--csv", "grades.csv", "--timeout", "60", "--jobs", "2"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=900,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert {path: path.read_bytes() for path in class_dir.rglob("*.ipynb")} == before
    with open(tmp_path / "grades.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    by_learner = {}
    for row in rows:
        by_learner.setdefault(row["notebook"].split("/")[1], []).append(row)
    assert set(by_learner) == set(notebooks) | {"stranger", "corrupt"}
    for learner, learner_rows in by_learner.items():
        checks = [row for row in learner_rows if row["exercise"].startswith("Exercise 1.")]
        assert learner in ("stranger", "corrupt") or len(checks) == 2, learner_rows
        assert all(row["result"] == "FAIL" and row["detail"] and "\n" not in row["detail"] for row in learner_rows)
    reasons = {
        learner: {
            row["detail"].split(":")[0].split(" in ")[0] for row in rows if row["exercise"].startswith("Exercise")
        }
        for learner, rows in by_learner.items()
    }
    assert reasons["loops"] == {"timed out"} and reasons["dies"] == {"kernel died"}, by_learner
    answer_cell = f"cell {answer_index(exercise()) + 1} "  # the answer cell, as the gradebook counts (from 1)
    assert all(answer_cell in row["detail"] for row in by_learner["loops"] + by_learner["dies"])
    for learner in ("deleted_and_commented", "patched_and_wrapped", "a_cheat", "b_victim"):
        assert reasons[learner] == {"not done yet"}, by_learner[learner]
    assert reasons["c_cheat"] == {
        f"it modified a submission (class/b_victim/{EXERCISE.name}) while it was graded (the file was put back)"
    }, by_learner["c_cheat"]
    notes = {row["check_cell"] for row in by_learner["deleted_and_commented"] + by_learner["patched_and_wrapped"]}
    assert notes == {"restored: deleted", "restored: edited", ""}
    assert "FileNotFoundError" in " ".join(row["detail"] for row in by_learner["a_cheat"])
    assert by_learner["stranger"][0]["detail"].startswith("not one of the course's exercises")
    assert by_learner["corrupt"][0]["detail"].startswith("not a readable notebook (")
    hint = next(row["detail"] for row in by_learner["wrong"] if row["exercise"].startswith("Exercise 1.1"))
    assert "B/param" in hint and not hint.startswith("CheckFailed")
    assert "Traceback" not in result.stdout and "course_lib/" not in result.stdout
    assert (
        f"put back class/b_victim/{EXERCISE.name}: class/c_cheat/{EXERCISE.name}'s code changed it" in result.stdout
    ), result.stdout


@pytest.mark.parametrize(
    "args, says",
    [
        (["--timeout", "0"], "--timeout: must be a finite number above 0, got 0"),
        (["--timeout", "inf"], "--timeout: must be a finite number above 0, got inf (not a finite number)"),
        (["--notebook-timeout", "nan"], "--notebook-timeout: must be a finite number above 0, got nan"),
        (["--jobs", "two"], "--jobs: must be a whole number >= 1, got 'two'"),
        (["--csv", "g" * 300 + ".csv"], ": cannot write the gradebook there (File name too long)"),
        (["--junit", "nowhere/report.xml"], "nowhere/report.xml: no folder nowhere to write the gradebook in"),
        (["--reference", str(ROOT / "exercises")], f"holds {EXERCISE}, a notebook being graded"),
        (["--csv", "."], ".: a folder; give the gradebook a file name"),
        (["--reference", "nowhere"], "nowhere: no such folder to take the check cells from"),
        (["--only-errors"], "--only-errors grades again the ERROR rows of a gradebook: give it with --csv FILE"),
        (["--only-errors", "--csv", "old.csv"], "old.csv: cannot read the gradebook (No such file or directory)"),
    ],
)
def test_bad_grading_options_are_one_clear_line(tmp_path, args, says):
    result = subprocess.run([COURSE_LIB, "grade", str(EXERCISE), *args], capture_output=True, text=True, cwd=tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and says in lines[0], result.stderr
    assert list(tmp_path.iterdir()) == [] and result.stdout == ""  # nothing graded, nothing written


def test_a_reference_without_the_exercise_is_the_references_fault_not_the_submissions(tmp_path):
    (tmp_path / "reference").mkdir()
    shutil.copy(ROOT / "solutions" / "00_measuring_memory.ipynb", tmp_path / "reference")
    result = subprocess.run(
        [COURSE_LIB, "grade", str(EXERCISE), "--reference", "reference"], capture_output=True, text=True, cwd=tmp_path
    )
    assert result.returncode == 2 and result.stdout == "", result.stdout
    assert result.stderr.strip() == (
        f"course-lib: error: reference: no exercise {EXERCISE.stem} (which {EXERCISE} "
        "is); give --reference a folder with every exercise graded, e.g. the course's "
        "solutions/"
    )


# --- the second review's holes: nothing outlives a grade, the reference stays, the right lesson ---------


def spawn_detached(pid_file: Path, victim: Path) -> str:
    """Answer-cell code that starts a grandchild in a session of its own, whose parent exits at once: it
    rewrites `victim`, then records its pid and keeps on rewriting it."""
    child = (
        f"import os, time\nif os.fork():\n    os._exit(0)\nos.setsid()\n"
        f"open({str(victim)!r}, 'w').write('rewritten')\nopen({str(pid_file)!r} + '.tmp', 'w').write(str(os.getpid()))\n"
        f"os.rename({str(pid_file)!r} + '.tmp', {str(pid_file)!r})\n"
        f"while True:\n    time.sleep(0.2)\n    open({str(victim)!r}, 'w').write('rewritten')\n"
    )
    return (
        f"import os, subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {child!r}], "
        f"start_new_session=True)\nwhile not os.path.exists({str(pid_file)!r}):\n    time.sleep(0.1)"
    )


@pytest.mark.slow
def test_no_hole_of_the_second_review_passes_and_the_honest_solution_still_does(tmp_path):
    """One class run, alone (--jobs 1): a detached grandchild that rewrites another learner's notebook is
    dead when the grade ends (and the notebook is as it was); a submission that rewrites the reference's
    check cells is a FAIL and the reference is put back; lesson 1's exercise handed in under lesson 7's
    name is a FAIL in one line, and graded as lesson 1 with --as-recorded; the honest solution passes.
    The JUnit report has one test case per gradebook row."""
    reference = tmp_path / "reference"
    shutil.copytree(ROOT / "solutions", reference)
    reference_before = {path: path.read_bytes() for path in reference.glob("*.ipynb")}
    class_dir, solution = tmp_path / "class", ROOT / "solutions" / EXERCISE.name
    victim = variant(class_dir / "victim", source=solution)
    honest_bytes = victim.read_bytes()
    check_cell = check_cells(exercise())[0]
    variant(class_dir / "detached", append_to_answer(spawn_detached(tmp_path / "pid", victim)))
    variant(
        class_dir / "edits_reference",
        append_to_answer(
            f"import json\npath = {str(reference / EXERCISE.name)!r}\nnb = json.load(open(path))\n"
            f"for cell in nb['cells']:\n    if cell.get('id') == {check_cell.id!r}:\n        cell['source'] = 'pass'\n"
            "json.dump(nb, open(path, 'w'))"
        ),
    )
    (class_dir / "wrong_lesson").mkdir()
    lesson_one = nbformat.read(solution, as_version=4)
    lesson_one.metadata[METADATA] = exercise().metadata[METADATA]  # a solved exercise records its lesson
    nbformat.write(lesson_one, class_dir / "wrong_lesson" / "07_the_rest_of_the_toolbox.ipynb")

    def run(*args):
        return subprocess.run(
            [COURSE_LIB, "grade", "class", "--reference", "reference", "--jobs", "1", *args],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=900,
        )

    result = run("--csv", "grades.csv", "--junit", "grades.xml")
    assert result.returncode == 1, result.stdout + result.stderr
    grandchild = int((tmp_path / "pid").read_text())
    assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE
    assert victim.read_bytes() == honest_bytes
    assert {path: path.read_bytes() for path in reference.glob("*.ipynb")} == reference_before
    assert (reference / f"{EXERCISE.name}.changed-while-graded").exists()  # what it was changed to: nothing is lost
    with open(tmp_path / "grades.csv", newline="") as file:
        rows = {(row["notebook"].split("/")[1], row["exercise"][:12]): row for row in csv.DictReader(file)}
    results = {key: (row["result"], row["detail"], row["lesson"]) for key, row in rows.items()}
    wrong = (
        "the wrong lesson: this is 01_adam_memory's exercise, handed in as lesson 07's; hand in lesson 07's "
        "exercise (or grade it as what it is with --as-recorded)"
    )
    assert results == {
        ("victim", "Exercise 1.1"): ("PASS", "", EXERCISE.stem),
        ("victim", "Exercise 1.2"): ("PASS", "", EXERCISE.stem),
        **{
            ("detached", f"Exercise 1.{k}"): (
                "FAIL",
                f"it modified a submission (class/victim/{EXERCISE.name}) while it was graded (the file was put back)",
                EXERCISE.stem,
            )
            for k in (1, 2)
        },
        **{
            ("edits_reference", f"Exercise 1.{k}"): (
                "FAIL",
                f"it modified the reference (reference/{EXERCISE.name}) while it was graded (the file was put back)",
                EXERCISE.stem,
            )
            for k in (1, 2)
        },
        ("wrong_lesson", "(the whole n"): ("FAIL", wrong, ""),
    }
    assert (
        f"put back reference/{EXERCISE.name}: class/edits_reference/{EXERCISE.name}'s code changed it" in result.stdout
    )
    cases = ElementTree.parse(tmp_path / "grades.xml").getroot().iter("testcase")
    assert sorted(
        (case.get("classname").split("/")[1], case.get("name")[:12], case.find("failure") is None) for case in cases
    ) == sorted((key[0], key[1], row["result"] == "PASS") for key, row in rows.items())

    (tmp_path / "pid").unlink()
    shutil.rmtree(class_dir / "detached")
    shutil.rmtree(class_dir / "edits_reference")
    again = run("--csv", "again.csv", "--as-recorded")
    assert again.returncode == 0, again.stdout + again.stderr
    with open(tmp_path / "again.csv", newline="") as file:
        lessons = {(row["notebook"], row["result"], row["lesson"]) for row in csv.DictReader(file)}
    assert lessons == {
        (f"class/victim/{EXERCISE.name}", "PASS", EXERCISE.stem),
        ("class/wrong_lesson/07_the_rest_of_the_toolbox.ipynb", "PASS", EXERCISE.stem),
    }


def test_answers_not_calls_is_seen_on_every_thread_the_answer_starts():
    """An answer that calls the library from a thread pool is refused as one that calls it directly."""
    with pytest.raises(CheckFailed, match="your answer calls course_lib.layers.find_layer_stack"):
        with refuse_reference(course_lib.layers):
            with ThreadPoolExecutor(2) as pool:
                pool.submit(course_lib.layers.find_layer_stack, object()).exception()
    with refuse_reference(course_lib.layers):  # an answer of its own, in threads, is not refused
        with ThreadPoolExecutor(2) as pool:
            assert pool.submit(sum, [1, 2]).result() == 3


@pytest.mark.skipif(sys.version_info < (3, 12), reason="Python 3.11 cannot watch threads started before the check")
def test_answers_not_calls_is_seen_on_a_thread_that_was_running_already():
    with ThreadPoolExecutor(1) as pool:
        pool.submit(int).result()  # its thread is up before the check starts watching
        with pytest.raises(CheckFailed, match="your answer calls course_lib.layers.find_layer_stack"):
            with refuse_reference(course_lib.layers):
                pool.submit(course_lib.layers.find_layer_stack, object()).exception()


# --- a busy machine: a kernel that does not start is the grader's problem, never the learner's FAIL ---


@pytest.fixture
def ports_taken(monkeypatch):
    """The grader's kernel manager, but the starts numbered in `fail` (1 = the first) lose their shell
    port between choosing it and the kernel binding it, the race of kernels started together: those
    kernels die before they reply to kernel_info. `starts` counts the starts."""
    sockets = []

    class PortTaken(runner._ThisPythonsKernel):
        fail, starts = set(), 0

        def write_connection_file(self, **kwargs):
            super().write_connection_file(**kwargs)
            PortTaken.starts += 1
            if PortTaken.starts in PortTaken.fail:
                taken = socket.socket()
                sockets.append(taken)
                taken.bind((self.ip, self.shell_port))
                taken.listen()

    monkeypatch.setattr(runner, "_ThisPythonsKernel", PortTaken)
    yield PortTaken
    for taken in sockets:
        taken.close()


def test_a_kernel_that_does_not_start_ran_none_of_the_notebook(tmp_path, ports_taken):
    ports_taken.fail = {1}
    cells = [nbformat.v4.new_code_cell("open('ran', 'w').close()")]
    run = run_notebook(nbformat.v4.new_notebook(cells=cells), tmp_path, cell_timeout=60, notebook_timeout=60)
    assert not run.started and run.errors == {} and run.stopped_at is None
    assert run.stopped == "the grader could not start a kernel (Kernel died before replying to kernel_info)"
    assert not (tmp_path / "ran").exists()


def two_learners(folder: Path) -> None:
    """ada hands in the solution (PASS), bob the untouched exercise (FAIL: not done yet)."""
    variant(folder / "ada", source=ROOT / "solutions" / EXERCISE.name)
    variant(folder / "bob")


def gradebook(path: Path) -> dict:
    with open(path, newline="") as file:
        return {
            (row["notebook"].split("/")[1], row["exercise"][:12]): (row["result"], row["detail"])
            for row in csv.DictReader(file)
        }


LEARNERS_REAL_RESULTS = {
    ("ada", "Exercise 1.1"): ("PASS", ""),
    ("ada", "Exercise 1.2"): ("PASS", ""),
    ("bob", "Exercise 1.1"): ("FAIL", "not done yet: the exercise still raises NotImplementedError"),
    ("bob", "Exercise 1.2"): ("FAIL", "not done yet: the exercise still raises NotImplementedError"),
}


@pytest.mark.slow
def test_a_kernel_that_does_not_start_is_started_again_and_the_learners_real_result_comes_back(
    tmp_path, monkeypatch, capsys, ports_taken
):
    """ada's kernel loses its port at the first start: she is graded again, alone, after bob."""
    monkeypatch.chdir(tmp_path)
    two_learners(tmp_path / "class")
    ports_taken.fail = {1}
    assert grading.grade(["class"], "grades.csv", jobs=1) == 1  # bob's FAIL, nothing else
    assert gradebook(tmp_path / "grades.csv") == LEARNERS_REAL_RESULTS
    assert ports_taken.starts == 3  # ada, bob, ada again
    out = capsys.readouterr().out
    assert f"class/ada/{EXERCISE.name}: the grader could not start a kernel; it is graded again at the end" in out


@pytest.mark.slow
def test_a_kernel_that_never_starts_is_an_error_not_a_fail_and_only_errors_grades_it_again(
    tmp_path, monkeypatch, capsys, ports_taken
):
    """ada's kernel loses its port at both tries: her rows say ERROR (exit 3), bob's are his real FAIL;
    --only-errors then grades ada alone and puts her rows in their place."""
    monkeypatch.chdir(tmp_path)
    two_learners(tmp_path / "class")
    ports_taken.fail = {1, 3}  # ada, bob, ada again
    assert grading.grade(["class"], "grades.csv", jobs=1) == 3
    first = gradebook(tmp_path / "grades.csv")
    not_started = ("ERROR", "the grader could not start a kernel (Kernel died before replying to kernel_info)")
    assert first == {**LEARNERS_REAL_RESULTS, **{("ada", f"Exercise 1.{k}"): not_started for k in (1, 2)}}
    assert "grade them again later: course-lib grade class --csv grades.csv --only-errors" in capsys.readouterr().out
    rows = (tmp_path / "grades.csv").read_text().splitlines()

    assert grading.grade(["class"], "grades.csv", jobs=999, only_errors=True) == 1  # bob's FAIL, nothing else
    assert gradebook(tmp_path / "grades.csv") == LEARNERS_REAL_RESULTS and ports_taken.starts == 4  # ada alone
    assert "warning: --jobs 999 is more than this machine can grade at once" in capsys.readouterr().err
    assert (tmp_path / "grades.csv").read_text().splitlines()[3:] == rows[3:]  # bob's rows, as they were


@pytest.mark.parametrize(
    "available_gib, jobs, why",
    [
        (3.5, 1, "3.5 GiB of memory available, 2 GiB a notebook"),
        (1, 1, "1.0 GiB of memory available, 2 GiB a notebook"),
        (10**6, None, "CPU cores"),
    ],
)
def test_jobs_default_to_the_cpu_cores_or_the_memory_whichever_binds(monkeypatch, available_gib, jobs, why):
    monkeypatch.setattr(grading.psutil, "virtual_memory", lambda: SimpleNamespace(available=available_gib * 2**30))
    can, because = grading.machine_jobs()
    if jobs:  # the memory binds
        assert (can, because) == (jobs, why)
    else:
        assert can >= 1 and because == f"{can} CPU cores"


# --- the design card's route: pytest --nbval-lax on an exercise --------------------------------------


@pytest.mark.slow
def test_nbval_lax_on_an_exercise_fails_exactly_at_its_check_cells_and_passes_when_solved(tmp_path):
    """nbval-lax fails a cell only when it raises (no exercise cell compares its output: the markers
    are checked below), so on the unsolved exercise exactly the check cells fail, and on its answers
    (the solution, which CI runs under nbval for every lesson) nothing does. Lesson 1, the quickest;
    test_exercises.py shows the grader's run of every unsolved exercise fails at its check cells only."""
    for notebook in sorted((ROOT / "exercises").glob("*.ipynb")):
        for cell in nbformat.read(notebook, as_version=4).cells:
            assert "NBVAL_" not in cell.source, f"{notebook.name}: an nbval marker changes what nbval-lax checks"
    shutil.copy(EXERCISE, tmp_path / "unsolved.ipynb")
    shutil.copy(ROOT / "solutions" / EXERCISE.name, tmp_path / "solved.ipynb")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:xdist",
            "-p",
            "no:cacheprovider",
            "--nbval-lax",
            "--nbval-current-env",
            "-rA",
            "-q",
            "unsolved.ipynb",
            "solved.ipynb",
            "-c",
            "/dev/null",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
    )
    failed = sorted(
        line.split(" - ")[0].removeprefix("FAILED ") for line in result.stdout.splitlines() if line.startswith("FAILED")
    )
    code = [cell for cell in nbformat.read(EXERCISE, as_version=4).cells if cell.cell_type == "code"]
    checks = sorted(f"unsolved.ipynb::Cell {n}" for n, cell in enumerate(code) if "checks.check_" in cell.source)
    assert result.returncode == 1 and failed == checks, result.stdout[-3000:]  # solved.ipynb: every cell passed
