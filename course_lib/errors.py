"""`UserError`: bad input from the user, which `course-lib` prints as one line (exit status 2)."""


class UserError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""
