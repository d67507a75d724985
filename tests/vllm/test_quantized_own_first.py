"""The quantized experts compute their own experts before the slot-fill wait, as the BF16 experts do (issue 45).

``engine.own_then_slots`` runs the own groups, waits for the slot fill's event, then runs the slot groups, each
part over its own rows and weight rows. Here, in this process (vLLM's few imported names are stand-ins,
``tests/support/vllm_stubs.py``), with the dequantize experts (``MoonEPQuantizedExperts``: the CPU engine's)
over real quantized ``[E+B]`` (pull) and ``[2*epn]`` (push) views, slots filled by ``ops.moonep.prefetch``'s
deferred CPU copies (they land only when their event is waited on):

* the output equals one pass over every group (what ``apply`` computed before: ``quantized_grouped_ffn`` over
  the whole views), bit for bit, for INT4 g32, FP8 block and MXFP4, pull and push; rows past the last group
  are not written;
* the order: ``overlap.TRACE`` records ``own``, ``waited``, ``slots``, and the fill had not landed when the own
  part ran and had when the slot part ran (read from the event, not from the trace);
* the control: the old order (the experts wait as they take the event) fails that check;
* a decode-sized step (``overlap.arm(..., one_pass=True)``, as for BF16) waits, then runs one pass.

The Triton experts share ``own_then_slots``; that their kernels give the same bits per part is checked under
Triton's interpreter in the vLLM environment (``tests/support/quantized_own_first_check.py``, marked slow).
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from moonep_ep.ops.experts import quantized as quantized_experts
from moonep_ep.ops.experts.quantized import SPLIT_NAMES, quantized_grouped_ffn, views_of
from moonep_ep.ops.moonep.prefetch import SideStreams, pull_slots, wait_for_slots
from moonep_ep.vllm.experts import overlap
from moonep_ep.vllm.quantized import engine as qe
from tests.support.quantized_own_first_check import H, I, quantized_views
from tests.support.vllm_stubs import install

FORMATS = ("fp8-block", "int4-g32", "mxfp4")
#: pull: E=4 experts then B=2 slots; push: epn=3 own experts then 3 slots. One empty group in each part, and 16
#: tail rows past the last group (stale hidden rows, NaN route weights: what a reused shard holds there).
PULL_E, PULL_LENGTHS = 4, [16, 0, 32, 16, 16, 32]
PULL_LIVE = sum(PULL_LENGTHS)
PUSH_E, PUSH_LENGTHS = 3, [16, 0, 32, 16, 32, 0]
TAIL = 16


class _MoonEPExperts:
    def __init__(self, moe_config: Any, quant_config: Any, *args: Any) -> None:
        self.moe_config, self.quant_config = moe_config, quant_config
        self._weight_layout = None


@pytest.fixture
def experts(monkeypatch, tmp_path):
    """A dequantize experts instance built over vLLM's stand-in names (fresh class cache)."""
    monkeypatch.setattr(qe, "_EXPERTS_CLS", {})
    monkeypatch.setenv("MOONEP_EP_VLLM_STATS_DIR", str(tmp_path))
    monkeypatch.setenv("MOONEP_EP_CPU_DEFERRED_COPIES", "1")
    install(monkeypatch, {
        "vllm.model_executor.layers.fused_moe": {},
        "vllm.model_executor.layers.fused_moe.experts": {},
        "vllm.model_executor.layers.fused_moe.experts.moonep_experts": {"MoonEPExperts": _MoonEPExperts},
        "vllm.model_executor.layers.fused_moe.prepare_finalize": {},
        "vllm.model_executor.layers.fused_moe.prepare_finalize.moonep": {"MOONEP_DEFAULT_TOKEN_PADDING": 128},
    })
    cls = qe.experts_class("dequant")
    return cls(moe_config=types.SimpleNamespace(intermediate_size_per_partition=I), quant_config=None)


def _views(fmt: str, rows: int, split: bool) -> dict[str, torch.Tensor]:
    return quantized_views(fmt, rows, split)


def _single_pass(fmt: str, views: dict[str, torch.Tensor], hidden, cu, route) -> torch.Tensor:
    """What ``apply`` returned before the split: one ``quantized_grouped_ffn`` over every group."""
    if "gate" in views:
        g, gs, u, us, d, ds = (views[n] for n in SPLIT_NAMES)
        return quantized_grouped_ffn(hidden, fmt, g, gs, d, ds, cu, route, up=(u, us))
    return quantized_grouped_ffn(hidden, fmt, *views_of(fmt, views), cu, route)


def _run(experts: Any, fmt: str, api: str, monkeypatch, one_pass: bool = False) -> dict[str, Any]:
    """One ``apply`` over slots whose fill is still in flight (deferred CPU copies); the single pass over the
    slots as the fill leaves them; the trace; and, per call of the FFN, which groups and whether the fill had
    landed."""
    own, lengths = (PULL_E, PULL_LENGTHS) if api == "pull" else (PUSH_E, PUSH_LENGTHS)
    slots = len(lengths) - own
    views = _views(fmt, own + slots, split=api == "push")
    row = [2, 0] if api == "pull" else [1, 2, -1]             # slot b <- expert row (push: the last slot unused)
    for v in views.values():                                  # the slots before the fill: other experts' bytes
        for b, e in enumerate(row):
            v[own + b] = v[(e + 1) % own]
    right = {n: v.clone() for n, v in views.items()}          # the slots as the fill leaves them, set directly
    for b, e in enumerate(row):
        if e >= 0:
            for v in right.values():
                v[own + b] = v[e]
    gen = torch.Generator().manual_seed(5)
    rows = sum(lengths) + TAIL
    hidden = torch.randn(rows, H, generator=gen).to(torch.bfloat16)
    route = torch.rand(rows, generator=gen)
    route[sum(lengths):] = float("nan")
    cu = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0, dtype=torch.int32)
    expected = _single_pass(fmt, right, hidden, cu, route)

    streams = SideStreams()
    event = pull_slots(views, row, own, streams=streams)[2]
    assert not event.query()                                  # deferred: nothing landed yet
    calls: list[tuple[int, bool]] = []
    ffn = quantized_experts.quantized_grouped_ffn

    def spy(hidden_part, fmt_, w13, *args, **kwargs):
        calls.append((w13.shape[0], event.query()))           # which weight rows, and whether the fill landed
        return ffn(hidden_part, fmt_, w13, *args, **kwargs)

    monkeypatch.setattr(quantized_experts, "quantized_grouped_ffn", spy)
    layout = types.SimpleNamespace(format=fmt, views=views)
    if api == "push":
        layout.own_groups = own                               # PushWeightLayout's attribute; pull: E
    experts._weight_layout = layout
    overlap.SLOT_FILL_HANDOFF.put(event)
    overlap.SLOT_FILL_HANDOFF.one_pass = one_pass             # what overlap.arm sets for a decode-sized step
    trace: list[str] = []
    overlap.TRACE.events = trace
    output = torch.full((rows, H), 7.0, dtype=torch.bfloat16)
    try:
        experts.apply(output, hidden, None, None, route, torch.zeros(8, 2, dtype=torch.int64), None, own, None,
                      None, None, None, None, types.SimpleNamespace(expert_num_tokens=torch.tensor(lengths)), False)
    finally:
        overlap.TRACE.events = None
        streams.close()
    return {"output": output, "expected": expected, "trace": trace, "calls": calls, "own": own,
            "slots": slots, "live": sum(lengths)}


def check_own_first(run: dict[str, Any]) -> None:
    """The own part ran before the wait (the fill not landed), the slot part after it (landed)."""
    assert run["trace"] == ["own", "waited", "slots"], run["trace"]
    assert run["calls"] == [(run["own"], False), (run["slots"], True)], run["calls"]


@pytest.mark.parametrize("api", ["pull", "push"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_own_groups_first_then_the_wait_then_the_slots_with_one_pass_bits(experts, monkeypatch, fmt, api):
    run = _run(experts, fmt, api, monkeypatch)
    check_own_first(run)
    live = run["live"]
    assert torch.equal(run["output"][:live], run["expected"][:live])   # bit for bit: one pass over every group
    assert bool((run["output"][live:] == 7).all())          # past the last group: not written (combine never reads)
    assert bool(run["output"][:live].isfinite().all()) and bool(run["output"][:live].ne(0).any())


def test_control_waiting_as_the_event_is_taken_fails_the_order_check(experts, monkeypatch):
    """The order before issue 45: the experts waited for the fill before any GEMM."""
    def take_and_wait() -> None:
        wait_for_slots(overlap.take_slot_fill())
        overlap._trace("waited")

    monkeypatch.setattr(qe, "take_slot_fill", take_and_wait)
    run = _run(experts, "int4-g32", "pull", monkeypatch)
    assert torch.equal(run["output"][:PULL_LIVE], run["expected"][:PULL_LIVE])   # the same rows: only the order
    with pytest.raises(AssertionError, match="waited"):
        check_own_first(run)
    assert run["trace"] == ["waited", "own", "slots"] and run["calls"] == [(PULL_E, True), (2, True)]


def test_a_decode_sized_step_waits_then_runs_every_group_in_one_pass(experts, monkeypatch):
    """As the BF16 experts (``overlap.decode_sized``): no split, so no split row read back to the host."""
    run = _run(experts, "mxfp4", "push", monkeypatch, one_pass=True)
    assert run["trace"] == ["waited", "one pass"] and run["calls"] == [(PUSH_E + 3, True)]
    assert torch.equal(run["output"], run["expected"])       # the one pass, tail included (its own zeros)
    assert overlap.SLOT_FILL_HANDOFF.one_pass is False       # taken: the next layer decides again


def test_without_slot_groups_the_own_part_is_all_and_nothing_is_waited_for(experts, monkeypatch):
    """Rows ``[E]`` (no slots) and no fill: one part, no wait."""
    views = _views("fp8-block", PULL_E, split=False)
    lengths = [16, 0, 32, 16]
    hidden = torch.randn(sum(lengths) + TAIL, H, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    cu = torch.cumsum(torch.tensor(lengths), 0, dtype=torch.int32)
    experts._weight_layout = types.SimpleNamespace(format="fp8-block", views=views)
    trace: list[str] = []
    overlap.TRACE.events = trace
    output = torch.full_like(hidden, 7.0)
    try:
        experts.apply(output, hidden, None, None, None, torch.zeros(4, 2, dtype=torch.int64), None, PULL_E, None,
                      None, None, None, None, types.SimpleNamespace(expert_num_tokens=torch.tensor(lengths)), True)
    finally:
        overlap.TRACE.events = None
    assert trace == ["own", "slots"]
    live = sum(lengths)
    assert torch.equal(output[:live], _single_pass("fp8-block", views, hidden, cu, None)[:live])
    assert bool((output[live:] == 7).all())


@pytest.mark.slow
def test_the_triton_experts_split_gives_one_passs_bits_under_the_interpreter(report):
    """The Triton experts (vLLM's INT4 and FP8-block kernels, the project's MXFP4 kernel) through
    ``own_then_slots`` against their one pass over every group, in the vllm==0.33.0 environment; push for FP8
    block only (its gate and up apart are orthogonal to the own/slot split). Each part's down GEMM writes the
    output's rows in place (``gpu_grouped_ffn``'s ``out``). About 35 s on 2 cores, 20 of them importing vLLM."""
    from tests.support.vllm_envs import run_json

    out = run_json("vllm", ["-m", "tests.support.quantized_own_first_check", "--json",
                            "--cases", "int4-g32/pull,fp8-block/pull,mxfp4/pull,fp8-block/push"], timeout=300)
    assert set(out["results"]) == {"int4-g32/pull", "fp8-block/pull", "mxfp4/pull", "fp8-block/push"}
    for case, r in out["results"].items():
        assert r["equal"] and r["live_nonzero"] and r["finite"] and r["tail_untouched"], (case, r)
        assert r["in_place"], (case, r)
    assert out["ok"]
    report(f"[quantized own-first, Triton interpreter] {out['seconds']} s: "
           + ", ".join(f"{c} {r['seconds']}" for c, r in out["results"].items()) + " (one pass, split; s)")
