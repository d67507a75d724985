"""``EmulatedCudaApi``: the ``cuda.bindings.driver`` calls moonep_ep makes, on host memory.

Same names, the real bindings' argument types, enums and structs (delegated
to the installed ``cuda.bindings.driver``), and ``(CUresult, value...)``
returns. Each instance is one process's view of the emulated node (see
``node.py``); objects are shared with other processes through memfds (see
``objects.py``). The rules it enforces, each tested by breaking it on
purpose (``tests/memory/test_cuda_emulator.py``), are listed in
docs/design/memory.md. A ``cu*`` name it does not implement raises
:class:`UnknownCall`; a kernel it cannot execute raises
:class:`~.kernels.UnsupportedKernel`.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import importlib
import os
import threading
import zlib
from typing import Any, Callable

from ...memory import vm
from . import kernels
from .node import CLIQUE_CALLS_CUDA_VERSION, NodeSpec, host_of_process, visible_gpus
from .objects import (FABRIC_LAYOUT, FABRIC_MAGIC, Allocation, Mapping, MulticastRef, Table, node_bytes_in_use,
                      open_peer_fd)

_CTX_BASE = 0xC0DE_0000
_MODULE_BASE = 0x4D0D_0000
_POISON = 0xCD           # cuMemCreate memory is not zero-filled; neither is the emulator's
_POISON_LIMIT = 8 << 20  # larger allocations are poisoned at both ends only (keeps memfds sparse)


class UnknownCall(AttributeError):
    """A driver call the emulator does not implement (never passed through)."""


class IllegalAccess(RuntimeError):
    """Host code touched emulated device memory it may not (the emulator's illegal address)."""


class _Fail(Exception):
    def __init__(self, code: str, why: str):
        super().__init__(why)
        self.code, self.why = code, why


def _api(n_out: int, *, context: bool = True, init: bool = True) -> Callable:
    """Wrap a ``cu*`` method: record, inject faults, check init/context/version, return a tuple."""

    def deco(fn: Callable) -> Callable:
        name = fn.__name__

        @functools.wraps(fn)
        def call(self: "EmulatedCudaApi", *args: Any) -> tuple:
            if self.record:
                self.calls.append((name, args))
            if name != "cuDriverGetVersion" and self._bindings_too_new():
                # What the bindings do when the driver cannot supply a symbol at their ABI version.
                # (cuda-python's own version check still calls cuDriverGetVersion, so that one works.)
                raise RuntimeError(f'Function "{name}" not found')
            fault = self._faults.get(name)
            if fault and fault[2] > 0:
                fault[2] -= 1  # calls let through before the fault
            elif fault and fault[1] > 0:
                fault[1] -= 1
                self.errors.append((name, fault[0].name, "injected"))
                return (fault[0],) + (None,) * n_out
            try:
                if init and not self._initialized:
                    raise _Fail("CUDA_ERROR_NOT_INITIALIZED", "cuInit has not been called in this process")
                if context:
                    sticky = self._sticky.get(self._current_gpu())
                    if sticky:  # a kernel faulted: the context is unusable for the process's lifetime
                        raise _Fail(*sticky)
                out = fn(self, *args)
            except _Fail as fail:
                self.errors.append((name, fail.code, fail.why))
                self.last_error = fail.why
                return (getattr(self._real.CUresult, fail.code),) + (None,) * n_out
            ok = self._real.CUresult.CUDA_SUCCESS
            if n_out == 0:
                return (ok,)
            return (ok, out) if n_out == 1 else (ok, *out)

        return call

    return deco


class EmulatedCudaApi:
    """One process's ``cuda.bindings.driver`` over an emulated node.

    Args:
        node: the machine (default: ``MOONEP_EP_CUDA_EMULATOR_NODE`` or H100x8).
        visible: ``CUDA_VISIBLE_DEVICES`` for this process (default: read from
            the environment at ``cuInit``, as CUDA does).
        record: keep ``calls`` (every call and its arguments) for tests; off
            for the process-wide instance so long runs do not grow.
        host: the host of the domain this process runs on (index or name;
            default: ``MOONEP_EP_CUDA_EMULATOR_HOST``, else the host named like
            this process's hostname, else host 0; see ``node.host_of_process``).

    ``calls``, ``errors``, ``fail()``, ``names()``, ``calls_of()`` and
    ``live()`` are for tests; everything named ``cu*`` is the driver API.
    """

    def __init__(self, node: NodeSpec | str | None = None, *, visible: str | None = None,
                 record: bool = False, host: int | str | None = None):
        self._real = importlib.import_module("cuda.bindings.driver")
        if node is None:
            from ... import envs
            node = envs.MOONEP_EP_CUDA_EMULATOR_NODE
        self.node = node if isinstance(node, NodeSpec) else NodeSpec.parse(node)
        self.host = host_of_process(self.node, None if host is None else str(host))
        self._node_tag = zlib.crc32(self.node.node.encode())  # names this node's memfds (cuMemGetInfo)
        self._visible_override = visible
        self.visible: list[int] = []
        self.bindings_major = int(self._real.CUDA_VERSION) // 1000
        self.record = record
        self.calls: list[tuple[str, tuple]] = []
        self.errors: list[tuple[str, str, str]] = []
        self.last_error = ""
        self._faults: dict[str, list] = {}
        #: gpu -> (code, why) of a kernel fault: every later call in that context fails with it
        self._sticky: dict[int, tuple[str, str]] = {}
        self._initialized = False
        self._ctx_refs: dict[int, int] = {}             # gpu -> primary context retains
        self._thread = threading.local()
        self._next_handle = 0x1000
        self._handles: dict[int, tuple[Any, bool]] = {}  # handle -> (object, is the creation reference)
        self._allocs: dict[int, Allocation] = {}         # inode -> allocation referenced here
        self._mcs: dict[int, MulticastRef] = {}          # table inode -> multicast object referenced here
        self._reservations: dict[int, int] = {}          # base -> size
        self._map_starts: list[int] = []
        self._maps: dict[int, Mapping] = {}
        self._modules: dict[int, dict[str, kernels.KernelSpec]] = {}
        self._functions: dict[int, tuple[int, kernels.KernelSpec]] = {}

    # -- module surface ---------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        # Reached only for names not defined here: enums, structs and constants come
        # from the real bindings; an unimplemented call must fail, not reach libcuda.
        if name.startswith("_"):
            raise AttributeError(name)
        if name[:2] == "cu" and name[2:3].isupper():
            raise UnknownCall(f"the CUDA emulator does not implement {name}: add it to "
                              "moonep_ep.testing.cuda_emulator (with the rule it must enforce) or run on a GPU")
        return getattr(self._real, name)

    @property
    def moonep_ep_emulator(self) -> "EmulatedCudaApi":
        """Marks this module as the emulator (``CudaDriver`` asks for it at its one seam)."""
        return self

    # -- tests: faults, records, live objects --------------------------------------------
    def fail(self, name: str, code: Any, times: int = 1, after: int = 0) -> None:
        """Let ``after`` calls of ``name`` through, then make the next ``times`` return ``code``
        (a ``CUresult`` or its name) -- fault injection for tests."""
        if isinstance(code, str):
            code = getattr(self._real.CUresult, code)
        self._faults[name] = [self._real.CUresult(int(code)), int(times), int(after)]

    def names(self) -> list[str]:
        return [n for n, _ in self.calls]

    def calls_of(self, name: str) -> list[tuple]:
        return [a for n, a in self.calls if n == name]

    def live(self) -> dict[str, int]:
        """What this process still holds in the emulated driver; all zero after a clean teardown."""
        return {
            "handles": sum(isinstance(o, Allocation) for o, _ in self._handles.values()),
            "multicast_handles": sum(isinstance(o, MulticastRef) for o, _ in self._handles.values()),
            "allocations": len(self._allocs),
            "multicast_objects": len(self._mcs),
            "reservations": len(self._reservations),
            "mappings": len(self._maps),
            "binds": sum(m.binds for m in self._mcs.values()),
            "contexts": sum(self._ctx_refs.values()),
            "modules": len(self._modules),
        }

    def device_bytes_in_use(self, gpu: int | None = None) -> int:
        """Bytes of physical memory on node GPU ``gpu`` (default: any) that this process created
        and still keeps alive (by a handle, a mapping or a multicast bind)."""
        return sum(a.size for a in self._allocs.values() if a.created_here and gpu in (None, a.gpu))

    @property
    def hostname(self) -> str:
        """The emulated host's name: what this process reports as its host (``Capabilities.host``)."""
        return self.node.host_name(self.host)

    # -- helpers ------------------------------------------------------------------------
    def _bindings_too_new(self) -> bool:
        return self.bindings_major > self.node.cuda_version // 1000

    def _gpu(self, dev: Any) -> int:
        ordinal = int(dev)
        if not 0 <= ordinal < len(self.visible):
            raise _Fail("CUDA_ERROR_INVALID_DEVICE", f"device ordinal {ordinal}: this process sees "
                                                     f"{len(self.visible)} device(s)")
        return self.visible[ordinal]

    def _current_gpu(self) -> int:
        gpu = getattr(self._thread, "gpu", None)
        if gpu is None:
            raise _Fail("CUDA_ERROR_INVALID_CONTEXT", "no CUDA context is current on this thread "
                                                      "(cuCtxSetCurrent after cuDevicePrimaryCtxRetain)")
        if not self._ctx_refs.get(gpu):
            raise _Fail("CUDA_ERROR_INVALID_CONTEXT", "the current context was released")
        return gpu

    def _new_handle(self, obj: Any, created: bool = False) -> int:
        self._next_handle += 1
        self._handles[self._next_handle] = (obj, created)
        obj.handles += 1
        return self._next_handle

    def _obj(self, handle: Any, kind: type | None = None) -> Any:
        try:
            obj, _ = self._handles[int(handle)]
        except (KeyError, TypeError, ValueError):
            raise _Fail("CUDA_ERROR_INVALID_VALUE", f"unknown or released handle {handle!r}") from None
        if kind is not None and not isinstance(obj, kind):
            raise _Fail("CUDA_ERROR_INVALID_VALUE", f"handle {int(handle):#x} is not a {kind.__name__}")
        return obj

    def _maybe_free(self, obj: Any) -> None:
        if obj.alive():
            return
        if isinstance(obj, Allocation):
            if self._allocs.get(obj.inode) is obj:
                del self._allocs[obj.inode]
            os.close(obj.fd)
        else:
            if self._mcs.get(obj.inode) is obj:
                del self._mcs[obj.inode]
            obj.table.close()

    def _ht(self, name: str) -> int:
        return int(getattr(self._real.CUmemAllocationHandleType, f"CU_MEM_HANDLE_TYPE_{name}"))

    def _granularity(self, handle_types: int, recommended: bool = False) -> int:
        """The profile's granularity for an allocation exportable as ``handle_types``: the largest of
        the requested types' (POSIX fd when none is requested)."""
        p = self.node.profile
        fd, fabric = self._ht("POSIX_FILE_DESCRIPTOR"), self._ht("FABRIC")
        values = []
        if handle_types & fd or not handle_types & fabric:
            values.append(p.fd_rec if recommended else p.fd_min)
        if handle_types & fabric:
            values.append(p.fabric_rec if recommended else p.fabric_min)
        return max(values)

    @staticmethod
    def _aligned(what: str, value: int, gran: int) -> None:
        if int(value) % gran:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", f"{what}={value} is not a multiple of the granularity {gran}")

    def _reservation_of(self, addr: int, size: int) -> int:
        for base, rsize in self._reservations.items():
            if base <= addr and addr + size <= base + rsize:
                return base
        raise _Fail("CUDA_ERROR_INVALID_VALUE", f"[{addr:#x}, +{size}) is not inside one reserved range")

    def _mappings_in(self, addr: int, size: int) -> list[Mapping]:
        i = max(0, bisect.bisect_right(self._map_starts, addr) - 1)
        out = []
        while i < len(self._map_starts) and self._map_starts[i] < addr + size:
            m = self._maps[self._map_starts[i]]
            if m.addr + m.size > addr:
                out.append(m)
            i += 1
        return out

    def _covering(self, addr: int, size: int) -> list[Mapping]:
        """The mappings covering every byte of the range, or a failure naming the hole."""
        found, cursor = self._mappings_in(addr, size), addr
        for m in found:
            if m.addr > cursor:
                break
            cursor = max(cursor, m.addr + m.size)
        if cursor < addr + size:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", f"address {cursor:#x} in [{addr:#x}, +{size}) is not mapped")
        return found

    def _is_reserved(self, addr: int) -> bool:
        return any(base <= addr < base + size for base, size in self._reservations.items())

    # -- init, devices, contexts ------------------------------------------------------------
    @_api(0, context=False, init=False)
    def cuInit(self, flags):
        if int(flags) != 0:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", "cuInit flags must be 0")
        if not self._initialized:
            env = self._visible_override
            if env is None:
                env = os.environ.get("CUDA_VISIBLE_DEVICES")
            self.visible = visible_gpus(self.node, env, self.host)
        if not self.visible:
            raise _Fail("CUDA_ERROR_NO_DEVICE", "no CUDA device is visible (CUDA_VISIBLE_DEVICES)")
        self._initialized = True

    @_api(1, context=False, init=False)
    def cuDriverGetVersion(self):
        return self.node.cuda_version

    @_api(1, context=False)
    def cuDeviceGetCount(self):
        return len(self.visible)

    @_api(1, context=False)
    def cuDeviceGet(self, ordinal):
        self._gpu(ordinal)
        return self._real.CUdevice(int(ordinal))

    @_api(1, context=False)
    def cuDeviceGetName(self, length, dev):
        self._gpu(dev)
        return self.node.profile.name.encode()[: int(length) - 1]

    @_api(1, context=False)
    def cuDeviceGetUuid(self, dev):
        uuid = self._real.CUuuid()
        ctypes.memmove(uuid.getPtr(), self.node.uuid(self._gpu(dev)), 16)
        return uuid

    @_api(1, context=False)
    def cuDeviceGetAttribute(self, attrib, dev):
        self._gpu(dev)
        attr = self._real.CUdevice_attribute
        values = {
            attr.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: 1,
            attr.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: 1,
            # Set on Hopper/Blackwell whether or not an IMEX channel exists: the attribute
            # alone never tells whether fabric handles work here.
            attr.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED: int(self.node.fabric_attribute),
            attr.CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED: 1,
            attr.CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED: int(self.node.multicast and self._clique_size() > 1),
            attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: self.node.profile.compute_capability[0],
            attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: self.node.profile.compute_capability[1],
        }
        for key, value in values.items():
            if int(key) == int(attrib):
                return value
        raise UnknownCall(f"the CUDA emulator does not model device attribute {attrib!r}")

    # -- the NVLink domain: cliques ---------------------------------------------------------------
    def _clique_size(self) -> int:
        """GPUs in one NVLink clique (a multicast team and fabric handles stay inside one)."""
        return self.node.gpus // max(1, self.node.cliques)

    def _clique_call(self, name: str, dev) -> int:
        if self.node.cuda_version < CLIQUE_CALLS_CUDA_VERSION:
            # What the bindings do when the driver lacks the symbol (new in CUDA 13.4).
            raise RuntimeError(f'Function "{name}" not found')
        gpu = self._gpu(dev)
        if not self.node.fabric_domain:
            raise _Fail("CUDA_ERROR_NOT_SUPPORTED", "this GPU is not part of a multi-node NVLink fabric")
        return gpu

    @_api(1, context=False)
    def cuDeviceGetCliqueCount(self, dev):
        self._clique_call("cuDeviceGetCliqueCount", dev)
        return 2  # Hopper/Blackwell report a unicast and a multicast pointer clique

    @_api(2, context=False)
    def cuDeviceGetCliqueInfo(self, count, dev):
        gpu = self._clique_call("cuDeviceGetCliqueInfo", dev)
        kinds = (self._real.CUcliqueType.CU_CLIQUE_TYPE_UNICAST_POINTER,
                 self._real.CUcliqueType.CU_CLIQUE_TYPE_MULTICAST_POINTER)
        out = []
        for kind in kinds[:int(count)]:
            info = self._real.CUcliqueInfo()
            info.type, info.id = kind, self.node.clique_of_gpu(gpu)
            out.append(info)
        return out, len(out)

    @_api(1, context=False)
    def cuDeviceGetFabricClusterUuid(self, dev):
        self._clique_call("cuDeviceGetFabricClusterUuid", dev)
        uuid = self._real.CUuuid()
        ctypes.memmove(uuid.getPtr(), self.node.cluster_uuid(), 16)
        return uuid

    def _check_same_host(self, gpu: int, what: str) -> None:
        host = self.node.host_of_gpu(gpu)
        if host != self.host:
            raise _Fail("CUDA_ERROR_INVALID_HANDLE", f"{what} of GPU {gpu} lives on host "
                        f"{self.node.host_name(host)!r}; this process runs on {self.hostname!r}: a POSIX fd "
                        "never crosses hosts (FABRIC handles inside one NVLink clique do)")

    def _check_same_clique(self, gpu: int, what: str) -> None:
        mine = self.node.clique_of_gpu(self._current_gpu())
        theirs = self.node.clique_of_gpu(gpu)
        if mine != theirs:
            raise _Fail("CUDA_ERROR_INVALID_HANDLE", f"{what} of GPU {gpu} (host "
                        f"{self.node.host_name(self.node.host_of_gpu(gpu))!r}) is in NVLink clique {theirs:#x}; "
                        f"this process's GPUs are in clique {mine:#x}: fabric handles do not cross cliques")

    @_api(1, context=False)
    def cuDeviceCanAccessPeer(self, dev, peer):
        return int(self.node.peer_access and self._gpu(dev) != self._gpu(peer))  # NVSwitch: every pair

    @_api(1, context=False)
    def cuDevicePrimaryCtxRetain(self, dev):
        gpu = self._gpu(dev)
        self._ctx_refs[gpu] = self._ctx_refs.get(gpu, 0) + 1
        return self._real.CUcontext(_CTX_BASE + gpu)

    @_api(0, context=False)
    def cuDevicePrimaryCtxRelease(self, dev):
        gpu = self._gpu(dev)
        if not self._ctx_refs.get(gpu):
            raise _Fail("CUDA_ERROR_INVALID_CONTEXT", f"no retained primary context on device {int(dev)}")
        self._ctx_refs[gpu] -= 1
        if not self._ctx_refs[gpu]:
            del self._ctx_refs[gpu]

    @_api(0, context=False)
    def cuCtxSetCurrent(self, ctx):
        gpu = int(ctx) - _CTX_BASE
        if int(ctx) == 0:
            self._thread.gpu = None
            return
        if not self._ctx_refs.get(gpu):
            raise _Fail("CUDA_ERROR_INVALID_CONTEXT", f"context {int(ctx):#x} is not a retained primary context")
        self._thread.gpu = gpu

    @_api(1, context=False)
    def cuCtxGetCurrent(self):
        gpu = getattr(self._thread, "gpu", None)
        return self._real.CUcontext(0 if gpu is None else _CTX_BASE + gpu)

    @_api(0)
    def cuCtxSynchronize(self):
        return None  # every emulated operation completes before its call returns

    @_api(2)
    def cuMemGetInfo(self):
        # Device-wide, as the driver reports it: every process's live allocations on this GPU
        # (read from their memfds), not only this process's.
        total = self.node.profile.memory_bytes
        return total - node_bytes_in_use(self._node_tag, self._current_gpu()), total

    # -- physical memory --------------------------------------------------------------------
    def _check_prop(self, prop: Any) -> tuple[int, int]:
        if not isinstance(prop, self._real.CUmemAllocationProp):
            raise TypeError(f"prop must be a CUmemAllocationProp, got {type(prop).__name__}")
        if int(prop.type) != int(self.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED):
            raise UnknownCall("the CUDA emulator models pinned allocations only")
        if int(prop.location.type) != int(self.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE):
            raise UnknownCall("the CUDA emulator models device-located allocations only")
        types = int(prop.requestedHandleTypes)
        if types & ~(self._ht("POSIX_FILE_DESCRIPTOR") | self._ht("FABRIC")):
            raise UnknownCall(f"the CUDA emulator models POSIX_FD and FABRIC handle types only, got {types}")
        return self._gpu(prop.location.id), types

    @_api(1, context=False)
    def cuMemGetAllocationGranularity(self, prop, option):
        _, types = self._check_prop(prop)
        recommended = int(option) == int(
            self.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
        return self._granularity(types, recommended)

    @_api(1)
    def cuMemCreate(self, size, prop, flags=0):
        gpu, types = self._check_prop(prop)
        size = int(size)
        if int(flags) != 0 or size <= 0:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", "size > 0 and flags 0 expected")
        gran = self._granularity(types)
        self._aligned("size", size, gran)
        if types & self._ht("FABRIC") and not self.node.fabric_attribute:
            raise _Fail("CUDA_ERROR_NOT_SUPPORTED", "this device/driver has no FABRIC handle support")
        if types & self._ht("FABRIC") and self.node.imex == "none":
            raise _Fail("CUDA_ERROR_NOT_PERMITTED", "FABRIC handles need an IMEX channel "
                                                    "(/dev/nvidia-caps-imex-channels); this node has none")
        if size > self.node.profile.memory_bytes - self.device_bytes_in_use(gpu):
            raise _Fail("CUDA_ERROR_OUT_OF_MEMORY", f"{size} bytes do not fit on GPU {gpu}")
        fd = os.memfd_create(Allocation.name(self._node_tag, gpu, types, gran), os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            poison = bytes([_POISON]) * min(size, _POISON_LIMIT // 2)
            os.pwrite(fd, poison, 0)
            if size > len(poison):
                os.pwrite(fd, poison, size - len(poison))
            alloc = Allocation(fd, size, gpu, types, gran, os.fstat(fd).st_ino, created_here=True)
        except BaseException:
            os.close(fd)
            raise
        self._allocs[alloc.inode] = alloc
        return self._new_handle(alloc)

    @_api(0)
    def cuMemRelease(self, handle):
        obj = self._obj(handle)
        _, created = self._handles.pop(int(handle))
        obj.handles -= 1
        if isinstance(obj, MulticastRef) and created:
            obj.created_handles -= 1
            if not obj.created_handles:
                # The creator's reference is what the exported handle resolves to: once it is
                # gone, a late importer gets a fresh, empty object (PyTorch CUDASymmetricMemory.cu).
                obj.table.set_creator_alive(False)
        self._maybe_free(obj)

    @_api(1)
    def cuMemExportToShareableHandle(self, handle, handle_type, flags=0):
        obj = self._obj(handle)
        ht = int(handle_type)
        if int(flags) != 0:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", "flags must be 0")
        if not obj.handle_types & ht:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", f"handle type {ht} was not requested when the object was "
                                                    f"created (requested: {obj.handle_types})")
        fd = obj.fd if isinstance(obj, Allocation) else obj.table.fd
        if ht == self._ht("POSIX_FILE_DESCRIPTOR"):
            return os.dup(fd)  # a new fd the caller owns; it keeps the object alive like the driver's
        if ht == self._ht("FABRIC"):
            fabric = self._real.CUmemFabricHandle()
            kind = 0 if isinstance(obj, Allocation) else 1
            gpu = obj.gpu if isinstance(obj, Allocation) else self._current_gpu()
            fabric.data = FABRIC_LAYOUT.pack(FABRIC_MAGIC, kind, os.getpid(), fd, obj.inode,
                                             obj.size, gpu).ljust(64, b"\0")
            return fabric
        raise UnknownCall(f"the CUDA emulator does not model handle type {ht}")

    @_api(1)
    def cuMemImportFromShareableHandle(self, os_handle, handle_type):
        ht = int(handle_type)
        if ht == self._ht("POSIX_FILE_DESCRIPTOR"):
            if isinstance(os_handle, bool) or not isinstance(os_handle, int):
                raise TypeError(f"a POSIX fd handle is an int, got {type(os_handle).__name__}")
            try:
                os.fstat(os_handle)
            except OSError as exc:
                raise _Fail("CUDA_ERROR_INVALID_VALUE", f"fd {os_handle}: {exc}") from None
            return self._import_fd(os_handle, ht)
        if ht == self._ht("FABRIC"):
            if not isinstance(os_handle, (bytes, bytearray, memoryview)):
                # The bindings want a buffer, not the CUmemFabricHandle struct.
                raise TypeError(f"Provided argument is of type {type(os_handle)} but expected Type None, int "
                                "or object with Buffer Protocol")
            data = bytes(os_handle)
            if self.node.imex == "none":
                raise _Fail("CUDA_ERROR_NOT_PERMITTED", "FABRIC import needs an IMEX channel; this node has none")
            magic, _kind, pid, fd, inode, _size, gpu = FABRIC_LAYOUT.unpack_from(data.ljust(64, b"\0"))
            if magic != FABRIC_MAGIC:
                raise _Fail("CUDA_ERROR_INVALID_HANDLE", "not a fabric handle of this emulated node")
            if pid != os.getpid() and self.node.imex != "domain":
                raise _Fail("CUDA_ERROR_INVALID_HANDLE", "the exporter is another process and no IMEX daemon "
                                                         "joins this node to an IMEX domain")
            self._check_same_clique(gpu, "the fabric handle's memory")
            mine = open_peer_fd(pid, fd, inode)
            if mine is None:
                raise _Fail("CUDA_ERROR_INVALID_HANDLE", "the exporter no longer holds this object")
            try:
                return self._import_fd(mine, self._ht("FABRIC"))
            finally:
                os.close(mine)
        raise UnknownCall(f"the CUDA emulator does not model handle type {ht}")

    def _import_fd(self, fd: int, via: int) -> int:
        inode = os.fstat(fd).st_ino
        if inode in self._allocs:
            return self._new_handle(self._allocs[inode])
        if inode in self._mcs:
            return self._new_handle(self._mcs[inode])
        if Table.is_table(fd):
            table = Table(os.dup(fd))
            head = table.header()
            if not head["creator_alive"]:
                table.close()  # the object is gone with its creator's reference: a fresh one
                table = Table.create(head["size"], head["num_devices"], head["handle_types"], creator_alive=False)
            mc = MulticastRef(table, head["size"], head["num_devices"], head["handle_types"])
            self._mcs[table.inode] = mc
            return self._new_handle(mc)
        alloc = Allocation.from_fd(fd)
        if alloc is None:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", f"fd {fd} is not an exported allocation of the emulated node")
        if via == self._ht("POSIX_FILE_DESCRIPTOR"):
            self._check_same_host(alloc.gpu, "the exported allocation")
        if not alloc.handle_types & via:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", "the allocation was not created for this handle type")
        alloc.fd = os.dup(fd)
        self._allocs[alloc.inode] = alloc
        return self._new_handle(alloc)

    # -- virtual ranges -----------------------------------------------------------------------
    @_api(1)
    def cuMemAddressReserve(self, size, alignment, addr, flags=0):
        size, alignment = int(size), int(alignment)
        gran = self.node.profile.fd_min
        if size <= 0 or int(flags) != 0 or int(addr) != 0:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", "size > 0, no address hint and flags 0 expected")
        self._aligned("size", size, gran)
        if alignment & (alignment - 1):
            raise _Fail("CUDA_ERROR_INVALID_VALUE", f"alignment {alignment} is not a power of two")
        base = vm.reserve(size, max(alignment, gran))
        self._reservations[base] = size
        return self._real.CUdeviceptr(base)

    @_api(0)
    def cuMemAddressFree(self, ptr, size):
        ptr, size = int(ptr), int(size)
        if self._reservations.get(ptr) != size:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", f"[{ptr:#x}, +{size}) is not a reserved range")
        if self._mappings_in(ptr, size):
            raise _Fail("CUDA_ERROR_INVALID_VALUE", "the range still has mappings; unmap them first")
        vm.release(ptr, size)
        del self._reservations[ptr]

    @_api(0)
    def cuMemMap(self, ptr, size, offset, handle, flags=0):
        ptr, size, offset = int(ptr), int(size), int(offset)
        obj = self._obj(handle)
        if int(flags) != 0 or size <= 0:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", "size > 0 and flags 0 expected")
        gran = obj.min_granularity if isinstance(obj, Allocation) else self.node.profile.mc_min
        for what, value in (("ptr", ptr), ("size", size), ("offset", offset)):
            self._aligned(what, value, gran)
        self._reservation_of(ptr, size)
        if offset + size > obj.size:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", f"offset {offset} + size {size} exceed the object's {obj.size} bytes")
        if isinstance(obj, MulticastRef):
            head = obj.table.header()
            if offset != 0:
                raise _Fail("CUDA_ERROR_INVALID_VALUE", "a multicast object maps from offset 0")
            if len(head["team"]) < obj.num_devices:
                raise _Fail("CUDA_ERROR_ILLEGAL_STATE", f"{len(head['team'])} of {obj.num_devices} devices were "
                                                        "added; the driver would block here forever")
        if self._mappings_in(ptr, size):
            raise _Fail("CUDA_ERROR_ALREADY_MAPPED", f"[{ptr:#x}, +{size}) overlaps an existing mapping")
        if isinstance(obj, Allocation):
            vm.map_shared(ptr, size, obj.fd, offset)  # inaccessible until cuMemSetAccess
        # A multicast range stays reserved PROT_NONE: only multimem.* may touch it.
        bisect.insort(self._map_starts, ptr)
        self._maps[ptr] = Mapping(ptr, size, obj, offset)
        obj.mappings += 1

    @_api(0)
    def cuMemUnmap(self, ptr, size):
        ptr, size = int(ptr), int(size)
        inside = self._mappings_in(ptr, size)
        if not inside:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", f"nothing is mapped at [{ptr:#x}, +{size})")
        if inside[0].addr < ptr or inside[-1].addr + inside[-1].size > ptr + size:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", "cuMemUnmap takes whole mappings, not part of one")
        self._covering(ptr, size)
        for m in inside:
            if not m.multicast:
                vm.unmap_to_reserved(m.addr, m.size)
            self._map_starts.remove(m.addr)
            del self._maps[m.addr]
            m.obj.mappings -= 1
            self._maybe_free(m.obj)

    @_api(0)
    def cuMemSetAccess(self, ptr, size, desc, count):
        ptr, size = int(ptr), int(size)
        descs = list(desc)  # the bindings iterate it too: a bare descriptor is a TypeError
        if len(descs) != int(count) or not descs:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", f"count {count} != {len(descs)} descriptors")
        grants = {}
        for d in descs:
            if not isinstance(d, self._real.CUmemAccessDesc):
                raise TypeError("desc items must be CUmemAccessDesc")
            if int(d.location.type) != int(self.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE):
                raise UnknownCall("the CUDA emulator models device access descriptors only")
            grants[self._gpu(d.location.id)] = int(d.flags)
        covered = self._covering(ptr, size)
        if covered[0].addr < ptr or covered[-1].addr + covered[-1].size > ptr + size:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", "access is set on whole mappings")
        for m in covered:
            for gpu in grants:
                self._check_peer_path(gpu, m)
        rw = int(self.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        for m in covered:
            m.access.update(grants)
            if not m.multicast:
                prot = vm.PROT_READ | vm.PROT_WRITE if rw in m.access.values() else vm.PROT_NONE
                vm.protect(m.addr, m.size, prot)

    def _check_peer_path(self, gpu: int, m: Mapping) -> None:
        """Granting ``gpu`` access to memory of another GPU of its host needs a peer path
        (``cuDeviceCanAccessPeer``), as ``cudaDeviceEnablePeerAccess`` does; GPUs of other hosts
        in the clique reach each other over the NVLink fabric (fabric handles checked the clique)."""
        if m.multicast or gpu == m.obj.gpu or self.node.peer_access:
            return
        if self.node.host_of_gpu(gpu) == self.node.host_of_gpu(m.obj.gpu):
            raise _Fail("CUDA_ERROR_INVALID_DEVICE", f"GPU {gpu} cannot access GPU {m.obj.gpu}'s memory: no peer "
                                                     "path between them (cuDeviceCanAccessPeer is 0)")

    # -- the seam: host code reading or writing emulated device memory ------------------------
    def check_host_access(self, addr: int, nbytes: int) -> None:
        """Raise :class:`IllegalAccess` unless the current device may read and write every
        byte of the range with ordinary loads and stores (CudaDriver.as_tensor asks)."""
        try:
            gpu = self._current_gpu()
            covered = self._covering(addr, nbytes)
        except _Fail as fail:
            raise IllegalAccess(f"[{addr:#x}, +{nbytes}): {fail.why}") from None
        rw = int(self.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        for m in covered:
            if m.multicast:
                raise IllegalAccess(f"[{addr:#x}, +{nbytes}) is a multicast address: only multimem.* instructions "
                                    "may access it (PTX ISA); a tensor over it would copy with plain stores")
            if m.access.get(gpu) != rw:
                raise IllegalAccess(f"mapping at {m.addr:#x} has no read/write access for GPU {gpu} "
                                    "(cuMemSetAccess for this device first)")

    # -- multicast ----------------------------------------------------------------------------------
    def _check_mc_prop(self, prop: Any) -> None:
        if not isinstance(prop, self._real.CUmulticastObjectProp):
            raise TypeError(f"prop must be a CUmulticastObjectProp, got {type(prop).__name__}")
        if not 1 <= int(prop.numDevices) <= self._clique_size() or int(prop.flags) != 0:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", f"numDevices in [1, {self._clique_size()}] (the GPUs of one "
                                                    "NVLink clique) and flags 0 expected")

    @_api(1, context=False)
    def cuMulticastGetGranularity(self, prop, option):
        self._check_mc_prop(prop)
        if int(prop.size) <= 0:
            # NCCL (nvls.cc) and PyTorch set the object's size before they query; a zero-size prop
            # describes no multicast object (stricter than an unknown driver behaviour, never laxer).
            raise _Fail("CUDA_ERROR_INVALID_VALUE", "prop.size is 0: set the multicast object's size before "
                                                    "querying its granularity")
        recommended = int(option) == int(
            self.CUmulticastGranularity_flags.CU_MULTICAST_GRANULARITY_RECOMMENDED)
        return self.node.profile.mc_rec if recommended else self.node.profile.mc_min

    @_api(1)
    def cuMulticastCreate(self, prop):
        self._check_mc_prop(prop)
        if not (self.node.multicast and self._clique_size() > 1):
            raise _Fail("CUDA_ERROR_NOT_SUPPORTED", "this node has no NVLink multicast (NVSwitch + Fabric Manager)")
        size, types = int(prop.size), int(prop.handleTypes)
        if size <= 0:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", "size must be positive")
        self._aligned("size", size, self.node.profile.mc_min)
        if types & self._ht("FABRIC") and self.node.imex == "none":
            raise _Fail("CUDA_ERROR_NOT_PERMITTED", "FABRIC handles need an IMEX channel; this node has none")
        table = Table.create(size, int(prop.numDevices), types, creator_alive=True)
        mc = MulticastRef(table, size, int(prop.numDevices), types, created_handles=1)
        self._mcs[table.inode] = mc
        return self._new_handle(mc, created=True)

    @_api(0)
    def cuMulticastAddDevice(self, mc_handle, dev):
        mc = self._obj(mc_handle, MulticastRef)
        team = mc.table.header()["team"]
        if team and self.node.clique_of_gpu(team[0]) != self.node.clique_of_gpu(self._gpu(dev)):
            raise _Fail("CUDA_ERROR_INVALID_DEVICE", f"GPU {self._gpu(dev)} is not in the NVLink clique of the "
                                                     f"team's GPU {team[0]}: a multicast team stays in one clique")
        why = mc.table.add_device(self._gpu(dev))
        if why:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", why)

    @_api(0)
    def cuMulticastBindMem(self, mc_handle, mc_offset, mem_handle, mem_offset, size, flags=0):
        mc = self._obj(mc_handle, MulticastRef)
        alloc = self._obj(mem_handle, Allocation)
        mc_offset, mem_offset, size = int(mc_offset), int(mem_offset), int(size)
        if int(flags) != 0 or size <= 0:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", "size > 0 and flags 0 expected")
        mc_min = self.node.profile.mc_min
        self._aligned("mcOffset", mc_offset, mc_min)
        self._aligned("size", size, mc_min)
        self._aligned("memOffset", mem_offset, alloc.min_granularity)
        if mc_offset + size > mc.size or mem_offset + size > alloc.size:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", "the bind range exceeds the multicast object or the memory")
        team = mc.table.header()["team"]
        if alloc.gpu not in team:
            raise _Fail("CUDA_ERROR_INVALID_DEVICE", f"the memory's GPU {alloc.gpu} was not added to the team")
        if len(team) < mc.num_devices:
            raise _Fail("CUDA_ERROR_ILLEGAL_STATE", f"{len(team)} of {mc.num_devices} devices were added; the "
                                                    "driver blocks until every member joined (barrier first)")
        why = mc.table.add_bind(alloc.gpu, alloc, mem_offset, mc_offset, size)
        if why:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", why)
        alloc.binds += 1
        mc.binds += 1

    @_api(0)
    def cuMulticastUnbind(self, mc_handle, dev, mc_offset, size):
        mc = self._obj(mc_handle, MulticastRef)
        gpu = self._gpu(dev)
        entry = next((b for b in mc.table.binds() if b["gpu"] == gpu and b["mc_offset"] == int(mc_offset)
                      and b["size"] == int(size) and b["pid"] == os.getpid()), None)
        if entry is None:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", f"no bind of {size} bytes at mc offset {mc_offset} for GPU {gpu}")
        alloc = self._allocs.get(entry["inode"])
        if alloc is None or alloc.handles == 0:
            # B200: unbinding after the bound memory was released fails (pytorch/pytorch#162429).
            raise _Fail("CUDA_ERROR_INVALID_VALUE", "the bound memory was released before the unbind")
        mc.table.remove_bind(gpu, int(mc_offset), int(size))
        alloc.binds -= 1
        mc.binds -= 1
        self._maybe_free(mc)

    # -- kernels ------------------------------------------------------------------------------------
    @_api(1)
    def cuModuleLoadData(self, image):
        specs = kernels.parse_module(image, self.node.profile.compute_capability)
        self._next_handle += 1
        module = _MODULE_BASE + self._next_handle
        self._modules[module] = specs
        return self._real.CUmodule(module)

    @_api(1)
    def cuModuleGetFunction(self, hmod, name):
        specs = self._modules.get(int(hmod))
        if specs is None:
            raise _Fail("CUDA_ERROR_INVALID_HANDLE", f"module {int(hmod):#x} is not loaded")
        key = name.decode() if isinstance(name, (bytes, bytearray)) else str(name)
        if key not in specs:
            raise _Fail("CUDA_ERROR_NOT_FOUND", f"no kernel {key!r} in the module")
        self._next_handle += 1
        self._functions[self._next_handle] = (int(hmod), specs[key])
        return self._real.CUfunction(self._next_handle)

    @_api(0)
    def cuModuleUnload(self, hmod):
        if self._modules.pop(int(hmod), None) is None:
            raise _Fail("CUDA_ERROR_INVALID_HANDLE", f"module {int(hmod):#x} is not loaded")
        for f in [f for f, (m, _) in self._functions.items() if m == int(hmod)]:
            del self._functions[f]

    @_api(0)
    def cuLaunchKernel(self, f, gx, gy, gz, bx, by, bz, shared_bytes, stream, kernel_params, extra):
        if int(f) not in self._functions:
            raise _Fail("CUDA_ERROR_INVALID_HANDLE", "unknown kernel function (module unloaded?)")
        _, spec = self._functions[int(f)]
        if min(int(gx), int(gy), int(gz), int(bx), int(by), int(bz)) < 1 or int(bx) * int(by) * int(bz) > 1024:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", "grid and block dimensions must be >= 1, <= 1024 threads a block")
        if int(shared_bytes) != 0 or extra not in (None, 0):
            raise kernels.UnsupportedKernel(f"{spec.name} is launched without shared memory or extra options")
        dst, src, vectors = kernels.launch_arguments(spec, kernel_params)
        try:
            self._multimem_store(dst, src, vectors * 16)
        except _Fail as fault:
            # A fault inside a kernel is asynchronous: the launch succeeds, the fault surfaces at the
            # next call (cuCtxSynchronize, or any other) and poisons the context for good.
            self._sticky[self._current_gpu()] = (fault.code, f"a kernel launched earlier faulted: {fault.why}")
            self.errors.append(("cuLaunchKernel", fault.code, "asynchronous: " + fault.why))

    def _multimem_store(self, dst: int, src: int, nbytes: int) -> None:
        """``multimem.st`` of ``nbytes`` at multicast address ``dst``: one store lands in every
        bound member's memory at the same offset (the NVSwitch fan-out)."""
        gpu = self._current_gpu()
        if dst % 16 or src % 16:
            raise _Fail("CUDA_ERROR_MISALIGNED_ADDRESS", "v4.f32 accesses need 16-byte aligned addresses")
        target = self._covering(dst, nbytes)
        if len(target) != 1 or not target[0].multicast:
            raise _Fail("CUDA_ERROR_ILLEGAL_ADDRESS", "multimem.st needs a mapped multicast address range")
        m = target[0]
        if m.access.get(gpu) != int(self.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE):
            raise _Fail("CUDA_ERROR_ILLEGAL_ADDRESS", "no read/write access to the multicast range for this device")
        if self._is_reserved(src):
            try:
                self.check_host_access(src, nbytes)  # ld.global from device memory needs access too
            except IllegalAccess as exc:
                raise _Fail("CUDA_ERROR_ILLEGAL_ADDRESS", str(exc)) from None
        data = ctypes.string_at(src, nbytes)
        offset = dst - m.addr
        for bind in m.obj.table.binds():
            lo, hi = max(offset, bind["mc_offset"]), min(offset + nbytes, bind["mc_offset"] + bind["size"])
            if lo >= hi:
                continue
            local = self._allocs.get(bind["inode"]) if bind["pid"] == os.getpid() else None
            fd = local.fd if local is not None else open_peer_fd(bind["pid"], bind["fd"], bind["inode"])
            if fd is None:
                raise _Fail("CUDA_ERROR_ILLEGAL_ADDRESS", f"bound member memory of pid {bind['pid']} is gone")
            try:
                os.pwrite(fd, data[lo - offset:hi - offset], bind["mem_offset"] + lo - bind["mc_offset"])
            finally:
                if local is None:
                    os.close(fd)
