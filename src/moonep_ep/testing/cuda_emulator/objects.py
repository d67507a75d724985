"""The emulator's driver objects, backed by host memory shared across processes.

* An **allocation** (``cuMemCreate``) is a memfd named
  ``cudaemu.mem.n<node tag>.g<gpu>.t<handle types>.m<min granularity>``: its POSIX-fd
  export is a ``dup`` of it (a real fd another process imports), and a peer
  that imports it reads the metadata back from ``/proc/self/fd``'s link name.
* A **multicast object** is a one-page memfd table (``cudaemu.mc``) holding
  the team (devices added), the creator's liveness, and one entry per bind:
  ``(gpu, pid, fd, inode, mem_offset, mc_offset, size)``. The multimem store
  reaches every bound member's memory through ``/proc/<pid>/fd/<fd>``.
* A **fabric handle** is 64 bytes naming ``(pid, fd, inode)`` of the exporter's
  memfd; importing it opens ``/proc/<pid>/fd/<fd>`` and checks the inode --
  possible only while the exporter keeps the object alive, like IMEX.

Records (team, binds) are guarded by POSIX record locks on the table, which
exclude other processes (one process drives its own records in order).
"""

from __future__ import annotations

import dataclasses
import fcntl
import mmap
import os
import struct
import zlib
from typing import Any

MEM_PREFIX = "cudaemu.mem"
MC_PREFIX = "cudaemu.mc"
FABRIC_MAGIC = b"CUDAEMU1"
#: kind (0 memory, 1 multicast), pid, fd, inode, size, the exporter's domain GPU (its host and clique)
FABRIC_LAYOUT = struct.Struct("<8sBiiQQi")

_TABLE_BYTES = 4096
_MAGIC = 0x43454D55  # "CEMU"
_MAX_TEAM = 72  # an NVL72 clique
# magic, size, num_devices, handle_types, creator_alive, added count, added gpu+1 x16
_HEADER = struct.Struct("<IQIIII" + "I" * _MAX_TEAM)
# in_use, gpu, pid, fd, inode, mem_offset, mc_offset, size
_ENTRY = struct.Struct("<IIiiQQQQ")
MAX_BINDS = (_TABLE_BYTES - _HEADER.size) // _ENTRY.size


def memfd_name(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").removeprefix("/memfd:").split(" ")[0]
    except OSError:
        return ""


@dataclasses.dataclass(eq=False)
class Allocation:
    """Physical memory as this process references it (created here or imported)."""

    fd: int
    size: int
    gpu: int                 # physical GPU index on the node
    handle_types: int        # CU_MEM_HANDLE_TYPE_* bitmask requested at creation
    min_granularity: int     # of the creation prop: maps must align to it
    inode: int
    created_here: bool
    handles: int = 0
    mappings: int = 0
    binds: int = 0

    def alive(self) -> bool:
        return bool(self.handles or self.mappings or self.binds)

    @staticmethod
    def name(node_tag: int, gpu: int, handle_types: int, min_granularity: int) -> str:
        return f"{MEM_PREFIX}.n{node_tag}.g{gpu}.t{handle_types}.m{min_granularity}"

    @classmethod
    def from_fd(cls, fd: int) -> "Allocation | None":
        """An allocation exported by any process, from a (dup'ed) fd; None if it is not one."""
        name = memfd_name(fd)
        if not name.startswith(MEM_PREFIX + "."):
            return None
        parts = dict((p[0], int(p[1:])) for p in name[len(MEM_PREFIX) + 1:].split("."))
        st = os.fstat(fd)
        return cls(fd, st.st_size, parts["g"], parts["t"], parts["m"], st.st_ino, created_here=False)


def node_tag(node: str, machine: str = "") -> int:
    """The tag in the names of node ``node``'s memfds on emulated machine ``machine``: processes with
    other machines (two pytest workers) never see each other's device memory."""
    return zlib.crc32(f"{node}|{machine}".encode() if machine else node.encode())


def node_bytes_in_use(node_tag: int, gpu: int) -> int:
    """Bytes of live allocations on ``gpu`` of the node tagged ``node_tag``, over every process this
    user can see: each allocation is a memfd held open by its creator or an importer (one inode,
    counted once), so a process that exits takes its memory with it, as on a GPU."""
    prefix = f"/memfd:{MEM_PREFIX}.n{node_tag}.g{gpu}."
    seen: dict[int, int] = {}
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        base = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(base)
        except OSError:  # another user's process, or gone
            continue
        for fd in fds:
            try:
                if not os.readlink(f"{base}/{fd}").startswith(prefix):
                    continue
                st = os.stat(f"{base}/{fd}")
            except OSError:
                continue
            seen[st.st_ino] = st.st_size
    return sum(seen.values())


class Table:
    """A multicast object's shared record (the memfd table)."""

    def __init__(self, fd: int):
        self.fd = fd
        self.inode = os.fstat(fd).st_ino
        self.view = mmap.mmap(fd, _TABLE_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    @classmethod
    def create(cls, size: int, num_devices: int, handle_types: int, creator_alive: bool) -> "Table":
        fd = os.memfd_create(MC_PREFIX, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, _TABLE_BYTES)
            table = cls(fd)
        except BaseException:
            os.close(fd)
            raise
        _HEADER.pack_into(table.view, 0, _MAGIC, size, num_devices, handle_types, int(creator_alive), 0,
                          *([0] * _MAX_TEAM))
        return table

    @staticmethod
    def is_table(fd: int) -> bool:
        return memfd_name(fd) == MC_PREFIX

    def close(self) -> None:
        self.view.close()
        os.close(self.fd)

    def locked(self) -> "_Lock":
        return _Lock(self.fd)

    # header fields
    def header(self) -> dict[str, Any]:
        magic, size, num, types, alive, added, *team = _HEADER.unpack_from(self.view, 0)
        return {"size": size, "num_devices": num, "handle_types": types, "creator_alive": bool(alive),
                "team": [g - 1 for g in team[:added]]}

    def set_creator_alive(self, alive: bool) -> None:
        with self.locked():
            fields = list(_HEADER.unpack_from(self.view, 0))
            fields[4] = int(alive)
            _HEADER.pack_into(self.view, 0, *fields)

    def add_device(self, gpu: int) -> str | None:
        """Add ``gpu`` to the team; returns why not (a message) or None."""
        with self.locked():
            fields = list(_HEADER.unpack_from(self.view, 0))
            num, added = fields[2], fields[5]
            team = [g - 1 for g in fields[6:6 + added]]
            if gpu in team:
                return f"GPU {gpu} was already added to this multicast object"
            if added >= num:
                return f"the team of {num} devices is full"
            fields[6 + added] = gpu + 1
            fields[5] = added + 1
            _HEADER.pack_into(self.view, 0, *fields)
        return None

    def entries(self) -> list[tuple[int, tuple]]:
        out = []
        for i in range(MAX_BINDS):
            off = _HEADER.size + i * _ENTRY.size
            out.append((off, _ENTRY.unpack_from(self.view, off)))
        return out

    def binds(self) -> list[dict[str, int]]:
        keys = ("gpu", "pid", "fd", "inode", "mem_offset", "mc_offset", "size")
        return [dict(zip(keys, e[1:])) for _, e in self.entries() if e[0]]

    def add_bind(self, gpu: int, alloc: Allocation, mem_offset: int, mc_offset: int, size: int) -> str | None:
        with self.locked():
            for _, e in self.entries():
                in_use, egpu, _pid, _fd, _ino, _mo, moff, msize = e
                if in_use and egpu == gpu and moff < mc_offset + size and mc_offset < moff + msize:
                    return f"GPU {gpu} already has memory bound at mc offset {moff} (+{msize})"
            for off, e in self.entries():
                if not e[0]:
                    _ENTRY.pack_into(self.view, off, 1, gpu, os.getpid(), alloc.fd, alloc.inode, mem_offset,
                                     mc_offset, size)
                    return None
        return "no bind slot left in the emulated multicast object"

    def remove_bind(self, gpu: int, mc_offset: int, size: int) -> dict[str, int] | None:
        with self.locked():
            for off, e in self.entries():
                in_use, egpu, pid, fd, ino, mem_off, moff, msize = e
                if in_use and egpu == gpu and moff == mc_offset and msize == size and pid == os.getpid():
                    _ENTRY.pack_into(self.view, off, 0, 0, 0, 0, 0, 0, 0, 0)
                    return {"inode": ino, "mem_offset": mem_off}
        return None


class _Lock:
    def __init__(self, fd: int):
        self.fd = fd

    def __enter__(self) -> None:
        fcntl.lockf(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.lockf(self.fd, fcntl.LOCK_UN)


@dataclasses.dataclass(eq=False)
class MulticastRef:
    """This process's view of a multicast object."""

    table: Table
    size: int
    num_devices: int
    handle_types: int
    handles: int = 0
    created_handles: int = 0   # references cuMulticastCreate returned here
    mappings: int = 0
    binds: int = 0

    def alive(self) -> bool:
        return bool(self.handles or self.mappings or self.binds)

    @property
    def inode(self) -> int:
        return self.table.inode


@dataclasses.dataclass(eq=False)
class Mapping:
    addr: int
    size: int
    obj: Any                  # Allocation | MulticastRef
    offset: int
    access: dict = dataclasses.field(default_factory=dict)   # gpu -> CUmemAccess_flags value

    @property
    def multicast(self) -> bool:
        return isinstance(self.obj, MulticastRef)


def open_peer_fd(pid: int, fd: int, inode: int) -> int | None:
    """A new fd on another process's object, if it still holds it (checked by inode)."""
    try:
        mine = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    if os.fstat(mine).st_ino != inode:
        os.close(mine)
        return None
    return mine
