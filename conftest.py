"""The whole suite (tests, and the notebooks nbval runs in kernels that inherit this environment)
plans with a trace cache of its own, fresh for each run and removed after it: no test reads what an
earlier run, or the user's own `course-lib plan`, left in ~/.cache/course-lib."""

import atexit
import os
import shutil
import tempfile

os.environ["COURSE_LIB_CACHE_DIR"] = tempfile.mkdtemp(prefix="course-lib-cache-")
atexit.register(shutil.rmtree, os.environ["COURSE_LIB_CACHE_DIR"], ignore_errors=True)
