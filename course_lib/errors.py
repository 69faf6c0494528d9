"""`UserError`: bad input from the user, which `course-lib` prints as one line (exit status 2).

Every error class of the library for bad input (`memory.PlanError`, `qlora.RecipeError`,
`paging.PagingError`, `models.ModelNotFound`) is a `UserError`; `course_lib.validate` raises them."""


class UserError(ValueError):
    """Bad input from the user: one line that names the argument, the value and what to give instead
    (`course-lib` prints it, exit status 2). A ValueError, so that `except ValueError` still catches it.
    A message that shows a value whose repr spans lines (a tensor, a module) is put on one line."""

    def __init__(self, message: object = "", *args: object) -> None:
        super().__init__(" ".join(str(message).split()), *args)


# What an unanswered exercise (its stub raises NotImplementedError) shows, in its check cell and in the grade.
NOT_DONE = "not done yet: the exercise still raises NotImplementedError"


class UserTypeError(UserError, TypeError):
    """Bad input of the wrong type (a float where a count is expected): a UserError and a TypeError."""
