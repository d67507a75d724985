"""A dense torch reference of Kimi K3's whole MoE block, written from the formula (not from the serving code).

The order is vLLM 0.33.0's (``vllm/models/kimi_k3/nvidia/model.py``): ``KimiMoE.forward`` runs the router
gate and ``routed_expert_down_proj`` on the full-width hidden (``_maybe_overlap_router_and_down_proj``),
hands the down-projected latent to the experts (``self.experts(hidden_states=routed_hidden_states, ...,
shared_experts_input=hidden_states)``), and the runner applies ``routed_output_transform`` —
``KimiRoutedOutputTransform``: the optional ``routed_expert_norm`` (RMSNorm) **on the K-summed latent, after
the combine**, then ``routed_expert_up_proj`` — before adding the shared experts' output
(``fused_moe/runner/moe_runner.py``, ``apply_routed_output_transform`` then ``shared_output + fused_output``).
So the norm sits between the combine and the up-projection, never on the latent before dispatch::

    logits  = fp32(x) @ fp32(gate).T                                   [T, E]
    scores  = sigmoid(logits)
    chosen  = top-k of (scores + e_score_correction_bias)             (the bias only chooses: noaux_tc)
    weights = scores[chosen] / sum(scores[chosen]) * routed_scaling_factor
    latent  = fp32(x) @ fp32(down_proj).T                              [T, L]
    y_e     = down_e( situ(gate_e latent, up_e latent) )               every chosen expert, fp32
    routed  = sum_k weights[t, k] * y_{chosen[t, k]}                   [T, L]
    routed  = rms_norm(routed) * norm_weight                           (latent_moe_use_norm)
    out     = routed @ up_proj.T + shared(x)                           [T, H]
    situ(g, u) = beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta)

(``SituAndMul.forward_native``, ``model_executor/layers/activation.py``; the gate is the first half of w13.)
Routing as ``fused_moe/router/grouped_topk_router.py`` with one expert group (K3's ``num_expert_group`` 1).

Every value here is fp32 from the weights as given (the quantized formats' exact fp32 dequantization, which
:func:`quantize` returns next to the stored bytes). The four flags of :func:`k3_moe_block` are the four
deliberately wrong variants the issue's controls name (SiLU for SiTU, ``linear_beta`` ignored, the bias in the
weights as well as the choice, the norm skipped); the oracle is always called without them, and the tests run
the *path under test* with each bug (``tests/ops/test_k3_moe_block.py``).

The quantizers follow the formats' definitions, independently of ``ops/experts/quantized.py``: INT4 g32
(compressed-tensors ``pack_to_int32``, symmetric: value ``i`` of a word in bits ``4i..4i+3``, stored ``+8``;
bf16 scale per 32), MXFP4 (OCP MX v1.0: E2M1 from its bit fields, E8M0 ``2^(e-127)`` per 32, the even element
in the low nibble), FP8 block (e4m3 times an fp32 ``scale_inv`` per 128x128 block, DeepSeek-V3's formula).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

#: K3's published activation constants (config ``activation_situ_beta``, ``activation_situ_linear_beta``)
K3_BETA, K3_LINEAR_BETA = 4.0, 25.0
#: K3's ``rms_norm_eps``
K3_RMS_EPS = 1e-5


@dataclasses.dataclass
class K3MoEWeights:
    """One K3 MoE layer, every tensor fp32 (the oracle's values). ``H``: model width; ``L``: latent width
    (``routed_expert_hidden_size``); ``I``: ``moe_intermediate_size``; ``S``: the shared experts' width."""

    router: torch.Tensor          # [E, H]  GateLinear (fp32 logits)
    bias: torch.Tensor            # [E]     e_score_correction_bias (fp32)
    down_proj: torch.Tensor       # [L, H]  routed_expert_down_proj
    norm_weight: Optional[torch.Tensor]  # [L] routed_expert_norm (None: latent_moe_use_norm false)
    up_proj: torch.Tensor         # [H, L]  routed_expert_up_proj
    gate: torch.Tensor            # [E, I, L] experts' w1 (the first half of w13)
    up: torch.Tensor              # [E, I, L] experts' w3
    down: torch.Tensor            # [E, L, I] experts' w2
    shared_gate: torch.Tensor     # [S, H]
    shared_up: torch.Tensor       # [S, H]
    shared_down: torch.Tensor     # [H, S]
    top_k: int
    routed_scaling_factor: float = 1.0
    beta: float = K3_BETA
    linear_beta: Optional[float] = K3_LINEAR_BETA
    eps: float = K3_RMS_EPS


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: Optional[float]) -> torch.Tensor:
    """SiTU-GLU in fp32 (no rounding)."""
    g, u = gate.float(), up.float()
    act = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return act * u


def route(x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor, top_k: int, scale: float = 1.0, *,
          bias_in_weights: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [T, k] int64, weights [T, k] fp32)``: sigmoid scores, top-k on ``scores + bias``, the unbiased
    scores of the chosen renormalized to 1, times ``scale``. ``bias_in_weights``: the control's bug (the biased
    scores as weights)."""
    scores = torch.sigmoid(x.float() @ router.float().T)
    biased = scores + bias.float()
    ids = torch.topk(biased, top_k, dim=-1).indices
    picked = torch.gather(biased if bias_in_weights else scores, 1, ids)
    return ids, picked / picked.sum(-1, keepdim=True) * scale


def rms_norm(v: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    v = v.float()
    return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def shared_mlp(x: torch.Tensor, w: K3MoEWeights) -> torch.Tensor:
    """The shared experts (one SiTU MLP of width ``S``) on the full-width ``x``, fp32."""
    x = x.float()
    return situ(x @ w.shared_gate.T, x @ w.shared_up.T, w.beta, w.linear_beta) @ w.shared_down.T


def expert_pre_activations(latent: torch.Tensor, ids: torch.Tensor, w: K3MoEWeights
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gate, up)`` ``[T, k, I]`` fp32 of every chosen expert: what SiTU's saturation acts on."""
    g = torch.einsum("tl,tkil->tki", latent.float(), w.gate[ids])
    u = torch.einsum("tl,tkil->tki", latent.float(), w.up[ids])
    return g, u


def k3_moe_block(x: torch.Tensor, w: K3MoEWeights, *, silu: bool = False, ignore_linear_beta: bool = False,
                 bias_in_weights: bool = False, skip_norm: bool = False) -> torch.Tensor:
    """K3's MoE block ``[T, H] -> [T, H]`` fp32 (the module docstring's formula). The flags are the controls'
    bugs; the oracle is called without them."""
    x = x.float()
    ids, weights = route(x, w.router, w.bias, w.top_k, w.routed_scaling_factor, bias_in_weights=bias_in_weights)
    latent = x @ w.down_proj.T
    g, u = expert_pre_activations(latent, ids, w)
    if silu:
        act = torch.nn.functional.silu(g) * u
    else:
        act = situ(g, u, w.beta, None if ignore_linear_beta else w.linear_beta)
    y = torch.einsum("tki,tkli->tkl", act, w.down[ids])
    routed = (weights.unsqueeze(-1) * y).sum(1)
    if w.norm_weight is not None and not skip_norm:
        routed = rms_norm(routed, w.norm_weight, w.eps)
    return routed @ w.up_proj.T + shared_mlp(x, w)


def token_rel_errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per token ``max|out - ref| / max|ref|`` (fp32): an error relative to the token's output."""
    diff = (out.float() - ref.float()).abs().amax(-1)
    return diff / ref.float().abs().amax(-1).clamp_min(torch.finfo(torch.float32).tiny)


# ---------------------------------------------------------------------------------------------------------
# the formats, from their definitions: dense target -> (stored tensors, exact fp32 values of those bytes)


def e2m1_from_bits(codes: torch.Tensor) -> torch.Tensor:
    """fp32 value of E2M1 codes: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0; exponent 0 subnormal."""
    c = codes.to(torch.int64)
    sign = 1.0 - 2.0 * ((c >> 3) & 1).float()
    exp, man = ((c >> 1) & 3).float(), (c & 1).float()
    return sign * torch.where(exp == 0, 0.5 * man, torch.exp2(exp - 1.0) * (1.0 + 0.5 * man))


def _groups(w: torch.Tensor, size: int) -> torch.Tensor:
    return w.reshape(*w.shape[:-1], w.shape[-1] // size, size)


def quantize(fmt: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``w [n, out, in]`` fp32 -> (``{"weight": ..., "scale": ...}`` as the format stores them, the exact fp32
    values those bytes decode to). ``bf16``: the weight rounded to bf16, no scale."""
    if fmt == "bf16":
        q = w.to(torch.bfloat16)
        return {"weight": q}, q.float()
    if fmt == "int4-g32":
        g = _groups(w, 32)
        scale = (g.abs().amax(-1) / 7.0).clamp_min(2.0 ** -20).to(torch.bfloat16)
        q = torch.clamp(torch.round(g / scale.float().unsqueeze(-1)), -8, 7)
        dense = (q * scale.float().unsqueeze(-1)).flatten(-2)
        nibbles = (q.flatten(-2).to(torch.int64) + 8).reshape(*w.shape[:-1], w.shape[-1] // 8, 8)
        word = sum(nibbles[..., i] << (4 * i) for i in range(8))
        word = torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)
        return {"weight": word, "scale": scale}, dense
    if fmt == "mxfp4":
        g = _groups(w, 32)
        table = e2m1_from_bits(torch.arange(16))
        amax = g.abs().amax(-1).clamp_min(2.0 ** -100)
        exp = torch.clamp(torch.ceil(torch.log2(amax / 6.0)), -127, 127)
        v = g / torch.exp2(exp).unsqueeze(-1)
        codes = (v.unsqueeze(-1) - table).abs().argmin(-1)        # nearest E2M1 value
        dense = (table[codes] * torch.exp2(exp).unsqueeze(-1)).flatten(-2)
        pairs = codes.flatten(-2).reshape(*w.shape[:-1], w.shape[-1] // 2, 2)
        packed = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
        return {"weight": packed, "scale": (exp + 127).to(torch.uint8)}, dense
    if fmt == "fp8-block":
        n, out, inp = w.shape
        assert out % 128 == 0 and inp % 128 == 0, (out, inp)
        blocks = w.reshape(n, out // 128, 128, inp // 128, 128)
        scale = blocks.abs().amax((2, 4)) / 448.0
        q = (blocks / scale[:, :, None, :, None]).to(torch.float8_e4m3fn)
        dense = (q.float() * scale[:, :, None, :, None]).reshape(n, out, inp)
        return {"weight": q.reshape(n, out, inp), "scale": scale}, dense
    raise ValueError(f"unknown format {fmt!r}")


def random_k3_layer(seed: int, *, H: int, L: int, I: int, E: int, top_k: int, shared: int,  # noqa: E741
                    gate_std: float, up_std: float, favoured: Optional[list[int]] = None) -> dict[str, torch.Tensor]:
    """Dense fp32 targets of one layer (before any format's rounding). The experts' gate and up rows are drawn so
    that, on a latent of unit variance, their outputs have standard deviations ``gate_std`` and ``up_std``
    (SiTU's saturation, past ``beta`` and ``linear_beta``, must matter). ``favoured`` experts get a larger
    score-correction bias, so the choice leans on them (an owner overloaded: slots fill from it)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    bias = torch.rand(E, generator=gen) * 0.5
    if favoured:
        bias[favoured] += 1.0 + 2.0 * torch.rand(len(favoured), generator=gen)
    return {
        "router": randn(E, H, std=1 / math.sqrt(H)), "bias": bias,
        "down_proj": randn(L, H, std=1 / math.sqrt(H)),
        "norm_weight": 1.0 + 0.25 * torch.randn(L, generator=gen),
        "up_proj": randn(H, L, std=1 / math.sqrt(L)),
        "gate": randn(E, I, L, std=gate_std / math.sqrt(L)), "up": randn(E, I, L, std=up_std / math.sqrt(L)),
        "down": randn(E, L, I, std=1 / math.sqrt(I)),
        # the shared MLP's output of the order of the routed one's (after the norm): no term swamps the other
        "shared_gate": randn(shared, H, std=gate_std / math.sqrt(H)),
        "shared_up": randn(shared, H, std=up_std / math.sqrt(H)),
        "shared_down": randn(H, shared, std=1 / (up_std * math.sqrt(shared))),
    }
