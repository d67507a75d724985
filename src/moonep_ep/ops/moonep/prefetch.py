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
(``push_step.run_push``): before the first copy, a barrier that every rank
reaches only once it has finished reading its slots (the pool is shared by
all layers: a peer may still be reading the previous layer's slots), and
after all ranks pushed, a barrier that makes the writes visible before
anyone reads its slots.

On CUDA every copy is one ``cudaMemcpyAsync`` (device to device, run by a
copy engine) issued on a side stream that first waits for the current
stream, so prefetch overlaps compute queued after it; the function returns an
event recorded after the last copy (``cudaEventRecord``). A slot may be read
only after the reading stream waited on that event (``cudaStreamWaitEvent``):
:func:`wait_for_slots` is that wait, for every kind of event the library
hands out.

**CPU tensors** (the host driver, the CUDA emulator) get the same contract,
not a more lenient one: with ``MOONEP_EP_CPU_DEFERRED_COPIES`` (default on)
the copies are queued on the side stream's host queue and land, in issue
order, only when an event of that queue is waited on or synchronized (which
lands everything queued before it, as on a stream), or at teardown
(:meth:`SideStreams.close`, :func:`land_all`). A copy reads its source when
it lands, as a copy engine does. A reader that did not wait sees the old
bytes: on a GPU that is the previous layer's expert or the reload poison.
Off: the copies run at issue and a completed event is returned.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Mapping, Optional, Sequence

import torch

from ... import envs

__all__ = ["pull_slots", "push_slots", "slot_copies", "SideStreams", "wait_for_slots", "land_all", "DoneEvent",
           "PendingCopies"]


class DoneEvent:
    """Event of work that already completed: ``wait``/``synchronize`` return at once."""

    def wait(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class _HostCopyQueue:
    """A CPU side stream: copies issued, not yet landed, run in issue order when waited for."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: collections.deque[tuple[torch.Tensor, torch.Tensor]] = collections.deque()
        self.issued = 0
        self.landed = 0

    def issue(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> "PendingCopies":
        with self._lock:
            self._pending.extend(pairs)
            self.issued += len(pairs)
            return PendingCopies(self, self.issued)

    def land_through(self, ticket: int) -> None:
        """Land every copy issued up to ``ticket`` (and so everything queued before it)."""
        with self._lock:
            while self.landed < ticket:
                dst, src = self._pending.popleft()
                self.landed += 1
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


def slot_copies(experts_to_copy_row: Sequence[int], num_experts: int) -> list[tuple[int, int]]:
    """``(source row, slot row)`` pairs of one rank's pull: ``(e, E + b)`` for ``e >= 0``."""
    return [(int(e), num_experts + b) for b, e in enumerate(experts_to_copy_row) if int(e) >= 0]


def _run_copies(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], device: torch.device,
                streams: Optional[SideStreams]) -> Any:
    """Issue ``dst.copy_(src)`` for every pair on a side stream; return the event after the last copy."""
    if device.type != "cuda":
        if envs.MOONEP_EP_CPU_DEFERRED_COPIES:
            return (streams or _DEFAULT_STREAMS).host_queue().issue(pairs)
        for dst, src in pairs:
            dst.copy_(src)
        return DoneEvent()
    stream = (streams or _DEFAULT_STREAMS).get(device)
    current = torch.cuda.current_stream(device)
    # The slots may still be read by compute queued earlier, and the sources
    # may have been written on the current stream: order after both.
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        for dst, src in pairs:
            # Contiguous same-dtype rows: one cudaMemcpyAsync each. The
            # weight views are persistent VMM mappings outside the caching
            # allocator, so no record_stream is needed (or allowed).
            dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    return event


def pull_slots(full_weights: Mapping[str, torch.Tensor], experts_to_copy_row: Sequence[int], num_experts: int, *,
               streams: Optional[SideStreams] = None,
               bytes_by_tensor: Optional[dict[str, int]] = None) -> tuple[int, dict[int, int], Any]:
    """The pull: ``full[E + b] <- full[experts_to_copy_row[b]]`` for every used slot.

    Args:
        full_weights: ``{name: [E+B, out, in]}`` pull views (gate, up, down
            and optionally scales), all on one device; row ``E + b`` is slot
            ``b`` of this rank.
        experts_to_copy_row: ``[B]`` ints, this rank's row of the plan's
            ``experts_to_copy`` (``-1`` = unused slot, left untouched).
        num_experts: ``E``.
        streams: side-stream cache (CUDA only); the module default otherwise.
        bytes_by_tensor: if given, the bytes copied are added to it per tensor
            name (counted at the copy), so weight and scale traffic read apart.

    Returns:
        ``(copies, bytes_by_expert, event)``: copies issued (used slots ×
        tensors), the bytes each copy read, summed per source expert (counted
        at the copy, from the source tensors' sizes), and the event after the
        last copy: nothing may read a slot before :func:`wait_for_slots` of it.
    """
    pairs = []
    bytes_by_expert: dict[int, int] = {}
    # Every tensor of the row moves: a quantized projection's weight and its scales share the row
    # index (expert id / slot id), so a slot never pairs a fresh weight with a stale scale.
    for src_row, slot_row in slot_copies(experts_to_copy_row, num_experts):
        for name, full in full_weights.items():
            src = full[src_row]
            pairs.append((full[slot_row], src))
            nbytes = src.numel() * src.element_size()
            bytes_by_expert[src_row] = bytes_by_expert.get(src_row, 0) + nbytes
            if bytes_by_tensor is not None:
                bytes_by_tensor[name] = bytes_by_tensor.get(name, 0) + nbytes
    device = next(iter(full_weights.values())).device if full_weights else torch.device("cpu")
    event = _run_copies(pairs, device, streams)
    return len(pairs), bytes_by_expert, event


def push_slots(local_weights: Mapping[str, torch.Tensor], pools: Mapping[str, torch.Tensor],
               experts_to_copy: torch.Tensor, rank: int, experts_per_rank: int, *,
               streams: Optional[SideStreams] = None,
               bytes_by_tensor: Optional[dict[str, int]] = None,
               bytes_by_expert: Optional[dict[int, int]] = None) -> tuple[int, int, Any]:
    """The push: ``pool[r][b] <- local[e - rank*epn]`` for every slot holding one of our experts.

    Args:
        local_weights: ``{name: [epn, out, in]}`` this rank's own experts.
        pools: ``{name: [R, epn, out, in]}`` every rank's slot pool (same
            names as ``local_weights``); ``pool[r]`` is mapped writable.
        experts_to_copy: ``[R, SL]`` int table (``SL <= epn``), identical on
            every rank; ``-1`` = unused.
        rank: this rank; experts ``[rank*epn, (rank+1)*epn)`` are pushed.
        experts_per_rank: ``epn``.
        bytes_by_tensor: as :func:`pull_slots` (a quantized push names its scales apart).
        bytes_by_expert: bytes pushed per own expert (global id), every tensor of its slots.

    Returns:
        ``(copies, bytes, event)`` as :func:`pull_slots`. The caller must call
        this only after every rank finished reading its slots (write after
        read), and synchronize the event (the pushes landed), then barrier,
        before any rank reads a slot.
    """
    table = experts_to_copy.to("cpu", torch.int64).tolist()
    lo, hi = rank * experts_per_rank, (rank + 1) * experts_per_rank
    pairs = []
    nbytes = 0
    for r, row in enumerate(table):
        for b, e in enumerate(row):
            if lo <= e < hi:
                # Every tensor of the slot (weight and scale of each projection) in the same issue.
                for name, local in local_weights.items():
                    pairs.append((pools[name][r, b], local[e - lo]))
                    row_bytes = local[e - lo].numel() * local.element_size()
                    nbytes += row_bytes
                    if bytes_by_tensor is not None:
                        bytes_by_tensor[name] = bytes_by_tensor.get(name, 0) + row_bytes
                    if bytes_by_expert is not None:
                        bytes_by_expert[e] = bytes_by_expert.get(e, 0) + row_bytes
    device = next(iter(local_weights.values())).device if local_weights else torch.device("cpu")
    event = _run_copies(pairs, device, streams)
    return len(pairs), nbytes, event
