"""The model-wide sharded MoonEP expert store as vLLM's MoE layers see it.

vLLM converts MoE layers one at a time (``process_weights_after_loading``
walks ``model.named_modules()`` in the same order on every rank). The store
must nevertheless exchange the handles of *all* layers and of the shared
slot pool in one collective round, so it is allocated whole at the **first**
MoonEP layer, from what is known by then:

* the model's MoE layer names, in construction order: vLLM registers every
  MoE layer in ``compilation_config.static_all_moe_layers`` while the model
  is built, i.e. before any weight is loaded (so ``L`` is exact, including
  models with dense layers in between);
* ``E`` from the layer's ``moe_config.num_experts``; ``H`` and ``I`` from
  the local ``w13 [epn, 2I, H]``; ``B`` = vLLM's MoonEP slot count
  (``MOONEP_DEFAULT_NUM_PREFETCH_SLOTS``, what the buffers are built with).

Every layer (the first included) then only copies its local experts into its
own pages (gate and up split from ``w13``, down from ``w2``); no rank writes
or reads another's rows during loading, and no weight crosses the process
group. When the last layer is in, one barrier makes all rows final before
any prefetch can read a peer's rows.

The ranks agree on the model description (names and shapes) in one
metadata collective before allocating, so a mismatch raises the same error
on every rank instead of hanging.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from ..errors import ConfigError, config_error
from ..layout.store import ShardedExpertStore, ffn_projections
from ..memory.group import GroupComm
from .buffers import make_store_driver

#: MoonEP kernels tile both expert dims by 128 (vLLM's MOONEP_WEIGHT_TILE).
WEIGHT_TILE = 128


class ModelExpertStore:
    """All MoonEP MoE layers of one model: one :class:`ShardedExpertStore` + one shared slot pool.

    Collective constructor (every EP rank, same arguments). ``group`` is the
    EP group's CPU (gloo) group: it carries metadata and the handle exchange
    only.
    """

    def __init__(self, *, layer_names: Sequence[str], num_experts: int, hidden: int, intermediate: int,
                 num_slots: int, group: Any, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                 driver: Any = None):
        t0 = time.perf_counter()
        self.comm = GroupComm(group)
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self.layer_names = list(layer_names)
        self.index = {name: i for i, name in enumerate(self.layer_names)}
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.num_slots, self.dtype, self.device = num_slots, dtype, torch.device(device)
        desc = (tuple(self.layer_names), num_experts, hidden, intermediate, num_slots, str(dtype),
                self.device.type)
        with self.comm.step("check the MoonEP model description") as described:
            self._validate()
            described.share(desc)
        everyone = described.gathered
        differ = [r for r, d in enumerate(everyone) if d != everyone[0]]
        if differ:  # every rank sees the same list: every rank raises alike
            raise ConfigError(f"[rank {self.rank}] EP ranks {differ} describe the MoE layers differently from "
                              f"rank 0 ({everyone[0][1:]} vs {everyone[differ[0]][1:]}, "
                              f"{len(everyone[0][0])} vs {len(everyone[differ[0]][0])} layers). Fix: load the "
                              "same model with the same settings on every rank")
        self._owns_driver = driver is None  # a driver made here is closed here (close())
        self.driver = driver if driver is not None else make_store_driver(self.device, self.rank)
        self.store = ShardedExpertStore(num_layers=len(self.layer_names), num_experts=num_experts,
                                        projections=ffn_projections(hidden, intermediate, dtype),
                                        num_slots=num_slots, driver=self.driver, group=group)
        self.loaded: set[int] = set()
        self.ready = False
        self.closed = False
        self.allocate_seconds = time.perf_counter() - t0

    def _validate(self) -> None:
        r, E, R = self.rank, self.num_experts, self.world_size
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
        if self.dtype != torch.bfloat16:
            raise config_error(r, "MoonEP's sharded layout holds bf16 expert weights", self.dtype,
                               "load the model with --dtype bfloat16 (quantized models need another backend)")
        if not 0 < self.num_slots <= E:
            raise config_error(r, "the MoonEP slot count B must be in [1, E]", self.num_slots, "use vLLM's default")

    # -- per layer ---------------------------------------------------------------------------
    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.world_size

    def adopt(self, layer_name: str, w13_local: torch.Tensor, w2_local: torch.Tensor,
              expert_ids: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copy one layer's local experts into this rank's pages; return its ``[E+B]`` gate, up, down views.

        ``w13_local`` ``[epn, 2I, H]`` (gate rows first), ``w2_local``
        ``[epn, H, I]``: this rank's experts ``[rank*epn, (rank+1)*epn)``
        (vLLM's linear placement; ``expert_ids``, when given, must be
        exactly those). Collective in lockstep (a bad layer on one rank raises
        on every rank; metadata only, no weight crosses the group); adopting
        the last layer ends with one barrier (all rows final everywhere).
        """
        with self.comm.step(f"adopt MoE layer {layer_name}"):  # a bad layer on one rank raises on all
            idx = self._check_layer(layer_name, w13_local, w2_local, expert_ids)
        I = self.intermediate
        self.store.load_layer(idx, {"gate": w13_local[:, :I], "up": w13_local[:, I:], "down": w2_local})
        self.loaded.add(idx)
        if len(self.loaded) == len(self.layer_names):
            self.store.finish_loading()  # barrier: every owner's rows are final before any prefetch
            self.ready = True
        return self.views(idx)

    def _check_layer(self, layer_name: str, w13_local: torch.Tensor, w2_local: torch.Tensor,
                     expert_ids: Sequence[int] | None) -> int:
        r, epn, I, H = self.rank, self.experts_per_rank, self.intermediate, self.hidden
        if self.closed:
            raise config_error(r, "the MoonEP expert store is closed", layer_name, "rebuild the engine")
        if layer_name not in self.index:
            raise config_error(r, "unknown MoE layer", layer_name,
                               f"adopt one of the {len(self.layer_names)} layers the store was built for")
        idx = self.index[layer_name]
        if idx in self.loaded:
            raise config_error(r, f"MoE layer {layer_name} was already loaded into the sharded MoonEP store "
                               "(in-place weight reload is not supported)", layer_name,
                               "restart the engine to load new weights")
        if expert_ids is not None:
            want = list(range(r * epn, (r + 1) * epn))
            if list(expert_ids) != want:
                raise config_error(r, f"layer {layer_name}: this rank holds experts {list(expert_ids)[:8]}…, "
                                   f"but MoonEP's sharded layout needs the linear placement {want[0]}..{want[-1]}",
                                   list(expert_ids), "use --expert-placement-strategy linear without EPLB")
        if tuple(w13_local.shape) != (epn, 2 * I, H) or tuple(w2_local.shape) != (epn, H, I):
            raise config_error(r, f"layer {layer_name}: local expert weights have the wrong shapes",
                               (tuple(w13_local.shape), tuple(w2_local.shape)),
                               f"expect w13 [{epn}, {2 * I}, {H}] and w2 [{epn}, {H}, {I}] (E % EP size must be 0)")
        if w13_local.dtype != self.dtype or w2_local.dtype != self.dtype:
            raise config_error(r, f"layer {layer_name}: expert weights must be {self.dtype}",
                               (w13_local.dtype, w2_local.dtype), "load the model with --dtype bfloat16")
        if w13_local.device.type != self.device.type:
            raise config_error(r, f"layer {layer_name}: weights on {w13_local.device}, store on {self.device}",
                               w13_local.device, "load every MoE layer on the same device")
        return idx

    def views(self, idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.store
        return s.gen_a(idx, "gate"), s.gen_a(idx, "up"), s.gen_a(idx, "down")

    def missing_layers(self) -> list[str]:
        return [n for i, n in enumerate(self.layer_names) if i not in self.loaded]

    # -- accounting --------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        s = self.store
        return {
            "layers": len(self.layer_names), "layer_names": self.layer_names, "experts": self.num_experts,
            "slots": self.num_slots, "hidden": self.hidden, "intermediate": self.intermediate,
            "ep_rank": self.rank, "ep_size": self.world_size, "experts_per_rank": self.experts_per_rank,
            "driver": getattr(self.driver, "name", type(self.driver).__name__), "granularity": s.granularity,
            "physical_bytes": s.physical_bytes(), "replicated_bytes": s.replicated_bytes(),
            "collective_rounds": dict(s.symm.comm.rounds), "mappings": s.mapping_count,
            "allocate_seconds": round(self.allocate_seconds, 4),
        }

    def close(self) -> None:
        """Collective (the symmetric memory's teardown). Views already handed out stay valid."""
        if self.closed:
            return
        self.closed = True
        self.store.close()
        if self._owns_driver:
            self.driver.close()  # CUDA: the context retain goes once the last view is gone
