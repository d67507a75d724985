"""The capture-and-replay emulator (``src/moonep_ep/testing/cuda_capture.py``, issue 46): replays equal eager bit for bit,
and each thing a CUDA graph bakes in shows, as a refusal at the call or a replay that disagrees with eager.

Controls: a planted ``.item()`` / ``int(t)`` is refused naming the op and this file's line; a per-call output
kept by the caller disagrees under replay (and its fix, a clone, agrees); a slot read before its fill's wait
disagrees under replay (and with the replay made lenient, landing at issue, it would agree: the deferred
landing is what catches it); a fill never waited on is refused at the end (the side stream not joined).
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist

from moonep_ep.ops.moonep.prefetch import PendingCopies, pull_slots, wait_for_slots
from moonep_ep.testing import cuda_capture
from moonep_ep.testing.cuda_capture import CaptureRefused, CapturedGraph, capture
from moonep_ep.testing.host_syncs import count_host_syncs, mark_host

T, H, F, E, K, CAP = 6, 8, 16, 4, 2, 2   # tokens, hidden, inter, experts, top-k, rows per expert kept
B = 3                                       # slots


def _routing(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    ids = torch.randint(0, E, (T, K), generator=g)
    weights = torch.rand(T, K, generator=g)
    return x, ids, weights


def moe_step(x, ids, weights, w_up, w_down):
    """A MoE-like step with no host read: rows grouped by expert, a cumsum offset table, capacity by position."""
    dev = x.device
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.int64, device=dev).index_add_(0, flat, torch.ones_like(flat))
    offsets = torch.cumsum(counts, 0) - counts                       # first row of each expert
    expert = flat.index_select(0, order)
    position = torch.arange(flat.numel(), device=dev) - offsets.index_select(0, expert)
    rows = x.index_select(0, order // K)
    h = torch.matmul(rows.unsqueeze(1), w_up.index_select(0, expert)).squeeze(1)
    h = torch.where(h > 0, h, 0.1 * h)
    y = torch.matmul(h.unsqueeze(1), w_down.index_select(0, expert)).squeeze(1)
    y = torch.where((position < CAP).unsqueeze(1), y, torch.zeros_like(y))
    y = y * weights.reshape(-1).index_select(0, order).unsqueeze(1)
    return torch.zeros_like(x).index_add_(0, order // K, y)


def test_a_moe_step_replays_equal_to_eager_bit_for_bit_with_three_inputs():
    g = torch.Generator().manual_seed(0)
    w_up, w_down = torch.randn(E, H, F, generator=g), torch.randn(E, F, H, generator=g)
    static = [t.clone() for t in _routing(100)]
    graph, out = capture(moe_step, *static, w_up, w_down)
    assert out.isnan().all()          # capture ran nothing: the pool holds garbage until a replay
    names = graph.op_names()
    for op in ("index_select", "bmm", "index_add_", "cumsum", "where", "sort"):
        assert any(op in n for n in names), (op, names)
    for seed in (1, 2, 3):
        inputs = _routing(seed)
        for s, t in zip(static, inputs):
            s.copy_(t)
        graph.replay()
        eager = moe_step(*inputs, w_up, w_down)
        assert torch.equal(out, eager), seed
    assert graph.replays == 3
    # the control: another routing gives another result, so the equalities above are not vacuous
    assert not torch.equal(out, moe_step(*_routing(1), w_up, w_down))


# -- control 1: a host read is refused at the call ----------------------------------------------------------

def _with_item(x):
    scale = x.abs().max().item()          # planted
    return x / scale


def _with_int(x, ids):
    n = int(ids.max())                    # planted
    return x[:n]


def test_a_planted_item_is_refused_naming_the_op_and_the_file_and_line():
    line = inspect.getsourcelines(_with_item)[1] + 1
    with pytest.raises(CaptureRefused) as err:
        capture(_with_item, torch.randn(4))
    assert err.value.kind == "item"
    assert err.value.site == f"tests/ops/test_cuda_capture.py:{line} _with_item", err.value.site
    assert "item at tests/ops/test_cuda_capture.py" in str(err.value)
    line = inspect.getsourcelines(_with_int)[1] + 1
    with pytest.raises(CaptureRefused) as err:
        capture(_with_int, torch.randn(4), torch.tensor([1, 2], device=torch.device("cpu")))
    assert (err.value.kind, err.value.site) == ("int", f"tests/ops/test_cuda_capture.py:{line} _with_int")
    # the control: the same division with the scale kept on the device captures and replays
    graph, out = capture(lambda x: x / x.abs().max(), static := torch.randn(4))
    static.copy_(torch.tensor([1.0, -4.0, 2.0, 0.5]))
    graph.replay()
    assert torch.equal(out, torch.tensor([0.25, -1.0, 0.5, 0.125]))


@pytest.mark.parametrize("planted, kind", [
    (lambda x: x.nonzero(), "nonzero"),
    (lambda x: torch.bincount(x.long().abs()), "bincount"),
    (lambda x: x.tolist(), "tolist"),
    (lambda x: x.cpu(), "cpu"),
    (lambda x: torch.cuda.synchronize(), "synchronize"),   # refused before it would fail on a CPU build
])
def test_data_dependent_shapes_copies_to_the_host_and_a_device_synchronize_are_refused(planted, kind):
    with pytest.raises(CaptureRefused) as err:
        capture(planted, torch.tensor([0.0, 2.0, 3.0]))
    assert err.value.kind == kind and err.value.site.startswith("tests/ops/test_cuda_capture.py:")


def test_a_side_stream_synchronize_an_event_query_and_a_nested_capture_are_refused():
    full = torch.zeros(E + B, 2, 2)

    def synchronizing(table):
        fill = pull_slots({"w": full}, table, E)
        assert isinstance(fill.event, PendingCopies)
        fill.event.synchronize()
        return full[E:] * 1

    with pytest.raises(CaptureRefused) as err:
        capture(synchronizing, torch.tensor([0, 1, 2], device=torch.device("cpu")))
    assert err.value.kind == "event_synchronize"
    with pytest.raises(CaptureRefused) as err:
        capture(lambda table: pull_slots({"w": full}, table, E).event.query(),
                torch.tensor([0, 1, 2], device=torch.device("cpu")))
    assert err.value.kind == "event_query"
    with pytest.raises(CaptureRefused) as err:
        with CapturedGraph().capture():
            capture(lambda x: x + 1, torch.zeros(2))
    assert err.value.kind == "a nested capture"


# -- control 2: an output allocated per call, kept by the caller ----------------------------------------------

def _residual(x):
    return x * 2 + 1                      # a fresh tensor every eager call


def test_a_per_call_output_the_caller_keeps_disagrees_under_replay_and_its_clone_agrees():
    """Eager: each call returns a new tensor, so step 1's output survives step 2. Under a graph the output is
    the pool's one storage: step 2's replay overwrites what the caller kept from step 1."""
    x1, x2 = torch.tensor([1.0, 2.0]), torch.tensor([5.0, -1.0])
    eager_first = _residual(x1)
    eager = eager_first + _residual(x2)   # the caller sums two steps' outputs
    static = torch.zeros(2)
    graph, out = capture(_residual, static)
    static.copy_(x1)
    graph.replay()
    first = out                           # planted: the caller keeps the graph's output object
    static.copy_(x2)
    graph.replay()
    assert not torch.equal(first + out, eager)
    assert torch.equal(first + out, 2 * _residual(x2))   # step 1's values are gone
    static.copy_(x1)
    graph.replay()
    first = out.clone()                   # the fix: copy out of the pool before the next replay
    static.copy_(x2)
    graph.replay()
    assert torch.equal(first + out, eager)


def test_a_python_value_computed_at_capture_is_baked_into_the_replay():
    """CPU work is not captured: a host tensor made from Python state at capture keeps that value."""
    calls = []

    def counted(x):
        calls.append(1)
        return x * torch.tensor(float(len(calls)))   # host tensor: the call count, on the host

    static = torch.ones(2)
    graph, out = capture(counted, static)
    eager = [counted(torch.ones(2)) for _ in range(2)]    # eager: 2, then 3
    graph.replay()
    assert torch.equal(out, torch.ones(2)) and not torch.equal(out, eager[-1])


# -- control 3: slot fills land at their recorded wait ---------------------------------------------------------

def _weights() -> torch.Tensor:
    full = torch.full((E + B, H, H), float("nan"))
    for e in range(E):
        full[e] = torch.randn(H, H, generator=torch.Generator().manual_seed(e))
    return full


def slot_step(full, table, x):
    fill = pull_slots({"w": full}, table, E)
    wait_for_slots(fill.event)
    return torch.matmul(x.unsqueeze(1), full[E:]).squeeze(1)


def read_then_wait(full, table, x):
    fill = pull_slots({"w": full}, table, E)
    y = torch.matmul(x.unsqueeze(1), full[E:]).squeeze(1)   # planted: the read is not after the wait
    wait_for_slots(fill.event)                               # joined only at the end
    return y


def never_waits(full, table, x):
    pull_slots({"w": full}, table, E)
    return torch.matmul(x.unsqueeze(1), full[E:]).squeeze(1)


TABLES = ([0, 1, 2], [3, 0, 1], [2, 3, 3])


def _replays(fn, lenient=False, monkeypatch=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(replayed, eager with the wait in place)`` per table; each eager run on its own weights."""
    if lenient:   # the control of the control: a replay that landed every fill at issue
        def issue_and_land(item, tickets):
            tickets[(id(item.queue), item.ticket)] = ticket = item.queue.issue(item.work)._ticket
            item.queue.land_through(ticket)
        monkeypatch.setattr(cuda_capture._Issue, "replay", issue_and_land)
    full = _weights()
    table = torch.tensor([0, 1, 2], device=torch.device("cpu"))
    x = torch.zeros(B, H)
    graph, out = capture(fn, full, table, x)
    pairs = []
    for i, rows in enumerate(TABLES):
        new_x = torch.randn(B, H, generator=torch.Generator().manual_seed(10 + i))
        table.copy_(torch.tensor(rows))
        x.copy_(new_x)
        graph.replay()
        pairs.append((out.clone(), slot_step(_weights(), torch.tensor(rows), new_x)))
    return pairs


def test_slot_fills_replay_with_new_tables_equal_to_eager():
    for replayed, eager in _replays(slot_step):
        assert torch.equal(replayed, eager)


def test_a_read_before_the_fill_wait_disagrees_under_replay(monkeypatch):
    pairs = _replays(read_then_wait)
    assert all(not torch.equal(replayed, eager) for replayed, eager in pairs)
    # the control: with fills landing at issue (a lenient replay) the same bug would pass unseen
    for replayed, eager in _replays(read_then_wait, lenient=True, monkeypatch=monkeypatch):
        assert torch.equal(replayed, eager)


def test_a_fill_never_waited_on_is_refused_at_the_end_of_capture():
    line = inspect.getsourcelines(never_waits)[1] + 1
    with pytest.raises(CaptureRefused) as err:
        capture(never_waits, _weights(), torch.tensor([0, 1, 2], device=torch.device("cpu")), torch.zeros(B, H))
    assert err.value.kind == "a side stream not joined"
    assert err.value.site == f"tests/ops/test_cuda_capture.py:{line} never_waits"


def test_capture_restores_what_the_region_wrote():
    """On a GPU capture runs nothing: a buffer the region writes in place is as it was after capture."""
    buf = torch.arange(4.0)
    capture(lambda b: b.mul_(10), buf)
    assert torch.equal(buf, torch.arange(4.0))


# -- collectives ------------------------------------------------------------------------------------------------

def test_a_collective_is_recorded_and_replayed_and_a_barrier_refused(one_rank):
    def reduce(x):
        y = x * 3
        dist.all_reduce(y)
        return y

    static = torch.zeros(3)
    graph, out = capture(reduce, static)
    assert any(n.startswith("c10d.allreduce_") for n in graph.op_names()), graph.op_names()
    static.copy_(torch.tensor([1.0, 2.0, 3.0]))
    graph.replay()
    assert torch.equal(out, torch.tensor([3.0, 6.0, 9.0]))
    with pytest.raises(CaptureRefused) as err:
        capture(lambda x: dist.barrier(), static)
    assert err.value.kind == "barrier"


def test_cpu_work_runs_once_at_capture_and_is_elided_at_replay():
    """A host tensor's update is CPU work: it ran at capture and is not in the graph (PyTorch: "CPU work is
    not captured ... elided during replay"); the control, eager, repeats it every call."""
    from moonep_ep.testing.host_syncs import mark_host

    counter = torch.zeros(())
    mark_host(counter)

    def step(x):
        counter.add_(1)
        return x + counter

    static = torch.zeros(2)
    graph, out = capture(step, static)
    assert float(counter) == 1.0
    for _ in range(2):
        graph.replay()
        assert torch.equal(out, torch.ones(2)) and float(counter) == 1.0
    assert "aten.add_.Tensor" not in graph.op_names()
    assert torch.equal(step(static), torch.full((2,), 2.0))   # eager: the count moves on


def test_an_interpreted_triton_launch_is_one_replayed_item():
    """``tests/support/capture_triton_check.py`` in the vLLM environment (Triton's interpreter)."""
    from tests.support.vllm_envs import run_json

    out = run_json("vllm", ["-m", "tests.support.capture_triton_check"], timeout=300)
    assert out["launch_items"] == 1 and out["ops"].count("triton_launch") == 1, out
    assert out["poisoned_after_capture"] and out["replays_equal"] == [True, True, True], out
    assert out["control_without_launch_equal"] is False, out   # the launch item is what computes
    assert out["item_refused"][0] == "item", out
    assert out["item_refused"][1].startswith("tests/support/capture_triton_check.py:"), out


def test_memory_a_driver_makes_during_capture_is_refused():
    """cuMemCreate and kin are not the graph's pool: refused at the call; the control, before capture, works."""
    from moonep_ep.memory.driver import HandleType
    from moonep_ep.memory.host import HostDriver

    driver = HostDriver(rank=0, granularity=4096)
    try:
        handle = driver.create(4096, HandleType.POSIX_FD, tag="before")   # warm-up: allowed
        line = inspect.currentframe().f_lineno + 3
        with pytest.raises(CaptureRefused) as err:
            with CapturedGraph().capture():
                driver.create(4096, HandleType.POSIX_FD, tag="during")
        assert (err.value.kind, err.value.site) == (
            "MemoryDriver.create", f"tests/ops/test_cuda_capture.py:{line} "
            "test_memory_a_driver_makes_during_capture_is_refused")
        driver.release(handle)   # after capture the driver is itself again
    finally:
        driver.close()


def test_a_synchronous_host_to_device_copy_is_refused_and_a_non_blocking_one_baked():
    full = _weights()

    def host_table(x):
        return slot_step(full, [0, 1, 2], x)            # host ints: a blocking copy of the table at issue

    with pytest.raises(CaptureRefused) as err:
        capture(host_table, torch.zeros(B, H))
    assert err.value.kind == "host_to_device_copy"
    assert err.value.site.startswith("tests/ops/test_cuda_capture.py:") and "slot_step" in err.value.site
    with pytest.raises(CaptureRefused) as err:
        capture(lambda x: x + torch.tensor([1.0, 2.0], device=x.device), torch.zeros(2))
    assert err.value.kind == "tensor_from_python"
    # the control: a non-blocking copy of a host buffer is captured; replay reads the buffer as it is then
    host = torch.tensor([1.0, 2.0])
    graph, out = capture(lambda x: x + host.to(torch.device("cpu"), non_blocking=True), torch.zeros(2))
    host.copy_(torch.tensor([5.0, 7.0]))
    graph.replay()
    assert torch.equal(out, torch.tensor([5.0, 7.0]))


def test_a_host_op_that_torch_decomposes_is_cpu_work_and_replays_nothing():
    """``repeat_interleave`` on a host table reaches the dispatcher as ``repeat_interleave.Tensor`` then
    ``index_select``, whose outputs no tensor-level tag sees: both are CPU work (their inputs are host memory), not
    captured, so a replay reads nothing. Control: the same op on a device table is a data-dependent read, refused."""
    table = torch.tensor([1, 0, 2])
    mark_host(table)
    x = torch.randn(4)
    graph, out = capture(lambda: x + 0 * torch.repeat_interleave(table, table).sum())
    assert not any("repeat_interleave" in n or "index_select" in n for n in graph.op_names()), graph.op_names()
    with count_host_syncs(cpu_is_device=True) as reads:
        graph.replay()
    assert reads.total == 0 and torch.equal(out, x)
    device_table = torch.tensor([1, 0, 2])   # made outside a counted region and not declared: device memory
    with pytest.raises(CaptureRefused) as err:
        capture(lambda: x + 0 * torch.repeat_interleave(device_table, device_table).sum())
    assert err.value.kind == "repeat_interleave"


def test_a_refusal_leaves_an_outer_host_read_counter_counting():
    """The engine's observer may count around a capture: a refused synchronize must not leave it suppressed."""
    from moonep_ep.testing.host_syncs import count_host_syncs

    full = torch.zeros(E + B, 2, 2)
    with count_host_syncs() as outer:
        with pytest.raises(CaptureRefused):
            capture(lambda t: pull_slots({"w": full}, t, E).event.synchronize(),
                    torch.tensor([0, 1, 2], device=torch.device("cpu")))
        torch.ones(1, device=torch.device("cpu")).item()   # a read of a device tensor after the refusal
    assert outer.by_kind() == {"item": 1}, outer.report()


def test_the_device_planner_replays_equal_to_eager_at_three_routings():
    """``ops/moonep/planner_device.py`` (no host read by design) under capture: every field of the plan and the
    flag equal the eager device plan at each replay; the control: the routings' plans differ from each other."""
    from moonep_ep.ops.moonep.planner_device import plan_dispatch_device

    R, S = 2, 3

    def counts(seed):
        g = torch.Generator().manual_seed(seed)
        ids = [torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(S)]) for _ in range(R)]
        return torch.stack([torch.bincount(i.reshape(-1), minlength=E) for i in ids])

    def plan(T):
        return plan_dispatch_device(T, S=S, K=K, E=E, R=R, B=2, token_padding=4, local_tokens=S)

    static = counts(0).to(torch.device("cpu"))
    graph, (captured, flags) = capture(plan, static)
    fields = [f for f, v in vars(captured).items() if isinstance(v, torch.Tensor)]
    assert len(fields) >= 5, fields
    seen = []
    for seed in (1, 2, 3):
        static.copy_(counts(seed))
        graph.replay()
        eager, eager_flags = plan(counts(seed))
        assert all(torch.equal(getattr(captured, f), getattr(eager, f)) for f in fields), seed
        assert int(flags) == int(eager_flags) == 0
        seen.append(tuple(getattr(eager, f).tolist().__repr__() for f in fields))
    assert len(set(seen)) == 3
