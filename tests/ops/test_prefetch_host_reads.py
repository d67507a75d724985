"""Slot fills without a device->host read (issue 45): the copies take the plan's slot table as a device tensor.

``prefetch.pull_slots`` / ``push_slots`` keep a copy of the table and issue work whose shape depends on its
size only (CUDA: ``copy_rows_kernel.py``; CPU: the side stream's landing, the emulated device's own work). The
byte counts are read from the copy when first asked, after the step. Counted with ``testing/host_syncs.py``
(every CPU tensor is device memory): the fills, their waits and the buffers' ``prefetch_weight`` (pull and push,
2 gloo ranks, ``lockstep_checks=False`` as in decode) read nothing; the controls (a ``tolist`` of the row, the
earlier host-row path, the tuple form's counts) are counted. The slots are checked against the experts
regenerated from their seed, and unused slots (``-1``) keep their sentinel. The push's two barriers are device
barriers now (``GroupComm.device_barrier``); a peer lost in one is still reported with that barrier's step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from moonep_ep.launch import run_ranks
from moonep_ep.ops.moonep.commplan import PrefetchStats
from moonep_ep.ops.moonep.prefetch import SideStreams, pull_slots, push_slots, wait_for_slots
from moonep_ep.testing.host_syncs import count_host_syncs

E, B = 4, 3
SENTINEL = -7.0


def _full() -> torch.Tensor:
    """``[E+B, 2, 8]``: expert ``e``'s row holds ``e + 1``, the slots the sentinel."""
    full = torch.full((E + B, 2, 8), SENTINEL)
    for e in range(E):
        full[e] = e + 1
    return full


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_a_pull_from_a_device_row_reads_nothing_and_lands_at_its_wait(dtype):
    full = _full()
    row = torch.tensor([2, -1, 0], dtype=dtype)
    streams = SideStreams()
    with count_host_syncs() as syncs:
        fill = pull_slots({"w": full, "s": full.clone()}, row, E, streams=streams)
        before_wait = full[E:].clone()
        row.fill_(3)  # the caller's next plan written over the row: the fill copied it at issue
        wait_for_slots(fill.event)
    assert syncs.total == 0, syncs.report()
    assert bool((before_wait == SENTINEL).all())  # a reader that did not wait: the old bytes
    assert torch.equal(full[E], full[2]) and torch.equal(full[E + 2], full[0])
    assert bool((full[E + 1] == SENTINEL).all())  # the unused slot
    # the counts, read now (one host read each time they are first asked for)
    with count_host_syncs() as syncs:
        counted = (fill.copies, fill.bytes, fill.bytes_by_expert, fill.bytes_by_tensor)
    assert counted == (4, 256, {2: 128, 0: 128}, {"w": 128, "s": 128}) and syncs.by_kind() == {"tolist": 1}
    copies, by_expert, event = fill  # the earlier tuple form
    assert (copies, by_expert, event) == (4, {2: 128, 0: 128}, fill.event)


def test_the_controls_are_counted():
    """A ``tolist`` of the row, the earlier host-row path (``experts_to_copy[rank].tolist()``) and the tuple
    form's counts of a device row each read the device once."""
    full, row = _full(), torch.tensor([2, -1, 0], dtype=torch.int32)
    with count_host_syncs() as deliberate:
        row.tolist()
    with count_host_syncs() as earlier_path:
        wait_for_slots(pull_slots({"w": full}, row.tolist(), E).event)
    with count_host_syncs() as tuple_form:
        _, _, event = pull_slots({"w": full}, row, E)
        wait_for_slots(event)
    assert deliberate.by_kind() == earlier_path.by_kind() == tuple_form.by_kind() == {"tolist": 1}


def test_a_push_from_a_device_table_writes_only_this_ranks_experts_slots():
    """Rank 1 of 2 (experts 3..5, ``epn`` 3), a ``[2, 2]`` table (``SL`` 2 < ``epn``), pools with a gap row
    between the ranks: only the pool rows holding 4 or 5 are written, nothing else (gap rows included)."""
    base = torch.full((2, 4, 2, 8), SENTINEL)
    pools = base[:, :3]
    local = torch.stack([torch.full((2, 8), 10.0 + i) for i in range(3)])  # experts 3, 4, 5
    table = torch.tensor([[4, 1], [0, 5]], dtype=torch.int32)
    with count_host_syncs() as syncs:
        fill = push_slots({"w": local}, {"w": pools}, table, 1, 3)
        wait_for_slots(fill.event)
    assert syncs.total == 0, syncs.report()
    want = torch.full_like(base, SENTINEL)
    want[0, 0], want[1, 1] = local[1], local[2]
    assert torch.equal(base, want)
    assert (fill.copies, fill.bytes, fill.bytes_by_expert) == (2, 128, {4: 64, 5: 64})
    stats = PrefetchStats.of_fill(fill, 0.0, 3, 1)
    assert (stats.slots, stats.bytes_by_owner, stats.remote_bytes, stats.bytes_by_tensor) == (
        [(0, 0, 0), (1, 5, 1)], {1: 128}, 128, {"w": 128})


def test_copies_at_issue_read_nothing_either(monkeypatch):
    monkeypatch.setenv("MOONEP_EP_CPU_DEFERRED_COPIES", "0")
    full = _full()
    with count_host_syncs() as syncs:
        fill = pull_slots({"w": full}, torch.tensor([3, 2, -1]), E)
    assert syncs.total == 0 and fill.event.query()
    assert torch.equal(full[E], full[3]) and torch.equal(full[E + 1], full[2]) and bool((full[E + 2] == SENTINEL).all())


def test_the_quantized_fill_takes_the_device_row_and_counts_as_from_host_ints():
    """``vllm/quantized/engine.py``'s fill (the manager passes the plan's device row): weights and scales land at
    the wait with nothing read; its counts, read afterwards, equal those of the same row given as host ints."""
    from moonep_ep.vllm.quantized.engine import prefetch_quantized

    def views() -> dict[str, torch.Tensor]:
        out = {"w13_weight_packed": torch.zeros(E + B, 4, 8, dtype=torch.uint8),
               "w13_weight_scale": torch.zeros(E + B, 4, 2)}
        for e in range(E):
            for v in out.values():
                v[e] = e + 1
        return out

    device_views, host_views = views(), views()
    with count_host_syncs() as syncs:
        filled = prefetch_quantized(device_views, torch.tensor([3, -1, 0], dtype=torch.int32), E, 1, 2)
        wait_for_slots(filled.pop("event"))
    assert syncs.total == 0, syncs.report()
    want = prefetch_quantized(host_views, [3, -1, 0], E, 1, 2)
    wait_for_slots(want.pop("event"))
    assert dict(filled) == dict(want) == {"bytes_by_expert": {3: 64, 0: 64}, "weight_bytes": 64, "scale_bytes": 64,
                                          "remote_weight_bytes": 32, "remote_scale_bytes": 32}
    assert filled.weight_bytes == 64  # the manager's attribute reads (stats on)
    assert all(torch.equal(device_views[n], host_views[n]) for n in device_views)
    assert int(device_views["w13_weight_packed"][E + 1].max()) == 0  # the unused slot


# -- the buffers' prefetch_weight on 2 gloo ranks -----------------------------------------------------------------

def buffers_rank(ctx: Any) -> dict[str, Any]:
    from moonep_ep.ops.moonep.pull import ReferenceBuffer
    from moonep_ep.ops.moonep.push import push_prefetch
    from tests.ops.test_ops import PROJ, _skewed_plan, build_store, expert_weight
    from tests.support.memory import GRAN

    Eb, H, I, K, seed, layer = 8, 128, 128, 2, 3, 0
    epn = Eb // ctx.world_size
    shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    store = build_store(ctx, H, I, Eb, 1, GRAN, seed)
    views = {p: store.pull_view(layer, p) for p in PROJ}
    buf = ReferenceBuffer(64, H, K, Eb, ctx.world_size, lockstep_checks=False, explicitly_destroy=True)
    _, _, _, plan = _skewed_plan(buf, ctx, Eb, K, H, 64, seed)
    table = plan.experts_to_copy.tolist()  # read here, outside the counted regions
    row = table[ctx.rank]

    def reset() -> None:
        for p in PROJ:
            views[p][Eb:].fill_(SENTINEL)
        store.finish_loading()  # every rank's slots reset before anyone fills

    def slots_as_planned() -> bool:  # the experts regenerated from the seed; unused slots keep the sentinel
        return all(torch.equal(views[p][Eb + b], expert_weight(seed, layer, p, e, shapes[p])) if e >= 0 else
                   bool((views[p][Eb + b] == SENTINEL).all()) for b, e in enumerate(row) for p in PROJ)

    out: dict[str, Any] = {"row": row}
    full = {f"full_{p}_weight": views[p] for p in PROJ}
    reset()
    with count_host_syncs() as syncs:
        event = buf.prefetch_weight(plan, async_finish=True, **full)
        wait_for_slots(event)
    out["pull"] = {"reads": syncs.report(), "as_planned": slots_as_planned()}
    pulled = buf.last_prefetch
    out["pull_stats"] = [pulled.copies, pulled.bytes, pulled.bytes_by_owner, pulled.remote_bytes,
                         pulled.bytes_by_expert, pulled.slots, pulled.bytes_by_tensor]
    reset()
    with count_host_syncs() as syncs:
        buf.prefetch_weight(plan, **full)  # blocking: the buffer's own wait
    out["pull_blocking"] = {"reads": syncs.report(), "as_planned": slots_as_planned()}
    reset()
    push = {**{f"local_{p}_weight": store.owner_view(layer, p) for p in PROJ},
            **{f"{p}_prefetch_buffer": store.push_pool(layer, p) for p in PROJ}}
    with count_host_syncs() as syncs:
        push_prefetch(buf, plan, **push)
    out["push"] = {"reads": syncs.report(), "as_planned": slots_as_planned()}
    pushed = buf.last_prefetch
    out["push_stats"] = [pushed.copies, pushed.bytes, pushed.bytes_by_owner, pushed.remote_bytes,
                         pushed.bytes_by_expert, pushed.slots, pushed.bytes_by_tensor]
    out["table"], out["row_bytes"] = table, {p: store.owner_view(layer, p)[0].numel() * 2 for p in PROJ}
    store.finish_loading()
    buf.destroy()
    store.close()
    return out


@pytest.mark.slow
def test_the_buffers_prefetch_reads_nothing_and_counts_what_it_copied():
    results = run_ranks(buffers_rank, 2, timeout_s=180)
    assert any(e >= 0 for r in results for e in r["row"]), "the plan filled no slot: the checks would be vacuous"
    epn = 4
    for rank, r in enumerate(results):
        for step in ("pull", "pull_blocking", "push"):
            assert r[step] == {"reads": "", "as_planned": True}, (rank, step, r[step])
        per_expert = sum(r["row_bytes"].values())
        used = [e for e in r["row"] if e >= 0]
        by_expert: dict[int, int] = {}
        for e in used:
            by_expert[e] = by_expert.get(e, 0) + per_expert
        by_owner: dict[int, int] = {}
        for e, n in by_expert.items():
            by_owner[e // epn] = by_owner.get(e // epn, 0) + n
        slots = [(b, e, e // epn) for b, e in enumerate(r["row"]) if e >= 0]
        remote = sum(n for o, n in by_owner.items() if o != rank)
        assert r["pull_stats"] == [3 * len(used), per_expert * len(used), by_owner, remote, by_expert, slots, {}]
        # the push is counted at the owner: its experts in every rank's slots
        mine = [e for row in r["table"] for e in row if rank * epn <= e < (rank + 1) * epn]
        pushed: dict[int, int] = {}
        for e in mine:
            pushed[e] = pushed.get(e, 0) + per_expert
        nbytes = per_expert * len(mine)
        assert r["push_stats"] == [3 * len(mine), nbytes, {rank: nbytes} if nbytes else {}, nbytes, pushed, slots,
                                   {p: n * len(mine) for p, n in r["row_bytes"].items()} if mine else {}]


# -- a peer lost in one of the push's device barriers is named with the barrier's step -----------------------------

def killed_in_push_barrier(ctx: Any, step: str) -> dict[str, Any]:
    """Rank 1 SIGKILLs itself where it would enter ``step``'s device barrier; rank 0 meets the loss inside it."""
    import os
    import signal

    from moonep_ep.ops.moonep.push import PushReferenceBuffer, push_prefetch
    from tests.ops.test_ops import PROJ, build_store
    from tests.support.memory import GRAN

    E_, H, I, K, S = 4, 128, 128, 2, 4
    store = build_store(ctx, H, I, E_, 1, GRAN, 5)
    buf = PushReferenceBuffer(S, H, K, E_, 2, token_padding=4, lockstep_checks=False, explicitly_destroy=True)
    ids = torch.tensor([[0, 1]] * S, dtype=torch.int32)
    _, _, _, plan = buf.dispatch(torch.ones(S, H, dtype=torch.bfloat16), torch.full((S, K), 0.5), ids,
                                 torch.bincount(ids.reshape(-1).long(), minlength=E_).to(torch.int32))
    if ctx.rank == 1:
        enter = buf.comm.device_barrier

        def die_at_step(name: str, device: Any) -> None:
            if name == step:
                os.kill(os.getpid(), signal.SIGKILL)
            enter(name, device)
        buf.comm.device_barrier = die_at_step
    try:
        push_prefetch(buf, plan, **{f"local_{p}_weight": store.owner_view(0, p) for p in PROJ},
                      **{f"{p}_prefetch_buffer": store.push_pool(0, p) for p in PROJ})
    except Exception as exc:  # noqa: BLE001 - the survivor's error is the result
        return {"type": type(exc).__name__, "error": str(exc)}
    return {"type": None, "error": None}


@pytest.mark.slow
@pytest.mark.parametrize("which", ["SLOTS_READ_STEP", "PUSHES_LANDED_STEP"])
def test_a_peer_lost_in_a_push_barrier_is_reported_with_the_barriers_step(which):
    from moonep_ep.launch import RankFailure
    from moonep_ep.ops.moonep import push_step

    step = getattr(push_step, which)
    with pytest.raises(RankFailure) as info:
        run_ranks(killed_in_push_barrier, 2, args=(step,), env={"MOONEP_EP_TIMEOUT_S": "10"}, group_timeout_s=10,
                  timeout_s=120)
    survivor = info.value.results[0]
    assert survivor["type"] == "PeerLostError", survivor
    assert survivor["error"].startswith("[rank 0]") and f"during '{step}'" in survivor["error"], survivor
