"""Kernel tier: vLLM 0.33.0's own MoonEP classes over the sharded layout, on N gloo ranks (CPU).

Run with the interpreter of an environment holding ``vllm==0.33.0`` and
moonep_ep::

    python -m tests.support.kernel_check --ranks 2 --json

Every rank (a spawned process; ``VLLM_TARGET_DEVICE=cpu``, ``MOONEP_EP_CPU=1``):

1. initializes vLLM's distributed state over the rank group (EP group = all
   ranks) and installs the plugin (:func:`moonep_ep.vllm.plugin.install`);
2. builds the plugin's :class:`ShardedMoonEPAll2AllManager` for the EP group;
3. builds ``L`` of vLLM's own MoE layers (``RoutedExperts``, see
   ``vllm_moe_model.py``) twice: once with the plugin's sharded layout
   (expert parameters on ``meta``, the store bound before loading) and once
   with ``MOONEP_EP_LAYOUT=replicated`` (vLLM's all-gather); loads each
   rank's experts through vLLM's ``RoutedExperts.load_weights`` and runs
   vLLM's ``process_weights_after_loading`` (conversion, ``replace_parameter``,
   the kernel); every collective of both loads is recorded, with every
   loaded expert tensor registered for the content check;
4. runs each layer's ``FusedMoEKernel`` (vLLM's ``MoonEPPrepareAndFinalize``
   over the manager's pool + ``MoonEPExperts``) on skewed routing
   (``logits += skew * bias`` with one bias shared by all ranks) for both
   layouts;
5. compares with a dense fp32 torch MoE, checks both layouts give the same
   output, checks every filled slot holds its expert's weights (read from
   the owner), and measures per-rank expert bytes of both layouts.

Also: :func:`bad_config_rank` for the clear-message-no-hang cases.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing.util
import os
import shutil
import sys
import tempfile
from typing import Any

from tests.support.vllm_moe_model import KernelCase, expert_weights

#: Pass criterion against the dense fp32 reference: |out - ref| <= atol + rtol*|ref| elementwise.
#: The kernel rounds to bf16 after each grouped GEMM, the SiLU product and the route weight.
TOLERANCE = {"atol": 2e-2, "rtol": 2e-2}


def routing(case: KernelCase, layer: int, rank: int) -> tuple[Any, Any, Any]:
    """Tokens ``[M, H]`` bf16 and skewed top-k (ids int32, weights fp32, renormalized)."""
    import torch

    M = case.tokens - 9 * rank
    g_tok = torch.Generator().manual_seed(case.seed * 7919 + layer * 101 + rank)
    x = torch.randn(M, case.hidden, generator=g_tok).to(torch.bfloat16)
    g_shared = torch.Generator().manual_seed(case.seed * 7919 + layer * 101 + 99_991)
    router = torch.randn(case.experts, case.hidden, generator=g_shared) / case.hidden ** 0.5
    bias = torch.randn(1, case.experts, generator=g_shared)
    logits = x.float() @ router.T + case.skew * bias
    probs = torch.softmax(logits, dim=-1)
    w, ids = torch.topk(probs, case.top_k, dim=-1)
    w = w / w.sum(dim=-1, keepdim=True)
    return x, ids.to(torch.int32), w.to(torch.float32)


def dense_reference(case: KernelCase, layer: int, x: Any, ids: Any, w: Any) -> Any:
    """fp32 MoE straight from the dense weights: no dispatch, no padding, no slots."""
    import torch
    import torch.nn.functional as F

    out = torch.zeros(x.shape[0], case.hidden, dtype=torch.float32)
    xf = x.float()
    for e in torch.unique(ids).tolist():
        gate, up, down = (t.float() for t in expert_weights(case, layer, e))
        rows, ks = torch.nonzero(ids == e, as_tuple=True)
        h = F.silu(xf[rows] @ gate.T) * (xf[rows] @ up.T)
        out.index_add_(0, rows, (h @ down.T) * w[rows, ks, None])
    return out


_KEEP: list[Any] = []


def setup_vllm(rank: int, world: int) -> Any:
    from vllm.config import CompilationConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    vcfg = VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=world, enable_expert_parallel=True),
                      compilation_config=CompilationConfig())
    ctx = set_current_vllm_config(vcfg)
    ctx.__enter__()
    _KEEP.append(ctx)  # a collected context generator would restore the previous (no) config
    init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                 distributed_init_method="env://")
    _record_created_rings()
    initialize_model_parallel(tensor_model_parallel_size=world)
    # a rank is a fork-server child, which skips atexit; multiprocessing runs its own exit finalizers
    multiprocessing.util.Finalize(None, unlink_created_rings, exitpriority=10)
    return vcfg


#: The /dev/shm segments of vLLM's message queues this rank created (see unlink_created_rings).
_CREATED_RINGS: list[Any] = []


def _record_created_rings() -> None:
    from vllm.distributed.device_communicators import shm_broadcast

    ring_init = shm_broadcast.ShmRingBuffer.__init__
    if getattr(ring_init, "_records_creator", False):
        return

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        ring_init(self, *args, **kwargs)
        if self.is_creator:
            _CREATED_RINGS.append(self.shared_memory)

    init._records_creator = True  # type: ignore[attr-defined]
    shm_broadcast.ShmRingBuffer.__init__ = init


def unlink_created_rings() -> None:
    """vLLM's TP group holds a /dev/shm ring buffer that its creator unlinks in the ring's ``__del__``, after
    closing it; with tensors still viewing the mapping the close raises and the unlink never runs. The segment
    then waits for Python's resource tracker, which removes it only after the whole check has exited ("1 leaked
    shared_memory objects"): under make test's two workers that window is a /dev/shm entry no process holds
    while make serve scans for leaks. At the rank's exit, unlink what this rank created."""
    while _CREATED_RINGS:
        segment = _CREATED_RINGS.pop()
        try:
            segment.unlink()
        except FileNotFoundError:
            pass


def kernel_rank(ctx: Any, case_dict: dict[str, Any]) -> dict[str, Any]:
    stats = tempfile.mkdtemp(prefix="moonep-ep-kstats-")
    try:
        return _kernel_rank(ctx, case_dict, stats)
    finally:
        shutil.rmtree(stats, ignore_errors=True)


def _kernel_rank(ctx: Any, case_dict: dict[str, Any], stats_dir: str) -> dict[str, Any]:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ["MOONEP_EP_CPU"] = "1"
    os.environ["MOONEP_EP_VLLM_STATS_DIR"] = stats_dir  # turns on the per-prefetch slot records
    case = KernelCase(**case_dict)
    rank, world = ctx.rank, ctx.world_size
    from moonep_ep.vllm import plugin

    plugin.install()
    import torch

    setup_vllm(rank, world)
    from vllm.distributed import get_ep_group
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.prepare_finalize import moonep as vllm_moonep

    from moonep_ep.memory.accounting import own_physical_bytes
    from moonep_ep.ops.moonep.instrument import CollectiveRecorder
    from tests.support.vllm_moe_model import build, checkpoint
    from moonep_ep.vllm.manager import ShardedMoonEPAll2AllManager
    from moonep_ep.vllm.observe.stats import STATS

    out: dict[str, Any] = {"rank": rank, "plugin": plugin.state()["patched"]}
    ep = get_ep_group()
    out["ep_size"] = ep.world_size
    manager = ShardedMoonEPAll2AllManager(ep.cpu_group, device_group=ep.device_group)
    ep.device_communicator.all2all_manager = manager
    mem_before = own_physical_bytes(rank)  # memfds, or the CUDA emulator's device memory

    # -- load and convert: sharded (plugin) and replicated (vLLM's all-gather), vLLM's own layers ----
    def load(model: Any, recorder: Any) -> None:
        weights = list(checkpoint(case, case.seed, rank=rank))
        for _, _, t in weights:
            recorder.register(t)  # a collective carrying these bytes (or aliasing these tensors) is counted
        with recorder:
            model.load_weights(weights)
            for layer in model.layers:
                layer.quant_method.process_weights_after_loading(layer)

    rec_sharded, rec_repl = CollectiveRecorder(), CollectiveRecorder()
    sharded = build(case, rank)
    out["sharded_param_devices"] = sorted({p.device.type for l in sharded.layers for p in (l.w13_weight, l.w2_weight)})
    load(sharded, rec_sharded)
    os.environ["MOONEP_EP_LAYOUT"] = "replicated"
    try:
        replicated = build(case, rank, prefix="replicated")
        load(replicated, rec_repl)
    finally:
        os.environ.pop("MOONEP_EP_LAYOUT", None)
    store = manager.expert_store
    out["store"] = store.describe()
    out["store_ready"] = store.ready
    out["replicated_is_vllm_path"] = all(getattr(l, "_moonep_ep_binding", None) is None for l in replicated.layers)
    out["load_weight_bytes_sharded"] = rec_sharded.weight_bytes
    out["load_collectives_sharded"] = rec_sharded.by_op()
    out["load_weight_bytes_replicated"] = rec_repl.weight_bytes
    out["load_collectives_replicated"] = rec_repl.by_op()
    out["vllm_gather_calls"] = STATS.data["load"]["vllm_gather_calls"]
    layout0 = sharded.layers[0]._moonep_weight_layout
    out["layout_type"] = type(layout0).__qualname__
    out["layout_is_vllm_class"] = isinstance(layout0, vllm_moonep.MoonEPExpertWeightLayout)
    out["w13_is_gate_view"] = sharded.layers[0].w13_weight.data_ptr() == layout0.full_gate_weight.data_ptr()
    E = case.experts
    out["view_shapes"] = [list(layout0.full_gate_weight.shape), list(layout0.full_up_weight.shape),
                          list(layout0.full_down_weight.shape)]
    # Row e of every view is the owner's expert, for all e (peer rows read through the mapping).
    bad_rows = 0
    for l, layer in enumerate(sharded.layers):
        lay = layer._moonep_weight_layout
        for e in range(E):
            gate, up, down = expert_weights(case, l, e)
            bad_rows += int(not (torch.equal(lay.full_gate_weight[e], gate) and torch.equal(lay.full_up_weight[e], up)
                                 and torch.equal(lay.full_down_weight[e], down)))
    out["bad_rows"] = bad_rows
    views = [layer._moonep_weight_layout for layer in sharded.layers]
    out["slot_pool_shared_by_layers"] = (
        case.layers < 2 or views[0].full_up_weight[E:].data_ptr() != views[1].full_up_weight[E:].data_ptr())
    # … distinct views of one physical pool: a write through layer 0's slot view is seen through layer 1's.
    if case.layers >= 2:
        s0, s1 = views[0].full_down_weight[E], views[1].full_down_weight[E]
        s0.fill_(rank + 0.5)
        out["slot_pool_shared_by_layers"] = out["slot_pool_shared_by_layers"] and bool(s1.eq(rank + 0.5).all())
        s0.zero_()
    ep.barrier()

    # -- forward through vLLM's FusedMoEKernel(MoonEPPrepareAndFinalize, MoonEPExperts) ----------
    results = []
    for l in range(case.layers):
        x, ids, w = routing(case, l, rank)
        ref = dense_reference(case, l, x, ids, w)
        outs = {}
        for kind, layer in (("sharded", sharded.layers[l]), ("replicated", replicated.layers[l])):
            kernel = layer.quant_method.moe_kernel
            y = kernel.apply(hidden_states=x, w1=layer.w13_weight, w2=layer.w2_weight, topk_ids=ids,
                             topk_weights=w, activation=MoEActivation.SILU, global_num_experts=E, expert_map=None,
                             apply_router_weight_on_input=False)
            outs[kind] = y
            if kind == "sharded":
                pf = kernel.prepare_finalize
                out.setdefault("pf_class", type(pf).__qualname__)
                experts = kernel.fused_experts
                out.setdefault("experts_class", f"{type(experts).__module__}.{type(experts).__qualname__}")
                sources = list(pf._buffer.last_slots)
                lay = layer._moonep_weight_layout
                # None when the layer filled no slot: "all of nothing" would read as a passed check.
                slot_ok = None if not sources else all(
                    torch.equal(lay.full_gate_weight[E + b], expert_weights(case, l, e)[0])
                    and torch.equal(lay.full_down_weight[E + b], expert_weights(case, l, e)[2])
                    for b, e, _ in sources)
        err = (outs["sharded"].float() - ref).abs()
        bound = TOLERANCE["atol"] + TOLERANCE["rtol"] * ref.abs()
        results.append({
            "layer": l, "tokens": int(x.shape[0]),
            "max_abs_err": float(err.max()), "ref_max_abs": float(ref.abs().max()),
            "within_tolerance": bool((err <= bound).all()),
            "sharded_equals_replicated": bool(torch.equal(outs["sharded"], outs["replicated"])),
            "max_abs_diff_sharded_replicated": float((outs["sharded"].float() - outs["replicated"].float())
                                                     .abs().max()),
            "slots": [[b, e, o] for b, e, o in sources],
            "remote_slots": sum(1 for _, _, o in sources if o != rank),
            "slot_contents_ok": slot_ok,
            "tokens_per_expert": torch.bincount(ids.flatten().long(), minlength=E).tolist(),
        })
    out["layers"] = results
    out["remote_prefetched"] = STATS.data["forward"]["remote_prefetched"]
    # -- bytes per rank -----------------------------------------------------------------------------
    out["sharded_bytes_measured_os"] = own_physical_bytes(rank) - mem_before
    out["store_driver"] = store.driver.name
    out["store_driver_emulated"] = bool(getattr(store.driver, "emulated", False))
    out["sharded_bytes"] = store.store.physical_bytes()["total_bytes"]
    out["replicated_bytes_measured"] = sum(
        t.untyped_storage().nbytes() for layer in replicated.layers for t in
        (layer._moonep_weight_layout.full_gate_weight, layer._moonep_weight_layout.full_up_weight,
         layer._moonep_weight_layout.full_down_weight))
    out["replicated_bytes_formula"] = store.store.replicated_bytes()
    ep.barrier()
    manager.destroy()
    out["store_released"] = manager.expert_store is None and store.closed
    return out


def bad_config_rank(ctx: Any, case: str) -> str:
    """One misconfiguration on every rank: returns the error text (or 'no error')."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import torch

    from moonep_ep.errors import MoonEPError
    from moonep_ep.vllm.store.sharded import ModelExpertStore

    kwargs: dict[str, Any] = dict(layer_names=["a", "b"], num_experts=8, hidden=256, intermediate=128, num_slots=4,
                                  group=None, device=torch.device("cpu"))
    if case == "experts_not_divisible":
        kwargs["num_experts"] = 6 if ctx.world_size == 4 else 7
    elif case == "hidden_not_128":
        kwargs["hidden"] = 200
    elif case == "intermediate_not_128":
        kwargs["intermediate"] = 96
    elif case == "ranks_disagree":
        kwargs["layer_names"] = ["a", "b", "c"][: 2 + (ctx.rank % 2)]
    elif case == "nonlinear_placement":
        kwargs["local_expert_ids"] = [list(range(ctx.rank, 8, ctx.world_size))] * 2  # round robin
    elif case == "fp16":
        kwargs["dtype"] = torch.float16
    elif case == "heterogeneous_layers":
        kwargs["layer_shapes"] = {((4, 256, 256), (4, 256, 128)), ((4, 512, 256), (4, 256, 256))}
    try:
        store = ModelExpertStore(**kwargs)
    except MoonEPError as exc:
        return str(exc)
    store.close()
    return "no error"


BAD_CASES = ("experts_not_divisible", "hidden_not_128", "intermediate_not_128", "ranks_disagree",
             "nonlinear_placement", "fp16", "heterogeneous_layers")


def bad_configs_rank(ctx: Any) -> dict[str, str]:
    """Every misconfiguration in turn, on the same ranks (one process start for all); then backend
    selection with ``MOONEP_EP_BUFFER=moonep`` on CPU (the real library cannot serve)."""
    out = {case: bad_config_rank(ctx, case) for case in BAD_CASES}
    os.environ["MOONEP_EP_CPU"] = "1"
    from moonep_ep.errors import MoonEPError
    from moonep_ep.vllm import plugin

    plugin.install()
    setup_vllm(ctx.rank, ctx.world_size)
    from vllm.distributed import get_ep_group

    from moonep_ep.vllm.manager import ShardedMoonEPAll2AllManager

    ep = get_ep_group()
    os.environ["MOONEP_EP_BUFFER"] = "moonep"
    try:
        ShardedMoonEPAll2AllManager(ep.cpu_group, device_group=ep.device_group)
        out["buffer_moonep_on_cpu"] = "no error"
    except MoonEPError as exc:
        out["buffer_moonep_on_cpu"] = str(exc)
    finally:
        os.environ.pop("MOONEP_EP_BUFFER", None)
    return out


def plugin_checks() -> dict[str, Any]:
    """Single process: install twice (idempotent), version verdict, other backends untouched."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from moonep_ep.vllm import compat, hooks, plugin

    first = plugin.install()
    second = plugin.install()
    import torch
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as method
    from vllm.model_executor.layers.fused_moe.oracle import unquantized as oracle

    wrapped = oracle.convert_to_unquantized_kernel_format
    w13 = torch.randn(2, 128, 256).to(torch.bfloat16).transpose(1, 2)  # non-contiguous on purpose
    w2 = torch.randn(2, 128, 128).to(torch.bfloat16)
    a = wrapped(oracle.UnquantizedMoeBackend.TRITON, None, w13, w2, None)
    b = wrapped.__wrapped__(oracle.UnquantizedMoeBackend.TRITON, None, w13, w2, None)
    return {
        "compat": dataclasses.asdict(compat.check_vllm()),
        "first": first, "second": second, "after_import": plugin.state(),
        "wrapped_in_oracle": hooks.is_wrapped(wrapped),
        "wrapped_in_method": hooks.is_wrapped(method.convert_to_unquantized_kernel_format),
        "wrapped_once": hooks.is_wrapped(wrapped.__wrapped__) is False,
        "other_backend_untouched": all(torch.equal(x, y) for x, y in zip(a, b)),
    }


def run(case: KernelCase) -> list[dict[str, Any]]:
    from moonep_ep.launch import run_ranks

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    return run_ranks(kernel_rank, case.ranks, args=(dataclasses.asdict(case),), timeout_s=600,
                     env={"VLLM_TARGET_DEVICE": "cpu", "MOONEP_EP_CPU": "1"})


def verdict(results: list[dict[str, Any]]) -> list[str]:
    """Every failed check of a kernel-tier run, by rank ("ok" is true only when this is empty)."""
    failed = []
    for r in results:
        checks = {
            "every layer within tolerance of the dense fp32 MoE": all(l["within_tolerance"] for l in r["layers"]),
            "sharded output equals vLLM's replicated layout": all(l["sharded_equals_replicated"] for l in r["layers"]),
            "every filled slot holds its expert": all(l["slot_contents_ok"] is not False for l in r["layers"]),
            "row e of every view is the owner's expert e": r["bad_rows"] == 0,
            "no expert byte in a load collective (sharded)": r["load_weight_bytes_sharded"] == 0,
            "the detector sees vLLM's all-gather (replicated)": r["load_weight_bytes_replicated"] > 0,
            "one handle exchange for the whole model": r["store"]["collective_rounds"]["handle_exchange"] == 1,
            "vLLM's expert parameters held no memory (meta)": r["sharded_param_devices"] == ["meta"],
            "the replicated layers took vLLM's all-gather path": bool(r["replicated_is_vllm_path"]),
            "store ready before the forward and released after": bool(r["store_ready"] and r["store_released"]),
            "OS-measured bytes equal the store's": r["sharded_bytes_measured_os"] == r["sharded_bytes"],
            "fewer bytes than the replicated layout": r["sharded_bytes_measured_os"] < r["replicated_bytes_measured"],
        }
        failed += [f"rank {r['rank']}: {name}" for name, ok in checks.items() if not ok]
    if not sum(r["remote_prefetched"] for r in results):
        failed.append("no rank prefetched an expert from a remote owner (skewed routing should make them)")
    if not any(l["slot_contents_ok"] for r in results for l in r["layers"]):
        failed.append("no layer of any rank filled a slot, so no slot's contents were checked")
    return failed


def format_table(results: list[dict[str, Any]]) -> str:
    lines = [f"per-rank expert bytes, {results[0]['store']['layers']} MoE layers, E={results[0]['store']['experts']}, "
             f"B={results[0]['store']['slots']}:",
             f"  {'rank':>4}  {'sharded (OS-measured)':>22}  {'replicated [E+B] (measured)':>28}  {'ratio':>6}"]
    for r in results:
        ratio = r["replicated_bytes_measured"] / max(1, r["sharded_bytes_measured_os"])
        lines.append(f"  {r['rank']:>4}  {r['sharded_bytes_measured_os']:>22,}  {r['replicated_bytes_measured']:>28,}"
                     f"  {ratio:>5.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.support.kernel_check")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--skew", type=float, default=8.0)
    p.add_argument("--bad", default=None, help=f"run one misconfiguration case instead ({', '.join(BAD_CASES)}, all)")
    p.add_argument("--plugin-checks", action="store_true", help="single-process plugin checks instead")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from moonep_ep.launch import RankFailure, run_ranks

    if args.plugin_checks:
        print(json.dumps(plugin_checks(), default=str))
        return 0
    if args.bad:
        fn, fargs = (bad_configs_rank, ()) if args.bad == "all" else (bad_config_rank, (args.bad,))
        try:
            msgs = run_ranks(fn, args.ranks, args=fargs, timeout_s=180, env={"VLLM_TARGET_DEVICE": "cpu"})
        except RankFailure as exc:
            print(json.dumps({"ok": False, "errors": exc.errors}))
            return 1
        # Every case must have raised (on every rank) with a fix.
        missing = [f"rank {r}: {case}" for r, m in enumerate(msgs) for case, text in
                   (m.items() if isinstance(m, dict) else [(args.bad, m)]) if "Fix:" not in text]
        print(json.dumps({"ok": not missing, "failed": missing, "messages": msgs}))
        return 0 if not missing else 1
    case = KernelCase(ranks=args.ranks, experts=args.experts, layers=args.layers, skew=args.skew)
    try:
        results = run(case)
    except RankFailure as exc:
        print(json.dumps({"ok": False, "errors": exc.errors}) if args.json else str(exc))
        return 1
    print(format_table(results), file=sys.stderr if args.json else sys.stdout)
    failed = verdict(results)
    if args.json:
        print(json.dumps({"ok": not failed, "failed": failed, "case": dataclasses.asdict(case), "ranks": results},
                         default=str))
    elif failed:
        print("FAILED:\n  " + "\n  ".join(failed))
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
