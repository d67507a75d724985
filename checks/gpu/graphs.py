"""The MoE step's expert half captured in a CUDA graph and replayed on one GPU (``scripts/gpu_check.sh`` part 8).

``python -m checks.gpu.graphs --json``, from the repository root, prints one JSON object. It needs one GPU, torch
and Triton (and cuda-bindings for the VMM store; without it, or where the driver refuses VMM, the views are plain
device tensors and the output says so); not vLLM. Where a precondition is missing (no GPU, the CUDA emulator,
Triton missing or interpreting) it prints ``{"not_applicable": reason, "ok": null}`` and exits 0, as parts 6
and 7 do.

**The step** is what a decode step's MoE layer runs on a rank between dispatch and combine, at Kimi K3's expert
widths (latent 3584, expert 3072), ``E`` experts and ``B`` slots in one ``[E+B]`` view per tensor (the store over
CUDA VMM on one rank: the owner's pages and the slot pool in one mapping):

1. the slot fill: slot ``b`` <- expert ``table[b]`` (``ops.moonep.prefetch.pull_slots`` with the table on the
   device: the row-copy kernel on a side stream forked from the capturing stream);
2. the wait (``wait_for_slots``: the side stream joined back);
3. the experts over the rows grouped by expert and slot, ``cu_seqlens`` on the device: BF16 through
   ``ops.experts.grouped.grouped_ffn`` (``torch._grouped_mm``; where this torch cannot run it on this GPU the
   BF16 cases are "not applicable", since its segment loop reads the group bounds on the host), MXFP4 through
   ``vllm.experts.gpu.gpu_grouped_ffn`` (the project's Triton kernel); SiLU and SiTU (Kimi K3's betas 4, 25).

For each format, activation and size (1, 8 and 64 tokens per rank, top-16 entries each, groups padded to 16
rows) the step is warmed up, captured once on static inputs (``torch.cuda.graph``), and replayed with
:data:`REPLAYS` new inputs (rows, route weights, group sizes, slot table) copied into the static tensors; every
replay's output must equal an eager run of the same step on the same inputs, bit for bit, over the rows the
groups use (the experts leave the rows past ``cu_seqlens[-1]`` unwritten, and combine never reads them), and the
replays must differ from each other. Then the captured and the eager step are timed (fastest of :data:`TRIALS`, CUDA events)
and their ratio printed. Controls: the same step without the wait must be refused at the end of capture (the
side stream never joined: ``cudaErrorStreamCaptureUnjoined``); the slot table read to the host before capture
and handed to the fill as ints must be caught (a GPU refuses the host copy in the capture; where it is not
refused, a replay with a new table disagrees with eager).

The same functions run on CPU in the tests (``tests/support/gpu_graphs_interpreted.py``) with the capture-and-
replay emulator (``moonep_ep.testing.cuda_capture``) in place of ``torch.cuda.graph`` and Triton's interpreter.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from typing import Any, Callable, Iterator, Optional

import torch

from . import mxfp4
from .k3 import BETA, LINEAR_BETA

__all__ = ["Dims", "REAL", "SIZES", "run_case", "run_all", "main"]

SIZES = (1, 8, 64)
REPLAYS = 3
TRIALS = 20
FORMATS = ("bf16", "mxfp4")
ACTIVATIONS = ("silu", "situ")


@dataclasses.dataclass(frozen=True)
class Dims:
    hidden: int = 3584     # Kimi K3's latent width (what its experts read)
    inter: int = 3072      # Kimi K3's expert width
    experts: int = 16      # a handful of a rank's experts: the step's shape per group is what matters
    slots: int = 4
    top_k: int = 16
    padding: int = 16      # rows per group block (the token padding a decode buffer would use)


REAL = Dims()


def _activation(name: str) -> Any:
    from moonep_ep.ops.experts.activation import SILU, GatedActivation

    return SILU if name == "silu" else GatedActivation("situ", beta=BETA, linear_beta=LINEAR_BETA)


def _shape(dims: Dims) -> mxfp4.Shape:
    """The dims as part 6's ``Shape``, whose ``expert_views`` makes the views of either format."""
    return mxfp4.Shape("k3-graphs", dims.hidden, dims.inter, dims.experts, dims.top_k, dims.slots)


def fill_experts(fmt: str, views: dict[str, torch.Tensor], dims: Dims, seed: int = 0) -> None:
    """Random expert rows ``[0, E)``: bf16 values of a unit-variance output scale, MXFP4 codes and exponents."""
    if fmt == "mxfp4":
        mxfp4.fill_rows(views, list(range(dims.experts)), seed)
        return
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, view in views.items():
        fan_in = view.shape[-1]
        for e in range(dims.experts):
            view[e].copy_((torch.randn(tuple(view.shape[1:]), generator=gen) / fan_in ** 0.5).to(view.dtype))


def draw_inputs(dims: Dims, tokens: int, seed: int, device: torch.device
                ) -> tuple[dict[str, torch.Tensor], int]:
    """One step's inputs as dispatch and the planner leave them: ``tokens * top_k`` entries over the experts and
    the slots, each group padded to ``dims.padding`` rows (zero rows, zero route weights), ``cu_seqlens``
    inclusive ends, and the slot table (slot ``b`` <- an expert); and the rows the groups use (``cu_seqlens[-1]``,
    known here on the host: the experts leave the rows past it unwritten, and combine never reads them)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    G, P = dims.experts + dims.slots, dims.padding
    groups = torch.randint(0, G, (tokens * dims.top_k,), generator=gen)
    counts = torch.bincount(groups, minlength=G)
    padded = (counts + P - 1) // P * P
    rows = capacity_rows(dims, tokens)
    hidden = torch.zeros(rows, dims.hidden)
    route = torch.zeros(rows)
    start = 0
    for g in range(G):
        n = int(counts[g])
        hidden[start:start + n] = torch.randn(n, dims.hidden, generator=gen)
        route[start:start + n] = torch.rand(n, generator=gen) + 0.1
        start += int(padded[g])
    table = torch.randperm(dims.experts, generator=gen)[:dims.slots]
    return ({"hidden": hidden.to(device=device, dtype=torch.bfloat16), "route": route.to(device),
             "cu_seqlens": torch.cumsum(padded, 0).to(device=device, dtype=torch.int32),
             "table": table.to(device=device, dtype=torch.int64)}, int(padded.sum()))


def capacity_rows(dims: Dims, tokens: int) -> int:
    """The rows a step of ``tokens`` can fill: every entry, plus fewer than a block of padding per group."""
    return tokens * dims.top_k + (dims.padding - 1) * (dims.experts + dims.slots)


def make_step(fmt: str, activation: str, views: dict[str, torch.Tensor], dims: Dims, static: dict[str, torch.Tensor],
              config: Optional[dict[str, int]], wait: bool = True, baked_table: Optional[list] = None
              ) -> Callable[[], torch.Tensor]:
    """The fill, the wait and the experts over ``static``'s tensors (read at every call, or replay).
    ``baked_table``: the slot table as host ints read before the capture (a control: the capture bakes it)."""
    from moonep_ep.ops.moonep.prefetch import pull_slots, wait_for_slots

    act = _activation(activation)
    E, I = dims.experts, dims.inter

    def experts() -> torch.Tensor:
        if fmt == "bf16":
            from moonep_ep.ops.experts.grouped import grouped_ffn

            w13, w2 = views["w13_weight"], views["w2_weight"]
            return grouped_ffn(static["hidden"], w13[:, :I], w13[:, I:], w2, static["cu_seqlens"], static["route"],
                               use_grouped_mm=True, activation=act)
        from moonep_ep.vllm.experts.gpu import gpu_grouped_ffn

        return gpu_grouped_ffn("mxfp4", static["hidden"], views, static["cu_seqlens"], static["route"],
                               token_padding=dims.padding, config=config, activation=act)

    def step() -> torch.Tensor:
        table = static["table"] if baked_table is None else baked_table
        fill = pull_slots(views, table, E)   # its counts are never asked: they would read the table
        if wait:
            wait_for_slots(fill.event)
        return experts()

    return step


class CudaGraph:
    """``torch.cuda.graph`` behind the emulator's interface (``capture()``, ``replay()``)."""

    def __init__(self) -> None:
        self.graph = torch.cuda.CUDAGraph()

    @contextlib.contextmanager
    def capture(self) -> Iterator["CudaGraph"]:
        with torch.cuda.graph(self.graph):
            yield self

    def replay(self) -> None:
        self.graph.replay()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fastest_ms(fn: Callable[[], Any], device: torch.device, trials: int) -> Optional[float]:
    if device.type != "cuda":
        return None
    best = None
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = start.elapsed_time(end) if best is None else min(best, start.elapsed_time(end))
    return best


def run_case(fmt: str, activation: str, views: dict[str, torch.Tensor], dims: Dims, tokens: int,
             device: torch.device, new_graph: Callable[[], Any], config: Optional[dict[str, int]],
             trials: int = TRIALS) -> dict[str, Any]:
    """One format, activation and size: capture, :data:`REPLAYS` replays against eager, the timing."""
    static, _ = draw_inputs(dims, tokens, 1000 + tokens, device)
    step = make_step(fmt, activation, views, dims, static, config)
    for _ in range(2):           # warm-up before capture (Triton's compile, the side stream, the caches)
        step()
    _synchronize(device)
    graph = new_graph()
    with graph.capture():
        out = step()
    _synchronize(device)
    equal, sums, finite = [], [], True
    for j in range(REPLAYS):
        new, used = draw_inputs(dims, tokens, 2000 + 10 * tokens + j, device)
        for name, t in new.items():
            static[name].copy_(t)
        graph.replay()
        _synchronize(device)
        got = out[:used].clone()       # the rows the groups use: the ones combine reads
        eager = step()[:used]
        _synchronize(device)
        equal.append(bool(torch.equal(got, eager)))
        sums.append(float(got.float().abs().sum()))
        finite = finite and bool(torch.isfinite(got).all())
    res: dict[str, Any] = {"rows": int(static["hidden"].shape[0]), "replays_equal_eager": equal,
                           "replays_differ": len(set(sums)) == len(sums), "finite": finite}
    eager_ms = _fastest_ms(step, device, trials)
    replay_ms = _fastest_ms(graph.replay, device, trials)
    if eager_ms is not None and replay_ms is not None:
        res.update(eager_ms=round(eager_ms, 4), replay_ms=round(replay_ms, 4),
                   captured_over_eager=round(replay_ms / eager_ms, 3))
    res["ok"] = all(equal) and res["replays_differ"] and res["finite"]
    return res


def unjoined_control(fmt: str, views: dict[str, torch.Tensor], dims: Dims, device: torch.device,
                     new_graph: Callable[[], Any], config: Optional[dict[str, int]]) -> dict[str, Any]:
    """The step without the wait: capture must refuse it (the fill's side stream never joined)."""
    static, _ = draw_inputs(dims, 1, 7, device)
    step = make_step(fmt, "silu", views, dims, static, config, wait=False)
    step()
    _synchronize(device)
    try:
        with new_graph().capture():
            step()
    except Exception as exc:  # noqa: BLE001 - the refusal is the expected outcome; its words are reported
        return {"refused": True, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    finally:
        _synchronize(device)
    return {"refused": False, "error": None}


def baked_table_control(fmt: str, views: dict[str, torch.Tensor], dims: Dims, device: torch.device,
                        new_graph: Callable[[], Any], config: Optional[dict[str, int]]) -> dict[str, Any]:
    """The slot table read to the host before capture and handed to the fill as ints: the capture bakes the
    capture's table (a GPU refuses the host copy inside the capture; the emulator elides it as CPU work), so it
    must be caught, refused or as a replay that disagrees with eager."""
    static, _ = draw_inputs(dims, 8, 11, device)
    host_table = [int(e) for e in static["table"].tolist()]
    baked = make_step(fmt, "silu", views, dims, static, config, baked_table=host_table)
    right = make_step(fmt, "silu", views, dims, static, config)
    baked()
    _synchronize(device)
    graph = new_graph()
    try:
        with graph.capture():
            out = baked()
    except Exception as exc:  # noqa: BLE001 - refused: caught
        _synchronize(device)
        return {"caught": True, "how": f"refused: {type(exc).__name__}: {str(exc)[:200]}"}
    equal = []
    for j in range(REPLAYS):
        new, used = draw_inputs(dims, 8, 3000 + j, device)
        for name, t in new.items():
            static[name].copy_(t)
        graph.replay()
        _synchronize(device)
        got = out[:used].clone()
        equal.append(bool(torch.equal(got, right()[:used])))
        _synchronize(device)
    return {"caught": not all(equal), "how": "replays against eager", "replays_equal_eager": equal}


def bf16_not_applicable(device: torch.device) -> Optional[str]:
    from moonep_ep.ops.experts.grouped import grouped_mm_supported

    if not grouped_mm_supported(device, torch.bfloat16):
        return ("torch._grouped_mm does not run bf16 on this device (its segment loop reads the group bounds on "
                "the host, which no capture holds)")
    return None


def run_all(dims: Dims, device: torch.device, new_graph: Callable[[], Any], config: Optional[dict[str, int]],
            sizes: tuple[int, ...] = SIZES, vmm: bool = True, trials: int = TRIALS) -> dict[str, Any]:
    out: dict[str, Any] = {"dims": dataclasses.asdict(dims), "sizes": list(sizes), "formats": {}}
    for fmt in FORMATS:
        why = bf16_not_applicable(device) if fmt == "bf16" else None
        if why:
            out["formats"][fmt] = {"not_applicable": why}
            continue
        with mxfp4.expert_views(_shape(dims), device, vmm, fmt=fmt) as (views, info):
            fill_experts(fmt, views, dims)
            res: dict[str, Any] = dict(info)
            for act in ACTIVATIONS:
                res[act] = {str(n): run_case(fmt, act, views, dims, n, device, new_graph, config, trials)
                            for n in sizes}
            res["control_without_wait"] = unjoined_control(fmt, views, dims, device, new_graph, config)
            res["control_baked_table"] = baked_table_control(fmt, views, dims, device, new_graph, config)
            out["formats"][fmt] = res
    ran = [r for r in out["formats"].values() if "not_applicable" not in r]
    out["ok"] = bool(ran) and all(r[act][str(n)]["ok"] for r in ran for act in ACTIVATIONS for n in sizes) and \
        all(r["control_without_wait"]["refused"] and r["control_baked_table"]["caught"] for r in ran)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m checks.gpu.graphs", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-vmm", action="store_true", help="plain device tensors instead of the VMM store")
    args = p.parse_args(argv)
    why = mxfp4.missing_preconditions()
    if why:
        out: dict[str, Any] = {"check": "moe_step_graphs", "not_applicable": "; ".join(why), "ok": None}
    else:
        import triton

        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        cfg = mxfp4.vllm_default_config(64, REAL.experts)
        from moonep_ep.vllm.experts.gpu import fit_block_m

        cfg["BLOCK_SIZE_M"] = fit_block_m(cfg["BLOCK_SIZE_M"], REAL.padding)
        t0 = time.perf_counter()
        res = run_all(REAL, device, CudaGraph, cfg, vmm=not args.no_vmm)
        out = {"check": "moe_step_graphs", "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
               "triton": triton.__version__, **res, "seconds": round(time.perf_counter() - t0, 1)}
        import torch.distributed as dist

        if dist.is_initialized():  # the one-rank group of the VMM store
            dist.destroy_process_group()
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))
    return 0 if out["ok"] is not False else 1


if __name__ == "__main__":
    sys.exit(main())
