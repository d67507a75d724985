"""``moonep-ep bench layout``: map a Kimi-K2-shaped sharded layout on N ranks.

Keeps Kimi K2's *counts* — 60 MoE layers × 3 projections × R owners, 384
experts — and shrinks each expert row to one granularity page, so the run
exercises exactly as many mappings and handles as the real model while
fitting a laptop (memfds are sparse; only sampled rows are touched). Prints
each rank's mapping time, mapping count and the number of collective rounds
(handle exchanges and metadata all-gathers) the whole model needed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from ..args import add_run_arguments



def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=8, help="EP ranks (default 8; 384 experts must divide)")
    p.add_argument("--layers", type=int, default=60, help="MoE layers (Kimi K2: 60)")
    p.add_argument("--experts", type=int, default=384, help="routed experts (Kimi K2: 384)")
    add_run_arguments(p, granularity_default=64 << 10,
                      granularity_help="host granularity and shrunk row size in bytes (default 64 KiB)")


def _bench_rank(ctx: Any, layers: int, experts: int, gran: int) -> dict[str, Any]:
    from ...memory.host import HostDriver
    from ...layout.store import FFN_PROJECTIONS, ProjectionSpec, ShardedExpertStore

    driver = HostDriver(rank=ctx.rank, granularity=gran)
    row = (1, gran // 2)  # one bf16 row of one page per expert
    projs = [ProjectionSpec(name, row) for name in FFN_PROJECTIONS]
    epn = experts // ctx.world_size
    t0 = time.perf_counter()
    store = ShardedExpertStore(num_layers=layers, num_experts=experts, projections=projs, num_slots=epn,
                               driver=driver)
    total_s = time.perf_counter() - t0
    try:
        rounds = dict(store.symm.comm.rounds)
        # Sampled check: first and last layer, every owner's first row.
        for layer in (0, layers - 1):
            store.owner_view(layer, "down")[:, 0, 0] = float(ctx.rank + 1)
        store.finish_loading()
        ok = all(float(store.pull_view(layer, "down")[o * epn, 0, 0]) == o + 1
                 for layer in (0, layers - 1) for o in range(ctx.world_size))
        with open("/proc/self/maps") as maps:
            vmas = sum(1 for _ in maps)
        return {"rank": ctx.rank, "ok": ok, "setup_s": round(total_s, 4),
                "allocate_exchange_s": round(store.allocate_seconds, 4),
                "map_s": round(store.mapping_seconds, 4), "mappings": store.mapping_count,
                "views": layers * len(projs), "vmas": vmas, "rounds": rounds,
                "physical_bytes": store.physical_bytes()["total_bytes"]}
    finally:
        store.close()


def run(args: argparse.Namespace) -> int:
    from ...launch import admit_ranks, run_ranks

    if not admit_ranks(args.ranks, "moonep-ep bench layout"):
        return 2
    if args.experts % args.ranks:
        print(f"moonep-ep bench layout: --experts {args.experts} must be a multiple of --ranks {args.ranks}",
              file=sys.stderr)
        return 2

    def progress(msg: str) -> None:
        print(f"[bench layout] {msg}", file=sys.stderr, flush=True)

    per_rank = run_ranks(_bench_rank, args.ranks, args=(args.layers, args.experts, args.granularity),
                         progress=progress, timeout_s=900)
    summary = {
        "ok": all(r["ok"] for r in per_rank),
        "shape": {"layers": args.layers, "projections": 3, "experts": args.experts, "ranks": args.ranks,
                  "row_bytes": args.granularity},
        "setup_s_per_rank": [r["setup_s"] for r in per_rank],
        "map_s_per_rank": [r["map_s"] for r in per_rank],
        "mappings_per_rank": [r["mappings"] for r in per_rank],
        "views_per_rank": per_rank[0]["views"],
        "handle_exchange_rounds": per_rank[0]["rounds"]["handle_exchange"],
        "metadata_rounds": per_rank[0]["rounds"]["metadata"],
        "vmas_per_rank": [r["vmas"] for r in per_rank],
        "per_rank": per_rank,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"Kimi-K2-shaped layout: {args.layers} layers x 3 projections x {args.ranks} owners, "
              f"E={args.experts}, rows shrunk to {args.granularity} B")
        print(f"  {'rank':>4} {'alloc+exchange ms':>18} {'map ms':>8} {'total ms':>9} {'mappings':>9} {'VMAs':>6}")
        for r in per_rank:
            print(f"  {r['rank']:>4} {r['allocate_exchange_s'] * 1e3:>18.1f} {r['map_s'] * 1e3:>8.1f} "
                  f"{r['setup_s'] * 1e3:>9.1f} {r['mappings']:>9} {r['vmas']:>6}")
        print(f"  collective rounds for the whole model: {summary['handle_exchange_rounds']} handle "
              f"exchange, {summary['metadata_rounds']} metadata all-gathers; "
              f"{'OK' if summary['ok'] else 'DATA MISMATCH'}")
    return 0 if summary["ok"] else 1
