# Two entry points for a fresh machine: `make demo` (the main job) and `make test`.
# Both create .venv on first use. Torch is installed first, pinned, so that pip takes
# the CPU wheel instead of resolving a multi-GB CUDA build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0

.PHONY: demo test venv clean

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) -m dynapipe bench --output out/bench.json --png out/bench.png

test: $(VENV)/.installed
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info
