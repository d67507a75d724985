"""The sync-free path's functions driven directly, with a stand-in buffer that plays R = 2 or 3 ranks.

``test_sync_free_decisions.py`` runs the real buffer on a one-rank group, where every entry lands on rank 0.
Here ``_exchange_and_place``, ``combine``, ``_comm_plan``, ``dispatch`` and the deferred error word get a
stand-in ``buf`` whose ``comm`` records what each step sends and hands back a prepared receive buffer (what
the peers sent), and whose counts gather appends prepared peer rows, so the per-destination split, the
placement, the per-destination sums and the gathered header are checked against expected values computed
here with Python loops. A run on the ``meta`` device checks that every tensor is made on the buffer's
device (a CPU tensor there raises).
"""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

from moonep_ep.errors import CollectiveError
from moonep_ep.ops.moonep import sync_free
from moonep_ep.ops.moonep.base import ReferenceBufferBase
from moonep_ep.ops.moonep.commplan import CommPlan
from moonep_ep.ops.moonep.sync_free import FixedRoutes

HOST, BAD_ID, BAD_COUNTS, KINDS = 1 << 8, 1 << 9, 1 << 10, 1 << 11
WHY = sync_free.LOCAL_FLAG_BITS


class FakeComm:
    """One rank's view of R ranks: records each step's name and send buffer; the receive buffer is
    ``recv[step]`` (what the peers sent) or, if none is prepared, a copy of what this rank sent."""

    def __init__(self, device, recv: dict | None = None):
        self.device, self.recv, self.sent, self.steps = torch.device(device), recv or {}, {}, []

    def all_to_all_single(self, step, out, inp):
        assert out.shape == inp.shape and out.device == inp.device == self.device, (step, out.shape, inp.shape)
        self.steps.append(step)
        self.sent[step] = inp.clone()
        out.copy_(self.recv.get(step, inp))

    def peer_loss_named(self, step):
        self.steps.append(step)
        return contextlib.nullcontext()


def _buf(R, S, K, H, NvS, dev="cpu", recv=None, fail=None):
    full = torch.full((NvS + 1, H), -1.0, dtype=torch.bfloat16, device=dev)
    wfull = torch.full((NvS + 1,), -1.0, dtype=torch.float32, device=dev)
    buf = types.SimpleNamespace(R=R, S=S, K=K, H=H, NvS=NvS, E=4, B=2, rank=0, uid=7, device=torch.device(dev),
                                _hidden_full=full, _weight_full=wfull, _hidden_shard=full[:NvS],
                                _weight_shard=wfull[:NvS], _errors=sync_free.DeferredErrors(R, torch.device(dev)),
                                comm=FakeComm(dev, recv))

    def check(*args):
        if fail is not None:
            raise fail
    buf._check_combine_inputs = check
    buf._reuse_error = lambda plan, s: ReferenceBufferBase._reuse_error(buf, plan, s)
    return buf


def _bf16(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32).to(torch.bfloat16)


# -- _exchange_and_place ----------------------------------------------------------------------------------------
R, S, K, H, NvS = 2, 3, 2, 4, 8


def test_each_destination_is_sent_its_entries_rows_and_weights_and_what_arrives_is_placed_by_row():
    # s = 2 tokens: entry -> (rank, row): (0, 2), (1, 5), a duplicate (1, 3), (0, 7); slots 4, 5 unused
    dst = torch.tensor([0 * NvS + 2, 1 * NvS + 5, -(1 * NvS + 3) - 1, 0 * NvS + 7])
    w = torch.tensor([[0.5, 0.25], [0.75, 1.5]])
    x = _bf16([[10 * t + h for h in range(H)] for t in range(2)])
    # what the two sources sent here: each entry slot's row here (-1: none) and its weight
    recv_loff = [[1, -1, 4, -1, -1, 0], [-1, 3, -1, -1, 2, 5]]
    recv_w = [[0.125 * (i + 1) for i in range(S * K)], [2.0 + i for i in range(S * K)]]
    recv_rows = [[[100 * j + 10 * t + h for h in range(H)] for t in range(S)] for j in range(R)]
    meta = torch.stack([torch.tensor(recv_loff, dtype=torch.int32),
                        torch.tensor(recv_w).view(torch.int32)], dim=1)
    buf = _buf(R, S, K, H, NvS, recv={"dispatch: metadata": meta, "dispatch: rows": _bf16(recv_rows)})
    got = sync_free._exchange_and_place(buf, dst, x, w, torch.tensor([[6, 1]], dtype=torch.int32))

    assert buf.comm.steps == ["dispatch: metadata", "dispatch: rows"]
    sent = buf.comm.sent["dispatch: metadata"]
    assert sent.shape == (R, 2, S * K)
    assert sent[:, 0].tolist() == [[2, -1, -1, 7, -1, -1], [-1, 5, 3, -1, -1, -1]]
    assert sent[:, 1].contiguous().view(torch.float32).tolist() == [[0.5, 0.25, 0.75, 1.5, 0.0, 0.0]] * R
    want_rows = [[10 * t + h for h in range(H)] for t in range(2)] + [[0] * H]   # every destination, padded
    assert buf.comm.sent["dispatch: rows"].float().tolist() == [want_rows] * R
    assert got.tolist() == recv_loff
    rows, weights = [[-1.0] * H for _ in range(NvS)], [-1.0] * NvS
    for j in range(R):
        for i, row in enumerate(recv_loff[j]):
            if row >= 0:
                rows[row], weights[row] = [float(v) for v in recv_rows[j][i // K]], recv_w[j][i]
    rows[6], weights[6] = [0.0] * H, 0.0   # the padding row
    assert buf._hidden_shard.float().tolist() == rows
    assert buf._weight_shard.tolist() == weights


def test_a_rank_that_routes_nothing_sends_no_entry_and_zero_rows():
    buf = _buf(R, S, K, H, NvS)   # the peers mirror what this rank sent
    got = sync_free._exchange_and_place(buf, torch.zeros(0, dtype=torch.int64), None, None,
                                        torch.zeros(0, 2, dtype=torch.int32))
    assert buf.comm.sent["dispatch: metadata"][:, 0].tolist() == [[-1] * (S * K)] * R
    assert buf.comm.sent["dispatch: metadata"][:, 1].tolist() == [[0] * (S * K)] * R
    assert buf.comm.sent["dispatch: rows"].float().tolist() == [[[0.0] * H] * S] * R
    assert got.tolist() == [[-1] * (S * K)] * R
    assert buf._hidden_shard.float().tolist() == [[-1.0] * H] * NvS   # nothing placed, nothing zeroed


def test_rows_past_the_last_rank_are_clamped_to_it_so_a_void_step_writes_in_bounds():
    # R*NvS + 1 and its duplicate: no rank owns them; the clamp sends them to the last rank, row 1
    dst = torch.tensor([R * NvS + 1, -(R * NvS + 1) - 1, 3])
    buf = _buf(R, S, K, H, NvS)
    sync_free._exchange_and_place(buf, dst, _bf16([[1] * H] * 2), None, torch.zeros(0, 2, dtype=torch.int32))
    assert buf.comm.sent["dispatch: metadata"][:, 0].tolist() == [[-1, -1, 3, -1, -1, -1], [1, 1, -1, -1, -1, -1]]


# -- combine ----------------------------------------------------------------------------------------------------
CS, CK, CNvS = 2, 2, 6


def _combine_case(route_weights: bool):
    # entries here per (source, token): source 0: [0, 1], [-, 2]; source 1: [3, -], [4, 5]
    recv_loff = torch.tensor([[0, 1, -1, 2], [3, -1, 4, 5]])
    # this rank's tokens' entries: (rank 1, row 0) duplicate, (0, 3), (0, 5) duplicate, (1, 5)
    dst = torch.tensor([-(CNvS + 0) - 1, 3, -5 - 1, CNvS + 5])
    back = [[[d + t + 0.5 * h for h in range(H)] for t in range(CS)] for d in range(R)]
    w_back = [[0.25 * (d * 8 + i) for i in range(CS * CK)] + [0.0] for d in range(R)]
    recv = {"combine: rows": _bf16(back), "combine: route weights": torch.tensor(w_back)}
    buf = _buf(R, CS, CK, H, CNvS, recv=recv)
    plan = types.SimpleNamespace(routing=FixedRoutes(CS, dst, recv_loff), num_tokens=CS)
    hidden = _bf16([[r + 0.25 * h for h in range(H)] for r in range(CNvS)])
    rw = torch.tensor([0.5 + r for r in range(CNvS)]) if route_weights else None
    out, wk = sync_free.combine(buf, plan, hidden, rw, False, False)
    return buf, recv_loff.tolist(), hidden.float().tolist(), back, w_back, dst.tolist(), out, wk


def test_combine_sums_each_pairs_entries_sends_them_back_and_sums_the_destinations_in_rank_order():
    buf, loff, hidden, back, w_back, dst, out, wk = _combine_case(route_weights=True)
    assert buf.comm.steps == ["combine: rows", "combine: route weights"]
    merged = [[[sum(hidden[r][h] for r in loff[j][t * CK:(t + 1) * CK] if r >= 0) for h in range(H)]
               for t in range(CS)] for j in range(R)]
    assert buf.comm.sent["combine: rows"].float().tolist() == merged
    weights = [[0.5 + r if r >= 0 else 0.0 for r in loff[j]] + [0.0] for j in range(R)]
    assert buf.comm.sent["combine: route weights"].tolist() == weights
    assert out.dtype == torch.bfloat16
    assert out.float().tolist() == [[back[0][t][h] + back[1][t][h] for h in range(H)] for t in range(CS)]
    owner = [(d if d >= 0 else -d - 1) // CNvS for d in dst]   # each entry's destination
    assert owner == [1, 0, 0, 1]
    assert wk.tolist() == [[w_back[owner[t * CK + k]][t * CK + k] for k in range(CK)] for t in range(CS)]
    assert buf._errors.bits.tolist() == [0, 0, 0]


def test_combine_without_route_weights_sends_zero_weights_and_returns_none():
    buf, loff, hidden, *_, wk = _combine_case(route_weights=False)
    assert wk is None
    assert buf.comm.sent["combine: route weights"].tolist() == [[0.0] * (CS * CK + 1)] * R


def test_a_destination_past_the_last_rank_is_read_from_the_last_rank():
    buf = _buf(R, 1, 2, H, CNvS, recv={"combine: route weights": torch.tensor([[1.0, 2.0, 0.0], [3.0, 4.0, 0.0]])})
    plan = types.SimpleNamespace(routing=FixedRoutes(1, torch.tensor([R * CNvS + 2, 0]), torch.full((R, 2), -1)),
                                 num_tokens=1)
    _, wk = sync_free.combine(buf, plan, torch.zeros(CNvS, H, dtype=torch.bfloat16), torch.ones(CNvS), False, False)
    assert wk.tolist() == [[3.0, 2.0]]


def test_a_failed_combine_check_is_held_sent_to_every_peer_and_returns_empty_outputs():
    fail = ValueError("hidden_nvsh has 3 rows")
    # peer 1 failed too: its flag arrives in the last column
    w_recv = torch.zeros(R, CS * CK + 1)
    w_recv[1, -1] = float(HOST)
    buf = _buf(R, CS, CK, H, CNvS, recv={"combine: route weights": w_recv}, fail=fail)
    out, wk = sync_free.combine(buf, "not a plan", torch.zeros(3, H, dtype=torch.bfloat16), torch.ones(CNvS),
                                False, False)
    assert buf._errors.held is fail
    assert buf.comm.sent["combine: rows"].float().abs().sum() == 0
    assert buf.comm.sent["combine: route weights"][:, -1].tolist() == [float(HOST)] * R
    assert buf._errors.bits.tolist() == [0, HOST, 0]
    assert out.shape == (0, H) and out.dtype == torch.bfloat16   # not a plan: no tokens
    assert wk.shape == (0, CK) and wk.dtype == torch.float32


def test_a_plan_of_the_lockstep_path_is_refused_naming_its_kind():
    buf = _buf(R, CS, CK, H, CNvS)
    plan = CommPlan.__new__(CommPlan)   # a plan of this buffer's kind of call, made by the lockstep path
    plan.routing, plan.N, plan.K = object(), CS * CK, CK
    out, wk = sync_free.combine(buf, plan, torch.zeros(CNvS, H, dtype=torch.bfloat16), torch.ones(CNvS),
                                False, False)
    assert "other lockstep_checks" in str(buf._errors.held) and "'object'" in str(buf._errors.held)
    assert out.tolist() == [[0.0] * H] * CS and out.dtype == torch.bfloat16   # the plan's tokens, zero
    assert wk.tolist() == [[0.0] * CK] * CS and wk.dtype == torch.float32


# -- the meta device: every tensor on the buffer's device ---------------------------------------------------------
def test_every_tensor_is_made_on_the_buffers_device():
    meta = torch.device("meta")
    buf = _buf(R, S, K, H, NvS, dev="meta")
    assert buf._errors.bits.device == meta and buf._errors.bad_id.device == meta
    dst = torch.tensor([2, NvS + 5, -4, 7], device=meta)
    x = torch.zeros(2, H, dtype=torch.bfloat16, device=meta)
    zero_fill = torch.zeros(3, 2, dtype=torch.int32, device=meta)
    recv_loff = sync_free._exchange_and_place(buf, dst, x, torch.zeros(2, K, device=meta), zero_fill)
    assert recv_loff.device == meta
    assert sync_free._padding_mask(zero_fill, NvS).device == meta
    assert all(t.device == meta for t in sync_free._dedup_tables(recv_loff.view(R * S, K), NvS))
    plan = types.SimpleNamespace(routing=FixedRoutes(2, dst, recv_loff), num_tokens=2)
    out, wk = sync_free.combine(buf, plan, torch.zeros(NvS, H, dtype=torch.bfloat16, device=meta),
                                torch.zeros(NvS, device=meta), False, False)
    assert out.device == meta and wk.device == meta
    gplan = types.SimpleNamespace(experts_to_copy=torch.zeros(R, 2, device=meta),
                                  zero_fill_ranges=torch.zeros(R, 3, 2, device=meta),
                                  remote_stats=torch.zeros(R, 4, device=meta),
                                  cu_seqlens=torch.zeros(R, 6, device=meta), nvs_s=5)
    cplan = sync_free._comm_plan(buf, gplan, dst, recv_loff, 2)
    assert all(t.device == meta for t in (cplan.dst, cplan.dup_groups, cplan.cu_seqlens, cplan.remote_stats))
    buf = _buf(R, S, K, H, NvS, dev="meta", fail=ValueError("x"))
    out, wk = sync_free.combine(buf, "not a plan", x, torch.zeros(NvS, device=meta), False, False)
    assert out.device == meta and wk.device == meta


def test_the_comm_plan_carries_the_global_plans_row_of_this_rank_as_int32():
    buf = _buf(R, S, K, H, NvS)
    buf.rank = 1
    gplan = types.SimpleNamespace(experts_to_copy=torch.tensor([[1, 2], [3, 4]]),
                                  zero_fill_ranges=torch.tensor([[[0, 1]], [[5, 2]]]),
                                  remote_stats=torch.tensor([[7, 8], [9, 10]]),
                                  cu_seqlens=torch.tensor([[1, 2, 3], [4, 5, 6]]), nvs_s=5)
    dst = torch.tensor([3, NvS + 1])
    recv_loff = torch.tensor([[0, -1, 1, 2, -1, -1], [-1, -1, -1, -1, 4, -1]])
    plan = sync_free._comm_plan(buf, gplan, dst, recv_loff, 1)
    assert isinstance(plan, CommPlan)
    assert (plan.R, plan.E, plan.NvS, plan.K, plan.B, plan.nvs_s, plan.rank, plan.N) == (R, 4, NvS, K, 2, 5, 1, K)
    assert plan.dst.tolist() == [3, NvS + 1] and plan.experts_to_copy.tolist() == [[1, 2], [3, 4]]
    assert plan.zero_fill_ranges.tolist() == [[5, 2]] and plan.remote_stats.tolist() == [9, 10]
    assert plan.cu_seqlens.tolist() == [4, 5, 6] and int(plan.num_received) == 4
    assert plan.dup_counts.tolist() == [1, 1]   # source 0's token 1: rows 1 and 2
    tables = (plan.dst, plan.experts_to_copy, plan.zero_fill_ranges, plan.remote_stats, plan.dup_groups,
              plan.dup_loffs, plan.dup_counts, plan.cu_seqlens)
    assert all(t.dtype == torch.int32 for t in tables)
    assert plan.routing.s == 1 and plan.routing.recv_loff is recv_loff and plan.global_plan is gplan


# -- the padding mask ---------------------------------------------------------------------------------------------
def test_padding_ranges_of_a_void_plan_outside_the_shard_are_clipped_to_it():
    # (start, count): before row 0, partly before it, past the end, ending at 0
    ranges = torch.tensor([[-5, 2], [-2, 4], [NvS + 3, 2], [NvS - 1, 9], [-2, 2]], dtype=torch.int32)
    assert sync_free._padding_mask(ranges, NvS).tolist() == [True, True] + [False] * (NvS - 3) + [True]
    assert sync_free._padding_mask(ranges[[0, 4]], NvS).tolist() == [False] * NvS   # both end before row 0
    assert sync_free._padding_mask(torch.tensor([[NvS, 0], [3, 0]]), NvS).tolist() == [False] * NvS


# -- the deferred error word --------------------------------------------------------------------------------------
def _read(errors: sync_free.DeferredErrors, rank: int) -> CollectiveError:
    with pytest.raises(CollectiveError) as info:
        errors.raise_if_set(rank, 4)
    return info.value


def _word(bits, bad=None) -> sync_free.DeferredErrors:
    errors = sync_free.DeferredErrors(len(bits) - 1, torch.device("cpu"))
    errors.bits.copy_(torch.tensor(bits))
    errors.bad_id.copy_(torch.tensor(bad or [0] * (len(bits) - 1)))
    return errors


def test_each_ranks_bits_name_that_rank_with_the_value_and_the_fix_and_the_planners_name_every_rank():
    errors = _word([BAD_ID, BAD_COUNTS | KINDS, 0, 4 | 32], bad=[-3, 0, 0])
    exc = _read(errors, rank=1)
    assert exc.rank == 1 and "sync-free" in exc.step and sorted(exc.failures) == [0, 1, 2]
    zero, one, two = exc.failures[0], exc.failures[1], exc.failures[2]
    assert zero.startswith(WHY[BAD_ID] + " (the first: -3; pass ids in [0, 4)")
    assert "as expert 0 with weight 0)" in zero and "bincount" not in zero
    assert one.startswith(f"{WHY[BAD_COUNTS]}; {WHY[KINDS]}; fix: pass tokens_per_expert = bincount(topk, minlength=E)")
    assert "the first" not in one
    planner = two
    assert planner.startswith("the device planner flagged")
    assert "a rank routes no tokens; total_num_tokens differs from the tokens routed (fix: route 1 <= s <= S" in planner
    assert planner.endswith("total_num_tokens = the sum of s)") and "negative" not in planner
    assert zero.endswith("; " + planner) and one.endswith("; " + planner)
    assert errors.bits.tolist() == [0] * 4 and errors.raise_if_set(1, 4) is None   # read once, then cleared


def test_without_planner_bits_only_the_failing_ranks_are_named():
    exc = _read(_word([0, BAD_COUNTS, 0, 0]), rank=0)
    assert sorted(exc.failures) == [1] and exc.rank == 0
    assert "planner" not in exc.failures[1]


def test_a_held_error_names_its_rank_and_masks_what_follows_from_routing_nothing():
    # rank 1 held a host-side error; rank 0 failed one too; rank 2 a bad id; kinds and the planner follow from them
    errors = _word([HOST | KINDS, HOST | KINDS, BAD_ID | KINDS, 4], bad=[0, 0, 7])
    errors.hold(ValueError("hidden_sh must be bf16"))
    errors.hold(ValueError("a later one"))   # the first is kept
    exc = _read(errors, rank=1)
    assert sorted(exc.failures) == [0, 1, 2]
    assert exc.failures[1] == "ValueError: hidden_sh must be bf16"   # its own host-check bit is not repeated
    assert exc.failures[0] == WHY[HOST]
    assert exc.failures[2].startswith(WHY[BAD_ID] + " (the first: 7;") and WHY[KINDS] not in exc.failures[2]
    assert errors.held is None
    # an earlier step's bad counts on the same rank (bits add up until the read): both named there
    errors = _word([0, HOST | BAD_COUNTS, 0, 0])
    errors.hold(ValueError("hidden_sh must be bf16"))
    text = _read(errors, rank=1).failures[1]
    assert text.startswith("ValueError: hidden_sh must be bf16; " + WHY[BAD_COUNTS]) and WHY[HOST] not in text


def test_a_peers_host_check_masks_kinds_and_planner_without_a_held_error():
    exc = _read(_word([KINDS | BAD_COUNTS, 0, HOST | KINDS, 8]), rank=0)
    assert sorted(exc.failures) == [0, 2]
    assert exc.failures[0].startswith(WHY[BAD_COUNTS]) and WHY[KINDS] not in exc.failures[0]
    assert exc.failures[2] == WHY[HOST]


def test_the_first_bad_id_of_each_rank_is_kept_until_the_read():
    errors = sync_free.DeferredErrors(3, torch.device("cpu"))
    header = torch.zeros(3, 6, dtype=torch.int64)
    header[1, 0], header[1, 5] = BAD_ID, -5
    errors.record(header, torch.tensor(4, dtype=torch.int32))
    header[:, 0], header[:, 5] = torch.tensor([0, BAD_ID, BAD_ID]), torch.tensor([0, 9, 11])
    errors.record(header, torch.tensor(32, dtype=torch.int32))
    assert errors.bits.tolist() == [0, BAD_ID, BAD_ID, 4 | 32]
    assert errors.bad_id.tolist() == [0, -5, 11]


# -- dispatch -----------------------------------------------------------------------------------------------------
E = 4


def _dispatch_buf(monkeypatch, dev="cpu", peers=(), fail=None):
    """A rank-0 stand-in of ``1 + len(peers)`` ranks; ``peers``: the other ranks' gathered rows ``[6 + E]``.
    Its planner routes entry ``i`` to rank 0, row ``i``; ``calls`` records what reached the gather, the
    planner and ``entry_rows``."""
    n = 1 + len(peers)
    buf, calls = _buf(n, S, K, H, NvS, dev), {}
    buf.group = "the group"

    def check_hidden(h):
        if fail is not None:
            raise fail
        return h.shape[0]
    buf._check_hidden, buf._check_plan, buf._check_total = check_hidden, lambda plan: plan, lambda t, s: t
    buf._check_tensor = buf._check_routing_shapes = lambda *args: None
    gplan = types.SimpleNamespace(zero_fill_ranges=torch.zeros(n, 1, 2, dtype=torch.int64, device=dev),
                                  cu_seqlens=torch.arange(n * (E + 2), device=dev).view(n, E + 2),
                                  experts_to_copy=torch.zeros(n, 2, dtype=torch.int64, device=dev),
                                  remote_stats=torch.zeros(n, 4, dtype=torch.int64, device=dev), nvs_s=5)

    def plan(counts, total, local_tokens):
        calls["plan"] = (counts.clone(), total, local_tokens)
        return gplan, torch.tensor(4, dtype=torch.int32, device=dev)
    buf._plan = plan

    def gather(out, inp, group):
        assert group == "the group" and out.device == inp.device == buf.device
        calls["mine"] = inp.clone()
        out.copy_(torch.cat([inp] + [torch.tensor(p, device=dev) for p in peers]))

    def rows(gplan_, rank, ids, s):
        calls["ids"] = ids.clone()
        return torch.arange(s * K, device=dev)
    monkeypatch.setattr(sync_free.dist, "all_gather_single", gather)
    monkeypatch.setattr(sync_free, "entry_rows", rows)
    return buf, calls, gplan


def test_the_gathered_header_holds_the_flags_the_kind_of_call_the_first_bad_id_and_the_counts(monkeypatch):
    buf, calls, gplan = _dispatch_buf(monkeypatch)
    ids = torch.tensor([[1, 3], [3, E]], dtype=torch.int32)   # E: outside [0, E)
    tpe = torch.tensor([0, 1, 0, 2], dtype=torch.int32)       # the bincount of the valid ids
    cu, plan = sync_free.dispatch(buf, _bf16([[1] * H] * 2), torch.ones(2, K), ids, tpe, None, 5)
    # header [flags, s, fresh, weighted, total, first bad id], then the counts (the bad id counted as expert 0)
    assert calls["mine"].tolist() == [BAD_ID | BAD_COUNTS, 2, 1, 1, 5, E, 1, 1, 0, 2]
    assert calls["ids"].tolist() == [1, 3, 3, 0]   # made safe before planning
    counts, total, local = calls["plan"]
    assert counts.tolist() == [[1, 1, 0, 2]] and total == 5 and local == 2
    assert buf.comm.steps == ["dispatch: counts gather", "dispatch: metadata", "dispatch: rows"]
    assert buf._errors.bits.tolist() == [BAD_ID | BAD_COUNTS, 4] and buf._errors.bad_id.tolist() == [E]
    assert cu.dtype == torch.int32 and cu.tolist() == gplan.cu_seqlens[0].tolist()
    assert plan.routing.dst.tolist() == [0, 1, 2, 3] and plan.num_tokens == 2

    buf, calls, _ = _dispatch_buf(monkeypatch)
    ids = torch.tensor([[2, 1]], dtype=torch.int32)
    sync_free.dispatch(buf, _bf16([[1] * H]), None, ids, torch.tensor([0, 1, 1, 0], dtype=torch.int32), None, None)
    assert calls["mine"].tolist() == [0, 1, 1, 0, -1, 2, 0, 1, 1, 0]   # no bad id: the first id is sent
    assert calls["plan"][1:] == (None, 1)


def test_a_failed_host_check_sends_its_flag_routes_nothing_and_still_returns_a_plan(monkeypatch):
    fail = ValueError("hidden_sh has more tokens than S")
    buf, calls, _ = _dispatch_buf(monkeypatch, fail=fail)
    ids = torch.tensor([[1, 2]], dtype=torch.int32)
    cu, plan = sync_free.dispatch(buf, _bf16([[1] * H]), torch.ones(1, K), ids, torch.zeros(E, dtype=torch.int32),
                                  None, 3)
    assert calls["mine"].tolist() == [HOST, 0, 1, 1, 3, 0, 0, 0, 0, 0]
    assert calls["plan"][2] == 1 and "ids" not in calls
    assert buf._errors.held is fail
    assert buf.comm.sent["dispatch: rows"].float().abs().sum() == 0   # its rows are not sent
    assert buf.comm.sent["dispatch: metadata"][:, 0].tolist() == [[-1] * (S * K)]
    assert plan.num_tokens == 0 and plan.dst.numel() == 0 and plan.routing.dst.dtype == torch.int64
    assert cu is not None


def test_ranks_making_different_kinds_of_call_set_the_kinds_bit_on_every_rank(monkeypatch):
    ids, tpe = torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([0, 1, 1, 0], dtype=torch.int32)

    def run(peer):   # this rank: s 1, fresh, weighted, total 2
        buf, calls, _ = _dispatch_buf(monkeypatch, peers=[peer])
        sync_free.dispatch(buf, _bf16([[1] * H]), torch.ones(1, K), ids, tpe, None, 2)
        assert calls["plan"][0].tolist() == [[0, 1, 1, 0], peer[6:]]
        return buf._errors.bits.tolist()
    # the peer differs in s and in its first id only: the same kind of call
    assert run([0, 2, 1, 1, 2, 3, 1, 2, 0, 1]) == [0, 0, 4]
    assert run([0, 1, 0, 1, 2, 1, 0, 1, 1, 0]) == [KINDS, KINDS, 4]   # a reused plan
    assert run([0, 1, 1, 0, 2, 1, 0, 1, 1, 0]) == [KINDS, KINDS, 4]   # no route weights
    assert run([0, 1, 1, 1, 3, 1, 0, 1, 1, 0]) == [KINDS, KINDS, 4]   # another total_num_tokens
    assert run([BAD_ID, 1, 1, 1, 2, 9, 0, 1, 1, 0]) == [0, BAD_ID, 4]


def test_a_reused_plan_is_resent_without_planning(monkeypatch):
    buf, calls, gplan = _dispatch_buf(monkeypatch)
    routes = FixedRoutes(1, torch.tensor([3, 1]), torch.full((1, S * K), -1))
    plan = types.SimpleNamespace(routing=routes, num_tokens=1, global_plan=gplan)
    cu, same = sync_free.dispatch(buf, _bf16([[2] * H]), None, None, None, plan, None)
    assert cu is None and same is plan and "plan" not in calls
    assert calls["mine"].tolist() == [0, 1, 0, 0, -1, 0, 0, 0, 0, 0]
    assert buf.comm.sent["dispatch: metadata"][0, 0].tolist() == [3, 1, -1, -1, -1, -1]
    assert buf._errors.bits.tolist() == [0, 0]


def test_dispatch_makes_every_tensor_on_the_buffers_device(monkeypatch):
    meta = torch.device("meta")
    ids = torch.zeros(2, K, dtype=torch.int32, device=meta)
    x = torch.zeros(2, H, dtype=torch.bfloat16, device=meta)
    buf, _, gplan = _dispatch_buf(monkeypatch, dev="meta", peers=[[0] * (6 + E)])
    cu, plan = sync_free.dispatch(buf, x, torch.zeros(2, K, device=meta), ids, torch.zeros(E, device=meta), None, 4)
    assert cu.device == meta and plan.dst.device == meta
    sync_free.dispatch(buf, x, None, None, None, plan, None)   # reused
    buf, _, _ = _dispatch_buf(monkeypatch, dev="meta", fail=ValueError("x"))
    cu, plan = sync_free.dispatch(buf, x, None, ids, None, None, None)
    assert plan.routing.dst.device == meta


@pytest.fixture
def bf16_default():
    """vLLM's model loader makes the model's dtype torch's default; the sums must stay fp32 anyway."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    yield
    torch.set_default_dtype(before)


def test_sums_and_weights_stay_fp32_where_the_default_dtype_is_bf16(bf16_default):
    # three entries 256, 1, 1: fp32 sums to 258 (a bf16 value); summed in bf16, 256 + 1 rounds back to 256
    n, k = 3, 3
    back = torch.tensor([[[256.0]], [[1.0]], [[1.0]]], dtype=torch.float32).to(torch.bfloat16)
    w_back = torch.tensor([[0.1, 0.2, 0.3, 0.0]] * n, dtype=torch.float32)
    buf = _buf(n, 1, k, 1, 4, recv={"combine: rows": back, "combine: route weights": w_back})
    loff = torch.tensor([[0, 1, 2], [-1, -1, -1], [3, -1, -1]])
    plan = types.SimpleNamespace(routing=FixedRoutes(1, torch.tensor([0, 4, 8]), loff), num_tokens=1)
    hidden = torch.tensor([[256.0], [1.0], [1.0], [5.0]], dtype=torch.float32).to(torch.bfloat16)
    weights = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float32)
    out, wk = sync_free.combine(buf, plan, hidden, weights, False, False)
    assert buf.comm.sent["combine: rows"].float().view(-1).tolist() == [258.0, 0.0, 5.0]
    assert buf.comm.sent["combine: route weights"].dtype == torch.float32
    assert buf.comm.sent["combine: route weights"][0, :k].tolist() == weights[:k].tolist()
    assert out.float().tolist() == [[258.0]]
    assert wk.dtype == torch.float32 and wk.tolist() == [[w_back[d, d].item() for d in range(k)]]
    buf = _buf(n, 1, k, 1, 4, fail=ValueError("x"))
    out, wk = sync_free.combine(buf, "not a plan", hidden, weights, False, False)
    assert out.dtype == torch.bfloat16 and wk.dtype == torch.float32
    buf = _buf(n, 1, k, 1, 4)
    sync_free._exchange_and_place(buf, torch.tensor([0, 4, 8]), hidden[:1], weights[None, :k],
                                  torch.zeros(0, 2, dtype=torch.int32))
    assert buf.comm.sent["dispatch: metadata"][0, 1].view(torch.float32).tolist() == weights[:k].tolist()
    # a row's rank is an integer division: 1999 // 1000 = 1, though 1999 / 1000 rounds to 2.0 in bf16
    buf = _buf(n, 1, 1, 1, 1000)
    sync_free._exchange_and_place(buf, torch.tensor([1999]), hidden[:1], None, torch.zeros(0, 2, dtype=torch.int32))
    assert buf.comm.sent["dispatch: metadata"][:, 0].tolist() == [[-1], [999], [-1]]


def test_a_cloned_route_table_is_equal_and_independent():
    routes = FixedRoutes(2, torch.tensor([1, -3]), torch.tensor([[0, -1]]))
    copy = routes.clone()
    assert (copy.s, copy.dst.tolist(), copy.recv_loff.tolist()) == (2, [1, -3], [[0, -1]])
    copy.dst[0], copy.recv_loff[0, 0] = 7, 7
    assert routes.dst.tolist() == [1, -3] and routes.recv_loff.tolist() == [[0, -1]]
