"""Own experts before the prefetch wait, slot experts after (vllm/experts/overlap.py), on CPU: order and arithmetic."""

from __future__ import annotations

import types

import torch

from moonep_ep.vllm.experts import overlap

E, B, H, I = 4, 2, 128, 64
SILU = types.SimpleNamespace(name="SILU")


def _reference(hidden, w1, up, w2, cu, weights):
    """vLLM's MoonEPExperts.apply: one grouped GEMM over all E+B groups."""
    gm = lambda a, w: torch._grouped_mm(a, w.transpose(1, 2), offs=cu)  # noqa: E731
    act = torch.nn.functional.silu(gm(hidden, w1)) * gm(hidden, up)
    act = act * weights.to(act.dtype).unsqueeze(-1)
    return gm(act, w2)


class _Buffer:
    def __init__(self, log):
        self.log = log

    def prefetch_weight(self, plan=None, async_finish=False, **weights):
        self.log.append(("prefetch", async_finish))
        return _Event(self.log) if async_finish else None


class _Event:
    def __init__(self, log):
        self.log = log

    def wait(self):
        self.log.append(("wait", None))


def _run(lengths, log):
    gen = torch.Generator().manual_seed(0)
    w1 = torch.randn(E + B, I, H, generator=gen).to(torch.bfloat16)
    up = torch.randn(E + B, I, H, generator=gen).to(torch.bfloat16)
    w2 = torch.randn(E + B, H, I, generator=gen).to(torch.bfloat16)
    rows = sum(lengths) + 16                     # rows past the last group: stale, must come out zero
    hidden = torch.randn(rows, H, generator=gen).to(torch.bfloat16)
    weights = torch.rand(rows, generator=gen)
    counts = torch.tensor(lengths, dtype=torch.int32)
    self = types.SimpleNamespace(_weight_layout=types.SimpleNamespace(full_up_weight=up))
    meta = types.SimpleNamespace(expert_num_tokens=counts)
    output = torch.full((rows, H), 7.0, dtype=torch.bfloat16)
    overlap.apply(self, output, hidden, w1, w2, weights, None, SILU, E, None, None, None, None, None, meta, False)
    overlap.TRACE.events = None
    cu = torch.cumsum(counts, 0, dtype=torch.int32)
    return output, _reference(hidden, w1, up, w2, cu, weights)


def test_own_groups_run_before_the_prefetch_wait_and_slots_after():
    log = []
    experts_module = types.SimpleNamespace(MoonEPExperts=type("MoonEPExperts", (), {"apply": lambda self: None}))
    assert overlap.patch_experts(experts_module) and not overlap.patch_experts(experts_module)
    overlap.arm(types.SimpleNamespace(_fused_experts=experts_module.MoonEPExperts()))
    overlap.TRACE.events = log
    assert overlap.prefetch(_Buffer(log), plan=None, async_finish=False, weights={}) is None
    output, expected = _run([16, 0, 32, 16, 16, 16], log)
    assert log == [("prefetch", True), "prefetch issued", "own", ("wait", None), "waited", "slots"]
    assert torch.equal(output[:96], expected[:96])  # same rows as vLLM's single grouped GEMM
    assert not output[96:].any()                    # rows past the last group: zero (vLLM's: stale)


def test_no_slot_rows_and_unarmed_steps_block():
    log = []
    overlap.arm(types.SimpleNamespace(_fused_experts=types.SimpleNamespace()))  # experts that are not ours
    overlap.TRACE.events = log
    overlap.prefetch(_Buffer(log), plan=None, async_finish=False, weights={})
    assert log == [("prefetch", False)]              # blocking: nobody would wait on an event
    output, expected = _run([16, 16, 0, 16, 0, 0], log)
    assert torch.equal(output[:48], expected[:48]) and not output[48:].any()
    assert log[1:] == ["own", "slots"]               # no pending event: nothing to wait for


def test_the_slot_fill_handoff_is_taken_once_and_stays_on_its_thread():
    """The hand-off from the prepare step's fill to the experts: armed per step, the event taken once, and a
    thread's event never seen by another thread (each forward thread has its own)."""
    import threading

    handoff, event = overlap.SLOT_FILL_HANDOFF, object()
    overlap.arm(types.SimpleNamespace(_fused_experts=type("Q", (), {overlap.WAITS_ATTR: True})()))
    assert overlap.deliver_slot_fill(event, async_finish=False) is None and handoff.armed is False  # disarmed
    seen_elsewhere = []
    other = threading.Thread(target=lambda: seen_elsewhere.append((handoff.armed, overlap.take_slot_fill())))
    other.start()
    other.join()
    assert seen_elsewhere == [(False, None)]
    assert overlap.take_slot_fill() is event and overlap.take_slot_fill() is None


def _config(max_num_seqs, spec=None):
    return types.SimpleNamespace(scheduler_config=types.SimpleNamespace(max_num_seqs=max_num_seqs),
                                 speculative_config=None if spec is None
                                 else types.SimpleNamespace(num_speculative_tokens=spec))


def test_a_decode_sized_step_runs_one_pass_after_the_wait_with_no_host_read():
    """A decode-sized step (the prepare step's ``one_pass``): the experts wait, then compute every group in one
    grouped GEMM, so no row index is read back (a ``_local_scalar_dense``/``tolist`` would show in the counted
    ops); the rows equal the split's and vLLM's, rows past the last group zero. Control: the same step
    unarmed splits, and the split reads."""
    lengths = [16, 0, 32, 16, 16, 16]
    results = {}
    for one_pass in (True, False):
        log = []
        experts_module = types.SimpleNamespace(MoonEPExperts=type("MoonEPExperts", (), {"apply": lambda s: None}))
        overlap.patch_experts(experts_module)
        overlap.arm(types.SimpleNamespace(_fused_experts=experts_module.MoonEPExperts()), one_pass=one_pass)
        overlap.TRACE.events = log
        overlap.prefetch(_Buffer(log), plan=None, async_finish=False, weights={})
        reads = _reads()
        with reads:
            output, expected = _run(lengths, log)
        results[one_pass] = (output, expected, log, reads.calls)
    output, expected, log, calls = results[True]
    assert log == [("prefetch", True), "prefetch issued", ("wait", None), "waited", "one pass"]
    assert calls == []
    # rows past the last group are not defined in one pass (MoonEP's combine reads dispatched rows only)
    assert torch.equal(output[:96], expected[:96])
    split, _, split_log, split_calls = results[False]
    assert split_log[-3:] == [("wait", None), "waited", "slots"] and split_calls == ["tolist"]   # the control
    assert torch.equal(output[:96], split[:96])
    assert overlap.SLOT_FILL_HANDOFF.one_pass is False   # taken by the layer that was armed


def test_decode_sized_steps_are_bounded_by_the_sequences_a_step_decodes():
    assert overlap.decode_token_bound(_config(256)) == 256
    assert overlap.decode_token_bound(_config(64, spec=3)) == 256      # MTP: 1 + 3 tokens per sequence
    assert overlap.decode_token_bound(None) is None and overlap.decode_token_bound(_config(None)) is None
    assert overlap.decode_sized(256, _config(256)) and not overlap.decode_sized(257, _config(256))
    assert not overlap.decode_sized(1, None)                              # no config: today's split


def test_on_a_gpu_each_part_is_bounded_on_the_device_written_in_place_and_nothing_is_read_back(monkeypatch):
    """The CUDA branch (``bf16_gpu.py``) with its launch helper a spy: own groups (``num_tokens_post_padded`` =
    the own part's end), the wait, then the slots (the own blocks ``-1``), or after the wait every group at once;
    each launch writes ``output`` itself, and neither order reads a value back (the CPU split reads one: the
    control in the test above). A SiLU layer without slots takes it too (vLLM's own code would run otherwise)."""
    from moonep_ep.vllm.experts import bf16_gpu, gpu

    calls = []

    def gpu_grouped_ffn(fmt, hidden, views, cu, route, *, token_padding, config, blocks, activation, out=None):
        calls.append((fmt, blocks.num_tokens_post_padded, blocks.expert_ids, out))   # read after the step
        return out

    monkeypatch.setattr(gpu, "gpu_grouped_ffn", gpu_grouped_ffn)
    monkeypatch.setattr(bf16_gpu, "runs_here", lambda t: True)
    lengths = [16, 0, 32, 16, 16, 16]                     # own rows end at 64, slots at 96; 16 stale rows
    counts, rows = torch.tensor(lengths, dtype=torch.int32), sum(lengths) + 16
    hidden, weights = torch.zeros(rows, H, dtype=torch.bfloat16), torch.ones(rows)
    w1, up, w2 = (torch.zeros(E + B, *s, dtype=torch.bfloat16) for s in ((I, H), (I, H), (H, I)))
    layout = types.SimpleNamespace(full_up_weight=up)
    moe = types.SimpleNamespace(num_local_experts=E, intermediate_size_per_partition=I)
    self = types.SimpleNamespace(_weight_layout=layout, moe_config=moe)
    bf16_gpu.gpu_experts(self, token_padding=16, interpreter=True)
    reads = _reads()
    logs = {}
    for one_pass in (False, True):
        calls.clear()
        log = overlap.TRACE.events = []
        overlap.SLOT_FILL_HANDOFF.one_pass = one_pass
        overlap.SLOT_FILL_HANDOFF.event = _Event(log)
        output = torch.empty(rows, H, dtype=torch.bfloat16)
        with reads:
            overlap.apply(self, output, hidden, w1, w2, weights, torch.zeros(4, 2), SILU, E, None, None, None, None,
                          None, types.SimpleNamespace(expert_num_tokens=counts), False)
        overlap.TRACE.events = None
        assert all(fmt == "bf16" and out is output for fmt, _, _, out in calls)
        logs[one_pass] = (log, [(c[1].tolist(), c[2].tolist()) for c in calls])
    every = [0, 2, 2, 3, 4, 5, -1]   # the 16-row blocks' weight rows, by hand; the stale block -1
    assert logs[False] == (["own", ("wait", None), "waited", "slots"],
                           [([64], every), ([96], [-1, -1, -1, -1, 4, 5, -1])])
    assert logs[True] == ([("wait", None), "waited", "one pass"], [([96], every)])
    assert reads.calls == []
    # no slots (E rows), SiLU: the GPU branch too, not the original
    calls.clear()
    overlap.apply(self, torch.empty(rows, H, dtype=torch.bfloat16), hidden, w1[:E], w2[:E], weights,
                  torch.zeros(4, 2), SILU, E, None, None, None, None, None,
                  types.SimpleNamespace(expert_num_tokens=counts[:E]), False,
                  original=lambda *a: calls.append("original"))
    assert [c[1].tolist() for c in calls] == [[64]]


def _reads():
    from torch.overrides import TorchFunctionMode

    class Reads(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_function__(self, func, types_, args=(), kwargs=None):
            if getattr(func, "__name__", "") in ("tolist", "item", "__int__", "__bool__", "__index__"):
                self.calls.append(func.__name__)
            return func(*args, **(kwargs or {}))

    return Reads()
