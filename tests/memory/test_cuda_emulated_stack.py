"""The symmetric-memory stack over CudaDriver and the CUDA driver emulator, multi-process:
a failure at each driver call, and the GPU-only defects of issue 9 put back on purpose
(negative controls: the emulated tier must fail with them).

Rank bodies run with ``MOONEP_EP_CUDA_EMULATOR=1`` (the process-wide emulator, as the
CLI uses it) or with a private ``EmulatedCudaApi`` per rank (fault injection).
"""

from __future__ import annotations

import os

from typing import Any

import pytest

from moonep_ep.errors import MoonEPError
from moonep_ep.memory.symmetric import SymmetricMemory
from moonep_ep.launch import run_ranks
from tests.support.memory import (allocate_map_and_close, emulated_cuda_driver, holdings, leaks,
                                  run_emulated_ranks)

MiB = 1 << 20
pytestmark = [pytest.mark.cuda_emulated, pytest.mark.slow]


# -- a failure at each driver call -----------------------------------------------------------------

#: (call, calls let through first, who performs it). Chunks: two per rank; multicast on.
CALL_POINTS = [
    ("cuMemCreate", 0, "all"), ("cuMemCreate", 1, "all"), ("cuMemExportToShareableHandle", 1, "all"),
    ("cuMemImportFromShareableHandle", 0, "all"), ("cuMulticastCreate", 0, "root"),
    ("cuMemImportFromShareableHandle", 2, "peer"),   # the multicast handle (non-root ranks import it)
    ("cuMulticastAddDevice", 0, "all"), ("cuMulticastBindMem", 0, "all"), ("cuMemAddressReserve", 0, "all"),
    ("cuMemMap", 0, "all"), ("cuMemSetAccess", 0, "all"), ("cuMemMap", 2, "all"),
]


def cuda_call_faults(ctx: Any, failing_rank: int) -> list[dict[str, Any]]:
    # MOONEP_EP_MULTICAST=on: a multicast failure is an error too (under auto every rank goes on without
    # multicast instead: tests/memory/test_cuda_emulator_realism.py).
    os.environ["MOONEP_EP_MULTICAST"] = "on"
    results = []
    for call, after, who in CALL_POINTS:
        if (who == "root" and failing_rank != 0) or (who == "peer" and failing_rank == 0):
            continue
        driver = emulated_cuda_driver(ctx.rank, "H100x2,fabric=0")  # no fabric trial: fds straight away
        before = holdings(driver)
        if ctx.rank == failing_rank:
            driver.api.fail(call, "CUDA_ERROR_INVALID_VALUE", times=1, after=after)
        out: dict[str, Any] = {"call": call, "after": after, **allocate_map_and_close(driver, 2 * MiB)}
        out["leaks"] = leaks(driver, before)
        driver.close()
        out["contexts_left"] = driver.api.live()["contexts"]
        results.append(out)
    return results


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_failure_at_each_cuda_call_raises_everywhere_and_leaves_nothing_in_the_driver(failing_rank):
    for rank, outcomes in enumerate(run_ranks(cuda_call_faults, 2, args=(failing_rank,), timeout_s=240)):
        assert len(outcomes) == len(CALL_POINTS) - 1  # one root-only or peer-only point skipped
        for out in outcomes:
            assert out["raised"] == "CollectiveError", (rank, out)
            assert out["failures"] == [failing_rank], (rank, out)
            assert out["call"] in out["message"] and "CUDA_ERROR_INVALID_VALUE" in out["message"]
            assert out["leaks"] == {}, (rank, out)
            assert out["contexts_left"] == 0, (rank, out)


# -- negative controls: the defects put back -------------------------------------------------------

def _old_granularity(self, handle_type):
    """Finding 1 put back: CudaDriver.granularity with a required handle type (no None)."""
    from moonep_ep.memory.cuda import CudaDriver
    from moonep_ep.memory.driver import HandleType

    return CudaDriver._fixed_granularity(self, HandleType(handle_type))


def store_and_selftest(ctx: Any, put_back: str | None) -> dict[str, Any]:
    """The sharded store and the selftest over the emulator; optionally with a defect put back."""
    from moonep_ep.layout.store import ShardedExpertStore, ffn_projections
    from moonep_ep.memory import make_driver
    from moonep_ep.memory import symmetric
    from moonep_ep.memory.cuda import CudaDriver
    from moonep_ep.tools.commands.selftest import selftest_rank

    if put_back == "granularity":
        CudaDriver._fixed_granularity = CudaDriver.granularity
        CudaDriver.granularity = _old_granularity
    if put_back == "plain_copy":
        def old_multicast_write(self, offset, src):  # finding 2 put back: a copy into the multicast VA
            mc = self._multicast
            data = src.contiguous().view(-1).view(__import__("torch").uint8)
            self.driver.as_tensor(mc.va[0], mc.size, mc)[offset:offset + data.numel()].copy_(data)
        symmetric.SymmetricMemory.multicast_write = old_multicast_write
    out: dict[str, Any] = {}
    try:
        with make_driver("cuda", rank=ctx.rank) as driver:
            store = ShardedExpertStore(num_layers=2, num_experts=8, projections=ffn_projections(256, 128),
                                       num_slots=4, driver=driver)
            out["store_granularity"] = store.granularity
            store.close()
        out["store"] = "ok"
    except (MoonEPError, TypeError, ValueError) as exc:
        out["store"] = f"{type(exc).__name__}: {exc}"
    try:
        res = selftest_rank(ctx, "cuda", 4 * MiB)
        out["selftest"] = "ok" if not res["errors"] else res["errors"]
        out["multicast"] = res["first_cycle"]["multicast"]
    except (MoonEPError, TypeError, ValueError) as exc:
        out["selftest"] = f"{type(exc).__name__}: {exc}"
    return out


def test_store_and_selftest_pass_over_the_emulator():
    for res in run_emulated_ranks(store_and_selftest, 2, args=(None,)):
        assert res["store"] == "ok" and res["selftest"] == "ok", res
        assert res["store_granularity"] == 2 * MiB
        # 4 MiB chunks with a 512 MiB RECOMMENDED multicast granularity: MINIMUM sizes it (finding 3).
        assert res["multicast"]["used"] and res["multicast"]["members_updated"] == 2


def test_negative_control_granularity_without_handle_type_fails_the_emulated_tier():
    """Finding 1 put back (CudaDriver.granularity requiring a handle type): the store fails on every
    rank in its planning step, and the selftest at its first granularity() call."""
    for res in run_emulated_ranks(store_and_selftest, 2, args=("granularity",)):
        assert "CollectiveError" in res["store"] and "plan expert pages" in res["store"], res
        assert "not a valid HandleType" in res["store"]
        assert res["selftest"].startswith("TypeError") and "handle_type" in res["selftest"], res


def test_negative_control_plain_copy_into_the_multicast_address_fails_the_emulated_tier():
    """Finding 2 put back (multicast_write as tensor.copy_ into the multicast VA): refused by the
    emulator, and the failure is raised on every rank."""
    for res in run_emulated_ranks(store_and_selftest, 2, args=("plain_copy",)):
        assert res["store"] == "ok"
        assert "CollectiveError" in res["selftest"] and "multicast address" in res["selftest"], res
        assert "rank(s) [0]" in res["selftest"]


def vote_identity(ctx: Any, by_ordinal: bool) -> dict[str, Any]:
    """Allocate with multicast over the emulator, each rank on its own GPU as ordinal 0."""
    from moonep_ep.memory import exchange, make_driver

    if by_ordinal:  # finding 6 put back: the vote sees "cuda:0 (NVIDIA H100 ...)" on every rank
        original = exchange.local_vote

        def by_ordinal_vote(caps, hostname):
            vote = original(caps, hostname)
            vote["device"] = caps.device
            return vote
        exchange.local_vote = by_ordinal_vote
        from moonep_ep.memory import symmetric
        symmetric.local_vote = by_ordinal_vote
    with make_driver("cuda", rank=ctx.rank) as driver:
        symm = SymmetricMemory.allocate([2 * MiB], driver=driver, multicast=True)
        out = {"multicast": symm.has_multicast, "reason": symm.decision.reason, "device": driver.device,
               "uuid": driver.device_uuid()}
        symm.close()
    return out


@pytest.mark.parametrize("by_ordinal", [False, True])
def test_the_vote_identifies_gpus_by_uuid_under_per_rank_cuda_visible_devices(by_ordinal):
    results = run_emulated_ranks(vote_identity, 2, args=(by_ordinal,))
    assert [r["device"] for r in results] == [0, 0]                 # every rank's ordinal 0 ...
    assert results[0]["uuid"] != results[1]["uuid"]                 # ... is another GPU
    if by_ordinal:  # the defect: two GPUs look like one, multicast is voted off
        assert not any(r["multicast"] for r in results) and "lack it" in results[0]["reason"]
    else:
        assert all(r["multicast"] for r in results)


def multicast_size(ctx: Any, recommended: bool) -> dict[str, Any]:
    """4 MiB chunks with multicast on an 8xH100 node (RECOMMENDED multicast granularity 512 MiB)."""
    from moonep_ep.memory import make_driver
    from moonep_ep.memory.cuda import CudaDriver

    if recommended:  # finding 3 put back: size the multicast object by RECOMMENDED
        minimum = CudaDriver.multicast_granularity
        CudaDriver.multicast_granularity = lambda self, n, ht, recommended=False: minimum(self, n, ht, True)
    with make_driver("cuda", rank=ctx.rank) as driver:
        try:
            symm = SymmetricMemory.allocate([4 * MiB], driver=driver, multicast=True)
        except MoonEPError as exc:
            return {"error": str(exc)}
        out = {"multicast": symm.has_multicast, "size": symm._multicast.size, "chunk": symm.chunk_sizes[ctx.rank][0]}
        symm.close()
    return out


@pytest.mark.parametrize("recommended", [False, True])
def test_the_multicast_object_is_sized_by_the_minimum_granularity(recommended):
    """Finding 3: MINIMUM (2 MiB) sizes a 4 MiB multicast object over a 4 MiB chunk 0. By RECOMMENDED
    (512 MiB on 8xH100) the old floor gave size 0; rounding up instead (as NCCL does for its own
    buffers) would grow every rank's chunk 0 to 512 MiB -- 128x what was asked."""
    for res in run_emulated_ranks(multicast_size, 2, args=(recommended,)):
        if recommended:
            assert res == {"multicast": True, "size": 512 * MiB, "chunk": 512 * MiB}
        else:
            assert res == {"multicast": True, "size": 4 * MiB, "chunk": 4 * MiB}
