"""Kernel tier of the push API: vLLM 0.33.0's MoE layers through the push path and the pull path, N gloo ranks.

    python -m tests.support.push_kernel_check --ranks 2 --json

Every rank (``VLLM_TARGET_DEVICE=cpu``, ``MOONEP_EP_CPU=1``) builds the same
``L`` vLLM ``RoutedExperts`` layers twice over the plugin's sharded store:
once under the pull API (vLLM's ``MoonEPPrepareAndFinalize``, ``[E+B]``
views, the pull ``ReferenceBuffer``) and once under ``MOONEP_EP_MOONEP_API=push``
(a second all2all manager: ``prepare_finalize/push.py``'s prepare/finalize, the release's
``PushReferenceBuffer``, ``[2*epn]`` compute views, the collective push). Each
layer runs vLLM's ``FusedMoEKernel`` on the same skewed routing through both;
the outputs are compared with each other and with a dense fp32 MoE, every
filled slot is read back against the expert the plan named, and the pushes
are counted at the copy (bytes per tensor). Control: with the slot pool
poisoned and the push skipped, a layer in which some rank used a slot
gives NaN on some rank, and a layer in which none did stays finite.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
from typing import Any

from tests.support.kernel_check import TOLERANCE, dense_reference, routing, setup_vllm
from tests.support.vllm_moe_model import KernelCase, checkpoint, expert_weights


def push_rank(ctx: Any, case_dict: dict[str, Any]) -> dict[str, Any]:
    stats = tempfile.mkdtemp(prefix="moonep-ep-pstats-")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ["MOONEP_EP_CPU"] = "1"
    os.environ["MOONEP_EP_VLLM_STATS_DIR"] = stats
    try:
        return _push_rank(ctx, KernelCase(**case_dict))
    finally:
        os.environ.pop("MOONEP_EP_MOONEP_API", None)
        shutil.rmtree(stats, ignore_errors=True)


def _load(model: Any, case: KernelCase, rank: int) -> None:
    model.load_weights(list(checkpoint(case, case.seed, rank=rank)))
    for layer in model.layers:
        layer.quant_method.process_weights_after_loading(layer)


def _forward(layer: Any, x: Any, ids: Any, w: Any, E: int) -> Any:
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    return layer.quant_method.moe_kernel.apply(
        hidden_states=x, w1=layer.w13_weight, w2=layer.w2_weight, topk_ids=ids, topk_weights=w,
        activation=MoEActivation.SILU, global_num_experts=E, expert_map=None, apply_router_weight_on_input=False)


def _push_rank(ctx: Any, case: KernelCase) -> dict[str, Any]:
    rank, world = ctx.rank, ctx.world_size
    from moonep_ep.vllm import plugin

    plugin.install()
    import torch

    setup_vllm(rank, world)
    from vllm.distributed import get_ep_group

    from moonep_ep.vllm.manager import ShardedMoonEPAll2AllManager
    from moonep_ep.vllm.experts import overlap
    from moonep_ep.vllm.experts.overlap import TRACE
    from tests.support.vllm_moe_model import build

    ep = get_ep_group()
    E, epn = case.experts, case.experts // world
    models, managers = {}, {}
    for api in ("pull", "push"):
        os.environ["MOONEP_EP_MOONEP_API"] = api
        managers[api] = ShardedMoonEPAll2AllManager(ep.cpu_group, device_group=ep.device_group)
        ep.device_communicator.all2all_manager = managers[api]  # what bind_model and the kernel's handle use
        models[api] = build(case, rank, prefix=api)
        _load(models[api], case, rank)
    out: dict[str, Any] = {"rank": rank, "buffers": {a: m.buffer_choice.cls.__name__ for a, m in managers.items()},
                           "apis": {a: m.buffer_choice.api for a, m in managers.items()}}
    push_layer0 = models["push"].layers[0]
    lay = push_layer0._moonep_weight_layout
    out["push_view_shapes"] = [list(lay.full_gate_weight.shape), list(lay.full_up_weight.shape),
                               list(lay.full_down_weight.shape)]
    out["push_w13_is_compute_view"] = push_layer0.w13_weight.data_ptr() == lay.full_gate_weight.data_ptr()
    out["push_store_slots"] = managers["push"].expert_store.num_slots
    # row g < epn of the compute view is own expert rank*epn + g (read through the store's pages)
    out["own_rows_ok"] = all(
        torch.equal(lay.full_gate_weight[g], expert_weights(case, 0, rank * epn + g)[0])
        and torch.equal(lay.full_down_weight[g], expert_weights(case, 0, rank * epn + g)[2]) for g in range(epn))

    seen: dict[str, Any] = {}
    results = []
    for l in range(case.layers):
        x, ids, w = routing(case, l, rank)
        ref = dense_reference(case, l, x, ids, w)
        outs, row = {}, {"layer": l, "tokens": int(x.shape[0])}
        for api in ("pull", "push"):
            layer = models[api].layers[l]
            kernel = layer.quant_method.moe_kernel
            pf = kernel.prepare_finalize
            prepare = pf.prepare

            def spy(*a: Any, _prepare: Any = prepare, _api: str = api, **k: Any) -> Any:
                got = _prepare(*a, **k)
                seen[_api] = int(got[2].expert_num_tokens.numel())   # the groups of cu_seqlens
                return got

            pf.prepare = spy
            TRACE.events = []
            # a prefill-sized step: the own/slot split this check traces (decode-sized steps run one pass after
            # the wait, checked by slot_fill_check's bf16_decode round)
            sized, overlap.decode_sized = overlap.decode_sized, lambda step_tokens, vllm_config: False
            try:
                outs[api] = _forward(layer, x, ids, w, E)
            finally:
                del pf.prepare
                overlap.decode_sized = sized
            # overlap.apply's steps: own groups, the wait on the prefetch's event, the slot groups
            row[f"{api}_trace"] = [e for e in TRACE.events if e in ("own", "waited", "slots")]
            TRACE.events = None
            row[f"{api}_pf_class"] = type(pf).__name__
            row[f"{api}_groups"] = seen[api]
            buf = pf._buffer
            row[f"{api}_slots"] = [list(s) for s in buf.last_slots]
            if api == "push":
                stats = buf._inner.last_prefetch
                row["push_generation"] = getattr(stats, "api", None)
                row["push_bytes_by_tensor"] = dict(getattr(stats, "bytes_by_tensor", {}) or {})
                row["push_capacity"] = int(buf._inner.S)
                lay = layer._moonep_weight_layout
                row["slot_contents_ok"] = None if not buf.last_slots else all(
                    torch.equal(lay.full_gate_weight[epn + b], expert_weights(case, l, e)[0])
                    and torch.equal(lay.full_up_weight[epn + b], expert_weights(case, l, e)[1])
                    and torch.equal(lay.full_down_weight[epn + b], expert_weights(case, l, e)[2])
                    for b, e, _ in buf.last_slots)
        err = (outs["push"].float() - ref).abs()
        row.update({
            "within_tolerance": bool((err <= TOLERANCE["atol"] + TOLERANCE["rtol"] * ref.abs()).all()),
            "max_abs_err": float(err.max()),
            "push_equals_pull": bool(torch.equal(outs["push"], outs["pull"])),
            "max_abs_diff_push_pull": float((outs["push"].float() - outs["pull"].float()).abs().max()),
        })
        results.append(row)
    out["layers"] = results

    # -- control: poisoned slots, the push skipped on every rank -------------------------------------
    store = managers["push"].expert_store
    control = []
    for l in range(case.layers):
        store.poison_slots()
        layer = models["push"].layers[l]
        pool = layer.quant_method.moe_kernel.prepare_finalize.buffer_pool
        buffers = list(pool._buffers.values())
        for b in buffers:
            b._inner.prefetch_weight = lambda *a, **k: None   # every rank skips it: no collective left waiting
        try:
            x, ids, w = routing(case, l, rank)
            y = _forward(layer, x, ids, w, E)
        finally:
            for b in buffers:
                del b._inner.prefetch_weight
        control.append({"layer": l, "has_nan": bool(torch.isnan(y).any()),
                        "slots_used": bool(layer.quant_method.moe_kernel.prepare_finalize._buffer.last_slots)})
    out["control"] = control
    ep.barrier()
    for api in ("push", "pull"):
        ep.device_communicator.all2all_manager = managers[api]
        managers[api].destroy()
    return out


def verdict(results: list[dict[str, Any]], epn: int) -> list[str]:
    failed = []
    for r in results:
        checks = {
            "the push manager serves PushReferenceBuffer, the pull one ReferenceBuffer":
                r["buffers"] == {"pull": "ReferenceBuffer", "push": "PushReferenceBuffer"},
            "push store has epn slots": r["push_store_slots"] == epn,
            "push views are [2*epn] and w13 is the compute view": r["push_w13_is_compute_view"]
                and [s[0] for s in r["push_view_shapes"]] == [2 * epn] * 3,
            "own rows of the compute view are the own experts": r["own_rows_ok"],
            "push prepare/finalize served the push layers": all(
                l["push_pf_class"] == "MoonEPPushPrepareAndFinalize"
                and l["pull_pf_class"] == "MoonEPPrepareAndFinalize" for l in r["layers"]),
            "push groups 2*epn": all(l["push_groups"] == 2 * epn for l in r["layers"]),
            "the experts computed the own groups, waited on the push's event, then the slot groups":
                all(l["push_trace"] == ["own", "waited", "slots"] for l in r["layers"]),
            "push output within tolerance of the dense fp32 MoE": all(l["within_tolerance"] for l in r["layers"]),
            "push output equals pull output": all(l["push_equals_pull"] for l in r["layers"]),
            "every filled slot holds its expert": all(l["slot_contents_ok"] is not False for l in r["layers"]),
        }
        failed += [f"rank {r['rank']}: {name}" for name, ok in checks.items() if not ok]
    if not any(o != r["rank"] for r in results for l in r["layers"] for _, _, o in l["push_slots"]):
        failed.append("no slot was filled from a remote owner through the push")
    for l in range(len(results[0]["control"])):
        used = any(r["control"][l]["slots_used"] for r in results)
        poisoned = any(r["control"][l]["has_nan"] for r in results)
        if poisoned != used:
            failed.append(f"control layer {l}: slots used {used} but NaN reached an output {poisoned}")
    if not any(r["control"][l]["slots_used"] for r in results for l in range(len(r["control"]))):
        failed.append("the control used no slot, so it shows nothing")
    return failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.support.push_kernel_check")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from moonep_ep.launch import RankFailure, run_ranks

    case = KernelCase(ranks=args.ranks, layers=args.layers)
    try:
        results = run_ranks(push_rank, case.ranks, args=(dataclasses.asdict(case),), timeout_s=400,
                            env={"VLLM_TARGET_DEVICE": "cpu", "MOONEP_EP_CPU": "1"})
    except RankFailure as exc:
        print(json.dumps({"ok": False, "errors": exc.errors}))
        return 1
    failed = verdict(results, case.experts // case.ranks)
    print(json.dumps({"ok": not failed, "failed": failed, "case": dataclasses.asdict(case), "ranks": results},
                     default=str))
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
