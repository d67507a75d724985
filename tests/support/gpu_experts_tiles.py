"""The block sizes the GPU experts pick for a decode and a prefill step at K2 shapes (vLLM 0.33.0, an H200's name).

Run in the vLLM environment (``python -m tests.support.gpu_experts_tiles``;
the kernel tier's rank 1 runs :func:`tile_choices` while rank 0 computes).
``MoonEPTritonQuantizedExperts.grouped_ffn`` — the method the engine calls —
is driven with the step's real shapes, its kernels replaced by a recorder of
the config they receive, and vLLM's device name read as ``NVIDIA_H200``
(``fused_moe.get_device_name_as_file_name``, what ``get_config_file_name``
reads). K2's FP8-block experts: H 7168, I 2048, E 384, top-8, MoonEP's
defaults (token padding 128, 4 prefetch slots), at EP 8 (48 local experts:
vLLM ships no H200 file for them, so its default config) and EP 12 (32
local experts: vLLM's ``E=32,N=2048,device_name=NVIDIA_H200,dtype=fp8_w8a8,
block_shape=[128,128].json``). A decode step is 32 tokens per rank, a prefill
step 4096. The step's ``hidden_nvsh`` has MoonEP's ``NvS`` rows, what the
choice must not follow (``NvS = S·K + (token_padding - 1)·2·E/EP`` with ``S``
the buffer's capacity, vLLM's ``MoonEPBufferPool.capacity_for``); the same
lookup keyed the old way (``NvS // top_k`` tokens, the global ``E``) is
recorded as the control. vLLM's tuned file entries are read here directly.
"""

from __future__ import annotations

import json
import os
import sys
import types
from typing import Any

H, I, E, TOP_K = 7168, 2048, 384, 8
TOKEN_PADDING, SLOTS, MIN_CAPACITY = 128, 4, 128
STEPS = {"decode": 32, "prefill": 4096}
EPS = (8, 12)
TUNED_FILE = "E=32,N=2048,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json"


def nvs_rows(tokens: int, ep: int) -> int:
    """MoonEP's ``NvS`` for a step of ``tokens`` per rank: capacity ``max(128, next power of two)``."""
    capacity = max(MIN_CAPACITY, 1 << max(tokens - 1, 0).bit_length())
    return capacity * TOP_K + (TOKEN_PADDING - 1) * 2 * (E // ep)


def tile_choices() -> dict[str, Any]:
    import torch
    import vllm.model_executor.layers.fused_moe.fused_moe as fm

    from moonep_ep.vllm.experts import gpu as gpu_experts
    from moonep_ep.vllm.quantized.engine import experts_class

    cls = experts_class("triton")
    seen: list[dict[str, int]] = []

    def recorder(fmt: str, hidden: Any, views: Any, cu_seqlens: Any, route: Any, **kwargs: Any) -> Any:
        seen.append(dict(kwargs["config"]))
        return hidden

    configs_dir = os.path.join(os.path.dirname(fm.__file__), "configs")
    with open(os.path.join(configs_dir, TUNED_FILE)) as f:
        tuned = json.load(f)
    saved_name, saved_ffn = fm.get_device_name_as_file_name, gpu_experts.gpu_grouped_ffn
    fm.get_device_name_as_file_name = lambda: "NVIDIA_H200"
    fm.get_moe_configs.cache_clear()
    gpu_experts.gpu_grouped_ffn = recorder
    out: dict[str, Any] = {"tuned_file": {k: tuned[str(v)] for k, v in STEPS.items()},
                           "files_present": {n: os.path.exists(os.path.join(configs_dir, n)) for n in (
                               TUNED_FILE, TUNED_FILE.replace("E=32,", "E=48,"),
                               TUNED_FILE.replace("E=32,", "E=384,"))}}
    try:
        layout = types.SimpleNamespace(format="fp8-block", views={}, num_prefetch_slots=SLOTS)
        for ep in EPS:
            for step, tokens in STEPS.items():
                experts = cls.__new__(cls)  # the engine's object without vLLM's layer around it
                experts.interpreter, experts.token_padding, experts._configs = False, TOKEN_PADDING, {}
                experts.moe_config = types.SimpleNamespace(num_local_experts=E // ep,
                                                           intermediate_size_per_partition=I)
                rows = nvs_rows(tokens, ep)
                hidden = torch.zeros(1, H, dtype=torch.bfloat16).expand(rows, H)  # NvS rows, no memory
                experts.grouped_ffn(layout, hidden, torch.zeros(E + SLOTS, dtype=torch.int32), None,
                                    torch.zeros(tokens, TOP_K, dtype=torch.int32))
                old = gpu_experts.kernel_config("fp8-block", local_experts=E, hidden=H, intermediate=I,
                                                tokens=rows // TOP_K, top_k=TOP_K, token_padding=TOKEN_PADDING,
                                                interpreter=False)
                out.setdefault(f"ep{ep}", {})[step] = {"tokens": tokens, "nvs": rows, "config": seen[-1],
                                                       "keyed_by_nvs_and_global_e": old}
    finally:
        fm.get_device_name_as_file_name, gpu_experts.gpu_grouped_ffn = saved_name, saved_ffn
        fm.get_moe_configs.cache_clear()
    return out


if __name__ == "__main__":
    print(json.dumps(tile_choices()))
    sys.exit(0)
