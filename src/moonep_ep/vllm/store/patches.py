"""Where vLLM is patched so that MoonEP layers keep their experts in the sharded store (``plugin.py``'s convention).

Every patch acts for MoonEP layers only (the MOONEP backend, expert parallelism over more than one rank, the
sharded layout); every other layer takes vLLM's code unchanged.

* ``convert_to_unquantized_kernel_format`` (in ``oracle.unquantized`` and in ``unquantized_fused_moe_method``,
  which imports the name): :func:`~moonep_ep.vllm.manager.convert_moonep_layer` (sharded store) instead of
  vLLM's all-gather. ``MOONEP_EP_LAYOUT=replicated`` keeps vLLM's all-gather (for A/B runs).
* ``UnquantizedFusedMoEMethod.create_weights``: with the sharded layout, vLLM's own ``create_weights`` runs on
  the ``meta`` device and the expert parameters get the plugin's loader, which writes straight into the store
  (``loading.py``).
* ``base_loader.initialize_model`` (called by ``BaseModelLoader.create_model``): when it returns, the model's
  MoonEP layers get their store, allocated and exchanged before any weight is read (``loading.bind_model``).
* ``reload_weights`` where it is defined and as the GPU model runners (and the CPU runner, which inherits them)
  imported it: a reload from disk is checked against the store's shapes from the checkpoint's headers before
  vLLM reads a tensor; kernel-format reloads are refused for the sharded layout.
* ``GPUModelRunner.load_model``: the store's physical bytes are added to the model memory vLLM reports (its
  KV-cache sizing already sees them as device memory in use, from ``cuMemGetInfo``).
"""

from __future__ import annotations

import logging
import sys
from types import ModuleType
from typing import Any

from ... import envs
from ..hooks import RUNNER_MODULES, Install, Mark, Note, Patch, is_wrapped

logger = logging.getLogger("vllm.moonep_ep")

MOD_ORACLE = "vllm.model_executor.layers.fused_moe.oracle.unquantized"
MOD_METHOD = "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method"
MOD_BASE_LOADER = "vllm.model_executor.model_loader.base_loader"
MOD_RELOAD = "vllm.model_executor.model_loader.reload.inplace"


def _ep_size() -> int:
    from vllm.distributed import get_ep_group

    try:
        return get_ep_group().world_size
    except AssertionError:
        return 1


def sharded_manager() -> Any:
    """The EP group's all2all manager, which owns the sharded store; a ConfigError with the fix if it is vLLM's."""
    from vllm.distributed import get_ep_group

    from ...errors import ConfigError
    from ..manager import ShardedMoonEPAll2AllManager

    manager = getattr(get_ep_group().device_communicator, "all2all_manager", None)
    if not isinstance(manager, ShardedMoonEPAll2AllManager):
        hint = ("on CPU set MOONEP_EP_CPU=1 so the CPU communicator builds it" if envs.MOONEP_EP_CPU
                else "check that the moonep_ep plugin loaded in this worker")
        raise ConfigError(f"moonep_ep: the MoonEP all2all manager of the EP group is {type(manager).__name__}, "
                          f"not moonep_ep's, so the sharded expert store has no owner. Fix: {hint}")
    return manager


def _store_bytes() -> int:
    try:
        from vllm.distributed import get_ep_group

        manager = getattr(get_ep_group().device_communicator, "all2all_manager", None)
    except Exception:  # noqa: BLE001 - no EP group: no store
        return 0
    return int(manager.store_bytes()) if hasattr(manager, "store_bytes") else 0


def wrap_convert(module: ModuleType, *, install: Install, mark: Mark, note: Note) -> None:
    """``convert_to_unquantized_kernel_format``: the sharded store for the MOONEP backend, vLLM's otherwise."""
    orig = getattr(module, "convert_to_unquantized_kernel_format", None)
    if orig is None or is_wrapped(orig):
        return
    original = getattr(orig, "__wrapped__", orig)

    def convert_to_unquantized_kernel_format(unquantized_backend: Any, moe_config: Any, w13_weight: Any,
                                             w2_weight: Any, layer: Any = None) -> Any:
        from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

        from .loading import ZERO_COPY_FLAG

        zero_copy = getattr(layer, ZERO_COPY_FLAG, False)
        if (unquantized_backend != UnquantizedMoeBackend.MOONEP or envs.MOONEP_EP_LAYOUT != "sharded"
                or layer is None or (getattr(layer, "_moonep_weight_layout", None) is not None and not zero_copy)
                or _ep_size() <= 1):
            # Other backends, the replicated A/B mode, and vLLM's own error paths
            # (no layer, reload of a replicated layout) take vLLM's code unchanged.
            return original(unquantized_backend, moe_config, w13_weight, w2_weight, layer)
        from ..manager import convert_moonep_layer

        return convert_moonep_layer(layer, moe_config, w13_weight, w2_weight)

    install(module, "convert_to_unquantized_kernel_format", convert_to_unquantized_kernel_format, original,
            f"{module.__name__.rsplit('.', 1)[-1]}.convert_to_unquantized_kernel_format")


def patch_create_weights(module: ModuleType, *, install: Install, mark: Mark, note: Note) -> None:
    """``UnquantizedFusedMoEMethod.create_weights``: placeholders on ``meta`` whose loader fills the store."""
    cls = module.UnquantizedFusedMoEMethod
    orig = cls.create_weights
    if is_wrapped(orig):
        return
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

    def create_weights(self: Any, layer: Any, *args: Any, **kwargs: Any) -> None:
        moonep = getattr(self, "unquantized_backend", None) == UnquantizedMoeBackend.MOONEP and _ep_size() > 1
        if moonep and envs.MOONEP_EP_LAYOUT == "sharded":
            from .loading import create_placeholder_weights

            create_placeholder_weights(orig, self, layer, *args, **kwargs)
            return
        orig(self, layer, *args, **kwargs)
        if moonep:
            from ..observe.stats import STATS

            for name in ("w13_weight", "w2_weight"):
                STATS.watch_expert_tensor(getattr(layer, name, None), "vLLM local parameters")

    install(cls, "create_weights", create_weights, orig, "UnquantizedFusedMoEMethod.create_weights")


def patch_initialize_model(module: ModuleType, *, install: Install, mark: Mark, note: Note) -> None:
    """``base_loader.initialize_model``: the built model's MoonEP layers bound to the store (and to the routing
    record, when it is on)."""
    orig = module.initialize_model
    if is_wrapped(orig):
        return

    def initialize_model(*args: Any, **kwargs: Any) -> Any:
        model = orig(*args, **kwargs)
        from ..observe import routing_record
        from .loading import bind_model, zero_copy_layers

        if zero_copy_layers(model):
            bind_model(model, sharded_manager().new_model_store)
        routing_record.bind_model(model)
        return model

    install(module, "initialize_model", initialize_model, orig, "base_loader.initialize_model")


def patch_reload(module: ModuleType, *, install: Install, mark: Mark, note: Note) -> None:
    """``reload_weights`` where it is defined and where the model runners imported it by name."""
    orig = getattr(module, "reload_weights", None)
    if orig is None or is_wrapped(orig):
        return
    from .loading import wrap_reload_weights

    inplace = sys.modules.get(MOD_RELOAD)
    if inplace is not None and getattr(inplace.reload_weights, "__wrapped__", None) is orig:
        module.reload_weights = inplace.reload_weights  # the runner bound vLLM's function before the patch
    else:
        module.reload_weights = wrap_reload_weights(orig)
    mark(f"{module.__name__.rsplit('.', 1)[-1]}.reload_weights")


def patch_model_memory(module: ModuleType, *, install: Install, mark: Mark, note: Note) -> None:
    """``GPUModelRunner.load_model``: the store's bytes in the model memory vLLM reports."""
    cls = getattr(module, "GPUModelRunner", None)
    if cls is None or is_wrapped(cls.load_model):
        return
    orig = cls.load_model

    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        before = _store_bytes()
        out = orig(self, *args, **kwargs)
        added = _store_bytes() - before
        if added > 0 and hasattr(self, "model_memory_usage"):
            # cuMemCreate memory is outside torch's allocator, which vLLM's model-memory figure reads.
            self.model_memory_usage += added
            logger.info("moonep_ep: model memory includes the sharded MoonEP expert store: %.2f GiB",
                        added / 2**30)
        return out

    install(cls, "load_model", load_model, orig, f"{module.__name__.rsplit('.', 1)[-1]}.GPUModelRunner.load_model")


#: In this order: on ``unquantized_fused_moe_method`` the conversion before ``create_weights``; ``reload.inplace``
#: before the runners, whose patch re-binds its wrapper when they imported vLLM's function first.
PATCHES: tuple[Patch, ...] = (
    Patch(MOD_ORACLE, wrap_convert),
    Patch(MOD_METHOD, wrap_convert),
    Patch(MOD_METHOD, patch_create_weights),
    Patch(MOD_BASE_LOADER, patch_initialize_model),
    Patch(MOD_RELOAD, patch_reload),
    *(Patch(runner, patch) for runner in RUNNER_MODULES
      for patch in (patch_reload, patch_model_memory)),
)
