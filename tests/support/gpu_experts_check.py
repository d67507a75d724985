"""Kernel tier of the GPU experts, on CPU under the Triton interpreter (run in the vllm==0.33.0 environment).

``python -m tests.support.gpu_experts_check --json`` starts two gloo ranks over
the host driver. Each builds one sharded store per format (``E`` experts, ``B``
slots) and loads its own experts, quantized by the format's own tools
(compressed-tensors' ``ModelCompressor`` for INT4 g32 and MXFP4; DeepSeek's
FP8 block quantization). Rank 0 fills its slots through ops' pull — one from
rank 1's pages, one from its own — and runs ``vllm.experts.gpu.gpu_grouped_ffn``
over its ``[E+B]`` views with MoonEP-grouped rows: groups padded to
``token_padding``, an empty expert group, both slots used, stale tail rows
with NaN route weights. The oracle is fp32 math on the weights decompressed
by the format's own decompressor (compressed-tensors ``decompress``; FP8:
``weight · scale_inv`` per 128x128 block, activations quantized per 1x128 by
torch math written here), judged per row:
``max|out - ref| / max|ref| <= bound(format, dtype)`` (:data:`BOUNDS`, about twice the measured maxima).
fp16 runs need no help from the harness; bf16 runs (MoonEP's dtype) need
the interpreter mends of ``moonep_ep/testing/triton_interpreter.py``, which rank
0 applies after measuring the bugs they mend.

Negative controls (each must exceed the bound): a block's expert id off by
one row, a stale slot scale (slot refilled with weights only), swapped
nibble order (INT4, MXFP4), transposed block scales (FP8).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from moonep_ep.testing.triton_interpreter import INTERPRETER_ENV, enter_interpreter

H, I, E, WORLD, LAYER = 256, 128, 4, 2, 0
TOKEN_PADDING = 16
#: per-row relative bound, ``max|out - ref| / max|ref|``, per tier (``kernel``: this harness's small shapes;
#: ``real``: one real-shaped expert, ``gpu_experts_real_shapes``), format and activation dtype: about twice the
#: largest error measured (the 2-core machine, Dec 4; kernel tier / real shapes, fp16 ; bf16):
#: INT4 4.32e-4 / 3.87e-4 ; 9.11e-3 / 6.07e-3, FP8 block 4.47e-4 / 5.31e-4 (1.0e-3 in an earlier run) ;
#: 3.51e-3 / 3.36e-3, MXFP4 4.32e-4 / 4.44e-4 ; 3.43e-3 / 3.38e-3. The oracle rounds where the path rounds, so
#: what it cannot place is fp32 accumulation order (a 16-bit rounding may flip by one ulp, and for FP8 an e4m3
#: activation code by one step), the final rounding of the down output, and, for INT4, the kernel's rounding
#: of each dequantized weight ``(q - 8) * scale`` to the 16-bit dtype before the dot (the oracle keeps the
#: exact product: INT4's bf16 error is the largest).
BOUNDS = {"kernel": {"int4-g32": {"float16": 9e-4, "bfloat16": 1.9e-2},
                     "fp8-block": {"float16": 9e-4, "bfloat16": 7e-3},
                     "mxfp4": {"float16": 9e-4, "bfloat16": 7e-3}},
          "real": {"int4-g32": {"float16": 8e-4, "bfloat16": 1.2e-2},
                   "fp8-block": {"float16": 2e-3, "bfloat16": 7e-3},
                   "mxfp4": {"float16": 9e-4, "bfloat16": 7e-3}}}


def bound(fmt: str, dtype: str, tier: str = "kernel") -> float:
    return BOUNDS[tier][fmt][dtype]


#: groups of the [E+B] rows: counts (multiples of TOKEN_PADDING); expert 1 and 3 have no rows of their own
COUNTS = [16, 0, 32, 0, 16, 16]
SLOT_EXPERTS = [3, 0]   # slot 0 <- expert 3 (rank 1's pages), slot 1 <- expert 0 (own)
STALE_FILL = [1, 2]     # what the slots held before (the stale-scale control leaves these scales)
TAIL = 16               # stale rows past cu_seqlens[-1]
SENTINEL = 7.0          # what the caller's output holds before the FFN: rows past cu_seqlens[-1] keep it


def _dense_weights(h: int, i: int, experts: int, seed: int = 0) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for e in range(experts):
        for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            w = torch.randn(shape, generator=gen) / shape[1] ** 0.5
            # uneven group magnitudes so a stale or transposed scale shows
            w *= torch.rand(shape[0], 1, generator=gen) * 1.5 + 0.25
            out[f"model.layers.0.mlp.experts.{e}.{proj}.weight"] = w.to(torch.bfloat16)
    return out


def quantized_experts(fmt: str, h: int = H, i: int = I, experts: int = E) -> tuple[dict[str, Any], dict[str, Any]]:
    """``({store tensor name: [experts, ...]}, {gate/up/down: [experts, out, in] fp32 oracle weights})``."""
    import torch

    from moonep_ep.tools.checkpoints.tiny_quantized import (compress_experts_ct, decompress_tensors,
                                                             fp8_block_dequantize, quantize_fp8_block)

    dense = _dense_weights(h, i, experts)
    key = "model.layers.0.mlp.experts.{}.{}.{}"
    if fmt == "fp8-block":
        tensors: dict[str, Any] = {}
        for name, w in dense.items():
            q, s = quantize_fp8_block(w.float())
            tensors[name] = q
            tensors[name + "_scale_inv"] = s
        plain = {k: fp8_block_dequantize(v, tensors[k + "_scale_inv"]) for k, v in tensors.items()
                 if not k.endswith("_scale_inv")}
        wname, sname = "weight", "weight_scale_inv"
    else:
        tensors, qcfg = compress_experts_ct(dense, fmt)
        plain = decompress_tensors({"quantization_config": qcfg}, tensors)
        wname, sname = "weight_packed", "weight_scale"
    store = {}
    for part, suffix in ((wname, wname), (sname, sname)):
        store[f"w13_{suffix}"] = torch.stack([torch.cat([tensors[key.format(e, "gate_proj", part)],
                                                         tensors[key.format(e, "up_proj", part)]])
                                              for e in range(experts)])
        store[f"w2_{suffix}"] = torch.stack([tensors[key.format(e, "down_proj", part)] for e in range(experts)])
    oracle = {p: torch.stack([plain[key.format(e, p + "_proj", "weight")].float() for e in range(experts)])
              for p in ("gate", "up", "down")}
    return store, oracle


def _fp8_act_quant(x: Any) -> Any:
    """Per 1x128 e4m3 quantize-dequantize, torch math independent of vLLM's op: scale ``amax · (1/448)``
    (a multiply by the reciprocal, as vLLM's op computes it: with 16-bit inputs ``x / scale`` often lands
    on an exact e4m3 tie, where a one-ulp different scale flips the code)."""
    import torch

    g = x.float().unflatten(-1, (-1, 128))
    s = g.abs().amax(-1, keepdim=True).clamp_min(1e-10) * (1.0 / 448.0)
    return ((g / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).flatten(-2)


def oracle_rows(fmt: str, hidden: Any, route: Any, row_experts: list[int], w: dict[str, Any]) -> Any:
    """fp32 products from the decompressed weights, rounded to the activations' dtype where MoonEPExperts
    rounds (gate and up outputs, silu, the product, the route weight and its product); FP8 quantizes the
    activations of both GEMMs per 1x128 (:func:`_fp8_act_quant`). Returns ``[M, H]`` fp32."""
    import torch
    import torch.nn.functional as F

    dt = hidden.dtype
    out = torch.zeros(hidden.shape[0], w["down"].shape[1])
    for r, e in enumerate(row_experts):
        if e < 0:
            continue
        x = hidden[r:r + 1].float()
        if fmt == "fp8-block":
            x = _fp8_act_quant(x)
        gate, up = (x @ w["gate"][e].T).to(dt), (x @ w["up"][e].T).to(dt)
        act = (F.silu(gate.float()).to(dt).float() * up.float()).to(dt)
        act = (act.float() * route[r:r + 1].to(dt).float()).to(dt).float()
        if fmt == "fp8-block":
            act = _fp8_act_quant(act)
        out[r] = (act @ w["down"][e].T)[0]
    return out


def row_errors(out: Any, ref: Any, row_experts: list[int]) -> float:
    rows = [r for r, e in enumerate(row_experts) if e >= 0]
    d = (out[rows].float() - ref[rows]).abs().amax(-1) / ref[rows].abs().amax(-1).clamp_min(1e-30)
    return float(d.max())


def _swap_nibbles(t: Any) -> Any:
    b = t.contiguous().view(__import__("torch").uint8)
    return (((b & 0xF) << 4) | (b >> 4)).view(t.dtype)


def _check_format(fmt: str, views: dict[str, Any], oracle: dict[str, Any], dtypes: list[str],
                  controls: bool) -> dict[str, Any]:
    import torch

    from moonep_ep.ops.experts.grouped_blocks import check_segments_aligned, grouped_blocks
    from moonep_ep.ops.moonep.prefetch import pull_slots, wait_for_slots
    from moonep_ep.vllm.experts.gpu import INTERPRETER_CONFIG, gpu_grouped_ffn

    cu = torch.tensor(COUNTS, dtype=torch.int32).cumsum(0).to(torch.int32)
    check_segments_aligned(cu, INTERPRETER_CONFIG["BLOCK_SIZE_M"])
    M = int(cu[-1]) + TAIL
    groups = [g for g, n in enumerate(COUNTS) for _ in range(n)]
    row_experts = [g if g < E else SLOT_EXPERTS[g - E] for g in groups] + [-1] * TAIL
    gen = torch.Generator().manual_seed(11)
    hidden32 = torch.randn(M, H, generator=gen)
    route = torch.rand(M, generator=gen) + 0.1
    route[int(cu[-1]):] = float("nan")  # stale tail: must not reach the output
    res: dict[str, Any] = {"rows": M, "cu_seqlens": cu.tolist(), "slot_experts": SLOT_EXPERTS, "dtypes": {}}
    weights = {n: v for n, v in views.items() if "scale" not in n}

    def run(dtype: str, use_views: dict[str, Any], blocks: Any = None) -> tuple[float, float, Any]:
        hidden = hidden32.to(getattr(torch, dtype))
        t0 = time.perf_counter()
        # the caller's output, written in place; the sentinel shows the rows past cu[-1] are never written
        out = torch.full((M, H), SENTINEL, dtype=hidden.dtype)
        gpu_grouped_ffn(fmt, hidden, use_views, cu, route, token_padding=TOKEN_PADDING, blocks=blocks, out=out)
        dt = time.perf_counter() - t0
        ref = oracle_rows(fmt, hidden, route, row_experts, oracle)
        return row_errors(out, ref, row_experts), dt, out

    # stale slot scale: the slots held experts 1 and 2; a refill moved the weights only
    wait_for_slots(pull_slots(views, STALE_FILL, E)[2])
    wait_for_slots(pull_slots(weights, SLOT_EXPERTS, E)[2])
    ctl: dict[str, float] = {}
    if controls:
        ctl["stale_slot_scale"] = run("float16", views)[0]
    wait_for_slots(pull_slots(views, SLOT_EXPERTS, E)[2])  # the real fill: weights and scales, one row index
    res["slot_rows_equal_sources"] = all(torch.equal(v[E + b], v[e]) for v in views.values()
                                         for b, e in enumerate(SLOT_EXPERTS))
    for dtype in dtypes:
        err, dt, out = run(dtype, views)
        res["dtypes"][dtype] = {"max_row_rel_err": err, "bound": bound(fmt, dtype), "seconds": round(dt, 3),
                                "tail_untouched": bool((out[int(cu[-1]):] == SENTINEL).all()),
                                "finite": bool(torch.isfinite(out[:int(cu[-1])]).all())}
    # The push layout (gate, up, down apart; scale rows padded per expert to 16 KiB, read through their data
    # views): the same bits as the fused w13 row.
    res["push_layout_equals_fused"] = bool(torch.equal(run("float16", push_layout_views(fmt, views))[2],
                                                       run("float16", views)[2]))
    if controls:
        blocks = grouped_blocks(cu, M, INTERPRETER_CONFIG["BLOCK_SIZE_M"])
        first_block_of_expert2 = COUNTS[0] // INTERPRETER_CONFIG["BLOCK_SIZE_M"]
        blocks.expert_ids[first_block_of_expert2] += 1
        ctl["expert_id_off_by_one"] = run("float16", views, blocks)[0]
        w13 = next(n for n in views if n.startswith("w13_") and "scale" not in n)
        if fmt in ("int4-g32", "mxfp4"):
            ctl["swapped_nibbles"] = run("float16", {**views, w13: _swap_nibbles(views[w13])})[0]
        if fmt == "fp8-block":
            s13 = "w13_weight_scale_inv"
            assert views[s13].shape[-1] == views[s13].shape[-2], "square block grid needed for the control"
            transposed = views[s13].transpose(-1, -2).contiguous()
            ctl["transposed_block_scales"] = run("float16", {**views, s13: transposed})[0]
    res["controls"] = ctl
    res["control_bound"] = bound(fmt, "float16")  # the controls run in fp16
    return res


def push_layout_views(fmt: str, views: dict[str, Any]) -> dict[str, Any]:
    """``views`` (vLLM's fused names) rebuilt as the push store holds them: gate and up rows of ``w13`` apart,
    every scale tensor in 16 KiB-padded uint8 rows read through ``layout.formats.scale_data_view``."""
    import torch

    from moonep_ep.layout.formats import scale_data_view
    from moonep_ep.layout.store import ProjectionSpec
    from moonep_ep.ops.experts.quantized import views_of

    w13, s13, w2, s2 = views_of(fmt, views)

    def padded(scale: Any) -> Any:
        spec = ProjectionSpec("s", tuple(scale.shape[1:]), scale.dtype, role="scale")
        rows = torch.zeros(scale.shape[0], -(-spec.row_bytes // 16384) * 16384, dtype=torch.uint8)
        rows[:, :spec.row_bytes] = scale.contiguous().view(scale.shape[0], -1).view(torch.uint8)
        return scale_data_view(rows, spec)

    half, shalf = w13.shape[1] // 2, s13.shape[1] // 2
    return {"gate": w13[:, :half].contiguous(), "gate_scale": padded(s13[:, :shalf]),
            "up": w13[:, half:].contiguous(), "up_scale": padded(s13[:, shalf:]), "down": w2, "down_scale": padded(s2)}


def rank_main(ctx: Any, formats: list[str], dtypes: list[str], controls: bool) -> dict[str, Any]:
    enter_interpreter()
    import torch

    from moonep_ep.layout.formats import expert_projections
    from moonep_ep.layout.store import ShardedExpertStore
    from moonep_ep.memory.host import HostDriver
    from tests.support.memory import GRAN

    rank = ctx.rank
    out: dict[str, Any] = {"rank": rank, "formats": {}}
    if rank == 0:
        from moonep_ep.testing import triton_interpreter as ti

        out["bf16_dot_error_bare"], out["downcast_mismatch_bare"] = ti.bf16_dot_error(), ti.downcast_mismatch()
        ti.mend_bf16_dot()
        ti.mend_downcasts()
        out["bf16_dot_error_mended"], out["downcast_mismatch_mended"] = ti.bf16_dot_error(), ti.downcast_mismatch()
    driver = HostDriver(rank=rank, granularity=GRAN)
    epn = E // WORLD
    try:
        for fmt in formats:
            t0 = time.perf_counter()
            tensors, oracle = quantized_experts(fmt)
            projs = expert_projections(fmt, H, I)
            store = ShardedExpertStore(num_layers=1, num_experts=E, projections=projs, num_slots=epn, driver=driver)
            try:
                store.load(lambda layer, name, e: tensors[name][e])
                views = {p.name: store.pull_view(LAYER, p.name) for p in projs}
                if rank == 0:
                    res = _check_format(fmt, views, oracle, dtypes, controls)
                    res["owner_rows_equal_checkpoint"] = all(torch.equal(views[n][e], tensors[n][e])
                                                             for n in tensors for e in range(E))
                    res["seconds_total"] = round(time.perf_counter() - t0, 2)
                    out["formats"][fmt] = res
                if rank == 1 and "engine_selection" not in out:
                    # while rank 0 computes: the vllm engine's selection (its own vLLM import, so it adds no wall
                    # time here; tests/support/gpu_engine_selection.py says what it builds)
                    from tests.support.gpu_engine_selection import collect
                    from tests.support.gpu_experts_tiles import tile_choices

                    out["engine_selection"] = collect()
                    out["tile_choices"] = tile_choices()
                del views
                store.symm.comm.barrier(f"{fmt} checked")
            finally:
                store.close()
    finally:
        driver.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--formats", default="int4-g32,fp8-block,mxfp4")
    p.add_argument("--dtypes", default="float16,bfloat16")
    p.add_argument("--no-controls", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    enter_interpreter()
    from moonep_ep.launch import run_ranks

    t0 = time.perf_counter()
    results = run_ranks(rank_main, WORLD, args=(args.formats.split(","), args.dtypes.split(","),
                                               not args.no_controls), timeout_s=600, group_timeout_s=600,
                        env={"MOONEP_EP_TIMEOUT_S": "600", **INTERPRETER_ENV})
    out = {"ranks": results, "seconds": round(time.perf_counter() - t0, 1), "bounds": BOUNDS["kernel"],
           "token_padding": TOKEN_PADDING, "shape": {"H": H, "I": I, "E": E, "world": WORLD}}
    out["ok"] = all(d["max_row_rel_err"] <= d["bound"] and d["tail_untouched"] and d["finite"]
                    for f in results[0]["formats"].values() for d in f["dtypes"].values())
    print(json.dumps(out, indent=1 if not args.json else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
