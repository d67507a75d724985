"""What the operating system says this process holds: memfds, mappings, bytes.

Leak checks and footprint figures read these, not the allocator's own
bookkeeping, so a bug in the bookkeeping cannot hide a leak.
"""

from __future__ import annotations

import dataclasses
import os

from . import vm
from .host import MEMFD_PREFIX


@dataclasses.dataclass(frozen=True)
class ProcessMemory:
    """One snapshot of this process's moonep_ep host memory, as the kernel reports it."""

    open_memfds: int          # fds in /proc/self/fd pointing at our memfds
    memfd_mappings: int       # lines of /proc/self/maps backed by our memfds
    own_bytes: int            # st_size of memfds this rank created (physical allocation)
    own_bytes_by_tag: dict    # the same, split by the allocation's tag (memfd name suffix)
    own_resident_bytes: int   # st_blocks of those memfds (pages actually backed)
    held_bytes: int           # bytes of our memfds (any rank's) this process keeps alive: open or mapped
    rss_bytes: int            # VmRSS


def is_moonep_memfd(target: str) -> bool:
    """An fd or mapping target (``/memfd:...``) of one of moonep_ep's memfds."""
    return target.startswith(f"/memfd:{MEMFD_PREFIX}")


def _open_memfds() -> list[tuple[str, str]]:
    """``(fd, target)`` of every moonep_ep memfd open in this process (``/proc/self/fd``)."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # the fd of the listdir itself, closed meanwhile
        if is_moonep_memfd(target):
            out.append((name, target))
    return out


def _own_prefix(rank: int) -> str:
    """The fd target prefix of the memfds ``rank`` created (``host.HostDriver.create`` names them)."""
    return f"/memfd:{MEMFD_PREFIX}.r{rank}."


def own_memfd_bytes(rank: int) -> int:
    """``snapshot(rank).own_bytes`` without the mapping scan: the load-peak sampler calls it at every expert
    a loader writes, and ``/proc/self/maps`` of a vLLM worker has thousands of lines."""
    own_prefix = _own_prefix(rank)
    own = 0
    for name, target in _open_memfds():
        if target.startswith(own_prefix):
            try:
                own += os.fstat(int(name)).st_size
            except OSError:
                continue
    return own


def snapshot(rank: int | None = None) -> ProcessMemory:
    """Scan ``/proc/self``; ``own_*`` count memfds named for ``rank``."""
    open_memfds = own = resident = 0
    by_tag: dict[str, int] = {}
    held: dict[int, int] = {}  # inode -> bytes kept alive (fd size, or mapped extent)
    own_prefix = _own_prefix(rank) if rank is not None else None
    for name, target in _open_memfds():
        open_memfds += 1
        try:
            st_any = os.fstat(int(name))
            held[st_any.st_ino] = st_any.st_size
        except OSError:
            pass
        if own_prefix and target.startswith(own_prefix):
            try:
                st = os.fstat(int(name))
            except OSError:
                continue
            own += st.st_size
            resident += st.st_blocks * 512
            tag = target[len(own_prefix):].split(" ")[0]
            by_tag[tag] = by_tag.get(tag, 0) + st.st_size
    mappings = 0
    mapped: dict[int, int] = {}
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(None, 5)
            if len(parts) == 6 and is_moonep_memfd(parts[5].strip()):
                mappings += 1
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                inode = int(parts[4])
                mapped[inode] = mapped.get(inode, 0) + hi - lo
    for inode, extent in mapped.items():
        held.setdefault(inode, extent)
    return ProcessMemory(open_memfds, mappings, own, by_tag, resident, sum(held.values()), rss_bytes())


def _proc_kib_field(path: str, field: str) -> int:
    """Bytes of a ``Field:  N kB`` line of a /proc status-style file (0 if absent)."""
    with open(path) as lines:
        for line in lines:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def rss_bytes(pid: int | str = "self") -> int:
    """``VmRSS`` of process ``pid`` (this one by default); raises OSError when it is gone."""
    return _proc_kib_field(f"/proc/{pid}/status", "VmRSS:")


def system_shmem_bytes() -> int:
    """``Shmem`` of /proc/meminfo: every memfd page on the machine, counted once."""
    return _proc_kib_field("/proc/meminfo", "Shmem:")


@dataclasses.dataclass(frozen=True)
class DriverHoldings:
    """What the layer *below* the library holds for this process, for leak checks.

    Host driver: the OS (open memfds, memfd mappings, bytes of our memfds kept
    alive). CUDA driver over the emulator: the emulator's own registry (live
    allocation and multicast handles; mappings and reservations; device bytes
    this process created), never moonep_ep's bookkeeping. CUDA on a GPU: the
    driver lists no handles or mappings, so ``handles``/``mappings`` are None
    (with ``how`` saying so) and only the device's used bytes (``cuMemGetInfo``)
    are measured.
    """

    handles: int | None
    mappings: int | None
    bytes_held: int | None
    detail: dict
    how: str
    #: Device-wide used bytes (``cuMemGetInfo``: every process on the GPU, and the driver's own memory
    #: such as lazily loaded kernels); None for the host driver. Read it only after a warm-up.
    device_used: int | None = None


def driver_holdings(driver, rank: int | None = None) -> DriverHoldings:
    """A :class:`DriverHoldings` snapshot for ``driver``'s kind (see its docstring)."""
    if driver.name == "host":
        mem = snapshot(rank)
        return DriverHoldings(mem.open_memfds, mem.memfd_mappings, mem.held_bytes,
                              {"open_memfds": mem.open_memfds, "memfd_mappings": mem.memfd_mappings},
                              "OS: /proc/self/fd and /proc/self/maps entries of moonep_ep memfds")
    from .cuda_calls import emulator_of

    emulator = emulator_of(driver.api)
    if emulator is not None:  # readable after driver.close() too: the emulator is process-wide
        live = emulator.live()
        return DriverHoldings(live["handles"] + live["multicast_handles"],
                              live["mappings"] + live["reservations"], emulator.device_bytes_in_use(), live,
                              "CUDA emulator: its live handles, mappings, reservations and device bytes",
                              emulator.device_used_bytes(driver.device))
    free, total = driver.memory_info()
    return DriverHoldings(None, None, total - free, {},
                          "GPU: the CUDA driver lists no handles or mappings; device bytes from cuMemGetInfo, "
                          "device-wide (every process on the GPU), read after every rank's cleanup", total - free)


def own_physical_bytes(rank: int | None) -> int:
    """Bytes of physical memory this process created and still keeps alive, as reported below
    the library: its memfds (host driver) plus, under ``MOONEP_EP_CUDA_EMULATOR=1``, the
    emulator's device memory (the CUDA driver's allocations). Needs no driver object."""
    from .. import envs

    total = snapshot(rank).own_bytes
    if envs.MOONEP_EP_CUDA_EMULATOR:
        from .cuda_calls import driver_module

        total += driver_module().device_bytes_in_use()
    return total


def resident_bytes(address: int, nbytes: int) -> int:
    """Bytes of ``[address, address + nbytes)`` of this process backed by physical pages now.

    ``mincore(2)``: a page counts once the kernel has backed it (written, or
    read from a file). A fresh large ``torch.empty`` on the CPU is *not*
    resident until written, so this measures what a buffer really costs, not
    its size. Partial pages at either end count for their overlap only.
    """
    if nbytes <= 0:
        return 0
    page = os.sysconf("SC_PAGE_SIZE")
    start = address - address % page
    end = address + nbytes
    npages = -(-(end - start) // page)
    flags = vm.mincore(start, npages * page)
    total = sum(b & 1 for b in flags) * page
    # The first and last pages may hold bytes outside the range: count only the overlap.
    if flags[0] & 1:
        total -= address - start
    if flags[-1] & 1:
        total -= start + npages * page - end
    return total

