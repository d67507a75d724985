"""The model-wide sharded expert-weight store over symmetric memory.

Physical memory per rank (two chunks, all handles exchanged in one round)::

    chunk "experts":  for every (layer l, projection p), in that order, the run
                      of pages of the (l, p) expert region this rank allocates
                      (see plan.py: pages straddling two owners belong to the
                      earlier one); size ≈ L · epn · Σ_p row_bytes(p)
    chunk "slots":    for every pool k (1, or 2 for double buffering) and
                      projection p: B slot rows, rounded up to one page

Virtual views on every rank, for layer l and projection p (pool k = l mod pools)::

    Gen A [E+B, out, in]  ─ one reservation:
      | lead pad | owner0 pages | owner1 pages | … | ownerR-1 pages | own slot pool k,p | tail |
                 ^ tensor base                                      ^ row E, page-aligned
    owner view [epn, out, in]      = Gen A rows [rank·epn, (rank+1)·epn)
    Gen B pool [R, epn, out, in]   = every rank's slot pool k,p (needs B = epn),
                                     rank stride = one pool (page-rounded)
    Gen B compute [2·epn, out, in] = own expert pages then own slot pool
                                     (needs page-aligned own rows and B = epn)

Every layer's Gen A view maps the *same* slot pool: one physical pool per
projection serves the whole model (MoonEP runs one MoE layer at a time).
Rows of expert ``e`` are physically in exactly one place, so row ``e`` of
every rank's view is the owner's data.
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
from .plan import ExpertRegionPlan, plan_expert_region, slot_pool_bytes

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


def ffn_projections(hidden: int, intermediate: int, dtype: torch.dtype = torch.bfloat16) -> list[ProjectionSpec]:
    """gate ``[I, H]``, up ``[I, H]``, down ``[H, I]`` — vLLM's w13 split in two, and w2."""
    return [ProjectionSpec("gate", (intermediate, hidden), dtype),
            ProjectionSpec("up", (intermediate, hidden), dtype),
            ProjectionSpec("down", (hidden, intermediate), dtype)]


@dataclasses.dataclass
class LoadStats:
    """What one rank's loading did (for instrumentation and progress)."""

    experts_requested: list[int] = dataclasses.field(default_factory=list)
    bytes_written: int = 0
    max_transient_bytes: int = 0
    seconds: float = 0.0


class ShardedExpertStore:
    """Sharded routed-expert weights of a whole model, with zero-copy views on every rank.

    Collective: construct on every rank of the EP group with identical
    arguments. ``num_slots`` (B) rows per projection form one slot pool shared
    by all layers (``slot_pools=2`` keeps two, used by alternating layers).
    """

    def __init__(self, *, num_layers: int, num_experts: int, projections: Sequence[ProjectionSpec],
                 num_slots: int, driver: MemoryDriver, group: Any = None, slot_pools: int = 1,
                 gen_b: bool = False, timeout_s: float | None = None):
        self.driver = driver
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
            self.plans: dict[str, ExpertRegionPlan] = {
                p.name: plan_expert_region(num_experts, self.world_size, p.row_bytes, gran)
                for p in self.projections}
            self.pool_bytes = {p.name: slot_pool_bytes(num_slots, p.row_bytes, gran) for p in self.projections}
            # Offsets of each (layer, projection) run inside every rank's experts chunk.
            self.expert_offsets: list[dict[tuple[int, str], int]] = []
            expert_chunk_bytes = []
            for r in range(self.world_size):
                cursor, offs = 0, {}
                for layer in range(num_layers):
                    for p in self.projections:
                        offs[(layer, p.name)] = cursor
                        cursor += self.plans[p.name].pages_of(r) * gran
                self.expert_offsets.append(offs)
                expert_chunk_bytes.append(cursor)
            self.slot_offsets: dict[tuple[int, str], int] = {}
            cursor = 0
            for k in range(slot_pools):
                for p in self.projections:
                    self.slot_offsets[(k, p.name)] = cursor
                    cursor += self.pool_bytes[p.name]
            slot_chunk_bytes = cursor
        self.symm = SymmetricMemory.allocate([expert_chunk_bytes[self.rank], slot_chunk_bytes],
                                             driver=driver, tags=["experts", "slots"], comm=comm)
        t_map = time.perf_counter()
        self.allocate_seconds = t_map - t0
        try:
            with comm.step("map expert views"):
                for layer in range(num_layers):
                    for p in self.projections:
                        self._map_gen_a(layer, p)
                        if gen_b:
                            self._map_gen_b(layer, p)
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
        r, E, R = self.rank, self.num_experts, self.world_size
        if self.num_layers <= 0:
            raise config_error(r, "num_layers must be positive", self.num_layers, "pass the MoE layer count")
        if E <= 0 or E % R:
            raise config_error(r, "num_experts must be a positive multiple of the EP size", (E, R),
                               "choose an EP size that divides the number of routed experts")
        if not self.projections or len({p.name for p in self.projections}) != len(self.projections):
            raise config_error(r, "projection names must be unique and non-empty",
                               [p.name for p in self.projections], "name each per-expert tensor once")
        if not 0 < self.num_slots <= E:
            raise config_error(r, "num_slots (B) must be in [1, E]", self.num_slots,
                               "use MoonEP's B (default E/R)")
        if self.slot_pools not in (1, 2):
            raise config_error(r, "slot_pools must be 1 or 2", self.slot_pools,
                               "use 2 only for double-buffered prefetch")

    def _description(self) -> tuple:
        return (self.num_layers, self.num_experts, self.num_slots, self.slot_pools,
                [(p.name, p.shape, str(p.dtype)) for p in self.projections])

    def _check_same_everywhere(self, everyone: list[tuple]) -> None:
        """Every rank sees the same list, so every rank raises (or not) alike."""
        differing = [i for i, other in enumerate(everyone) if other != everyone[0]]
        if differing:
            raise ConfigError(f"[rank {self.rank}] ranks disagree on the expert layout; ranks {differing} differ "
                              f"from rank 0 ({everyone[0]} vs {everyone[differing[0]]}). Fix: build the store "
                              "from the same model config on every rank")

    def _gen_a_segments(self, layer: int, proj: ProjectionSpec) -> list[Segment]:
        plan, gran = self.plans[proj.name], self.granularity
        segs = [Segment(o, EXPERTS_CHUNK, self.expert_offsets[o][(layer, proj.name)], plan.pages_of(o) * gran)
                for o in range(self.world_size) if plan.pages_of(o)]
        pool = layer % self.slot_pools
        segs.append(Segment(self.rank, SLOTS_CHUNK, self.slot_offsets[(pool, proj.name)],
                            self.pool_bytes[proj.name]))
        return segs

    def _map_gen_a(self, layer: int, proj: ProjectionSpec) -> None:
        vr = self.symm.map_range(self._gen_a_segments(layer, proj), f"L{layer}.{proj.name}.genA")
        self._ranges.append(vr)
        rows = self.num_experts + self.num_slots
        view = vr.tensor(proj.dtype, (rows, *proj.shape), byte_offset=self.plans[proj.name].lead_pad)
        self._views[("A", layer, proj.name)] = view

    def _map_gen_b(self, layer: int, proj: ProjectionSpec) -> None:
        epn, plan, gran = self.num_experts // self.world_size, self.plans[proj.name], self.granularity
        rank = self.rank
        if self.num_slots != epn:
            raise config_error(rank, "Gen B views need num_slots == E/R", (self.num_slots, epn),
                               "construct the store with num_slots=E//R for the push API")
        aligned = plan.lead_pad == 0 and (epn * proj.row_bytes) % gran == 0
        if not aligned:
            raise config_error(rank, f"Gen B compute view of {proj.name!r} needs each rank's expert rows "
                               "to fill whole pages", (epn, proj.row_bytes, gran),
                               "use the Gen A [E+B] view (exact for any shape), or shapes with "
                               "epn*row_bytes a multiple of the granularity")
        pool = layer % self.slot_pools
        slot_off = self.slot_offsets[(pool, proj.name)]
        pool_bytes = self.pool_bytes[proj.name]
        pool_vr = self.symm.map_range([Segment(o, SLOTS_CHUNK, slot_off, pool_bytes)
                                       for o in range(self.world_size)], f"L{layer}.{proj.name}.genB.pool")
        itemsize = torch.empty((), dtype=proj.dtype).element_size()
        flat = pool_vr.tensor(proj.dtype, (pool_vr.size // itemsize,))
        row = proj.row_bytes // itemsize
        inner = [1]
        for d in reversed(proj.shape[1:]):
            inner.insert(0, inner[0] * d)
        strides = (pool_bytes // itemsize, row, *inner)
        pool_view = flat.as_strided((self.world_size, epn, *proj.shape), strides)
        compute_vr = self.symm.map_range(
            [Segment(rank, EXPERTS_CHUNK, self.expert_offsets[rank][(layer, proj.name)], plan.pages_of(rank) * gran),
             Segment(rank, SLOTS_CHUNK, slot_off, pool_bytes)], f"L{layer}.{proj.name}.genB.compute")
        compute = compute_vr.tensor(proj.dtype, (2 * epn, *proj.shape))
        self._ranges += [pool_vr, compute_vr]
        self._views[("Bpool", layer, proj.name)] = pool_view
        self._views[("Bcompute", layer, proj.name)] = compute

    def _zero_own(self) -> None:
        for layer in range(self.num_layers):
            for p in self.projections:
                self.driver.zero_(self.owner_view(layer, p.name))
        for p in self.projections:
            for pool in range(self.slot_pools):
                self.driver.zero_(self.gen_a(pool, p.name)[self.num_experts:])
        self.driver.synchronize()
        self.symm.comm.barrier("zero own expert pages and slots")

    # -- views --------------------------------------------------------------------------
    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.world_size

    def _view(self, kind: str, layer: int, proj: str) -> torch.Tensor:
        try:
            return self._views[(kind, layer, proj)]
        except KeyError:
            raise config_error(self.rank, f"no {kind} view for layer/projection", (layer, proj),
                               f"layers are 0..{self.num_layers - 1}, projections "
                               f"{[p.name for p in self.projections]}" +
                               ("; build with gen_b=True for Gen B views" if kind != "A" else "")) from None

    def gen_a(self, layer: int, proj: str) -> torch.Tensor:
        """``[E+B, out, in]``: rows ``[0, E)`` the owners' experts (global order), rows
        ``[E, E+B)`` this rank's slot pool (shared by every layer using the same pool)."""
        return self._view("A", layer, proj)

    def owner_view(self, layer: int, proj: str) -> torch.Tensor:
        """``[epn, out, in]``: this rank's own experts of ``layer``."""
        epn = self.experts_per_rank
        return self.gen_a(layer, proj)[self.rank * epn:(self.rank + 1) * epn]

    def slots(self, layer: int, proj: str) -> torch.Tensor:
        """``[B, out, in]``: the slot rows ``layer``'s view uses."""
        return self.gen_a(layer, proj)[self.num_experts:]

    def gen_b_pool(self, layer: int, proj: str) -> torch.Tensor:
        """``[R, epn, out, in]``: every rank's slot pool (push target)."""
        return self._view("Bpool", layer, proj)

    def gen_b_compute(self, layer: int, proj: str) -> torch.Tensor:
        """``[2·epn, out, in]``: own experts then own slots."""
        return self._view("Bcompute", layer, proj)

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
        """Collective: make every rank's writes visible before anyone reads a peer's rows."""
        self.driver.synchronize()
        self.symm.comm.barrier("finish loading")

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
        data = sum(self.num_layers * self.plans[p.name].data_bytes_in_pages_of(self.rank) +
                   self.slot_pools * self.num_slots * p.row_bytes for p in self.projections)
        by_role = {"weight": 0, "scale": 0}
        for p in self.projections:  # each tensor's runs and pools are its own pages: an exact split
            by_role[p.role] += (self.num_layers * self.plans[p.name].pages_of(self.rank) * self.granularity
                                + self.slot_pools * self.pool_bytes[p.name])
        return {"expert_bytes": sizes[EXPERTS_CHUNK], "slot_bytes": sizes[SLOTS_CHUNK],
                "padding_bytes": sizes[EXPERTS_CHUNK] + sizes[SLOTS_CHUNK] - data,
                "total_bytes": sizes[EXPERTS_CHUNK] + sizes[SLOTS_CHUNK],
                "weight_bytes": by_role["weight"], "scale_bytes": by_role["scale"]}

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
