"""Which MoonEP API a Buffer speaks (signature probe) and the per-run choice with what follows from it.

The stand-ins restate the two public signatures (docs/design/moonep.md, "Which API generation"):
``PullBuffer`` is MoonEP at commit 7745ffa0, the API vLLM 0.33.0 calls (``B=`` in
``MoonEPAll2AllManager._make_buffer_kwargs``, ``full_*_weight=`` in ``MoonEPPrepareAndFinalize.prepare``);
``PushBuffer`` is MoonEP's release 26/09 (commit 33327eb): no ``B``, ``local_*_weight`` +
``*_prefetch_buffer``. Each deciding parameter has a control that flips or removes it alone.
"""

from __future__ import annotations


import pytest

from moonep_ep.errors import ConfigError
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
    """A wrapper of the pull reference buffer still speaks pull."""


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


def test_the_reference_buffers_speak_one_api_each_like_a_real_moonep():
    """No "either": the pull reference buffer is probed as pull, so a push request against it is refused
    (the push run gets PushReferenceBuffer, ``vllm/buffers.select_buffer``)."""
    probe = probe_moonep_api(ReferenceBuffer)
    assert probe == ApiProbe("pull", PULL_EVIDENCE, "moonep_ep.ops.moonep.pull.ReferenceBuffer")
    assert choose_moonep_api(ReferenceBuffer, "auto").api == "pull"
    assert probe_moonep_api(ReferenceSubclass).api == "pull"
    with pytest.raises(ConfigError, match="MOONEP_EP_MOONEP_API=push contradicts"):
        choose_moonep_api(ReferenceBuffer, "push")
    # Control: both keyword sets on one class are refused.
    with pytest.raises(ConfigError, match="matches both"):
        probe_moonep_api(BothKeywordSets)


def test_the_choice_says_what_follows_from_it():
    pull, push = choose_moonep_api(PullBuffer, "pull"), choose_moonep_api(PushBuffer, "push")
    assert (pull.is_push, push.is_push) == (False, True)
    assert pull.num_slots(4, 8) == 8 and push.num_slots(4, 8) == 4
    kwargs = {"S": 16, "H": 128, "K": 2, "E": 8, "num_ep_ranks": 2, "B": 8}
    assert pull.buffer_kwargs(kwargs) == kwargs and "B" not in push.buffer_kwargs(kwargs)
    assert push.buffer_kwargs(kwargs) == {k: v for k, v in kwargs.items() if k != "B"}


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
    assert choose_moonep_api(PushBuffer).api == "push"
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
