"""Kimi K3's MoE block through MoonEP's path on two gloo ranks, against the dense reference of the formula.

Used by ``tests/ops/test_k3_moe_block.py``: :func:`block_rank` runs in each rank (``launch.run_ranks``); the
main environment runs the CPU expert paths, and ``python -m tests.support.k3_block_check --json`` runs the
MXFP4 Triton experts under the Triton interpreter in the vLLM environment (it has Triton; nothing here imports
vLLM). What runs where and why: the test module's docstring.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch

from tests.support.k3_moe_reference import (K3_BETA, K3_LINEAR_BETA, K3MoEWeights, expert_pre_activations,
                                            k3_moe_block, quantize, random_k3_layer, route, situ, token_rel_errors)

#: model width, latent width (MoonEP's rows: a multiple of 128), expert width, experts, top-k, shared width
H, L, I, E, K, SHARED = 256, 128, 128, 16, 4, 256  # noqa: E741
TOKENS, RANKS, SEED = 32, 2, 37
#: the experts' gate and up output scales on the unit-variance latent: SiTU's saturation is reached often
GATE_STD, UP_STD = 4.0, 14.0
#: the expert paths: ``format/cpu`` (ops' grouped FFN; the quantized ones dequantize the used rows) in the main
#: environment, ``mxfp4/triton`` (``vllm.experts.gpu.gpu_grouped_ffn``, the project's MXFP4 Triton kernel) under
#: the Triton interpreter in the vLLM environment
CPU_KINDS = ("bf16/cpu", "int4-g32/cpu", "fp8-block/cpu", "mxfp4/cpu")
TRITON_KINDS = ("mxfp4/triton",)
#: Bound on every token's ``max|out - ref| / max|ref|``. The path rounds to bf16 where the model does (the
#: latent rows, gate and up, the activation, the route weight, each expert row, the combine, the norm's and
#: the up-projection's outputs, the shared MLP) and takes bf16 products of the dequantized weights (INT4 and FP8
#: values are not all bf16 numbers); the reference rounds nowhere. Measured maxima over both ranks' 64 tokens
#: (2-core CPU, torch 2.13): bf16 7.3e-3, int4-g32 7.8e-3, fp8-block 7.6e-3, mxfp4 8.0e-3 (the MXFP4 Triton
#: experts under the interpreter: the same, their rows bitwise equal to the CPU path's here); the bound is about
#: twice the largest. The controls measured 0.12 (no linear_beta) to 8.9 (norm skipped), 7x the bound and more.
BOUND = 2.0 ** -6
CONTROLS = ("silu", "no_linear_beta", "bias_in_weights", "norm_skipped")


def layer(fmt: str) -> tuple[dict[str, torch.Tensor], K3MoEWeights]:
    """``(stored expert tensors by the store's projection names [E, ...], the oracle's weights)``: the experts
    quantized to ``fmt`` (the oracle takes the exact values of the stored bytes), everything else bf16."""
    from moonep_ep.layout.formats import expert_projections, store_projections

    t = random_k3_layer(SEED, H=H, L=L, I=I, E=E, top_k=K, shared=SHARED, gate_std=GATE_STD, up_std=UP_STD,
                        favoured=list(range(E // RANKS)))
    dense = {}
    parts = {}
    for proj in ("gate", "up", "down"):
        parts[proj], dense[proj] = quantize(fmt, t[proj])
    if fmt == "bf16":
        stored = {p.name: parts[p.name]["weight"] for p in store_projections("bf16", L, I)}
    else:
        names = [p.name for p in expert_projections(fmt, L, I)]
        w13 = [n for n in names if n.startswith("w13_")]
        w2 = [n for n in names if n.startswith("w2_")]
        stored = {w13[0]: torch.cat([parts["gate"]["weight"], parts["up"]["weight"]], 1),
                  w13[1]: torch.cat([parts["gate"]["scale"], parts["up"]["scale"]], 1),
                  w2[0]: parts["down"]["weight"], w2[1]: parts["down"]["scale"]}
    b = {n: t[n].to(torch.bfloat16).float() for n in ("router", "down_proj", "norm_weight", "up_proj",
                                                      "shared_gate", "shared_up", "shared_down")}
    oracle = K3MoEWeights(router=b["router"], bias=t["bias"], down_proj=b["down_proj"], norm_weight=b["norm_weight"],
                          up_proj=b["up_proj"], gate=dense["gate"], up=dense["up"], down=dense["down"],
                          shared_gate=b["shared_gate"], shared_up=b["shared_up"], shared_down=b["shared_down"],
                          top_k=K)
    return stored, oracle


def tokens(rank: int) -> torch.Tensor:
    return torch.randn(TOKENS, H, generator=torch.Generator().manual_seed(SEED * 101 + rank)).to(torch.bfloat16)


# -- the harness around the path: vLLM's KimiMoE steps at the model's bf16 --------------------------------

def _bf(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16)


def harness_output(routed_latent: torch.Tensor, x: torch.Tensor, w: K3MoEWeights, *, skip_norm: bool = False
                   ) -> torch.Tensor:
    """After the combine: RMSNorm of the K-summed latent (fp32 inside, bf16 out, times the bf16 weight), the
    up-projection, plus the shared experts (SiTU in fp32, rounded once), all bf16 as vLLM runs them."""
    v = routed_latent
    if not skip_norm:
        f = v.float()
        v = _bf(_bf(f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + w.eps)) * _bf(w.norm_weight))
    routed = v @ _bf(w.up_proj).T
    gate, up = x @ _bf(w.shared_gate).T, x @ _bf(w.shared_up).T
    shared = _bf(situ(gate, up, w.beta, w.linear_beta)) @ _bf(w.shared_down).T
    return routed + shared


def block_rank(ctx: Any, kinds: tuple[str, ...] = CPU_KINDS) -> dict[str, Any]:
    """One rank: the block through the path for every expert kind, the controls, the oracle (see the module
    docstring)."""
    from moonep_ep.layout.formats import expert_projections, store_projections
    from moonep_ep.layout.store import ShardedExpertStore
    from moonep_ep.memory.host import HostDriver
    from moonep_ep.ops.experts.activation import GatedActivation
    from moonep_ep.ops.moonep.pull import ReferenceBuffer
    from moonep_ep.ops.experts.grouped import grouped_ffn
    from moonep_ep.ops.moonep.prefetch import wait_for_slots
    from moonep_ep.ops.experts.quantized import quantized_grouped_ffn, views_of
    from moonep_ep.vllm.quantized.engine import prefetch_quantized

    rank, R = ctx.rank, ctx.world_size
    epn = E // R
    activations = {"ok": GatedActivation("situ", K3_BETA, K3_LINEAR_BETA), "silu": GatedActivation("silu"),
                   "no_linear_beta": GatedActivation("situ", K3_BETA, None)}
    x = tokens(rank)
    _, w0 = layer("bf16")
    ids, weights = route(x, w0.router, w0.bias, K, w0.routed_scaling_factor)
    _, biased = route(x, w0.router, w0.bias, K, w0.routed_scaling_factor, bias_in_weights=True)
    latent = _bf(x @ _bf(w0.down_proj).T)
    buf = ReferenceBuffer(TOKENS, L, K, E, R, explicitly_destroy=True)
    tpe = torch.bincount(ids.reshape(-1), minlength=E).to(torch.int32)
    _, _, cu, plan = buf.dispatch(latent, weights, ids.to(torch.int32), tpe)
    row = [int(e) for e in plan.experts_to_copy[rank].tolist()]
    out: dict[str, Any] = {"rank": rank, "slot_sources": [list(s) for s in plan.slot_sources],
                           "slot_rows": {str(b): int(cu[E + b]) - int(cu[E + b - 1]) for b, e in enumerate(row) if e >= 0},
                           "kinds": {}}
    for kind in kinds:
        fmt, experts = kind.split("/")
        stored, oracle = layer(fmt)
        ref = k3_moe_block(x, oracle)
        if "gate_past_beta" not in out:  # SiTU's saturation on this rank's chosen (token, expert) pairs, from the oracle
            g, u = expert_pre_activations(x.float() @ oracle.down_proj.T, ids, oracle)
            out["gate_past_beta"] = float((g.abs() > K3_BETA).float().mean())
            out["up_past_linear_beta"] = float((u.abs() > K3_LINEAR_BETA).float().mean())
        specs = store_projections(fmt, L, I)
        driver = HostDriver(rank=rank)
        store = ShardedExpertStore(num_layers=1, num_experts=E, projections=specs, num_slots=buf.B, driver=driver)
        try:
            store.load(lambda layer, name, e: stored[name][e])
            views = {p.name: store.pull_view(0, p.name) for p in specs}
            if fmt == "bf16":
                buf.prefetch_weight(plan, full_gate_weight=views["gate"], full_up_weight=views["up"],
                                    full_down_weight=views["down"])
            else:
                filled = prefetch_quantized(views, row, E, rank, epn)
                wait_for_slots(filled["event"])
            slots_hold_owner_rows = all(torch.equal(v[E + b], v[e]) for b, e in enumerate(row) if e >= 0
                                        for v in views.values())

            def path(route_weights: torch.Tensor, act: Any) -> torch.Tensor:
                """dispatch (the plan's rows again) -> experts -> combine: the K-summed latent [T, L] bf16."""
                hidden, w_nvs, _, _ = buf.dispatch(latent, route_weights, plan=plan)  # reuse: no new cu_seqlens
                if experts == "triton":
                    from moonep_ep.vllm.experts.gpu import INTERPRETER_CONFIG, gpu_grouped_ffn

                    y = gpu_grouped_ffn(fmt, hidden, views, cu, w_nvs, token_padding=buf.token_padding,
                                        config=INTERPRETER_CONFIG, activation=act)
                elif fmt == "bf16":
                    y = grouped_ffn(hidden, views["gate"], views["up"], views["down"], cu, w_nvs, activation=act)
                else:
                    y = quantized_grouped_ffn(hidden, fmt, *views_of(fmt, views), cu, w_nvs, activation=act)
                return buf.combine(plan, y)[0]

            runs = {"ok": harness_output(path(weights, activations["ok"]), x, oracle),
                    "silu": harness_output(path(weights, activations["silu"]), x, oracle),
                    "no_linear_beta": harness_output(path(weights, activations["no_linear_beta"]), x, oracle),
                    "bias_in_weights": harness_output(path(biased, activations["ok"]), x, oracle)}
            runs["norm_skipped"] = harness_output(path(weights, activations["ok"]), x, oracle, skip_norm=True)
            errs = {k: float(token_rel_errors(v, ref).max()) for k, v in runs.items()}
            out["kinds"][kind] = {"max_token_rel_err": errs.pop("ok"), "controls": errs,
                                   "slots_hold_owner_rows": slots_hold_owner_rows,
                                   "finite": bool(torch.isfinite(runs["ok"]).all())}
        finally:
            store.close()
            driver.close()
    buf.destroy()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.support.k3_block_check")
    p.add_argument("--kinds", default=",".join(TRITON_KINDS))
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from moonep_ep.launch import run_ranks
    from moonep_ep.testing.triton_interpreter import INTERPRETER_ENV

    kinds = tuple(args.kinds.split(","))
    env = dict(INTERPRETER_ENV) if any(k.endswith("/triton") for k in kinds) else {}
    os.environ.update(env)
    t0 = time.perf_counter()
    ranks = run_ranks(triton_rank if env else block_rank, RANKS, args=(kinds,), timeout_s=280, env=env)
    print(json.dumps({"seconds": round(time.perf_counter() - t0, 1), "ranks": ranks}))
    return 0


def triton_rank(ctx: Any, kinds: tuple[str, ...]) -> dict[str, Any]:
    """:func:`block_rank` with the interpreter's bf16 dot and downcasts mended first (its bugs, not the kernel's)."""
    from moonep_ep.testing.triton_interpreter import mend_interpreter

    mended = mend_interpreter()
    return {**block_rank(ctx, kinds), "mended": mended}


if __name__ == "__main__":
    sys.exit(main())
