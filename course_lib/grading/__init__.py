"""Exercises from solutions, and grading (docs/grading.md); one module per job:

- generate: an exercise from a solved notebook (stubs, no outputs, the record of its protected cells);
- write: `course-lib make-exercises`, which never loses a learner's work (the manifest);
- kernelspec: a notebook as JupyterLab saves it (its kernel spec, streams, numbers, no stale widget state),
  so that opening and saving a notebook changes nothing;
- restore: a submission with its setup and check cells taken from the instructor's copy;
- run: a notebook run in a fresh kernel under per-cell and per-notebook time limits (nbclient), and every
  process its code started killed when it ends;
- guard: the reference's notebooks and the submissions, as read before any run, put back if a run changed one;
- repoint: `course-lib repoint`, a fork's badges and links moved to its own address;
- grade: `course-lib grade`, one notebook or a class's folder, into an optional CSV gradebook.
"""

from course_lib.grading.generate import (  # noqa: F401
    BEGIN,
    END,
    METADATA,
    learner_fingerprint,
    make_exercise,
    protected_cells,
    strip_solutions,
)
from course_lib.grading.grade import grade, notebooks_to_grade  # noqa: F401
from course_lib.grading.kernelspec import (  # noqa: F401
    as_jupyterlab_saves,
    jupyterlab_kernelspec,
    set_kernelspec,
    set_kernelspecs,
    shown_widget_models,
)
from course_lib.grading.repoint import repoint  # noqa: F401
from course_lib.grading.restore import identify, load_references, restore  # noqa: F401
from course_lib.grading.run import run_notebook  # noqa: F401
from course_lib.grading.write import MANIFEST, write_exercises  # noqa: F401
