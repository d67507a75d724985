"""Per-slot weight copies for MoonEP's two prefetch generations.

Both establish the same post-condition (moonep.md §2.3): *rank ``d``'s slot
``b`` holds expert ``experts_to_copy[d, b]``* for every ``b`` with a value
``>= 0``; slots holding ``-1`` are not touched.

**Pull (Gen A)**, :func:`pull_slots`: each rank copies into its *own* slots::

    full[E + b] <- full[experts_to_copy[rank, b]]      for b with a value >= 0

``full`` is a ``[E+B, out, in]`` Gen A view. Over the sharded store, row
``e < E`` of that view is a mapping of the owner's physical memory, so the
copy reads the owner's bytes directly (host: shared memfd pages; GPU: the
peer's HBM over NVLink through the VMM mapping). No collective runs and no
other rank is involved; the caller guarantees the owners' rows are final.

**Push (Gen B)**, :func:`push_slots`: each rank copies *its own* experts into
every rank's slot pool::

    pool[r][b] <- local[e - rank*epn]   for every (r, b) with e = experts_to_copy[r, b]
                                        owned by this rank

``pool`` is the ``[R, epn, out, in]`` view of every rank's slot chunk; after
all ranks pushed, a barrier makes the writes visible before anyone reads its
slots (the caller runs it: :meth:`ReferenceBuffer.prefetch_weight` does).

On CUDA every copy is one ``cudaMemcpyAsync`` (device to device, run by a
copy engine) issued on a side stream that first waits for the current
stream, so prefetch overlaps compute queued after it; the function returns an
event recorded after the last copy. On CPU the copies are plain ``memcpy``
and run immediately (``None`` is returned).
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch

__all__ = ["pull_slots", "push_slots", "slot_copies", "SideStreams"]


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


_DEFAULT_STREAMS = SideStreams()


def slot_copies(experts_to_copy_row: Sequence[int], num_experts: int) -> list[tuple[int, int]]:
    """``(source row, slot row)`` pairs of one rank's pull: ``(e, E + b)`` for ``e >= 0``."""
    return [(int(e), num_experts + b) for b, e in enumerate(experts_to_copy_row) if int(e) >= 0]


def _run_copies(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], device: torch.device,
                streams: Optional[SideStreams]) -> Optional["torch.cuda.Event"]:
    """Issue ``dst.copy_(src)`` for every pair; on CUDA on a side stream, returning its event."""
    if device.type != "cuda":
        for dst, src in pairs:
            dst.copy_(src)
        return None
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
               bytes_by_tensor: Optional[dict[str, int]] = None) -> tuple[int, int, Optional["torch.cuda.Event"]]:
    """Gen A pull: ``full[E + b] <- full[experts_to_copy_row[b]]`` for every used slot.

    Args:
        full_weights: ``{name: [E+B, out, in]}`` Gen A views (gate, up, down
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
        at the copy, from the source tensors' sizes), and the CUDA event after
        the last copy (``None`` on CPU, where the copies are complete on return).
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
               streams: Optional[SideStreams] = None) -> tuple[int, int, Optional["torch.cuda.Event"]]:
    """Gen B push: ``pool[r][b] <- local[e - rank*epn]`` for every slot holding one of our experts.

    Args:
        local_weights: ``{name: [epn, out, in]}`` this rank's own experts.
        pools: ``{name: [R, epn, out, in]}`` every rank's slot pool (same
            names as ``local_weights``); ``pool[r]`` is mapped writable.
        experts_to_copy: ``[R, SL]`` int table (``SL <= epn``), identical on
            every rank; ``-1`` = unused.
        rank: this rank; experts ``[rank*epn, (rank+1)*epn)`` are pushed.
        experts_per_rank: ``epn``.

    Returns:
        ``(copies, bytes, event)`` as :func:`pull_slots`. The caller must
        barrier after every rank pushed and before any slot is read.
    """
    table = experts_to_copy.to("cpu", torch.int64).tolist()
    lo, hi = rank * experts_per_rank, (rank + 1) * experts_per_rank
    pairs = []
    nbytes = 0
    for r, row in enumerate(table):
        for b, e in enumerate(row):
            if lo <= e < hi:
                for name, local in local_weights.items():
                    pairs.append((pools[name][r, b], local[e - lo]))
                    nbytes += local[e - lo].numel() * local.element_size()
    device = next(iter(local_weights.values())).device if local_weights else torch.device("cpu")
    event = _run_copies(pairs, device, streams)
    return len(pairs), nbytes, event
