"""Capacity padding in a dispatch plan (``ops/moonep/padding.py``): which slot fills serve real tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moonep_ep.ops.moonep.padding import (classify_slot_fills, padding_entries, real_entries, replan_without_padding)
from moonep_ep.ops.moonep.planner import plan_dispatch

S, K, E, R = 8, 2, 4, 2


def _plan(counts, B=2):
    return plan_dispatch(torch.tensor(counts), S=S, K=K, E=E, R=R, B=B, token_padding=1)


def test_a_fill_that_serves_only_padding_is_found():
    # Rank 1 has one real token (experts 2, 3) and 7 padding tokens: 14 entries to expert 0. Owner 0's group
    # holds 30 entries for a capacity of 16, so rank 1 computes 14 of expert 0's entries in a slot: its own
    # padding, the last entries of its expert-0 list.
    plan = _plan([[8, 8, 0, 0], [14, 0, 1, 1]])
    pads = padding_entries(plan, [8, 1])
    assert pads == [0, 14]
    real = real_entries(plan, pads)
    assert real.sum(1).tolist() == [8, 8, 1, 1]          # the real entries of each expert, all accounted for
    fills = classify_slot_fills(plan, 1, real)
    assert [(f.slot, f.expert, f.owner, f.entries, f.real_entries, f.padding_only) for f in fills] == \
        [(0, 0, 0, 14, 0, True)]
    assert classify_slot_fills(plan, 0, real) == []
    # A used slot after an unused one is still reported, under its own slot index.
    gap = dataclasses.replace(plan, experts_to_copy=torch.tensor([[-1, -1], [-1, 0]], dtype=torch.int32),
                              copy_owner=torch.tensor([[-1, -1], [-1, 0]], dtype=torch.int32))
    assert [(f.slot, f.expert, f.entries, f.real_entries) for f in classify_slot_fills(gap, 1, real)] == \
        [(1, 0, 14, 0)]


def test_a_fill_that_serves_real_tokens_is_not_padding():
    # Positive control: both ranks' real tokens overload owner 0's group; no padding at all.
    plan = _plan([[8, 8, 0, 0], [8, 8, 0, 0]])
    real = real_entries(plan, padding_entries(plan, [8, 8]))
    fills = classify_slot_fills(plan, 1, real)
    assert fills and all(not f.padding_only and f.real_entries == f.entries for f in fills)
    # Without counts every entry counts as real.
    assert [f.real_entries for f in classify_slot_fills(plan, 1, None)] == [f.entries for f in fills]


def test_padding_split_across_destinations_keeps_the_real_entries_first():
    # Owner 0's group (experts 0, 1) holds 32 entries for a capacity of S*K = 16: the planner keeps 8 of
    # source 0's 14 expert-0 entries on rank 0 and moves the other 6 to rank 1, so source 0's list is
    # split across both destinations (rank 0 takes the first 8 of the list, rank 1 the next 6).
    plan = _plan([[14, 2, 0, 0], [10, 6, 0, 0]])
    assert plan.route_count[0, 0].tolist() == [8, 6] and plan.route_count[1, 0].tolist() == [0, 10]
    # Source 0 has 2 real tokens (6 padding tokens: 12 entries at the end of its expert-0 list): its 2
    # real expert-0 entries are the first of the list, so both land on rank 0; source 1 pads nothing.
    pads = padding_entries(plan, [2, 8])
    assert pads == [12, 0]
    assert real_entries(plan, pads).tolist() == [[2, 10], [8, 0], [0, 0], [0, 0]]
    # Source 0 with 6 real tokens (4 padding tokens, 8 entries): 10 real entries of expert 0, rank 0 takes
    # 8 of them and rank 1 the other 2 (destinations in descending rank would give rank 1 all 6 of its
    # share: [4, 16]).
    real = real_entries(plan, padding_entries(plan, [6, 8]))
    assert real[0].tolist() == [8, 12]
    # The fill on rank 1 of expert 0 computes 16 entries, 12 of them real.
    assert [(f.expert, f.owner, f.entries, f.real_entries) for f in classify_slot_fills(plan, 1, real)] == \
        [(0, 0, 16, 12)]


def test_replan_without_padding_shows_which_fills_padding_caused():
    plan = plan_dispatch(torch.tensor([[8, 8, 0, 0], [14, 0, 1, 1]]), S=S, K=K, E=E, R=R, B=1, token_padding=4)
    without = replan_without_padding(plan, padding_entries(plan, [8, 1]))
    assert without is not None and without.total_num_tokens == 9
    assert without.tokens_per_expert.tolist() == [[8, 8, 0, 0], [0, 0, 1, 1]]
    assert (without.S, without.K, without.B, without.token_padding) == (S, K, 1, 4)   # the plan's own settings
    with pytest.raises(ValueError, match="^more padding entries than entries in the plan: the padding does not "
                                         "match this plan$"):
        replan_without_padding(plan, [0, 15])
    # A source with no real token cannot be planned in MoonEP's varlen mode.
    assert replan_without_padding(_plan([[8, 8, 0, 0], [16, 0, 0, 0]]), [0, 16]) is None


def test_counts_that_do_not_fit_the_plan_are_refused():
    plan = _plan([[8, 8, 0, 0], [14, 0, 1, 1]])
    with pytest.raises(ValueError, match="one real-token count per source"):
        padding_entries(plan, [8])
    with pytest.raises(ValueError, match=r"source rank 0: 9 real tokens is outside \[0, S=8\]"):
        padding_entries(plan, [9, 1])
    assert padding_entries(plan, [0, 8]) == [16, 0]     # a source with no real token: all S rows are padding
    with pytest.raises(ValueError, match=r"^source rank 1: 16 padding entries but only 14 entries of expert 0: the "
                                         r"real-token counts do not match this plan$"):
        real_entries(plan, [0, 16])
    with pytest.raises(ValueError, match=r"^padding matrix must be \[R, E\] = \[2, 4\], got \(3, 4\)$"):
        real_entries(plan, torch.zeros(3, 4))
    # int64 counts whatever the padding's dtype (the plan's own counts are int32).
    assert real_entries(plan, [0, 14]).dtype == torch.int64
    matrix = torch.zeros(2, 4)
    matrix[1, 0] = 14.0
    assert real_entries(plan, matrix).dtype == torch.int64 and real_entries(plan, matrix).tolist() == \
        real_entries(plan, [0, 14]).tolist()
