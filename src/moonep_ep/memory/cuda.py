"""CUDA VMM memory driver: ``MemoryDriver`` over ``cuda.bindings.driver``.

Pure Python; every primitive is one (occasionally two) CUDA driver calls.
``cuda.bindings`` is imported lazily, so ``import moonep_ep.memory.cuda``
works on machines without it and without an NVIDIA driver; ``capabilities()``
then reports why the driver is unavailable instead of raising. With
``MOONEP_EP_CUDA_EMULATOR=1`` the calls go to the emulator in
``moonep_ep.testing.cuda_emulator`` (``cuda_calls.driver_module``), so every
line here runs on CPU except one: the device named in :meth:`as_tensor`'s
DLPack capsule (CPU for emulated memory, ``cuda:<device>`` on a GPU).

Handles (``CUmemGenericAllocationHandle``) and virtual addresses
(``CUdeviceptr``) are plain ``int`` values, which the bindings accept back.

Teardown order (the caller's job; ``symmetric.py`` follows it):

1. ``synchronize()`` -- no kernel or copy may still touch a range that is
   about to be unmapped (an unmap under a running kernel is an illegal-address
   fault that poisons the context);
2. ``multicast_unbind`` every bind -- *before* the bound memory is unmapped or
   released (on B200 an unbind after that fails with ``CUDA_ERROR_INVALID_VALUE``
   and leaves the multicast team inconsistent);
3. ``unmap`` every mapping (unicast and multicast ranges);
4. ``multicast_release`` multicast handles, then ``release`` memory handles --
   physical memory is returned when the last handle *and* mapping are gone;
5. ``free_reservation`` last: a reservation must be empty when freed;
6. ``close()`` unloads the multimem module and drops this driver's retain of
   the primary context -- at once if nothing made through the driver is
   alive, else when the last such object is released (a tensor may outlive
   the allocation object; its late unmap still needs the context).

Not thread-safe: one allocator drives one ``CudaDriver``. The primary context
is made current on each thread that issues a call, once per thread.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import torch

from . import cuda_calls, cuda_probe, dlpack, multimem
from .driver import Capabilities, HandleType, MemoryDriver, Shareable


class CudaDriver(MemoryDriver):
    """CUDA virtual-memory-management driver for one device of this process.

    Args:
        device: CUDA device ordinal; default ``torch.cuda.current_device()`` when torch has CUDA, else 0.
        rank: used in error messages only.
        api: the ``cuda.bindings.driver`` module (default: the real module, or the emulator under
            ``MOONEP_EP_CUDA_EMULATOR=1``), or an :class:`~moonep_ep.testing.cuda_emulator.EmulatedCudaApi`.
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
        self._closing = False           # close() asked; the retain goes with the last live object
        self._closed = False
        self._thread = threading.local()  # .ctx_current: primary ctx set on this thread
        self._props: dict[HandleType, Any] = {}
        self._gran: dict[HandleType, int] = {}
        self._mc_gran: dict[tuple[int, HandleType, bool], int] = {}
        self._rdma: bool | None = None
        self._kernel: multimem.MultimemKernel | None = None  # loaded on the first multicast store
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
            self._api = cuda_calls.driver_module()
        return self._api

    @property
    def emulated(self) -> bool:
        return cuda_calls.emulator_of(self.api) is not None

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu") if self.emulated else torch.device("cuda", self.device)

    def check(self, result: Any, call: str, detail: str = "") -> Any:
        """Unpack ``(CUresult, *outputs)``; raise ``DriverError`` unless CUDA_SUCCESS."""
        return cuda_calls.check(self.api, result, call, detail, self.error)

    def _cu(self, call: str, *args: Any, detail: str = "", context: bool = True) -> Any:
        """Call ``api.<call>(*args)`` and :meth:`check` the result."""
        if context:
            self._ensure_context()
        try:
            result = getattr(self.api, call)(*args)
        except RuntimeError as exc:
            if cuda_calls.is_missing_driver_library(exc):
                raise self.error(call, f"no NVIDIA driver library (libcuda) found: {exc}",
                                 "NO_DRIVER_LIBRARY") from exc
            raise
        return self.check(result, call, detail)

    # -- context and lifetime --------------------------------------------------------
    def _ensure_context(self) -> None:
        """Make the device's primary context (the one torch uses) current here. Driver calls on a thread
        without a current context fail or land in the wrong one, so: ``cuInit``, ``cuDeviceGet``,
        ``cuDevicePrimaryCtxRetain`` once per driver, and ``cuCtxSetCurrent`` once per calling thread."""
        if self._ctx is None:
            if self._closed:
                raise self.error("context", "this CudaDriver is closed; make a new one")
            self._cu("cuInit", 0, context=False)
            self._cu_device = self._cu("cuDeviceGet", self.device, context=False,
                                       detail=f"device {self.device}")
            self._ctx = self._cu("cuDevicePrimaryCtxRetain", self._cu_device, context=False,
                                 detail=f"device {self.device}")
        if not getattr(self._thread, "ctx_current", False):
            self._cu("cuCtxSetCurrent", self._ctx, context=False)
            self._thread.ctx_current = True

    def close(self) -> None:
        """Unload the multimem module and drop the primary-context retain (idempotent).

        If objects made through this driver are still alive (a tensor keeps a
        mapping), the retain is dropped when the last of them is released.
        torch holds its own reference, so the context outlives this driver
        while torch uses the device.
        """
        self._closing = True
        if self._kernel is not None:
            kernel, self._kernel = self._kernel, None
            kernel.unload(self)
        self._release_context_if_idle()

    def _release_context_if_idle(self) -> None:
        if not self._closing or self._ctx is None or any(self.live_objects().values()):
            return
        ctx_dev, self._ctx = self._cu_device, None
        self._closed = True
        self._thread = threading.local()
        self._cu("cuDevicePrimaryCtxRelease", ctx_dev, context=False)

    # -- device ------------------------------------------------------------------------
    def attribute(self, name: str) -> int:
        attr = getattr(self.api.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name}")
        self._ensure_context()
        return int(self._cu("cuDeviceGetAttribute", attr, self._cu_device, detail=name))

    def device_name(self) -> str:
        self._ensure_context()
        raw = self._cu("cuDeviceGetName", 256, self._cu_device)
        return bytes(raw).split(b"\0", 1)[0].decode(errors="replace").strip()

    def device_uuid(self) -> str:
        """``GPU-<uuid>`` of this device: its identity across processes (ordinals are per process)."""
        import uuid

        self._ensure_context()
        raw = self._cu("cuDeviceGetUuid", self._cu_device, detail=f"device {self.device}")
        return "GPU-" + str(uuid.UUID(bytes=bytes(raw.bytes)))

    def can_access_peer(self, peer: int) -> bool:
        self._ensure_context()
        peer_dev = self._cu("cuDeviceGet", peer)
        return bool(int(self._cu("cuDeviceCanAccessPeer", self._cu_device, peer_dev)))

    def memory_info(self) -> tuple[int, int]:
        """``cuMemGetInfo``: (free, total) bytes of this device."""
        free, total = self._cu("cuMemGetInfo")
        return int(free), int(total)

    # -- props and granularity -------------------------------------------------------
    def _handle_type_enum(self, handle_type: HandleType) -> Any:
        ht = self.api.CUmemAllocationHandleType
        if HandleType(handle_type) is HandleType.FABRIC:
            return ht.CU_MEM_HANDLE_TYPE_FABRIC
        return ht.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR

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
                    self._rdma = bool(self.attribute("GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED"))
                except Exception:  # optional flag: leave it off if the query fails
                    self._rdma = False
            if self._rdma:
                prop.allocFlags.gpuDirectRDMACapable = 1
            self._props[handle_type] = prop
        return prop

    def granularity(self, handle_type: HandleType | None = None) -> int:
        """RECOMMENDED granularity (bytes) of this driver's prop for ``handle_type``.

        ``None``: the largest over the handle types this device may be voted to
        use -- POSIX fds, and FABRIC when the device attribute allows it -- as
        MoonEP's ``get_vmm_granularity`` does, so pages planned before the vote
        fit whichever type the group picks.
        """
        if handle_type is None:
            grans = [self.granularity(HandleType.POSIX_FD)]
            try:
                if self.attribute("HANDLE_TYPE_FABRIC_SUPPORTED"):
                    grans.append(self.granularity(HandleType.FABRIC))
            except Exception:  # noqa: BLE001 - fabric not queryable: it will not be voted either
                pass
            return max(grans)
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

    def multicast_granularity(self, num_devices: int, handle_type: HandleType,
                              recommended: bool = False) -> int:
        """MINIMUM (default) or RECOMMENDED multicast granularity for a team of ``num_devices``.

        Sizes and bind offsets need multiples of MINIMUM only (driver API docs);
        RECOMMENDED is a performance hint that can be 512 MiB (8xH100), larger
        than a whole chunk. Queried with a positive size (one allocation page of the type):
        NCCL sets the object's size before it queries, and a zero-size prop is refused.
        """
        key = (int(num_devices), HandleType(handle_type), bool(recommended))
        if key not in self._mc_gran:
            flags = self.api.CUmulticastGranularity_flags
            flag = (flags.CU_MULTICAST_GRANULARITY_RECOMMENDED if recommended
                    else flags.CU_MULTICAST_GRANULARITY_MINIMUM)
            self._mc_gran[key] = int(self._cu(
                "cuMulticastGetGranularity", self._mc_prop(self.granularity(handle_type), num_devices, handle_type),
                flag,
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
        self._release_context_if_idle()

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
        self._release_context_if_idle()

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
        """``cuCtxSynchronize`` of the primary context: every stream torch uses on the device
        (what ``torch.cuda.synchronize`` does), issued through the driver so the emulator runs it."""
        self._cu("cuCtxSynchronize")

    def zero_(self, tensor: torch.Tensor) -> None:
        """torch's fill kernel: its first launch lazily loads a module that ``cuMemGetInfo`` counts and nothing
        frees. Over the emulator (host memory) the emulator takes the same stated bytes (node spec ``lazy=``)."""
        tensor.zero_()
        if (emulator := cuda_calls.emulator_of(self.api)) is not None:
            self._ensure_context()
            emulator.kernel_launched("torch-fill")

    # -- tensors: the seam between emulated and real device memory ------------------------
    def _stream(self) -> int:
        """The stream torch issues work on (a launch orders behind the copy that filled its source);
        the emulator runs every call to completion, so it has only stream 0."""
        return 0 if self.emulated else torch.cuda.current_stream(self.device).cuda_stream

    def as_tensor(self, addr: int, nbytes: int, owner: object) -> torch.Tensor:
        """Zero-copy ``torch.uint8`` tensor of shape ``(nbytes,)`` on :attr:`torch_device`.

        Built from a DLPack capsule that names the device explicitly: torch never
        infers it from the pointer, which for a range starting with a peer's
        memory would be the peer GPU. ``owner`` lives until the last tensor
        sharing the storage dies.
        """
        emulator = cuda_calls.emulator_of(self.api)
        if emulator is not None:
            # The seam: emulated device memory is host memory, so the tensor is a CPU
            # tensor -- after the emulator checked what the GPU would enforce (the range is
            # mapped, read/write for this device, and not a multicast address).
            self._ensure_context()
            try:
                emulator.check_host_access(int(addr), int(nbytes))
            except Exception as exc:
                raise self.error("as_tensor", f"{exc} (CUDA emulator)", "CUDA_ERROR_ILLEGAL_ADDRESS") from exc
            device = (dlpack.DL_CPU, 0)
        else:
            if not torch.cuda.is_available():
                raise self.error("as_tensor", "torch has no usable CUDA here; CUDA tensors over "
                                              "mapped memory need a CUDA build of torch and a GPU")
            device = (dlpack.DL_CUDA, self.device)  # the one line the emulator cannot run
        tensor = dlpack.tensor_from_pointer(int(addr), int(nbytes), owner, *device)
        if tensor.data_ptr() != int(addr) or tensor.device != self.torch_device:
            raise self.error("as_tensor", f"torch did not wrap {addr:#x} in place on {self.torch_device} "
                                          f"(got {tensor.device}, {tensor.data_ptr():#x})")
        return tensor

    # -- multicast ---------------------------------------------------------------------
    def multicast_create(self, size: int, num_devices: int, handle_type: HandleType) -> int:
        """``cuMulticastCreate``; ``size`` a multiple of ``multicast_granularity``."""
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
        self._release_context_if_idle()

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

    def multimem_store(self, mc_addr: int, src: torch.Tensor) -> None:
        """``multimem.st`` of ``src`` at the mapped multicast address ``mc_addr``: the bytes
        land at the same offset of every bound member (``multimem.py``). ``src``: contiguous
        ``uint8`` on :attr:`torch_device`, 16-byte multiple; ordered on the current stream."""
        if self._kernel is None:
            self._kernel = multimem.MultimemKernel.load(self)
        self._kernel.store(self, int(mc_addr), src, self._stream())

    # -- capabilities ------------------------------------------------------------------
    def capabilities(self) -> Capabilities:
        """Probe the driver, device attributes, peer access and granularity. Never raises.

        ``fabric=True`` only means the device attribute is set: creating FABRIC
        memory can still fail (``CUDA_ERROR_NOT_PERMITTED``: no IMEX channel), or a
        peer's import can (no IMEX domain), so the allocator tries fabric
        collectively and falls back to POSIX fds (``fabric.py``).
        """
        caps = Capabilities(driver=self.name, available=False, device=f"cuda:{self.device}")
        reasons = caps.reasons
        try:
            cuda_probe.probe(self, caps)
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

    # -- accounting --------------------------------------------------------------------
    def live_objects(self) -> dict[str, int]:
        """Counts of live objects held through this driver; all zero after teardown and close()."""
        return {
            "handles": len(self._created),
            "imported": sum(self._import_refs.values()),
            "reservations": len(self._reservations),
            "mappings": len(self._mappings),
            "multicast": sum(self._mc_refs.values()),
            "binds": len(self._binds),
            "modules": int(self._kernel is not None),
        }

    def holds_context(self) -> bool:
        """True while this driver retains the primary context (until close() took effect)."""
        return self._ctx is not None


def visible_device_count(api: Any = None) -> int:
    """CUDA devices this process sees (0 when the driver is unusable here)."""
    api = api or cuda_calls.driver_module()
    try:
        if int(api.cuInit(0)[0]) != 0:
            return 0
        err, count = api.cuDeviceGetCount()
        return int(count) if int(err) == 0 else 0
    except RuntimeError:  # no libcuda, or bindings too new for the driver
        return 0
