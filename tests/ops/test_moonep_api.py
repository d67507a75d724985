"""Which MoonEP API a Buffer speaks (signature probe) and the per-run choice, refused alike on every rank.

The stand-ins restate the two public signatures (docs/design/moonep.md, "Which API generation"):
``PullBuffer`` is MoonEP at commit 7745ffa0, the API vLLM 0.33.0 calls (``B=`` in
``MoonEPAll2AllManager._make_buffer_kwargs``, ``full_*_weight=`` in ``MoonEPPrepareAndFinalize.prepare``);
``PushBuffer`` is MoonEP's release 26/09 (commit 33327eb): no ``B``, ``local_*_weight`` +
``*_prefetch_buffer``. Each deciding parameter has a control that flips or removes it alone.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from moonep_ep.errors import ConfigError
from moonep_ep.launch import run_ranks
from moonep_ep.ops.moonep.pull import ReferenceBuffer
from moonep_ep.ops.moonep.api import ApiProbe, choose_moonep_api, probe_moonep_api, requested_api


class _DispatchAndCombine:
    """``dispatch`` and ``combine`` as both generations declare them (the probe decides on ``B`` and
    ``prefetch_weight``; the push side also needs ``async_finish``/``zero_copy`` here)."""

    def dispatch(self, hidden_sh, route_weights_sk=None, topk_experts_sk=None, tokens_per_expert=None, plan=None,
                 async_finish=False, *, inter_rank_sync=True, zero_copy=False, router_weights_zero_copy=False):
        pass

    def combine(self, plan=None, hidden_nvsh=None, route_weights_nvs=None, async_finish=False, inter_rank_sync=True,
                *, zero_copy=False, router_weights_zero_copy=False):
        pass


class PullBuffer(_DispatchAndCombine):
    """MoonEP 7745ffa0's signatures."""

    def __init__(self, S, H, K, E, num_ep_ranks, num_sms=None, token_padding=128, B=None, group=None,
                 comm_stream_priority=-1, enable_pdl=True, explicitly_destroy=False):
        pass

    def prefetch_weight(self, plan=None, async_finish=False, *, full_gate_weight, full_up_weight, full_down_weight,
                        full_gate_scale=None, full_up_scale=None, full_down_scale=None):
        pass


class PushBuffer(_DispatchAndCombine):
    """MoonEP release 26/09's signatures."""

    def __init__(self, S, H, K, E, num_ep_ranks, num_sms=None, token_padding=128, group=None,
                 comm_stream_priority=-1, enable_pdl=True, explicitly_destroy=False):
        pass

    def prefetch_weight(self, plan=None, async_finish=False, *, local_gate_weight, local_up_weight, local_down_weight,
                        gate_prefetch_buffer, up_prefetch_buffer, down_prefetch_buffer, local_gate_scale=None,
                        local_up_scale=None, local_down_scale=None, gate_scale_prefetch_buffer=None,
                        up_scale_prefetch_buffer=None, down_scale_prefetch_buffer=None):
        pass


# -- controls: one deciding parameter changed at a time ----------------------------------------------
class PullWithoutB(PullBuffer):
    def __init__(self, S, H, K, E, num_ep_ranks, num_sms=None, token_padding=128, group=None):
        pass


class PushWithB(PushBuffer):
    def __init__(self, S, H, K, E, num_ep_ranks, num_sms=None, token_padding=128, B=None, group=None):
        pass


class PullMissingDown(PullBuffer):
    def prefetch_weight(self, plan=None, async_finish=False, *, full_gate_weight, full_up_weight):
        pass


class PushMissingPool(PushBuffer):
    def prefetch_weight(self, plan=None, async_finish=False, *, local_gate_weight, local_up_weight, local_down_weight,
                        gate_prefetch_buffer, up_prefetch_buffer):
        pass


class PushWithoutZeroCopy(PushBuffer):
    def dispatch(self, hidden_sh, route_weights_sk=None, topk_experts_sk=None, tokens_per_expert=None, plan=None,
                 async_finish=False):
        pass


class BothKeywordSets(PullBuffer):
    """Not the reference buffer, yet both prefetch keyword sets: refused."""

    def prefetch_weight(self, plan=None, async_finish=False, *, full_gate_weight=None, full_up_weight=None,
                        full_down_weight=None, local_gate_weight=None, local_up_weight=None, local_down_weight=None,
                        gate_prefetch_buffer=None, up_prefetch_buffer=None, down_prefetch_buffer=None):
        pass


class OnlyKwargs:
    def __init__(self, S, H, K, E, num_ep_ranks, **kwargs):
        pass

    def prefetch_weight(self, **kwargs):
        pass


class NotABuffer:
    def __init__(self, size):
        pass


class PullSubclass(PullBuffer):
    """A wrapper that inherits the library's methods still speaks its API."""


class ReferenceSubclass(ReferenceBuffer):
    """A wrapper of the reference buffer still plays either generation."""


PULL_EVIDENCE = ("__init__ has B", "prefetch_weight has full_gate_weight, full_up_weight, full_down_weight")
PUSH_EVIDENCE = ("__init__ has no B", "prefetch_weight has local_gate_weight, local_up_weight, local_down_weight, "
                 "gate_prefetch_buffer, up_prefetch_buffer, down_prefetch_buffer",
                 "async_finish on dispatch, combine, prefetch_weight; zero_copy on dispatch, combine")


def test_the_7745ffa0_signature_is_pull_and_the_release_push():
    assert probe_moonep_api(PullBuffer) == ApiProbe("pull", PULL_EVIDENCE, f"{__name__}.PullBuffer")
    assert probe_moonep_api(PushBuffer) == ApiProbe("push", PUSH_EVIDENCE, f"{__name__}.PushBuffer")
    assert probe_moonep_api(PullSubclass).api == "pull"


@pytest.mark.parametrize("cls, words", [
    (PullWithoutB, ["matches neither", "__init__(E, H, K, num_ep_ranks, S)"]),     # pull prefetch, no B
    (PushWithB, ["matches both", "__init__(B, E, H, K, num_ep_ranks, S)"]),        # push prefetch, with B
    (PullMissingDown, ["matches neither", "prefetch_weight(async_finish, full_gate_weight, full_up_weight)"]),
    (PushMissingPool, ["matches neither", "gate_prefetch_buffer"]),
    (PushWithoutZeroCopy, ["lacks keywords the push path calls (dispatch.zero_copy)", "33327eb"]),
    (BothKeywordSets, ["matches both", "a real MoonEP Buffer speaks one"]),
    (OnlyKwargs, ["not a MoonEP Buffer", "prefetch_weight: only **kwargs", "dispatch: missing"]),
    (NotABuffer, ["not a MoonEP Buffer", "__init__(none of the MoonEP names)"]),
])
def test_a_buffer_that_is_neither_or_both_is_refused_naming_what_was_found(cls, words):
    with pytest.raises(ConfigError) as info:
        probe_moonep_api(cls)
    msg = str(info.value)
    assert cls.__qualname__ in msg and "Fix:" in msg
    assert all(w in msg for w in words), msg


def test_the_reference_buffer_plays_either_and_the_caller_chooses():
    probe = probe_moonep_api(ReferenceBuffer)
    assert probe.api == "either" and probe.buffer == "moonep_ep.ops.moonep.pull.ReferenceBuffer"
    assert choose_moonep_api(ReferenceBuffer, "auto").api == "pull"   # auto keeps what vLLM 0.33.0 calls
    assert choose_moonep_api(ReferenceBuffer, "pull").api == "pull"
    assert choose_moonep_api(ReferenceBuffer, "push").api == "push"
    assert probe_moonep_api(ReferenceSubclass).api == "either"
    # Control: the same two keyword sets on a class that is not the reference buffer are refused.
    with pytest.raises(ConfigError, match="matches both"):
        probe_moonep_api(BothKeywordSets)


def test_an_agreeing_override_is_accepted_and_a_contradicting_one_refused():
    assert choose_moonep_api(PullBuffer, "pull").api == "pull"
    assert choose_moonep_api(PushBuffer, "PUSH").api == "push"
    assert choose_moonep_api(PushBuffer, "auto").api == "push"
    with pytest.raises(ConfigError) as info:
        choose_moonep_api(PullBuffer, "push")
    msg = str(info.value)
    assert "MOONEP_EP_MOONEP_API=push contradicts" in msg and "speaks the pull API" in msg
    assert "33327eb" in msg and "set MOONEP_EP_MOONEP_API=pull" in msg
    with pytest.raises(ConfigError) as info:
        choose_moonep_api(PushBuffer, "pull")
    msg = str(info.value)
    assert "speaks the push API" in msg and "7745ffa0" in msg and "set MOONEP_EP_MOONEP_API=push" in msg


def test_the_environment_variable_decides_and_a_bad_value_names_it(monkeypatch):
    monkeypatch.setenv("MOONEP_EP_MOONEP_API", "push")
    assert choose_moonep_api(ReferenceBuffer).api == "push"
    with pytest.raises(ConfigError, match="contradicts"):
        choose_moonep_api(PullBuffer)
    monkeypatch.delenv("MOONEP_EP_MOONEP_API")
    assert requested_api() == "auto" and choose_moonep_api(PushBuffer).api == "push"   # default: the probe
    monkeypatch.setenv("MOONEP_EP_MOONEP_API", "gen_b")
    with pytest.raises(ConfigError) as info:
        choose_moonep_api(PullBuffer)
    msg = str(info.value)
    assert "MOONEP_EP_MOONEP_API='gen_b'" in msg and "auto | pull | push" in msg and "Fix:" in msg
    with pytest.raises(ConfigError, match=r"'sideways' is not valid: use auto \| pull \| push"):
        requested_api("sideways")


# -- every rank ---------------------------------------------------------------------------------------------
def _attempt(fn) -> tuple[str, str]:
    try:
        return "ok", fn().api
    except Exception as exc:  # noqa: BLE001 - the kind and message are what the test compares
        return type(exc).__name__, str(exc)


def api_choice_cases(ctx: Any) -> dict:
    from moonep_ep.memory.group import GroupComm

    rank = ctx.rank
    comm = GroupComm()

    def on(r, bad, good):
        return bad if rank == r else good

    out = {
        "agree_pull": _attempt(lambda: choose_moonep_api(PullBuffer, "pull", comm)),
        "auto_push": _attempt(lambda: choose_moonep_api(PushBuffer, "auto", comm)),
        "reference_push": _attempt(lambda: choose_moonep_api(ReferenceBuffer, "push", comm)),
        "contradicts_everywhere": _attempt(lambda: choose_moonep_api(PullBuffer, "push", comm)),
        "contradicts_on_rank_1": _attempt(lambda: choose_moonep_api(PullBuffer, on(1, "push", "auto"), comm)),
        "neither_on_rank_0": _attempt(lambda: choose_moonep_api(on(0, PullWithoutB, PullBuffer), "auto", comm)),
        "installed_differs": _attempt(lambda: choose_moonep_api(on(1, PushBuffer, PullBuffer), "auto", comm)),
    }
    if rank == 1:
        os.environ["MOONEP_EP_MOONEP_API"] = "gen_b"
    out["bad_env_on_rank_1"] = _attempt(lambda: choose_moonep_api(PullBuffer, None, comm))
    os.environ.pop("MOONEP_EP_MOONEP_API", None)
    out["after"] = comm.all_gather_object(rank, "still in step")  # nobody hung or fell out of step
    return out


def test_an_override_contradicting_the_install_is_refused_on_every_rank():
    results = run_ranks(api_choice_cases, 2, timeout_s=120)
    for r in results:
        assert r["agree_pull"] == ("ok", "pull") and r["auto_push"] == ("ok", "push")
        assert r["reference_push"] == ("ok", "push")
        assert r["after"] == [0, 1]
    for case, failing in {"contradicts_everywhere": [0, 1], "contradicts_on_rank_1": [1],
                          "neither_on_rank_0": [0], "bad_env_on_rank_1": [1]}.items():
        for rank, r in enumerate(results):
            kind, msg = r[case]
            assert kind == "CollectiveError", (case, rank, kind, msg)
            assert f"[rank {rank}] collective step 'choose the MoonEP API' failed on rank(s) {failing}" in msg, msg
            for bad in failing:
                assert f"rank {bad}: ConfigError: [rank {bad}]" in msg, msg
            assert all(f"rank {ok}: " not in msg for ok in {0, 1} - set(failing)), msg
    one = results[0]["contradicts_on_rank_1"][1]
    assert "MOONEP_EP_MOONEP_API=push contradicts" in one and "speaks the pull API" in one and "33327eb" in one
    assert "PullWithoutB matches neither" in results[1]["neither_on_rank_0"][1]
    assert "MOONEP_EP_MOONEP_API='gen_b'" in results[0]["bad_env_on_rank_1"][1]
    for rank, r in enumerate(results):   # each rank's own check passed; the ranks' choices differ
        kind, msg = r["installed_differs"]
        assert kind == "ConfigError" and msg.startswith(f"[rank {rank}] ranks would use different MoonEP APIs"), msg
        assert "0: 'pull (MOONEP_EP_MOONEP_API=auto, installed pull)'" in msg
        assert "1: 'push (MOONEP_EP_MOONEP_API=auto, installed push)'" in msg
