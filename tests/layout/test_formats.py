"""Quantized expert formats: per-expert tensors in vLLM 0.33.0's in-memory layout, scales apart."""

from __future__ import annotations

import pytest
import torch

from moonep_ep.errors import ConfigError
from moonep_ep.layout.formats import (FORMAT_NAMES, expert_format_bytes, expert_projections, get_format,
                                      projection_bytes)
from moonep_ep.layout.store import ProjectionSpec, ffn_projections

# Bytes per Kimi K2 expert (H 7168, I 2048), weights + scales, in vLLM's in-memory layout
# (issue 17 / the formats' published layouts: DeepSeek-V3 README_WEIGHTS, compressed-tensors
# pack_quantized, vLLM's create_weights of each MoE method).
K2 = {"bf16": (88_080_384, 0), "fp8-block": (44_040_192, 10_752),
      "int4-g32": (22_020_096, 2_752_512), "mxfp4": (22_020_096, 1_376_256)}


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_kimi_k2_bytes_per_expert(fmt):
    got = expert_format_bytes(fmt, 7168, 2048)
    weight, scale = K2[fmt]
    assert (got["weight_bytes"], got["scale_bytes"], got["total_bytes"]) == (weight, scale, weight + scale)
    assert got["format"] == fmt


def test_published_totals():
    assert {f: sum(K2[f]) for f in K2} == {"bf16": 88_080_384, "fp8-block": 44_050_944,
                                           "int4-g32": 24_772_608, "mxfp4": 23_396_352}
    # Kimi K3 (latent H 3584, I 3072) in MXFP4.
    assert expert_format_bytes("mxfp4", 3584, 3072)["total_bytes"] == 17_547_264


def test_vllm_names_shapes_and_dtypes():
    H, I = 7168, 2048
    by = {p.name: p for p in expert_projections("fp8-block", H, I)}
    assert by["w13_weight"].shape == (2 * I, H) and by["w13_weight"].dtype == torch.float8_e4m3fn
    assert by["w13_weight_scale_inv"].shape == (32, 56) and by["w13_weight_scale_inv"].dtype == torch.float32
    assert by["w2_weight_scale_inv"].shape == (56, 16)
    by = {p.name: p for p in expert_projections("int4-g32", H, I)}
    assert by["w13_weight_packed"].shape == (2 * I, H // 8) and by["w13_weight_packed"].dtype == torch.int32
    assert by["w2_weight_scale"].shape == (H, I // 32) and by["w2_weight_scale"].dtype == torch.bfloat16
    by = {p.name: p for p in expert_projections("mxfp4", H, I)}
    assert by["w13_weight_packed"].shape == (2 * I, H // 2) and by["w13_weight_scale"].dtype == torch.uint8
    native = [p.name for p in expert_projections("mxfp4", H, I, weight_name="weight")]
    assert native == ["w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"]
    for fmt in FORMAT_NAMES:
        specs = expert_projections(fmt, H, I)
        assert {p.projection for p in specs} == {"w13", "w2"}
        assert all((p.role == "scale") == ("scale" in p.name) for p in specs)


def test_fp8_block_scales_round_up_unaligned_dims():
    # I = 1408 (DeepSeek-V2-Lite-like): ceil(1408/128) = 11 blocks per half of w13.
    by = {p.name: p for p in expert_projections("fp8-block", 2048, 1408)}
    assert by["w13_weight_scale_inv"].shape == (22, 16) and by["w2_weight_scale_inv"].shape == (16, 11)


def test_split_layout_matches_the_bf16_store_names():
    assert expert_projections("bf16", 512, 256, split_w13=True) == ffn_projections(512, 256)
    names = [p.name for p in expert_projections("int4-g32", 512, 256, split_w13=True)]
    assert names == ["gate", "gate_scale", "up", "up_scale", "down", "down_scale"]
    # Split and fused hold the same bytes.
    for fmt in FORMAT_NAMES:
        assert (projection_bytes(expert_projections(fmt, 7168, 2048, split_w13=True))
                == projection_bytes(expert_projections(fmt, 7168, 2048)))


def test_bad_input_names_value_and_fix():
    with pytest.raises(ConfigError, match="unknown expert format 'nvfp4'.*Fix"):
        get_format("nvfp4")
    with pytest.raises(ConfigError, match="hidden_size.*= 100 is not a multiple of 32.*Fix"):
        expert_projections("int4-g32", 100, 256)
    with pytest.raises(ConfigError, match="role must be"):
        ProjectionSpec("x", (1, 2), role="bias")
    assert get_format("FP8") is get_format("fp8-block") and get_format("w4a16").name == "int4-g32"
