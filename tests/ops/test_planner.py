"""Tests of the MoonEP pull dispatch planner (docs/design/moonep.md §4).

1. The worked example of moonep.md §4.10, every field it gives.
2. Hand-checked corner cases (slot tie-breaking with B < #remote, a donor
   that overshoots and becomes a receiver).
3. Hypothesis properties over random, skewed routing: the §4.9 guarantees.
4. Bad inputs: ConfigError messages name the value and the fix.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moonep_ep.errors import ConfigError
from moonep_ep.ops.moonep.planner import DispatchPlan, entry_dst, nvs_rows, plan_dispatch
from tests.support.hypothesis_budget import max_examples

SETTINGS = settings(max_examples=max_examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])


def counts_of(topks: list[list[int]], E: int) -> list[list[int]]:
    return [torch.bincount(torch.tensor(t, dtype=torch.int64), minlength=E).tolist() for t in topks]


def decode(dst: torch.Tensor, NvS: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dest rank, loff) of every entry, duplicates included."""
    raw = torch.where(dst >= 0, dst, -dst - 1).to(torch.int64)
    return raw // NvS, raw % NvS


# ---------------------------------------------------------------------------
# 1. worked example (§4.10)

EX_TOPK = [[0, 1, 0, 1, 0, 2, 1, 0], [0, 1, 1, 0, 0, 3, 0, 1]]


@pytest.fixture
def example_plan() -> DispatchPlan:
    return plan_dispatch(counts_of(EX_TOPK, 4), S=4, K=2, E=4, R=2, B=2, token_padding=4)


def test_worked_example_globals(example_plan: DispatchPlan) -> None:
    p = example_plan
    assert (p.epn, p.N, p.NvS, p.nvs_s, p.total_num_tokens) == (2, 8, 20, 20, 8)
    assert p.NvS == nvs_rows(4, 2, 4, 2, 4) == 8 + 3 * 2 * 2
    assert p.tokens_per_expert.sum(0).tolist() == [8, 6, 1, 1]  # C
    assert p.tokens_per_expert.sum(0).view(2, 2).sum(1).tolist() == [14, 2]  # G_tok; balance = G_tok - cap = [6, -6]
    assert p.cap.tolist() == [8, 8]
    assert p.z.tolist() == [[0, 6], [0, 0]]
    assert p.alloc.tolist() == [[2, 6], [6, 0], [0, 1], [0, 1]]
    assert p.experts_to_copy.tolist() == [[-1, -1], [0, -1]]
    assert p.copy_owner.tolist() == [[-1, -1], [0, -1]]
    assert p.remote_stats.tolist() == [[0, 1], [1, 0]]


def test_worked_example_pull_layout(example_plan: DispatchPlan) -> None:
    p = example_plan
    assert p.cu_seqlens.tolist() == [[4, 12, 12, 12, 12, 12], [0, 0, 4, 8, 16, 16]]
    assert [[tuple(x) for x in row] for row in p.zero_fill_ranges.tolist()] == [
        [(2, 2), (10, 2), (0, 0), (0, 0), (0, 0), (0, 0)],
        [(0, 0), (0, 0), (1, 3), (5, 3), (14, 2), (0, 0)],
    ]


def test_worked_example_push_segments(example_plan: DispatchPlan) -> None:
    # The planner is pull; push differs only in group order (local experts,
    # then slots by ascending id). Re-deriving the push numbers from alloc
    # checks the same counts and padding.
    p, tp = example_plan, example_plan.token_padding
    cu_b, zf_b = [], []
    for d in range(p.R):
        remote = sorted(int(e) for e in p.experts_to_copy[d] if e >= 0)
        groups = list(range(d * p.epn, (d + 1) * p.epn)) + remote + [-1] * (p.epn - len(remote))
        start, cu, zf = 0, [], []
        for e in groups:
            cnt = int(p.alloc[e, d]) if e >= 0 else 0
            padded = -(-cnt // tp) * tp
            zf.append((start + cnt, padded - cnt) if padded > cnt else (0, 0))
            start += padded
            cu.append(start)
        cu_b.append(cu)
        zf_b.append(zf)
    assert cu_b == [[4, 12, 12, 12], [4, 8, 16, 16]]
    assert zf_b == [[(2, 2), (10, 2), (0, 0), (0, 0)], [(1, 3), (5, 3), (14, 2), (0, 0)]]


def test_worked_example_dst(example_plan: DispatchPlan) -> None:
    p = example_plan
    dst0 = entry_dst(p, 0, torch.tensor(EX_TOPK[0]).view(4, 2))
    dst1 = entry_dst(p, 1, EX_TOPK[1])  # flat list accepted too
    assert dst0.dtype == torch.int32 and dst0.shape == (8,)
    assert dst0.tolist() == [0, -5, 1, -6, 28, -21, 6, 29]
    assert dst1.tolist() == [30, 7, 8, 31, 32, -25, 33, 9]
    raw = lambda v: [x if x >= 0 else -x - 1 for x in v.tolist()]  # noqa: E731
    assert raw(dst0) == [0, 4, 1, 5, 28, 20, 6, 29]
    assert raw(dst1) == [30, 7, 8, 31, 32, 24, 33, 9]
    # Any integer dtype of ids gives the same rows (uint8 ids index like int64 ones, not as a mask).
    for dtype in (torch.uint8, torch.int16, torch.int32):
        assert entry_dst(p, 0, torch.tensor(EX_TOPK[0], dtype=dtype)).tolist() == [0, -5, 1, -6, 28, -21, 6, 29]


def test_worked_example_routes(example_plan: DispatchPlan) -> None:
    p = example_plan
    # Expert 0: rank 0's 4 entries = global [0,4): 2 home rows on rank 0 then
    # rows 8,9 of rank 1's slot segment; rank 1's 4 entries follow at row 10.
    assert p.route_count[:, 0, :].tolist() == [[2, 2], [0, 4]]
    assert p.route_row[:, 0, :].tolist() == [[0, 8], [-1, 10]]
    assert p.expert_off.tolist() == [[0, 4, -1, -1], [8, -1, 0, 4]]


# ---------------------------------------------------------------------------
# 2. hand-checked corner cases


def test_pull_slot_ties_and_unslotted_remote() -> None:
    # Group 0 (experts 0..3) holds all 16 entries; rank 1 takes 8 of them:
    # 4 of expert 0 and 4 of expert 1 (fullest expert first, ties -> smaller j).
    T = [[2, 2, 2, 2, 0, 0, 0, 0]] * 2
    p2 = plan_dispatch(T, S=8, K=1, E=8, R=2, B=2, token_padding=1)
    assert p2.alloc[:, 1].tolist() == [4, 4, 0, 0, 0, 0, 0, 0]
    # Equal counts: the larger id takes the first slot.
    assert p2.experts_to_copy.tolist() == [[-1, -1], [1, 0]]
    p1 = plan_dispatch(T, S=8, K=1, E=8, R=2, B=1, token_padding=1)
    assert p1.experts_to_copy.tolist() == [[-1], [1]]
    assert p1.remote_stats.tolist() == [[0, 1], [2, 0]]  # 2 remote experts, 1 slotted
    # Unslotted expert 0 is computed in its own group g = 0 (reading full[0]).
    assert p1.cu_seqlens[1].tolist() == [4, 4, 4, 4, 4, 4, 4, 4, 8]
    assert p1.expert_off[1].tolist()[:2] == [0, 4]


def test_overshooting_donor_becomes_receiver() -> None:
    # R=3, epn=1: G_tok=[7,7,1], cap=5 each, balance [2,2,-4]. Donor 0 fills
    # rank 2 (overshoots to -2), then donor 1 fills rank 0.
    T = [[3, 2, 0], [2, 3, 0], [2, 2, 1]]
    p = plan_dispatch(T, S=5, K=1, E=3, R=3, token_padding=1)
    assert p.z.tolist() == [[0, 0, 4], [2, 0, 0], [0, 0, 0]]
    assert p.alloc.tolist() == [[3, 0, 4], [2, 5, 0], [0, 0, 1]]
    assert p.cap.tolist() == [5, 5, 5]
    assert p.experts_to_copy.tolist() == [[1], [-1], [0]]


def test_receiver_ties_pick_smallest_rank() -> None:
    # R=4, epn=1: balance [1, 1, -1, -1]. Donor 0 fills the first of the tied
    # receivers (rank 2), then donor 1 fills rank 3.
    T = [[3, 0, 0, 0], [1, 2, 0, 0], [0, 2, 1, 0], [0, 0, 1, 2]]
    p = plan_dispatch(T, S=3, K=1, E=4, R=4, token_padding=1)
    assert p.z.tolist() == [[0, 0, 1, 0], [0, 0, 0, 1], [0] * 4, [0] * 4]
    assert p.alloc.tolist() == [[3, 0, 1, 0], [0, 3, 0, 1], [0, 0, 2, 0], [0, 0, 0, 2]]


def test_donor_ties_pick_smallest_rank() -> None:
    # R=3, epn=1: balance [1, 1, -2]. Donor 0 (first max) fills rank 2 and
    # overshoots; donor 1 then fills rank 0.
    T = [[3, 0, 0], [1, 2, 0], [0, 2, 1]]
    p = plan_dispatch(T, S=3, K=1, E=3, R=3, token_padding=1)
    assert p.z.tolist() == [[0, 0, 2], [1, 0, 0], [0, 0, 0]]
    assert p.alloc.tolist() == [[2, 0, 2], [1, 3, 0], [0, 0, 1]]


def test_split_serves_tied_quotas_smallest_rank_first() -> None:
    # Group 0 = experts 0, 1 with 5 and 4 entries; ranks 1 and 2 each need 2
    # (tied quotas). Rank 1 goes first and takes the fullest expert (0), which
    # leaves expert 1 the fullest for rank 2.
    T = [[3, 2, 0, 0, 0, 0], [2, 2, 1, 0, 0, 0], [0, 0, 2, 0, 1, 2]]
    p = plan_dispatch(T, S=5, K=1, E=6, R=3, token_padding=1)
    assert p.cap.tolist() == [5, 5, 5]
    assert p.z.tolist() == [[0, 2, 2], [0, 0, 0], [0, 0, 0]]
    assert p.alloc[:2].tolist() == [[3, 2, 0], [2, 0, 2]]
    assert p.experts_to_copy.tolist() == [[-1, -1], [0, -1], [1, -1]]
    # Entry order: expert 0's entries (source 0 first) fill rank 0 then rank 1.
    assert p.route_count[:, 0, :].tolist() == [[3, 0, 0], [0, 2, 0], [0, 0, 0]]
    assert p.route_count[:, 1, :].tolist() == [[2, 0, 0], [0, 0, 2], [0, 0, 0]]


def test_no_migration_when_home_fits() -> None:
    T = [[2, 2, 0, 0], [0, 0, 3, 1]]
    p = plan_dispatch(T, S=2, K=2, E=4, R=2, token_padding=8)
    assert int(p.z.abs().sum()) == 0
    assert p.alloc.tolist() == [[2, 0], [2, 0], [0, 3], [0, 1]]
    assert (p.experts_to_copy == -1).all()
    assert p.cu_seqlens.tolist() == [[8, 16, 16, 16, 16, 16], [0, 0, 8, 16, 16, 16]]


# ---------------------------------------------------------------------------
# 3. properties


def expected_slots(alloc: list[list[int]], d: int, epn: int, B: int) -> tuple[list[int], list[int]]:
    """Remote experts of destination d, and the pull slot choice (§4.5)."""
    remote = [e for e in range(len(alloc)) if alloc[e][d] > 0 and e // epn != d]
    return remote, sorted(remote, key=lambda e: (alloc[e][d], e), reverse=True)[:B]


def check_plan(p: DispatchPlan, T: np.ndarray, total_given: int | None) -> None:
    """Every §4.9 guarantee that only needs the counts."""
    R, E, epn, B, tp, K = p.R, p.E, p.epn, p.B, p.token_padding, p.K
    T = torch.as_tensor(T, dtype=torch.int64)
    alloc = p.alloc.to(torch.int64)
    C = T.sum(0)
    total = int(T.sum())
    s = T.sum(1) // K

    # inputs kept as given
    assert torch.equal(p.tokens_per_expert.to(torch.int64), T)
    assert torch.equal(p.num_tokens.to(torch.int64), s)
    assert torch.equal(p.tpe_cumsum.to(torch.int64), T.cumsum(0))
    assert p.total_num_tokens == int(s.sum()) == (total_given if total_given is not None else R * int(s[0]))

    # quotas: every rank receives exactly cap[d] rows
    cap = [total // R + (1 if d < total % R else 0) for d in range(R)]
    assert p.cap.tolist() == cap
    if bool((s == p.S).all()):
        assert cap == [p.S * K] * R
    assert bool((alloc >= 0).all())
    assert torch.equal(alloc.sum(1), C)  # conservation
    assert alloc.sum(0).tolist() == cap  # capacity
    assert torch.equal(p.alloc_cumsum.to(torch.int64), alloc.cumsum(1))

    # donor structure: z matches alloc, one donor group per receiver
    z = p.z.to(torch.int64)
    assert bool((z >= 0).all()) and int(z.diagonal().abs().sum()) == 0
    assert bool(((z > 0).sum(0) <= 1).all())
    group_alloc = alloc.view(R, epn, R).sum(1)  # [h, d]
    off_home = group_alloc - torch.diag(group_alloc.diagonal())
    assert torch.equal(off_home, z)
    G_tok = C.view(R, epn).sum(1)
    if bool((G_tok <= torch.tensor(cap)).all()):
        assert int(z.sum()) == 0

    NvS, nvs_s = p.NvS, p.nvs_s
    assert NvS == p.S * K + (tp - 1) * 2 * epn
    assert nvs_s == -(-total // R) + (tp - 1) * 2 * epn and nvs_s <= NvS

    # Per destination, on plain lists (tensor element access is slow).
    A = alloc.tolist()
    etc, owner = p.experts_to_copy.tolist(), p.copy_owner.tolist()
    cu_all, zf_all, off_all = p.cu_seqlens.tolist(), p.zero_fill_ranges.tolist(), p.expert_off.tolist()
    stats = p.remote_stats.tolist()
    stats1 = [0] * R
    for d in range(R):
        remote_groups = {e // epn for e in range(E) if A[e][d] > 0 and e // epn != d}
        assert len(remote_groups) <= 1  # at most one remote home group
        assert sum(A[e][d] > 0 for e in range(E)) <= 2 * epn  # <= 2*epn segments

        # experts_to_copy: pull slot order, valid prefix, <= B
        remote, slots = expected_slots(A, d, epn, B)
        assert etc[d] == slots + [-1] * (B - len(slots))
        assert len(slots) <= min(B, epn)
        assert all(0 <= e < E and e // epn != d for e in slots)
        assert owner[d] == [e // epn for e in slots] + [-1] * (B - len(slots))
        assert stats[d][0] == len(remote)
        for e in slots:
            stats1[e // epn] += 1

        # cu_seqlens / zero_fill / expert_off: pull group order
        group_expert = [(-1 if g in slots else g) for g in range(E)] + etc[d]
        assert check_group_layout(A, d, group_expert, tp, cu_all[d], zf_all[d], off_all[d]) == cap[d]
        assert cu_all[d][-1] <= nvs_s <= NvS
    assert [row[1] for row in stats] == stats1
    check_routes(p, T)


def check_group_layout(A: list[list[int]], d: int, group_expert: list[int], tp: int, cu: list[int],
                       zf: list[list[int]], off: list[int]) -> int:
    """Destination d's groups back to back, each expert's ``A[e][d]`` rows padded to tp, in the order
    ``group_expert`` names (-1 = empty); returns the real rows laid out."""
    start = real_rows = 0
    placed = set()
    for g, e in enumerate(group_expert):
        cnt = A[e][d] if e >= 0 else 0
        seg = cu[g] - start
        assert seg >= 0 and seg % tp == 0  # non-decreasing, padded to tp
        assert seg == -(-cnt // tp) * tp
        assert zf[g] == ([start + cnt, seg - cnt] if seg > cnt else [0, 0])
        if cnt > 0:
            assert off[e] == start
            placed.add(e)
        real_rows += cnt
        start = cu[g]
    # experts absent from d have no offset
    assert all(off[e] == -1 for e in range(len(A)) if e not in placed)
    return real_rows


def check_routes(p: DispatchPlan, T: torch.Tensor) -> None:
    """Route tables: every (source, expert) entry assigned once, rows contiguous from expert_off."""
    alloc = p.alloc.to(torch.int64)
    R = p.R
    rc = p.route_count.to(torch.int64)
    rr = p.route_row.to(torch.int64)
    assert bool((rc >= 0).all())
    assert torch.equal(rc.sum(2), T)
    assert torch.equal(rc.sum(0), alloc)  # [E, R]: destinations get exactly alloc
    next_row = p.expert_off.to(torch.int64).t().clone()  # [E, R]
    for src in range(R):
        live = rc[src] > 0
        assert torch.equal(rr[src][~live], torch.full_like(rr[src][~live], -1))
        assert torch.equal(rr[src][live], next_row[live])
        next_row = next_row + rc[src]


@st.composite
def layouts(draw, max_S: int):
    R = draw(st.sampled_from([2, 4, 8]))
    epn = draw(st.integers(1, 6))
    K = draw(st.sampled_from([1, 2, 4, 8]))
    tp = draw(st.sampled_from([1, 2, 3, 4, 8, 128]))
    # Small B is over-weighted so that B < #remote (unslotted remote experts) occurs.
    B = draw(st.one_of(st.none(), st.just(1), st.integers(1, epn + 1)))
    S = draw(st.integers(1, max_S))
    varlen = draw(st.booleans())
    if varlen:
        s = draw(st.lists(st.integers(1, S), min_size=R, max_size=R))
    else:
        s = [draw(st.integers(1, S))] * R
    return R, epn * R, K, tp, B, S, s, varlen


@SETTINGS
@given(
    layout=layouts(max_S=4096),
    alpha=st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0, 4.0]),
    per_rank_perm=st.booleans(),
    mode=st.sampled_from(["zipf", "zipf", "zipf", "hot_group", "all_local", "all_remote", "single_expert"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_plan_properties_from_counts(layout, alpha, per_rank_perm, mode, seed) -> None:
    R, E, K, tp, B, S, s, varlen = layout
    epn = E // R
    rng = np.random.default_rng(seed)
    perm = rng.permutation(E)
    T = np.zeros((R, E), dtype=np.int64)
    for r in range(R):
        n = s[r] * K
        if mode == "single_expert":
            T[r, 0] = n
            continue
        if mode == "all_local":
            w = np.zeros(E)
            w[r * epn:(r + 1) * epn] = 1.0
        elif mode in ("all_remote", "hot_group"):
            # hot_group: every rank spreads evenly over group 0, so receivers
            # take several of its experts (exercises B < #remote).
            h = (r + 1) % R if mode == "all_remote" else 0
            w = np.zeros(E)
            w[h * epn:(h + 1) * epn] = 1.0
        else:  # Zipf-like: weight 1/(rank+1)^alpha over a random expert order
            order = rng.permutation(E) if per_rank_perm else perm
            w = np.empty(E)
            w[order] = 1.0 / np.arange(1, E + 1) ** alpha
        T[r] = rng.multinomial(n, w / w.sum())
    total_given = sum(s) if varlen else None
    # Input type must not matter: numpy int64 / torch int32 / nested lists.
    p = plan_dispatch(T, S=S, K=K, E=E, R=R, B=B, token_padding=tp, total_num_tokens=total_given)
    check_plan(p, T, total_given)
    assert p.B == (epn if B is None else B)
    # determinism
    again = plan_dispatch(
        torch.from_numpy(T).to(torch.int32), S=S, K=K, E=E, R=R, B=B, token_padding=tp, total_num_tokens=total_given
    )
    assert p.same_as(again)
    assert p.same_as(plan_dispatch(T.tolist(), S=S, K=K, E=E, R=R, B=B, token_padding=tp, total_num_tokens=total_given))


@st.composite
def routed_topk(draw):
    R, E, K, tp, B, S, s, varlen = draw(layouts(max_S=8))
    epn = E // R
    alpha = draw(st.sampled_from([0.0, 1.0, 2.0, 4.0]))
    mode = draw(
        st.sampled_from(["zipf", "zipf", "zipf", "hot_group", "all_local", "all_remote", "duplicate_topk", "single_expert"])
    )
    hot = draw(st.integers(0, E - 1))
    topks = []
    for r in range(R):
        xs = draw(st.lists(st.integers(0, 2**16 - 1), min_size=s[r] * K, max_size=s[r] * K))
        if mode == "zipf":
            # u^alpha piles mass near 0, i.e. near expert `hot`: Zipf-like skew.
            ids = [(hot + int(E * (x / 2**16) ** (1.0 + alpha))) % E for x in xs]
        elif mode == "all_local":
            ids = [r * epn + x % epn for x in xs]
        elif mode == "all_remote":
            ids = [((r + 1) % R) * epn + x % epn for x in xs]
        elif mode == "hot_group":
            ids = [(hot // epn) * epn + x % epn for x in xs]
        elif mode == "duplicate_topk":
            ids = [xs[t * K] % E for t in range(s[r]) for _ in range(K)]
        else:
            ids = [0] * len(xs)
        topks.append(ids)
    return R, E, K, tp, B, S, s, varlen, topks


@SETTINGS
@given(case=routed_topk())
def test_entries_form_a_bijection_onto_real_rows(case) -> None:
    R, E, K, tp, B, S, s, varlen, topks = case
    T = np.array(counts_of(topks, E), dtype=np.int64)
    total_given = sum(s) if varlen else None
    p = plan_dispatch(T, S=S, K=K, E=E, R=R, B=B, token_padding=tp, total_num_tokens=total_given)
    check_plan(p, T, total_given)
    NvS = p.NvS

    seen: dict[tuple[int, int], tuple[int, int, int]] = {}  # (d, loff) -> (expert, src, i)
    for src in range(R):
        topk = torch.tensor(topks[src], dtype=torch.int64).view(s[src], K)
        dst = entry_dst(p, src, topk)
        assert dst.dtype == torch.int32 and dst.shape == (s[src] * K,)
        assert torch.equal(dst, entry_dst(p, src, topk))  # determinism
        d, loff = decode(dst, NvS)
        assert bool(((d >= 0) & (d < R)).all()) and bool(((loff >= 0) & (loff < NvS)).all())
        dl, ll, vl = d.tolist(), loff.tolist(), dst.tolist()
        for i in range(s[src] * K):
            key = (dl[i], ll[i])
            assert key not in seen  # every entry gets its own row
            seen[key] = (topks[src][i], src, i)
            # primary = first k of the token on that destination
            t, k = divmod(i, K)
            assert (vl[i] < 0) == (dl[i] in dl[t * K:i])
        # route_count agrees with the per-entry destinations
        per_ed = torch.bincount(topk.view(-1) * R + d, minlength=E * R).view(E, R)
        assert torch.equal(per_ed, p.route_count[src].to(torch.int64))

    # The entries cover exactly the real (non-padding) rows of every segment,
    # each segment holding only its expert, in (source rank, flat index) order.
    for dd in range(R):
        for e in range(E):
            cnt = int(p.alloc[e, dd])
            if cnt == 0:
                continue
            off = int(p.expert_off[dd, e])
            owners = [seen.get((dd, off + j)) for j in range(cnt)]
            assert all(o is not None and o[0] == e for o in owners)
            assert [o[1:] for o in owners] == sorted(o[1:] for o in owners)
    assert len(seen) == int(T.sum())


# ---------------------------------------------------------------------------
# 4. bad inputs

GOOD = dict(S=4, K=2, E=4, R=2, B=2, token_padding=4)
GOOD_T = [[4, 3, 1, 0], [4, 3, 0, 1]]


FIX_T = "Fix: pass the all-gathered tokens_per_expert of every rank as an integer [R, E] = [2, 4] array"


@pytest.mark.parametrize(
    "T, overrides, message",
    [
        (GOOD_T, dict(E=6, R=4), "E (routed experts) must be a multiple of R=4 (each rank owns E/R experts): got 6. "
                                 "Fix: use E=8 or E=4, or an EP size dividing 6"),
        # the first negative count is named, not the zero before it
        ([[4, 0, -1, 3], [4, 3, 0, 1]], {}, "tokens_per_expert[0][2] is negative: got -1. Fix: pass each rank's "
                                            "bincount(topk, minlength=E) (counts >= 0)"),
        ([[4, 3, 1, 1], [4, 3, 0, 1]], {}, "tokens_per_expert of rank 0 sums to a value that is not a multiple of "
                                           "K=2: got 9. Fix: each rank's counts must sum to s*K (s tokens, K entries "
                                           "each); pass bincount(topk, minlength=E)"),
        ([[6, 3, 1, 0], [4, 3, 0, 1]], dict(total_num_tokens=9),
         "rank 0 routes s = sum/K tokens, more than the capacity S=4: got 5. Fix: route at most S tokens per rank "
         "(sum of counts <= S*K = 8) or raise S"),
        ([[0, 0, 0, 0], [4, 3, 0, 1]], dict(total_num_tokens=4),
         "rank 0 routes no tokens (sum of tokens_per_expert is 0): got 0. Fix: MoonEP does not support s = 0: "
         "route at least one (dummy) token on every rank"),
        ([[2, 0, 0, 0], [4, 3, 0, 1]], {}, "ranks route different token counts but total_num_tokens is None: got "
                                           "[1, 4]. Fix: pass total_num_tokens=5 (varlen) or route the same s on "
                                           "every rank"),
        (GOOD_T, dict(total_num_tokens=7), "total_num_tokens differs from the tokens routed by all ranks (sum of "
                                           "tokens_per_expert / K): got 7. Fix: pass total_num_tokens=8"),
        (GOOD_T, dict(total_num_tokens=7.5), "total_num_tokens must be an integer: got 7.5. Fix: pass an int "
                                             "(here 8) or None"),
        (GOOD_T, dict(B=0), "B (prefetch slots per rank) must be a positive int: got 0. Fix: pass a positive int or "
                            "None (= E/R = 2)"),
        (GOOD_T, dict(B=1.5), "B (prefetch slots per rank) must be an integer: got 1.5. Fix: pass a positive int or "
                              "None (= E/R = 2)"),
        (GOOD_T, dict(token_padding=0), "token_padding must be a positive int: got 0. Fix: pass a positive int, "
                                        "e.g. 128 (1 = no padding)"),
        (GOOD_T, dict(K=33), "K (top-k) must be <= 32 (MoonEP kmask bitset): got 33. Fix: use K <= 32"),
        (GOOD_T, dict(S=0), "S (token capacity per rank) must be a positive int: got 0. Fix: pass the largest "
                            "per-rank token count, e.g. 128"),
        (GOOD_T, dict(R=True), "R (EP ranks) must be an integer: got True. Fix: pass the EP group size "
                               "(1 <= R <= 128)"),
        ([[4, 3, 1], [4, 3, 0]], {}, "tokens_per_expert has the wrong shape: got (2, 3). " + FIX_T),
        ([[4.0, 3.0, 1.0, 0.0], [4.0, 3.0, 0.0, 1.0]], {},
         "tokens_per_expert must have an integer dtype: got 'float64'. " + FIX_T),
        (torch.tensor(GOOD_T, dtype=torch.float32), {},
         "tokens_per_expert must have an integer dtype: got torch.float32. " + FIX_T),
        (torch.tensor(GOOD_T, dtype=torch.bool), {}, "tokens_per_expert must have an integer dtype: got torch.bool. "
                                                     + FIX_T),
        (torch.tensor(GOOD_T, dtype=torch.complex64), {},
         "tokens_per_expert must have an integer dtype: got torch.complex64. " + FIX_T),
        ([[4, 3, 1, 0], [4]], {}, "tokens_per_expert is not an array: got 'list'. " + FIX_T),   # ragged
        (np.array([[2**63, 3, 1, 0], [4, 3, 0, 1]], dtype=np.uint64), {},
         "tokens_per_expert has a count too large for int64: got 9223372036854775808. " + FIX_T),
        # the largest int64 passes the dtype check and is judged as a count
        (np.array([[2**63 - 1, 0, 0, 0], [4, 3, 0, 1]], dtype=np.uint64), {},
         "tokens_per_expert of rank 0 sums to a value that is not a multiple of K=2: got 9223372036854775807. Fix: "
         "each rank's counts must sum to s*K (s tokens, K entries each); pass bincount(topk, minlength=E)"),
        # NvS = S*K + (token_padding - 1) * 2 * E/R = 2^21 * 8 + 3 * 2 * 2 = 16777228
        (GOOD_T, dict(S=2**21, K=8), "NvS = S*K + (token_padding-1)*2*E/R exceeds 2^24-1 (MoonEP packs loff in 24 "
                                     "bits next to a 7-bit kidx): got 16777228. Fix: lower S, K or token_padding"),
        (GOOD_T, dict(S=2**28, K=8), f"S*K must be < 2^31-1 (int32 entry indices): got {2**31}. Fix: lower S or K"),
    ],
)
def test_bad_inputs(T, overrides, message) -> None:
    for rank, who in ((None, ""), (1, "[rank 1] ")):   # the rank that saw it, when known, leads the message
        with pytest.raises(ConfigError) as info:
            plan_dispatch(T, **{**GOOD, **overrides}, rank=rank)
        assert str(info.value) == who + message
        assert isinstance(info.value, ValueError)


def test_counts_of_any_integer_dtype_give_the_same_plan() -> None:
    """uint8 / int32 arrays and tensors are read as int64: the plan equals the one of nested lists."""
    ref = plan_dispatch(GOOD_T, **GOOD)
    for T in (np.array(GOOD_T, dtype=np.uint8), np.array(GOOD_T, dtype=np.int32),
              torch.tensor(GOOD_T, dtype=torch.int32), torch.tensor(GOOD_T, dtype=torch.uint8)):
        assert plan_dispatch(T, **GOOD).same_as(ref)
    single = plan_dispatch([[4, 3, 1, 0]], S=4, K=2, E=4, R=1, token_padding=4)   # one rank: uniform by itself
    assert single.alloc.tolist() == [[4], [3], [1], [0]]


def test_a_donor_whose_fullest_expert_holds_one_entry_still_sends_it() -> None:
    """K = 1: rank 0 routes to expert 0, rank 1 to expert 1, both homed on rank 0 (E/R = 2). Capacity 1 each, so
    group 0 hands 1 entry to rank 1: expert 0 (the first of two fullest, 1 entry each) moves there."""
    p = plan_dispatch([[1, 0, 0, 0], [0, 1, 0, 0]], S=1, K=1, E=4, R=2, token_padding=1)
    assert (p.cap.tolist(), p.z.tolist()) == ([1, 1], [[0, 1], [0, 0]])
    assert p.alloc.tolist() == [[0, 1], [1, 0], [0, 0], [0, 0]]


def test_defaults_pad_to_128_rows_and_give_each_rank_epn_slots() -> None:
    p = plan_dispatch(GOOD_T, S=4, K=2, E=4, R=2)
    # NvS = S*K + (token_padding - 1) * 2 * E/R = 8 + 127 * 2 * 2
    assert (p.token_padding, p.B, p.NvS) == (128, 2, 516)


def _entry_dst_by_loops(p: DispatchPlan, src: int, topk: list[int]) -> list[int]:
    """moonep.md §4.6-4.7 written as loops: expert e's entries in (source rank, flat index) order; destination d
    takes positions [alloc_cumsum[e][d-1], alloc_cumsum[e][d]) of it, at expert_off[d][e] onwards; a later k of a
    token landing on a destination an earlier k already reached is stored as -raw-1."""
    K, R = p.K, p.R
    before = [int(p.tpe_cumsum[src - 1, e]) if src else 0 for e in range(p.E)]
    seen = [0] * p.E
    out: list[int] = []
    for i, e in enumerate(topk):
        pos = before[e] + seen[e]
        seen[e] += 1
        d = next(d for d in range(R) if int(p.alloc_cumsum[e, d]) > pos)
        start = int(p.alloc_cumsum[e, d - 1]) if d else 0
        raw = d * p.NvS + int(p.expert_off[d, e]) + pos - start
        t = i // K
        earlier = [out_d for out_d in (abs(v) if v >= 0 else -v - 1 for v in out[t * K:i])]
        out.append(-raw - 1 if any(v // p.NvS == d for v in earlier) else raw)
    return out


def test_entry_dst_keeps_each_experts_entries_in_flat_order_beyond_a_short_sort() -> None:
    """32 entries per rank with many equal ids: an unstable sort reorders equal ids from 17 elements on (a
    shorter run is insertion-sorted, stable either way). Rank 0 overloads experts 0-1, so rows migrate."""
    K = 2
    topk0 = [e for t in range(16) for e in ((0, 1) if t % 4 else (1, 3))]
    topk1 = [e for t in range(16) for e in ((2, 3) if t % 2 else (0, 2))]
    counts = [[topk.count(e) for e in range(4)] for topk in (topk0, topk1)]
    p = plan_dispatch(counts, S=16, K=K, E=4, R=2, token_padding=4)
    assert int(p.alloc[0, 1]) + int(p.alloc[1, 1]) > 0          # some of group 0's rows go to rank 1
    for src, topk in ((0, topk0), (1, topk1)):
        assert entry_dst(p, src, torch.tensor(topk).view(16, K)).tolist() == _entry_dst_by_loops(p, src, topk)


def test_entry_dst_rows_stay_exact_above_2_24() -> None:
    """Rows past 2^24 are exact (float32 would round an odd one to an even value). Every group holds exactly its
    capacity (2 entries), so nothing migrates; rank 0 routes its token to experts 0 (home rank 0) and 7 (home 3)."""
    tp = 2**21 + 1
    counts = [[1, 0, 0, 0, 0, 0, 0, 1], [0, 0, 1, 0, 0, 0, 1, 0], [0, 1, 0, 0, 1, 0, 0, 0], [0, 0, 0, 1, 0, 1, 0, 0]]
    p = plan_dispatch(counts, S=1, K=2, E=8, R=4, token_padding=tp)
    assert p.NvS == 2 + (tp - 1) * 2 * 2 == 8388610      # S*K + (token_padding - 1) * 2 * E/R
    # expert 0: rank 0's first row; expert 7 on rank 3: after expert 6's segment, padded to tp rows:
    # 3 * NvS + tp = 25165830 + 2097153 = 27262983 (odd, above 2^24)
    assert entry_dst(p, 0, [[0, 7]]).tolist() == [0, 27262983] == _entry_dst_by_loops(p, 0, [0, 7])


def test_error_names_rank() -> None:
    with pytest.raises(ConfigError, match=r"^\[rank 3\] E \(routed experts\)"):
        plan_dispatch(GOOD_T, **{**GOOD, "E": 5}, rank=3)


# The fix of rank r's top-k errors (the worked example: s = 4 tokens of K = 2 on either rank).
FIX_TOPK = "Fix: pass rank {r}'s top-k ids, an integer [s, K] = [4, 2] tensor, the same ids whose bincount built the plan"


@pytest.mark.parametrize(
    "rank, topk, message",
    [   # rank 0's plan counts from EX_TOPK[0]: [4, 3, 1, 0]; these ids count [3, 4, 1, 0]
        (0, [0, 1, 0, 1, 0, 2, 1, 1],
         "[rank 0] bincount(topk)[0] differs from the planned tokens_per_expert[0][0]=4: got 3. " + FIX_TOPK),
        (0, [0, 1, 0, 1, 0, 2, 1, 4], "[rank 0] topk holds an expert id outside [0, 4): got 4. " + FIX_TOPK),
        (0, [0, 1, 0, 1, -1, 2, 1, 4], "[rank 0] topk holds an expert id outside [0, 4): got -1. " + FIX_TOPK),
        (0, [[0, 1, 0, 1], [0, 2, 1, 0]], "[rank 0] topk has the wrong shape: got (2, 4). " + FIX_TOPK),
        (0, [0, 1, 0, 1, 0, 2], "[rank 0] topk has the wrong shape: got (6,). " + FIX_TOPK),
        (0, [[[0, 1], [0, 1], [0, 2], [1, 0]]], "[rank 0] topk has the wrong shape: got (1, 4, 2). " + FIX_TOPK),
        (2, EX_TOPK[0], "source rank must be in [0, 2): got 2. Fix: pass a source rank in [0, 2)"),
        (1, [0.0] * 8, "[rank 1] topk must have an integer dtype: got torch.float64. " + FIX_TOPK),
        (1, torch.zeros(8, dtype=torch.bool), "[rank 1] topk must have an integer dtype: got torch.bool. " + FIX_TOPK),
        (1, torch.zeros(8, dtype=torch.bfloat16),
         "[rank 1] topk must have an integer dtype: got torch.bfloat16. " + FIX_TOPK),
        (1, torch.zeros(8, dtype=torch.complex64),
         "[rank 1] topk must have an integer dtype: got torch.complex64. " + FIX_TOPK),
    ],
)
def test_entry_dst_bad_inputs(example_plan, rank, topk, message) -> None:
    with pytest.raises(ConfigError) as info:
        entry_dst(example_plan, rank, topk)
    assert str(info.value) == message.format(r=rank)


def test_plan_is_frozen(example_plan: DispatchPlan) -> None:
    with pytest.raises(AttributeError):
        example_plan.B = 3  # type: ignore[misc]


def test_entry_dst_names_a_rank_that_is_no_integer(example_plan) -> None:
    """The house format, exactly: what, the value, the fix (R = 2 in the worked example)."""
    for bad in (True, 1.0, "1"):
        with pytest.raises(ConfigError) as info:
            entry_dst(example_plan, bad, EX_TOPK[1])
        assert str(info.value) == f"rank must be an integer: got {bad!r}. Fix: pass a source rank in [0, 2)"
    with pytest.raises(ConfigError) as info:
        entry_dst(example_plan, -1, EX_TOPK[0])
    assert str(info.value) == "source rank must be in [0, 2): got -1. Fix: pass a source rank in [0, 2)"


# The tensor fields of DispatchPlan, listed by hand from its definition (the ints R, E, ... are not tensors).
PLAN_TENSORS = ["tokens_per_expert", "num_tokens", "tpe_cumsum", "cap", "z", "alloc", "alloc_cumsum",
                "experts_to_copy", "copy_owner", "remote_stats", "cu_seqlens", "zero_fill_ranges", "expert_off",
                "route_count", "route_row"]


def test_tensor_fields_are_the_plans_own_tensors(example_plan) -> None:
    fields = example_plan.tensor_fields()
    assert sorted(fields) == sorted(PLAN_TENSORS)
    assert all(fields[name] is getattr(example_plan, name) for name in PLAN_TENSORS)


def test_same_as_tells_every_kind_of_difference(example_plan) -> None:
    def again(**change):
        plan = plan_dispatch(counts_of(EX_TOPK, 4), S=4, K=2, E=4, R=2, B=2, token_padding=4)
        for name, value in change.items():   # past the frozen dataclass and its checks: same_as alone decides
            object.__setattr__(plan, name, value)
        return plan

    cap = example_plan.cap
    assert example_plan.same_as(again()) and again().same_as(example_plan)
    assert torch.equal(cap.to(torch.float64), cap)   # same values, another dtype: torch.equal alone says True
    for changed in (again(cap=cap + 1), again(cap=cap.to(torch.float64)), again(cap=cap.tolist()),
                    again(nvs_s=example_plan.nvs_s + 1)):
        assert example_plan.same_as(changed) is False
    assert example_plan.same_as(again(cap=cap.clone())) is True


def test_the_plans_self_check_names_the_field_and_the_shapes(example_plan) -> None:
    """__post_init__ refuses a field of the wrong shape (naming it, its shape and the expected one), dtype or
    layout: z is [R, R] = [2, 2] int32 in the worked example."""
    import dataclasses

    z = example_plan.z
    with pytest.raises(AssertionError) as info:
        dataclasses.replace(example_plan, z=z[:1])
    assert info.value.args == (("z", (1, 2), (2, 2)),)
    for bad in (z.to(torch.int64), z.t().contiguous().t()):   # right shape: int64, or int32 not contiguous
        assert tuple(bad.shape) == (2, 2)
        with pytest.raises(AssertionError) as info:
            dataclasses.replace(example_plan, z=bad)
        assert info.value.args == ("z",)
    assert dataclasses.replace(example_plan, z=z.clone()).same_as(example_plan)
