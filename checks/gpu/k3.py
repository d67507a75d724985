"""One Kimi K3 MoE layer on one GPU through the MXFP4 Triton experts with SiTU (``scripts/gpu_check.sh`` part 7).

``python -m checks.gpu.k3 --json``, from the repository root, prints one JSON object. It needs a machine with one
GPU (compute capability 8.0+), torch, Triton and moonep_ep importable; not vLLM (the MXFP4 path of
``vllm.experts.gpu`` imports none). Where a precondition is missing (no GPU, the CUDA emulator, Triton missing or
interpreting) it prints ``{"not_applicable": reason, "ok": null}`` and exits 0, as part 6 (:mod:`.mxfp4`) does.

**The layer** at K3's real widths (``models.py`` ``kimi-k3``: latent 3584, expert width 3072; model width 7168
and two shared experts of 3072, published config): a handful of experts (``--experts``, default 32) and
tokens (``--tokens``, 64) so that it runs in seconds. In vLLM 0.33.0's order (``vllm/models/kimi_k3/nvidia/
model.py``: ``KimiMoE.forward``; the runner's ``routed_output_transform`` after the combine): router logits in
fp32, sigmoid, top-k on the scores plus ``e_score_correction_bias``, the unbiased scores renormalized;
``routed_expert_down_proj`` to the latent; the experts (``vllm.experts.gpu.gpu_grouped_ffn``, format
``mxfp4``, ``activation=GatedActivation("situ", 4.0, 25.0)``) over rows grouped by expert as MoonEP's dispatch
leaves them, one expert's rows read from slot 0 (a copy of its row after every owner row); the K-sum (fp32,
one bf16 rounding, MoonEP's combine); RMSNorm of the summed latent, ``routed_expert_up_proj``, plus the shared
experts (SiTU) on the full-width hidden; bf16 where the model is bf16.

**The reference** (:func:`reference_block`) is the formula in fp32, built here from the MXFP4 bytes (E2M1 from
its bit fields, E8M0 ``2^(e-127)``: :func:`.mxfp4.dequantize_reference`), not from the library;
``tests/ops/test_k3_moe_block.py`` checks that it equals ``tests/support/k3_moe_reference.py``. Expert weights
are random bytes with exponents chosen so that SiTU's saturation matters (gate outputs past 4, up outputs
past 25: the fractions are printed). Bound: :data:`BOUND`, per token ``max|out - ref| / max|ref|``. Controls
that must exceed it: SiLU for SiTU, SiTU without ``linear_beta``, the bias in the route weights as well as in
the choice, the norm skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from typing import Any, Optional

import torch

from . import mxfp4

__all__ = ["K3Dims", "REAL", "BOUND", "draw_layer", "reference_block", "system_block", "run_layer", "main"]

#: Per token ``max|out - ref| / max|ref|``. The path rounds to bf16 where the model does (latent rows, gate and
#: up, the activation, the route weight, each expert row, the combine, the norm, the up-projection, the shared
#: MLP); the reference rounds nowhere. The CPU tier of the same block (``tests/ops/test_k3_moe_block.py``,
#: latent 128) measured at most 8.0e-3 in every format; this bound is about twice that.
BOUND = 2.0 ** -6
BETA, LINEAR_BETA, RMS_EPS = 4.0, 25.0, 1e-5
#: standard deviations of the experts' gate and up outputs on a unit-variance latent (SiTU's saturation: gate
#: past beta 4 and up past linear_beta 25 often enough to matter), and of a down row's weights times sqrt(I)
GATE_STD, UP_STD, DOWN_STD = 4.5, 15.0, 0.05
#: RMS of a uniformly random E2M1 code's value: sqrt(mean of 0, .25, 1, 2.25, 4, 9, 16, 36)
E2M1_RMS = (68.5 / 8) ** 0.5
CONTROLS = ("silu", "no_linear_beta", "bias_in_weights", "norm_skipped")


@dataclasses.dataclass(frozen=True)
class K3Dims:
    hidden: int = 7168       # model width
    latent: int = 3584       # routed_expert_hidden_size (MoonEP's rows)
    inter: int = 3072        # moe_intermediate_size
    shared: int = 6144       # 2 shared experts x 3072
    experts: int = 32
    top_k: int = 8
    tokens: int = 64
    padding: int = 16        # every expert group padded to it (MoonEP's token_padding; divides BLOCK_SIZE_M)


REAL = K3Dims()


def _situ(gate: torch.Tensor, up: torch.Tensor, linear_beta: Optional[float] = LINEAR_BETA) -> torch.Tensor:
    g, u = gate.float(), up.float()
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return BETA * torch.tanh(g / BETA) * torch.sigmoid(g) * u


def _route(x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor, k: int, bias_in_weights: bool = False
           ) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.sigmoid(x.float() @ router.float().T)
    biased = scores + bias
    ids = torch.topk(biased, k, dim=-1).indices
    picked = torch.gather(biased if bias_in_weights else scores, 1, ids)
    return ids, picked / picked.sum(-1, keepdim=True)  # routed_scaling_factor 1.0 (K3)


def _rms_norm(v: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    v = v.float()
    return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + RMS_EPS) * weight.float()


def draw_layer(dims: K3Dims, views: dict[str, torch.Tensor], device: torch.device, seed: int = 0
               ) -> dict[str, Any]:
    """Random bf16 dense weights and MXFP4 expert bytes (written into rows ``[0, E)`` of ``views``)."""
    gen = torch.Generator().manual_seed(seed)
    d = dims

    def randn(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(device=device, dtype=torch.bfloat16)

    def codes(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)

    def exps(std: float, fan_in: int, *shape: int) -> torch.Tensor:
        """E8M0 bytes of the two powers of two around the scale that gives outputs of ``std``."""
        c = math.log2(std / (E2M1_RMS * math.sqrt(fan_in)))
        return torch.randint(math.floor(c) + 127, math.ceil(c) + 128, shape, generator=gen, dtype=torch.uint8)

    E, L, I = d.experts, d.latent, d.inter  # noqa: E741
    views["w13_weight_packed"][:E].copy_(codes(E, 2 * I, L // 2))
    views["w13_weight_scale"][:E].copy_(torch.cat([exps(GATE_STD, L, E, I, L // 32),
                                                   exps(UP_STD, L, E, I, L // 32)], 1))
    views["w2_weight_packed"][:E].copy_(codes(E, L, I // 2))
    views["w2_weight_scale"][:E].copy_(exps(DOWN_STD, 1, E, L, I // 32))
    bias = torch.rand(E, generator=gen) * 0.5
    bias[: E // 4] += 1.0 + torch.rand(E // 4, generator=gen)  # a few experts favoured, as a trained bias does
    H, S = d.hidden, d.shared
    return {"router": randn(E, H, std=H ** -0.5), "bias": bias.to(device),
            "down_proj": randn(L, H, std=H ** -0.5), "norm_weight": (1.0 + 0.25 * randn(L, std=1.0).float()).to(
                torch.bfloat16), "up_proj": randn(H, L, std=L ** -0.5),
            "shared_gate": randn(S, H, std=GATE_STD * H ** -0.5), "shared_up": randn(S, H, std=UP_STD * H ** -0.5),
            "shared_down": randn(H, S, std=1.0 / (UP_STD * S ** 0.5))}


def _expert_dense(views: dict[str, torch.Tensor], e: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (mxfp4.dequantize_reference(views["w13_weight_packed"][e], views["w13_weight_scale"][e]),
            mxfp4.dequantize_reference(views["w2_weight_packed"][e], views["w2_weight_scale"][e]))


def reference_block(x: torch.Tensor, w: dict[str, torch.Tensor], experts: dict[int, tuple[torch.Tensor, torch.Tensor]],
                    top_k: int) -> dict[str, Any]:
    """K3's MoE block in fp32: ``{"out": [T, H], "gate_past_beta", "up_past_linear_beta"}`` (the saturation
    fractions over the chosen experts' outputs). ``experts[e] = (w13 [2I, L], w2 [L, I])`` fp32."""
    x = x.float()
    ids, weights = _route(x, w["router"], w["bias"], top_k)
    latent = x @ w["down_proj"].float().T
    routed = torch.zeros_like(latent)
    past_g = past_u = n = 0
    for e in torch.unique(ids).tolist():
        rows, ks = torch.nonzero(ids == e, as_tuple=True)
        w13, w2 = experts[e]
        gate_up = latent[rows] @ w13.T
        g, u = gate_up.chunk(2, dim=-1)
        past_g += int((g.abs() > BETA).sum())
        past_u += int((u.abs() > LINEAR_BETA).sum())
        n += g.numel()
        routed.index_add_(0, rows, weights[rows, ks, None] * (_situ(g, u) @ w2.T))
    routed = _rms_norm(routed, w["norm_weight"])
    shared = _situ(x @ w["shared_gate"].float().T, x @ w["shared_up"].float().T) @ w["shared_down"].float().T
    return {"out": routed @ w["up_proj"].float().T + shared, "gate_past_beta": past_g / max(n, 1),
            "up_past_linear_beta": past_u / max(n, 1)}


def _grouped_rows(ids: torch.Tensor, dims: K3Dims, slot_expert: int, slots: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """MoonEP's grouping of the ``(t, k)`` entries: group ``g`` (expert ``g``; ``slot_expert``'s entries in slot
    group ``E``) padded to ``dims.padding``. Returns (entry -> row, cu_seqlens [E+B] int32, row -> token or -1,
    rows)."""
    E = dims.experts
    flat = ids.reshape(-1).cpu()
    group = torch.where(flat == slot_expert, torch.full_like(flat, E), flat)
    counts = torch.bincount(group, minlength=E + slots)
    padded = (counts + dims.padding - 1) // dims.padding * dims.padding
    cu = torch.cumsum(padded, 0)
    start = cu - padded
    row_of = torch.empty_like(flat)
    fill = start.clone()
    for i, g in enumerate(group.tolist()):
        row_of[i] = fill[g]
        fill[g] += 1
    M = int(cu[-1])
    token_of = torch.full((M,), -1, dtype=torch.int64)
    token_of[row_of] = torch.arange(flat.numel()) // ids.shape[1]
    return row_of, cu.to(torch.int32), token_of, M


def system_block(x: torch.Tensor, w: dict[str, torch.Tensor], views: dict[str, torch.Tensor], dims: K3Dims,
                 cfg: dict[str, int], *, activation: Any, bias_in_weights: bool = False, skip_norm: bool = False,
                 slot_expert: int = 0) -> torch.Tensor:
    """The layer as served: harness steps at bf16 around ``gpu_grouped_ffn`` (see the module docstring)."""
    from moonep_ep.vllm.experts.gpu import gpu_grouped_ffn

    device = x.device
    ids, weights = _route(x, w["router"], w["bias"], dims.top_k, bias_in_weights)
    latent = x @ w["down_proj"].T
    slots = views["w13_weight_packed"].shape[0] - dims.experts
    row_of, cu, token_of, M = _grouped_rows(ids, dims, slot_expert, slots)
    row_of, token_of = row_of.to(device), token_of.to(device)
    hidden = torch.zeros(M, dims.latent, dtype=torch.bfloat16, device=device)
    route = torch.zeros(M, dtype=torch.float32, device=device)
    flat_tok = torch.arange(ids.numel(), device=device) // dims.top_k
    hidden[row_of] = latent[flat_tok]
    route[row_of] = weights.reshape(-1)
    y = gpu_grouped_ffn("mxfp4", hidden, views, cu.to(device), route, token_padding=dims.padding, config=cfg,
                        activation=activation)
    summed = torch.zeros(x.shape[0], dims.latent, dtype=torch.float32, device=device)
    real = token_of >= 0
    summed.index_add_(0, token_of[real], y[real].float())   # MoonEP's combine: fp32 sum, one bf16 rounding
    v = summed.to(torch.bfloat16)
    if not skip_norm:
        f = v.float()
        v = (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + RMS_EPS)).to(torch.bfloat16) * w["norm_weight"]
    shared = _situ(x @ w["shared_gate"].T, x @ w["shared_up"].T).to(torch.bfloat16) @ w["shared_down"].T
    return v @ w["up_proj"].T + shared


def run_layer(dims: K3Dims, views: dict[str, torch.Tensor], device: torch.device, cfg: dict[str, int],
              seed: int = 0) -> dict[str, Any]:
    """Draw the layer, run the path and the four controls, judge each against the reference."""
    from moonep_ep.ops.experts.activation import GatedActivation

    w = draw_layer(dims, views, device, seed)
    slot_expert = 0
    for view in views.values():  # slot 0 <- expert 0: its rows are read past every owner row
        view[dims.experts].copy_(view[slot_expert])
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(dims.tokens, dims.hidden, generator=gen).to(device=device, dtype=torch.bfloat16)
    ids, _ = _route(x, w["router"], w["bias"], dims.top_k)
    experts = {e: _expert_dense(views, e) for e in torch.unique(ids).tolist()}
    ref = reference_block(x, w, experts, dims.top_k)
    del experts
    situ = GatedActivation("situ", BETA, LINEAR_BETA)
    runs = {"ok": {"activation": situ}, "silu": {"activation": GatedActivation("silu")},
            "no_linear_beta": {"activation": GatedActivation("situ", BETA, None)},
            "bias_in_weights": {"activation": situ, "bias_in_weights": True},
            "norm_skipped": {"activation": situ, "skip_norm": True}}
    errs = {}
    for name, kwargs in runs.items():
        out = system_block(x, w, views, dims, cfg, slot_expert=slot_expert, **kwargs)
        errs[name] = float(mxfp4.row_rel_errors(out, ref["out"]).max())
        if name == "ok":
            finite = bool(torch.isfinite(out).all())
    ok_err = errs.pop("ok")
    saturated = ref["gate_past_beta"] > 0 and ref["up_past_linear_beta"] > 0
    return {"dims": dataclasses.asdict(dims), "config": cfg, "slot_0_holds": slot_expert,
            "slot_expert_chosen": bool((ids == slot_expert).any()), "max_token_rel_err": ok_err, "bound": BOUND,
            "controls": errs, "gate_past_beta": ref["gate_past_beta"],
            "up_past_linear_beta": ref["up_past_linear_beta"], "finite": finite,
            "ok": bool(finite and ok_err <= BOUND and all(v > BOUND for v in errs.values()) and saturated)}


def _views(dims: K3Dims, device: torch.device, slots: int = 1) -> dict[str, torch.Tensor]:
    from moonep_ep.layout.formats import expert_projections

    return {p.name: torch.zeros((dims.experts + slots, *p.shape), dtype=p.dtype, device=device)
            for p in expert_projections("mxfp4", dims.latent, dims.inter)}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m checks.gpu.k3", description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=REAL.experts)
    p.add_argument("--tokens", type=int, default=REAL.tokens)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    why = mxfp4.missing_preconditions()
    if why:
        out: dict[str, Any] = {"check": "k3_moe_layer", "not_applicable": "; ".join(why), "ok": None}
    else:
        import triton

        torch.backends.cuda.matmul.allow_tf32 = False  # the reference's fp32 products stay fp32
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        dims = dataclasses.replace(REAL, experts=args.experts, tokens=args.tokens)
        cfg = mxfp4.vllm_default_config(dims.tokens, dims.experts)
        from moonep_ep.vllm.experts.gpu import fit_block_m

        cfg["BLOCK_SIZE_M"] = fit_block_m(cfg["BLOCK_SIZE_M"], dims.padding)
        t0 = time.perf_counter()
        res = run_layer(dims, _views(dims, device), device, cfg)
        out = {"check": "k3_moe_layer", "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
               "triton": triton.__version__, **res, "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))
    return 0 if out["ok"] is not False else 1


if __name__ == "__main__":
    sys.exit(main())
