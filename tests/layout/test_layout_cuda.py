"""The sharded expert store through CudaDriver: over the CUDA driver emulator (2 MiB pages,
POSIX-fd handles after a refused fabric trial) on 2 real ranks, and on a real GPU (2 ranks
on one GPU over gloo) where one exists."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from moonep_ep.layout.plan import predict_rank_bytes
from moonep_ep.layout.store import ShardedExpertStore, ffn_projections
from tests.layout.test_layout import expert_value
from tests.support.memory import run_emulated_ranks

pytestmark = pytest.mark.slow


def store_over_the_cuda_driver(ctx: Any) -> dict[str, Any]:
    from moonep_ep.memory import make_driver
    from moonep_ep.memory.accounting import driver_holdings

    rank, world = ctx.rank, ctx.world_size
    experts, layers = 8, 2
    epn = experts // world
    projs = ffn_projections(1024, 512)  # 1 MiB bf16 rows: epn rows fill whole 2 MiB pages (push)
    out: dict[str, Any] = {"errors": []}
    with make_driver("cuda", rank=rank) as driver:
        before = driver_holdings(driver, rank)
        store = ShardedExpertStore(num_layers=layers, num_experts=experts, projections=projs, num_slots=epn,
                                   driver=driver, api="push")
        try:
            out["granularity"] = store.granularity
            out["handle_type"] = store.symm.decision.handle_type.value
            fresh = store.slots(0, "gate").cpu()
            out["slots_zeroed"] = bool((fresh == 0).all())  # cuMemCreate memory is not zero: the store zeroes it
            shapes = {p.name: p.shape for p in projs}
            store.load(lambda layer, proj, e: expert_value(layer, proj, e, shapes[proj]).to(driver.torch_device))
            for layer in range(layers):
                for p in projs:
                    view = store.pull_view(layer, p.name)
                    assert view.device == driver.torch_device and view.shape == (experts + epn, *p.shape)
                    for e in range(experts):
                        if not torch.equal(view[e].cpu(), expert_value(layer, p.name, e, p.shape)):
                            out["errors"].append(f"layer {layer} {p.name} expert {e} wrong on rank {rank}")
            # push: write our expert 0 of layer 0 into the next rank's slot pool, row = our rank's block.
            nxt = (rank + 1) % world
            store.push_pool(0, "down")[nxt, 0].copy_(store.owner_view(0, "down")[0])
            store.finish_loading()
            prev = (rank - 1) % world
            pushed = store.push_view(0, "down")[epn]  # own slot pool row 0, written by prev
            out["push_seen"] = torch.equal(pushed.cpu(), expert_value(0, "down", prev * epn, projs[2].shape))
            measured = driver_holdings(driver, rank).bytes_held - before.bytes_held
            predicted = predict_rank_bytes(num_layers=layers, num_experts=experts, ep_size=world, num_slots=epn,
                                           row_bytes=[p.row_bytes for p in projs], granularity=store.granularity,
                                           rank=rank)
            out["measured"], out["predicted"] = measured, predicted["total_bytes"]
            out["physical"] = store.physical_bytes()["total_bytes"]
            store.finish_loading()
            del view, fresh, pushed  # views keep their mappings alive (by design) until they die
        finally:
            store.close()
        gc.collect()
        out["driver_live_after_close"] = {k: v for k, v in driver.live_objects().items() if v}
        if driver.emulated:
            out["live_after_close"] = {k: v for k, v in driver.api.live().items() if v and k != "contexts"}
    out["context_held"] = driver.holds_context()
    if driver.emulated:
        out["contexts_after_close"] = driver.api.live()["contexts"]
    return out


@pytest.mark.cuda_emulated
def test_the_sharded_store_over_the_cuda_emulator():
    for rank, res in enumerate(run_emulated_ranks(store_over_the_cuda_driver, 2)):
        assert res["errors"] == [], res["errors"]
        assert res["granularity"] == 2 << 20 and res["handle_type"] == "fd"
        assert res["slots_zeroed"] and res["push_seen"]
        assert res["measured"] == res["predicted"] == res["physical"], res
        assert res["live_after_close"] == {} and res["contexts_after_close"] == 0, res


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_sharded_store_on_a_real_gpu():
    """Two ranks on one GPU (POSIX fds, gloo metadata): views are CUDA tensors on the rank's device.
    Device bytes come from cuMemGetInfo, which two ranks on one GPU share, so only each rank's
    handle sizes are compared with the plan here."""
    from moonep_ep.launch import run_ranks

    for res in run_ranks(store_over_the_cuda_driver, 2, backend="gloo", use_cuda=True, timeout_s=300):
        assert res["errors"] == [] and res["push_seen"] and res["slots_zeroed"], res
        assert res["physical"] == res["predicted"]
        assert res["driver_live_after_close"] == {} and not res["context_held"], res
