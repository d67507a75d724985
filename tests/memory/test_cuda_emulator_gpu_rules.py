"""Emulator rules added before the first run on a GPU machine, each broken on purpose (as test_cuda_emulator.py):
peer access in cuMemSetAccess, asynchronous sticky kernel faults, a node-wide cuMemGetInfo, and the
multicast granularity query's size. (Multi-host domains: test_cuda_domain.py.)
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid
from typing import Any

import pytest
import torch

from moonep_ep.errors import DriverError
from moonep_ep.memory import multimem
from moonep_ep.memory.cuda import CudaDriver
from moonep_ep.memory.driver import HandleType
from moonep_ep.testing.cuda_emulator import EmulatedCudaApi
from moonep_ep.launch import run_ranks
from tests.memory.test_cuda_emulator import _multicast_range
from tests.support.memory import unmap_and_release_multicast

MiB = 1 << 20
FD = HandleType.POSIX_FD

pytestmark = pytest.mark.cuda_emulated


@pytest.mark.parametrize("p2p", [0, 1])
def test_access_to_another_gpus_memory_needs_a_peer_path(p2p):
    """cudaDeviceEnablePeerAccess returns InvalidDevice when cuDeviceCanAccessPeer says 0; VMM's
    cuMemSetAccess grants the same peer access per mapping. Control: with p2p=1 it is granted."""
    api = EmulatedCudaApi(f"H200x2,p2p={p2p}", visible="0,1", record=True)
    gpu0, gpu1 = CudaDriver(device=0, api=api), CudaDriver(device=1, api=api)
    assert gpu0.can_access_peer(1) is bool(p2p)
    h = gpu1.create(2 * MiB, FD)                      # GPU 1's memory ...
    api.cuCtxSetCurrent(gpu0._ctx)                    # (one thread, two drivers: GPU 0's context again)
    va = gpu0.reserve(2 * MiB, 2 * MiB)
    gpu0.map(va, 2 * MiB, h, 0)
    if p2p:
        gpu0.set_access(va, 2 * MiB)                  # ... read/write from GPU 0 over the peer path
        gpu0.as_tensor(va, 2 * MiB, None)[:4].fill_(7)
    else:
        with pytest.raises(DriverError) as info:
            gpu0.set_access(va, 2 * MiB)
        assert info.value.code == "CUDA_ERROR_INVALID_DEVICE" and "no peer path" in api.last_error
        with pytest.raises(DriverError, match="no read/write access"):
            gpu0.as_tensor(va, 2 * MiB, None)       # nothing was granted
    gpu0.unmap(va, 2 * MiB)
    gpu0.free_reservation(va, 2 * MiB)
    gpu1.release(h)
    gpu0.close()
    gpu1.close()
    assert not any(api.live().values()), api.live()


def test_a_kernel_fault_surfaces_later_and_poisons_the_context():
    """A fault inside a kernel (here: multimem's v4 load from a source that is not 16-byte aligned,
    PTX ISA: vector accesses are naturally aligned) is asynchronous: the launch succeeds, the next
    call fails (cuCtxSynchronize), and so does every call in that context afterwards (sticky), while
    context-free queries still answer. The emulator used to raise at the launch and stay usable."""
    drv = CudaDriver(device=0, rank=0, api=EmulatedCudaApi("H100x2", visible="0", record=True))
    mc, mem, uc, va = _multicast_range(drv)
    kernel = multimem.MultimemKernel.load(drv)
    src = torch.zeros(4096 + 16, dtype=torch.uint8)
    params = multimem.kernel_params(va, src.data_ptr() + 4, 4096 // 16)
    drv._cu("cuLaunchKernel", kernel.function, 1, 1, 1, 256, 1, 1, 0, 0, params, 0)   # succeeds
    with pytest.raises(DriverError) as info:
        drv.synchronize()
    assert info.value.code == "CUDA_ERROR_MISALIGNED_ADDRESS"
    with pytest.raises(DriverError) as again:
        drv.reserve(2 * MiB, 2 * MiB)                # any later call in the context
    assert again.value.code == "CUDA_ERROR_MISALIGNED_ADDRESS"
    assert int(drv.api.cuDeviceGetCount()[0]) == 0   # no context needed: still answers


def test_the_library_refuses_a_misaligned_source_before_the_launch():
    """multimem.py checks the source's alignment too, so the kernel never faults: a clear error at the
    call, no launch, and the context stays usable (negative control of the check: the test above)."""
    drv = CudaDriver(device=0, rank=0, api=EmulatedCudaApi("H100x2", visible="0", record=True))
    mc, mem, uc, va = _multicast_range(drv)
    src = torch.arange(4096 + 16, dtype=torch.int64).to(torch.uint8)
    with pytest.raises(DriverError, match="16-byte aligned"):
        drv.multimem_store(va, src[4:4 + 4096])
    assert "cuLaunchKernel" not in drv.api.names()
    drv.synchronize()                                # usable
    drv.multimem_store(va, src[16:16 + 4096].clone())
    assert torch.equal(drv.as_tensor(uc, 4096, None), src[16:16 + 4096])
    unmap_and_release_multicast(drv, mc, mem, uc, va, 2 * MiB)
    drv.close()
    assert not any(drv.api.live().values()), drv.api.live()


def misaligned_multicast_write(ctx: Any) -> list[int]:
    from moonep_ep.memory import make_driver
    from moonep_ep.memory.symmetric import SymmetricMemory

    with make_driver("cuda", rank=ctx.rank) as driver:
        symm = SymmetricMemory.allocate([2 * MiB], driver=driver, multicast=True)
        try:
            src = torch.arange(64 + 4, dtype=torch.int32)
            symm.multicast_write(32, src[1:65])        # a view 4 bytes into its storage
            view = symm.map_chunks(0)
            got = view.bytes()[32:32 + 256].view(torch.int32).tolist()
            view.close()
            return got
        finally:
            symm.close()


@pytest.mark.slow
def test_multicast_write_of_a_misaligned_view_lands_whole():
    """SymmetricMemory.multicast_write copies a misaligned source to aligned memory first."""
    env = {"MOONEP_EP_CUDA_EMULATOR": "1", "MOONEP_EP_CUDA_EMULATOR_NODE": "H100x2,fabric=0",
           "CUDA_VISIBLE_DEVICES": "0"}
    (got,) = run_ranks(misaligned_multicast_write, 1, env=env, timeout_s=120)
    assert got == list(range(1, 65))


def _free(api: EmulatedCudaApi) -> int:
    return int(api.cuMemGetInfo()[1])


def _context(api: EmulatedCudaApi) -> EmulatedCudaApi:
    api.cuInit(0)
    _, ctx = api.cuDevicePrimaryCtxRetain(0)
    api.cuCtxSetCurrent(ctx)
    return api


def test_cuda_mem_get_info_is_device_wide_over_every_process():
    """cuMemGetInfo reports the device's free memory: other processes' allocations on the GPU count
    (what footprint --measure and selftest must allow for on a GPU). The emulator used to count only
    the calling process. Another GPU's and another node's allocations do not count."""
    node = f"H100x2,node=meminfo-{uuid.uuid4().hex[:8]}"
    mine = CudaDriver(device=0, api=EmulatedCudaApi(node, visible="0"))
    reader = _context(EmulatedCudaApi(node, visible="0"))
    start = _free(reader)
    h = mine.create(4 * MiB, FD)                        # another driver instance, this process
    assert _free(reader) == start - 4 * MiB
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from moonep_ep.memory.cuda import CudaDriver
        from moonep_ep.memory.driver import HandleType
        from moonep_ep.testing.cuda_emulator import EmulatedCudaApi
        d = CudaDriver(device=0, api=EmulatedCudaApi({node!r}, visible="0"))
        other = CudaDriver(device=0, api=EmulatedCudaApi({node!r}, visible="1"))
        elsewhere = CudaDriver(device=0, api=EmulatedCudaApi("H100x2,node=elsewhere-{node[-8:]}", visible="0"))
        hs = [d.create(6 << 20, HandleType.POSIX_FD), other.create(8 << 20, HandleType.POSIX_FD),
              elsewhere.create(2 << 20, HandleType.POSIX_FD)]
        print("held", flush=True)
        sys.stdin.readline()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        assert _free(reader) == start - 10 * MiB          # + the child's 6 MiB on GPU 0 only
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    assert _free(reader) == start - 4 * MiB               # gone with the process
    mine.release(h)
    assert _free(reader) == start
    mine.close()


def test_the_multicast_granularity_query_describes_an_object_of_positive_size():
    """NCCL (nvls.cc) sets prop.size before cuMulticastGetGranularity; a zero-size prop is refused.
    CudaDriver queries with one allocation page."""
    api = EmulatedCudaApi("H100x8", visible="0", record=True)
    drv = CudaDriver(device=0, api=api)
    assert drv.multicast_granularity(8, FD) == 2 * MiB
    (prop, _flag), = api.calls_of("cuMulticastGetGranularity")
    assert int(prop.size) == drv.granularity(FD) and int(prop.numDevices) == 8
    zero = drv._mc_prop(0, 8, FD)
    result = api.cuMulticastGetGranularity(zero, api.CUmulticastGranularity_flags.CU_MULTICAST_GRANULARITY_MINIMUM)
    assert result[0].name == "CUDA_ERROR_INVALID_VALUE" and "size" in api.last_error
    drv.close()
