"""The functions exercise check cells call, one module per lesson (see CONTRIBUTING.md).

Each check raises `CheckFailed` (an AssertionError) with a hint when the learner's answer is wrong:
every `check_...` below is wrapped by `hints_only`, so that Jupyter shows the hint as one short block,
not the check's source. `refuse_reference` (or `refusing`) lets a check refuse an answer that only
calls the library's own implementation of what the exercise asks (hints.py).
"""

from course_lib.checks.accumulation import *  # noqa: F401,F403  lesson 2
from course_lib.checks.accumulation_window import *  # noqa: F401,F403  lesson 2, exercise 2.2
from course_lib.checks.adam import *  # noqa: F401,F403  lesson 1
from course_lib.checks.checkpointing import *  # noqa: F401,F403  lesson 3
from course_lib.checks.hints import NOT_DONE, CheckFailed, hints_only, refuse_reference, refusing  # noqa: F401
from course_lib.checks.measuring import *  # noqa: F401,F403  lesson 0
from course_lib.checks.paging import *  # noqa: F401,F403  lesson 4
from course_lib.checks.qlora import *  # noqa: F401,F403  lesson 5
from course_lib.checks.sharding import *  # noqa: F401,F403  lesson 6
from course_lib.checks.toolbox import *  # noqa: F401,F403  lesson 7

for _name in [name for name in globals() if name.startswith("check_")]:
    globals()[_name] = hints_only(globals()[_name])
del _name
