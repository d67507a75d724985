"""The MoonEP all2all manager, buffer pool and layer conversion that the plugin puts into vLLM 0.33.0.

Imported only once vLLM's ``all2all`` module is (see ``plugin.py``).

* :class:`ShardedMoonEPAll2AllManager` replaces
  ``vllm.distributed.device_communicators.all2all.MoonEPAll2AllManager``
  (looked up by name when the communicator is built). It picks the Buffer
  (``MOONEP_EP_BUFFER``), runs the system check, builds buffer pools that
  serve that Buffer, and owns the model-wide expert store, released by
  :meth:`destroy`.
* :func:`convert_moonep_layer` replaces the MOONEP branch of
  ``convert_to_unquantized_kernel_format``: instead of all-gathering every
  rank's experts into a replicated ``[E+B]`` copy, it copies the local
  experts into this rank's pages of the store and returns ``[E+B]`` views
  whose rows ``[0, E)`` map the owners' memory and rows ``[E, E+B)`` the
  shared slot pool. vLLM then rebinds ``w13_weight``/``w2_weight`` to the
  gate/down views (which frees the original local parameters) and
  ``MoonEPExperts`` picks up ``layer._moonep_weight_layout``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from vllm.distributed.device_communicators.all2all import MoonEPAll2AllManager
from vllm.distributed.device_communicators.base_device_communicator import All2AllManagerBase, Cache
from vllm.model_executor.layers.fused_moe.prepare_finalize import moonep as vllm_moonep

from ..errors import ConfigError
from ..memory.group import GroupComm
from .buffers import select_buffer, system_check
from .sharded import ModelExpertStore
from .stats import STATS, stats_dir

logger = logging.getLogger("vllm.moonep_ep")


def _device_type() -> str:
    from vllm.platforms import current_platform

    return "cuda" if current_platform.is_cuda_alike() else "cpu"


class InstrumentedBuffer:
    """Wraps a Buffer (reference or real): checks the store is complete before the first
    prefetch and, with stats on, counts the slots filled from remote owners."""

    def __init__(self, inner: Any, manager: "ShardedMoonEPAll2AllManager"):
        self._inner = inner
        self._manager = manager
        self._checked = False
        #: ``(slot, expert, owner)`` of the last prefetch (recorded with stats on).
        self.last_slots: list[tuple[int, int, int]] = []

    @property
    def _ctx(self) -> Any:  # vLLM reads _ctx["NvS"]
        return self._inner._ctx

    def dispatch(self, *args: Any, **kwargs: Any) -> Any:
        return self._inner.dispatch(*args, **kwargs)

    def combine(self, *args: Any, **kwargs: Any) -> Any:
        return self._inner.combine(*args, **kwargs)

    def prefetch_weight(self, plan: Any = None, async_finish: bool = False, **weights: Any) -> Any:
        if not self._checked:
            self._manager.check_ready_for_prefetch(weights.get("full_gate_weight"))
            self._checked = True
        out = self._inner.prefetch_weight(plan=plan, async_finish=async_finish, **weights)
        if stats_dir() is not None and plan is not None:
            store = self._manager.expert_store
            rank = self._manager.rank
            epn = store.experts_per_rank if store is not None else self._manager.num_experts_hint
            row = [int(e) for e in plan.experts_to_copy[rank].tolist()]
            STATS.record_prefetch(row, epn, rank)
            self.last_slots = [(b, e, e // epn) for b, e in enumerate(row) if e >= 0]
        return out

    def destroy(self) -> None:
        self._inner.destroy()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class ShardedBufferPool(vllm_moonep.MoonEPBufferPool):
    """vLLM's power-of-two buffer pool, serving the Buffer class the manager chose."""

    def __init__(self, buffer_kwargs: dict[str, Any], max_tokens_per_rank: int, *, buffer_cls: Any,
                 manager: "ShardedMoonEPAll2AllManager"):
        super().__init__(buffer_kwargs, max_tokens_per_rank)
        self._buffer_cls = buffer_cls
        self._manager = manager

    def get(self, num_tokens: int) -> tuple[int, Any]:
        capacity = self.capacity_for(num_tokens)
        buffer = self._buffers.get(capacity)
        if buffer is None:
            buffer = InstrumentedBuffer(self._buffer_cls(S=capacity, **self._kwargs), self._manager)
            self._buffers[capacity] = buffer
        return capacity, buffer


class ShardedMoonEPAll2AllManager(MoonEPAll2AllManager):
    """vLLM's MoonEP all2all manager with moonep_ep's buffer choice and the model-wide expert store."""

    def __init__(self, cpu_group: Any, tcp_store_group: Any = None, device_group: Any = None):
        device_type = _device_type()
        # Lockstep: a rank missing a capability fails every rank with every rank's reason,
        # instead of leaving the others waiting in the EP group's next collective.
        with GroupComm(cpu_group).step("MoonEP backend selection (moonep_ep system check)"):
            self.buffer_choice = select_buffer(device_type)
            if self.buffer_choice.kind == "moonep":
                from vllm.utils.import_utils import check_moonep_system_support

                check_moonep_system_support()
            self.capabilities = system_check(device_type, self.buffer_choice.kind)
        All2AllManagerBase.__init__(self, cpu_group, tcp_store_group)
        self._device_group = device_group
        self.handle_cache = Cache()
        self.device_type = device_type
        self.expert_store: ModelExpertStore | None = None
        self.num_experts_hint = 1
        try:
            from vllm.config import get_current_vllm_config_or_none

            self.vllm_config = get_current_vllm_config_or_none()
        except Exception:  # noqa: BLE001
            self.vllm_config = None
        logger.info("moonep_ep: MoonEP all2all manager (sharded expert layout, %s buffer) on %d EP ranks",
                    self.buffer_choice.kind, self.world_size)

    def get_handle(self, kwargs: dict[str, Any]) -> Any:
        buffer_kwargs = self._make_buffer_kwargs(**kwargs)
        self.num_experts_hint = max(1, buffer_kwargs["E"] // max(1, self.world_size))

        def make_pool(**kw: Any) -> ShardedBufferPool:
            return ShardedBufferPool(kw, max_tokens_per_rank=kw["S"], buffer_cls=self.buffer_choice.cls,
                                     manager=self)

        return self.handle_cache.get_or_create(buffer_kwargs, make_pool)

    # -- the model-wide store ----------------------------------------------------------------
    def moe_layer_names(self) -> list[str]:
        from vllm.config import get_current_vllm_config_or_none

        for cfg in (get_current_vllm_config_or_none(), self.vllm_config):
            names = list(getattr(getattr(cfg, "compilation_config", None), "static_all_moe_layers", []) or [])
            if names:
                return names
        return []

    def model_store(self, layer: Any, num_experts: int, w13_local: torch.Tensor) -> ModelExpertStore:
        """The store, allocated (collectively) on the first MoonEP layer, for every MoE layer of the model."""
        if self.expert_store is None:
            names = self.moe_layer_names()
            name = getattr(layer, "layer_name", None)
            if name not in names:
                raise ConfigError(
                    f"[rank {self.rank}] moonep_ep: MoE layer {name!r} is not among the model's registered MoE "
                    f"layers ({len(names)} found in compilation_config.static_all_moe_layers), so the model-wide "
                    "store cannot be sized. Fix: build the model through vLLM's model loader")
            _, two_i, hidden = w13_local.shape
            self.expert_store = ModelExpertStore(
                layer_names=names, num_experts=num_experts, hidden=hidden, intermediate=two_i // 2,
                num_slots=vllm_moonep.MOONEP_DEFAULT_NUM_PREFETCH_SLOTS, group=self.cpu_group,
                device=w13_local.device, dtype=w13_local.dtype)
            STATS.set(ep_rank=self.rank, ep_size=self.world_size, buffer=self.buffer_choice.kind,
                      device=str(w13_local.device), store=self.expert_store.describe())
            logger.info("moonep_ep: sharded MoonEP expert store for %d MoE layers: %s on this rank vs %s "
                        "replicated (one handle exchange for the whole model)", len(names),
                        _gib(self.expert_store.store.physical_bytes()["total_bytes"]),
                        _gib(self.expert_store.store.replicated_bytes()))
        return self.expert_store

    def check_ready_for_prefetch(self, full_gate_weight: Any) -> None:
        store = self.expert_store
        if store is None:
            return  # replicated layout (MOONEP_EP_LAYOUT=replicated): nothing to check
        if not store.ready:
            raise ConfigError(f"[rank {self.rank}] moonep_ep: MoonEP prefetch before every MoE layer was loaded "
                              f"into the sharded store (missing: {store.missing_layers()[:4]}). Fix: load all "
                              "MoE layers of the model before the first forward")
        if stats_dir() is not None:
            STATS.check_freed()
            STATS.flush()

    def destroy(self) -> None:
        super().destroy()  # the buffer pools first: they may still reference the views
        if self.expert_store is not None:
            try:
                self.expert_store.close()
            finally:
                self.expert_store = None


def _gib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def convert_moonep_layer(layer: Any, moe_config: Any, w13_weight: torch.Tensor,
                         w2_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The MOONEP branch of ``convert_to_unquantized_kernel_format``, over the sharded store."""
    from vllm.distributed import get_ep_group

    ep_group = get_ep_group()
    comm = ep_group.device_communicator
    manager = getattr(comm, "all2all_manager", None)
    if not isinstance(manager, ShardedMoonEPAll2AllManager):
        hint = ("on CPU set MOONEP_EP_CPU=1 so the CPU communicator builds it"
                if _device_type() == "cpu" else "check that the moonep_ep plugin loaded in this worker")
        raise ConfigError(f"moonep_ep: the MoonEP all2all manager of the EP group is "
                          f"{type(manager).__name__}, not moonep_ep's, so the sharded layout has no owner. "
                          f"Fix: {hint}")
    recorder = None
    if stats_dir() is not None:
        from ..ops.instrument import CollectiveRecorder

        I = w13_weight.shape[1] // 2
        recorder = CollectiveRecorder(weights=[w13_weight, w13_weight[:, :I], w13_weight[:, I:], w2_weight])
    t0 = time.perf_counter()
    expert_ids = _local_expert_ids(layer)
    if recorder is not None:
        recorder.__enter__()
    try:
        store = manager.model_store(layer, moe_config.num_experts, w13_weight)
        gate, up, down = store.adopt(layer.layer_name, w13_weight.data, w2_weight.data, expert_ids=expert_ids)
    finally:
        if recorder is not None:
            recorder.__exit__(None, None, None)
    layout = vllm_moonep.MoonEPExpertWeightLayout(full_gate_weight=gate, full_up_weight=up, full_down_weight=down,
                                                  num_prefetch_slots=store.num_slots)
    layer._moonep_weight_layout = layout
    if stats_dir() is not None:
        if recorder is not None:
            STATS.add_collectives(recorder.by_op())
        STATS.watch_original(w13_weight.data, w2_weight.data)
        load = STATS.data["load"]
        load["layers_adopted"] += 1
        load["seconds"] = round(load["seconds"] + time.perf_counter() - t0, 4)
        STATS.set(store=store.describe())
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
