#!/usr/bin/env bash
# GPU check (>= 2 GPUs, vllm==0.33.0 in .venv-vllm): `make serve` unchanged on the CUDA engine -- the OpenAI
# server with --data-parallel-size 2 --enable-expert-parallel --all2all-backend moonep -- under the openai
# client: concurrency, the HF oracle, 4xx errors, SIGTERM without leaks. Called by scripts/gpu_check.sh.
# It runs tests/vllm/test_serve.py (which runs `python -m tests.support.serve_check -- make serve`: one
# server start) and keeps pytest's output, with the test's summary line, in $OUT.
# The test runs its check in the environment named by MOONEP_EP_VLLM_CPU_PYTHON (it needs transformers and
# openai next to vLLM; vllm==0.33.0 brings both); on a GPU machine that is .venv-vllm, set below.
CHECK=serve
source "$(dirname "$0")/common.sh"

echo "== serve test: make serve on the CUDA engine"
MOONEP_EP_VLLM_CPU_PYTHON="$PWD/$PY" timeout "${TIMEOUT_S:-660}" "${PYTHON:-python3}" -m pytest tests/vllm/test_serve.py -k make_serve -rs -q \
  2>&1 | tee "$OUT/pytest-serve.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "serve: exit $status"
exit $status
