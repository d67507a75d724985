"""Kernel-level demo: a sharded tiny MoE through dispatch → prefetch → grouped FFN → combine.

``moonep-ep demo`` spawns ``R`` local ranks (host driver + gloo on CPU; CUDA
VMM + NCCL when every rank has a GPU). Each rank:

1. maps a :class:`ShardedExpertStore` holding only its own experts' pages
   plus one slot pool shared by all layers, and loads its experts (random
   bf16, reproducible from the seed: each rank generates only its own);
2. runs ``L`` MoE layers on its ``T`` tokens, residual
   ``h <- h + moe_l(rmsnorm(h))``, with a skewed router
   ``logits = rmsnorm(h) @ W_r^T + skew * bias_l`` (``bias_l`` shared by all
   ranks, so a few experts are hot everywhere);
3. per layer: :meth:`ReferenceBuffer.dispatch`, Gen A
   :meth:`~ReferenceBuffer.prefetch_weight` on the store's ``[E+B]`` views
   (pull from the owners' pages), :func:`grouped_ffn`,
   :meth:`~ReferenceBuffer.combine`; compares with :func:`reference_moe` on
   the same input, computed from weights regenerated from the seed (not read
   through the store); checks every filled slot against the regenerated
   expert;
4. records every ``torch.distributed`` collective of the forward with a
   :class:`CollectiveRecorder` that flags any call carrying expert-weight
   bytes (alias or content match);
5. measures pull-prefetch bandwidth from peers' pages vs a local copy of the
   same bytes (:func:`moonep_ep.tools.prefetch_bench.measure_pull`).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import Any, Callable, Optional

import torch

from .. import envs
from ..models import MoEModelConfig, get_model
from ..ops.experts import BF16_REL_TOL

__all__ = ["DemoConfig", "demo_rank", "run_demo", "format_report", "expert_weight", "resolve_config"]

_PROJ_CODE = {"gate": 1, "up": 2, "down": 3}


@dataclasses.dataclass
class DemoConfig:
    """Everything a demo rank needs (plain data: it crosses the spawn boundary)."""

    ranks: int = 4
    model: str = "tiny"
    hidden: int = 512
    intermediate: int = 256
    experts: int = 16
    top_k: int = 4
    layers: int = 4
    tokens: int = 128
    skew: float = 8.0
    slots: Optional[int] = None
    token_padding: int = 128
    seed: int = 0
    driver: str = "host"
    granularity: Optional[int] = None
    bandwidth_reps: int = 7
    rel_tol: float = BF16_REL_TOL  # pass: max |err| <= rel_tol * max |ref|, per layer

    @classmethod
    def for_model(cls, model: MoEModelConfig, **kw: Any) -> "DemoConfig":
        return cls(model=model.name, hidden=model.hidden_size, intermediate=model.moe_intermediate_size,
                   experts=model.num_experts, top_k=model.top_k, layers=model.num_moe_layers, **kw)


def _seed(*parts: int) -> int:
    """A stable 63-bit seed from small ints (same on every rank and run)."""
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (p & 0xFFFFFFFF)) * 1099511628211) & ((1 << 63) - 1)
    return h


def expert_weight(seed: int, layer: int, proj: str, expert: int, shape: tuple[int, int]) -> torch.Tensor:
    """Expert ``expert``'s ``proj`` matrix of ``layer``: N(0, 1/in) in bf16, from the seed alone."""
    gen = torch.Generator().manual_seed(_seed(seed, 1, layer, _PROJ_CODE[proj], expert))
    return (torch.randn(shape, generator=gen) / math.sqrt(shape[1])).to(torch.bfloat16)


def _router(seed: int, layer: int, E: int, H: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(_seed(seed, 2, layer))
    return torch.randn(E, H, generator=gen) / math.sqrt(H), torch.randn(E, generator=gen)


def _rmsnorm(h: torch.Tensor) -> torch.Tensor:
    x = h.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)


def route(x: torch.Tensor, w_router: torch.Tensor, bias: torch.Tensor, skew: float, K: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``K`` ids (int32) and softmax-over-top-K weights (fp32) of a skewed router."""
    logits = x.float() @ w_router.to(x.device).T + skew * bias.to(x.device)
    top, ids = torch.topk(logits, K, dim=-1)
    return ids.to(torch.int32), torch.softmax(top, dim=-1)


def demo_rank(ctx: Any, cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """Rank body of ``moonep-ep demo``; returns this rank's report (plain data)."""
    from ..layout.store import ShardedExpertStore, ffn_projections
    from ..memory import make_driver
    from .prefetch_bench import measure_pull, page_holders, split_by_holder
    from ..ops.buffer import ReferenceBuffer
    from ..ops.experts import grouped_ffn, reference_moe
    from ..ops.instrument import CollectiveRecorder

    cfg = DemoConfig(**cfg_dict)
    rank, R = ctx.rank, ctx.world_size
    H, I, E, K, L, T = cfg.hidden, cfg.intermediate, cfg.experts, cfg.top_k, cfg.layers, cfg.tokens
    device = torch.device(ctx.device)

    def say(msg: str) -> None:
        sys.stderr.write(f"[demo] rank {rank}: {msg}\n")  # one write per line: ranks share the terminal
        sys.stderr.flush()

    t_start = time.perf_counter()
    kwargs = {"granularity": cfg.granularity} if cfg.granularity and cfg.driver == "host" else {}
    driver = make_driver(cfg.driver, rank=rank, **kwargs)
    projs = ffn_projections(H, I)
    shapes = {p.name: p.shape for p in projs}
    buf = ReferenceBuffer(S=T, H=H, K=K, E=E, num_ep_ranks=R, token_padding=cfg.token_padding, B=cfg.slots,
                          explicitly_destroy=True)
    B = buf.B
    store = ShardedExpertStore(num_layers=L, num_experts=E, projections=projs, num_slots=B, driver=driver)
    report: dict[str, Any] = {"rank": rank, "device": str(device), "slots": B}
    finished = False
    try:
        say(f"mapped {L} layers x {E} experts ({store.mapping_count} mappings), loading own experts")
        store.load(lambda layer, proj, e: expert_weight(cfg.seed, layer, proj, e, shapes[proj]).to(device))
        say(f"loaded {len(store.load_stats.experts_requested)} expert matrices in {store.load_stats.seconds:.2f}s")
        views = {(layer, p.name): store.gen_a(layer, p.name) for layer in range(L) for p in projs}
        recorder = CollectiveRecorder(views.values(), rows_per_tensor=E)

        gen = torch.Generator().manual_seed(_seed(cfg.seed, 3, rank))
        h = torch.randn(T, H, generator=gen).to(device=device, dtype=torch.bfloat16)
        layers_out = []
        with recorder:
            for layer in range(L):
                x = _rmsnorm(h)
                w_router, bias = _router(cfg.seed, layer, E, H)
                ids, weights = route(x, w_router, bias, cfg.skew, K)
                tpe = torch.bincount(ids.reshape(-1).long(), minlength=E).to(torch.int32)
                with recorder.phase("dispatch"):
                    hidden_nvsh, w_nvs, cu, plan = buf.dispatch(x, weights, ids, tpe)
                with recorder.phase("prefetch"):
                    buf.prefetch_weight(plan, full_gate_weight=views[(layer, "gate")],
                                        full_up_weight=views[(layer, "up")],
                                        full_down_weight=views[(layer, "down")])
                pf = buf.last_prefetch
                with recorder.phase("ffn"):
                    y_nvsh = grouped_ffn(hidden_nvsh, views[(layer, "gate")], views[(layer, "up")],
                                         views[(layer, "down")], cu, w_nvs)
                with recorder.phase("combine"):
                    y, _, _ = buf.combine(plan, y_nvsh)
                # Oracle, from weights regenerated from the seed (independent of the store).
                dense = {p: torch.stack([expert_weight(cfg.seed, layer, p, e, shapes[p]) for e in range(E)])
                         for p in _PROJ_CODE}
                ref = reference_moe(x.cpu(), ids.cpu(), weights.cpu(), dense["gate"], dense["up"], dense["down"])
                diff = (y.float().cpu() - ref).abs()
                within = bool(diff.max() <= cfg.rel_tol * ref.abs().max())
                slots_ok = all(torch.equal(views[(layer, p)][E + b].cpu(), dense[p][e])
                               for b, e, _ in plan.slot_sources for p in _PROJ_CODE)
                layers_out.append({
                    "layer": layer,
                    "tokens_received": plan.num_received,
                    "cu_seqlens_last": int(cu[-1]),
                    "prefetched": [{"slot": b, "expert": e, "owner": o,
                                    "pages_held_by": sorted(page_holders(store, "gate", e))}
                                   for b, e, o in plan.slot_sources],
                    "prefetch_bytes": pf.bytes,
                    "prefetch_copies": pf.copies,
                    "slots_hold_right_experts": slots_ok,
                    "max_abs_err": float(diff.max()),
                    "max_abs_ref": float(ref.abs().max()),
                    "within_tolerance": within,
                    "remote_experts_with_tokens": int(plan.remote_stats[0]),
                })
                h = h + y
                say(f"layer {layer}: {plan.num_received} rows, slots {[e for _, e, _ in plan.slot_sources]}, "
                    f"max |err| {float(diff.max()):.2e}")
        store.finish_loading()  # every rank done with the forward before slots are reused for timing
        remote, _ = split_by_holder(store, rank)
        bw: dict[str, Any] = {}
        for turn in range(R):  # one rank at a time: concurrent ranks would time each other's contention
            if turn == rank:
                bw = measure_pull(store, 0, remote, cfg.bandwidth_reps)
            store.finish_loading()
        phys = store.physical_bytes()
        report.update({
            "layers": layers_out,
            "tokens_received": sum(x["tokens_received"] for x in layers_out),
            "tokens_received_per_layer": [x["tokens_received"] for x in layers_out],
            "max_abs_err": max(x["max_abs_err"] for x in layers_out),
            "within_tolerance": all(x["within_tolerance"] for x in layers_out),
            "slots_ok": all(x["slots_hold_right_experts"] for x in layers_out),
            "physical": phys,
            "replicated_bytes": store.replicated_bytes(),
            "granularity": store.granularity,
            "prefetch_bandwidth": bw,
            "collectives": recorder.by_op(),
            "collectives_by_phase": {ph: recorder.by_op(ph) for ph in ("dispatch", "prefetch", "ffn", "combine")},
            "weight_collective_bytes": recorder.weight_bytes,
            "seconds": time.perf_counter() - t_start,
        })
        store.finish_loading()  # nobody unmaps while a peer may still read its pages
        finished = True
    finally:
        # Teardown is collective; after a failure on this rank only, peers are elsewhere in the
        # forward, so skip it (the process exits and the OS reclaims the memory) rather than pair
        # this rank's barrier with a peer's unrelated collective.
        if finished:
            buf.destroy()
            store.close()
            driver.close()
    return report


def run_demo(cfg: DemoConfig, progress: Optional[Callable[[str], None]] = None) -> dict[str, Any]:
    """Spawn the ranks, run :func:`demo_rank`, and summarise (raises ``RankFailure``)."""
    from .launch import plan_launch, run_ranks

    plan = plan_launch(cfg.driver, cfg.ranks)  # emulated CUDA: gloo, CPU tensors, one emulated GPU per rank
    backend = plan.backend
    t0 = time.perf_counter()
    per_rank = run_ranks(demo_rank, cfg.ranks, args=(dataclasses.asdict(cfg),), backend=backend,
                         use_cuda=plan.use_cuda, rank_envs=plan.rank_envs, progress=progress)
    received = [r["tokens_received"] for r in per_rank]
    weight_bytes = sum(r["weight_collective_bytes"] for r in per_rank)
    summary = {
        "ok": (all(r["within_tolerance"] and r["slots_ok"] for r in per_rank) and len(set(received)) == 1
               and weight_bytes == 0),
        "ranks": cfg.ranks,
        "driver": cfg.driver,
        "emulated": plan.emulated,
        "backend": backend,
        "model": {"name": cfg.model, "H": cfg.hidden, "I": cfg.intermediate, "E": cfg.experts, "K": cfg.top_k,
                  "layers": cfg.layers},
        "tokens_per_rank": cfg.tokens,
        "skew": cfg.skew,
        "slots_per_rank": per_rank[0]["slots"],
        "token_padding": cfg.token_padding,
        "tolerance": {"rel_tol": cfg.rel_tol, "rule": "max|err| <= rel_tol * max|ref| per layer"},
        "max_abs_err": max(r["max_abs_err"] for r in per_rank),
        "max_abs_err_per_rank": [r["max_abs_err"] for r in per_rank],
        "tokens_received": received,
        "tokens_received_per_layer": [r["tokens_received_per_layer"] for r in per_rank],
        "redundant_experts": [[[{"expert": p["expert"], "owner": p["owner"], "pages_held_by": p["pages_held_by"]}
                                for p in layer["prefetched"]] for layer in r["layers"]] for r in per_rank],
        "weight_allgather_bytes": weight_bytes,
        "collective_bytes_per_rank": [sum(v["bytes"] for v in r["collectives"].values()) for r in per_rank],
        "collectives_rank0": per_rank[0]["collectives_by_phase"],
        "expert_bytes_per_rank": [r["physical"]["total_bytes"] for r in per_rank],
        "expert_bytes_breakdown_per_rank": [r["physical"] for r in per_rank],
        "replicated_expert_bytes_per_rank": [r["replicated_bytes"] for r in per_rank],
        "granularity": per_rank[0]["granularity"],
        "prefetch_remote_gbps": [r["prefetch_bandwidth"]["remote_gbps"] for r in per_rank],
        "prefetch_local_gbps": [r["prefetch_bandwidth"]["local_gbps"] for r in per_rank],
        "prefetch_remote_over_local": [r["prefetch_bandwidth"]["ratio"] for r in per_rank],
        "prefetch_bench_bytes": [r["prefetch_bandwidth"]["bytes"] for r in per_rank],
        "seconds": time.perf_counter() - t0,
    }
    summary["per_rank"] = per_rank
    return summary


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def format_report(s: dict[str, Any]) -> str:
    """Human-readable report of :func:`run_demo`'s summary."""
    m = s["model"]
    lines = [
        f"moonep-ep demo: {s['ranks']} ranks ({s['driver']} driver, {s['backend']}), model {m['name']} "
        f"(H={m['H']} I={m['I']} E={m['E']} K={m['K']} layers={m['layers']}), {s['tokens_per_rank']} tokens/rank, "
        f"skew {s['skew']}, {s['slots_per_rank']} slots/rank",
        f"result: {'OK' if s['ok'] else 'FAILED'}  max |err| vs dense fp32 reference {s['max_abs_err']:.3e} "
        f"(pass: max |err| <= {s['tolerance']['rel_tol']:g} * max |ref| per layer)",
        f"weight bytes in collectives during the forward: {s['weight_allgather_bytes']} "
        f"(all collectives: {[_mib(b) for b in s['collective_bytes_per_rank']]} per rank, activations and plan)",
        "",
    ]
    for r in s["per_rank"]:
        phys, rep = r["physical"], r["replicated_bytes"]
        bw = r["prefetch_bandwidth"]
        lines.append(f"rank {r['rank']}: received {r['tokens_received']} token-expert rows "
                     f"({r['tokens_received_per_layer']} per layer), max |err| {r['max_abs_err']:.3e}")
        for layer in r["layers"]:
            pre = ", ".join(f"e{p['expert']}<-rank{p['owner']}" + ("" if p["pages_held_by"] == [p["owner"]]
                                                                    else f" (pages on {p['pages_held_by']})")
                            for p in layer["prefetched"]) or "none"
            lines.append(f"    layer {layer['layer']}: prefetched {pre}")
        lines.append(f"    expert memory: {_mib(phys['total_bytes'])} physical (experts {_mib(phys['expert_bytes'])}"
                     f" + slots {_mib(phys['slot_bytes'])}) vs {_mib(rep)} replicated "
                     f"({phys['total_bytes'] / rep:.1%})")
        if bw["remote_gbps"] is not None:
            lines.append(f"    pull prefetch: {bw['remote_gbps']:.2f} GB/s from peers' pages vs "
                         f"{bw['local_gbps']:.2f} GB/s local copy (ratio {bw['ratio']:.2f}, "
                         f"{_mib(bw['bytes'])} per trial)")
    return "\n".join(lines)


def resolve_config(*, ranks: int, skew: float, model: str, tokens: int, slots: Optional[int], driver: str,
                   granularity: Optional[int], layers: Optional[int], seed: int) -> DemoConfig:
    """Build a :class:`DemoConfig` from CLI values (raises ConfigError on a bad model/size)."""
    from ..errors import ConfigError

    spec = get_model(model)
    if driver == "auto":
        driver = "cuda" if (envs.MOONEP_EP_CUDA_EMULATOR or torch.cuda.is_available() and
                            torch.cuda.device_count() >= ranks) else "host"
    if granularity is None and driver == "host":
        granularity = envs.MOONEP_EP_HOST_GRANULARITY  # None: HostDriver's own default (2 MiB)
    cfg = DemoConfig.for_model(spec, ranks=ranks, skew=skew, tokens=tokens, slots=slots, driver=driver,
                               granularity=granularity, seed=seed)
    if layers is not None:
        cfg.layers = layers
    if cfg.experts % ranks:
        raise ConfigError(f"model {spec.name} has E={cfg.experts} experts, not a multiple of --ranks {ranks}. "
                          f"Fix: use --ranks dividing {cfg.experts}")
    return cfg
