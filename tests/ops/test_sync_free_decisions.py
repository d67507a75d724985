"""The sync-free path's decisions in this process (a one-rank gloo group), where mutation testing sees them.

``test_sync_free.py`` compares the paths on 2 and 4 spawned ranks; here one rank, so every entry lands on it and
the dedup tables, the padding mask, the placement and the deferred errors are checked against references
written here (Python loops), and the lockstep path on the same call. ``scripts/mutate.py`` runs this file
against ``ops/moonep/sync_free.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from moonep_ep.errors import CollectiveError
from moonep_ep.ops.moonep import sync_free
from moonep_ep.ops.moonep.pull import ReferenceBuffer
from moonep_ep.ops.moonep.push import PushReferenceBuffer

H, K, E, S, TP = 128, 3, 4, 4, 4


def _inputs(s: int, seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(s)]).to(torch.int32)
    ids[0, 2] = ids[0, 0]          # a token with two entries on one expert: a dedup group
    ids[s - 1, 1] = ids[s - 1, 0]  # and another
    tpe = torch.bincount(ids.reshape(-1).long(), minlength=E).to(torch.int32)
    x = torch.randn(s, H, generator=gen).to(torch.bfloat16)
    w = torch.rand(s, K, generator=gen)
    return ids, tpe, x, w


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _dispatch_combine(buf, ids, tpe, x, w) -> dict:
    hidden, w_nvs, cu, plan = buf.dispatch(x, w, ids, tpe)
    end = int(cu[-1])
    n_groups, n_dups = plan.dup_counts.tolist()
    y = (hidden.float() * 1.5 - 0.25).to(torch.bfloat16)
    out, wk, _ = buf.combine(plan, y, w_nvs)
    again, _, _, _ = buf.dispatch(x * 2, w, plan=plan)
    return {"cu": cu.tolist(), "dst": plan.dst.tolist(), "zero_fill": plan.zero_fill_ranges.tolist(),
            "num_received": int(plan.num_received), "rows": _bits(hidden[:end]).tolist(),
            "weights": w_nvs[:end].tolist(), "groups": plan.dup_groups[:n_groups].tolist(),
            "dups": plan.dup_loffs[:n_dups].tolist(), "counts": [n_groups, n_dups], "out": _bits(out).tolist(),
            "weights_back": wk.tolist(), "reused_rows": _bits(again[:end]).tolist()}


@pytest.mark.parametrize("api", ["pull", "push"])
def test_one_rank_sync_free_equals_the_lockstep_path_and_the_formula(one_rank, api):
    def make(lockstep: bool):
        if api == "pull":
            return ReferenceBuffer(S, H, K, E, 1, token_padding=TP, B=2, lockstep_checks=lockstep)
        return PushReferenceBuffer(S, H, K, E, 1, token_padding=TP, lockstep_checks=lockstep)
    lock, free = make(True), make(False)
    for seed in range(3):
        ids, tpe, x, w = _inputs(S, seed)
        a, b = _dispatch_combine(lock, ids, tpe, x, w), _dispatch_combine(free, ids, tpe, x, w)
        assert a == b, [k for k in a if a[k] != b[k]]
        # one rank: every token's K entries land here, each token a dedup group of K - 1 duplicates
        assert b["num_received"] == S * K and b["counts"] == [S, S * (K - 1)], b["counts"]
        # the formula: each token's K rows summed in fp32, rounded once (one rank: every entry is here)
        y = (x.float() * 1.5 - 0.25).to(torch.bfloat16).float()
        want = torch.zeros(S, H)
        for k in range(K):
            want += y
        assert b["out"] == _bits(want.to(torch.bfloat16)).tolist()
        assert b["weights_back"] == w.tolist()
        free.raise_deferred_errors()   # good input: nothing to raise
    lock.destroy()
    free.destroy()


def test_the_padding_mask_marks_exactly_the_rows_of_every_range():
    ranges = torch.tensor([[0, 2], [2, 0], [5, 3], [8, 1], [12, 0], [12, 4]], dtype=torch.int32)
    want = [False] * 20
    for start, count in ranges.tolist():
        for row in range(start, start + count):
            want[row] = True
    assert sync_free._padding_mask(ranges, 20).tolist() == want
    assert sync_free._padding_mask(torch.tensor([[18, 5]], dtype=torch.int32), 20).tolist() == [False] * 18 + [True] * 2


def test_the_dedup_tables_list_each_pairs_primary_then_its_duplicates_in_k_order():
    entries = torch.tensor([[3, -1, 7], [-1, -1, -1], [9, 10, 11], [-1, 4, 5], [6, -1, -1]])
    groups, loffs, counts = sync_free._dedup_tables(entries, NvS=16)
    want_groups, want_loffs = [], []
    for row in entries.tolist():
        present = [v for v in row if v >= 0]
        if len(present) >= 2:
            want_groups.append([present[0], len(want_loffs), len(present) - 1])
            want_loffs += present[1:]
    assert counts.tolist() == [len(want_groups), len(want_loffs)] == [3, 4]
    assert groups[:3].tolist() == want_groups and groups[3:].abs().sum() == 0
    assert loffs[:4].tolist() == want_loffs and loffs[4:].abs().sum() == 0


def _raised(buf) -> str:
    try:
        buf.raise_deferred_errors()
    except CollectiveError as exc:
        return str(exc)
    return "no error"


def test_each_check_is_deferred_named_with_its_value_and_cleared_after_the_read(one_rank):
    buf = ReferenceBuffer(S, H, K, E, 1, token_padding=TP, B=2, lockstep_checks=False)
    ids, tpe, x, w = _inputs(S, 0)
    bad = ids.clone()
    bad[1, 1] = -3
    buf.dispatch(x, w, bad, tpe)
    text = _raised(buf)
    assert "expert id outside [0, E) (the first: -3; pass ids in [0, 4)" in text, text
    assert _raised(buf) == "no error"   # the read cleared the word
    wrong = tpe.clone()
    wrong[2] += 1
    buf.dispatch(x, w, ids, wrong)
    text = _raised(buf)
    assert "tokens_per_expert disagrees" in text and "expert id" not in text, text
    ids3, tpe3, x3, w3 = _inputs(S - 1, 1)
    buf.dispatch(x3, w3, ids3, tpe3, total_num_tokens=S)   # a total the host allows, the tokens routed do not
    text = _raised(buf)
    assert "the device planner flagged" in text and "total_num_tokens differs" in text, text
    _, _, cu, plan = buf.dispatch(x.float(), w, ids, tpe)   # a host-side check: held, the call still returns
    assert cu.shape == (E + 2,) and plan.num_tokens == 0
    text = _raised(buf)
    assert "ConfigError" in text and "hidden_sh" in text and "planner" not in text, text
    _, _, _, plan = buf.dispatch(x, w, ids, tpe)
    out, wk, _ = buf.combine(plan, torch.zeros(3, H, dtype=torch.bfloat16), None)   # wrong rows: held
    assert out.shape == (S, H) and wk is None
    text = _raised(buf)
    assert "hidden_nvsh" in text, text
    buf.combine(plan, buf.hidden_nvsh_buffer_view, None)
    assert _raised(buf) == "no error"
    buf.dispatch(x, w, bad, tpe)
    with pytest.raises(CollectiveError, match="the first: -3"):
        sync_free.raise_everywhere()
    buf.dispatch(x, w, bad, tpe)
    with pytest.raises(CollectiveError, match="the first: -3"):
        buf.destroy()   # a pending error is raised at the end, after the release
    assert buf.destroyed
    sync_free.raise_everywhere()   # a destroyed buffer is skipped


def test_host_side_checks_of_each_argument_are_deferred_naming_it(one_rank):
    buf = ReferenceBuffer(S, H, K, E, 1, token_padding=TP, B=2, lockstep_checks=False)
    ids, tpe, x, w = _inputs(S, 0)
    _, _, _, plan = buf.dispatch(x, None, ids, tpe)   # no route weights: nothing to check
    assert _raised(buf) == "no error"
    buf.dispatch(x, w[:, :2], ids, tpe)
    text = _raised(buf)
    assert "route_weights_sk must have shape" in text and f"[s, K] = [{S}, {K}]" in text, text
    buf.dispatch(x, w, ids[:3], tpe)
    assert f"topk_experts_sk must have shape [{S}, {K}]" in _raised(buf)
    buf.dispatch(x[:3], None, plan=plan)   # a plan made for S tokens
    text = _raised(buf)
    assert f"reused plan was made for {S} tokens: got 3" in text, text
    y = buf.hidden_nvsh_buffer_view
    buf.combine(plan, y, torch.zeros(buf.NvS, dtype=torch.float64))
    assert "route_weights_nvs must be float32" in _raised(buf)
    buf.combine(plan, y.clone(), None, zero_copy=True)
    assert "zero_copy combine needs hidden_nvsh to alias" in _raised(buf)
    buf.combine(plan, y, torch.zeros(buf.NvS), router_weights_zero_copy=True)
    assert "router_weights_zero_copy needs route_weights_nvs to alias" in _raised(buf)
    buf.destroy()


def test_the_counts_gather_uses_all_gather_single_and_falls_back_where_torch_lacks_it(one_rank, monkeypatch):
    buf = ReferenceBuffer(S, H, K, E, 1, token_padding=TP, B=2, lockstep_checks=False)
    ids, tpe, x, w = _inputs(S, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)   # torch >= 2.13 deprecates all_gather_into_tensor
        cu, *_ = buf.dispatch(x, w, ids, tpe)
    monkeypatch.delattr(dist, "all_gather_single")   # torch < 2.13
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        again, *_ = buf.dispatch(x, w, ids, tpe)
    assert again.tolist() == cu.tolist() and _raised(buf) == "no error"
    buf.destroy()
