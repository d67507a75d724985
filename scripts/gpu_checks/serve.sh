#!/usr/bin/env bash
# GPU check (>= 2 GPUs, vllm==0.33.0 in .venv-vllm): `make serve` unchanged on the CUDA engine -- the OpenAI
# server with --data-parallel-size 2 --enable-expert-parallel --all2all-backend moonep -- under the openai
# client: concurrency, the HF oracle, 4xx errors, SIGTERM without leaks. To be called by scripts/gpu_check.sh.
#   1. tests/vllm/test_serve.py (it runs `python -m moonep_ep.tools.serve_check -- make serve`);
#   2. the check's JSON into $OUT for the session's notes.
# The test runs its check in the environment named by MOONEP_EP_VLLM_CPU_PYTHON (it needs transformers and
# openai next to vLLM; vllm==0.33.0 brings both); on a GPU machine that is .venv-vllm, set below.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-gpu-check-out}"
mkdir -p "$OUT"
status=0
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ "${GPUS:-0}" -lt 2 ]; then
  echo "serve: needs >= 2 GPUs (found ${GPUS:-0}); skipped" | tee "$OUT/serve.txt"
  exit 0
fi
PY=.venv-vllm/bin/python
[ -x "$PY" ] || { echo "serve: $PY missing (make venv-vllm)"; exit 1; }

echo "== serve check: make serve on the CUDA engine"
timeout 600 "$PY" -m moonep_ep.tools.serve_check --json -- make serve | tee "$OUT/serve.json"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== the serve test (same check, asserted)"
MOONEP_EP_VLLM_CPU_PYTHON="$PWD/$PY" timeout 660 .venv/bin/python -m pytest tests/vllm/test_serve.py -rs -q \
  2>&1 | tee "$OUT/pytest-serve.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "serve: exit $status"
exit $status
