"""The functions exercise check cells call, one module per lesson (see CONTRIBUTING.md).

Each check raises AssertionError with a hint when the learner's answer is wrong.
"""

from course_lib.checks.measuring import *  # noqa: F401,F403  lesson 0
from course_lib.checks.adam import *  # noqa: F401,F403  lesson 1
from course_lib.checks.accumulation import *  # noqa: F401,F403  lesson 2
from course_lib.checks.checkpointing import *  # noqa: F401,F403  lesson 3
from course_lib.checks.paging import *  # noqa: F401,F403  lesson 4
from course_lib.checks.qlora import *  # noqa: F401,F403  lesson 5
