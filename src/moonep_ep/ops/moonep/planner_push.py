"""MoonEP's dispatch plan in the push generation (``[2*epn]`` groups, slots = ``epn``) as a pure function.

The release (26/09) plans exactly as the pull generation does up to
``alloc[e][d]`` (moonep.md §4.1–4.4: the same balancing, the same first-index
tie-breaking), because every rank routes exactly ``S*K`` entries, so its
per-rank capacity ``S*K`` equals the pull planner's ``total // R``. It then lays
each destination out differently (its planning reference,
``tests/planning_reference.py`` of the release):

* **slots**: every remote expert with entries on ``d`` gets a slot (at most
  ``epn`` of them, §4.4), in **ascending expert id**; the pull generation orders
  them by count, ties to the larger id, and keeps the first ``B``;
* **groups**: ``2*epn`` per rank, group ``g < epn`` is the rank's own expert
  ``d*epn + g``, group ``epn + b`` is slot ``b``; the pull generation has ``E+B``
  groups (every expert by global id, empty when not computed there, then the
  slots);
* **NvS**: ``S*K + (tp-1)*2*epn`` rounded up to a multiple of ``tp`` (the pull
  generation does not round).

So an entry goes to the same destination rank in both generations and a
slotted expert's rows keep their order; only the offset of each group inside
the shard can differ (when a rank holds two or more slots).
:func:`plan_push_dispatch` reuses the pull planner for ``alloc`` and the entry
routes and rebuilds the per-destination tables; :func:`~moonep_ep.ops.moonep.planner.entry_dst`
works on its result unchanged (it reads ``expert_off``, the cumulative tables
and ``NvS``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from ...errors import config_error
from .limits import check_shape
from .planner import DispatchPlan, plan_dispatch

__all__ = ["PushDispatchPlan", "plan_push_dispatch", "push_nvs_rows"]


def push_nvs_rows(S: int, K: int, E: int, R: int, token_padding: int) -> int:
    """The push generation's ``NvS``: ``S*K + (tp-1)*2*epn`` rounded up to a multiple of ``tp``
    (the release rounds so that tiled kernels see a fixed, tile-aligned shape)."""
    rows = S * K + (token_padding - 1) * 2 * (E // R)
    return -(-rows // token_padding) * token_padding


@dataclasses.dataclass(frozen=True, eq=False)
class PushDispatchPlan(DispatchPlan):
    """A :class:`DispatchPlan` of the push generation: ``B = epn``; ``experts_to_copy`` and
    ``copy_owner`` ``[R, epn]`` (ascending expert ids, ``-1`` unused); ``cu_seqlens`` and
    ``zero_fill_ranges`` over ``2*epn`` groups (own experts, then slots); ``NvS`` rounded up to
    ``token_padding``; ``nvs_s = NvS`` (every rank routes ``S`` tokens, so a call may fill it)."""

    @property
    def NvS(self) -> int:  # noqa: N802 - MoonEP's name
        return push_nvs_rows(self.S, self.K, self.E, self.R, self.token_padding)

    @property
    def num_groups(self) -> int:
        return 2 * self.epn

    def __post_init__(self) -> None:
        R, E, G, epn = self.R, self.E, 2 * self.epn, self.epn
        shapes = {"tokens_per_expert": (R, E), "num_tokens": (R,), "tpe_cumsum": (R, E), "cap": (R,), "z": (R, R),
                  "alloc": (E, R), "alloc_cumsum": (E, R), "experts_to_copy": (R, epn), "copy_owner": (R, epn),
                  "remote_stats": (R, 2), "cu_seqlens": (R, G), "zero_fill_ranges": (R, G, 2), "expert_off": (R, E),
                  "route_count": (R, E, R), "route_row": (R, E, R)}
        assert self.B == epn, (self.B, epn)
        for name, shape in shapes.items():
            t = getattr(self, name)
            assert isinstance(t, torch.Tensor) and tuple(t.shape) == shape, (name, getattr(t, "shape", None), shape)
            assert t.dtype == torch.int32 and t.is_contiguous(), name


def plan_push_dispatch(tokens_per_expert: Any, *, S: int, K: int, E: int, R: int, token_padding: int = 128,
                       rank: Optional[int] = None) -> PushDispatchPlan:
    """Plan one push-generation dispatch from every rank's ``[R, E]`` expert counts.

    Every row must sum to exactly ``S*K`` (the release asserts ``S*K`` routed
    entries per call); otherwise :class:`~moonep_ep.errors.ConfigError` names
    the rank and the fix (pad the batch to the capacity). Identical inputs give
    an identical plan on every rank.
    """
    shape = check_shape(rank, S=S, K=K, E=E, R=R, B=None, token_padding=token_padding)
    rows = tokens_per_expert.tolist() if isinstance(tokens_per_expert, torch.Tensor) else tokens_per_expert
    try:
        entries = [int(sum(int(v) for v in row)) for row in rows]
    except (TypeError, ValueError):  # not a table of integers: plan_dispatch names what is wrong
        entries = []
    for r, n in enumerate(entries):
        if n != shape.N:
            raise config_error(rank, f"the push generation routes exactly S*K = {shape.S}*{shape.K} = {shape.N} "
                               f"entries per rank; rank {r} routes {n}", n,
                               f"pad every batch to the capacity S={shape.S} (dummy tokens with route weight 0)")
    base = plan_dispatch(tokens_per_expert, S=S, K=K, E=E, R=R, B=None, token_padding=token_padding,
                         total_num_tokens=None, rank=rank)
    epn, tp = base.epn, base.token_padding
    alloc = base.alloc.to(torch.int64)
    experts_to_copy = torch.full((R, epn), -1, dtype=torch.int64)
    remote_stats = torch.zeros(R, 2, dtype=torch.int64)
    cu_seqlens = torch.zeros(R, 2 * epn, dtype=torch.int64)
    zero_fill = torch.zeros(R, 2 * epn, 2, dtype=torch.int64)
    expert_off = torch.full((R, E), -1, dtype=torch.int64)
    for d in range(R):
        remote = [e for e in range(E) if alloc[e, d] > 0 and e // epn != d]  # ascending id
        assert len(remote) <= epn, (d, remote)  # one donor group per receiver (§4.4)
        experts_to_copy[d, :len(remote)] = torch.tensor(remote, dtype=torch.int64)
        remote_stats[d, 0] = len(remote)
        for e in remote:
            remote_stats[e // epn, 1] += 1
        start = 0
        for g, e in enumerate(list(range(d * epn, (d + 1) * epn)) + experts_to_copy[d].tolist()):
            count = int(alloc[e, d]) if e >= 0 else 0
            padded = -(-count // tp) * tp
            if count:
                expert_off[d, e] = start
                if padded > count:
                    zero_fill[d, g] = torch.tensor([start + count, padded - count])
            start += padded
            cu_seqlens[d, g] = start
    # The same entries move (route_count); each lands at the same position inside its expert's run on d,
    # so only the run's start changes: route_row - old start + new start.
    moved = base.route_count > 0
    old_off = base.expert_off.to(torch.int64).t()[None]   # [1, E, R]: expert_off[d][e]
    new_off = expert_off.t()[None]
    route_row = torch.where(moved, base.route_row.to(torch.int64) - old_off + new_off, torch.full_like(old_off, -1))

    def i32(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.int32).contiguous()

    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    fields.update(experts_to_copy=i32(experts_to_copy),
                  copy_owner=i32(torch.where(experts_to_copy >= 0, experts_to_copy // epn, -1)),
                  remote_stats=i32(remote_stats), cu_seqlens=i32(cu_seqlens), zero_fill_ranges=i32(zero_fill),
                  expert_off=i32(expert_off), route_row=i32(route_row),
                  nvs_s=push_nvs_rows(base.S, base.K, base.E, base.R, tp))
    return PushDispatchPlan(**fields)
