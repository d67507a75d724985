"""The push layout at any page size (issue 43): each rank's rows of a (layer, tensor) are a run of whole pages of
its own, the first slot bytes in the free tail of the run's last page (per layer), the rest in the pool shared
by the layers. Checked four ways:

* the page arithmetic of ``plan.PushRowsPlan`` against hand-worked examples;
* every shipped model x its checkpoint's format and BF16 x EP 8..72 (where E allows) x pull and push x 2 MiB and
  the host driver's 64 KiB: the store's page decisions (``plan_store``, every view checked as the driver would
  map it, no memory) and ``footprint`` agree byte for byte, or refuse with the same text; the table is printed in
  the run's measured figures, beside the rule the push layout replaced;
* 4 ranks over the host driver at 64 KiB with rows that end inside pages: loaded, pushed into a peer's pool
  for two layers, every byte checked, the slot head per layer and the rest shared, OS bytes = the plan;
* 2 ranks over the CUDA emulator at 2 MiB with Kimi K3 MXFP4's real row bytes (experts cut to 2 a rank):
  a slot filled from the other owner, bytes equal to the owner's, no leak.
"""

from __future__ import annotations

import gc
import zlib
from typing import Any

import pytest
import torch

from moonep_ep.errors import ConfigError, MoonEPError
from moonep_ep.launch import run_ranks
from moonep_ep.layout.footprint import FootprintOptions, model_format, scheme_bytes
from moonep_ep.layout.formats import push_store_projections, store_projections
from moonep_ep.layout.plan import PushRowsPlan, plan_expert_region, plan_tensor, predict_rank_bytes
from moonep_ep.layout.store import ShardedExpertStore, ffn_projections, plan_store
from moonep_ep.models import DEFAULT_MODELS, get_model
from tests.support.memory import run_emulated_ranks

MIB = 1 << 20
GPU_PAGE, HOST_PAGE = 2 * MIB, 64 << 10
EP_SIZES = (8, 16, 32, 48, 64, 72)


# -- the page arithmetic -------------------------------------------------------------------------------------

def test_push_rows_plan_hand_worked():
    # K3 MXFP4 scale rows at EP 8: 112 x 344,064 B = 38,535,168 B = 18.375 pages of 2 MiB -> 19 pages; the free
    # 0.625 page (1,310,720 B) holds the first 3.8 slot rows; the other 37,224,448 B need 17.75 -> 18 pages.
    p = PushRowsPlan(112, 112, 344_064, GPU_PAGE)
    assert (p.own_bytes, p.own_pages, p.boundary) == (38_535_168, 19, True)
    assert (p.head_bytes, p.pool_bytes, p.pool_offset) == (1_310_720, 18 * GPU_PAGE, 786_432)
    assert p.pool_rank_stride == 19 * GPU_PAGE and not p.has_pull_view
    assert (p.pages_of(0), p.pages_of(7), p.data_bytes_in_pages_of(3), p.lead_pad) == (19, 19, 38_535_168, 0)
    # Rows that fill whole pages: no head, the pool rank stride is one pool, the same pages as the pull plan.
    q = PushRowsPlan(112, 112, 5_505_024 // 2 * 2, GPU_PAGE)  # 5.25 MiB x 112 = 294 pages
    assert (q.own_pages, q.boundary, q.head_bytes, q.pool_offset) == (294, False, 0, 0)
    assert q.pool_bytes == q.pool_rank_stride == 294 * GPU_PAGE and q.has_pull_view
    # A head larger than every slot row: the pool rest is empty (K3 MXFP4 scales, 2 experts a rank).
    r = PushRowsPlan(2, 2, 344_064, GPU_PAGE)
    assert (r.own_pages, r.head_bytes, r.pool_bytes, r.pool_rank_stride) == (1, 688_128, 0, GPU_PAGE)


def test_push_plan_against_pull_plan_when_rows_fill_pages():
    """Where each rank's rows fill whole pages the two layouts are the same pages (so the [E+B] view exists)."""
    pull = plan_expert_region(16, 4, 256 * 512 * 2, HOST_PAGE)
    push = PushRowsPlan(4, 4, 256 * 512 * 2, HOST_PAGE)
    assert pull.lead_pad == 0 and all(pull.pages_of(r) == push.pages_of(r) == 16 for r in range(4))
    assert push.has_pull_view


def test_push_slot_count_is_refused_alike_by_store_and_footprint():
    model = get_model("kimi-k2")
    with pytest.raises(ConfigError) as fp:
        scheme_bytes(model, 8, "moonep_ep", FootprintOptions(moonep_api="push", num_slots=4))
    with pytest.raises(ConfigError) as st:
        plan_store(num_layers=60, num_experts=384, ep_size=8, projections=push_store_projections("fp8-block", 7168,
                   2048), num_slots=4, granularity=GPU_PAGE, api="push", rank=3)
    want = "the push layout needs num_slots == E/R: got (4, 48). Fix: use E//R slots for the push API"
    assert str(fp.value).startswith(want) and str(st.value).startswith("[rank 3] " + want)


# -- every shipped shape, plan only ----------------------------------------------------------------------------

def _old_push_rule(E: int, R: int, rows: list[int], gran: int) -> bool:
    """The rule the push layout had before (issue 43): own rows must fill whole pages, no lead pad."""
    return all(plan_expert_region(E, R, rb, gran).lead_pad == 0 and (E // R * rb) % gran == 0 for rb in rows)


def _decide(model, fmt: str, R: int, api: str, gran: int) -> tuple[str, int | None]:
    """(outcome, the largest rank's bytes) from the store's page plan and from footprint, which must agree."""
    tensors = (push_store_projections if api == "push" else store_projections)(fmt, model.hidden_size,
                                                                                 model.moe_intermediate_size)
    E, L, B = model.num_experts, model.num_moe_layers, model.num_experts // R
    try:
        planned = plan_store(num_layers=L, num_experts=E, ep_size=R, projections=tensors, num_slots=B,
                             granularity=gran, api=api, rank=0)
        for rank in range(R):
            planned.check_views(rank)
        store = max(planned.rank_bytes(r)["total_bytes"] for r in range(R))
        store_error = None
    except ConfigError as exc:
        store, store_error = None, str(exc).removeprefix("[rank 0] ")
    try:
        figure = scheme_bytes(model, R, "moonep_ep", FootprintOptions(moonep_api=api, granularity=gran,
                                                                      expert_format=fmt, num_slots=B))
        foot, foot_error = figure["bytes"], None
    except ConfigError as exc:
        foot, foot_error = None, str(exc)
    assert (store, store_error) == (foot, foot_error), (model.name, fmt, R, api, gran)
    # The closed form (plan.py's own loop over the same tensors) gives the same bytes on every rank.
    closed = max(predict_rank_bytes(num_layers=L, num_experts=E, ep_size=R, num_slots=B,
                                    row_bytes=[p.row_bytes for p in tensors], granularity=gran, rank=r, api=api,
                                    roles=[p.role for p in tensors])["total_bytes"] for r in range(R))
    assert closed == store
    return ("builds" if store_error is None else f"refused: {store_error}"), store


@pytest.mark.slow  # about 11 s: out of make mutate's in-process selection (the hand-worked tests above serve it)
def test_every_shipped_shape_builds_in_both_layouts_and_footprint_counts_the_store(report):
    rows, old_refusals, cells = [], 0, 0
    for name in DEFAULT_MODELS:
        model = get_model(name)
        formats = sorted({model_format(model).name, "bf16"})
        for fmt in formats:
            for gran in (GPU_PAGE, HOST_PAGE):
                line = []
                for R in EP_SIZES:
                    if model.num_experts % R:
                        continue
                    push_rows = [p.row_bytes for p in push_store_projections(fmt, model.hidden_size,
                                                                           model.moe_intermediate_size)]
                    old = _old_push_rule(model.num_experts, R, push_rows, gran)
                    old_refusals += not old
                    outcomes = {api: _decide(model, fmt, R, api, gran) for api in ("pull", "push")}
                    cells += 2
                    assert all(o == "builds" for o, _ in outcomes.values()), (name, fmt, R, gran, outcomes)
                    pull_b, push_b = outcomes["pull"][1], outcomes["push"][1]
                    line.append(f"EP{R} {push_b / 2**30:.2f}/{pull_b / 2**30:.2f}"
                                + ("" if old else " (was refused)"))
                if line and gran == GPU_PAGE:
                    rows.append(f"  {name:<20} {fmt:<10} push/pull GiB a rank at 2 MiB: " + ", ".join(line))
    report(f"push and pull layouts, every shipped model x format x EP (plan only, no memory): {cells} cells "
           f"build at 2 MiB and 64 KiB; store plan == footprint == closed form; {old_refusals} push cells the "
           "earlier rule refused now build")
    for row in rows:
        report(row)
    # The cells of the table that the earlier rule refused at 2 MiB (weights or scales)
    k3, k2, k2t = (get_model(n) for n in ("kimi-k3", "kimi-k2", "kimi-k2-thinking"))
    for model, fmt, eps in ((k3, "mxfp4", (8, 16, 32, 64)), (k2, "fp8-block", (8, 16, 32, 64)),
                            (k2t, "int4-g32", (16, 32, 64))):
        rows_b = [p.row_bytes for p in push_store_projections(fmt, model.hidden_size, model.moe_intermediate_size)]
        assert not any(_old_push_rule(model.num_experts, R, rows_b, GPU_PAGE) for R in eps), model.name
    assert _old_push_rule(k2t.num_experts, 8, [p.row_bytes for p in push_store_projections(
        "int4-g32", k2t.hidden_size, k2t.moe_intermediate_size)], GPU_PAGE)  # control: this one built before


def test_push_layout_cost_over_pull_at_k2_and_k3(report):
    """The bytes a rank pays for the push layout's whole-page runs (the largest rank), in MiB."""
    for name, fmt in (("kimi-k3", "mxfp4"), ("kimi-k2", "fp8-block"), ("kimi-k2-thinking", "int4-g32")):
        model = get_model(name)
        cells = []
        for R in (8, 16, 64):
            push = scheme_bytes(model, R, "moonep_ep", FootprintOptions(moonep_api="push"))
            pull = scheme_bytes(model, R, "moonep_ep", FootprintOptions(moonep_api="pull"))
            tensors = push_store_projections(fmt, model.hidden_size, model.moe_intermediate_size)
            epn, L = model.num_experts // R, model.num_moe_layers
            data = (L * epn + epn) * sum(p.row_bytes for p in tensors)
            # Each (layer, tensor) run and each pool wastes under a page.
            assert 0 <= push["bytes"] - data < (L + 1) * len(tensors) * GPU_PAGE
            pull_data = pull["data_bytes"]
            cells.append(f"EP{R} page padding {(push['bytes'] - data) / MIB:.0f} MiB (pull "
                         f"{(pull['bytes'] - pull_data) / MIB:.0f} MiB), push - pull "
                         f"{(push['bytes'] - pull['bytes']) / MIB:+.0f} MiB of {push['bytes'] / 2**30:.1f} GiB")
        report(f"  push layout cost, {name} {fmt}: " + "; ".join(cells))


# -- allocating runs -------------------------------------------------------------------------------------------

def owner_bytes(name: str, layer: int, expert: int, nbytes: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}.{layer}.{expert}".encode()))
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def push_round_trip(ctx: Any, driver_kind: str, specs: list, num_experts: int, layers: int) -> dict[str, Any]:
    """Load, then for each layer push every own row into the next rank's pool, and read the slots back."""
    from moonep_ep.memory import make_driver

    rank, world = ctx.rank, ctx.world_size
    driver = make_driver(driver_kind, rank=rank, **({"granularity": HOST_PAGE} if driver_kind == "host" else {}))
    epn = num_experts // world
    out: dict[str, Any] = {"granularity": driver.granularity(None), "bad": []}
    store = ShardedExpertStore(num_layers=layers, num_experts=num_experts, projections=specs, num_slots=epn,
                               driver=driver, api="push")
    try:
        spec = {p.name: p for p in specs}
        store.load(lambda layer, name, e: owner_bytes(name, layer, e, spec[name].row_bytes)
                   .view(spec[name].dtype).view(spec[name].shape))
        out["boundary"] = {p.name: store.plans[p.name].boundary for p in specs}
        out["pool_bytes"] = {p.name: store.plans[p.name].pool_bytes for p in specs}
        prev, nxt = (rank - 1) % world, (rank + 1) % world
        for layer in range(layers):
            for p in specs:
                store.push_pool(layer, p.name)[nxt].copy_(store.owner_view(layer, p.name))
            store.finish_loading()  # every push landed
            for p in specs:
                got = store.slots(layer, p.name).contiguous().view(torch.uint8).reshape(epn, -1).cpu().clone()
                for j in range(epn):
                    if not torch.equal(got[j], owner_bytes(p.name, layer, prev * epn + j, p.row_bytes)):
                        out["bad"].append((layer, p.name, j))
                own = store.owner_view(layer, p.name).contiguous().view(torch.uint8).reshape(epn, -1).cpu().clone()
                if not all(torch.equal(own[j], owner_bytes(p.name, layer, rank * epn + j, p.row_bytes))
                           for j in range(epn)):
                    out["bad"].append((layer, p.name, "own"))
            store.finish_loading()  # nobody pushes the next layer before every rank read this one
        # Layer 0's slots after layer 1's push: its head bytes are its own, the rest is the shared pool.
        out["head_kept"], out["rest_shared"] = {}, {}
        if layers > 1:
            for p in specs:
                plan = store.plans[p.name]
                s0 = store.slots(0, p.name).contiguous().view(torch.uint8).reshape(-1).cpu().clone()
                want0 = torch.cat([owner_bytes(p.name, 0, prev * epn + j, p.row_bytes) for j in range(epn)])
                want1 = torch.cat([owner_bytes(p.name, 1, prev * epn + j, p.row_bytes) for j in range(epn)])
                out["head_kept"][p.name] = bool(torch.equal(s0[:plan.head_bytes], want0[:plan.head_bytes]))
                out["rest_shared"][p.name] = bool(torch.equal(s0[plan.head_bytes:], want1[plan.head_bytes:]))
        out["physical"] = store.physical_bytes()
        out["planned"] = store.plan.rank_bytes(rank)
        try:
            store.pull_view(0, specs[0].name)
            out["pull_view"] = "built"
        except MoonEPError as exc:
            out["pull_view"] = str(exc)
    finally:
        store.close()
        gc.collect()
    out["leaks"] = {k: v for k, v in driver.live_objects().items() if v}
    return out


def expected_push_bytes(row_bytes: list[int], epn: int, layers: int, gran: int) -> int:
    """Bytes every rank allocates in the push layout, written from the layout's rule: per (layer, tensor) a run of
    ceil(epn*row/gran) pages of its own; the pool (shared by the layers) the slot bytes past the run's last page's
    free tail, page-rounded."""
    total = 0
    for row in row_bytes:
        own = epn * row
        pages = -(-own // gran)
        head = min(pages * gran - own, own)
        total += layers * pages * gran + -(-(own - head) // gran) * gran
    return total


@pytest.mark.slow
def test_push_layout_with_rows_inside_pages_host_driver():
    # BF16 H=320, I=200: a row is 128,000 B; 3 a rank = 384,000 B = 5.86 pages of 64 KiB (a 9,216 B slot head).
    specs = ffn_projections(320, 200)
    results = run_ranks(push_round_trip, 4, args=("host", specs, 12, 2))
    for rank, res in enumerate(results):
        assert res["granularity"] == HOST_PAGE and all(res["boundary"].values())
        assert res["bad"] == [], (rank, res["bad"])
        assert all(res["head_kept"].values()) and all(res["rest_shared"].values())
        assert res["physical"] == res["planned"]
        assert res["physical"]["total_bytes"] == expected_push_bytes([p.row_bytes for p in specs], 3, 2, HOST_PAGE)
        assert "has no [E+B] pull view at this page size" in res["pull_view"] and "Fix:" in res["pull_view"]
        assert res["leaks"] == {}


@pytest.mark.slow
@pytest.mark.cuda_emulated
def test_k3_mxfp4_real_row_bytes_push_layout_at_2mib_cuda_emulator(report):
    """Kimi K3 MXFP4's real rows (gate/up [3072, 1792] and down [3584, 1536] bytes, E8M0 scales 344,064 B), 2
    experts a rank: 5.25 pages of weights (a 0.75-page head) and 0.33 page of scales (every slot row in the head,
    no pool rest) per (layer, tensor)."""
    specs = push_store_projections("mxfp4", 3584, 3072)
    assert [p.row_bytes for p in specs] == [5_505_024, 344_064] * 3
    results = run_emulated_ranks(push_round_trip, 2, args=("cuda", specs, 4, 2), timeout_s=300)
    for rank, res in enumerate(results):
        assert res["granularity"] == GPU_PAGE
        assert all(res["boundary"].values())
        assert res["pool_bytes"] == {"gate": 5 * GPU_PAGE, "gate_scale": 0, "up": 5 * GPU_PAGE, "up_scale": 0,
                                     "down": 5 * GPU_PAGE, "down_scale": 0}
        assert res["bad"] == [], (rank, res["bad"])
        assert all(res["head_kept"].values()) and all(res["rest_shared"].values())
        assert res["physical"] == res["planned"]
        assert res["physical"]["total_bytes"] == expected_push_bytes([p.row_bytes for p in specs], 2, 2, GPU_PAGE)
        assert res["leaks"] == {}
    report(f"K3 MXFP4 real rows, push layout at 2 MiB over the CUDA emulator: 2 ranks, 2 layers, "
           f"{results[0]['physical']['total_bytes'] / MIB:.0f} MiB a rank (emulator handles), every slot byte "
           "equal to its owner's")


def poison_covers_every_slot(ctx: Any) -> dict[str, Any]:
    """``slot_views`` of the push layout, filled with a poison, leave no slot byte of any layer unpoisoned."""
    from moonep_ep.memory.host import HostDriver

    specs = ffn_projections(320, 200)
    store = ShardedExpertStore(num_layers=3, num_experts=12, projections=specs, num_slots=6, driver=HostDriver(
        rank=ctx.rank, granularity=HOST_PAGE), api="push")
    try:
        for layer in range(3):
            store.slots(layer, "up").view(torch.int16).fill_(7)
        views = store.slot_views("up")
        counts = [v.shape[0] for v in views]
        for v in views:
            v.view(torch.int16).fill_(-1)
        del views
        clean = [bool(store.slots(layer, "up").view(torch.int16).eq(-1).all()) for layer in range(3)]
    finally:
        store.close()
    return {"counts": counts, "clean": clean}


def test_slot_views_cover_every_slot_byte_of_the_push_layout():
    # 6 rows of 128,000 B a rank = 11.7 pages of 64 KiB: an 18,432 B head (part of 1 row) in each layer; 3 layers.
    results = run_ranks(poison_covers_every_slot, 2)
    for res in results:
        assert res["counts"] == [6, 1, 1] and res["clean"] == [True] * 3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_k3_mxfp4_real_row_bytes_push_layout_on_a_real_gpu():
    """The same run as over the emulator, on GPU 0 with two ranks over CUDA VMM (POSIX fds, gloo metadata)."""
    specs = push_store_projections("mxfp4", 3584, 3072)
    for rank, res in enumerate(run_ranks(push_round_trip, 2, args=("cuda", specs, 4, 2), backend="gloo",
                                         use_cuda=True, timeout_s=300)):
        assert res["granularity"] % GPU_PAGE == 0 and res["bad"] == [], (rank, res)
        assert all(res["head_kept"].values()) and all(res["rest_shared"].values())
        assert res["physical"] == res["planned"] and res["leaks"] == {}, res


def test_the_layout_name_and_the_push_slot_count_are_refused_in_words():
    """The page plan's two refusals, word for word (house format: what, the value, the fix), each with a
    control that passes: a layout other than pull or push, and a push plan whose slots are not E/R."""
    with pytest.raises(ConfigError) as info:
        plan_tensor("sideways", 8, 2, 4, 4096, 4096)
    assert str(info.value) == ("the layout must be pull or push: got 'sideways'. "
                               "Fix: pass api='pull' or api='push'")
    assert plan_tensor("pull", 8, 2, 4, 4096, 4096)[1] == 4 * 4096          # control: pull plans
    rows = [4096, 4096, 4096]
    with pytest.raises(ConfigError) as info:
        predict_rank_bytes(num_layers=2, num_experts=8, ep_size=2, num_slots=3, row_bytes=rows,
                           granularity=4096, api="push")
    assert str(info.value) == ("the push layout needs num_slots == E/R: got (3, 4). Fix: use E//R slots for the "
                               "push API (MoonEP's release fixes it), or the pull API")
    # Controls: E/R slots plan, on one rank too (E/R = E), and pull takes any slot count.
    one_rank = predict_rank_bytes(num_layers=2, num_experts=8, ep_size=1, num_slots=8, row_bytes=rows,
                                  granularity=4096, api="push")
    assert one_rank["slot_bytes"] == 3 * PushRowsPlan(8, 8, 4096, 4096).pool_bytes
    two_ranks = predict_rank_bytes(num_layers=2, num_experts=8, ep_size=2, num_slots=4, row_bytes=rows,
                                   granularity=4096, api="push")
    assert all(type(v) is int for v in (*one_rank.values(), *two_ranks.values())), (one_rank, two_ranks)  # bytes
    assert predict_rank_bytes(num_layers=2, num_experts=8, ep_size=2, num_slots=3, row_bytes=rows,
                              granularity=4096)["slot_bytes"] == 3 * 3 * 4096
