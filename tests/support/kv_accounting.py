"""GPU check: vLLM's memory profiling counts the sharded store as model memory, so the KV cache does not over-commit.

Run on >= 2 GPUs in the ``vllm==0.33.0`` environment::

    python -m tests.support.kv_accounting --json

Starts the DP=2 expert-parallel engine with ``all2all_backend="moonep"`` on a
synthesized Qwen3-MoE large enough that the store is visible next to the rest
(default: hidden 2048, moe_intermediate 1024, 64 experts, 4 layers: about
1.7 GB of store per rank), then reads from each worker (``MoonEPProbe``):
the store's physical bytes (driver handles), vLLM's ``model_memory_usage``
(its reported model memory), ``total_consumed`` (``cuMemGetInfo`` from start
to after profiling), ``requested_memory`` and the KV-cache bytes it chose.

Why it should pass: the store is allocated at the end of model construction,
inside ``load_model``, so (1) the plugin's ``GPUModelRunner.load_model``
wrapper adds its bytes to ``model_memory_usage``; (2) it is device memory in
use when ``determine_available_memory`` measures ``cuMemGetInfo`` after the
profile run, so it is inside ``total_consumed`` and the KV cache is sized
from what is left: ``available_kv <= requested - store``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from moonep_ep.tools.args import add_moe_shape_arguments


def check(workers: list[dict[str, Any]]) -> dict[str, Any]:
    """The claims, per worker: reported model memory >= store; total consumed >= store; KV <= requested - store."""
    rows = []
    for w in workers:
        store = w["store_bytes"] or 0
        rows.append({
            **w,
            "model_memory_includes_store": w["model_memory_usage"] >= store > 0,
            "profiling_counts_store": (w["total_consumed"] or 0) >= store,
            "kv_cache_leaves_store":
                (w["available_kv_cache_memory_bytes"] or 0) <= (w["requested_memory"] or 0) - store,
        })
    ok = bool(rows) and all(r["model_memory_includes_store"] and r["profiling_counts_store"]
                            and r["kv_cache_leaves_store"] for r in rows)
    return {"ok": ok, "workers": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.support.kv_accounting")
    add_moe_shape_arguments(p, hidden=2048, intermediate=1024, experts=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    p.add_argument("--timeout", type=float, default=500.0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print(json.dumps({"ok": False, "error": "needs >= 2 CUDA GPUs"}))
        return 2
    from moonep_ep.tools.engine.harness import EngineConfig, run_dp
    from moonep_ep.tools.checkpoints.tiny_model import TinyMoEConfig, build_tiny_qwen3_moe, default_model_dir, demo_prompts

    tiny = TinyMoEConfig(hidden=args.hidden, intermediate=args.intermediate, experts=args.experts,
                         layers=args.layers)
    cfg = EngineConfig(model_dir=build_tiny_qwen3_moe(default_model_dir(tiny), tiny), prompts=demo_prompts(2),
                       device="cuda", timeout_s=args.timeout,
                       dp_llm_kwargs={"gpu_memory_utilization": args.gpu_memory_utilization},
                       probe_calls=["moonep_ep_memory"])
    t0 = time.perf_counter()
    try:
        dp, _ = run_dp(cfg, lambda m: print(f"[kv] {m}", file=sys.stderr, flush=True))
    except RuntimeError as exc:
        print(json.dumps({"ok": False, "error": str(exc)}))
        return 1
    workers = [w for r in sorted(dp) for w in dp[r]["probes"]["moonep_ep_memory"]]
    out = dict(check(workers), seconds=round(time.perf_counter() - t0, 1))
    print(json.dumps(out, indent=None if args.json else 1))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
