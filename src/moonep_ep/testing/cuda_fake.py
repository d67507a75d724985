"""A recording, validating stand-in for ``cuda.bindings.driver`` (no GPU needed).

:class:`RecordingCudaApi` is passed as ``api=`` to
:class:`~moonep_ep.memory.cuda.CudaDriver`. It implements the ``cu*``
functions that driver calls, with the bindings' calling convention (a tuple
starting with a ``CUresult``), and delegates every other attribute -- the
real enums and structs (``CUresult``, ``CUmemAllocationProp``,
``CUmemAccessDesc``, ``CUmulticastObjectProp`` ...) -- to the real module, so
the argument objects it records can be replayed against the real bindings to
prove they are accepted.

What it models (cheaply, in one process):

* physical allocations, multicast objects and the handles that reference them
  (plain ``int`` handles; physical memory lives while a handle, mapping or
  multicast bind references it);
* POSIX-fd export as real, closable ``memfd`` file descriptors (recognised on
  import by inode), FABRIC export as a ``CUmemFabricHandle`` whose 64 bytes
  identify the object;
* reservations (bump-allocated ``int`` addresses), mappings and access;
* the checks a real driver makes: sizes/offsets/addresses multiples of the
  granularity, maps inside a reservation and not overlapping, releases of
  known handles only, binds after every member device was added, unbinds of
  existing binds only -- and, as on B200, an unbind after the bound memory's
  last handle was released fails.

A mock accepts what real hardware rejects (wrong contexts, real granularity
values, cross-process behaviour); tests on a GPU remain necessary.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib
import os
import struct
from typing import Any, Callable

_FABRIC_MAGIC = b"moonep-fake-fabric"
_ADDRESS_BASE = 0x7F00_0000_0000


class _Fail(Exception):
    """Raised inside a fake call to return ``(code, None...)`` like the driver."""

    def __init__(self, code_name: str, why: str):
        super().__init__(why)
        self.code_name = code_name
        self.why = why


@dataclasses.dataclass(eq=False)
class _Alloc:
    """Physical memory from cuMemCreate."""

    ident: int
    size: int
    device: int
    handle_types: int
    handles: int = 0
    mappings: int = 0
    binds: int = 0

    def alive(self) -> bool:
        return bool(self.handles or self.mappings or self.binds)


@dataclasses.dataclass(eq=False)
class _Multicast:
    """A multicast object from cuMulticastCreate."""

    ident: int
    size: int
    num_devices: int
    handle_types: int
    devices: set[int] = dataclasses.field(default_factory=set)
    #: (device, mc_offset) -> (bound allocation, size)
    binds: dict[tuple[int, int], tuple[_Alloc, int]] = dataclasses.field(default_factory=dict)
    handles: int = 0
    mappings: int = 0
    #: Exported by POSIX fd: other members live in other processes (other fakes),
    #: whose AddDevice calls this fake cannot see; only its own add is required.
    shared: bool = False

    def alive(self) -> bool:
        return bool(self.handles or self.mappings or self.binds)


@dataclasses.dataclass(eq=False)
class _Mapping:
    addr: int
    size: int
    obj: Any
    offset: int
    access: int = 0


def _recorded(n_out: int) -> Callable:
    """Record ``(name, args)``, apply injected faults, turn ``_Fail`` into a result.

    On failure the real bindings return ``(code, None, ...)``, one ``None`` per
    output; so does the fake.
    """

    def deco(fn: Callable) -> Callable:
        name = fn.__name__

        @functools.wraps(fn)
        def wrapper(self: "RecordingCudaApi", *args: Any) -> tuple:
            self.calls.append((name, args))
            fault = self._take_fault(name)
            if fault is not None:
                self.errors.append((name, fault.name, "injected"))
                return (fault,) + (None,) * n_out
            if name != "cuInit" and not self._initialized:
                return self._failed(name, n_out, _Fail("CUDA_ERROR_NOT_INITIALIZED",
                                                       "cuInit has not been called"))
            try:
                out = fn(self, *args)
            except _Fail as fail:
                return self._failed(name, n_out, fail)
            if n_out == 0:
                return (self.CUresult.CUDA_SUCCESS,)
            if n_out == 1:
                return (self.CUresult.CUDA_SUCCESS, out)
            return (self.CUresult.CUDA_SUCCESS, *out)

        return wrapper

    return deco


class RecordingCudaApi:
    """Fake ``cuda.bindings.driver`` module: records calls, validates, injects faults.

    Args:
        granularity: allocation granularity reported and enforced (bytes).
        mc_granularity: multicast granularity (default: ``granularity``).
        fabric, multicast, vmm, posix_fd, rdma: device attributes.
        device_count: number of visible devices.
        peer_access: ``cuDeviceCanAccessPeer`` answer between distinct devices.
        total_memory: what ``cuMemGetInfo`` reports as total (free = total - live).
        strict_unbind: fail ``cuMulticastUnbind`` once the bound memory's last
            handle was released (the B200 behaviour; teardown-order bugs show).

    Attributes:
        calls: ``[(name, args), ...]`` in call order, failed calls included.
        errors: ``[(name, code_name, why), ...]`` for every failed call.
    """

    def __init__(self, *, granularity: int = 2 << 20, mc_granularity: int | None = None,
                 fabric: bool = True, multicast: bool = True, vmm: bool = True,
                 posix_fd: bool = True, rdma: bool = False, device_count: int = 1,
                 peer_access: bool = True, total_memory: int = 80 << 30,
                 strict_unbind: bool = True, name: str = "Fake CUDA device"):
        self._real = importlib.import_module("cuda.bindings.driver")
        self.granularity = int(granularity)
        self.mc_granularity = int(mc_granularity or granularity)
        self.device_count = int(device_count)
        self.peer_access = peer_access
        self.total_memory = int(total_memory)
        self.strict_unbind = strict_unbind
        self.device_name = name
        attr = self._real.CUdevice_attribute
        #: ``cuDeviceGetAttribute`` answers by attribute value; others read 0.
        self.attributes: dict[int, int] = {
            int(getattr(attr, f"CU_DEVICE_ATTRIBUTE_{name}")): int(value)
            for name, value in (
                ("VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED", vmm),
                ("HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED", posix_fd),
                ("GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED", rdma),
                ("HANDLE_TYPE_FABRIC_SUPPORTED", fabric),
                ("MULTICAST_SUPPORTED", multicast),
            )
        }
        self.calls: list[tuple[str, tuple]] = []
        self.errors: list[tuple[str, str, str]] = []
        self._faults: dict[str, list] = {}
        self._initialized = False
        self._ctx_refs: collections.Counter[int] = collections.Counter()
        self.current_context: int | None = None
        self._next_id = 0x10
        self._handles: dict[int, Any] = {}          # handle -> _Alloc | _Multicast
        self._objects: list[Any] = []               # every allocation / multicast object
        self._by_inode: dict[int, Any] = {}         # memfd inode -> exported object
        self._by_ident: dict[tuple[int, int], Any] = {}  # (pid, fabric id) -> exported object
        self._reservations: dict[int, int] = {}     # addr -> size
        self._next_addr = _ADDRESS_BASE
        self._mappings: dict[int, _Mapping] = {}    # addr -> mapping

    # -- module delegation ------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes not defined here: enums, structs, constants.
        # An unimplemented cu* function must not silently reach the real driver.
        if name.startswith("_"):
            raise AttributeError(name)
        if name.startswith("cu"):
            raise AttributeError(f"RecordingCudaApi does not implement {name}")
        return getattr(self._real, name)

    # -- fault injection and inspection -----------------------------------------------
    def fail(self, name: str, code: Any, times: int = 1) -> None:
        """Make the next ``times`` calls of ``name`` return ``code`` (a ``CUresult``)."""
        if isinstance(code, str):
            code = getattr(self.CUresult, code)
        self._faults[name] = [self.CUresult(int(code)), int(times)]

    def _take_fault(self, name: str) -> Any:
        fault = self._faults.get(name)
        if not fault or fault[1] <= 0:
            return None
        fault[1] -= 1
        return fault[0]

    def _failed(self, name: str, n_out: int, fail: _Fail) -> tuple:
        self.errors.append((name, fail.code_name, fail.why))
        return (getattr(self.CUresult, fail.code_name),) + (None,) * n_out

    def names(self) -> list[str]:
        """Names of the recorded calls, in order."""
        return [name for name, _ in self.calls]

    def calls_of(self, name: str) -> list[tuple]:
        """Argument tuples of every recorded call of ``name``."""
        return [args for n, args in self.calls if n == name]

    def live(self) -> dict[str, int]:
        """What the fake still holds; all zero after a clean teardown."""
        allocs = [o for o in self._objects if isinstance(o, _Alloc)]
        mcs = [o for o in self._objects if isinstance(o, _Multicast)]
        return {
            "handles": sum(isinstance(o, _Alloc) for o in self._handles.values()),
            "multicast_handles": sum(isinstance(o, _Multicast) for o in self._handles.values()),
            "allocations": sum(a.alive() for a in allocs),
            "multicast_objects": sum(m.alive() for m in mcs),
            "reservations": len(self._reservations),
            "mappings": len(self._mappings),
            "binds": sum(len(m.binds) for m in mcs),
            "contexts": sum(self._ctx_refs.values()),
        }

    # -- helpers -----------------------------------------------------------------------
    def _attr(self, name: str) -> int:
        return self.attributes.get(
            int(getattr(self.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name}")), 0)

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _obj(self, handle: Any, kind: type | None = None) -> Any:
        try:
            obj = self._handles[int(handle)]
        except (KeyError, TypeError, ValueError):
            raise _Fail("CUDA_ERROR_INVALID_VALUE", f"unknown handle {handle!r}") from None
        if kind is not None and not isinstance(obj, kind):
            raise _Fail("CUDA_ERROR_INVALID_VALUE", f"handle {handle!r} is not a {kind.__name__}")
        return obj

    def _device(self, dev: Any) -> int:
        ordinal = int(dev)
        if not 0 <= ordinal < self.device_count:
            raise _Fail("CUDA_ERROR_INVALID_DEVICE", f"device {ordinal} out of range")
        return ordinal

    def _aligned(self, what: str, value: int, gran: int) -> None:
        if int(value) % gran:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", f"{what}={value} is not a multiple of {gran}")

    def _reservation_of(self, addr: int, size: int) -> int:
        for base, rsize in self._reservations.items():
            if base <= addr and addr + size <= base + rsize:
                return base
        raise _Fail("CUDA_ERROR_INVALID_VALUE",
                    f"[{addr:#x}, +{size}) is not inside one reservation")

    def _foreign(self, fd: int, st: os.stat_result) -> Any:
        """Stand-in for memory exported by another process's fake (multi-process tests).

        The peer's memory is modelled as an allocation on the peer's device; a
        multicast object as a team whose other members were added elsewhere."""
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return None
        parts = name.replace("/memfd:", "").split(" ")[0].split("-")
        if parts[:3] != ["moonep", "fake", "cuda"] or len(parts) != 7:
            return None
        kind, ident, extra, handle_types = parts[3], int(parts[4]), int(parts[5]), int(parts[6])
        if kind == "mc":
            obj: Any = _Multicast(self._new_id(), st.st_size, extra, handle_types)
            obj.shared = True
        else:
            obj = _Alloc(self._new_id(), st.st_size, extra, handle_types)
        self._objects.append(obj)
        self._by_inode[st.st_ino] = obj
        return obj

    def _new_handle(self, obj: Any) -> int:
        handle = self._new_id()
        self._handles[handle] = obj
        obj.handles += 1
        return handle

    # -- init, devices, contexts -------------------------------------------------------
    @_recorded(0)
    def cuInit(self, flags):
        if int(flags) != 0:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", "cuInit flags must be 0")
        self._initialized = True

    @_recorded(1)
    def cuDeviceGetCount(self):
        return self.device_count

    @_recorded(1)
    def cuDeviceGet(self, ordinal):
        return self._real.CUdevice(self._device(ordinal))

    @_recorded(1)
    def cuDeviceGetName(self, length, dev):
        self._device(dev)
        return self.device_name.encode()[: int(length) - 1]

    @_recorded(1)
    def cuDeviceGetAttribute(self, attrib, dev):
        self._device(dev)
        return self.attributes.get(int(attrib), 0)

    @_recorded(1)
    def cuDeviceCanAccessPeer(self, dev, peer):
        a, b = self._device(dev), self._device(peer)
        return int(bool(self.peer_access) and a != b)

    @_recorded(1)
    def cuDevicePrimaryCtxRetain(self, dev):
        ordinal = self._device(dev)
        self._ctx_refs[ordinal] += 1
        return self._real.CUcontext(0xC0_0000 + ordinal)

    @_recorded(0)
    def cuDevicePrimaryCtxRelease(self, dev):
        ordinal = self._device(dev)
        if self._ctx_refs[ordinal] <= 0:
            raise _Fail("CUDA_ERROR_INVALID_CONTEXT", f"no retained primary context on {ordinal}")
        self._ctx_refs[ordinal] -= 1
        if not self._ctx_refs[ordinal]:
            del self._ctx_refs[ordinal]

    @_recorded(0)
    def cuCtxSetCurrent(self, ctx):
        self.current_context = int(ctx)

    @_recorded(0)
    def cuCtxSynchronize(self):
        if not self.current_context:
            raise _Fail("CUDA_ERROR_INVALID_CONTEXT", "no current context")

    @_recorded(2)
    def cuMemGetInfo(self):
        used = sum(o.size for o in self._objects if isinstance(o, _Alloc) and o.alive())
        return self.total_memory - used, self.total_memory

    # -- physical memory ---------------------------------------------------------------
    @_recorded(1)
    def cuMemGetAllocationGranularity(self, prop, option):
        if not isinstance(prop, self._real.CUmemAllocationProp):
            raise TypeError("prop must be a CUmemAllocationProp")
        int(option)
        return self.granularity

    @_recorded(1)
    def cuMemCreate(self, size, prop, flags=0):
        if not isinstance(prop, self._real.CUmemAllocationProp):
            raise TypeError("prop must be a CUmemAllocationProp")
        if int(flags) != 0:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", "flags must be 0")
        if int(size) <= 0:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", "size must be positive")
        self._aligned("size", size, self.granularity)
        if int(prop.type) != int(self.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED):
            raise _Fail("CUDA_ERROR_INVALID_VALUE", "only pinned allocations are modelled")
        if int(prop.location.type) != int(self.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE):
            raise _Fail("CUDA_ERROR_INVALID_VALUE", "only device allocations are modelled")
        device = self._device(prop.location.id)
        handle_types = int(prop.requestedHandleTypes)
        fabric = int(self.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC)
        if handle_types & fabric and not self._attr("HANDLE_TYPE_FABRIC_SUPPORTED"):
            raise _Fail("CUDA_ERROR_NOT_SUPPORTED", "FABRIC handles not supported")
        alloc = _Alloc(self._new_id(), int(size), device, handle_types)
        self._objects.append(alloc)
        return self._new_handle(alloc)

    @_recorded(0)
    def cuMemRelease(self, handle):
        obj = self._obj(handle)
        del self._handles[int(handle)]
        obj.handles -= 1

    @_recorded(1)
    def cuMemExportToShareableHandle(self, handle, handle_type, flags=0):
        obj = self._obj(handle)
        ht = int(handle_type)
        if int(flags) != 0:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", "flags must be 0")
        if not obj.handle_types & ht:
            raise _Fail("CUDA_ERROR_INVALID_VALUE",
                        f"handle type {ht} was not requested at creation ({obj.handle_types})")
        if ht == int(self.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR):
            # The fd names the object and carries its size (sparse, no memory), so a
            # fake in *another process* can import it as a stand-in (see _foreign).
            if isinstance(obj, _Multicast):
                obj.shared = True
                name = f"moonep-fake-cuda-mc-{obj.ident}-{obj.num_devices}-{obj.handle_types}"
            else:
                name = f"moonep-fake-cuda-mem-{obj.ident}-{obj.device}-{obj.handle_types}"
            fd = os.memfd_create(name, os.MFD_CLOEXEC)
            os.ftruncate(fd, obj.size)
            self._by_inode[os.fstat(fd).st_ino] = obj
            return fd
        if ht == int(self.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC):
            fabric = self._real.CUmemFabricHandle()
            # ident, then what a fake in another process needs for a stand-in:
            # kind (0 memory, 1 multicast), size, device or member count, handle types.
            is_mc = isinstance(obj, _Multicast)
            if is_mc:
                obj.shared = True
            payload = _FABRIC_MAGIC + struct.pack(
                "<QBQIIi", obj.ident, int(is_mc), obj.size,
                obj.num_devices if is_mc else obj.device, obj.handle_types, os.getpid())
            fabric.data = payload.ljust(64, b"\0")
            self._by_ident[(os.getpid(), obj.ident)] = obj
            return fabric
        raise _Fail("CUDA_ERROR_NOT_SUPPORTED", f"handle type {ht} not modelled")

    @_recorded(1)
    def cuMemImportFromShareableHandle(self, os_handle, handle_type):
        ht = int(handle_type)
        if ht == int(self.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR):
            if isinstance(os_handle, bool) or not isinstance(os_handle, int):
                raise TypeError(f"POSIX fd must be an int, got {type(os_handle).__name__}")
            try:
                st = os.fstat(os_handle)
            except OSError as exc:
                raise _Fail("CUDA_ERROR_INVALID_VALUE", f"bad fd {os_handle}: {exc}") from None
            obj = self._by_inode.get(st.st_ino)
            if obj is None:
                obj = self._foreign(os_handle, st)
                if obj is not None:
                    return self._new_handle(obj)
        elif ht == int(self.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC):
            # Same rule as the bindings: a buffer, not a CUmemFabricHandle.
            if not isinstance(os_handle, (bytes, bytearray, memoryview)):
                raise TypeError(f"Provided argument is of type {type(os_handle)} but expected "
                                "Type None, int or object with Buffer Protocol")
            data = bytes(os_handle)
            if len(data) != 64 or not data.startswith(_FABRIC_MAGIC):
                raise _Fail("CUDA_ERROR_INVALID_VALUE", "not a fabric handle of this fake")
            ident, is_mc, size, extra, handle_types, pid = struct.unpack_from(
                "<QBQIIi", data, len(_FABRIC_MAGIC))
            obj = self._by_ident.get((pid, ident))  # idents repeat across processes; pids do not
            if obj is None:  # exported by another process's fake: a stand-in, as for fds
                if is_mc:
                    obj = _Multicast(self._new_id(), size, extra, handle_types)
                    obj.shared = True
                else:
                    obj = _Alloc(self._new_id(), size, extra, handle_types)
                self._objects.append(obj)
                self._by_ident[(pid, ident)] = obj
                return self._new_handle(obj)
        else:
            raise _Fail("CUDA_ERROR_NOT_SUPPORTED", f"handle type {ht} not modelled")
        if obj is None or not obj.alive():
            raise _Fail("CUDA_ERROR_INVALID_VALUE", "shareable handle refers to no live object")
        return self._new_handle(obj)

    # -- virtual ranges ----------------------------------------------------------------
    @_recorded(1)
    def cuMemAddressReserve(self, size, alignment, addr, flags=0):
        size, alignment = int(size), int(alignment)
        if size <= 0 or int(flags) != 0 or int(addr) != 0:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", "size > 0, addr 0 and flags 0 expected")
        self._aligned("size", size, self.granularity)
        if alignment & (alignment - 1):
            raise _Fail("CUDA_ERROR_INVALID_VALUE", f"alignment {alignment} is not a power of two")
        align = max(alignment, self.granularity)
        base = -(-self._next_addr // align) * align
        # Leave a one-granule gap so ranges never touch and overruns show.
        self._next_addr = base + size + self.granularity
        self._reservations[base] = size
        return base

    @_recorded(0)
    def cuMemAddressFree(self, ptr, size):
        ptr, size = int(ptr), int(size)
        if self._reservations.get(ptr) != size:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", f"[{ptr:#x}, +{size}) is not a reservation")
        if any(ptr <= m < ptr + size for m in self._mappings):
            raise _Fail("CUDA_ERROR_INVALID_VALUE", "reservation still has mappings")
        del self._reservations[ptr]

    @_recorded(0)
    def cuMemMap(self, ptr, size, offset, handle, flags=0):
        ptr, size, offset = int(ptr), int(size), int(offset)
        obj = self._obj(handle)
        if int(flags) != 0 or size <= 0:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", "size > 0 and flags 0 expected")
        gran = self.mc_granularity if isinstance(obj, _Multicast) else self.granularity
        for what, value in (("ptr", ptr), ("size", size), ("offset", offset)):
            self._aligned(what, value, gran)
        self._reservation_of(ptr, size)
        if offset + size > obj.size:
            raise _Fail("CUDA_ERROR_INVALID_VALUE",
                        f"offset {offset} + size {size} exceeds the object's {obj.size} bytes")
        if isinstance(obj, _Multicast):
            if offset != 0:
                raise _Fail("CUDA_ERROR_INVALID_VALUE", "multicast objects map from offset 0")
            if len(obj.devices) < (1 if obj.shared else obj.num_devices):
                # The real driver blocks here until every member was added.
                raise _Fail("CUDA_ERROR_ILLEGAL_STATE", "map before all devices were added "
                                                        "(would block forever)")
        for m in self._mappings.values():
            if m.addr < ptr + size and ptr < m.addr + m.size:
                raise _Fail("CUDA_ERROR_ALREADY_MAPPED", f"{ptr:#x} overlaps mapping {m.addr:#x}")
        self._mappings[ptr] = _Mapping(ptr, size, obj, offset)
        obj.mappings += 1

    @_recorded(0)
    def cuMemUnmap(self, ptr, size):
        ptr, size = int(ptr), int(size)
        inside = [m for m in self._mappings.values() if ptr <= m.addr < ptr + size]
        if not inside:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", f"nothing mapped at [{ptr:#x}, +{size})")
        for m in self._mappings.values():
            overlaps = m.addr < ptr + size and ptr < m.addr + m.size
            if overlaps and (m.addr < ptr or m.addr + m.size > ptr + size):
                raise _Fail("CUDA_ERROR_INVALID_VALUE",
                            f"cannot unmap part of mapping {m.addr:#x}")
        for m in inside:
            del self._mappings[m.addr]
            m.obj.mappings -= 1

    @_recorded(0)
    def cuMemSetAccess(self, ptr, size, desc, count):
        ptr, size = int(ptr), int(size)
        descs = list(desc)  # the bindings iterate it too: a bare desc is a TypeError
        if len(descs) != int(count) or not descs:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", f"count {count} != {len(descs)} descriptors")
        for d in descs:
            if not isinstance(d, self._real.CUmemAccessDesc):
                raise TypeError("desc items must be CUmemAccessDesc")
            if int(d.location.type) != int(self.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE):
                raise _Fail("CUDA_ERROR_INVALID_VALUE", "only device locations are modelled")
            self._device(d.location.id)
        covered = sorted((m for m in self._mappings.values()
                          if m.addr < ptr + size and ptr < m.addr + m.size), key=lambda m: m.addr)
        cursor = ptr
        for m in covered:
            if m.addr > cursor:
                break
            cursor = max(cursor, m.addr + m.size)
        if cursor < ptr + size:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", f"[{ptr:#x}, +{size}) is not fully mapped")
        for m in covered:
            m.access = int(descs[-1].flags)

    # -- multicast ---------------------------------------------------------------------
    def _check_mc_prop(self, prop: Any) -> None:
        if not isinstance(prop, self._real.CUmulticastObjectProp):
            raise TypeError("prop must be a CUmulticastObjectProp")
        if int(prop.numDevices) < 1 or int(prop.flags) != 0:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", "numDevices >= 1 and flags 0 expected")

    @_recorded(1)
    def cuMulticastGetGranularity(self, prop, option):
        self._check_mc_prop(prop)
        int(option)
        return self.mc_granularity

    @_recorded(1)
    def cuMulticastCreate(self, prop):
        self._check_mc_prop(prop)
        if not self._attr("MULTICAST_SUPPORTED"):
            raise _Fail("CUDA_ERROR_NOT_SUPPORTED", "multicast not supported")
        size = int(prop.size)
        if size <= 0:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", "size must be positive")
        self._aligned("size", size, self.mc_granularity)
        mc = _Multicast(self._new_id(), size, int(prop.numDevices), int(prop.handleTypes))
        self._objects.append(mc)
        return self._new_handle(mc)

    @_recorded(0)
    def cuMulticastAddDevice(self, mc_handle, dev):
        mc = self._obj(mc_handle, _Multicast)
        ordinal = self._device(dev)
        if ordinal not in mc.devices and len(mc.devices) >= mc.num_devices:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", f"team of {mc.num_devices} is full")
        mc.devices.add(ordinal)

    @_recorded(0)
    def cuMulticastBindMem(self, mc_handle, mc_offset, mem_handle, mem_offset, size, flags=0):
        mc = self._obj(mc_handle, _Multicast)
        alloc = self._obj(mem_handle, _Alloc)
        mc_offset, mem_offset, size = int(mc_offset), int(mem_offset), int(size)
        if int(flags) != 0 or size <= 0:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", "size > 0 and flags 0 expected")
        self._aligned("mcOffset", mc_offset, self.mc_granularity)
        self._aligned("size", size, self.mc_granularity)
        self._aligned("memOffset", mem_offset, self.granularity)
        if mc_offset + size > mc.size or mem_offset + size > alloc.size:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", "bind range exceeds the object or allocation")
        if alloc.device not in mc.devices:
            raise _Fail("CUDA_ERROR_INVALID_DEVICE", f"device {alloc.device} was not added")
        if len(mc.devices) < (1 if mc.shared else mc.num_devices):
            # The real driver blocks until every member was added (a hang).
            raise _Fail("CUDA_ERROR_ILLEGAL_STATE", "bind before all devices were added "
                                                    "(would block forever)")
        for (dev, off), (_, bsize) in mc.binds.items():
            if dev == alloc.device and off < mc_offset + size and mc_offset < off + bsize:
                raise _Fail("CUDA_ERROR_INVALID_VALUE", f"overlaps the bind at offset {off}")
        mc.binds[(alloc.device, mc_offset)] = (alloc, size)
        alloc.binds += 1

    @_recorded(0)
    def cuMulticastUnbind(self, mc_handle, dev, mc_offset, size):
        mc = self._obj(mc_handle, _Multicast)
        key = (self._device(dev), int(mc_offset))
        bound = mc.binds.get(key)
        if bound is None or bound[1] != int(size):
            raise _Fail("CUDA_ERROR_INVALID_VALUE", f"no bind of {size} bytes at {key}")
        alloc = bound[0]
        if self.strict_unbind and alloc.handles == 0:
            raise _Fail("CUDA_ERROR_INVALID_VALUE",
                        "bound memory was released before the unbind (unbind first)")
        del mc.binds[key]
        alloc.binds -= 1
