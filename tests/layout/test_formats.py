"""Quantized expert formats: per-expert tensors in vLLM 0.33.0's in-memory layout, scales apart."""

from __future__ import annotations

import pytest
import torch

from moonep_ep.errors import ConfigError
from moonep_ep.layout.formats import (FORMAT_NAMES, expert_format_bytes, expert_projections, get_format,
                                      push_store_projections, scale_data_view,
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


def test_check_dims_refusals_in_full_and_the_smallest_dims():
    """The whole text: what the format packs, the group when it asks for more than the packing, and the fix."""
    for fmt, hidden, intermediate, message in (
            ("int4-g32", 512, 1000,
             "format int4-g32: moe_intermediate_size (I) = 1000 is not a multiple of 32 (INT4 W4A16, group 32 (bf16 "
             "scales) packs 8 values per int32 and groups 32 per scale). Fix: use a model whose expert dims are "
             "multiples of 32, or another --format"),
            ("int4-g8", 4100, 64,   # group 8 = the packing: no group clause
             "format int4-g8: hidden_size (H) = 4100 is not a multiple of 8 (INT4 W4A16, group 8 (bf16 scales) packs "
             "8 values per int32). Fix: use a model whose expert dims are multiples of 8, or another --format"),
            ("mxfp4", 48, 64,
             "format mxfp4: hidden_size (H) = 48 is not a multiple of 32 (MXFP4 (E2M1, E8M0 scale per 32) packs 2 "
             "values per uint8 and groups 32 per scale). Fix: use a model whose expert dims are multiples of 32, or "
             "another --format")):
        with pytest.raises(ConfigError) as info:
            get_format(fmt).check_dims(hidden, intermediate)
        assert str(info.value) == message
    get_format("bf16").check_dims(1, 1)   # 1 is a positive int, and BF16 packs one value per element
    with pytest.raises(ConfigError) as info:
        get_format("fp16")
    assert str(info.value) == "unknown expert format 'fp16'. Fix: use one of bf16, fp8-block, int4-g32, mxfp4"


def test_every_spec_names_its_role_and_projection_with_int_shapes():
    # H = 256, I = 96, INT4 group 32 (8 values per int32): gate/up [I, H/8] = [96, 32], scales [96, H/32] = [96, 8];
    # down [H, I/8] = [256, 12], scale [256, I/32] = [256, 3]
    assert expert_projections("int4-g32", 256, 96, split_w13=True) == [
        ProjectionSpec("gate", (96, 32), torch.int32, role="weight", projection="gate"),
        ProjectionSpec("gate_scale", (96, 8), torch.bfloat16, role="scale", projection="gate"),
        ProjectionSpec("up", (96, 32), torch.int32, role="weight", projection="up"),
        ProjectionSpec("up_scale", (96, 8), torch.bfloat16, role="scale", projection="up"),
        ProjectionSpec("down", (256, 12), torch.int32, role="weight", projection="down"),
        ProjectionSpec("down_scale", (256, 3), torch.bfloat16, role="scale", projection="down")]
    # fp8-block fused: w13 [2I, H] with scales [2*ceil(96/128), ceil(256/128)] = [2, 2]; w2 [H, I], scales [2, 1]
    assert expert_projections("fp8-block", 256, 96) == [
        ProjectionSpec("w13_weight", (192, 256), torch.float8_e4m3fn, role="weight", projection="w13"),
        ProjectionSpec("w13_weight_scale_inv", (2, 2), torch.float32, role="scale", projection="w13"),
        ProjectionSpec("w2_weight", (256, 96), torch.float8_e4m3fn, role="weight", projection="w2"),
        ProjectionSpec("w2_weight_scale_inv", (2, 1), torch.float32, role="scale", projection="w2")]
    for fmt in FORMAT_NAMES:   # shapes are ints (torch allocates them), not 12.0 (which compares equal to 12)
        for split in (False, True):
            assert all(type(n) is int for p in expert_projections(fmt, 256, 96, split_w13=split) for n in p.shape)


def test_the_push_store_holds_gate_up_down_apart_with_16_kib_scale_rows():
    """Kimi K2 dims (H 7168, I 2048), by hand: the release's push takes gate, up, down apart; a scale row that is
    not a multiple of 16 KiB becomes a uint8 [128, padded/128] row (FP8 block), the others keep their spec."""
    H, I = 7168, 2048
    bf16 = push_store_projections("bf16", H, I)
    assert [(p.name, tuple(p.shape), p.dtype) for p in bf16] == [
        ("gate", (I, H), torch.bfloat16), ("up", (I, H), torch.bfloat16), ("down", (H, I), torch.bfloat16)]
    int4 = push_store_projections("int4-g32", H, I)
    assert [(p.name, tuple(p.shape), p.dtype, p.role) for p in int4] == [
        ("gate", (I, H // 8), torch.int32, "weight"), ("gate_scale", (I, H // 32), torch.bfloat16, "scale"),
        ("up", (I, H // 8), torch.int32, "weight"), ("up_scale", (I, H // 32), torch.bfloat16, "scale"),
        ("down", (H, I // 8), torch.int32, "weight"), ("down_scale", (H, I // 32), torch.bfloat16, "scale")]
    assert I * (H // 32) * 2 == 56 * 16384  # INT4's scale rows already meet the rule
    fp8 = push_store_projections("fp8-block", H, I)
    assert [(p.name, tuple(p.shape), p.dtype, p.projection) for p in fp8] == [
        ("gate", (I, H), torch.float8_e4m3fn, "gate"), ("gate_scale", (128, 128), torch.uint8, "gate"),
        ("up", (I, H), torch.float8_e4m3fn, "up"), ("up_scale", (128, 128), torch.uint8, "up"),
        ("down", (H, I), torch.float8_e4m3fn, "down"), ("down_scale", (128, 128), torch.uint8, "down")]
    # the padded rows' data: 16 x 56 fp32 = 3,584 B of each 16 KiB row, read in place
    rows = torch.zeros(2, 128, 128, dtype=torch.uint8)
    rows.view(2, -1)[:, :3584] = torch.arange(2 * 896, dtype=torch.float32).view(2, 896).view(torch.uint8)
    data = scale_data_view(rows, expert_projections("fp8-block", H, I, split_w13=True)[1])
    assert data.shape == (2, 16, 56) and data.dtype == torch.float32 and data[1, 0, 0] == 896
