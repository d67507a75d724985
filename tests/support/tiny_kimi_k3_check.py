"""Run in the vLLM 0.33.0 environment (compressed-tensors, tokenizers, vLLM's ``KimiLinearConfig``): build both
tiny K3 checkpoints into ``argv[1]`` and print one JSON object of what ``tests/vllm/test_tiny_kimi_k3.py``
asserts. No engine starts."""

from __future__ import annotations

import json
import os
import sys

import torch
from safetensors.torch import load_file

#: E2M1 code -> value (OCP MX spec: sign bit 3, then 2 exponent bits and 1 mantissa bit)
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def decode_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Written from the format, not from compressed-tensors: even element in the low nibble, E8M0 = 2^(b-127)."""
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()
    table = torch.tensor(E2M1 + [-v for v in E2M1])
    values = table[codes]
    return (values.unflatten(-1, (-1, 32)) * torch.pow(2.0, scale.float() - 127)[..., None]).flatten(-2)


def main() -> None:
    from vllm.model_executor.layers.quantization.utils.config_utils import is_equal_or_regex_match
    from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig

    from moonep_ep.tools.checkpoints.tiny_kimi_k3 import (K3_IGNORE, build_tiny_kimi_k3, expert_module_names,
                                                          saturation_fractions, TinyKimiK3Config)
    from moonep_ep.tools.checkpoints.tiny_quantized import decompress_tensors
    from moonep_ep.vllm.checkpoint.schemes import _ct_matches, checkpoint_module_names, classify

    root = sys.argv[1]
    bf16_dir = build_tiny_kimi_k3("tiny-k3", os.path.join(root, "bf16"))
    mx_dir = build_tiny_kimi_k3("tiny-k3-mxfp4", os.path.join(root, "mxfp4"))
    out: dict = {}
    with open(os.path.join(mx_dir, "config.json")) as f:
        cfg = json.load(f)
    kc = KimiLinearConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "quantization_config")})
    out["vllm_config"] = {"kda": [kc.is_kda_layer(i) for i in range(kc.num_hidden_layers)], "is_mla": kc.is_mla,
                          "is_moe": kc.is_moe, "is_linear_attn": kc.is_linear_attn,
                          **{k: getattr(kc, k) for k in (
                              "hidden_act", "activation_situ_beta", "activation_situ_linear_beta",
                              "routed_expert_hidden_size", "latent_moe_use_norm", "num_experts",
                              "num_experts_per_token", "num_shared_experts", "moe_renormalize",
                              "moe_router_activation_func", "routed_scaling_factor", "first_k_dense_replace",
                              "topk_method", "use_grouped_topk", "num_expert_group", "topk_group",
                              "mla_use_nope", "mla_use_output_gate", "linear_attn_config", "model_type")}}
    out["architectures"] = cfg["architectures"]
    out["quantization_config"] = cfg["quantization_config"]
    bf16 = load_file(os.path.join(bf16_dir, "model.safetensors"))
    mx = load_file(os.path.join(mx_dir, "model.safetensors"))
    out["bf16_names"] = {k: [list(t.shape), str(t.dtype)] for k, t in bf16.items()}
    out["mxfp4_names"] = {k: [list(t.shape), str(t.dtype)] for k, t in mx.items()}
    # every expert: compressed-tensors' decompressor == the format decoded here, and within E2M1 rounding of
    # the BF16 variant's weight (at most one scale unit per value: half of E2M1's widest step, 4 -> 6)
    plain = decompress_tensors(cfg, mx)
    worst_rel, exact, clamped = 0.0, True, 0
    for name in expert_module_names(TinyKimiK3Config()):
        ours = decode_mxfp4(mx[name + ".weight_packed"], mx[name + ".weight_scale"])
        exact &= torch.equal(ours, plain[name + ".weight"].float())
        unit = torch.pow(2.0, mx[name + ".weight_scale"].float() - 127).repeat_interleave(32, -1)
        err = (plain[name + ".weight"].float() - bf16[name + ".weight"].float()).abs()
        worst_rel = max(worst_rel, float((err / unit).max()))
        clamped += int((err > unit).sum())
    out["decompress"] = {"ct_equals_format_decode": bool(exact), "max_error_in_scale_units": worst_rel,
                         "values_past_one_scale_unit": clamped}
    # a nibble-swapped copy must not decode to the same weights (negative control of the decoder)
    name = expert_module_names(TinyKimiK3Config())[0]
    p = mx[name + ".weight_packed"]
    swapped = decode_mxfp4((p << 4) | (p >> 4), mx[name + ".weight_scale"])
    out["nibble_swap_changes_weights"] = not torch.equal(swapped, plain[name + ".weight"].float())
    # vLLM's own matcher over every module of the checkpoint: what the ignore list keeps BF16
    modules = checkpoint_module_names(mx_dir)
    out["vllm_ignored"] = {m: any(is_equal_or_regex_match(m, p) for p in K3_IGNORE) for m in modules}
    # our matcher against vLLM's on entries of each kind
    pairs = [(n, p) for n in ("model.layers.1.self_attn.o_proj", "language_model.lm_head", "lm_head",
                              "model.layers.1.block_sparse_moe.experts.0.w1")
             for p in ("o_proj", "self_attn.o_proj", "re:.*o_proj", "re:o_proj", "lm_head", "re:.*lm_head",
                       "model.layers.1.self_attn.o_proj", "w1", r"re:.*experts\.\d+\.w1$")]
    out["matcher_pairs"] = [[n, p, is_equal_or_regex_match(n, p), _ct_matches(n, [p])] for n, p in pairs]
    scheme = classify(cfg["quantization_config"], "vllm-cpu", modules)
    out["classify_cpu"] = {"format": scheme.format, "problems": list(scheme.problems)}
    out["saturation"] = {"bf16": saturation_fractions(bf16_dir), "mxfp4": saturation_fractions(mx_dir)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
