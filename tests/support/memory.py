"""Leak checks and sizes shared by the multi-process memory tests."""

from __future__ import annotations

import gc

from moonep_ep.memory.accounting import snapshot
from moonep_ep.memory.host import HostDriver

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

    from moonep_ep.tools.launch import plan_launch, run_ranks

    saved = {k: os.environ.get(k) for k in EMULATOR_ENV}
    os.environ.update(EMULATOR_ENV)
    try:
        plan = plan_launch("cuda", world)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert plan.emulated and plan.backend == "gloo", plan
    return run_ranks(fn, world, args=args, backend=plan.backend, env=EMULATOR_ENV, rank_envs=plan.rank_envs,
                     timeout_s=timeout_s, **kw)
