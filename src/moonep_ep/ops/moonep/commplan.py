"""One dispatch plan as a rank sees it, and what a prefetch did.

:class:`CommPlan` carries MoonEP's ``MoonEPCommPlan`` fields (moonep.md §3)
plus the reference buffer's own state: the global :class:`DispatchPlan` and
this rank's :class:`~moonep_ep.ops.moonep.routing.Routing`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from .planner import DispatchPlan
from .routing import Routing

__all__ = ["CommPlan", "PrefetchStats"]


@dataclasses.dataclass(eq=False)
class CommPlan:
    """This rank's view of one dispatch plan: MoonEP's ``MoonEPCommPlan`` fields plus reference state.

    MoonEP fields (int32, contiguous, on the buffer's device; ``G = E + B``):

    * ``dst`` ``[n]`` (``n = s*K``): entry ``i = t*K + k`` goes to
      ``raw = dest_rank*NvS + loff``; the first entry of a token on a
      destination is stored ``raw`` (primary), later ones ``-raw-1``.
    * ``experts_to_copy`` ``[R, B]``: the whole slot table, identical on every
      rank; row ``d`` = experts prefetched into rank ``d``'s slots, ``-1``
      unused.
    * ``zero_fill_ranges`` ``[G, 2]``: this rank's ``(pad_start, n_pad)``
      per group.
    * ``remote_stats`` ``[2]``: ``[#remote experts with entries here,
      #slots on all ranks holding this rank's experts]``.
    * ``dup_groups`` ``[NvS, 3]``, ``dup_loffs`` ``[NvS]``, ``dup_counts``
      ``[2]``: for every source token with several entries on this rank,
      ``(primary_loff, dup_start, dup_count)`` (valid prefix
      ``dup_counts[0]`` rows) and the duplicates' rows (prefix
      ``dup_counts[1]``). Ordered by received row; MoonEP's order is arrival
      order, so compare as sets.
    * ``N = s*K`` (varlen meaning), ``R``, ``E``, ``NvS``, ``K``, ``B``,
      ``nvs_s``; ``num_tokens = N // K``.

    Reference extras: ``rank``; ``cu_seqlens`` ``[G]`` int32 (also returned by
    dispatch); ``global_plan`` (the :class:`DispatchPlan`, CPU);
    ``num_received`` (entries this rank computes); the routing tables.
    """

    dst: torch.Tensor
    experts_to_copy: torch.Tensor
    zero_fill_ranges: torch.Tensor
    remote_stats: torch.Tensor
    dup_groups: torch.Tensor
    dup_loffs: torch.Tensor
    dup_counts: torch.Tensor
    N: int
    R: int
    E: int
    NvS: int
    K: int
    B: int
    nvs_s: int
    rank: int
    cu_seqlens: torch.Tensor
    global_plan: DispatchPlan
    num_received: int
    routing: Routing
    buffer_uid: int

    @property
    def num_tokens(self) -> int:
        return self.N // self.K

    @property
    def slot_sources(self) -> list[tuple[int, int, int]]:
        """``(slot, expert, owner rank)`` of every used slot of this rank."""
        row = self.global_plan.experts_to_copy[self.rank].tolist()
        owners = self.global_plan.copy_owner[self.rank].tolist()
        return [(b, e, o) for b, (e, o) in enumerate(zip(row, owners)) if e >= 0]

    def clone(self) -> "CommPlan":
        fields = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            fields[f.name] = v.clone() if isinstance(v, (torch.Tensor, Routing)) else v
        return CommPlan(**fields)


@dataclasses.dataclass
class PrefetchStats:
    """What the last ``prefetch_weight`` call did on this rank, counted at the copies.

    The buffers build it with :meth:`of_fill`: the fields are then computed when first read, from the fill's
    copy of the slot table (one host read then, outside the MoE op: issue 45)."""

    api: str                 # "pull" or "push": the MoonEP API of the call
    copies: int              # row copies issued (used slots x tensors)
    bytes: int               # bytes copied
    seconds: Optional[float]  # wall time of the copies (None when left asynchronous on CUDA)
    slots: list[tuple[int, int, int]]  # (slot, expert, owner) filled on this rank (pull)
    #: Bytes per owner rank of the source row (``e // epn``): pull what each copy read; push what this
    #: rank (the owner) pushed.
    bytes_by_owner: dict[int, int] = dataclasses.field(default_factory=dict)
    #: The part of ``bytes`` that crossed ranks: pull read from rows another rank owns; push all of it
    #: (a rank pushes only into other ranks' slots).
    remote_bytes: int = 0
    #: Bytes by source expert (global id): pull read by this rank; push: pushed by this rank (its own experts).
    bytes_by_expert: dict[int, int] = dataclasses.field(default_factory=dict)
    #: push: bytes pushed per tensor name (weights and scales apart), counted at the copies.
    bytes_by_tensor: dict[str, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_copies(cls, api: str, copies: int, bytes_by_expert: dict[int, int], seconds: Optional[float],
                    slots: list[tuple[int, int, int]], epn: int, rank: int) -> "PrefetchStats":
        by_owner: dict[int, int] = {}
        for expert, nbytes in bytes_by_expert.items():
            by_owner[expert // epn] = by_owner.get(expert // epn, 0) + nbytes
        return cls(api, copies, sum(by_owner.values()), seconds, slots, by_owner,
                   sum(n for owner, n in by_owner.items() if owner != rank), dict(bytes_by_expert))

    @classmethod
    def of_fill(cls, fill: Any, seconds: Optional[float], epn: int, rank: int) -> "PrefetchStats":
        """The stats of a :class:`~.prefetch.SlotFill` (``fill.api``: ``"pull"`` or ``"push"``), counted when
        first read: pull as :meth:`from_copies`; push as counted at the owner, which pushes every byte into
        another rank's slot."""
        return _CountedOnRead(fill, seconds, epn, rank)


_COUNTED = tuple(f.name for f in dataclasses.fields(PrefetchStats) if f.name not in ("api", "seconds"))


class _CountedOnRead(PrefetchStats):
    """:class:`PrefetchStats` whose fields past ``api`` and ``seconds`` are counted when first read."""

    def __init__(self, fill: Any, seconds: Optional[float], epn: int, rank: int) -> None:  # noqa: D107
        self.api, self.seconds = fill.api, seconds
        self._pending = (fill, epn, rank)

    def __getattr__(self, name: str) -> Any:
        pending = self.__dict__.get("_pending")
        if name not in _COUNTED or pending is None:
            raise AttributeError(name)
        fill, epn, rank = pending
        table = fill.table()
        row = table[rank] if fill.api == "push" else table
        slots = [(b, int(e), int(e) // epn) for b, e in enumerate(row) if int(e) >= 0]
        if fill.api == "push":
            nbytes = fill.bytes
            counted = PrefetchStats("push", fill.copies, nbytes, self.seconds, slots,
                                    bytes_by_owner={rank: nbytes} if nbytes else {}, remote_bytes=nbytes,
                                    bytes_by_expert=fill.bytes_by_expert, bytes_by_tensor=fill.bytes_by_tensor)
        else:
            counted = PrefetchStats.from_copies("pull", fill.copies, fill.bytes_by_expert, self.seconds, slots,
                                                epn, rank)
        for field in _COUNTED:
            setattr(self, field, getattr(counted, field))
        del self._pending
        return getattr(self, name)

    def __reduce__(self) -> tuple:
        """Pickled as the plain stats (counted now): the fill's event stays in this process."""
        return PrefetchStats, tuple(getattr(self, f.name) for f in dataclasses.fields(PrefetchStats))
