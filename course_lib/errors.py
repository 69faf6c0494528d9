"""`UserError`: bad input from the user, which `course-lib` prints as one line (exit status 2)."""


class UserError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""


# What an unanswered exercise (its stub raises NotImplementedError) shows, in its check cell and in the grade.
NOT_DONE = "not done yet: the exercise still raises NotImplementedError"
