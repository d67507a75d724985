"""The CUDA driver emulator's rules, each broken on purpose.

A fake more lenient than the driver passes code a GPU rejects, so every rule
the emulator enforces has a test here that breaks it and expects the driver's
failure. Sources for each rule are cited where it is tested: the CUDA driver
API documentation (cuMem*/cuMulticast* reference), the PTX ISA, and how
PyTorch (``CUDASymmetricMemory.cu``), NCCL (``src/transport/nvls.cc``),
TensorRT-LLM (``tensorrt_llm/_mnnvl_utils.py``) and FlashInfer
(``flashinfer/comm/mnnvl.py``) use these calls.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest
import torch

from moonep_ep.errors import DriverError
from moonep_ep.memory import multimem
from moonep_ep.memory.cuda import CudaDriver
from moonep_ep.memory.driver import HandleType
from moonep_ep.testing.cuda_emulator import (PROFILES, EmulatedCudaApi, NodeSpec, NodeSpecError, UnknownCall,
                                             UnsupportedKernel, visible_gpus)
from moonep_ep.launch import run_ranks
from tests.support.memory import bind_and_map_multicast, unmap_and_release_multicast

MiB = 1 << 20
FD, FABRIC = HandleType.POSIX_FD, HandleType.FABRIC

pytestmark = pytest.mark.cuda_emulated


def _driver(node: str = "H100x2,imex=domain", visible: str | None = "0", device: int = 0) -> CudaDriver:
    return CudaDriver(device=device, rank=0, api=EmulatedCudaApi(node, visible=visible, record=True))


def _code(exc_info) -> str:
    return exc_info.value.code


def _mapped(drv: CudaDriver, size: int = 2 * MiB, access: bool = True) -> tuple[int, int]:
    h = drv.create(size, FD)
    va = drv.reserve(size, 2 * MiB)
    drv.map(va, size, h, 0)
    if access:
        drv.set_access(va, size)
    return h, va


def _teardown(drv: CudaDriver, h: int, va: int, size: int = 2 * MiB) -> None:
    drv.unmap(va, size)
    drv.free_reservation(va, size)
    drv.release(h)
    drv.close()
    assert not any(drv.api.live().values()), drv.api.live()


# -- granularity ----------------------------------------------------------------------------

def test_granularity_profiles_minimum_and_recommended_per_handle_type_and_for_multicast():
    """cuMemGetAllocationGranularity depends on the prop's handle types and the option;
    cuMulticastGetGranularity's RECOMMENDED can dwarf MINIMUM (512 MiB reported on 8xH100)."""
    h100 = _driver("H100x8")
    assert h100.granularity(FD) == 2 * MiB
    assert h100.multicast_granularity(8, FD) == 2 * MiB                       # MINIMUM
    assert h100.multicast_granularity(8, FD, recommended=True) == 512 * MiB   # RECOMMENDED
    b200 = _driver("B200x4")
    assert b200.multicast_granularity(4, FD, recommended=True) == PROFILES["B200"].mc_rec
    assert PROFILES["H200"].memory_bytes > PROFILES["H100"].memory_bytes
    # A node whose FABRIC prop has a larger granularity: the query answers per handle type,
    # and granularity(None) is the one valid for either (MoonEP's get_vmm_granularity).
    odd = _driver("H100x2,imex=domain,fabric_min=4MiB,fabric_rec=4MiB")
    assert (odd.granularity(FD), odd.granularity(FABRIC), odd.granularity()) == (2 * MiB, 4 * MiB, 4 * MiB)
    for d in (h100, b200, odd):
        d.close()


def test_planning_with_one_handle_type_and_allocating_with_another_fails():
    """PyTorch CUDASymmetricMemory.cu queries the granularity with the prop it allocates with:
    a size that fits the POSIX_FD granularity is INVALID_VALUE for a FABRIC prop needing 4 MiB."""
    drv = _driver("H100x2,imex=domain,fabric_min=4MiB,fabric_rec=2MiB")
    prop = drv._alloc_prop(FABRIC)
    result = drv.api.cuMemCreate(2 * MiB, prop, 0)
    assert result[0].name == "CUDA_ERROR_INVALID_VALUE" and "granularity 4194304" in drv.api.last_error
    drv.close()


# -- sizes and offsets -----------------------------------------------------------------------

def test_sizes_offsets_and_alignments_must_be_granularity_multiples():
    """Driver API docs: cuMemCreate size, cuMemMap offset/size/address, cuMemAddressReserve size,
    cuMulticastCreate size and cuMulticastBindMem offsets are multiples of the granularity."""
    drv = _driver()
    api = drv.api
    prop = drv._alloc_prop(FD)
    assert api.cuMemCreate(2 * MiB + 4096, prop, 0)[0].name == "CUDA_ERROR_INVALID_VALUE"
    drv._ensure_context()
    assert api.cuMemAddressReserve(MiB, 0, 0, 0)[0].name == "CUDA_ERROR_INVALID_VALUE"
    h = drv.create(4 * MiB, FD)
    va = drv.reserve(4 * MiB, 2 * MiB)
    with pytest.raises(DriverError) as info:
        drv.map(va, 2 * MiB, h, 64 << 10)  # offset inside a granule
    assert _code(info) == "CUDA_ERROR_INVALID_VALUE"
    mc_prop = drv._mc_prop(3 * MiB, 1, FD)
    assert api.cuMulticastCreate(mc_prop)[0].name == "CUDA_ERROR_INVALID_VALUE"
    mc = drv.multicast_create(4 * MiB, 1, FD)
    drv.multicast_add_device(mc)
    with pytest.raises(DriverError) as info:
        drv.multicast_bind(mc, MiB, h, 0, 2 * MiB)  # mc offset inside the multicast granule
    assert _code(info) == "CUDA_ERROR_INVALID_VALUE"
    drv.multicast_release(mc)
    drv.free_reservation(va, 4 * MiB)
    drv.release(h)
    drv.close()
    assert not any(api.live().values())


# -- export --------------------------------------------------------------------------------

def test_export_only_of_handle_types_requested_at_creation():
    """Driver API docs (cuMemExportToShareableHandle): the type must be in the creation
    prop's requestedHandleTypes."""
    drv = _driver()
    h = drv.create(2 * MiB, FD)
    with pytest.raises(DriverError) as info:
        drv.export(h, FABRIC)
    assert _code(info) == "CUDA_ERROR_INVALID_VALUE" and "not requested" in drv.api.last_error
    drv.release(h)
    drv.close()


# -- fabric and IMEX -------------------------------------------------------------------------

def test_fabric_without_imex_channel_is_not_permitted_although_the_attribute_says_yes():
    """Driver API docs (CU_MEM_HANDLE_TYPE_FABRIC needs an IMEX channel); microsoft/mscclpp#467,
    MoonshotAI/MoonEP#28: the attribute is 1 while cuMemCreate fails NOT_PERMITTED."""
    drv = _driver("H100x2,imex=none")
    assert drv.capabilities().fabric  # the attribute alone says yes
    with pytest.raises(DriverError) as info:
        drv.create(2 * MiB, FABRIC)
    assert _code(info) == "CUDA_ERROR_NOT_PERMITTED" and "IMEX" in str(info.value) and "IMEX" in drv.api.last_error
    drv.close()


def fabric_peer_import(ctx: Any, node: str) -> dict[str, Any]:
    """Rank 1 exports a FABRIC allocation; rank 0 imports it (another process) and reads it."""
    from moonep_ep.memory.group import GroupComm

    comm = GroupComm()
    drv = CudaDriver(device=ctx.rank, rank=ctx.rank, api=EmulatedCudaApi(node, visible=None))
    out: dict[str, Any] = {}
    with comm.step("export") as st:
        if ctx.rank == 1:
            h = drv.create(2 * MiB, FABRIC)
            va = drv.reserve(2 * MiB, 2 * MiB)
            drv.map(va, 2 * MiB, h, 0)
            drv.set_access(va, 2 * MiB)
            drv.as_tensor(va, 2 * MiB, None)[:4].copy_(torch.tensor([1, 2, 3, 4], dtype=torch.uint8))
            mine = drv.export(h, FABRIC)
            out["self_import"] = drv.import_handle(mine, FABRIC, size=2 * MiB) > 0  # own handle: always works
            st.share(mine)
    if ctx.rank == 0:
        try:
            imp = drv.import_handle(st.gathered[1], FABRIC, size=2 * MiB)
            va0 = drv.reserve(2 * MiB, 2 * MiB)
            drv.map(va0, 2 * MiB, imp, 0)
            drv.set_access(va0, 2 * MiB)
            out["read"] = drv.as_tensor(va0, 2 * MiB, None)[:4].tolist()
        except DriverError as exc:
            out["error"] = exc.code
    comm.barrier("done")
    return out


@pytest.mark.parametrize("imex,expect", [("channel", "CUDA_ERROR_INVALID_HANDLE"), ("domain", [1, 2, 3, 4])])
def test_fabric_peer_import_needs_an_imex_domain_not_just_a_channel(imex, expect):
    """meta-pytorch/torchcomms#3517, kubernetes-sigs/dra-driver-nvidia-gpu#294/#1417: with a node-local
    channel a process re-imports its own fabric handle, a peer's import fails (invalid handle);
    with an IMEX domain the peer reads the exporter's bytes."""
    r0, r1 = run_ranks(fabric_peer_import, 2, args=(f"H100x2,imex={imex}",))
    assert r1["self_import"]
    assert r0.get("error", r0.get("read")) == expect


# -- access ------------------------------------------------------------------------------------

def test_access_only_after_set_access_for_that_device():
    """Driver API docs (cuMemSetAccess); openxla/xla#40852: access granted to another device
    does not grant this one."""
    drv = _driver("H100x2", visible="0,1")
    h, va = _mapped(drv, access=False)
    with pytest.raises(DriverError, match="no read/write access"):
        drv.as_tensor(va, 2 * MiB, None)
    desc = drv._access_desc()
    desc.location.id = 1  # the other GPU
    drv.check(drv.api.cuMemSetAccess(va, 2 * MiB, [desc], 1), "cuMemSetAccess")
    with pytest.raises(DriverError, match="GPU 0"):
        drv.as_tensor(va, 2 * MiB, None)
    drv.set_access(va, 2 * MiB)
    assert drv.as_tensor(va, 2 * MiB, None).shape == (2 * MiB,)
    _teardown(drv, h, va)


_RAW_TOUCH = textwrap.dedent("""
    import ctypes, sys
    from moonep_ep.memory.cuda import CudaDriver
    from moonep_ep.memory.driver import HandleType
    from moonep_ep.testing.cuda_emulator import EmulatedCudaApi
    drv = CudaDriver(device=0, api=EmulatedCudaApi("H100x2", visible="0"))
    size = 2 << 20
    if sys.argv[1] == "unicast":
        h = drv.create(size, HandleType.POSIX_FD)
        va = drv.reserve(size, size)
        drv.map(va, size, h, 0)          # mapped, but no cuMemSetAccess
    else:
        mc = drv.multicast_create(size, 1, HandleType.POSIX_FD)
        drv.multicast_add_device(mc)
        mem = drv.create(size, HandleType.POSIX_FD)
        drv.multicast_bind(mc, 0, mem, 0, size)
        va = drv.reserve(size, size)
        drv.multicast_map(va, size, mc)  # mapped with access: still only multimem may touch it
    print("touching", flush=True)
    ctypes.memset(va, 1, 16)             # a plain store
    print("survived", flush=True)
""")


@pytest.mark.parametrize("kind", ["unicast", "multicast"])
def test_a_plain_store_without_access_or_into_a_multicast_address_faults(kind):
    """A mapping without cuMemSetAccess, and any multicast address, are PROT_NONE to host code:
    a raw store is killed by SIGSEGV, as a GPU raises an illegal-address fault."""
    proc = subprocess.run([sys.executable, "-c", _RAW_TOUCH, kind], capture_output=True, text=True, timeout=120)
    assert "touching" in proc.stdout and "survived" not in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode == -11, (proc.returncode, proc.stderr[-2000:])


# -- unmap and unbind ---------------------------------------------------------------------------

def test_unmap_takes_whole_mappings_only():
    """Driver API docs (cuMemUnmap): the range must cover whole mappings."""
    drv = _driver()
    h, va = _mapped(drv, size=4 * MiB)
    with pytest.raises(DriverError) as info:
        drv.unmap(va, 2 * MiB)
    assert _code(info) == "CUDA_ERROR_INVALID_VALUE" and "whole mappings" in drv.api.last_error
    _teardown(drv, h, va, 4 * MiB)


def test_unbind_after_the_bound_memory_was_released_fails():
    """pytorch/pytorch#162429 (B200): unbind after the bound memory is freed fails
    INVALID_VALUE; NCCL nvls.cc and PyTorch unbind first."""
    drv = _driver()
    mc = drv.multicast_create(2 * MiB, 1, FD)
    drv.multicast_add_device(mc)
    mem = drv.create(2 * MiB, FD)
    drv.multicast_bind(mc, 0, mem, 0, 2 * MiB)
    drv.release(mem)
    with pytest.raises(DriverError) as info:
        drv.multicast_unbind(mc, 0, 2 * MiB)
    assert _code(info) == "CUDA_ERROR_INVALID_VALUE" and "released before the unbind" in drv.api.last_error


def test_bind_before_every_device_joined_is_an_illegal_state():
    """NCCL nvls.cc: cuMulticastBindMem 'will block until all ranks have been added'; MoonEP saw
    ILLEGAL_STATE or a hang without a barrier. The emulator fails instead of hanging."""
    drv = _driver()
    mc = drv.multicast_create(2 * MiB, 2, FD)  # a team of two, one member added
    drv.multicast_add_device(mc)
    mem = drv.create(2 * MiB, FD)
    with pytest.raises(DriverError) as info:
        drv.multicast_bind(mc, 0, mem, 0, 2 * MiB)
    assert _code(info) == "CUDA_ERROR_ILLEGAL_STATE"
    drv.release(mem)
    drv.multicast_release(mc)
    drv.close()


def late_importer(ctx: Any) -> dict[str, Any]:
    """Rank 0 creates a team of two, exports it, and drops its creation reference before
    rank 1 imports: rank 1 gets a fresh object and its bind can never complete."""
    from moonep_ep.memory.exchange import HandleExchanger
    from moonep_ep.memory.group import GroupComm

    comm = GroupComm()
    drv = CudaDriver(device=ctx.rank, rank=ctx.rank, api=EmulatedCudaApi("H100x2", visible=None))
    exported = []
    if ctx.rank == 0:
        mc = drv.multicast_create(2 * MiB, 2, FD)
        drv.multicast_add_device(mc)
        exported = [drv.multicast_export(mc, FD)]
        drv.multicast_release(mc)  # wrong: before the peer imported
    received = HandleExchanger(comm).exchange(exported, FD)[0]
    out: dict[str, Any] = {}
    if ctx.rank == 1:
        mc = drv.multicast_import(received[0], FD, size=2 * MiB)
        drv.multicast_add_device(mc)
        mem = drv.create(2 * MiB, FD)
        try:
            drv.multicast_bind(mc, 0, mem, 0, 2 * MiB)
        except DriverError as exc:
            out["bind"] = exc.code
    for fd in exported + received:
        os.close(fd)
    return out


def test_the_creator_must_keep_its_reference_until_peers_imported():
    """PyTorch CUDASymmetricMemory.cu (MulticastSetup::commit): once the reference
    cuMulticastCreate returned is gone, the exported handle resolves to a fresh, empty object."""
    _, r1 = run_ranks(late_importer, 2)
    assert r1["bind"] == "CUDA_ERROR_ILLEGAL_STATE"


# -- multicast addresses and multimem -------------------------------------------------------------

def _multicast_range(drv: CudaDriver, size: int = 2 * MiB) -> tuple[int, int, int, int]:
    mc = drv.multicast_create(size, 1, FD)
    return (mc, *bind_and_map_multicast(drv, mc, size))


def test_multicast_addresses_take_multimem_only():
    """PTX ISA (multimem) / CUDA programming guide: only multimem.* may access a multicast address.
    A tensor over it (whose copy_ is a plain copy) is refused; the multimem kernel stores."""
    drv = _driver()
    mc, mem, uc, va = _multicast_range(drv)
    with pytest.raises(DriverError, match="multicast address"):
        drv.as_tensor(va, 4096, None)
    data = ((torch.arange(4096) * 3) % 256).to(torch.uint8)
    drv.multimem_store(va + 8192, data)
    assert torch.equal(drv.as_tensor(uc, 2 * MiB, None)[8192:8192 + 4096], data)
    with pytest.raises(DriverError, match="multiple of 16"):
        drv.multimem_store(va, data[:10])
    drv.synchronize()
    unmap_and_release_multicast(drv, mc, mem, uc, va, 2 * MiB)
    drv.close()
    assert not any(drv.api.live().values()), drv.api.live()


def test_only_the_multimem_kernel_runs_and_its_arguments_are_typed():
    drv = _driver()
    api = drv.api
    drv._ensure_context()
    other = multimem.PTX.replace(multimem.ENTRY, "my_kernel")
    with pytest.raises(UnsupportedKernel, match="my_kernel"):
        api.cuModuleLoadData(other.encode())
    with pytest.raises(UnsupportedKernel, match="PTX ISA 8.0"):
        api.cuModuleLoadData(multimem.PTX.replace(".version 8.1", ".version 8.0").encode())
    err, module = api.cuModuleLoadData(multimem.PTX.encode() + b"\0")
    err, function = api.cuModuleGetFunction(module, multimem.ENTRY.encode())
    assert api.cuModuleGetFunction(module, b"nope")[0].name == "CUDA_ERROR_NOT_FOUND"
    bad = ((0, 0, 1), (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32))
    with pytest.raises(UnsupportedKernel, match="takes"):
        api.cuLaunchKernel(function, 1, 1, 1, 32, 1, 1, 0, 0, bad, 0)
    api.cuModuleUnload(module)
    drv.close()


# -- context ------------------------------------------------------------------------------------------

def test_calls_need_a_current_context_on_the_calling_thread():
    """Driver API docs; vLLM cumem.py's ensure_context: a thread without a current context
    fails INVALID_CONTEXT; CudaDriver makes the primary context current on each thread."""
    drv = _driver()
    h = drv.create(2 * MiB, FD)
    seen: dict[str, Any] = {}

    def other_thread() -> None:
        seen["raw"] = drv.api.cuMemRelease(h)[0].name   # the bindings, no context here
        drv.release(h)                                  # the driver sets it current first
        seen["driver"] = "ok"

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert seen == {"raw": "CUDA_ERROR_INVALID_CONTEXT", "driver": "ok"}
    drv.close()
    assert not any(drv.api.live().values())


# -- identity ------------------------------------------------------------------------------------------

def test_device_identity_is_the_uuid_under_cuda_visible_devices():
    """Driver API docs (CUDA_VISIBLE_DEVICES renumbers ordinals; cuDeviceGetUuid is stable)."""
    node = NodeSpec.parse("H100x4")
    assert visible_gpus(node, None) == [0, 1, 2, 3]
    assert visible_gpus(node, "3,1") == [3, 1]
    assert visible_gpus(node, node.uuid_string(2)[:12]) == [2]   # a UUID prefix
    assert visible_gpus(node, "1,7,2") == [1]                      # the list ends at an invalid entry
    assert visible_gpus(node, "") == []
    a, b = _driver("H100x4", visible="3"), _driver("H100x4", visible="1")
    assert a.device == b.device == 0
    assert a.device_uuid() == node.uuid_string(3) != b.device_uuid() == node.uuid_string(1)
    a.close()
    b.close()
    with pytest.raises(NodeSpecError, match="imex"):
        NodeSpec.parse("H100x2,imex=maybe")


# -- versions ----------------------------------------------------------------------------------------

def test_bindings_newer_than_the_driver_fail_and_the_probe_names_the_fix():
    """cuda-bindings 13.x need an R580+ driver; cuda-python's own check compares
    cuDriverGetVersion with the bindings' CUDA_VERSION."""
    from moonep_ep.memory.cuda_calls import bindings_fix

    major = int(EmulatedCudaApi("H100x2").CUDA_VERSION) // 1000  # the installed bindings' CUDA major
    api = EmulatedCudaApi(f"H100x2,cuda={major - 1}.8", visible="0")  # a driver one major older
    assert api.cuDriverGetVersion() == (api.CUresult.CUDA_SUCCESS, (major - 1) * 1000 + 80)
    with pytest.raises(RuntimeError, match='Function "cuInit" not found'):
        api.cuInit(0)
    caps = CudaDriver(device=0, api=api).capabilities()
    assert not caps.available
    assert f"{major - 1}.8" in caps.reasons["driver"] and bindings_fix(major - 1) in caps.reasons["driver"]
    assert bindings_fix(12) == 'pip install "cuda-bindings>=12.8,<13"'
    # The same driver with bindings it supports: no mismatch (positive control of the check).
    ok = EmulatedCudaApi(f"H100x2,cuda={major}.0", visible="0")
    assert CudaDriver(device=0, api=ok).capabilities().available


# -- unknown calls ------------------------------------------------------------------------------------

def test_an_unknown_call_or_attribute_fails_loudly():
    api = EmulatedCudaApi("H100x2", visible="0")
    with pytest.raises(UnknownCall, match="cuMemAllocAsync"):
        api.cuMemAllocAsync  # noqa: B018
    api.cuInit(0)
    with pytest.raises(UnknownCall, match="attribute"):
        api.cuDeviceGetAttribute(api.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CLOCK_RATE, 0)


def test_new_memory_is_not_zero_filled():
    """cuMemCreate memory is not zero-filled (MoonEP expert_pools.py zero-fills its own chunk)."""
    drv = _driver()
    h, va = _mapped(drv)
    assert set(drv.as_tensor(va, 4096, None).tolist()) == {0xCD}
    _teardown(drv, h, va)
