"""The experts' elementwise work in one Triton pass over the row blocks that carry tokens.

Between the two grouped GEMMs the GPU experts compute, per row, the gated
activation (SiLU or SiTU, :mod:`.activation`), times the row's route weight,
and for FP8 block weights the 1x128 quantization of the result. Eagerly that
is 3 (SiLU) to 12 (SiTU) kernels, each over all ``NvS`` rows, most of them
MoonEP's padding at decode. Here it is one kernel in the form of the grouped
GEMMs (:mod:`.grouped_blocks`): one program per ``(BLOCK_M rows, BLOCK_N
columns)`` tile (its rows in slices of at most 32), and a program returns at
once when its row block starts at or past ``num_tokens_post_padded``
(``cu_seqlens[-1]``, read from the device: no
host sync) or its ``expert_ids`` entry is ``-1`` (a block of padding only, or
one past the groups). The GEMMs never read those blocks' rows (vLLM's kernels
and :mod:`.mxfp4_kernel` write zeros there without loading ``a``), so their
rows are left unwritten.

Numerics, as the eager chain (:class:`~.activation.GatedActivation`, then
``act.mul_(route.to(dtype))``) rounds:

* SiLU: ``silu(g)`` rounded to the activation dtype, times ``u`` rounded
  (vLLM ``MoonEPExperts``' two bf16 steps);
* SiTU: fp32 inside, ``beta·tanh(g/beta)·sigmoid(g) · linear_beta·tanh(u/linear_beta)``
  rounded once;
* then the route weight rounded to the dtype, the product rounded;
* FP8 (``QUANT``): vLLM's ``_per_token_group_quant_fp8`` on that rounded
  value, one group per ``BLOCK_N`` = 128 columns (``max(amax, eps) / fp8_max``,
  clamp, cast); with ``ACT`` none the same quantization of the input alone (the
  first GEMM's activations).

Triton 3.8's interpreter has no ``tanh`` (``libdevice`` is an extern call
there), so :func:`_tanh` is built from ``exp`` on every platform, one
formula for the interpreter and GPUs: ``(1 - e^-2|x|) / (1 + e^-2|x|)``, and
below ``|x|`` 0.25, where that cancels, the odd series to ``x^11`` (its next
term is under ``6e-11``). Within a few fp32 ulps of ``torch.tanh``; rounded
to bf16 the results equal the eager chain's but for a one-ulp flip where the
fp32 value sits on a rounding boundary (``tests/vllm/test_gated_activation.py``
measures how often).
"""

from __future__ import annotations

import functools
import os
from typing import Any, Optional

import torch

from .activation import GatedActivation
from .grouped_blocks import GroupedBlocks

__all__ = ["ACT_CODES", "QUANT_GROUP", "fused_gated_activation", "fused_quantize_fp8", "launch", "use_triton"]

#: the ``ACT`` constexpr per activation name; ``None``: no activation (quantization of the input only)
ACT_CODES = {None: 0, "silu": 1, "situ": 2}
#: FP8 block weights' activation group (vLLM's 1x128), one ``BLOCK_N`` of the kernel
QUANT_GROUP = 128
#: columns of one program: one FP8 quantization group (its rows are the blocks' ``block_m``, the GEMMs' tile)
BLOCK_N = QUANT_GROUP
#: rows one slice of a program's block computes at a time (GPU registers: 32 x 128 fp32 values over 4 warps are
#: 32 a thread per live tile; a 128-row block at once would spill)
SUB_M = 32


def use_triton(t: torch.Tensor) -> bool:
    """Whether ``t``'s device runs the kernel: CUDA, or the CPU under Triton's interpreter (``TRITON_INTERPRET=1``).
    Elsewhere (the meta device, a CPU without the interpreter) the callers keep the eager chain."""
    if t.device.type == "cuda":
        return True
    return t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def _tanh(x):
        ax = tl.abs(x)
        e = tl.exp(-2.0 * ax)
        big = tl.div_rn(1.0 - e, 1.0 + e)
        x2 = ax * ax
        small = ax + ax * x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (
            -0.05396825396825397 + x2 * (0.021869488536155203 + x2 * -0.008863235529902197))))
        r = tl.where(ax < 0.25, small, big)
        return tl.where(x < 0, -r, r)

    # a jitted kernel resolves the functions it calls among its module's globals
    globals()["_tanh"] = _tanh

    @triton.jit
    def gated_activation_kernel(x_ptr, y_ptr, route_ptr, out_ptr, scale_ptr, expert_ids_ptr, ntpp_ptr,
                                M, N, stride_xm, stride_xn, stride_ym, stride_yn, stride_om, stride_on,
                                stride_sm, stride_sn, beta, linear_beta,
                                ACT: tl.constexpr, HAS_ROUTE: tl.constexpr, HAS_LINEAR_BETA: tl.constexpr,
                                QUANT: tl.constexpr, fp8_min: tl.constexpr, fp8_max: tl.constexpr,
                                eps: tl.constexpr, BLOCK_M: tl.constexpr, SUB_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                dtype: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        # the rows the GEMMs compute, bounded on the device: nothing past cu_seqlens[-1], no padding-only block
        if pid_m * BLOCK_M >= tl.load(ntpp_ptr):
            return
        if tl.load(expert_ids_ptr + pid_m) < 0:
            return
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
        # the block in SUB_M-row slices: a [SUB_M, BLOCK_N] fp32 tile a few times over stays in registers
        for sub in tl.static_range(BLOCK_M // SUB_M):
            rows = pid_m * BLOCK_M + sub * SUB_M + tl.arange(0, SUB_M).to(tl.int64)
            row_mask = rows < M
            mask = row_mask[:, None] & (cols < N)[None, :]
            g = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xn, mask=mask, other=0.0
                        ).to(tl.float32)
            if ACT == 0:
                a = g
            else:
                u = tl.load(y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn, mask=mask, other=0.0
                            ).to(tl.float32)
                if ACT == 1:   # silu rounded, then the product rounded (MoonEPExperts' bf16 steps)
                    s = tl.div_rn(g, 1.0 + tl.exp(-g)).to(dtype).to(tl.float32)
                    a = (s * u).to(dtype).to(tl.float32)
                else:          # SiTU: fp32 inside, rounded once
                    t = beta * _tanh(tl.div_rn(g, beta)) * tl.div_rn(1.0, 1.0 + tl.exp(-g))
                    if HAS_LINEAR_BETA:
                        u = linear_beta * _tanh(tl.div_rn(u, linear_beta))
                    a = (t * u).to(dtype).to(tl.float32)
                if HAS_ROUTE:  # the weight rounded to the dtype first, then the product (MoonEPExperts' order)
                    w = tl.load(route_ptr + rows, mask=row_mask, other=0.0).to(dtype).to(tl.float32)
                    a = (a * w[:, None]).to(dtype).to(tl.float32)
            o_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on
            if QUANT:          # vLLM's _per_token_group_quant_fp8 (no UE8M0), one group per BLOCK_N
                amax = tl.maximum(tl.max(tl.abs(a), axis=1), eps)
                scale = amax * (1.0 / fp8_max)
                q = tl.clamp(a / scale[:, None], fp8_min, fp8_max).to(out_ptr.dtype.element_ty)
                tl.store(o_ptrs, q, mask=mask)
                tl.store(scale_ptr + rows * stride_sm + pid_n * stride_sn, scale, mask=row_mask)
            else:
                tl.store(o_ptrs, a.to(dtype), mask=mask)

    return gated_activation_kernel


def launch(x: torch.Tensor, y: Optional[torch.Tensor], out: torch.Tensor, route: Optional[torch.Tensor],
           blocks: GroupedBlocks, activation: Optional[GatedActivation],
           quant: Optional[tuple[float, float, int]] = None, scales: Optional[torch.Tensor] = None) -> None:
    """One launch over ``blocks`` (grid: its row blocks x ``N / BLOCK_N``); see the module docstring."""
    import triton.language as tl

    M, N = x.shape
    dtype = tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16
    name = None if activation is None else activation.name
    situ = name == "situ"
    fp8_min, fp8_max, eps = (quant[0], quant[1], 1e-10) if quant is not None else (0.0, 0.0, 0.0)
    s = scales if scales is not None else out   # unused without QUANT: any pointer
    y = x if y is None else y
    grid = (blocks.num_blocks, -(-N // BLOCK_N))
    _kernel()[grid](x, y, route if route is not None else x, out, s, blocks.expert_ids,
                    blocks.num_tokens_post_padded, M, N, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
                    out.stride(0), out.stride(1), s.stride(0), s.stride(1),
                    float(activation.beta) if situ else 1.0,
                    float(activation.linear_beta) if situ and activation.linear_beta is not None else 1.0,
                    ACT=ACT_CODES[name], HAS_ROUTE=route is not None,
                    HAS_LINEAR_BETA=situ and activation.linear_beta is not None, QUANT=quant is not None,
                    fp8_min=fp8_min, fp8_max=fp8_max, eps=eps, BLOCK_M=blocks.block_m,
                    SUB_M=min(blocks.block_m, SUB_M), BLOCK_N=BLOCK_N, dtype=dtype)


def fused_gated_activation(gate: torch.Tensor, up: torch.Tensor, route: Optional[torch.Tensor],
                           blocks: GroupedBlocks, activation: GatedActivation, *,
                           quant: Optional[tuple[float, float, torch.dtype]] = None
                           ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``activation(gate, up) * route`` over the computed row blocks of ``blocks``: ``[M, I]`` in ``gate``'s
    dtype, or with ``quant`` = ``(fp8_min, fp8_max, fp8 dtype)`` the pair ``(q [M, I], fp32 scales [M, I/128])``.
    ``gate`` and ``up`` may be strided views (the halves of one GEMM output). Rows of blocks not computed are
    left unwritten (``torch.empty``): the GEMMs never read them."""
    M, N = gate.shape
    if quant is None:
        out = torch.empty(M, N, dtype=gate.dtype, device=gate.device)
        launch(gate, up, out, route, blocks, activation)
        return out
    return _quantized(gate, up, route, blocks, activation, quant)


def fused_quantize_fp8(a: torch.Tensor, blocks: GroupedBlocks, quant: tuple[float, float, torch.dtype]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's 1x128 FP8 quantization of ``a`` ``[M, K]`` over the computed row blocks only."""
    return _quantized(a, None, None, blocks, None, quant)


def _quantized(x: torch.Tensor, y: Optional[torch.Tensor], route: Optional[torch.Tensor], blocks: GroupedBlocks,
               activation: Optional[GatedActivation], quant: tuple[float, float, torch.dtype]
               ) -> tuple[torch.Tensor, torch.Tensor]:
    M, N = x.shape
    if N % QUANT_GROUP:
        raise ValueError(f"FP8 block activations need a width that is a multiple of {QUANT_GROUP}, got {N}")
    q = torch.empty(M, N, dtype=quant[2], device=x.device)
    s = torch.empty(M, N // QUANT_GROUP, dtype=torch.float32, device=x.device)
    launch(x, y, q, route, blocks, activation, quant=(quant[0], quant[1], QUANT_GROUP), scales=s)
    return q, s
