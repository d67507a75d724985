"""The emulated driver's VMM calls: physical allocations, their handles, virtual ranges, access.

``cuMemCreate`` (poisoned memfds, granularity per handle type), release,
export and import of POSIX-fd and FABRIC handles (with the host and NVLink
clique rules of a multi-host domain), address reservations, ``cuMemMap`` /
``cuMemUnmap`` of allocations and multicast objects, and ``cuMemSetAccess``
(with its peer-path rule). The memory lifecycle moonep_ep's memory manager
drives, on top of :class:`~.core.EmulatorCore`.
"""

from __future__ import annotations

import bisect
import os
from typing import Any

from ...memory import vm
from .core import EmulatorCore, UnknownCall, _api, _Fail
from .objects import FABRIC_LAYOUT, FABRIC_MAGIC, Allocation, Mapping, MulticastRef, Table, open_peer_fd

_POISON = 0xCD           # cuMemCreate memory is not zero-filled; neither is the emulator's
_POISON_LIMIT = 8 << 20  # larger allocations are poisoned at both ends only (keeps memfds sparse)


class MemoryCalls(EmulatorCore):
    """``cuMem*``: allocations, shareable handles, reservations, mappings and access."""

    # -- helpers: granularity, reservations, where an exported handle may be imported ----------
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

    def _reservation_of(self, addr: int, size: int) -> int:
        for base, rsize in self._reservations.items():
            if base <= addr and addr + size <= base + rsize:
                return base
        raise _Fail("CUDA_ERROR_INVALID_VALUE", f"[{addr:#x}, +{size}) is not inside one reserved range")

    def _check_same_host(self, gpu: int, what: str) -> None:
        host = self.node.host_of_gpu(gpu)
        if host != self.host:
            raise _Fail("CUDA_ERROR_INVALID_HANDLE", f"{what} of GPU {gpu} lives on host "
                        f"{self.node.host_name(host)!r}; this process runs on {self.hostname!r}: a POSIX fd "
                        "never crosses hosts (FABRIC handles inside one NVLink clique do)")

    def _check_same_clique(self, gpu: int, what: str) -> None:
        me = self._current_gpu()
        if not self.node.fabric_ready and self.node.host_of_gpu(gpu) != self.node.host_of_gpu(me):
            raise _Fail("CUDA_ERROR_INVALID_HANDLE", f"{what} of GPU {gpu} lives on host "
                        f"{self.node.host_name(self.node.host_of_gpu(gpu))!r} and the NVLink fabric is not formed "
                        f"(fabric_state={self.node.fabric_state}): fabric handles do not cross hosts")
        mine = self.node.clique_of_gpu(me)
        theirs = self.node.clique_of_gpu(gpu)
        if mine != theirs:
            raise _Fail("CUDA_ERROR_INVALID_HANDLE", f"{what} of GPU {gpu} (host "
                        f"{self.node.host_name(self.node.host_of_gpu(gpu))!r}) is in NVLink clique {theirs:#x}; "
                        f"this process's GPUs are in clique {mine:#x}: fabric handles do not cross cliques")

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
        if isinstance(obj, MulticastRef):
            self._injected_multicast_failure("export")
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
            self._injected_multicast_failure("import")
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
            self._injected_multicast_failure("map")
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
