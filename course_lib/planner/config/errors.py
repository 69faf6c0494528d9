"""The planner's refusal (lesson 1, "the planner")."""

from course_lib.errors import UserError


class PlanError(UserError):
    """A setup the planner cannot plan: the message says what to change (lesson 1)."""
