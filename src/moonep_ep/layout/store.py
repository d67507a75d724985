"""The model-wide sharded expert-weight store over symmetric memory.

Physical memory per rank (two chunks, all handles exchanged in one round)::

    chunk "experts":  for every (layer l, projection p), in that order, the run
                      of pages of the (l, p) expert region this rank allocates
                      (see plan.py: pages straddling two owners belong to the
                      earlier one); size ≈ L · epn · Σ_p row_bytes(p)
    chunk "slots":    for every pool k (1, or 2 for double buffering) and
                      projection p: B slot rows, rounded up to one page

Virtual views on every rank, for layer l and projection p (pool k = l mod pools).
The pull layout (``api="pull"``, the API vLLM 0.33.0 calls; upstream's "Gen A")::

    pull view [E+B, out, in]  ─ one reservation:
      | lead pad | owner0 pages | owner1 pages | … | ownerR-1 pages | own slot pool k,p | tail |
                 ^ tensor base                                      ^ row E, page-aligned
    owner view [epn, out, in]      = pull rows [rank·epn, (rank+1)·epn)

The push layout (``api="push"``, MoonEP's release, upstream's "Gen B"; B = epn):
every rank's own rows of (l, p) are a run of whole pages of its own
(``plan.PushRowsPlan``), whose last page's free tail holds the first slot
bytes of that layer, the shared pool the rest::

    push view [2·epn, out, in]     = own run (own rows, slot head) then own pool rest
    push pool [R, epn, out, in]    = per rank: its last own page and its pool rest,
                                     rows from ``pool_offset``, rank stride = that segment
    owner view / slots             = push view rows [0, epn) / [epn, 2·epn)

Where the own rows fill whole pages the two layouts are the same pages, and
the push store also hands out the pull view. Every layer's view maps the
*same* slot pool (in the push layout: the same pool rest; the slot head is
per layer): one physical pool per tensor serves the whole model (MoonEP runs
one MoE layer at a time). Rows of expert ``e`` are physically in exactly one
place, so row ``e`` of every rank's view is the owner's data.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Mapping, Sequence

import torch

from ..errors import ConfigError, config_error
from ..memory.driver import MemoryDriver
from ..memory.group import GroupComm
from ..memory.symmetric import Segment, SymmetricMemory, VirtualRange
from .plan import ExpertRegionPlan, PushRowsPlan, check_push_slots, plan_tensor

PULL, PUSH = "pull", "push"

EXPERTS_CHUNK, SLOTS_CHUNK = 0, 1


@dataclasses.dataclass(frozen=True)
class ProjectionSpec:
    """One per-expert weight tensor: ``name``, ``shape`` ``(out, in)`` and dtype.

    MoE FFN experts have ``gate [I, H]``, ``up [I, H]``, ``down [H, I]``.
    Quantized weights add entries of their own (a scale tensor per
    projection, ``formats.expert_projections``) with their dtype and shape;
    the layout treats each alike: one region per tensor, page-aligned in each
    owner's shard, the same row index (expert id, then slot id) for all.
    ``role`` is ``"weight"`` or ``"scale"`` (accounting counts them apart);
    ``projection`` names the projection a tensor belongs to (default: ``name``).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.bfloat16
    role: str = "weight"
    projection: str = ""

    def __post_init__(self) -> None:
        if self.role not in ("weight", "scale"):
            raise ConfigError(f"projection {self.name!r}: role must be 'weight' or 'scale': got {self.role!r}. "
                              "Fix: mark scale tensors role='scale'")
        if not self.projection:
            object.__setattr__(self, "projection", self.name)

    @property
    def row_bytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * torch.empty((), dtype=self.dtype).element_size()


#: An expert FFN's three weights by MoonEP's names (its ``{gate,up,down}`` keywords): vLLM's w13 split, and w2.
FFN_PROJECTIONS = ("gate", "up", "down")


def ffn_projections(hidden: int, intermediate: int, dtype: torch.dtype = torch.bfloat16) -> list[ProjectionSpec]:
    """gate ``[I, H]``, up ``[I, H]``, down ``[H, I]`` — vLLM's w13 split in two, and w2."""
    gate, up, down = FFN_PROJECTIONS
    return [ProjectionSpec(gate, (intermediate, hidden), dtype),
            ProjectionSpec(up, (intermediate, hidden), dtype),
            ProjectionSpec(down, (hidden, intermediate), dtype)]


@dataclasses.dataclass
class LoadStats:
    """What one rank's loading did (for instrumentation and progress)."""

    experts_requested: list[int] = dataclasses.field(default_factory=list)
    bytes_written: int = 0
    max_transient_bytes: int = 0
    seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class StorePlan:
    """Every page decision of a store, for every rank: what :class:`ShardedExpertStore` allocates and maps
    and what ``footprint`` counts (:func:`plan_store`; arithmetic, no memory)."""

    api: str
    granularity: int
    num_layers: int
    num_slots: int
    slot_pools: int
    projections: tuple[ProjectionSpec, ...]
    plans: Mapping[str, ExpertRegionPlan | PushRowsPlan]
    pool_bytes: Mapping[str, int]
    #: per rank: (layer, tensor) -> offset of its run in that rank's experts chunk
    expert_offsets: tuple[Mapping[tuple[int, str], int], ...]
    expert_chunk_bytes: tuple[int, ...]
    slot_offsets: Mapping[tuple[int, str], int]
    slot_chunk_bytes: int

    def rank_bytes(self, rank: int) -> dict[str, int]:
        """What ``rank`` allocates, as ``physical_bytes`` reports it (data: own rows of every layer, B slot
        rows per pool)."""
        by_role = {"weight": 0, "scale": 0}
        data = 0
        for p in self.projections:
            plan = self.plans[p.name]
            by_role[p.role] += (self.num_layers * plan.pages_of(rank) * self.granularity
                                + self.slot_pools * self.pool_bytes[p.name])
            data += (self.num_layers * plan.data_bytes_in_pages_of(rank)
                     + self.slot_pools * self.num_slots * p.row_bytes)
        total = self.expert_chunk_bytes[rank] + self.slot_chunk_bytes
        return {"expert_bytes": self.expert_chunk_bytes[rank], "slot_bytes": self.slot_chunk_bytes,
                "padding_bytes": total - data, "total_bytes": total,
                "weight_bytes": by_role["weight"], "scale_bytes": by_role["scale"]}

    # -- what each view maps (the store maps exactly these; check_views checks them without memory) --------
    def has_pull_view(self, name: str) -> bool:
        plan = self.plans[name]
        return not isinstance(plan, PushRowsPlan) or plan.has_pull_view

    def pull_segments(self, rank: int, layer: int, name: str) -> list[Segment]:
        """``rank``'s ``[E+B]`` view: every owner's run of (layer, name), then ``rank``'s slot pool."""
        plan, gran = self.plans[name], self.granularity
        segs = [Segment(o, EXPERTS_CHUNK, self.expert_offsets[o][(layer, name)], plan.pages_of(o) * gran)
                for o in range(len(self.expert_offsets)) if plan.pages_of(o)]
        segs.append(Segment(rank, SLOTS_CHUNK, self.slot_offsets[(layer % self.slot_pools, name)],
                            self.pool_bytes[name]))
        return segs

    def push_segments(self, owner: int, layer: int, name: str, whole_run: bool) -> list[Segment]:
        """``owner``'s run of (layer, name), whole (its push view) or only its last page when that holds a slot
        head (its part of the push pool), then its slot pool rest."""
        plan, gran = self.plans[name], self.granularity
        assert isinstance(plan, PushRowsPlan)
        run = self.expert_offsets[owner][(layer, name)]
        segs = []
        if whole_run:
            segs.append(Segment(owner, EXPERTS_CHUNK, run, plan.own_pages * gran))
        elif plan.boundary:
            segs.append(Segment(owner, EXPERTS_CHUNK, run + (plan.own_pages - 1) * gran, gran))
        if plan.pool_bytes:
            segs.append(Segment(owner, SLOTS_CHUNK, self.slot_offsets[(layer % self.slot_pools, name)],
                                plan.pool_bytes))
        return segs

    def check_views(self, rank: int, layer: int = 0) -> None:
        """Every view ``rank`` maps for ``layer``, checked as the driver and the tensor wrap would: segments on
        pages inside their chunk, each view's bytes inside its range. Raises :class:`ConfigError`."""
        R, chunk = len(self.expert_offsets), lambda o, c: (self.expert_chunk_bytes[o], self.slot_chunk_bytes)[c]
        for p in self.projections:
            ranges = []
            if self.api == PUSH:
                plan = self.plans[p.name]
                assert isinstance(plan, PushRowsPlan)
                epn = plan.experts_per_rank
                ranges.append(("push view", self.push_segments(rank, layer, p.name, True), 0, 2 * epn * p.row_bytes))
                pool = [s for o in range(R) for s in self.push_segments(o, layer, p.name, False)]
                ranges.append(("push pool", pool, plan.pool_offset,
                               (R - 1) * plan.pool_rank_stride + epn * p.row_bytes))
            if self.has_pull_view(p.name):
                rows = self.num_slots + len(self.expert_offsets) * self.plans[p.name].experts_per_rank
                ranges.append(("pull view", self.pull_segments(rank, layer, p.name), self.plans[p.name].lead_pad,
                               rows * p.row_bytes))
            for what, segs, start, nbytes in ranges:
                bad = [s for s in segs if s.offset % self.granularity or s.nbytes % self.granularity
                       or s.nbytes <= 0 or s.offset + s.nbytes > chunk(s.owner, s.chunk)]
                size = sum(s.nbytes for s in segs)
                if bad or start + nbytes > size:
                    raise config_error(rank, f"the {what} of {p.name!r} does not map", (bad, start + nbytes, size),
                                       "report this layout bug with the model's shape and the page size")


def check_store_args(rank: int | None, *, num_layers: int, num_experts: int, ep_size: int,
                     projections: Sequence[ProjectionSpec], num_slots: int, slot_pools: int, api: str) -> None:
    """The store's refusals (the same text wherever they are decided: the store, ``footprint``)."""
    E, R = num_experts, ep_size
    if num_layers <= 0:
        raise config_error(rank, "num_layers must be positive", num_layers, "pass the MoE layer count")
    if E <= 0 or R <= 0 or E % R:
        raise config_error(rank, "num_experts must be a positive multiple of the EP size", (E, R),
                           "choose an EP size that divides the number of routed experts")
    if not projections or len({p.name for p in projections}) != len(projections):
        raise config_error(rank, "projection names must be unique and non-empty",
                           [p.name for p in projections], "name each per-expert tensor once")
    if not 0 < num_slots <= E:
        raise config_error(rank, "num_slots (B) must be in [1, E]", num_slots, "use MoonEP's B (default E/R)")
    if slot_pools not in (1, 2):
        raise config_error(rank, "slot_pools must be 1 or 2", slot_pools, "use 2 only for double-buffered prefetch")
    if api not in (PULL, PUSH):
        raise config_error(rank, "the store's API must be pull or push", api, "pass api='pull' or 'push'")
    if api == PUSH:
        check_push_slots(rank, num_slots, E // R)


def plan_store(*, num_layers: int, num_experts: int, ep_size: int, projections: Sequence[ProjectionSpec],
               num_slots: int, granularity: int, slot_pools: int = 1, api: str = PULL,
               rank: int | None = None) -> StorePlan:
    """Every rank's chunks, runs and pools of a store (see the module docstring); refuses as the store does."""
    projections = tuple(projections)
    check_store_args(rank, num_layers=num_layers, num_experts=num_experts, ep_size=ep_size,
                     projections=projections, num_slots=num_slots, slot_pools=slot_pools, api=api)
    gran = granularity
    plans: dict[str, ExpertRegionPlan | PushRowsPlan] = {}
    pool_bytes: dict[str, int] = {}
    for p in projections:
        plans[p.name], pool_bytes[p.name] = plan_tensor(api, num_experts, ep_size, num_slots, p.row_bytes, gran)
    expert_offsets, expert_chunk_bytes = [], []
    for r in range(ep_size):
        cursor, offs = 0, {}
        for layer in range(num_layers):
            for p in projections:
                offs[(layer, p.name)] = cursor
                cursor += plans[p.name].pages_of(r) * gran
        expert_offsets.append(offs)
        expert_chunk_bytes.append(cursor)
    slot_offsets, cursor = {}, 0
    for k in range(slot_pools):
        for p in projections:
            slot_offsets[(k, p.name)] = cursor
            cursor += pool_bytes[p.name]
    return StorePlan(api, gran, num_layers, num_slots, slot_pools, projections, plans, pool_bytes,
                     tuple(expert_offsets), tuple(expert_chunk_bytes), slot_offsets, cursor)


class ShardedExpertStore:
    """Sharded routed-expert weights of a whole model, with zero-copy views on every rank.

    Collective: construct on every rank of the EP group with identical
    arguments. ``num_slots`` (B) rows per projection form one slot pool shared
    by all layers (``slot_pools=2`` keeps two, used by alternating layers).
    """

    def __init__(self, *, num_layers: int, num_experts: int, projections: Sequence[ProjectionSpec],
                 num_slots: int, driver: MemoryDriver, group: Any = None, slot_pools: int = 1,
                 api: str = PULL, timeout_s: float | None = None):
        self.driver = driver
        #: The MoonEP API whose layout this store holds: ``pull`` ([E+B] views) or ``push`` ([2*epn], [R, epn]).
        self.api = api
        self.num_layers, self.num_experts = num_layers, num_experts
        self.projections = list(projections)
        self.num_slots, self.slot_pools = num_slots, slot_pools
        self._views: dict[tuple[str, int, str], torch.Tensor] = {}
        self._ranges: list[VirtualRange] = []
        self.load_stats = LoadStats()
        t0 = time.perf_counter()
        comm = GroupComm(group, timeout_s)
        self.rank, self.world_size = comm.rank, comm.world_size
        with comm.step("validate expert layout") as layout:
            self._validate()
            layout.share(self._description())
        self._check_same_everywhere(layout.gathered)
        with comm.step("plan expert pages"):
            # No handle type: the page size valid for whichever type the group votes next
            # (CUDA's granularity depends on it; the vote happens inside allocate()).
            self.granularity = gran = driver.granularity(None)
            self.plan = plan_store(num_layers=num_layers, num_experts=num_experts, ep_size=self.world_size,
                                   projections=self.projections, num_slots=num_slots, granularity=gran,
                                   slot_pools=slot_pools, api=api, rank=self.rank)
            self.plan.check_views(self.rank)  # a layout that cannot map is refused here, on every rank
            self.plans, self.pool_bytes = self.plan.plans, self.plan.pool_bytes
            self.expert_offsets, self.slot_offsets = self.plan.expert_offsets, self.plan.slot_offsets
        self.symm = SymmetricMemory.allocate([self.plan.expert_chunk_bytes[self.rank], self.plan.slot_chunk_bytes],
                                             driver=driver, tags=["experts", "slots"], comm=comm)
        t_map = time.perf_counter()
        self.allocate_seconds = t_map - t0
        try:
            with comm.step("map expert views"):
                for layer in range(num_layers):
                    for p in self.projections:
                        if api == PUSH:
                            self._map_push(layer, p)
                        if self.has_pull_view(p.name):
                            self._map_pull(layer, p)
            self.mapping_seconds = time.perf_counter() - t_map
            self.symm.release_imports()  # mappings keep peers' memory alive
            if driver.device_type != "cpu":
                self._zero_own()  # cuMemCreate memory is not zero-filled
        except BaseException:
            self.close()
            raise
        self.map_seconds = time.perf_counter() - t0

    # -- construction helpers ----------------------------------------------------------
    def _validate(self) -> None:
        check_store_args(self.rank, num_layers=self.num_layers, num_experts=self.num_experts,
                         ep_size=self.world_size, projections=self.projections, num_slots=self.num_slots,
                         slot_pools=self.slot_pools, api=self.api)

    def _description(self) -> tuple:
        return (self.num_layers, self.num_experts, self.num_slots, self.slot_pools, self.api,
                [(p.name, p.shape, str(p.dtype)) for p in self.projections])

    def _check_same_everywhere(self, everyone: list[tuple]) -> None:
        """Every rank sees the same list, so every rank raises (or not) alike."""
        differing = [i for i, other in enumerate(everyone) if other != everyone[0]]
        if differing:
            raise ConfigError(f"[rank {self.rank}] ranks disagree on the expert layout; ranks {differing} differ "
                              f"from rank 0 ({everyone[0]} vs {everyone[differing[0]]}). Fix: build the store "
                              "from the same model config on every rank")

    def _map_pull(self, layer: int, proj: ProjectionSpec) -> None:
        vr = self.symm.map_range(self.plan.pull_segments(self.rank, layer, proj.name), f"L{layer}.{proj.name}.pull")
        self._ranges.append(vr)
        rows = self.num_experts + self.num_slots
        view = vr.tensor(proj.dtype, (rows, *proj.shape), byte_offset=self.plans[proj.name].lead_pad)
        self._views[(PULL, layer, proj.name)] = view

    def _map_push(self, layer: int, proj: ProjectionSpec) -> None:
        epn, plan = self.experts_per_rank, self.plans[proj.name]
        assert isinstance(plan, PushRowsPlan)
        compute_vr = self.symm.map_range(self.plan.push_segments(self.rank, layer, proj.name, whole_run=True),
                                         f"L{layer}.{proj.name}.push")
        self._ranges.append(compute_vr)
        segs = [s for o in range(self.world_size) for s in self.plan.push_segments(o, layer, proj.name, False)]
        pool_vr = self.symm.map_range(segs, f"L{layer}.{proj.name}.push.pool")
        self._ranges.append(pool_vr)
        itemsize = torch.empty((), dtype=proj.dtype).element_size()
        flat = pool_vr.tensor(proj.dtype, (pool_vr.size // itemsize,))
        inner = [1]
        for d in reversed(proj.shape[1:]):
            inner.insert(0, inner[0] * d)
        strides = (plan.pool_rank_stride // itemsize, proj.row_bytes // itemsize, *inner)
        self._views[("push.pool", layer, proj.name)] = flat.as_strided(
            (self.world_size, epn, *proj.shape), strides, flat.storage_offset() + plan.pool_offset // itemsize)
        self._views[(PUSH, layer, proj.name)] = compute_vr.tensor(proj.dtype, (2 * epn, *proj.shape))

    def _zero_own(self) -> None:
        for layer in range(self.num_layers):
            for p in self.projections:
                if self.api == PUSH:  # own rows and slots (the slot head is per layer)
                    self.driver.zero_(self.push_view(layer, p.name))
                else:
                    self.driver.zero_(self.owner_view(layer, p.name))
        if self.api == PULL:
            for p in self.projections:
                for pool in range(self.slot_pools):
                    self.driver.zero_(self.slots(pool, p.name))
        self.driver.synchronize()
        self.symm.comm.barrier("zero own expert pages and slots")

    # -- views --------------------------------------------------------------------------
    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.world_size

    def has_pull_view(self, proj: str) -> bool:
        """Whether the ``[E+B]`` pull view of ``proj`` exists: always in the pull layout; in the push layout
        where each rank's rows of ``proj`` fill whole pages (then both layouts are the same pages)."""
        return self.plan.has_pull_view(proj)

    def _view(self, kind: str, layer: int, proj: str) -> torch.Tensor:
        try:
            return self._views[(kind, layer, proj)]
        except KeyError:
            pass
        if proj in self.plans and 0 <= layer < self.num_layers:
            if kind == PULL:
                plan = self.plans[proj]
                raise config_error(self.rank, f"the push layout of {proj!r} has no [E+B] pull view at this page "
                                   "size: each rank's rows end inside a page", (plan.experts_per_rank,
                                   plan.row_bytes, self.granularity),
                                   "read the push views (push_view, push_pool, owner_view, slots), or build the "
                                   "store with api='pull'")
            raise config_error(self.rank, "the pull layout has no push views", (kind, layer, proj),
                               "build the store with api='push' (num_slots = E/R) for the push API")
        raise config_error(self.rank, f"no {kind} view for layer/projection", (layer, proj),
                           f"layers are 0..{self.num_layers - 1}, projections "
                           f"{[p.name for p in self.projections]}")

    def pull_view(self, layer: int, proj: str) -> torch.Tensor:
        """``[E+B, out, in]``: rows ``[0, E)`` the owners' experts (global order), rows
        ``[E, E+B)`` this rank's slot pool (shared by every layer using the same pool)."""
        return self._view(PULL, layer, proj)

    def compute_view(self, layer: int, proj: str) -> torch.Tensor:
        """The rows the experts read for this store's API: the ``[E+B]`` pull view or the ``[2*epn]`` push view."""
        return self.push_view(layer, proj) if self.api == PUSH else self.pull_view(layer, proj)

    def owner_view(self, layer: int, proj: str) -> torch.Tensor:
        """``[epn, out, in]``: this rank's own experts of ``layer``."""
        epn = self.experts_per_rank
        if self.api == PUSH:
            return self.push_view(layer, proj)[:epn]
        return self.pull_view(layer, proj)[self.rank * epn:(self.rank + 1) * epn]

    def slots(self, layer: int, proj: str) -> torch.Tensor:
        """``[B, out, in]``: the slot rows ``layer``'s view uses."""
        if self.api == PUSH:
            return self.push_view(layer, proj)[self.experts_per_rank:]
        return self.pull_view(layer, proj)[self.num_experts:]

    def slot_views(self, proj: str) -> list[torch.Tensor]:
        """Slot views that together cover every slot byte of ``proj``: one per pool (pull); in the push layout
        every slot row of the first layer of each pool, and the rows of each other layer that lie (partly) in
        its own slot head. Filling them all fills every slot row of the model."""
        if self.api == PUSH:
            plan = self.plans[proj]
            assert isinstance(plan, PushRowsPlan)
            head_rows = -(-plan.head_bytes // plan.row_bytes)
            return [self.slots(layer, proj) if layer < self.slot_pools else self.slots(layer, proj)[:head_rows]
                    for layer in range(self.num_layers) if layer < self.slot_pools or head_rows]
        return [self.slots(pool, proj) for pool in range(min(self.slot_pools, self.num_layers))]

    def push_pool(self, layer: int, proj: str) -> torch.Tensor:
        """``[R, epn, out, in]``: every rank's slot rows of ``layer`` (the push target)."""
        return self._view("push.pool", layer, proj)

    def push_view(self, layer: int, proj: str) -> torch.Tensor:
        """``[2·epn, out, in]``: own experts then own slots (what the push API's experts read)."""
        return self._view(PUSH, layer, proj)

    # -- loading --------------------------------------------------------------------------
    def load(self, loader: Callable[[int, str, int], torch.Tensor], progress: Callable[[str], None] | None = None) -> LoadStats:
        """Write this rank's experts: ``loader(layer, projection, expert) -> [out, in]``.

        Called only for this rank's experts, one at a time, so no rank ever
        materializes another's experts and transient memory is one expert.
        Collective at the end (barrier): every rank's rows are final on return.
        """
        t0 = time.perf_counter()
        epn, first = self.experts_per_rank, self.rank * self.experts_per_rank
        stats = self.load_stats
        # Lockstep: a bad tensor on one rank raises on every rank, nobody waits in a barrier.
        with self.symm.comm.step("load experts"):
            for layer in range(self.num_layers):
                for p in self.projections:
                    own = self.owner_view(layer, p.name)
                    for j in range(epn):
                        expert = first + j
                        stats.experts_requested.append(expert)
                        src = loader(layer, p.name, expert)
                        self._check_src(src, p, (layer, p.name, expert))
                        own[j].copy_(src)
                        stats.bytes_written += p.row_bytes
                        stats.max_transient_bytes = max(stats.max_transient_bytes,
                                                        src.numel() * src.element_size())
                if progress:
                    progress(f"rank {self.rank}: loaded layer {layer + 1}/{self.num_layers}")
        self.finish_loading()
        stats.seconds += time.perf_counter() - t0
        return stats

    def load_layer(self, layer: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Write this rank's experts of one layer from ``{projection: [epn, out, in]}``.

        Collective (lockstep): a bad tensor on one rank raises on every rank."""
        with self.symm.comm.step(f"load layer {layer}"):
            self._load_layer_local(layer, tensors)

    def _load_layer_local(self, layer: int, tensors: Mapping[str, torch.Tensor]) -> None:
        for p in self.projections:
            if p.name not in tensors:
                raise config_error(self.rank, "missing projection in load_layer", p.name,
                                   f"pass all of {[q.name for q in self.projections]}")
            src = tensors[p.name]
            want = (self.experts_per_rank, *p.shape)
            if tuple(src.shape) != want:
                raise config_error(self.rank, f"layer {layer} {p.name} has the wrong shape", tuple(src.shape),
                                   f"pass this rank's {want} tensor (its own experts only)")
            self._check_src(src[0], p, (layer, p.name, None))
            self.owner_view(layer, p.name).copy_(src)
            self.load_stats.bytes_written += src.numel() * src.element_size()
            self.load_stats.max_transient_bytes = max(self.load_stats.max_transient_bytes,
                                                      src.numel() * src.element_size())

    def finish_loading(self) -> None:
        """Collective: make every rank's writes visible before anyone reads a peer's rows. The synchronize runs
        inside the step: a device fault on one rank (a sticky CUDA error) reaches every rank, naming it."""
        with self.symm.comm.step("finish loading"):
            self.driver.synchronize()

    def _check_src(self, src: torch.Tensor, p: ProjectionSpec, where: tuple) -> None:
        if not isinstance(src, torch.Tensor) or tuple(src.shape) != tuple(p.shape):
            raise config_error(self.rank, f"expert weight {where} has the wrong shape",
                               getattr(src, "shape", type(src).__name__), f"return a {tuple(p.shape)} tensor")
        if src.dtype != p.dtype:
            raise config_error(self.rank, f"expert weight {where} has the wrong dtype", src.dtype,
                               f"convert to {p.dtype} before loading")

    # -- accounting -------------------------------------------------------------------------
    def physical_bytes(self) -> dict[str, int]:
        """This rank's physical bytes by category, measured from the driver's handles.

        ``expert_bytes`` and ``slot_bytes`` are the allocation sizes;
        ``padding_bytes`` the part of them that holds no row (lead pads of the
        pages this rank allocates, and slot pools' page tails); ``weight_bytes``
        and ``scale_bytes`` split the total by tensor role."""
        sizes = self.symm.chunk_sizes[self.rank]
        planned = self.plan.rank_bytes(self.rank)  # each tensor's runs and pools are its own pages: an exact split
        data = planned["total_bytes"] - planned["padding_bytes"]
        return {"expert_bytes": sizes[EXPERTS_CHUNK], "slot_bytes": sizes[SLOTS_CHUNK],
                "padding_bytes": sizes[EXPERTS_CHUNK] + sizes[SLOTS_CHUNK] - data,
                "total_bytes": sizes[EXPERTS_CHUNK] + sizes[SLOTS_CHUNK],
                "weight_bytes": planned["weight_bytes"], "scale_bytes": planned["scale_bytes"]}

    def replicated_bytes(self, num_slots: int | None = None) -> int:
        """Bytes vLLM 0.33.0's all-gathered layout holds per rank: ``L · (E+B)`` rows per projection."""
        b = self.num_slots if num_slots is None else num_slots
        return self.num_layers * (self.num_experts + b) * sum(p.row_bytes for p in self.projections)

    @property
    def mapping_count(self) -> int:
        return sum(len(r.segments) for r in self._ranges)

    # -- teardown -----------------------------------------------------------------------------
    def close(self) -> None:
        """Collective. Views handed out stay valid until they die (they keep their mapping)."""
        self._views.clear()
        for vr in self._ranges:
            vr.close()
        self._ranges.clear()
        symm = getattr(self, "symm", None)
        if symm is not None:
            symm.close()

    def __enter__(self) -> "ShardedExpertStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
