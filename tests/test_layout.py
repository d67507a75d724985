"""Sharded expert layout: page plan (pure) and the store on 4 real ranks (host driver)."""

from __future__ import annotations

import pytest

import mp_layout as ml
from clitools import moonep_ep_json
from moonep_ep.errors import ConfigError
from moonep_ep.launch import run_ranks
from moonep_ep.layout.plan import plan_expert_region, predict_rank_bytes, slot_pool_bytes

MIB = 1 << 20


@pytest.mark.parametrize("E,R,rb,gran", [(12, 4, 384 * 512 * 2, 2 * MIB), (384, 64, 2048 * 7168 * 2, 2 * MIB),
                                         (16, 4, 256 * 512 * 2, 2 * MIB), (7 * 4, 4, 12345 * 2, 64 << 10),
                                         (128, 8, 768 * 2048 * 2, 2 * MIB)])
def test_page_plan_invariants(E, R, rb, gran):
    plan = plan_expert_region(E, R, rb, gran)
    data = E * rb
    assert (plan.lead_pad + data) % gran == 0 and 0 <= plan.lead_pad < gran
    assert list(plan.page_owner) == sorted(plan.page_owner)  # each owner one contiguous run
    assert sum(plan.pages_of(r) for r in range(R)) == plan.num_pages
    # Every data byte is in exactly one page, and padding is < one page per region.
    assert sum(plan.data_bytes_in_pages_of(r) for r in range(R)) == data
    assert plan.num_pages * gran - data == plan.lead_pad < gran
    # A page is allocated by the owner of its first data byte.
    epn = E // R
    for j, owner in enumerate(plan.page_owner):
        first = max(j * gran, plan.lead_pad) - plan.lead_pad
        assert owner == (first // rb) // epn


def test_predicted_bytes_kimi_k2_ep64_below_40_gb():
    rb = 2048 * 7168 * 2
    got = predict_rank_bytes(num_layers=60, num_experts=384, ep_size=64, num_slots=6,
                             row_bytes=[rb] * 3, granularity=2 * MIB)
    assert got["padding_bytes"] == 0  # 28 MiB rows are whole pages
    assert got["expert_bytes"] == 60 * 3 * 6 * rb and got["slot_bytes"] == 3 * 6 * rb
    assert got["total_bytes"] < 40e9


def test_slot_pool_rounds_to_a_page():
    assert slot_pool_bytes(3, 384 * 1024, 2 * MIB) == 2 * MIB
    assert slot_pool_bytes(6, 384 * 1024, 2 * MIB) == 4 * MIB


def test_plan_rejects_indivisible_experts():
    with pytest.raises(ConfigError, match="divides the number of routed experts"):
        plan_expert_region(10, 4, 4096, 4096)


@pytest.mark.slow
def test_aligned_layout_four_ranks_gen_a_and_gen_b():
    # H=512, I=384: rows of 384 KiB = 6 pages of 64 KiB: every owner's rows fill whole pages.
    results = run_ranks(ml.layout_checks, 4, args=(512, 384, 12, 8, 64 << 10, True))
    for rank, res in enumerate(results):
        assert res["errors"] == [], (rank, res["errors"])
        assert res["bad_rows"] == 0                      # row e == owner's data, all e, all layers
        assert res["requested_other"] == []              # loader asked only for own experts
        assert res["requested_count"] == 8 * 3 * 3
        assert res["slot_shared"] and res["slot_ptrs_differ"]  # one pool, two virtual views
        assert res["genb_pool_sees_peers"] == [True] * 4
        assert res["genb_compute_own"] and res["genb_compute_slots"]
        phys = res["physical"]
        assert phys["expert_bytes"] == 8 * 3 * 3 * 384 * 512 * 2 and phys["padding_bytes"] == 0
        assert res["os_bytes_by_tag"] == phys["total_bytes"]  # the OS agrees with the driver
        assert res["leaks"] == {} and res["leaked_fds"] == 0 and res["leaked_maps"] == 0


@pytest.mark.slow
def test_unaligned_layout_exact_contiguous_views_with_bounded_padding():
    # Same shapes at a 2 MiB granularity: epn*row = 1.125 MiB, nothing is page-aligned.
    gran = 2 * MIB
    results = run_ranks(ml.layout_checks, 4, args=(512, 384, 12, 8, gran, False))
    row = 384 * 512 * 2
    plan = plan_expert_region(12, 4, row, gran)
    for rank, res in enumerate(results):
        assert res["errors"] == [] and res["bad_rows"] == 0 and res["requested_other"] == []
        assert res["slot_shared"]
        assert all(0 < pad < gran for pad in res["lead_pad"].values())
        predicted = predict_rank_bytes(num_layers=8, num_experts=12, ep_size=4, num_slots=3,
                                       row_bytes=[row] * 3, granularity=gran, rank=rank)
        assert res["physical"]["total_bytes"] == predicted["total_bytes"] == res["os_bytes_by_tag"]
        assert res["physical"]["padding_bytes"] == predicted["padding_bytes"]
        assert res["leaks"] == {} and res["leaked_fds"] == 0 and res["leaked_maps"] == 0
    # Padding: under one page per chunk boundary — one lead pad per (layer, projection)
    # region across all ranks, plus each rank's slot-pool tail.
    total_pad = sum(r["physical"]["padding_bytes"] for r in results)
    assert total_pad == 8 * 3 * plan.lead_pad + 4 * 3 * (gran - 3 * row)
    # Ranks whose rows all sit in a neighbour's pages allocate no expert page at all.
    assert [r["physical"]["expert_bytes"] for r in results] == [
        8 * 3 * plan.pages_of(r) * gran for r in range(4)]


@pytest.mark.slow
@pytest.mark.parametrize("case,needle", [
    ("experts_not_divisible", "multiple of the EP size"),
    ("ranks_disagree", "ranks disagree on the expert layout"),
    ("gen_b_unaligned", "use the Gen A [E+B] view"),
])
def test_bad_layouts_fail_on_every_rank(case, needle):
    for rank, msg in enumerate(run_ranks(ml.bad_layout, 4, args=(case,))):
        assert needle in msg, (rank, msg)
        assert "Fix:" in msg


@pytest.mark.slow
def test_footprint_measure_tiny_matches_prediction_within_one_percent():
    out = moonep_ep_json("footprint", "--measure", "--ranks", "4", "--model", "tiny", "--layers", "8")
    assert out["ok"] and out["ranks"] == 4 and out["layers"] == 8
    assert out["max_relative_error"] <= 0.01
    for r, row in enumerate(out["per_rank"]):
        assert row["filled"]
        # OS-measured categories (memfd sizes by tag) equal the driver's and the plan's.
        assert row["measured_by_category"]["expert_bytes"] == row["predicted_by_category"]["expert_bytes"]
        assert row["measured_by_category"]["slot_bytes"] == row["predicted_by_category"]["slot_bytes"]
        assert row["resident_bytes"] <= row["measured_bytes"]
    tiny_row = 256 * 512 * 2
    assert out["replicated_bytes_per_rank"] == 8 * (16 + 4) * 3 * tiny_row
    assert out["replicated_over_moonep_ep"] > 1


@pytest.mark.slow
def test_bench_layout_reports_mapping_time_and_one_exchange_round():
    # Kimi K2's counts at a smaller rank count to keep CI short.
    out = moonep_ep_json("bench", "layout", "--ranks", "4", "--layers", "60", "--experts", "384")
    assert out["ok"] and out["handle_exchange_rounds"] == 1
    assert out["mappings_per_rank"] == [60 * 3 * (4 + 1)] * 4  # R owner runs + 1 slot pool per view
    assert all(t > 0 for t in out["map_s_per_rank"])
