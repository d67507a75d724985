"""Sharded expert layout: page plan (pure) and the store on 4 real ranks (host driver)."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moonep_ep.errors import ConfigError, MoonEPError
from moonep_ep.layout.footprint import rank_bytes_closed_form
from moonep_ep.layout.plan import plan_expert_region, predict_rank_bytes, slot_pool_bytes
from moonep_ep.layout.store import ShardedExpertStore, ffn_projections
from moonep_ep.memory.accounting import snapshot
from moonep_ep.memory.host import HostDriver
from moonep_ep.launch import run_ranks
from tests.support.cli import moonep_ep_json


def expert_value(layer: int, proj: str, expert: int, shape) -> torch.Tensor:
    """Deterministic, distinct content per (layer, projection, expert)."""
    code = layer * 1000 + {"gate": 0, "up": 300, "down": 600}[proj] + expert
    idx = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)
    return (torch.sin(idx * 0.01 + code) * 4 + code % 7).to(torch.bfloat16)


def layout_checks(ctx: Any, hidden: int, inter: int, experts: int, layers: int, gran: int,
                  api: str) -> dict[str, Any]:
    rank, world = ctx.rank, ctx.world_size
    driver = HostDriver(rank=rank, granularity=gran)
    before = snapshot(rank)
    projs = ffn_projections(hidden, inter)
    epn = experts // world
    store = ShardedExpertStore(num_layers=layers, num_experts=experts, projections=projs,
                               num_slots=epn, driver=driver, api=api)
    out: dict[str, Any] = {"errors": []}
    before_load = {(layer, p.name): store.pull_view(layer, p.name)[:experts].clone()
                   for layer in range(layers) for p in projs}
    store.symm.comm.barrier("test: every rank saw zero rows")  # before anyone writes

    def loader(layer: int, proj: str, expert: int) -> torch.Tensor:
        shape = next(p.shape for p in projs if p.name == proj)
        return expert_value(layer, proj, expert, shape)

    stats = store.load(loader)  # collective: every rank loads its own experts, then a barrier
    # What the store asked for and wrote, from its own instrumentation (not this test's loop).
    out["requested"] = list(stats.experts_requested)
    out["bytes_written"] = stats.bytes_written
    out["max_transient_bytes"] = stats.max_transient_bytes
    out["all_zero_before_load"] = all(bool((v == 0).all()) for v in before_load.values())
    # Row e of every rank's pull view equals the owner's data, for all e.
    bad = 0
    for layer in range(layers):
        for p in projs:
            view = store.pull_view(layer, p.name)
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
    if api == "push":
        pool = store.push_pool(0, "down")
        comp = store.push_view(0, "down")
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
    del view
    store.close()
    gc.collect()
    after = snapshot(rank)
    out["leaks"] = {k: v for k, v in driver.live_objects().items() if v}
    out["leaked_fds"] = after.open_memfds - before.open_memfds
    out["leaked_maps"] = after.memfd_mappings - before.memfd_mappings
    return out


def bad_layout(ctx: Any, case: str) -> str:
    driver = HostDriver(rank=ctx.rank, granularity=64 << 10)
    kwargs = dict(num_layers=2, num_experts=8, projections=ffn_projections(256, 128), num_slots=4,
                  driver=driver)
    if case == "experts_not_divisible":
        kwargs["num_experts"] = 6 if ctx.world_size == 4 else 7
    elif case == "ranks_disagree":
        kwargs["num_layers"] = 2 + ctx.rank
    elif case == "push_slots":  # the push API fixes B = E/R
        kwargs.update(api="push")
    try:
        ShardedExpertStore(**kwargs).close()
        return "no error"
    except MoonEPError as exc:  # a step failure or a decision from gathered data: raised on every rank
        return str(exc)


MIB = 1 << 20


@pytest.mark.parametrize("E,R,rb,gran", [(12, 4, 384 * 512 * 2, 2 * MIB), (384, 64, 2048 * 7168 * 2, 2 * MIB),
                                         (16, 4, 256 * 512 * 2, 2 * MIB), (7 * 4, 4, 12345 * 2, 64 << 10),
                                         (128, 8, 768 * 2048 * 2, 2 * MIB)])
def test_page_plan_invariants(E, R, rb, gran):
    plan = plan_expert_region(E, R, rb, gran)
    data = E * rb
    assert (plan.lead_pad + data) % gran == 0 and 0 <= plan.lead_pad < gran
    assert list(plan.page_owner) == sorted(plan.page_owner)  # each owner one contiguous run
    assert sum(plan.pages_of(r) for r in range(R)) == plan.num_pages
    # Every data byte is in exactly one page, and padding is < one page per region.
    assert sum(plan.data_bytes_in_pages_of(r) for r in range(R)) == data
    assert plan.num_pages * gran - data == plan.lead_pad < gran
    # A page is allocated by the owner of its first data byte.
    epn = E // R
    for j, owner in enumerate(plan.page_owner):
        first = max(j * gran, plan.lead_pad) - plan.lead_pad
        assert owner == (first // rb) // epn


@given(E_R=st.sampled_from([(8, 2), (12, 4), (16, 4), (16, 8), (384, 64), (64, 8), (10, 5)]),
       rb=st.integers(1, 3 << 20), gran=st.sampled_from([4096, 64 << 10, 2 << 20]),
       layers=st.integers(1, 3), slots=st.integers(1, 8), pools=st.sampled_from([1, 2]))
@settings(max_examples=200, deadline=None)
def test_closed_form_equals_the_page_plan(E_R, rb, gran, layers, slots, pools):
    E, R = E_R
    for rank in range(R):
        loop = predict_rank_bytes(num_layers=layers, num_experts=E, ep_size=R, num_slots=slots, row_bytes=[rb, rb + 7],
                                  granularity=gran, rank=rank, slot_pools=pools)
        closed = rank_bytes_closed_form(num_layers=layers, num_experts=E, ep_size=R, num_slots=slots,
                                        row_bytes=[rb, rb + 7], granularity=gran, rank=rank, slot_pools=pools)
        assert closed == {k: loop[k] for k in closed}, (rank, loop, closed)


def test_predicted_bytes_kimi_k2_ep64_below_40_gb():
    rb = 2048 * 7168 * 2
    got = predict_rank_bytes(num_layers=60, num_experts=384, ep_size=64, num_slots=6,
                             row_bytes=[rb] * 3, granularity=2 * MIB)
    assert got["padding_bytes"] == 0  # 28 MiB rows are whole pages
    assert got["expert_bytes"] == 60 * 3 * 6 * rb and got["slot_bytes"] == 3 * 6 * rb
    assert got["total_bytes"] < 40e9


def test_slot_pool_rounds_to_a_page():
    assert slot_pool_bytes(3, 384 * 1024, 2 * MIB) == 2 * MIB
    assert slot_pool_bytes(6, 384 * 1024, 2 * MIB) == 4 * MIB


def test_plan_rejects_indivisible_experts():
    with pytest.raises(ConfigError, match="divides the number of routed experts"):
        plan_expert_region(10, 4, 4096, 4096)


def test_page_plan_by_hand_with_a_lead_pad():
    """E = 4 experts of 5 bytes on R = 2 ranks, 8-byte pages: 20 data bytes, lead pad (-20) % 8 = 4, 3 pages.
    A page belongs to the owner of the row holding its first data byte: page 0 (data 0..3, row 0), page 1
    (data 4..11, row 0), page 2 (data 12..19, row 2 of rank 1): owners (0, 0, 1)."""
    plan = plan_expert_region(4, 2, 5, 8)
    assert (plan.num_experts, plan.ep_size, plan.row_bytes, plan.granularity) == (4, 2, 5, 8)
    assert plan.experts_per_rank == 2 and plan.lead_pad == 4 and plan.region_bytes == 24
    assert plan.page_owner == (0, 0, 1) and all(type(o) is int for o in plan.page_owner)
    assert [plan.first_page(r) for r in (0, 1, 2)] == [0, 2, 3]
    assert [plan.pages_of(r) for r in (0, 1, 2)] == [2, 1, 0]
    # data [4, 24): page 0 holds 4 bytes of it, page 1 8, page 2 8
    assert [plan.data_bytes_in_pages_of(r) for r in (0, 1, 2)] == [12, 8, 0]
    # one rank, 1-byte pages: every byte a page of rank 0
    one = plan_expert_region(4, 1, 5, 1)
    assert one.page_owner == (0,) * 20 and one.lead_pad == 0 and one.experts_per_rank == 4
    # 4 ranks, 4-byte pages, no lead pad: pages start at bytes 0, 4, ..., 16 (rows 0, 0, 1, 2, 3)
    assert plan_expert_region(4, 4, 5, 4).page_owner == (0, 0, 1, 2, 3)


def test_predicted_bytes_by_hand_with_padding_in_regions_and_pools():
    """2 layers, E = 4, R = 2, 3 slots, 8-byte pages, two tensors of 5 and 3 bytes per expert.
    5-byte rows: pages owned (0, 0, 1) (above); rank 0: 2 pages x 2 layers = 32 B holding 12 data bytes per layer
    (padding 2 x 4 = 8), pool 15 -> 16 B (padding 1). 3-byte rows: 12 data bytes, lead pad 4, 2 pages, both of
    rank 0 (rows 0 and 1): 32 B, padding 2 x 4 = 8; pool 9 -> 16 B (padding 7). Rank 1: one 8-byte page of the
    5-byte tensor per layer (all data), and both pools."""
    kw = dict(num_layers=2, num_experts=4, ep_size=2, num_slots=3, row_bytes=[5, 3], granularity=8)
    rank0 = {"expert_bytes": 64, "slot_bytes": 32, "padding_bytes": 8 + 1 + 8 + 7, "total_bytes": 96,
             "weight_bytes": 96, "scale_bytes": 0}
    assert predict_rank_bytes(**kw) == rank0                 # rank 0 by default
    assert predict_rank_bytes(**kw, rank=0) == rank0
    assert predict_rank_bytes(**kw, rank=1) == {"expert_bytes": 16, "slot_bytes": 32, "padding_bytes": 1 + 7,
                                                "total_bytes": 48, "weight_bytes": 48, "scale_bytes": 0}
    split = predict_rank_bytes(**kw, rank=1, roles=["weight", "scale"], slot_pools=2)
    assert split == {"expert_bytes": 16, "slot_bytes": 64, "padding_bytes": 2 * (1 + 7), "total_bytes": 80,
                     "weight_bytes": 16 + 32, "scale_bytes": 32}
    with pytest.raises(ConfigError) as info:
        predict_rank_bytes(**kw, roles=["weight"])
    assert str(info.value) == "roles must match row_bytes one to one: got (1, 2). Fix: pass one role per tensor"


@pytest.mark.parametrize("args, message", [
    ((10, 4, 4096, 4096), "num_experts must be a multiple of ep_size: got (10, 4). Fix: choose an EP size that "
                          "divides the number of routed experts"),
    ((8, 0, 4096, 4096), "num_experts must be a multiple of ep_size: got (8, 0). Fix: choose an EP size that "
                         "divides the number of routed experts"),
    ((8, -2, 4096, 4096), "num_experts must be a multiple of ep_size: got (8, -2). Fix: choose an EP size that "
                          "divides the number of routed experts"),
    ((8, 2, 0, 4096), "row_bytes and granularity must be positive: got (0, 4096). Fix: pass the real expert shape "
                      "and driver granularity"),
    ((8, 2, 4096, 0), "row_bytes and granularity must be positive: got (4096, 0). Fix: pass the real expert shape "
                      "and driver granularity"),
    ((8, 2, 4096, -1), "row_bytes and granularity must be positive: got (4096, -1). Fix: pass the real expert "
                       "shape and driver granularity"),
])
def test_page_plan_refusals_exactly(args, message):
    with pytest.raises(ConfigError) as info:
        plan_expert_region(*args)
    assert str(info.value) == message


@pytest.mark.slow
def test_aligned_layout_four_ranks_pull_and_push_views():
    # H=512, I=384: rows of 384 KiB = 6 pages of 64 KiB: every owner's rows fill whole pages.
    results = run_ranks(layout_checks, 4, args=(512, 384, 12, 8, 64 << 10, "push"))
    for rank, res in enumerate(results):
        assert res["errors"] == [], (rank, res["errors"])
        assert res["bad_rows"] == 0                      # row e == owner's data, all e, all layers
        # store.load() asked only for this rank's experts, each once per (layer, projection) ...
        own = list(range(rank * 3, rank * 3 + 3))
        assert res["requested"] == own * (8 * 3)
        # ... wrote exactly their bytes, one expert at a time, into rows that were zero before.
        assert res["bytes_written"] == 8 * 3 * 3 * 384 * 512 * 2
        assert res["max_transient_bytes"] == 384 * 512 * 2
        assert res["all_zero_before_load"]
        assert res["slot_shared"] and res["slot_ptrs_differ"]  # one pool, two virtual views
        assert res["genb_pool_sees_peers"] == [True] * 4
        assert res["genb_compute_own"] and res["genb_compute_slots"]
        phys = res["physical"]
        assert phys["expert_bytes"] == 8 * 3 * 3 * 384 * 512 * 2 and phys["padding_bytes"] == 0
        assert res["os_bytes_by_tag"] == phys["total_bytes"]  # the OS agrees with the driver
        assert res["leaks"] == {} and res["leaked_fds"] == 0 and res["leaked_maps"] == 0


@pytest.mark.slow
def test_unaligned_layout_exact_contiguous_views_with_bounded_padding():
    # Same shapes at a 2 MiB granularity: epn*row = 1.125 MiB, nothing is page-aligned.
    gran = 2 * MIB
    results = run_ranks(layout_checks, 4, args=(512, 384, 12, 8, gran, "pull"))
    row = 384 * 512 * 2
    plan = plan_expert_region(12, 4, row, gran)
    for rank, res in enumerate(results):
        assert res["errors"] == [] and res["bad_rows"] == 0
        assert res["requested"] == list(range(rank * 3, rank * 3 + 3)) * (8 * 3)
        assert res["slot_shared"]
        assert all(0 < pad < gran for pad in res["lead_pad"].values())
        predicted = predict_rank_bytes(num_layers=8, num_experts=12, ep_size=4, num_slots=3,
                                       row_bytes=[row] * 3, granularity=gran, rank=rank)
        assert res["physical"]["total_bytes"] == predicted["total_bytes"] == res["os_bytes_by_tag"]
        assert res["physical"]["padding_bytes"] == predicted["padding_bytes"]
        assert res["leaks"] == {} and res["leaked_fds"] == 0 and res["leaked_maps"] == 0
    # Padding: under one page per chunk boundary — one lead pad per (layer, projection)
    # region across all ranks, plus each rank's slot-pool tail.
    total_pad = sum(r["physical"]["padding_bytes"] for r in results)
    assert total_pad == 8 * 3 * plan.lead_pad + 4 * 3 * (gran - 3 * row)
    # Ranks whose rows all sit in a neighbour's pages allocate no expert page at all.
    assert [r["physical"]["expert_bytes"] for r in results] == [
        8 * 3 * plan.pages_of(r) * gran for r in range(4)]


@pytest.mark.slow
@pytest.mark.parametrize("case,needle", [
    ("experts_not_divisible", "multiple of the EP size"),
    ("ranks_disagree", "ranks disagree on the expert layout"),
    ("push_slots", "the push layout needs num_slots == E/R: got (4, 2)"),
])
def test_bad_layouts_fail_on_every_rank(case, needle):
    for rank, msg in enumerate(run_ranks(bad_layout, 4, args=(case,))):
        assert needle in msg, (rank, msg)
        assert "Fix:" in msg


@pytest.mark.slow
def test_footprint_measure_tiny_equals_the_closed_form_on_every_rank():
    out = moonep_ep_json("footprint", "--measure", "--ranks", "4", "--model", "tiny", "--layers", "8")
    assert out["ok"] and out["ranks"] == 4 and out["layers"] == 8
    assert out["measured_bytes_per_rank"] == out["predicted_bytes_per_rank"]  # OS vs closed form, exactly
    assert out["max_relative_error"] == 0
    for r, row in enumerate(out["per_rank"]):
        assert row["filled"]
        # OS-measured categories (memfd sizes by tag) equal the driver's and the plan's.
        assert row["measured_by_category"]["expert_bytes"] == row["predicted_by_category"]["expert_bytes"]
        assert row["measured_by_category"]["slot_bytes"] == row["predicted_by_category"]["slot_bytes"]
        assert row["resident_bytes"] <= row["measured_bytes"]
    tiny_row = 256 * 512 * 2
    assert out["replicated_bytes_per_rank"] == 8 * (16 + 4) * 3 * tiny_row
    assert out["replicated_over_moonep_ep"] > 1


@pytest.mark.slow
def test_bench_layout_reports_mapping_time_and_one_exchange_round():
    # Kimi K2's counts at a smaller rank count to keep CI short.
    out = moonep_ep_json("bench", "layout", "--ranks", "4", "--layers", "60", "--experts", "384")
    assert out["ok"] and out["handle_exchange_rounds"] == 1
    assert out["mappings_per_rank"] == [60 * 3 * (4 + 1)] * 4  # R owner runs + 1 slot pool per view
    assert all(0 < t < 60 for t in out["map_s_per_rank"])  # 900 mappings per rank: milliseconds each at most

