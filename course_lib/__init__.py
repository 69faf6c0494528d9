"""Memory tricks course library: the tested code behind every lesson of the course.

`%load_ext course_lib` in a notebook registers the `%%gpu_only` cell magic (lesson 0, "Setup"). Its modules
and their floors: docs/architecture.md.
"""

import logging

__version__ = "0.3.0"

# bitsandbytes on a CPU warns at import that an optional kernel (fetched from a model hub, which the
# course never reaches) is missing; nothing of the course needs it. Only that one module is silenced.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def load_ipython_extension(ipython) -> None:
    """Register the course's cell magics in IPython (`%load_ext course_lib`)."""
    from course_lib.course import gpu_only

    ipython.register_magic_function(gpu_only, magic_kind="cell", magic_name="gpu_only")
