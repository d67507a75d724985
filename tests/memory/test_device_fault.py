"""A rank that fails on the device (issue 43): a sticky CUDA fault on one rank in the middle of a step.

A device-side failure (a ``torch._assert_async`` guard, an illegal address) poisons that rank's CUDA
context for the rest of the process: every later driver call returns the same error (the driver's
documentation of CUDA_ERROR_ASSERT: "The context cannot be used anymore, and must be destroyed").
The emulator plants one (``plant_device_fault``). Over it, three ranks build the sharded expert store
and load it; the victim's fault lands during the load's device work and surfaces at the
``cuCtxSynchronize`` of ``finish_loading``, inside its lockstep step: every rank raises the same
``CollectiveError`` naming the victim and ``CUDA_ERROR_ASSERT``, at once, whether the victim then exits
or stays alive, closes, and holds nothing afterwards. A victim that hangs on the device before it reaches
the step (a kernel that never returns) is lost at the group timeout: ``PeerLostError``, not a hang.
Ranks that meet at different steps fail alike instead of completing each other's round. Control: the
same run without the fault succeeds. docs/design/reliability.md ("A rank that fails on the device").
"""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any
from unittest import mock

import pytest
import torch

from moonep_ep.errors import DriverError, MoonEPError
from moonep_ep.launch import RankFailure
from moonep_ep.memory.cuda import CudaDriver
from moonep_ep.memory.driver import HandleType
from moonep_ep.testing.cuda_emulator import EmulatedCudaApi
from tests.support.memory import EMULATOR_ENV, holdings, leaks, run_emulated_ranks

pytestmark = pytest.mark.cuda_emulated

MiB = 1 << 20
WORLD, VICTIM = 3, 1
TIMEOUT_S = 10.0
#: the CUDA emulator's memfd names (objects.MEM_PREFIX, MC_PREFIX); ".driver-" ones are the driver's own
#: memory (lazy-loaded modules), which only the process's exit frees, as on a GPU
EMULATOR_MEMFD = "/memfd:cudaemu."


# -- the emulator's sticky fault, in one process ---------------------------------------------------------
def _mapped_range(drv: CudaDriver) -> tuple[int, int]:
    h = drv.create(2 * MiB, HandleType.POSIX_FD)
    va = drv.reserve(2 * MiB, 2 * MiB)
    drv.map(va, 2 * MiB, h, 0)
    drv.set_access(va, 2 * MiB)
    return h, va


@pytest.mark.parametrize("planted", [False, True])
def test_a_planted_device_fault_fails_every_later_call_in_the_context(planted):
    """After the fault every call in the context returns CUDA_ERROR_ASSERT (710) -- synchronize, the
    teardown calls, the context calls, a kernel launch -- and nothing is given back (the process's exit
    does that); context-free queries still answer. Control (planted=False): the same calls succeed and
    leave nothing behind."""
    api = EmulatedCudaApi("H100x2", visible="0", record=True)
    drv = CudaDriver(device=0, rank=1, api=api)
    h, va = _mapped_range(drv)
    if planted:
        api.plant_device_fault("CUDA_ERROR_ASSERT", after_calls=1)
    drv.synchronize()                                 # the one call let through
    teardown = [("cuCtxSynchronize", drv.synchronize), ("cuMemUnmap", lambda: drv.unmap(va, 2 * MiB)),
                ("cuMemRelease", lambda: drv.release(h)),
                ("cuMemAddressFree", lambda: drv.free_reservation(va, 2 * MiB))]
    for call, step in teardown:
        if not planted:
            step()
            continue
        with pytest.raises(DriverError) as info:
            step()
        assert info.value.code == "CUDA_ERROR_ASSERT" and info.value.call == call, info.value
        assert str(info.value).startswith("[rank 1] cuda driver: " + call), info.value
    context_calls = {"cuCtxSetCurrent": api.cuCtxSetCurrent(drv._ctx), "cuCtxGetCurrent": api.cuCtxGetCurrent(),
                     "cuDevicePrimaryCtxRetain": api.cuDevicePrimaryCtxRetain(0)}
    if not planted:
        api.cuDevicePrimaryCtxRelease(0)              # the retain just taken
    context_calls["cuDevicePrimaryCtxRelease"] = api.cuDevicePrimaryCtxRelease(0)  # the driver's own retain
    want = "CUDA_ERROR_ASSERT" if planted else "CUDA_SUCCESS"
    assert {call: result[0].name for call, result in context_calls.items()} == dict.fromkeys(context_calls, want)
    assert int(api.cuDeviceGetCount()[0]) == 0        # no context needed: still answers
    if planted:
        with pytest.raises(RuntimeError, match="CUDA error: CUDA_ERROR_ASSERT"):
            api.kernel_launched("torch-fill")         # a kernel launch fails as torch's does
        assert api.sticky_faults() == {0: "CUDA_ERROR_ASSERT"}
        live = api.live()
        assert live["mappings"] == live["allocations"] == live["reservations"] == live["contexts"] == 1, live
    else:
        assert api.sticky_faults() == {} and not any(api.live().values()), api.live()


def test_a_planted_fault_waits_for_a_context_and_counts_calls():
    """Planted before any context exists, the fault lands at the first call made with one (a kernel runs
    in a context); ``after_calls`` lets that many calls through first."""
    api = EmulatedCudaApi("H100x2", visible="0", record=True)
    api.plant_device_fault(after_calls=0)             # no context yet: pending
    drv = CudaDriver(device=0, rank=0, api=api)
    assert drv.granularity(HandleType.POSIX_FD) == 2 * MiB   # context-free calls answer ...
    with pytest.raises(DriverError, match="CUDA_ERROR_ASSERT"):
        drv.reserve(2 * MiB, 2 * MiB)                 # ... the first one in the context fails
    api2 = EmulatedCudaApi("H100x2", visible="0", record=True)
    drv2 = CudaDriver(device=0, rank=0, api=api2)
    drv2.synchronize()
    api2.plant_device_fault(code=710, after_calls=3)  # a CUresult's value works too
    for _ in range(3):
        drv2.synchronize()
    with pytest.raises(DriverError, match="CUDA_ERROR_ASSERT"):
        drv2.synchronize()
    with pytest.raises(AttributeError):
        api2.plant_device_fault("CUDA_ERROR_NO_SUCH_THING")


# -- a rank that fails on the device in the middle of a step ---------------------------------------------
def _below_the_library() -> dict[str, Any]:
    """What this process holds that the emulated driver cannot see itself: its open fds and the emulator's
    memfds (open or mapped; the driver's own memory, the lazy-loaded fill kernel, left out of both) and
    the /dev/shm files it holds."""
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass  # the listdir's own fd
    with open("/proc/self/maps") as maps:
        mapped = [parts[5].strip() for parts in (line.split(None, 5) for line in maps) if len(parts) == 6]
    memfds = [t for t in targets + mapped if t.startswith(EMULATOR_MEMFD) and ".driver-" not in t]
    driver_own = [t for t in targets if t.startswith(EMULATOR_MEMFD) and ".driver-" in t]
    return {"fds": len(targets) - len(driver_own), "emulator_memfds": len(memfds),
            "dev_shm": sorted({t for t in targets + mapped if t.startswith("/dev/shm/")})}


def device_fault_in_load(ctx: Any, victim: int | None, out_dir: str, then: str = "exit") -> dict[str, Any]:
    """Build the store and load it; ``victim``'s loader hits a device fault (planted) at its last expert.
    The victim records when and how it failed, then dies with the error; before that, ``then="linger"``
    stays alive and silent past the group timeout, ``then="teardown"`` closes its store (a collective).
    A survivor reports its error, when it came, and what it still holds after closing."""
    from moonep_ep.errors import MoonEPError
    from moonep_ep.layout.store import ShardedExpertStore, ffn_projections
    from moonep_ep.memory.group import GroupComm
    from moonep_ep.testing import cuda_emulator
    from moonep_ep.testing.cuda_emulator.objects import node_bytes_in_use, node_tag

    rank = ctx.rank
    driver = CudaDriver(device=0, rank=rank)  # the process-wide emulator, as a vLLM worker gets it
    gpus = GroupComm().all_gather_object(int(os.environ["CUDA_VISIBLE_DEVICES"]), "test: node GPUs")
    below_before, before = _below_the_library(), holdings(driver)  # after gloo's pairs connected
    projections = ffn_projections(256, 128)
    shapes = {p.name: p.shape for p in projections}
    out: dict[str, Any] = {"rank": rank, "error": None}
    store = ShardedExpertStore(num_layers=2, num_experts=2 * ctx.world_size, projections=projections,
                               num_slots=2, driver=driver)
    last = (1, projections[-1].name, (rank + 1) * store.experts_per_rank - 1)

    def loader(layer: int, proj: str, expert: int) -> torch.Tensor:
        if rank == victim and (layer, proj, expert) == last:
            # the kernel writing this expert fails on the device (an index guard), asynchronously
            cuda_emulator.plant_device_fault("CUDA_ERROR_ASSERT", why="torch._assert_async: expert index in range")
            out["t_fault"] = time.time()
            if then == "hang":  # a kernel that never returns: the victim reaches no collective
                with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
                    json.dump(out, f)
                time.sleep(TIMEOUT_S + 5)
        return torch.full(shapes[proj], float(expert), dtype=torch.bfloat16)

    try:
        store.load(loader)
    except MoonEPError as exc:
        out.update(error=str(exc), error_type=type(exc).__name__, t_error=time.time())
        if rank == victim:
            cause = exc.__cause__
            out.update(cause=str(cause), code=getattr(cause, "code", None), sticky=driver.api.sticky_faults())
            if then == "linger":
                time.sleep(TIMEOUT_S + 2)  # a worker slow to die: alive, in no collective
            with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
                json.dump(out, f)
            raise  # dies with the error (launch.run_ranks reports it, then os._exit)
    try:
        store.close()  # collective: a dead peer fails its barrier after every local release
    except MoonEPError as exc:
        out["close_error"] = type(exc).__name__
    del store
    driver.close()
    out["leaks"] = leaks(driver, before)
    out["below"], out["below_before"] = _below_the_library(), below_before
    out["context_retained"] = driver.holds_context()
    if victim is not None:
        # the victim's device memory: gone once it exited and every survivor released its imports (the
        # other survivor may still be closing, hence the wait)
        tag = node_tag(driver.api.node.node, os.environ["MOONEP_EP_CUDA_EMULATOR_MACHINE"])
        deadline = time.time() + 2 * TIMEOUT_S
        while node_bytes_in_use(tag, gpus[victim]) and time.time() < deadline:
            time.sleep(0.1)
        out["victim_device_bytes"] = node_bytes_in_use(tag, gpus[victim])
    return out


def _run(victim: int | None, tmp_path, then: str = "exit") -> tuple[Any, dict[int, str]]:
    """(results by rank, errors by rank) of one run; its own emulated machine, so the device-wide
    figures see no other test's ranks."""
    env = dict(EMULATOR_ENV, MOONEP_EP_TIMEOUT_S=str(TIMEOUT_S),
               MOONEP_EP_CUDA_EMULATOR_MACHINE=f"issue43-{uuid.uuid4().hex[:8]}")
    with mock.patch.dict(os.environ, env):
        try:
            return run_emulated_ranks(device_fault_in_load, WORLD, args=(victim, str(tmp_path), then),
                                      timeout_s=120, group_timeout_s=TIMEOUT_S), {}
        except RankFailure as failure:
            return failure.results, failure.errors


def _clean(res: dict) -> None:
    assert res["leaks"] == {}, res
    below, before = res["below"], res["below_before"]
    assert below["emulator_memfds"] == 0 and below["dev_shm"] == before["dev_shm"], res
    assert below["fds"] <= before["fds"], res  # fewer: the lost peer's gloo sockets
    assert not res["context_retained"], res


def _victim(tmp_path, errors: dict[int, str], hung: bool = False) -> dict:
    with open(tmp_path / f"rank{VICTIM}.json") as f:
        victim = json.load(f)
    if hung:
        return victim
    assert set(errors) == {VICTIM}, errors
    assert "CollectiveError" in errors[VICTIM] and "CUDA_ERROR_ASSERT" in errors[VICTIM], errors[VICTIM]
    # the sticky error through the driver's check, at the first call after the fault, inside the step
    assert victim["code"] == "CUDA_ERROR_ASSERT" and victim["sticky"] == {str(VICTIM): "CUDA_ERROR_ASSERT"}, victim
    assert victim["cause"].startswith(f"[rank {VICTIM}] cuda driver: cuCtxSynchronize -> CUDA_ERROR_ASSERT"), victim
    return victim


def _survivors_raise(results, victim: dict, kind: str, at_least_s: float, at_most_s: float) -> None:
    for rank in sorted(set(range(WORLD)) - {VICTIM}):
        res = results[rank]
        assert res["error_type"] == kind, res
        if kind == "CollectiveError":  # the victim named, with its error
            assert res["error"].startswith(f"[rank {rank}] collective step 'finish loading' failed on rank(s) "
                                           f"[{VICTIM}]:"), res
            assert f"rank {VICTIM}: DriverError: [rank {VICTIM}] cuda driver: cuCtxSynchronize -> " \
                   "CUDA_ERROR_ASSERT" in res["error"], res
        else:
            assert res["error"].startswith(f"[rank {rank}] lost contact with a peer during 'load experts'"), res
        seconds = res["t_error"] - victim["t_fault"]
        print(f"rank {rank}: {kind} {seconds:.2f} s after rank {VICTIM}'s device fault")
        assert at_least_s <= seconds <= at_most_s, (rank, seconds)
        _clean(res)
        assert res["victim_device_bytes"] == 0, res


@pytest.mark.slow
def test_without_a_device_fault_the_same_load_succeeds(tmp_path):
    """The control of the two below: the same run minus the planted fault."""
    results, errors = _run(None, tmp_path)
    assert errors == {}, errors
    for res in results:
        assert res["error"] is None and "close_error" not in res, res
        _clean(res)


@pytest.mark.slow
def test_a_rank_that_fails_on_the_device_is_named_by_every_survivor_at_once(tmp_path):
    """The victim's synchronize fails inside 'finish loading': the step carries its error to every rank
    (measured: well under a second after the fault on 2 cores), long before the timeout."""
    results, errors = _run(VICTIM, tmp_path)
    _survivors_raise(results, _victim(tmp_path, errors), "CollectiveError", 0, TIMEOUT_S / 2)


@pytest.mark.slow
def test_a_faulted_rank_that_stays_alive_is_named_at_once_too(tmp_path):
    """A victim slow to exit after its error: the survivors already know, from the step."""
    results, errors = _run(VICTIM, tmp_path, "linger")
    _survivors_raise(results, _victim(tmp_path, errors), "CollectiveError", 0, TIMEOUT_S / 2)


@pytest.mark.slow
def test_a_rank_hung_on_the_device_is_lost_at_the_group_timeout(tmp_path):
    """A victim whose kernel never returns reaches no collective: the survivors' step ends at
    MOONEP_EP_TIMEOUT_S with PeerLostError, not a hang."""
    results, errors = _run(VICTIM, tmp_path, "hang")
    _survivors_raise(results, _victim(tmp_path, errors, hung=True), "PeerLostError", TIMEOUT_S * 0.9,
                     TIMEOUT_S + 5)


def _different_steps(ctx: Any) -> str:
    from moonep_ep.memory.group import GroupComm

    try:
        GroupComm().barrier("finish loading" if ctx.rank == 0 else "close: peers done")
        return "no error"
    except MoonEPError as exc:
        return str(exc)


def test_ranks_that_meet_at_different_steps_fail_alike():
    """A rank that left its peers' step (a teardown after a failure of its own) must not complete their round:
    every metadata round carries its step's name. Control: the same barrier name on both passes."""
    from moonep_ep.launch import run_ranks

    got = run_ranks(_different_steps, 2)
    assert got[0].startswith("[rank 0] collective step 'finish loading' failed on rank(s) [1]:") and \
        "rank 1: was at step 'close: peers done', not 'finish loading'" in got[0], got
    assert got[1].startswith("[rank 1] collective step 'close: peers done' failed on rank(s) [0]:") and \
        "rank 0: was at step 'finish loading', not 'close: peers done'" in got[1], got
    assert run_ranks(_same_step, 2) == ["no error", "no error"]


def _same_step(ctx: Any) -> str:
    from moonep_ep.memory.group import GroupComm

    GroupComm().barrier("finish loading")
    return "no error"
