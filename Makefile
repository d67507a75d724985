# Set-up and checks. `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# Without a GPU, take the CPU build of torch (small, and on this workplace's
# disk) before the project resolves its own `torch>=…` requirement; with a GPU
# the default (CUDA) build is kept.
TORCH_CPU_SPEC ?= torch==2.13.0
RANKS  ?= 4

.PHONY: install install-test demo test check selftest clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip >/dev/null

$(VENV)/.torch: | $(PY)
	@if $(PY) -c "import torch" 2>/dev/null; then echo "torch already installed"; \
	elif command -v nvidia-smi >/dev/null 2>&1; then echo "GPU found: torch comes with the project"; \
	else $(PIP) install "$(TORCH_CPU_SPEC)"; fi
	@touch $@

install: $(VENV)/.torch
	$(PIP) install -e .

install-test: $(VENV)/.torch
	$(PIP) install -e ".[test]"

demo: install
	$(VENV)/bin/moonep-ep selftest --ranks $(RANKS) --driver auto

test: install-test
	$(PY) -m pytest

check: install
	$(VENV)/bin/moonep-ep check

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
