"""The MoonEP all2all manager, buffer pool and layer conversion that the plugin puts into vLLM 0.33.0.

Imported only once vLLM's ``all2all`` module is (see ``plugin.py``).

* :class:`ShardedMoonEPAll2AllManager` replaces
  ``vllm.distributed.device_communicators.all2all.MoonEPAll2AllManager``
  (looked up by name when the communicator is built). It refuses sleep mode
  with the sharded layout, picks the Buffer (``MOONEP_EP_BUFFER``), runs the
  system check, agrees with every EP rank on each setting that decides a
  collective (``buffers.agree_decisions``: buffer, API, layout, padding, the
  cost model's inputs, the pool's largest capacity; kept in ``decisions``),
  builds buffer pools that serve that Buffer, and owns the
  expert stores (one per model, allocated at the end of the model's
  construction by ``loading.bind_model``), released by :meth:`destroy`.
* :func:`convert_moonep_layer` replaces the MOONEP branch of
  ``convert_to_unquantized_kernel_format``: the layer's experts are already
  in the store (vLLM's loader wrote them there), so it returns the layer's
  ``[E+B]`` views — rows ``[0, E)`` map the owners' memory, rows ``[E, E+B)``
  the shared slot pool — without a copy or a collective. vLLM then rebinds
  ``w13_weight``/``w2_weight`` to the gate/down views and ``MoonEPExperts``
  picks up ``layer._moonep_weight_layout``. On a weight update vLLM calls it
  again and gets the same views: the new rows were written in place.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from vllm.distributed.device_communicators.all2all import MoonEPAll2AllManager
from vllm.distributed.device_communicators.base_device_communicator import All2AllManagerBase, Cache
from vllm.model_executor.layers.fused_moe.prepare_finalize import moonep as vllm_moonep

from ..errors import ConfigError
from ..ops.moonep import prefetch as slot_copies
from ..memory.group import GroupComm, register_peers
from .buffers import agree_decisions, local_decisions, select_buffer, system_check
from .gc_heap import freeze_heap_at_exit, freeze_startup_heap
from .store.loading import BINDING_ATTR, TARGET_DEVICE_ATTR, refuse_mtp_draft, refuse_sleep_mode
from .store.sharded import ModelExpertStore
from .observe.deferred import dp_token_counts
from .observe.stats import STATS, stats_dir

logger = logging.getLogger("vllm.moonep_ep")


def _device_type() -> str:
    from vllm.platforms import current_platform

    return "cuda" if current_platform.is_cuda_alike() else "cpu"


class SlotFillBuffer:
    """The Buffer (reference or real) as vLLM's pool hands it out, deciding how each prefetch fills the slots.

    ``dispatch`` and ``combine`` go straight to the Buffer. ``prefetch_weight`` checks once that the store is
    complete, then fills the slots one of two ways: quantized views (INT4, MXFP4, FP8 block) through the
    store's own copy of each slot's weights and scales (``quantized/engine.py``), everything else through the
    Buffer's prefetch, overlapped with the own experts (``experts/overlap.py``); either way the fill's event
    is handed to the experts, which wait for it before reading a slot row. With stats on it also counts the
    slots filled from remote owners.
    """

    def __init__(self, inner: Any, manager: "ShardedMoonEPAll2AllManager"):
        self._inner = inner
        self._manager = manager
        self._checked = False
        #: The last prefetch's row of the slot table and ``E/R`` (kept with stats on): :attr:`last_slots`.
        self._last_row: tuple[Any, int] | None = None

    @property
    def last_slots(self) -> list[tuple[int, int, int]]:
        """``(slot, expert, owner)`` of the last prefetch (with stats on), read from the device when asked: the
        prefetch only keeps its row (issue 45: no device read in the MoE op)."""
        if self._last_row is None:
            return []
        row, epn = self._last_row
        return [(b, e, e // epn) for b, e in enumerate(int(x) for x in row.tolist()) if e >= 0]

    @property
    def _ctx(self) -> Any:  # vLLM reads _ctx["NvS"]
        return self._inner._ctx

    def dispatch(self, *args: Any, **kwargs: Any) -> Any:
        return self._inner.dispatch(*args, **kwargs)

    def combine(self, *args: Any, **kwargs: Any) -> Any:
        return self._inner.combine(*args, **kwargs)

    def prefetch_weight(self, plan: Any = None, async_finish: bool = False, **weights: Any) -> Any:
        if not self._checked:
            self._manager.check_ready_for_prefetch()
            self._checked = True
        from .quantized.engine import prefetch_quantized, quantized_views_for

        quantized = quantized_views_for(weights.get("full_gate_weight"))
        copied = None
        if quantized is not None and plan is not None:
            # Quantized views: each slot's weights and scales pulled through the mapped rows (the
            # reference/real buffer's prefetch moves bf16/int8/uint8 weights with 16 KiB-multiple scales only).
            from .experts.overlap import deliver_slot_fill

            _, views, num_experts = quantized
            rank = self._manager.rank
            # The plan's device row: the copies read it on the device, the counts when first read (issue 45)
            filled = prefetch_quantized(views, plan.experts_to_copy[rank], num_experts, rank,
                                        num_experts // self._manager.world_size)
            # The weight and scale events go to the experts' apply, which waits before reading a slot row.
            out = deliver_slot_fill(filled.pop("event"), async_finish)
            copied = filled
        else:
            from .experts.overlap import prefetch

            out = prefetch(self._inner, plan, async_finish, weights)  # own experts overlap it (overlap.py)
        if stats_dir() is not None and plan is not None:
            rank = self._manager.rank
            epn = self._experts_per_rank()  # this Buffer's model's (a draft model's store has its own)
            store = self._manager.expert_store
            last = copied or getattr(self._inner, "last_prefetch", None)
            # A snapshot, analysed after the step (observe/deferred.py), the fill's byte counts with it (they read
            # the fill's device table): nothing here reads the device.
            STATS.defer_prefetch(plan, rank, epn, copied=last, real_tokens=dp_token_counts(),
                                 hosts=store.hosts if store else None, counts=lambda: _count_quantized_fill(last))
            self._last_row = (plan.experts_to_copy[rank].clone(), epn)
        return out

    def _experts_per_rank(self) -> int:
        """``E/R`` of the model this Buffer serves (its own arguments), not of the manager's first store."""
        epn = getattr(self._inner, "epn", None) or getattr(self._inner, "_ctx", {}).get("epn")
        return int(epn) if epn else self._manager.experts_per_rank()

    def destroy(self) -> None:
        self._inner.destroy()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _count_quantized_fill(fill: Any) -> None:
    """Weight and scale bytes of one quantized fill, apart, into the stats (at the deferred analysis): a pull
    fill counts its own; a quantized push is counted by the owner per tensor, every byte into another rank."""
    if fill is None:
        return
    if hasattr(fill, "scale_bytes"):
        STATS.record_quantized_fill(fill.weight_bytes, fill.scale_bytes, fill.remote_weight_bytes,
                                    fill.remote_scale_bytes)
    elif getattr(fill, "api", None) == "push":
        by_tensor = getattr(fill, "bytes_by_tensor", None) or {}
        scales = sum(n for name, n in by_tensor.items() if name.endswith("_scale"))
        if scales:
            weights = sum(by_tensor.values()) - scales
            STATS.record_quantized_fill(weights, scales, weights, scales)


class ShardedBufferPool(vllm_moonep.MoonEPBufferPool):
    """vLLM's power-of-two buffer pool, serving the Buffer class the manager chose."""

    def __init__(self, buffer_kwargs: dict[str, Any], max_tokens_per_rank: int, *, buffer_cls: Any,
                 manager: "ShardedMoonEPAll2AllManager"):
        super().__init__(buffer_kwargs, max_tokens_per_rank)
        self._buffer_cls = buffer_cls
        self._manager = manager
        #: The MoonEP API its buffers speak: "push" makes vLLM build the push prepare/finalize
        #: (``prepare_finalize/push.py``).
        self.api = manager.buffer_choice.api
        self._decode_sizes: list[int] = []
        self._decode_sizes = self.build_decode_buffers()

    def build_decode_buffers(self) -> list[int]:
        """Build, now, the buffer of every capacity a decode step can pick (up to vLLM's ``max_num_seqs`` times
        one plus the speculative tokens): building one is a collective with host reads, which vLLM's pool
        would otherwise run inside the first decode step of each new batch size (and no CUDA graph can hold).
        Collective: every rank builds its pools in the same order (vLLM's ``get_handle`` at model set-up).
        Returns the capacities built."""
        from .experts.overlap import decode_token_bound

        bound = decode_token_bound(getattr(self._manager, "vllm_config", None))
        if not bound:
            return []
        sizes = sorted({self.capacity_for(n) for n in [1 << i for i in range(bound.bit_length())] + [bound]})
        for capacity in sizes:
            self.get(capacity)
        return sizes

    def get(self, num_tokens: int) -> tuple[int, Any]:
        capacity = self.capacity_for(num_tokens)
        buffer = self._buffers.get(capacity)
        if buffer is None:
            if slot_copies.stream_capturing():  # the module's: the capture emulator answers it
                raise RuntimeError(
                    f"moonep_ep: rank {self._manager.rank}: a MoonEP Buffer of capacity {capacity} (a step of "
                    f"{num_tokens} tokens) would be built inside a CUDA graph capture; building one is a "
                    "collective with host reads and memory mapping, which a capture cannot hold. Fix: let a warm-up "
                    "step of that size run before the capture (-cc.cudagraph_num_of_warmups=1, which the plugin "
                    "sets for full decode graphs), or capture no size above the decode bound "
                    f"({self._decode_sizes or 'none'} are built at start)")
            kwargs = dict(self._kwargs)
            if self._manager.buffer_choice.kind == "reference":   # the real library has no such argument
                kwargs["lockstep_checks"] = self._manager.decisions.lockstep_checks   # agreed by every rank
            buffer = SlotFillBuffer(self._buffer_cls(S=capacity, **kwargs), self._manager)
            self._buffers[capacity] = buffer
        return capacity, buffer


class ShardedMoonEPAll2AllManager(MoonEPAll2AllManager):
    """vLLM's MoonEP all2all manager with moonep_ep's buffer choice and the model-wide expert store."""

    def __init__(self, cpu_group: Any, tcp_store_group: Any = None, device_group: Any = None):
        device_type = _device_type()
        # Lockstep: a rank missing a capability fails every rank with every rank's reason,
        # instead of leaving the others waiting in the EP group's next collective.
        try:
            from vllm.config import get_current_vllm_config_or_none

            self.vllm_config = get_current_vllm_config_or_none()
        except Exception:  # noqa: BLE001
            self.vllm_config = None
        comm = GroupComm(cpu_group)
        with comm.step("MoonEP backend selection (moonep_ep system check)") as selected:
            refuse_sleep_mode(self.vllm_config)
            refuse_mtp_draft(self.vllm_config)
            self.buffer_choice = select_buffer(device_type)
            if self.buffer_choice.kind == "moonep":
                from vllm.utils.import_utils import check_moonep_system_support

                check_moonep_system_support()
            self.capabilities = system_check(device_type, self.buffer_choice.kind)
            selected.share(local_decisions(self.buffer_choice, self.vllm_config))
        # The same step carried every rank's decisions: ranks that would run different collectives all raise
        # here, alike, instead of hanging later. prepare_finalize/padding.py reads these, the same on every rank.
        self.decisions = agree_decisions(selected.gathered, comm.rank)
        All2AllManagerBase.__init__(self, cpu_group, tcp_store_group)
        # Why: full GC passes over the ~700k import-time objects slow the CPU worker's start and, at
        # finalization, outlast vLLM's 5 s worker grace (gc_heap.py); destroy() closes the stores before exit.
        freeze_startup_heap()
        freeze_heap_at_exit()
        self._device_group = device_group
        self.handle_cache = Cache()
        self.device_type = device_type
        #: One store per model built with the sharded layout (a draft model gets its own).
        self.expert_stores: list[ModelExpertStore] = []
        self.num_experts_hint = 1
        if stats_dir() is not None:
            STATS.set(ep_rank=self.rank, ep_size=self.world_size, buffer=self.buffer_choice.kind,
                      moonep_api=self.buffer_choice.api,
                      device=device_type, layout=self.decisions.layout)
        logger.info("moonep_ep: MoonEP all2all manager (sharded expert layout, %s buffer) on %d EP ranks",
                    self.buffer_choice.kind, self.world_size)

    def get_handle(self, kwargs: dict[str, Any]) -> Any:
        buffer_kwargs = self.buffer_choice.api_choice.buffer_kwargs(self._make_buffer_kwargs(**kwargs))
        self.num_experts_hint = max(1, buffer_kwargs["E"] // max(1, self.world_size))

        def make_pool(**kw: Any) -> ShardedBufferPool:
            return ShardedBufferPool(kw, max_tokens_per_rank=kw["S"], buffer_cls=self.buffer_choice.cls,
                                     manager=self)

        return self.handle_cache.get_or_create(buffer_kwargs, make_pool)

    # -- the expert stores -------------------------------------------------------------------
    @property
    def expert_store(self) -> ModelExpertStore | None:
        """The first model's store (None with the replicated layout or before the model is built)."""
        return self.expert_stores[0] if self.expert_stores else None

    def experts_per_rank(self) -> int:
        store = self.expert_store
        return store.experts_per_rank if store is not None else self.num_experts_hint

    def new_model_store(self, layers: list[Any]) -> ModelExpertStore:
        """Collective: the store for one model's MoonEP layers (``loading.bind_model`` calls it)."""
        from .quantized.engine import FORMAT_ATTR

        first = layers[0]
        fmt = getattr(first, FORMAT_ATTR, "bf16")
        if fmt == "bf16":
            epn_local, two_i, hidden = first.w13_weight.shape
            dtype = first.w13_weight.dtype
            shapes = {(tuple(layer.w13_weight.shape), tuple(layer.w2_weight.shape), layer.w13_weight.dtype,
                       layer.moe_config.num_experts) for layer in layers}
        else:  # quantized: the dims from the MoE config, the tensors from layout.formats
            hidden, two_i, dtype = first.moe_config.hidden_dim, 2 * first.moe_config.intermediate_size_per_partition, \
                torch.bfloat16
            shapes = {(getattr(layer, FORMAT_ATTR, "bf16"), layer.moe_config.hidden_dim,
                       layer.moe_config.intermediate_size_per_partition, layer.moe_config.num_experts)
                      for layer in layers}
        api = self.buffer_choice.api_choice
        epn = first.moe_config.num_experts // max(1, self.world_size)
        store = ModelExpertStore(
            layer_names=[layer.layer_name for layer in layers], num_experts=first.moe_config.num_experts,
            hidden=hidden, intermediate=two_i // 2,
            # push: E/R slots and the [R, epn] / [2*epn] views over the same pages (moonep.md §2.7)
            num_slots=api.num_slots(epn, vllm_moonep.MOONEP_DEFAULT_NUM_PREFETCH_SLOTS), api=api.api,
            group=self.cpu_group, device=getattr(first, TARGET_DEVICE_ATTR), dtype=dtype,
            local_expert_ids=[_local_expert_ids(layer) for layer in layers], layer_shapes=shapes, fmt=fmt)
        self.expert_stores.append(store)
        if self._device_group is not None:  # the Buffer's group (vLLM passes it the device group): same ranks
            register_peers(self._device_group, store.peers)
        if stats_dir() is not None:
            STATS.set(store=store.describe())
        logger.info("moonep_ep: sharded MoonEP expert store for %d MoE layers, allocated before any weight is "
                    "read: %s on this rank vs %s replicated (one handle exchange for the whole model)",
                    len(layers), _gib(store.store.physical_bytes()["total_bytes"]),
                    _gib(store.store.replicated_bytes()))
        return store

    def store_bytes(self) -> int:
        """Physical bytes of every store of this rank (from the driver's handles)."""
        return sum(s.store.physical_bytes()["total_bytes"] for s in self.expert_stores if not s.closed)

    def check_ready_for_prefetch(self) -> None:
        not_ready = [s for s in self.expert_stores if not s.ready]
        if not_ready:
            raise ConfigError(f"[rank {self.rank}] moonep_ep: MoonEP prefetch before the model's expert weights "
                              f"were loaded into the sharded store ({not_ready[0].layer_names[:2]}…). Fix: load "
                              "the model's weights (vLLM's model loader) before the first forward")
        if stats_dir() is not None:
            STATS.flush()

    def destroy(self) -> None:
        super().destroy()  # the buffer pools first: they may still reference the views
        from ..ops.moonep.prefetch import land_all
        from .quantized.engine import forget_layouts

        land_all()  # slot fills still queued on the default side stream (CPU) land before the stores close
        forget_layouts()
        stores, self.expert_stores = self.expert_stores, []
        for store in stores:
            store.close()


def _gib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def convert_moonep_layer(layer: Any, moe_config: Any, w13_weight: torch.Tensor,
                         w2_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The MOONEP branch of ``convert_to_unquantized_kernel_format``, over the sharded store.

    The experts are already in the store: return the layer's ``[E+B]`` gate
    and down views (and stash the layout with the up view), on the first load
    and on every update alike. Local, no collective."""
    binding = getattr(layer, BINDING_ATTR, None)
    if binding is None:
        raise ConfigError(f"moonep_ep: MoE layer {getattr(layer, 'layer_name', '?')} reached MoonEP's sharded "
                          "conversion without a store: it was not built by vLLM's model loader with the plugin "
                          "active (its expert parameters must be created by UnquantizedFusedMoEMethod."
                          "create_weights and the model by BaseModelLoader.create_model). Fix: build the model "
                          "through vLLM's model loader, or set MOONEP_EP_LAYOUT=replicated")
    store, idx = binding
    if not store.ready:
        raise ConfigError(f"[rank {store.rank}] moonep_ep: MoE layer {layer.layer_name} is converted before the "
                          "model's expert weights were loaded through its load_weights (e.g. load_format=dummy "
                          "fills no store). Fix: load a real checkpoint with vLLM's default loader, or set "
                          "MOONEP_EP_LAYOUT=replicated")
    if store.api == "push":  # the push API: the experts read [2*epn] rows (own experts, then slots)
        from .prepare_finalize.push import make_push_layout

        if getattr(layer, "_moonep_weight_layout", None) is None:
            layer._moonep_weight_layout = make_push_layout(store, idx)
        layout = layer._moonep_weight_layout
        gate, down = layout.full_gate_weight, layout.full_down_weight
    else:
        gate, up, down = store.views(idx)
    if getattr(layer, "_moonep_weight_layout", None) is None:
        layer._moonep_weight_layout = vllm_moonep.MoonEPExpertWeightLayout(
            full_gate_weight=gate, full_up_weight=up, full_down_weight=down, num_prefetch_slots=store.num_slots)
        if stats_dir() is not None:  # the store's summary was recorded when its pass settled
            STATS.data["load"]["layers_converted"] += 1
            STATS.flush()
    return gate, down


def _local_expert_ids(layer: Any) -> list[int] | None:
    """Global ids of the experts this rank loaded (from the layer's expert map), or None if unknown."""
    try:
        emap = layer.expert_map
    except Exception:  # noqa: BLE001 - the property may need a built kernel
        emap = getattr(layer, "_expert_map", None)
    if not isinstance(emap, torch.Tensor):
        return None
    emap = emap.cpu()
    local = [(int(emap[g]), int(g)) for g in torch.nonzero(emap >= 0).flatten().tolist()]
    return [g for _, g in sorted(local)]  # global id of local expert 0, 1, ...



def _bind_when_the_plugin_asked() -> None:
    """manager.py imported before vLLM's all2all: the import above ran the plugin's hook while this module's
    classes did not exist yet, and the hook left a flag on vLLM's module for this binding."""
    import sys

    all2all = sys.modules.get("vllm.distributed.device_communicators.all2all")
    if getattr(all2all, "moonep_ep_bind_pending", False):
        all2all.MoonEPAll2AllManager = ShardedMoonEPAll2AllManager
        all2all.moonep_ep_bind_pending = False


_bind_when_the_plugin_asked()
