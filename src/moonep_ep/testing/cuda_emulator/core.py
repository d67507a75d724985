"""The machinery every emulated ``cu*`` call shares, and the state behind it.

``EmulatedCudaApi`` (``api.py``) is composed of call groups, one module each
(``devices.py``, ``vmm.py``, ``multicast.py``); they all build on
:class:`EmulatorCore` here: the ``_api`` wrapper (call record, fault
injection, init/context/version checks, ``(CUresult, value...)`` returns),
the per-process state (handles, allocations, reservations, mappings,
contexts) and the lookups more than one group needs (devices, handles,
mappings, cliques, host access). Kept apart so the groups depend on it alone,
never on each other.
"""

from __future__ import annotations

import bisect
import functools
import importlib
import os
import threading
import weakref
from typing import Any, Callable

from . import kernels
from .node import NodeSpec, host_of_process
from .objects import MEM_PREFIX, Allocation, Mapping, MulticastRef, node_tag


class UnknownCall(AttributeError):
    """A driver call the emulator does not implement (never passed through)."""


class IllegalAccess(RuntimeError):
    """Host code touched emulated device memory it may not (the emulator's illegal address)."""


def _close_all(fds: dict) -> None:
    for fd in fds.values():
        os.close(fd)


class _Fail(Exception):
    def __init__(self, code: str, why: str):
        super().__init__(why)
        self.code, self.why = code, why


def _api(n_out: int, *, context: bool = True, init: bool = True) -> Callable:
    """Wrap a ``cu*`` method: record, inject faults, check init/context/version, return a tuple."""

    def deco(fn: Callable) -> Callable:
        name = fn.__name__

        @functools.wraps(fn)
        def call(self: "EmulatorCore", *args: Any) -> tuple:
            if self.record:
                self.calls.append((name, args))
            if name != "cuDriverGetVersion" and self._bindings_too_new():
                # What the bindings do when the driver cannot supply a symbol at their ABI version.
                # (cuda-python's own version check still calls cuDriverGetVersion, so that one works.)
                raise RuntimeError(f'Function "{name}" not found')
            if self._planted is not None:
                self._count_toward_planted_fault()
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


class EmulatorCore:
    """The state of one process's view of the emulated node, and the helpers the call groups share
    (constructor arguments: see :class:`~.api.EmulatedCudaApi`)."""

    def __init__(self, node: NodeSpec | str | None = None, *, visible: str | None = None,
                 record: bool = False, host: int | str | None = None):
        self._real = importlib.import_module("cuda.bindings.driver")
        if node is None:
            from ... import envs
            node = envs.MOONEP_EP_CUDA_EMULATOR_NODE
        self.node = node if isinstance(node, NodeSpec) else NodeSpec.parse(node)
        self.host = host_of_process(self.node, None if host is None else str(host))
        # names this node's memfds (cuMemGetInfo's device-wide figure counts them over every process); the
        # machine keeps two unrelated runs (two pytest workers) off each other's device
        from ... import envs
        machine = envs.MOONEP_EP_CUDA_EMULATOR_MACHINE or ""
        self._node_tag = node_tag(self.node.node, machine)
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
        #: a device fault planted by a test, not landed yet: [code, why, driver calls still let through]
        self._planted: list | None = None
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
        #: (gpu, module kernels) -> memfd of the device memory its first launch took: freed by nothing
        #: but the end of the process (here: of this instance, one process's view)
        self._driver_memory: dict[tuple, int] = {}
        weakref.finalize(self, _close_all, self._driver_memory)

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

    @staticmethod
    def _aligned(what: str, value: int, gran: int) -> None:
        if int(value) % gran:
            raise _Fail("CUDA_ERROR_INVALID_VALUE", f"{what}={value} is not a multiple of the granularity {gran}")

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

    def _clique_size(self) -> int:
        """GPUs in one multicast pointer clique (a multicast team stays inside one); one host's
        GPUs while the fabric is not formed."""
        if not self.node.fabric_ready:
            return self.node.gpus_per_host
        return self.node.gpus // max(1, self.node.mc_cliques or self.node.cliques)

    def _injected_multicast_failure(self, step: str, gpu: int | None = None) -> None:
        """The node spec's ``mc_fail`` at ``step`` (on every GPU, or the one it names)."""
        fail = self.node.mc_fail
        if fail is None or fail[0] != step:
            return
        gpu = self._current_gpu() if gpu is None else gpu
        if fail[2] is None or fail[2] == gpu:
            raise _Fail(fail[1], f"injected by the node spec (mc_fail={step}:{fail[1]}) on GPU {gpu}")

    def _count_toward_planted_fault(self) -> None:
        """One driver call toward the planted fault; it lands once none is left to let through and a
        context is current (a kernel runs in one), making that context sticky-faulted."""
        planted = self._planted
        if planted[2] > 0:
            planted[2] -= 1
            return
        gpu = getattr(self._thread, "gpu", None)
        if gpu is None or not self._ctx_refs.get(gpu):
            return  # no context to fault yet: the next call that has one
        self._planted = None
        self._sticky.setdefault(gpu, (planted[0], planted[1]))  # the first fault is the one reported
        self.errors.append(("(device)", planted[0], "planted: " + planted[1]))

    def _raise_if_faulted(self, gpu: int | None) -> None:
        """Calls that name or act on a context (retain, release, set current) fail once it is
        sticky-faulted too: the real driver gives the context up only when the process exits."""
        sticky = self._sticky.get(gpu) if gpu is not None else None
        if sticky:
            raise _Fail(*sticky)

    def kernel_launched(self, module: str) -> None:
        """A kernel of ``module`` ran on the current GPU (``cuLaunchKernel``, or a library above the driver
        API such as torch's fill): its first launch in the process lazily loads the module. In a
        sticky-faulted context the launch fails as torch's does (``RuntimeError: CUDA error: ...``)."""
        gpu = self._current_gpu()
        sticky = self._sticky.get(gpu)
        if sticky:
            raise RuntimeError(f"CUDA error: {sticky[0]} ({sticky[1]}); the context is unusable until the "
                               "process exits (CUDA emulator)")
        self._take_driver_memory((gpu, module), gpu, self.node.lazy_load, f"module-{module}")

    def _take_driver_memory(self, key: tuple, gpu: int, nbytes: int, what: str) -> None:
        """Device memory the driver takes for itself once per ``key`` (lazy-loaded module code) and
        never returns: a memfd named like an allocation of ``gpu`` (so ``cuMemGetInfo`` counts it,
        device-wide), held until the process exits, in no handle table (nothing can free it)."""
        if not nbytes or key in self._driver_memory:
            return
        fd = os.memfd_create(f"{MEM_PREFIX}.n{self._node_tag}.g{gpu}.driver-{what}", os.MFD_CLOEXEC)
        os.ftruncate(fd, nbytes)  # sparse: costs no host RAM
        self._driver_memory[key] = fd

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
