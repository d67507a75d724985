"""What the OS says a server's process tree holds, one sample at a time: RSS, open fds, shared memory.

A soak asks whether these creep over hours. They are read from ``/proc`` (never from the server's own
bookkeeping, which a leak could bypass) for the root process and every descendant, found by their parent
pid in ``/proc/<pid>/stat`` (``/proc/<pid>/task/*/children`` would need every thread's file and a kernel
option). No psutil: the main environment does not install it.

The memfd figure counts moonep_ep's memfds (``memory.accounting.is_moonep_memfd``) that a process keeps
alive, open or mapped, each inode once: the sharded store hands every rank its peers' memfds, so the same
inode is held by several processes, and the tree's total must not count it once per holder.
"""

from __future__ import annotations

import dataclasses
import os
import time

from moonep_ep.memory.accounting import is_moonep_memfd, rss_bytes

__all__ = ["ProcessSample", "Sample", "tree_pids", "sample_process", "sample_tree", "DEV_SHM"]

#: POSIX shared memory (``shm_open``, Python's ``multiprocessing.shared_memory``) lives here on Linux.
DEV_SHM = "/dev/shm"


@dataclasses.dataclass(frozen=True)
class ProcessSample:
    """One process at one moment.

    ``pid`` with ``start_ticks`` (field 22 of ``/proc/<pid>/stat``: start time in clock ticks after boot)
    names one process even if its pid is reused. ``name`` is ``/proc/<pid>/comm`` (vLLM sets it, e.g.
    ``VLLM::EngineCor``; at most 15 characters).
    """

    pid: int
    ppid: int
    start_ticks: int
    name: str
    rss_bytes: int        # VmRSS of /proc/<pid>/status, bytes (0 for a process without memory: a zombie)
    open_fds: int         # entries of /proc/<pid>/fd
    memfd_bytes: int      # bytes of moonep_ep memfds it keeps alive (open: st_size; mapped only: mapped extent)
    shm_files: int        # distinct files under the shared-memory directory it has open or mapped

    @property
    def key(self) -> tuple[int, int]:
        """``(pid, start_ticks)``: one process across samples."""
        return (self.pid, self.start_ticks)

    def label(self) -> str:
        """``pid 1234 (VLLM::EngineCor)``, for verdict messages."""
        return f"pid {self.pid} ({self.name})"


@dataclasses.dataclass(frozen=True)
class Sample:
    """The tree at one moment.

    ``t`` is ``time.monotonic()`` seconds (CLOCK_MONOTONIC on Linux, the clock ``time.perf_counter()``
    reads there too, so ``vllm bench serve``'s per-request ``start_times`` share it); ``wall`` is
    ``time.time()``. ``processes`` are the root first, then the others by pid; empty if the root is gone.
    """

    t: float
    wall: float
    root_pid: int
    processes: tuple[ProcessSample, ...]
    dev_shm_entries: int  # entries of the shared-memory directory (machine-wide, not only the tree's)
    memfd_bytes: int      # moonep_ep memfd bytes the tree keeps alive, each inode once

    def by_key(self) -> dict[tuple[int, int], ProcessSample]:
        return {p.key: p for p in self.processes}


def _stat(pid: int) -> tuple[str, int, int] | None:
    """``(comm, ppid, start_ticks)`` from ``/proc/<pid>/stat``, or None if the process is gone.

    The comm field is in parentheses and may itself hold spaces and parentheses, so the fields after it are
    split from the last ``)``: then field 3 (state) is ``rest[0]``, field 4 (ppid) ``rest[1]``, field 22
    (starttime) ``rest[19]``.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    head, _, tail = raw.rpartition(")")
    rest = tail.split()
    if len(rest) < 20:
        return None
    return head.partition("(")[2], int(rest[1]), int(rest[19])


def tree_pids(root_pid: int) -> list[int]:
    """``root_pid`` and every live descendant, the root first and the rest ascending; ``[]`` if the root is
    gone. One scan of ``/proc``: a pid whose parent is in the tree joins it."""
    if _stat(root_pid) is None:
        return []
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None:
                children.setdefault(stat[1], []).append(int(entry))
    found, todo = [root_pid], [root_pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.append(child)
                todo.append(child)
    return [root_pid] + sorted(found[1:])


def _rss_bytes(pid: int) -> int:
    """0 for a process gone since the scan (or without memory: a zombie has no VmRSS line)."""
    try:
        return rss_bytes(pid)
    except OSError:
        return 0


def _holdings(pid: int, shm_dir: str) -> tuple[int, dict[int, int], dict[int, int], set[str]]:
    """``(open fds, memfd inode -> st_size of open ones, memfd inode -> mapped extent of mapped ones,
    shared-memory files open or mapped)`` of one process."""
    fd_dir = f"/proc/{pid}/fd"
    shm_prefix = os.path.realpath(shm_dir).rstrip("/") + "/"  # fd links name real paths
    open_memfds: dict[int, int] = {}
    mapped: dict[int, int] = {}
    shm: set[str] = set()
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return 0, open_memfds, mapped, shm
    for name in names:
        try:
            target = os.readlink(f"{fd_dir}/{name}")
            if is_moonep_memfd(target):
                st = os.stat(f"{fd_dir}/{name}")  # follows the link to the memfd itself
                open_memfds[st.st_ino] = st.st_size
            elif target.startswith(shm_prefix):
                shm.add(target.removesuffix(" (deleted)"))
        except OSError:
            continue  # closed between the listing and the read
    try:
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                parts = line.split(None, 5)
                if len(parts) < 6:
                    continue
                path = parts[5].strip()
                if is_moonep_memfd(path):
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    inode = int(parts[4])
                    mapped[inode] = mapped.get(inode, 0) + hi - lo
                elif path.startswith(shm_prefix):
                    shm.add(path.removesuffix(" (deleted)"))
    except OSError:
        pass
    return len(names), open_memfds, mapped, shm


def _held(open_memfds: dict[int, int], mapped: dict[int, int]) -> dict[int, int]:
    """inode -> bytes kept alive: the file size where an fd is open, else the mapped extent (as
    ``memory.accounting.snapshot`` counts ``held_bytes``)."""
    return {**mapped, **open_memfds}


def sample_process(pid: int, shm_dir: str = DEV_SHM) -> tuple[ProcessSample, dict[int, int]] | None:
    """One process's :class:`ProcessSample` and its memfd holdings (inode -> bytes), or None if it is gone."""
    stat = _stat(pid)
    if stat is None:
        return None
    fds, open_memfds, mapped, shm = _holdings(pid, shm_dir)
    held = _held(open_memfds, mapped)
    proc = ProcessSample(pid=pid, ppid=stat[1], start_ticks=stat[2], name=stat[0], rss_bytes=_rss_bytes(pid),
                         open_fds=fds, memfd_bytes=sum(held.values()), shm_files=len(shm))
    return proc, held


def sample_tree(root_pid: int, shm_dir: str = DEV_SHM) -> Sample:
    """Sample ``root_pid``'s tree now (see :class:`Sample`). ``shm_dir`` is the shared-memory directory whose
    entries are counted (a test passes its own)."""
    t, wall = time.monotonic(), time.time()
    processes: list[ProcessSample] = []
    tree_held: dict[int, int] = {}
    for pid in tree_pids(root_pid):
        got = sample_process(pid, shm_dir)
        if got is None:
            continue  # exited since the scan
        proc, held = got
        processes.append(proc)
        for inode, nbytes in held.items():
            # One inode held by several processes counts once; an open fd's size is exact, a mapping may
            # cover part of the file, so the largest figure any holder reports is the file's.
            tree_held[inode] = max(tree_held.get(inode, 0), nbytes)
    return Sample(t=t, wall=wall, root_pid=root_pid, processes=tuple(processes),
                  dev_shm_entries=len(os.listdir(shm_dir)),
                  memfd_bytes=sum(tree_held.values()))
