"""Quantized expert FFN on CPU: dequantize only the ``[E+B]`` rows a step uses, then the grouped GEMM.

vLLM's quantized CPU experts (``CPUExpertsFp8``, ``CPUExpertsMxfp4``,
``CPUExpertsInt4``) need x86 AMX, which these machines lack, so the CPU path
is this project's own. For each non-empty ``cu_seqlens`` group ``g`` (an
expert ``g < E`` or a slot ``E + b``) the weight rows and their scale rows
— one row index for both, as the store holds them — are dequantized to
bf16, and :func:`~moonep_ep.ops.experts.grouped.grouped_ffn` runs over the compacted
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
  ``w = e2m1(code) · 2^(scale - 127)``, NaN for the scale 0xFF;
* ``fp8-block`` — ``weight`` float8_e4m3fn ``[N, K]``; ``weight_scale_inv``
  fp32 ``[ceil(N/128), ceil(K/128)]``: ``w = weight · scale_inv`` per
  128x128 block (DeepSeek-V3's ``README_WEIGHTS.md``).

The tests compare these against compressed-tensors' own decompressor, not
against this file.

**Memory.** The used rows are dequantized a chunk at a time
(:func:`rows_per_chunk`: ``c = max(1, floor(2^27 / (3·I·H)))`` rows, 3 at K2's
H 7168, I 2048), each chunk's dense weights freed before the next chunk's
exist. With ``n = 3·I·H`` weight values a row, ``M`` rows of ``hidden_nvsh``
and ``β`` the format's bytes per value at the widest moment of its
dequantization, one call's transient peak is at most::

    2·M·H  +  2·M·(3·I + 2·H)  +  β·c·n      bytes

(the bf16 output; the chunk's bf16 activations; the chunk's rows copied out
of the view, their 16/32-bit temporaries and the gate-up rows kept while the
down rows are built). ``β``: FP8 block 9 (the e4m3 copy, fp32 values, fp32
product), INT4 8.56 (the words' copy, shifted and masked int32 nibbles),
MXFP4 4.72 (the bytes' copy, their int32 indices, the bf16 pairs), each
worked out and measured in ``tests/ops/test_quantized_experts.py``; more
with fp32 INT4 scales or a partial FP8 128-block (its repeated fp32 scales).
Measured there at K2's FP8 shape with 96 used rows of 16 rows each: 0.815 GB
in chunks of 3 rows, under the bound's 1.275 GB; all rows at once, 25.39 GB.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from ...errors import config_error
from .activation import SILU, GatedActivation
from .grouped import group_bounds, grouped_ffn

__all__ = ["dequantize_rows", "quantized_grouped_ffn", "rows_per_chunk", "used_groups", "DEQUANT_CHUNK_ELEMENTS",
           "E2M1_VALUES"]

#: E2M1 code -> value (codes 8..15 are the negatives)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32
FP8_BLOCK = 128
#: dequantized weight values per chunk of used rows (2^27: 3 rows of a K2 expert, 3·2048·7168 values each)
DEQUANT_CHUNK_ELEMENTS = 1 << 27
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
        powers.masked_fill_(scale == 0xFF, float("nan"))  # E8M0's NaN (OCP MX v1.0); exp2 alone: 2^128 = inf
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
    bounds = group_bounds(cu_seqlens)
    return [g for g, _, _ in bounds], torch.tensor([e for _, _, e in bounds], dtype=torch.int32,
                                                   device=cu_seqlens.device)


def rows_per_chunk(hidden: int, intermediate: int, chunk_elements: int = DEQUANT_CHUNK_ELEMENTS) -> int:
    """Used ``[E+B]`` rows dequantized at once: as many whole rows (``3·I·H`` weight values: gate, up, down) as
    fit ``chunk_elements``, at least one."""
    return max(1, chunk_elements // (3 * intermediate * hidden))


def quantized_grouped_ffn(hidden_nvsh: torch.Tensor, fmt: str, w13: torch.Tensor, w13_scale: torch.Tensor,
                          w2: torch.Tensor, w2_scale: torch.Tensor, cu_seqlens: torch.Tensor,
                          route_weights_nvs: Optional[torch.Tensor] = None, *,
                          chunk_elements: int = DEQUANT_CHUNK_ELEMENTS,
                          activation: GatedActivation = SILU,
                          up: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """:func:`grouped_ffn` over quantized ``[E+B]`` views: only the used rows are dequantized, a chunk at a time.

    ``w13`` / ``w13_scale`` / ``w2`` / ``w2_scale``: the pull views (``[E+B, ...]``) of the fused gate-up
    and down weights and their scales; ``cu_seqlens`` ``[E+B]`` int32 inclusive ends. The used rows go in
    chunks of :func:`rows_per_chunk` (consecutive groups, so a chunk's rows of ``hidden_nvsh`` are one
    slice); a chunk's dense weights and temporaries are freed before the next chunk's are built, which bounds
    the call's transient memory by the chunk, not by the number of used rows (the module docstring's bound).
    The result is the same, bit for bit, whatever the chunk. ``activation``: the layer's (SiLU or SiTU),
    computed by :func:`grouped_ffn`. ``up``: the push layout's ``(up, up_scale)`` rows; ``w13`` / ``w13_scale``
    are then the gate rows alone (the two halves of vLLM's fused row, stored apart)."""
    M, H = hidden_nvsh.shape
    out = torch.zeros(M, w2.shape[1], dtype=hidden_nvsh.dtype, device=hidden_nvsh.device)
    bounds = group_bounds(cu_seqlens)
    inter = w13.shape[1] // 2 if up is None else w13.shape[1]
    step = rows_per_chunk(H, inter, chunk_elements)
    for i in range(0, len(bounds), step):
        part = bounds[i:i + step]
        lo, hi = part[0][1], part[-1][2]
        rows = torch.tensor([g for g, _, _ in part], dtype=torch.int64, device=w13.device)
        gate_up = dequantize_rows(fmt, w13.index_select(0, rows), w13_scale.index_select(0, rows))
        if up is not None:
            gate_up = torch.cat([gate_up, dequantize_rows(fmt, up[0].index_select(0, rows),
                                                          up[1].index_select(0, rows))], dim=1)
        down = dequantize_rows(fmt, w2.index_select(0, rows), w2_scale.index_select(0, rows))
        ends = torch.tensor([e - lo for _, _, e in part], dtype=torch.int32, device=cu_seqlens.device)
        route = None if route_weights_nvs is None else route_weights_nvs[lo:hi]
        out[lo:hi] = grouped_ffn(hidden_nvsh[lo:hi], gate_up[:, :inter], gate_up[:, inter:], down, ends, route,
                                 activation=activation)
        del gate_up, down  # before the next chunk's rows exist: one chunk alive at a time
    return out


#: The push layout's tensor names (``layout.formats.expert_projections(split_w13=True)``)
SPLIT_NAMES = ("gate", "gate_scale", "up", "up_scale", "down", "down_scale")


def is_split(views: Mapping[str, torch.Tensor]) -> bool:
    """Whether ``views`` is the push layout (gate, up, down apart) rather than vLLM's fused w13/w2."""
    return "gate" in views


def views_of(fmt: str, views: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``(w13, w13_scale, w2, w2_scale)`` from a ``{vLLM parameter name: view}`` map of format ``fmt``."""
    weight = "weight" if fmt == "fp8-block" else "weight_packed"
    scale = "weight_scale_inv" if fmt == "fp8-block" else "weight_scale"
    try:
        return views[f"w13_{weight}"], views[f"w13_{scale}"], views[f"w2_{weight}"], views[f"w2_{scale}"]
    except KeyError as exc:
        raise config_error(None, f"{fmt} views need w13/w2 {weight} and {scale}", sorted(views),
                           "pass the store's views named as layout.formats.expert_projections names them") from exc
