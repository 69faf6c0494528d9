"""The `course-lib` command: a thin layer over the modules (docs/planner.md)."""

from __future__ import annotations

import argparse
import json
import re
import sys

from course_lib import course, validate
from course_lib.errors import UserError


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line that says what to do, and `--params -7e9` (or -1.5B, -inf)
    is a value to check, not an unknown option."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(
            r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?[kKmMbBtT]?$|^-(inf|nan)$", re.IGNORECASE
        )

    def error(self, message: str) -> None:
        raise UserError(f"{message} (see `{self.prog} --help`)")


def _check(args: argparse.Namespace) -> int:
    # off the import path: course_lib.device imports torch (a second): keeps the other commands light
    from course_lib.device import check_environment

    return 0 if check_environment() else 1


def _make_exercises(args: argparse.Namespace) -> int:
    # off the import path: course_lib.grading imports nbclient and nbformat (seconds): keeps `course-lib plan` light
    from course_lib.grading import write_exercises

    report = write_exercises(args.solutions, args.exercises, force=args.force)
    for line in report:
        print(line)
    return 1 if any(line.startswith("kept") for line in report) else 0


def _kernelspec(args: argparse.Namespace) -> int:
    # off the import path: course_lib.grading imports nbclient and nbformat (seconds): keeps `course-lib plan` light
    from course_lib.grading import set_kernelspecs

    for path in set_kernelspecs(args.folders):
        print(f"rewritten as JupyterLab saves it: {path}")
    return 0


def _repoint(args: argparse.Namespace) -> int:
    # off the import path: course_lib.grading imports nbclient and nbformat (seconds): keeps `course-lib plan` light
    from course_lib.grading import repoint

    report = repoint(args.folder)
    for line in report or [f"every address already points at {course.REPOSITORY}@{course.BRANCH}"]:
        print(line)
    return 1 if any(line.startswith("kept") for line in report) else 0


def _grade(args: argparse.Namespace) -> int:
    # off the import path: course_lib.grading imports nbclient and nbformat (seconds): keeps `course-lib plan` light
    from course_lib.grading import grade

    return grade(
        args.notebooks,
        args.csv,
        reference_dir=args.reference,
        cell_timeout=args.timeout,
        notebook_timeout=args.notebook_timeout,
        jobs=args.jobs,
        only_errors=args.only_errors,
        as_recorded=args.as_recorded,
        junit_path=args.junit,
    )


def _checked(check, **options):
    """An argparse type: the text read as a number, then checked by `check` (course_lib.validate), whose
    one line says what to give instead."""

    def parse(text: str):
        try:
            return validate.from_text(check, text, **options)
        except ValueError as error:  # argparse names the option: "argument --timeout: must be ..."
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse


_POSITIVE_INT = _checked(validate.positive_int)


def _plan(argv: list[str]) -> int:
    """`course-lib plan`: its parser is generated from the planner's setup (course_lib.planner.config.command)."""
    # off the import path: course_lib.planner imports torch (a second): keeps `course-lib grade` light
    from course_lib.planner import PlanError, plan_from_cli
    from course_lib.planner.config.command import parse, recipe_applied  # the same: off the import path
    from course_lib.planner.config.recipes import describe  # the same: off the import path

    command = parse(argv)
    applied = recipe_applied(command) if command.recipe is not None else {}
    try:
        result = plan_from_cli(command.model, params=command.params, gpu=command.target.gpu, **command.setup_fields())
    except PlanError as error:
        raise UserError(str(error)) from None
    if command.json:
        shown = result.to_dict()
        if command.recipe is not None:
            shown["recipe"] = {"name": command.recipe, "set": applied}  # json writes a tuple as a list
        print(json.dumps(shown, indent=2))
    else:
        if command.recipe is not None:
            print(describe(command.recipe, applied))
        print(result)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="course-lib", description="Memory tricks course: tools for learners and instructors.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    check = commands.add_parser("check", help="print OK/FAIL for each requirement of the course")
    check.set_defaults(run=_check)

    make = commands.add_parser("make-exercises", help="write exercises/ from solutions/ (never overwrites your work)")
    make.add_argument("--solutions", default="solutions", help="folder of solved notebooks (default: solutions)")
    make.add_argument("--exercises", default="exercises", help="folder to write (default: exercises)")
    make.add_argument("--force", action="store_true", help="overwrite exercises that were edited since generated")
    make.set_defaults(run=_make_exercises)

    grade = commands.add_parser("grade", help="run notebooks with the course's own check cells; PASS/FAIL per exercise")
    grade.add_argument(
        "notebooks",
        nargs="+",
        metavar="NOTEBOOK_OR_FOLDER",
        help="notebooks (.ipynb), or folders of them (e.g. one per learner); not modified",
    )
    grade.add_argument("--csv", metavar="FILE", help="also write a gradebook: one row per notebook and exercise")
    grade.add_argument(
        "--junit",
        metavar="FILE",
        help="also write a JUnit XML report, one test case per notebook "
        "and exercise (for a course's CI or a classroom autograder)",
    )
    grade.add_argument(
        "--as-recorded",
        action="store_true",
        help="grade a notebook whose recorded exercise is of another lesson than its file name says "
        "as the exercise it records (by default it is a FAIL)",
    )
    grade.add_argument(
        "--reference",
        metavar="DIR",
        help="the instructor's copy the setup and check cells come "
        "from: a folder of the course's exercises or solutions (default: the course's solutions/)",
    )
    grade.add_argument(
        "--timeout",
        type=_checked(validate.positive),
        default=300,
        metavar="SECONDS",
        help="the longest a cell may run (default 300)",
    )
    grade.add_argument(
        "--notebook-timeout",
        type=_checked(validate.positive),
        default=1800,
        metavar="SECONDS",
        help="the longest a whole notebook may run, once its kernel is up (default 1800)",
    )
    grade.add_argument(
        "--jobs",
        type=_POSITIVE_INT,
        metavar="N",
        help="grade N notebooks at once, each in its own kernel (default: what this machine can "
        "run, by its CPU cores or its available memory, whichever binds)",
    )
    grade.add_argument(
        "--only-errors",
        action="store_true",
        help="grade again only the notebooks whose rows in the --csv gradebook say ERROR (the "
        "grader could not start a kernel), and put their new rows in its place",
    )
    grade.set_defaults(run=_grade)

    kernelspec = commands.add_parser(
        "kernelspec",
        help="write notebooks as JupyterLab saves them, so that "
        "opening and saving one changes nothing (for maintainers, after a merge)",
    )
    kernelspec.add_argument(
        "folders",
        nargs="*",
        default=["notebooks", "solutions"],
        metavar="FOLDER",
        help="folders of notebooks (default: notebooks solutions)",
    )
    kernelspec.set_defaults(run=_kernelspec)

    repoint = commands.add_parser(
        "repoint",
        help="point the Colab badges, setup cells and links at course_lib/course.py's REPOSITORY and BRANCH "
        "(for a fork), then make exercises/ again",
    )
    repoint.add_argument("folder", nargs="?", default=".", help="the course's folder (default: .)")
    repoint.set_defaults(run=_repoint)

    # `plan`'s own arguments are tyro's (main hands them over): listed here for `course-lib --help`
    commands.add_parser("plan", help="predict the memory of a training step and whether it fits a GPU", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["plan"]:
            return _plan(argv[1:])
        args = build_parser().parse_args(argv)
        return args.run(args)
    except UserError as error:
        print(f"course-lib: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # a path the file system refuses (too long, not allowed): the user's to change
        where = f"{error.filename}: " if error.filename else ""
        print(f"course-lib: error: {where[:120]}{error.strerror or error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
