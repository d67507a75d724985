"""On the GPU engine (vLLM 0.33.0): which experts each quantized format's MoE method selects for a MoonEP layer.

Run in the vLLM environment (``python -m tests.support.gpu_engine_selection``),
prints one JSON object. For INT4 W4A16 (``select_wna16_moe_backend``, what
``CompressedTensorsWNA16MoEMethod.__init__`` calls), MXFP4
(``CompressedTensorsW4A4Mxfp4MoEMethod``) and FP8 block 128x128
(``Fp8MoEMethod``), each built from vLLM's own classes with a
``FusedMoEConfig`` of two EP ranks and ``all2all_backend="moonep"``:

* ``cuda``: the platform reported as CUDA — this machine has no GPU, so
  vLLM's platform is ``UnspecifiedPlatform``; its ``_enum`` is set to CUDA
  for the selection only (no kernel runs here) — and
  ``MOONEP_EP_QUANTIZED_EXPERTS`` unset (``auto``);
* ``cuda_dequant``: the same with ``MOONEP_EP_QUANTIZED_EXPERTS=dequant``;
* ``no_gpu``: the platform as it is (not CUDA), ``auto``;
* ``replicated``: CUDA, ``MOONEP_EP_LAYOUT=replicated`` (not moonep_ep's
  sharded layer: vLLM's own choice, or vLLM's own error on this machine).

Each entry is the selected experts class name (or ``raised: <type>``).
"""

from __future__ import annotations

import json
import os
import sys
import types
from typing import Any, Callable


def _selectors() -> dict[str, Callable[[Any], Any]]:
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_w4a4_mxfp4 as mxfp4, compressed_tensors_moe_wna16 as wna16)
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config, Fp8MoEMethod

    def fp8(moe: Any) -> Any:
        cfg = Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic", weight_block_size=[128, 128])
        with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
            return Fp8MoEMethod(cfg, types.SimpleNamespace(moe_config=moe)).experts_cls

    return {"int4-g32": lambda moe: wna16.select_wna16_moe_backend(moe)[1],
            "mxfp4": lambda moe: mxfp4.CompressedTensorsW4A4Mxfp4MoEMethod(moe).experts_cls,
            "fp8-block": fp8}


def collect() -> dict[str, Any]:
    from vllm.platforms import PlatformEnum, current_platform
    from vllm.plugins import load_general_plugins

    from tests.support.vllm_moe_model import KernelCase, fused_moe_config

    load_general_plugins()  # the plugin's patches, as every vLLM process gets them
    moe = fused_moe_config(KernelCase(), 0)
    selectors = _selectors()
    cases = {"no_gpu": (None, {}), "cuda": (PlatformEnum.CUDA, {}),
             "cuda_dequant": (PlatformEnum.CUDA, {"MOONEP_EP_QUANTIZED_EXPERTS": "dequant"}),
             "replicated": (PlatformEnum.CUDA, {"MOONEP_EP_LAYOUT": "replicated"})}
    out: dict[str, Any] = {"platform": type(current_platform).__name__}
    native = current_platform._enum
    for case, (platform, env) in cases.items():
        current_platform._enum = platform or native
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            for fmt, select in selectors.items():
                try:
                    cls = select(moe)
                    out.setdefault(case, {})[fmt] = getattr(cls, "__name__", repr(cls))
                except Exception as exc:  # noqa: BLE001 - vLLM's own refusal on this GPU-less machine is a result
                    out.setdefault(case, {})[fmt] = f"raised: {type(exc).__name__}"
        finally:
            current_platform._enum = native
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    out["tuned_config"] = tuned_config()
    return out


def tuned_config() -> dict[str, Any]:
    """``gpu_experts.kernel_config`` on a GPU, with vLLM's device name read as an H200's: K2's FP8-block experts
    at TP 16 (E 384, N 128: a tuned file vLLM ships), the file's entries read here directly: M 2048 (BLOCK_SIZE_M
    64) with MoonEP's token padding 128 and 32 (it must come down to 32), and M 2 (8: below tl.dot's 16)."""
    import vllm.model_executor.layers.fused_moe.fused_moe as fm

    from moonep_ep.vllm.experts.gpu import kernel_config

    name = "E=384,N=128,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json"
    with open(os.path.join(os.path.dirname(fm.__file__), "configs", name)) as f:
        entries = json.load(f)
    saved = fm.get_device_name_as_file_name
    fm.get_device_name_as_file_name = lambda: "NVIDIA_H200"
    fm.get_moe_configs.cache_clear()
    try:
        shape = dict(local_experts=384, hidden=7168, intermediate=128, top_k=8, interpreter=False)
        return {"file_m2048": entries["2048"], "file_m2": entries["2"],
                "m2048_padding_128": kernel_config("fp8-block", tokens=2048, token_padding=128, **shape),
                "m2048_padding_32": kernel_config("fp8-block", tokens=2048, token_padding=32, **shape),
                "m2_padding_128": kernel_config("fp8-block", tokens=2, token_padding=128, **shape)}
    finally:
        fm.get_device_name_as_file_name = saved
        fm.get_moe_configs.cache_clear()


if __name__ == "__main__":
    print(json.dumps(collect()))
    sys.exit(0)
