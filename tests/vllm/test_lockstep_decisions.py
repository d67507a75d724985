"""Every setting that decides which collective an EP rank runs is agreed at backend selection (issue 43).

Two gloo ranks build ``ShardedMoonEPAll2AllManager`` (``tests/support/lockstep_decisions_check.py``), each
with its own settings: ranks that would run different collectives (the cost model that may swap a step's
Buffer, the MoonEP API, the padding policy, the layout, the pool's capacities) raise the same ConfigError,
naming each rank's value and the fix, instead of hanging; the same settings on both ranks raise nothing.
Afterwards the prepare step's padding uses the agreed settings, not a rank's own.

The main environment runs the manager over stand-ins of the vLLM names it imports; one test runs the same
cases over vLLM 0.33.0 itself.
"""

from __future__ import annotations

import pytest

from moonep_ep.errors import ConfigError
from moonep_ep.launch import run_ranks
from moonep_ep.models import get_model
from moonep_ep.ops.decode.cost import OVERRIDES, cost_model, cost_overrides
from moonep_ep.vllm.buffers import AGREED, agree_decisions
from tests.support.lockstep_decisions_check import CASES, manager_cases
from tests.support.vllm_envs import run_json

HEAD = ("moonep_ep: the EP ranks disagree on settings that decide which collectives run, so each would wait "
        "in collectives the others never enter: ")

#: What each disagreeing case's error says, after HEAD, written out by hand.
DISAGREE = {
    "padding_differs": "capacity padding: balanced on rank(s) [0], own on rank(s) [1]. "
                       "Fix: set the same MOONEP_EP_PADDING on every rank",
    "api_differs": "MoonEP API: pull (MOONEP_EP_MOONEP_API=pull, the reference buffer) on rank(s) [0], "
                   "push (MOONEP_EP_MOONEP_API=push, the reference buffer) on rank(s) [1]. "
                   "Fix: set the same MOONEP_EP_MOONEP_API on every rank and install the same MoonEP library "
                   "on every node",
    "tflops_differs": "cost model's overrides: none on rank(s) [0], MOONEP_EP_COST_TFLOPS=500.0 on rank(s) [1]. "
                      "Fix: set the same cost-model overrides (MOONEP_EP_COST_TFLOPS, _LINK_GBPS, _HBM_GBPS, "
                      "_EXPERT_BYTES) on every rank",
    "profile_differs": "cost model's GPU profile: h100 (MOONEP_EP_GPU_PROFILE=h100) on rank(s) [0], "
                       "h200 (MOONEP_EP_GPU_PROFILE=h200) on rank(s) [1]. Fix: set the same MOONEP_EP_GPU_PROFILE "
                       "on every rank (auto reads each rank's own GPU name)",
    "applies_differs": "cost model in use: yes (MOONEP_EP_GPU_PROFILE=h200, no GPU) on rank(s) [0], "
                       "no (MOONEP_EP_GPU_PROFILE=auto, no GPU) on rank(s) [1]. Fix: set the same "
                       "MOONEP_EP_GPU_PROFILE on every rank (auto applies the model on GPU ranks only)",
    "layout_differs": "expert layout: sharded on rank(s) [0], replicated on rank(s) [1]. "
                      "Fix: set the same MOONEP_EP_LAYOUT on every rank",
    "max_tokens_differs": "buffer pool's largest capacity (max_num_batched_tokens): 2048 on rank(s) [0], "
                          "4096 on rank(s) [1]. Fix: start every engine with the same --max-num-batched-tokens",
    "two_differ": "MoonEP API: push (MOONEP_EP_MOONEP_API=push, the reference buffer) on rank(s) [0], "
                  "pull (MOONEP_EP_MOONEP_API=auto, the reference buffer) on rank(s) [1]; capacity padding: vllm on "
                  "rank(s) [0], balanced on rank(s) [1]. Fix: set the same MOONEP_EP_MOONEP_API on every rank and "
                  "install the same MoonEP library on every node; set the same MOONEP_EP_PADDING on every rank",
}
#: The controls: the same settings (or the same decision) on both ranks, and what was agreed.
AGREE = {
    "same_defaults": {"buffer": "reference", "api": "pull", "layout": "sharded", "padding": "balanced",
                      "cost_profile": "h200", "cost_overrides": (), "cost_applies": False, "max_tokens": 8192},
    "padding_same": {"padding": "own"},
    "api_same": {"api": "push"},
    "api_same_decision": {"api": "pull"},
    "tflops_same": {"cost_overrides": (("MOONEP_EP_COST_TFLOPS", 500.0),)},
    "profile_same": {"cost_profile": "h100", "cost_applies": True},
}


@pytest.fixture(scope="module")
def two_ranks():
    """Every case on two gloo ranks, in one run (each rank imports torch once); bounded: a rank left waiting
    fails the run within the group's 30 s timeout instead of hanging."""
    return run_ranks(manager_cases, 2, timeout_s=180, group_timeout_s=30)


def test_every_case_is_checked():
    assert set(CASES) == set(DISAGREE) | set(AGREE) | {"bad_value_on_rank_1", "bad_api_on_rank_1"}


@pytest.mark.parametrize("case", sorted(DISAGREE))
def test_ranks_that_decide_apart_raise_the_same_error_on_every_rank(two_ranks, case):
    for rank, result in enumerate(two_ranks):
        kind, message = result[case]
        assert kind == "ConfigError", (case, rank, message)
        assert message == f"[rank {rank}] {HEAD}{DISAGREE[case]}", (case, rank)
    assert all(r["after"] == [0, 1] for r in two_ranks)   # both ranks still in step afterwards


@pytest.mark.parametrize("case", sorted(AGREE))
def test_the_same_settings_on_every_rank_raise_nothing(two_ranks, case):
    agreed = [r[case] for r in two_ranks]
    assert [kind for kind, _ in agreed] == ["ok", "ok"], agreed
    assert agreed[0][1] == agreed[1][1]
    for name, value in AGREE[case].items():
        assert agreed[0][1][name] == value, (case, name)


def test_a_bad_value_on_one_rank_fails_every_rank_in_the_selection_step(two_ranks):
    for rank, result in enumerate(two_ranks):
        kind, message = result["bad_value_on_rank_1"]
        assert kind == "CollectiveError"
        assert message.startswith(f"[rank {rank}] collective step 'MoonEP backend selection (moonep_ep system "
                                  "check)' failed on rank(s) [1]"), message
        assert "MOONEP_EP_PADDING='sideways' is not valid: use balanced | own | vllm" in message


def test_a_bad_moonep_api_on_one_rank_fails_every_rank_in_the_selection_step(two_ranks):
    """The API is chosen inside the manager's lockstep step: one rank's bad value names that rank everywhere."""
    for rank, result in enumerate(two_ranks):
        kind, message = result["bad_api_on_rank_1"]
        assert kind == "CollectiveError", message
        assert message.startswith(f"[rank {rank}] collective step 'MoonEP backend selection (moonep_ep system "
                                  "check)' failed on rank(s) [1]"), message
        assert "MOONEP_EP_MOONEP_API='gen_b'" in message and "auto | pull | push" in message


def test_the_prepare_step_uses_the_agreed_settings_not_a_ranks_own(two_ranks):
    """Rank 1 changed its padding and cost settings after the agreement: the padding still all-gathers
    (balanced) and both ranks swap to the same larger Buffer (S = 64, hot_path's docstring)."""
    hot = [r["hot_path"] for r in two_ranks]
    assert [kind for kind, _ in hot] == ["ok", "ok"], hot
    for rank, (_, h) in enumerate(hot):
        assert h["policy"] == h["agreed_policy"] == "balanced"
        assert h["capacity"] == 64 and h["swapped"] == [64] and h["buffer"] == "buffer S=64"
        assert h["agreed_inputs"] == ["h200", (), True]
    # Control: what rank 1 would have used had it re-read its own settings.
    assert hot[1][1]["own_inputs"] == ["h200", (("MOONEP_EP_COST_TFLOPS", 0.001),), True]
    assert hot[1][1]["own_policy"] == "own" and hot[0][1]["own_policy"] == "balanced"


def test_the_agreement_alone_without_a_group():
    """``agree_decisions`` over hand-made gathered lists: every listed decision is compared, and a rank's
    shown text only appears where values differ."""
    base = {name: (f"v-{name}", f"v-{name} (shown)") for name in AGREED}
    assert agree_decisions([base, dict(base)], 1).padding == "v-padding"
    for name in AGREED:
        other = dict(base, **{name: ("other", "other (shown)")})
        with pytest.raises(ConfigError) as info:
            agree_decisions([base, base, other], 2)
        msg = str(info.value)
        assert msg.startswith(f"[rank 2] {HEAD}{AGREED[name][0]}: v-{name} (shown) on rank(s) [0, 1], "
                              f"other (shown) on rank(s) [2]. Fix: {AGREED[name][1]}"), msg


def test_the_cost_model_takes_the_agreed_overrides_not_this_processs(monkeypatch):
    for var in OVERRIDES:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MOONEP_EP_COST_TFLOPS", "500")
    k2 = get_model("kimi-k2")
    assert cost_overrides() == (("MOONEP_EP_COST_TFLOPS", 500.0),)
    assert cost_model(k2, "bf16", "h200").flop_rate == 500e12            # none given: this process's
    agreed_none = cost_model(k2, "bf16", "h200", ())
    assert agreed_none.flop_rate == 989e12 and agreed_none.overrides == ()  # agreed: none, the profile's rate
    agreed = cost_model(k2, "bf16", "h200", (("MOONEP_EP_COST_TFLOPS", 100.0), ("MOONEP_EP_COST_LINK_GBPS", 2.0),
                                             ("MOONEP_EP_COST_HBM_GBPS", 3.0), ("MOONEP_EP_COST_EXPERT_BYTES", 7)))
    assert (agreed.flop_rate, agreed.link_bw, agreed.hbm_bw, agreed.expert_bytes) == (100e12, 2e9, 3e9, 7)
    assert agreed.overrides == ("MOONEP_EP_COST_TFLOPS=100.0", "MOONEP_EP_COST_LINK_GBPS=2.0",
                                "MOONEP_EP_COST_HBM_GBPS=3.0", "MOONEP_EP_COST_EXPERT_BYTES=7")


def test_the_same_cases_over_vllm_0_33_0():
    """vLLM 0.33.0's own classes under the manager: the disagreements raise the same errors; where the ranks
    agree, ``__init__`` goes on to vLLM's base ``__init__``, which needs vLLM's parallel state (not built
    here), so it fails there, past the agreement."""
    out = run_json("vllm", ["-m", "tests.support.lockstep_decisions_check"], timeout=300)
    assert out["ok"], out
    ranks = out["ranks"]
    for case, text in DISAGREE.items():
        for rank, result in enumerate(ranks):
            assert result[case] == ["ConfigError", f"[rank {rank}] {HEAD}{text}"], (case, rank)
    for case in AGREE:
        for result in ranks:
            kind, message = result[case]
            assert kind != "ConfigError" and "data parallel group is not initialized" in message, (case, message)
    assert all(r["after"] == [0, 1] for r in ranks)
