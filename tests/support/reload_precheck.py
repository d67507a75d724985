"""Cases for ``loading._checkpoint_problems`` (the reload precheck), run in a vLLM environment (safetensors).

Writes small safetensors checkpoints with the tensor names, shapes and dtypes
each format's real checkpoints carry (``layout/formats.py``), and a
``config.json`` with the format's ``quantization_config``; prints
``{case: [problems]}`` as JSON. No engine, no store memory: a stand-in layer
(the checkpoint names vLLM's FusedMoE records) and a stand-in store (format,
dims, shapes).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import types

import torch
from safetensors.torch import save_file

from moonep_ep.layout.formats import expert_projections, get_format
from moonep_ep.vllm.store.loading import BINDING_ATTR, _checkpoint_problems

H, I, E = 256, 256, 2
CT_INT4 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
           "config_groups": {"g": {"targets": ["re:.*experts.*"], "format": "pack-quantized",
                                   "weights": {"num_bits": 4, "type": "int", "symmetric": True, "group_size": 32,
                                               "strategy": "group"}}}}
FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
       "ignored_layers": ["lm_head", "model.layers.1.self_attn.o_proj", "model.layers.1.self_attn.kv_b_proj",
                          "model.layers.1.self_attn.q_proj", "model.layers.1.mlp.shared_experts.down_proj",
                          "model.layers.0.mlp.down_proj"]}
CONFIGS = {"bf16": None, "int4-g32": CT_INT4, "fp8-block": FP8}


def _tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.float32).to(dtype) if dtype.is_floating_point else \
        torch.zeros(shape, dtype=dtype)


def write(root: str, fmt: str, intermediate: int = I, scale_dtype: torch.dtype | None = None) -> str:
    """A one-layer checkpoint of ``E`` experts in ``fmt``; ``scale_dtype`` overrides the scales' dtype."""
    f = get_format(fmt)
    out = tempfile.mkdtemp(prefix=f"{fmt}-", dir=root)
    tensors = {}
    for e in range(E):
        for spec in expert_projections(f, H, intermediate, split_w13=True):
            name = (f.scale_name if spec.role == "scale" else f.weight_name) or "weight"
            dtype = scale_dtype if spec.role == "scale" and scale_dtype is not None else spec.dtype
            tensors[f"model.layers.1.mlp.experts.{e}.{spec.projection}_proj.{name}"] = _tensor(spec.shape, dtype)
            if f.weight_name == "weight_packed" and spec.role == "weight":  # compressed-tensors' unpacked shape
                tensors[f"model.layers.1.mlp.experts.{e}.{spec.projection}_proj.weight_shape"] = torch.tensor(
                    [intermediate if spec.projection != "down" else H, H if spec.projection != "down" else intermediate])
    save_file(tensors, os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json"), "w") as fh:
        json.dump({"model_type": "deepseek_v3", **({"quantization_config": CONFIGS[fmt]} if CONFIGS[fmt] else {})},
                  fh)
    return out


def served(fmt: str) -> tuple[object, object]:
    """A stand-in model (one bound MoE layer) and store serving ``fmt``."""
    store = types.SimpleNamespace(format=fmt, hidden=H, intermediate=I, checkpoint_dtypes=set(),
                                  shapes={"gate": (I, H), "up": (I, H), "down": (H, I)})
    if fmt == "bf16":
        store.checkpoint_dtypes = {"torch.bfloat16"}
    layer = types.SimpleNamespace(ckpt_gate_proj_name="gate_proj", ckpt_up_proj_name="up_proj",
                                  ckpt_down_proj_name="down_proj", **{BINDING_ATTR: (store, 0)})
    return types.SimpleNamespace(modules=lambda: [layer]), store


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="moonep-ep-precheck-") as root:
        json.dump(run_cases(root), sys.stdout)


def run_cases(root: str) -> dict[str, list[str]]:
    cases = {
        "int4_same_shapes": ("int4-g32", write(root, "int4-g32")),
        "int4_other_intermediate": ("int4-g32", write(root, "int4-g32", intermediate=128)),
        "int4_fp32_scales": ("int4-g32", write(root, "int4-g32", scale_dtype=torch.float32)),
        "int4_served_fp8_checkpoint": ("int4-g32", write(root, "fp8-block")),
        "fp8_same_shapes": ("fp8-block", write(root, "fp8-block")),
        "fp8_other_intermediate": ("fp8-block", write(root, "fp8-block", intermediate=128)),
        "bf16_same_shapes": ("bf16", write(root, "bf16")),
        "bf16_served_int4_checkpoint": ("bf16", write(root, "int4-g32")),
    }
    out = {}
    for case, (fmt, path) in cases.items():
        model, store = served(fmt)
        out[case] = _checkpoint_problems(model, [store], path)
    return out


if __name__ == "__main__":
    main()
