"""`course-lib grade`: PASS/FAIL per exercise, for one notebook or a class's folder (README,
"Exercises and grading").

Every submission is read before any runs. Each runs from a copy in a fresh temporary folder, with its
setup and check cells from the instructor's copy (restore.py), under a per-cell and a per-notebook time
limit; an exercise passes only when its check cell ran without an error. Folders are graded with a
progress bar, several notebooks at once (as many as the machine can run, by default), into an optional
CSV gradebook.

A kernel that does not start is the machine's problem, not the submission's (none of its code ran): the
notebook is graded again once the others are done, alone, with a longer wait for its kernel; if it
still does not start, its rows say ERROR, never FAIL, and `--only-errors` grades them again later.
"""

from __future__ import annotations

import csv
import os
import shlex
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import nbformat
import psutil
from tqdm.auto import tqdm

import course_lib
from course_lib.errors import UserError
from course_lib.exercises.restore import identify, load_references, restore
from course_lib.exercises.run import run_notebook

COLUMNS = ["notebook", "exercise", "result", "detail", "check_cell"]
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


def grade_notebook(path: str, text: str, reference: dict | None, cell_timeout: float, notebook_timeout: float,
                   problem: str = "", startup_timeout: int = STARTUP_TIMEOUT) -> Graded:
    """Grade one submission (its path, for the report, and its text); `reference` is its exercise from
    the instructor's copy, None when there is none (`problem` then says why). Its rows say ERROR when
    its kernel did not start within `startup_timeout` seconds."""
    lines = [f"Grading {path}"]
    if reference is None:
        detail = problem or "not one of the course's exercises (no exercise of this name or with these cells)"
        return Graded(lines + [f"  FAIL  {detail}"], [[path, "(the whole notebook)", "FAIL", detail, ""]], 1)
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
            rows.append([path, record["label"], result, detail, note])
    protected = set(index_of[record["id"]] for record in restored.records)
    for index, error in sorted(run.errors.items()):
        if error and index not in protected:
            rows.append([path, f"{restored.origin[index]} (not a check)", "FAIL", error, ""])
    lines += [f"  {result}  {label}" + (f": {detail}" if detail else "") for _, label, result, detail, _ in rows]
    checks = [record for record in restored.records if record["role"] == "check"]
    passed = sum(1 for row in rows if row[2] == "PASS")
    lines.append("  not graded: the grader could not start a kernel" if not run.started
                 else f"  {passed} of {len(checks)} exercises passed")
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
        return data, None, f"not a readable notebook ({type(error).__name__}): re-download it or start again " \
                           "from the exercise"


def _check_gradebook_path(csv_path: str) -> None:
    where = Path(csv_path)
    if where.suffix == ".ipynb":
        raise UserError(f"{csv_path}: the gradebook is a .csv file, not a notebook")
    if where.is_dir():
        raise UserError(f"{csv_path}: a folder; give the gradebook a file name, e.g. {where / 'grades.csv'}")
    if not where.parent.is_dir():
        raise UserError(f"{csv_path}: no folder {where.parent} to write the gradebook in")


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


def _grade_all(tasks: list[tuple], jobs: int) -> dict[int, Graded]:
    """Each task's Graded, by index, printed as it is done, `jobs` notebooks at once; a notebook whose
    kernel did not start is graded again once the others are done, alone, with a longer wait."""
    results, pending = {}, dict(enumerate(tasks))
    tries = [(jobs, STARTUP_TIMEOUT), (1, RETRY_STARTUP_TIMEOUT)]
    with tqdm(total=len(tasks), unit="notebook", file=sys.stderr, disable=True if len(tasks) < 2 else None) as bar:
        for n, (workers, startup_timeout) in enumerate(tries, 1):
            for i, graded in _graded(list(pending.items()), workers, startup_timeout):
                if graded.not_started and n < len(tries):
                    bar.write(f"{tasks[i][0]}: the grader could not start a kernel; it is graded again at the end, "
                              f"alone, with {RETRY_STARTUP_TIMEOUT} s for its kernel to start", file=sys.stdout)
                    continue
                results[i] = graded
                del pending[i]
                bar.write("\n".join(graded.lines), file=sys.stdout)
                bar.update()
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


def grade(paths: list[str], csv_path: str | None = None, reference_dir: str | None = None,
          cell_timeout: float = 300, notebook_timeout: float = 1800, jobs: int | None = None,
          only_errors: bool = False) -> int:
    """Grade notebooks and folders of notebooks: print PASS/FAIL per exercise with the check's hint, and
    write one CSV row per notebook and exercise to `csv_path` when given. `jobs` notebooks run at once
    (None: machine_jobs()); `only_errors` grades again only the notebooks whose rows in `csv_path` say
    ERROR, and puts their new rows in their place. Exit status: _exit_status of the gradebook."""
    if csv_path is not None:
        _check_gradebook_path(csv_path)
    earlier = _earlier_gradebook(csv_path) if only_errors else []
    reference = Path(reference_dir) if reference_dir else default_reference()
    if not reference.is_dir():
        raise UserError(f"{reference}: no such folder to take the check cells from; give --reference the "
                        "course's exercises/ or solutions/ folder")
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
        print(f"course-lib: warning: --jobs {jobs} is more than this machine can grade at once ({can}: {why})",
              file=sys.stderr)
    submissions = [(path, *_read_submission(path)) for path in paths_found]  # all read before any runs
    tasks = [(str(path), data.decode(errors="replace"), notebook and references.get(identify(notebook, path, references)),
              cell_timeout, notebook_timeout, problem) for path, data, notebook, problem in submissions]
    results = _grade_all(tasks, jobs)
    rows = [row for i in sorted(results) for row in results[i].rows]
    _put_back_changed(submissions)
    if len(tasks) > 1:
        passed = sum(1 for row in rows if row[2] == "PASS")
        print(f"{len(tasks)} notebooks graded: {passed} of {sum(r.exercises for r in results.values())} exercises passed")
    if only_errors:
        rows = _in_place(earlier, rows, {str(path) for path in paths_found})
    not_graded = sorted({row[0] for row in rows if row[2] == "ERROR"})
    if not_graded:
        rerun = shlex.join(["course-lib", "grade", *paths, "--csv", csv_path, "--only-errors"] if csv_path
                           else ["course-lib", "grade", *not_graded])
        print(f"ERROR: the grader could not start a kernel for {len(not_graded)} of the notebooks (a busy machine?); "
              f"grade them again later: {rerun}")
    if csv_path is not None:
        try:
            with open(csv_path, "w", newline="") as file:
                csv.writer(file).writerows([COLUMNS, *rows])
        except OSError as error:
            raise UserError(f"{csv_path}: cannot write the gradebook ({error.strerror})") from None
        print(f"gradebook: {csv_path}")
    return _exit_status(rows)


def _put_back_changed(submissions: list[tuple]) -> None:
    """A submission's code may have written another submission's file by its absolute path: put the
    file back as it was read (each was graded from what was read, before any ran)."""
    for path, data, *_ in submissions:
        try:
            if path.read_bytes() == data:
                continue
        except OSError:
            pass
        try:
            path.write_bytes(data)
            print(f"put back {path}: a submission's code changed it while grading")
        except OSError as error:
            print(f"{path}: a submission's code changed it while grading, and it cannot be put back ({error.strerror})")
