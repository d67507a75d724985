"""Symmetric allocations across real processes (spawned ranks, gloo, host driver)."""

from __future__ import annotations

import pytest

import mp_scenarios as sc
from moonep_ep.launch import RankFailure, run_ranks

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("world", [2, 4])
def test_visibility_both_directions_and_views(world):
    results = run_ranks(sc.visibility, world)
    for rank, res in enumerate(results):
        assert res["errors"] == [], (rank, res["errors"])
        assert res["leaks"] == {}, (rank, res["leaks"])
        assert res["alias_seen"], rank
        sizes = res["chunk_sizes"]
        # Unequal sizes: rank r has (r+1) pages in chunk 0; even ranks have a chunk 1.
        assert [s[0] for s in sizes] == [(r + 1) * sc.GRAN for r in range(world)]
        assert [len(s) for s in sizes] == [2 if r % 2 == 0 else 1 for r in range(world)]
        assert res["local_first_order"] == [(rank + i) % world for i in range(world)]
        # Physical memory (per the OS) is only this rank's chunks; the view shows all.
        assert res["physical_bytes"] == sum(sizes[rank])
        assert res["visible_bytes"] == sum(s[0] for s in sizes)


def test_mapping_outlives_the_allocation_until_the_last_tensor_dies():
    results = run_ranks(sc.outlive, 2)
    for rank, res in enumerate(results):
        assert res["values"] == [100, 101]
        assert res["mappings_while_alive"] == 2       # both owners' chunks still mapped
        assert res["fds_while_alive"] == 0            # handles released, fds closed
        assert res["mappings_with_view_only"] == 2    # a slice still holds the mapping
        assert res["leaks"] == {}, (rank, res["leaks"])


@pytest.mark.parametrize("world", [2, 4])
def test_multicast_fan_out(world):
    results = run_ranks(sc.multicast, world)
    for rank, res in enumerate(results):
        assert res["has_multicast"]
        assert res["mc_size"] == 2 * sc.GRAN  # the smallest chunk 0
        assert res["seen"] == [[True] * world] * world, rank
        assert res["leaks"] == {}, (rank, res["leaks"])


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_injected_failure_at_each_step_raises_everywhere_and_leaks_nothing(failing_rank):
    results = run_ranks(sc.faults, 2, args=(failing_rank,), timeout_s=240)
    for rank, per_point in enumerate(results):
        expected = set(sc.FAULT_POINTS) - (sc.ROOT_ONLY if failing_rank != 0 else set())
        assert set(per_point) == expected
        for point, outcome in per_point.items():
            assert outcome["raised"] == "CollectiveError", (rank, point, outcome)
            assert outcome["failures"] == [failing_rank] or (
                point == "exchange" and failing_rank in outcome["failures"]), (rank, point, outcome)
            assert f"rank {failing_rank}" in outcome["message"]
            assert outcome["leaks"] == {}, (rank, point, outcome["leaks"])


def test_transient_bind_failure_is_retried_in_lockstep():
    for res in run_ranks(sc.bind_retry, 2, args=(2,)):
        assert res["ok"] and res["leaks"] == {}


def test_persistent_bind_failure_fails_every_rank():
    for res in run_ranks(sc.bind_retry, 2, args=(100,)):
        assert not res["ok"] and res["failures"] == [1] and "SYSTEM_NOT_READY" in res["error"]
        assert res["leaks"] == {}


def test_ranks_disagreeing_on_granularity_all_raise():
    for res in run_ranks(sc.disagree_granularity, 2):
        assert res["raised"] and "different granularities" in res["raised"]
        assert "MOONEP_EP_HOST_GRANULARITY" in res["raised"]
        assert res["leaks"] == {}


def test_launcher_reports_env_and_failures():
    assert run_ranks(sc.env_probe, 2, env={"MOONEP_EP_PROBE": "x"}) == ["x", "x"]
    with pytest.raises(RankFailure) as info:
        run_ranks(sc.visibility, 1, args=("unexpected",))
    assert 0 in info.value.errors and "TypeError" in info.value.errors[0]


def test_cuda_call_sequence_against_the_recording_fake():
    """SymmetricMemory driving the CUDA driver (fake API) on 2 real ranks: order and arguments."""
    results = run_ranks(sc.cuda_fake_sequence, 2)
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
        assert names.count("cuMemCreate") == 2
        # Multicast: only rank 0 creates; every rank imports (rank 0 too), adds its device, then binds.
        assert names.count("cuMulticastCreate") == (1 if rank == 0 else 0)
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


def test_two_ranks_on_one_gpu_vote_multicast_off():
    # A multicast team has one member per GPU: two processes on one GPU (the
    # single-GPU fd-exchange setup) must not try to form one.
    for res in run_ranks(sc.cuda_fake_sequence, 2, args=(True,)):
        names = [n for n, _ in res["calls"]]
        assert res["multicast"] is False and "lack it" in res["reason"]
        assert "cuMulticastCreate" not in names and "cuMulticastBindMem" not in names
        assert "cuMemImportFromShareableHandle" in names
        assert all(v == 0 for v in res["live"].values())
