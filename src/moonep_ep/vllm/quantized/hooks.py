"""The quantized MoE methods whose experts moonep_ep holds in the sharded store: where vLLM is patched.

One patch per vLLM module, declared in :data:`PATCHES` (``plugin.py``'s
convention: each runs when its module is first imported). Every patch acts only
for MoonEP layers (``--all2all-backend moonep``, expert parallelism over more
than one rank, the sharded layout); every other layer takes vLLM's code
unchanged. What the patched methods then do (placeholders on ``meta``, the
store's loader, binding the ``[E+B]`` views, moonep_ep's experts) is in
``engine.py``.

================================== =============================== =========================================
vLLM method                        format (``layout/formats.py``)   what is replaced
================================== =============================== =========================================
``CompressedTensorsWNA16MoEMethod`` ``int4-g32``                    ``select_wna16_moe_backend``'s choice
``CompressedTensorsW4A4Mxfp4MoEMethod`` ``mxfp4``                   the kernel its ``__init__`` picks
``Fp8MoEMethod``                   ``fp8-block``                   ``select_fp8_moe_backend``'s choice
================================== =============================== =========================================

and, for all three, ``create_weights`` and ``process_weights_after_loading``
(:func:`_wrap_quantized_method`); ``gpu_worker.kernel_warmup`` runs the Triton
experts' warm-up after vLLM's own (``experts/warmup.py``).

Each patch takes the plugin's ``install`` (put a wrapper in place, marked so a
second install skips it), ``mark`` and ``note`` (the plugin's state, for
log-once flags).
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

from ... import envs
from ..hooks import Install, Mark, Note, Patch, is_wrapped

logger = logging.getLogger("vllm.moonep_ep")

MOD_CT_WNA16 = ("vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe."
                "compressed_tensors_moe_wna16")
MOD_CT_MXFP4 = ("vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe."
                "compressed_tensors_moe_w4a4_mxfp4")
MOD_FP8 = "vllm.model_executor.layers.quantization.fp8"
MOD_GPU_WORKER = "vllm.v1.worker.gpu_worker"


def _sharded_moonep(moe: Any) -> bool:
    """A MoonEP layer over more than one EP rank, with the sharded layout."""
    parallel = moe.moe_parallel_config
    return bool(parallel.use_moonep_kernels) and envs.MOONEP_EP_LAYOUT == "sharded" and parallel.ep_size > 1


def _log_once(note: Note, key: str, message: str, *args: Any) -> None:
    if key not in note:
        note[key] = True
        logger.info(message, *args)


def patch_wna16(module: ModuleType, *, install: Install, mark: Mark, note: Note) -> None:
    """compressed-tensors W4A16 MoE: moonep_ep's experts instead of ``select_wna16_moe_backend``'s choice."""
    cls = module.CompressedTensorsWNA16MoEMethod
    if is_wrapped(cls.create_weights):
        return
    select = module.select_wna16_moe_backend

    def select_wna16_moe_backend(config: Any, *args: Any, **kwargs: Any) -> Any:
        if _sharded_moonep(config):
            from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import WNA16MoEBackend

            from .engine import experts_class

            # EMULATION: the non-Marlin, bf16-input branch of the method; its kernel is replaced at binding.
            return WNA16MoEBackend.EMULATION, experts_class()
        return select(config, *args, **kwargs)

    install(module, "select_wna16_moe_backend", select_wna16_moe_backend, select,
            "compressed_tensors_moe_wna16.select_wna16_moe_backend")
    _wrap_quantized_method(cls, "CompressedTensorsWNA16MoEMethod", install)


def patch_mxfp4(module: ModuleType, *, install: Install, mark: Mark, note: Note) -> None:
    """compressed-tensors MXFP4 MoE (``CompressedTensorsW4A4Mxfp4MoEMethod``, which vLLM picks for every
    MXFP4-weight scheme): moonep_ep's experts instead of the kernel its ``__init__`` picks (CUTLASS, or Marlin
    on CPU: both repack or swizzle the checkpoint layout)."""
    cls = module.CompressedTensorsW4A4Mxfp4MoEMethod
    if is_wrapped(cls.create_weights):
        return
    init = cls.__init__

    def __init__(self: Any, moe: Any, *args: Any, **kwargs: Any) -> None:
        init(self, moe, *args, **kwargs)
        if _sharded_moonep(moe):
            from .engine import experts_class

            self.use_cutlass_mxfp4 = False  # weight-only MXFP4 in the checkpoint layout: no swizzle, no repack
            self.experts_cls = experts_class()
            _log_once(note, "mxfp4 experts", "moonep_ep: MXFP4 MoE on the sharded store: %s (the MarlinExperts/"
                      "CUTLASS choice logged above is replaced)", self.experts_cls.__name__)

    install(cls, "__init__", __init__, init, "CompressedTensorsW4A4Mxfp4MoEMethod.__init__")
    _wrap_quantized_method(cls, "CompressedTensorsW4A4Mxfp4MoEMethod", install)


def _fp8_block_128(weight_key: Any) -> bool:
    """vLLM's weight ``QuantKey`` of static 128x128 block scales (``create_fp8_quant_key``)."""
    scale = getattr(weight_key, "scale", None)
    return bool(getattr(scale, "static", False)) and tuple(getattr(scale, "group_shape", ()) or ()) == (128, 128)


def patch_fp8(module: ModuleType, *, install: Install, mark: Mark, note: Note) -> None:
    """vLLM's FP8 MoE (``Fp8MoEMethod``) with 128x128 block scales: moonep_ep's experts instead of the backend
    ``select_fp8_moe_backend`` picks (DeepGEMM / Triton / CUTLASS on GPUs; ``CPUExpertsFp8`` on CPU, which needs
    AMX). vLLM's choice is not consulted for these layers: the experts read the store's rows as they are.

    The backend becomes ``Fp8MoeBackend.CPU``, vLLM's weight-only FP8 label: its quant config (``fp8_w8a16``)
    leaves activations bf16, which MoonEP's prepare dispatches (the Triton experts quantize them per 1x128
    themselves), and no kernel conversion runs (the binding replaces ``process_weights_after_loading``)."""
    cls = module.Fp8MoEMethod
    if is_wrapped(cls.create_weights):
        return
    select = module.select_fp8_moe_backend

    def select_fp8_moe_backend(config: Any, weight_key: Any, activation_key: Any, *args: Any, **kwargs: Any) -> Any:
        if _sharded_moonep(config) and _fp8_block_128(weight_key):
            from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend

            from .engine import experts_class

            experts = experts_class()
            _log_once(note, "fp8 experts", "moonep_ep: FP8-block MoE on the sharded store: %s (vLLM's FP8 backend "
                      "selection is not used for these layers)", experts.__name__)
            return Fp8MoeBackend.CPU, experts
        return select(config, weight_key, activation_key, *args, **kwargs)

    install(module, "select_fp8_moe_backend", select_fp8_moe_backend, select, "fp8.select_fp8_moe_backend")
    _wrap_quantized_method(cls, "Fp8MoEMethod", install)


def _wrap_quantized_method(cls: Any, label: str, install: Install) -> None:
    """``create_weights`` on ``meta`` with the store's loader, and ``process_weights_after_loading`` binding
    the store's views, for a quantized MoE method whose experts are moonep_ep's (``engine.py``)."""
    create, process = cls.create_weights, cls.process_weights_after_loading

    def create_weights(self: Any, layer: Any, *args: Any, **kwargs: Any) -> None:
        from .engine import experts_class, method_format

        fmt = method_format(self)
        if fmt is not None and getattr(self, "experts_cls", None) is experts_class():
            from .engine import create_quantized_placeholders

            create_quantized_placeholders(create, self, layer, fmt, *args, **kwargs)
            return
        create(self, layer, *args, **kwargs)

    def process_weights_after_loading(self: Any, layer: Any) -> None:
        from .engine import FORMAT_ATTR, bind_quantized_layer

        if getattr(layer, FORMAT_ATTR, None) is not None:
            bind_quantized_layer(self, layer)
            return
        process(self, layer)

    install(cls, "create_weights", create_weights, create, f"{label}.create_weights")
    install(cls, "process_weights_after_loading", process_weights_after_loading, process,
            f"{label}.process_weights_after_loading")


def patch_gpu_worker(module: ModuleType, *, install: Install, mark: Mark, note: Note) -> None:
    """vLLM's GPU worker: the quantized Triton experts' variants compile at its kernel warm-up
    (``experts/warmup.py``), not on the first step of each token-count bucket."""
    from ..experts.warmup import patch_kernel_warmup

    patch_kernel_warmup(module, install=install, mark=mark, note=note)


PATCHES: tuple[Patch, ...] = (Patch(MOD_CT_WNA16, patch_wna16), Patch(MOD_CT_MXFP4, patch_mxfp4),
                              Patch(MOD_FP8, patch_fp8), Patch(MOD_GPU_WORKER, patch_gpu_worker))
