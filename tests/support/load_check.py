"""Kernel tier for loading: vLLM 0.33.0's own MoE layer, loader, reload and kernel over the sharded store (CPU).

Run with the interpreter of an environment holding ``vllm==0.33.0``::

    python -m tests.support.load_check --ranks 2 --json

Every rank (a spawned process; ``VLLM_TARGET_DEVICE=cpu``, ``MOONEP_EP_CPU=1``,
stats on) builds a small model of ``L`` real ``RoutedExperts`` layers —
vLLM's constructor, its ``UnquantizedFusedMoEMethod`` with the MOONEP backend
and the plugin's ``create_weights`` — then:

1. **zero-copy load** of checkpoint A through vLLM's ``RoutedExperts.load_weights``
   (each rank is fed only its own experts, in its own order — rank 1 in
   reverse — as vLLM's EP weight filter and threaded loaders may do: the
   loader holds no collective); the expert parameters are on ``meta``;
   the peak of expert bytes is measured (memfd sizes + resident tensors);
2. vLLM's ``process_weights_after_loading`` (real ``_setup_kernel``:
   conversion, ``replace_parameter``, ``FusedMoEKernel`` over
   ``MoonEPPrepareAndFinalize`` + ``MoonEPExperts``) and a forward of every
   layer against a dense fp32 reference on A;
3. **stale slots**: the slot pool is poisoned and the next forward still
   matches (every prefetch refills the slots it uses); positive control:
   with the prefetch disabled, poisoned slots reach the output;
4. **in-place update** to checkpoint B with vLLM's own ``reload_weights``
   (layerwise reload, iterator path): every pointer unchanged, forward
   matches the dense reference on B, no slot holds an expert after the pass;
5. **wrong shape**: an update whose experts have another shape is refused on
   every rank with one message, no row changes, pointers unchanged, and the
   forward still matches B; the disk pre-check refuses the same shapes from a
   safetensors checkpoint's headers;
6. **skipped rows**: a first load that misses experts fails on every rank
   naming them; **a model built later** (a draft's layers) gets its own store
   (its own single handle exchange) and the first store keeps serving;
7. **sleep mode** with the sharded layout is refused at backend selection,
   on every rank, with the alternative named.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from typing import Any

from tests.support.kernel_check import TOLERANCE, setup_vllm, dense_reference, routing
from tests.support.vllm_moe_model import SEED_A, SEED_B, KernelCase, build, checkpoint, expert_weights

def _forward(case: KernelCase, model: Any, rank: int, weight_seed: int) -> list[dict[str, Any]]:
    import torch
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    out = []
    for l, layer in enumerate(model.layers):
        x, ids, w = routing(case, l, rank)
        ref = dense_reference(KernelCase(**{**case.__dict__, "seed": weight_seed}), l, x, ids, w)
        y = layer.quant_method.moe_kernel.apply(
            hidden_states=x, w1=layer.w13_weight, w2=layer.w2_weight, topk_ids=ids, topk_weights=w,
            activation=MoEActivation.SILU, global_num_experts=case.experts, expert_map=None,
            apply_router_weight_on_input=False)
        err = (y.float() - ref).abs()
        buffer = layer.quant_method.moe_kernel.prepare_finalize._buffer
        out.append({"layer": l, "max_abs_err": float(err.nan_to_num(float("inf")).max()),
                    "slots_used": len(buffer.last_slots),
                    "has_nan": bool(torch.isnan(y).any()),
                    "within_tolerance": bool((err <= TOLERANCE["atol"] + TOLERANCE["rtol"] * ref.abs()).all())})
    return out


def _pointers(model: Any) -> list[dict[str, int]]:
    out = []
    for layer in model.layers:
        lay = layer._moonep_weight_layout
        out.append({"w13_weight": layer.w13_weight.data_ptr(), "w2_weight": layer.w2_weight.data_ptr(),
                    "w13_param_id": id(layer.w13_weight), "w2_param_id": id(layer.w2_weight),
                    "gate": lay.full_gate_weight.data_ptr(), "up": lay.full_up_weight.data_ptr(),
                    "down": lay.full_down_weight.data_ptr()})
    return out


def _rows_equal(case: KernelCase, model: Any, seed: int) -> bool:
    import torch

    c = KernelCase(**{**case.__dict__, "seed": seed})
    for l, layer in enumerate(model.layers):
        lay = layer._moonep_weight_layout
        for e in range(case.experts):
            gate, up, down = expert_weights(c, l, e)
            if not (torch.equal(lay.full_gate_weight[e], gate) and torch.equal(lay.full_up_weight[e], up)
                    and torch.equal(lay.full_down_weight[e], down)):
                return False
    return True


def error_of(fn: Any) -> str:
    """``"Type: message"`` of what ``fn()`` raised, or ``"no error"`` (the checks compare the text)."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def load_rank(ctx: Any, case_dict: dict[str, Any], work_dir: str) -> dict[str, Any]:
    """One rank; its stats and the checkpoints it writes go under ``work_dir/rank<r>`` (``run`` removes it)."""
    work = os.path.join(work_dir, f"rank{ctx.rank}")
    os.makedirs(os.path.join(work, "stats"))
    return _load_rank(ctx, KernelCase(**case_dict), work)


def _load_rank(ctx: Any, case: KernelCase, work: str) -> dict[str, Any]:
    os.environ["MOONEP_EP_VLLM_STATS_DIR"] = os.path.join(work, "stats")
    rank = ctx.rank
    from moonep_ep.vllm import plugin

    plugin.install()
    import torch

    vcfg = setup_vllm(rank, ctx.world_size)
    from vllm.distributed import get_ep_group
    from vllm.model_executor.model_loader.reload import inplace

    from moonep_ep.vllm.store import loading
    from moonep_ep.vllm.manager import ShardedMoonEPAll2AllManager
    from moonep_ep.vllm.observe.stats import STATS

    ep = get_ep_group()
    manager = ShardedMoonEPAll2AllManager(ep.cpu_group, device_group=ep.device_group)
    ep.device_communicator.all2all_manager = manager
    out: dict[str, Any] = {"rank": rank, "patched": plugin.state()["patched"]}

    # 1. zero-copy load of A: only this rank's experts, rank 1 in reverse order.
    model = build(case, rank)
    store = model.layers[0]._moonep_ep_binding[0]
    out["param_devices"] = sorted({str(p.device) for layer in model.layers for p in
                                   (layer.w13_weight, layer.w2_weight)})
    model.load_weights(checkpoint(case, SEED_A, rank=rank, reverse=rank == 1))
    out["store"] = store.describe()
    out["load_memory"] = dict(STATS.data.get("load_memory") or {})
    out["load_collectives"] = STATS.data["load"]["collectives"]
    out["load_collective_weight_bytes"] = STATS.data["load"]["collective_weight_bytes"]
    out["expert_tensors_loaded"] = STATS.data["load"]["expert_tensors_loaded"]

    # 2. vLLM's process_weights_after_loading and a forward on A.
    for layer in model.layers:
        layer.quant_method.process_weights_after_loading(layer)
    out["rows_are_a"] = _rows_equal(case, model, SEED_A)
    out["forward_a"] = _forward(case, model, rank, SEED_A)
    ptr_a = _pointers(model)
    out["kernel_classes"] = sorted({f"{type(l.quant_method.moe_kernel.prepare_finalize).__name__}+"
                                    f"{type(l.quant_method.moe_kernel.fused_experts).__name__}" for l in model.layers})

    # 3. stale slots: poisoned slots are refilled; with the prefetch disabled they reach the output.
    store.poison_slots()
    out["forward_after_poison"] = _forward(case, model, rank, SEED_A)
    buffers = list({id(b): b for l in model.layers
                    for b in l.quant_method.moe_kernel.prepare_finalize.buffer_pool._buffers.values()}.values())
    saved = [(b, b._inner.prefetch_weight) for b in buffers]
    for b, _ in saved:
        b._inner.prefetch_weight = lambda *a, **k: None
    store.poison_slots()
    out["forward_without_prefetch"] = _forward(case, model, rank, SEED_A)
    for b, fn in saved:
        b._inner.prefetch_weight = fn

    # 4. in-place update to B through vLLM's reload_weights (layerwise, iterator).
    reload_cfg = _ReloadConfig(vcfg)
    inplace.reload_weights(reload_cfg, model, weights_iterator=checkpoint(case, SEED_B), weights_path=None,
                           is_checkpoint_format=True)
    out["pointers_unchanged_after_update"] = _pointers(model) == ptr_a
    out["rows_are_b"] = _rows_equal(case, model, SEED_B)
    out["slots_poisoned_after_update"] = bool(torch.isnan(store.store.pull_view(0, "gate")[case.experts:]).all())
    out["forward_b"] = _forward(case, model, rank, SEED_B)
    out["update_memory"] = dict(STATS.data.get("update_memory") or {})

    # 5. wrong shapes: the iterator path and the disk pre-check.
    out["wrong_shape_error"] = error_of(lambda: inplace.reload_weights(
        reload_cfg, model, weights_iterator=checkpoint(case, SEED_B, intermediate=case.intermediate // 2),
        weights_path=None, is_checkpoint_format=True))
    out["rows_are_b_after_wrong_shape"] = _rows_equal(case, model, SEED_B)
    out["pointers_unchanged_after_wrong_shape"] = _pointers(model) == ptr_a
    out["forward_after_wrong_shape"] = _forward(case, model, rank, SEED_B)
    out["precheck_error"] = error_of(lambda: loading.precheck_reload(
        model, _write_checkpoint(case, os.path.join(work, "wrong"), case.intermediate // 2)))
    out["precheck_same_shape"] = error_of(lambda: loading.precheck_reload(
        model, _write_checkpoint(case, os.path.join(work, "same"), None)))
    out["passes"] = list(store.settled)

    # 6. a first load that skips a layer's experts; a model built later gets its own store.
    late = build(case, rank, prefix="draft")
    out["skipped_layer_error"] = error_of(lambda: late.load_weights(checkpoint(case, SEED_A, rank=rank,
                                                                                 skip_layer=case.layers - 1)))
    draft = build(case, rank, prefix="draft2")
    draft.load_weights(checkpoint(case, SEED_B, rank=rank))
    for layer in draft.layers:
        layer.quant_method.process_weights_after_loading(layer)
    out["late_model_stores"] = len(manager.expert_stores)
    out["late_store_rounds"] = draft.layers[0]._moonep_ep_binding[0].store.symm.comm.rounds["handle_exchange"]
    out["late_forward"] = _forward(case, draft, rank, SEED_B)
    out["first_model_forward_after_late"] = _forward(case, model, rank, SEED_B)

    # 7. sleep mode with the sharded layout: refused at backend selection, on every rank.
    out["sleep_mode_error"] = error_of(lambda: _manager_with_sleep_mode(ep))
    ep.barrier()
    manager.destroy()
    out["stores_closed"] = all(s.closed for s in (store, draft.layers[0]._moonep_ep_binding[0]))
    return out


class _ReloadConfig:
    """The parts of a VllmConfig ``reload_weights`` reads (the kernel tier has no model config)."""

    def __init__(self, vcfg: Any) -> None:
        import torch
        from types import SimpleNamespace

        self.model_config = SimpleNamespace(quantization=None, dtype=torch.bfloat16, model="(iterator)")
        self.load_config = vcfg.load_config
        self.lora_config = None


def _manager_with_sleep_mode(ep: Any) -> None:
    from types import SimpleNamespace

    import vllm.config as vllm_config_module

    from moonep_ep.vllm.manager import ShardedMoonEPAll2AllManager

    saved = vllm_config_module.get_current_vllm_config_or_none
    vllm_config_module.get_current_vllm_config_or_none = lambda: SimpleNamespace(
        model_config=SimpleNamespace(enable_sleep_mode=True))
    try:
        ShardedMoonEPAll2AllManager(ep.cpu_group, device_group=ep.device_group)
    finally:
        vllm_config_module.get_current_vllm_config_or_none = saved


def _write_checkpoint(case: KernelCase, path: str, intermediate: int | None) -> str:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    tensors = {f"model.layers.{l}.mlp.experts.{name}": t.contiguous()
               for l, name, t in checkpoint(case, SEED_B, intermediate=intermediate)}
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return path


def verdict(results: list[dict[str, Any]], layers: int) -> list[str]:
    """Every failed check of a load-check run, by rank ("ok" is true only when this is empty)."""
    failed = []
    for r in results:
        store, mem, upd = r["store"], r["load_memory"], r["update_memory"]
        final, one_layer = store["physical_bytes"]["total_bytes"], store["one_layer_local_bytes"]
        fine = lambda key: all(l["within_tolerance"] and not l["has_nan"] for l in r[key])  # noqa: E731
        checks = {
            "expert parameters on meta (no local copy)": r["param_devices"] == ["meta"],
            "load peak = the store (zero-copy)": mem.get("peak_expert_bytes") == final,
            "no expert byte in a load collective": r["load_collective_weight_bytes"] == 0,
            "one handle exchange for the model": store["collective_rounds"]["handle_exchange"] == 1,
            "forward on A within tolerance": r["rows_are_a"] and fine("forward_a"),
            "poisoned slots refilled by the next prefetch": fine("forward_after_poison"),
            "update in place: same pointers, rows of B, slots poisoned": bool(
                r["pointers_unchanged_after_update"] and r["rows_are_b"] and r["slots_poisoned_after_update"]),
            "forward on B within tolerance": fine("forward_b"),
            "update peak within the store + one layer": final <= upd.get("peak_expert_bytes", -1) <= final + one_layer,
            "wrong-shape update refused on every rank": "rank(s) [0, 1]" in r["wrong_shape_error"],
            "B still serves after the refusal": bool(r["rows_are_b_after_wrong_shape"]
                                                     and r["pointers_unchanged_after_wrong_shape"]
                                                     and fine("forward_after_wrong_shape")),
            "disk pre-check refuses another shape, accepts the same": "reload refused" in r["precheck_error"]
                                                                      and r["precheck_same_shape"] == "no error",
            "missing rows named on every rank": "rank(s) [0, 1]" in r["skipped_layer_error"],
            "a model built later: own store, both serve": bool(
                r["late_store_rounds"] == 1 and fine("late_forward") and fine("first_model_forward_after_late")),
            "sleep mode refused on every rank": "rank(s) [0, 1]" in r["sleep_mode_error"],
            "stores closed": bool(r["stores_closed"]),
        }
        failed += [f"rank {r['rank']}: {name}" for name, ok in checks.items() if not ok]
    for l in range(layers):  # the stale-slot control must bite exactly where a slot was used
        used = any(r["forward_without_prefetch"][l]["slots_used"] for r in results)
        if used != any(r["forward_without_prefetch"][l]["has_nan"] for r in results):
            failed.append(f"layer {l}: disabling the prefetch {'did not' if used else 'did'} poison the output")
    if not any(l["slots_used"] for r in results for l in r["forward_after_poison"]):
        failed.append("no rank used a slot: the stale-slot check read nothing")
    return failed


def run(case: KernelCase) -> list[dict[str, Any]]:
    from moonep_ep.launch import run_ranks

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    work_dir = tempfile.mkdtemp(prefix="moonep-ep-lc-")  # this run's alone: removed even if a rank died
    try:
        return run_ranks(load_rank, case.ranks, args=(case.__dict__, work_dir), timeout_s=600,
                         env={"VLLM_TARGET_DEVICE": "cpu", "MOONEP_EP_CPU": "1"})
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.support.load_check")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from moonep_ep.launch import RankFailure

    case = KernelCase(ranks=args.ranks, layers=args.layers)
    try:
        results = run(case)
    except RankFailure as exc:
        print(json.dumps({"ok": False, "errors": exc.errors}) if args.json else str(exc))
        return 1
    failed = verdict(results, case.layers)
    doc = {"ok": not failed, "failed": failed, "case": case.__dict__, "ranks": results}
    print(json.dumps(doc, default=str) if args.json else json.dumps(doc, indent=1, default=str))
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
