# Two entry points for a fresh machine: `make demo` (the main job) and `make test`.
# Both create .venv on first use. Torch is installed first and pinned, so that the
# package's `torch>=2.1` does not resolve to another build. PyPI's Linux torch is the CUDA
# build (several GB; it runs on CPUs too): TORCH_INDEX=https://download.pytorch.org/whl/cpu
# takes the CPU build from PyTorch's own index instead.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
TORCH_INDEX ?=

.PHONY: demo test test-fast venv clean

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) -m dynapipe bench --output out/bench.json --png out/bench.png

# Two pytest-xdist workers: on 2 cores the spawned ranks of one job wait on each other (start-up,
# pipeline bubbles) about a third of the time, and a second worker fills it. Each module runs
# whole in one worker and the modules reading the shared training jobs in the same one
# (tests/conftest.py), so every job still trains once. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2

test: $(VENV)/.installed
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

# The modules that start no process (planner, schedules, plans, cost model, data, checks):
# about two minutes, for a quick loop while editing. CI runs `make test`.
test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -m "not spawns" tests

clean:
	rm -rf $(VENV) build *.egg-info
