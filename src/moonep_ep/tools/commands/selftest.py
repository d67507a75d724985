"""The per-rank body of ``moonep-ep selftest``: map, write, verify, multicast, tear down, count leaks.

Leaks are measured below the library (``accounting.driver_holdings``): the OS's
memfds and mappings for the host driver, the emulator's live handles, mappings
and reservations for the CUDA driver over the emulator; on a real GPU only
device bytes (``cuMemGetInfo``). ``inject_leak`` leaves one object behind on
purpose, so tests can show each counter reports what it should.
"""

from __future__ import annotations

import ctypes
import gc
import time
from typing import Any

import torch

from ...memory import make_driver
from ...memory.accounting import driver_holdings, snapshot, system_shmem_bytes
from ...memory.driver import HandleType
from ...memory.group import GroupComm
from ...memory.symmetric import SymmetricMemory

_PERIOD = 251  # prime: byte i holds (131 i + c) mod 251, so the pattern repeats every 251 bytes


def _pattern(owner: int, writer: int, n: int, device: str) -> torch.Tensor:
    """``n`` bytes distinct per (owner, writer) and per byte position (mod 251), so a misplaced page shows.

    One period is computed and tiled: the int64 modulo over every byte took 85 % of a soak cycle."""
    period = ((torch.arange(_PERIOD, dtype=torch.int64) * 131 + owner * 17 + writer * 29 + 7) % _PERIOD)
    return period.to(torch.uint8).repeat(-(-n // _PERIOD))[:n].to(device)


def _one_cycle(ctx: Any, driver, chunk_bytes: int) -> dict[str, Any]:
    rank, world = ctx.rank, ctx.world_size
    device = driver.torch_device
    gran = driver.granularity()  # no handle type: valid whichever type the group votes for
    # Unequal chunk sizes on purpose: odd ranks get one extra page.
    symm = SymmetricMemory.allocate([chunk_bytes + (rank % 2) * gran], driver=driver,
                                    tags=["selftest"], multicast=True)
    t0 = time.perf_counter()
    by_rank = symm.map_chunks(order="rank")
    local_first = symm.map_chunks(order="local_first")
    symm.release_imports()  # mappings keep peers' memory alive
    map_s = time.perf_counter() - t0
    sizes = [s[0] for s in symm.chunk_sizes]
    offsets = [sum(sizes[:r]) for r in range(world)]
    half = min(sizes) // 2
    view = by_rank.bytes()
    # Own chunk, first half; next rank's chunk, second half (a write into a peer's memory).
    peer = (rank + 1) % world
    view[offsets[rank]:offsets[rank] + half].copy_(_pattern(rank, rank, half, device))
    view[offsets[peer] + half:offsets[peer] + 2 * half].copy_(_pattern(peer, rank, half, device))
    driver.synchronize()
    symm.comm.barrier("selftest: patterns written")
    errors = []
    lf = local_first.bytes()
    lf_offsets = {}
    cursor = 0
    for owner in symm.owner_order("local_first"):
        lf_offsets[owner] = cursor
        cursor += sizes[owner]
    for owner in range(world):
        writer = (owner - 1) % world
        want_first = _pattern(owner, owner, half, device)
        want_second = _pattern(owner, writer, half, device)
        got = view[offsets[owner]:offsets[owner] + 2 * half]
        if not torch.equal(got[:half], want_first) or not torch.equal(got[half:], want_second):
            errors.append(f"rank-order view: chunk of rank {owner} has wrong bytes")
        if not torch.equal(lf[lf_offsets[owner]:lf_offsets[owner] + 2 * half], got):
            errors.append(f"local-first view disagrees with rank-order view for rank {owner}")
    multicast = {"used": symm.has_multicast, "reason": symm.decision.reason}
    if symm.has_multicast:
        symm.comm.barrier("selftest: before the multicast write")
        probe = _pattern(world, world, 4096, device)
        with symm.comm.step("selftest: multicast write"):  # rank 0's failure raises on every rank
            if rank == 0:
                symm.multicast_write(0, probe)
            driver.synchronize()
        seen = sum(torch.equal(view[offsets[o]:offsets[o] + 4096], probe) for o in range(world))
        multicast["members_updated"] = int(seen)
        if seen != world:
            errors.append(f"multicast write reached {seen} of {world} chunks")
    mem = snapshot(rank)
    result = {
        "errors": errors,
        "physical_bytes": mem.own_bytes if driver.name == "host" else sum(
            driver.handle_size(h) for h in symm.own_handles()),
        "resident_bytes": mem.own_resident_bytes if driver.name == "host" else None,
        "visible_bytes": by_rank.size,
        "handle_type": symm.decision.handle_type.value,
        "multicast": multicast,
        "map_ms": round(map_s * 1e3, 3),
    }
    del view, lf
    by_rank.close()
    local_first.close()
    symm.close()
    return result


def _settled_rss(rank: int) -> int:
    """RSS after garbage collection and returning free heap pages to the OS, so the
    figure is memory still held, not memory the allocator merely caches."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the raw figure is still meaningful
        pass
    return snapshot(rank).rss_bytes


def _inject_leak(driver, kind: str, gran: int) -> None:
    """Leave one object behind on purpose (a positive control for the leak counters)."""
    handle = driver.create(gran, HandleType.POSIX_FD, tag="leak")
    if kind == "mapping":
        base = driver.reserve(gran, gran)
        driver.map(base, gran, handle, 0)


def _warm_up(ctx: Any, driver) -> str:
    """Before a device-wide reading (``cuMemGetInfo``): CUDA loads a kernel into device memory at
    its first launch (lazy loading, the default since 12.2) and grows page tables at the first
    mappings; neither is freed, and both count. One cycle on a one-page chunk launches every kernel
    the measured cycles launch and maps and unmaps once."""
    _one_cycle(ctx, driver, driver.granularity())
    gc.collect()
    if not getattr(driver, "emulated", False):
        torch.cuda.empty_cache()  # the warm-up's temporaries, cached by torch, are not ours
    driver.synchronize()
    return ("one selftest cycle on a one-page chunk: the pattern/copy/compare kernels (torch), the multimem "
            "store when multicast is used, one create/map/unmap/release")


def selftest_rank(ctx: Any, driver_name: str, chunk_bytes: int, cycles: int = 1,
                  inject_leak: str | None = None, skip_warm_up: bool = False) -> dict[str, Any]:
    """Run ``cycles`` full allocate/verify/teardown cycles; report the first cycle and leaks."""
    driver = make_driver(driver_name, rank=ctx.rank)
    comm = GroupComm()
    host = driver.capabilities().host  # the emulator's host on an emulated multi-host domain
    gc.collect()
    comm.barrier("selftest: start")  # every rank idle: the machine-wide shared-memory figure is comparable
    shm_before = system_shmem_bytes()
    before = snapshot(ctx.rank)
    held_before = driver_holdings(driver, ctx.rank)
    own_context = int(getattr(driver, "holds_context", lambda: False)())  # released by close() below
    live_before = driver.live_objects()
    # Device-wide figures are read after a warm-up; objects (above) before it, so the warm-up's
    # driver-owned objects (the multimem module, unloaded at close) are not counted as freed.
    warm_up = _warm_up(ctx, driver) if driver.name == "cuda" and not skip_warm_up else None
    comm.barrier("selftest: every rank warmed up")
    device_before = driver_holdings(driver, ctx.rank)
    first = None
    rss_baseline = None
    # RSS is compared from the end of a warm-up: allocator arenas and torch/gloo
    # state grow over the first few hundred collectives, then stay flat; a leak
    # of ours grows every cycle and shows in the remaining cycles.
    warmup = max(1, min(50, cycles // 4))
    errors: list[str] = []
    t0 = time.perf_counter()
    for cycle in range(cycles):
        res = _one_cycle(ctx, driver, chunk_bytes)
        errors += [f"cycle {cycle}: {e}" for e in res["errors"]]
        if first is None:
            first = res
        if cycle + 1 == warmup:
            rss_baseline = _settled_rss(ctx.rank)
    rss_end = _settled_rss(ctx.rank)
    if inject_leak in ("handle", "mapping"):  # "context": the driver is simply not closed below
        _inject_leak(driver, inject_leak, driver.granularity(HandleType.POSIX_FD))
    comm.barrier("selftest: every rank torn down")
    emulated = bool(getattr(driver, "emulated", False))
    readable_after_close = emulated or driver.name == "host"  # the emulator and the OS; cuMemGetInfo needs a context
    if readable_after_close:
        if inject_leak != "context":
            driver.close()
    else:  # a real GPU: torch's cached blocks are not ours
        gc.collect()
        torch.cuda.empty_cache()
        driver.synchronize()
    # What is below the library may be device-wide (cuMemGetInfo; the emulator's too): read it only once
    # every rank has cleaned up, or a rank sharing the GPU counts another's not-yet-freed temporaries as
    # its own leak; and nobody allocates again before every rank has read.
    comm.barrier("selftest: every rank cleaned up")
    held_after = driver_holdings(driver, ctx.rank)
    comm.barrier("selftest: every rank read what it holds")
    if not readable_after_close and inject_leak != "context":
        driver.close()
    live = driver.live_objects()  # after close(): the driver's own objects (multimem module) are gone too
    leaked_driver = {k: v - live_before.get(k, 0) for k, v in live.items() if v != live_before.get(k, 0)}
    if getattr(driver, "holds_context", lambda: False)():
        leaked_driver["context"] = 1
    shm_after = system_shmem_bytes()
    after = snapshot(ctx.rank)
    below = {k: v - held_before.detail.get(k, 0) + (own_context if k == "contexts" else 0)
             for k, v in held_after.detail.items()}
    measured = held_after.handles is not None
    return {
        "rank": ctx.rank,
        "host": comm.hostname if driver.name == "host" else (host or comm.hostname),
        "driver": driver.name,
        "emulated": emulated,
        "errors": errors,
        "first_cycle": first,
        "cycles": cycles,
        "seconds": round(time.perf_counter() - t0, 3),
        # Below the library: memfds/maps (host), the emulator's handles and mappings+reservations
        # (emulated CUDA); None on a GPU, whose driver lists neither (see leak_measure).
        "leaked_fds": held_after.handles - held_before.handles if measured else None,
        "leaked_mappings": held_after.mappings - held_before.mappings if measured else None,
        "leaked_below_library": {k: v for k, v in below.items() if v},
        "leaked_device_bytes": held_after.bytes_held - device_before.bytes_held,
        "device_wide_drift_bytes": (None if held_after.device_used is None
                                    else held_after.device_used - device_before.device_used),
        "warm_up": warm_up,
        "leak_measure": held_after.how,
        "leaked_driver_objects": leaked_driver,
        "rss_growth_bytes": rss_end - rss_baseline if cycles > warmup else None,
        "rss_growth_note": (f"RSS after cycle {warmup} (end of warm-up) vs after cycle {cycles}" if cycles > warmup
                            else f"not measured: needs more cycles than the {warmup}-cycle warm-up "
                                 "(--cycles >= 2); one reading before and one after no work says nothing"),
        "rss_warmup_cycles": warmup,
        # Shared memory this rank still keeps alive (its open or mapped memfds, any owner's).
        "leaked_shm_bytes": after.held_bytes - before.held_bytes,
        # Machine-wide /proc/meminfo Shmem change: informative only, other processes move it.
        "system_shmem_delta_bytes": (shm_after - shm_before) if ctx.rank == 0 else 0,
    }
