#!/usr/bin/env bash
# GPU check (>= 2 GPUs, vllm==0.33.0 in .venv-vllm): vLLM's memory profiling counts the sharded MoonEP
# expert store as model memory, so the KV cache leaves room for it. Called by scripts/gpu_check.sh.
#   1. the `cuda`/`multi_gpu`-marked test tests/vllm/test_gpu_kv_accounting.py (it runs the tool below);
#   2. the tool's JSON into $OUT for the session's notes.
CHECK=kv-accounting
source "$(dirname "$0")/common.sh"

echo "== kv accounting: store bytes vs vLLM's model memory and KV cache"
timeout 560 "$PY" -m moonep_ep.tools.kv_accounting --json | tee "$OUT/kv-accounting.json"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== cuda/multi_gpu test"
timeout 600 .venv/bin/python -m pytest tests/vllm/test_gpu_kv_accounting.py -m "cuda and multi_gpu" -rs -q \
  2>&1 | tee "$OUT/pytest-kv-accounting.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "kv_accounting: exit $status"
exit $status
