"""The MoonEP library synchronous under CUDA graph capture, its async mode refused there (issue 46).

The plugin's prefetch (``moonep_ep/vllm/experts/overlap.prefetch``) asks a Buffer for ``async_finish=True`` in an
armed step, so the own experts overlap the slot fill. The real MoonEP library's async mode runs on its comm stream
and calls ``record_stream``, which a capture cannot hold; the reference buffers fork and join with events only
(``async_capture_safe``). Under the capture-and-replay emulator (``moonep_ep.testing.cuda_capture``, which answers
``prefetch.stream_capturing()`` and refuses ``Tensor.record_stream``):

* a library-like Buffer (async mode with ``record_stream``) is driven synchronously even in an armed step, and the
  replays equal eager with new slot tables; control: its async mode under capture is refused at ``record_stream``;
* ``async_finish=True`` asked of it under capture is refused with the reason and the fix;
* a capture-safe Buffer keeps its asynchronous handoff under capture (the experts' wait joins it), replays equal
  eager; control: outside a capture the library-like Buffer gets the asynchronous call it is asked for.
"""

from __future__ import annotations

import pytest
import torch

from moonep_ep.ops.moonep import prefetch as slot_copies
from moonep_ep.ops.moonep.prefetch import pull_slots, wait_for_slots
from moonep_ep.testing.cuda_capture import CaptureRefused, CapturedGraph
from moonep_ep.vllm.experts import overlap

E, B, H = 4, 3, 8   # experts, slots, width
TABLES = ([0, 1, 2], [3, 0, 1], [2, 3, 3])
COMM_STREAM = object()   # the library's comm stream (a CPU build has no CUDA stream)


def _weights() -> torch.Tensor:
    """``[E + B, H, H]``: the experts' rows, then the slots (stale: NaN until a fill lands)."""
    full = torch.randn(E + B, H, H, generator=torch.Generator().manual_seed(7))
    full[E:] = float("nan")
    return full


class LibraryLike:
    """Stands in for the MoonEP library's Buffer: ``async_finish=True`` records its input on the comm stream (as the
    release's async mode does) and returns the fill's event; ``False`` waits in the calling stream."""

    def __init__(self) -> None:
        self.calls: list[bool] = []

    def prefetch_weight(self, plan=None, async_finish=False, **weights):
        self.calls.append(async_finish)
        full = weights["full_gate_weight"]
        fill = pull_slots({"w": full}, plan, E)
        if async_finish:
            full.record_stream(COMM_STREAM)   # the library's async mode
            return fill.event
        wait_for_slots(fill.event)
        return None


class CaptureSafe(LibraryLike):
    async_capture_safe = True

    def prefetch_weight(self, plan=None, async_finish=False, **weights):
        self.calls.append(async_finish)
        fill = pull_slots({"w": weights["full_gate_weight"]}, plan, E)
        if async_finish:
            return fill.event
        wait_for_slots(fill.event)
        return None


def _step(buffer, full, table, x, *, armed=True, async_finish=False):
    """The plugin's order: arm, prefetch (the fill's event handed to the experts), the experts' wait, the read."""
    overlap.SLOT_FILL_HANDOFF.armed = armed
    returned = overlap.prefetch(buffer, table, async_finish, {"full_gate_weight": full})
    wait_for_slots(overlap.take_slot_fill())
    wait_for_slots(returned)
    return torch.matmul(x.unsqueeze(1), full[E:]).squeeze(1)


def _eager(rows, x):
    full = _weights()
    full[E:] = full[torch.tensor(rows)]
    return torch.matmul(x.unsqueeze(1), full[E:]).squeeze(1)


def _replays_equal_eager(buffer) -> list[bool]:
    full, table, x = _weights(), torch.tensor([0, 1, 2]), torch.zeros(B, H)
    graph = CapturedGraph()
    with graph.capture():
        out = _step(buffer, full, table, x)
    equal = []
    for i, rows in enumerate(TABLES):
        new_x = torch.randn(B, H, generator=torch.Generator().manual_seed(20 + i))
        table.copy_(torch.tensor(rows))
        x.copy_(new_x)
        graph.replay()
        equal.append(bool(torch.equal(out, _eager(rows, new_x))))
    return equal


@pytest.fixture(autouse=True)
def _unarmed():
    yield
    overlap.SLOT_FILL_HANDOFF.armed = False
    overlap.take_slot_fill()


def test_the_emulator_says_a_capture_is_under_way_only_while_it_records():
    assert slot_copies.stream_capturing() is False
    with CapturedGraph().capture():
        seen = slot_copies.stream_capturing()
    assert seen is True and slot_copies.stream_capturing() is False


def test_a_library_buffer_runs_synchronously_under_capture_even_when_armed_and_replays_equal_eager():
    lib = LibraryLike()
    assert _replays_equal_eager(lib) == [True, True, True]
    assert lib.calls == [False]   # one call, at capture: synchronous although the step was armed


def test_the_library_async_mode_under_capture_is_refused_at_record_stream():
    """The control: the library's async mode itself, captured, is what the emulator refuses."""
    lib, table, full = LibraryLike(), torch.tensor([0, 1, 2]), _weights()
    with pytest.raises(CaptureRefused) as err:
        with CapturedGraph().capture():
            lib.prefetch_weight(table, True, full_gate_weight=full)
    assert err.value.kind == "record_stream"
    assert err.value.site.startswith("tests/vllm/test_capture_sync_mode.py:")


def test_async_finish_asked_under_capture_is_refused_with_the_reason_and_the_fix():
    lib, table, full, x = LibraryLike(), torch.tensor([0, 1, 2]), _weights(), torch.zeros(B, H)
    with pytest.raises(RuntimeError) as err:
        with CapturedGraph().capture():
            _step(lib, full, table, x, armed=False, async_finish=True)
    message = str(err.value)
    assert "prefetch_weight(async_finish=True) asked of LibraryLike during a CUDA graph capture" in message
    assert "record_stream" in message and "Fix: pass async_finish=False while capturing" in message
    assert lib.calls == []   # refused before the library was called


def test_a_capture_safe_buffer_keeps_its_async_handoff_under_capture():
    safe = CaptureSafe()
    assert _replays_equal_eager(safe) == [True, True, True]
    assert safe.calls == [True]   # the armed step's asynchronous fill, joined by the experts' wait


def test_outside_a_capture_the_library_gets_the_asynchronous_call_of_an_armed_step():
    """The control of the first test: the synchronous call under capture is the capture's doing."""
    lib = LibraryLike()
    full, table = _weights(), torch.tensor([0, 1, 2])
    overlap.SLOT_FILL_HANDOFF.armed = True
    try:
        overlap.prefetch(lib, table, False, {"full_gate_weight": full})
    except RuntimeError as err:   # record_stream itself: a build with no CUDA stream to record on
        assert "unknown parameter type" in str(err)
    assert lib.calls == [True]
