"""The push generation's planner (``ops/moonep/planner_push.py``) over random, skewed routing.

Its plan shares the pull planner's balancing (every field up to ``alloc`` and the route counts) and lays each
destination out its own way: the rank's own experts, then every remote expert in a slot, in ascending id. The
hand-computed example is in ``test_push_buffer.py``.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from moonep_ep.ops.moonep.planner import plan_dispatch
from moonep_ep.ops.moonep.planner_push import plan_push_dispatch
from tests.ops.test_planner import SETTINGS, check_group_layout, check_routes

# Equal route counts and cumulative tables: every entry goes to the same destination rank in both generations.
SHARED = ("tokens_per_expert", "num_tokens", "tpe_cumsum", "cap", "z", "alloc", "alloc_cumsum", "route_count")


@SETTINGS
@given(
    R=st.sampled_from([1, 2, 4, 8]),
    epn=st.integers(1, 6),
    K=st.sampled_from([1, 2, 4, 8]),
    tp=st.sampled_from([1, 2, 3, 4, 8, 128]),
    S=st.integers(1, 512),
    alpha=st.sampled_from([0.0, 1.0, 2.0, 4.0]),
    hot_group=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_push_plan_balances_as_the_pull_plan_and_lays_out_own_experts_then_slots(R, epn, K, tp, S, alpha,
                                                                                   hot_group, seed) -> None:
    E = R * epn
    rng = np.random.default_rng(seed)
    weights = np.zeros(E)
    if hot_group:   # every rank routes to group 0: each receiver takes several of its experts into slots
        weights[:epn] = 1.0
    else:
        weights[rng.permutation(E)] = 1.0 / np.arange(1, E + 1) ** alpha
    T = np.stack([rng.multinomial(S * K, weights / weights.sum()) for _ in range(R)])
    push = plan_push_dispatch(T, S=S, K=K, E=E, R=R, token_padding=tp)
    pull = plan_dispatch(T, S=S, K=K, E=E, R=R, token_padding=tp)
    for name in SHARED:
        assert torch.equal(getattr(push, name), getattr(pull, name)), name
    assert push.B == epn and push.num_groups == 2 * epn
    assert push.NvS == push.nvs_s == -(-(S * K + (tp - 1) * 2 * epn) // tp) * tp

    A = push.alloc.tolist()
    slots, owners, stats = push.experts_to_copy.tolist(), push.copy_owner.tolist(), push.remote_stats.tolist()
    cu, zf, off = push.cu_seqlens.tolist(), push.zero_fill_ranges.tolist(), push.expert_off.tolist()
    slotted_from = [0] * R
    for d in range(R):
        remote = [e for e in range(E) if A[e][d] > 0 and e // epn != d]
        unused = [-1] * (epn - len(remote))
        assert slots[d] == remote + unused and owners[d] == [e // epn for e in remote] + unused
        assert stats[d][0] == len(remote)
        for e in remote:
            slotted_from[e // epn] += 1
        own = list(range(d * epn, (d + 1) * epn))
        assert check_group_layout(A, d, own + slots[d], tp, cu[d], zf[d], off[d]) == S * K
        assert cu[d][-1] <= push.NvS
    assert [row[1] for row in stats] == slotted_from
    check_routes(push, torch.from_numpy(T))
