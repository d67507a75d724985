"""``moonep-ep bench prefetch``: pull-prefetch bandwidth from remote shards vs a local copy.

For several expert sizes, every rank builds a one-layer sharded store and
times, side by side in one run (trials interleaved, the fastest of each side
reported, medians beside them):

* **remote**: ``slot <- full[e]`` for experts ``e`` whose pages another rank
  allocated: the copy the pull prefetch issues, reading the peer's
  memory through the mapping (host: the peer's memfd pages; GPU: the peer's
  HBM over NVLink);
* **local**: ``slot <- copy`` of the same rows from an ordinary tensor in
  this rank's own memory: same bytes, same destination.

``ratio = remote / local`` (GB/s over GB/s). On the host driver both sides
are DRAM-to-DRAM memcpy, so the ratio says whether reading a peer's pages
through the mapping costs anything over local memory; on GPUs it is NVLink
read bandwidth over HBM copy bandwidth.

Why the fastest trial: another process can only ever slow a trial (a
preempted copy, a thread of the copy waiting for a core), never speed one
up, so the fastest of several interleaved trials is the estimate of what the
copy itself costs. A median is not: on a two-core machine whose other core
runs a vLLM engine, most trials of one side can be preempted while the
other side's are not, and a median ratio of 5.05 was read (CI, 3 Dec) for
copies whose undisturbed ratio is about 1. ``timeit`` reports its minimum
for the same reason.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Sequence

import torch

from ..args import HOST_GRANULARITY_HELP, add_deadline_argument, add_run_arguments

__all__ = ["add_arguments", "run", "page_holders", "split_by_holder", "measure_pull", "pull_rates",
           "bench_rank", "DEFAULT_SIZES"]

#: (H, I) of the benchmarked experts: 2, 4, 8, 16 and 28 MiB per projection (bf16);
#: the last is Kimi-K2 / DeepSeek-V3's routed expert.
DEFAULT_SIZES: tuple[tuple[int, int], ...] = ((512, 2048), (1024, 2048), (2048, 2048), (4096, 2048), (7168, 2048))


# ---------------------------------------------------------------------------
# helpers shared with the demo


def page_holders(store: Any, proj: str, expert: int) -> set[int]:
    """Ranks whose physical pages hold expert row ``expert`` of projection ``proj``.

    The store allocates each page of an expert region on the rank owning its
    first data byte (see ``layout/plan.py``), so with small experts and a
    large granularity a row can live in another rank's page than its
    logical owner's, or straddle two ranks' pages.
    """
    plan = store.plans[proj]
    lo = plan.lead_pad + expert * plan.row_bytes
    hi = lo + plan.row_bytes
    first, last = lo // plan.granularity, (hi - 1) // plan.granularity
    return {plan.page_owner[j] for j in range(first, last + 1)}


def split_by_holder(store: Any, rank: int) -> tuple[list[int], list[int]]:
    """Experts whose rows (all projections) are wholly in a peer's pages, and wholly in ours."""
    remote, local = [], []
    for e in range(store.num_experts):
        holders = set().union(*(page_holders(store, p.name, e) for p in store.projections))
        if rank not in holders:
            remote.append(e)
        elif holders == {rank}:
            local.append(e)
    return remote, local


def _time_copies(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> float:
    """Seconds to run ``dst.copy_(src)`` for every pair (CUDA: events around the batch)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    for dst, src in pairs:
        dst.copy_(src)
    return time.perf_counter() - t0


def measure_pull(store: Any, layer: int, experts: Sequence[int], reps: int = 5) -> dict[str, Any]:
    """Remote pull vs local copy of the same rows into this rank's slots.

    ``experts`` (global ids, rows held by peers) are copied, for every
    projection, into slot ``i % B``; the local side copies identical bytes
    from a private clone. Returns GB/s (1 GB = 1e9 B) of each side's fastest
    trial and their ratio remote/local (see the module docstring for why the
    fastest), each side's median GB/s beside them, and the bytes per trial.
    The slots are overwritten.
    """
    E, B = store.num_experts, store.num_slots
    remote_pairs, local_pairs = [], []
    for p in store.projections:
        view = store.pull_view(layer, p.name)
        for i, e in enumerate(experts):
            dst = view[E + i % B]
            remote_pairs.append((dst, view[e]))
            local_pairs.append((dst, view[e].clone()))  # same bytes, in this rank's own memory
    nbytes = sum(src.numel() * src.element_size() for _, src in remote_pairs)
    if not remote_pairs:
        return {"bytes": 0, "remote_gbps": None, "local_gbps": None, "ratio": None,
                "remote_gbps_median": None, "local_gbps_median": None, "trials": 0, "experts": []}
    device = remote_pairs[0][1].device
    _time_copies(remote_pairs, device)  # warm-up: fault in pages, wake the copy engines
    _time_copies(local_pairs, device)
    remote_t, local_t = [], []
    for rep in range(max(1, reps)):
        # Alternate which side goes first so neither always runs on a warmer cache.
        order = ((remote_pairs, remote_t), (local_pairs, local_t))
        for pairs, sink in (order if rep % 2 == 0 else order[::-1]):
            sink.append(_time_copies(pairs, device))
    return {"bytes": nbytes, **pull_rates(nbytes, remote_t, local_t), "experts": list(experts)}


def pull_rates(nbytes: int, remote_seconds: Sequence[float], local_seconds: Sequence[float]) -> dict[str, Any]:
    """GB/s of each side's fastest trial, their ratio (remote/local), and each side's median GB/s."""
    def gbps(seconds: float) -> float:
        return nbytes / seconds / 1e9

    remote_gbps, local_gbps = gbps(min(remote_seconds)), gbps(min(local_seconds))
    return {"remote_gbps": remote_gbps, "local_gbps": local_gbps, "ratio": remote_gbps / local_gbps,
            "remote_gbps_median": gbps(statistics.median(remote_seconds)),
            "local_gbps_median": gbps(statistics.median(local_seconds)), "trials": len(remote_seconds)}


# ---------------------------------------------------------------------------
# the benchmark


def bench_rank(ctx: Any, sizes: Sequence[tuple[int, int]], driver_name: str, granularity: int | None,
               reps: int, experts_per_rank: int) -> dict[str, Any]:
    """Rank body: one store per size; remote (peer pages) vs local copy of the same bytes."""
    from ...memory import make_driver

    kwargs = {"granularity": granularity} if granularity and driver_name == "host" else {}
    with make_driver(driver_name, rank=ctx.rank, **kwargs) as driver:
        out = [_bench_size(ctx, driver, H, I, reps, experts_per_rank) for H, I in sizes]
        # No handle type: the page size valid for whichever type the group votes (CUDA needs it named).
        return {"rank": ctx.rank, "device": str(driver.torch_device), "driver": driver.name,
                "emulated": bool(getattr(driver, "emulated", False)), "granularity": driver.granularity(),
                "sizes": out}


def _bench_size(ctx: Any, driver: Any, H: int, I: int, reps: int, experts_per_rank: int) -> dict[str, Any]:
    """One size: a one-layer store, then remote (peer pages) vs local copies of the same rows."""
    from ...layout.store import ShardedExpertStore, ffn_projections

    store = ShardedExpertStore(num_layers=1, num_experts=experts_per_rank * ctx.world_size,
                               projections=ffn_projections(H, I), num_slots=experts_per_rank, driver=driver)
    try:
        for p in store.projections:  # non-zero content so nothing can short-cut the copies
            own = store.owner_view(0, p.name)
            own.copy_(torch.randn(own.shape, device=own.device).to(own.dtype))
        store.finish_loading()
        remote, _ = split_by_holder(store, ctx.rank)
        # Take the peers' experts nearest after our own (rank+1, rank+2, ...), as many as we have slots.
        remote.sort(key=lambda e: (e // experts_per_rank - ctx.rank) % ctx.world_size)
        res: dict[str, Any] = {}
        for turn in range(ctx.world_size):  # one rank at a time: no contention between ranks' copies
            if turn == ctx.rank:
                t0 = time.perf_counter()
                res = measure_pull(store, 0, remote[:store.num_slots], reps)
                res["measure_seconds"] = round(time.perf_counter() - t0, 3)  # how long the others waited
            store.finish_loading()  # also: nobody unmaps while a peer still reads its pages
        res.update(H=H, I=I, row_bytes=store.projections[0].row_bytes)
        return res
    finally:
        store.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=2, help="local ranks (default 2; >= 2 for remote reads)")
    parser.add_argument("--reps", type=int, default=5, help="timed trials per side and size (default 5)")
    parser.add_argument("--experts-per-rank", type=int, default=2, help="experts (and slots) per rank (default 2)")
    add_deadline_argument(parser)
    add_run_arguments(parser, driver_help="memory driver (auto: cuda with one GPU per rank, else host)",
                      granularity_help=HOST_GRANULARITY_HELP)


def run(args: argparse.Namespace) -> int:
    from ...launch import RankFailure, admit_ranks, plan_one_gpu_per_rank, run_ranks

    if not admit_ranks(args.ranks, "moonep-ep bench prefetch", minimum=2, why="remote reads need a peer"):
        return 2
    plan = plan_one_gpu_per_rank(args.driver, args.ranks, "moonep-ep bench prefetch")
    if plan is None:
        return 2
    driver, backend = plan.driver, plan.backend

    def progress(msg: str) -> None:
        print(f"[bench prefetch] {msg}", file=sys.stderr, flush=True)

    try:
        per_rank = run_ranks(bench_rank, args.ranks, args=(DEFAULT_SIZES, driver, args.granularity, args.reps,
                                                           args.experts_per_rank),
                             backend=backend, use_cuda=plan.use_cuda, rank_envs=plan.rank_envs, progress=progress,
                             # ranks measure one at a time (bench_rank's turns): a waiting rank's barrier lasts as
                             # long as its peer's measurement, bounded by the run's deadline
                             timeout_s=args.deadline_s, group_timeout_s=args.deadline_s)
    except RankFailure as exc:
        print(json.dumps({"ok": False, "errors": exc.errors}, indent=2) if args.json else str(exc))
        return 1
    rows = []
    for i, (H, I) in enumerate(DEFAULT_SIZES):
        entries = [r["sizes"][i] for r in per_rank]
        rows.append({
            "H": H, "I": I, "row_mib": entries[0]["row_bytes"] / 2**20,
            "bytes_per_trial": [e["bytes"] for e in entries],
            "remote_gbps": [e["remote_gbps"] for e in entries],
            "local_gbps": [e["local_gbps"] for e in entries],
            "remote_over_local": [e["ratio"] for e in entries],
            "measure_seconds": [e["measure_seconds"] for e in entries],
        })
    summary = {"ok": all(v is not None for row in rows for v in row["remote_gbps"]),
               "ranks": args.ranks, "driver": per_rank[0]["driver"], "emulated": per_rank[0]["emulated"],
               "backend": backend,
               "granularity": per_rank[0]["granularity"], "reps": args.reps,
               "experts_per_rank": args.experts_per_rank, "deadline_s": args.deadline_s, "sizes": rows}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"pull prefetch, {args.ranks} ranks, {summary['driver']} driver, the fastest of {args.reps} "
              f"interleaved trials a side (GB/s = 1e9 B/s; mean over ranks, min..max in brackets)")
        print(f"{'expert (H x I)':>16} {'MiB/proj':>9} {'remote GB/s':>22} {'local GB/s':>22} {'remote/local':>14}")

        def fmt(vals: list) -> str:
            vals = [v for v in vals if v is not None]
            if not vals:
                return "n/a"
            return f"{statistics.mean(vals):7.2f} [{min(vals):.2f}..{max(vals):.2f}]"

        for row in rows:
            print(f"{row['H']:>7} x {row['I']:<6} {row['row_mib']:>9.1f} {fmt(row['remote_gbps']):>22} "
                  f"{fmt(row['local_gbps']):>22} {fmt(row['remote_over_local']):>14}")
    return 0 if summary["ok"] else 1
