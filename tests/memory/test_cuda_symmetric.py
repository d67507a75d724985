"""SymmetricMemory on real GPUs. Skipped (with the reason) where the hardware is absent;
scripts/gpu_check.sh runs these on a GPU machine."""

from __future__ import annotations

import pytest
import torch

from moonep_ep.launch import run_ranks
from moonep_ep.tools.commands.selftest import selftest_rank
from tests.support.memory import decision_mismatch


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _multicast_gpus() -> bool:
    if _gpus() < 2:
        return False
    from moonep_ep.memory.cuda import CudaDriver

    with CudaDriver(device=0) as probe:
        return bool(probe.capabilities().multicast)


@pytest.mark.cuda
@pytest.mark.skipif(_gpus() < 1, reason="needs a CUDA GPU")
def test_two_processes_on_one_gpu_map_each_other():
    # Export/import across processes on one device; gloo carries metadata. The handle type is what the
    # vote saw (fabric where an IMEX channel lets the trial pass, else POSIX fds), with the reason.
    from moonep_ep.memory.cuda import CudaDriver

    with CudaDriver(device=0) as probe:
        fabric = bool(probe.capabilities().fabric)
    results = run_ranks(selftest_rank, 2, args=("cuda", 64 << 20, 2), backend="gloo", use_cuda=True,
                        timeout_s=180)
    for res in results:
        assert res["errors"] == [] and res["leaked_driver_objects"] == {}
        assert decision_mismatch(res["first_cycle"], fabric) is None
        assert res["first_cycle"]["multicast"]["used"] is False  # one GPU: no team


@pytest.mark.multi_gpu
@pytest.mark.nvswitch
@pytest.mark.skipif(not _multicast_gpus(), reason="needs >= 2 GPUs with multicast (NVSwitch + Fabric Manager)")
def test_multicast_across_gpus():
    world = min(_gpus(), 4)
    results = run_ranks(selftest_rank, world, args=("cuda", 64 << 20, 1), backend="nccl", timeout_s=180)
    for res in results:
        assert res["errors"] == [] and res["leaked_driver_objects"] == {}
        assert res["first_cycle"]["multicast"]["used"]
        assert res["first_cycle"]["multicast"]["members_updated"] == world
