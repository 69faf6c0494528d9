"""The whole suite (tests, and the notebooks nbval runs in kernels that inherit this environment)
plans with a trace cache of its own, fresh for each run and removed after it: no test reads what an
earlier run, or the user's own `course-lib plan`, left in ~/.cache/course-lib. Under pytest-xdist
(`make test`) each worker has its own cache, and it and everything it starts (kernels, graders, rank
processes) run torch on one thread: the workers share the cores, and on a core another process
holds, the OpenMP threads of two made the lessons' tiny models several times slower. No hypothesis
test has a deadline: timing goals go to benchmarks/ (CONTRIBUTING.md), and the default 200 ms an
example only fails a test on a busy machine."""

import atexit
import json
import os
import shutil
import tempfile

import pytest
from hypothesis import settings

settings.register_profile("no-deadline", deadline=None)
settings.load_profile("no-deadline")

os.environ["COURSE_LIB_CACHE_DIR"] = tempfile.mkdtemp(prefix="course-lib-cache-")
atexit.register(shutil.rmtree, os.environ["COURSE_LIB_CACHE_DIR"], ignore_errors=True)
if "PYTEST_XDIST_WORKER" in os.environ:  # read by torch's OpenMP when it loads: no test module has yet
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_config(tmp_path_factory) -> str:
    """The path of a config.json of a 2-layer Llama 32 wide: a model the planner traces in a fraction of a
    second (tests/test_bad_input.py, tests/test_fuzz.py)."""
    path = tmp_path_factory.mktemp("tiny_config") / "config.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "vocab_size": 64,
                "max_position_embeddings": 128,
            }
        )
    )
    return str(path)


def pytest_collection_modifyitems(items) -> None:
    """Every cell nbval collects from a notebook is marked `notebook` (pyproject.toml's markers)."""
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.notebook)
