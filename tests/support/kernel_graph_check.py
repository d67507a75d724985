"""Kernel tier of issue 46: vLLM 0.33.0's ``FusedMoEKernel`` captured and replayed by the capture-and-replay
emulator (``src/moonep_ep/testing/cuda_capture.py``), N gloo ranks, CPU.

Run in the ``vllm==0.33.0`` environment::

    python -m tests.support.kernel_graph_check --ranks 2 --json [--cases bf16/pull/silu,...] [--sizes 1,8,32]

Every rank (``VLLM_TARGET_DEVICE=cpu``, ``MOONEP_EP_CPU=1``, CPU slot copies deferred) builds, per case
``format/api/activation``, two MoE layers that share one slot pool over the plugin's sharded store:

* ``bf16``: vLLM's own ``RoutedExperts`` (``vllm_moe_model.py``) under its ``MoonEPPrepareAndFinalize`` (pull)
  or the plugin's push prepare/finalize, and ``MoonEPExperts.apply`` as the plugin patches it;
* ``mxfp4``: a store of the format bound by the plugin's ``bind_quantized_layer``
  (``slot_fill_check.quantized_layers``), the GPU experts (``MoonEPTritonQuantizedExperts``: the Triton kernels
  a GPU runs, in Triton's interpreter);
* ``silu`` or ``situ`` (Kimi K3's betas 4 and 25 on the layer's ``FusedMoEConfig``).

The step is both layers' ``FusedMoEKernel.apply`` on one batch of ``M`` tokens per rank (every rank the same
``M``, as vLLM pads DP ranks to one capture size). Each capture size has its own buffer of capacity ``S = M``
(vLLM's pool floor of 128 tokens lowered to 1 here), so the hot owner's entries exceed its ``S*K`` and the step
fills slots at every size. For each capture size ``M``: one eager warm-up (what vLLM's warm-up does before
capture: the size's buffer is made then, collectively), a capture on static inputs, and
``max(3, R)`` replays, each with new tokens and a routing skewed towards another owner's experts (replay ``j``
overloads rank ``j mod R``: over the replays every owner's experts fill another rank's slots). Each replay's
outputs are compared bit for bit with an eager run of the same kernels on the same inputs, run after it;
the eager run's slot records say which owners filled slots. A capture that succeeds made no device->host
read, no host wait and no allocation outside the graph's pool: the emulator refuses each at the call.

Controls (``bf16/pull/silu``, size 8):

* ``item``: the experts' ``apply`` reads ``expert_num_tokens.sum().item()`` (a planted host read): the capture
  is refused with kind ``item`` at this file's line;
* ``kept_output``: a caller that keeps replay ``j``'s output tensor (no copy) and adds replay ``j+1``'s: the
  graph wrote both into the same pool memory, so the sum disagrees with eager ``j`` + eager ``j+1``; with the
  copy it agrees;
* ``unbuilt_buffer``: a capture at a size above every capacity built (the pool's decode capacities at start, the
  warm-ups'), with no warm-up: refused where the pool would build its Buffer (a collective inside the capture),
  naming the capacity and the fix;
* ``skipped_wait``: the experts' wait for the slot fill removed. Never waited on, the capture is refused at its
  end (the side stream not joined); waited on only after both layers (the stream joined, the slots read before
  the fill lands), some replay disagrees with eager (which waits).

Prints one JSON document; :func:`verdict` lists every failed expectation.
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
from typing import Any, Callable, Iterator

#: the capture sizes (tokens per rank): a decode step of one token, a small batch, a larger one
SIZES = (1, 8, 32)
CASES = tuple(f"{fmt}/{api}/{act}" for fmt in ("bf16", "mxfp4") for api in ("pull", "push")
              for act in ("silu", "situ"))
CONTROL_SIZE = 8
#: logits added to the hot owner's experts: a replay's tokens route mostly there, so other ranks fill slots
HOT_LOGIT = 6.0
#: the quantized layers' shape (the interpreter runs their kernels: small)
QE, QH, QI, QTOPK = 8, 256, 128, 4


def _inputs(case: Any, M: int, rank: int, world: int, j: int) -> tuple[Any, Any, Any]:
    """Tokens ``[M, H]`` bf16 and top-k routing skewed towards owner ``j mod R``'s experts (different tokens
    and routing for every ``j``, rank and size)."""
    import torch

    g = torch.Generator().manual_seed(100_003 * j + 1_009 * rank + M)
    x = torch.randn(M, case.hidden, generator=g).to(torch.bfloat16)
    logits = torch.randn(M, case.experts, generator=g)
    epn, hot = case.experts // world, j % world
    logits[:, hot * epn:(hot + 1) * epn] += HOT_LOGIT
    w, ids = torch.topk(torch.softmax(logits, dim=-1), case.top_k, dim=-1)
    return x, ids.to(torch.int32), (w / w.sum(dim=-1, keepdim=True)).to(torch.float32)


class _Layers:
    """Two MoE layers of one case and the step over them."""

    def __init__(self, case: Any, layers: list, kernels: list, activation: Any) -> None:
        self.case, self.layers, self.kernels, self.activation = case, layers, kernels, activation

    def step(self, x: Any, ids: Any, w: Any) -> list:
        return [kernel.apply(hidden_states=x, w1=layer.w13_weight, w2=layer.w2_weight, topk_ids=ids, topk_weights=w,
                             activation=self.activation, global_num_experts=self.case.experts, expert_map=None,
                             apply_router_weight_on_input=False)
                for layer, kernel in zip(self.layers, self.kernels)]

    def slot_owners(self) -> list[int]:
        """The owners whose experts the last step's prefetches filled into this rank's slots."""
        return sorted({o for k in self.kernels for _, _, o in k.prepare_finalize._buffer.last_slots})


def _build(case_name: str, rank: int, world: int, manager: Any, materials: dict) -> _Layers:
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    from tests.support.vllm_moe_model import KernelCase, build, checkpoint

    fmt, _, act = case_name.split("/")
    if fmt == "bf16":
        case = KernelCase(ranks=world, activation=act)
        model = build(case, rank, prefix=case_name.replace("/", "_"))
        model.load_weights(list(checkpoint(case, case.seed, rank=rank)))
        for layer in model.layers:
            layer.quant_method.process_weights_after_loading(layer)
        layers = list(model.layers)
        kernels = [layer.quant_method.moe_kernel for layer in layers]
    else:
        from tests.support.gpu_experts_check import quantized_experts
        from tests.support.slot_fill_check import quantized_layers

        case = KernelCase(ranks=world, experts=QE, top_k=QTOPK, hidden=QH, intermediate=QI, activation=act)
        if fmt not in materials:  # the same checkpoint on every rank (fixed seed)
            materials[fmt] = quantized_experts(fmt, QH, QI, case.layers * QE)
        layers, kernels = quantized_layers(rank, manager, fmt, "triton", materials[fmt], case)
    return _Layers(case, layers, kernels, MoEActivation(act))


def _replays_and_eager(layers: _Layers, graph: Any, static: list, outs: list, rank: int, world: int
                       ) -> Iterator[tuple[list, list, list[int]]]:
    """For each of the ``max(3, R)`` replays (new tokens, routing skewed towards owner ``j mod R``, copied into the
    static inputs): the replay's outputs (copied), an eager run's on the same inputs after it, and the owners that
    eager run's prefetches filled slots from."""
    M = static[0].shape[0]
    for j in range(1, max(3, world) + 1):
        new = _inputs(layers.case, M, rank, world, j)
        for s, n in zip(static, new):
            s.copy_(n)
        graph.replay()
        got = [o.clone() for o in outs]
        yield got, layers.step(*new), layers.slot_owners()


def run_case(layers: _Layers, rank: int, world: int, sizes: tuple[int, ...]) -> dict[str, Any]:
    import torch

    from moonep_ep.testing.cuda_capture import CapturedGraph

    out: dict[str, Any] = {}
    for M in sizes:
        t0 = time.perf_counter()
        static = [t.clone() for t in _inputs(layers.case, M, rank, world, 0)]
        layers.step(*static)                     # warm-up: what vLLM runs before it captures
        graph = CapturedGraph()
        with graph.capture():
            outs = layers.step(*static)
        poisoned = all(bool(o.isnan().all()) for o in outs)
        replays = [{"equal": [bool(torch.equal(a, b)) for a, b in zip(got, eager)],
                    "finite": all(bool(torch.isfinite(o).all()) for o in got),
                    "owners": owners, "digest": [float(o.float().sum()) for o in got]}
                   for got, eager, owners in _replays_and_eager(layers, graph, static, outs, rank, world)]
        out[str(M)] = {"items": len(graph.items), "poisoned_after_capture": poisoned, "replays": replays,
                       "seconds": round(time.perf_counter() - t0, 2)}
    return out


def _planted_item(layers: _Layers) -> Callable[[], Any]:
    """Wrap the experts' ``apply`` with a host read of the group sizes; returns the undo."""
    experts = [k.fused_experts for k in layers.kernels]
    real = type(experts[0]).apply

    def apply(self: Any, *args: Any, **kwargs: Any) -> Any:
        meta = kwargs.get("expert_tokens_meta")
        counts = meta.expert_num_tokens if meta is not None else args[0]
        _ = int(counts.sum().item())  # the planted host read
        return real(self, *args, **kwargs)

    type(experts[0]).apply = apply

    def undo() -> None:
        type(experts[0]).apply = real
    return undo


@contextlib.contextmanager
def _late_waits(join: bool) -> Iterator[list]:
    """The experts' wait for the slot fill removed (swapped in the two modules whose ``apply`` calls it, as
    ``slot_fill_check.waits`` does); ``join``: the caller waits for the skipped events after the step, so the
    side stream is joined before the region ends (only the read comes before the fill's landing)."""
    from moonep_ep.ops.moonep import prefetch
    from moonep_ep.vllm.experts import overlap
    from moonep_ep.vllm.quantized import engine as quantized_engine

    skipped: list = []
    saved = overlap.wait_for_slots, quantized_engine.wait_for_slots
    overlap.wait_for_slots = quantized_engine.wait_for_slots = lambda event: skipped.append(event)
    try:
        yield skipped
    finally:
        overlap.wait_for_slots, quantized_engine.wait_for_slots = saved
        if join:
            for event in skipped:
                if event is not None:
                    prefetch.wait_for_slots(event)


def _skipped_wait(layers: _Layers, static: list, rank: int, world: int) -> dict[str, Any]:
    import torch

    from moonep_ep.testing.cuda_capture import CapturedGraph, CaptureRefused

    try:   # never joined: cudaStreamEndCapture refuses the capture
        with CapturedGraph().capture(), _late_waits(join=False):
            layers.step(*static)
        unjoined = None
    except CaptureRefused as err:
        unjoined = {"kind": err.kind, "site": err.site}
    graph = CapturedGraph()
    with graph.capture():
        with _late_waits(join=True) as skipped:
            outs = layers.step(*static)
    equal, owners = [], []
    for got, eager, slot_owners in _replays_and_eager(layers, graph, static, outs, rank, world):
        equal.append(all(bool(torch.equal(a, b)) for a, b in zip(got, eager)))
        owners.append(slot_owners)
    return {"unjoined_refused": unjoined, "replays_equal": equal, "owners": owners,
            "waits_skipped": sum(e is not None for e in skipped)}


def run_controls(layers: _Layers, rank: int, world: int) -> dict[str, Any]:
    import torch

    from moonep_ep.testing.cuda_capture import CapturedGraph, CaptureRefused

    M, out = CONTROL_SIZE, {}
    static = [t.clone() for t in _inputs(layers.case, M, rank, world, 0)]
    layers.step(*static)
    # -- kept_output: the caller keeps replay j's output tensor, then replays j+1 -----------------------------
    graph = CapturedGraph()
    with graph.capture():
        outs = layers.step(*static)
    results = {}
    for keep in ("reference", "copy"):
        sums = []
        for j in (1, 2):
            new = _inputs(layers.case, M, rank, world, j)
            for s, n in zip(static, new):
                s.copy_(n)
            graph.replay()
            sums.append(outs[0] if keep == "reference" else outs[0].clone())
        kept = sums[0].float() + sums[1].float()
        eager = sum(layers.step(*_inputs(layers.case, M, rank, world, j))[0].float() for j in (1, 2))
        results[keep] = bool(torch.equal(kept, eager))
    out["kept_output_equal"] = results
    # -- skipped_wait: the experts do not wait for the slot fill; the step joins it only after both layers ----
    out["skipped_wait"] = _skipped_wait(layers, static, rank, world)
    # -- unbuilt_buffer: a size with no warm-up, whose Buffer the pool would build inside the capture ---------
    pool = layers.kernels[0].prepare_finalize.buffer_pool
    built = sorted(pool._buffers)   # the decode capacities the pool built at start, and the warm-ups'
    unwarmed_size = built[-1] + 1   # the smallest step whose capacity is none of them
    out["unbuilt"] = {"built_capacities": built, "tokens": unwarmed_size,
                      "capacity": pool.capacity_for(unwarmed_size)}
    try:
        unwarmed = [t.clone() for t in _inputs(layers.case, unwarmed_size, rank, world, 0)]
        with CapturedGraph().capture():
            layers.step(*unwarmed)
        out["unbuilt_buffer_refused"] = None
    except (RuntimeError, CaptureRefused) as err:
        out["unbuilt_buffer_refused"] = {"type": type(err).__name__, "message": str(err)[:600]}
    # -- item: a planted host read in the experts, last (the refused capture is abandoned) -------------------
    undo = _planted_item(layers)
    try:
        with CapturedGraph().capture():
            layers.step(*static)
        out["item_refused"] = None
    except CaptureRefused as err:
        out["item_refused"] = {"kind": err.kind, "site": err.site}
    finally:
        undo()
    return out


def check_rank(ctx: Any, cases: tuple[str, ...], sizes: tuple[int, ...], controls: bool) -> dict[str, Any]:
    stats = tempfile.mkdtemp(prefix="moonep-ep-graphs-")
    os.environ["MOONEP_EP_VLLM_STATS_DIR"] = stats  # the buffer records each prefetch's slots
    try:
        return _check_rank(ctx, cases, sizes, controls)
    finally:
        os.environ.pop("MOONEP_EP_MOONEP_API", None)
        shutil.rmtree(stats, ignore_errors=True)


def _check_rank(ctx: Any, cases: tuple[str, ...], sizes: tuple[int, ...], controls: bool) -> dict[str, Any]:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ["MOONEP_EP_CPU"] = "1"
    from moonep_ep.vllm import plugin

    plugin.install()
    from vllm.distributed import get_ep_group

    from moonep_ep import envs
    from tests.support.kernel_check import setup_vllm

    rank, world = ctx.rank, ctx.world_size
    setup_vllm(rank, world)
    import vllm.distributed.device_communicators.all2all  # noqa: F401 - first, so the plugin's hook patches it
    from vllm.model_executor.layers.fused_moe.prepare_finalize import moonep as vllm_moonep

    # One buffer per capture size, S = M (vLLM's pool otherwise serves every step under 128 tokens from one
    # S = 128 buffer): at S = M the hot owner's R*M*K entries exceed its S*K, so the step fills slots at every
    # size. The buffer is built by the warm-up, collectively, before the capture.
    vllm_moonep.MOONEP_MIN_DISPATCH_TOKENS = 1

    from moonep_ep.vllm.manager import ShardedMoonEPAll2AllManager

    ep = get_ep_group()
    managers: dict[str, Any] = {}
    out: dict[str, Any] = {"rank": rank, "deferred_copies": envs.MOONEP_EP_CPU_DEFERRED_COPIES,
                           "lockstep_checks": envs.MOONEP_EP_LOCKSTEP_CHECKS, "cases": {}}
    materials: dict[str, Any] = {}
    for name in cases:
        api = name.split("/")[1]
        os.environ["MOONEP_EP_MOONEP_API"] = api
        if api not in managers:
            managers[api] = ShardedMoonEPAll2AllManager(ep.cpu_group, device_group=ep.device_group)
        ep.device_communicator.all2all_manager = managers[api]  # what bind_model and the kernels' handle use
        t0 = time.perf_counter()
        layers = _build(name, rank, world, managers[api], materials)
        res = {"experts_class": type(layers.kernels[0].fused_experts).__name__,
               "prepare_finalize_class": type(layers.kernels[0].prepare_finalize).__name__,
               "sizes": run_case(layers, rank, world, sizes)}
        if controls and name == "bf16/pull/silu":
            res["controls"] = run_controls(layers, rank, world)
        res["seconds"] = round(time.perf_counter() - t0, 2)
        out["cases"][name] = res
    ep.barrier()
    for manager in managers.values():
        manager.destroy()
    return out


def verdict(ranks: list[dict[str, Any]], controls: bool) -> list[str]:
    """Every failed expectation (``ok`` is true only when this is empty)."""
    failed = []
    world = len(ranks)
    for name in ranks[0]["cases"]:
        for size in ranks[0]["cases"][name]["sizes"]:
            per_rank = [r["cases"][name]["sizes"][size] for r in ranks]
            where = f"{name} at {size} tokens per rank"
            if not all(r["poisoned_after_capture"] for r in per_rank):
                failed.append(f"{where}: the capture's outputs hold values after capture (capture ran the step)")
            replays = [rep for r in per_rank for rep in r["replays"]]
            if not all(all(rep["equal"]) for rep in replays):
                failed.append(f"{where}: a replay differs from eager on the same inputs")
            if not all(rep["finite"] for rep in replays):
                failed.append(f"{where}: a replay has a non-finite output")
            owners = {o for rep in replays for o in rep["owners"]}
            if owners != set(range(world)):
                failed.append(f"{where}: slots filled from owners {sorted(owners)}, not from every owner")
            digests = [tuple(rep["digest"]) for rep in per_rank[0]["replays"]]
            if len(set(digests)) != len(digests):
                failed.append(f"{where}: two replays gave the same outputs (the inputs did not reach the graph)")
    if controls:
        for r in ranks:
            c = r["cases"]["bf16/pull/silu"]["controls"]
            refused = c["item_refused"]
            if not refused or refused["kind"] != "item" or "kernel_graph_check.py" not in refused["site"]:
                failed.append(f"rank {r['rank']}: the planted item() was not refused at its line: {refused}")
            if c["kept_output_equal"] != {"reference": False, "copy": True}:
                failed.append(f"rank {r['rank']}: kept outputs: {c['kept_output_equal']} (reference must disagree, "
                              "copy agree)")
            unbuilt, size = c["unbuilt_buffer_refused"], c["unbuilt"]
            if size["capacity"] in size["built_capacities"] or not unbuilt or unbuilt["type"] != "RuntimeError" or \
                    f"Buffer of capacity {size['capacity']} (a step of {size['tokens']}" not in unbuilt["message"]:
                failed.append(f"rank {r['rank']}: a Buffer built inside a capture was not refused: {unbuilt}")
            sw = c["skipped_wait"]
            if sw["waits_skipped"] == 0:
                failed.append(f"rank {r['rank']}: the skipped-wait control skipped no wait")
            if not sw["unjoined_refused"] or sw["unjoined_refused"]["kind"] != "a side stream not joined":
                failed.append(f"rank {r['rank']}: a fill never waited on was not refused at capture's end: "
                              f"{sw['unjoined_refused']}")
        if all(all(r["cases"]["bf16/pull/silu"]["controls"]["skipped_wait"]["replays_equal"]) for r in ranks):
            failed.append("the skipped wait was not caught: every replay without the wait equals eager")
    if not all(r["deferred_copies"] for r in ranks):
        failed.append("CPU slot copies were not deferred")
    return failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.support.kernel_graph_check")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--cases", default=",".join(CASES), help="format/api/activation (default: %(default)s)")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="capture sizes, tokens per rank")
    p.add_argument("--no-controls", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from moonep_ep.launch import run_ranks
    from moonep_ep.testing.triton_interpreter import INTERPRETER_ENV

    cases = tuple(c for c in args.cases.split(",") if c)
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        p.error(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    sizes = tuple(int(s) for s in args.sizes.split(","))
    controls = not args.no_controls and "bf16/pull/silu" in cases
    env = {"VLLM_TARGET_DEVICE": "cpu", "MOONEP_EP_CPU": "1", "MOONEP_EP_CPU_DEFERRED_COPIES": "1"}
    if any(c.startswith("mxfp4") for c in cases):
        env.update(INTERPRETER_ENV)  # the GPU experts' Triton kernels run in its interpreter on CPU
    os.environ.update(env)
    t0 = time.perf_counter()
    ranks = run_ranks(check_rank, args.ranks, args=(cases, sizes, controls), timeout_s=600, env=env)
    failed = verdict(ranks, controls)
    out = {"ok": not failed, "failed": failed, "ranks_n": args.ranks, "sizes": list(sizes),
           "seconds": round(time.perf_counter() - t0, 1), "ranks": ranks}
    print(json.dumps(out, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
