"""Page-level plan of the sharded expert layout: pure arithmetic, no memory.

One pull view ``[E+B, out, in]`` of one (layer, projection) is laid out in
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

The push layout (MoonEP's release: ``[2*epn]`` compute rows, own experts
then the slots, and every rank's slots as ``[R, epn]``) needs each rank's own
rows to *end* on a page, so that its slot rows can follow them in one
uniform-stride view. :class:`PushRowsPlan` gives every rank a run of whole
pages per (layer, tensor); where ``epn * row_bytes`` is not a page multiple,
the first slot bytes go into the free tail of the run's last page (a per-layer
"slot head") and the rest into the pool shared by all layers. At any page
size this wastes less than one page per (layer, tensor) and rank, where
padding every row to make ``epn * row`` a page multiple could cost ``epn``
times more; where the rows fill whole pages it is the pull layout page for
page (``has_pull_view``).
"""

from __future__ import annotations

import dataclasses
import functools
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
        return self._per_rank[0].get(rank, 0)

    def data_bytes_in_pages_of(self, rank: int) -> int:
        """Data bytes (expert rows, any owner's) inside the pages ``rank`` allocates."""
        return self._per_rank[1].get(rank, 0)

    @functools.cached_property
    def _per_rank(self) -> tuple[dict[int, int], dict[int, int]]:
        """Pages and data bytes of every owner, in one pass (a model plans R x tensors of these)."""
        data_begin, data_end = self.lead_pad, self.lead_pad + self.num_experts * self.row_bytes
        pages: dict[int, int] = {}
        data: dict[int, int] = {}
        for j, owner in enumerate(self.page_owner):
            lo, hi = j * self.granularity, (j + 1) * self.granularity
            pages[owner] = pages.get(owner, 0) + 1
            data[owner] = data.get(owner, 0) + max(0, min(hi, data_end) - max(lo, data_begin))
        return pages, data


@functools.lru_cache(maxsize=512)  # pure, and the result is frozen: a model asks for the same region per rank
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


@dataclasses.dataclass(frozen=True)
class PushRowsPlan:
    """Pages of one (layer, tensor) in the push layout: the same for every rank.

    Each rank allocates ``own_pages`` pages per layer holding its ``epn`` rows,
    data first; the free tail of the last page (``head_bytes`` of it) holds the
    first slot bytes of that layer, and the pool shared by all layers the rest
    (``pool_bytes``, page-rounded, possibly 0). In virtual memory::

        compute view [2*epn]:  | own pages (rows 0..epn-1, slot head) | pool rest |
        pool view [R, epn]:    per rank: | last own page | pool rest |, rows from ``pool_offset``
    """

    experts_per_rank: int
    num_slots: int
    row_bytes: int
    granularity: int
    lead_pad: int = 0   # the pull plan's field: push runs start on a page

    @property
    def own_bytes(self) -> int:
        return self.experts_per_rank * self.row_bytes

    @property
    def own_pages(self) -> int:
        return -(-self.own_bytes // self.granularity)

    @property
    def boundary(self) -> bool:
        """Whether the own rows end inside a page (then that page also holds the slot head)."""
        return self.own_bytes % self.granularity != 0

    @property
    def head_bytes(self) -> int:
        """Slot bytes held in the last own page of each layer (0 when the own rows fill whole pages)."""
        return min(self.own_pages * self.granularity - self.own_bytes, self.num_slots * self.row_bytes)

    @property
    def pool_bytes(self) -> int:
        """Physical bytes of the slot pool shared by all layers: the slot bytes past the head, page-rounded."""
        return slot_pool_bytes(1, self.num_slots * self.row_bytes - self.head_bytes, self.granularity)

    @property
    def pool_offset(self) -> int:
        """Where the slot rows start in each rank's pool-view segment (its last own page, then its pool)."""
        return self.own_bytes % self.granularity

    @property
    def pool_rank_stride(self) -> int:
        return (self.granularity if self.boundary else 0) + self.pool_bytes

    @property
    def has_pull_view(self) -> bool:
        """The rows fill whole pages: this is also the pull layout, page for page (an ``[E+B]`` view exists)."""
        return not self.boundary

    def pages_of(self, rank: int) -> int:
        return self.own_pages

    def data_bytes_in_pages_of(self, rank: int) -> int:
        """Own rows only: slot bytes (the head included) count once per pool, as in the pull layout."""
        return self.own_bytes


def check_push_slots(rank: int | None, num_slots: int, experts_per_rank: int) -> None:
    """The push API's slot count: every rank's pool holds ``E/R`` rows (MoonEP's release)."""
    if num_slots != experts_per_rank:
        raise config_error(rank, "the push layout needs num_slots == E/R", (num_slots, experts_per_rank),
                           "use E//R slots for the push API (MoonEP's release fixes it), or the pull API")


def plan_tensor(api: str, num_experts: int, ep_size: int, num_slots: int, row_bytes: int,
                granularity: int) -> tuple[ExpertRegionPlan | PushRowsPlan, int]:
    """One (layer, tensor)'s page plan and its slot pool's bytes, in the ``pull`` or ``push`` layout."""
    if api == "push":
        plan = PushRowsPlan(num_experts // ep_size, num_slots, row_bytes, granularity)
        plan_expert_region(num_experts, ep_size, row_bytes, granularity)  # the same input checks as pull
        return plan, plan.pool_bytes
    if api != "pull":
        raise config_error(None, "the layout must be pull or push", api, "pass api='pull' or api='push'")
    return (plan_expert_region(num_experts, ep_size, row_bytes, granularity),
            slot_pool_bytes(num_slots, row_bytes, granularity))


def slot_pool_bytes(num_slots: int, row_bytes: int, granularity: int) -> int:
    """Physical bytes of one projection's slot pool: ``B`` rows rounded up to a page."""
    return -(-num_slots * row_bytes // granularity) * granularity


def predict_rank_bytes(*, num_layers: int, num_experts: int, ep_size: int, num_slots: int,
                       row_bytes: Sequence[int], granularity: int, rank: int = 0,
                       slot_pools: int = 1, roles: Sequence[str] | None = None,
                       api: str = "pull") -> dict[str, int]:
    """Physical bytes one rank allocates for a whole model's routed experts.

    ``row_bytes`` has one entry per per-expert tensor (BF16: gate ``I*H*2``,
    up, down; quantized: each weight and each scale tensor, see
    ``formats.expert_projections``), ``roles`` the matching ``"weight"`` /
    ``"scale"`` (default: all weights). Returns ``expert_bytes`` (pages of
    expert regions this rank allocates, all layers and tensors),
    ``slot_bytes`` (its slot pool(s), shared by all layers), ``padding_bytes``
    (bytes inside those allocations that hold no data), ``total_bytes``, and
    the same total split by role, ``weight_bytes`` and ``scale_bytes`` (each
    tensor's pages are its own, so the split is exact). ``api`` picks the
    pull or the push layout (:class:`PushRowsPlan`; ``num_slots`` must be
    ``E/R`` there, :func:`check_push_slots`).
    """
    roles = list(roles) if roles is not None else ["weight"] * len(row_bytes)
    if len(roles) != len(row_bytes):
        raise config_error(None, "roles must match row_bytes one to one", (len(roles), len(row_bytes)),
                           "pass one role per tensor")
    if api == "push":
        check_push_slots(None, num_slots, num_experts // max(1, ep_size))
    expert_bytes = slot_bytes = padding = 0
    by_role = {"weight": 0, "scale": 0}
    for rb, role in zip(row_bytes, roles):
        region, pool = plan_tensor(api, num_experts, ep_size, num_slots, rb, granularity)
        pages = region.pages_of(rank)
        expert_bytes += num_layers * pages * granularity
        padding += num_layers * (pages * granularity - region.data_bytes_in_pages_of(rank))
        slot_bytes += slot_pools * pool
        padding += slot_pools * (pool - num_slots * rb)
        by_role[role] += num_layers * pages * granularity + slot_pools * pool
    return {"expert_bytes": expert_bytes, "slot_bytes": slot_bytes,
            "padding_bytes": padding, "total_bytes": expert_bytes + slot_bytes,
            "weight_bytes": by_role["weight"], "scale_bytes": by_role["scale"]}
