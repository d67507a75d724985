# Sourced by each DP=2 GPU check (kv_accounting.sh, serve.sh) with the check's name in $CHECK: the
# repository root as working directory, $OUT for the results, status=0, and PY=.venv-vllm/bin/python.
# With fewer than 2 GPUs the check is skipped (exit 0, the reason in $OUT/$CHECK.txt).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"   # the tests run from the tree (python3, no venv)
OUT="${OUT:-gpu-check-out}"
mkdir -p "$OUT"
status=0
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ "${GPUS:-0}" -lt 2 ]; then
  echo "$CHECK: needs >= 2 GPUs (found ${GPUS:-0}); skipped" | tee "$OUT/$CHECK.txt"
  exit 0
fi
PY=.venv-vllm/bin/python
[ -x "$PY" ] || { echo "$CHECK: $PY missing (make venv-vllm)"; exit 1; }
