"""The plugin's model-wide store, written in passes (no vLLM needed): 2 gloo ranks over the host driver.

Each case runs on both ranks and asserts on what every rank saw: rows land
in the owner's pages and read the same from every rank, a pass settles on
every rank at once, refusals and missing rows raise on all ranks with every
rank's message, an update whose shape or dtype differs writes nothing, and
every settled pass leaves no expert copy in the slot pool.
"""

from __future__ import annotations

import pytest
import torch

from moonep_ep.errors import CollectiveError
from moonep_ep.launch import run_ranks
from moonep_ep.vllm.store.sharded import ModelExpertStore
from tests.support.memory import GRAN

pytestmark = pytest.mark.slow

E, H, I, L, B = 8, 256, 128, 2, 4
SHAPES = {"gate": (I, H), "up": (I, H), "down": (H, I)}


def _row(seed: int, layer: int, proj: str, expert: int, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100_003 + layer * 1009 + expert * 7 + len(proj))
    return torch.randn(*SHAPES[proj], generator=g).to(dtype)


def _store(rank: int) -> ModelExpertStore:
    from moonep_ep.memory.host import HostDriver

    return ModelExpertStore(layer_names=[f"l{i}" for i in range(L)], num_experts=E, hidden=H, intermediate=I,
                            num_slots=B, group=None, device=torch.device("cpu"),
                            driver=HostDriver(rank=rank, granularity=GRAN))


def _write_all(store: ModelExpertStore, seed: int, rank: int, dtype=torch.bfloat16, skip=None) -> None:
    epn = E // 2
    for layer in range(L):
        for proj in SHAPES:
            for j in range(epn):
                if skip != (layer, proj, j):
                    store.write_expert(layer, proj, j, _row(seed, layer, proj, rank * epn + j, dtype), "t")


def _rows_are(store: ModelExpertStore, seed: int) -> bool:
    return all(torch.equal(store.views(layer)[k][e], _row(seed, layer, proj, e))
               for layer in range(L) for k, proj in enumerate(SHAPES) for e in range(E))


def _error(fn) -> str:
    try:
        fn()
    except CollectiveError as exc:
        return str(exc)
    return "no error"


def passes_rank(ctx) -> dict:
    rank = ctx.rank
    out = {}
    store = _store(rank)
    try:
        out["slots_zero_before"] = bool((store.views(0)[0][E:] == 0).all())
        _write_all(store, 0, rank)
        out["ready_before_settle"] = store.ready
        summary = store.settle()
        out["initial"] = summary
        out["ready"] = store.ready
        out["rows_a"] = _rows_are(store, 0)  # every row of every owner, read through this rank's views
        out["slots_poisoned"] = all(bool(torch.isnan(v[E:]).all()) for v in store.views(1))
        ptrs = [v.data_ptr() for layer in range(L) for v in store.views(layer)]
        # A peer must not start the next pass while this rank still reads its rows (vLLM pauses every
        # DP rank around a reload for the same reason); settle is the barrier after writes, not before them.
        torch.distributed.barrier()

        store.begin_update()
        _write_all(store, 1, rank)
        out["update"] = store.settle()
        out["rows_b"] = _rows_are(store, 1)
        out["pointers_unchanged"] = ptrs == [v.data_ptr() for layer in range(L) for v in store.views(layer)]

        # An update of another shape on every rank: refused at the first tensor, nothing written.
        store.begin_update()
        for j in range(E // 2):
            store.write_expert(0, "gate", j, torch.zeros(I // 2, H, dtype=torch.bfloat16), "wrong")
        out["wrong_shape"] = _error(store.settle)
        out["rows_b_after_wrong_shape"] = _rows_are(store, 1)
        torch.distributed.barrier()  # rank 0 writes a row below

        # Another dtype than the checkpoint the engine loaded: refused.
        store.begin_update()
        store.write_expert(0, "gate", 0, _row(2, 0, "gate", rank * 4, torch.float32), "fp32")
        out["wrong_dtype"] = _error(store.settle)

        # Only rank 1 refuses, after rank 0 wrote a row: both raise; rank 0's message says the weights mix.
        store.begin_update()
        if rank == 0:
            store.write_expert(1, "down", 0, _row(3, 1, "down", 0), "ok")
        else:
            store.refuse("[rank 1] a tensor this rank cannot load")
        out["one_rank_refuses"] = _error(store.settle)

        # A loader exception on rank 0 only: every rank raises, naming it.
        store.begin_update()
        out["failure_on_rank0"] = _error(lambda: store.settle(RuntimeError("boom") if rank == 0 else None))
        out["passes"] = list(store.settled)
    finally:
        store.close()
    return out


def coverage_rank(ctx) -> dict:
    store = _store(ctx.rank)
    try:
        _write_all(store, 0, ctx.rank, skip=(1, "up", 2) if ctx.rank == 1 else None)
        return {"error": _error(store.settle), "ready": store.ready}
    finally:
        store.close()


def cast_rank(ctx) -> dict:
    """The first load casts float checkpoints as vLLM does; updates must then bring that dtype."""
    store = _store(ctx.rank)
    try:
        _write_all(store, 0, ctx.rank, dtype=torch.float32)
        store.settle()
        store.begin_update()
        store.write_expert(0, "gate", 0, _row(0, 0, "gate", ctx.rank * 4), "bf16 update")
        return {"dtypes": sorted(store.checkpoint_dtypes), "bf16_update": _error(store.settle)}
    finally:
        store.close()


def test_passes_write_in_place_settle_everywhere_and_refuse_together():
    for rank, out in enumerate(run_ranks(passes_rank, 2, timeout_s=120)):
        assert out["slots_zero_before"] and not out["ready_before_settle"]
        assert out["ready"] and out["rows_a"] and out["slots_poisoned"]
        assert out["initial"]["kind"] == "initial" and out["initial"]["ranks_rows_written"] == [24, 24]
        assert out["update"]["rows_written"] == 24 and out["rows_b"] and out["pointers_unchanged"]
        assert "shape (64, 256) differs from the served (128, 256)" in out["wrong_shape"]
        assert "no expert row was written in this pass on this rank" in out["wrong_shape"]
        assert "rank(s) [0, 1]" in out["wrong_shape"] and out["rows_b_after_wrong_shape"]
        assert "dtype torch.float32 differs from the checkpoint the engine loaded" in out["wrong_dtype"]
        assert "rank(s) [1]" in out["one_rank_refuses"] and "a tensor this rank cannot load" in out["one_rank_refuses"]
        assert "loading failed on this rank: RuntimeError: boom" in out["failure_on_rank0"]
        assert "rank(s) [0]" in out["failure_on_rank0"]
        assert [p["ok"] for p in out["passes"]] == [True, True, False, False, False, False]


def test_initial_pass_names_missing_rows_on_every_rank():
    for out in run_ranks(coverage_rank, 2, timeout_s=120):
        assert "rank(s) [1]" in out["error"] and "did not provide 1 of this rank's 24 expert rows" in out["error"]
        assert "l1.up[expert 6]" in out["error"] and not out["ready"]


def test_first_load_casts_and_updates_keep_the_checkpoint_dtype():
    for out in run_ranks(cast_rank, 2, timeout_s=120):
        assert out["dtypes"] == ["torch.float32"]
        assert "dtype torch.bfloat16 differs from the checkpoint the engine loaded" in out["bf16_update"]


# -- a quantized store (INT4 W4A16 g32, vLLM's fused w13 names): what the engine binding relies on ------------

def _int4_rows(seed: int, layer: int, expert: int) -> dict:
    g = torch.Generator().manual_seed(seed * 100_003 + layer * 1009 + expert)
    return {"w1_packed": torch.randint(-2**31, 2**31 - 1, (I, H // 8), generator=g, dtype=torch.int32),
            "w3_packed": torch.randint(-2**31, 2**31 - 1, (I, H // 8), generator=g, dtype=torch.int32),
            "w2_packed": torch.randint(-2**31, 2**31 - 1, (H, I // 8), generator=g, dtype=torch.int32),
            "w1_scale": (torch.rand(I, H // 32, generator=g) / 8).to(torch.bfloat16),
            "w3_scale": (torch.rand(I, H // 32, generator=g) / 8).to(torch.bfloat16),
            "w2_scale": (torch.rand(H, I // 32, generator=g) / 8).to(torch.bfloat16)}


def quantized_rank(ctx, skip_up: bool) -> dict:
    from moonep_ep.memory.host import HostDriver
    from moonep_ep.ops.moonep.prefetch import wait_for_slots
    from moonep_ep.ops.experts.quantized import quantized_grouped_ffn, views_of
    from moonep_ep.vllm.quantized.engine import prefetch_quantized

    rank, epn, out = ctx.rank, E // 2, {}
    store = ModelExpertStore(layer_names=[f"l{i}" for i in range(L)], num_experts=E, hidden=H, intermediate=I,
                             num_slots=B, group=None, device=torch.device("cpu"), fmt="int4-g32",
                             driver=HostDriver(rank=rank, granularity=GRAN))
    try:
        for layer in range(L):
            for j in range(epn):
                rows = _int4_rows(0, layer, rank * epn + j)
                for kind in ("packed", "scale"):
                    name = "weight_packed" if kind == "packed" else "weight_scale"
                    store.write_expert(layer, f"w13_{name}", j, rows[f"w1_{kind}"], "t", part=0)
                    if not (skip_up and rank == 1 and (layer, j) == (1, 2)):
                        store.write_expert(layer, f"w13_{name}", j, rows[f"w3_{kind}"], "t", part=1)
                    store.write_expert(layer, f"w2_{name}", j, rows[f"w2_{kind}"], "t")
        out["error"] = _error(store.settle)
        if skip_up:
            return out
        views = store.named_views(1)
        out["slots_poisoned"] = bool((views["w13_weight_packed"][E:] == 0).all()) and \
            bool(torch.isnan(views["w13_weight_scale"][E:]).all())
        other = 1 - rank
        remote = [other * epn + b for b in range(B)]
        out["fill"] = prefetch_quantized(views, remote[:3] + [-1], E, rank, epn)
        wait_for_slots(out["fill"].pop("event"))  # weights and scales land before a slot is read
        out["slots_equal_sources"] = all(torch.equal(v[E + b], v[remote[b]]) for v in views.values() for b in range(3))
        rows = _int4_rows(0, 1, remote[0])
        out["source_rows_are_the_checkpoint"] = torch.equal(views["w13_weight_packed"][remote[0]][:I], rows["w1_packed"]) \
            and torch.equal(views["w13_weight_scale"][remote[0]][I:], rows["w3_scale"])
        cu = torch.zeros(E + B, dtype=torch.int32)
        cu[E + 3:] = 4  # 4 rows in the unfilled (poisoned) slot 3: the output must show it
        hidden = torch.randn(4, H).to(torch.bfloat16)
        out["unfilled_slot_is_nan"] = bool(torch.isnan(
            quantized_grouped_ffn(hidden, "int4-g32", *views_of("int4-g32", views), cu)).all())
    finally:
        store.close()
    return out


def test_a_quantized_store_loads_halves_of_w13_counts_scales_apart_and_poisons_integer_slots():
    for out in run_ranks(quantized_rank, 2, args=(False,), timeout_s=120):
        assert out["error"] == "no error" and out["slots_poisoned"], out
        per_expert_weight = (2 * I * H // 8 + H * I // 8) * 4
        per_expert_scale = (2 * I * H // 32 + H * I // 32) * 2
        assert out["fill"]["weight_bytes"] == 3 * per_expert_weight == out["fill"]["remote_weight_bytes"]
        assert out["fill"]["scale_bytes"] == 3 * per_expert_scale == out["fill"]["remote_scale_bytes"]
        assert out["slots_equal_sources"] and out["source_rows_are_the_checkpoint"] and out["unfilled_slot_is_nan"]
    for out in run_ranks(quantized_rank, 2, args=(True,), timeout_s=120):
        assert "rank(s) [1]" in out["error"] and "l1.w13_weight_packed[expert 6]" in out["error"], out["error"]


def push_layout_rank(ctx) -> dict:
    """A quantized store built for the push API (``api="push"``, E/R slots): vLLM's fused names land in gate,
    up and down apart; each 16 KiB-padded scale row holds its data first and a zero tail; the experts' views
    are ``[2*epn]`` rows, own experts first; the slot scales are poisoned after the pass."""
    from moonep_ep.memory.host import HostDriver

    rank, epn, out = ctx.rank, E // 2, {}
    store = ModelExpertStore(layer_names=[f"l{i}" for i in range(L)], num_experts=E, hidden=H, intermediate=I,
                             num_slots=epn, group=None, device=torch.device("cpu"), fmt="int4-g32", api="push",
                             driver=HostDriver(rank=rank, granularity=GRAN))
    try:
        out["targets"] = [store.store_target("w13_weight_packed", 0), store.store_target("w13_weight_scale", 1),
                          store.store_target("w2_weight_packed", None), store.store_target("w2_weight_scale", None)]
        out["stored_row_bytes"] = {p.name: p.row_bytes for p in store.store.projections}
        for layer in range(L):
            for j in range(epn):
                rows = _int4_rows(0, layer, rank * epn + j)
                for kind, name in (("packed", "weight_packed"), ("scale", "weight_scale")):
                    for vllm_name, part, shard in ((f"w13_{name}", 0, "w1"), (f"w13_{name}", 1, "w3"),
                                                   (f"w2_{name}", None, "w2")):
                        target, tpart = store.store_target(vllm_name, part)
                        store.write_expert(layer, target, j, rows[f"{shard}_{kind}"], "t", part=tpart)
        out["error"] = _error(store.settle)
        views = store.named_views(1)
        out["view_shapes"] = {n: list(v.shape) for n, v in views.items()}
        rows = _int4_rows(0, 1, rank * epn + 2)
        out["own_rows_are_the_checkpoint"] = all(torch.equal(views[n][2], rows[k]) for n, k in (
            ("gate", "w1_packed"), ("up", "w3_packed"), ("down", "w2_packed"), ("gate_scale", "w1_scale"),
            ("up_scale", "w3_scale"), ("down_scale", "w2_scale")))
        padded = store.store.owner_view(1, "up_scale")[2].reshape(-1)
        data = I * (H // 32) * 2
        out["tail_zero_data_kept"] = bool((padded[data:] == 0).all()) and \
            torch.equal(padded[:data].view(torch.bfloat16).view(I, H // 32), rows["w3_scale"])
        out["slot_scales_nan"] = bool(torch.isnan(views["gate_scale"][epn:]).all())
    finally:
        store.close()
    return out


def test_the_push_layout_stores_gate_up_down_apart_with_padded_scale_rows():
    for out in run_ranks(push_layout_rank, 2, timeout_s=120):
        assert out["error"] == "no error", out["error"]
        assert out["targets"] == [("gate", None), ("up_scale", None), ("down", None), ("down_scale", None)]
        # INT4 g32 at H=256, I=128: weights I*H/2 = 16 KiB a projection; bf16 scales I*H/32*2 = 2 KiB -> 16 KiB
        assert out["stored_row_bytes"] == {"gate": 16384, "gate_scale": 16384, "up": 16384, "up_scale": 16384,
                                           "down": 16384, "down_scale": 16384}
        epn = E // 2
        assert out["view_shapes"] == {"gate": [2 * epn, I, H // 8], "gate_scale": [2 * epn, I, H // 32],
                                      "up": [2 * epn, I, H // 8], "up_scale": [2 * epn, I, H // 32],
                                      "down": [2 * epn, H, I // 8], "down_scale": [2 * epn, H, I // 32]}
        assert out["own_rows_are_the_checkpoint"] and out["tail_zero_data_kept"] and out["slot_scales_nan"], out
