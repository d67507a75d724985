"""Slot fills waited for where the experts read them, and the negative control: kernel tier on CPU.

Run in the ``vllm==0.33.0`` environment::

    python -m tests.support.slot_fill_check --json [--cases fp8-block/dequant,fp8-block/triton,mxfp4/dequant]

Two gloo ranks over the host driver, CPU slot copies deferred (``MOONEP_EP_CPU_DEFERRED_COPIES=1``: a
copy lands only when its event is waited on, as a GPU's side-stream copy may land only then). Each rank
runs vLLM 0.33.0's ``FusedMoEKernel(MoonEPPrepareAndFinalize, experts)`` over the plugin's manager, its
reference buffer and the sharded store, two MoE layers that share one slot pool:

* BF16: vLLM's own MoE layers (``vllm_moe_model.py``, as ``kernel_check``), ``MoonEPExperts.apply`` as
  the plugin patches it (``overlap.apply``: own groups, the wait, slot groups);
* quantized: a store of the format (weights and scales), each layer bound by the plugin's
  ``bind_quantized_layer`` to vLLM's prepare/finalize and ``MoonEPQuantizedExperts`` (dequant) or
  ``MoonEPTritonQuantizedExperts`` (Triton, in the interpreter); the prefetch pulls weights and scales
  (``prefetch_quantized``) and hands both events to the experts' ``apply``.

Steps (each over both layers; the oracle is a dense fp32 MoE from weights built apart from the system:
``kernel_check.dense_reference`` for BF16, the format's own decompression of the checkpoint,
``gpu_experts_check.quantized_experts``, for the quantized layers, layer 1's experts other experts than
layer 0's at twice the scale, :func:`layer_material`; BF16 steps route fresh tokens, the quantized ones
the same tokens in every layer and step, so both layers fill the same slots):

* ``poison``: the wait removed, right after loading: slots hold the settle's NaN poison;
* ``fixed``: with the library's wait;
* ``stale``: the wait removed, one step later: layer 0's slots still hold the previous step's layer 1
  experts (the pool is shared by all layers);
* ``scales`` (quantized): only the weights' event waited on: fresh weights with the other layer's scales.

The wait is removed here, by this harness (:func:`waits`, which swaps the name ``wait_for_slots`` in the
two modules whose ``apply`` calls it), never by a product setting. Controls must fail the oracle, the
fixed steps must pass it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
import types
from typing import Any, Iterator

STEPS_BF16 = ("poison", "fixed", "stale", "fixed")
#: the quantized cases run by default, and their steps (the Triton kernels run in the interpreter: fewer)
CASES = {"fp8-block/dequant": ("poison", "fixed", "stale", "fixed", "scales", "fixed"),
         "fp8-block/triton": ("poison", "fixed", "stale", "fixed"),
         "mxfp4/dequant": ("poison", "fixed", "stale", "fixed", "scales", "fixed")}
#: quantized store: experts, hidden, intermediate, layers, tokens per rank, top-k
QE, QH, QI, QL, QTOKENS, QTOPK = 8, 256, 128, 2, 128, 4
#: bound of a quantized layer's ``max|out - ref| / max|ref|`` (over the layer's tokens) against :func:`_dense`
#: (rounded where the experts round, FP8 Triton's activation quantization included): what it cannot place is
#: fp32 summation order, which flips a bf16 rounding, and then an e4m3 activation code (2^-4 of an element),
#: by one step. About twice the maxima measured on this harness (fp8-block: dequant 0.010, Triton 0.029;
#: mxfp4 0.006); a stale slot is off by O(1), a poisoned one is NaN.
QUANT_REL_BOUND = {"fp8-block/dequant": 2.0 ** -5, "fp8-block/triton": 2.0 ** -4, "mxfp4/dequant": 2.0 ** -6,
                   "mxfp4/triton": 2.0 ** -6, "int4-g32/dequant": 2.0 ** -5, "int4-g32/triton": 2.0 ** -5}


@contextlib.contextmanager
def waits(mode: str, counter: dict[str, int]) -> Iterator[None]:
    """``all``: the library's wait (counted); ``none``: no wait where the experts read the slots;
    ``weights``: of a (weights, scales) pair of events only the weights' is waited on."""
    from moonep_ep.ops.moonep import prefetch
    from moonep_ep.vllm.experts import overlap
    from moonep_ep.vllm.quantized import engine as quantized_engine

    real = prefetch.wait_for_slots

    def hooked(event: Any) -> None:
        counter["calls"] = counter.get("calls", 0) + 1
        if event is None:
            return
        counter["events"] = counter.get("events", 0) + 1
        if mode == "all":
            real(event)
        elif mode == "weights" and isinstance(event, tuple):
            real(event[0])

    saved = overlap.wait_for_slots, quantized_engine.wait_for_slots
    overlap.wait_for_slots = quantized_engine.wait_for_slots = hooked
    try:
        yield
    finally:
        overlap.wait_for_slots, quantized_engine.wait_for_slots = saved


def _mode(step: str) -> str:
    return {"fixed": "all", "poison": "none", "stale": "none", "scales": "weights"}[step]


def _layer_rel(out: Any, ref: Any) -> float:
    """``max|out - ref| / max|ref|`` over the layer's output (NaN: infinite)."""
    err = (out.float() - ref).abs().max() / ref.abs().max()
    return float("inf") if err.isnan() else float(err)


def layer_material(material: Any, layers: int, experts: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Layer ``l``'s experts: entries ``[l*E, (l+1)*E)`` of the material with every scale doubled ``l`` times
    (exact: an E8M0 exponent byte + 1, a float scale x 2) and its oracle weights x 2^l, so a slot that pairs
    one layer's scale with another layer's weight is off by 2x, as one that holds the other layer's expert."""
    import torch

    tensors, oracle = material
    scale = torch.tensor([2.0 ** (i // experts) for i in range(layers * experts)])
    out = {}
    for name, t in tensors.items():
        t = t[:layers * experts].clone()
        if "scale" in name:
            shape = (-1,) + (1,) * (t.dim() - 1)
            steps = scale.log2().to(torch.int64).view(shape)
            t = (t.to(torch.int64) + steps).to(t.dtype) if t.dtype == torch.uint8 else t * scale.view(shape).to(t.dtype)
        out[name] = t
    return out, {p: w[:layers * experts] * scale.view(-1, 1, 1) for p, w in oracle.items()}


def _dense(w: dict[str, Any], first: int, x: Any, ids: Any, route: Any, act_quant: bool) -> Any:
    """The MoE of expert ``first + ids[t, k]`` in fp32 from the decompressed weights, rounded to bf16 where the
    experts round (gate and up outputs, SiLU, the product, the route weight; each expert row's output, then
    the combine's sum), as ``gpu_experts_check.oracle_rows`` does; with ``act_quant`` both GEMMs' activations
    quantized per 1x128 to e4m3 (FP8's Triton kernel). Returns ``[tokens, H]`` fp32."""
    import torch
    import torch.nn.functional as F

    from tests.support.gpu_experts_check import _fp8_act_quant

    bf = torch.bfloat16

    def q(t: Any) -> Any:
        return _fp8_act_quant(t) if act_quant else t

    out = torch.zeros(x.shape[0], w["down"].shape[1])
    xq = q(x.float())
    for e in torch.unique(ids).tolist():
        rows, ks = torch.nonzero(ids == e, as_tuple=True)
        gate, up = (xq[rows] @ w["gate"][first + e].T).to(bf), (xq[rows] @ w["up"][first + e].T).to(bf)
        act = (F.silu(gate.float()).to(bf).float() * up.float()).to(bf)
        act = (act.float() * route[rows, ks, None].to(bf).float()).to(bf).float()
        out.index_add_(0, rows, (q(act) @ w["down"][first + e].T).to(bf).float())
    return out.to(bf).float()


def _forward(kernel: Any, layer: Any, x: Any, ids: Any, w: Any, E: int) -> Any:
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    return kernel.apply(hidden_states=x, w1=layer.w13_weight, w2=layer.w2_weight, topk_ids=ids, topk_weights=w,
                        activation=MoEActivation.SILU, global_num_experts=E, expert_map=None,
                        apply_router_weight_on_input=False)


def bf16_rank(rank: int, world: int, *, decode_sized: bool = False) -> dict[str, Any]:
    """The BF16 steps; ``decode_sized``: every step is taken for a decode step (the experts wait, then run one
    pass), else for a prefill (own groups, the wait, the slot groups)."""
    import torch

    from moonep_ep.vllm.experts import overlap

    sized, overlap.decode_sized = overlap.decode_sized, lambda step_tokens, vllm_config: decode_sized
    try:
        return _bf16_steps(rank, world)
    finally:
        overlap.decode_sized = sized


def _bf16_steps(rank: int, world: int) -> dict[str, Any]:
    import torch

    from moonep_ep.vllm.experts import overlap
    from tests.support.kernel_check import TOLERANCE, dense_reference, routing
    from tests.support.vllm_moe_model import KernelCase, build, checkpoint

    case = KernelCase(ranks=world)
    model = build(case, rank)
    model.load_weights(list(checkpoint(case, case.seed, rank=rank)))
    for layer in model.layers:
        layer.quant_method.process_weights_after_loading(layer)
    steps = []
    for s, step in enumerate(STEPS_BF16):
        counter: dict[str, int] = {}
        layers = []
        overlap.TRACE.events = trace = []
        with waits(_mode(step), counter):
            for l, layer in enumerate(model.layers):
                x, ids, w = routing(dataclasses.replace(case, seed=100 + s), l, rank)
                ref = dense_reference(case, l, x, ids, w)
                kernel = layer.quant_method.moe_kernel
                y = _forward(kernel, layer, x, ids, w, case.experts)
                err = (y.float() - ref).abs()
                layers.append({"within_oracle": bool((err <= TOLERANCE["atol"] + TOLERANCE["rtol"] * ref.abs()).all()),
                               "finite": bool(torch.isfinite(y).all()), "max_abs_err": float(err.max()),
                               "slots": [list(t) for t in kernel.prepare_finalize._buffer.last_slots]})
        overlap.TRACE.events = None
        steps.append({"step": step, "layers": layers, "waits": counter, "trace": trace})
    return {"experts_class": type(model.layers[0].quant_method.moe_kernel.fused_experts).__name__, "steps": steps}


def quantized_layers(rank: int, manager: Any, fmt: str, kind: str, material: Any, case: Any) -> tuple[list, list]:
    """``case.layers`` MoE layers of format ``fmt`` over a new store of the manager's API (weights and scales,
    layer ``l``'s expert ``e`` is entry ``l*E + e`` of the material: every layer's experts differ), each bound by
    the plugin's ``bind_quantized_layer`` to vLLM's prepare/finalize and the experts of ``kind`` (``dequant``:
    ``MoonEPQuantizedExperts``; ``triton``: ``MoonEPTritonQuantizedExperts``). Returns ``(layers, kernels)``."""
    import torch
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
    from vllm.model_executor.layers.fused_moe.prepare_finalize import moonep as vllm_moonep

    from moonep_ep.vllm.store.loading import BINDING_ATTR
    from moonep_ep.vllm.quantized.engine import bind_quantized_layer
    from moonep_ep.vllm.store.sharded import ModelExpertStore
    from tests.support.vllm_moe_model import fused_moe_config

    os.environ["MOONEP_EP_QUANTIZED_EXPERTS"] = kind
    E, L = case.experts, case.layers
    tensors, _ = layer_material(material, L, E)
    epn = E // case.ranks
    api = manager.buffer_choice.api_choice
    store = ModelExpertStore(layer_names=[f"{fmt}.{kind}.{api.api}.{l}" for l in range(L)], num_experts=E,
                             hidden=case.hidden, intermediate=case.intermediate,
                             num_slots=api.num_slots(epn, vllm_moonep.MOONEP_DEFAULT_NUM_PREFETCH_SLOTS),
                             api=api.api, group=manager.cpu_group, device=torch.device("cpu"), fmt=fmt)
    manager.expert_stores.append(store)
    for l in range(L):
        for j in range(epn):
            for name, stacked in tensors.items():
                row = stacked[l * E + rank * epn + j]
                # gate and up, as vLLM's loader writes them: the row's two halves (push: split store tensors)
                parts = enumerate(row.chunk(2)) if name.startswith("w13_") else [(None, row)]
                for part, half in parts:
                    target, target_part = store.store_target(name, part)
                    store.write_expert(l, target, j, half, "slot_fill_check", part=target_part)
    store.settle()  # slots poisoned (NaN scales), as after a load or a reload
    layers, kernels = [], []
    for l in range(L):
        layer = torch.nn.Module()
        layer.layer_name = store.layer_names[l]
        layer._expert_routing_tables = lambda: None
        setattr(layer, BINDING_ATTR, (store, l))
        method = types.SimpleNamespace(moe=fused_moe_config(case, rank), moe_kernel=None, moe_quant_config=None,
                                       get_fused_moe_quant_config=lambda _layer: FUSED_MOE_UNQUANTIZED_CONFIG)
        bind_quantized_layer(method, layer)
        layers.append(layer)
        kernels.append(method.moe_kernel)
    return layers, kernels


def quantized_rank(rank: int, world: int, manager: Any, fmt: str, kind: str, material: Any,
                   step_names: tuple[str, ...]) -> dict[str, Any]:
    import torch

    from tests.support.kernel_check import routing
    from tests.support.vllm_moe_model import KernelCase

    case = KernelCase(ranks=world, experts=QE, top_k=QTOPK, hidden=QH, intermediate=QI, layers=QL, tokens=QTOKENS)
    _, oracle = layer_material(material, QL, QE)
    layers, kernels = quantized_layers(rank, manager, fmt, kind, material, case)
    steps = []
    for step in step_names:
        counter: dict[str, int] = {}
        rows = []
        with waits(_mode(step), counter):
            for l in range(QL):
                # The same tokens and routing in every layer and step: both layers fill the same slots (with
                # their own experts), so a slot not refilled holds the other layer's expert or scale.
                x, ids, w = routing(case, 0, rank)
                t0 = time.perf_counter()
                y = _forward(kernels[l], layers[l], x, ids, w, QE)
                ref = _dense(oracle, l * QE, x, ids, w, act_quant=fmt == "fp8-block" and kind == "triton")
                rows.append({"rel_err": _layer_rel(y, ref),
                             "finite": bool(torch.isfinite(y).all()), "seconds": round(time.perf_counter() - t0, 2),
                             "slots": [list(t) for t in kernels[l].prepare_finalize._buffer.last_slots]})
        steps.append({"step": step, "layers": rows, "waits": counter})
    return {"experts_class": type(kernels[0].fused_experts).__name__, "bound": QUANT_REL_BOUND[f"{fmt}/{kind}"],
            "steps": steps}


def check_rank(ctx: Any, cases: dict[str, tuple[str, ...]]) -> dict[str, Any]:
    stats = tempfile.mkdtemp(prefix="moonep-ep-slotfill-")
    os.environ["MOONEP_EP_VLLM_STATS_DIR"] = stats  # the buffer records each prefetch's slots
    try:
        return _check_rank(ctx, cases)
    finally:
        shutil.rmtree(stats, ignore_errors=True)


def _check_rank(ctx: Any, cases: dict[str, tuple[str, ...]]) -> dict[str, Any]:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ["MOONEP_EP_CPU"] = "1"
    from moonep_ep.vllm import plugin

    plugin.install()
    from vllm.distributed import get_ep_group

    from moonep_ep import envs
    from tests.support.gpu_experts_check import quantized_experts
    from tests.support.kernel_check import setup_vllm

    rank, world = ctx.rank, ctx.world_size
    setup_vllm(rank, world)
    import vllm.distributed.device_communicators.all2all  # noqa: F401 - first, so the plugin's hook patches it

    from moonep_ep.vllm.manager import ShardedMoonEPAll2AllManager

    ep = get_ep_group()
    manager = ShardedMoonEPAll2AllManager(ep.cpu_group, device_group=ep.device_group)
    ep.device_communicator.all2all_manager = manager
    out: dict[str, Any] = {"rank": rank, "deferred_copies": envs.MOONEP_EP_CPU_DEFERRED_COPIES}
    t0 = time.perf_counter()
    out["bf16"] = bf16_rank(rank, world)
    out["bf16"]["seconds"] = round(time.perf_counter() - t0, 2)
    out["bf16_decode"] = bf16_rank(rank, world, decode_sized=True)
    out["quantized"] = {}
    materials: dict[str, Any] = {}
    for key, step_names in cases.items():
        t0 = time.perf_counter()
        fmt, kind = key.split("/")
        if fmt not in materials:  # the same checkpoint on every rank (fixed seed)
            materials[fmt] = quantized_experts(fmt, QH, QI, QL * QE)
        res = quantized_rank(rank, world, manager, fmt, kind, materials[fmt], step_names)
        res["seconds"] = round(time.perf_counter() - t0, 2)
        out["quantized"][key] = res
    ep.barrier()
    manager.destroy()
    return out


def verdict(ranks: list[dict[str, Any]]) -> list[str]:
    """Every failed expectation: fixed steps pass the oracle on every rank and layer with one wait per layer;
    every control step (wait removed) fails it somewhere, with slots in use."""
    failed = []
    runs = [("bf16", [r["bf16"] for r in ranks]), ("bf16_decode", [r["bf16_decode"] for r in ranks])]
    runs += [(key, [r["quantized"][key] for r in ranks]) for key in ranks[0]["quantized"]]
    for name, per_rank in runs:
        for s, step in enumerate(per_rank[0]["steps"]):
            layers = [layer for r in per_rank for layer in r["steps"][s]["layers"]]
            ok = [(layer["within_oracle"] if "within_oracle" in layer else layer["rel_err"] <= per_rank[0]["bound"])
                  for layer in layers]
            used = any(layer["slots"] for layer in layers)
            if step["step"] == "fixed":
                if not all(ok):
                    failed.append(f"{name} step {s} (with the wait): a layer fails the oracle")
                waits = [r["steps"][s]["waits"] for r in per_rank]
                if any(w.get("events") != len(r["steps"][s]["layers"]) for w, r in zip(waits, per_rank)):
                    failed.append(f"{name} step {s}: not one waited event per layer: {waits}")
            else:
                if not used:
                    failed.append(f"{name} step {s} ({step['step']}): no slot in use, the control proves nothing")
                elif all(ok):
                    failed.append(f"{name} step {s} ({step['step']}, wait removed): every layer passes the oracle")
    if not all(r["deferred_copies"] for r in ranks):
        failed.append("CPU slot copies were not deferred")
    return failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.support.slot_fill_check")
    p.add_argument("--cases", default=",".join(CASES),
                   help="format/kind pairs (default: %(default)s; others run the default's longest steps)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from moonep_ep.launch import run_ranks
    from moonep_ep.testing.triton_interpreter import INTERPRETER_ENV

    cases = {c: CASES.get(c, CASES["mxfp4/dequant"]) for c in args.cases.split(",") if c}
    env = {"VLLM_TARGET_DEVICE": "cpu", "MOONEP_EP_CPU": "1", "MOONEP_EP_CPU_DEFERRED_COPIES": "1"}
    if any(c.endswith("/triton") for c in cases):
        env.update(INTERPRETER_ENV)  # Triton's kernels run in its interpreter on CPU
        os.environ.update(INTERPRETER_ENV)
    os.environ.update(env)
    t0 = time.perf_counter()
    ranks = run_ranks(check_rank, 2, args=(cases,), timeout_s=400, env=env)
    failed = verdict(ranks)
    out = {"ok": not failed, "failed": failed, "seconds": round(time.perf_counter() - t0, 1), "ranks": ranks}
    print(json.dumps(out, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
