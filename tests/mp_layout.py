"""Rank bodies for the expert-layout tests."""

from __future__ import annotations

import gc
from typing import Any

import torch

from moonep_ep.errors import CollectiveError
from moonep_ep.layout.store import ShardedExpertStore, ffn_projections
from moonep_ep.memory.accounting import snapshot
from moonep_ep.memory.host import HostDriver


def expert_value(layer: int, proj: str, expert: int, shape) -> torch.Tensor:
    """Deterministic, distinct content per (layer, projection, expert)."""
    code = layer * 1000 + {"gate": 0, "up": 300, "down": 600}[proj] + expert
    idx = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)
    return (torch.sin(idx * 0.01 + code) * 4 + code % 7).to(torch.bfloat16)


def layout_checks(ctx: Any, hidden: int, inter: int, experts: int, layers: int, gran: int,
                  gen_b: bool) -> dict[str, Any]:
    rank, world = ctx.rank, ctx.world_size
    driver = HostDriver(rank=rank, granularity=gran)
    before = snapshot(rank)
    projs = ffn_projections(hidden, inter)
    epn = experts // world
    store = ShardedExpertStore(num_layers=layers, num_experts=experts, projections=projs,
                               num_slots=epn, driver=driver, gen_b=gen_b)
    out: dict[str, Any] = {"errors": []}
    requested: list[tuple[int, str, int]] = []

    # Instrumented loading, one rank at a time: after rank k loads, only rows of
    # ranks <= k may be non-zero anywhere (nobody writes another rank's rows).
    def loader(layer: int, proj: str, expert: int) -> torch.Tensor:
        requested.append((layer, proj, expert))
        shape = next(p.shape for p in projs if p.name == proj)
        return expert_value(layer, proj, expert, shape)

    for turn in range(world):
        if turn == rank:
            store.load_stats.experts_requested.clear()
            for layer in range(layers):
                for p in projs:
                    own = store.owner_view(layer, p.name)
                    for j in range(epn):
                        own[j].copy_(loader(layer, p.name, rank * epn + j))
        store.finish_loading()
        for layer in range(layers):
            for p in projs:
                rows = store.gen_a(layer, p.name)[:experts]
                nonzero_owner = {e // epn for e in range(experts) if bool(rows[e].ne(0).any())}
                if not nonzero_owner <= set(range(turn + 1)):
                    out["errors"].append(f"after rank {turn} loaded, rows of ranks "
                                         f"{sorted(nonzero_owner - set(range(turn + 1)))} are non-zero")
        store.symm.comm.barrier()  # everyone checked before the next rank writes
    out["requested_other"] = sorted({e for (_, _, e) in requested if e // epn != rank})
    out["requested_count"] = len(requested)
    # Row e of every rank's Gen A view equals the owner's data, for all e.
    bad = 0
    for layer in range(layers):
        for p in projs:
            view = store.gen_a(layer, p.name)
            assert view.is_contiguous() and tuple(view.shape) == (experts + epn, *p.shape)
            for e in range(experts):
                if not torch.equal(view[e], expert_value(layer, p.name, e, p.shape)):
                    bad += 1
    out["bad_rows"] = bad
    # One physical slot pool: written through layer 3's view, read through layer 7's.
    l_w, l_r = min(3, layers - 1), min(7, layers - 1)
    store.slots(l_w, "up")[0].fill_(rank + 1.5)
    out["slot_shared"] = bool(store.slots(l_r, "up")[0].eq(rank + 1.5).all())
    out["slot_ptrs_differ"] = store.slots(l_w, "up").data_ptr() != store.slots(l_r, "up").data_ptr()
    # Slots are per rank (private pools): a peer's pool is untouched by our write.
    store.finish_loading()
    if gen_b:
        pool = store.gen_b_pool(0, "down")
        comp = store.gen_b_compute(0, "down")
        store.slots(0, "down")[1].fill_(-(rank + 2))
        store.finish_loading()
        out["genb_pool_sees_peers"] = [bool(pool[r, 1].eq(-(r + 2)).all()) for r in range(world)]
        out["genb_compute_own"] = bool(torch.equal(comp[:epn], store.owner_view(0, "down")))
        out["genb_compute_slots"] = bool(torch.equal(comp[epn:], store.slots(0, "down")))
        del pool, comp
    phys = store.physical_bytes()
    mem = snapshot(rank)
    out["physical"] = phys
    out["os_bytes_by_tag"] = mem.own_bytes
    out["lead_pad"] = {p.name: store.plans[p.name].lead_pad for p in projs}
    out["gran"] = gran
    out["mappings"] = store.mapping_count
    del view, rows, own
    store.close()
    gc.collect()
    after = snapshot(rank)
    out["leaks"] = {k: v for k, v in driver.live_objects().items() if v}
    out["leaked_fds"] = after.open_memfds - before.open_memfds
    out["leaked_maps"] = after.memfd_mappings - before.memfd_mappings
    return out


def bad_layout(ctx: Any, case: str) -> str:
    driver = HostDriver(rank=ctx.rank, granularity=(2 << 20) if case == "gen_b_unaligned" else (64 << 10))
    kwargs = dict(num_layers=2, num_experts=8, projections=ffn_projections(256, 128), num_slots=4,
                  driver=driver)
    if case == "experts_not_divisible":
        kwargs["num_experts"] = 6 if ctx.world_size == 4 else 7
    elif case == "ranks_disagree":
        kwargs["num_layers"] = 2 + ctx.rank
    elif case == "gen_b_unaligned":
        kwargs.update(projections=ffn_projections(512, 384), num_experts=12, num_slots=3, gen_b=True)
    try:
        ShardedExpertStore(**kwargs).close()
        return "no error"
    except CollectiveError as exc:
        return str(exc)
