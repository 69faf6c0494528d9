"""The `course-lib` command: a thin layer over the modules (README, "Commands")."""

from __future__ import annotations

import argparse
import sys


class UserError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line that says what to do."""

    def error(self, message: str) -> None:
        raise UserError(f"{message} (see `{self.prog} --help`)")


def _check(args: argparse.Namespace) -> int:
    from course_lib.device import check_environment

    return 0 if check_environment() else 1


def _make_exercises(args: argparse.Namespace) -> int:
    from course_lib.exercises import write_exercises

    report = write_exercises(args.solutions, args.exercises, force=args.force)
    for line in report:
        print(line)
    return 1 if any(line.startswith("kept") for line in report) else 0


def _grade(args: argparse.Namespace) -> int:
    from course_lib.exercises import grade

    return grade(args.notebooks)


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

    grade = commands.add_parser("grade", help="run notebooks under nbval and summarise each exercise")
    grade.add_argument("notebooks", nargs="+", help="notebooks (.ipynb) to grade; they are not modified")
    grade.set_defaults(run=_grade)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.run(args)
    except UserError as error:
        print(f"course-lib: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
