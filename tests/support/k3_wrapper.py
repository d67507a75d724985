"""The tiny K3 laid out as the released Kimi K3 checkpoint is (the wrapper run of ``tests/vllm/test_k3_engine.py``).

Only a test serves this layout, so it lives beside the tests; the builder it copies is the package's
(``tools/checkpoints/tiny_kimi_k3.py``).
"""

from __future__ import annotations

import json
import os

from moonep_ep.tools.checkpoints.tiny_quantized import _copy_beside, _read

#: the text model's names -> the released K3 checkpoint's (``KimiK3ForConditionalGeneration``: vLLM's
#: ``hf_to_vllm_mapper`` maps ``language_model.layers.`` to ``language_model.model.layers.`` and nothing else of
#: the text model, so the other text tensors carry vLLM's module paths already)
WRAPPER_PREFIXES = (("model.layers.", "language_model.layers."), ("model.", "language_model.model."),
                    ("lm_head.", "language_model.lm_head."))


def kimi_k3_wrapper_copy(model_dir: str) -> str:
    """A copy of tiny K3 ``model_dir`` as the released K3 is laid out: ``KimiK3ForConditionalGeneration``
    (``model_type`` ``kimi_k3``, the text config under ``text_config``, MoonViT's default ``vision_config``) with
    the text tensors under :data:`WRAPPER_PREFIXES`' names; no vision tensors (the CPU engine serves it as a
    language model). Written beside ``model_dir`` (``<dir>-kimi-k3``)."""
    text, tensors = _read(model_dir)
    renamed = {}
    for key, tensor in tensors.items():
        old, new = next((o, n) for o, n in WRAPPER_PREFIXES if key.startswith(o))
        renamed[new + key[len(old):]] = tensor
    cfg = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "text_config": text,
           "vision_config": {}, "media_placeholder_token_id": text["vocab_size"] - 1,
           **{k: text[k] for k in ("torch_dtype", "bos_token_id", "eos_token_id", "pad_token_id",
                                  "tie_word_embeddings") if k in text}}
    if "quantization_config" in text:
        cfg["quantization_config"] = text["quantization_config"]
    out = _copy_beside(model_dir, f"{model_dir.rstrip('/')}-kimi-k3", cfg, renamed)
    # vLLM builds K3's processing info (its image processor, vLLM's KimiK25FusedVisionProcessor) for every
    # KimiK3ForConditionalGeneration, even serving text only: the fields that class reads; no image is served
    media = {"patch_size": 14, "merge_kernel_size": [2, 2], "temporal_merge_kernel_size": 4,
             "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "in_patch_limit": 16384,
             "patch_limit_on_one_side": 512, "fixed_output_tokens": None, "in_patch_limit_each_frame": 4096}
    with open(os.path.join(out, "preprocessor_config.json"), "w") as f:
        json.dump({"media_proc_cfg": media}, f, indent=1)
    return out
