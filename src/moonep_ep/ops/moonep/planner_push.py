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
:func:`plan_push_dispatch` runs the pull planner's pipeline
(:func:`~moonep_ep.ops.moonep.planner.build_plan`) once, with this generation's
slot choice and group order; :func:`~moonep_ep.ops.moonep.planner.entry_dst`
works on its result unchanged (it reads ``expert_off``, the cumulative tables
and ``NvS``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from ...errors import config_error
from .limits import DispatchShape, check_shape
from .planner import DispatchPlan, build_plan, check_counts

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
        assert self.B == self.epn, (self.B, self.epn)
        super().__post_init__()


def _slots_by_id(remote: list[int], alloc: list[list[int]], d: int, B: int) -> list[int]:
    """Every remote expert with entries on ``d`` takes a slot, in ascending id (``remote``'s order)."""
    assert len(remote) <= B, (d, remote)  # B = epn, and one donor group per receiver (§4.4)
    return remote


def _own_experts_then_slots(d: int, slot_row: list[int], shape: DispatchShape) -> list[int]:
    """``2*epn`` groups: ``d``'s own experts, then its slots (``-1`` = unused)."""
    return list(range(d * shape.epn, (d + 1) * shape.epn)) + slot_row


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
    except (TypeError, ValueError):  # not a table of integers: check_counts names what is wrong
        entries = []
    for r, n in enumerate(entries):
        if n != shape.N:
            raise config_error(rank, f"the push generation routes exactly S*K = {shape.S}*{shape.K} = {shape.N} "
                               f"entries per rank; rank {r} routes {n}", n,
                               f"pad every batch to the capacity S={shape.S} (dummy tokens with route weight 0)")
    T, num_tokens = check_counts(rank, tokens_per_expert, shape, None)
    # Every rank routes S tokens, so a call may fill the whole shard: nvs_s = NvS.
    nvs_s = push_nvs_rows(shape.S, shape.K, shape.E, shape.R, shape.token_padding)
    return build_plan(PushDispatchPlan, shape, T, num_tokens, nvs_s, _slots_by_id, _own_experts_then_slots)
