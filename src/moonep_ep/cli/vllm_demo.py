"""``moonep-ep vllm-demo``: vLLM's engine, DP=2 expert parallel, ``--all2all-backend moonep``, vs an HF oracle.

Runs one checkpoint — the tiny DeepSeek-V3 (default), the tiny Qwen3-MoE, or
any HF MoE checkpoint directory — in a single process, DP=2 with moonep_ep's
sharded store, and DP=2 with vLLM's replicated layout, and judges each run's
greedy sequences with HF transformers' forward of the same checkpoint
(``tools/engine/demo.py``). ``--json`` prints one JSON object on stdout (the
human report then goes to stderr).

Needs vLLM in the running interpreter; from an environment without it the
command re-runs itself in the project's vLLM environment (``vllm_env.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ..errors import ConfigError
from .vllm_env import add_engine_arguments


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("vllm-demo", help="vLLM engine: single process, DP=2 moonep sharded and replicated, "
                                                "each judged by HF transformers (tiny DeepSeek-V3 by default)")
    add_engine_arguments(p)
    p.add_argument("--runs", default="single,dp_sharded,dp_replicated",
                   help="comma list of single, dp_sharded, dp_replicated (default: all three)")
    p.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per prompt (default 16)")
    p.add_argument("--model-dir", default=None,
                   help="where to write a tiny model (default: a cache directory under the temp dir)")
    p.add_argument("--timeout", type=float, default=420.0, help="seconds per engine run (default 420)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--reload", action="store_true",
                   help="after the first generation, update the dp_sharded engines in place to checkpoint B (same "
                        "shapes, other values; judged by the oracle on B, every expert row changed), then try a "
                        "checkpoint of another shape, which must be refused while B keeps serving, then update "
                        "back to A: every expert row as the first load wrote it (tiny models only)")
    p.add_argument("--workload", choices=("auto", "skewed", "mixed"), default="auto",
                   help="skewed: one phase per owner in which every DP rank gets a 250-token prompt of words routed "
                        "to that owner's experts (on the tiny DeepSeek-V3 family, its planted skew; on PATH, words "
                        "read off the checkpoint's own routers), then the mixed prompts; mixed: six mixed prompts "
                        "only; auto (default): skewed on the tiny DeepSeek-V3 family and the tiny Kimi K3s, mixed "
                        "otherwise")
    p.add_argument("--cudagraph-mode", default=None, type=str.upper, metavar="MODE",
                   help="vLLM's -cc.cudagraph_mode for the dp_sharded run (NONE, PIECEWISE, FULL, FULL_DECODE_ONLY, "
                        "FULL_AND_PIECEWISE). The CPU engine captures no graph: a mode with full graphs runs each "
                        "decode-sized MoE step under the CUDA graph capture-and-replay emulator, as a full decode "
                        "graph holds it on a GPU; the JSON's moe_graph counts captures, replays and host reads")
    p.add_argument("--moe-graphs", action="store_true", help="the same as --cudagraph-mode FULL_DECODE_ONLY")
    p.add_argument("--oracle-model", default=None, metavar="PATH",
                   help="judge the runs against this bf16 checkpoint instead of the model's own (or its "
                        "decompressed copy): a negative control, e.g. a checkpoint with a planted bug judged "
                        "against the correct one must fail")
    p.add_argument("--reload-control", default=None, metavar="PATH",
                   help="with --reload: after the refused update, update the engines in place to PATH, a "
                        "checkpoint of the model's shapes with a planted bug, and judge its tokens by the model's "
                        "own oracle: they must fail it (a negative control of the engine's verdict), then update "
                        "back to the model")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from .vllm_env import engine_context, progress_printer

    progress = progress_printer("vllm-demo")
    code, dist, device = engine_context("vllm-demo", args, None if args.max_tokens >= 1 else
                                        f"--max-tokens {args.max_tokens}: nothing to generate. Fix: pass --max-tokens 1 or more")
    if code is not None:
        return code

    from ..tools.engine.demo import DemoConfig, run_demo

    if args.moonep_api is not None:  # read by every engine process (envs.py)
        os.environ["MOONEP_EP_MOONEP_API"] = args.moonep_api

    cfg = DemoConfig(model=args.model, dp=args.dp, runs=tuple(r for r in args.runs.split(",") if r),
                     max_tokens=args.max_tokens, device=device, engine=dist,
                     reload=args.reload, model_dir=args.model_dir, timeout_s=args.timeout,
                     oracle_model=args.oracle_model, workload=args.workload, reload_control=args.reload_control,
                     cudagraph_mode=args.cudagraph_mode or ("FULL_DECODE_ONLY" if args.moe_graphs else None))
    try:
        summary = run_demo(cfg, progress)
    except ConfigError as exc:
        print(f"moonep-ep vllm-demo: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        if args.json:
            print(json.dumps({"ok": False, "error": str(exc)}, indent=2))
        print(f"moonep-ep vllm-demo: {exc}", file=sys.stderr)
        return 1
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
    from ..tools.engine.near_ties import describe as describe_near_tie

    m = s["model"]
    lines = [f"{s['engine']} on {s['device']}, model {m['name']} ({m.get('architecture')}: E={m.get('experts')} "
             f"top-{m.get('top_k')}, {m.get('moe_layers')} MoE layers, H={m.get('hidden')}, "
             f"I={m.get('moe_intermediate')}) at {m['path']}",
             f"oracle: {s['oracle_version']}, fp32 (verdict) and bf16, teacher-forced along each run's own tokens; "
             f"rule: {s['oracle_rule']}", ""]
    for name, run in s["runs"].items():
        v32, v16 = run["oracle"]["float32"], run["oracle"].get("bfloat16")
        lines.append(f"{name} ({run['what']}): ok={run['ok']}")
        lines.append(f"  oracle fp32: {v32['positions']} positions, {v32['divergences']} divergences (largest gap "
                     f"{v32['max_gap_at_divergence']} nats), |dlogprob| {v32['abs_logprob_diff']}, max at matching "
                     f"tokens {v32['max_abs_logprob_diff_at_matching_tokens']}, failed {v32['failed']}")
        if v16:
            lines.append(f"  oracle bf16: {v16['divergences']} divergences, |dlogprob| {v16['abs_logprob_diff']}")
        failed = [k for k, ok in run.get("checks", {}).items() if not ok]
        lines.append(f"  checks: {len(run.get('checks', {})) - len(failed)} passed" +
                     (f", FAILED: {failed}" if failed else ""))
        for g in run["generated"][:3]:
            if g:
                lines.append(f"  [dp{g['dp_rank']}] prompt {g['index']} ({g['label']}) -> {g['text'][:60]!r}")
    if "expert_bytes_per_rank" in s:
        fills = s["remote_prefetch_fills"]
        lines += ["", f"remote prefetches (dp_sharded, first generation): {fills['fills']} slot fills, "
                      f"{fills['serving_real_tokens']} serving real tokens, {fills['padding_only']} serving only "
                      f"vLLM's capacity padding; owners with real fills {fills['owners_with_real_fills']}; "
                      f"{fills['bytes_read_from_owners']} bytes read from owners (counted at the copy)"]
        for owner, experts in s["remote_prefetches_by_owner_expert"].items():
            row = ", ".join(f"e{e}: {v['fills']}" + (f" ({v['padding_only']} padding-only)" if v["padding_only"]
                                                     else "") for e, v in experts.items())
            lines.append(f"  from owner {owner}: {row}")
        lines += ["", f"  {'rank':>4}  {'sharded (OS)':>14}  {'replicated [E+B]':>18}  {'load peak':>14}"]
        for r, (mine, rep, peak) in enumerate(zip(s["expert_bytes_per_rank"], s["replicated_expert_bytes_per_rank"],
                                                  s["load_peak_expert_bytes_per_rank"])):
            lines.append(f"  {r:>4}  {_mib(mine):>14}  {_mib(rep):>18}  {_mib(peak):>14}")
        lines.append(f"expert weight bytes in load collectives: {s['expert_weight_bytes_in_load_collectives']}; "
                     f"vLLM all-gather calls: {s['vllm_all_gather_layout_calls']}; handle exchanges: "
                     f"{s['handle_exchange_rounds_per_rank']}")
    if "replicated_load_peak_expert_bytes_per_rank" in s:
        lines.append(f"vLLM's replicated layout: load peak {[_mib(p) for p in s['replicated_load_peak_expert_bytes_per_rank']]}"
                     f" per rank, final {[_mib(p) for p in s['replicated_final_expert_bytes_per_rank']]}")
    if "reload_oracle" in s:
        lines += ["", f"in-place update A -> B: oracle on B {s['reload_oracle']['checkpoint_b']['after_update']['ok']}"
                      f" (checkpoint A rejects those sequences: "
                      f"{s['reload_oracle']['positive_control_checkpoint_a_rejects_b_sequences']}); pointers "
                      f"unchanged {s['reload_pointers_unchanged_by_rank']}; seconds {s['reload_seconds_by_rank']}",
                  f"every expert row changed: {s['reload_changes_expert_bytes_by_rank']}; back to A equals the "
                  f"first load, row by row: {s['reload_back_to_a_matches_first_load_by_rank']}",
                  f"other-shape update refused: {s['wrong_shape_reload_refused']}; B still serves: oracle "
                  f"{s['reload_oracle']['checkpoint_b']['after_refused_update']['ok']}, same tokens "
                  f"{s['generation_after_wrong_shape_repeats_b']}"]
    for note in s.get("notes", []):
        lines.append(f"note: {note}")
    lines += ["", f"timings (s): {s.get('timings_s')}",
              f"max |dlogprob| at matching tokens: {s['max_abs_logprob_diff_at_matching_tokens']}"]
    for name, run in s["runs"].items():
        v = run["oracle"]["float32"]
        for n in v.get("near_ties") or []:  # excused from the gap / abs_max gates, by measurement
            lines.append(f"{name}: routing near-tie at {describe_near_tie(n)}")
    lines += [f"deviating runs: {s['deviating_runs'] or 'none'}", f"ok: {s['ok']}"]
    return "\n".join(lines)
