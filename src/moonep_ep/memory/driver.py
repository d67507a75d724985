"""The memory-driver interface: the few virtual-memory primitives that the
symmetric allocator needs, mirrored on CUDA VMM and on host memory.

A driver is a thin, stateless-looking façade over one address space (one GPU
context, or one process's host memory). It never decides policy: the
symmetric allocator (``symmetric.py``) decides sizes, order, exchange and
teardown. Every primitive has an undo:

=========================  ==============================
acquire                    undo
=========================  ==============================
``create``                 ``release``
``import_handle``          ``release``
``export``  (fd)           ``os.close`` by the caller
``reserve``                ``free_reservation``
``map``                    ``unmap``
``multicast_create/import``  ``multicast_release``
``multicast_bind``         ``multicast_unbind``
=========================  ==============================

Both drivers require sizes, offsets and addresses to be multiples of
``granularity()``: CUDA enforces it in hardware (``CUDA_ERROR_INVALID_VALUE``),
the host driver in software, so alignment bugs surface on CPU too.

A driver may hold a process-level resource (``CudaDriver``: a retain of the
device's primary context); whoever makes a driver closes it (``close()``, or
``with make_driver(...) as driver:``) after the last object made through it
is gone.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from typing import Any, Union

import torch

from ..errors import DriverError

#: A shareable handle as it crosses process boundaries: an ``int`` file
#: descriptor (POSIX_FD) or 64 opaque bytes (FABRIC).
Shareable = Union[int, bytes]


class HandleType(str, enum.Enum):
    """How a physical allocation is shared with other processes."""

    POSIX_FD = "fd"
    FABRIC = "fabric"


@dataclasses.dataclass
class Capabilities:
    """What one driver instance can do here, with the reason for each 'no'.

    ``reasons`` maps a capability name (``"driver"``, ``"vmm"``, ``"posix_fd"``,
    ``"fabric"``, ``"multicast"``, ``"peer_access"``) to a one-line reason
    when that capability is absent.
    """

    driver: str
    available: bool
    vmm: bool = False
    posix_fd: bool = False
    fabric: bool = False
    multicast: bool = False
    peer_access: bool | None = None
    granularity: int | None = None
    device: str = ""
    #: Identity of the physical device that is stable across processes (a GPU's
    #: UUID, never its ordinal, which CUDA_VISIBLE_DEVICES renumbers per process).
    device_id: str = ""
    #: True when the CUDA driver calls run over moonep_ep's emulator (no GPU).
    emulated: bool = False
    #: The host this device is on ("" = this process's hostname); the emulator names its emulated host.
    host: str = ""
    #: ``<fabric cluster UUID>/<clique id>`` of the GPU's NVLink clique; "" when the driver cannot say
    #: (no multi-node fabric, or a driver older than CUDA 13.4; the reason is in ``reasons["clique"]``).
    clique: str = ""
    #: ``<fabric cluster UUID>/<multicast pointer clique id>``: a multicast team stays inside one; "" as ``clique``.
    multicast_clique: str = ""
    reasons: dict[str, str] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class MemoryDriver(abc.ABC):
    """Virtual-memory primitives of one address space.

    Handles returned by ``create``/``import_handle`` and multicast handles are
    opaque driver objects; callers only pass them back to the same driver.
    ``rank`` is used in error messages only.
    """

    #: ``"host"`` or ``"cuda"``.
    name: str = ""
    #: torch device type of the tensors ``as_tensor`` returns.
    device_type: str = "cpu"
    #: True when ``multicast_map`` gives an address whose stores fan out in
    #: hardware; False when fan-out is done in software (``multicast_write``).
    hardware_multicast: bool = False

    def __init__(self, rank: int | None = None):
        self.rank = rank

    # -- lifetime -------------------------------------------------------------
    def close(self) -> None:
        """Release what the driver itself holds (idempotent). Objects made through
        it must be released first; a driver that holds nothing does nothing."""

    def __enter__(self) -> "MemoryDriver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def torch_device(self) -> torch.device:
        """Device of the tensors :meth:`as_tensor` returns (and of sources to copy from)."""
        return torch.device("cpu")

    # -- errors -------------------------------------------------------------
    def error(self, call: str, detail: str, code: str = "") -> DriverError:
        who = f"[rank {self.rank}] " if self.rank is not None else ""
        code_part = f" -> {code}" if code else ""
        return DriverError(f"{who}{self.name} driver: {call}{code_part}: {detail}",
                           call=call, code=code, rank=self.rank)

    # -- capabilities --------------------------------------------------------
    @abc.abstractmethod
    def capabilities(self) -> Capabilities:
        """Probe what this driver supports here (cheap, no allocation kept)."""

    @abc.abstractmethod
    def granularity(self, handle_type: HandleType | None = None) -> int:
        """Allocation granularity in bytes for physical memory of ``handle_type``.

        ``None``: a granularity valid for *every* handle type this driver may be
        voted to use (the largest; granularities are powers of two), for callers
        that lay out pages before the group has chosen the handle type."""

    @abc.abstractmethod
    def multicast_granularity(self, num_devices: int, handle_type: HandleType) -> int:
        """MINIMUM granularity in bytes of a multicast object spanning ``num_devices``:
        what its size and bind offsets must be multiples of."""

    # -- physical memory ------------------------------------------------------
    @abc.abstractmethod
    def create(self, size: int, handle_type: HandleType, tag: str = "") -> Any:
        """Allocate ``size`` bytes of physical memory exportable as ``handle_type``.

        ``tag`` names the allocation where the platform can show it (host memfd
        names appear in /proc, which the leak checks read); CUDA ignores it."""

    @abc.abstractmethod
    def release(self, handle: Any) -> None:
        """Drop this reference to physical memory (mappings keep it alive)."""

    @abc.abstractmethod
    def export(self, handle: Any, handle_type: HandleType) -> Shareable:
        """Shareable form of ``handle``. A returned fd is new and owned by the caller."""

    @abc.abstractmethod
    def import_handle(self, shareable: Shareable, handle_type: HandleType,
                      size: int | None = None) -> Any:
        """Handle to a peer's memory of ``size`` bytes (as the owner announced it).
        The caller still owns (and closes) a passed fd."""

    @abc.abstractmethod
    def handle_size(self, handle: Any) -> int:
        """Size in bytes of the physical allocation behind ``handle``."""

    # -- virtual ranges --------------------------------------------------------
    @abc.abstractmethod
    def reserve(self, size: int, alignment: int) -> int:
        """Reserve ``size`` bytes of address space aligned to ``alignment``; no access."""

    @abc.abstractmethod
    def free_reservation(self, addr: int, size: int) -> None:
        """Return a reservation; it must have no mappings left."""

    @abc.abstractmethod
    def map(self, addr: int, size: int, handle: Any, offset: int) -> None:
        """Map ``[offset, offset+size)`` of ``handle`` at ``addr`` (inside a reservation)."""

    @abc.abstractmethod
    def unmap(self, addr: int, size: int) -> None:
        """Undo ``map``; the range returns to reserved, inaccessible address space."""

    @abc.abstractmethod
    def set_access(self, addr: int, size: int) -> None:
        """Grant this device read/write access to a mapped range."""

    def synchronize(self) -> None:
        """Wait for all work that may touch mapped memory (before any unmap)."""

    def zero_(self, tensor: torch.Tensor) -> None:
        """Zero ``tensor`` (a view of mapped memory) with the device's fill kernel."""
        tensor.zero_()

    # -- tensors ---------------------------------------------------------------
    @abc.abstractmethod
    def as_tensor(self, addr: int, nbytes: int, owner: object) -> torch.Tensor:
        """Zero-copy ``uint8[nbytes]`` tensor over mapped memory at ``addr``.

        ``owner`` is kept alive by the tensor's storage until the last view of
        it dies; the owner's finalizer is what unmaps the range.
        """

    # -- multicast -------------------------------------------------------------
    @abc.abstractmethod
    def multicast_create(self, size: int, num_devices: int, handle_type: HandleType) -> Any:
        """Create a multicast object of ``size`` bytes for ``num_devices`` members."""

    @abc.abstractmethod
    def multicast_export(self, mc: Any, handle_type: HandleType) -> Shareable: ...

    @abc.abstractmethod
    def multicast_import(self, shareable: Shareable, handle_type: HandleType, size: int | None = None) -> Any:
        """Import a peer's multicast object (``size``: as announced by its creator)."""

    @abc.abstractmethod
    def multicast_add_device(self, mc: Any) -> None:
        """Add this device to the multicast team (before any member binds)."""

    @abc.abstractmethod
    def multicast_bind(self, mc: Any, mc_offset: int, handle: Any, mem_offset: int,
                       size: int) -> None:
        """Bind ``[mem_offset, +size)`` of this device's ``handle`` at ``mc_offset``."""

    @abc.abstractmethod
    def multicast_unbind(self, mc: Any, mc_offset: int, size: int) -> None:
        """Undo this device's bind. Must precede releasing/unmapping the bound memory."""

    @abc.abstractmethod
    def multicast_release(self, mc: Any) -> None: ...

    def multicast_map(self, addr: int, size: int, mc: Any) -> None:
        """Map the multicast object at ``addr`` (hardware multicast only)."""
        raise self.error("multicast_map", "this driver has no hardware multicast; "
                         "use multicast_write (software fan-out)")

    def multicast_write(self, mc: Any, mc_offset: int, src: torch.Tensor) -> None:
        """Store ``src`` (uint8, contiguous) at ``mc_offset`` of every bound member."""
        raise self.error("multicast_write", "this driver fans out in hardware; "
                         "store into the mapped multicast range with multimem_store")

    def multimem_store(self, mc_addr: int, src: torch.Tensor) -> None:
        """Store ``src`` (uint8, contiguous, on :attr:`torch_device`) at the mapped
        multicast address ``mc_addr`` with ``multimem.st`` (hardware multicast only:
        plain loads, stores and copies on a multicast address are undefined)."""
        raise self.error("multimem_store", "this driver has no hardware multicast; use multicast_write")

    # -- accounting --------------------------------------------------------------
    @abc.abstractmethod
    def live_objects(self) -> dict[str, int]:
        """Counts of objects this driver instance holds: handles, reservations,
        mappings, multicast objects. All zero after a clean teardown."""


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``value``."""
    return -(-value // multiple) * multiple
