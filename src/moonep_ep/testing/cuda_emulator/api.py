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

The calls are grouped by role, one module each, all on the shared state and
call wrapper of ``core.py``: ``devices.py`` (init, devices, cliques,
contexts), ``vmm.py`` (allocations, handles, virtual ranges, access),
``multicast.py`` (multicast objects and the multimem-store kernel). This
module composes them and adds the tests' surface.
"""

from __future__ import annotations

from typing import Any

from .core import IllegalAccess, UnknownCall
from .devices import DeviceCalls
from .multicast import MulticastCalls
from .objects import Allocation, MulticastRef, node_bytes_in_use
from .vmm import MemoryCalls

__all__ = ["EmulatedCudaApi", "IllegalAccess", "UnknownCall"]


class EmulatedCudaApi(DeviceCalls, MemoryCalls, MulticastCalls):
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

    ``calls``, ``errors``, ``fail()``, ``plant_device_fault()``, ``sticky_faults()``, ``names()``,
    ``calls_of()`` and ``live()`` are for tests; everything named ``cu*`` is the driver API.
    """

    # -- module surface ---------------------------------------------------------------
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

    def plant_device_fault(self, code: Any = "CUDA_ERROR_ASSERT", after_calls: int = 0,
                           why: str = "a device-side assert triggered in a kernel (planted by a test)") -> None:
        """A kernel of this process fails on the device, as a ``torch._assert_async`` guard or a bad
        address would: after ``after_calls`` more driver calls (0: now, if a context is current, else
        at the first call that has one) the current context is sticky-faulted. From then on every
        call in it -- ``cuCtxSynchronize``, ``cuMemUnmap``, ``cuMemRelease``, ``cuCtxSetCurrent``,
        ``cuDevicePrimaryCtxRelease`` -- and every kernel launch returns ``code`` (CUDA_ERROR_ASSERT
        = 710 by default; the driver's docs: "The context cannot be used anymore"); context-free
        queries still answer. Nothing undoes it: the memory goes back when the process exits."""
        code = code if isinstance(code, str) else self._real.CUresult(int(code)).name
        getattr(self._real.CUresult, code)  # an unknown code name fails here, not at the landing
        self._planted = [code, str(why), max(0, int(after_calls))]
        if not after_calls:
            self._count_toward_planted_fault()

    def sticky_faults(self) -> dict[int, str]:
        """Node GPU -> the sticky error code its context in this process returns (empty: none faulted)."""
        return {gpu: code for gpu, (code, _) in self._sticky.items()}

    def names(self) -> list[str]:
        return [n for n, _ in self.calls]

    def calls_of(self, name: str) -> list[tuple]:
        return [a for n, a in self.calls if n == name]

    def device_used_bytes(self, ordinal: int = 0) -> int:
        """What ``cuMemGetInfo`` reports as used (total - free) on visible device ``ordinal``,
        device-wide: every process's allocations and the driver's own memory (lazy-loaded
        modules); readable without a context, e.g. after ``CudaDriver.close()``."""
        return node_bytes_in_use(self._node_tag, self.visible[int(ordinal)])

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
