# The course's two commands (README, "Quick start"):
#   make lab    set up .venv if needed, then open the course in JupyterLab
#   make test   set up .venv if needed, then run the whole test suite (what CI runs)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
READY := $(VENV)/.ready
LAB_ARGS ?=
# pytest-xdist workers for `make test`, one test file per worker at a time (--dist loadfile: a
# notebook's cells run in order in one kernel). 2 suits CI's 2 cores; `-n auto` would count the
# host's physical cores, not a container's share. `make test TEST_WORKERS=0` runs in one process.
TEST_WORKERS ?= 2
ROOT_ARGS := $(if $(filter 0,$(shell id -u)),--allow-root)  # JupyterLab refuses root without it

.PHONY: lab test exercises

lab: $(READY)
	$(BIN)/jupyter lab --ServerApp.root_dir=. --LabApp.default_url=/lab/tree/notebooks/00_measuring_memory.ipynb $(ROOT_ARGS) $(LAB_ARGS)

test: $(READY)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

exercises: $(READY)
	$(BIN)/course-lib make-exercises

# torch is pinned to the CPU wheel in constraints.txt; the package itself keeps wide ranges.
$(READY): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev,lab]'
	touch $@
