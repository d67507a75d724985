"""Quantized expert FFN on CPU: dequantize only the ``[E+B]`` rows a step uses, then the grouped GEMM.

vLLM's quantized CPU experts (``CPUExpertsFp8``, ``CPUExpertsMxfp4``,
``CPUExpertsInt4``) need x86 AMX, which these machines lack, so the CPU path
is this project's own. For each non-empty ``cu_seqlens`` group ``g`` (an
expert ``g < E`` or a slot ``E + b``) the weight rows and their scale rows
— one row index for both, as the store holds them — are dequantized to
bf16, and :func:`~moonep_ep.ops.experts.grouped_ffn` runs over the compacted
groups. Rows no group uses are never read.

Formats (``layout/formats.py`` names and vLLM 0.33.0's in-memory layout,
per expert; ``w13 = [gate; up]``):

* ``int4-g32`` — ``weight_packed`` int32 ``[N, K/8]``: value ``i`` of a word
  in bits ``4i..4i+3`` (low nibble first), stored ``+8``; ``weight_scale``
  bf16 ``[N, K/32]``: ``w = (q - 8) · scale`` (compressed-tensors
  ``pack_to_int32``, symmetric);
* ``mxfp4`` — ``weight_packed`` uint8 ``[N, K/2]``: two E2M1 codes a byte,
  the first value in the low nibble (compressed-tensors
  ``pack_fp4_to_uint8``); ``weight_scale`` E8M0 uint8 ``[N, K/32]``:
  ``w = e2m1(code) · 2^(scale - 127)``;
* ``fp8-block`` — ``weight`` float8_e4m3fn ``[N, K]``; ``weight_scale_inv``
  fp32 ``[ceil(N/128), ceil(K/128)]``: ``w = weight · scale_inv`` per
  128x128 block (DeepSeek-V3's ``README_WEIGHTS.md``).

The tests compare these against compressed-tensors' own decompressor, not
against this file.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from ..errors import config_error
from .experts import grouped_ffn

__all__ = ["dequantize_rows", "quantized_grouped_ffn", "used_groups", "E2M1_VALUES"]

#: E2M1 code -> value (codes 8..15 are the negatives)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32
FP8_BLOCK = 128
#: byte -> its two E2M1 values, low nibble first (bf16 holds every E2M1 value exactly)
_E2M1_PAIRS = torch.tensor([(E2M1_VALUES[b & 0xF], E2M1_VALUES[b >> 4]) for b in range(256)], dtype=torch.bfloat16)


def _unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """``[n, N, K/8]`` int32 -> ``[n, N, K]`` signed values ``q - 8`` (bf16: exact for -8..7)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF
    return nibbles.flatten(-2).to(torch.bfloat16) - 8.0


def _unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """``[n, N, K/2]`` uint8 -> ``[n, N, K]`` E2M1 values (bf16, exact): one gather of a byte's two values."""
    pairs = torch.nn.functional.embedding(packed.to(torch.int32), _E2M1_PAIRS.to(packed.device))
    return pairs.flatten(-2)


def _times_groups(fmt: str, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``values [n, N, K] * scale [n, N, K/32]``, each scale over its 32 columns (no repeated scale tensor)."""
    n, N, K = values.shape
    if K % GROUP or tuple(scale.shape) != (n, N, K // GROUP):
        raise config_error(None, f"{fmt} scale rows do not cover the weight rows",
                           (tuple(scale.shape), tuple(values.shape)),
                           "pass the format's scale tensor of the same projection")
    return (values.view(n, N, K // GROUP, GROUP) * scale.unsqueeze(-1)).view(n, N, K)


def _times_blocks(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``values [n, N, K] * scale [n, ceil(N/128), ceil(K/128)]``, each scale over its 128x128 block."""
    n, N, K = values.shape
    nb, kb = -(-N // FP8_BLOCK), -(-K // FP8_BLOCK)
    if tuple(scale.shape) != (n, nb, kb):
        raise config_error(None, "fp8-block scale rows do not cover the weight rows",
                           (tuple(scale.shape), tuple(values.shape)),
                           "pass the format's scale tensor of the same projection")
    if N % FP8_BLOCK or K % FP8_BLOCK:  # a partial last block (I = 1344 = 10.5 x 128): repeat, cut to size
        return values * scale.repeat_interleave(FP8_BLOCK, -2).repeat_interleave(FP8_BLOCK, -1)[..., :N, :K]
    return (values.view(n, nb, FP8_BLOCK, kb, FP8_BLOCK) * scale[:, :, None, :, None]).view(n, N, K)


def dequantize_rows(fmt: str, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16
                    ) -> torch.Tensor:
    """``[n, N, K]`` dequantized rows from ``n`` expert rows of weight and scale (same row index).

    Every value is the float32 product ``value * scale`` rounded once to ``out_dtype``. For bf16 out, the INT4
    (bf16 scales) and MXFP4 products are taken in bf16, which rounds the exact product once: the same bytes,
    with a quarter of the memory traffic (``tests/ops/test_quantized_experts.py`` compares the two)."""
    if weight.shape[0] != scale.shape[0]:
        raise config_error(None, "weight and scale rows must pair one to one", (weight.shape[0], scale.shape[0]),
                           "pass the same rows of the weight view and of its scale view")
    narrow = out_dtype == torch.bfloat16
    if fmt == "int4-g32":
        values = _unpack_int4(weight)
        if not (narrow and scale.dtype == torch.bfloat16):
            values, scale = values.to(torch.float32), scale.to(torch.float32)
        w = _times_groups(fmt, values, scale)
    elif fmt == "mxfp4":
        values = _unpack_e2m1(weight)
        powers = torch.exp2(scale.to(torch.float32) - 127.0)  # E8M0: a power of two, exact in bf16 too
        if not narrow:
            values = values.to(torch.float32)
        w = _times_groups(fmt, values, powers.to(values.dtype))
    elif fmt == "fp8-block":
        w = _times_blocks(weight.to(torch.float32), scale.to(torch.float32))
    else:
        raise config_error(None, "unknown quantized expert format", fmt, "use int4-g32, mxfp4 or fp8-block")
    return w.to(out_dtype)


def used_groups(cu_seqlens: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """The non-empty groups and their compacted inclusive ends (int32, one host sync)."""
    ends = cu_seqlens.to("cpu", torch.int64).tolist()
    groups, compact, start = [], [], 0
    for g, end in enumerate(ends):
        if end > start:
            groups.append(g)
            compact.append(end)
        start = max(start, end)
    return groups, torch.tensor(compact, dtype=torch.int32, device=cu_seqlens.device)


def quantized_grouped_ffn(hidden_nvsh: torch.Tensor, fmt: str, w13: torch.Tensor, w13_scale: torch.Tensor,
                          w2: torch.Tensor, w2_scale: torch.Tensor, cu_seqlens: torch.Tensor,
                          route_weights_nvs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`grouped_ffn` over quantized ``[E+B]`` views: only the used rows are dequantized.

    ``w13`` / ``w13_scale`` / ``w2`` / ``w2_scale``: the Gen A views (``[E+B, ...]``) of the fused gate-up
    and down weights and their scales; ``cu_seqlens`` ``[E+B]`` int32 inclusive ends."""
    M = hidden_nvsh.shape[0]
    groups, compact = used_groups(cu_seqlens)
    if not groups:
        return torch.zeros(M, w2.shape[1], dtype=hidden_nvsh.dtype, device=hidden_nvsh.device)
    rows = torch.tensor(groups, dtype=torch.int64, device=w13.device)
    gate_up = dequantize_rows(fmt, w13.index_select(0, rows), w13_scale.index_select(0, rows))
    down = dequantize_rows(fmt, w2.index_select(0, rows), w2_scale.index_select(0, rows))
    inter = gate_up.shape[1] // 2
    return grouped_ffn(hidden_nvsh, gate_up[:, :inter], gate_up[:, inter:], down, compact, route_weights_nvs)


def views_of(fmt: str, views: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``(w13, w13_scale, w2, w2_scale)`` from a ``{vLLM parameter name: view}`` map of format ``fmt``."""
    weight = "weight" if fmt == "fp8-block" else "weight_packed"
    scale = "weight_scale_inv" if fmt == "fp8-block" else "weight_scale"
    try:
        return views[f"w13_{weight}"], views[f"w13_{scale}"], views[f"w2_{weight}"], views[f"w2_{scale}"]
    except KeyError as exc:
        raise config_error(None, f"{fmt} views need w13/w2 {weight} and {scale}", sorted(views),
                           "pass the store's views named as layout.formats.expert_projections names them") from exc
