"""The push buffer's prefetch step: argument checks and the push step, weights with their scales.

MoonEP's release moves each rank's own experts into the slot pools of the
ranks that need them (``prefetch_weight(plan, local_*_weight, *_prefetch_buffer)``,
docs/design/moonep.md §2.3). Its prefetch kernel takes bf16, int8 or uint8
weights, and optionally one scale tensor per projection, allowed only with
uint8 weights (``local_*_scale [epn, ...]`` + ``*_scale_prefetch_buffer
[R, epn, ...]``); it re-tiles each expert's scales to ``[128, nbytes/128]``
bytes, so one expert's scale bytes must be a multiple of 16 KiB. Weights and
scales of a slot move in the same call and land before the same barrier, so
no rank ever reads a fresh weight with a stale scale.

Formats whose scale rows do not meet the 16 KiB rule (FP8 block) are stored
in the push layout (``layout.formats.push_projections``: scale rows padded
per expert), and push those padded rows.

**Two orders across ranks, each an explicit barrier in stream order** (:func:`run_push`). The
slot pool is one per rank, shared by every layer, and the push writes into
the peers' pools:

* *write after read* (:func:`wait_for_slot_readers`, before the first copy):
  a peer may still be reading its slots for the previous layer; no rank writes
  into any pool until every rank has finished the reads it issued before this
  push (on a GPU its current stream has run them);
* *read after write* (after the last copy): no rank reads its slots until
  every rank's pushes have landed.

The first is the one the release's push kernel keeps with its in-kernel
cross-rank barrier. Both are ``GroupComm.device_barrier``: a one-element
``all_reduce`` queued on the current stream (NCCL: the host does not wait;
gloo on the CPU: a real barrier), with the copies' event waited on by the
current stream before the second (``wait_for_slots``), so no host read or
synchronize is left in the push. Without the first the order held only by
accident; ``tests/ops/test_push_order.py`` removes it and a peer's slot of
one layer is overwritten by the next layer's push before the peer reads it.
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Optional

import torch

from ...errors import config_error
from ...layout.store import FFN_PROJECTIONS
from .commplan import CommPlan, PrefetchStats
from .limits import SCALE_TILE_BYTES, check_push_weights
from .prefetch import push_slots, wait_for_slots

__all__ = ["check_push_args", "run_push", "wait_for_slot_readers", "SLOTS_READ_STEP", "PUSHES_LANDED_STEP"]

#: the barriers of :func:`run_push`, by the name a rank stuck in one reports
SLOTS_READ_STEP = "prefetch_weight (push): every rank finished reading its slots (write after read)"
PUSHES_LANDED_STEP = "prefetch_weight (push): every push landed"



def check_push_args(rank: int, device: torch.device, local: Mapping[str, Any], pools: Mapping[str, Any],
                    local_scales: Mapping[str, Any], scale_pools: Mapping[str, Any], R: int, epn: int,
                    B: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Check a push call; return ``({name: local [epn, ...]}, {name: pool [R, epn, ...]})`` with the
    scales (when given) as ``gate_scale``, ``up_scale``, ``down_scale``.

    Weights: ``limits.check_push_weights``. Scales: all six tensors or none; uint8 weights only; each
    ``local_*_scale`` a contiguous ``[epn, ...]`` tensor whose per-expert bytes are a multiple of 16384;
    each ``*_scale_prefetch_buffer`` ``[R, epn, ...]`` of the same trailing shape and dtype, each rank's
    rows contiguous (gaps between ranks allowed, as for the weights).
    """
    check_push_weights(rank, device, local, pools, R, epn, B)
    out_local = {name: local[name] for name in FFN_PROJECTIONS}
    out_pools = {name: pools[name] for name in FFN_PROJECTIONS}
    given = [f"local_{n}_scale" for n in FFN_PROJECTIONS if local_scales.get(n) is not None] + \
            [f"{n}_scale_prefetch_buffer" for n in FFN_PROJECTIONS if scale_pools.get(n) is not None]
    if not given:
        return out_local, out_pools
    if len(given) != 2 * len(FFN_PROJECTIONS):
        raise config_error(rank, "push scales must be given for all three projections, local and pool, or none",
                           given, "pass local_{gate,up,down}_scale and {gate,up,down}_scale_prefetch_buffer "
                           "together, or none of them")
    for name in FFN_PROJECTIONS:
        weight = local[name]
        if weight.dtype != torch.uint8:
            raise config_error(rank, f"scales need uint8 weights (MoonEP's prefetch kernel); local_{name}_weight is",
                               weight.dtype, "pass the quantized weights as uint8 views (t.view(torch.uint8)), "
                               "or drop the scales for bf16/int8 weights")
        scale, pool = local_scales[name], scale_pools[name]
        fix = (f"pass this rank's [epn, ...] = [{epn}, ...] contiguous scale rows on {device} "
               "(ShardedExpertStore.owner_view of the scale tensor)")
        if not isinstance(scale, torch.Tensor) or scale.dim() < 2 or scale.shape[0] != epn \
                or not scale.is_contiguous() or scale.device != device:
            raise config_error(rank, f"local_{name}_scale must be a contiguous [{epn}, ...] tensor on {device}",
                               getattr(scale, "shape", type(scale).__name__), fix)
        per_expert = scale[0].numel() * scale.element_size()
        if per_expert % SCALE_TILE_BYTES:
            padded = -(-per_expert // SCALE_TILE_BYTES) * SCALE_TILE_BYTES
            raise config_error(rank, f"local_{name}_scale: per-expert scale bytes must be a multiple of "
                               f"{SCALE_TILE_BYTES} (MoonEP re-tiles scales to [128, nbytes/128])", per_expert,
                               f"store the scales in the push layout, padded per expert to {padded} bytes "
                               "(layout.formats.push_projections)")
        want = (R, epn, *scale.shape[1:])
        pool_fix = (f"pass the {list(want)} {scale.dtype} view of every rank's scale slot pool "
                    "(ShardedExpertStore.push_pool of the scale tensor)")
        if not isinstance(pool, torch.Tensor) or tuple(pool.shape) != want:
            raise config_error(rank, f"{name}_scale_prefetch_buffer has the wrong shape",
                               getattr(pool, "shape", type(pool).__name__), pool_fix)
        if pool.dtype != scale.dtype or pool.device != device:
            raise config_error(rank, f"{name}_scale_prefetch_buffer must match local_{name}_scale's dtype and device",
                               (pool.dtype, pool.device), pool_fix)
        if pool[0].stride() != scale.stride() or pool.stride(0) < scale.numel():
            raise config_error(rank, f"{name}_scale_prefetch_buffer rows must be contiguous within each rank's pool",
                               tuple(pool.stride()), pool_fix)
        out_local[f"{name}_scale"], out_pools[f"{name}_scale"] = scale, pool
    return out_local, out_pools


def wait_for_slot_readers(buffer: Any) -> None:
    """The write-after-read order of a push (collective), in stream order: every rank's later work (the
    copies wait for the current stream) runs once every rank has run the slot reads it issued before this
    call. The pool is shared by every layer, so the reads this protects are the previous layer's slot groups;
    on a GPU the current stream runs them first (the experts of that layer were queued on it), on CPU they ran
    before the call."""
    buffer.comm.device_barrier(SLOTS_READ_STEP, buffer.device)


def run_push(buffer: Any, plan: CommPlan, local: Mapping[str, torch.Tensor], pools: Mapping[str, torch.Tensor],
             t0: Optional[float] = None) -> PrefetchStats:
    """The push step of ``buffer`` (a checked push call): once every rank is done reading its slots, every
    tensor of every slot this rank owns the expert of, weights and scales in one issue; the current stream
    waits for them, then a barrier: work queued after the return reads final slots on every rank. No host
    read: the copies read the plan's device table, the stats when first asked. Collective."""
    t0 = time.perf_counter() if t0 is None else t0
    # Write after read: the pools we write into are the peers' slots, which they may still read for the
    # previous layer (one pool for all layers)
    wait_for_slot_readers(buffer)
    fill = push_slots(local, pools, plan.experts_to_copy, buffer.rank, buffer.epn, streams=buffer._streams)
    wait_for_slots(fill.event)  # our pushes land before the barrier releases the readers (CPU: they land now)
    buffer.comm.device_barrier(PUSHES_LANDED_STEP, buffer.device)   # read after write
    seconds = None if buffer.device.type == "cuda" else time.perf_counter() - t0  # CUDA: left in stream order
    return PrefetchStats.of_fill(fill, seconds, buffer.epn, buffer.rank)
