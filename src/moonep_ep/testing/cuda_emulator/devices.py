"""The emulated driver's device calls: init, devices, NVLink cliques, peer access, contexts.

``cuInit`` and ``CUDA_VISIBLE_DEVICES``, the device queries (name, UUID,
attributes), the clique calls of a multi-host NVLink domain (CUDA 13.4+),
``cuDeviceCanAccessPeer``, primary contexts and the current context of a
thread, and ``cuMemGetInfo`` (device-wide free memory). Everything here
describes the machine, not memory objects; it sits on :class:`~.core.EmulatorCore`.
"""

from __future__ import annotations

import ctypes
import os

from .core import EmulatorCore, UnknownCall, _api, _Fail
from .node import CLIQUE_CALLS_CUDA_VERSION, visible_gpus
from .objects import node_bytes_in_use

_CTX_BASE = 0xC0DE_0000


class DeviceCalls(EmulatorCore):
    """``cuInit``, ``cuDevice*``, ``cuCtx*`` and ``cuMemGetInfo``."""

    # -- init, devices ----------------------------------------------------------------------------
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
    def _clique_call(self, name: str, dev) -> int:
        if self.node.cuda_version < CLIQUE_CALLS_CUDA_VERSION:
            # What the bindings do when the driver lacks the symbol (new in CUDA 13.4).
            raise RuntimeError(f'Function "{name}" not found')
        gpu = self._gpu(dev)
        if not self.node.fabric_domain:
            raise _Fail("CUDA_ERROR_NOT_SUPPORTED", "this GPU is not part of a multi-node NVLink fabric")
        return gpu

    def _clique_kinds(self) -> tuple:
        # Hopper reports a unicast and a multicast pointer clique (NVML's fabric info v4 notes).
        return (self._real.CUcliqueType.CU_CLIQUE_TYPE_UNICAST_POINTER,
                self._real.CUcliqueType.CU_CLIQUE_TYPE_MULTICAST_POINTER)

    @_api(1, context=False)
    def cuDeviceGetCliqueCount(self, dev):
        self._clique_call("cuDeviceGetCliqueCount", dev)
        return len(self._clique_kinds())

    @_api(2, context=False)
    def cuDeviceGetCliqueInfo(self, count, dev):
        gpu = self._clique_call("cuDeviceGetCliqueInfo", dev)
        ids = (self.node.clique_of_gpu(gpu), self.node.multicast_clique_of_gpu(gpu))
        out = []
        for kind, clique in list(zip(self._clique_kinds(), ids))[:int(count)]:
            info = self._real.CUcliqueInfo()
            # Registering, or outside any fabric: the ids are not assigned yet (zero).
            info.type, info.id = kind, clique if self.node.fabric_ready else 0
            out.append(info)
        return out, len(out)

    @_api(1, context=False)
    def cuDeviceGetFabricClusterUuid(self, dev):
        self._clique_call("cuDeviceGetFabricClusterUuid", dev)
        uuid = self._real.CUuuid()
        ctypes.memmove(uuid.getPtr(), self.node.cluster_uuid(), 16)
        return uuid

    def gpu_fabric_state(self, dev) -> str:
        """What NVML's ``nvmlDeviceGetGpuFabricInfoV`` reports as the GPU's fabric registration
        state (the CUDA driver API has no such query; ``cuda_probe.fabric_state`` asks NVML on a
        GPU and this on the emulator): ``COMPLETED``, ``IN_PROGRESS`` or ``NOT_SUPPORTED``."""
        self._gpu(int(dev))
        if not self.node.fabric_domain:
            return "NOT_SUPPORTED"
        return "IN_PROGRESS" if self.node.fabric_state == "registering" else "COMPLETED"

    # -- peer access, contexts ---------------------------------------------------------------------
    @_api(1, context=False)
    def cuDeviceCanAccessPeer(self, dev, peer):
        return int(self.node.peer_access and self._gpu(dev) != self._gpu(peer))  # NVSwitch: every pair

    @_api(1, context=False)
    def cuDevicePrimaryCtxRetain(self, dev):
        gpu = self._gpu(dev)
        self._raise_if_faulted(gpu)
        self._ctx_refs[gpu] = self._ctx_refs.get(gpu, 0) + 1
        return self._real.CUcontext(_CTX_BASE + gpu)

    @_api(0, context=False)
    def cuDevicePrimaryCtxRelease(self, dev):
        gpu = self._gpu(dev)
        if not self._ctx_refs.get(gpu):
            raise _Fail("CUDA_ERROR_INVALID_CONTEXT", f"no retained primary context on device {int(dev)}")
        self._raise_if_faulted(gpu)  # the retain stays: a faulted context goes with the process
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
        self._raise_if_faulted(gpu)
        self._thread.gpu = gpu

    @_api(1, context=False)
    def cuCtxGetCurrent(self):
        gpu = getattr(self._thread, "gpu", None)
        self._raise_if_faulted(gpu)
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
