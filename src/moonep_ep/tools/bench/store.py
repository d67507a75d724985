"""``moonep-ep bench store``: two performance facts of the sharded store, each a ratio measured side by side in one
run (``scripts/gpu_check.sh`` part 2 runs it on a GPU):

* **slot fill**: ``slot <- full[e]`` from rows another rank allocated (read
  through this rank's *imported* mapping of the peer's memory) over the same
  bytes copied from a local allocation (``prefetch_bench.measure_pull``),
  bytes per second over bytes per second. Two ranks on one GPU: both sides
  read the same HBM, so a ratio far from 1.0 means the imported mapping
  itself costs something (page size, access flags, caching). Ranks on two
  GPUs: NVLink over HBM.
* **grouped FFN**: the SiLU-gated expert FFN (``ops.experts.grouped_ffn``)
  over the store's ``[E+B]`` views over the same FFN over plain
  ``torch.empty`` tensors of the same shapes and bytes, seconds over seconds
  (inverted: throughput ratio). The views are VMM-mapped, possibly
  multi-owner; a ratio far from 1.0 means the kernels run slower on them.

Ranks measure one at a time (no contention between them); a rank whose turn it
is not waits in the process group for the measuring peer, with the run's own
bound ``--deadline-s`` as the group's timeout, not ``MOONEP_EP_TIMEOUT_S``
(a peer's measurement may take longer than that on a slow or busy CPU; a peer
that dies is still reported at once, by the launcher). Each rank's
``measure_seconds`` is the wall time of its own turn.

Trials alternate which side runs first, and both ratios compare each side's
fastest trial (``prefetch.measure_pull``, :mod:`.timing`): another process only
ever slows a trial, so the ratio holds on a busy machine, where a median ratio
does not (medians are reported beside). On the host
driver or the emulator the figures are CPU memcpy / matmul times: they show
the tool works, not GPU facts (``"device"`` says which).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Callable, Optional

import torch

from ..args import add_deadline_argument, add_moe_shape_arguments, add_run_arguments
from .timing import fastest_ratio, interleaved_trials, timer_for


def ffn_views_vs_plain(store: Any, layer: int, tokens: int, reps: int,
                       timer: Optional[Callable[[Callable[[], Any]], float]] = None) -> dict[str, Any]:
    """Grouped FFN over the store's ``[E+B]`` views vs over ``torch.empty`` copies of the same shapes:
    throughput ratio ``views / plain`` from each side's fastest of ``reps`` interleaved trials
    (``timer``: seconds of one call; default CUDA events on a GPU, the wall clock on CPU)."""
    from ...ops.experts.grouped import grouped_ffn

    views = {p.name: store.pull_view(layer, p.name) for p in store.projections}
    plain = {name: torch.empty_like(v).copy_(v) for name, v in views.items()}
    device = views["gate"].device
    groups, hidden = views["gate"].shape[0], views["gate"].shape[2]
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(tokens, hidden, generator=gen) * 0.1).to(device=device, dtype=views["gate"].dtype)
    counts = torch.full((groups,), tokens // groups, dtype=torch.int32)
    counts[: tokens % groups] += 1
    cu = torch.cumsum(counts, 0).to(torch.int32).to(device)

    def run(w: dict[str, torch.Tensor]) -> torch.Tensor:
        return grouped_ffn(x, w["gate"], w["up"], w["down"], cu)

    same = torch.equal(run(views), run(plain))  # warm-up, and the two sides compute the same thing
    seconds = interleaved_trials({"views": lambda: run(views), "plain": lambda: run(plain)}, reps,
                                 timer or timer_for(device))
    # plain seconds over views seconds: the views' throughput over the plain tensors'
    rates = fastest_ratio(seconds["plain"], seconds["views"])
    return {"tokens": tokens, "groups": groups, "views_seconds": rates["denominator_fastest_s"],
            "plain_seconds": rates["numerator_fastest_s"], "views_over_plain_throughput": rates["ratio"],
            "views_median_seconds": rates["denominator_median_s"], "plain_median_seconds": rates["numerator_median_s"],
            "views_over_plain_throughput_of_medians": rates["ratio_of_medians"], "trials": rates["trials"],
            "outputs_equal": same}


def perf_rank(ctx: Any, driver_name: str, hidden: int, inter: int, experts_per_rank: int, tokens: int,
              reps: int) -> dict[str, Any]:
    from ...layout.store import ShardedExpertStore, ffn_projections
    from ...memory import make_driver
    from .prefetch import measure_pull, split_by_holder

    with make_driver(driver_name, rank=ctx.rank) as driver:
        store = ShardedExpertStore(num_layers=1, num_experts=experts_per_rank * ctx.world_size,
                                   projections=ffn_projections(hidden, inter), num_slots=experts_per_rank,
                                   driver=driver)
        try:
            gen = torch.Generator().manual_seed(ctx.rank)
            for p in store.projections:  # non-zero content: nothing can short-cut a copy or a matmul
                own = store.owner_view(0, p.name)
                own.copy_((torch.randn(own.shape, generator=gen) * 0.05).to(device=own.device, dtype=own.dtype))
            store.finish_loading()
            remote, _ = split_by_holder(store, ctx.rank)
            out: dict[str, Any] = {"rank": ctx.rank, "device": str(driver.torch_device), "driver": driver.name,
                                   "emulated": bool(getattr(driver, "emulated", False))}
            # One rank at a time: no contention between ranks. The others wait in the barrier below for as
            # long as the measuring rank takes: main() sets the group's timeout to the run's deadline, not to
            # MOONEP_EP_TIMEOUT_S (which bounds waits on a peer that is merely answering).
            for turn in range(ctx.world_size):
                if turn == ctx.rank:
                    t0 = time.perf_counter()
                    out["slot_fill"] = measure_pull(store, 0, remote[:store.num_slots], reps)
                    out["ffn"] = ffn_views_vs_plain(store, 0, tokens, reps)
                    out["measure_seconds"] = round(time.perf_counter() - t0, 3)
                store.finish_loading()  # a barrier: nobody unmaps while a peer still reads
            return out
        finally:
            store.close()


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_moe_shape_arguments(p, hidden=2048, intermediate=1024)
    p.add_argument("--experts-per-rank", type=int, default=4, help="experts (and slots) per rank (default 4)")
    p.add_argument("--tokens", type=int, default=2048, help="rows through the grouped FFN (default 2048)")
    p.add_argument("--reps", type=int, default=7, help="timed trials per side (default 7)")
    add_deadline_argument(p)
    add_run_arguments(p, driver_help="memory driver (auto: cuda when torch sees a GPU, else host)")


def run(args: argparse.Namespace) -> int:
    from ...launch import RankFailure, plan_launch, run_ranks

    plan = plan_launch(args.driver, 2)  # two ranks; on one GPU both share it (gloo), as selftest does
    try:
        per_rank = run_ranks(perf_rank, 2, args=(plan.driver, args.hidden, args.intermediate, args.experts_per_rank,
                                                 args.tokens, args.reps),
                             backend=plan.backend, use_cuda=plan.use_cuda, rank_envs=plan.rank_envs,
                             timeout_s=args.deadline_s, group_timeout_s=args.deadline_s)
    except RankFailure as exc:
        print(json.dumps({"ok": False, "errors": exc.errors}))
        return 1
    fills = [r["slot_fill"]["ratio"] for r in per_rank]
    ffns = [r["ffn"]["views_over_plain_throughput"] for r in per_rank]
    summary = {
        "ok": all(f is not None and f > 0 for f in fills) and all(r["ffn"]["outputs_equal"] for r in per_rank),
        "driver": plan.driver, "emulated": per_rank[0]["emulated"], "device": per_rank[0]["device"],
        "measure": "interleaved trials, each ratio from the fastest trial a side (medians in per_rank); CUDA "
                   "events on a GPU, wall clock on CPU",
        "slot_fill_imported_over_local": fills,
        "slot_fill_gbps": [(r["slot_fill"]["remote_gbps"], r["slot_fill"]["local_gbps"]) for r in per_rank],
        "ffn_views_over_plain": ffns,
        "ffn_outputs_equal": [r["ffn"]["outputs_equal"] for r in per_rank],
        "measure_seconds": [r["measure_seconds"] for r in per_rank],
        "deadline_s": args.deadline_s,
        "per_rank": per_rank,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"slot fill, imported mapping / local allocation (B/s over B/s): {fills}")
        print(f"grouped FFN, [E+B] views / torch.empty tensors (throughput): {ffns}")
    return 0 if summary["ok"] else 1
