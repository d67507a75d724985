"""The model-wide sharded MoonEP expert store as vLLM's MoE layers see it: written in place, in passes.

One :class:`ModelExpertStore` holds every MoonEP MoE layer of one model: each
rank's own experts of every layer plus one slot pool shared by all layers,
with all handles exchanged in one collective round. It is allocated at the
end of model construction (``loading.py``), before any weight is read, so
vLLM's weight loader writes each rank's experts straight into its pages.

Weights arrive in **passes**. The initial pass opens with the store and
covers the model's first load; every later call of the model's
``load_weights`` (vLLM's ``reload_weights``, an RL framework's update) opens
an update pass. During a pass each write is checked (projection, expert,
shape, dtype) *before* any byte is copied; a bad tensor is refused, recorded,
and the rank writes nothing more in that pass, so a systematically wrong
checkpoint leaves every old row in place. :meth:`settle` ends a pass on every
rank at once (lockstep): every rank's refusals raise on all ranks; the
initial pass must have written every local row of every layer; on success
the step's gather is the barrier after which every owner's rows are final,
and this rank's slot pool is poisoned (NaN) so that no slot holds a copy of
an expert from before the pass — the next prefetch refills every slot it uses.
"""

from __future__ import annotations

import dataclasses
import socket
import time
from typing import Any, Sequence

import torch

from ...errors import ConfigError, config_error
from ...layout.store import FFN_PROJECTIONS, ShardedExpertStore, ffn_projections
from ...memory.group import GroupComm, register_peers, transport_address
from ..buffers import make_store_driver

#: MoonEP kernels tile both expert dims by 128 (vLLM's MOONEP_WEIGHT_TILE).
WEIGHT_TILE = 128


@dataclasses.dataclass
class WeightPass:
    """What one rank wrote (and refused) since the pass opened."""

    kind: str                                      # "initial" or "update"
    written: set = dataclasses.field(default_factory=set)   # {(layer, projection, local expert)}
    rows_written: int = 0
    bytes_written: int = 0
    refused: int = 0
    errors: list = dataclasses.field(default_factory=list)  # first few refusal messages
    dtypes: set = dataclasses.field(default_factory=set)    # checkpoint dtypes seen (str)
    opened_at: float = dataclasses.field(default_factory=time.perf_counter)

    def summary(self) -> dict[str, Any]:
        return {"kind": self.kind, "rows_written": self.rows_written, "bytes_written": self.bytes_written,
                "refused": self.refused, "seconds": round(time.perf_counter() - self.opened_at, 4)}


class ModelExpertStore:
    """All MoonEP MoE layers of one model: one :class:`ShardedExpertStore` + one shared slot pool.

    Collective constructor (every EP rank, same arguments). ``group`` is the
    EP group's CPU (gloo) group: it carries metadata and the handle exchange
    only. ``local_expert_ids[l]`` is the global ids this rank's layer ``l``
    holds (from vLLM's expert map); MoonEP needs the linear placement.
    """

    def __init__(self, *, layer_names: Sequence[str], num_experts: int, hidden: int, intermediate: int,
                 num_slots: int, group: Any, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                 driver: Any = None, local_expert_ids: Sequence[Sequence[int] | None] | None = None,
                 layer_shapes: set | None = None, fmt: str = "bf16", api: str = "pull"):
        t0 = time.perf_counter()
        #: expert format: "bf16" (gate/up/down) or a quantized one of ``layout.formats`` (vLLM's fused
        #: ``w13_*``/``w2_*`` weight and scale tensors, one row index for all, ``quantized/engine.py``)
        self.format = fmt
        self.comm = GroupComm(group)
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self.layer_names = list(layer_names)
        self.index = {name: i for i, name in enumerate(self.layer_names)}
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.num_slots, self.dtype, self.device = num_slots, dtype, torch.device(device)
        #: The MoonEP API the store serves, "pull" or "push" (the push API's views too: ``push_pool [R, epn]``,
        #: ``push_view [2*epn]``; num_slots = E/R), as the manager's agreed choice says.
        self.api = api
        desc = (tuple(self.layer_names), num_experts, hidden, intermediate, num_slots, str(dtype),
                self.device.type, fmt, api)
        with self.comm.step("check the MoonEP model description") as described:
            self._validate(local_expert_ids, layer_shapes)
            described.share((desc, socket.gethostname(), transport_address()))
        everyone = [d for d, _, _ in described.gathered]
        #: Every EP rank's host, and the address its group transport uses (a lost peer is named by them).
        self.hosts = [h for _, h, _ in described.gathered]
        self.peers = [(h, a) for _, h, a in described.gathered]
        register_peers(group, self.peers)
        differ = [r for r, d in enumerate(everyone) if d != everyone[0]]
        if differ:  # every rank sees the same list: every rank raises alike
            raise ConfigError(f"[rank {self.rank}] EP ranks {differ} describe the MoE layers differently from "
                              f"rank 0 ({everyone[0][1:]} vs {everyone[differ[0]][1:]}, "
                              f"{len(everyone[0][0])} vs {len(everyone[differ[0]][0])} layers). Fix: load the "
                              "same model with the same settings on every rank")
        self._owns_driver = driver is None  # a driver made here is closed here (close())
        self.driver = driver if driver is not None else make_store_driver(self.device, self.rank)
        self.store = ShardedExpertStore(num_layers=len(self.layer_names), num_experts=num_experts,
                                        projections=self._projections(),
                                        num_slots=num_slots, driver=self.driver, group=group,
                                        api=api)
        #: Each store tensor's data: its shape and dtype as the checkpoint and the experts see them (a push
        #: layout scale row is stored padded to 16 KiB bytes; :meth:`data_view` reads its head)
        self.data_specs = {p.name: p for p in self._projections(padded=False)}
        self.shapes = {name: tuple(p.shape) for name, p in self.data_specs.items()}
        self.padded = {p.name for p in self.store.projections if p.shape != self.data_specs[p.name].shape}
        self.closed = False
        self.ready = False            # True once the initial pass settled on every rank
        self.pass_: WeightPass | None = WeightPass("initial")
        self.settled: list[dict[str, Any]] = []   # one summary per settled pass (this rank)
        self.checkpoint_dtypes: set[str] = set()
        self.allocate_seconds = time.perf_counter() - t0

    def _projections(self, padded: bool = True) -> list:
        if self.format == "bf16":
            return ffn_projections(self.hidden, self.intermediate, self.dtype)
        from ...layout.formats import expert_projections, push_store_projections

        if self.api == "push":  # the release's push: gate, up, down apart, with scale rows (vllm_prepare_finalize.md)
            if padded:
                return push_store_projections(self.format, self.hidden, self.intermediate)
            return expert_projections(self.format, self.hidden, self.intermediate, split_w13=True)
        return expert_projections(self.format, self.hidden, self.intermediate)

    def store_target(self, name: str, part: int | None) -> tuple[str, int | None]:
        """Where vLLM's parameter ``name`` (shard ``part``: 0 = w1, 1 = w3, None = w2) lives in this store:
        itself (the pull layout: vLLM's fused names), or under the push layout's split names (``gate``,
        ``up``, ``down``, each ``<name>_scale`` for its scales)."""
        if self.api != "push" or self.format == "bf16" or name in self.shapes:
            return name, part
        proj = {("w13", 0): "gate", ("w13", 1): "up", ("w2", None): "down"}.get((name.split("_", 1)[0], part))
        if proj is None:
            return name, part
        return (f"{proj}_scale" if name.endswith(("_scale", "_scale_inv")) else proj), None

    def data_view(self, rows: torch.Tensor, name: str) -> torch.Tensor:
        """``rows`` ``[n, ...]`` of store tensor ``name`` as its data (the unpadded scales of a push row)."""
        if name not in self.padded:
            return rows
        from ...layout.formats import scale_data_view

        return scale_data_view(rows, self.data_specs[name])

    @property
    def row_parts(self) -> dict[str, int]:
        """How many checkpoint tensors make one row of each store tensor (2 for fused w13: w1, w3)."""
        return {name: (2 if name.startswith("w13_") else 1) for name in self.shapes}

    def _validate(self, local_expert_ids: Sequence[Sequence[int] | None] | None, layer_shapes: set | None) -> None:
        r, E, R = self.rank, self.num_experts, self.world_size
        if layer_shapes is not None and len(layer_shapes) > 1:
            raise config_error(r, "MoonEP's model-wide store needs every MoE layer to have the same expert "
                               "shapes, dtype and expert count", sorted(map(str, layer_shapes))[:2],
                               "use another --all2all-backend (or MOONEP_EP_LAYOUT=replicated) for models with "
                               "heterogeneous MoE layers")
        if not self.layer_names:
            raise config_error(r, "no MoE layer names", self.layer_names, "build the store from the model's MoE layers")
        if len(self.index) != len(self.layer_names):
            raise config_error(r, "duplicate MoE layer names", self.layer_names, "pass each layer once")
        if E <= 0 or E % R:
            raise config_error(r, f"MoonEP needs the {E} routed experts split evenly over the {R} EP ranks "
                               "(E % EP size == 0)", (E, R),
                               "choose a data/expert-parallel size that divides the number of experts")
        for name, dim in (("hidden_size", self.hidden), ("moe_intermediate_size", self.intermediate)):
            if dim <= 0 or dim % WEIGHT_TILE:
                raise config_error(r, f"MoonEP needs {name} to be a multiple of {WEIGHT_TILE} (its kernels tile "
                                   f"expert weights by {WEIGHT_TILE})", dim,
                                   f"use a model whose {name} is a multiple of {WEIGHT_TILE}, or another "
                                   "--all2all-backend")
        if self.dtype != torch.bfloat16 and self.format == "bf16":
            raise config_error(r, "MoonEP's sharded layout holds bf16 expert weights", self.dtype,
                               "load the model with --dtype bfloat16 (quantized models need another backend)")
        if not 0 < self.num_slots <= E:
            raise config_error(r, "the MoonEP slot count B must be in [1, E]", self.num_slots, "use vLLM's default")
        epn = E // R
        want = list(range(r * epn, (r + 1) * epn))
        for name, ids in zip(self.layer_names, local_expert_ids or []):
            if ids is not None and list(ids) != want:
                raise config_error(r, f"layer {name}: this rank holds experts {list(ids)[:8]}…, but MoonEP's "
                                   f"sharded layout needs the linear placement {want[0]}..{want[-1]}",
                                   list(ids), "use --expert-placement-strategy linear without EPLB")

    # -- writing, one expert row at a time ----------------------------------------------------
    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.world_size

    @property
    def one_layer_local_bytes(self) -> int:
        """Bytes of one layer's local experts (derived from the shapes: ``epn · Σ_p row_bytes``)."""
        return self.experts_per_rank * sum(p.row_bytes for p in self.store.projections)

    def begin_update(self) -> bool:
        """Open an update pass unless one is open; True if this call opened it."""
        if self.pass_ is not None:
            return False
        self.pass_ = WeightPass("update")
        return True

    def refuse(self, problem: str) -> None:
        """Record a tensor this rank cannot load; :meth:`settle` raises it on every rank."""
        self.begin_update()  # a no-op while a pass is open
        p = self.pass_
        assert p is not None
        p.refused += 1
        if not p.errors:
            p.errors.append(problem)

    def write_expert(self, layer: int, projection: str, local: int, src: torch.Tensor, where: str = "",
                     part: int | None = None) -> bool:
        """Copy one expert row (``[out, in]``) into this rank's pages; False if refused.

        Never raises for bad input: the first refusal is recorded and the rank
        writes nothing more in this pass; :meth:`settle` raises it on every rank.
        """
        self.begin_update()  # a writer outside model.load_weights: loading.finish_weight_update settles it
        p = self.pass_
        assert p is not None
        problem = p.errors[0] if p.errors else self._check_write(layer, projection, local, src, where, p.kind,
                                                                 part)
        if problem is not None:
            self.refuse(problem)  # counts it; only the pass's first problem is kept
            return False
        row = self.data_view(self.store.owner_view(layer, projection)[local:local + 1], projection)[0]
        if part is not None:  # one half of a fused w13 row: w1 (gate) then w3 (up)
            half = row.shape[0] // 2
            row = row[part * half:(part + 1) * half]
        row.copy_(src)
        p.written.add((layer, projection, local) if part is None else (layer, projection, local, part))
        p.rows_written += 1
        p.bytes_written += src.numel() * src.element_size()
        p.dtypes.add(str(src.dtype))
        return True

    def _check_write(self, layer: int, projection: str, local: int, src: Any, where: str, kind: str,
                     part: int | None = None) -> str | None:
        name = self.layer_names[layer] if 0 <= layer < len(self.layer_names) else layer
        r, what = self.rank, f"{where or 'expert weight'} (layer {name}, {projection}, local expert {local})"
        if self.closed:
            return f"[rank {r}] {what}: the MoonEP expert store is closed. Fix: rebuild the engine"
        if projection not in self.shapes or not 0 <= layer < len(self.layer_names):
            return (f"[rank {r}] {what}: no such layer/projection in the store. Fix: load the model the store "
                    "was built for")
        if not 0 <= local < self.experts_per_rank:
            return (f"[rank {r}] {what}: local expert index out of range [0, {self.experts_per_rank}). "
                    "Fix: write only this rank's experts")
        want = self.shapes[projection]
        if part is not None:
            want = (want[0] // 2,) + tuple(want[1:])
        if not isinstance(src, torch.Tensor) or tuple(src.shape) != want:
            return (f"[rank {r}] {what}: shape {tuple(getattr(src, 'shape', ()))} differs from the served "
                    f"{want}. Fix: load a checkpoint with the served model's shapes "
                    "(moe_intermediate_size, hidden_size); a model of another shape needs a new engine")
        if self.format != "bf16":
            dtype = self.data_specs[projection].dtype
            if src.dtype != dtype:
                return (f"[rank {r}] {what}: dtype {src.dtype} differs from the {self.format} store's {dtype}. "
                        "Fix: load a checkpoint in the format the engine was started with")
            return None
        if not src.is_floating_point():
            return f"[rank {r}] {what}: dtype {src.dtype} is not a floating type. Fix: load unquantized weights"
        if kind == "update" and self.checkpoint_dtypes and str(src.dtype) not in self.checkpoint_dtypes:
            return (f"[rank {r}] {what}: dtype {src.dtype} differs from the checkpoint the engine loaded "
                    f"({sorted(self.checkpoint_dtypes)}). Fix: convert the update to that dtype")
        return None

    # -- ending a pass (collective) --------------------------------------------------------------
    def settle(self, failure: BaseException | None = None) -> dict[str, Any]:
        """End the open pass on every rank; raise every rank's refusals (and ``failure``) on all ranks.

        Collective (one metadata round, which is also the barrier after which
        every owner's rows are final). Returns this rank's pass summary.
        """
        p = self.pass_ if self.pass_ is not None else WeightPass("update")
        self.pass_ = None
        try:
            with self.comm.step(f"settle MoonEP expert weights ({p.kind} pass)") as settled:
                # This rank's copies are complete before the round; a device fault here is every rank's error.
                self.driver.synchronize()
                if failure is not None:
                    raise RuntimeError(f"loading failed on this rank: {type(failure).__name__}: {failure}")
                if p.errors:
                    raise ConfigError(self._refusal_message(p))
                if p.kind == "initial":
                    self._check_coverage(p)
                settled.share(p.summary())
        except Exception:
            if p.kind == "update":
                self._note_update_outcome(p, ok=False)
            raise
        if p.kind == "initial":
            self.checkpoint_dtypes = set(p.dtypes)
            self.ready = True
        self.poison_slots()
        summary = dict(p.summary(), ok=True, ranks_rows_written=[s["rows_written"] for s in settled.gathered])
        self.settled.append(summary)
        return summary

    def _refusal_message(self, p: WeightPass) -> str:
        kept = ("no expert row was written in this pass on this rank: the previous expert weights still serve"
                if p.rows_written == 0 else
                f"{p.rows_written} expert rows of this pass were written before the refusal: the expert weights "
                "now mix two checkpoints. Fix: load a consistent checkpoint")
        return f"{p.errors[0]} ({p.refused} expert tensor(s) refused in this {p.kind} pass; {kept})"

    def _check_coverage(self, p: WeightPass) -> None:
        epn, missing = self.experts_per_rank, []
        parts = {proj: 1 for proj in FFN_PROJECTIONS} if self.format == "bf16" else self.row_parts
        for idx, name in enumerate(self.layer_names):
            for proj, n in parts.items():
                for j in range(epn):
                    keys = [(idx, proj, j)] if n == 1 else [(idx, proj, j, k) for k in range(n)]
                    if any(k not in p.written for k in keys):
                        missing.append(f"{name}.{proj}[expert {self.rank * epn + j}]")
        if missing:
            raise config_error(self.rank, f"the checkpoint did not provide {len(missing)} of this rank's "
                               f"{len(self.layer_names) * len(parts) * epn} expert rows (first: {missing[:3]})",
                               len(missing), "load a complete checkpoint of the served model")

    def _note_update_outcome(self, p: WeightPass, ok: bool) -> None:
        self.settled.append(dict(p.summary(), ok=ok))

    def poison_slots(self) -> None:
        """Fill this rank's slot pool with NaN: after a pass no slot holds an expert until a prefetch fills it.

        Quantized formats: integer and FP8 weight rows cannot hold NaN, so their slot rows get zeros and the
        scale rows NaN (bf16/fp32 scales; an E8M0 scale of 0xFF is NaN by the OCP MX spec): a dequantized
        stale slot is NaN either way."""
        for proj in (FFN_PROJECTIONS if self.format == "bf16" else self.shapes):
            for slots in self.store.slot_views(proj):  # push: each layer's slot head too
                if slots.is_floating_point() and slots.dtype.itemsize > 1:
                    slots.fill_(float("nan"))
                elif slots.dtype == torch.uint8 and proj.endswith("_scale"):
                    slots.fill_(0xFF)
                else:
                    slots.zero_()
        self.driver.synchronize()

    # -- views and accounting ----------------------------------------------------------------
    def views(self, idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """BF16 layer ``idx``'s gate, up, down: ``[E+B]`` pull views, or ``[2*epn]`` push views."""
        view = self.store.compute_view
        return view(idx, "gate"), view(idx, "up"), view(idx, "down")

    def named_views(self, idx: int) -> dict[str, torch.Tensor]:
        """Quantized layer ``idx``'s views the experts read: ``{vLLM parameter name: [E+B, ...]}`` (pull), or
        ``{gate, gate_scale, up, up_scale, down, down_scale: [2*epn, ...]}`` (push: own experts, then the
        slots; scales as their data)."""
        return {name: self.data_view(self.store.compute_view(idx, name), name) for name in self.shapes}

    def describe(self) -> dict[str, Any]:
        s = self.store
        return {
            "layers": len(self.layer_names), "layer_names": self.layer_names, "experts": self.num_experts,
            "slots": self.num_slots, "format": self.format, "hidden": self.hidden, "intermediate": self.intermediate,
            "ep_rank": self.rank, "ep_size": self.world_size, "experts_per_rank": self.experts_per_rank,
            "host": self.hosts[self.rank], "hosts": self.hosts, "handle_type": s.symm.decision.handle_type.value,
            "handle_decision": s.symm.decision.reason,
            "driver": getattr(self.driver, "name", type(self.driver).__name__), "granularity": s.granularity,
            "physical_bytes": s.physical_bytes(), "os_bytes": self.os_bytes(),
            "replicated_bytes": s.replicated_bytes(),
            "one_layer_local_bytes": self.one_layer_local_bytes, "push_layout": self.api == "push",
            "collective_rounds": dict(s.symm.comm.rounds), "mappings": s.mapping_count,
            "allocate_seconds": round(self.allocate_seconds, 4), "ready": self.ready, "passes": list(self.settled),
        }

    def os_bytes(self) -> dict[str, Any] | None:
        """This rank's store bytes as the OS reports them (host driver: the sizes and resident blocks of the
        memfds this rank created, ``fstat``); None on CUDA, where the driver's handles are the record."""
        if getattr(self.driver, "name", None) != "host":
            return None
        from ...memory.accounting import snapshot

        snap = snapshot(self.rank)
        return {"total_bytes": snap.own_bytes, "resident_bytes": snap.own_resident_bytes,
                "by_tag": snap.own_bytes_by_tag, "method": "fstat of this rank's memfds (/proc/self/fd)"}

    def close(self) -> None:
        """Collective (the symmetric memory's teardown). Views already handed out stay valid."""
        if self.closed:
            return
        self.closed = True
        self.store.close()
        if self._owns_driver:
            self.driver.close()  # CUDA: the context retain goes once the last view is gone
