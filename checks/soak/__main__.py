"""``python -m checks.soak``: vLLM's OpenAI server (``moonep-ep serve``) under ``vllm bench serve`` for a bounded
time, with faults injected, resources sampled and the answers checked (``run.py``). ``make soak`` runs it from the
repository root in the CPU engine's environment (the transformers oracle and vLLM's server live there)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

PROG = "python -m checks.soak"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="the OpenAI server under vLLM's load client for MINUTES, "
                                "faults injected, RSS/fds//dev/shm/memfds sampled, answers checked; JSON + PNG")
    p.add_argument("--minutes", type=float, default=30.0, help="load duration (default 30; SOAK_MIN in make soak)")
    p.add_argument("--model", default="tiny-deepseek-v3",
                   help="a tiny model (default tiny-deepseek-v3; SOAK_MODEL, e.g. tiny-kimi-k2-thinking-int4)")
    p.add_argument("--seed", type=int, default=None, help="fault plan seed (default: drawn and printed)")
    p.add_argument("--rate", type=float, default=1.5, help="load requests per second (default 1.5)")
    p.add_argument("--concurrency", type=int, default=4, help="load requests in flight at most (default 4)")
    p.add_argument("--warmup", type=float, default=None, help="seconds before the resource verdicts judge "
                                                                 "(default: a fifth of the run, 120 to 300)")
    p.add_argument("--rss-bound", type=float, default=64.0, help="RSS slope bound, MiB/hour/process (default 64)")
    p.add_argument("--replicated-minutes", type=float, default=0.0,
                   help="then the same load this long against vLLM's replicated layout: the throughput ratio")
    p.add_argument("--fit-load", action="store_true",
                   help="offer at most half the requests/s the server is measured to serve at start (the short CI "
                        "run: its verdicts then do not depend on how fast the CPU is); default: --rate as given")
    p.add_argument("--no-kill", action="store_true", help="skip the SIGKILL of one engine core at the end")
    p.add_argument("--out", default="soak-out", help="directory for soak.json, soak.png, logs (default soak-out)")
    p.add_argument("--json", action="store_true", help="print the whole result as one JSON line")
    return p


def run(args: argparse.Namespace) -> int:
    try:
        import transformers  # noqa: F401 - the oracle
        import vllm  # noqa: F401 - the server
    except ImportError as exc:
        print(f"{PROG}: {exc}. Fix: run it from the CPU engine's environment (`make soak`)", file=sys.stderr)
        return 2
    from .run import SoakConfig, run_soak

    if args.minutes <= 0.5:
        print(f"{PROG}: --minutes {args.minutes}: too short for a minute's checks. Fix: 1 or more",
              file=sys.stderr)
        return 2
    cfg = SoakConfig(minutes=args.minutes, model=args.model, seed=args.seed, request_rate=args.rate,
                     max_concurrency=args.concurrency, warmup_s=args.warmup, rss_bound_mib_per_hour=args.rss_bound,
                     replicated_minutes=args.replicated_minutes, kill=not args.no_kill, out_dir=args.out,
                     fit_load=args.fit_load)
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else (lambda m: print(m, flush=True))
    from moonep_ep.errors import ConfigError

    try:
        result = run_soak(cfg, say)
    except ConfigError as exc:
        print(exc, file=sys.stderr)  # its message names the soak and the fix
        return 2
    verdicts = result["verdicts"]
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "samples"}, default=str))
    else:
        for name, v in verdicts["verdicts"].items():
            print(f"  {'ok ' if v['ok'] else 'FAIL'} {name}: {v['rule']}" + "".join(f"\n       {m}" for m in v["failures"]))
        rep = result.get("replicated") or {}
        if rep.get("error"):
            print(f"soak: no replicated side by side: {rep['error']} ({rep.get('log')})")
        elif "throughput_ratio_sharded_over_replicated" in verdicts:
            print(f"soak: sharded/replicated output throughput {verdicts['throughput_ratio_sharded_over_replicated']}")
        print(f"soak: {'all verdicts pass' if result['ok'] else 'FAILED'}; {args.out}/soak.json, {result.get('png')}")
    return 0 if result["ok"] else 1


def main(argv: Optional[list[str]] = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
