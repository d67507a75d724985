"""The push's write-after-read order across ranks (issue 45): no rank writes into a peer's slots for layer l+1
before the peer has read its slots of layer l.

The slot pool is one per rank and shared by every layer, and the push (``PushReferenceBuffer.prefetch_weight``)
writes into the peers' pools. ``push_step.run_push`` therefore starts with a barrier that every rank passes
only once it has finished reading its slots (``wait_for_slot_readers``), and ends with the barrier after which
the pushes have landed; both are device barriers in stream order (``GroupComm.device_barrier``: an
``all_reduce``, a real barrier over gloo). Before issue 45 the first order held only through host syncs that
were there for other reasons (the push's lockstep round, combine's reads back).

One spawn of 2 gloo ranks over one two-layer sharded store (host driver), ``lockstep_checks=False`` (so no
other round orders the ranks: the push's lockstep round is then local), the CPU copies deferred
(``MOONEP_EP_CPU_DEFERRED_COPIES``: a push lands when its event is waited on, inside the push). Every token
routes to rank 0's experts 0 and 1, so rank 0 (the producer) pushes into slots of rank 1 (the consumer). Per
case, layer 0 is pushed; then rank 0 pushes layer 1 at once, while rank 1 first waits until rank 0 is in a
barrier of that push (told through the group's store, in the producer's first barrier), then reads its
slots as layer 0's experts compute would, then joins the push of layer 1. The consumer's read must see layer
0's experts:

* with the barrier, rank 0's first barrier is the write-after-read one, which waits for rank 1: it reads
  layer 0;
* the control, the barrier removed: rank 0's first barrier is the one after its pushes landed, so rank 1
  reads layer 1's experts in its slots of layer 0.
"""

from __future__ import annotations

import datetime
import math
from typing import Any

import pytest
import torch

from moonep_ep.launch import run_ranks

H, I, E, R, K, S, TP, GRAN = 256, 128, 8, 2, 2, 32, 16, 64 << 10
EPN = E // R
PROJ = ("gate", "up", "down")
CASES = ("with the barrier", "without it (control)")


def expert_weight(layer: int, proj: str, expert: int) -> torch.Tensor:
    shape = (H, I) if proj == "down" else (I, H)
    gen = torch.Generator().manual_seed(10007 * layer + 1009 * PROJ.index(proj) + expert)
    return (torch.randn(shape, generator=gen) / math.sqrt(shape[1])).to(torch.bfloat16)


def _layer_read(store: Any, slots: list[int]) -> Any:
    """Which layer's experts the used slots hold (this rank's ``[2*epn]`` view), or ``"neither"``."""
    views = {p: store.push_view(0, p) for p in PROJ}
    for layer in (0, 1):
        if all(torch.equal(views[p][EPN + b], expert_weight(layer, p, e)) for b, e in enumerate(slots) if e >= 0
               for p in PROJ):
            return layer
    return "neither"


def producer_and_consumer(ctx: Any) -> dict[str, Any]:
    import torch.distributed as dist

    from moonep_ep import envs
    from moonep_ep.layout.store import ShardedExpertStore, ffn_projections
    from moonep_ep.memory.host import HostDriver
    from moonep_ep.ops.moonep import push_step
    from moonep_ep.ops.moonep.push import PushReferenceBuffer

    rank = ctx.rank
    store = ShardedExpertStore(num_layers=2, num_experts=E, projections=ffn_projections(H, I), num_slots=EPN,
                               driver=HostDriver(rank=rank, granularity=GRAN), api="push")
    store.load(expert_weight)
    buf = PushReferenceBuffer(S, H, K, E, R, token_padding=TP, explicitly_destroy=True, lockstep_checks=False)
    gen = torch.Generator().manual_seed(3 + rank)
    ids = torch.tensor([[0, 1]] * S, dtype=torch.int32)   # rank 0's experts only: rank 0 overflows into rank 1
    tpe = torch.bincount(ids.reshape(-1).long(), minlength=E).to(torch.int32)
    _, _, _, plan = buf.dispatch(torch.randn(S, H, generator=gen).to(torch.bfloat16), torch.full((S, K), 0.5),
                                 ids, tpe)
    slots = plan.experts_to_copy[1].tolist()
    kv = dist.distributed_c10d._get_default_store()

    def push(layer: int) -> None:
        buf.prefetch_weight(plan, **{f"local_{p}_weight": store.owner_view(layer, p) for p in PROJ},
                            **{f"{p}_prefetch_buffer": store.push_pool(layer, p) for p in PROJ})

    out: dict[str, Any] = {"slots_of_rank_1": slots, "deferred": bool(envs.MOONEP_EP_CPU_DEFERRED_COPIES)}
    barrier = push_step.wait_for_slot_readers
    device_barrier = buf.comm.device_barrier
    for case in CASES:
        if case != CASES[0]:
            push_step.wait_for_slot_readers = lambda buffer: None   # the control: no write-after-read barrier
        try:
            push(0)
            if rank == 0:
                def tell_the_consumer(step: str, device: Any, case: str = case) -> None:
                    kv.set(case, step)            # the producer's first barrier of layer 1's push
                    buf.comm.device_barrier = device_barrier
                    device_barrier(step, device)

                buf.comm.device_barrier = tell_the_consumer
                push(1)
            else:
                kv.wait([case], datetime.timedelta(seconds=60))
                out[case] = {"producer_round": kv.get(case).decode(), "read": _layer_read(store, slots)}
                push(1)
        finally:
            push_step.wait_for_slot_readers = barrier
            buf.comm.device_barrier = device_barrier
    out["steps"] = {"slots_read": push_step.SLOTS_READ_STEP, "pushes_landed": push_step.PUSHES_LANDED_STEP}
    buf.destroy()
    store.finish_loading()
    store.close()
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_ranks(producer_and_consumer, R, timeout_s=180)


def consumer_read_its_layer(consumer: dict[str, Any], case: str) -> None:
    """The consumer read layer 0's experts in its slots of layer 0."""
    got = consumer[case]
    assert got["read"] == 0, (f"{case}: the consumer read layer {got['read']}'s experts in its slots of layer 0 "
                              f"(the producer was in {got['producer_round']!r})")


def test_no_push_writes_a_slot_a_peer_has_not_read_and_without_the_barrier_one_does(runs):
    consumer = runs[1]
    assert consumer["deferred"] and any(e in range(EPN) for e in consumer["slots_of_rank_1"])  # rank 0's experts
    steps = consumer["steps"]
    consumer_read_its_layer(consumer, CASES[0])
    assert consumer[CASES[0]]["producer_round"] == steps["slots_read"]
    # the control: the producer's pushes of layer 1 landed before the consumer read its slots of layer 0
    assert consumer[CASES[1]] == {"producer_round": steps["pushes_landed"], "read": 1}
    with pytest.raises(AssertionError, match="read layer 1's experts in its slots of layer 0"):
        consumer_read_its_layer(consumer, CASES[1])
