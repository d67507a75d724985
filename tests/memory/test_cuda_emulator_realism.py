"""What a real driver does that a kinder emulator would hide, each with its control.

* Lazy loading: CUDA loads a module's kernels into device memory at their first launch (the
  default since CUDA 12.2, ``CUDA_MODULE_LOADING=LAZY`` in the CUDA programming guide); the driver
  keeps that memory and ``cuMemGetInfo`` counts it. A device-wide reading taken before anything
  ran (``selftest``'s, ``footprint --measure``'s) must come after a warm-up.
* Multicast that fails part-way: ``cuMulticastCreate``, ``cuMulticastAddDevice``,
  ``cuMulticastBindMem`` and ``cuMemMap`` of the multicast handle may return
  MULTICAST_RESOURCE_FULL, ILLEGAL_STATE (Fabric Manager restarted, NVIDIA/nccl#1788),
  SYSTEM_NOT_READY (a transient FM stall, meta-pytorch/torchcomms#3130), OUT_OF_MEMORY or
  INVALID_DEVICE. PyTorch's ``init_multicast_for_block`` (CUDASymmetricMemory.cu) all-gathers every
  rank's outcome and goes on without multicast; with ``MOONEP_EP_MULTICAST=auto`` so do we.
* Cliques still forming: NCCL (``ncclNvmlDeviceGetGpuFabricInfoV``), NVSHMEM, FlashInfer
  (``comm/mnnvl.py``: ``is_mnnvl_fabric_supported``) and vLLM trust a GPU's fabric clique only when
  NVML reports the fabric state COMPLETED and a non-zero cluster UUID: while the Fabric Manager
  registers the GPU, or outside any fabric, the UUID is all zeros and every host looks like one
  clique.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest
import torch

from moonep_ep.errors import CollectiveError
from moonep_ep.memory.cuda import CudaDriver
from moonep_ep.memory.driver import HandleType
from moonep_ep.memory.exchange import vote
from moonep_ep.testing.cuda_emulator import EmulatedCudaApi, NodeSpec, NodeSpecError
from moonep_ep.launch import run_ranks
from tests.memory.test_cuda_domain import domain_allocate
from tests.support.cli import moonep_ep, moonep_ep_json
from tests.support.memory import bind_and_map_multicast, unmap_and_release_multicast

MiB = 1 << 20
FD = HandleType.POSIX_FD
LAZY = 2 * MiB  # node.LAZY_LOAD_BYTES, restated: the emulator's stated lazy-load figure

pytestmark = pytest.mark.cuda_emulated


# -- lazy loading ------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec,taken", [("", LAZY), (",lazy=0", 0), (",lazy=6MiB", 6 * MiB)])
def test_a_modules_first_launch_takes_device_memory_that_nothing_frees(spec, taken):
    """The first multimem store takes the stated bytes (cuMemGetInfo shows them), the second takes
    nothing more, and neither the module's unload nor the context's release returns them. Control:
    ``lazy=0`` takes nothing, so the figure is the lazy load's."""
    node = f"H100x2,node=lazy{os.getpid()}{spec}"  # a node of its own: device-wide figures stay ours
    drv = CudaDriver(device=0, rank=0, api=EmulatedCudaApi(node, visible="0", record=True))

    def used() -> int:
        free, total = drv.memory_info()
        return total - free

    mc = drv.multicast_create(2 * MiB, 1, FD)
    mem, uc, va = bind_and_map_multicast(drv, mc, 2 * MiB)
    before = used()
    data = torch.arange(4096, dtype=torch.int32).to(torch.uint8)
    drv.multimem_store(va, data)
    first = used() - before
    drv.multimem_store(va + 4096, data)
    second = used() - before
    assert (first, second) == (taken, taken)
    unmap_and_release_multicast(drv, mc, mem, uc, va, 2 * MiB)
    api = drv.api
    drv.close()  # unloads the module and releases the context
    assert not any(api.live().values()), api.live()
    # What this process created is gone; the lazily loaded code is not.
    assert api.device_used_bytes(0) == taken and api.device_bytes_in_use() == 0
    assert "cuModuleUnload" in api.names() and "cuDevicePrimaryCtxRelease" in api.names()


def test_the_lazy_figure_is_a_node_spec_option_with_a_clear_error():
    assert NodeSpec.parse("H100x2").lazy_load == LAZY and NodeSpec.parse("H100x2,lazy=0").lazy_load == 0
    with pytest.raises(NodeSpecError, match="lazy="):
        NodeSpec.parse("H100x2,lazy=lots")


@pytest.fixture
def emulator(monkeypatch):
    monkeypatch.setenv("MOONEP_EP_CUDA_EMULATOR", "1")
    monkeypatch.setenv("MOONEP_EP_CUDA_EMULATOR_NODE", "H100x8")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("MOONEP_EP_MULTICAST", raising=False)


@pytest.mark.slow
def test_selftest_reads_the_device_wide_figure_after_a_warm_up(emulator):
    """Lazy loading on (the emulator's default): the warm-up launches the multimem store once, so the
    device-wide figure (cuMemGetInfo, every process on the GPU and the driver's code) does not move
    over the measured cycle on any rank."""
    out = moonep_ep_json("selftest", "--ranks", "2", "--driver", "cuda")
    assert out["ok"] is True and out["multicast"]["used"] and out["multicast"]["members_updated"] == 2
    assert out["device_wide_drift_bytes_per_rank"] == [0, 0]
    assert "multimem store" in out["warm_up"]


@pytest.mark.slow
@pytest.mark.parametrize("lazy,drift,ok", [("", [LAZY, 0], False), (",lazy=0", [0, 0], True)])
def test_selftest_without_the_warm_up_counts_the_lazy_load_control(monkeypatch, emulator, lazy, drift, ok):
    """Negative control of the warm-up: read before any kernel ran, rank 0 (the one rank that launches
    the multimem store) sees the lazy load as device-wide growth and the selftest fails. With
    ``lazy=0`` the same reading is flat: the failure is the lazy load's, not the warm-up's absence as such."""
    monkeypatch.setenv("MOONEP_EP_CUDA_EMULATOR_NODE", f"H100x8{lazy}")
    proc = moonep_ep("selftest", "--ranks", "2", "--driver", "cuda", "--skip-warm-up", "--json")
    import json

    out = json.loads(proc.stdout)
    assert out["device_wide_drift_bytes_per_rank"] == drift and out["warm_up"] is None
    assert out["ok"] is ok and proc.returncode == (0 if ok else 1)
    assert out["leaked_device_bytes"] == 0  # the store's own memory was all returned: only the code stayed


# -- multicast that degrades ----------------------------------------------------------------------------

#: (step, injected CUresult, the domain GPU that fails it): create/export happen on rank 0 only,
#: import on the others; add, bind and map fail on rank 1 alone, so rank 0 must undo its own steps.
MC_CASES = [("create", "MULTICAST_RESOURCE_FULL", 0), ("create", "OUT_OF_MEMORY", 0),
            ("export", "ILLEGAL_STATE", 0), ("import", "INVALID_DEVICE", 1),
            ("add", "INVALID_DEVICE", 1), ("add", "ILLEGAL_STATE", 1),
            ("bind", "MULTICAST_RESOURCE_FULL", 1), ("bind", "SYSTEM_NOT_READY", 1),
            ("bind", "ILLEGAL_STATE", None), ("map", "OUT_OF_MEMORY", 1), ("map", "MULTICAST_RESOURCE_FULL", None)]


#: The collective step of ``SymmetricMemory`` each driver step runs in (export is part of create).
STEP_NAMES = {"create": "multicast create", "export": "multicast create", "import": "multicast import",
              "add": "multicast add device", "bind": "multicast bind", "map": "multicast map"}


def multicast_cases(ctx: Any, cases: list, modes: list[str]) -> list[dict[str, Any]]:
    """Each (case, mode): a fresh emulated node whose spec injects the failure, one collective
    allocation with multicast, a write into the peer's chunk and a read of it, teardown, and what the
    emulator still holds."""
    from moonep_ep.memory.symmetric import SymmetricMemory

    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("moonep_ep.memory").addHandler(handler)
    out = []
    for case in cases:
        for mode in modes:
            node = "H100x8" if case is None else f"H100x8,mc_fail={case[0]}:{case[1]}" + (
                "" if case[2] is None else f"@{case[2]}")
            os.environ["MOONEP_EP_MULTICAST"] = mode
            drv = CudaDriver(device=ctx.rank, rank=ctx.rank, api=EmulatedCudaApi(node, visible=None))
            del logged[:]
            res: dict[str, Any] = {"case": case, "mode": mode}
            try:
                symm = SymmetricMemory.allocate([4 * MiB], driver=drv, multicast=True)
                try:
                    res["used"], res["reason"] = symm.has_multicast, symm.decision.reason
                    view = symm.map_chunks(0)
                    peer = (ctx.rank + 1) % ctx.world_size
                    bytes_ = view.bytes()
                    bytes_[peer * 4 * MiB:peer * 4 * MiB + 8].fill_(ctx.rank + 1)
                    symm.comm.barrier("written")
                    res["read"] = int(bytes_[ctx.rank * 4 * MiB])  # written by the previous rank
                    del bytes_
                    view.close()
                finally:
                    symm.close()
            except CollectiveError as exc:
                res["error"] = str(exc)
            res["logged"] = list(logged)
            api = drv.api
            drv.close()
            res["live"] = {k: v for k, v in api.live().items() if v}
            res["device_bytes"] = api.device_bytes_in_use()
            out.append(res)
    return out


@pytest.mark.slow
def test_auto_multicast_goes_on_without_it_on_every_rank_at_any_step_and_on_fails_naming_the_fix(monkeypatch):
    """Every injected error at every step: with ``auto`` both ranks allocate without multicast, in
    lockstep (the same reason on both, naming the failing rank, the step and the driver's error; one
    log line each), and their chunks still work; with ``on`` both ranks raise one error naming the fix.
    Nothing leaks on either path. Control: with no injected failure both ranks use multicast, so the
    set-up reaches every step the cases break."""
    monkeypatch.setenv("MOONEP_EP_MC_BIND_RETRIES", "1")
    results = run_ranks(multicast_cases, 2, args=([None] + MC_CASES, ["auto", "on"]), timeout_s=300)
    by_case: dict[Any, list] = {}
    for rank, rows in enumerate(results):
        for row in rows:
            assert row["live"] == {} and row["device_bytes"] == 0, (rank, row)  # nothing leaks, any path
            by_case.setdefault((row["case"] and tuple(row["case"]), row["mode"]), []).append((rank, row))
    for mode in ("auto", "on"):  # control
        for rank, row in by_case[(None, mode)]:
            assert row["used"] and "error" not in row and row["read"] == (rank - 1) % 2 + 1, row
    for step, code, gpu in MC_CASES:
        auto = by_case[((step, code, gpu), "auto")]
        reasons = {row["reason"] for _, row in auto}
        assert len(reasons) == 1, reasons  # the same decision on every rank
        reason = reasons.pop()
        failing = 0 if gpu is None else gpu
        assert f"multicast: off (rank {failing} failed at '{STEP_NAMES[step]}" in reason, reason
        assert f"CUDA_ERROR_{code}" in reason, reason
        for rank, row in auto:
            assert row["used"] is False and "error" not in row and row["read"] == (rank - 1) % 2 + 1, row
            assert len(row["logged"]) == 1 and f"[rank {rank}] multicast: off on every rank" in row["logged"][0]
            assert f"CUDA_ERROR_{code}" in row["logged"][0] and f"rank {failing} failed at" in row["logged"][0]
        for rank, row in by_case[((step, code, gpu), "on")]:
            assert "used" not in row and f"[rank {rank}]" in row["error"], row
            assert f"CUDA_ERROR_{code}" in row["error"] and "Fix: MOONEP_EP_MULTICAST=auto" in row["error"]
            assert row["logged"] == []


def test_a_multicast_failure_spec_names_step_code_and_gpu_or_says_what_is_accepted():
    assert NodeSpec.parse("H100x8,mc_fail=bind:MULTICAST_RESOURCE_FULL").mc_fail == (
        "bind", "CUDA_ERROR_MULTICAST_RESOURCE_FULL", None)
    assert NodeSpec.parse("H100x8,mc_fail=map:CUDA_ERROR_OUT_OF_MEMORY@3").mc_fail == ("map", "CUDA_ERROR_OUT_OF_MEMORY", 3)
    for bad, why in [("H100x8,mc_fail=unbind:ILLEGAL_STATE", "step one of"), ("H100x8,mc_fail=bind", "<step>:<CODE>"),
                     ("H100x8,mc_fail=bind:ILLEGAL_STATE@8", "GPUs 0..7")]:
        with pytest.raises(NodeSpecError, match=why):
            NodeSpec.parse(bad)


# -- cliques: trusted only when the fabric is ready ---------------------------------------------------------

DOMAIN = "GB200x8,hosts=2,imex=domain,cuda=13.4"


def _caps(spec: str, host: int = 0):
    drv = CudaDriver(device=0, rank=0, api=EmulatedCudaApi(spec, visible="0", host=host, record=True))
    return drv, drv.capabilities()


@pytest.mark.parametrize("state", ["registering", "outside"])
def test_a_zero_cluster_uuid_is_not_a_clique(state):
    """Registration in progress (state IN_PROGRESS) and a GPU outside any fabric (COMPLETED, no
    cluster) both answer the clique calls with an all-zero UUID: no clique is reported, with the
    reason. Control: the same domain, registered, reports unicast and multicast cliques."""
    drv, caps = _caps(f"{DOMAIN},fabric_state={state}")
    assert caps.clique == "" and caps.multicast_clique == "" and "all zeros" in caps.reasons["clique"]
    assert drv.api.gpu_fabric_state(0) == ("IN_PROGRESS" if state == "registering" else "COMPLETED")
    drv.close()
    drv, caps = _caps(DOMAIN)
    assert caps.clique.endswith("/0x7ffe") and caps.multicast_clique.endswith("/0x7ffe") and "clique" not in caps.reasons
    # The clique count is queried, not assumed: cuDeviceGetCliqueInfo is asked for what cuDeviceGetCliqueCount said.
    assert [int(a[0]) for a in drv.api.calls_of("cuDeviceGetCliqueInfo")] == [2]
    assert "cuDeviceGetCliqueCount" in drv.api.names()
    drv.close()


def test_a_clique_is_not_trusted_unless_the_fabric_state_is_completed(monkeypatch):
    """A non-zero UUID is not enough: NCCL, NVSHMEM and FlashInfer require the state COMPLETED too."""
    drv = CudaDriver(device=0, rank=0, api=EmulatedCudaApi(DOMAIN, visible="0", record=True))
    monkeypatch.setattr(drv.api, "gpu_fabric_state", lambda dev: "IN_PROGRESS", raising=False)
    caps = drv.capabilities()
    assert caps.clique == "" and "IN_PROGRESS, not COMPLETED" in caps.reasons["clique"]
    drv.close()


@pytest.mark.slow
@pytest.mark.parametrize("state", ["registering", "outside", "completed"])
def test_hosts_whose_fabric_is_not_ready_are_proven_by_the_trial_not_trusted(state):
    """Two ranks on two hosts. Not ready: no clique is trusted, so the fabric trial runs and fails,
    and every rank refuses with the hosts and the fix -- not the opaque INVALID_HANDLE a trusted
    all-zero 'clique' leads to at import time. Control: registered, the clique is trusted and the
    ranks allocate over fabric with no trial."""
    node = f"{DOMAIN},fabric_state={state}"
    env = {"MOONEP_EP_CUDA_EMULATOR": "1", "MOONEP_EP_CUDA_EMULATOR_NODE": node, "CUDA_VISIBLE_DEVICES": "0"}
    results = run_ranks(domain_allocate, 2, args=(node, [0, 1]), env=env, timeout_s=120)
    for rank, out in enumerate(results):
        assert out["live"] == {}, out
        if state == "completed":
            assert out.get("handle_type") == "fabric" and out["driver_errors"] == [], out
        else:
            assert f"[rank {rank}]" in out.get("error", ""), out
            assert "trial failed" in out["error"] and "node0-host0" in out["error"] and "node0-host1" in out["error"]
            assert "Fix:" in out["error"]


def _peer(rank: int, clique: str, mc_clique: str) -> dict[str, Any]:
    """Rank ``rank`` of four, two per host, each on its own GPU."""
    return {"host": f"h{rank // 2}", "clique": clique, "mc_clique": mc_clique, "fd": True, "fabric": True,
            "multicast": True, "device": f"GPU-{rank}", "driver": "cuda", "prefs": (None, None)}


def test_the_multicast_decision_uses_the_multicast_clique():
    """One unicast clique over two hosts, two multicast cliques: fabric yes, multicast no, naming the
    ranks. Controls: one multicast clique, and an unreported one (tried; auto degrades if it fails)."""
    split = vote([_peer(r, "c/0x7ffe", f"c/{0x7ffe + r // 2:#x}") for r in range(4)], 0)
    assert split.handle_type == HandleType.FABRIC and not split.multicast and "rank(s) [2, 3] lack it" in split.reason
    assert vote([_peer(r, "c/0x7ffe", "c/0x7ffe") for r in range(4)], 0).multicast
    assert vote([_peer(r, "c/0x7ffe", "") for r in range(4)], 0).multicast
    drv, caps = _caps(f"{DOMAIN},mc_cliques=2", host=1)
    assert caps.clique.endswith("/0x7ffe") and caps.multicast_clique.endswith("/0x7fff")  # host 1: second mc clique
    drv.close()


# -- the one-GPU test's rule, over the emulator ---------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("imex,used", [("none", "fd"), ("domain", "fabric")])
def test_two_ranks_on_one_gpu_use_what_the_vote_saw_with_the_reason(imex, used):
    """The emulated twin of ``test_cuda_symmetric.test_two_processes_on_one_gpu_map_each_other`` on a
    one-H200 node: without an IMEX channel the trial fails and both ranks fall back to fds; with one,
    fabric is kept. The rule accepts both. Control: the rule rejects a decision that contradicts the vote."""
    from tests.support.memory import decision_mismatch
    from moonep_ep.tools.commands.selftest import selftest_rank

    env = {"MOONEP_EP_CUDA_EMULATOR": "1", "MOONEP_EP_CUDA_EMULATOR_NODE": f"H200x1,imex={imex}",
           "CUDA_VISIBLE_DEVICES": "0"}
    for res in run_ranks(selftest_rank, 2, args=("cuda", 4 * MiB, 1), env=env, timeout_s=120):
        first = res["first_cycle"]
        assert res["errors"] == [] and first["handle_type"] == used and not first["multicast"]["used"]
        assert decision_mismatch(first, fabric_supported=True) is None, first
        assert decision_mismatch(first, fabric_supported=False) is not None  # control: the vote saw fabric
        wrong = {**first, "handle_type": "fabric" if used == "fd" else "fd"}
        assert decision_mismatch(wrong, fabric_supported=True) is not None  # control: type without its reason
