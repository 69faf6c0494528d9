# The course's two commands (README, "Quick start"):
#   make lab    set up .venv if needed, then open the course in JupyterLab
#   make test   set up .venv if needed, lint (ruff), then run the whole test suite (what CI runs), then
#               the floors' run (make test-floors)
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
# The floors' run: the lowest transformers, accelerate and peft that pyproject.toml admits (Colab's:
# constraints-floors.txt), in a venv of their own that resolves its own tokenizers and
# huggingface-hub, on a stated part of the suite: every lesson notebook (lesson 1 plans with the
# meta-device trace), the planner's trace composed (trace_compose), hf_checkpointing (checkpointing_apply)
# and the Trainer path (accumulation_trainer, qlora). transformers 5.17 (the lent GPU machine's) lies between these floors and constraints.txt's;
# another set of versions runs the same way: make test-floors FLOORS=.venv-x FLOORS_CONSTRAINTS=x.txt
FLOORS ?= .venv-floors
FLOORS_CONSTRAINTS ?= constraints-floors.txt
FLOORS_READY := $(FLOORS)/.ready
FLOORS_TESTS := notebooks tests/planner/test_trace_compose.py tests/checkpointing/test_checkpointing_apply.py \
	tests/accumulation/test_accumulation_trainer.py tests/qlora/test_qlora.py

.PHONY: lab test test-floors exercises browser-test

lab: $(READY)
	$(BIN)/jupyter lab --ServerApp.root_dir=. --LabApp.default_url=/lab/tree/notebooks/00_measuring_memory.ipynb $(ROOT_ARGS) $(LAB_ARGS)

test: $(READY)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile
	$(MAKE) test-floors

test-floors: $(FLOORS_READY)
	$(FLOORS)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(FLOORS_TESTS)

exercises: $(READY)
	$(BIN)/course-lib make-exercises

# torch is pinned to the CPU wheel in constraints.txt; the package itself keeps wide ranges. --no-compile:
# a module is byte-compiled when it is first imported, not all of torch's and jupyter's at install (35 s).
$(READY): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-compile -c constraints.txt -e '.[dev,lab]'
	touch $@

$(FLOORS_READY): pyproject.toml $(FLOORS_CONSTRAINTS)
	$(PYTHON) -m venv $(FLOORS)
	$(FLOORS)/bin/python -m pip install --quiet --disable-pip-version-check --no-compile -c $(FLOORS_CONSTRAINTS) -e '.[dev]'
	touch $@

# The course in a real browser (README, "Developing"): JupyterLab on 127.0.0.1 and the system's Chromium
# (apt-get install chromium; pip install playwright, which never downloads a browser here). Minutes long,
# so not part of `make test` (CI's 20 minutes).
browser-test: $(READY)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check 'playwright>=1.40'
	$(BIN)/python -m pytest -n 0 browser/check_in_jupyterlab.py
