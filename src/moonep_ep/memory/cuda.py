"""CUDA VMM memory driver: ``MemoryDriver`` over ``cuda.bindings.driver``.

Pure Python; every primitive is one (occasionally two) CUDA driver calls.
``cuda.bindings`` is imported lazily, so ``import moonep_ep.memory.cuda``
works on machines without it and without an NVIDIA driver; ``capabilities()``
then reports why the driver is unavailable instead of raising.

Calling convention of the bindings: every ``cu*`` function returns a tuple
whose first item is a ``CUresult``; :meth:`CudaDriver.check` turns a failure
into a :class:`~moonep_ep.errors.DriverError` naming the result code
(``CUDA_ERROR_NOT_PERMITTED``), the call and the rank, and returns the
remaining outputs (none, one, or a tuple).

Objects are plain ``int`` values: allocation and multicast handles
(``CUmemGenericAllocationHandle``) and virtual addresses (``CUdeviceptr``) are
converted with ``int()`` on the way out and passed back as ints, which the
bindings accept for those parameter types.

Teardown order (the caller's job; ``symmetric.py`` follows it):

1. ``synchronize()`` -- no kernel or copy may still touch a range that is
   about to be unmapped (an unmap under a running kernel is an illegal-address
   fault that poisons the context);
2. ``multicast_unbind`` every bind -- *before* the bound memory is unmapped or
   released (on some systems an unbind after that fails with
   ``CUDA_ERROR_INVALID_VALUE`` and leaves the multicast team inconsistent);
3. ``unmap`` every mapping (unicast and multicast ranges);
4. ``multicast_release`` multicast handles, then ``release`` memory handles --
   physical memory is returned when the last handle *and* mapping are gone;
5. ``free_reservation`` last: a reservation must be empty when freed;
6. ``close()`` drops this driver's reference on the primary context.

Not thread-safe: one allocator drives one ``CudaDriver``. The primary context
is made current on each thread that issues a call, once per thread.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import torch

from .driver import Capabilities, HandleType, MemoryDriver, Shareable

#: Why a given result code usually happens, appended to the error message so
#: that the log line from the failing rank says what to do about it.
_HINTS: dict[str, str] = {
    "CUDA_ERROR_INVALID_VALUE":
        "sizes, offsets and addresses must be multiples of the granularity queried "
        "for this exact allocation prop; a multicast unbind after the bound memory "
        "was released also reports this",
    "CUDA_ERROR_OUT_OF_MEMORY": "not enough free device memory for this allocation",
    "CUDA_ERROR_NOT_INITIALIZED": "the CUDA driver is not initialised in this process",
    "CUDA_ERROR_INVALID_CONTEXT": "no current CUDA context on this thread",
    "CUDA_ERROR_NO_DEVICE": "no CUDA device is visible (check CUDA_VISIBLE_DEVICES)",
    "CUDA_ERROR_INVALID_DEVICE": "device ordinal out of range or no peer path to it",
    "CUDA_ERROR_ALREADY_MAPPED": "the address range is already mapped; unmap it first",
    "CUDA_ERROR_INVALID_HANDLE":
        "the shareable handle is not valid here (different host or NVLink clique, "
        "or the exporter released it before this import)",
    "CUDA_ERROR_NOT_PERMITTED":
        "for FABRIC handles: no IMEX channel (/dev/nvidia-caps-imex-channels) or no "
        "access to it; fall back to POSIX_FD handles within one node",
    "CUDA_ERROR_NOT_SUPPORTED":
        "this device/driver does not support the requested handle type, VMM or "
        "multicast; see capabilities()",
    "CUDA_ERROR_ILLEGAL_STATE":
        "multicast: NVIDIA Fabric Manager not running or restarted without a GPU "
        "reset; or a member bound before every device was added",
    "CUDA_ERROR_SYSTEM_NOT_READY":
        "transient fabric stall while forming the multicast team; retry on all "
        "ranks together or abort on all ranks",
    "CUDA_ERROR_MULTICAST_RESOURCE_FULL": "no multicast resources left on this fabric",
    "CUDA_ERROR_ILLEGAL_ADDRESS":
        "a kernel touched unmapped memory (synchronize before unmap); the context "
        "is now unusable",
}


def _is_missing_driver_library(exc: BaseException) -> bool:
    """True for the bindings' "libcuda not found" error (no NVIDIA driver here).

    ``cuda.pathfinder.DynamicLibNotFoundError`` subclasses ``RuntimeError``;
    matched by name so that this module does not import ``cuda.pathfinder``.
    """
    return any(cls.__name__ == "DynamicLibNotFoundError" for cls in type(exc).__mro__)


class DeviceMemoryView:
    """``__cuda_array_interface__`` (v3) of ``nbytes`` bytes at ``addr``.

    Exposes a 1-D ``uint8`` array (typestr ``|u1``, shape ``(nbytes,)``,
    contiguous) and holds a strong reference to ``owner``. ``torch.as_tensor``
    keeps this object alive for as long as the resulting storage lives, so the
    owner -- whose finalizer unmaps the range -- outlives every view.
    """

    __slots__ = ("addr", "nbytes", "owner", "__weakref__")

    def __init__(self, addr: int, nbytes: int, owner: object):
        self.addr = int(addr)
        self.nbytes = int(nbytes)
        self.owner = owner

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "shape": (self.nbytes,),
            "typestr": "|u1",
            "data": (self.addr, False),
            "strides": None,
            "version": 3,
        }


class CudaDriver(MemoryDriver):
    """CUDA virtual-memory-management driver for one device of this process.

    Args:
        device: CUDA device ordinal; default ``torch.cuda.current_device()``
            when torch has CUDA, else 0.
        rank: used in error messages only.
        api: the ``cuda.bindings.driver`` module (default) or a stand-in with
            the same interface, e.g. :class:`moonep_ep.testing.cuda_fake.RecordingCudaApi`.
    """

    name = "cuda"
    device_type = "cuda"
    hardware_multicast = True

    def __init__(self, device: int | None = None, rank: int | None = None, api: Any = None):
        super().__init__(rank)
        if device is None:
            device = torch.cuda.current_device() if torch.cuda.is_available() else 0
        self.device = int(device)
        self._api = api
        self._cu_device: Any = None     # CUdevice from cuDeviceGet
        self._ctx: Any = None           # retained primary context
        self._thread = threading.local()  # .ctx_current: primary ctx set on this thread
        self._props: dict[HandleType, Any] = {}
        self._gran: dict[HandleType, int] = {}
        self._mc_gran: dict[tuple[int, HandleType], int] = {}
        self._rdma: bool | None = None
        # Live objects, updated only after the driver call succeeded.
        self._created: dict[int, int] = {}                      # handle -> size
        self._imported: dict[int, int | None] = {}              # handle -> size if known
        self._import_refs: collections.Counter[int] = collections.Counter()
        self._reservations: dict[int, int] = {}                 # addr -> size
        self._mappings: dict[int, int] = {}                     # addr -> size
        self._multicast: dict[int, int | None] = {}             # mc handle -> size if known
        self._mc_refs: collections.Counter[int] = collections.Counter()
        self._binds: dict[tuple[int, int], int] = {}            # (mc, mc_offset) -> size

    # -- bindings and result checking --------------------------------------------
    @property
    def api(self) -> Any:
        """The driver module (imported on first use)."""
        if self._api is None:
            from cuda.bindings import driver  # lazy: keep this module importable anywhere
            self._api = driver
        return self._api

    def _code_name(self, code: Any) -> str:
        name = getattr(code, "name", None)
        if name:
            return str(name)
        try:
            return str(self.api.CUresult(int(code)).name)
        except Exception:  # an unknown code still deserves a readable message
            return f"CUresult({code!r})"

    def check(self, result: Any, call: str, detail: str = "") -> Any:
        """Unpack ``(CUresult, *outputs)``; raise ``DriverError`` unless CUDA_SUCCESS.

        Returns ``None``, the single output, or a tuple of outputs.
        """
        if not isinstance(result, tuple) or not result:
            raise self.error(call, f"unexpected return value {result!r} from the bindings")
        code, outs = result[0], result[1:]
        if int(code) != 0:
            name = self._code_name(code)
            parts = [p for p in (detail, _HINTS.get(name, "")) if p]
            raise self.error(call, "; ".join(parts) or "failed", name)
        if not outs:
            return None
        return outs[0] if len(outs) == 1 else outs

    def _cu(self, call: str, *args: Any, detail: str = "", context: bool = True) -> Any:
        """Call ``api.<call>(*args)`` and :meth:`check` the result."""
        if context:
            self._ensure_context()
        try:
            result = getattr(self.api, call)(*args)
        except RuntimeError as exc:
            if _is_missing_driver_library(exc):
                raise self.error(call, f"no NVIDIA driver library (libcuda) found: {exc}",
                                 "NO_DRIVER_LIBRARY") from exc
            raise
        return self.check(result, call, detail)

    # -- context -------------------------------------------------------------------
    def _ensure_context(self) -> None:
        """Make the device's primary context (the one torch uses) current here.

        Driver calls on a thread without a current context fail or land in the
        wrong context, so: ``cuInit``, ``cuDeviceGet``, ``cuDevicePrimaryCtxRetain``
        once per driver, and ``cuCtxSetCurrent`` once per calling thread.
        """
        if self._ctx is None:
            self._cu("cuInit", 0, context=False)
            self._cu_device = self._cu("cuDeviceGet", self.device, context=False,
                                       detail=f"device {self.device}")
            self._ctx = self._cu("cuDevicePrimaryCtxRetain", self._cu_device, context=False,
                                 detail=f"device {self.device}")
        if not getattr(self._thread, "ctx_current", False):
            self._cu("cuCtxSetCurrent", self._ctx, context=False)
            self._thread.ctx_current = True

    def close(self) -> None:
        """Drop this driver's reference on the primary context (idempotent).

        Call after the teardown above. torch holds its own reference, so the
        context stays alive while torch uses the device.
        """
        if self._ctx is not None:
            ctx_dev, self._ctx = self._cu_device, None
            self._thread = threading.local()
            self._cu("cuDevicePrimaryCtxRelease", ctx_dev, context=False)

    # -- props and granularity -------------------------------------------------------
    def _handle_type_enum(self, handle_type: HandleType) -> Any:
        ht = self.api.CUmemAllocationHandleType
        if HandleType(handle_type) is HandleType.FABRIC:
            return ht.CU_MEM_HANDLE_TYPE_FABRIC
        return ht.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR

    def _attribute(self, name: str) -> int:
        attr = getattr(self.api.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name}")
        self._ensure_context()
        return int(self._cu("cuDeviceGetAttribute", attr, self._cu_device, detail=name))

    def _alloc_prop(self, handle_type: HandleType) -> Any:
        """The one ``CUmemAllocationProp`` used for both granularity and create.

        Pinned device memory on ``self.device`` exportable as ``handle_type``;
        ``gpuDirectRDMACapable`` when the device supports RDMA on VMM memory
        (granularity depends on the exact prop, hence one cached prop per type).
        """
        handle_type = HandleType(handle_type)
        prop = self._props.get(handle_type)
        if prop is None:
            api = self.api
            prop = api.CUmemAllocationProp()
            prop.type = api.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            prop.location.type = api.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            prop.location.id = self.device
            prop.requestedHandleTypes = self._handle_type_enum(handle_type)
            if self._rdma is None:
                try:
                    self._rdma = bool(self._attribute("GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED"))
                except Exception:  # optional flag: leave it off if the query fails
                    self._rdma = False
            if self._rdma:
                prop.allocFlags.gpuDirectRDMACapable = 1
            self._props[handle_type] = prop
        return prop

    def granularity(self, handle_type: HandleType) -> int:
        """RECOMMENDED granularity (bytes) of this driver's prop for ``handle_type``."""
        handle_type = HandleType(handle_type)
        if handle_type not in self._gran:
            prop = self._alloc_prop(handle_type)
            flag = self.api.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
            self._gran[handle_type] = int(self._cu(
                "cuMemGetAllocationGranularity", prop, flag,
                detail=f"handle_type={handle_type.value}"))
        return self._gran[handle_type]

    def _mc_prop(self, size: int, num_devices: int, handle_type: HandleType) -> Any:
        prop = self.api.CUmulticastObjectProp()
        prop.numDevices = int(num_devices)
        prop.size = int(size)
        prop.handleTypes = int(self._handle_type_enum(handle_type))  # a bitmask field
        prop.flags = 0
        return prop

    def multicast_granularity(self, num_devices: int, handle_type: HandleType) -> int:
        """RECOMMENDED multicast granularity (bytes) for a team of ``num_devices``.

        Queried with ``size=0``: the size of the object does not enter the query.
        """
        key = (int(num_devices), HandleType(handle_type))
        if key not in self._mc_gran:
            prop = self._mc_prop(0, num_devices, handle_type)
            flag = self.api.CUmulticastGranularity_flags.CU_MULTICAST_GRANULARITY_RECOMMENDED
            self._mc_gran[key] = int(self._cu(
                "cuMulticastGetGranularity", prop, flag,
                detail=f"num_devices={num_devices}, handle_type={key[1].value}"))
        return self._mc_gran[key]

    # -- physical memory --------------------------------------------------------------
    def create(self, size: int, handle_type: HandleType, tag: str = "") -> int:
        """``cuMemCreate`` of ``size`` bytes (a multiple of ``granularity(handle_type)``).
        ``tag`` is accepted for interface parity and ignored (VMM memory has no name).

        Returns the allocation handle (int). Memory is **not** zero-filled.
        """
        handle_type = HandleType(handle_type)
        gran = self.granularity(handle_type)
        if size <= 0 or size % gran:
            raise self.error("cuMemCreate",
                             f"size {size} is not a positive multiple of the {handle_type.value} "
                             f"granularity {gran} of cuda:{self.device}; round it up first")
        handle = int(self._cu("cuMemCreate", int(size), self._alloc_prop(handle_type), 0,
                              detail=f"size={size}, handle_type={handle_type.value}, "
                                     f"device=cuda:{self.device}"))
        self._created[handle] = int(size)
        return handle

    def release(self, handle: Any) -> None:
        """``cuMemRelease``: drop this handle; mappings keep the memory alive."""
        handle = int(handle)
        self._cu("cuMemRelease", handle, detail=f"handle={handle:#x}")
        self._forget_handle(handle)

    def _forget_handle(self, handle: int) -> None:
        if handle in self._created:
            del self._created[handle]
        elif handle in self._import_refs:
            self._import_refs[handle] -= 1
            if self._import_refs[handle] <= 0:
                del self._import_refs[handle]
                self._imported.pop(handle, None)
        elif handle in self._mc_refs:
            self._mc_refs[handle] -= 1
            if self._mc_refs[handle] <= 0:
                del self._mc_refs[handle]
                self._multicast.pop(handle, None)

    def _export(self, call_handle: int, handle_type: HandleType, what: str) -> Shareable:
        handle_type = HandleType(handle_type)
        out = self._cu("cuMemExportToShareableHandle", int(call_handle),
                       self._handle_type_enum(handle_type), 0,
                       detail=f"{what}={int(call_handle):#x}, handle_type={handle_type.value}")
        if handle_type is HandleType.POSIX_FD:
            return int(out)
        data = bytes(out.data)  # CUmemFabricHandle: ship the 64 opaque bytes
        if len(data) != 64:
            raise self.error("cuMemExportToShareableHandle",
                             f"fabric handle has {len(data)} bytes, expected 64")
        return data

    def _import(self, shareable: Shareable, handle_type: HandleType) -> int:
        handle_type = HandleType(handle_type)
        call = "cuMemImportFromShareableHandle"
        if handle_type is HandleType.POSIX_FD:
            if isinstance(shareable, bool) or not isinstance(shareable, int):
                raise self.error(call, "POSIX_FD import needs an int fd, got "
                                       f"{type(shareable).__name__}")
            os_handle: Any = int(shareable)
        else:
            # The bindings want a buffer, not a CUmemFabricHandle (TypeError otherwise).
            if not isinstance(shareable, (bytes, bytearray, memoryview)) or len(shareable) != 64:
                raise self.error(call, "FABRIC import needs the 64 bytes of the exported handle, "
                                       f"got {type(shareable).__name__}")
            os_handle = bytes(shareable)
        return int(self._cu(call, os_handle, self._handle_type_enum(handle_type),
                            detail=f"handle_type={handle_type.value}"))

    def export(self, handle: Any, handle_type: HandleType) -> Shareable:
        """``cuMemExportToShareableHandle``: an int fd (new, caller closes it) or 64 bytes."""
        return self._export(handle, handle_type, "handle")

    def import_handle(self, shareable: Shareable, handle_type: HandleType,
                      size: int | None = None) -> int:
        """``cuMemImportFromShareableHandle``; the caller still owns and closes a passed fd.

        ``size`` (the exporter's allocation size, exchanged with the handle) is
        remembered for :meth:`handle_size`; the driver cannot report it.
        """
        handle = self._import(shareable, handle_type)
        self._import_refs[handle] += 1
        if size is not None or handle not in self._imported:
            self._imported[handle] = None if size is None else int(size)
        return handle

    def handle_size(self, handle: Any) -> int:
        """Size of a created handle, or of an imported one when ``size=`` was given."""
        handle = int(handle)
        size = self._created.get(handle)
        if size is None:
            size = self._imported.get(handle)
        if size is None:
            size = self._multicast.get(handle)
        if size is None:
            raise self.error("handle_size", f"size of handle {handle:#x} is unknown: pass "
                                            "size= to import_handle/multicast_import")
        return size

    # -- virtual ranges ----------------------------------------------------------------
    def reserve(self, size: int, alignment: int) -> int:
        """``cuMemAddressReserve(size, alignment, 0, 0)``; returns the base address."""
        addr = int(self._cu("cuMemAddressReserve", int(size), int(alignment), 0, 0,
                            detail=f"size={size}, alignment={alignment}"))
        self._reservations[addr] = int(size)
        return addr

    def free_reservation(self, addr: int, size: int) -> None:
        """``cuMemAddressFree``: the range must have no mappings left."""
        self._cu("cuMemAddressFree", int(addr), int(size), detail=f"addr={addr:#x}, size={size}")
        self._reservations.pop(int(addr), None)

    def map(self, addr: int, size: int, handle: Any, offset: int) -> None:
        """``cuMemMap(addr, size, offset, handle, 0)``; follow with :meth:`set_access`."""
        self._cu("cuMemMap", int(addr), int(size), int(offset), int(handle), 0,
                 detail=f"addr={addr:#x}, size={size}, offset={offset}, handle={int(handle):#x}")
        self._mappings[int(addr)] = int(size)

    def unmap(self, addr: int, size: int) -> None:
        """``cuMemUnmap``; :meth:`synchronize` first if any work may touch the range."""
        addr, size = int(addr), int(size)
        self._cu("cuMemUnmap", addr, size, detail=f"addr={addr:#x}, size={size}")
        for start in [a for a in self._mappings if addr <= a < addr + size]:
            del self._mappings[start]

    def _access_desc(self) -> Any:
        api = self.api
        desc = api.CUmemAccessDesc()
        desc.location.type = api.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = self.device
        desc.flags = api.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        return desc

    def set_access(self, addr: int, size: int) -> None:
        """``cuMemSetAccess``: read/write for this device on a mapped range."""
        self._cu("cuMemSetAccess", int(addr), int(size), [self._access_desc()], 1,
                 detail=f"addr={addr:#x}, size={size}, device=cuda:{self.device}")

    def synchronize(self) -> None:
        """Wait for all work on the device (``torch.cuda.synchronize`` or ``cuCtxSynchronize``)."""
        if torch.cuda.is_available():
            torch.cuda.synchronize(self.device)
        else:
            self._cu("cuCtxSynchronize")

    # -- tensors -----------------------------------------------------------------------
    def as_tensor(self, addr: int, nbytes: int, owner: object) -> torch.Tensor:
        """Zero-copy ``torch.uint8`` tensor of shape ``(nbytes,)`` on ``cuda:<device>``.

        Built from a :class:`DeviceMemoryView` that holds ``owner``; the
        tensor's storage keeps that view (hence ``owner``) alive until the last
        view of the storage dies. The explicit device index matters: without
        it torch infers the device from the pointer, which for a peer's memory
        is the peer GPU.
        """
        if not torch.cuda.is_available():
            raise self.error("as_tensor", "torch has no usable CUDA here; CUDA tensors over "
                                          "mapped memory need a CUDA build of torch and a GPU")
        view = DeviceMemoryView(addr, nbytes, owner)
        tensor = torch.as_tensor(view, device=f"cuda:{self.device}")
        if tensor.data_ptr() != int(addr) or tensor.device.index != self.device:
            # Older torch inferred the device from the pointer and copied.
            raise self.error("as_tensor", f"torch did not wrap {addr:#x} in place on "
                                          f"cuda:{self.device} (got {tensor.device}, "
                                          f"{tensor.data_ptr():#x}); upgrade torch")
        return tensor

    # -- multicast ---------------------------------------------------------------------
    def multicast_create(self, size: int, num_devices: int, handle_type: HandleType) -> int:
        """``cuMulticastCreate``; ``size`` already rounded to ``multicast_granularity``."""
        handle_type = HandleType(handle_type)
        mc = int(self._cu("cuMulticastCreate", self._mc_prop(size, num_devices, handle_type),
                          detail=f"size={size}, num_devices={num_devices}, "
                                 f"handle_type={handle_type.value}"))
        self._multicast[mc] = int(size)
        self._mc_refs[mc] += 1
        return mc

    def multicast_export(self, mc: Any, handle_type: HandleType) -> Shareable:
        """Shareable form of a multicast handle (int fd owned by the caller, or 64 bytes)."""
        return self._export(mc, handle_type, "multicast")

    def multicast_import(self, shareable: Shareable, handle_type: HandleType,
                         size: int | None = None) -> int:
        """Import a multicast handle; ``size`` is remembered for :meth:`handle_size`."""
        mc = self._import(shareable, handle_type)
        self._mc_refs[mc] += 1
        if size is not None or mc not in self._multicast:
            self._multicast[mc] = None if size is None else int(size)
        return mc

    def multicast_add_device(self, mc: Any) -> None:
        """``cuMulticastAddDevice(mc, this device)``; every member before any bind."""
        self._ensure_context()
        self._cu("cuMulticastAddDevice", int(mc), self._cu_device,
                 detail=f"multicast={int(mc):#x}, device=cuda:{self.device}")

    def multicast_bind(self, mc: Any, mc_offset: int, handle: Any, mem_offset: int,
                       size: int) -> None:
        """``cuMulticastBindMem(mc, mc_offset, handle, mem_offset, size, 0)``."""
        self._cu("cuMulticastBindMem", int(mc), int(mc_offset), int(handle), int(mem_offset),
                 int(size), 0,
                 detail=f"multicast={int(mc):#x}, mc_offset={mc_offset}, handle={int(handle):#x}, "
                        f"mem_offset={mem_offset}, size={size}")
        self._binds[(int(mc), int(mc_offset))] = int(size)

    def multicast_unbind(self, mc: Any, mc_offset: int, size: int) -> None:
        """``cuMulticastUnbind(mc, this device, mc_offset, size)``.

        Must precede unmapping/releasing the bound memory; its errors are
        raised, never swallowed (an ignored failure can poison the context).
        """
        self._ensure_context()
        self._cu("cuMulticastUnbind", int(mc), self._cu_device, int(mc_offset), int(size),
                 detail=f"multicast={int(mc):#x}, mc_offset={mc_offset}, size={size}")
        self._binds.pop((int(mc), int(mc_offset)), None)

    def multicast_release(self, mc: Any) -> None:
        """``cuMemRelease`` of a multicast handle."""
        mc = int(mc)
        self._cu("cuMemRelease", mc, detail=f"multicast={mc:#x}")
        self._forget_handle(mc)

    def multicast_map(self, addr: int, size: int, mc: Any) -> None:
        """Map the multicast object at ``addr`` (reserved by the caller) read/write.

        Multicast handles map from offset 0. Undo with :meth:`unmap`. If access
        cannot be granted the mapping is undone before the error propagates.
        """
        self.map(addr, size, mc, 0)
        try:
            self.set_access(addr, size)
        except Exception:
            self.unmap(addr, size)
            raise

    # -- capabilities ------------------------------------------------------------------
    def capabilities(self) -> Capabilities:
        """Probe the driver, device attributes, peer access and granularity. Never raises.

        ``fabric=True`` only means the device attribute is set: creating FABRIC
        memory can still fail with ``CUDA_ERROR_NOT_PERMITTED`` (no IMEX channel),
        so the caller must be ready to fall back to POSIX_FD.
        """
        caps = Capabilities(driver=self.name, available=False, device=f"cuda:{self.device}")
        reasons = caps.reasons
        try:
            self._probe(caps)
        except Exception as exc:  # a probe must never take the process down
            reasons.setdefault("driver", f"capability probe failed: {exc}")
        if not caps.available:
            reasons.setdefault("driver", "CUDA driver unavailable")
            why = "CUDA driver unavailable (see reasons['driver'])"
            for cap in ("vmm", "posix_fd", "fabric", "multicast"):
                reasons.setdefault(cap, why)
            if caps.peer_access is None:
                reasons.setdefault("peer_access", why)
        for cap in ("vmm", "posix_fd", "fabric", "multicast"):
            if not getattr(caps, cap):
                reasons.setdefault(cap, "not supported")
        if caps.peer_access is False:
            reasons.setdefault("peer_access", "not supported")
        return caps

    def _probe(self, caps: Capabilities) -> None:
        reasons = caps.reasons
        try:
            api = self.api
        except Exception as exc:
            reasons["driver"] = f"cuda-bindings not importable ({exc}); pip install cuda-bindings"
            return
        try:
            self.check(api.cuInit(0), "cuInit")
            count = int(self.check(api.cuDeviceGetCount(), "cuDeviceGetCount"))
        except RuntimeError as exc:
            if _is_missing_driver_library(exc):
                reasons["driver"] = f"no NVIDIA driver library (libcuda) found: {exc}"
            else:
                reasons["driver"] = str(exc)
            return
        if count == 0:
            reasons["driver"] = "no CUDA device visible (CUDA_VISIBLE_DEVICES?)"
            return
        if not 0 <= self.device < count:
            reasons["driver"] = f"device {self.device} out of range: {count} device(s) visible"
            return
        try:
            self._ensure_context()
            raw = self.check(api.cuDeviceGetName(256, self._cu_device), "cuDeviceGetName")
            name = bytes(raw).split(b"\0", 1)[0].decode(errors="replace").strip()
            if name:
                caps.device = f"cuda:{self.device} ({name})"
        except Exception as exc:
            reasons["driver"] = str(exc)
            return
        caps.available = True

        for cap, attr, why in (
            ("vmm", "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
             "device has no virtual memory management"),
            ("posix_fd", "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED",
             "device cannot export POSIX fd handles"),
            ("fabric", "HANDLE_TYPE_FABRIC_SUPPORTED",
             "device cannot export FABRIC handles (needs an NVLink fabric / MNNVL domain)"),
            ("multicast", "MULTICAST_SUPPORTED",
             "device has no NVLink multicast (needs SM90+ on NVSwitch and Fabric Manager)"),
        ):
            try:
                ok = bool(self._attribute(attr))
                why = f"{why} (CU_DEVICE_ATTRIBUTE_{attr}=0)"
            except Exception as exc:
                ok, why = False, f"CU_DEVICE_ATTRIBUTE_{attr} query failed: {exc}"
            setattr(caps, cap, ok)
            if not ok:
                reasons[cap] = why

        if count == 1:
            caps.peer_access = None
            reasons["peer_access"] = "only one GPU"
        else:
            blocked = []
            try:
                for peer in range(count):
                    if peer == self.device:
                        continue
                    peer_dev = self._cu("cuDeviceGet", peer)
                    if not int(self._cu("cuDeviceCanAccessPeer", self._cu_device, peer_dev)):
                        blocked.append(peer)
                caps.peer_access = not blocked
                if blocked:
                    reasons["peer_access"] = (f"cuda:{self.device} cannot access peer(s) "
                                              f"{blocked} (no NVLink/P2P path)")
            except Exception as exc:
                caps.peer_access = False
                reasons["peer_access"] = f"peer query failed: {exc}"

        if caps.vmm and caps.posix_fd:
            try:
                caps.granularity = self.granularity(HandleType.POSIX_FD)
            except Exception as exc:
                reasons["granularity"] = f"granularity query failed: {exc}"

    # -- accounting --------------------------------------------------------------------
    def live_objects(self) -> dict[str, int]:
        """Counts of live objects created through this driver; all zero after teardown."""
        return {
            "handles": len(self._created),
            "imported": sum(self._import_refs.values()),
            "reservations": len(self._reservations),
            "mappings": len(self._mappings),
            "multicast": sum(self._mc_refs.values()),
            "binds": len(self._binds),
        }
