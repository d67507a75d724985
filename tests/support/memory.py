"""Leak checks and sizes shared by the multi-process memory tests."""

from __future__ import annotations

import gc

from moonep_ep.memory.accounting import snapshot

#: Small logical granularity: multi-process tests stay fast while every alignment rule still applies.
GRAN = 64 << 10


def holdings(driver) -> object:
    """What is below the library before a test acts: the OS view (host driver) or the CUDA
    emulator's live objects (CudaDriver over the emulator)."""
    if driver.name == "host":
        return snapshot(driver.rank)
    return dict(driver.api.live())


def leaks(driver, before) -> dict[str, int]:
    """What this rank still holds compared with ``before`` (from :func:`holdings`): the driver's
    live objects and, below the library, open memfds and memfd mappings (host) or the
    emulator's handles, mappings, reservations, binds and modules (CUDA). Empty when nothing
    leaked. A CUDA driver's own context retain is not counted (it is released by close())."""
    gc.collect()
    out = {k: v for k, v in driver.live_objects().items() if v}
    if driver.name != "host":
        after = driver.api.live()
        out.update({f"emulator_{k}": v - before.get(k, 0) for k, v in after.items()
                    if k != "contexts" and v != before.get(k, 0)})
        return out
    after = snapshot(driver.rank)
    if after.open_memfds != before.open_memfds:
        out["open_memfds"] = after.open_memfds - before.open_memfds
    if after.memfd_mappings != before.memfd_mappings:
        out["memfd_mappings"] = after.memfd_mappings - before.memfd_mappings
    return out


def emulated_cuda_driver(rank: int, node: str = "H100x2"):
    """A CudaDriver on GPU ``rank`` of an emulated node (one private emulator per rank)."""
    from moonep_ep.memory.cuda import CudaDriver
    from moonep_ep.testing.cuda_emulator import EmulatedCudaApi

    return CudaDriver(device=rank, rank=rank, api=EmulatedCudaApi(node, visible=None))


#: The environment of ranks running over the process-wide CUDA emulator (as the CLI runs them).
EMULATOR_ENV = {"MOONEP_EP_CUDA_EMULATOR": "1", "MOONEP_EP_CUDA_EMULATOR_NODE": "H100x8"}


def run_emulated_ranks(fn, world: int, args: tuple = (), timeout_s: float = 180, **kw) -> list:
    """Run ``fn`` on ``world`` ranks the way the CLI does over the emulator: gloo, CPU tensors,
    and each rank's own ``CUDA_VISIBLE_DEVICES`` (so every rank's ordinal 0 is another GPU)."""
    import os
    from unittest import mock

    from moonep_ep.launch import plan_launch, run_ranks

    with mock.patch.dict(os.environ, EMULATOR_ENV):
        plan = plan_launch("cuda", world)
    assert plan.emulated and plan.backend == "gloo", plan
    return run_ranks(fn, world, args=args, backend=plan.backend, env=EMULATOR_ENV, rank_envs=plan.rank_envs,
                     timeout_s=timeout_s, **kw)


def allocate_map_and_close(driver, chunk_bytes: int) -> dict:
    """Two chunks with multicast, mapped in rank and local-first order, torn down: the outcome
    (``raised`` None, or "CollectiveError" with the failing ranks, the step and the message)."""
    from moonep_ep.errors import CollectiveError
    from moonep_ep.memory.symmetric import SymmetricMemory

    outcome: dict = {}
    try:
        symm = SymmetricMemory.allocate([chunk_bytes, chunk_bytes], driver=driver, multicast=True)
        try:
            with symm.comm.step("map views"):
                a = symm.map_chunks(0)
                b = symm.map_chunks(1, "local_first")
            a.close()
            b.close()
        finally:
            symm.close()
        outcome["raised"] = None
    except CollectiveError as exc:
        outcome.update(raised="CollectiveError", failures=sorted(exc.failures), step=exc.step,
                       message=str(exc)[:600])
    return outcome


def bind_and_map_multicast(drv, mc, size: int) -> tuple[int, int, int]:
    """One member's multicast set-up on a CudaDriver: join, bind fresh memory at offset 0, map that
    memory read/write and the multicast object. Returns (memory handle, unicast VA, multicast VA)."""
    from moonep_ep.memory.driver import HandleType

    drv.multicast_add_device(mc)
    mem = drv.create(size, HandleType.POSIX_FD)
    drv.multicast_bind(mc, 0, mem, 0, size)
    uc = drv.reserve(size, size)
    drv.map(uc, size, mem, 0)
    drv.set_access(uc, size)
    va = drv.reserve(size, size)
    drv.multicast_map(va, size, mc)
    return mem, uc, va


def unmap_and_release_multicast(drv, mc, mem, uc: int, va: int, size: int) -> None:
    """The undo of :func:`bind_and_map_multicast` plus the multicast object, in the driver's order
    (unbind before the bound memory goes; NCCL nvls.cc and PyTorch do the same)."""
    drv.multicast_unbind(mc, 0, size)
    for addr in (va, uc):
        drv.unmap(addr, size)
        drv.free_reservation(addr, size)
    drv.multicast_release(mc)
    drv.release(mem)


def decision_mismatch(first_cycle: dict, fabric_supported: bool) -> str | None:
    """None when the handle type a selftest cycle used follows from what the vote saw, with its reason;
    else what disagrees. Every rank supporting fabric: FABRIC, kept only if the collective trial and the
    allocation succeeded (on real hardware an allocation succeeds exactly when the handle exchange does,
    pytorch/pytorch#156074), else POSIX fds with the reason naming the failure. No fabric support: POSIX fds
    because the ranks share a host. Never a fixed handle type: an image with an IMEX channel keeps fabric."""
    used, reason = first_cycle["handle_type"], first_cycle["multicast"]["reason"]
    if not fabric_supported:
        want = used == "fd" and reason.startswith("all ranks on one host")
    elif used == "fabric":
        want = reason.startswith("all ranks support fabric") and "fell back" not in reason
    else:
        want = (used == "fd" and reason.startswith("all ranks support fabric")
                and "fell back to POSIX fds on every rank" in reason)
    return None if want else f"handle type {used!r} with reason {reason!r} (fabric supported: {fabric_supported})"
