"""Page-level plan of the sharded expert layout: pure arithmetic, no memory.

One Gen A view ``[E+B, out, in]`` of one (layer, projection) is laid out in
virtual memory as::

    reservation:  | lead pad | E expert rows (owners 0..R-1, in order) | B slot rows | tail pad |
                  ^ page 0                                            ^ page boundary
    tensor base = reservation + lead_pad,  lead_pad = (-E*row_bytes) mod gran

The lead pad makes the expert region *end* on a page boundary, so the slot
pool (one physical allocation per rank, shared by every layer) always starts
on a page. The expert region is cut into ``gran`` pages; each page is
physically allocated by exactly one rank, the owner of the first data byte in
that page. A page that straddles two owners' rows is allocated by the earlier
owner and written by both through the mapping. Hence:

* the view is one exact, contiguous tensor for any shape;
* the whole expert region of one (layer, projection) wastes at most the lead
  pad (< one page) across all ranks, and each slot pool at most its tail pad
  (< one page);
* every expert row lives in exactly one physical page set, so row ``e`` of
  every rank's view reads the same bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from ..errors import config_error


@dataclasses.dataclass(frozen=True)
class ExpertRegionPlan:
    """Pages of the expert region ``[0, E)`` of one (layer, projection) view.

    ``page_owner[j]`` is the rank that allocates page ``j``; pages owned by
    one rank are consecutive, so each owner contributes one contiguous run
    ``[first_page[r], first_page[r] + num_pages[r])`` (possibly empty).
    """

    num_experts: int
    ep_size: int
    row_bytes: int
    granularity: int
    lead_pad: int
    page_owner: tuple[int, ...]

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def num_pages(self) -> int:
        return len(self.page_owner)

    @property
    def region_bytes(self) -> int:
        """Bytes of virtual memory of the expert region, lead pad included."""
        return self.num_pages * self.granularity

    def first_page(self, rank: int) -> int:
        for j, owner in enumerate(self.page_owner):
            if owner >= rank:
                return j
        return self.num_pages

    def pages_of(self, rank: int) -> int:
        return sum(1 for owner in self.page_owner if owner == rank)

    def data_bytes_in_pages_of(self, rank: int) -> int:
        """Data bytes (expert rows, any owner's) inside the pages ``rank`` allocates."""
        data_begin, data_end = self.lead_pad, self.lead_pad + self.num_experts * self.row_bytes
        total = 0
        for j, owner in enumerate(self.page_owner):
            if owner == rank:
                lo, hi = j * self.granularity, (j + 1) * self.granularity
                total += max(0, min(hi, data_end) - max(lo, data_begin))
        return total


def plan_expert_region(num_experts: int, ep_size: int, row_bytes: int,
                       granularity: int) -> ExpertRegionPlan:
    """Assign each page of one ``[E, out, in]`` expert region to an owner rank."""
    if ep_size <= 0 or num_experts % ep_size != 0:
        raise config_error(None, "num_experts must be a multiple of ep_size",
                           (num_experts, ep_size),
                           "choose an EP size that divides the number of routed experts")
    if row_bytes <= 0 or granularity <= 0:
        raise config_error(None, "row_bytes and granularity must be positive",
                           (row_bytes, granularity), "pass the real expert shape and driver granularity")
    epn = num_experts // ep_size
    data = num_experts * row_bytes
    lead_pad = (-data) % granularity
    num_pages = (lead_pad + data) // granularity
    owners = []
    for j in range(num_pages):
        first_data_byte = max(j * granularity, lead_pad) - lead_pad
        owners.append((first_data_byte // row_bytes) // epn)
    return ExpertRegionPlan(num_experts, ep_size, row_bytes, granularity, lead_pad, tuple(owners))


def slot_pool_bytes(num_slots: int, row_bytes: int, granularity: int) -> int:
    """Physical bytes of one projection's slot pool: ``B`` rows rounded up to a page."""
    return -(-num_slots * row_bytes // granularity) * granularity


def predict_rank_bytes(*, num_layers: int, num_experts: int, ep_size: int, num_slots: int,
                       row_bytes: Sequence[int], granularity: int, rank: int = 0,
                       slot_pools: int = 1, roles: Sequence[str] | None = None) -> dict[str, int]:
    """Physical bytes one rank allocates for a whole model's routed experts.

    ``row_bytes`` has one entry per per-expert tensor (BF16: gate ``I*H*2``,
    up, down; quantized: each weight and each scale tensor, see
    ``formats.expert_projections``), ``roles`` the matching ``"weight"`` /
    ``"scale"`` (default: all weights). Returns ``expert_bytes`` (pages of
    expert regions this rank allocates, all layers and tensors),
    ``slot_bytes`` (its slot pool(s), shared by all layers), ``padding_bytes``
    (bytes inside those allocations that hold no data), ``total_bytes``, and
    the same total split by role, ``weight_bytes`` and ``scale_bytes`` (each
    tensor's pages are its own, so the split is exact).
    """
    roles = list(roles) if roles is not None else ["weight"] * len(row_bytes)
    if len(roles) != len(row_bytes):
        raise config_error(None, "roles must match row_bytes one to one", (len(roles), len(row_bytes)),
                           "pass one role per tensor")
    expert_bytes = slot_bytes = padding = 0
    by_role = {"weight": 0, "scale": 0}
    for rb, role in zip(row_bytes, roles):
        region = plan_expert_region(num_experts, ep_size, rb, granularity)
        pages = region.pages_of(rank)
        expert_bytes += num_layers * pages * granularity
        padding += num_layers * (pages * granularity - region.data_bytes_in_pages_of(rank))
        pool = slot_pool_bytes(num_slots, rb, granularity)
        slot_bytes += slot_pools * pool
        padding += slot_pools * (pool - num_slots * rb)
        by_role[role] += num_layers * pages * granularity + slot_pools * pool
    return {"expert_bytes": expert_bytes, "slot_bytes": slot_bytes,
            "padding_bytes": padding, "total_bytes": expert_bytes + slot_bytes,
            "weight_bytes": by_role["weight"], "scale_bytes": by_role["scale"]}
