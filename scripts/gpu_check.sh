#!/usr/bin/env bash
# GPU checks for one lent GPU (e.g. one H200), kept under 8 minutes:
#   1. the `cuda`-marked tests (VMM allocate/map/teardown, 2-process fd export/import);
#   2. `moonep-ep check --json` (what this GPU supports);
#   3. `moonep-ep selftest --driver cuda` with 2 ranks on the one GPU (gloo metadata,
#      POSIX-fd handles; multicast is voted off: a team needs distinct GPUs).
# Multicast, fabric handles and NVLink need a multi-GPU NVSwitch node (markers
# `multi_gpu`, `nvswitch`); those tests skip here with their reason.
# Results land in $OUT (or ./gpu-check-out) for the session's notes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-check-out}"
mkdir -p "$OUT"
status=0

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv && .venv/bin/python -m pip install -q -e ".[test]" || exit 1
fi
PY=.venv/bin/python
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/nvidia-smi.csv"

echo "== cuda-marked tests"
timeout 300 $PY -m pytest -m "cuda or multi_gpu or nvswitch" -rs -q 2>&1 | tee "$OUT/pytest-cuda.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== moonep-ep check --json"
timeout 60 .venv/bin/moonep-ep check --json | tee "$OUT/check.json" || status=1

echo "== moonep-ep selftest --driver cuda --ranks 2"
timeout 120 .venv/bin/moonep-ep selftest --driver cuda --ranks 2 --chunk-mib 64 --json \
  | tee "$OUT/selftest-cuda.json" || status=1

echo "gpu_check: exit $status"
exit $status
