"""The host-sync counter (``moonep_ep.testing.host_syncs``, issue 45): every kind of device→host read counted
exactly once at its site, ops that stay on the device counted 0, nesting and the predicate, and today's figures
of the project's MoE pieces (the reference buffer's dispatch, prefetch and combine; the plugin's capacity
padding) as a measurement whose sites must stay within a known set."""

from __future__ import annotations

import operator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from moonep_ep.launch import run_ranks
from moonep_ep.ops.moonep.prefetch import DoneEvent, SideStreams, pull_slots
from moonep_ep.testing.host_syncs import HostSyncs, count_host_syncs, is_host_tensor, mark_host

DEV = torch.device("cpu")  # "the device": a torch.device, so these tensors are device tensors, not host ones
HERE = "tests/ops/test_host_syncs.py"


def _dev(values: Any, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=DEV)


T = _dev([3, 1, 2])
S0 = _dev(2)
MASK = T > 1

#: (kind, the read) — one read each, made on the lambda's line.
READS = [
    ("item", lambda: S0.item()),
    ("tolist", lambda: T.tolist()),
    ("bool", lambda: bool(S0)),
    ("bool", lambda: 1 if MASK.any() else 0),
    ("int", lambda: int(S0)),
    ("float", lambda: float(S0)),
    ("index", lambda: operator.index(S0)),
    ("index", lambda: range(S0)),
    ("contains", lambda: 3 in T),
    ("format", lambda: f"{S0}"),
    ("cpu", lambda: T.cpu()),
    ("cpu", lambda: T.cpu().tolist()),  # the host copy's list is no second read
    ("to_cpu", lambda: T.to("cpu", torch.int32).tolist()),
    ("numpy", lambda: T.numpy()),
    ("copy_to_host", lambda: torch.empty(3, dtype=torch.int64).copy_(T)),
    ("scalar", lambda: T[S0]),
    ("equal", lambda: torch.equal(T, T)),
    ("nonzero", lambda: T.nonzero()),
    ("nonzero", lambda: torch.where(MASK)),
    ("nonzero", lambda: torch.argwhere(MASK)),
    ("unique", lambda: torch.unique(T)),
    ("unique", lambda: torch.unique_consecutive(T)),
    ("masked_select", lambda: torch.masked_select(T, MASK)),
    ("bincount", lambda: torch.bincount(T, minlength=4)),
    ("repeat_interleave", lambda: torch.repeat_interleave(T, T)),
    ("bool_index", lambda: T[MASK]),
    ("bool_index_put", lambda: T.clone().__setitem__(MASK, 0)),
    ("event_synchronize", lambda: DoneEvent().synchronize()),
]


@pytest.mark.parametrize("kind, read", READS, ids=[f"{i}-{k}" for i, (k, _) in enumerate(READS)])
def test_each_kind_is_counted_once_at_its_site(kind, read):
    line = read.__code__.co_firstlineno
    with count_host_syncs() as syncs:
        read()
    assert syncs.by_kind() == {kind: 1}
    assert syncs.by_site() == {f"{HERE}:{line} <lambda>": 1}
    assert syncs.by_function() == {f"{HERE} <lambda>": 1}


def test_the_cpu_side_streams_deferred_copies_count_their_synchronize():
    src, dst = torch.ones(2, 4), torch.zeros(2, 4)
    streams = SideStreams()
    _, _, event = pull_slots({"w": torch.stack([src[0], dst[0]])}, [0], 1, streams=streams)
    with count_host_syncs() as syncs:
        event.synchronize()
        event.wait()  # a stream wait: the host does not block on a GPU
    assert syncs.by_kind() == {"event_synchronize": 1}
    streams.close()


def test_cuda_synchronize_is_counted_where_called(monkeypatch):
    """The wrapper counts whatever ``torch.cuda.synchronize`` is (a no-op here: no GPU needed)."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    with count_host_syncs() as syncs:
        torch.cuda.synchronize()
    assert syncs.by_kind() == {"synchronize": 1}
    assert torch.cuda.synchronize() is None  # unwrapped again after the region (the patched no-op)


def test_a_region_without_reads_counts_zero():
    """Control: the same tensors, only device-side work; and ops that stay on the device count 0."""
    with count_host_syncs() as syncs:
        counts = torch.zeros(4, dtype=torch.int64, device=DEV).scatter_add_(0, T, torch.ones_like(T))
        counts.index_add_(0, T, torch.ones_like(T))
        cu = counts.cumsum(0)
        y = (cu * 2 + 1).to(torch.float32).softmax(0)
        torch.where(MASK, T, -T)  # the three-argument where: no shape from data
        torch.repeat_interleave(T, T, output_size=6)
        T.to(DEV)  # a move to the device (a torch.device target) is no read
        _ = T.shape, T.device, T[1:], T[0]
    assert syncs.total == 0, syncs.report()
    assert y.shape == (4,)


def test_host_tensors_are_free_and_a_host_copy_is_one_read():
    with count_host_syncs() as syncs:
        host = torch.arange(6) % 3  # a factory without device=: a host tensor on a GPU machine too
        torch.bincount(host).tolist()
        listed = T.cpu()
        listed.sum().item()  # computed from the host copy alone
        assert is_host_tensor(listed) and not is_host_tensor(T)
    assert syncs.by_kind() == {"cpu": 1}


def test_a_host_tensor_moved_to_the_device_is_read_again_and_a_declared_host_table_is_free():
    table = _dev([4, 4])  # made before the region: a device tensor unless declared
    with count_host_syncs() as syncs:
        moved = torch.tensor([1, 2]).to(DEV)  # on CPU ``to`` returns its input: an alias stands for the copy
        torch.empty_like(moved).cpu().tolist()
        mark_host(table)
        int(table.max())
    assert syncs.by_kind() == {"cpu": 1} and not is_host_tensor(moved)


def test_nested_counters_each_count_every_read_inside_them():
    with count_host_syncs() as outer:
        T.tolist()
        with count_host_syncs() as inner:
            S0.item()
            torch.bincount(T)
        bool(S0)
    assert inner.by_kind() == {"item": 1, "bincount": 1}
    assert outer.by_kind() == {"tolist": 1, "item": 1, "bincount": 1, "bool": 1}


def test_the_predicate_decides_per_read_and_a_counter_re_enters():
    counting = {"on": False}
    syncs = HostSyncs(when=lambda: counting["on"])
    with syncs:
        S0.item()
        counting["on"] = True
        S0.item()
        T.tolist()
    with syncs:  # the engine's observer enters one counter per MoE call
        S0.item()
    assert syncs.by_kind() == {"item": 2, "tolist": 1}
    with pytest.raises(RuntimeError, match="already entered"):
        with syncs, syncs:
            pass


def test_cpu_is_device_false_counts_only_other_devices():
    with count_host_syncs(cpu_is_device=False) as syncs:
        T.tolist()
        torch.bincount(T)
        DoneEvent().synchronize()  # synchronizes count whatever the tensors
    assert syncs.by_kind() == {"event_synchronize": 1}


# -- today's figures of the project's MoE pieces ---------------------------------------------------------------
#: Where the lockstep reference buffer (the library's default, ``lockstep_checks=True``: clear errors at once)
#: and the capacity padding read the device (``file function``, no line numbers); a read at a site outside this
#: set is new and fails the test. The sync-free buffer vLLM runs reads nothing: ``test_sync_free.py`` (dispatch,
#: combine) and ``test_prefetch_host_reads.py`` (the fills). The figures are printed (``pytest -s``).
KNOWN_SITES = {
    "moonep_ep/memory/group.py GroupComm.all_gather_object",  # the lockstep checks and the plan's counts
    "moonep_ep/ops/moonep/base.py ReferenceBufferBase._check_routing",
    "moonep_ep/ops/moonep/base.py ReferenceBufferBase._fresh_dispatch",
    "moonep_ep/ops/moonep/planner.py entry_dst",
    "moonep_ep/ops/moonep/routing.py source_routes",
    # the busiest group's load, read only where the cost model applies (a GPU or a named profile)
    "moonep_ep/vllm/prepare_finalize/padding.py _capacity_by_cost",
}


def measure_moe_pieces(ctx: Any) -> dict:
    """One rank of 2: the capacity padding (``balanced``) of 3 real tokens to S=4, then the reference buffer's
    dispatch, pull prefetch and combine of them (moonep.md §4.10's worked example), each counted apart."""
    from moonep_ep.ops.moonep.pull import ReferenceBuffer
    from moonep_ep.vllm.prepare_finalize.padding import pad_to_capacity

    R, S, H, K, E, B, I = 2, 4, 128, 2, 4, 2, 128
    decided = SimpleNamespace(padding="balanced", cost_profile="h100", cost_overrides=(), cost_applies=False)
    manager = SimpleNamespace(world_size=R, rank=ctx.rank, decisions=decided, cpu_group=None, _device_group=None)
    prepare = SimpleNamespace(buffer_pool=SimpleNamespace(_manager=manager, max_tokens_per_rank=S),
                              num_global_experts=E)
    topk = {0: [0, 1, 0, 1, 0, 2], 1: [0, 1, 1, 0, 0, 3]}[ctx.rank]
    ids = torch.tensor(topk, dtype=torch.int32, device=DEV).view(3, K)
    x = (torch.arange(3 * H, dtype=torch.float32, device=DEV).view(3, H) / 64 + 100 * ctx.rank).to(torch.bfloat16)
    w = torch.rand(3, K, device=DEV)
    out: dict[str, Any] = {}
    with count_host_syncs() as syncs:
        x, ids, w, _ = pad_to_capacity(prepare, x, ids, w, S, original=None)
    out["pad_to_capacity"] = syncs
    buf = ReferenceBuffer(S, H, K, E, R, token_padding=4, B=B, explicitly_destroy=True)
    full = {name: torch.zeros(E + B, *shape, dtype=torch.bfloat16, device=DEV)
            for name, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I)))}
    tpe = torch.zeros(E, dtype=torch.int32, device=DEV).index_add_(0, ids.reshape(-1), torch.ones_like(ids.reshape(-1)))
    with count_host_syncs() as syncs:
        hidden, w_nvs, cu, plan = buf.dispatch(x, w, ids, tpe)
    out["dispatch"] = syncs
    with count_host_syncs() as syncs:
        buf.prefetch_weight(plan, full_gate_weight=full["gate"], full_up_weight=full["up"],
                            full_down_weight=full["down"])
    out["prefetch"] = syncs
    with count_host_syncs() as syncs:
        buf.combine(plan, hidden, w_nvs)
    out["combine"] = syncs
    buf.destroy()
    return {step: {"total": c.total, "by_function": c.by_function(), "report": c.report()} for step, c in out.items()}


@pytest.fixture(scope="module")
def moe_pieces():
    return run_ranks(measure_moe_pieces, 2, timeout_s=120)


def test_todays_host_reads_of_the_moe_pieces_stay_within_the_known_sites(moe_pieces):
    """A measurement, not a target: prints today's figure per step and site; fails only on a new site."""
    for rank, steps in enumerate(moe_pieces):
        for step, got in steps.items():
            print(f"\nrank {rank} {step}: {got['total']} host reads\n{got['report']}")
            assert set(got["by_function"]) <= KNOWN_SITES, (step, sorted(set(got["by_function"]) - KNOWN_SITES))
    # The counter saw the buffer at all (the lockstep path's all_gather_object: its checks and counts).
    assert all(steps["dispatch"]["total"] > 0 for steps in moe_pieces)


# -- the engine's observer (vllm/observe/host_syncs.py) and the demo's figure, without vLLM --------------------------
def _scheduled(counts: dict, new=(), produced=None, resumed=()):
    produced = produced if produced is not None else {r: 1 for r in counts}
    cached = SimpleNamespace(req_ids=list(produced), num_output_tokens=list(produced.values()),
                             resumed_req_ids=set(resumed))
    return SimpleNamespace(num_scheduled_tokens=counts, scheduled_new_reqs=list(new), scheduled_cached_reqs=cached)


def test_a_step_is_decode_only_when_every_request_takes_its_next_token():
    from moonep_ep.vllm.observe.host_syncs import step_kind

    assert step_kind(_scheduled({"a": 1, "b": 1})) == "decode"
    assert step_kind(_scheduled({"a": 1, "b": 7})) == "prefill"                    # a prompt chunk beside it
    assert step_kind(_scheduled({"a": 1}, new=["b"])) == "prefill"                 # a new request
    assert step_kind(_scheduled({"a": 1}, produced={"a": 0})) == "prefill"         # a 1-token last prompt chunk
    assert step_kind(_scheduled({"a": 1}, resumed={"a"})) == "prefill"             # a preempted one recomputes
    assert step_kind(_scheduled({})) == "dummy"


def test_the_observer_tallies_each_moe_call_by_step_kind(monkeypatch):
    from moonep_ep.vllm.observe import host_syncs as observer
    from moonep_ep.vllm.observe.stats import STATS

    monkeypatch.delenv("MOONEP_EP_VLLM_STATS_DIR", raising=False)
    monkeypatch.setitem(STATS.data, "forward", {})
    monkeypatch.setattr(observer, "_STEP", {"kind": "decode", "id": 7})
    for _ in range(3):  # three MoE layers of decode step 7
        assert observer.TALLY.count(lambda: (S0.item(), T.tolist())[0], cpu_is_device=True) == 2
    observer._STEP.update(kind="prefill", id=8)
    observer.TALLY.count(lambda: torch.bincount(T), cpu_is_device=True)
    decode = STATS.data["forward"]["host_syncs"]["decode"]
    assert (decode["steps"], decode["moe_calls"], decode["reads"], decode["max_reads_per_call"]) == (1, 3, 6, 2)
    assert decode["by_kind"] == {"item": 3, "tolist": 3}
    assert all(site.startswith(f"{HERE}:") for site in decode["by_site"])
    assert STATS.data["forward"]["host_syncs"]["prefill"]["by_kind"] == {"bincount": 1}


def test_the_demo_reports_the_most_reads_of_one_layer_in_one_decode_step():
    from moonep_ep.tools.engine.summary import FIGURE_SOURCES, host_sync_fields

    def rank(max_reads, calls):
        return {"forward_stats": {"host_syncs": {"decode": {
            "steps": 2, "moe_calls": calls, "reads": max_reads * calls, "max_reads_per_call": max_reads,
            "by_kind": {"item": max_reads * calls}, "by_site": {}}}}}

    out = host_sync_fields({0: rank(5, 6), 1: rank(7, 6)}, [0, 1])
    assert out["decode_host_syncs"] == 7 and isinstance(out["decode_host_syncs"], int)
    assert [r["mean_per_layer_step"] for r in out["decode_host_syncs_by_rank"]] == [5.0, 7.0]
    assert host_sync_fields({0: {"forward_stats": {}}, 1: {}}, [0, 1]) == {}  # not counted: no figure
    assert {"decode_host_syncs", "decode_host_syncs_by_rank"} <= set(FIGURE_SOURCES)


def test_the_library_imports_the_counter_only_when_asked():
    """The plugin and its observer load without ``moonep_ep.testing.host_syncs`` while the setting is off."""
    import subprocess
    import sys

    code = ("import sys, moonep_ep.vllm.plugin, moonep_ep.vllm.observe.host_syncs as o; "
            "assert not o.enabled(); print('moonep_ep.testing.host_syncs' in sys.modules)")
    env = {k: v for k, v in __import__("os").environ.items() if k != "MOONEP_EP_COUNT_HOST_SYNCS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_an_interpreted_triton_launch_is_device_work_and_the_reads_around_it_are_counted():
    """``tests/support/host_syncs_interpreter_check.py`` in the vLLM environment (Triton's interpreter)."""
    from tests.support.vllm_envs import run_json

    out = run_json("vllm", ["-m", "tests.support.host_syncs_interpreter_check"], timeout=300)
    assert out["launch"] == 0 and out["launch_result_ok"], out
    assert out["item_then_launch"] == 1, out
    assert any("host_syncs_interpreter_check.py" in site for site in out["item_site"]), out
    assert out["control_launch_without_exemption"] > 0, out   # the interpreter's copies, counted without it
