"""Symmetric allocations: each rank's physical chunks, mapped on every rank.

Objects and ownership (one object releases exactly what it acquired)::

    SymmetricMemory (group rendezvous, collective create/close)
      ├─ own chunks        driver handles from create(); released at close()
      ├─ peer imports      driver handles from import_handle(); released by
      │                    release_imports() or close() (mappings keep memory alive)
      ├─ multicast         _Multicast: mc handle + own bind (+ mc VA on CUDA)
      └─ VirtualRange ...  one reservation + its mappings, built from Segments
           └─ _RangeMapping  unmaps and frees the reservation when the last
                             tensor over the range dies (weakref finalizer)

A ``Segment(owner, chunk, offset, nbytes)`` names bytes of one rank's chunk;
a virtual range is a list of segments laid back to back, so several ranges can
map the same physical bytes (views), e.g. every layer's ``[E+B]`` view maps the
same slot pool. Memory layout of ``map_chunks(order="rank")`` with chunk
sizes ``c0 .. c3`` (each a granularity multiple)::

    rank r's address space (same picture on every rank, different base):
    base ─┬────────────┬────────────┬────────────┬────────────┐
          │ rank 0 c0  │ rank 1 c1  │ rank 2 c2  │ rank 3 c3  │
          └────────────┴────────────┴────────────┴────────────┘
            ▲ physical memory of rank 0 (memfd / cuMemCreate), shared

Teardown order (``close``): synchronize → barrier (no rank still reads a
peer) → multicast: unmap MC range, unbind own memory, release the MC handle
(the root's is the one it created), barrier → drop ranges (each unmaps, then
frees its reservation, as soon as no tensor uses it) → release imported
handles → release own handles. Received fds are closed right after import.
Every step of ``create`` registers its undo before the next step runs, so a
failure anywhere leaves nothing behind, and the failure is raised on every
rank (``GroupComm.step``). The driver is the caller's: it outlives this object.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time
import weakref
from typing import Any, Sequence

import torch

from .. import envs
from ..errors import CollectiveError, ConfigError, DriverError, PeerLostError
from .domain import refusal as domain_refusal
from .driver import MemoryDriver, round_up
from .exchange import ExchangeDecision, HandleExchanger, local_vote, vote
from .fabric import fabric_trial
from .group import GroupComm

_RETRYABLE = ("SYSTEM_NOT_READY",)
_log = logging.getLogger("moonep_ep.memory")
MULTICAST_FIX = ("Fix: MOONEP_EP_MULTICAST=auto goes on without multicast when any rank's multicast setup fails "
                 "(or off skips it); to keep multicast, free other multicast objects (MULTICAST_RESOURCE_FULL) or "
                 "restart the Fabric Manager (ILLEGAL_STATE, SYSTEM_NOT_READY)")


def _driver_failure(exc: CollectiveError) -> bool:
    """Every failing rank failed in a driver call (not bad input, not a lost peer)."""
    return (not isinstance(exc, PeerLostError) and bool(exc.failures)
            and all(msg.startswith("DriverError") for msg in exc.failures.values()))


@dataclasses.dataclass(frozen=True)
class Segment:
    """``nbytes`` bytes at ``offset`` of chunk ``chunk`` of rank ``owner``."""

    owner: int
    chunk: int
    offset: int
    nbytes: int


class _RangeMapping:
    """Owns one reservation and the mappings inside it.

    Tensors over the range keep this object alive (driver.as_tensor); its
    finalizer runs when the last one dies, or at ``VirtualRange.close`` when
    none is alive, and unmaps before freeing the reservation.
    """

    def __init__(self, driver: MemoryDriver, base: int, size: int):
        self.driver, self.base, self.size = driver, base, size
        self.mapped: list[tuple[int, int]] = []
        self._finalizer = weakref.finalize(self, _RangeMapping._teardown, driver, base, size, self.mapped)

    @staticmethod
    def _teardown(driver: MemoryDriver, base: int, size: int, mapped: list[tuple[int, int]]) -> None:
        driver.synchronize()
        while mapped:
            addr, length = mapped.pop()
            driver.unmap(addr, length)
        driver.free_reservation(base, size)

    def release_now(self) -> None:
        self._finalizer()


class VirtualRange:
    """One contiguous virtual range over segments of (possibly several) ranks' chunks.

    ``size`` bytes starting at ``base`` (an address in this process: a CPU
    address for the host driver, a device address for CUDA).
    """

    def __init__(self, mapping: _RangeMapping, segments: tuple[Segment, ...], name: str):
        self._mapping: _RangeMapping | None = mapping
        self.base, self.size = mapping.base, mapping.size
        self.segments = segments
        self.name = name
        self.device_type = mapping.driver.device_type

    @property
    def closed(self) -> bool:
        return self._mapping is None

    def bytes(self) -> torch.Tensor:
        """Zero-copy ``uint8[size]`` tensor over the whole range."""
        if self._mapping is None:
            raise RuntimeError(f"virtual range {self.name!r} is closed")
        return self._mapping.driver.as_tensor(self.base, self.size, self._mapping)

    def tensor(self, dtype: torch.dtype, shape: Sequence[int], byte_offset: int = 0) -> torch.Tensor:
        """Zero-copy tensor of ``dtype``/``shape`` at ``byte_offset`` into the range.

        The tensor keeps the mapping alive: the range is unmapped only after
        ``close()`` *and* the death of every tensor made here.
        """
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = 1
        for dim in shape:
            numel *= int(dim)
        nbytes = numel * itemsize
        if byte_offset < 0 or byte_offset + nbytes > self.size or byte_offset % itemsize:
            raise ConfigError(f"[rank {self._mapping.driver.rank if self._mapping else '?'}] "
                              f"tensor [{byte_offset}, +{nbytes}) of {dtype} does not fit the "
                              f"{self.size}-byte range {self.name!r} (or is misaligned). Fix: check the "
                              "shape and offset against the layout")
        raw = self.bytes()[byte_offset:byte_offset + nbytes]
        return raw.view(dtype).view(*shape)

    def close(self) -> None:
        """Drop this object's hold on the mapping (tensors may still hold it)."""
        mapping, self._mapping = self._mapping, None
        del mapping  # the finalizer runs now if no tensor holds the mapping


class _Multicast:
    def __init__(self, handle: Any, size: int):
        self.handle = handle
        self.size = size
        self.bound = False
        self.va: tuple[int, int] | None = None     # CUDA: reserved MC range (base, size)
        self.mapped = False


class SymmetricMemory:
    """Collective allocation: every rank's chunks, importable and mappable on every rank.

    Create with :meth:`allocate`. ``chunk_sizes[r][i]`` is the (granularity-
    rounded) size of chunk ``i`` of rank ``r``; ranks may have different sizes
    and different numbers of chunks. All handles are exchanged in one round.
    """

    def __init__(self) -> None:  # use allocate()
        self.comm: GroupComm
        self.driver: MemoryDriver
        self.decision: ExchangeDecision
        self.granularity = 0
        self.chunk_sizes: list[list[int]] = []
        self.tags: list[str] = []
        self._own: list[Any] = []
        self._imports: dict[tuple[int, int], Any] = {}
        self._multicast: _Multicast | None = None
        self._ranges: list[VirtualRange] = []
        self._closed = False

    # -- construction -------------------------------------------------------------
    @classmethod
    def allocate(cls, chunk_bytes: Sequence[int], *, driver: MemoryDriver, group: Any = None,
                 tags: Sequence[str] | None = None, multicast: bool = False,
                 multicast_bytes: int | None = None, timeout_s: float | None = None,
                 comm: GroupComm | None = None) -> "SymmetricMemory":
        """Collective over ``group``: allocate this rank's chunks and import every peer's.

        ``chunk_bytes`` lists this rank's chunk sizes in bytes (rounded up to
        the driver granularity). ``multicast=True`` also builds a multicast
        object over the first ``multicast_bytes`` (default: the smallest chunk
        0 of any rank) of every rank's chunk 0, when every rank supports it.
        Raises the same ``CollectiveError`` on every rank if any rank fails.
        """
        self = cls()
        self.comm = comm or GroupComm(group, timeout_s)
        self.driver = driver
        rank = self.comm.rank
        undo = contextlib.ExitStack()
        with undo:
            with self.comm.step("validate and vote") as voting:
                voting.share(local_vote(driver.capabilities(), self.comm.hostname))
                requested = [int(n) for n in chunk_bytes]
                if not requested or any(n < 0 for n in requested):
                    raise ConfigError(f"[rank {rank}] chunk sizes must be >= 0 (at least one chunk), got "
                                      f"{requested}. Fix: pass each chunk's size in bytes")
                self.tags = list(tags) if tags else [f"chunk{i}" for i in range(len(requested))]
                if len(self.tags) != len(requested):
                    raise ConfigError(f"[rank {rank}] {len(self.tags)} tags for {len(requested)} chunks")
            self.decision = vote(voting.gathered, rank, want_multicast=multicast)
            if self.decision.verify_domain:
                # Ranks span hosts and not every driver names its NVLink clique: prove the domain.
                refused = fabric_trial(self.comm, driver)
                if refused:
                    raise domain_refusal(voting.gathered, refused, rank)
            if self.decision.fallback is not None:
                # The device attribute is not proof: try fabric for real, on every rank together.
                refused = fabric_trial(self.comm, driver)
                if refused:
                    self._fall_back(refused, "the fabric trial")
            while True:
                attempt = contextlib.ExitStack()
                try:
                    self._create_exchange_import(requested, attempt)
                except CollectiveError as exc:
                    attempt.close()  # this attempt leaves nothing behind
                    if self.decision.fallback is None or not _driver_failure(exc):
                        raise
                    self._fall_back(exc.failures, "the allocation")
                    continue
                undo.push(attempt.pop_all())
                break
            if self.decision.multicast:
                self._setup_multicast_or_go_without(undo, multicast_bytes)
            undo.pop_all()  # success: the object owns every handle now
        return self

    def _fall_back(self, failures: dict[int, str], where: str) -> None:
        """Every rank switches to the fallback handle type together (they saw the same failures)."""
        first = failures[min(failures)].splitlines()[0][:300]
        self.decision = dataclasses.replace(
            self.decision, handle_type=self.decision.fallback, fallback=None,
            reason=f"{self.decision.reason}; fabric failed in {where} on rank(s) {sorted(failures)} "
                   f"({first}), fell back to POSIX fds on every rank")

    def _create_exchange_import(self, requested: list[int], undo: contextlib.ExitStack) -> None:
        """Collective: round sizes for the chosen handle type, create and export own chunks,
        exchange all handles in one round, import the peers' chunks, close every fd."""
        comm, driver, rank = self.comm, self.driver, self.comm.rank
        ht = self.decision.handle_type
        # Ranks must agree on granularity and handle type before sizes mean anything;
        # the granularity query itself may fail on one rank, so it runs inside the step.
        with comm.step(f"granularity and chunk sizes ({ht.value})") as sizing:
            gran = driver.granularity(ht)
            sizes = [round_up(n, gran) for n in requested]
            if self.decision.multicast and sizes[0]:
                # Chunk 0 is bound to the multicast object: a multiple of its MINIMUM granularity too.
                sizes[0] = round_up(sizes[0], math.lcm(gran, driver.multicast_granularity(comm.world_size, ht)))
            sizing.share((sizes, gran, ht.value))
        meta = sizing.gathered
        if len({m[1] for m in meta}) != 1:
            raise ConfigError(f"[rank {rank}] ranks report different granularities "
                              f"{[m[1] for m in meta]}. Fix: use the same GPU model / "
                              "MOONEP_EP_HOST_GRANULARITY on every rank")
        if len({m[2] for m in meta}) != 1:
            raise ConfigError(f"[rank {rank}] ranks chose different handle types {[m[2] for m in meta]}. "
                              "Fix: set the same MOONEP_EP_HANDLE_TYPE on every rank")
        self.granularity = meta[rank][1]
        sizes = meta[rank][0]
        self.chunk_sizes = [list(m[0]) for m in meta]
        self._own = []
        undo.callback(self._own.clear)

        exported: list[Any] = []
        fds: list[int] = []  # every fd this attempt holds; closed right after import, on every path
        undo.callback(lambda: [_close_quietly(fd) for fd in fds])
        with comm.step(f"create and export ({ht.value})"):
            for size, tag in zip(sizes, self.tags):
                if size == 0:  # an empty chunk (e.g. a rank owning no page) has no memory
                    self._own.append(None)
                    continue
                handle = driver.create(size, ht, tag=tag)
                undo.callback(driver.release, handle)
                self._own.append(handle)
            for handle in self._own:
                if handle is not None:
                    shareable = driver.export(handle, ht)
                    if isinstance(shareable, int):
                        fds.append(shareable)
                    exported.append(shareable)

        received = HandleExchanger(comm).exchange(exported, ht)
        fds.extend(item for peer_list in received for item in peer_list if isinstance(item, int))

        with comm.step(f"import peer handles ({ht.value})"):
            for owner, peer_list in enumerate(received):
                nonempty = [i for i, n in enumerate(self.chunk_sizes[owner]) if n > 0]
                if len(peer_list) != len(nonempty):
                    raise DriverError(f"[rank {rank}] rank {owner} sent {len(peer_list)} handles "
                                      f"for {len(nonempty)} non-empty chunks")
                if owner == rank:
                    continue
                for i, shareable in zip(nonempty, peer_list):
                    handle = driver.import_handle(shareable, ht, size=self.chunk_sizes[owner][i])
                    undo.callback(driver.release, handle)
                    undo.callback(self._imports.pop, (owner, i), None)
                    self._imports[(owner, i)] = handle
        while fds:  # imported: the handles keep the memory, the fds are done
            _close_quietly(fds.pop())

    def _setup_multicast_or_go_without(self, undo: contextlib.ExitStack, multicast_bytes: int | None) -> None:
        """Build the multicast object; with ``MOONEP_EP_MULTICAST=auto`` a driver failure on any rank
        at any step from create to map makes every rank go on without it, in lockstep (every rank saw
        the same ``CollectiveError``), as PyTorch's ``init_multicast_for_block`` does. With ``on`` the
        failure stands, with the fix. Either way everything multicast acquired is released."""
        try:
            self._setup_multicast(undo, multicast_bytes)
        except CollectiveError as exc:
            if not _driver_failure(exc):
                raise  # bad input or a lost peer: not a reason to go on
            if self.decision.multicast_forced:  # the same error on every rank, the fix once
                forced = CollectiveError(exc.step, exc.failures, rank=self.rank)
                forced.args = (f"{forced}\n  (MOONEP_EP_MULTICAST=on) {MULTICAST_FIX}",)
                raise forced from exc
            with self.comm.step("multicast off: release what multicast acquired"):
                self._teardown_multicast()
            first = min(exc.failures)
            why = (f"rank {first} failed at '{exc.step}': {exc.failures[first].splitlines()[0][:300]}"
                   + (f" (rank(s) {sorted(exc.failures)} failed)" if len(exc.failures) > 1 else ""))
            self.decision = dataclasses.replace(self.decision, multicast=False,
                                                reason=f"{self.decision.reason}; multicast: off ({why})")
            _log.warning("[rank %d] multicast: off on every rank (MOONEP_EP_MULTICAST=auto): %s", self.rank, why)

    def _setup_multicast(self, undo: contextlib.ExitStack, multicast_bytes: int | None) -> None:
        comm, driver, ht = self.comm, self.driver, self.decision.handle_type
        rank, world = comm.rank, comm.world_size
        with comm.step("multicast size"):
            # MINIMUM is what the driver requires; RECOMMENDED (512 MiB on 8xH100) is a
            # performance hint that can exceed a whole chunk (flooring to it gave size 0).
            mc_gran = driver.multicast_granularity(world, ht)
            smallest = min(sizes[0] for sizes in self.chunk_sizes)
            wanted = multicast_bytes if multicast_bytes is not None else smallest
            size = round_up(wanted, mc_gran)  # up, as NCCL's nvlsAllocateMem does
            if wanted <= 0 or size > smallest:
                raise ConfigError(f"[rank {rank}] multicast size {wanted} (rounded up to the multicast "
                                  f"granularity {mc_gran}: {size}) must be positive and fit every rank's chunk 0 "
                                  f"(smallest {smallest}). Fix: enlarge chunk 0 or pass a smaller multicast_bytes")
        exported: list[Any] = []
        received: list[Any] = []
        try:
            with comm.step("multicast create"):
                if rank == 0:
                    # The root keeps the reference cuMulticastCreate returned until teardown, as
                    # NCCL (nvls.cc) does: peers import it, and an exported handle resolves to the
                    # object only while that reference lives.
                    mc = _Multicast(driver.multicast_create(size, world, ht), size)
                    self._multicast = mc
                    undo.callback(self._teardown_multicast_quietly)
                    exported.append(driver.multicast_export(mc.handle, ht))
            received = HandleExchanger(comm).exchange(exported, ht)[0]
            with comm.step("multicast import"):
                if rank != 0:
                    mc = _Multicast(driver.multicast_import(received[0], ht, size=size), size)
                    self._multicast = mc
                    undo.callback(self._teardown_multicast_quietly)
        finally:
            for item in exported + received:
                if isinstance(item, int):
                    _close_quietly(item)
        with comm.step("multicast add device"):
            driver.multicast_add_device(mc.handle)
        self._bind_multicast_in_lockstep(mc)
        with comm.step("multicast map"):
            if driver.hardware_multicast:
                base = driver.reserve(size, mc_gran)
                mc.va = (base, size)
                driver.multicast_map(base, size, mc.handle)
                mc.mapped = True

    def _bind_multicast_in_lockstep(self, mc: _Multicast) -> None:
        """Bind own chunk 0; transient failures are retried by all ranks together."""
        comm, driver = self.comm, self.driver
        retries = envs.MOONEP_EP_MC_BIND_RETRIES
        for attempt in range(retries + 1):
            with comm.step(f"multicast bind (attempt {attempt + 1}): share outcomes") as binding:
                if not mc.bound:
                    try:
                        driver.multicast_bind(mc.handle, 0, self._own[0], 0, mc.size)
                        mc.bound = True
                    except DriverError as exc:  # shared below: retried or raised on every rank
                        binding.share((exc.code, str(exc)))
            failed = {r: s for r, s in enumerate(binding.gathered) if s is not None}
            if not failed:
                return
            retryable = all(any(code in s[0] for code in _RETRYABLE) for s in failed.values())
            if not retryable or attempt == retries:
                raise CollectiveError(f"multicast bind (attempt {attempt + 1})",
                                      {r: f"DriverError: {s[1]}" for r, s in failed.items()}, rank=comm.rank)
            time.sleep(0.05 * (attempt + 1))

    # -- views ---------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    def _handle(self, owner: int, chunk: int) -> Any:
        if owner == self.rank:
            return self._own[chunk]
        try:
            return self._imports[(owner, chunk)]
        except KeyError:
            raise RuntimeError(f"[rank {self.rank}] chunk {chunk} of rank {owner} is not imported "
                               "(release_imports() was called, or it does not exist)") from None

    def map_range(self, segments: Sequence[Segment], name: str = "") -> VirtualRange:
        """Local: reserve one range and map ``segments`` back to back, read/write.

        Each segment's offset and size must be granularity multiples and lie
        inside its chunk. On failure everything this call mapped is undone.
        """
        self._check_open()
        segments = tuple(segments)
        gran = self.granularity
        for s in segments:
            if not (0 <= s.owner < self.world_size) or not (0 <= s.chunk < len(self.chunk_sizes[s.owner])):
                raise ConfigError(f"[rank {self.rank}] segment {s} names a chunk that does not exist")
            if s.offset % gran or s.nbytes % gran or s.nbytes <= 0:
                raise ConfigError(f"[rank {self.rank}] segment {s} is not aligned to the granularity "
                                  f"{gran}. Fix: round offsets and sizes to granularity multiples")
            if s.offset + s.nbytes > self.chunk_sizes[s.owner][s.chunk]:
                raise ConfigError(f"[rank {self.rank}] segment {s} runs past the end of its "
                                  f"{self.chunk_sizes[s.owner][s.chunk]}-byte chunk")
        total = sum(s.nbytes for s in segments)
        if total == 0:
            raise ConfigError(f"[rank {self.rank}] a virtual range needs at least one segment")
        base = self.driver.reserve(total, gran)
        mapping = _RangeMapping(self.driver, base, total)
        try:
            cursor = base
            for s in segments:
                self.driver.map(cursor, s.nbytes, self._handle(s.owner, s.chunk), s.offset)
                mapping.mapped.append((cursor, s.nbytes))
                cursor += s.nbytes
            self.driver.set_access(base, total)
        except BaseException:
            mapping.release_now()
            raise
        vr = VirtualRange(mapping, segments, name)
        self._ranges.append(vr)
        return vr

    def map_chunks(self, chunk: int = 0, order: str = "rank", name: str = "") -> VirtualRange:
        """Every rank's chunk ``chunk`` back to back, in rank order or local-first.

        ``local_first``: this rank's chunk, then ranks ``rank+1, …, R-1, 0, …``.
        """
        owners = self.owner_order(order)
        return self.map_range([Segment(r, chunk, 0, self.chunk_sizes[r][chunk]) for r in owners],
                              name or f"chunk{chunk}/{order}")

    def owner_order(self, order: str) -> list[int]:
        if order == "rank":
            return list(range(self.world_size))
        if order == "local_first":
            return [(self.rank + i) % self.world_size for i in range(self.world_size)]
        raise ConfigError(f"[rank {self.rank}] order={order!r}. Fix: use 'rank' or 'local_first'")

    def release_imports(self) -> None:
        """Release imported peer handles once every view is mapped (mappings keep
        the memory alive). Further ``map_range`` calls on peer chunks then fail."""
        while self._imports:
            _, handle = self._imports.popitem()
            self.driver.release(handle)

    # -- multicast -------------------------------------------------------------------
    @property
    def has_multicast(self) -> bool:
        return self._multicast is not None and self._multicast.bound

    def multicast_write(self, offset: int, src: torch.Tensor) -> None:
        """Store ``src`` (any dtype, contiguous) at byte ``offset`` of every rank's chunk 0.

        CUDA: ``multimem.st`` into the multicast range (the switch fans it out;
        a plain copy there is undefined), so offset and size are multiples of
        16 bytes. Host: software fan-out through this rank's mappings of every
        member. Ordering with other ranks' reads is the caller's (synchronize,
        then barrier).
        """
        mc = self._multicast
        if mc is None or not mc.bound:
            raise RuntimeError(f"[rank {self.rank}] no multicast object (decision: {self.decision.reason})")
        data = src.contiguous().view(torch.uint8).reshape(-1)
        if offset < 0 or offset + data.numel() > mc.size:
            raise ConfigError(f"[rank {self.rank}] multicast write [{offset}, +{data.numel()}) exceeds "
                              f"the {mc.size}-byte multicast object")
        if mc.va is not None:
            data = data.to(self.driver.torch_device)
            if data.data_ptr() % 16:  # a view at an odd offset: multimem's v4 loads need 16-byte alignment
                data = data.clone()
            self.driver.multimem_store(mc.va[0] + offset, data)
        else:
            self.driver.multicast_write(mc.handle, offset, data.cpu())

    def _teardown_multicast_quietly(self) -> None:
        try:
            self._teardown_multicast()
        except Exception:  # noqa: BLE001 - rollback path: keep undoing the rest
            pass

    def _teardown_multicast(self) -> None:
        mc, self._multicast = self._multicast, None
        if mc is None:
            return
        driver = self.driver
        driver.synchronize()
        if mc.mapped and mc.va is not None:
            driver.unmap(mc.va[0], mc.va[1])
            mc.mapped = False
        if mc.va is not None:
            driver.free_reservation(*mc.va)
            mc.va = None
        if mc.bound:
            # Unbind before the bound memory is unmapped or released anywhere.
            driver.multicast_unbind(mc.handle, 0, mc.size)
            mc.bound = False
        driver.multicast_release(mc.handle)

    # -- accounting ---------------------------------------------------------------------
    def own_handles(self) -> list[Any]:
        return [h for h in self._own if h is not None]

    # -- teardown -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"[rank {self.comm.rank}] symmetric memory is closed")

    def close(self) -> None:
        """Collective teardown (see the module docstring for the order). Idempotent.

        If a peer is gone (the barrier fails), every local resource is still
        released, then the error is raised: a survivor never leaks because a
        peer died.
        """
        if self._closed:
            return
        self._closed = True
        driver = self.driver
        errors: list[BaseException] = []

        def attempt(fn, *args) -> None:
            try:
                fn(*args)
            except BaseException as exc:  # noqa: BLE001 - keep releasing, raise the first at the end
                errors.append(exc)

        attempt(driver.synchronize)
        attempt(self.comm.barrier, "close: peers done")  # nobody reads a peer's chunk any more
        if self._multicast is not None:
            attempt(self._teardown_multicast)
            if not errors:
                attempt(self.comm.barrier, "close: multicast unbound")  # before anyone frees memory
        ranges, self._ranges = self._ranges, []
        for vr in ranges:
            attempt(vr.close)
        del ranges
        attempt(self.release_imports)
        while self._own:
            handle = self._own.pop()
            if handle is not None:
                attempt(driver.release, handle)
        if errors:
            raise errors[0]

    def __enter__(self) -> "SymmetricMemory":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass

