"""Capacity padding in a dispatch plan (``ops/padding.py``): which slot fills serve real tokens."""

from __future__ import annotations

import pytest
import torch

from moonep_ep.ops.padding import (classify_slot_fills, padding_entries, real_entries, replan_without_padding)
from moonep_ep.ops.planner import plan_dispatch

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
    assert [(f.expert, f.owner, f.entries, f.real_entries, f.padding_only) for f in fills] == [(0, 0, 14, 0, True)]
    assert classify_slot_fills(plan, 0, real) == []


def test_a_fill_that_serves_real_tokens_is_not_padding():
    # Positive control: both ranks' real tokens overload owner 0's group; no padding at all.
    plan = _plan([[8, 8, 0, 0], [8, 8, 0, 0]])
    real = real_entries(plan, padding_entries(plan, [8, 8]))
    fills = classify_slot_fills(plan, 1, real)
    assert fills and all(not f.padding_only and f.real_entries == f.entries for f in fills)
    # Without counts every entry counts as real.
    assert [f.real_entries for f in classify_slot_fills(plan, 1, None)] == [f.entries for f in fills]


def test_padding_split_across_destinations_keeps_the_real_entries_first():
    # Source 0: 3 real tokens to expert 0 (one entry each... K=2: token t -> (0, 1)), 5 padding tokens.
    plan = _plan([[13, 3, 0, 0], [0, 0, 8, 8]])
    pads = padding_entries(plan, [3, 8])
    real = real_entries(plan, pads)
    assert int(real[0].sum()) == 13 - 10 and (real >= 0).all()
    # Every destination's expert-0 real entries come from the first 3 entries of the source's list.
    counts = plan.route_count[0, 0].tolist()
    assert real[0].tolist() == [min(3, counts[0]), max(0, 3 - counts[0])]


def test_replan_without_padding_shows_which_fills_padding_caused():
    plan = _plan([[8, 8, 0, 0], [14, 0, 1, 1]])
    without = replan_without_padding(plan, padding_entries(plan, [8, 1]))
    assert without is not None and without.total_num_tokens == 9
    assert int(without.tokens_per_expert[1, 0]) == 0
    # A source with no real token cannot be planned in MoonEP's varlen mode.
    assert replan_without_padding(_plan([[8, 8, 0, 0], [16, 0, 0, 0]]), [0, 16]) is None


def test_counts_that_do_not_fit_the_plan_are_refused():
    plan = _plan([[8, 8, 0, 0], [14, 0, 1, 1]])
    with pytest.raises(ValueError, match="one real-token count per source"):
        padding_entries(plan, [8])
    with pytest.raises(ValueError, match="outside"):
        padding_entries(plan, [9, 1])
    with pytest.raises(ValueError, match="padding entries but only"):
        real_entries(plan, [0, 16])
