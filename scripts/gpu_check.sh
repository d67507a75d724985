#!/usr/bin/env bash
# The checks a lent GPU must run: the CUDA path on real hardware, the part the CPU emulator cannot run
# (docs/design/memory.md, "The seam"), in parts that each fit one command (<= 480 s of step limits).
#
#   bash scripts/gpu_check.sh --plan      every part's steps and time limits (runs nothing)
#   bash scripts/gpu_check.sh --part N    run part N; its last stdout line is one JSON object
#
# Runs as the lent machine is: `python3` (override: PYTHON=...) with PYTHONPATH=src -- no venv, no
# install, nothing fetched. Part 1 alone answers the first question: does the CUDA path allocate,
# export, import, map, verify and tear down with 0 leaks on the real driver? Part 6 (one GPU, torch and
# Triton) runs the project's MXFP4 experts at Kimi K2/K3 shapes and the slot-fill race; part 7 (the same) one
# Kimi K3 MoE layer with SiTU through them against a dense reference. Parts 3-5 need >= 2 GPUs
# and an installed vLLM 0.33.0 environment (.venv-vllm, up to date); elsewhere they report
# "not_applicable" with the reason and "ok": null (nothing ran, nothing passed).
# MOONEP_EP_CUDA_EMULATOR=1 (set by the CPU test of this script, never on a GPU) runs every step over
# the CUDA driver emulator; steps that need real hardware then report not_applicable.
# Logs and each step's output land in $OUT (default gpu-check-out).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-gpu-check-out}"
EMU=0
[ "${MOONEP_EP_CUDA_EMULATOR:-0}" = "1" ] && EMU=1
CLI="$PY -m moonep_ep"
VLLM_PY=.venv-vllm/bin/python

# part|step|limit_s|needs|modules|check over `out` (the step's JSON; "rc" = exit status only)|what it answers
# needs: - (always), gpu (real hardware), engine (>= 2 GPUs and an up-to-date .venv-vllm)
# A step that prints {"not_applicable": why} (a precondition it checks itself is missing) is reported so.
# modules: what `python3` must import for the step (engine steps: what .venv-vllm must import)
PLAN=$(cat <<'EOF'
1|env|30|-|torch,numpy,pytest|out["ok"]|python3, torch, cuda-bindings, pytest importable; the GPU seen by torch and the driver
1|check|60|-|torch,cuda.bindings|out["cuda"]["available"] and out["cuda"]["emulated"] == EMU and out["cuda"]["versions"]["compatible"]|moonep-ep check: CUDA usable, driver fits the bindings
1|selftest|120|-|torch,cuda.bindings|out["ok"] and out["driver"] == "cuda" and out["emulated"] == EMU|2 ranks on GPU 0: create, export (POSIX fd), import, map, verify, tear down, 0 leaks per rank (device-wide figure read after a warm-up)
1|gpu_tests|180|gpu|torch,cuda.bindings,numpy,pytest,hypothesis|out["ok"]|pytest -m cuda (memory and layout tiers): none may skip
1|footprint|90|-|torch,cuda.bindings|out["ok"] and out["driver"] == "cuda" and out["emulated"] == EMU|footprint --measure: the store's handles == the plan; device-wide cuMemGetInfo within a page (after a warm-up)
2|perf|240|-|torch,cuda.bindings|out["ok"] and out["emulated"] == EMU|slot fill imported/local and grouped FFN views/plain, ratios (about 1.0 expected)
2|ops_demo|120|-|torch,cuda.bindings|out["ok"] and out["driver"] == "cuda" and out["emulated"] == EMU|the ops demo with the store in GPU memory, against the dense oracle
2|selftest_soak|90|-|torch,cuda.bindings|out["ok"] and out["cycles"] == 6|6 allocate/verify/teardown cycles on GPU 0, leaks per rank
3|make_demo|450|engine|vllm,compressed_tensors|out.get("ok") is True|vLLM's CUDA engine, DP=2, the moonep backend (what make demo runs)
4|kv_accounting|450|engine|vllm|rc|vLLM's model memory counts the store (scripts/gpu_checks/kv_accounting.sh)
5|serve|450|engine|vllm|rc|the openai client against what make serve starts (scripts/gpu_checks/serve.sh)
6|mxfp4_experts|180|gpu|torch,triton|out["ok"]|the MXFP4 experts at K2 and K3 shapes, bf16 and fp16: an expert past 2^31 bytes, a slot row, against a reference decoded here; one scale off by one must fail
6|mxfp4_kernel|150|gpu|torch,triton|out["ok"]|the MXFP4 grouped GEMM's registers, spills and time over a dense bf16 grouped GEMM (decode and prefill, fastest trials)
6|mxfp4_race|120|gpu|torch,triton|out["ok"]|slot fills on a side stream, then the experts: without a wait (reported) and after wait_for_slots (must match)
7|k3_moe_layer|180|gpu|torch,triton|out["ok"]|one Kimi K3 MoE layer at real widths (latent 3584, I 3072) through the MXFP4 experts with SiTU against a dense fp32 reference; SiLU, no linear_beta, the bias in the weights, the norm skipped must each fail
EOF
)
# What the lent GPU machine's python3 (3.12) has, and what it lacks, as its lender states it.
LENT_HAS="torch triton numpy hypothesis pytest transformers safetensors"
LENT_LACKS="vllm compressed_tensors"
PART_LIMIT=480

plan() {
  "$PY" - "$PLAN" "$PART_LIMIT" "$LENT_HAS" "$LENT_LACKS" <<'PYEOF'
import json, sys
rows = [l.split("|") for l in sys.argv[1].splitlines() if l.strip()]
limit = int(sys.argv[2])
has, lacks = set(sys.argv[3].split()), set(sys.argv[4].split())


def on_lent(needs, mods):
    """Whether the step can run on the lent machine (python3 3.12, one GPU), from its stated list."""
    missing = [m for m in mods if m in lacks]
    if missing:
        return f"cannot run: it has no {', '.join(missing)}"
    if needs == "engine":
        return "cannot run: needs >= 2 GPUs and .venv-vllm"
    unknown = [m for m in mods if m not in has]
    if unknown:
        return f"runs if python3 has {', '.join(unknown)} (not on its list; checked before the step)"
    return "runs"


print(f"lent GPU machine (stated): python3 3.12 with {', '.join(sorted(has))}; without {', '.join(sorted(lacks))}")
for part in sorted({int(r[0]) for r in rows}):
    steps = [r for r in rows if int(r[0]) == part]
    total = sum(int(r[2]) for r in steps)
    print(f"part {part}: {total} s of limits (at most {limit})")
    for _, name, secs, needs, mods, _check, what in steps:
        print(f"  {name:<14} {secs:>4} s  {'[' + needs + '] ' if needs != '-' else ''}{what}")
        print(f"  {'':<14}         needs {mods.replace(',', ', ')}; lent machine: {on_lent(needs, mods.split(','))}")
    print(json.dumps({"part": part, "limit_s": total, "max_limit_s": limit,
                      "steps": [{"step": r[1], "limit_s": int(r[2]), "needs": r[3], "modules": r[4].split(","),
                                 "lent_machine": on_lent(r[3], r[4].split(","))} for r in steps]}))
PYEOF
}

# Modules of a comma list that `python3` cannot import ("" = all present).
missing_modules() {
  "$PY" - "$1" <<'PYEOF'
import importlib.util, sys
missing = []
for m in sys.argv[1].split(","):
    try:
        found = importlib.util.find_spec(m) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        missing.append(m)
print(",".join(missing))
PYEOF
}

gpu_count() {
  if [ "$EMU" = 1 ]; then
    "$PY" -c "from moonep_ep import envs; from moonep_ep.testing.cuda_emulator import NodeSpec; print(NodeSpec.parse(envs.MOONEP_EP_CUDA_EMULATOR_NODE).gpus_per_host)"
  else
    nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
  fi
}

# The command of each step (stdout: its JSON).
run_step() {
  local name=$1 limit=$2
  case "$name" in
    env) timeout "$limit" "$PY" - "$EMU" <<'PYEOF'
import importlib, json, sys
out = {"emulated": sys.argv[1] == "1", "python": sys.version.split()[0]}
for mod in ("torch", "cuda.bindings", "numpy", "pytest"):
    try:
        m = importlib.import_module(mod)
        out[mod] = getattr(m, "__version__", "present")
    except Exception as exc:
        out[mod] = f"missing: {exc}"
import torch
out["torch_cuda"] = torch.version.cuda
out["torch_sees_gpu"] = torch.cuda.is_available()
out["gpu"] = torch.cuda.get_device_name(0) if out["torch_sees_gpu"] else None
out["ok"] = all(not str(out[m]).startswith("missing") for m in ("torch", "cuda.bindings", "numpy", "pytest")) \
    and (out["emulated"] or out["torch_sees_gpu"])
print(json.dumps(out))
PYEOF
      ;;
    check) timeout "$limit" $CLI check --json ;;
    selftest) CUDA_VISIBLE_DEVICES=0 timeout "$limit" $CLI selftest --driver cuda --ranks 2 --chunk-mib 64 --json ;;
    selftest_soak) CUDA_VISIBLE_DEVICES=0 timeout "$limit" $CLI selftest --driver cuda --ranks 2 --chunk-mib 16 \
                     --cycles 6 --json ;;
    gpu_tests) timeout "$limit" "$PY" scripts/gpu_checks/pytest_gpu.py "$OUT" "$GPUS" ;;
    footprint) timeout "$limit" $CLI footprint --measure --ranks "$RANKS" --model tiny --layers 8 --driver cuda --json ;;
    perf) timeout "$limit" "$PY" -m moonep_ep.tools.bench.gpu_perf --driver cuda --json ;;
    ops_demo) timeout "$limit" $CLI demo --ranks "$RANKS" --skew 8 --driver cuda --json ;;
    make_demo) timeout "$limit" "$VLLM_PY" -m moonep_ep vllm-demo --reload --json ;;
    kv_accounting) TIMEOUT_S=$((limit - 10)) timeout "$limit" bash scripts/gpu_checks/kv_accounting.sh ;;
    serve) TIMEOUT_S=$((limit - 10)) timeout "$limit" bash scripts/gpu_checks/serve.sh ;;
    mxfp4_experts) timeout "$limit" "$PY" -m moonep_ep.tools.bench.gpu_mxfp4 --check experts --json ;;
    mxfp4_kernel) timeout "$limit" "$PY" -m moonep_ep.tools.bench.gpu_mxfp4 --check kernel --json ;;
    mxfp4_race) timeout "$limit" "$PY" -m moonep_ep.tools.bench.gpu_mxfp4 --check race --json ;;
    k3_moe_layer) timeout "$limit" "$PY" -m moonep_ep.tools.bench.gpu_k3 --json ;;
    *) echo "unknown step $name" >&2; return 2 ;;
  esac
}

# Why a step ($2) cannot run here ("" = it can).
not_applicable() {
  case "$1" in
    gpu)
      if [ "$EMU" = 1 ] && [ "$2" = gpu_tests ]; then
        echo "needs a real GPU (the emulated twins of these tests run in CI: pytest -m cuda_emulated)"
      elif [ "$EMU" = 1 ]; then
        echo "needs a real GPU and Triton's GPU backend (the emulated CUDA driver runs no kernels)"
      fi ;;
    engine)
      if [ "$EMU" = 1 ]; then echo "needs vLLM's CUDA engine on real GPUs"
      elif [ "${GPUS:-0}" -lt 2 ]; then echo "needs >= 2 GPUs (DP=2), found ${GPUS:-0}"
      elif ! "$VLLM_PY" -c "import vllm" >/dev/null 2>&1; then echo "needs vllm==0.33.0 in .venv-vllm (not installed here)"
      elif ! make -q .venv/.moonep-ep-installed .venv-vllm/.moonep-ep-ready >/dev/null 2>&1; then
        echo "the environments are not up to date (make venv-vllm first: this script installs nothing)"
      fi ;;
  esac
  return 0
}

run_part() {
  local part=$1 steps_file="$OUT/part$1.jsonl"
  : >"$steps_file"
  while IFS='|' read -r p name limit needs mods check what; do
    [ "$p" = "$part" ] || continue
    local why
    why=$(not_applicable "$needs" "$name")
    if [ -z "$why" ] && [ "$needs" != engine ]; then  # engine steps run in .venv-vllm, checked above
      local missing
      missing=$(missing_modules "$mods")
      [ -n "$missing" ] && why="$PY cannot import ${missing//,/, } (the step needs ${mods//,/, })"
    fi
    if [ -n "$why" ]; then
      "$PY" -c 'import json,sys; print(json.dumps({"step": sys.argv[1], "status": "not_applicable", "detail": sys.argv[2]}))' \
        "$name" "$why" | tee -a "$steps_file"
      continue
    fi
    local t0=$SECONDS
    run_step "$name" "$limit" >"$OUT/$name.out" 2>"$OUT/$name.err"
    local rc=$?
    "$PY" - "$name" "$rc" "$check" "$OUT/$name.out" $((SECONDS - t0)) "$EMU" >>"$steps_file" <<'PYEOF'
import json, sys
name, rc, check, path, seconds, emu = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6] == "1"
status, detail, out = "passed", "", None
if rc in (124, 137):
    status, detail = "failed", "timed out"
else:
    try:
        text = open(path).read()
        try:
            out = json.loads(text)
        except ValueError:
            out = json.loads([l for l in text.splitlines() if l.strip().startswith("{")][-1])
    except Exception as exc:
        out = None
        if check != "rc":
            status, detail = "failed", f"rc={rc}, no JSON result ({type(exc).__name__}: {exc})"
    if status == "passed" and rc == 0 and isinstance(out, dict) and out.get("not_applicable"):
        status, detail = "not_applicable", str(out["not_applicable"])
    elif status == "passed":
        if check == "rc":
            status = "passed" if rc == 0 else "failed"
        else:
            try:
                ok = bool(eval(check, {}, {"out": out, "EMU": emu}))
            except Exception as exc:
                ok, detail = False, f"check raised {type(exc).__name__}: {exc}"
            status = "passed" if ok and rc == 0 else "failed"
            detail = detail or ("" if ok else f"check failed: {check} (rc={rc})")
# The figures worth keeping in the part's line (the whole output stays in $OUT).
keep = {
    "selftest": ("handle_type", "leaked_fds", "leaked_mappings", "leaked_device_bytes", "leak_measure",
                 "leaked_driver_objects", "map_ms_per_rank"),
    "selftest_soak": ("leaked_device_bytes", "leak_measure", "rss_growth_bytes", "seconds_per_rank"),
    "footprint": ("measure", "measured_bytes_per_rank", "predicted_bytes_per_rank", "device_wide_measure",
                  "device_wide_drift_bytes_per_rank", "granularity"),
    "perf": ("device", "measure", "slot_fill_imported_over_local", "slot_fill_gbps", "ffn_views_over_plain"),
    "check": ("cuda",), "env": ("python", "torch", "torch_cuda", "cuda.bindings", "gpu", "torch_sees_gpu"),
    "gpu_tests": ("tests", "skipped", "failures"),
    "ops_demo": ("max_token_rel_err", "ok"),
    "mxfp4_experts": ("device", "triton", "models"),
    "mxfp4_kernel": ("device", "triton", "models", "kernels"),
    "mxfp4_race": ("device", "models"),
    "k3_moe_layer": ("device", "max_token_rel_err", "bound", "controls", "gate_past_beta", "up_past_linear_beta"),
}.get(name, ())
figures = {k: out[k] for k in keep if isinstance(out, dict) and k in out}
if name == "check" and "cuda" in figures:
    figures["cuda"] = {k: figures["cuda"].get(k) for k in ("device", "device_id", "emulated", "versions", "fabric",
                                                           "multicast", "granularity", "clique", "host")}
print(json.dumps({"step": name, "status": status, "rc": rc, "seconds": seconds, "detail": detail,
                  "figures": figures}))
PYEOF
    tail -1 "$steps_file"
  done <<<"$PLAN"
  "$PY" - "$steps_file" "$part" "$GPUS" "$EMU" <<'PYEOF'
import json, sys
steps = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
ran = [s for s in steps if s["status"] != "not_applicable"]
summary = {
    "part": int(sys.argv[2]),
    "ok": (all(s["status"] == "passed" for s in ran) if ran else None),
    "emulated": sys.argv[4] == "1",
    "gpus": int(sys.argv[3]),
    "steps": {s["step"]: s["status"] for s in steps},
    "failed": [s for s in ran if s["status"] != "passed"],
    "not_applicable": {s["step"]: s["detail"] for s in steps if s["status"] == "not_applicable"},
    "figures": {s["step"]: s["figures"] for s in ran if s.get("figures")},
    "seconds": sum(s.get("seconds", 0) for s in ran),
}
print(json.dumps(summary))
sys.exit(0 if summary["ok"] is not False else 1)
PYEOF
}

case "${1:-}" in
  --plan) plan; exit 0 ;;
  --part)
    part="${2:-}"
    if ! printf '%s\n' "$PLAN" | cut -d'|' -f1 | grep -qx "$part"; then
      echo "gpu_check.sh: --part takes one of: $(printf '%s\n' "$PLAN" | cut -d'|' -f1 | sort -un | tr '\n' ' ')" >&2
      exit 2
    fi
    mkdir -p "$OUT"
    [ "$EMU" = 1 ] || unset MOONEP_EP_CUDA_EMULATOR_NODE   # real hardware: no emulated node
    GPUS=$(gpu_count)
    GPUS=${GPUS:-0}
    RANKS=$(( GPUS >= 4 ? 4 : (GPUS >= 2 ? 2 : 1) ))
    [ "$EMU" = 1 ] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/nvidia-smi.csv" 2>&1
    run_part "$part"
    ;;
  *) echo "usage: bash scripts/gpu_check.sh --plan | --part N" >&2; exit 2 ;;
esac
