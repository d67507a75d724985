"""Host virtual-memory primitives (ctypes ``mmap``/``mprotect``) for address-space reservations.

Python's ``mmap`` module cannot map at a fixed address, so these call libc
directly. Every function raises ``OSError`` with the C ``errno``; callers turn
it into their own error type. Addresses, sizes and offsets must be multiples
of the OS page size (the kernel enforces it).

Used by the host memory driver (``host.py``) and by the CUDA driver emulator
(``moonep_ep.testing.cuda_emulator``), which back "device" memory with memfds
the same way; ``mincore`` serves the resident-bytes figure (``accounting.py``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

PROT_NONE, PROT_READ, PROT_WRITE = 0, 1, 2
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS, _MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_libc.mincore.restype = ctypes.c_int


def _failed(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


def reserve(size: int, alignment: int) -> int:
    """Reserve ``size`` bytes of inaccessible address space aligned to ``alignment``
    (``PROT_NONE``, ``MAP_NORESERVE``: no memory is committed)."""
    raw_len = size + alignment
    raw = _libc.mmap(None, raw_len, PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
    if raw in (None, _MAP_FAILED):
        raise _failed("mmap(reserve)")
    addr = -(-raw // alignment) * alignment
    if addr > raw:  # trim the alignment slack on both sides
        _libc.munmap(raw, addr - raw)
    tail = raw + raw_len - (addr + size)
    if tail:
        _libc.munmap(addr + size, tail)
    return addr


def release(addr: int, size: int) -> None:
    """Give the range back to the OS (the end of a reservation)."""
    if _libc.munmap(addr, size) != 0:
        raise _failed("munmap")


def map_shared(addr: int, size: int, fd: int, offset: int, prot: int = PROT_NONE) -> None:
    """Map ``[offset, offset+size)`` of ``fd`` at exactly ``addr`` (replacing what was there)."""
    got = _libc.mmap(addr, size, prot, _MAP_SHARED | _MAP_FIXED, fd, offset)
    if got in (None, _MAP_FAILED) or got != addr:
        raise _failed("mmap(MAP_FIXED)")


def unmap_to_reserved(addr: int, size: int) -> None:
    """Replace a mapping with reserved, inaccessible address space (``MAP_FIXED`` is atomic)."""
    got = _libc.mmap(addr, size, PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED, -1, 0)
    if got in (None, _MAP_FAILED):
        raise _failed("mmap(unmap to reserved)")


def protect(addr: int, size: int, prot: int) -> None:
    """``mprotect``: ``PROT_READ | PROT_WRITE`` to grant access, ``PROT_NONE`` to revoke it."""
    if _libc.mprotect(addr, size, prot) != 0:
        raise _failed("mprotect")


def mincore(addr: int, size: int) -> bytes:
    """One byte per page of ``[addr, addr + size)`` (``addr`` page-aligned); bit 0 set if it is resident."""
    npages = -(-size // os.sysconf("SC_PAGE_SIZE"))
    vec = (ctypes.c_ubyte * npages)()
    if _libc.mincore(addr, size, vec) != 0:
        raise _failed(f"mincore({addr:#x}, {size})")
    return bytes(vec)
