"""GPU experts for a sharded MoonEP layer in each quantized format (and BF16 on CUDA, ``bf16_gpu.py``): Triton
grouped GEMMs over the ``[E+B]`` views.

Every format consumes MoonEP's expert-grouped ``hidden_nvsh [NvS, H]`` and
``cu_seqlens [E+B]`` as dispatch leaves them (``ops/experts/grouped_blocks.py``: per
``BLOCK_SIZE_M`` block the weight row, no sort, no permute) and reads weights
and scales through the store's ``[E+B]`` views, so a slot row is read exactly
like an owner's row. The FFN is :class:`MoonEPExperts`' math (vLLM 0.33.0,
``experts/moonep_experts.py``) with the layer's activation between the two
grouped GEMMs: ``act = silu(gate) * up`` in the activation dtype, or SiTU
(Kimi K3) in fp32 rounded once (``ops/experts/activation.py``), times the route weight cast to that dtype (unless vLLM applied it on
the input), then the down projection. Between the GEMMs that is one Triton
kernel over the row blocks that hold a token
(``ops/experts/gated_activation_kernel.py``); rows at or past
``cu_seqlens[-1]`` are not written (combine never reads them). The K-sum
happens in MoonEP's combine.

====================== ======================================== ==========================================
format                 kernel                                   stored layout / conversion
====================== ======================================== ==========================================
``int4-g32`` (W4A16)   vLLM ``fused_moe_kernel_gptq_awq``       compressed-tensors ``weight_packed`` int32
                       (``invoke_fused_moe_wna16_triton_kernel``) ``[N, K/8]``; the kernel reads ``[N, K/2]``
                                                                uint8, even ``k`` in the low nibble, +8:
                                                                on a little-endian host these are the same
                                                                bytes, so the conversion is a dtype view
                                                                (:func:`int4_kernel_view`), zero bytes
                                                                moved; bf16 ``weight_scale [N, K/32]`` as is
``fp8-block``          vLLM ``fused_moe_kernel``, block_shape   e4m3 ``weight [N, K]``; fp32
                       ``[128, 128]``; activations per 1x128 by ``weight_scale_inv [N/128, K/128]`` as the
                       vLLM's ``per_token_group_quant_fp8``      checkpoint has them
``mxfp4`` (W4A16)      ``ops/experts/mxfp4_kernel.py`` (project)     ``weight_packed`` uint8 ``[N, K/2]``,
                                                                ``weight_scale`` E8M0 uint8 ``[N, K/32]``
``bf16``               vLLM ``fused_moe_kernel``, unquantized   the layer's gate, up and down ``[E+B]``
                       (CUDA; ``overlap.apply``; on CPU vLLM's   views as they are (``views`` ``gate``,
                       ``MoonEPExperts`` GEMMs)                  ``up``, ``down``, no scales)
====================== ======================================== ==========================================

A later backend that repacks per expert (Marlin) adds a format entry whose
conversion writes its own layout into the owner's rows; the slot fill then
copies converted bytes, as it does here.

Block sizes: ``BLOCK_SIZE_M`` must divide MoonEP's ``token_padding``
(:func:`~moonep_ep.ops.experts.grouped_blocks.check_block_size` refuses otherwise,
naming both), and every group must start on a block boundary (checked on the
device, no host sync: :func:`~moonep_ep.ops.experts.grouped_blocks.assert_segments_aligned`).
:func:`kernel_config` picks them on GPUs from the step's tokens and the local
expert count, as vLLM does; :data:`INTERPRETER_CONFIG` is what the CPU runs
under the Triton interpreter use.
"""

from __future__ import annotations

import sys
from typing import Any, Mapping, Optional

import torch

from ...errors import config_error
from ...ops.experts import gated_activation_kernel as gk
from ...ops.experts.activation import SILU, GatedActivation
from ...ops.experts.grouped_blocks import (GroupedBlocks, assert_segments_aligned, check_block_size, grouped_blocks,
                                  skip_zero_weight_blocks)
from ...ops.experts.mxfp4_kernel import mxfp4_grouped_gemm

__all__ = ["GPU_KERNELS", "INTERPRETER_CONFIG", "fit_block_m", "gpu_grouped_ffn", "gpu_grouped_gemm",
           "int4_kernel_view", "kernel_config", "kernel_views"]

#: format -> the kernel that serves it (docs/design/vllm_experts.md's table)
GPU_KERNELS = {"int4-g32": "vllm fused_moe_kernel_gptq_awq", "fp8-block": "vllm fused_moe_kernel (block 128x128)",
               "mxfp4": "moonep_ep mxfp4_grouped_gemm_kernel",
               "bf16": "vllm fused_moe_kernel (unquantized; CPU: MoonEPExperts' grouped GEMMs)"}
#: block sizes of the interpreter runs: few, wide programs (the interpreter pays per program and per op)
INTERPRETER_CONFIG = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1}
#: block sizes of the CPU engine's interpreter runs: ``BLOCK_SIZE_M`` up to the token padding (every expert group is
#: padded to it, so larger blocks compute no more rows), wide N tiles (the interpreter pays per program and per op,
#: not per element: 16x512 tiles took 1.6 s per tiny FFN call, 16x128 2.8 s); K 128, FP8's scale block
ENGINE_INTERPRETER_CONFIG = {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 512, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1}
FP8_BLOCK = 128


#: format -> (vLLM's tuned-config dtype, block shape) for ``try_get_optimal_moe_config``. MXFP4 has no tuned files
#: of its own: it gets vLLM's bf16 entries (tiles for bf16 weights, up to N 256), which ``mxfp4_launch_config``
#: holds to the MXFP4 kernel's register and shared-memory bound at the launch
VLLM_CONFIG_KEYS = {"int4-g32": ("int4_w4a16", [0, 32]), "fp8-block": ("fp8_w8a8", [FP8_BLOCK, FP8_BLOCK]),
                    "mxfp4": (None, None), "bf16": (None, None)}


def fit_block_m(block_m: int, token_padding: int) -> int:
    """The largest power of two <= ``block_m`` that divides ``token_padding``, at least 16 (``tl.dot``'s least M;
    vLLM's tuned configs ask for 8 at M 2-4, and MoonEP's groups are ``token_padding`` rows anyway); ``block_m``
    itself when none does (``check_block_size`` then refuses, naming both)."""
    m = 1 << (max(int(block_m), 16).bit_length() - 1)
    while m >= 16:
        if token_padding % m == 0:
            return m
        m //= 2
    return int(block_m)


def kernel_config(fmt: str, *, local_experts: int, hidden: int, intermediate: int, tokens: int, top_k: int,
                  token_padding: int, interpreter: bool) -> dict[str, int]:
    """Block sizes of one layer's GPU experts for a step of ``tokens`` tokens.

    Under Triton's interpreter: :data:`ENGINE_INTERPRETER_CONFIG`. On GPUs: what vLLM 0.33.0's
    ``TritonExperts.apply`` asks ``try_get_optimal_moe_config`` for — ``w1``/``w2`` shapes whose ``E`` is the
    layer's **local** expert count (``w1.size(0)``: ``num_local_experts``, ``E / EP`` under expert
    parallelism; the tuned file's name is ``E={local},N={intermediate},device_name=...``) and ``M`` = the step's
    tokens (``hidden_states.size(0)``, rows before the top-k expansion) — its tuned ``configs/`` entry nearest
    ``M`` where a file exists, else its default for the shape; then ``BLOCK_SIZE_M`` brought down to divide
    MoonEP's ``token_padding`` (every group starts on a block boundary; vLLM's own alignment pads per block
    instead). ``tokens`` must be real tokens, not MoonEP's ``NvS`` rows (capacity and group padding: a decode
    step's ``NvS // top_k`` is over a thousand)."""
    if interpreter:
        cfg = dict(ENGINE_INTERPRETER_CONFIG)
    else:
        from vllm.model_executor.layers.fused_moe.fused_moe import try_get_optimal_moe_config

        dtype, block = VLLM_CONFIG_KEYS[fmt]
        # vLLM's lookup reads N from w2's last dim and doubles it for INT4, whose w2 is packed two to a byte
        w2_last = intermediate // 2 if dtype == "int4_w4a16" else intermediate
        cfg = dict(try_get_optimal_moe_config((local_experts, 2 * intermediate, hidden),
                                              (local_experts, hidden, w2_last), top_k, dtype, max(int(tokens), 1),
                                              block))
    cfg["BLOCK_SIZE_M"] = fit_block_m(cfg["BLOCK_SIZE_M"], token_padding)
    return cfg


def int4_kernel_view(packed: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' ``[..., N, K/8]`` int32 words as ``fused_moe_kernel_gptq_awq``'s ``[..., N, K/2]`` uint8.

    ``pack_to_int32`` puts value ``i`` of a word at bits ``4i`` (offset +8); the kernel reads byte ``k // 2``
    and takes the low nibble for even ``k``. Little-endian words are those bytes in that order."""
    if sys.byteorder != "little":
        raise config_error(None, "the INT4 kernel view needs a little-endian host", sys.byteorder,
                           "convert the words with a byte swap first")
    if packed.dtype != torch.int32:
        raise config_error(None, "INT4 weight_packed must be int32 (compressed-tensors pack-quantized)",
                           packed.dtype, "pass the store's weight_packed view")
    return packed.view(torch.uint8)


def kernel_views(fmt: str, views: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``(w13, w13_scale, w2, w2_scale)`` as the kernels read them, from the store's ``{name: [E+B] view}``."""
    from ...ops.experts.quantized import views_of

    from ...ops.experts.quantized import is_split

    if is_split(views):  # the push layout, and BF16's: the first GEMM's gate rows (gpu_grouped_ffn adds the up rows)
        w13, s13, w2, s2 = views["gate"], _scale(fmt, views, "gate"), views["down"], _scale(fmt, views, "down")
    else:
        w13, s13, w2, s2 = views_of(fmt, views)
    if fmt == "int4-g32":
        w13, w2 = int4_kernel_view(w13), int4_kernel_view(w2)
    return w13, s13, w2, s2


def _scale(fmt: str, views: Mapping[str, torch.Tensor], proj: str) -> Optional[torch.Tensor]:
    """A split layout's scale of ``proj``: none for BF16, the store's for the quantized formats."""
    return None if fmt == "bf16" else views[f"{proj}_scale"]


def _tl_dtype(dtype: torch.dtype) -> Any:
    from vllm.triton_utils import tl

    if dtype not in (torch.bfloat16, torch.float16):
        raise config_error(None, "activations must be bf16 or fp16", dtype, "pass MoonEP's bf16 hidden_nvsh")
    return tl.bfloat16 if dtype == torch.bfloat16 else tl.float16


def quantize_activations_fp8(a: torch.Tensor, *, native: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 [M, K], fp32 scales [M, K/128])``: vLLM's dynamic 1x128 group quantization (no UE8M0).

    ``native``: vLLM's torch path of the same op (``QuantFP8._quantize_group_native``) instead of its Triton kernel,
    which launches one program per row and group: 6144 interpreted programs for 1536 rows of the tiny model
    (17.7 s of an 18 s FFN call), so the CPU engine's interpreter runs take the torch path."""
    if native:
        import types

        from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8

        # The method body alone: a QuantFP8 instance is a CustomOp, which needs a vLLM config to be built; the
        # attributes it reads are these three.
        op = types.SimpleNamespace(group_size=FP8_BLOCK, use_ue8m0=False, column_major_scales=False)
        return QuantFP8._quantize_group_native(op, a)
    from vllm.model_executor.layers.quantization.utils.fp8_utils import per_token_group_quant_fp8

    return per_token_group_quant_fp8(a, FP8_BLOCK, use_ue8m0=False)


def gpu_grouped_gemm(fmt: str, a: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, blocks: GroupedBlocks,
                     config: Mapping[str, int], *, native_act_quant: bool = False,
                     out: Optional[torch.Tensor] = None,
                     a_quant: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """``[M, N]``: every block's rows times its weight row, in ``fmt``. The kernels write every row below
    ``num_tokens_post_padded`` (a ``-1`` block as zeros) and nothing at or past it, so ``out`` (default: a new
    ``torch.empty``; the caller's, written in place) needs no zero fill: rows past ``cu_seqlens[-1]`` are left as
    they were. ``a_quant``: FP8's ``(e4m3, scales)`` of ``a`` when the caller quantized it already."""
    M, N = a.shape[0], weight.shape[1]
    if out is None:
        out = torch.empty(M, N, dtype=a.dtype, device=a.device)
    elif tuple(out.shape) != (M, N) or out.dtype != a.dtype or not out.is_contiguous():
        raise config_error(None, "out must be a contiguous [M, N] tensor of the activations' dtype",
                           (tuple(out.shape), out.dtype), f"pass out = empty({M}, {N}, dtype={a.dtype})")
    # the whole config (a tuned one's num_warps / num_stages too), with the block rows the metadata was built for
    cfg = {**config, "BLOCK_SIZE_M": blocks.block_m, "GROUP_SIZE_M": config.get("GROUP_SIZE_M", 1)}
    if fmt == "mxfp4":
        return mxfp4_grouped_gemm(a, weight, scale, out, blocks, config=cfg)
    from vllm.model_executor.layers.fused_moe import fused_moe

    common = dict(topk_weights=None, sorted_token_ids=blocks.sorted_token_ids, expert_ids=blocks.expert_ids,
                  num_tokens_post_padded=blocks.num_tokens_post_padded, mul_routed_weight=False, top_k=1,
                  config=cfg, compute_type=_tl_dtype(a.dtype))
    if fmt == "int4-g32":
        common["config"] = {**cfg, "SPLIT_K": 1}
        fused_moe.invoke_fused_moe_wna16_triton_kernel(a, weight, out.view(M, 1, N), scale, None,
                                                       use_int8_w8a16=False, use_int4_w4a16=True,
                                                       block_shape=[0, 32], **common)
    elif fmt == "bf16":
        fused_moe.invoke_fused_moe_triton_kernel(a, weight, out.view(M, 1, N), None, None, use_fp8_w8a8=False,
                                                 use_int8_w8a8=False, use_int8_w8a16=False, use_int4_w4a16=False,
                                                 per_channel_quant=False, **common)   # block_shape None
    elif fmt == "fp8-block":
        a_q, a_scale = a_quant if a_quant is not None else quantize_activations_fp8(a, native=native_act_quant)
        fused_moe.invoke_fused_moe_triton_kernel(a_q, weight, out.view(M, 1, N), a_scale, scale,
                                                 use_fp8_w8a8=True, use_int8_w8a8=False, use_int8_w8a16=False,
                                                 use_int4_w4a16=False, per_channel_quant=False,
                                                 block_shape=[FP8_BLOCK, FP8_BLOCK], **common)
    else:
        raise config_error(None, "no GPU grouped kernel for this format", fmt,
                           "use int4-g32, fp8-block, mxfp4 or bf16")
    return out


def _fp8_limits() -> tuple[float, float, torch.dtype]:
    """vLLM's FP8 range and dtype for the activation quantization (e4m3fn: +-448; the platform's own)."""
    from vllm.model_executor.layers.quantization.utils.fp8_utils import get_fp8_min_max

    from vllm.platforms import current_platform

    lo, hi = get_fp8_min_max()
    return float(lo), float(hi), current_platform.fp8_dtype()


def gpu_grouped_ffn(fmt: str, hidden_nvsh: torch.Tensor, views: Mapping[str, torch.Tensor],
                    cu_seqlens: torch.Tensor, route_weights_nvs: Optional[torch.Tensor], *, token_padding: int,
                    config: Optional[Mapping[str, int]] = None, blocks: Optional[GroupedBlocks] = None,
                    native_act_quant: bool = False, activation: GatedActivation = SILU,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """MoonEPExperts' FFN over quantized (or BF16) ``[E+B]`` views with the format's GPU kernel.

    ``views``: the store's ``{vLLM parameter name: [E+B] view}`` (weights and scales; BF16: ``gate``, ``up``,
    ``down``); ``blocks``: the block metadata (default: built from ``cu_seqlens``; the BF16 experts pass one
    part's, :func:`~moonep_ep.ops.experts.grouped_blocks.restrict_to_groups`; a test a corrupted one as a
    negative control);
    ``native_act_quant``: FP8's activation quantization by vLLM's torch path (:func:`quantize_activations_fp8`);
    ``activation``: the layer's gated activation (SiLU or SiTU) on the gate and up halves of the first GEMM;
    ``out``: ``[NvS, H]`` the down projection writes in place (default: a new tensor).

    Work follows the rows that carry tokens: the GEMMs' outputs are ``torch.empty`` (the kernels write every
    row they are asked for), and where the kernels run (:func:`~moonep_ep.ops.experts.gated_activation_kernel.
    use_triton`) the activation, the route weight and FP8's quantizations are one kernel each over the computed
    row blocks only, bounded on the device by ``cu_seqlens[-1]`` and ``expert_ids``. Rows at or past
    ``cu_seqlens[-1]`` of the result are not written (MoonEP's combine reads only the rows of dispatched
    (token, expert) pairs, all before it: ``tests/ops/test_expert_bytes.py``); ``-1`` blocks are zeros."""
    cfg = dict(INTERPRETER_CONFIG if config is None else config)
    block_m = int(cfg["BLOCK_SIZE_M"])
    check_block_size(block_m, token_padding)
    M = hidden_nvsh.shape[0]
    if blocks is None:
        blocks = grouped_blocks(cu_seqlens, M, block_m)  # refuses misaligned groups on the device
        if route_weights_nvs is not None:
            blocks = skip_zero_weight_blocks(blocks, route_weights_nvs)
    else:
        assert_segments_aligned(cu_seqlens, blocks.block_m)
    w13, s13, w2, s2 = kernel_views(fmt, views)
    if cu_seqlens.numel() != w13.shape[0]:
        raise config_error(None, "cu_seqlens must have one entry per [E+B] weight row",
                           (cu_seqlens.numel(), w13.shape[0]), "pass dispatch's cu_seqlens with the layer's views")
    fused = gk.use_triton(hidden_nvsh)
    # FP8 on the kernels' path: the 1x128 quantizations bounded like the activation (vLLM's covers all NvS rows)
    quant = _fp8_limits() if fmt == "fp8-block" and fused and not native_act_quant else None
    gemm = dict(native_act_quant=native_act_quant)
    first = dict(gemm, a_quant=gk.fused_quantize_fp8(hidden_nvsh, blocks, quant)) if quant else gemm
    gate_up = gpu_grouped_gemm(fmt, hidden_nvsh, w13, s13, blocks, cfg, **first)
    if "up" in views:  # the push layout stores gate and up apart: a second GEMM over the up rows
        w_up = int4_kernel_view(views["up"]) if fmt == "int4-g32" else views["up"]
        up = gpu_grouped_gemm(fmt, hidden_nvsh, w_up, _scale(fmt, views, "up"), blocks, cfg, **first)
        gate = gate_up
    else:
        inter = gate_up.shape[1] // 2
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
    if fused:
        act = gk.fused_gated_activation(gate, up, route_weights_nvs, blocks, activation, quant=quant)
        if quant:  # the down GEMM reads the quantized pair; ``a`` only gives its shape and dtype
            rows = hidden_nvsh.new_empty(1, act[0].shape[1]).expand(M, -1)
            return gpu_grouped_gemm(fmt, rows, w2, s2, blocks, cfg, a_quant=act, out=out)
    else:  # the eager chain (meta, or a CPU without Triton's interpreter): every row, as the reference
        act = activation(gate, up)
        if route_weights_nvs is not None:
            act.mul_(route_weights_nvs.to(act.dtype).unsqueeze(-1))
    return gpu_grouped_gemm(fmt, act.contiguous(), w2, s2, blocks, cfg, native_act_quant=native_act_quant, out=out)
