"""MXFP4 W4A16 grouped GEMM in Triton over MoonEP's grouped rows and the store's ``[E+B]`` views.

vLLM 0.33.0 has no Triton kernel for MXFP4 weights with 16-bit activations
(its paths are Marlin, ``triton_kernels`` and emulation), so this is the
project's own, in the form of vLLM's ``fused_moe_kernel``: one program per
``(BLOCK_M rows, BLOCK_N outputs)`` tile, the weight row from ``expert_ids``
(:mod:`moonep_ep.ops.experts.grouped_blocks`), rows past ``num_tokens_post_padded``
not computed, blocks whose ``expert_ids`` entry is ``-1`` written as zeros (as
vLLM's kernels do); the config's ``num_warps`` and ``num_stages`` go to the launch.

Weights ``[G, N, K/2]`` uint8, two E2M1 codes a byte, the even ``k`` in the low
nibble (compressed-tensors ``pack_fp4_to_uint8``); scales ``[G, N, K/32]``
uint8 E8M0. Per K step the activations are one contiguous ``[BLOCK_M,
BLOCK_K]`` load and the weights one ``[BLOCK_K, BLOCK_N]`` load of the bytes
``k // 2`` (each byte read for its two ``k``, as vLLM's INT4 kernel reads its
nibbles), shifted by ``4 · (k % 2)``. A code becomes its fp32 value by bit
arithmetic (sign, 2-bit exponent, 1-bit mantissa: no lookup table), and an
E8M0 byte ``x`` its fp32 power of two ``2^(x - 127)`` by placing ``x`` in the
exponent field (``x = 0``: the subnormal ``2^-127``; ``x = 255`` is NaN, as
the OCP MX spec v1.0 defines it, so every weight and output it scales is NaN).

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
  finite); ``x = 255`` is a NaN scale. A scale picked as the OCP MX spec
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
import os
from typing import Any, Mapping, Optional

import torch

from ...errors import config_error
from .grouped_blocks import GroupedBlocks

__all__ = ["mxfp4_grouped_gemm", "mxfp4_launch_config", "mxfp4_tile_cost", "mxfp4_within_bound", "MXFP4_GROUP",
           "MXFP4_DEFAULT_CONFIG"]

MXFP4_GROUP = 32
#: launch parameters when the caller's config leaves them out (Triton's own defaults for warps and stages)
MXFP4_DEFAULT_CONFIG = {"BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "num_warps": 4, "num_stages": 3}

#: Hopper (sm_90) limits every launch is held to: registers one thread can address, the 32-bit register file a
#: block's threads share (so 16 warps get 128 each), shared memory one block may use (227 KiB of the SM's 228)
HOPPER_MAX_REGISTERS = 255
HOPPER_REGISTER_FILE = 64 * 1024
HOPPER_MAX_SHARED = 227 * 1024
#: values a thread may hold of each tile at up to 8 warps: the fp32 accumulator ``[BLOCK_M, BLOCK_N]`` (fp16:
#: counted twice), one ``[BLOCK_K, BLOCK_N]`` dequantization tile, the 16-bit ``[BLOCK_M, BLOCK_K]`` activation
#: tile. In registers 32 + 2 x 64 (two 32-bit decode temporaries live at once) + 2 x 16 (two 16-bit activations a
#: register, the tile in the dot and the next in flight) = 192 of 255, leaving MXFP4_REGISTER_RESERVE for
#: addresses, offsets and masks; checked against ptxas for sm_90a (docs/design/vllm_experts.md, "The MXFP4 launch
#: bound")
MXFP4_MAX_PER_THREAD = {"accumulator": 32, "dequant": 64, "activations": 32}
MXFP4_REGISTER_RESERVE = 63


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
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
        row_mask = offs_m < M
        n_mask = offs_n < N
        if expert < 0:
            # a block of padding only: zeros without reading a (as vLLM's write_zeros_to_output), so the output
            # needs no zero fill and the rows feeding it need not be written
            c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
            tl.store(c_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=compute_type),
                     mask=row_mask[:, None] & n_mask[None, :])
            return
        offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
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
                # E8M0 x -> 2^(x - 127) in fp32: x is the exponent field (0: the subnormal 2^-127); 255 is
                # E8M0's NaN, a quiet NaN here (its field alone would read as +inf)
                power = tl.where(x == 255, 0x7FC00000, tl.where(x > 0, x << 23, 1 << 22)).to(tl.float32, bitcast=True)
                acc = tl.dot(a, (values * power).to(compute_type), acc=acc)
            else:  # BLOCK_K == 32: one group, its scale after the dot
                x = tl.load(s_ptr + expert * stride_se + offs_n * stride_sn + (k0 // 32) * stride_sk,
                            mask=n_mask, other=127).to(tl.int32)
                power = tl.where(x == 255, 0x7FC00000, tl.where(x > 0, x << 23, 1 << 22)).to(tl.float32, bitcast=True)
                acc += tl.dot(a, values.to(compute_type)) * power[None, :]
        c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(compute_type), mask=row_mask[:, None] & n_mask[None, :])

    return mxfp4_grouped_gemm_kernel


def mxfp4_tile_cost(block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int,
                    scale_before_dot: bool = True) -> dict[str, int]:
    """What one launch holds, as the launch bound counts it (docs/design/vllm_experts.md, "The MXFP4 launch bound").

    Per thread (``32 · num_warps`` threads share each tile): ``accumulator``, values of the fp32 ``[BLOCK_M,
    BLOCK_N]`` tile (twice in fp16, where each group's dot is a second such tile before it is scaled and added);
    ``dequant``, of one ``[BLOCK_K, BLOCK_N]`` dequantization tile (packed, code, bits, value, power: a chain of
    32-bit temporaries); ``activations``, of the 16-bit ``[BLOCK_M, BLOCK_K]`` tile; ``register_limit``, Hopper's
    255 or the register file's share. Per block, ``shared_bytes``: ``num_stages`` pipelined activation tiles, the
    dequantized ``[BLOCK_K, BLOCK_N]`` dot operand and the ``[BLOCK_M, BLOCK_N]`` output tile staged for the
    store (the weight and scale bytes go to registers, not shared memory: their addresses repeat, so no async
    copy carries them; what Triton 3.8 allocates for sm_90a is at most this)."""
    threads = 32 * num_warps
    return {"accumulator": -(-block_m * block_n // threads) * (1 if scale_before_dot else 2),
            "dequant": -(-block_k * block_n // threads),
            "activations": -(-block_m * block_k // threads),
            "register_limit": min(HOPPER_MAX_REGISTERS, HOPPER_REGISTER_FILE // threads),
            "shared_bytes": 2 * (max(num_stages, 1) * block_m * block_k + block_k * block_n + block_m * block_n)}


def _over(cost: Mapping[str, int]) -> list[str]:
    """The tiles over their per-thread cap. Where the register file leaves a thread fewer than 255 registers (16
    warps: 128) the reserve stays and the caps shrink with what is left for tiles (65 of 192: about a third)."""
    share = (cost["register_limit"] - MXFP4_REGISTER_RESERVE) / (HOPPER_MAX_REGISTERS - MXFP4_REGISTER_RESERVE)
    return [name for name, cap in MXFP4_MAX_PER_THREAD.items() if cost[name] > cap * share]


def mxfp4_within_bound(cost: Mapping[str, int]) -> bool:
    """Whether a :func:`mxfp4_tile_cost` fits Hopper: every tile within its cap, the shared memory within 227 KiB."""
    return not _over(cost) and cost["shared_bytes"] <= HOPPER_MAX_SHARED


def mxfp4_launch_config(dtype: torch.dtype, K: int, config: Optional[Mapping[str, Any]] = None,
                        block_m: Optional[int] = None, bounded: bool = True) -> dict[str, Any]:
    """``BLOCK_N``, ``BLOCK_K``, ``num_warps``, ``num_stages`` and whether the scale goes before the dot, for
    activations of ``dtype``, reduction length ``K`` and row blocks of ``block_m`` (default: the config's
    ``BLOCK_SIZE_M``, else 16), from a vLLM-style config (missing keys: :data:`MXFP4_DEFAULT_CONFIG`). bf16: the
    largest of 128, 64, 32 that is at most the config's ``BLOCK_SIZE_K`` and divides ``K``; fp16: 32 (one scale
    group per dot).

    Then held to the launch bound (:func:`mxfp4_within_bound`), whatever the config asked: the configs come from
    vLLM's tuned files for bf16 weights (``BLOCK_SIZE_N`` 256 with 4 stages on H100/H200), whose tiles run this
    kernel's dequantization out of registers (ptxas for sm_90a: all 255 a thread, and spills). Registers: 16
    warps down to 8; then ``BLOCK_N`` halved (down to 16) while the accumulator is over its cap, ``BLOCK_K``
    (down to 32, still dividing ``K``) while the activation tile is, either (``BLOCK_N`` first) while the
    dequantization tile is, and ``num_warps`` up to 8 where the tiles are at their least; shared memory: fewer
    stages, then a shorter ``BLOCK_K``. A config within the bound is kept as it is.

    ``bounded=False`` (Triton's interpreter, which has no registers to spill; :func:`mxfp4_grouped_gemm` passes
    it there) keeps every config as asked: the CPU engine's wide interpreter tiles (N 512) are its speed."""
    cfg = {**MXFP4_DEFAULT_CONFIG, **dict(config or {})}
    before = dtype == torch.bfloat16
    if before:
        block_k = next(b for b in (128, 64, MXFP4_GROUP) if b <= max(int(cfg["BLOCK_SIZE_K"]), MXFP4_GROUP)
                       and K % b == 0)
    else:
        block_k = MXFP4_GROUP
    bm = int(block_m if block_m is not None else cfg.get("BLOCK_SIZE_M", 16))
    bn, warps, stages = int(cfg["BLOCK_SIZE_N"]), int(cfg["num_warps"]), int(cfg["num_stages"])

    def cost() -> dict[str, int]:
        return mxfp4_tile_cost(bm, bn, block_k, warps, stages, before)

    def launch() -> dict[str, Any]:
        return {"BLOCK_N": bn, "BLOCK_K": block_k, "SCALE_BEFORE_DOT": before, "num_warps": warps,
                "num_stages": stages}

    if not bounded:
        return launch()
    # 16 warps share the register file at 128 registers each (65 beside the reserve); 8 get Hopper's 255
    while _over(cost()) and warps > 8:
        warps //= 2
    # the accumulator shrinks with BLOCK_N, the activation tile with BLOCK_K, the dequantization tile with either
    # (BLOCK_N first: the K step stays long); BLOCK_K stays a multiple of 32 dividing K
    while over := _over(cost()):
        if "accumulator" in over and bn > 16:
            bn //= 2
        elif "activations" in over and block_k > MXFP4_GROUP:
            block_k //= 2
        elif "dequant" in over and bn > 16:
            bn //= 2
        elif "dequant" in over and block_k > MXFP4_GROUP:
            block_k //= 2
        elif warps < 8:  # tiles at their least: more threads to share them
            warps *= 2
        else:
            break
    while cost()["shared_bytes"] > HOPPER_MAX_SHARED and stages > 1:
        stages -= 1
    while cost()["shared_bytes"] > HOPPER_MAX_SHARED and block_k > MXFP4_GROUP:
        block_k //= 2
    if not mxfp4_within_bound(cost()):
        raise config_error(None, f"no MXFP4 launch for BLOCK_M {bm} fits Hopper's registers and shared memory",
                           cost(), "use a BLOCK_SIZE_M of at most 256")
    return launch()


def mxfp4_grouped_gemm(a: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor,
                       blocks: GroupedBlocks, config: Optional[Mapping[str, Any]] = None) -> torch.Tensor:
    """``out[rows of group g] = a[rows] @ dequant(weight[g], scale[g]).T`` for every block of ``blocks``.

    ``a`` ``[M, K]`` bf16/fp16; ``weight`` ``[G, N, K/2]`` uint8; ``scale`` ``[G, N, K/32]`` uint8;
    ``out`` ``[M, N]`` in ``a``'s dtype (``-1`` blocks below ``num_tokens_post_padded`` are written as zeros, rows
    at or past it are left as they are); ``config``: a
    vLLM-style block config (``BLOCK_SIZE_N``, ``BLOCK_SIZE_K``, ``num_warps``, ``num_stages``; see
    :func:`mxfp4_launch_config`, which holds it to the launch bound for ``blocks.block_m``)."""
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
    launch = mxfp4_launch_config(a.dtype, K, config, block_m=blocks.block_m,
                                 bounded=os.environ.get("TRITON_INTERPRET") != "1")
    compute = tl.bfloat16 if a.dtype == torch.bfloat16 else tl.float16
    grid = (blocks.num_blocks, -(-N // launch["BLOCK_N"]))
    _kernel()[grid](a, weight, scale, out, blocks.expert_ids, blocks.num_tokens_post_padded,
                    M, N, K, a.stride(0), a.stride(1), weight.stride(0), weight.stride(1), weight.stride(2),
                    scale.stride(0), scale.stride(1), scale.stride(2), out.stride(0), out.stride(1),
                    BLOCK_M=blocks.block_m, BLOCK_N=launch["BLOCK_N"], BLOCK_K=launch["BLOCK_K"],
                    SCALE_BEFORE_DOT=launch["SCALE_BEFORE_DOT"], compute_type=compute,
                    num_warps=launch["num_warps"], num_stages=launch["num_stages"])
    return out
