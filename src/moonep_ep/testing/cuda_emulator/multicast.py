"""The emulated driver's multicast calls and the one kernel it runs: the multimem store.

Multicast objects (granularity, create, team, bind, unbind; a team stays
inside one NVLink clique) and the module calls that load, look up and
launch moonep_ep's PTX multimem store (parsed by ``kernels.py``). They live
together because the kernel's only effect is the NVSwitch fan-out through
the multicast object's binds; a fault inside it poisons the context, as on
a GPU.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

from . import kernels
from .core import EmulatorCore, IllegalAccess, _api, _Fail
from .objects import Allocation, MulticastRef, Table, open_peer_fd

_MODULE_BASE = 0x4D0D_0000


class MulticastCalls(EmulatorCore):
    """``cuMulticast*``, ``cuModule*`` and ``cuLaunchKernel``."""

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
        self._injected_multicast_failure("create")
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
        gpu = self._gpu(dev)
        self._injected_multicast_failure("add", gpu)
        team = mc.table.header()["team"]
        if team and not self._same_multicast_clique(team[0], gpu):
            raise _Fail("CUDA_ERROR_INVALID_DEVICE", f"GPU {gpu} is not in the multicast clique of the "
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
        self._injected_multicast_failure("bind", alloc.gpu)
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

    def _same_multicast_clique(self, a: int, b: int) -> bool:
        node = self.node
        if not node.fabric_ready and node.host_of_gpu(a) != node.host_of_gpu(b):
            return False  # no fabric formed: a team cannot span hosts
        return node.multicast_clique_of_gpu(a) == node.multicast_clique_of_gpu(b)

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
        self.kernel_launched(spec.name)  # lazy loading: the module's code lands in device memory, and stays
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
