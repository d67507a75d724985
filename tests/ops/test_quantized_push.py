"""Quantized pushes (issue 38): the push path leaves the same slot bytes as the pull path.

One fixed plan on 2 real gloo ranks: every token of both ranks is routed to experts 0..7 (rank 0's), so
the planner hands some of them to rank 1's slots. One sharded store per run holds a BF16 set and an
MXFP4-like set (uint8 weight ``[N, K/2]`` plus E8M0 scales padded per expert to 16 KiB, the push layout);
its pull ``[E+B]`` views and push views (``push_pool``, ``push_view``) are one physical layout.
The slots are poisoned, filled by a pull through the reference buffer, poisoned again, filled by a push
(weights and scales in the same call), and every slot row's bytes are compared, weights and scales, over
the host driver and over the CUDA driver emulator. Controls: the poison is gone from every used slot
(and equals the owner's bytes, built here independently); a push without the scales leaves every used
scale slot stale; a deliberately wrong plan row gives different bytes. The entry check refuses bad scales
on every rank. The footprint of the push layout for Kimi K2's FP8-block scales at EP 8/16/64 is checked
against a page computation written here.
"""

from __future__ import annotations

import gc
import zlib
from typing import Any

import pytest
import torch

from moonep_ep.errors import CollectiveError
from moonep_ep.launch import run_ranks
from moonep_ep.layout.footprint import FootprintOptions, scheme_bytes
from moonep_ep.layout.formats import expert_projections, push_projections, push_store_projections, scale_data_view
from moonep_ep.layout.store import ProjectionSpec, ShardedExpertStore
from moonep_ep.models import get_model
from moonep_ep.ops.moonep.pull import ReferenceBuffer
from moonep_ep.ops.moonep.prefetch import pull_slots, wait_for_slots
from tests.layout.test_push_layout import expected_push_bytes
from tests.support.cli import moonep_ep_json
from tests.support.memory import run_emulated_ranks
from moonep_ep.ops.moonep.push import push_prefetch

# 2 ranks, E = 256 (epn = 128): every tensor's run of epn rows fills whole 2 MiB pages (the emulator's
# page; push compute views need it), the 16 KiB scale rows included (128 x 16 KiB = 2 MiB).
E, WORLD, EPN, TOKEN_H, K, S = 256, 2, 128, 128, 2, 16
POISON = 0xA5
PROJ = ("gate", "up", "down")
BF16 = [ProjectionSpec(p, (128, 128), torch.bfloat16) for p in PROJ]            # 32 KiB a row
MXFP4_REAL_SCALE = (256, 8)        # E8M0, one byte per 32 of K = 256 values: 2 KiB an expert
QUANT = []
for _p in PROJ:
    QUANT.append(ProjectionSpec(f"q{_p}", (256, 128), torch.uint8, role="weight", projection=f"q{_p}"))  # [N, K/2]
    # 2,048 B rounded up to 16 KiB = [128, 128] bytes: the push layout, by hand.
    QUANT.append(ProjectionSpec(f"q{_p}_scale", (128, 128), torch.uint8, role="scale", projection=f"q{_p}"))
SPECS = BF16 + QUANT
REAL_SCALE_BYTES = 256 * 8


def owner_bytes(name: str, expert: int, nbytes: int) -> torch.Tensor:
    """Expert ``expert``'s raw bytes of tensor ``name`` (the same on every rank; scales: 2 KiB of data, zero tail)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}.{expert}".encode()))
    data = nbytes if not name.endswith("_scale") else REAL_SCALE_BYTES
    out = torch.zeros(nbytes, dtype=torch.uint8)
    out[:data] = torch.randint(0, 256, (data,), dtype=torch.uint8, generator=gen)
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], -1).clone()


def push_vs_pull(ctx: Any, driver_kind: str) -> dict[str, Any]:
    from moonep_ep.memory import make_driver

    rank = ctx.rank
    driver = make_driver(driver_kind, rank=rank, **({"granularity": 64 << 10} if driver_kind == "host" else {}))
    out: dict[str, Any] = {"driver": type(driver).__name__, "emulated": bool(getattr(driver, "emulated", False))}
    store = ShardedExpertStore(num_layers=1, num_experts=E, projections=SPECS, num_slots=EPN, driver=driver,
                               api="push")
    buf = ReferenceBuffer(S, TOKEN_H, K, E, WORLD, explicitly_destroy=True)
    try:
        out["granularity"] = store.granularity
        store.load(lambda layer, name, e: owner_bytes(name, e, next(p.row_bytes for p in SPECS if p.name == name))
                   .view(next(p.dtype for p in SPECS if p.name == name)).view(next(p.shape for p in SPECS
                                                                                 if p.name == name)))
        ids = torch.tensor([[(2 * t) % 8, (2 * t + 1) % 8] for t in range(S)], dtype=torch.int32)
        x = torch.full((S, TOKEN_H), float(rank + 1), dtype=torch.bfloat16)
        tpe = torch.bincount(ids.reshape(-1).long(), minlength=E).to(torch.int32)
        _, _, _, plan = buf.dispatch(x, torch.full((S, K), 0.5), ids, tpe)
        table = plan.global_plan.experts_to_copy.tolist()
        out["table"] = table
        row = table[rank]
        pull_views = {p.name: store.pull_view(0, p.name) for p in SPECS}

        def poison() -> None:
            for p in SPECS:
                store.slots(0, p.name).view(torch.uint8).fill_(POISON)
            store.finish_loading()  # no peer pushes into a pool before its owner poisoned it

        def snapshot() -> dict[str, torch.Tensor]:
            return {p.name: _bytes(store.slots(0, p.name)) for p in SPECS}

        def full_kw(names: tuple, scales: bool) -> dict:
            kw = {f"full_{p}_weight": pull_views[n] for p, n in zip(PROJ, names)}
            if scales:
                kw.update({f"full_{p}_scale": pull_views[f"{n}_scale"] for p, n in zip(PROJ, names)})
            return kw

        def push_kw(names: tuple, scales: bool) -> dict:
            kw = {f"local_{p}_weight": store.owner_view(0, n) for p, n in zip(PROJ, names)}
            kw.update({f"{p}_prefetch_buffer": store.push_pool(0, n) for p, n in zip(PROJ, names)})
            if scales:
                kw.update({f"local_{p}_scale": store.owner_view(0, f"{n}_scale") for p, n in zip(PROJ, names)})
                kw.update({f"{p}_scale_prefetch_buffer": store.push_pool(0, f"{n}_scale") for p, n in zip(PROJ, names)})
            return kw

        bf16_names, q_names = PROJ, tuple(f"q{p}" for p in PROJ)
        # -- pull ([E+B] views, scales with the weights) --
        poison()
        buf.prefetch_weight(plan, **full_kw(bf16_names, False))
        buf.prefetch_weight(plan, **full_kw(q_names, True))
        pulled = snapshot()
        out["pull_generation"] = buf.last_prefetch.api
        # -- push (local + pools, scales in the same call), the pull plan's slots --
        store.finish_loading()  # every rank has read its pulled slots before peers push into them
        poison()
        push_prefetch(buf, plan, **push_kw(bf16_names, False))
        push_prefetch(buf, plan, **push_kw(q_names, True))
        pushed = snapshot()
        stats = buf.last_prefetch
        out["push_generation"], out["push_by_tensor"] = stats.api, dict(stats.bytes_by_tensor)
        used = [(b, e) for b, e in enumerate(row) if e >= 0]
        unused = [b for b, e in enumerate(row) if e < 0]
        out["used"] = used
        out["same_bytes"] = {n: torch.equal(pulled[n], pushed[n]) for n in pulled}
        poison_row = {n: torch.full_like(pulled[n][0], POISON) for n in pulled}
        out["owner_bytes_pulled"] = all(torch.equal(pulled[p.name][b], owner_bytes(p.name, e, p.row_bytes))
                                        for p in SPECS for b, e in used)
        out["poison_gone"] = all(not torch.equal(snap[n][b], poison_row[n]) for snap in (pulled, pushed)
                                 for n in pulled for b, _ in used)
        out["unused_still_poison"] = all(torch.equal(snap[n][b], poison_row[n]) for snap in (pulled, pushed)
                                         for n in pulled for b in unused)
        # One physical layout: the push compute view's slot half shows the same bytes.
        out["compute_view_same"] = all(torch.equal(_bytes(store.push_view(0, n)[EPN:]), pushed[n]) for n in pushed)
        # The kernels' reading of a padded scale row: the 2 KiB of E8M0 data, [256, 8], no copy.
        real = ProjectionSpec("qgate_scale", MXFP4_REAL_SCALE, torch.uint8, role="scale")
        view = scale_data_view(store.slots(0, "qgate_scale"), real)
        out["scale_view"] = (tuple(view.shape), all(torch.equal(view[b].reshape(-1),
                                                                 owner_bytes("qgate_scale", e, 16384)[:REAL_SCALE_BYTES])
                                                    for b, e in used))
        # -- negative control 1: weights pushed without their scales leave every used scale slot stale --
        store.finish_loading()
        poison()
        push_prefetch(buf, plan, **push_kw(q_names, False))
        stale = snapshot()
        out["stale_scale_slots"] = sum(not torch.equal(stale[f"{n}_scale"][b], pulled[f"{n}_scale"][b])
                                       for n in q_names for b, _ in used)
        out["weights_only_fresh"] = all(torch.equal(stale[n][b], pulled[n][b]) for n in q_names for b, _ in used)
        # -- negative control 2: a wrong plan row (each used slot names the next expert) --
        store.finish_loading()
        wrong = [(e + 1) % E if e >= 0 else -1 for e in row]
        wait_for_slots(pull_slots(pull_views, wrong, E)[2])
        wrong_snap = snapshot()
        out["wrong_plan_differs"] = sum(not torch.equal(wrong_snap[n][b], pushed[n][b]) for n in pushed for b, _ in used)
        store.finish_loading()
        out["errors"] = _bad_inputs(buf, plan, store, rank)
        del view, pull_views
    finally:
        buf.destroy()
        store.close()
        gc.collect()
        driver.close()
    return out


def _bad_inputs(buf: ReferenceBuffer, plan: Any, store: ShardedExpertStore, rank: int) -> dict[str, str]:
    """Each bad call is made on rank 1 only (rank 0 makes a valid one): every rank must raise."""
    good = {f"local_{p}_weight": store.owner_view(0, f"q{p}") for p in PROJ}
    good.update({f"{p}_prefetch_buffer": store.push_pool(0, f"q{p}") for p in PROJ})
    scales = {f"local_{p}_scale": store.owner_view(0, f"q{p}_scale") for p in PROJ}
    scales.update({f"{p}_scale_prefetch_buffer": store.push_pool(0, f"q{p}_scale") for p in PROJ})
    bf16 = {f"local_{p}_weight": store.owner_view(0, p) for p in PROJ}
    bf16.update({f"{p}_prefetch_buffer": store.push_pool(0, p) for p in PROJ})
    unpadded = {f"local_{p}_scale": torch.zeros(EPN, *MXFP4_REAL_SCALE, dtype=torch.uint8) for p in PROJ}
    unpadded.update({f"{p}_scale_prefetch_buffer": torch.zeros(WORLD, EPN, *MXFP4_REAL_SCALE, dtype=torch.uint8)
                     for p in PROJ})
    wrong_pool = dict(scales, gate_scale_prefetch_buffer=torch.zeros(WORLD, EPN, 64, 256, dtype=torch.uint8))
    cases = {
        "scales_with_bf16": {**bf16, **scales},
        "scale_not_16k": {**good, **unpadded},
        "scale_pool_shape": {**good, **wrong_pool},
        "some_scales": {**good, **{k: v for k, v in scales.items() if k.startswith("local_")}},
    }
    out = {}
    for name, kw in cases.items():
        try:
            push_prefetch(buf, plan, **(kw if rank == 1 else {**good, **scales}))
            out[name] = "no error"
        except CollectiveError as exc:
            out[name] = str(exc)
    return out


def _check(results: list[dict[str, Any]]) -> None:
    tables = [r["table"] for r in results]
    assert tables[0] == tables[1]
    table = tables[0]
    # The fixed plan fills rank 1's slots from rank 0 (the owner of experts 0..7); rank 0 fetches nothing.
    assert all(e < 0 for e in table[0]) and results[1]["used"]
    assert all(0 <= e < 8 for _, e in results[1]["used"])
    pushed_by_owner0 = sum(1 for row in table for e in row if 0 <= e < EPN)
    for rank, res in enumerate(results):
        assert (res["pull_generation"], res["push_generation"]) == ("pull", "push")
        assert res["same_bytes"] == {p.name: True for p in SPECS}, (rank, res["same_bytes"])
        assert res["owner_bytes_pulled"] and res["poison_gone"] and res["unused_still_poison"], rank
        assert res["compute_view_same"], rank
        assert res["scale_view"] == ((EPN, 256, 8), True)
        n_used = len(res["used"])
        assert res["stale_scale_slots"] == 3 * n_used and (n_used == 0 or res["weights_only_fresh"])
        assert res["wrong_plan_differs"] == len(SPECS) * n_used
        # The last push (MXFP4 set, scales) counted at the copy on its pusher: weights and scales apart.
        n = pushed_by_owner0 if rank == 0 else 0
        want = {p: n * 256 * 128 for p in PROJ} | {f"{p}_scale": n * 16384 for p in PROJ} if n else {}
        assert res["push_by_tensor"] == want, (rank, res["push_by_tensor"])
        errors = res["errors"]
        for case, needle in (("scales_with_bf16", "torch.bfloat16"), ("scale_not_16k", "got 2048"),
                             ("scale_pool_shape", "[2, 128, 64, 256]"), ("some_scales", "all three")):
            assert "[rank 1]" in errors[case] and needle in errors[case] and "Fix:" in errors[case], (case, errors[case])


def test_push_equals_pull_bf16_and_mxfp4_scales_host_driver():
    results = run_ranks(push_vs_pull, WORLD, args=("host",), timeout_s=240)
    assert results[0]["driver"] == "HostDriver" and results[0]["granularity"] == 64 << 10
    _check(results)


@pytest.mark.cuda_emulated
def test_push_equals_pull_bf16_and_mxfp4_scales_cuda_emulator():
    results = run_emulated_ranks(push_vs_pull, WORLD, args=("cuda",), timeout_s=240)
    assert results[0]["driver"] == "CudaDriver" and results[0]["emulated"] and results[0]["granularity"] == 2 << 20
    _check(results)


# -- the push layout of FP8-block scales: Kimi K2 (H 7168, I 2048, E 384, L 60), 2 MiB pages --

def _k2_pages(R: int, rows: list[int], g: int = 2 << 20, L: int = 60, E_: int = 384) -> list[int]:
    """Bytes each rank allocates, page by page: a tensor's [E] rows start after a lead pad that ends the
    rows on a page boundary; page j belongs to the rank owning its first data byte; slots ceil(epn*row/g)."""
    epn = E_ // R
    per_rank = [0] * R
    for row in rows:
        lead = (-E_ * row) % g
        for j in range(-(-(E_ * row + lead) // g)):
            per_rank[min(max(j * g - lead, 0) // (epn * row), R - 1)] += L * g
        for r in range(R):
            per_rank[r] += -(-epn * row // g) * g
    return per_rank


def _k2_push_pages(R: int, rows: list[int]) -> int:
    """Bytes every rank allocates in the push layout at 2 MiB pages (60 layers, 384 experts)."""
    return expected_push_bytes(rows, 384 // R, 60, 2 << 20)


def test_fp8_block_push_layout_footprint_at_k2_ep_8_16_64():
    """The push store (gate, up, down apart, as the release's prefetch_weight takes them) pads each FP8-block
    scale row to 16 KiB: K2's gate and up scales [16, 56] fp32 and down [56, 16] are 3,584 B each; each
    rank's rows of a (layer, tensor) are whole pages of its own (the layout maps at 2 MiB)."""
    H, I = 7168, 2048
    w13, w2 = 2 * I * H, H * I                                           # fp8: one byte a value
    s13, s2 = 2 * (I // 128) * (H // 128) * 4, (H // 128) * (I // 128) * 4  # fp32 per 128x128 block
    assert (s13, s2) == (7168, 3584)
    gate = I * H
    push_rows = [gate, 16384, gate, 16384, w2, 16384]
    assert [p.row_bytes for p in push_store_projections("fp8-block", H, I)] == push_rows
    assert [p.row_bytes for p in push_projections(expert_projections("fp8-block", H, I))] == [w13, 16384, w2, 16384]
    k2 = get_model("kimi-k2")
    grown = {}
    for R in (8, 16, 64):
        epn = 384 // R
        pull = scheme_bytes(k2, R, "moonep_ep", FootprintOptions(moonep_api="pull"))
        push = scheme_bytes(k2, R, "moonep_ep", FootprintOptions(moonep_api="push"))
        totals = _k2_pages(R, [w13, s13, w2, s2])
        top = totals.index(max(totals))
        scales = _k2_pages(R, [s13, s2])
        assert (pull["bytes"], pull["rank"], pull["scale_bytes"]) == (totals[top], top, scales[top]), R
        # Push: every rank alike, so the first is the largest.
        assert (push["bytes"], push["rank"], push["scale_bytes"]) == (
            _k2_push_pages(R, push_rows), 0, _k2_push_pages(R, [16384] * 3)), R
        # Without pages, the padding costs (L*epn + B) * (3*16384 - 7168 - 3584) bytes on every rank ...
        assert push["push_scale_padding_bytes"] == (60 * epn + epn) * (3 * 16384 - s13 - s2) and \
            pull["push_scale_padding_bytes"] == 0
        # ... the whole-page runs against the pull page plan of the same six tensors on that rank ...
        shared = _k2_pages(R, push_rows)[0]
        assert push["push_page_bytes_over_pull"] == push["bytes"] - shared, R
        grown[R] = (push["bytes"] - pull["bytes"], push["push_page_bytes_over_pull"])
    # Every run wastes under one page and every pool under one: the push layout's cost over its data bytes.
    for R in grown:
        epn = 384 // R
        push = scheme_bytes(k2, R, "moonep_ep", FootprintOptions(moonep_api="push"))
        data = (60 * epn + epn) * sum(push_rows)
        assert 0 <= push["bytes"] - data < (60 + 1) * len(push_rows) * (2 << 20), R


def test_footprint_cli_prints_the_push_layout():
    out = moonep_ep_json("footprint", "--model", "kimi-k2", "--ep", "8,16,64", "--moonep-api", "push")
    assert out["assumptions"]["moonep_api"] == "push"
    for ep in ("8", "16", "64"):
        ours = out["models"]["kimi-k2"]["ep"][ep]["schemes"]["moonep_ep"]
        assert ours["moonep_api"] == "push" and ours["expert_bytes_as_stored"] == 4096 * 7168 + 7168 * 2048 + 3 * 16384
        assert ours["push_scale_padding_bytes"] == (60 + 1) * (384 // int(ep)) * (3 * 16384 - 7168 - 3584)
