"""The push generation on CPU (issue 38): :class:`PushReferenceBuffer` has the contract of MoonEP's release 26/09.

One spawn of 2 real gloo ranks over one sharded store (host driver; pull and push views of one physical
layout): dispatch → push prefetch into the ``push_pool`` views → grouped FFN over the ``[2·epn]``
``push_view`` views → combine, for a routing skewed onto rank 0's experts, so rank 1 computes some of
them in its slots. The same tokens then go through the pull reference buffer (``[E+B]`` groups, pull
prefetch over the pull views) and must give the same output bit for bit (why: see ``_check_run``). Then
the refusals, each made on rank 1 only so that every rank must raise. The planner of the push generation
is checked against a small example computed by hand (no ranks).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from moonep_ep.errors import CollectiveError, ConfigError
from moonep_ep.launch import run_ranks
from moonep_ep.layout.store import ShardedExpertStore, ffn_projections
from moonep_ep.memory.host import HostDriver
from moonep_ep.ops.moonep.pull import ReferenceBuffer
from moonep_ep.ops.moonep.push import PushReferenceBuffer
from moonep_ep.ops.experts.grouped import TOKEN_REL_TOL, grouped_ffn, reference_moe_bf16, token_rel_errors
from moonep_ep.ops.moonep.api import choose_moonep_api, probe_moonep_api, reference_buffer_class
from moonep_ep.ops.moonep.planner import entry_dst, plan_dispatch
from moonep_ep.ops.moonep.planner_push import plan_push_dispatch

PROJ = ("gate", "up", "down")
# H=256, I=128 bf16: 64 KiB rows = one page of the 64 KiB host granularity, so the push views are aligned.
H, I, E, R, K, S, TP, GRAN = 256, 128, 8, 2, 2, 32, 16, 64 << 10
EPN = E // R
SENTINEL = -7.0  # bf16-exact; no expert row holds it (N(0, 1/in) weights)
# NvS by hand: S*K + (tp-1)*2*epn = 64 + 15*8 = 184 (pull), rounded up to a multiple of 16: 192 (push).
NVS_PULL, NVS_PUSH = 184, 192


def expert_weight(proj: str, expert: int) -> torch.Tensor:
    shape = (H, I) if proj == "down" else (I, H)
    gen = torch.Generator().manual_seed(1009 * PROJ.index(proj) + expert)
    return (torch.randn(shape, generator=gen) / math.sqrt(shape[1])).to(torch.bfloat16)


def rank_inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``S`` tokens of ``rank``: two distinct experts each, drawn mostly from rank 0's experts 0..3 with
    expert 3 the most popular, so rank 0's group overflows and the larger share it hands over is of a
    larger id than the smaller one (the two generations then order rank 1's slots differently)."""
    gen = torch.Generator().manual_seed(77 + rank)
    popularity = torch.tensor([1.0, 2.0, 3.0, 6.0, 0.3, 0.3, 0.3, 0.3])
    ids = torch.multinomial(popularity.expand(S, E), K, replacement=False, generator=gen).to(torch.int32)
    x = torch.randn(S, H, generator=gen).to(torch.bfloat16)
    w = torch.rand(S, K, generator=gen) + 0.1
    return x, ids, w / w.sum(dim=1, keepdim=True)


def landed_groups_match(cu: list[int], slots: list[int], landed: list[tuple[int, int]], rank: int) -> bool:
    """Group ``g < epn`` holds exactly expert ``rank*epn + g``'s rows and group ``epn + b`` slot ``b``'s, back to
    back from the previous group's end, each padded to a multiple of ``TP`` (written here from the contract)."""
    group_of = {rank * EPN + g: g for g in range(EPN)}
    group_of.update({e: EPN + b for b, e in enumerate(slots) if e >= 0})
    rows: dict[int, list[int]] = {}
    for loff, e in landed:
        if e not in group_of:
            return False  # an entry computed here whose expert is neither own nor slotted
        rows.setdefault(group_of[e], []).append(loff)
    start = 0
    for g, end in enumerate(cu):
        got = sorted(rows.get(g, []))
        if got != list(range(start, start + len(got))) or end - start != -(-len(got) // TP) * TP:
            return False
        start = end
    return len(cu) == 2 * EPN


def _refusals(rank: int, store: ShardedExpertStore, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> dict:
    """Each bad call on rank 1 only (rank 0 makes the valid one): every rank must raise the same error."""
    out = {}
    buf = PushReferenceBuffer(S, H, K, E, R, token_padding=TP, explicitly_destroy=True)
    try:
        n = S - 1 if rank == 1 else S  # rank 1 does not pad its batch to the capacity
        tpe = torch.bincount(ids[:n].reshape(-1).long(), minlength=E).to(torch.int32)
        buf.dispatch(x[:n], w[:n], ids[:n], tpe)
        out["short_batch"] = "no error"
    except CollectiveError as exc:
        out["short_batch"] = str(exc)
    buf.destroy()
    try:
        kw = {"B": 4} if rank == 1 else {}
        PushReferenceBuffer(S, H, K, E, R, token_padding=TP, **kw).destroy()
        out["B"] = "no error"
    except CollectiveError as exc:
        out["B"] = str(exc)
    try:  # the pull generation's positional B lands on group: refused before any collective, on this rank
        PushReferenceBuffer(S, H, K, E, R, None, TP, 4)
        out["positional_B"] = "no error"
    except ConfigError as exc:
        out["positional_B"] = str(exc)
    return out


def push_and_pull(ctx: Any) -> dict:
    rank = ctx.rank
    store = ShardedExpertStore(num_layers=1, num_experts=E, projections=ffn_projections(H, I), num_slots=EPN,
                               driver=HostDriver(rank=rank, granularity=GRAN), api="push")
    store.load(lambda layer, proj, e: expert_weight(proj, e))
    dense = {p: torch.stack([expert_weight(p, e) for e in range(E)]) for p in PROJ}
    x, ids, w = rank_inputs(rank)
    tpe = torch.bincount(ids.reshape(-1).long(), minlength=E).to(torch.int32)
    res: dict[str, Any] = {}

    def poison_slots() -> None:
        store.finish_loading()  # every rank has read its slots before anyone overwrites a pool
        for p in PROJ:
            store.slots(0, p).fill_(SENTINEL)
        store.finish_loading()  # no push lands in a pool before its owner poisoned it

    # -- push generation: [2*epn] groups over the push views --
    push = PushReferenceBuffer(S, H, K, E, R, token_padding=TP, explicitly_destroy=True)
    poison_slots()
    hidden, w_nvs, cu, plan = push.dispatch(x, w, ids, tpe)
    ev = push.prefetch_weight(plan, True, **{f"local_{p}_weight": store.owner_view(0, p) for p in PROJ},
                              **{f"{p}_prefetch_buffer": store.push_pool(0, p) for p in PROJ})
    compute = {p: store.push_view(0, p) for p in PROJ}
    y_nvsh = grouped_ffn(hidden, compute["gate"], compute["up"], compute["down"], cu, w_nvs)
    y_push, none_w, none_ev = push.combine(plan, y_nvsh)
    res["event_done"] = ev is not None and ev.query()
    res["combine_extras_none"] = none_w is None and none_ev is None
    res["shapes"] = (tuple(hidden.shape), tuple(w_nvs.shape), tuple(cu.shape), cu.dtype == torch.int32,
                     push._ctx["NvS"], "B" in push._ctx)
    res["push_table"] = plan.experts_to_copy.tolist()
    res["push_cu"] = cu.tolist()
    slots = plan.experts_to_copy[rank].tolist()
    res["slots_hold_experts"] = all(torch.equal(compute[p][EPN + b], dense[p][e])
                                    for b, e in enumerate(slots) if e >= 0 for p in PROJ)
    res["unused_slots_poisoned"] = all(bool((compute[p][EPN + b] == SENTINEL).all())
                                       for b, e in enumerate(slots) if e < 0 for p in PROJ)
    res["own_half_is_own_experts"] = all(torch.equal(compute[p][g], dense[p][rank * EPN + g])
                                         for g in range(EPN) for p in PROJ)
    res["push_copies"], res["generation"] = push.last_prefetch.copies, push.last_prefetch.api
    # Where every entry of every source rank landed here (rebuilt from the source's ids), against cu_seqlens.
    landed, bad_rows = [], 0
    for src in range(R):
        xs, ids_s, _ = rank_inputs(src)
        raw = entry_dst(plan.global_plan, src, ids_s).to(torch.int64)
        raw = torch.where(raw >= 0, raw, -raw - 1)
        mine = raw // NVS_PUSH == rank
        loffs = raw[mine] % NVS_PUSH
        bad_rows += int((hidden[loffs] != xs[torch.nonzero(mine).squeeze(1) // K]).any(dim=1).sum())
        landed += zip(loffs.tolist(), ids_s.reshape(-1)[mine].tolist())
    res["bad_rows"], res["groups_match_landed_rows"] = bad_rows, landed_groups_match(cu.tolist(), slots, landed, rank)
    # The release's zero-copy, asynchronous calls: the FFN writes into the shard, combine reads it in place.
    hidden_zc, w_zc, cu_zc, plan_zc, ev_d = push.dispatch(x, w, ids, tpe, async_finish=True, zero_copy=True,
                                                          router_weights_zero_copy=True)
    hidden_zc.copy_(grouped_ffn(hidden_zc, compute["gate"], compute["up"], compute["down"], cu_zc, w_zc))
    y_zc, _, ev_c = push.combine(plan_zc, hidden_zc, async_finish=True, zero_copy=True)
    res["zero_copy_same"] = (hidden_zc.data_ptr() == push.hidden_nvsh_buffer_view.data_ptr() and ev_d.query()
                             and ev_c.query() and torch.equal(y_zc, y_push))
    push.destroy()
    # -- pull generation: [E+B] groups over the pull views, the same tokens --
    pull = ReferenceBuffer(S, H, K, E, R, token_padding=TP, explicitly_destroy=True)
    poison_slots()
    hidden_a, w_a, cu_a, plan_a = pull.dispatch(x, w, ids, tpe)
    full = {p: store.pull_view(0, p) for p in PROJ}
    pull.prefetch_weight(plan_a, full_gate_weight=full["gate"], full_up_weight=full["up"],
                         full_down_weight=full["down"])
    y_pull, _, _ = pull.combine(plan_a, grouped_ffn(hidden_a, full["gate"], full["up"], full["down"], cu_a, w_a))
    res["pull_table"], res["pull_cu"] = plan_a.experts_to_copy.tolist(), cu_a.tolist()
    res["pull_shapes"] = (tuple(hidden_a.shape), tuple(cu_a.shape))
    res["same_destinations"] = torch.equal(plan.dst // NVS_PUSH, plan_a.dst // NVS_PULL)  # dups: -raw-1 < 0 both
    res["push_equals_pull"] = torch.equal(y_push, y_pull)
    pull.destroy()
    # -- against the dense MoE rounded where the path rounds (the project's bf16 bound), with its control --
    ref = reference_moe_bf16(x, ids, w, dense["gate"], dense["up"], dense["down"])
    res["token_rel_err"] = float(token_rel_errors(y_push, ref).max())
    wrong = reference_moe_bf16(x, (ids + 1) % E, w, dense["gate"], dense["up"], dense["down"])
    res["wrong_expert_rel_err"] = float(token_rel_errors(y_push, wrong).min())
    res["refusals"] = _refusals(rank, store, x, ids, w)
    store.finish_loading()
    store.close()
    return res


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_ranks(push_and_pull, R, timeout_s=180)


def test_push_generation_computes_the_dense_moe_and_the_pull_generation_bit_for_bit(runs):
    tables = [r["push_table"] for r in runs]
    assert tables[0] == tables[1]
    # The routing reaches the slots, and a rank holding two or more slots orders them differently in the two
    # generations: ascending expert id (push, the release's planner) vs count descending (pull).
    assert any(e >= 0 for row in tables[0] for e in row)
    differ = [d for d in range(R) if runs[0]["pull_table"][d] != tables[0][d]]
    assert differ and all(sorted(tables[0][d]) == sorted(runs[0]["pull_table"][d]) for d in range(R))
    assert all(row[:sum(e >= 0 for e in row)] == sorted(e for e in row if e >= 0) for row in tables[0])
    for rank, r in enumerate(runs):
        assert r["shapes"] == ((NVS_PUSH, H), (NVS_PUSH,), (2 * EPN,), True, NVS_PUSH, False), rank
        assert r["pull_shapes"] == ((NVS_PULL, H), (E + EPN,)), rank
        assert r["generation"] == "push" and r["event_done"] and r["combine_extras_none"], rank
        assert r["slots_hold_experts"] and r["unused_slots_poisoned"] and r["own_half_is_own_experts"], rank
        assert r["bad_rows"] == 0 and r["groups_match_landed_rows"], rank
        assert r["zero_copy_same"], rank
        assert 0 <= r["token_rel_err"] <= TOKEN_REL_TOL < r["wrong_expert_rel_err"], (rank, r["token_rel_err"])
        # Every entry goes to the same rank and a slotted expert's rows keep their order in both generations;
        # only group offsets differ. Each group's GEMMs see the same rows, the dedup prologue and the source
        # sum add the same rows in the same order: the outputs are equal bit for bit, not just within the bound.
        assert r["same_destinations"] and r["push_equals_pull"], rank
    # Every used slot is pushed once by its owner, three projections each.
    assert sum(r["push_copies"] for r in runs) == 3 * sum(e >= 0 for row in tables[0] for e in row)
    # The shard layout really differs where the slot order does (so equality is not a copy of one layout).
    assert any(runs[d]["push_cu"][EPN:] != runs[d]["pull_cu"][E:] for d in differ)


def test_push_generation_refusals_raise_on_every_rank_naming_rank_value_and_fix(runs):
    for r in runs:
        short, slots = r["refusals"]["short_batch"], r["refusals"]["B"]
        assert "[rank 1]" in short and "exactly S*K = 32*2 = 64 entries" in short and "got 62" in short, short
        assert "pad the batch to the capacity S=32" in short and "rank 0:" not in short, short
        assert "[rank 1]" in slots and "has no B" in slots and "got 4" in slots and "drop B=" in slots, slots
        assert "group, not B" in r["refusals"]["positional_B"] and "got 4" in r["refusals"]["positional_B"]


def test_the_probe_calls_the_push_reference_buffer_push():
    probe = probe_moonep_api(PushReferenceBuffer)
    assert probe.api == "push" and probe.buffer == "moonep_ep.ops.moonep.push.PushReferenceBuffer"
    assert "__init__ has no B" in probe.evidence
    assert choose_moonep_api(PushReferenceBuffer, "auto").api == "push"
    with pytest.raises(ConfigError, match="contradicts"):
        choose_moonep_api(PushReferenceBuffer, "pull")
    assert probe_moonep_api(ReferenceBuffer).api == "pull"  # control: the pull buffer speaks pull only
    # The reference class a run of each API gets.
    assert reference_buffer_class("push") is PushReferenceBuffer and reference_buffer_class("pull") is ReferenceBuffer


def test_push_planner_matches_a_hand_computed_example():
    """R=2, E=6 (epn 3), K=1, S=8, tp=2. Rank 0 routes [0,0,1,1,1,2,2,2], rank 1 [0,0,1,1,2,2,2,3]:
    C = [4,5,6,1,0,0], loads [15, 1], cap 8, so rank 0 hands 7 entries to rank 1: 6 of expert 2 (its
    fullest), then 1 of expert 1. By hand:
    push: rank 1's slots [1, 2] (ascending id); groups own 3,4,5 then slots: counts [1,0,0 | 1,6,0],
    padded to 2: cu [2,2,2,4,10,10]; rank 0: [4,8,8 | 8,8,8]; NvS = 8 + 1*2*3 = 14 (already even).
    pull (B=3): rank 1's slots [2, 1] (count desc); cu [0,0,0,2,2,2 | 8,10,10], so expert 2's rows start at 2.
    """
    r0, r1 = [0, 0, 1, 1, 1, 2, 2, 2], [0, 0, 1, 1, 2, 2, 2, 3]
    counts = [torch.bincount(torch.tensor(r), minlength=6).tolist() for r in (r0, r1)]
    push = plan_push_dispatch(counts, S=8, K=1, E=6, R=2, token_padding=2)
    assert push.alloc.tolist() == [[4, 0], [4, 1], [0, 6], [0, 1], [0, 0], [0, 0]]
    assert push.experts_to_copy.tolist() == [[-1, -1, -1], [1, 2, -1]]
    assert push.copy_owner.tolist() == [[-1, -1, -1], [0, 0, -1]]
    assert push.cu_seqlens.tolist() == [[4, 8, 8, 8, 8, 8], [2, 2, 2, 4, 10, 10]]
    assert push.zero_fill_ranges[1].tolist() == [[1, 1], [0, 0], [0, 0], [3, 1], [0, 0], [0, 0]]
    assert push.remote_stats.tolist() == [[0, 2], [2, 0]]
    assert push.NvS == 14 and push.num_groups == 6
    # dst = rank*14 + loff: rank 1's expert-1 entry (its 2nd) at slot 0's row 2, expert 2's at rows 4..9.
    assert entry_dst(push, 0, torch.tensor(r0)).tolist() == [0, 1, 4, 5, 6, 18, 19, 20]
    assert entry_dst(push, 1, torch.tensor(r1)).tolist() == [2, 3, 7, 16, 21, 22, 23, 14]
    # route_row[src, e, dst]: first row of src's entries of e on dst (expert 1: rank 1's one entry at slot 0's
    # row 2; expert 2: rank 0's three at rows 4..6, rank 1's three at rows 7..9).
    assert [int(push.route_row[1, 1, 1]), int(push.route_row[0, 2, 1]), int(push.route_row[1, 2, 1])] == [2, 4, 7]
    pull = plan_dispatch(counts, S=8, K=1, E=6, R=2, token_padding=2)  # control: the other generation
    assert [int(pull.route_row[1, 1, 1]), int(pull.route_row[0, 2, 1]), int(pull.route_row[1, 2, 1])] == [8, 2, 5]
    assert pull.experts_to_copy.tolist() == [[-1, -1, -1], [2, 1, -1]]
    assert pull.cu_seqlens[1].tolist() == [0, 0, 0, 2, 2, 2, 8, 10, 10]
    assert entry_dst(pull, 1, torch.tensor(r1)).tolist() == [2, 3, 7, 22, 19, 20, 21, 14]
    # NvS rounding: 5*1 + (4-1)*2*2 = 17 rows, rounded up to 20 (the pull generation keeps 17).
    five = [[5, 0, 0, 0], [0, 0, 5, 0]]
    assert plan_push_dispatch(five, S=5, K=1, E=4, R=2, token_padding=4).NvS == 20
    assert plan_dispatch(five, S=5, K=1, E=4, R=2, token_padding=4).NvS == 17
    # A rank below the capacity is refused, naming it and the fix.
    with pytest.raises(ConfigError, match=r"rank 1 routes 7: got 7\. Fix: pad every batch to the capacity S=8"):
        plan_push_dispatch([counts[0], [2, 2, 1, 1, 1, 0]], S=8, K=1, E=6, R=2, token_padding=2)
