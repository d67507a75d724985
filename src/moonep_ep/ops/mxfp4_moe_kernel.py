"""MXFP4 W4A16 grouped GEMM in Triton over MoonEP's grouped rows and the store's ``[E+B]`` views.

vLLM 0.33.0 has no Triton kernel for MXFP4 weights with 16-bit activations
(its paths are Marlin, ``triton_kernels`` and emulation), so this is the
project's own, in the form of vLLM's ``fused_moe_kernel``: one program per
``(BLOCK_M rows, BLOCK_N outputs)`` tile, the weight row from ``expert_ids``
(:mod:`moonep_ep.ops.grouped_blocks`), rows past ``num_tokens_post_padded``
not computed.

Weights ``[G, N, K/2]`` uint8, two E2M1 codes a byte, the even ``k`` in the low
nibble (compressed-tensors ``pack_fp4_to_uint8``); scales ``[G, N, K/32]``
uint8 E8M0. One K step is one scale group (32 values = 16 bytes): the codes
go through a 16-entry lookup table to their values (exact in fp16 and bf16),
the even and odd halves are two ``tl.dot`` s with the activations' even and
odd columns, and the fp32 partial product is multiplied by ``2^(e - 127)``
before it is added to the fp32 accumulator — so a scale never passes through
16-bit range. The output is rounded once to the activations' dtype.

Offsets are int64 (an ``[E+B]`` view of one real projection passes 2^31
bytes). E8M0 ``0xFF`` (NaN) is read as ``2^128`` = inf, not NaN.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..errors import config_error
from .grouped_blocks import GroupedBlocks
from .quantized_experts import E2M1_VALUES

__all__ = ["mxfp4_grouped_gemm", "MXFP4_GROUP"]

MXFP4_GROUP = 32


@functools.lru_cache(maxsize=None)
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def mxfp4_grouped_gemm_kernel(a_ptr, b_ptr, s_ptr, c_ptr, lut_ptr, expert_ids_ptr, ntpp_ptr,
                                  M, N, K,
                                  stride_am, stride_ak, stride_be, stride_bn, stride_bk,
                                  stride_se, stride_sn, stride_sk, stride_cm, stride_cn,
                                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, compute_type: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if pid_m * BLOCK_M >= tl.load(ntpp_ptr):
            return
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        if expert < 0:
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
        row_mask = offs_m < M
        n_mask = offs_n < N
        offs_byte = tl.arange(0, 16).to(tl.int64)          # 16 bytes = one group of 32 values
        a_even = a_ptr + offs_m[:, None] * stride_am + (2 * offs_byte[None, :]) * stride_ak
        b_rows = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_byte[:, None] * stride_bk
        s_rows = s_ptr + expert * stride_se + offs_n * stride_sn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for g in range(0, K // 32):
            a_lo = tl.load(a_even + (g * 32) * stride_ak, mask=row_mask[:, None], other=0.0).to(compute_type)
            a_hi = tl.load(a_even + (g * 32 + 1) * stride_ak, mask=row_mask[:, None], other=0.0).to(compute_type)
            packed = tl.load(b_rows + (g * 16) * stride_bk, mask=n_mask[None, :], other=0).to(tl.int32)
            w_lo = tl.load(lut_ptr + (packed & 0xF)).to(compute_type)       # [16, BLOCK_N]
            w_hi = tl.load(lut_ptr + ((packed >> 4) & 0xF)).to(compute_type)
            part = tl.dot(a_lo, w_lo)
            part = tl.dot(a_hi, w_hi, acc=part)
            e = tl.load(s_rows + g * stride_sk, mask=n_mask, other=127).to(tl.int32)
            acc += part * tl.exp2((e - 127).to(tl.float32))[None, :]
        c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(compute_type), mask=row_mask[:, None] & n_mask[None, :])

    return mxfp4_grouped_gemm_kernel


_LUTS: dict[torch.device, torch.Tensor] = {}


def _lut(device: torch.device) -> torch.Tensor:
    if device not in _LUTS:
        _LUTS[device] = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return _LUTS[device]


def mxfp4_grouped_gemm(a: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor,
                       blocks: GroupedBlocks, block_n: int = 64) -> torch.Tensor:
    """``out[rows of group g] = a[rows] @ dequant(weight[g], scale[g]).T`` for every block of ``blocks``.

    ``a`` ``[M, K]`` bf16/fp16; ``weight`` ``[G, N, K/2]`` uint8; ``scale`` ``[G, N, K/32]`` uint8;
    ``out`` ``[M, N]`` in ``a``'s dtype (rows of blocks not computed are left as they are)."""
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
    compute = tl.bfloat16 if a.dtype == torch.bfloat16 else tl.float16
    grid = (blocks.num_blocks, -(-N // block_n))
    _kernel()[grid](a, weight, scale, out, _lut(a.device), blocks.expert_ids, blocks.num_tokens_post_padded,
                    M, N, K, a.stride(0), a.stride(1), weight.stride(0), weight.stride(1), weight.stride(2),
                    scale.stride(0), scale.stride(1), scale.stride(2), out.stride(0), out.stride(1),
                    BLOCK_M=blocks.block_m, BLOCK_N=block_n, compute_type=compute)
    return out
