"""`course-lib grade`: PASS/FAIL per exercise, for one notebook or a class's folder (docs/grading.md).

Every submission is read before any runs. Each runs from a copy in a fresh temporary folder, with its
setup and check cells from the instructor's copy (restore.py), under a per-cell and a per-notebook time
limit; an exercise passes only when its check cell ran without an error. Folders are graded with a
progress bar, several notebooks at once (as many as the machine can run, by default), into an optional
CSV gradebook.

A kernel that does not start is the machine's problem, not the submission's (none of its code ran): the
notebook is graded again once the others are done, alone, with a longer wait for its kernel; if it
still does not start, its rows say ERROR, never FAIL, and `--only-errors` grades them again later.

The reference's notebooks and every submission are read before any runs and compared after each run
(guard.py): a run that changed one is a FAIL for its submission, and the file is put back. When
several notebooks ran at once, which of them did it is not known: those whose runs ended after the
change are graded again at the end, alone, like a kernel that did not start.
"""

from __future__ import annotations

import csv
import os
import shlex
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import nbformat
import psutil
from tqdm.auto import tqdm

import course_lib
from course_lib.errors import UserError
from course_lib.grading.generate import METADATA
from course_lib.grading.guard import Watched
from course_lib.grading.restore import identify, load_references, recorded_exercise, restore, wrong_lesson
from course_lib.grading.run import run_notebook

COLUMNS = ["notebook", "exercise", "result", "detail", "check_cell", "lesson"]  # lesson: the exercise graded
# Seconds a kernel has to reply: at the first try, then at the second, when it runs alone
STARTUP_TIMEOUT, RETRY_STARTUP_TIMEOUT = 120, 300
# Memory a notebook graded at once is given: a margin over what a kernel held at its peak grading lessons
# 1 and 5's solutions on a CPU (0.42 and 0.49 GiB, getrusage's max RSS)
GIB_PER_JOB = 2


@dataclass
class Graded:
    """One notebook's result: the lines to print and one gradebook row per exercise (COLUMNS)."""

    lines: list[str]
    rows: list[list[str]]
    exercises: int  # how many exercises it counts for (1 when the notebook could not be graded at all)

    @property
    def not_started(self) -> bool:
        """Whether the grader could not start its kernel (its rows say ERROR)."""
        return any(row[2] == "ERROR" for row in self.rows)

    def modified(self, what: str, put_back: list[str]) -> Graded:
        """This notebook's result when its run changed a file it may not (`what`): FAIL for each exercise."""
        detail = f"it modified {what} while it was graded (the file was put back)"
        rows = [[path, label, "FAIL", detail, note, lesson] for path, label, _, _, note, lesson in self.rows]
        return Graded(
            [
                self.lines[0],
                *[f"  FAIL  {row[1]}: {detail}" for row in rows],
                *put_back,
                f"  0 of {self.exercises} exercises passed",
            ],
            rows,
            self.exercises,
        )


def machine_jobs() -> tuple[int, str]:
    """How many notebooks this machine can grade at once: one per CPU core this process may use and per
    GIB_PER_JOB of available memory, whichever is fewer (at least 1); and which of the two binds."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    available = psutil.virtual_memory().available / 2**30
    by_memory = int(available // GIB_PER_JOB)
    if cpus <= by_memory:
        return cpus, f"{cpus} CPU cores"
    return max(1, by_memory), f"{available:.1f} GiB of memory available, {GIB_PER_JOB} GiB a notebook"


def default_reference() -> Path:
    """The course's own solutions/ (the single source of exercises/), next to the installed course_lib."""
    return Path(course_lib.__file__).resolve().parents[1] / "solutions"


def grade_notebook(
    path: str,
    text: str,
    reference: dict | None,
    cell_timeout: float,
    notebook_timeout: float,
    problem: str = "",
    startup_timeout: int = STARTUP_TIMEOUT,
) -> Graded:
    """Grade one submission (its path, for the report, and its text); `reference` is its exercise from
    the instructor's copy, None when there is none (`problem` then says why). Its rows say ERROR when
    its kernel did not start within `startup_timeout` seconds."""
    lines = [f"Grading {path}"]
    if reference is None:
        detail = problem or "not one of the course's exercises (no exercise of this name or with these cells)"
        return Graded(lines + [f"  FAIL  {detail}"], [[path, "(the whole notebook)", "FAIL", detail, "", ""]], 1)
    lesson = reference["metadata"][METADATA]["exercise"]
    restored = restore(nbformat.reads(text, as_version=4), nbformat.from_dict(reference))
    with tempfile.TemporaryDirectory(prefix="course-lib-grade-", ignore_cleanup_errors=True) as folder:
        nbformat.write(restored.notebook, Path(folder) / Path(path).name)
        run = run_notebook(restored.notebook, Path(folder), cell_timeout, notebook_timeout, startup_timeout)
    index_of = {cell.get("id"): i for i, cell in enumerate(restored.notebook.cells)}
    rows = []
    for record in restored.records:
        note = f"restored: {restored.restored[record['id']]}" if record["id"] in restored.restored else ""
        if note:
            lines.append(f"  restored {record['label']}: it was {restored.restored[record['id']]}")
        index = index_of[record["id"]]
        if not run.started:  # the machine's problem: none of the submission's code ran
            result, detail = "ERROR", run.stopped
        elif index in run.errors:
            result, detail = ("FAIL", run.errors[index]) if run.errors[index] else ("PASS", "")
        else:
            where = restored.origin[run.stopped_at] if run.stopped_at is not None else "a cell"
            result, detail = "FAIL", run.stopped.replace("{where}", where) if run.stopped else "did not run"
        if record["role"] == "check" or result == "FAIL":
            rows.append([path, record["label"], result, detail, note, lesson])
    protected = set(index_of[record["id"]] for record in restored.records)
    for index, error in sorted(run.errors.items()):
        if error and index not in protected:
            rows.append([path, f"{restored.origin[index]} (not a check)", "FAIL", error, "", lesson])
    lines += [f"  {result}  {label}" + (f": {detail}" if detail else "") for _, label, result, detail, *_ in rows]
    checks = [record for record in restored.records if record["role"] == "check"]
    passed = sum(1 for row in rows if row[2] == "PASS")
    lines.append(
        "  not graded: the grader could not start a kernel"
        if not run.started
        else f"  {passed} of {len(checks)} exercises passed"
    )
    return Graded(lines, rows, len(checks))


def notebooks_to_grade(paths: list[str]) -> list[Path]:
    """Each notebook named, and every notebook under each folder named (a class's submissions, one
    folder per learner, say), in order; Jupyter's .ipynb_checkpoints copies are skipped."""
    found = []
    for path in map(Path, paths):
        if path.is_dir():
            inside = sorted(p for p in path.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
            if not inside:
                raise UserError(f"{path}: no notebooks (.ipynb) in this folder")
            found += inside
        else:
            found.append(path)
    return found


def _read_submission(path: Path) -> tuple[bytes, nbformat.NotebookNode | None, str]:
    """The file's bytes, the notebook (None when it cannot be read) and why it cannot be read."""
    if not path.exists():
        raise UserError(f"{path}: no such file; give the path of a notebook, e.g. exercises/00_measuring_memory.ipynb")
    if path.suffix != ".ipynb":
        raise UserError(f"{path}: not a notebook (.ipynb); give the path of a notebook to grade")
    try:
        data = path.read_bytes()
    except OSError as error:
        raise UserError(f"{path}: cannot read it ({error.strerror})") from None
    try:
        return data, nbformat.reads(data.decode(), as_version=4), ""
    except Exception as error:  # nbformat raises several kinds on a broken file
        return (
            data,
            None,
            f"not a readable notebook ({type(error).__name__}): re-download it or start again from the exercise",
        )


def _check_gradebook_path(csv_path: str, kind: str = "csv") -> None:
    """One-line errors, before anything is graded, for a gradebook (or JUnit report) that cannot be written."""
    where = Path(csv_path)
    if where.suffix == ".ipynb":
        raise UserError(f"{csv_path}: the gradebook is a .{kind} file, not a notebook")
    try:
        if where.is_dir():
            raise UserError(f"{csv_path}: a folder; give the gradebook a file name, e.g. {where / ('grades.' + kind)}")
        if not where.parent.is_dir():
            raise UserError(f"{csv_path}: no folder {where.parent} to write the gradebook in")
        if where.exists():  # opened as it will be written at the end, without truncating what is there
            open(where, "r+b").close()
        else:
            open(where, "xb").close()
            where.unlink()
    except OSError as error:
        raise UserError(f"{csv_path}: cannot write the gradebook there ({error.strerror})") from None


def _earlier_gradebook(csv_path: str | None) -> list[list[str]]:
    """The rows of the gradebook --only-errors grades again (one-line errors when it cannot be read)."""
    if csv_path is None:
        raise UserError("--only-errors grades again the ERROR rows of a gradebook: give it with --csv FILE")
    try:
        with open(csv_path, newline="") as file:
            rows = list(csv.reader(file))
    except OSError as error:
        raise UserError(f"{csv_path}: cannot read the gradebook ({error.strerror})") from None
    except (UnicodeDecodeError, csv.Error):
        rows = []
    if not rows or rows[0] != COLUMNS:
        raise UserError(f"{csv_path}: not a gradebook of course-lib grade (its first row is not {','.join(COLUMNS)})")
    return rows[1:]


def _graded(tasks: list[tuple[int, tuple]], workers: int, startup_timeout: int):
    """Each task's index and Graded, as each is done; `workers` notebooks at once."""
    if workers > 1 and len(tasks) > 1:
        with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
            futures = {pool.submit(grade_notebook, *task, startup_timeout=startup_timeout): i for i, task in tasks}
            for future in as_completed(futures):
                yield futures[future], future.result()
    else:
        for i, task in tasks:
            yield i, grade_notebook(*task, startup_timeout=startup_timeout)


def _grade_all(tasks: list[tuple], jobs: int, watched: Watched) -> dict[int, Graded]:
    """Each task's Graded, by index, printed as it is done, `jobs` notebooks at once. A notebook whose
    kernel did not start, or whose run ended after a watched file changed while others ran with it, is
    graded again once the others are done, alone (with a longer wait for its kernel); a run alone that
    changed a watched file is a FAIL, and the file is put back (module docstring)."""
    results, pending = {}, dict(enumerate(tasks))
    tries = [(jobs, STARTUP_TIMEOUT), (1, RETRY_STARTUP_TIMEOUT)]
    with tqdm(total=len(tasks), unit="notebook", file=sys.stderr, disable=True if len(tasks) < 2 else None) as bar:
        for n, (workers, startup_timeout) in enumerate(tries, 1):
            alone = workers == 1 or len(pending) == 1
            for i, graded in _graded(list(pending.items()), workers, startup_timeout):
                path, changed = tasks[i][0], watched.changed()
                if graded.not_started and n < len(tries):
                    bar.write(
                        f"{path}: the grader could not start a kernel; it is graded again at the end, "
                        f"alone, with {RETRY_STARTUP_TIMEOUT} s for its kernel to start",
                        file=sys.stdout,
                    )
                    continue
                if changed and not alone:
                    bar.write(
                        f"{path}: a file no submission may change ({changed[0]}) changed while it was graded "
                        "with others; it is graded again at the end, alone",
                        file=sys.stdout,
                    )
                    continue
                if changed:
                    graded = graded.modified(watched.what(changed[0]), watched.put_back(changed, path))
                results[i] = graded
                del pending[i]
                bar.write("\n".join(graded.lines), file=sys.stdout)
                bar.update()
            if changed := watched.changed():  # by one of the notebooks that ran at once: graded again, alone
                bar.write("\n".join(watched.put_back(changed, "a submission")), file=sys.stdout)
    return results


def _in_place(earlier: list[list[str]], rows: list[list[str]], graded_again: set[str]) -> list[list[str]]:
    """The earlier gradebook's rows, each notebook graded again with its new rows in place of its old ones."""
    by_notebook, merged = {}, []
    for row in rows:
        by_notebook.setdefault(row[0], []).append(row)
    for row in earlier:
        merged += by_notebook.pop(row[0], []) if row[0] in graded_again else [row]
    return merged


def _exit_status(rows: list[list[str]]) -> int:
    """0 when every row passes, 3 when some say ERROR (the grader could not start a kernel), else 1."""
    if any(row[2] == "ERROR" for row in rows):
        return 3
    return 0 if rows and all(row[2] == "PASS" for row in rows) else 1


def _check_reference(reference: Path, submissions: list[tuple], references: dict) -> None:
    """One-line errors for a reference folder that cannot grade these submissions: one that holds some of
    them (they would bring their own check cells), or one that lacks an exercise of the course that a
    submission is (the reference's fault, not the submission's)."""
    for path, _, notebook, _ in submissions:
        if path.resolve().parent == reference.resolve():
            raise UserError(
                f"{reference}: the folder the check cells come from holds {path}, a notebook being "
                "graded: the submissions would bring their own checks; give --reference the course's "
                "solutions/ or exercises/"
            )
        course = {p.stem for p in default_reference().glob("*.ipynb")}
        claimed = (notebook is not None and recorded_exercise(notebook)) or path.stem
        if claimed in course and claimed not in references:
            raise UserError(
                f"{reference}: no exercise {claimed} (which {path} is); give --reference a folder with "
                "every exercise graded, e.g. the course's solutions/"
            )


def _write_junit(junit_path: str, rows: list[list[str]]) -> None:
    """A JUnit XML report, one test case per gradebook row: a notebook is a class, an exercise a test."""
    failures, errors = sum(row[2] == "FAIL" for row in rows), sum(row[2] == "ERROR" for row in rows)
    suites = ElementTree.Element("testsuites")
    suite = ElementTree.SubElement(
        suites, "testsuite", name="course-lib grade", tests=str(len(rows)), failures=str(failures), errors=str(errors)
    )
    for path, label, result, detail, _, lesson in rows:
        case = ElementTree.SubElement(suite, "testcase", classname=path, name=label)
        if result != "PASS":
            ElementTree.SubElement(case, "failure" if result == "FAIL" else "error", message=detail).text = detail
        if lesson:
            ElementTree.SubElement(ElementTree.SubElement(case, "properties"), "property", name="lesson", value=lesson)
    try:
        ElementTree.ElementTree(suites).write(junit_path, encoding="utf-8", xml_declaration=True)
    except OSError as error:
        raise UserError(f"{junit_path}: cannot write the JUnit report ({error.strerror})") from None


def grade(
    paths: list[str],
    csv_path: str | None = None,
    reference_dir: str | None = None,
    cell_timeout: float = 300,
    notebook_timeout: float = 1800,
    jobs: int | None = None,
    only_errors: bool = False,
    as_recorded: bool = False,
    junit_path: str | None = None,
) -> int:
    """Grade notebooks and folders of notebooks: print PASS/FAIL per exercise with the check's hint, and
    write one CSV row per notebook and exercise to `csv_path` when given (and a JUnit XML test case per
    row to `junit_path`). `jobs` notebooks run at once (None: machine_jobs()); `only_errors` grades again
    only the notebooks whose rows in `csv_path` say ERROR, and puts their new rows in their place. A
    notebook whose recorded exercise is of another lesson than its file name says is a FAIL, unless
    `as_recorded`: then it is graded as what it records. Exit status: _exit_status of the gradebook."""
    for path, kind in ((csv_path, "csv"), (junit_path, "xml")):
        if path is not None:
            _check_gradebook_path(path, kind)
    earlier = _earlier_gradebook(csv_path) if only_errors else []
    reference = Path(reference_dir) if reference_dir else default_reference()
    if not reference.is_dir():
        raise UserError(
            f"{reference}: no such folder to take the check cells from; give --reference the "
            "course's exercises/ or solutions/ folder"
        )
    references = load_references(reference)
    paths_found = notebooks_to_grade(paths)
    if only_errors:
        again = {row[0] for row in earlier if row[2] == "ERROR"}
        paths_found = [path for path in paths_found if str(path) in again]
        if not paths_found:
            print(f"{csv_path}: no ERROR rows of these notebooks to grade again")
    can, why = machine_jobs()
    if jobs is None:
        jobs = can
    elif jobs > can:
        print(
            f"course-lib: warning: --jobs {jobs} is more than this machine can grade at once ({can}: {why})",
            file=sys.stderr,
        )
    submissions = [(path, *_read_submission(path)) for path in paths_found]  # all read before any runs
    _check_reference(reference, submissions, references)
    watched = Watched(reference, {path: data for path, data, *_ in submissions})
    tasks = []
    for path, data, notebook, problem in submissions:
        name = notebook and identify(notebook, path, references)
        if name and not as_recorded and (problem := wrong_lesson(notebook, path)):
            name = None
        tasks.append(
            (
                str(path),
                data.decode(errors="replace"),
                references.get(name) if name else None,
                cell_timeout,
                notebook_timeout,
                problem,
            )
        )
    results = _grade_all(tasks, jobs, watched)
    rows = [row for i in sorted(results) for row in results[i].rows]
    if len(tasks) > 1:
        passed = sum(1 for row in rows if row[2] == "PASS")
        print(
            f"{len(tasks)} notebooks graded: {passed} of {sum(r.exercises for r in results.values())} exercises passed"
        )
    if only_errors:
        rows = _in_place(earlier, rows, {str(path) for path in paths_found})
    not_graded = sorted({row[0] for row in rows if row[2] == "ERROR"})
    if not_graded:
        rerun = shlex.join(
            ["course-lib", "grade", *paths, "--csv", csv_path, "--only-errors"]
            if csv_path
            else ["course-lib", "grade", *not_graded]
        )
        print(
            f"ERROR: the grader could not start a kernel for {len(not_graded)} of the notebooks (a busy machine?); "
            f"grade them again later: {rerun}"
        )
    if csv_path is not None:
        try:
            with open(csv_path, "w", newline="") as file:
                csv.writer(file).writerows([COLUMNS, *rows])
        except OSError as error:
            raise UserError(f"{csv_path}: cannot write the gradebook ({error.strerror})") from None
        print(f"gradebook: {csv_path}")
    if junit_path is not None:
        _write_junit(junit_path, rows)
        print(f"JUnit report: {junit_path}")
    return _exit_status(rows)
