"""Grouped gated expert FFN (SiLU or SiTU) over MoonEP's ``[NvS, H]`` layout, and a dense oracle.

After ``dispatch`` every rank holds ``hidden_nvsh [NvS, H]`` whose rows are
grouped by ``cu_seqlens`` (inclusive end offsets, the ``offs`` format of
``torch._grouped_mm``): group ``g`` is rows ``[cu[g-1], cu[g])`` with
``cu[-1]`` taken as 0, and is computed with weight row ``g`` of the ``[E+B]``
pull views (``g < E``: expert ``g``; ``g = E + b``: slot ``b``).

:func:`grouped_ffn` computes, per row ``x`` of group ``g`` (the same math and
the same bf16 rounding points as vLLM 0.33.0's ``MoonEPExperts.apply``)::

    gate = bf16(x @ W_gate[g].T)            # [I]
    up   = bf16(x @ W_up[g].T)              # [I]
    act  = bf16(silu(gate))                 # silu in bf16, like F.silu on a bf16 tensor
    act  = bf16(act * up)                   # (SiTU: one rounding of the fp32 act(gate, up), see below)
    act  = bf16(act * bf16(w))              # route weight cast to bf16 first, as vLLM does
    y    = bf16(act @ W_down[g].T)          # [H]

The activation is the layer's (``activation=``, an :class:`~moonep_ep.ops.experts.activation.GatedActivation`):
SiLU by default, as above; SiTU (Kimi K3) computes ``act(gate, up)`` from the bf16 gate and up in fp32
and rounds the product once, as vLLM's ``SituAndMul.forward_native`` does.

Route weights are applied *before* the down projection (MoonEP's combine
sums unweighted rows). Rows at or past ``cu[-1]`` (the stale tail of the
shard) are zero in the output whatever the input holds there: their route
weights may be stale or NaN (vLLM does not ``nan_to_num`` them).
Padding rows inside a group are zero in ``hidden_nvsh`` and in the route
weights, so they come out zero too; combine never reads them.

:func:`reference_moe` is the oracle: every token through its ``K`` experts in
fp32, straight from the dense ``[E, ...]`` weights, no dispatch, no padding.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from ...errors import config_error
from .activation import SILU, GatedActivation

__all__ = ["grouped_ffn", "grouped_mm", "grouped_mm_supported", "group_bounds", "reference_moe",
           "reference_moe_bf16", "reference_rows_bf16", "token_rel_errors", "TOKEN_REL_TOL", "ENTRY_REL_TOL"]


@functools.lru_cache(maxsize=None)
def _probe_grouped_mm(device_type: str, device_index: Optional[int], dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs on this device and dtype, and is exact.

    Probed once with a tiny problem (two groups, one empty) against a plain
    matmul: the op exists only in recent torch builds, and on CUDA only on
    some architectures (bf16 needs sm90+); an unsupported combination raises,
    which sends callers to the segment loop.
    """
    fn = getattr(torch, "_grouped_mm", None)
    if fn is None:
        return False
    device = torch.device(device_type, device_index) if device_index is not None else torch.device(device_type)
    try:
        gen = torch.Generator(device="cpu").manual_seed(0)
        a = torch.randn(48, 32, generator=gen).to(device=device, dtype=dtype)
        w = torch.randn(3, 16, 32, generator=gen).to(device=device, dtype=dtype)
        offs = torch.tensor([16, 16, 32], dtype=torch.int32, device=device)
        out = fn(a, w.transpose(1, 2), offs=offs)
        want = torch.cat([a[:16] @ w[0].T, a[16:32] @ w[2].T])
        return bool(torch.allclose(out[:32].float(), want.float(), rtol=1e-2, atol=1e-2))
    except Exception:  # noqa: BLE001 - any failure means "use the loop"
        return False


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """True when :func:`grouped_mm` uses ``torch._grouped_mm`` for this device/dtype."""
    device = torch.device(device)
    return _probe_grouped_mm(device.type, device.index, dtype)


def group_bounds(cu_seqlens: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(group, start, end)`` of every non-empty group of ``cu_seqlens`` (inclusive ends), one host sync;
    the grouped GEMM's segment loop and the quantized path's used rows both walk these."""
    ends = cu_seqlens.to("cpu", torch.int64).tolist()
    out, start = [], 0
    for g, end in enumerate(ends):
        if end > start:
            out.append((g, start, end))
        start = max(start, end)
    return out


def grouped_mm(a: torch.Tensor, w: torch.Tensor, cu_seqlens: torch.Tensor, *,
               use_grouped_mm: Optional[bool] = None) -> torch.Tensor:
    """``out[seg_g] = a[seg_g] @ w[g].T`` for every ``cu_seqlens`` group.

    Args:
        a: ``[M, K]`` activations in group order (bf16 on the MoonEP path).
        w: ``[G, N, K]`` weights, vLLM's ``[E, out, in]`` convention (any
            strides; the pull ``[E+B]`` views are contiguous).
        cu_seqlens: ``[G]`` int32 inclusive group end offsets, non-decreasing,
            ``cu[-1] <= M``.
        use_grouped_mm: force (``True``) or forbid (``False``) the fused op;
            ``None`` picks it when the device/dtype probe succeeds.

    Returns:
        ``[M, N]`` in ``a``'s dtype; rows at or past ``cu[-1]`` are zero.
    """
    M, N = a.shape[0], w.shape[1]
    if use_grouped_mm is None:
        use_grouped_mm = grouped_mm_supported(a.device, a.dtype)
    if use_grouped_mm:
        out = torch._grouped_mm(a, w.transpose(1, 2), offs=cu_seqlens)
        # The op leaves rows past the last offset unwritten on some backends;
        # zero them with a device-side mask (no host sync).
        tail = torch.arange(M, device=a.device) >= cu_seqlens[-1].to(torch.int64)
        return out.masked_fill_(tail[:, None], 0)
    out = torch.zeros(M, N, dtype=a.dtype, device=a.device)
    for g, start, end in group_bounds(cu_seqlens):
        out[start:end] = a[start:end] @ w[g].T
    return out


def _check_ffn_inputs(hidden: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                      cu_seqlens: torch.Tensor, route_weights: Optional[torch.Tensor]) -> None:
    if hidden.dim() != 2:
        raise config_error(None, "hidden_nvsh must be 2-D [NvS, H]", tuple(hidden.shape), "pass dispatch's hidden_nvsh")
    M, H = hidden.shape
    if w_gate.dim() != 3 or w_gate.shape[2] != H:
        raise config_error(None, "w_gate must be [G, I, H] with H matching hidden_nvsh", tuple(w_gate.shape),
                           f"pass the pull gate view [E+B, I, {H}]")
    G, I = w_gate.shape[0], w_gate.shape[1]
    if tuple(w_up.shape) != (G, I, H):
        raise config_error(None, "w_up must have w_gate's shape [G, I, H]", tuple(w_up.shape), f"pass [{G}, {I}, {H}]")
    if tuple(w_down.shape) != (G, H, I):
        raise config_error(None, "w_down must be [G, H, I]", tuple(w_down.shape), f"pass [{G}, {H}, {I}]")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() != G or cu_seqlens.dtype != torch.int32:
        raise config_error(None, "cu_seqlens must be int32 [G] with one entry per weight row",
                           (tuple(cu_seqlens.shape), cu_seqlens.dtype), f"pass dispatch's cu_seqlens (G = {G})")
    if route_weights is not None and (route_weights.dim() != 1 or route_weights.numel() != M):
        raise config_error(None, "route_weights must be 1-D [NvS] like hidden_nvsh's rows",
                           tuple(route_weights.shape), f"pass dispatch's route_weights_nvs ({M} rows)")


def grouped_ffn(hidden_nvsh: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                cu_seqlens: torch.Tensor, route_weights_nvs: Optional[torch.Tensor] = None, *,
                use_grouped_mm: Optional[bool] = None, activation: GatedActivation = SILU) -> torch.Tensor:
    """Gated expert FFN over ``cu_seqlens`` groups (MoonEPExperts' math, with the layer's activation).

    Args:
        hidden_nvsh: ``[NvS, H]`` bf16, dispatch's output (rows in group order).
        w_gate: ``[G, I, H]`` bf16, pull gate view (``G = E + B``).
        w_up: ``[G, I, H]`` bf16, pull up view.
        w_down: ``[G, H, I]`` bf16, pull down view.
        cu_seqlens: ``[G]`` int32 inclusive group end offsets (dispatch's).
        route_weights_nvs: ``[NvS]`` fp32 per-row route weights, or ``None``
            to return unweighted rows (vLLM's input-weighted top-1 path).
        use_grouped_mm: see :func:`grouped_mm`.
        activation: the layer's gated activation (default SiLU).

    Returns:
        ``[NvS, H]`` in ``hidden_nvsh``'s dtype; rows at or past
        ``cu_seqlens[-1]`` are zero.
    """
    _check_ffn_inputs(hidden_nvsh, w_gate, w_up, w_down, cu_seqlens, route_weights_nvs)
    gate = grouped_mm(hidden_nvsh, w_gate, cu_seqlens, use_grouped_mm=use_grouped_mm)
    up = grouped_mm(hidden_nvsh, w_up, cu_seqlens, use_grouped_mm=use_grouped_mm)
    act = activation(gate, up)
    if route_weights_nvs is not None:
        # Tail rows may hold stale (even NaN) weights; their act rows are zero
        # and the down projection below never reads past cu[-1].
        act.mul_(route_weights_nvs.to(act.dtype).unsqueeze(-1))
    return grouped_mm(act, w_down, cu_seqlens, use_grouped_mm=use_grouped_mm)


def reference_moe(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, *,
                  activation: GatedActivation = SILU) -> torch.Tensor:
    """Dense per-token MoE in fp32: the oracle for dispatch → prefetch → FFN → combine.

    ``out[t] = Σ_k topk_weights[t, k] · down_e(act(gate_e x_t, up_e x_t))`` (``act``: ``activation``,
    SiLU by default)
    with ``e = topk_ids[t, k]``, every product in fp32 from the bf16 inputs.
    Tokens are processed expert by expert (all ``(t, k)`` pairs of one expert
    in one matmul), which is the per-token formula evaluated in bulk; a token
    that picks one expert twice gets that expert's output twice.

    Args:
        hidden: ``[T, H]`` tokens (any float dtype; upcast to fp32).
        topk_ids: ``[T, K]`` integer expert ids in ``[0, E)``.
        topk_weights: ``[T, K]`` float route weights.
        w_gate: ``[E, I, H]``; w_up: ``[E, I, H]``; w_down: ``[E, H, I]``.

    Returns:
        ``[T, H]`` fp32.
    """
    T, H = hidden.shape
    E = w_gate.shape[0]
    x = hidden.float()
    ids = topk_ids.to(torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= E):
        raise config_error(None, f"topk_ids must be in [0, {E})", (int(ids.min()), int(ids.max())),
                           "pass expert ids of this model")
    out = torch.zeros(T, H, dtype=torch.float32, device=hidden.device)
    flat_ids = ids.reshape(-1)
    flat_tok = torch.arange(T, device=hidden.device).repeat_interleave(ids.shape[1])
    flat_w = topk_weights.reshape(-1).float()
    for e in torch.unique(flat_ids).tolist():
        sel = flat_ids == e
        tok = flat_tok[sel]
        xe = x[tok]
        g = xe @ w_gate[e].float().T
        u = xe @ w_up[e].float().T
        y = activation(g, u) @ w_down[e].float().T
        out.index_add_(0, tok, y * flat_w[sel][:, None])
    return out


def reference_rows_bf16(hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                        w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, *,
                        activation: GatedActivation = SILU) -> torch.Tensor:
    """One expert-FFN output row per ``(token, k)`` entry, rounded to bf16 where the MoonEP
    path rounds: the oracle of :data:`ENTRY_REL_TOL`.

    ``hidden`` ``[n, H]`` (the entry's token), ``expert_ids`` ``[n]``, ``weights`` ``[n]``.
    Per entry, fp32 products from bf16 inputs, rounded once each: ``g = bf16(x W_g^T)``,
    ``u = bf16(x W_u^T)``, ``a = bf16(bf16(silu(g)) u)``, ``a = bf16(a bf16(w))``,
    ``y = bf16(a W_d^T)`` (:func:`grouped_ffn`'s steps; SiTU: ``a = bf16(situ_fp32(g, u))``, one rounding).
    Returns ``[n, H]`` bf16.
    """
    x = hidden.to(torch.bfloat16).float()
    ids = expert_ids.to(torch.int64).reshape(-1)
    w = weights.reshape(-1).to(torch.bfloat16).float()
    out = torch.zeros(ids.numel(), w_down.shape[1], dtype=torch.bfloat16, device=hidden.device)
    bf16 = torch.bfloat16
    for e in torch.unique(ids).tolist():
        sel = ids == e
        g = (x[sel] @ w_gate[e].float().T).to(bf16)
        u = (x[sel] @ w_up[e].float().T).to(bf16)
        if activation.name == "silu":   # silu rounded in bf16, then the product rounded: two roundings
            a = (F.silu(g).float() * u.float()).to(bf16)
        else:                           # SiTU in fp32 from the bf16 halves, rounded once
            a = activation(g, u)
        a = (a.float() * w[sel][:, None]).to(bf16)
        out[sel] = (a.float() @ w_down[e].float().T).to(bf16)
    return out


def reference_moe_bf16(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, *,
                       activation: GatedActivation = SILU) -> torch.Tensor:
    """Dense per-token MoE from :func:`reference_rows_bf16`'s rows: ``out[t] = Σ_k fp32(y_tk)``
    in fp32 (MoonEP also rounds each token's same-destination partial sum to bf16 once:
    the only rounding this oracle does not place). Returns ``[T, H]`` fp32."""
    T, K = topk_ids.shape
    rows = reference_rows_bf16(hidden.repeat_interleave(K, dim=0), topk_ids.reshape(-1), topk_weights.reshape(-1),
                               w_gate, w_up, w_down, activation=activation)
    return rows.float().view(T, K, -1).sum(dim=1)


#: Pass criterion of the MoonEP path against :func:`reference_moe_bf16`, per token:
#: ``max_i |ours[t, i] - ref[t, i]| <= TOKEN_REL_TOL * max_i |ref[t, i]|``. What the
#: oracle cannot place exactly is fp32 accumulation order inside the GEMMs (a bf16
#: rounding may flip by one ulp) and one bf16 rounding of a token's same-destination
#: partial sum: a few ulps at the token's scale (bf16: 2^-8 relative). See
#: docs/design/ops.md for the measured distribution and the negative controls.
TOKEN_REL_TOL = 2.0 ** -6

#: Pass criterion of every ``(token, k)`` expert row against :func:`reference_rows_bf16`:
#: ``max|row - ref| <= ENTRY_REL_TOL * max|ref|``. Scale-free per entry, so an entry with a
#: tiny route weight (a cold expert at high skew) is checked as strictly as a hot one.
ENTRY_REL_TOL = 2.0 ** -6


def token_rel_errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per-token ``max_i |out - ref| / max_i |ref|`` (``[T]`` fp32)."""
    diff = (out.float() - ref.float()).abs().amax(dim=-1)
    scale = ref.float().abs().amax(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
    return diff / scale
