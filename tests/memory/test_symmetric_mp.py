"""Symmetric allocations across real processes (spawned ranks, gloo, host driver)."""

from __future__ import annotations

import gc
import os
from typing import Any

import pytest
import torch

from moonep_ep.errors import CollectiveError, MoonEPError
from moonep_ep.memory.accounting import snapshot
from moonep_ep.memory.host import HostDriver
from moonep_ep.memory.symmetric import Segment, SymmetricMemory
from moonep_ep.launch import RankFailure, run_ranks
from tests.support.memory import GRAN, allocate_map_and_close, leaks


def _fill(owner: int, chunk: int, writer: int, n: int) -> torch.Tensor:
    idx = torch.arange(n, dtype=torch.int64)
    return ((idx * 7 + owner * 31 + chunk * 11 + writer * 3 + 1) % 253).to(torch.uint8)


def visibility(ctx: Any) -> dict[str, Any]:
    """Unequal sizes and chunk counts; rank-order and local-first views; writes both ways;
    a range that maps one physical chunk twice."""
    rank, world = ctx.rank, ctx.world_size
    driver = HostDriver(rank=rank, granularity=GRAN)
    before = snapshot(rank)
    # rank r: chunk0 of (r+1) pages; even ranks also have a 1-page chunk1.
    sizes = [(rank + 1) * GRAN] + ([GRAN] if rank % 2 == 0 else [])
    symm = SymmetricMemory.allocate(sizes, driver=driver, tags=["a", "b"][: len(sizes)])
    out: dict[str, Any] = {"chunk_sizes": symm.chunk_sizes, "errors": []}
    by_rank = symm.map_chunks(0, "rank")
    local_first = symm.map_chunks(0, "local_first")
    # chunk0 of the next rank twice in one range: two virtual pages, one physical page.
    nxt = (rank + 1) % world
    twice = symm.map_range([Segment(nxt, 0, 0, GRAN), Segment(nxt, 0, 0, GRAN)], "twice")
    ones = [symm.map_range([Segment(r, 1, 0, GRAN)]) for r in range(world) if len(symm.chunk_sizes[r]) > 1]
    symm.release_imports()
    c0 = [s[0] for s in symm.chunk_sizes]
    off = [sum(c0[:r]) for r in range(world)]
    v = by_rank.bytes()
    # Each rank writes its own chunk0 page 0, and page 1.. of the previous rank's chunk0 (if any).
    v[off[rank]:off[rank] + GRAN].copy_(_fill(rank, 0, rank, GRAN))
    prev = (rank - 1) % world
    if c0[prev] > GRAN:
        v[off[prev] + GRAN:off[prev] + 2 * GRAN].copy_(_fill(prev, 0, rank, GRAN))
    for t in ones:
        pass
    if len(sizes) > 1:
        ones_own = [o for o in ones if o.segments[0].owner == rank][0]
        ones_own.bytes().copy_(_fill(rank, 1, rank, GRAN))
    symm.comm.barrier("test: step 1")
    lf = local_first.bytes()
    lf_off, cur = {}, 0
    for o in symm.owner_order("local_first"):
        lf_off[o] = cur
        cur += c0[o]
    out["local_first_order"] = symm.owner_order("local_first")
    for o in range(world):
        if not torch.equal(v[off[o]:off[o] + GRAN], _fill(o, 0, o, GRAN)):
            out["errors"].append(f"chunk0 page0 of rank {o} wrong")
        writer = (o + 1) % world
        if c0[o] > GRAN and not torch.equal(v[off[o] + GRAN:off[o] + 2 * GRAN], _fill(o, 0, writer, GRAN)):
            out["errors"].append(f"chunk0 page1 of rank {o} (written by rank {writer}) wrong")
        if not torch.equal(lf[lf_off[o]:lf_off[o] + c0[o]], v[off[o]:off[o] + c0[o]]):
            out["errors"].append(f"local-first view of rank {o} differs")
    for t in ones:
        o = t.segments[0].owner
        if not torch.equal(t.bytes(), _fill(o, 1, o, GRAN)):
            out["errors"].append(f"chunk1 of rank {o} wrong")
    tw = twice.bytes()
    if not torch.equal(tw[:GRAN], tw[GRAN:]):
        out["errors"].append("two virtual pages of one physical page differ")
    symm.comm.barrier("test: step 2")
    # Alias: write through one view, read through the other.
    if rank == 0:
        lf[lf_off[world - 1]:lf_off[world - 1] + 16].fill_(0xAB)
    symm.comm.barrier("test: step 3")
    out["alias_seen"] = bool(v[off[world - 1]:off[world - 1] + 16].eq(0xAB).all())
    out["visible_bytes"] = by_rank.size
    out["physical_bytes"] = snapshot(rank).own_bytes
    del v, lf, tw
    for r_ in [by_rank, local_first, twice, *ones]:
        r_.close()
    symm.close()
    out["leaks"] = leaks(driver, before)
    return out


def outlive(ctx: Any) -> dict[str, Any]:
    """A tensor keeps its mapping alive after the allocation is closed."""
    rank, world = ctx.rank, ctx.world_size
    driver = HostDriver(rank=rank, granularity=GRAN)
    before = snapshot(rank)
    symm = SymmetricMemory.allocate([GRAN], driver=driver)
    view = symm.map_chunks()
    t = view.tensor(torch.int32, (world, GRAN // 4))
    t[rank].fill_(rank + 100)
    symm.comm.barrier("test: step 4")
    symm.close()           # collective: releases handles, drops the range
    del view
    gc.collect()
    mid = snapshot(rank)
    values = [int(t[r, 0]) for r in range(world)]
    mappings_while_alive = mid.memfd_mappings - before.memfd_mappings
    fds_while_alive = mid.open_memfds - before.open_memfds
    part = t[1:]           # a view of the tensor also keeps it alive
    del t
    gc.collect()
    still = snapshot(rank).memfd_mappings - before.memfd_mappings
    del part
    gc.collect()
    return {"values": values, "mappings_while_alive": mappings_while_alive,
            "fds_while_alive": fds_while_alive, "mappings_with_view_only": still,
            "leaks": leaks(driver, before)}


def multicast(ctx: Any) -> dict[str, Any]:
    """Each rank in turn writes through the multicast object; every chunk sees each write."""
    rank, world = ctx.rank, ctx.world_size
    driver = HostDriver(rank=rank, granularity=GRAN)
    before = snapshot(rank)
    symm = SymmetricMemory.allocate([2 * GRAN + rank * GRAN], driver=driver, multicast=True)
    view = symm.map_chunks()
    sizes = [s[0] for s in symm.chunk_sizes]
    off = [sum(sizes[:r]) for r in range(world)]
    seen = []
    for writer in range(world):
        if rank == writer:
            symm.multicast_write(writer * 256, torch.full((256,), writer + 1, dtype=torch.uint8))
        symm.comm.barrier("test: step 5")
        b = view.bytes()
        seen.append([bool(b[off[o] + writer * 256:off[o] + (writer + 1) * 256].eq(writer + 1).all())
                     for o in range(world)])
        del b
    out = {"has_multicast": symm.has_multicast, "seen": seen,
           "mc_size": symm._multicast.size if symm._multicast else 0}
    view.close()
    symm.close()
    out["leaks"] = leaks(driver, before)
    return out


class FaultyDriver:
    """Delegates to a HostDriver; the ``nth`` call of ``method`` raises (or returns
    a CUDA-like error code) on this rank."""

    def __init__(self, inner: HostDriver, method: str, nth: int = 1, code: str = "INJECTED",
                 times: int = 1):
        self._inner, self._method, self._nth, self._code, self._times = inner, method, nth, code, times
        self._calls = 0

    def __getattr__(self, name: str):
        attr = getattr(self._inner, name)
        if name != self._method:
            return attr

        def wrapped(*args, **kwargs):
            self._calls += 1
            if self._nth <= self._calls < self._nth + self._times:
                raise self._inner.error(name, f"injected failure (call {self._calls})", self._code)
            return attr(*args, **kwargs)
        return wrapped


FAULT_POINTS = ["create", "export", "import_handle", "multicast_create", "multicast_import",
                "multicast_add_device", "multicast_bind", "reserve", "map", "set_access", "exchange"]


#: Steps that only rank 0 performs (it creates the multicast object and keeps that handle),
#: and steps only the other ranks perform (they import it).
ROOT_ONLY = {"multicast_create"}
NON_ROOT = {"multicast_import"}


def faults(ctx: Any, failing_rank: int) -> dict[str, Any]:
    """Inject a failure at each step on ``failing_rank``: every rank must raise, none
    may hang, and nothing may leak on any rank."""
    from moonep_ep.memory import exchange

    os.environ["MOONEP_EP_MULTICAST"] = "on"  # under auto a multicast failure degrades instead (test_cuda_emulator_realism)
    rank = ctx.rank
    results: dict[str, Any] = {}
    for point in FAULT_POINTS:
        if (point in ROOT_ONLY and failing_rank != 0) or (point in NON_ROOT and failing_rank == 0):
            continue
        inner = HostDriver(rank=rank, granularity=GRAN)
        before = snapshot(rank)
        driver: Any = inner
        restore = None
        if rank == failing_rank:
            if point == "exchange":
                original = exchange._send_fds
                def broken(*a, **k):
                    raise ConnectionResetError("injected: peer connection dropped")
                exchange._send_fds = broken
                restore = lambda: setattr(exchange, "_send_fds", original)  # noqa: E731
            else:
                driver = FaultyDriver(inner, point, nth=2 if point in ("create", "export", "map") else 1)
        outcome: dict[str, Any] = {}
        try:
            outcome = allocate_map_and_close(driver, GRAN)
        except Exception as exc:  # noqa: BLE001 - reported, the test fails on it
            outcome["raised"] = f"{type(exc).__name__}: {exc}"
        finally:
            if restore:
                restore()
        outcome["leaks"] = leaks(inner, before)
        results[point] = outcome
    return results


def bind_retry(ctx: Any, times: int) -> dict[str, Any]:
    """SYSTEM_NOT_READY on one rank's multicast bind: retried by all ranks in lockstep (MOONEP_EP_MULTICAST=on:
    when the retries run out, every rank fails)."""
    os.environ["MOONEP_EP_MULTICAST"] = "on"
    rank = ctx.rank
    inner = HostDriver(rank=rank, granularity=GRAN)
    before = snapshot(rank)
    driver: Any = FaultyDriver(inner, "multicast_bind", 1, "SYSTEM_NOT_READY", times) if rank == 1 else inner
    try:
        symm = SymmetricMemory.allocate([GRAN], driver=driver, multicast=True)
        ok = symm.has_multicast
        symm.close()
        out = {"ok": ok}
    except CollectiveError as exc:
        out = {"ok": False, "error": str(exc)[:300], "failures": sorted(exc.failures)}
    out["leaks"] = leaks(inner, before)
    return out


def disagree_granularity(ctx: Any) -> dict[str, Any]:
    rank = ctx.rank
    driver = HostDriver(rank=rank, granularity=GRAN * (2 if rank == 1 else 1))
    before = snapshot(rank)
    try:
        SymmetricMemory.allocate([4 * GRAN], driver=driver)
        out = {"raised": None}
    except MoonEPError as exc:  # a decision from the gathered sizes: every rank raises alike
        out = {"raised": str(exc)}
    out["leaks"] = leaks(driver, before)
    return out


def env_probe(ctx: Any) -> str:
    return os.environ.get("MOONEP_EP_PROBE", "")


def cuda_emulated_sequence(ctx: Any, same_gpu: bool = False) -> dict[str, Any]:
    """SymmetricMemory over the CUDA driver, with the CUDA driver emulator in place of
    cuda.bindings.driver: the real call sequence, no GPU."""
    from moonep_ep.memory.cuda import CudaDriver
    from moonep_ep.testing.cuda_emulator import EmulatedCudaApi

    # One GPU per rank (device = rank), as on an NVSwitch node: the vote keeps multicast on.
    api = EmulatedCudaApi(f"H100x{ctx.world_size}", visible=None, record=True)
    driver = CudaDriver(device=0 if same_gpu else ctx.rank, rank=ctx.rank, api=api)
    cuda_gran = 2 << 20
    symm = SymmetricMemory.allocate([cuda_gran, 2 * cuda_gran], driver=driver, multicast=True)
    view = symm.map_chunks(1, "local_first")
    symm.release_imports()
    view.close()
    symm.close()
    driver.close()
    return {"multicast": symm.decision.multicast, "reason": symm.decision.reason,
            "calls": [(name, [repr(a) for a in args]) for name, args in api.calls],
            "live": api.live(), "driver_live": driver.live_objects(), "errors": api.errors}


pytestmark = pytest.mark.slow


@pytest.mark.parametrize("world", [2, 4])
def test_visibility_both_directions_and_views(world):
    results = run_ranks(visibility, world)
    for rank, res in enumerate(results):
        assert res["errors"] == [], (rank, res["errors"])
        assert res["leaks"] == {}, (rank, res["leaks"])
        assert res["alias_seen"], rank
        sizes = res["chunk_sizes"]
        # Unequal sizes: rank r has (r+1) pages in chunk 0; even ranks have a chunk 1.
        assert [s[0] for s in sizes] == [(r + 1) * GRAN for r in range(world)]
        assert [len(s) for s in sizes] == [2 if r % 2 == 0 else 1 for r in range(world)]
        assert res["local_first_order"] == [(rank + i) % world for i in range(world)]
        # Physical memory (per the OS) is only this rank's chunks; the view shows all.
        assert res["physical_bytes"] == sum(sizes[rank])
        assert res["visible_bytes"] == sum(s[0] for s in sizes)


def test_mapping_outlives_the_allocation_until_the_last_tensor_dies():
    results = run_ranks(outlive, 2)
    for rank, res in enumerate(results):
        assert res["values"] == [100, 101]
        assert res["mappings_while_alive"] == 2       # both owners' chunks still mapped
        assert res["fds_while_alive"] == 0            # handles released, fds closed
        assert res["mappings_with_view_only"] == 2    # a slice still holds the mapping
        assert res["leaks"] == {}, (rank, res["leaks"])


@pytest.mark.parametrize("world", [2, 4])
def test_multicast_fan_out(world):
    results = run_ranks(multicast, world)
    for rank, res in enumerate(results):
        assert res["has_multicast"]
        assert res["mc_size"] == 2 * GRAN  # the smallest chunk 0
        assert res["seen"] == [[True] * world] * world, rank
        assert res["leaks"] == {}, (rank, res["leaks"])


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_injected_failure_at_each_step_raises_everywhere_and_leaks_nothing(failing_rank):
    results = run_ranks(faults, 2, args=(failing_rank,), timeout_s=240)
    for rank, per_point in enumerate(results):
        expected = set(FAULT_POINTS) - (ROOT_ONLY if failing_rank != 0 else NON_ROOT)
        assert set(per_point) == expected
        for point, outcome in per_point.items():
            assert outcome["raised"] == "CollectiveError", (rank, point, outcome)
            assert outcome["failures"] == [failing_rank] or (
                point == "exchange" and failing_rank in outcome["failures"]), (rank, point, outcome)
            assert f"rank {failing_rank}" in outcome["message"]
            assert outcome["leaks"] == {}, (rank, point, outcome["leaks"])


def test_transient_bind_failure_is_retried_in_lockstep():
    for res in run_ranks(bind_retry, 2, args=(2,)):
        assert res["ok"] and res["leaks"] == {}


def test_persistent_bind_failure_fails_every_rank():
    for res in run_ranks(bind_retry, 2, args=(100,)):
        assert not res["ok"] and res["failures"] == [1] and "SYSTEM_NOT_READY" in res["error"]
        assert res["leaks"] == {}


def test_ranks_disagreeing_on_granularity_all_raise():
    for res in run_ranks(disagree_granularity, 2):
        assert res["raised"] and "different granularities" in res["raised"]
        assert "MOONEP_EP_HOST_GRANULARITY" in res["raised"]
        assert res["leaks"] == {}


def test_launcher_reports_env_and_failures():
    assert run_ranks(env_probe, 2, env={"MOONEP_EP_PROBE": "x"}) == ["x", "x"]
    with pytest.raises(RankFailure) as info:
        run_ranks(visibility, 1, args=("unexpected",))
    assert 0 in info.value.errors and "TypeError" in info.value.errors[0]


@pytest.mark.cuda_emulated
def test_cuda_call_sequence_against_the_emulator():
    """SymmetricMemory driving the CUDA driver (emulated API) on 2 real ranks: order and arguments."""
    results = run_ranks(cuda_emulated_sequence, 2)
    for rank, res in enumerate(results):
        names = [n for n, _ in res["calls"]]
        assert all(v == 0 for v in res["live"].values()), (rank, res["live"])
        assert all(v == 0 for v in res["driver_live"].values()), (rank, res["driver_live"])

        def first(name, start=0):
            return names.index(name, start)

        # Context before any memory call; granularity queried before create.
        assert first("cuCtxSetCurrent") < first("cuMemGetAllocationGranularity") < first("cuMemCreate")
        # create -> export -> (exchange) -> import of the peer's chunks.
        assert first("cuMemCreate") < first("cuMemExportToShareableHandle") < first("cuMemImportFromShareableHandle")
        # The fabric trial's create (refused: the attribute says yes, but no IMEX channel), then two chunks.
        assert names.count("cuMemCreate") == 3
        assert [e[:2] for e in res["errors"]] == [("cuMemCreate", "CUDA_ERROR_NOT_PERMITTED")]
        # Multicast: only rank 0 creates and keeps that handle (NCCL nvls.cc); the others import it.
        # Every rank adds its device, then binds.
        assert names.count("cuMulticastCreate") == (1 if rank == 0 else 0)
        mc_imports = [a for n, a in res["calls"] if n == "cuMemImportFromShareableHandle"]
        assert len(mc_imports) == (2 if rank == 0 else 3)  # peer's 2 chunks (+ the multicast handle)
        assert first("cuMulticastAddDevice") < first("cuMulticastBindMem") < first("cuMemAddressReserve")
        bind_args = [a for n, a in res["calls"] if n == "cuMulticastBindMem"][0]
        assert bind_args[1] == "0" and bind_args[3] == "0"  # mc offset 0, memory offset 0
        # Map, then grant access over the whole range in one call with one descriptor.
        access = [a for n, a in res["calls"] if n == "cuMemSetAccess"]
        assert access and all(a[3] == "1" for a in access)
        # Teardown: sync before the first unmap; unbind before the bound memory's release;
        # every reservation freed after its unmaps; primary context released last.
        # Imported handles are released right after mapping (the mappings keep the memory),
        # before any teardown starts.
        last_access = len(names) - 1 - names[::-1].index("cuMemSetAccess")
        assert names[last_access + 1:last_access + 3] == ["cuMemRelease", "cuMemRelease"]
        first_unmap = first("cuMemUnmap")
        assert "cuCtxSynchronize" in names[:first_unmap]
        unbind = first("cuMulticastUnbind")
        assert names[unbind + 1:].count("cuMemRelease") >= 3  # mc handle + both own chunks
        assert names[-1] == "cuDevicePrimaryCtxRelease"
        for i, n in enumerate(names):
            if n == "cuMemAddressFree":
                assert names[i - 1] in ("cuMemUnmap", "cuMemAddressFree")


@pytest.mark.cuda_emulated
def test_two_ranks_on_one_gpu_vote_multicast_off():
    # A multicast team has one member per GPU: two processes on one GPU (the
    # single-GPU fd-exchange setup) must not try to form one.
    for res in run_ranks(cuda_emulated_sequence, 2, args=(True,)):
        names = [n for n, _ in res["calls"]]
        assert res["multicast"] is False and "lack it" in res["reason"]
        assert "cuMulticastCreate" not in names and "cuMulticastBindMem" not in names
        assert "cuMemImportFromShareableHandle" in names
        assert all(v == 0 for v in res["live"].values())

