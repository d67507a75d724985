"""CudaDriver over the CUDA driver emulator: call sequences, arguments and bookkeeping;
binding compatibility against the real ``cuda.bindings.driver``; and (on a GPU) real
allocations.

The emulator (``moonep_ep.testing.cuda_emulator``) enforces the driver's rules
itself (``test_cuda_emulator.py`` breaks each on purpose); these tests check
what CudaDriver asks of it. Only a GPU proves real granularity values,
context handling with torch and real cross-process access -- the
``TestRealCuda`` class does that where a GPU exists.
"""

from __future__ import annotations

import ctypes
import gc
import os
import socket
import struct
import traceback
import weakref

import pytest
import torch

from moonep_ep.errors import DriverError
from moonep_ep.memory import dlpack
from moonep_ep.memory.cuda import CudaDriver
from moonep_ep.memory.driver import HandleType, MemoryDriver
from moonep_ep.testing.cuda_emulator import EmulatedCudaApi
from tests.support.memory import bind_and_map_multicast

MiB = 1 << 20
GRAN = 2 * MiB
FD, FABRIC = HandleType.POSIX_FD, HandleType.FABRIC
#: One process on GPU 0 of a two-GPU H100 node with a working IMEX domain.
NODE = "H100x2,imex=domain"


def _real_module():
    from cuda.bindings import driver
    return driver


def _real_driver_present() -> bool:
    """True when libcuda loads (calls on the real module would then execute)."""
    from cuda.pathfinder import DynamicLibNotFoundError
    try:
        _real_module().cuInit(0)
    except DynamicLibNotFoundError:
        return False
    return True


def _assert_in_order(names: list[str], expected: list[str]) -> None:
    """``expected`` occurs in ``names`` as a subsequence."""
    it = iter(names)
    missing = [name for name in expected if not any(n == name for n in it)]
    assert not missing, f"{expected} not in order within {names}"


def _zero(counts: dict[str, int]) -> bool:
    return not any(counts.values())


def _emulator(node: str = NODE, visible: str = "0") -> EmulatedCudaApi:
    return EmulatedCudaApi(node, visible=visible, record=True)


@pytest.fixture
def api() -> EmulatedCudaApi:
    return _emulator()


@pytest.fixture
def drv(api) -> CudaDriver:
    return CudaDriver(device=0, rank=0, api=api)


# -- scenarios (shared with the binding-compatibility replay) --------------------------

def unicast_scenario(drv: CudaDriver) -> dict:
    """allocate -> export (fd, fabric) -> import -> reserve -> map -> access -> teardown."""
    gran_fd, gran_fab = drv.granularity(FD), drv.granularity(FABRIC)
    h_fd = drv.create(2 * gran_fd, FD)
    h_fab = drv.create(gran_fab, FABRIC)
    fd = drv.export(h_fd, FD)
    fab = drv.export(h_fab, FABRIC)
    assert isinstance(fd, int) and os.fstat(fd)  # a real, open fd
    assert isinstance(fab, bytes) and len(fab) == 64
    imp_fd = drv.import_handle(fd, FD, size=2 * gran_fd)
    os.close(fd)  # the caller owns the exported fd; the import does not keep it
    imp_fab = drv.import_handle(fab, FABRIC, size=gran_fab)
    assert drv.handle_size(imp_fd) == 2 * gran_fd and drv.handle_size(imp_fab) == gran_fab

    total = 2 * gran_fd + gran_fab
    va = drv.reserve(total, gran_fd)
    drv.map(va, 2 * gran_fd, imp_fd, 0)
    drv.map(va + 2 * gran_fd, gran_fab, imp_fab, 0)
    drv.set_access(va, total)
    live = drv.live_objects()

    # Teardown: sync -> unmap -> release -> free the reservation last.
    drv.synchronize()
    drv.unmap(va, 2 * gran_fd)
    drv.unmap(va + 2 * gran_fd, gran_fab)
    for handle in (imp_fd, imp_fab, h_fd, h_fab):
        drv.release(handle)
    drv.free_reservation(va, total)
    drv.close()
    return {"live": live, "va": va, "total": total, "handles": (h_fd, h_fab, imp_fd, imp_fab)}


def multicast_scenario(drv: CudaDriver) -> dict:
    """create -> export -> import -> add_device -> bind -> map -> unbind -> release."""
    size = max(drv.multicast_granularity(1, FD), drv.granularity(FD))
    mc = drv.multicast_create(size, 1, FD)
    fd = drv.multicast_export(mc, FD)
    # Every member imports, the creator included (same provenance on all ranks).
    mc_imp = drv.multicast_import(fd, FD, size=size)
    os.close(fd)
    mem, uc_va, mc_va = bind_and_map_multicast(drv, mc_imp, size)
    probe = ((torch.arange(4096) * 7) % 251).to(torch.uint8)
    drv.multimem_store(mc_va + 4096, probe)  # lands in the bound memory at the same offset
    stored = drv.as_tensor(uc_va, size, owner=None)[4096:8192].clone()
    live = drv.live_objects()

    # Teardown: sync, unbind before the bound memory is unmapped or released,
    # unmap, release multicast then memory, free reservations last.
    drv.synchronize()
    drv.multicast_unbind(mc_imp, 0, size)
    drv.unmap(mc_va, size)
    drv.unmap(uc_va, size)
    drv.multicast_release(mc_imp)
    drv.multicast_release(mc)
    drv.release(mem)
    drv.free_reservation(mc_va, size)
    drv.free_reservation(uc_va, size)
    drv.close()
    return {"live": live, "size": size, "mc": mc, "mc_imp": mc_imp, "mem": mem,
            "stored_equal": torch.equal(stored, probe)}


# -- call sequences against the fake ---------------------------------------------------

@pytest.mark.cuda_emulated
def test_driver_is_a_memory_driver(drv):
    assert isinstance(drv, MemoryDriver)
    assert drv.name == "cuda" and drv.device_type == "cuda" and drv.hardware_multicast


@pytest.mark.cuda_emulated
def test_primary_context_comes_first(drv, api):
    drv.granularity(FD)
    assert api.names()[:4] == ["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain",
                               "cuCtxSetCurrent"]
    assert api.calls_of("cuInit") == [(0,)]
    assert api.calls_of("cuDeviceGet") == [(0,)]
    assert int(api.cuCtxGetCurrent()[1]) != 0
    assert api.live()["contexts"] == 1
    drv.close()
    drv.close()  # idempotent
    assert api.live()["contexts"] == 0


@pytest.mark.cuda_emulated
def test_unicast_sequence(drv, api):
    result = unicast_scenario(drv)
    live = result["live"]
    assert live == {"handles": 2, "imported": 2, "reservations": 1, "mappings": 2,
                    "multicast": 0, "binds": 0, "modules": 0}

    names = api.names()
    _assert_in_order(names, [
        "cuMemGetAllocationGranularity", "cuMemCreate", "cuMemCreate",
        "cuMemExportToShareableHandle", "cuMemExportToShareableHandle",
        "cuMemImportFromShareableHandle", "cuMemImportFromShareableHandle",
        "cuMemAddressReserve", "cuMemMap", "cuMemMap", "cuMemSetAccess",
        "cuMemUnmap", "cuMemUnmap", "cuMemRelease", "cuMemRelease", "cuMemRelease",
        "cuMemRelease", "cuMemAddressFree", "cuDevicePrimaryCtxRelease",
    ])
    # Unmap before any release; the reservation is freed after every release.
    assert max(i for i, n in enumerate(names) if n == "cuMemUnmap") < \
        min(i for i, n in enumerate(names) if n == "cuMemRelease")
    assert names.index("cuMemAddressFree") > \
        max(i for i, n in enumerate(names) if n == "cuMemRelease")

    ht = api.CUmemAllocationHandleType
    creates = api.calls_of("cuMemCreate")
    for size, prop, flags in creates:
        assert size % GRAN == 0 and size > 0 and flags == 0
        assert prop.type == api.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        assert prop.location.type == api.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        assert prop.location.id == 0
    assert [int(p.requestedHandleTypes) for _, p, _ in creates] == [
        int(ht.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), int(ht.CU_MEM_HANDLE_TYPE_FABRIC)]
    # Granularity was queried with the very prop objects used to create.
    gran_props = [args[0] for args in api.calls_of("cuMemGetAllocationGranularity")]
    assert all(any(p is q for q in gran_props) for _, p, _ in creates)

    imports = api.calls_of("cuMemImportFromShareableHandle")
    assert isinstance(imports[0][0], int)
    assert isinstance(imports[1][0], bytes) and len(imports[1][0]) == 64

    (size, align, addr, flags), = api.calls_of("cuMemAddressReserve")
    assert (size, align, addr, flags) == (result["total"], GRAN, 0, 0)
    for ptr, size, offset, handle, flags in api.calls_of("cuMemMap"):
        assert ptr % GRAN == 0 and size % GRAN == 0 and offset == 0 and flags == 0
        assert handle in result["handles"][2:]  # the imported handles are mapped

    (ptr, size, descs, count), = api.calls_of("cuMemSetAccess")
    assert (ptr, size, count) == (result["va"], result["total"], 1)
    assert isinstance(descs, list) and len(descs) == 1
    desc = descs[0]
    assert desc.flags == api.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    assert desc.location.type == api.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    assert desc.location.id == 0

    assert _zero(drv.live_objects()), drv.live_objects()
    assert _zero(api.live()), api.live()
    assert api.errors == []


@pytest.mark.cuda_emulated
def test_multicast_sequence(drv, api):
    result = multicast_scenario(drv)
    assert result["live"] == {"handles": 1, "imported": 0, "reservations": 2, "mappings": 2,
                              "multicast": 2, "binds": 1, "modules": 1}
    assert result["stored_equal"]
    names = api.names()
    _assert_in_order(names, [
        "cuMulticastGetGranularity", "cuMulticastCreate", "cuMemExportToShareableHandle",
        "cuMemImportFromShareableHandle", "cuMulticastAddDevice", "cuMemCreate",
        "cuMulticastBindMem", "cuMemMap", "cuMemSetAccess", "cuMemMap", "cuMemSetAccess",
        "cuModuleLoadData", "cuModuleGetFunction", "cuLaunchKernel",
        "cuMulticastUnbind", "cuMemUnmap", "cuMemUnmap", "cuMemRelease", "cuMemRelease",
        "cuMemRelease", "cuMemAddressFree", "cuMemAddressFree", "cuModuleUnload",
        "cuDevicePrimaryCtxRelease",
    ])
    size, mc_imp, mem = result["size"], result["mc_imp"], result["mem"]

    (prop,), = api.calls_of("cuMulticastCreate")
    assert (prop.numDevices, prop.size, prop.handleTypes, prop.flags) == (1, size, 1, 0)
    assert size % api.node.profile.mc_min == 0
    (mc, dev), = api.calls_of("cuMulticastAddDevice")
    assert (mc, int(dev)) == (mc_imp, 0)
    (f, gx, gy, gz, bx, by, bz, shared, stream, params, extra), = api.calls_of("cuLaunchKernel")
    assert (gy, gz, by, bz, shared, stream, extra) == (1, 1, 1, 1, 0, 0, 0) and bx == 256
    assert params[0][2] == 4096 // 16 and params[1] == (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64)
    assert api.calls_of("cuMulticastBindMem") == [(mc_imp, 0, mem, 0, size, 0)]
    (mc, dev, off, usize), = api.calls_of("cuMulticastUnbind")
    assert (mc, int(dev), off, usize) == (mc_imp, 0, 0, size)
    # The multicast VA maps the multicast handle from offset 0.
    assert (api.calls_of("cuMemMap")[1][2:]) == (0, mc_imp, 0)

    # Unbind precedes unmapping and releasing the bound memory.
    unbind = names.index("cuMulticastUnbind")
    release_mem = api.calls.index(("cuMemRelease", (mem,)))
    first_unmap = names.index("cuMemUnmap")
    assert unbind < first_unmap < release_mem

    assert _zero(drv.live_objects()), drv.live_objects()
    assert _zero(api.live()), api.live()
    assert api.errors == []


def _one_member_team(drv: CudaDriver) -> tuple[int, int, int]:
    """A one-device multicast object this device joined, and unbound memory of its size."""
    size = drv.multicast_granularity(1, FD)
    mc = drv.multicast_create(size, 1, FD)
    drv.multicast_add_device(mc)
    return size, mc, drv.create(size, FD)


@pytest.mark.cuda_emulated
def test_release_before_unbind_is_reported(drv, api):
    size, mc, mem = _one_member_team(drv)
    drv.multicast_bind(mc, 0, mem, 0, size)
    drv.release(mem)  # wrong: the bound memory goes before the unbind
    with pytest.raises(DriverError) as info:
        drv.multicast_unbind(mc, 0, size)
    assert info.value.code == "CUDA_ERROR_INVALID_VALUE"
    assert "cuMulticastUnbind" in str(info.value)
    assert drv.live_objects()["binds"] == 1  # the failed unbind is not forgotten


@pytest.mark.cuda_emulated
def test_injected_error_names_code_call_and_rank():
    api = _emulator()
    drv = CudaDriver(device=0, rank=3, api=api)
    api.fail("cuMemCreate", api.CUresult.CUDA_ERROR_NOT_PERMITTED, times=1)
    with pytest.raises(DriverError) as info:
        drv.create(GRAN, FABRIC)
    msg = str(info.value)
    for part in ("CUDA_ERROR_NOT_PERMITTED", "cuMemCreate", "rank 3", "IMEX"):
        assert part in msg, msg
    err = info.value
    assert (err.code, err.call, err.rank) == ("CUDA_ERROR_NOT_PERMITTED", "cuMemCreate", 3)
    assert drv.live_objects()["handles"] == 0
    # times=1: the next call goes through.
    handle = drv.create(GRAN, FABRIC)
    drv.release(handle)
    drv.close()
    assert _zero(api.live())


@pytest.mark.cuda_emulated
def test_size_not_multiple_of_granularity_fails_before_the_call(drv, api):
    with pytest.raises(DriverError, match="granularity"):
        drv.create(GRAN + 4096, FD)
    with pytest.raises(DriverError):
        drv.create(0, FD)
    assert "cuMemCreate" not in api.names()


@pytest.mark.cuda_emulated
def test_bind_retry_after_system_not_ready(drv, api):
    size, mc, mem = _one_member_team(drv)
    api.fail("cuMulticastBindMem", "CUDA_ERROR_SYSTEM_NOT_READY", times=1)
    with pytest.raises(DriverError) as info:
        drv.multicast_bind(mc, 0, mem, 0, size)
    assert info.value.code == "CUDA_ERROR_SYSTEM_NOT_READY"
    assert "retry" in str(info.value)
    assert drv.live_objects()["binds"] == 0 and api.live()["binds"] == 0
    drv.multicast_bind(mc, 0, mem, 0, size)  # retry succeeds
    drv.multicast_unbind(mc, 0, size)
    drv.multicast_release(mc)
    drv.release(mem)
    drv.close()
    assert _zero(api.live()) and _zero(drv.live_objects())


@pytest.mark.cuda_emulated
def test_unsupported_features_are_driver_errors():
    # An x86 HGX out of the box: the fabric attribute is set, but there is no IMEX channel.
    api = _emulator("H100x2,imex=none,multicast=0")
    drv = CudaDriver(device=0, api=api)
    with pytest.raises(DriverError, match="CUDA_ERROR_NOT_PERMITTED"):
        drv.create(GRAN, FABRIC)
    with pytest.raises(DriverError, match="CUDA_ERROR_NOT_SUPPORTED"):
        drv.multicast_create(GRAN, 2, FD)
    drv.close()
    assert _zero(api.live())


@pytest.mark.cuda_emulated
def test_emulator_rejects_what_the_driver_rejects(drv, api):
    h = drv.create(2 * GRAN, FD)
    va = drv.reserve(2 * GRAN, GRAN)
    with pytest.raises(DriverError, match="CUDA_ERROR_INVALID_VALUE"):
        drv.map(va + 2 * GRAN, 2 * GRAN, h, 0)  # outside the reservation
    with pytest.raises(DriverError, match="CUDA_ERROR_INVALID_VALUE"):
        drv.map(va, GRAN, h, 4096)  # misaligned offset
    with pytest.raises(DriverError, match="CUDA_ERROR_INVALID_VALUE"):
        drv.set_access(va, 2 * GRAN)  # nothing mapped yet
    drv.map(va, 2 * GRAN, h, 0)
    with pytest.raises(DriverError, match="CUDA_ERROR_ALREADY_MAPPED"):
        drv.map(va, GRAN, h, 0)
    with pytest.raises(DriverError, match="CUDA_ERROR_INVALID_VALUE"):
        drv.free_reservation(va, 2 * GRAN)  # still mapped
    with pytest.raises(DriverError, match="CUDA_ERROR_INVALID_VALUE"):
        drv.release(0xDEAD)  # unknown handle
    with pytest.raises(DriverError, match="CUDA_ERROR_INVALID_VALUE"):
        drv.export(h, FABRIC)  # not requested at creation
    drv.unmap(va, 2 * GRAN)
    drv.free_reservation(va, 2 * GRAN)
    drv.release(h)
    drv.close()
    assert _zero(api.live()) and _zero(drv.live_objects())


@pytest.mark.cuda_emulated
def test_import_argument_checks(drv, api):
    with pytest.raises(DriverError, match="int fd"):
        drv.import_handle("3", FD)
    with pytest.raises(DriverError, match="64 bytes"):
        drv.import_handle(api.CUmemFabricHandle(), FABRIC)  # must ship .data, not the struct
    h = drv.create(GRAN, FD)
    fd = drv.export(h, FD)
    imp = drv.import_handle(fd, FD)  # size unknown
    os.close(fd)
    with pytest.raises(DriverError, match="size="):
        drv.handle_size(imp)
    assert drv.handle_size(h) == GRAN
    drv.release(imp)
    drv.release(h)
    assert _zero(drv.live_objects())


@pytest.mark.cuda_emulated
def test_emulator_module_surface(api):
    assert api.CUresult.CUDA_SUCCESS == 0
    assert api.CUmemAllocationProp is _real_module().CUmemAllocationProp
    with pytest.raises(AttributeError, match="does not implement"):
        api.cuMemAllocAsync  # noqa: B018 - an unmodelled call must not reach the real driver
    assert api.CUDA_VERSION == _real_module().CUDA_VERSION  # constants: the installed bindings' own
    assert api.cuInit(0) == (api.CUresult.CUDA_SUCCESS,)


# -- capabilities ----------------------------------------------------------------------

@pytest.mark.cuda_emulated
def test_capabilities_one_gpu(drv, api):
    caps = drv.capabilities()
    assert caps.available and caps.vmm and caps.posix_fd and caps.fabric and caps.multicast
    assert caps.granularity == GRAN and caps.emulated
    assert caps.peer_access is None and caps.reasons["peer_access"] == "only one GPU"
    assert "NVIDIA H100" in caps.device
    assert caps.device_id == api.node.uuid_string(0)  # identity by UUID, not "cuda:0"
    assert caps.to_json()["driver"] == "cuda"
    drv.close()


@pytest.mark.cuda_emulated
def test_capabilities_reasons_for_every_no():
    api = _emulator("H100x2,fabric=0,multicast=0,p2p=0", visible=None)
    caps = CudaDriver(device=1, api=api).capabilities()
    assert caps.available and caps.vmm and caps.posix_fd
    assert not caps.fabric and "FABRIC_SUPPORTED" in caps.reasons["fabric"]
    assert not caps.multicast and "MULTICAST_SUPPORTED" in caps.reasons["multicast"]
    assert caps.peer_access is False and "[0]" in caps.reasons["peer_access"]
    assert set(caps.reasons) == {"fabric", "multicast", "peer_access", "clique"}  # no fabric clique on one host

    caps = CudaDriver(device=0, api=_emulator(visible=None)).capabilities()
    assert caps.peer_access is True and "peer_access" not in caps.reasons

    caps = CudaDriver(device=4, api=_emulator(visible=None)).capabilities()
    assert not caps.available and "out of range" in caps.reasons["driver"]
    assert all(caps.reasons[c] for c in ("vmm", "posix_fd", "fabric", "multicast"))


@pytest.mark.cuda_emulated
def test_capabilities_never_raise_on_failing_calls():
    api = _emulator()
    api.fail("cuInit", "CUDA_ERROR_NO_DEVICE")
    caps = CudaDriver(device=0, api=api).capabilities()
    assert not caps.available and "CUDA_ERROR_NO_DEVICE" in caps.reasons["driver"]

    api = _emulator()
    api.fail("cuDeviceGetAttribute", "CUDA_ERROR_INVALID_VALUE", times=100)
    caps = CudaDriver(device=0, api=api).capabilities()
    assert caps.available and not caps.vmm and "query failed" in caps.reasons["vmm"]


def test_capabilities_with_the_real_module():
    drv = CudaDriver(device=0, rank=0)  # api=None: the real cuda.bindings.driver
    caps = drv.capabilities()
    if _real_driver_present():
        assert caps.available, caps.reasons
        drv.close()
    else:
        assert not caps.available
        assert "driver library" in caps.reasons["driver"]
        assert not (caps.vmm or caps.posix_fd or caps.fabric or caps.multicast)
        assert all(caps.reasons[c] for c in ("vmm", "posix_fd", "fabric", "multicast"))


def test_calls_without_driver_library_raise_driver_error():
    if _real_driver_present():
        pytest.skip("a real CUDA driver is present")
    with pytest.raises(DriverError, match="driver library") as info:
        CudaDriver(device=0, rank=5).granularity(FD)
    assert "rank 5" in str(info.value) and info.value.call == "cuInit"


# -- binding compatibility -------------------------------------------------------------

@pytest.mark.skipif(_real_driver_present(),
                    reason="a real CUDA driver is present: replaying recorded calls would "
                           "execute them for real")
@pytest.mark.cuda_emulated
def test_recorded_calls_are_accepted_by_the_real_bindings():
    """Replay every recorded call with its exact argument objects on the real module.

    Without libcuda the bindings convert arguments first and then fail to load
    the library (DynamicLibNotFoundError); a wrong argument type would instead
    raise TypeError before that.
    """
    from cuda.pathfinder import DynamicLibNotFoundError

    api = _emulator(visible=None)
    drv = CudaDriver(device=0, rank=0, api=api)
    unicast_scenario(drv)
    multicast_scenario(CudaDriver(device=0, rank=0, api=api))
    drv = CudaDriver(device=0, rank=0, api=api)
    drv.capabilities()
    drv.memory_info()
    drv.close()

    real = _real_module()
    names = set()
    for name, args in api.calls:
        names.add(name)
        try:
            result = getattr(real, name)(*args)
        except DynamicLibNotFoundError:
            continue
        except TypeError as exc:  # pragma: no cover - this is the failure being tested for
            pytest.fail(f"{name}{args!r} rejected by the real bindings: {exc}")
        assert isinstance(result[0], real.CUresult), (name, result)
    # Every call the driver makes was exercised.
    assert {"cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent",
            "cuDevicePrimaryCtxRelease", "cuDeviceGetAttribute", "cuDeviceGetCount",
            "cuDeviceGetName", "cuDeviceCanAccessPeer", "cuMemGetAllocationGranularity",
            "cuMemCreate", "cuMemRelease", "cuMemExportToShareableHandle",
            "cuMemImportFromShareableHandle", "cuMemAddressReserve", "cuMemAddressFree",
            "cuMemMap", "cuMemUnmap", "cuMemSetAccess", "cuCtxSynchronize",
            "cuMulticastGetGranularity", "cuMulticastCreate", "cuMulticastAddDevice",
            "cuMulticastBindMem", "cuMulticastUnbind", "cuDeviceGetUuid", "cuModuleLoadData",
            "cuModuleGetFunction", "cuLaunchKernel", "cuModuleUnload", "cuMemGetInfo",
            "cuDriverGetVersion"} <= names


# -- tensors ---------------------------------------------------------------------------

def test_dlpack_capsule_names_the_device_shape_and_strides():
    """Finding 8: the CUDA tensor's device comes from the capsule, never from the pointer."""
    managed = dlpack.managed_tensor(0x7F00_0000_0000, 4096, object(), dlpack.DL_CUDA, 3)
    t = managed.dl_tensor
    assert (t.device.device_type, t.device.device_id) == (dlpack.DL_CUDA, 3)
    assert (t.data, t.ndim, t.shape[0], bool(t.strides), t.byte_offset) == (0x7F00_0000_0000, 1, 4096, False, 0)
    assert (t.dtype.code, t.dtype.bits, t.dtype.lanes) == (dlpack.DL_UINT, 8, 1)
    before = dlpack.live_count()
    managed.deleter(ctypes.pointer(managed))  # what torch calls when the storage dies
    assert dlpack.live_count() == before - 1


def test_dlpack_tensor_is_zero_copy_and_keeps_its_owner_until_the_last_view():
    buf = (ctypes.c_uint8 * 8192)()

    class Owner:
        pass

    owner = Owner()
    gone = weakref.ref(owner)
    tensor = dlpack.tensor_from_pointer(ctypes.addressof(buf), 8192, owner, dlpack.DL_CPU, 0)
    del owner
    assert tensor.data_ptr() == ctypes.addressof(buf) and tensor.shape == (8192,)
    tensor[:4].fill_(9)
    assert list(buf[:4]) == [9] * 4
    view = tensor[4096:]
    del tensor
    gc.collect()
    assert gone() is not None  # a view still holds the storage
    del view
    gc.collect()
    assert gone() is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error path")
def test_as_tensor_without_torch_cuda():
    drv = CudaDriver(device=0, rank=0, api=_real_module())
    with pytest.raises(DriverError, match="torch has no usable CUDA"):
        drv.as_tensor(0x7F00_0000_0000, 4096, object())


@pytest.mark.cuda_emulated
def test_as_tensor_over_the_emulator_is_a_cpu_tensor_after_the_access_check(drv):
    h = drv.create(GRAN, FD)
    va = drv.reserve(GRAN, GRAN)
    drv.map(va, GRAN, h, 0)
    with pytest.raises(DriverError, match="no read/write access"):
        drv.as_tensor(va, GRAN, owner=None)  # the seam enforces cuMemSetAccess
    drv.set_access(va, GRAN)
    t = drv.as_tensor(va, GRAN, owner=None)
    assert t.device.type == "cpu" and t.data_ptr() == va
    assert int(t[0]) == 0xCD  # cuMemCreate memory is not zero-filled; nor is the emulator's
    del t
    drv.unmap(va, GRAN)
    drv.free_reservation(va, GRAN)
    drv.release(h)
    drv.close()
    assert _zero(drv.live_objects()) and not drv.holds_context()


# -- real GPU --------------------------------------------------------------------------

def _pattern(nbytes: int, seed: int = 0) -> torch.Tensor:
    return ((torch.arange(nbytes, dtype=torch.int64) * 7 + seed) % 251).to(torch.uint8)


def _mem_free(drv: CudaDriver) -> int:
    drv.granularity(FD)  # makes the primary context current
    free, _total = drv.check(drv.api.cuMemGetInfo(), "cuMemGetInfo")
    return int(free)


def _map_local(drv: CudaDriver, handle: int, size: int, gran: int) -> int:
    va = drv.reserve(size, gran)
    drv.map(va, size, handle, 0)
    drv.set_access(va, size)
    return va


def _tear_down_one_mapping(drv: CudaDriver, va: int, size: int, handle: int) -> None:
    """Synchronize, unmap, free the reservation, release the handle; nothing may be left; close."""
    drv.synchronize()
    drv.unmap(va, size)
    drv.free_reservation(va, size)
    drv.release(handle)
    assert not any(drv.live_objects().values()), drv.live_objects()
    drv.close()


def _child_export(sock: socket.socket, device: int) -> None:
    """Spawned exporter: allocate, write a pattern through a tensor, send the fd."""
    try:
        torch.cuda.set_device(device)
        drv = CudaDriver(device=device, rank=1)
        gran = drv.granularity(FD)
        size = 2 * gran
        handle = drv.create(size, FD)
        va = _map_local(drv, handle, size, gran)
        tensor = drv.as_tensor(va, size, owner=None)
        tensor.copy_(_pattern(size, seed=1))
        torch.cuda.synchronize(device)
        del tensor
        fd = drv.export(handle, FD)
        socket.send_fds(sock, [b"K" + struct.pack("<Q", size)], [fd])
        os.close(fd)
        assert sock.recv(4) == b"done"  # the parent has imported, mapped and read
        _tear_down_one_mapping(drv, va, size, handle)
    except BaseException:
        sock.sendall(b"E" + traceback.format_exc().encode()[-3000:])
        raise


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
class TestRealCuda:
    def _driver(self) -> CudaDriver:
        drv = CudaDriver(device=0, rank=0)
        caps = drv.capabilities()
        if not (caps.vmm and caps.posix_fd):
            pytest.skip(f"no VMM with POSIX fd handles here: {caps.reasons}")
        return drv

    def _roundtrip(self, drv: CudaDriver, gran: int) -> None:
        size = 2 * gran
        free_before_create = _mem_free(drv)
        handle = drv.create(size, FD)
        va = _map_local(drv, handle, size, gran)
        assert _mem_free(drv) <= free_before_create - size
        owner = type("Owner", (), {})()
        gone = weakref.ref(owner)
        tensor = drv.as_tensor(va, size, owner)
        del owner
        assert tensor.dtype == torch.uint8 and tensor.shape == (size,)
        assert tensor.device == torch.device("cuda", 0) and tensor.data_ptr() == va
        tensor.copy_(_pattern(size))
        tensor[:4096].add_(1)  # a kernel writing through the mapping
        expected = _pattern(size)
        expected[:4096] += 1
        assert torch.equal(tensor.cpu(), expected)
        view = tensor[gran:]
        del tensor
        assert gone() is not None  # a view still references the storage
        del view
        gc.collect()
        assert gone() is None
        drv.synchronize()
        drv.unmap(va, size)
        drv.free_reservation(va, size)
        drv.release(handle)
        assert not any(drv.live_objects().values()), drv.live_objects()

    def test_single_process_roundtrip_returns_memory(self):
        drv = self._driver()
        gran = drv.granularity(FD)
        assert gran > 0 and gran % 4096 == 0
        self._roundtrip(drv, gran)  # warm-up: lazy module loading may take memory once
        free0 = _mem_free(drv)
        self._roundtrip(drv, gran)
        free1 = _mem_free(drv)
        # Physical memory comes in whole granules, so any leaked allocation shows
        # as >= gran; smaller differences are driver bookkeeping (page tables).
        assert abs(free0 - free1) < gran, f"device memory not returned: {free0} -> {free1}"
        drv.close()

    @pytest.mark.slow
    def test_two_process_fd_export_import(self):
        drv = self._driver()
        ctx = torch.multiprocessing.get_context("spawn")
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        child = ctx.Process(target=_child_export, args=(child_sock, 0))
        child.start()
        child_sock.close()
        try:
            parent_sock.settimeout(180)
            msg, fds, _flags, _addr = socket.recv_fds(parent_sock, 4096, 1)
            assert msg[:1] == b"K" and len(fds) == 1, msg.decode(errors="replace")
            size = struct.unpack("<Q", msg[1:9])[0]
            handle = drv.import_handle(fds[0], FD, size=size)
            os.close(fds[0])
            gran = drv.granularity(FD)
            va = _map_local(drv, handle, size, gran)
            tensor = drv.as_tensor(va, size, owner=None)
            assert torch.equal(tensor.cpu(), _pattern(size, seed=1))
            parent_sock.sendall(b"done")
            child.join(180)
            assert child.exitcode == 0, parent_sock.recv(4096).decode(errors="replace")
            # The exporter is gone; our import and mapping keep the memory alive.
            assert torch.equal(tensor.cpu(), _pattern(size, seed=1))
            del tensor
            _tear_down_one_mapping(drv, va, size, handle)
        finally:
            parent_sock.close()
            if child.is_alive():
                child.kill()
            child.join(10)
