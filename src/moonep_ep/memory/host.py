"""Host-memory driver: the VMM primitives on memfd + mmap, for machines without a GPU.

===========================  =====================================================
CUDA VMM                     host equivalent here
===========================  =====================================================
``cuMemCreate``              ``memfd_create`` + ``ftruncate`` + seals (no resize)
export / import (POSIX fd)   the memfd itself (``dup``), passed by SCM_RIGHTS
``cuMemAddressReserve``      ``mmap(PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE)``
``cuMemMap``                 ``mmap(PROT_NONE, MAP_SHARED|MAP_FIXED, fd, offset)``
``cuMemSetAccess``           ``mprotect(PROT_READ|PROT_WRITE)``
``cuMemUnmap``               re-reserve the slice (``PROT_NONE`` anonymous, ``MAP_FIXED``)
``cuMemAddressFree``         ``munmap``
multicast object             a memfd table of bound members; stores fan out in software
===========================  =====================================================

The kernel's page size is 4 KiB, but the driver enforces a *logical*
granularity (default 2 MiB, like CUDA) on every size, offset and address, so
alignment logic is exercised on CPU exactly as on a GPU. Like CUDA, a mapping
keeps its physical memory alive after the handle (fd) is released.

Multicast emulation: ``multicast_create`` makes a small shared table (itself
a memfd, exported and imported like memory). ``multicast_add_device`` counts
members; ``multicast_bind`` records ``(inode, mem_offset, mc_offset, size)`` of
the bound memory; ``multicast_write`` stores bytes into *every* bound
member's memory through this process's own mappings of that memory (the
symmetric allocator maps every peer's chunk), i.e. a software fan-out. Binding
before every member joined, releasing bound memory, and releasing a
multicast object with live binds all raise, mirroring the CUDA failure modes.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import fcntl
import mmap
import os
import struct

import torch

from .. import envs
from . import vm
from .driver import Capabilities, HandleType, MemoryDriver, Shareable

DEFAULT_HOST_GRANULARITY = 2 << 20
MEMFD_PREFIX = "moonep-ep"

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

# Multicast table layout (one page): header, then one entry per member.
_MC_MAGIC = 0x4D435354  # "MCST"
_MC_HEADER = struct.Struct("<IIQI")          # magic, num_devices, size, added
_MC_ENTRY = struct.Struct("<IiQQQQ")         # in_use, pid, inode, mem_offset, mc_offset, size
_MC_TABLE_BYTES = 4096


class HostHandle:
    """One reference to a memfd-backed physical allocation (owns ``fd``)."""

    __slots__ = ("fd", "size", "inode", "imported")

    def __init__(self, fd: int, size: int, inode: int, imported: bool):
        self.fd, self.size, self.inode, self.imported = fd, size, inode, imported

    def __repr__(self) -> str:
        kind = "imported" if self.imported else "created"
        return f"HostHandle({kind}, fd={self.fd}, size={self.size}, inode={self.inode})"


class HostMulticast:
    """This process's reference to a software multicast table."""

    __slots__ = ("fd", "table", "num_devices", "size")

    def __init__(self, fd: int, table: mmap.mmap, num_devices: int, size: int):
        self.fd, self.table, self.num_devices, self.size = fd, table, num_devices, size


class HostDriver(MemoryDriver):
    """VMM primitives over memfd + mmap in this process's address space."""

    name = "host"
    device_type = "cpu"
    hardware_multicast = False

    def __init__(self, rank: int | None = None, granularity: int | None = None):
        super().__init__(rank)
        gran = granularity or envs.MOONEP_EP_HOST_GRANULARITY or DEFAULT_HOST_GRANULARITY
        if gran <= 0 or gran % mmap.PAGESIZE:
            raise self.error("HostDriver", f"granularity {gran} must be a positive multiple of the "
                             f"OS page size {mmap.PAGESIZE}; set MOONEP_EP_HOST_GRANULARITY accordingly")
        self._gran = gran
        self._handles: dict[int, HostHandle] = {}          # id(handle) -> handle
        self._reservations: dict[int, int] = {}            # addr -> size
        self._map_starts: list[int] = []                   # sorted mapping addresses
        self._maps: dict[int, tuple[int, int, int]] = {}   # addr -> (size, inode, offset)
        self._accessible: set[int] = set()
        self._multicasts: dict[int, HostMulticast] = {}
        self._binds: dict[tuple[int, int], tuple[int, int]] = {}  # (id(mc), mc_offset) -> (inode, size)

    # -- capabilities ---------------------------------------------------------
    def capabilities(self) -> Capabilities:
        caps = Capabilities(driver="host", available=False, device="cpu", device_id="host-memory",
                            granularity=self._gran)
        try:
            handle = self.create(self._gran, HandleType.POSIX_FD)
            try:
                base = self.reserve(self._gran, self._gran)
                try:
                    self.map(base, self._gran, handle, 0)
                    self.set_access(base, self._gran)
                    ctypes.memset(base, 0x5A, 1)
                    self.unmap(base, self._gran)
                finally:
                    self.free_reservation(base, self._gran)
            finally:
                self.release(handle)
        except Exception as exc:  # the probe must report, not raise
            caps.reasons["driver"] = f"memfd/mmap probe failed: {exc}"
            return caps
        caps.available = caps.vmm = caps.posix_fd = caps.multicast = True
        caps.fabric = False
        caps.reasons["fabric"] = "fabric handles need a CUDA IMEX/NVLink domain; host memory shares POSIX fds only"
        caps.peer_access = True
        return caps

    def granularity(self, handle_type: HandleType | None = None) -> int:
        return self._gran

    def multicast_granularity(self, num_devices: int, handle_type: HandleType = HandleType.POSIX_FD) -> int:
        return self._gran

    # -- helpers --------------------------------------------------------------
    def _check_aligned(self, call: str, **values: int) -> None:
        for key, value in values.items():
            if value % self._gran:
                raise self.error(call, f"{key}={value} is not a multiple of the granularity "
                                 f"{self._gran} (CUDA_ERROR_INVALID_VALUE on a GPU); round it up "
                                 f"with round_up(n, driver.granularity())", "INVALID_VALUE")

    def _os_error(self, call: str, exc: OSError) -> Exception:
        err = exc.errno
        return self.error(call, f"{os.strerror(err)} (errno {errno.errorcode.get(err, err)})",
                          errno.errorcode.get(err, str(err)))

    def _own(self, handle: HostHandle, call: str) -> HostHandle:
        if not isinstance(handle, HostHandle) or id(handle) not in self._handles:
            raise self.error(call, f"unknown or already released handle {handle!r}", "INVALID_HANDLE")
        return handle

    # -- physical memory ---------------------------------------------------------
    def create(self, size: int, handle_type: HandleType = HandleType.POSIX_FD, tag: str = "mem") -> HostHandle:
        if handle_type != HandleType.POSIX_FD:
            raise self.error("create", f"handle type {handle_type.value!r} is not supported by host "
                             "memory; use POSIX fds (MOONEP_EP_HANDLE_TYPE=fd)", "NOT_SUPPORTED")
        if size <= 0:
            raise self.error("create", f"size {size} must be positive", "INVALID_VALUE")
        self._check_aligned("create", size=size)
        name = f"{MEMFD_PREFIX}.r{self.rank if self.rank is not None else '-'}.{tag}"
        try:
            fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as exc:
            raise self._os_error("memfd_create", exc) from exc
        try:
            os.ftruncate(fd, size)
            # Sealed against resizing: a peer's shrink would SIGBUS every mapper.
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            inode = os.fstat(fd).st_ino
        except OSError as exc:
            os.close(fd)
            raise self._os_error("ftruncate/seal", exc) from exc
        handle = HostHandle(fd, size, inode, imported=False)
        self._handles[id(handle)] = handle
        return handle

    def _bound_inodes(self) -> set[int]:
        return {inode for inode, _ in self._binds.values()}

    def release(self, handle: HostHandle) -> None:
        self._own(handle, "release")
        if not handle.imported and handle.inode in self._bound_inodes():
            raise self.error("release", "memory is still bound to a multicast object; "
                             "multicast_unbind must come first", "ILLEGAL_STATE")
        del self._handles[id(handle)]
        os.close(handle.fd)

    def export(self, handle: HostHandle, handle_type: HandleType = HandleType.POSIX_FD) -> Shareable:
        self._own(handle, "export")
        if handle_type != HandleType.POSIX_FD:
            raise self.error("export", "host memory exports POSIX fds only", "NOT_SUPPORTED")
        return os.dup(handle.fd)  # new fd, close-on-exec, owned by the caller

    def import_handle(self, shareable: Shareable, handle_type: HandleType = HandleType.POSIX_FD,
                      size: int | None = None) -> HostHandle:
        if handle_type != HandleType.POSIX_FD or not isinstance(shareable, int):
            raise self.error("import_handle", f"expected an int fd, got {type(shareable).__name__}",
                             "INVALID_VALUE")
        try:
            st = os.fstat(shareable)
            fd = os.dup(shareable)
        except OSError as exc:
            raise self._os_error("import_handle", exc) from exc
        handle = HostHandle(fd, st.st_size, st.st_ino, imported=True)
        self._handles[id(handle)] = handle
        return handle

    def handle_size(self, handle: HostHandle) -> int:
        return self._own(handle, "handle_size").size

    # -- virtual ranges -----------------------------------------------------------
    def reserve(self, size: int, alignment: int = 0) -> int:
        self._check_aligned("reserve", size=size)
        try:
            addr = vm.reserve(size, max(alignment or self._gran, self._gran))
        except OSError as exc:
            raise self._os_error("reserve(mmap)", exc) from exc
        self._reservations[addr] = size
        return addr

    def _reservation_of(self, addr: int, size: int) -> int:
        for base, length in self._reservations.items():
            if base <= addr and addr + size <= base + length:
                return base
        raise self.error("map", f"range [{addr:#x}, +{size}) is not inside a reservation", "INVALID_VALUE")

    def free_reservation(self, addr: int, size: int) -> None:
        if self._reservations.get(addr) != size:
            raise self.error("free_reservation", f"no reservation of {size} bytes at {addr:#x}", "INVALID_VALUE")
        i = bisect.bisect_left(self._map_starts, addr)
        if i < len(self._map_starts) and self._map_starts[i] < addr + size:
            raise self.error("free_reservation", "reservation still has mappings; unmap them first",
                             "ILLEGAL_STATE")
        try:
            vm.release(addr, size)
        except OSError as exc:
            raise self._os_error("free_reservation(munmap)", exc) from exc
        del self._reservations[addr]

    def map(self, addr: int, size: int, handle: HostHandle, offset: int) -> None:
        self._own(handle, "map")
        self._check_aligned("map", addr=addr, size=size, offset=offset)
        if offset + size > handle.size:
            raise self.error("map", f"[{offset}, +{size}) exceeds the allocation of {handle.size} bytes",
                             "INVALID_VALUE")
        self._reservation_of(addr, size)
        i = bisect.bisect_left(self._map_starts, addr)
        overlaps = (i < len(self._map_starts) and self._map_starts[i] < addr + size) or (
            i > 0 and self._map_starts[i - 1] + self._maps[self._map_starts[i - 1]][0] > addr)
        if overlaps:
            raise self.error("map", f"range [{addr:#x}, +{size}) is already mapped", "ALREADY_MAPPED")
        try:
            vm.map_shared(addr, size, handle.fd, offset)
        except OSError as exc:
            raise self._os_error("map(mmap)", exc) from exc
        self._map_starts.insert(i, addr)
        self._maps[addr] = (size, handle.inode, offset)

    def unmap(self, addr: int, size: int) -> None:
        entry = self._maps.get(addr)
        if entry is None or entry[0] != size:
            raise self.error("unmap", f"no mapping of {size} bytes at {addr:#x}", "INVALID_VALUE")
        try:  # back to reserved, inaccessible address space
            vm.unmap_to_reserved(addr, size)
        except OSError as exc:
            raise self._os_error("unmap(mmap)", exc) from exc
        del self._maps[addr]
        self._map_starts.remove(addr)
        self._accessible.discard(addr)

    def set_access(self, addr: int, size: int) -> None:
        end = addr + size
        cursor = addr
        i = bisect.bisect_left(self._map_starts, addr)
        # Every byte must be mapped (cuMemSetAccess rejects holes too).
        while cursor < end:
            if i >= len(self._map_starts) or self._map_starts[i] != cursor:
                raise self.error("set_access", f"address {cursor:#x} is not mapped", "INVALID_VALUE")
            cursor += self._maps[cursor][0]
            i += 1
        if cursor != end:
            raise self.error("set_access", "range ends inside a mapping", "INVALID_VALUE")
        try:
            vm.protect(addr, size, vm.PROT_READ | vm.PROT_WRITE)
        except OSError as exc:
            raise self._os_error("set_access(mprotect)", exc) from exc
        for start in self._map_starts[bisect.bisect_left(self._map_starts, addr):i]:
            self._accessible.add(start)

    def is_accessible(self, addr: int, size: int) -> bool:
        """True when every byte of the range is mapped read/write (a software check
        that catches misuse before it becomes a SIGSEGV)."""
        i = bisect.bisect_right(self._map_starts, addr) - 1
        cursor = addr
        while cursor < addr + size:
            if i < 0 or i >= len(self._map_starts):
                return False
            start = self._map_starts[i]
            length = self._maps[start][0]
            if not (start <= cursor < start + length) or start not in self._accessible:
                return False
            cursor = start + length
            i += 1
        return True

    # -- tensors ------------------------------------------------------------------
    def as_tensor(self, addr: int, nbytes: int, owner: object) -> torch.Tensor:
        if not self.is_accessible(addr, nbytes):
            raise self.error("as_tensor", f"[{addr:#x}, +{nbytes}) is not mapped read/write", "INVALID_VALUE")
        buf = (ctypes.c_uint8 * nbytes).from_address(addr)
        buf._moonep_owner = owner  # the tensor's storage keeps buf, buf keeps owner
        return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)

    # -- multicast (software fan-out) ---------------------------------------------------
    def _open_table(self, fd: int) -> HostMulticast:
        table = mmap.mmap(fd, _MC_TABLE_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        magic, num, size, _ = _MC_HEADER.unpack_from(table, 0)
        if magic != _MC_MAGIC:
            table.close()
            raise self.error("multicast_import", "fd is not a moonep_ep multicast table", "INVALID_HANDLE")
        mc = HostMulticast(fd, table, num, size)
        self._multicasts[id(mc)] = mc
        return mc

    def multicast_create(self, size: int, num_devices: int,
                         handle_type: HandleType = HandleType.POSIX_FD) -> HostMulticast:
        self._check_aligned("multicast_create", size=size)
        max_members = (_MC_TABLE_BYTES - _MC_HEADER.size) // _MC_ENTRY.size
        if not 0 < num_devices <= max_members:
            raise self.error("multicast_create", f"num_devices={num_devices} outside [1, {max_members}]",
                             "INVALID_VALUE")
        fd = os.memfd_create(f"{MEMFD_PREFIX}.mc", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, _MC_TABLE_BYTES)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            with mmap.mmap(fd, _MC_TABLE_BYTES) as table:
                _MC_HEADER.pack_into(table, 0, _MC_MAGIC, num_devices, size, 0)
            return self._open_table(fd)
        except BaseException:
            os.close(fd)
            raise

    def multicast_export(self, mc: HostMulticast, handle_type: HandleType = HandleType.POSIX_FD) -> Shareable:
        return os.dup(mc.fd)

    def multicast_import(self, shareable: Shareable, handle_type: HandleType = HandleType.POSIX_FD,
                         size: int | None = None) -> HostMulticast:
        fd = os.dup(shareable)
        try:
            return self._open_table(fd)
        except BaseException:
            os.close(fd)
            raise

    def _locked(self, mc: HostMulticast):
        driver = self

        class _Lock:
            # POSIX record locks, not flock: every member's fd shares one open file
            # description (dup + SCM_RIGHTS), and flock would not exclude them.
            def __enter__(self):
                fcntl.lockf(mc.fd, fcntl.LOCK_EX)

            def __exit__(self, *exc):
                fcntl.lockf(mc.fd, fcntl.LOCK_UN)
                return False

        if id(mc) not in driver._multicasts:
            raise driver.error("multicast", "unknown or released multicast object", "INVALID_HANDLE")
        return _Lock()

    def multicast_add_device(self, mc: HostMulticast) -> None:
        with self._locked(mc):
            magic, num, size, added = _MC_HEADER.unpack_from(mc.table, 0)
            if added >= num:
                raise self.error("multicast_add_device", f"all {num} members already joined",
                                 "MULTICAST_RESOURCE_FULL")
            _MC_HEADER.pack_into(mc.table, 0, magic, num, size, added + 1)

    def _entries(self, mc: HostMulticast):
        for i in range(mc.num_devices):
            off = _MC_HEADER.size + i * _MC_ENTRY.size
            yield off, _MC_ENTRY.unpack_from(mc.table, off)

    def multicast_bind(self, mc: HostMulticast, mc_offset: int, handle: HostHandle, mem_offset: int,
                       size: int) -> None:
        self._own(handle, "multicast_bind")
        self._check_aligned("multicast_bind", mc_offset=mc_offset, mem_offset=mem_offset, size=size)
        if mc_offset + size > mc.size or mem_offset + size > handle.size:
            raise self.error("multicast_bind", "bind range exceeds the multicast object or the memory",
                             "INVALID_VALUE")
        with self._locked(mc):
            _, num, _, added = _MC_HEADER.unpack_from(mc.table, 0)
            if added < num:
                # On a GPU this hangs or fails ILLEGAL_STATE: bind needs a barrier after AddDevice.
                raise self.error("multicast_bind", f"only {added} of {num} members have joined; "
                                 "barrier after multicast_add_device before binding", "ILLEGAL_STATE")
            for off, (in_use, *_rest) in self._entries(mc):
                if not in_use:
                    _MC_ENTRY.pack_into(mc.table, off, 1, os.getpid(), handle.inode, mem_offset, mc_offset, size)
                    break
            else:
                raise self.error("multicast_bind", "every member slot is bound", "MULTICAST_RESOURCE_FULL")
        self._binds[(id(mc), mc_offset)] = (handle.inode, size)

    def multicast_unbind(self, mc: HostMulticast, mc_offset: int, size: int) -> None:
        bound = self._binds.get((id(mc), mc_offset))
        if bound is None or bound[1] != size:
            raise self.error("multicast_unbind", f"nothing of {size} bytes bound at mc offset {mc_offset}",
                             "INVALID_VALUE")
        with self._locked(mc):
            for off, (in_use, pid, inode, _m, mc_off, sz) in self._entries(mc):
                if in_use and pid == os.getpid() and inode == bound[0] and mc_off == mc_offset:
                    _MC_ENTRY.pack_into(mc.table, off, 0, 0, 0, 0, 0, 0)
                    break
        del self._binds[(id(mc), mc_offset)]

    def multicast_release(self, mc: HostMulticast) -> None:
        if id(mc) not in self._multicasts:
            raise self.error("multicast_release", "unknown or released multicast object", "INVALID_HANDLE")
        if any(key[0] == id(mc) for key in self._binds):
            raise self.error("multicast_release", "this member is still bound; unbind first", "ILLEGAL_STATE")
        del self._multicasts[id(mc)]
        mc.table.close()
        os.close(mc.fd)

    def multicast_members(self, mc: HostMulticast) -> list[tuple[int, int, int, int, int]]:
        """Bound members as ``(pid, inode, mem_offset, mc_offset, size)``."""
        with self._locked(mc):
            return [tuple(e[1:]) for _, e in self._entries(mc) if e[0]]

    def multicast_write(self, mc: HostMulticast, mc_offset: int, src: torch.Tensor) -> int:
        """Software fan-out: store ``src`` (uint8, contiguous, CPU) at ``mc_offset`` of
        every bound member, through this process's mappings. Returns the member count."""
        if src.dtype != torch.uint8 or not src.is_contiguous() or src.device.type != "cpu":
            raise self.error("multicast_write", f"src must be a contiguous CPU uint8 tensor, got "
                             f"{src.dtype} on {src.device}", "INVALID_VALUE")
        nbytes = src.numel()
        members = self.multicast_members(mc)
        if not members:
            raise self.error("multicast_write", "no member is bound", "ILLEGAL_STATE")
        for _pid, inode, mem_off, mc_off, size in members:
            if not (mc_off <= mc_offset and mc_offset + nbytes <= mc_off + size):
                continue
            target = mem_off + (mc_offset - mc_off)
            addr = self._local_address(inode, target, nbytes)
            if addr is None:
                raise self.error("multicast_write", f"member memory (inode {inode}) is not mapped in this "
                                 "process; the software fan-out writes through local mappings", "ILLEGAL_STATE")
            ctypes.memmove(addr, src.data_ptr(), nbytes)
        return len(members)

    def _local_address(self, inode: int, offset: int, nbytes: int) -> int | None:
        for addr, (size, ino, off) in self._maps.items():
            if ino == inode and off <= offset and offset + nbytes <= off + size and addr in self._accessible:
                return addr + (offset - off)
        return None

    # -- accounting -----------------------------------------------------------------
    def live_objects(self) -> dict[str, int]:
        return {
            "created_handles": sum(1 for h in self._handles.values() if not h.imported),
            "imported_handles": sum(1 for h in self._handles.values() if h.imported),
            "reservations": len(self._reservations),
            "mappings": len(self._maps),
            "multicast_objects": len(self._multicasts),
            "multicast_binds": len(self._binds),
        }
