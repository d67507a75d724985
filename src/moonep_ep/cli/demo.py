"""``moonep-ep demo``: a sharded tiny MoE through the reference MoonEP path on N local ranks.

Dispatch → pull prefetch from the owners' pages → grouped expert FFN →
combine, per layer, compared with a dense reference MoE; the per-rank report
covers rows received, experts prefetched and from whom, the error, physical
expert bytes vs the replicated layout, and prefetch bandwidth remote vs
local. The work lives in :mod:`moonep_ep.tools.commands.demo`; this module parses
options and prints.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..tools.args import HOST_GRANULARITY_HELP, add_run_arguments


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("demo", help="run a sharded tiny MoE through dispatch/prefetch/FFN/combine "
                                           "on N local ranks and check it against a dense reference")
    p.add_argument("--ranks", type=int, default=4, help="local ranks (default 4)")
    p.add_argument("--skew", type=float, default=8.0,
                   help="router skew: logits += skew * shared per-expert bias (default 8; 0 = uniform)")
    p.add_argument("--model", default="tiny",
                   help="built-in model name or HuggingFace config.json (default tiny: H=512 I=256 E=16 K=4, "
                        "4 layers)")
    p.add_argument("--tokens", type=int, default=128, help="tokens per rank (default 128)")
    p.add_argument("--layers", type=int, default=None, help="MoE layers to run (default: the model's)")
    p.add_argument("--slots", type=int, default=None, help="prefetch slots per rank B (default E/ranks)")
    p.add_argument("--seed", type=int, default=0, help="weights, tokens and router seed (default 0)")
    add_run_arguments(p, driver_help="memory driver: auto = cuda (NCCL) with one GPU per rank, else host (gloo)",
                      granularity_help=HOST_GRANULARITY_HELP, json_help="print one JSON object on stdout")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..errors import ConfigError
    from ..tools.commands.demo import format_report, resolve_config, run_demo
    from ..launch import RankFailure, admit_ranks, plan_one_gpu_per_rank

    if not admit_ranks(args.ranks, "moonep-ep demo"):
        return 2
    if args.tokens < 1:
        print(f"moonep-ep demo: --tokens must be >= 1, got {args.tokens}. Fix: pass a positive token count",
              file=sys.stderr)
        return 2
    if args.layers is not None and args.layers < 1:
        print(f"moonep-ep demo: --layers must be >= 1, got {args.layers}. Fix: pass a positive layer count",
              file=sys.stderr)
        return 2
    plan = plan_one_gpu_per_rank(args.driver, args.ranks, "moonep-ep demo")
    if plan is None:
        return 2
    try:
        cfg = resolve_config(ranks=args.ranks, skew=args.skew, model=args.model, tokens=args.tokens,
                             slots=args.slots, driver=plan.driver, granularity=args.granularity,
                             layers=args.layers, seed=args.seed)
    except ConfigError as exc:
        print(f"moonep-ep demo: {exc}", file=sys.stderr)
        return 2

    def progress(msg: str) -> None:  # stderr, so --json stdout stays one clean object
        print(f"[demo] {msg}", file=sys.stderr, flush=True)

    progress(f"starting {cfg.ranks} ranks ({cfg.driver} driver), model {cfg.model}, {cfg.tokens} tokens/rank, "
             f"skew {cfg.skew}")
    try:
        summary = run_demo(cfg, progress)
    except RankFailure as exc:
        if args.json:
            print(json.dumps({"ok": False, "errors": exc.errors}, indent=2))
        else:
            print(str(exc), file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(format_report(summary))
    return 0 if summary["ok"] else 1
