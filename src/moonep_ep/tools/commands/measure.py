"""``moonep-ep footprint --measure``: allocate a (scaled-down) moonep_ep layout for real
across N ranks, and compare the bytes measured below the library with the
closed-form prediction (``layout.footprint.rank_bytes_closed_form``, derived
independently of the allocator's page plan) and with vLLM 0.33.0's replicated
layout. Passes only when measured equals predicted on every rank.

Measured: the host driver's memfd sizes from the OS. CUDA: the sizes of the
store's own physical allocations (its ``cuMemCreate`` handles, as the driver
accepted them), the figure that must equal the prediction; cross-checked by
the device-wide used bytes (``cuMemGetInfo``) before and after the store is
built. ``cuMemGetInfo`` counts everything on the GPU -- on a GPU also the
NCCL communicator and torch's caching-allocator segment that the store's
first collective creates -- so the group and the allocator are warmed up
first (two metadata collectives) and the device-wide figure may drift by
less than one page; over the emulator (whose ``cuMemGetInfo`` counts every
process's emulated allocations on the GPU) it must match too. The
prediction uses the driver's granularity (CUDA: queried).
The layout is the model's expert format (``--format``, else its checkpoint's;
``layout.formats.store_projections``): quantized, every weight and scale
tensor has pages of its own, and weights and scales are predicted and
reported apart.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from ...errors import ConfigError
from ...layout.footprint import rank_bytes_closed_form

#: Above this many bytes per rank the weights are allocated but not written
#: (memfds are sparse: st_size counts, untouched pages cost no RAM).
FILL_LIMIT_BYTES = 1 << 30


def _measure_rank(ctx: Any, driver_name: str, layers: int, experts: int, hidden: int, inter: int, slots: int,
                  slot_pools: int, granularity: int, fmt: str = "bf16", skip_warm_up: bool = False) -> dict[str, Any]:
    from ...memory import make_driver
    from ...memory.accounting import driver_holdings, snapshot
    from ...layout.formats import store_projections
    from ...layout.store import ShardedExpertStore

    from ...memory.group import GroupComm

    kwargs = {"granularity": granularity} if driver_name == "host" else {}
    with make_driver(driver_name, rank=ctx.rank, **kwargs) as driver:
        projs = store_projections(fmt, hidden, inter)
        cuda = driver.name != "host"
        if cuda:  # the group's communicator, the allocator's first segment, kernels and page tables, before the window
            warm = GroupComm()
            warm.barrier("footprint: warm up the group")
            if not skip_warm_up:
                _warm_up_device(driver)
            warm.barrier("footprint: warmed up")
            device_before = _device_used(driver)
        before = driver_holdings(driver, ctx.rank).bytes_held
        store = ShardedExpertStore(num_layers=layers, num_experts=experts, projections=projs, num_slots=slots,
                                   slot_pools=slot_pools, driver=driver)
        # CUDA commits physical memory at cuMemCreate; read the device figures now, before the
        # loader's temporary tensors take device memory through torch's caching allocator.
        if cuda:
            handle_bytes = sum(driver.handle_size(h) for h in store.symm.own_handles())
            device_wide = _device_used(driver) - device_before
            below = driver_holdings(driver, ctx.rank).bytes_held - before if driver.emulated else None
        try:
            filled = store.physical_bytes()["total_bytes"] <= FILL_LIMIT_BYTES
            if filled:
                gen = torch.Generator().manual_seed(ctx.rank)
                device = driver.torch_device

                def loader(layer: int, proj: str, expert: int) -> torch.Tensor:
                    p = next(q for q in projs if q.name == proj)
                    if p.dtype == torch.bfloat16:
                        return (torch.rand(p.shape, generator=gen) - 0.5).to(device=device, dtype=torch.bfloat16)
                    raw = torch.randint(0, 256, (p.row_bytes,), dtype=torch.uint8, generator=gen)  # packed / scales
                    return raw.view(p.dtype).view(p.shape).to(device)

                store.load(loader)
                for p in projs:  # touch the slot pool(s) too, so resident == allocated
                    for pool in range(slot_pools):
                        store.slots(pool, p.name).view(torch.uint8).fill_(1)
            predicted = rank_bytes_closed_form(num_layers=layers, num_experts=experts, ep_size=ctx.world_size,
                                               num_slots=slots, row_bytes=[p.row_bytes for p in projs],
                                               granularity=store.granularity, rank=ctx.rank, slot_pools=slot_pools,
                                               roles=[p.role for p in projs])
            if driver.name == "host":
                os_view = snapshot(ctx.rank)
                measured, resident = os_view.own_bytes, os_view.own_resident_bytes
                by_category = {"expert_bytes": os_view.own_bytes_by_tag.get("experts", 0),
                               "slot_bytes": os_view.own_bytes_by_tag.get("slots", 0)}
            else:  # the driver has no per-allocation names: the total only
                measured, resident, by_category = handle_bytes, None, None
            return {
                "rank": ctx.rank,
                "driver": driver.name,
                "emulated": bool(getattr(driver, "emulated", False)),
                "granularity": store.granularity,
                "measured_bytes": measured,
                "measure": ("OS: this rank's memfd sizes" if not cuda else
                            "the store's own cuMemCreate handles' sizes"),
                "device_wide_bytes": device_wide if cuda else None,
                "emulator_created_bytes": below if cuda else None,
                "measured_by_category": by_category,
                "resident_bytes": resident,
                "predicted": predicted,
                "driver_bytes": store.physical_bytes(),
                "filled": filled,
                "mappings": store.mapping_count,
                "map_seconds": round(store.map_seconds, 4),
            }
        finally:
            store.close()


def _warm_up_device(driver: Any) -> None:
    """What the store's construction does first, once, on a scratch page: CUDA loads a kernel into
    device memory at its first launch (lazy loading) and grows page tables at the first mappings;
    neither is freed and ``cuMemGetInfo`` counts both. So: ``driver.zero_`` and fill_() a device tensor
    (the kernels the store launches) and one create/reserve/map/unmap/free/release cycle."""
    from ...memory.driver import HandleType

    scratch = torch.empty(4096, dtype=torch.uint8, device=driver.torch_device)
    driver.zero_(scratch)  # the store's own zeroing goes through this seam (the emulator counts it too)
    scratch.fill_(1)
    del scratch
    gran = driver.granularity(HandleType.POSIX_FD)
    handle = driver.create(gran, HandleType.POSIX_FD, tag="warm-up")
    try:
        base = driver.reserve(gran, gran)
        try:
            driver.map(base, gran, handle, 0)
            try:
                driver.set_access(base, gran)
            finally:
                driver.unmap(base, gran)
        finally:
            driver.free_reservation(base, gran)
    finally:
        driver.release(handle)
    if not getattr(driver, "emulated", False):
        torch.cuda.empty_cache()
    driver.synchronize()


def _device_used(driver: Any) -> int:
    """Device-wide used bytes (``cuMemGetInfo``) once this rank's queued work is done."""
    driver.synchronize()
    free, total = driver.memory_info()
    return total - free


class _FormatChoice:
    """The one option ``model_format`` reads (``--format``)."""

    def __init__(self, expert_format: str | None) -> None:
        self.expert_format = expert_format


def measure_footprint(args: argparse.Namespace) -> int:
    from ...layout.footprint import default_slots, model_format
    from ...layout.formats import projection_bytes, store_projections
    from ...launch import admit_ranks, plan_one_gpu_per_rank, run_ranks
    from ...models import get_model, load_hf_config

    names = [n for item in (args.model or []) for n in str(item).split(",") if n]
    configs = list(args.config or [])
    if len(names) + len(configs) != 1:
        raise ConfigError(f"--measure takes exactly one model, got {names + configs}. "
                          "Fix: pass one --model NAME (e.g. tiny) or one --config PATH")
    model = get_model(names[0]) if names else load_hf_config(configs[0])
    ranks = args.ranks or 4
    if not admit_ranks(ranks, "moonep-ep footprint --measure"):
        return 2
    layers = args.layers or model.num_moe_layers
    if model.num_experts % ranks:
        raise ConfigError(f"{model.name}: {model.num_experts} experts do not split over --ranks {ranks}. "
                          "Fix: choose a rank count that divides the expert count")
    epn = model.num_experts // ranks
    slots = epn if args.slots in ("auto", None) else int(args.slots)
    granularity = int(args.granularity)
    fmt = model_format(model, _FormatChoice(getattr(args, "expert_format", None)))
    per_expert = projection_bytes(store_projections(fmt, model.hidden_size, model.moe_intermediate_size))
    repl_slots = default_slots("replicated", epn)
    replicated = layers * (model.num_experts + repl_slots) * per_expert["total_bytes"]
    # One GPU per rank: on a real GPU the measure is cuMemGetInfo, which counts every rank on the device.
    plan = plan_one_gpu_per_rank(getattr(args, "driver", "host") or "host", ranks, "moonep-ep footprint --measure")
    if plan is None:
        return 2

    def progress(msg: str) -> None:
        print(f"[measure] {msg}", file=sys.stderr, flush=True)

    progress(f"{model.name} ({fmt.name}): {layers} layers, E={model.num_experts}, {ranks} ranks, B={slots}, {plan.driver} "
             f"driver{' (emulated)' if plan.emulated else ''}" +
             (f", granularity {granularity} B" if plan.driver == "host" else ""))
    per_rank = run_ranks(_measure_rank, ranks, args=(plan.driver, layers, model.num_experts, model.hidden_size,
                                                     model.moe_intermediate_size, slots, args.slot_pools,
                                                     granularity, fmt.name, args.skip_warm_up),
                         backend=plan.backend, use_cuda=plan.use_cuda,
                         rank_envs=plan.rank_envs, progress=progress)
    granularity = per_rank[0]["granularity"]  # the driver's (CUDA: queried, not the host option)
    rows = []
    for r, res in enumerate(per_rank):
        predicted = res.pop("predicted")
        pred = predicted["total_bytes"]
        err = abs(res["measured_bytes"] - pred) / pred if pred else float(res["measured_bytes"] != 0)
        rows.append({**res, "predicted_bytes": pred, "predicted_by_category": predicted,
                     "relative_error": err, "replicated_bytes": replicated,
                     "replicated_over_measured": replicated / res["measured_bytes"] if res["measured_bytes"] else None})
    worst = max(r["relative_error"] for r in rows)
    # CUDA cross-checks: device-wide bytes within one page of the plan (NCCL and the caching allocator
    # were warmed up), and over the emulator the emulator's own count of created bytes exactly.
    for r in rows:
        r["device_wide_drift_bytes"] = (None if r["device_wide_bytes"] is None
                                        else r["device_wide_bytes"] - r["predicted_bytes"])
    cross_ok = all((r["device_wide_drift_bytes"] is None or abs(r["device_wide_drift_bytes"]) < granularity)
                   and r["emulator_created_bytes"] in (None, r["predicted_bytes"]) for r in rows)
    summary = {
        "ok": all(r["measured_bytes"] == r["predicted_bytes"] for r in rows) and cross_ok,
        "measure": rows[0]["measure"],
        "device_wide_measure": (None if plan.driver == "host" else
                                "cuMemGetInfo used bytes after minus before the store, after two warm-up collectives "
                                "(every process on the GPU counts; must be within one page of the plan)"),
        "device_wide_drift_bytes_per_rank": [r["device_wide_drift_bytes"] for r in rows],
        "driver": plan.driver, "emulated": plan.emulated,
        "model": model.name, "format": fmt.name, "format_label": fmt.label,
        "expert_weight_bytes": per_expert["weight_bytes"], "expert_scale_bytes": per_expert["scale_bytes"],
        "ranks": ranks, "layers": layers, "num_slots": slots,
        "slot_pools": args.slot_pools, "granularity": granularity,
        "replicated_num_slots": repl_slots,
        "measured_bytes_per_rank": [r["measured_bytes"] for r in rows],
        "resident_bytes_per_rank": [r["resident_bytes"] for r in rows],
        "predicted_bytes_per_rank": [r["predicted_bytes"] for r in rows],
        "replicated_bytes_per_rank": replicated,
        "max_relative_error": worst,
        "replicated_over_moonep_ep": replicated / max(r["measured_bytes"] for r in rows),
        "per_rank": rows,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        source = ("the OS (memfd sizes)" if plan.driver == "host" else
                  "the store's own cuMemCreate handles (device-wide cuMemGetInfo drift per rank: "
                  f"{summary['device_wide_drift_bytes_per_rank']} B)")
        print(f"{model.name}: {layers} MoE layers, E={model.num_experts}, R={ranks}, B={slots}, format {fmt.name} "
              f"({fmt.label}); "
              f"bytes per rank measured by {source}")
        print(f"  {'rank':>4} {'measured':>14} {'predicted':>14} {'err':>8} {'resident':>14} {'replicated':>14} {'ratio':>7}")
        for r in rows:
            resident = "-" if r["resident_bytes"] is None else f"{r['resident_bytes']:,}"
            print(f"  {r['rank']:>4} {r['measured_bytes']:>14,} {r['predicted_bytes']:>14,} "
                  f"{r['relative_error']:>8.2%} {resident:>14} {replicated:>14,} "
                  f"{r['replicated_over_measured']:>6.1f}x")
            if per_expert["scale_bytes"]:
                print(f"       of which scales: predicted {r['predicted_by_category']['scale_bytes']:,}, "
                      f"allocated {r['driver_bytes']['scale_bytes']:,} (weights "
                      f"{r['driver_bytes']['weight_bytes']:,})")
        print(f"  replicated / moonep_ep (largest rank): {summary['replicated_over_moonep_ep']:.2f}x; "
              f"{'OK' if summary['ok'] else 'MISMATCH'} (max error {worst:.3%})")
    return 0 if summary["ok"] else 1
