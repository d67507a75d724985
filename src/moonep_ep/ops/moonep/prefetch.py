"""Per-slot weight copies for MoonEP's two prefetch generations.

Both establish the same post-condition (moonep.md §2.3): *rank ``d``'s slot
``b`` holds expert ``experts_to_copy[d, b]``* for every ``b`` with a value
``>= 0``; slots holding ``-1`` are not touched.

**Pull**, :func:`pull_slots`: each rank copies into its *own* slots::

    full[E + b] <- full[experts_to_copy[rank, b]]      for b with a value >= 0

``full`` is a ``[E+B, out, in]`` pull view. Over the sharded store, row
``e < E`` of that view is a mapping of the owner's physical memory, so the
copy reads the owner's bytes directly (host: shared memfd pages; GPU: the
peer's HBM over NVLink through the VMM mapping). No collective runs and no
other rank is involved; the caller guarantees the owners' rows are final.

**Push**, :func:`push_slots`: each rank copies *its own* experts into
every rank's slot pool::

    pool[r][b] <- local[e - rank*epn]   for every (r, b) with e = experts_to_copy[r, b]
                                        owned by this rank

``pool`` is the ``[R, epn, out, in]`` view of every rank's slot chunk. The
writes land in memory other ranks read, so the caller orders them twice
(``push_step.run_push``, each a barrier in stream order): before the first
copy, one that every rank passes only once it has finished reading its slots
(the pool is shared by all layers: a peer may still be reading the previous
layer's slots), and after all ranks pushed, one that makes the writes
visible before anyone reads its slots.

**No host read of the table.** Both take the table as a device int tensor (int32 or int64; host ints
are moved there) and issue work whose shape depends on the table's size only: on CUDA one
:func:`~.copy_rows_kernel.copy_rows` launch per tensor (gate, up, down, scales), whose programs read the
table in device memory and skip the entries that copy nothing, on a side stream that first waits for the
current stream, so prefetch overlaps compute queued after it. They return a :class:`SlotFill` whose
``event`` is recorded after the last launch (``cudaEventRecord``). A slot may be read only after the
reading stream waited on that event (``cudaStreamWaitEvent``): :func:`wait_for_slots` is that wait, for
every kind of event the library hands out. The fill's byte counts (copies, bytes per expert and per
tensor) are read from its copy of the table when first asked, after the step (one host read then).

**CPU tensors** (the host driver, the CUDA emulator) get the same contract,
not a more lenient one: with ``MOONEP_EP_CPU_DEFERRED_COPIES`` (default on)
the copies are queued on the side stream's host queue and land, in issue
order, only when an event of that queue is waited on or synchronized (which
lands everything queued before it, as on a stream), or at teardown
(:meth:`SideStreams.close`, :func:`land_all`). A fill reads its index table
(the copy taken at issue, as the GPU path takes it in stream order) and its
sources when it lands, as the kernel does: :meth:`RowCopies.landing_pairs`
is the device's own work, so ``testing/host_syncs.py`` counts no read inside
it. A reader that did not wait sees the old bytes: on a GPU that is the
previous layer's expert or the reload poison. Off: the copies run at issue
and a completed event is returned.
"""

from __future__ import annotations

import collections
import math
import threading
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

import torch

from ... import envs
from ...errors import config_error
from .copy_rows_kernel import copy_rows

__all__ = ["pull_slots", "push_slots", "RowCopies", "SlotFill", "SideStreams", "wait_for_slots", "land_all",
           "DoneEvent", "PendingCopies", "stream_capturing"]


def stream_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (the capture emulator, ``testing/cuda_capture.py``,
    answers True while it records): what decides the MoonEP library's synchronous mode under capture
    (``vllm/experts/overlap.py``) and refuses a buffer built inside a capture (``vllm/manager.py``)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class DoneEvent:
    """Event of work that already completed: ``wait``/``synchronize`` return at once."""

    def wait(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class _HostCopyQueue:
    """A CPU side stream: fills issued, not yet landed, run in issue order when waited for."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: collections.deque[RowCopies] = collections.deque()
        self.issued = 0
        self.landed = 0

    def issue(self, work: "RowCopies") -> "PendingCopies":
        with self._lock:
            self._pending.append(work)
            self.issued += 1
            return PendingCopies(self, self.issued)

    def land_through(self, ticket: int) -> None:
        """Land every fill issued up to ``ticket`` (and so everything queued before it)."""
        with self._lock:
            while self.landed < ticket:
                work = self._pending.popleft()
                self.landed += 1
                for dst, src in work.landing_pairs():
                    dst.copy_(src)  # the source is read now, at landing, as a copy engine reads it


class PendingCopies:
    """Event of copies queued on a CPU side stream (``MOONEP_EP_CPU_DEFERRED_COPIES``): they land when this
    event, or a later one of the same stream, is waited on or synchronized."""

    def __init__(self, queue: _HostCopyQueue, ticket: int):
        self._queue, self._ticket = queue, ticket

    def wait(self, stream: Any = None) -> None:
        self._queue.land_through(self._ticket)

    def synchronize(self) -> None:
        self._queue.land_through(self._ticket)

    def query(self) -> bool:
        return self._queue.landed >= self._ticket


def wait_for_slots(event: Any) -> None:
    """Make the stream that reads the slots wait for the fills behind ``event`` (every path's one wait).

    ``torch.cuda.Event``: the current stream waits (``cudaStreamWaitEvent``; the host does not block).
    MoonEP / DeepEP event handles: their ``current_stream_wait()``. This module's events (and any other
    ``wait()``-able): ``wait()`` (CPU: the copies land). ``None``: nothing. A tuple or list: each.
    """
    if event is None:
        return
    if isinstance(event, (tuple, list)):
        for one in event:
            wait_for_slots(one)
        return
    waiter = getattr(event, "current_stream_wait", None)
    if waiter is not None:
        waiter()
    elif isinstance(event, torch.cuda.Event):
        # the current stream of the event's device (None until recorded: the current device's)
        torch.cuda.current_stream(getattr(event, "device", None)).wait_event(event)
    elif callable(getattr(event, "wait", None)):
        event.wait()
    else:
        raise TypeError(f"moonep_ep: cannot wait for slot fills on a {type(event).__name__} "
                        "(expected a torch.cuda.Event, an event handle with current_stream_wait(), one with "
                        "wait(), None, or a tuple of these). Fix: pass the event the prefetch returned")


class SideStreams:
    """One cached copy stream per CUDA device (created lazily, reused by every prefetch)."""

    def __init__(self) -> None:
        self._streams: dict[int, "torch.cuda.Stream"] = {}

    def get(self, device: torch.device) -> "torch.cuda.Stream":
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._streams.get(index)
        if stream is None:
            stream = torch.cuda.Stream(device=index)
            self._streams[index] = stream
        return stream

    def host_queue(self) -> _HostCopyQueue:
        """The CPU side stream (one per cache): deferred copies of CPU tensors, landed in issue order."""
        queue = getattr(self, "_host", None)
        if queue is None:
            queue = self._host = _HostCopyQueue()
        return queue

    def close(self) -> None:
        """Teardown: every copy still queued on the CPU side stream lands (as a CUDA stream finishes its
        queued copies before its memory goes); the cache stays usable."""
        queue = getattr(self, "_host", None)
        if queue is not None:
            queue.land_through(queue.issued)


_DEFAULT_STREAMS = SideStreams()


def land_all(streams: Optional[SideStreams] = None) -> None:
    """Teardown of ``streams`` (default: the module's cache, which callers without their own use)."""
    (streams or _DEFAULT_STREAMS).close()


class RowCopies:
    """One fill's copies: for every entry ``m`` of ``ids`` (flattened) with ``lo <= ids[m] < hi``, each
    tensor's source row ``ids[m] - lo`` into its destination row ``offset + m``, or with ``width`` (the table's
    row length) the ``[R, epn]`` pools' row ``(m // width, m % width)``. ``ids``: a copy of the plan's table,
    taken at issue."""

    def __init__(self, tensors: Mapping[str, tuple[torch.Tensor, torch.Tensor]], ids: torch.Tensor, lo: int,
                 hi: int, offset: int = 0, width: Optional[int] = None) -> None:
        self.tensors = dict(tensors)  # name -> (destination, source)
        self.ids, self.lo, self.hi, self.offset, self.width = ids, lo, hi, offset, width
        #: the pools' slots per rank (``epn``): destination rows are numbered ``r * pool_width + b``
        self.pool_width = next(iter(self.tensors.values()))[0].shape[1] if width is not None and tensors else 1

    @property
    def dst_row_dims(self) -> int:
        return 1 if self.width is None else 2

    def index_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(source rows, destination rows)`` ``[M]`` on the table's device, ``-1`` where nothing is copied:
        fixed-shape tensor ops, nothing read on the host."""
        flat = self.ids.reshape(-1)
        used = (flat >= self.lo) & (flat < self.hi)
        src_index = torch.where(used, flat - self.lo, torch.full_like(flat, -1))
        m = torch.arange(flat.numel(), dtype=flat.dtype, device=flat.device)
        dst_index = m + self.offset if self.width is None else (m // self.width) * self.pool_width + m % self.width
        return src_index, dst_index

    def landing_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(destination row, source row)`` of every copy, the table read now: the CPU side stream's landing
        (on a GPU the kernel reads it in device memory)."""
        pairs = []
        for m, e in enumerate(int(v) for v in self.ids.reshape(-1).tolist()):
            if not self.lo <= e < self.hi:
                continue
            for dst, src in self.tensors.values():
                row = dst[self.offset + m] if self.width is None else dst[m // self.width, m % self.width]
                pairs.append((row, src[e - self.lo]))
        return pairs


class SlotFill:
    """One issued fill: ``event`` (wait on it before a slot is read, :func:`wait_for_slots`) and its counts
    (``copies``, ``bytes``, ``bytes_by_expert``, ``bytes_by_tensor``), counted from the fill's copy of the table
    when first asked: one host read then, outside the step. Unpacks as the earlier return tuples: pull
    ``(copies, bytes_by_expert, event)``, push ``(copies, bytes, event)`` (a read of a device table)."""

    def __init__(self, api: str, event: Any, work: RowCopies, host_table: Optional[list] = None) -> None:
        self.api, self.event = api, event
        # What the counts need, and no view of the weights (the stats may outlive them)
        self._ids, self._range = work.ids, (work.lo, work.hi)
        self._row_bytes = {name: math.prod(src.shape[1:]) * src.element_size()
                           for name, (_, src) in work.tensors.items()}
        self._table = host_table  # a table given as host ints: nothing to read
        self._counts: Optional[dict[str, Any]] = None

    def table(self) -> list:
        """The table as host ints, in its shape (pull ``[B]``, push ``[R, SL]``); read once."""
        if self._table is None:
            self._table = self._ids.tolist()
        return self._table

    def _count(self) -> dict[str, Any]:
        if self._counts is None:
            row_bytes, (lo, hi) = self._row_bytes, self._range
            table = self.table()
            flat = [v for row in table for v in row] if self._ids.dim() == 2 else table
            used = [int(e) for e in flat if lo <= int(e) < hi]
            per_expert = sum(row_bytes.values())
            by_expert: dict[int, int] = {}
            for e in used:
                by_expert[e] = by_expert.get(e, 0) + per_expert
            self._counts = {"copies": len(used) * len(row_bytes), "bytes": len(used) * per_expert,
                            "bytes_by_expert": by_expert,
                            "bytes_by_tensor": {n: len(used) * b for n, b in row_bytes.items() if used}}
        return self._counts

    @property
    def copies(self) -> int:
        """Row copies (used entries x tensors)."""
        return self._count()["copies"]

    @property
    def bytes(self) -> int:
        return self._count()["bytes"]

    @property
    def bytes_by_expert(self) -> dict[int, int]:
        """Bytes read per source expert (global id), every tensor of its rows."""
        return dict(self._count()["bytes_by_expert"])

    @property
    def bytes_by_tensor(self) -> dict[str, int]:
        return dict(self._count()["bytes_by_tensor"])

    def add_to(self, bytes_by_tensor: Optional[dict[str, int]] = None,
               bytes_by_expert: Optional[dict[int, int]] = None) -> None:
        """Add the counts to the caller's tallies (a read of a device table)."""
        for tally, field in ((bytes_by_tensor, "bytes_by_tensor"), (bytes_by_expert, "bytes_by_expert")):
            if tally is not None:
                for key, n in getattr(self, field).items():
                    tally[key] = tally.get(key, 0) + n

    def __getitem__(self, index: int) -> Any:
        """``fill[2]`` is the event (nothing read); ``fill[0]``, ``fill[1]`` the counts of the tuple form."""
        fields = ("copies", "bytes_by_expert" if self.api == "pull" else "bytes", "event")
        return getattr(self, fields[index])

    def __len__(self) -> int:
        return 3

    def __iter__(self) -> Iterator[Any]:
        return iter((self[0], self[1], self[2]))


def _run_copies(work: RowCopies, device: torch.device, streams: Optional[SideStreams]) -> Any:
    """Issue ``work`` on a side stream; return the event after its last copy."""
    if device.type != "cuda":
        if envs.MOONEP_EP_CPU_DEFERRED_COPIES:
            return (streams or _DEFAULT_STREAMS).host_queue().issue(work)
        for dst, src in work.landing_pairs():
            dst.copy_(src)
        return DoneEvent()
    stream = (streams or _DEFAULT_STREAMS).get(device)
    current = torch.cuda.current_stream(device)
    # The slots may still be read by compute queued earlier, and the sources (and the table's copy) may have
    # been written on the current stream: order after both.
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        src_index, dst_index = work.index_tables()
        for dst, src in work.tensors.values():
            # The weight views are persistent VMM mappings outside the caching allocator: no record_stream.
            copy_rows(dst, dst_index, src, src_index, dst_row_dims=work.dst_row_dims)
        event = torch.cuda.Event()
        event.record(stream)
    work.ids.record_stream(stream)  # made on the current stream, read on this one
    return event


TableLike = Union[torch.Tensor, Sequence[int], Sequence[Sequence[int]]]


def _table_copy(table: TableLike, device: torch.device) -> tuple[torch.Tensor, Optional[list]]:
    """The fill's own copy of the table on ``device`` (a later plan may refill the caller's in place), and the
    host ints when it was given as such."""
    if isinstance(table, torch.Tensor):
        return table.detach().to(device=device, copy=True), None
    nested = len(table) > 0 and isinstance(table[0], (list, tuple))
    host = [[int(e) for e in row] for row in table] if nested else [int(e) for e in table]
    return torch.tensor(host, dtype=torch.int64).to(device=device), host


def _device_of(tensors: Mapping[str, torch.Tensor]) -> torch.device:
    return next(iter(tensors.values())).device if tensors else torch.device("cpu")


def pull_slots(full_weights: Mapping[str, torch.Tensor], experts_to_copy_row: TableLike, num_experts: int, *,
               streams: Optional[SideStreams] = None,
               bytes_by_tensor: Optional[dict[str, int]] = None) -> SlotFill:
    """The pull: ``full[E + b] <- full[experts_to_copy_row[b]]`` for every used slot.

    Args:
        full_weights: ``{name: [E+B, out, in]}`` pull views (gate, up, down
            and optionally scales), all on one device; row ``E + b`` is slot
            ``b`` of this rank.
        experts_to_copy_row: ``[B]`` this rank's row of the plan's
            ``experts_to_copy``: a device int tensor (read by the copies only), or host ints
            (``-1`` = unused slot, left untouched).
        num_experts: ``E``.
        streams: side-stream cache; the module default otherwise.
        bytes_by_tensor: if given, the bytes copied are added to it per tensor name now (a read of a device
            row: the step reads the returned fill's ``bytes_by_tensor`` later instead).

    Returns:
        A :class:`SlotFill`: nothing may read a slot before :func:`wait_for_slots` of its ``event``.
        Every tensor of the row moves: a weight and its scales share the row index, so a slot never
        pairs a fresh weight with a stale scale.
    """
    device = _device_of(full_weights)
    ids, host = _table_copy(experts_to_copy_row, device)
    work = RowCopies({name: (full, full) for name, full in full_weights.items()}, ids, 0, num_experts,
                     offset=num_experts)
    fill = SlotFill("pull", _run_copies(work, device, streams), work, host)
    fill.add_to(bytes_by_tensor)
    return fill


def push_slots(local_weights: Mapping[str, torch.Tensor], pools: Mapping[str, torch.Tensor],
               experts_to_copy: TableLike, rank: int, experts_per_rank: int, *,
               streams: Optional[SideStreams] = None,
               bytes_by_tensor: Optional[dict[str, int]] = None,
               bytes_by_expert: Optional[dict[int, int]] = None) -> SlotFill:
    """The push: ``pool[r][b] <- local[e - rank*epn]`` for every slot holding one of our experts.

    Args:
        local_weights: ``{name: [epn, out, in]}`` this rank's own experts.
        pools: ``{name: [R, epn, out, in]}`` every rank's slot pool (same
            names as ``local_weights``); ``pool[r]`` is mapped writable.
        experts_to_copy: ``[R, SL]`` int table (``SL <= epn``), identical on
            every rank, a device tensor (read by the copies only) or host ints; ``-1`` = unused.
        rank: this rank; experts ``[rank*epn, (rank+1)*epn)`` are pushed.
        experts_per_rank: ``epn``.
        bytes_by_tensor, bytes_by_expert: if given, added to now as :func:`pull_slots` (a read of a device table).

    Returns:
        A :class:`SlotFill` (its ``bytes_by_expert``: bytes pushed per own expert, every tensor of its slots).
        The caller must issue this only after every rank finished reading its slots (write after read), and
        order every rank's reads after the event (the pushes landed) and a barrier
        (``push_step.run_push``).
    """
    device = _device_of(local_weights)
    ids, host = _table_copy(experts_to_copy, device)
    if ids.dim() != 2:
        raise config_error(rank, "push_slots needs the [R, SL] slot table, of shape", tuple(ids.shape),
                           "pass the plan's whole experts_to_copy, not one rank's row")
    lo = rank * experts_per_rank
    work = RowCopies({name: (pools[name], local) for name, local in local_weights.items()}, ids, lo,
                     lo + experts_per_rank, width=ids.shape[1])
    fill = SlotFill("push", _run_copies(work, device, streams), work, host)
    fill.add_to(bytes_by_tensor, bytes_by_expert)
    return fill
