# Two commands for a fresh machine: `make demo` (the quickstart) and `make test` (the test suite).
# Each creates .venv/ in the checkout when missing: torch first (the CPU wheel), then rlbench and its extras.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test bench venv

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

demo: venv
	OMP_WAIT_POLICY=PASSIVE $(PY) -m rlbench.quickstart

test: venv
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

bench: venv
	OMP_WAIT_POLICY=PASSIVE $(PY) benchmarks/sampler.py
	OMP_WAIT_POLICY=PASSIVE $(PY) benchmarks/step.py
