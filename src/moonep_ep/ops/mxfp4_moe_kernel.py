"""MXFP4 W4A16 grouped GEMM in Triton over MoonEP's grouped rows and the store's ``[E+B]`` views.

vLLM 0.33.0 has no Triton kernel for MXFP4 weights with 16-bit activations
(its paths are Marlin, ``triton_kernels`` and emulation), so this is the
project's own, in the form of vLLM's ``fused_moe_kernel``: one program per
``(BLOCK_M rows, BLOCK_N outputs)`` tile, the weight row from ``expert_ids``
(:mod:`moonep_ep.ops.grouped_blocks`), rows past ``num_tokens_post_padded``
not computed; the config's ``num_warps`` and ``num_stages`` go to the launch.

Weights ``[G, N, K/2]`` uint8, two E2M1 codes a byte, the even ``k`` in the low
nibble (compressed-tensors ``pack_fp4_to_uint8``); scales ``[G, N, K/32]``
uint8 E8M0. Per K step the activations are one contiguous ``[BLOCK_M,
BLOCK_K]`` load and the weights one ``[BLOCK_K, BLOCK_N]`` load of the bytes
``k // 2`` (each byte read for its two ``k``, as vLLM's INT4 kernel reads its
nibbles), shifted by ``4 · (k % 2)``. A code becomes its fp32 value by bit
arithmetic (sign, 2-bit exponent, 1-bit mantissa: no lookup table), and an
E8M0 byte ``x`` its fp32 power of two ``2^(x - 127)`` by placing ``x`` in the
exponent field (``x = 0``: the subnormal ``2^-127``; ``x = 255``, E8M0's NaN:
``+inf``, as before).

* **bf16 activations** (MoonEP's dtype): the weight tile is scaled before the
  dot — ``value · 2^(x - 127)``, the format's own fp32 dequantized value,
  rounded to bf16 — and one ``tl.dot`` of ``BLOCK_K`` (the config's 128 or 64
  where it divides K, else 32: 2-4 scale groups) accumulates into the single
  fp32 tile. The rounding is exact: an
  E2M1 value has at most 2 significant bits and bf16 keeps fp32's exponent
  range, so for every ``x`` in ``[2, 252]`` the product is a normal bf16
  (``|value|`` is ``2^-1 .. 1.5 · 2^2``: exponents ``x - 128 .. x - 125``
  within ``[-126, 127]``), and for ``x`` in ``{0, 1}`` the smallest codes'
  products are bf16 subnormals, exact as numbers (down to ``2^-128``; bf16's
  least is ``2^-133``) — a GPU whose MMA flushed subnormal inputs would read
  those weights, below ``2^-126``, as 0. For ``x`` in ``{253, 254}`` the codes whose
  value reaches ``2^128`` (``|value| >= 4`` at 253, ``>= 2`` at 254) are
  ``±inf`` already in fp32, as in compressed-tensors' fp32 decompression,
  and so are the rows that read them (a post-dot scale could keep such a row
  finite); ``x = 255`` is an inf scale. A scale picked as the OCP MX spec
  picks it (``floor(log2 amax) - 2``, biased by 127) is above 252 only for a
  group whose largest weight is ``2^128`` or more (past fp32's range) and
  below 2 only for one whose largest weight is under ``2^-123``.
* **fp16 activations**: fp16 cannot hold ``2^(x - 127)`` times the codes
  (its largest finite value is ``65504``), so the scale stays after the dot:
  one K step is one group (``BLOCK_K`` 32), its fp32 partial product times
  ``2^(x - 127)`` is added to the fp32 accumulator.

The output is rounded once to the activations' dtype. Offsets are int64
(an ``[E+B]`` view of one real projection passes 2^31 bytes).
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Optional

import torch

from ..errors import config_error
from .grouped_blocks import GroupedBlocks

__all__ = ["mxfp4_grouped_gemm", "mxfp4_launch_config", "MXFP4_GROUP", "MXFP4_DEFAULT_CONFIG"]

MXFP4_GROUP = 32
#: launch parameters when the caller's config leaves them out (Triton's own defaults for warps and stages)
MXFP4_DEFAULT_CONFIG = {"BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "num_warps": 4, "num_stages": 3}


@functools.lru_cache(maxsize=None)
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def mxfp4_grouped_gemm_kernel(a_ptr, b_ptr, s_ptr, c_ptr, expert_ids_ptr, ntpp_ptr,
                                  M, N, K,
                                  stride_am, stride_ak, stride_be, stride_bn, stride_bk,
                                  stride_se, stride_sn, stride_sk, stride_cm, stride_cn,
                                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                  SCALE_BEFORE_DOT: tl.constexpr, compute_type: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if pid_m * BLOCK_M >= tl.load(ntpp_ptr):
            return
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        if expert < 0:
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
        row_mask = offs_m < M
        n_mask = offs_n < N
        a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + (offs_k[:, None] // 2) * stride_bk
        shift = ((offs_k % 2) * 4).to(tl.int32)[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_ptrs + k0 * stride_ak, mask=row_mask[:, None], other=0.0).to(compute_type)
            packed = tl.load(b_ptrs + (k0 // 2) * stride_bk, mask=n_mask[None, :], other=0).to(tl.int32)
            # E2M1 code -> fp32 value by its bits: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0;
            # exponent 0 is 0 or the subnormal 0.5 (fp32 exponent field 126)
            code = (packed >> shift) & 0xF                                    # [BLOCK_K, BLOCK_N]
            exp = (code >> 1) & 3
            man = code & 1
            bits = tl.where(exp > 0, ((exp + 126) << 23) | (man << 22), man * (126 << 23)) | ((code >> 3) << 31)
            values = bits.to(tl.float32, bitcast=True)
            if SCALE_BEFORE_DOT:
                s_ptrs = (s_ptr + expert * stride_se + offs_n[None, :] * stride_sn
                          + ((k0 + offs_k[:, None]) // 32) * stride_sk)
                x = tl.load(s_ptrs, mask=n_mask[None, :], other=127).to(tl.int32)
                # E8M0 x -> 2^(x - 127) in fp32: x is the exponent field (0: the subnormal 2^-127; 255: +inf)
                power = tl.where(x > 0, x << 23, 1 << 22).to(tl.float32, bitcast=True)
                acc = tl.dot(a, (values * power).to(compute_type), acc=acc)
            else:  # BLOCK_K == 32: one group, its scale after the dot
                x = tl.load(s_ptr + expert * stride_se + offs_n * stride_sn + (k0 // 32) * stride_sk,
                            mask=n_mask, other=127).to(tl.int32)
                power = tl.where(x > 0, x << 23, 1 << 22).to(tl.float32, bitcast=True)
                acc += tl.dot(a, values.to(compute_type)) * power[None, :]
        c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(compute_type), mask=row_mask[:, None] & n_mask[None, :])

    return mxfp4_grouped_gemm_kernel


def mxfp4_launch_config(dtype: torch.dtype, K: int, config: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """``BLOCK_N``, ``BLOCK_K``, ``num_warps``, ``num_stages`` and whether the scale goes before the dot, for
    activations of ``dtype`` and reduction length ``K``, from a vLLM-style config (missing keys:
    :data:`MXFP4_DEFAULT_CONFIG`). bf16: the largest of 128, 64, 32 that is at most the config's
    ``BLOCK_SIZE_K`` and divides ``K``; fp16: 32 (one scale group per dot)."""
    cfg = {**MXFP4_DEFAULT_CONFIG, **dict(config or {})}
    before = dtype == torch.bfloat16
    if before:
        block_k = next(b for b in (128, 64, MXFP4_GROUP) if b <= max(int(cfg["BLOCK_SIZE_K"]), MXFP4_GROUP)
                       and K % b == 0)
    else:
        block_k = MXFP4_GROUP
    return {"BLOCK_N": int(cfg["BLOCK_SIZE_N"]), "BLOCK_K": block_k, "SCALE_BEFORE_DOT": before,
            "num_warps": int(cfg["num_warps"]), "num_stages": int(cfg["num_stages"])}


def mxfp4_grouped_gemm(a: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor,
                       blocks: GroupedBlocks, config: Optional[Mapping[str, Any]] = None) -> torch.Tensor:
    """``out[rows of group g] = a[rows] @ dequant(weight[g], scale[g]).T`` for every block of ``blocks``.

    ``a`` ``[M, K]`` bf16/fp16; ``weight`` ``[G, N, K/2]`` uint8; ``scale`` ``[G, N, K/32]`` uint8;
    ``out`` ``[M, N]`` in ``a``'s dtype (rows of blocks not computed are left as they are); ``config``: a
    vLLM-style block config (``BLOCK_SIZE_N``, ``BLOCK_SIZE_K``, ``num_warps``, ``num_stages``; see
    :func:`mxfp4_launch_config`)."""
    import triton.language as tl

    M, K = a.shape
    if weight.dtype != torch.uint8 or scale.dtype != torch.uint8 or weight.dim() != 3 or scale.dim() != 3:
        raise config_error(None, "MXFP4 weights and scales must be [G, N, K/2] and [G, N, K/32] uint8",
                           (weight.dtype, tuple(weight.shape), scale.dtype, tuple(scale.shape)),
                           "pass the store's weight_packed and weight_scale views")
    G, N = weight.shape[:2]
    if K % MXFP4_GROUP or weight.shape[2] * 2 != K or tuple(scale.shape) != (G, N, K // MXFP4_GROUP):
        raise config_error(None, f"MXFP4 shapes do not fit activations with K={K}",
                           (tuple(weight.shape), tuple(scale.shape)),
                           f"pass weights [G, N, {K // 2}] and scales [G, N, {K // MXFP4_GROUP}]")
    if a.dtype not in (torch.bfloat16, torch.float16) or out.dtype != a.dtype or tuple(out.shape) != (M, N):
        raise config_error(None, "activations must be bf16/fp16 and out [M, N] of the same dtype",
                           (a.dtype, out.dtype, tuple(out.shape)), f"pass out = empty({M}, {N}, dtype={a.dtype})")
    launch = mxfp4_launch_config(a.dtype, K, config)
    compute = tl.bfloat16 if a.dtype == torch.bfloat16 else tl.float16
    grid = (blocks.num_blocks, -(-N // launch["BLOCK_N"]))
    _kernel()[grid](a, weight, scale, out, blocks.expert_ids, blocks.num_tokens_post_padded,
                    M, N, K, a.stride(0), a.stride(1), weight.stride(0), weight.stride(1), weight.stride(2),
                    scale.stride(0), scale.stride(1), scale.stride(2), out.stride(0), out.stride(1),
                    BLOCK_M=blocks.block_m, BLOCK_N=launch["BLOCK_N"], BLOCK_K=launch["BLOCK_K"],
                    SCALE_BEFORE_DOT=launch["SCALE_BEFORE_DOT"], compute_type=compute,
                    num_warps=launch["num_warps"], num_stages=launch["num_stages"])
    return out
