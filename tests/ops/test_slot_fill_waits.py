"""Slot fills land only where they are waited for, on CPU as on a GPU (issue 36), and the event audit.

How CUDA orders it, which the CPU emulation follows: each slot copy is a ``cudaMemcpyAsync`` issued on a
side stream (``ops/moonep/prefetch.py`` ``_run_copies``), then ``cudaEventRecord`` on that stream; a kernel on
another stream may read the slot only after ``cudaStreamWaitEvent(reader, event)`` — PyTorch's
``torch.cuda.Event.wait(stream)`` / ``Stream.wait_event``, DeepEP's ``EventOverlap.current_stream_wait()``
(``EventHandle::current_stream_wait``: ``getCurrentCUDAStream().wait(event)``). Until then the copy may
not have run: the reader sees the slot's previous bytes. With ``MOONEP_EP_CPU_DEFERRED_COPIES`` (default
on) CPU copies land only at such a wait (or at teardown), in issue order, reading their source then.

The audit (:data:`INVENTORY`): every place in ``src/moonep_ep`` that makes, returns or stores an event,
found by reading the source's syntax tree, and who waits on it; a new producer fails
:func:`test_every_event_producer_in_the_library_is_listed_with_its_consumer` until it is listed.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import sys
from typing import Any

import pytest
import torch

from moonep_ep.ops.moonep.prefetch import DoneEvent, PendingCopies, SideStreams, land_all, pull_slots, wait_for_slots

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "moonep_ep"
TESTS = pathlib.Path(__file__).resolve().parents[1]
E, B = 4, 3
POISON = float("nan")


def _full() -> torch.Tensor:
    """``[E+B, 2, 8]``: expert ``e``'s row holds ``e + 1`` everywhere, the slots hold NaN (the settle's poison)."""
    full = torch.full((E + B, 2, 8), POISON)
    for e in range(E):
        full[e] = e + 1
    return full


def _slot_values(full: torch.Tensor) -> list[Any]:
    """Each slot's single value (``nan`` when poisoned); raises if a slot is not uniform."""
    out = []
    for b in range(B):
        row = full[E + b]
        assert bool((row == row.flatten()[0]).all()) or bool(row.isnan().all()), row
        out.append("nan" if bool(row.isnan().all()) else float(row.flatten()[0]))
    return out


# -- the CPU emulation of a side stream ---------------------------------------------------------------

def test_a_cpu_fill_lands_only_when_its_event_is_waited_on():
    full = _full()
    copies, by_expert, event = pull_slots({"w": full}, [2, -1, 0], E)
    assert (copies, by_expert) == (2, {2: 64, 0: 64})  # 16 fp32 values a row, counted at issue
    assert isinstance(event, PendingCopies) and not event.query()
    assert _slot_values(full) == ["nan", "nan", "nan"]  # a reader that did not wait: the poison
    wait_for_slots(event)
    assert event.query()
    assert _slot_values(full) == [3.0, "nan", 1.0]      # slot 1 (-1) is never written


def test_copies_land_in_issue_order_and_read_their_source_when_they_land():
    streams = SideStreams()
    full = _full()
    _, _, first = pull_slots({"w": full}, [1, -1, -1], E, streams=streams)   # slot 0 <- expert 1
    _, _, second = pull_slots({"w": full}, [2, 3, -1], E, streams=streams)   # slot 0 <- expert 2, slot 1 <- 3
    full[2] = 20.0  # the owner rewrites expert 2 after the fill was issued: the copy reads it when it lands
    first.wait()
    assert _slot_values(full) == [2.0, "nan", "nan"] and not second.query()
    second.synchronize()
    assert _slot_values(full) == [20.0, 4.0, "nan"]
    # A later event lands everything queued before it, in issue order (the last write to slot 0 wins).
    full2 = _full()
    _, _, a = pull_slots({"w": full2}, [1, -1, -1], E, streams=streams)
    _, _, b = pull_slots({"w": full2}, [3, -1, -1], E, streams=streams)
    wait_for_slots(b)
    assert a.query() and _slot_values(full2) == [4.0, "nan", "nan"]


def test_teardown_lands_what_is_queued():
    streams = SideStreams()
    full = _full()
    _, _, event = pull_slots({"w": full}, [0, 1, 2], E, streams=streams)
    assert _slot_values(full) == ["nan"] * 3
    streams.close()
    assert event.query() and _slot_values(full) == [1.0, 2.0, 3.0]
    full = _full()
    _, _, event = pull_slots({"w": full}, [3, -1, -1], E)  # the module's default streams
    land_all()
    assert event.query() and _slot_values(full) == [4.0, "nan", "nan"]


def test_the_switch_off_copies_at_issue(monkeypatch):
    monkeypatch.setenv("MOONEP_EP_CPU_DEFERRED_COPIES", "0")
    full = _full()
    _, _, event = pull_slots({"w": full}, [3, 2, 1], E)
    assert isinstance(event, DoneEvent) and event.query()
    assert _slot_values(full) == [4.0, 3.0, 2.0]


def test_wait_for_slots_waits_on_every_kind_of_event_and_refuses_others():
    log = []

    class Handle:  # MoonEP / DeepEP style
        def current_stream_wait(self) -> None:
            log.append("current_stream_wait")

        def wait(self) -> None:  # must not be used when current_stream_wait exists
            log.append("wrong")

    class Waitable:
        def wait(self) -> None:
            log.append("wait")

    wait_for_slots(None)
    wait_for_slots((Handle(), None, [Waitable(), (Waitable(),)]))
    assert log == ["current_stream_wait", "wait", "wait"]
    with pytest.raises(TypeError, match="cannot wait for slot fills on a int.*Fix: pass the event"):
        wait_for_slots(3)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_fill_is_waited_by_the_current_stream():
    full = _full().cuda()
    _, _, event = pull_slots({"w": full}, [2, -1, 0], E)
    assert isinstance(event, torch.cuda.Event)
    wait_for_slots(event)  # the current stream waits; the read below is queued after the copies
    assert _slot_values(full.cpu()) == [3.0, "nan", 1.0]


# -- the reference buffer's consumers, on two ranks over the host driver --------------------------------

def buffer_consumers_rank(ctx: Any) -> dict[str, Any]:
    import torch.distributed as dist

    from moonep_ep.ops.moonep import pull as buffer_module
    from moonep_ep.ops.moonep.pull import ReferenceBuffer
    from tests.ops.test_ops import PROJ, SENTINEL, _skewed_plan, build_store, expert_weight
    from tests.support.memory import GRAN
    from moonep_ep.ops.moonep.push import push_prefetch

    Eb, H, I, K, seed = 8, 128, 128, 2, 3
    shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    store = build_store(ctx, H, I, Eb, 2, GRAN, seed)
    views = {(layer, p): store.pull_view(layer, p) for layer in range(2) for p in PROJ}
    buf = ReferenceBuffer(64, H, K, Eb, ctx.world_size, explicitly_destroy=True)
    hidden_nvsh, w_nvs, cu, plan = _skewed_plan(buf, ctx, Eb, K, H, 64, seed)
    slots = plan.slot_sources
    out: dict[str, Any] = {"slots": [list(s) for s in slots]}

    def sentinel(layer: int) -> None:
        for p in PROJ:
            views[(layer, p)][Eb:].fill_(SENTINEL)
        store.finish_loading()  # every rank's slots reset before anyone fills

    def filled(layer: int) -> bool:  # the experts regenerated from the seed, not read from the store
        return all(torch.equal(views[(layer, p)][Eb + b], expert_weight(seed, layer, p, e, shapes[p]))
                   for b, e, _ in slots for p in PROJ)

    def stale(layer: int) -> bool:
        return all(bool((views[(layer, p)][Eb + b] == SENTINEL).all()) for b, _, _ in slots for p in PROJ)

    full = {f"full_{p}_weight": views[(0, p)] for p in PROJ}
    sentinel(0)
    out["blocking_filled"] = buf.prefetch_weight(plan, **full) is None and filled(0)
    sentinel(0)
    saved = buffer_module.wait_for_slots
    buffer_module.wait_for_slots = lambda event: None  # the control: the buffer's own wait removed
    try:
        buf.prefetch_weight(plan, **full)
        out["blocking_without_its_wait_stale"] = stale(0)
    finally:
        buffer_module.wait_for_slots = saved
    buf._streams.close()
    out["control_landed_at_close"] = filled(0)
    sentinel(0)
    event = buf.prefetch_weight(plan, async_finish=True, **full)
    out["async_before_wait"] = {"stale": stale(0), "query": event.query(), "seconds": buf.last_prefetch.seconds}
    wait_for_slots(event)
    out["async_after_wait"] = {"filled": filled(0), "query": event.query()}
    # The push: every owner's pushes land before the barrier, so this rank's slots (pushed by rank 0) are final.
    push = dict(local_gate_weight=store.owner_view(1, "gate"), local_up_weight=store.owner_view(1, "up"),
                local_down_weight=store.owner_view(1, "down"), gate_prefetch_buffer=store.push_pool(1, "gate"),
                up_prefetch_buffer=store.push_pool(1, "up"), down_prefetch_buffer=store.push_pool(1, "down"))
    sentinel(1)
    push_prefetch(buf, plan, **push)
    out["push_filled"] = filled(1)
    sentinel(1)
    wait = PendingCopies.wait
    PendingCopies.wait = lambda self, stream=None: None  # the control: pushes not waited for before the barrier
    try:
        push_prefetch(buf, plan, **push)
        out["push_without_its_wait_stale"] = stale(1)
    finally:
        PendingCopies.wait = wait
    dist.barrier()  # every rank has read its slots before the owners' queued pushes land
    buf._streams.close()
    dist.barrier()
    out["push_control_landed_at_close"] = filled(1)
    # dispatch / combine with async_finish: gloo collectives, complete on return on CPU
    x = hidden_nvsh[:4].clone()
    ids = torch.zeros(4, K, dtype=torch.int32)
    ids[:, 1] = 1
    tpe = torch.bincount(ids.reshape(-1).long(), minlength=Eb).to(torch.int32)
    *_, plan2, dispatched = buf.dispatch(x, torch.full((4, K), 0.5), ids, tpe, async_finish=True)
    hidden2 = buf.hidden_nvsh_buffer_view.clone()
    *_, combined = buf.combine(plan2, hidden2, async_finish=True)
    out["dispatch_combine_events"] = [type(dispatched).__name__, dispatched.query(), type(combined).__name__,
                                      combined.query()]
    wait_for_slots((dispatched, combined))
    # teardown lands a fill nobody waited for
    sentinel(0)
    pending = buf.prefetch_weight(plan, async_finish=True, **full)
    out["pending_before_destroy"] = stale(0) and not pending.query()
    buf.destroy()
    out["destroy_landed"] = filled(0) and pending.query()
    del views, full, push, hidden_nvsh, w_nvs, cu
    store.close()
    return out


@pytest.mark.slow
def test_the_reference_buffer_waits_for_its_fills_and_hands_out_waitable_events():
    from moonep_ep.launch import run_ranks

    results = run_ranks(buffer_consumers_rank, 2, timeout_s=180)
    assert any(r["slots"] for r in results), "the plan filled no slot: every check below would be vacuous"
    for r in results:
        assert r["dispatch_combine_events"] == ["DoneEvent", True, "DoneEvent", True], r
        if not r["slots"]:  # a rank without slots: nothing to read stale
            continue
        assert r["blocking_filled"] and r["control_landed_at_close"], r
        assert r["blocking_without_its_wait_stale"], r  # the control: without the buffer's wait, stale slots
        assert r["async_before_wait"] == {"stale": True, "query": False, "seconds": None}, r
        assert r["async_after_wait"] == {"filled": True, "query": True}, r
        assert r["push_filled"] and r["push_control_landed_at_close"], r
        assert r["push_without_its_wait_stale"], r  # the control: the owner's pushes not waited for
        assert r["pending_before_destroy"] and r["destroy_landed"], r


# -- the audit: every event producer in the library and its consumer -------------------------------------

#: callees that make or pass on an event; ``cuda.Event`` is ``torch.cuda.Event(...)``; ``.event =`` stores one
PRODUCER_CALLS = {"DoneEvent", "PendingCopies", "_event", "_run_copies", "pull_slots", "push_slots",
                  "prefetch_weight", "prefetch_quantized", "deliver_slot_fill", "take_slot_fill", "issue", "cuda.Event"}
OPS_TEST = "tests/ops/test_slot_fill_waits.py"
VLLM_TEST = "tests/vllm/test_slot_fill_waits.py"
TIMING = "timing event: the host synchronizes the end event before reading elapsed_time"

#: ``(file, function, call)`` -> ``(who waits, (file, function) that waits and the call it waits with, checks)``.
#: The waiter is checked in the syntax tree; every named check must exist. The library only: the GPU checks
#: beside it (``checks/gpu/mxfp4.py``: a fill waited for, and the race that skips the wait on purpose) are
#: tooling, as ``tests/support`` is.
INVENTORY: dict[tuple[str, str, str], tuple[str, tuple[str, str, str], tuple[str, ...]]] = {
    ("ops/moonep/prefetch.py", "_run_copies", "cuda.Event"): (
        "CUDA copy stream's event (cudaEventRecord after the copy kernels), returned by pull_slots/push_slots",
        ("ops/moonep/prefetch.py", "wait_for_slots", "wait_event"),
        (f"{OPS_TEST}::test_a_cuda_fill_is_waited_by_the_current_stream",)),
    ("ops/moonep/prefetch.py", "_run_copies", "issue"): (
        "CPU deferred copies: a PendingCopies event, landed by its wait",
        ("ops/moonep/prefetch.py", "PendingCopies.wait", "land_through"),
        (f"{OPS_TEST}::test_a_cpu_fill_lands_only_when_its_event_is_waited_on",
         f"{OPS_TEST}::test_copies_land_in_issue_order_and_read_their_source_when_they_land")),
    ("testing/cuda_capture.py", "_Issue.replay", "issue"): (
        "the graph emulator's replay issues a captured fill again on the CPU side stream; the recorded wait lands it "
        "at the same place in the step",
        ("testing/cuda_capture.py", "_Land.replay", "land_through"),
        ("tests/ops/test_cuda_capture.py::test_a_read_before_the_fill_wait_disagrees_under_replay",
         "tests/ops/test_cuda_capture.py::test_slot_fills_replay_with_new_tables_equal_to_eager")),
    ("ops/moonep/prefetch.py", "_HostCopyQueue.issue", "PendingCopies"): (
        "the CPU side stream's event; teardown lands the queue",
        ("ops/moonep/prefetch.py", "SideStreams.close", "land_through"),
        (f"{OPS_TEST}::test_teardown_lands_what_is_queued",)),
    ("ops/moonep/prefetch.py", "_run_copies", "DoneEvent"): (
        "copies made at issue (switch off): complete", ("ops/moonep/prefetch.py", "_run_copies", "copy_"),
        (f"{OPS_TEST}::test_the_switch_off_copies_at_issue",)),
    ("ops/moonep/prefetch.py", "pull_slots", "_run_copies"): (
        "returned to the caller (buffer, quantized prefetch, tools)", ("ops/moonep/prefetch.py", "pull_slots", "_run_copies"),
        (f"{OPS_TEST}::test_a_cpu_fill_lands_only_when_its_event_is_waited_on",)),
    ("ops/moonep/prefetch.py", "push_slots", "_run_copies"): (
        "returned to the buffer's push step, whose current stream waits on it before its barrier",
        ("ops/moonep/push_step.py", "run_push", "wait_for_slots"),
        (f"{OPS_TEST}::test_the_reference_buffer_waits_for_its_fills_and_hands_out_waitable_events",)),
    ("ops/moonep/pull.py", "ReferenceBuffer.prefetch_weight", "pull_slots"): (
        "blocking: the buffer waits (wait_for_slots); async_finish: returned to the caller, who waits",
        ("ops/moonep/pull.py", "ReferenceBuffer.prefetch_weight", "wait_for_slots"),
        (f"{OPS_TEST}::test_the_reference_buffer_waits_for_its_fills_and_hands_out_waitable_events",)),
    ("ops/moonep/push_step.py", "run_push", "push_slots"): (
        "the current stream waits on the pushes (weights and scales; CPU: they land), then the device barrier "
        "releases the readers",
        ("ops/moonep/push_step.py", "run_push", "wait_for_slots"),
        (f"{OPS_TEST}::test_the_reference_buffer_waits_for_its_fills_and_hands_out_waitable_events",)),
    ("ops/moonep/base.py", "ReferenceBufferBase._event", "cuda.Event"): (
        "async_finish of dispatch/combine/the push: recorded on the current stream after the work; returned to the "
        "Buffer API's caller (vLLM 0.33.0 never asks), who waits with wait_for_slots",
        ("ops/moonep/prefetch.py", "wait_for_slots", "wait_event"), (),),
    ("ops/moonep/base.py", "ReferenceBufferBase._event", "DoneEvent"): (
        "CPU dispatch/combine/push: complete on return (gloo collectives, pushes synchronized)",
        ("ops/moonep/prefetch.py", "wait_for_slots", "wait"),
        (f"{OPS_TEST}::test_the_reference_buffer_waits_for_its_fills_and_hands_out_waitable_events",)),
    ("ops/moonep/base.py", "ReferenceBufferBase._dispatch_outputs", "_event"): (
        "returned to the caller with async_finish", ("ops/moonep/prefetch.py", "wait_for_slots", "wait"),
        (f"{OPS_TEST}::test_the_reference_buffer_waits_for_its_fills_and_hands_out_waitable_events",)),
    ("ops/moonep/base.py", "ReferenceBufferBase.combine", "_event"): (
        "returned to the caller with async_finish", ("ops/moonep/prefetch.py", "wait_for_slots", "wait"),
        (f"{OPS_TEST}::test_the_reference_buffer_waits_for_its_fills_and_hands_out_waitable_events",)),
    ("ops/moonep/push.py", "PushReferenceBuffer.prefetch_weight", "_event"): (
        "push with async_finish: recorded after run_push's wait on the pushes and its barrier (complete on CPU)",
        ("ops/moonep/push_step.py", "run_push", "wait_for_slots"), ()),
    ("vllm/prepare_finalize/push.py", "PushPrefetch.prefetch_weight", "prefetch_weight"): (
        "the plugin's SlotFillBuffer: overlap.prefetch hands the push's event to the experts' apply",
        ("vllm/experts/overlap.py", "prefetch", "deliver_slot_fill"),
        ("tests/vllm/test_push_path.py::test_push_path_equals_pull_and_dense_with_remote_fills",)),
    ("vllm/experts/overlap.py", "prefetch", "prefetch_weight"): (
        "armed: the buffer's async event to deliver; else the buffer's blocking call (it waits)",
        ("vllm/experts/overlap.py", "prefetch", "deliver_slot_fill"), (f"{VLLM_TEST}::test_overlap_apply_waits_before_the_slot_groups",)),
    ("vllm/experts/overlap.py", "prefetch", "deliver_slot_fill"): (
        "stored for the experts' apply", ("vllm/experts/overlap.py", "deliver_slot_fill", "wait_for_slots"),
        (f"{VLLM_TEST}::test_deliver_hands_the_event_to_the_caller_the_experts_or_the_current_stream",)),
    ("vllm/experts/overlap.py", "SlotFillHandoff.put", "stores .event"): (
        "put by deliver_slot_fill in an armed step; taken by the experts' apply (overlap.apply, "
        "_QuantizedExperts.apply, through take_slot_fill), which waits",
        ("vllm/experts/overlap.py", "apply", "wait_for_slots"),
        (f"{VLLM_TEST}::test_overlap_apply_waits_before_the_slot_groups",)),
    ("vllm/experts/overlap.py", "SlotFillHandoff.take", "stores .event"): (
        "clears the stored event as it hands it over", ("vllm/experts/overlap.py", "apply", "wait_for_slots"),
        (f"{VLLM_TEST}::test_deliver_hands_the_event_to_the_caller_the_experts_or_the_current_stream",)),
    ("vllm/experts/overlap.py", "apply", "take_slot_fill"): (
        "BF16 experts: own groups, wait_for_slots, then the slot groups",
        ("vllm/experts/overlap.py", "apply", "wait_for_slots"),
        (f"{VLLM_TEST}::test_overlap_apply_waits_before_the_slot_groups",
         f"{VLLM_TEST}::test_kernel_tier_fails_the_oracle_without_the_wait_and_passes_with_it")),
    ("vllm/quantized/engine.py", "prefetch_quantized", "pull_slots"): (
        "weights' and scales' events returned together ('event')",
        ("vllm/manager.py", "SlotFillBuffer.prefetch_weight", "deliver_slot_fill"),
        (f"{VLLM_TEST}::test_kernel_tier_fails_the_oracle_without_the_wait_and_passes_with_it",)),
    ("vllm/manager.py", "SlotFillBuffer.prefetch_weight", "prefetch_quantized"): (
        "its events delivered to the quantized experts", ("vllm/manager.py", "SlotFillBuffer.prefetch_weight",
                                                           "deliver_slot_fill"),
        (f"{VLLM_TEST}::test_kernel_tier_fails_the_oracle_without_the_wait_and_passes_with_it",)),
    ("vllm/manager.py", "SlotFillBuffer.prefetch_weight", "deliver_slot_fill"): (
        "the experts' apply, or the caller with async_finish, or the current stream now",
        ("vllm/experts/overlap.py", "deliver_slot_fill", "wait_for_slots"),
        (f"{VLLM_TEST}::test_kernel_tier_fails_the_oracle_without_the_wait_and_passes_with_it",)),
    ("vllm/quantized/engine.py", "_build_experts_class._QuantizedExperts.apply", "take_slot_fill"): (
        "quantized experts (dequant and Triton): handed to own_then_slots, which computes the own groups, then "
        "waits (wait_for_slots) before any slot row is read; a decode-sized step waits first, then one pass",
        ("vllm/quantized/engine.py", "own_then_slots", "wait_for_slots"),
        (f"{VLLM_TEST}::test_kernel_tier_fails_the_oracle_without_the_wait_and_passes_with_it",
         "tests/vllm/test_quantized_own_first.py::test_own_groups_first_then_the_wait_then_the_slots_with_one_pass_bits",
         "tests/vllm/test_quantized_own_first.py::test_control_waiting_as_the_event_is_taken_fails_the_order_check")),
    ("tools/commands/demo.py", "demo_rank", "prefetch_weight"): (
        "blocking call: the buffer waits before returning", ("ops/moonep/pull.py", "ReferenceBuffer.prefetch_weight",
                                                            "wait_for_slots"),
        (f"{OPS_TEST}::test_the_reference_buffer_waits_for_its_fills_and_hands_out_waitable_events",)),
    ("tools/bench/decode.py", "measure_copy", "cuda.Event"): (TIMING, ("tools/bench/decode.py", "measure_copy",
                                                                        "synchronize"), ()),
    ("tools/bench/prefetch.py", "_time_copies", "cuda.Event"): (TIMING, ("tools/bench/prefetch.py", "_time_copies",
                                                                          "synchronize"), ()),
    ("tools/bench/timing.py", "timer_for.cuda_seconds", "cuda.Event"): (TIMING, ("tools/bench/timing.py",
                                                                                   "timer_for.cuda_seconds",
                                                                                   "synchronize"), ()),
}


def _callee(node: ast.Call) -> str | None:
    f = node.func
    if isinstance(f, ast.Name):
        return f.id
    if isinstance(f, ast.Attribute):
        if f.attr == "Event":
            return "cuda.Event" if isinstance(f.value, ast.Attribute) and f.value.attr == "cuda" else None
        return f.attr
    return None


def _functions() -> dict[tuple[str, str], ast.AST]:
    return _functions_under(SRC)


@functools.lru_cache(maxsize=2)
def _functions_under(src: pathlib.Path) -> dict[tuple[str, str], ast.AST]:
    """``(file, qualified function) -> node`` of every function and method under ``src`` (parsed once)."""
    out: dict[tuple[str, str], ast.AST] = {}
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src).as_posix()

        def visit(node: ast.AST, qual: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = f"{qual}.{child.name}" if qual else child.name
                    if not isinstance(child, ast.ClassDef):
                        out[(rel, name)] = child
                    visit(child, name)
                else:
                    visit(child, qual)

        visit(ast.parse(path.read_text()), "")
    return out


def _own_nodes(fn: ast.AST) -> list[ast.AST]:
    """The nodes of ``fn`` outside its nested functions and classes."""
    nodes, todo = [], list(ast.iter_child_nodes(fn))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        nodes.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return nodes


def event_producers() -> set[tuple[str, str, str]]:
    sites = set()
    for (rel, qual), fn in _functions().items():
        for node in _own_nodes(fn):
            if isinstance(node, ast.Call) and _callee(node) in PRODUCER_CALLS:
                sites.add((rel, qual, _callee(node)))
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, ast.AnnAssign) else []
            if any(isinstance(t, ast.Attribute) and t.attr == "event" for t in targets):
                sites.add((rel, qual, "stores .event"))
    return sites


def missing_waits(inventory: dict) -> list[str]:
    """Every listed consumer that does not exist or does not make the call it waits with, and every named
    check that does not exist."""
    functions, problems = _functions(), []
    for site, (consumer, (rel, qual, call), checks) in sorted(inventory.items()):
        if (rel, qual) not in functions:
            problems.append(f"{site}: its consumer {rel}:{qual} does not exist")
            continue
        if call not in {_callee(n) for n in _own_nodes(functions[(rel, qual)]) if isinstance(n, ast.Call)}:
            problems.append(f"{site}: {rel}:{qual} does not call {call} ({consumer})")
        for check in checks:
            path, name = check.split("::")
            if f"def {name}(" not in (TESTS.parent / path).read_text():
                problems.append(f"{site}: no check {check}")
    return problems


def test_every_event_producer_in_the_library_is_listed_with_its_consumer(report):
    found = event_producers()
    assert found - set(INVENTORY) == set(), (
        "a new event producer: list it in INVENTORY with the consumer that waits on it and a check that shows it")
    assert set(INVENTORY) - found == set(), "INVENTORY lists producers the library no longer has: remove them"
    assert missing_waits(INVENTORY) == []
    report(f"[event audit] {len(found)} producer sites in src/moonep_ep, each with its consumer:")
    for (rel, qual, call), (consumer, waiter, _) in sorted(INVENTORY.items()):
        report(f"  {rel}:{qual} ({call}) -> {consumer} [waits: {waiter[0]}:{waiter[1]} {waiter[2]}]")


def test_the_audit_sees_a_new_producer_and_a_consumer_that_does_not_wait(tmp_path, monkeypatch):
    """Negative controls of the audit: an unlisted producer is found; a listed consumer that lost its wait,
    a missing consumer and a missing check are named."""
    pkg = tmp_path / "moonep_ep"
    (pkg / "ops").mkdir(parents=True)
    (pkg / "ops" / "new.py").write_text("import torch\n\ndef fill():\n    e = torch.cuda.Event()\n    return e\n\n"
                                        "def read(event):\n    event.query()\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", pkg)
    assert event_producers() == {("ops/new.py", "fill", "cuda.Event")}
    planted = {("ops/new.py", "fill", "cuda.Event"): ("read waits", ("ops/new.py", "read", "wait_for_slots"), ()),
               ("ops/new.py", "gone", "x"): ("?", ("ops/new.py", "gone", "wait"), ()),
               ("ops/new.py", "read", "y"): ("?", ("ops/new.py", "read", "query"), (f"{OPS_TEST}::no_such_test",))}
    assert missing_waits(planted) == [
        "('ops/new.py', 'fill', 'cuda.Event'): ops/new.py:read does not call wait_for_slots (read waits)",
        "('ops/new.py', 'gone', 'x'): its consumer ops/new.py:gone does not exist",
        f"('ops/new.py', 'read', 'y'): no check {OPS_TEST}::no_such_test"]
