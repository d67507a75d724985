"""Quantized experts in the sharded store: a projection is a weight plus its scales, one row index for all.

Four real ranks over the host driver (shared memfd pages): every tensor of
every format lands in its owner's pages, row ``e`` of every rank's view is
the owner's bytes for weights and scales alike, a slot fill (ops' pull)
moves the scales with the weight, and the accounting counts scales apart,
equal to the page plan and to the OS.
"""

from __future__ import annotations

import gc
import zlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import torch

from moonep_ep.layout.footprint import rank_bytes_closed_form
from moonep_ep.layout.formats import expert_projections
from moonep_ep.layout.plan import predict_rank_bytes
from moonep_ep.layout.store import ShardedExpertStore
from moonep_ep.memory.accounting import snapshot
from moonep_ep.memory.host import HostDriver
from moonep_ep.ops.moonep.prefetch import pull_slots, wait_for_slots
from moonep_ep.launch import run_ranks
from tests.support.cli import moonep_ep_json
from tests.support.hypothesis_budget import max_examples

H, I, E, L = 512, 256, 16, 3
GRAN = 64 << 10


def row_bytes(layer: int, name: str, expert: int, nbytes: int) -> torch.Tensor:
    """Distinct raw bytes per (layer, tensor, expert): raw, so fp8/int32/uint8 compare bit for bit."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{layer}.{name}.{expert}".encode()))  # same on every rank
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def quantized_store(ctx: Any, fmt: str) -> dict[str, Any]:
    rank, world = ctx.rank, ctx.world_size
    driver = HostDriver(rank=rank, granularity=GRAN)
    projs = expert_projections(fmt, H, I)
    epn = E // world
    store = ShardedExpertStore(num_layers=L, num_experts=E, projections=projs, num_slots=epn, driver=driver)
    out: dict[str, Any] = {}
    try:
        def loader(layer: int, name: str, expert: int) -> torch.Tensor:
            p = next(q for q in projs if q.name == name)
            return row_bytes(layer, name, expert, p.row_bytes).view(p.dtype).view(p.shape)

        store.load(loader)
        out["bad_rows"] = [(layer, p.name, e) for layer in range(L) for p in projs for e in range(E)
                           if not torch.equal(_bytes(store.pull_view(layer, p.name)[e]),
                                              row_bytes(layer, p.name, e, p.row_bytes))]
        # A fill through ops' pull: the remote experts of the next rank, for layer 1.
        layer, remote = 1, [((rank + 1) % world) * epn + j for j in range(epn)]
        full = {p.name: store.pull_view(layer, p.name) for p in projs}
        tally: dict[str, int] = {}
        copies, by_expert, event = pull_slots(full, remote, E, bytes_by_tensor=tally)
        wait_for_slots(event)
        out["copies"] = copies
        out["tally"] = tally
        out["by_expert"] = {int(k): v for k, v in by_expert.items()}
        out["slot_mismatch"] = [(p.name, b) for p in projs for b, e in enumerate(remote)
                                if not torch.equal(_bytes(store.slots(layer, p.name)[b]),
                                                   row_bytes(layer, p.name, e, p.row_bytes))]
        # Negative control: a fill given the weights only leaves every scale slot stale.
        weights_only = {p.name: store.pull_view(2, p.name) for p in projs if p.role == "weight"}
        wait_for_slots(pull_slots(weights_only, remote, E)[2])
        out["stale_scale_slots"] = [(p.name, b) for p in projs if p.role == "scale" for b, e in enumerate(remote)
                                    if not torch.equal(_bytes(store.slots(2, p.name)[b]),
                                                       row_bytes(2, p.name, e, p.row_bytes))]
        out["physical"] = store.physical_bytes()
        out["os_bytes"] = snapshot(rank).own_bytes
        out["page_aligned_runs"] = all(off % store.granularity == 0 for off in store.expert_offsets[rank].values())
        out["granularity"] = store.granularity
    finally:
        del full, weights_only
        store.close()
        gc.collect()
        out["leaks"] = {k: v for k, v in driver.live_objects().items() if v}
        driver.close()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["fp8-block", "int4-g32", "mxfp4"])
def test_quantized_store_rows_fills_and_accounting_on_four_ranks(fmt):
    projs = expert_projections(fmt, H, I)
    results = run_ranks(quantized_store, 4, args=(fmt,))
    epn = E // 4
    rows, roles = [p.row_bytes for p in projs], [p.role for p in projs]
    weight_row = sum(p.row_bytes for p in projs if p.role == "weight")
    scale_row = sum(p.row_bytes for p in projs if p.role == "scale")
    # Scale bytes of one expert, from the formats' shapes at H = 512, I = 256: fp8-block fp32 per 128x128
    # block, w13 [2*2, 4] + w2 [4, 2] = 24 values * 4 B; int4-g32 bf16 per 32 along in, w13 [512, 16] +
    # w2 [512, 8] = 12288 values * 2 B; mxfp4 e8m0 (1 B) per 32, the same 12288 values.
    assert scale_row == {"fp8-block": 96, "int4-g32": 24576, "mxfp4": 12288}[fmt]
    for rank, res in enumerate(results):
        assert res["bad_rows"] == [], (rank, res["bad_rows"][:3])   # weights AND scales, every owner
        # The fill moved every tensor of the row: weights and scales, counted apart at the copy.
        assert res["slot_mismatch"] == []
        assert res["copies"] == epn * len(projs)
        assert res["tally"] == {p.name: epn * p.row_bytes for p in projs}
        assert sum(v for k, v in res["tally"].items() if "scale" in k) == epn * scale_row
        assert set(res["by_expert"].values()) == {weight_row + scale_row}
        # The negative control is caught: without the scales, every scale slot is stale.
        assert len(res["stale_scale_slots"]) == epn * sum(1 for r in roles if r == "scale")
        # Accounting: scales apart from weights, equal to the page plan, the closed form and the OS.
        phys = res["physical"]
        plan = predict_rank_bytes(num_layers=L, num_experts=E, ep_size=4, num_slots=epn, row_bytes=rows,
                                  granularity=GRAN, rank=rank, roles=roles)
        closed = rank_bytes_closed_form(num_layers=L, num_experts=E, ep_size=4, num_slots=epn, row_bytes=rows,
                                        granularity=GRAN, rank=rank, roles=roles)
        assert phys["weight_bytes"] + phys["scale_bytes"] == phys["total_bytes"] == res["os_bytes"]
        assert (phys["weight_bytes"], phys["scale_bytes"]) == (plan["weight_bytes"], plan["scale_bytes"])
        assert (closed["weight_bytes"], closed["scale_bytes"]) == (plan["weight_bytes"], plan["scale_bytes"])
        assert res["page_aligned_runs"]
        assert res["leaks"] == {}
    # Hand-worked pages (64 KiB) of scales over the 4 ranks: each scale tensor's expert region of each of
    # the 3 layers is cut into pages (16 expert rows: fp8 1 + 1, int4 4 + 2, mxfp4 2 + 1 pages per layer),
    # and each rank's 4 slot rows of each of the 2 scale tensors take one page (8 pages in all).
    pages = {"fp8-block": 3 * 2 + 8, "int4-g32": 3 * 6 + 8, "mxfp4": 3 * 3 + 8}[fmt]
    assert sum(r["physical"]["scale_bytes"] for r in results) == pages * GRAN


@given(tensors=st.lists(st.tuples(st.integers(1, 3 << 20), st.sampled_from(["weight", "scale"])),
                        min_size=1, max_size=5),
       E_R=st.sampled_from([(8, 2), (16, 4), (384, 64), (896, 64), (128, 8)]),
       gran=st.sampled_from([4096, 64 << 10, 2 << 20]), layers=st.integers(1, 3), slots=st.integers(1, 8),
       pools=st.sampled_from([1, 2]))
@settings(max_examples=max_examples(200), deadline=None)
def test_closed_form_equals_the_page_plan_with_scale_tensors(tensors, E_R, gran, layers, slots, pools):
    E_, R = E_R
    rows, roles = [t[0] for t in tensors], [t[1] for t in tensors]
    for rank in sorted({0, 1, R // 2, R - 1}):
        kw = dict(num_layers=layers, num_experts=E_, ep_size=R, num_slots=slots, row_bytes=rows, granularity=gran,
                  rank=rank, slot_pools=pools, roles=roles)
        loop, closed = predict_rank_bytes(**kw), rank_bytes_closed_form(**kw)
        assert closed == {k: loop[k] for k in closed}, (rank, loop, closed)
        assert loop["weight_bytes"] + loop["scale_bytes"] == loop["total_bytes"]


@pytest.mark.slow
def test_footprint_measure_quantized_tiny_equals_the_prediction():
    """Host driver: measured by the OS (memfd sizes by tag)."""
    out = moonep_ep_json("footprint", "--measure", "--ranks", "4", "--model", "tiny", "--layers", "4",
                         "--format", "int4-g32")
    assert out["ok"] and out["format"] == "int4-g32" and out["driver"] == "host"
    assert out["measured_bytes_per_rank"] == out["predicted_bytes_per_rank"]  # OS vs closed form, exactly
    for row in out["per_rank"]:
        assert row["filled"]
        m, p = row["measured_by_category"], row["predicted_by_category"]
        assert (m["expert_bytes"], m["slot_bytes"]) == (p["expert_bytes"], p["slot_bytes"])
        assert row["driver_bytes"]["scale_bytes"] == p["scale_bytes"] > 0
        assert row["driver_bytes"]["weight_bytes"] == p["weight_bytes"]
    assert out["expert_scale_bytes"] == 3 * 512 * 256 // 32 * 2  # one bf16 scale per 32 values


@pytest.mark.slow
@pytest.mark.cuda_emulated
def test_footprint_measure_quantized_tiny_over_the_cuda_emulator(monkeypatch):
    """CUDA driver over the emulator: the device bytes it holds equal the prediction, MXFP4 layout."""
    monkeypatch.setenv("MOONEP_EP_CUDA_EMULATOR", "1")
    monkeypatch.setenv("MOONEP_EP_CUDA_EMULATOR_NODE", "H100x8")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    out = moonep_ep_json("footprint", "--measure", "--ranks", "4", "--model", "tiny", "--layers", "4",
                         "--format", "mxfp4", "--driver", "cuda")
    assert out["ok"] and out["driver"] == "cuda" and out["emulated"] and out["format"] == "mxfp4"
    assert out["measured_bytes_per_rank"] == out["predicted_bytes_per_rank"]
    assert all(r["driver_bytes"]["scale_bytes"] == r["predicted_by_category"]["scale_bytes"] > 0
               for r in out["per_rank"])
