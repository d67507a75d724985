#!/usr/bin/env bash
# GPU check (>= 2 GPUs, vllm==0.33.0 in .venv-vllm): vLLM's memory profiling counts the sharded MoonEP
# expert store as model memory, so the KV cache leaves room for it. Called by scripts/gpu_check.sh.
#   the `cuda`/`multi_gpu`-marked test tests/vllm/test_gpu_kv_accounting.py, which runs the tool
#   (python -m tests.support.kv_accounting: one DP=2 engine start) and prints its JSON, kept in $OUT for
#   the session's notes. gpu_check.sh's GPU-test step leaves this test to this script.
CHECK=kv-accounting
source "$(dirname "$0")/common.sh"

echo "== kv accounting: store bytes vs vLLM's model memory and KV cache (cuda/multi_gpu test)"
timeout "${TIMEOUT_S:-600}" "${PYTHON:-python3}" -m pytest tests/vllm/test_gpu_kv_accounting.py -m "cuda and multi_gpu" -rs -q -s \
  2>&1 | tee "$OUT/pytest-kv-accounting.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
grep '^{' "$OUT/pytest-kv-accounting.txt" | tail -1 > "$OUT/kv-accounting.json" || true
echo "kv_accounting: exit $status"
exit $status
