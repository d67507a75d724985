"""The experts wait for the slot fills before reading a slot (issue 36): the plugin's hand-over, and the
negative control on the kernel tier.

On a GPU the slot copies run on a side stream (``cudaMemcpyAsync``, then ``cudaEventRecord``); the
experts' kernels may read a slot only after their stream waited on that event (``cudaStreamWaitEvent``:
PyTorch's ``torch.cuda.Event.wait``, DeepEP's ``EventOverlap.current_stream_wait``). On CPU the copies are
deferred until that wait (``MOONEP_EP_CPU_DEFERRED_COPIES``), so a missing wait reads the slot's previous
bytes here too: the settle's NaN poison, or the other layer's expert (the slot pool is shared by all layers).

* :func:`test_overlap_apply_waits_before_the_slot_groups` (no vLLM needed): ``overlap.apply`` over
  deferred fills equals one grouped GEMM of the right weights; with its wait removed the slot rows are
  NaN (the poison the fill should have replaced).
* :func:`test_kernel_tier_fails_the_oracle_without_the_wait_and_passes_with_it`
  (``tests/support/slot_fill_check.py`` in the vLLM 0.33.0 environment, two ranks, no engine): vLLM's
  ``MoonEPPrepareAndFinalize`` with ``MoonEPExperts`` (BF16) and with ``MoonEPQuantizedExperts`` /
  ``MoonEPTritonQuantizedExperts`` (FP8 block, MXFP4) over the sharded store, against dense fp32 MoEs
  built apart from the system: with the library's wait every layer passes; with it removed (by the
  harness) a layer fails, and with only the scales' wait removed a quantized layer fails.
"""

from __future__ import annotations

import types

import pytest
import torch

from moonep_ep.ops.moonep.prefetch import SideStreams, pull_slots
from moonep_ep.vllm.experts import overlap

E, B, H, I = 4, 2, 128, 64
SILU = types.SimpleNamespace(name="SILU")


class _PullBuffer:
    """A buffer whose async prefetch is ``ops.moonep.prefetch.pull_slots`` on CPU tensors (deferred copies)."""

    def __init__(self, weights: dict[str, torch.Tensor], row: list[int]):
        self.weights, self.row, self.streams = weights, row, SideStreams()

    def prefetch_weight(self, plan=None, async_finish=False, **_):
        assert async_finish  # an armed step asks for the event
        return pull_slots(self.weights, self.row, E, streams=self.streams)[2]


def _weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    out = {p: (torch.randn(E + B, *s, generator=gen) / s[1] ** 0.5).to(torch.bfloat16) for p, s in shapes.items()}
    for w in out.values():
        w[E:] = float("nan")  # the slots as the settle leaves them
    return out


def _apply(waits: bool) -> tuple[torch.Tensor, torch.Tensor, list]:
    weights = _weights()
    row = [3, 0]  # slot 0 <- expert 3, slot 1 <- expert 0
    # the reference: the right experts in the slot rows, set here directly (not through the fill)
    right = {p: w.clone() for p, w in weights.items()}
    for b, e in enumerate(row):
        for w in right.values():
            w[E + b] = w[e]
    lengths = [16, 0, 16, 16, 16, 32]
    gen = torch.Generator().manual_seed(8)
    rows = sum(lengths)
    hidden = torch.randn(rows, H, generator=gen).to(torch.bfloat16)
    route = torch.rand(rows, generator=gen)
    cu = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0, dtype=torch.int32)
    gm = lambda a, w: torch._grouped_mm(a, w.transpose(1, 2), offs=cu)  # noqa: E731 - vLLM's one grouped GEMM
    act = torch.nn.functional.silu(gm(hidden, right["gate"])) * gm(hidden, right["up"])
    expected = gm(act * route.to(act.dtype).unsqueeze(-1), right["down"])
    experts_module = types.SimpleNamespace(MoonEPExperts=type("MoonEPExperts", (), {"apply": lambda self: None}))
    overlap.patch_experts(experts_module)
    overlap.arm(types.SimpleNamespace(_fused_experts=experts_module.MoonEPExperts()))
    trace: list = []
    overlap.TRACE.events = trace
    saved = overlap.wait_for_slots
    if not waits:
        overlap.wait_for_slots = lambda event: None  # the control: the experts' wait removed
    try:
        assert overlap.prefetch(_PullBuffer({"gate": weights["gate"], "up": weights["up"], "down": weights["down"]},
                                            row), plan=None, async_finish=False, weights={}) is None
        output = torch.full((rows, H), 7.0, dtype=torch.bfloat16)
        this = types.SimpleNamespace(_weight_layout=types.SimpleNamespace(full_up_weight=weights["up"]))
        meta = types.SimpleNamespace(expert_num_tokens=torch.tensor(lengths, dtype=torch.int32))
        overlap.apply(this, output, hidden, weights["gate"], weights["down"], route, None, SILU, E, None, None, None,
                      None, None, meta, False)
    finally:
        overlap.wait_for_slots = saved
        overlap.TRACE.events = None
    return output, expected, trace


def test_overlap_apply_waits_before_the_slot_groups():
    output, expected, trace = _apply(waits=True)
    assert trace == ["prefetch issued", "own", "waited", "slots"]
    assert torch.equal(output, expected)                 # the fills landed before the slot groups were read
    control, expected, _ = _apply(waits=False)
    own_end = 16 + 0 + 16 + 16                           # groups [0, E): the own experts, read in place
    assert torch.equal(control[:own_end], expected[:own_end])
    assert bool(control[own_end:].isnan().all())         # without the wait the slot rows read the poison


def test_deliver_hands_the_event_to_the_caller_the_experts_or_the_current_stream():
    full = torch.zeros(E + B, 4)
    full[:E] = torch.arange(1, E + 1, dtype=torch.float32)[:, None]
    streams = SideStreams()

    def issue():
        full[E:] = -1.0
        return pull_slots({"w": full}, [2, 1], E, streams=streams)[2]

    event = issue()
    assert overlap.deliver_slot_fill(event, async_finish=True) is event and not event.query()  # the caller waits
    streams.close()
    overlap.arm(types.SimpleNamespace(_fused_experts=None))                         # not armed
    event = issue()
    assert overlap.deliver_slot_fill(event, async_finish=False) is None and event.query()      # waited at once
    assert full[E:, 0].tolist() == [3.0, 2.0]
    # armed by an experts class that says it waits (the quantized experts): kept for its apply
    overlap.arm(types.SimpleNamespace(_fused_experts=type("Q", (), {overlap.WAITS_ATTR: True})()))
    event = issue()
    assert overlap.deliver_slot_fill(event, async_finish=False) is None and not event.query()
    assert overlap.take_slot_fill() is event and overlap.take_slot_fill() is None
    streams.close()


@pytest.mark.slow
def test_kernel_tier_fails_the_oracle_without_the_wait_and_passes_with_it(report):
    from tests.support.slot_fill_check import CASES
    from tests.support.vllm_envs import run_json

    out = run_json("vllm", ["-m", "tests.support.slot_fill_check", "--json"], timeout=300)
    assert out["ok"] and out["failed"] == [], out["failed"]
    ranks = out["ranks"]
    assert len(ranks) == 2 and all(r["deferred_copies"] for r in ranks)
    assert set(ranks[0]["quantized"]) == set(CASES)
    assert {k.split("/")[1] for k in CASES} == {"dequant", "triton"}  # both quantized expert kinds
    # BF16: MoonEPExperts as the plugin patches it; the own groups run before the wait, the slot groups after.
    # A prefill-sized step: the own groups run before the wait, the slot groups after. A decode-sized step: the
    # wait, then one pass over every group (no row index read back); the controls fail the oracle in both.
    for key, trace in (("bf16", ["prefetch issued", "own", "waited", "slots"]),
                       ("bf16_decode", ["prefetch issued", "waited", "one pass"])):
        steps = [r[key]["steps"] for r in ranks]
        assert all(r[key]["experts_class"] == "MoonEPExperts" for r in ranks)
        for s, name in enumerate(("poison", "fixed", "stale", "fixed")):
            layers = [layer for per_rank in steps for layer in per_rank[s]["layers"]]
            assert all(per_rank[s]["step"] == name and per_rank[s]["waits"] == {"calls": 2, "events": 2}
                       for per_rank in steps)
            if name == "fixed":
                assert all(layer["within_oracle"] for layer in layers), (key, s, layers)
                assert all(per_rank[s]["trace"] == trace * 2 for per_rank in steps), key
            else:
                assert any(layer["slots"] for layer in layers), (key, s, "no slot in use: the control proves nothing")
                assert not all(layer["within_oracle"] for layer in layers), (key, s, layers)
        # the poison reaches the output without the wait; one step later the other layer's expert does (finite)
        assert any(not layer["finite"] for per_rank in steps for layer in per_rank[0]["layers"]), key
        assert any(layer["finite"] and not layer["within_oracle"]
                   for per_rank in steps for layer in per_rank[2]["layers"]), key
    rows = []
    for key, names in CASES.items():
        per_rank = [r["quantized"][key] for r in ranks]
        kind = key.split("/")[1]
        assert all(q["experts_class"] == ("MoonEPTritonQuantizedExperts" if kind == "triton" else
                                          "MoonEPQuantizedExperts") for q in per_rank)
        bound = per_rank[0]["bound"]
        for s, name in enumerate(names):
            layers = [layer for q in per_rank for layer in q["steps"][s]["layers"]]
            assert all(q["steps"][s]["step"] == name and q["steps"][s]["waits"] == {"calls": 2, "events": 2}
                       for q in per_rank)
            worst = max(layer["rel_err"] for layer in layers)
            if name == "fixed":
                assert worst <= bound, (key, s, layers)
            else:
                assert any(layer["slots"] for layer in layers), (key, s)
                assert worst > bound, (key, s, layers)
                # poison: NaN; the other layer's expert or scale: finite, and far off
                finite = [layer["rel_err"] for layer in layers if layer["finite"] and layer["rel_err"] > bound]
                assert (not finite) if name == "poison" else min(finite) > 8 * bound, (key, name, layers)
            rows.append((key, name, worst))
    report(f"[slot fills waited, kernel tier] {out['seconds']} s, 2 ranks (layer max |out-ref|/max|ref|):")
    for key, name, worst in rows:
        report(f"  {key:18} {name:7} {worst:.4g}")
