#!/usr/bin/env bash
# The checks a GPU machine must run: the CUDA path on real hardware, the part the CPU emulator cannot run
# (docs/design/memory.md, "The seam"), in parts that each fit one command (<= 480 s of step limits).
#
#   bash scripts/gpu_check.sh --plan      every part's steps and time limits, and the one command (runs nothing)
#   bash scripts/gpu_check.sh --part N    run part N; its last stdout line is one JSON object
#   bash scripts/gpu_check.sh --one-gpu   the one command for a machine with one GPU: parts 6-8 and the
#                                         one-GPU steps of parts 1-2 that matter most, within one total limit
#                                         (ONE_GPU below); its last stdout line is one JSON object
#
# Runs as a machine with one GPU is: `python3` (override: PYTHON=...) with PYTHONPATH=src -- no venv, no
# install, nothing fetched. Part 1 alone answers the first question: does the CUDA path allocate,
# export, import, map, verify and tear down with 0 leaks on the real driver? Part 6 (one GPU, torch and
# Triton) runs the project's MXFP4 experts at Kimi K2/K3 shapes and the slot-fill race; part 7 (the same) one
# Kimi K3 MoE layer with SiTU through them against a dense reference; part 8 (the same) the MoE step's slot
# fill, wait and experts captured in a CUDA graph and replayed against eager. Parts 3-5 need >= 2 GPUs
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
KILL_AFTER_S=5   # a step that outlives its limit gets SIGTERM, and SIGKILL this long after (rc 137)
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
8|moe_step_graphs|240|gpu|torch,triton|out["ok"]|the MoE step's slot fill (a side stream), wait and experts captured in a CUDA graph at K3's expert widths, BF16 and MXFP4, SiLU and SiTU, 1/8/64 tokens: every replay equals eager, the captured/eager time; the step without the wait and a slot table baked on the host must be caught
EOF
)
# The one command for a machine with one GPU (`--one-gpu`): step|limit_s|needs|modules|check|what, where "="
# for the last four takes them from the step's PLAN row. The limits are tighter than the parts' so that their
# sum -- the command's total limit, stated by --plan -- fits one command (ONE_GPU_MAX_S) and, with the machine's
# start-up, a session's device time. Each step runs under `timeout` with min(its limit, what is left of the
# total): the whole command stops within the total. Parts 6-8 first, then what parts 1-2 ask of one GPU.
# needs besides PLAN's: vllm (python3 must import vllm), unbuilt (the check does not exist yet: never runs).
ONE_GPU=$(cat <<'EOF'
env|30|-|torch,numpy,pytest|out["ok"]|python3, torch, numpy, pytest importable (cuda-bindings and Triton reported: the steps that need them check for themselves); the GPU seen by torch
mxfp4_experts|100|=
mxfp4_kernel|80|=
mxfp4_race|45|=
k3_moe_layer|80|=
moe_step_graphs|70|=
check|30|=
selftest|50|=
push_layout|50|gpu|torch,cuda.bindings,numpy,pytest,hypothesis|out["ok"]|the push layout on GPU 0, 2 ranks over CUDA VMM (POSIX fds, gloo): the store's [2*epn] compute views and [R, epn] slot pools, a row pushed into the next rank's pool read back, handles == the plan, 0 leaks; Kimi K3 MXFP4 real rows at the GPU page size, every byte pushed and read back (pytest -m cuda tests/layout/test_layout_cuda.py tests/layout/test_push_layout.py)
quantized_vmm|65|gpu|torch,cuda.bindings,numpy,pytest,hypothesis|out["ok"]|INT4 g32, MXFP4 and FP8 block experts over CUDA VMM on GPU 0, 2 ranks: weights and scales in the store, a slot fill, the project's dequantizing expert FFN against a reference from the codes; a stale scale must miss (pytest -m cuda tests/ops/test_quantized_experts_cuda.py)
vllm_int4_fp8|0|vllm|vllm|rc|vLLM's own INT4 (Marlin) and FP8 block (DeepGEMM, Triton) MoE kernels on the store's views
EOF
)
ONE_GPU_COMMAND="bash scripts/gpu_check.sh --one-gpu"
ONE_GPU_MAX_S=600   # a command on the machine runs at most 10 minutes

# ONE_GPU as PLAN rows (part "one"), the "=" fields filled from PLAN.
one_gpu_rows() {
  local name limit rest row
  while IFS='|' read -r name limit rest; do
    [ -n "$name" ] || continue
    if [ "$rest" = "=" ]; then
      row=$(printf '%s\n' "$PLAN" | awk -F'|' -v n="$name" '$2 == n {print; exit}')
      [ -n "$row" ] || { echo "gpu_check.sh: ONE_GPU names $name, which PLAN lacks" >&2; return 2; }
      rest=$(printf '%s' "$row" | cut -d'|' -f4-)
    fi
    printf 'one|%s|%s|%s\n' "$name" "$limit" "$rest"
  done <<<"$ONE_GPU"
}

# What the GPU machine's python3 (3.12) has, and what it lacks, as stated for that machine.
GPU_MACHINE_HAS="torch triton numpy hypothesis pytest transformers safetensors"
GPU_MACHINE_LACKS="vllm compressed_tensors"
PART_LIMIT=480

plan() {
  local one
  one=$(one_gpu_rows) || return 2
  "$PY" - "$PLAN" "$PART_LIMIT" "$GPU_MACHINE_HAS" "$GPU_MACHINE_LACKS" "$one" "$ONE_GPU_COMMAND" "$ONE_GPU_MAX_S" <<'PYEOF'
import json, sys
rows = [l.split("|") for l in sys.argv[1].splitlines() if l.strip()]
limit = int(sys.argv[2])
has, lacks = set(sys.argv[3].split()), set(sys.argv[4].split())
one_rows = [l.split("|") for l in sys.argv[5].splitlines() if l.strip()]
one_command, one_max = sys.argv[6], int(sys.argv[7])


def on_gpu_machine(needs, mods):
    """Whether the step can run on the GPU machine (python3 3.12, one GPU), from its stated list."""
    if needs == "unbuilt":
        return "cannot run: not built yet"
    missing = [m for m in mods if m in lacks]
    if missing:
        return f"cannot run: it has no {', '.join(missing)}"
    if needs == "engine":
        return "cannot run: needs >= 2 GPUs and .venv-vllm"
    unknown = [m for m in mods if m not in has]
    if unknown:
        return f"runs if python3 has {', '.join(unknown)} (not on its list; checked before the step)"
    return "runs"


print(f"the GPU machine (stated): python3 3.12 with {', '.join(sorted(has))}; without {', '.join(sorted(lacks))}")
for part in sorted({int(r[0]) for r in rows}):
    steps = [r for r in rows if int(r[0]) == part]
    total = sum(int(r[2]) for r in steps)
    print(f"part {part}: {total} s of limits (at most {limit})")
    for _, name, secs, needs, mods, _check, what in steps:
        print(f"  {name:<14} {secs:>4} s  {'[' + needs + '] ' if needs != '-' else ''}{what}")
        print(f"  {'':<14}         needs {mods.replace(',', ', ')}; GPU machine: {on_gpu_machine(needs, mods.split(','))}")
    print(json.dumps({"part": part, "limit_s": total, "max_limit_s": limit,
                      "steps": [{"step": r[1], "limit_s": int(r[2]), "needs": r[3], "modules": r[4].split(","),
                                 "gpu_machine": on_gpu_machine(r[3], r[4].split(","))} for r in steps]}))
# The one command: its total limit is the sum of its steps' limits (each step also stops at what is left of it).
total = sum(int(r[2]) for r in one_rows)
print(f"one command for a machine with one GPU: {one_command}")
print(f"  total limit {total} s = the sum of its steps' limits (at most {one_max}: one command); "
      "each step stops at min(its limit, what is left of the total); last stdout line: one JSON object")
for _, name, secs, needs, mods, _check, what in one_rows:
    print(f"  {name:<14} {secs:>4} s  {'[' + needs + '] ' if needs != '-' else ''}{what}")
print(json.dumps({"command": one_command, "limit_s": total, "max_limit_s": one_max,
                  "steps": [{"step": r[1], "limit_s": int(r[2]), "needs": r[3], "modules": r[4].split(","),
                             "gpu_machine": on_gpu_machine(r[3], r[4].split(","))} for r in one_rows]}))
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
    env) timeout -k "$KILL_AFTER_S" "$limit" "$PY" - "$EMU" "$ENV_NEEDS" <<'PYEOF'
import importlib, json, sys
out = {"emulated": sys.argv[1] == "1", "python": sys.version.split()[0]}
needed = sys.argv[2].split(",")
for mod in ("torch", "cuda.bindings", "numpy", "pytest", "triton"):
    try:
        m = importlib.import_module(mod)
        out[mod] = getattr(m, "__version__", "present")
    except Exception as exc:
        out[mod] = f"missing: {exc}"
import torch
out["torch_cuda"] = torch.version.cuda
out["torch_sees_gpu"] = torch.cuda.is_available()
out["gpu"] = torch.cuda.get_device_name(0) if out["torch_sees_gpu"] else None
out["ok"] = all(not str(out[m]).startswith("missing") for m in needed) and (out["emulated"] or out["torch_sees_gpu"])
print(json.dumps(out))
PYEOF
      ;;
    check) timeout -k "$KILL_AFTER_S" "$limit" $CLI check --json ;;
    selftest) CUDA_VISIBLE_DEVICES=0 timeout -k "$KILL_AFTER_S" "$limit" $CLI selftest --driver cuda --ranks 2 --chunk-mib 64 --json ;;
    selftest_soak) CUDA_VISIBLE_DEVICES=0 timeout -k "$KILL_AFTER_S" "$limit" $CLI selftest --driver cuda --ranks 2 --chunk-mib 16 \
                     --cycles 6 --json ;;
    gpu_tests) timeout -k "$KILL_AFTER_S" "$limit" "$PY" scripts/gpu_checks/pytest_gpu.py "$OUT" "$GPUS" ;;
    footprint) timeout -k "$KILL_AFTER_S" "$limit" $CLI footprint --measure --ranks "$RANKS" --model tiny --layers 8 --driver cuda --json ;;
    perf) timeout -k "$KILL_AFTER_S" "$limit" $CLI bench store --driver cuda --json \
            --deadline-s $(( limit > 30 ? limit - 15 : limit )) ;;  # its own bound (also its ranks' waits), inside the step's
    ops_demo) timeout -k "$KILL_AFTER_S" "$limit" $CLI demo --ranks "$RANKS" --skew 8 --driver cuda --json ;;
    make_demo) timeout -k "$KILL_AFTER_S" "$limit" "$VLLM_PY" -m moonep_ep vllm-demo --reload --json ;;
    kv_accounting) TIMEOUT_S=$((limit - 10)) timeout -k "$KILL_AFTER_S" "$limit" bash scripts/gpu_checks/kv_accounting.sh ;;
    serve) TIMEOUT_S=$((limit - 10)) timeout -k "$KILL_AFTER_S" "$limit" bash scripts/gpu_checks/serve.sh ;;
    mxfp4_experts) timeout -k "$KILL_AFTER_S" "$limit" "$PY" -m checks.gpu.mxfp4 --check experts --json ;;
    mxfp4_kernel) timeout -k "$KILL_AFTER_S" "$limit" "$PY" -m checks.gpu.mxfp4 --check kernel --json ;;
    mxfp4_race) timeout -k "$KILL_AFTER_S" "$limit" "$PY" -m checks.gpu.mxfp4 --check race --json ;;
    k3_moe_layer) timeout -k "$KILL_AFTER_S" "$limit" "$PY" -m checks.gpu.k3 --json ;;
    moe_step_graphs) timeout -k "$KILL_AFTER_S" "$limit" "$PY" -m checks.gpu.graphs --json ;;
    push_layout) timeout -k "$KILL_AFTER_S" "$limit" "$PY" scripts/gpu_checks/pytest_gpu.py "$OUT" "$GPUS" push_layout \
                   tests/layout/test_layout_cuda.py tests/layout/test_push_layout.py ;;
    quantized_vmm) timeout -k "$KILL_AFTER_S" "$limit" "$PY" scripts/gpu_checks/pytest_gpu.py "$OUT" "$GPUS" quantized_vmm \
                     tests/ops/test_quantized_experts_cuda.py ;;
    *) echo "unknown step $name" >&2; return 2 ;;
  esac
}

# Why a step ($2) cannot run here ("" = it can).
not_applicable() {
  case "$1" in
    gpu)
      if [ "$EMU" = 1 ] && { [ "$2" = gpu_tests ] || [ "$2" = push_layout ] || [ "$2" = quantized_vmm ]; }; then
        echo "needs a real GPU (the emulated twins of these tests run in CI: pytest -m cuda_emulated)"
      elif [ "$EMU" = 1 ]; then
        echo "needs a real GPU and Triton's GPU backend (the emulated CUDA driver runs no kernels)"
      fi ;;
    unbuilt) echo "not built yet: $3" ;;
    vllm)
      if [ -n "$(missing_modules vllm)" ]; then
        echo "needs vLLM (these kernels are vLLM's), which $PY cannot import; the project's own INT4 and FP8 path over CUDA VMM runs in quantized_vmm"
      else
        echo "no one-GPU step runs them yet: vLLM's engine runs them in parts 3-5 (>= 2 GPUs)"
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

# Run the rows of $2 (PLAN's format) whose part is $1, appending each step's JSON line to $3. With $4 (a
# deadline in $SECONDS), each step gets min(its limit, what is left before it less KILL_AFTER_S); a step with
# nothing left is not started and fails.
run_steps() {
  local part=$1 rows=$2 steps_file=$3 deadline=${4:-}
  while IFS='|' read -r p name limit needs mods check what; do
    [ "$p" = "$part" ] || continue
    local why
    why=$(not_applicable "$needs" "$name" "$what")
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
    local given=$limit left
    if [ -n "$deadline" ]; then  # a step ends within given + KILL_AFTER_S: so does the last one, by the deadline
      left=$((deadline - SECONDS - KILL_AFTER_S))
      [ "$left" -lt "$given" ] && given=$left
    fi
    if [ "$given" -le 0 ]; then
      "$PY" -c 'import json,sys; print(json.dumps({"step": sys.argv[1], "status": "failed", "rc": None, "seconds": 0,
                 "limit_s": 0, "detail": "not started: the total limit was spent", "figures": {}}))' \
        "$name" | tee -a "$steps_file"
      continue
    fi
    local t0=$SECONDS
    run_step "$name" "$given" >"$OUT/$name.out" 2>"$OUT/$name.err"
    local rc=$?
    "$PY" - "$name" "$rc" "$check" "$OUT/$name.out" $((SECONDS - t0)) "$EMU" "$given" >>"$steps_file" <<'PYEOF'
import json, sys
name, rc, check, path, seconds, emu = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6] == "1"
given = int(sys.argv[7])
status, detail, out = "passed", "", None
if rc in (124, 137):
    status, detail = "failed", f"timed out (limit {given} s)"
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
    "perf": ("device", "measure", "slot_fill_imported_over_local", "slot_fill_gbps", "ffn_views_over_plain",
             "measure_seconds"),
    "check": ("cuda",), "env": ("python", "torch", "torch_cuda", "cuda.bindings", "triton", "gpu", "torch_sees_gpu"),
    "gpu_tests": ("tests", "skipped", "failures"),
    "push_layout": ("tests", "skipped", "failures", "outcomes"),
    "quantized_vmm": ("tests", "skipped", "failures", "outcomes"),
    "ops_demo": ("max_token_rel_err", "ok"),
    "mxfp4_experts": ("device", "triton", "models"),
    "mxfp4_kernel": ("device", "triton", "models", "kernels"),
    "mxfp4_race": ("device", "models"),
    "k3_moe_layer": ("device", "max_token_rel_err", "bound", "controls", "gate_past_beta", "up_past_linear_beta"),
    "moe_step_graphs": ("device", "formats"),
}.get(name, ())
figures = {k: out[k] for k in keep if isinstance(out, dict) and k in out}
if name == "check" and "cuda" in figures:
    figures["cuda"] = {k: figures["cuda"].get(k) for k in ("device", "device_id", "emulated", "versions", "fabric",
                                                           "multicast", "granularity", "clique", "host")}
print(json.dumps({"step": name, "status": status, "rc": rc, "seconds": seconds, "limit_s": given, "detail": detail,
                  "figures": figures}))
PYEOF
    tail -1 "$steps_file"
  done <<<"$rows"
}

run_part() {
  local part=$1 steps_file="$OUT/part$1.jsonl"
  : >"$steps_file"
  ENV_NEEDS=torch,cuda.bindings,numpy,pytest run_steps "$part" "$PLAN" "$steps_file"
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

# The one command: every ONE_GPU step, the whole within the sum of their limits; then one JSON line.
run_one_gpu() {
  local steps_file="$OUT/one-gpu.jsonl" rows total start=$SECONDS
  rows=$(one_gpu_rows) || return 2
  total=$(printf '%s\n' "$rows" | awk -F'|' '{s += $3} END {print s}')
  : >"$steps_file"
  ENV_NEEDS=torch,numpy,pytest run_steps one "$rows" "$steps_file" $((start + total))
  "$PY" - "$steps_file" "$GPUS" "$EMU" "$ONE_GPU_COMMAND" "$total" $((SECONDS - start)) <<'PYEOF'
import json, sys
steps = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
ran = [s for s in steps if s["status"] != "not_applicable"]
summary = {
    "command": sys.argv[4],
    "ok": (all(s["status"] == "passed" for s in ran) if ran else None),
    "emulated": sys.argv[3] == "1",
    "gpus": int(sys.argv[2]),
    "limit_s": int(sys.argv[5]),
    "wall_seconds": int(sys.argv[6]),
    "steps": {s["step"]: s["status"] for s in steps},
    # every step's result: status, exit status, seconds, the limit it ran under, why (figures below)
    "results": {s["step"]: {k: v for k, v in s.items() if k not in ("step", "figures")} for s in steps},
    "failed": [s["step"] for s in ran if s["status"] != "passed"],
    "not_applicable": {s["step"]: s["detail"] for s in steps if s["status"] == "not_applicable"},
    "figures": {s["step"]: s["figures"] for s in ran if s.get("figures")},
}
print(json.dumps(summary))
sys.exit(0 if summary["ok"] is not False else 1)
PYEOF
}

# The machine: GPUs seen, ranks for the multi-rank steps, nvidia-smi's answer kept.
machine() {
  mkdir -p "$OUT"
  [ "$EMU" = 1 ] || unset MOONEP_EP_CUDA_EMULATOR_NODE   # real hardware: no emulated node
  GPUS=$(gpu_count)
  GPUS=${GPUS:-0}
  RANKS=$(( GPUS >= 4 ? 4 : (GPUS >= 2 ? 2 : 1) ))
  [ "$EMU" = 1 ] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/nvidia-smi.csv" 2>&1
}

case "${1:-}" in
  --plan) plan; exit $? ;;
  --part)
    part="${2:-}"
    if ! printf '%s\n' "$PLAN" | cut -d'|' -f1 | grep -qx "$part"; then
      echo "gpu_check.sh: --part takes one of: $(printf '%s\n' "$PLAN" | cut -d'|' -f1 | sort -un | tr '\n' ' ')" >&2
      exit 2
    fi
    machine
    run_part "$part"
    ;;
  --one-gpu)
    machine
    run_one_gpu
    ;;
  *) echo "usage: bash scripts/gpu_check.sh --plan | --part N | --one-gpu" >&2; exit 2 ;;
esac
