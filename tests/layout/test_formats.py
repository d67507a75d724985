"""Quantized expert formats: per-expert tensors in vLLM 0.33.0's in-memory layout, scales apart."""

from __future__ import annotations

import pytest
import torch

from moonep_ep.errors import ConfigError
from moonep_ep.layout.formats import (FORMAT_NAMES, expert_format_bytes, expert_projections, get_format,
                                      store_projections,
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
    # vLLM's Fp8MoEMethod (block-quantized): w13_weight_scale_inv [2 * ceil(I/128), ceil(H/128)],
    # w2_weight_scale_inv [ceil(H/128), ceil(I/128)], each half of w13 (gate, up) rounded up on its own.
    # I = 1344 = 10.5 * 128: 11 blocks per half, 22 rows for w13 (ceil(2I/128) would give 21; rounding
    # down 10 and 20).
    by = {p.name: p for p in expert_projections("fp8-block", 2048, 1344)}
    assert by["w13_weight_scale_inv"].shape == (22, 16) and by["w2_weight_scale_inv"].shape == (16, 11)
    # H = 2112 = 16.5 * 128 rounds up too: 17 column blocks of w13, 17 row blocks of w2.
    by = {p.name: p for p in expert_projections("fp8-block", 2112, 1344)}
    assert by["w13_weight_scale_inv"].shape == (22, 17) and by["w2_weight_scale_inv"].shape == (17, 11)
    assert by["w13_weight_scale_inv"].row_bytes == 22 * 17 * 4 and by["w2_weight_scale_inv"].row_bytes == 17 * 11 * 4
    split = {p.name: p.shape for p in expert_projections("fp8-block", 2112, 1344, split_w13=True)}
    assert split["gate_scale"] == split["up_scale"] == (11, 17) and split["down_scale"] == (17, 11)
    # Aligned dims (I = 1408 = 11 * 128) need no rounding: the same counts.
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


def test_other_int4_group_sizes_size_their_scales_by_the_group():
    g128 = get_format(" INT4_G128 ")
    assert (g128.name, g128.scale_block, g128.label) == ("int4-g128", (1, 128), "INT4 W4A16, group 128 (bf16 scales)")
    assert get_format("int4g64").scale_block == (1, 64) and get_format("int4-g8").scale_block == (1, 8)
    # H = 512, I = 256, group 128: w13 scale [2I, H/128] = [512, 4], w2 [H, I/128] = [512, 2], bf16.
    by = {p.name: p for p in expert_projections("int4-g128", 512, 256)}
    assert by["w13_weight_scale"].shape == (512, 4) and by["w2_weight_scale"].shape == (512, 2)
    for bad in ("int4-g12", "int4-g0", "int4-g"):
        with pytest.raises(ConfigError, match="unknown expert format"):
            get_format(bad)
    assert get_format(g128) is g128
    for alias, name in (("bfloat16", "bf16"), ("fp8_block", "fp8-block"), ("int4", "int4-g32"),
                        ("mxfp4a16", "mxfp4")):
        assert get_format(alias).name == name


def test_one_experts_bytes_by_hand():
    # H = 256, I = 128. bf16: 3*H*I*2 = 196,608, no scales. fp8-block: 3*H*I = 98,304 weight bytes;
    # scales w13 [2*1, 2] + w2 [2, 1] = 6 fp32 = 24 B. mxfp4: 3*H*I/2 = 49,152; e8m0 scales
    # w13 [256, 8] + w2 [256, 4] = 3,072 B. int4-g32: 49,152 weight bytes; bf16 scales 3,072 values = 6,144 B.
    assert expert_format_bytes("bf16", 256, 128) == {"format": "bf16", "weight_bytes": 196_608, "scale_bytes": 0,
                                                      "total_bytes": 196_608}
    assert expert_format_bytes("fp8", 256, 128) == {"format": "fp8-block", "weight_bytes": 98_304,
                                                     "scale_bytes": 24, "total_bytes": 98_328}
    assert expert_format_bytes("mxfp4", 256, 128)["scale_bytes"] == 3_072
    assert expert_format_bytes("int4-g32", 256, 128)["scale_bytes"] == 6_144
    assert expert_format_bytes("int4-g32", 256, 128)["weight_bytes"] == 49_152
    # The store holds BF16 split (gate, up, down) and quantized formats fused (w13, w2), scales after weights.
    assert [p.name for p in store_projections("bf16", 256, 128)] == ["gate", "up", "down"]
    assert [(p.name, p.role) for p in store_projections("mxfp4", 256, 128)] == [
        ("w13_weight_packed", "weight"), ("w13_weight_scale", "scale"),
        ("w2_weight_packed", "weight"), ("w2_weight_scale", "scale")]
    assert get_format("bf16").scale_shape(256, 128) is None and not get_format("bf16").quantized


def test_check_dims_names_the_dimension_exactly():
    """Each refusal names which expert dim is wrong (H or I) with its value."""
    with pytest.raises(ConfigError) as info:
        get_format("bf16").check_dims(0, 256)
    assert str(info.value) == "format bf16: hidden_size (H) must be a positive int: got 0. Fix: pass the model's expert dims"
    with pytest.raises(ConfigError) as info:
        get_format("bf16").check_dims(512, True)
    assert str(info.value) == ("format bf16: moe_intermediate_size (I) must be a positive int: got True. "
                               "Fix: pass the model's expert dims")
    with pytest.raises(ConfigError) as info:
        get_format("int4-g32").check_dims(100, 256)
    assert str(info.value).startswith("format int4-g32: hidden_size (H) = 100 is not a multiple of 32 (")
    with pytest.raises(ConfigError) as info:
        get_format("int4-g32").check_dims(512, 100)
    assert str(info.value).startswith("format int4-g32: moe_intermediate_size (I) = 100 is not a multiple of 32 (")
