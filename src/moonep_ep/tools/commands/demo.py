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
3. per layer: :meth:`ReferenceBuffer.dispatch`, pull
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
   same bytes (:func:`moonep_ep.tools.bench.prefetch.measure_pull`).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import Any, Callable, Optional

import torch

from ... import envs
from ...models import MoEModelConfig, get_model
from ...ops.experts.grouped import ENTRY_REL_TOL, TOKEN_REL_TOL

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
    token_rel_tol: float = TOKEN_REL_TOL  # pass: per-token max|err| <= tol * max|ref_t| (bf16 oracle)
    entry_rel_tol: float = ENTRY_REL_TOL  # and per (token, k) expert row, scale-free
    fault: Optional[str] = None  # negative controls: swap_cold_experts | drop_lowest_weight

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
    from ...layout.store import ShardedExpertStore, ffn_projections
    from ...memory import make_driver
    from ...ops.moonep.pull import ReferenceBuffer
    from ...ops.experts.grouped import grouped_ffn, reference_moe, reference_moe_bf16, token_rel_errors
    from ...ops.moonep.instrument import CollectiveRecorder
    from ..bench.prefetch import measure_pull, page_holders, split_by_holder

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
        gen = torch.Generator().manual_seed(_seed(cfg.seed, 3, rank))
        h = torch.randn(T, H, generator=gen).to(device=device, dtype=torch.bfloat16)
        report["fault"] = _inject_fault(cfg, store, shapes, h, device)
        views = {(layer, p.name): store.pull_view(layer, p.name) for layer in range(L) for p in projs}
        recorder = CollectiveRecorder(views.values(), rows_per_tensor=E)
        layers_out, entries = [], []
        with recorder:
            for layer in range(L):
                x = _rmsnorm(h)
                w_router, bias = _router(cfg.seed, layer, E, H)
                ids, weights = route(x, w_router, bias, cfg.skew, K)
                tpe = torch.bincount(ids.reshape(-1).long(), minlength=E).to(torch.int32)
                sent = weights
                if cfg.fault == "drop_lowest_weight" and rank == 0 and layer == 0:
                    sent = weights.clone()  # token 0 loses its lowest-weight expert on the MoonEP path only
                    sent[0, int(weights[0].argmin())] = 0.0
                with recorder.phase("dispatch"):
                    hidden_nvsh, w_nvs, cu, plan = buf.dispatch(x, sent, ids, tpe)
                with recorder.phase("prefetch"):
                    buf.prefetch_weight(plan, full_gate_weight=views[(layer, "gate")],
                                        full_up_weight=views[(layer, "up")],
                                        full_down_weight=views[(layer, "down")])
                pf = buf.last_prefetch
                with recorder.phase("ffn"):
                    y_nvsh = grouped_ffn(hidden_nvsh, views[(layer, "gate")], views[(layer, "up")],
                                         views[(layer, "down")], cu, w_nvs)
                entries.append((x.cpu(), ids.cpu(), weights.cpu(), plan.dst.cpu(), y_nvsh.cpu()))
                with recorder.phase("combine"):
                    y, _, _ = buf.combine(plan, y_nvsh)
                # Oracles, from weights regenerated from the seed (independent of the store).
                dense = {p: torch.stack([expert_weight(cfg.seed, layer, p, e, shapes[p]) for e in range(E)])
                         for p in _PROJ_CODE}
                args = (x.cpu(), ids.cpu(), weights.cpu(), dense["gate"], dense["up"], dense["down"])
                ref_bf16 = reference_moe_bf16(*args)
                ref_fp32 = reference_moe(*args)
                rel = token_rel_errors(y.cpu(), ref_bf16)
                slots_ok = all(torch.equal(views[(layer, p)][E + b].cpu(), dense[p][e])
                               for b, e, _ in plan.slot_sources for p in _PROJ_CODE)
                worst = int(rel.argmax())
                layers_out.append({
                    "layer": layer,
                    "tokens_received": plan.num_received,
                    "cu_seqlens_last": int(cu[-1]),
                    "prefetched": [{"slot": b, "expert": e, "owner": o,
                                    "pages_held_by": sorted(page_holders(store, "gate", e))}
                                   for b, e, o in plan.slot_sources],
                    "prefetch_bytes": pf.bytes,
                    "prefetch_remote_bytes": pf.remote_bytes,
                    "prefetch_bytes_by_owner": {str(o): n for o, n in sorted(pf.bytes_by_owner.items())},
                    "prefetch_copies": pf.copies,
                    "slots_hold_right_experts": slots_ok,
                    "max_token_rel_err": float(rel.max()),
                    "worst_token": worst,
                    "tokens_over_tolerance": int((rel > cfg.token_rel_tol).sum()),
                    "max_abs_err_vs_fp32": float((y.float().cpu() - ref_fp32).abs().max()),
                    "max_abs_ref": float(ref_fp32.abs().max()),
                    "remote_experts_with_tokens": int(plan.remote_stats[0]),
                })
                h = h + y
                say(f"layer {layer}: {plan.num_received} rows, slots {[e for _, e, _ in plan.slot_sources]}, "
                    f"max per-token rel err {float(rel.max()):.2e}")
        for layer, checked in enumerate(_check_entries(cfg, entries, buf.NvS, shapes)):
            layers_out[layer].update(checked)
        store.finish_loading()  # every rank done with the forward before slots are reused for timing
        remote, _ = split_by_holder(store, rank)
        bw: dict[str, Any] = {}
        for turn in range(R):  # one rank at a time: concurrent ranks would time each other's contention
            if turn == rank:
                bw = measure_pull(store, 0, remote, cfg.bandwidth_reps)
            store.finish_loading()
        report.update({
            "layers": layers_out,
            "tokens_received": sum(x["tokens_received"] for x in layers_out),
            "tokens_received_per_layer": [x["tokens_received"] for x in layers_out],
            **_error_summary(layers_out),
            "slots_ok": all(x["slots_hold_right_experts"] for x in layers_out),
            "prefetch_remote_bytes": sum(x["prefetch_remote_bytes"] for x in layers_out),
            "physical": store.physical_bytes(),
            "measured_bytes": _measured_store_bytes(driver, store, rank),
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


def _error_summary(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The correctness figures of several layers (or ranks) as one: worst errors, total failures."""
    return {"max_token_rel_err": max(x["max_token_rel_err"] for x in parts),
            "tokens_over_tolerance": sum(x["tokens_over_tolerance"] for x in parts),
            "max_entry_rel_err": max(x["max_entry_rel_err"] for x in parts),
            "entries_over_tolerance": sum(x["entries_over_tolerance"] for x in parts),
            "max_abs_err_vs_fp32": max(x["max_abs_err_vs_fp32"] for x in parts)}


def _check_entries(cfg: DemoConfig, entries: list, NvS: int, shapes: dict[str, tuple[int, int]]
                   ) -> list[dict[str, Any]]:
    """Every ``(token, k)`` expert row of every layer against the bf16 row oracle (collective).

    Each rank fetches the rows its entries landed on (every rank's FFN output is
    all-gathered: a test harness step, outside the recorded forward) through its
    plan's ``dst``, and compares each with :func:`reference_rows_bf16` computed
    from its own token, the expert it routed to, the route weight it chose, and
    weights regenerated from the seed. Scale-free per entry: a cold expert's row
    is checked as strictly as a hot one's, whatever its route weight."""
    import torch.distributed as dist

    from ...ops.experts.grouped import reference_rows_bf16, token_rel_errors

    out = []
    for layer, (x, ids, weights, dst, y_nvsh) in enumerate(entries):
        shards = [torch.empty_like(y_nvsh) for _ in range(dist.get_world_size())]
        dist.all_gather(shards, y_nvsh)
        raw = torch.where(dst >= 0, dst, -dst - 1).to(torch.int64)
        rows = torch.stack([shards[int(r) // NvS][int(r) % NvS] for r in raw.tolist()])
        dense = {p: torch.stack([expert_weight(cfg.seed, layer, p, e, shapes[p]) for e in range(cfg.experts)])
                 for p in _PROJ_CODE}
        ref = reference_rows_bf16(x.repeat_interleave(cfg.top_k, dim=0), ids.reshape(-1), weights.reshape(-1),
                                  dense["gate"], dense["up"], dense["down"])
        rel = token_rel_errors(rows, ref)
        out.append({"max_entry_rel_err": float(rel.max()), "worst_entry": int(rel.argmax()),
                    "entries_over_tolerance": int((rel > cfg.entry_rel_tol).sum())})
    return out


def _measured_store_bytes(driver: Any, store: Any, rank: int) -> dict[str, Any]:
    """This rank's physical expert and slot bytes as the memory system reports them.

    Host driver: the OS (``st_size`` of this rank's memfds, by allocation tag, and the
    pages actually resident). CUDA: the sizes of the driver's live allocation handles."""
    if driver.name == "host":
        from ...memory.accounting import snapshot

        mem = snapshot(rank)
        return {"source": "OS: /proc/self/fd memfds of this rank (st_size, st_blocks)",
                "expert_bytes": mem.own_bytes_by_tag.get("experts", 0),
                "slot_bytes": mem.own_bytes_by_tag.get("slots", 0),
                "total_bytes": mem.own_bytes, "resident_bytes": mem.own_resident_bytes}
    sizes = [driver.handle_size(h) for h in store.symm.own_handles()]
    return {"source": f"{driver.name} driver: sizes of this rank's live allocation handles",
            "expert_bytes": sizes[0] if sizes else 0, "slot_bytes": sum(sizes[1:]),
            "total_bytes": sum(sizes), "resident_bytes": None}


def _inject_fault(cfg: DemoConfig, store: Any, shapes: dict[str, tuple[int, int]], h: torch.Tensor,
                  device: torch.device) -> Optional[dict[str, Any]]:
    """Negative controls of the correctness rule (``cfg.fault``); the oracle never sees them.

    ``swap_cold_experts``: the two least-used experts of layer 0 that still get a token
    trade rows in the store (each owner writes the other's weights into its own row).
    ``drop_lowest_weight`` is applied in the forward (rank 0, layer 0, token 0)."""
    if cfg.fault != "swap_cold_experts":
        return {"kind": cfg.fault} if cfg.fault else None
    import torch.distributed as dist

    E = cfg.experts
    w_router, bias = _router(cfg.seed, 0, E, cfg.hidden)
    ids, _ = route(_rmsnorm(h), w_router, bias, cfg.skew, cfg.top_k)
    counts = torch.bincount(ids.reshape(-1).long().cpu(), minlength=E)
    dist.all_reduce(counts)  # the same global counts on every rank, so every rank picks the same pair
    used = [e for e in range(E) if int(counts[e]) > 0]
    a, b = sorted(used, key=lambda e: (int(counts[e]), e))[:2]
    epn = store.experts_per_rank
    for mine, other in ((a, b), (b, a)):
        if mine // epn == store.rank:
            for p, shape in shapes.items():
                store.owner_view(0, p)[mine - store.rank * epn].copy_(
                    expert_weight(cfg.seed, 0, p, other, shape).to(device))
    store.finish_loading()
    return {"kind": "swap_cold_experts", "experts": [a, b], "tokens": [int(counts[a]), int(counts[b])]}


#: Where every figure of ``moonep-ep demo --json`` comes from (a test checks each key is listed).
FIGURE_SOURCES: dict[str, str] = {
    "max_token_rel_err": "measured: max over tokens of max|out - oracle| / max|oracle|, oracle = dense bf16-emulated "
                         "MoE from weights regenerated from the seed (ops.experts.reference_moe_bf16)",
    "max_token_rel_err_per_rank": "measured: as max_token_rel_err, per rank",
    "tokens_over_tolerance": "measured: tokens (all ranks and layers) whose error exceeds the tolerance",
    "max_entry_rel_err": "measured: max over (token, k) entries of max|row - oracle row| / max|oracle row|, the "
                         "row read back through the plan's dst (ops.experts.reference_rows_bf16)",
    "entries_over_tolerance": "measured: (token, k) entries whose row error exceeds entry_rel_tol",
    "max_abs_err_vs_fp32": "measured: max |out - fp32 dense MoE| (informational; the rule uses the bf16 oracle)",
    "tokens_received": "measured: rows each rank's shard received, summed over layers (counted at placement)",
    "tokens_received_per_layer": "measured: as tokens_received, per layer",
    "redundant_experts": "measured: the plan's slots filled per rank and layer (expert, owner, page holders)",
    "prefetch_remote_bytes_per_rank": "measured: bytes the prefetch copies read from rows another rank owns, "
                                      "counted at each copy (ops.moonep.prefetch.pull_slots)",
    "weight_allgather_bytes": "measured: expert-weight bytes found in any torch.distributed collective "
                              "(ops.moonep.instrument.CollectiveRecorder, alias and content match)",
    "collective_bytes_per_rank": "measured: bytes of every collective of the forward (recorder)",
    "collectives_rank0": "measured: rank 0's collectives by phase (recorder)",
    "expert_bytes_per_rank": "measured: see expert_bytes_source (OS memfd sizes on the host driver; the CUDA "
                             "driver's allocation handles on CUDA)",
    "expert_bytes_breakdown_per_rank": "measured: experts / slots / resident bytes, same source",
    "layout_bytes_per_rank": "derived: the store's page plan (layout.plan), for comparison with the measurement",
    "replicated_expert_bytes_per_rank": "derived: L*(E+B)*3*row bytes, vLLM 0.33.0's all-gathered [E+B] layout",
    "granularity": "measured: the driver's allocation granularity",
    "prefetch_remote_gbps": "measured: GB/s of the fastest trial of slot <- peer-held rows "
                            "through the mapping",
    "prefetch_local_gbps": "measured: GB/s of the fastest trial of slot <- the same bytes from "
                           "this rank's own memory",
    "prefetch_remote_over_local": "derived: prefetch_remote_gbps / prefetch_local_gbps",
    "prefetch_bench_bytes": "measured: bytes copied per bandwidth trial",
    "seconds": "measured: wall time of the run",
}


def run_demo(cfg: DemoConfig, progress: Optional[Callable[[str], None]] = None) -> dict[str, Any]:
    """Spawn the ranks, run :func:`demo_rank`, and summarise (raises ``RankFailure``)."""
    from ...launch import DEFAULT_RANK_TIMEOUT_S, plan_launch, run_ranks

    plan = plan_launch(cfg.driver, cfg.ranks)  # emulated CUDA: gloo, CPU tensors, one emulated GPU per rank
    backend = plan.backend
    t0 = time.perf_counter()
    # The ranks time the pull one at a time (demo_rank's bandwidth turns) while the others wait in a barrier:
    # that wait lasts as long as a peer's measurement, bounded by the run's own bound, not MOONEP_EP_TIMEOUT_S
    # (a peer that dies is still reported at once, by the launcher).
    per_rank = run_ranks(demo_rank, cfg.ranks, args=(dataclasses.asdict(cfg),), backend=backend,
                         use_cuda=plan.use_cuda, rank_envs=plan.rank_envs, progress=progress,
                         group_timeout_s=DEFAULT_RANK_TIMEOUT_S)
    received = [r["tokens_received"] for r in per_rank]
    weight_bytes = sum(r["weight_collective_bytes"] for r in per_rank)
    measured = [r["measured_bytes"] for r in per_rank]
    summary = {
        "ok": (all(r["tokens_over_tolerance"] == 0 and r["entries_over_tolerance"] == 0 and r["slots_ok"]
                   for r in per_rank)
               and len(set(received)) == 1 and weight_bytes == 0),
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
        "fault": per_rank[0]["fault"],
        "tolerance": {"token_rel_tol": cfg.token_rel_tol, "entry_rel_tol": cfg.entry_rel_tol,
                      "rule": "per token: max|out - oracle| <= token_rel_tol * max|oracle|, and per (token, k) "
                              "expert row: max|row - oracle row| <= entry_rel_tol * max|oracle row|; oracles = "
                              "dense MoE rounded to bf16 where the MoonEP path rounds, weights regenerated"},
        **_error_summary(per_rank),
        "max_token_rel_err_per_rank": [r["max_token_rel_err"] for r in per_rank],
        "tokens_received": received,
        "tokens_received_per_layer": [r["tokens_received_per_layer"] for r in per_rank],
        "redundant_experts": [[[{"expert": p["expert"], "owner": p["owner"], "pages_held_by": p["pages_held_by"]}
                                for p in layer["prefetched"]] for layer in r["layers"]] for r in per_rank],
        "prefetch_remote_bytes_per_rank": [r["prefetch_remote_bytes"] for r in per_rank],
        "weight_allgather_bytes": weight_bytes,
        "collective_bytes_per_rank": [sum(v["bytes"] for v in r["collectives"].values()) for r in per_rank],
        "collectives_rank0": per_rank[0]["collectives_by_phase"],
        "expert_bytes_per_rank": [m["total_bytes"] for m in measured],
        "expert_bytes_source": measured[0]["source"],
        "expert_bytes_breakdown_per_rank": [{k: m[k] for k in ("expert_bytes", "slot_bytes", "resident_bytes")}
                                            for m in measured],
        "layout_bytes_per_rank": [r["physical"]["total_bytes"] for r in per_rank],
        "replicated_expert_bytes_per_rank": [r["replicated_bytes"] for r in per_rank],
        "granularity": per_rank[0]["granularity"],
        "prefetch_remote_gbps": [r["prefetch_bandwidth"]["remote_gbps"] for r in per_rank],
        "prefetch_local_gbps": [r["prefetch_bandwidth"]["local_gbps"] for r in per_rank],
        "prefetch_remote_over_local": [r["prefetch_bandwidth"]["ratio"] for r in per_rank],
        "prefetch_bench_bytes": [r["prefetch_bandwidth"]["bytes"] for r in per_rank],
        "seconds": time.perf_counter() - t0,
        "figure_sources": FIGURE_SOURCES,
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
        f"result: {'OK' if s['ok'] else 'FAILED'}  max per-token relative error vs the bf16-emulated dense "
        f"oracle {s['max_token_rel_err']:.2e} (pass: <= {s['tolerance']['token_rel_tol']:g} for every token; "
        f"{s['tokens_over_tolerance']} over)" + (f"; fault injected: {s['fault']}" if s["fault"] else ""),
        f"weight bytes in collectives during the forward: {s['weight_allgather_bytes']} "
        f"(all collectives: {[_mib(b) for b in s['collective_bytes_per_rank']]} per rank, activations and plan)",
        "",
    ]
    for r in s["per_rank"]:
        phys, rep = r["measured_bytes"], r["replicated_bytes"]
        bw = r["prefetch_bandwidth"]
        lines.append(f"rank {r['rank']}: received {r['tokens_received']} token-expert rows "
                     f"({r['tokens_received_per_layer']} per layer), max per-token rel err "
                     f"{r['max_token_rel_err']:.2e}, {_mib(r['prefetch_remote_bytes'])} prefetched from peers")
        for layer in r["layers"]:
            pre = ", ".join(f"e{p['expert']}<-rank{p['owner']}" + ("" if p["pages_held_by"] == [p["owner"]]
                                                                    else f" (pages on {p['pages_held_by']})")
                            for p in layer["prefetched"]) or "none"
            lines.append(f"    layer {layer['layer']}: prefetched {pre}")
        lines.append(f"    expert memory: {_mib(phys['total_bytes'])} physical, measured (experts "
                     f"{_mib(phys['expert_bytes'])} + slots {_mib(phys['slot_bytes'])}) vs {_mib(rep)} replicated "
                     f"(derived; {phys['total_bytes'] / rep:.1%})")
        if bw["remote_gbps"] is not None:
            lines.append(f"    pull prefetch: {bw['remote_gbps']:.2f} GB/s from peers' pages vs "
                         f"{bw['local_gbps']:.2f} GB/s local copy (ratio {bw['ratio']:.2f}, "
                         f"{_mib(bw['bytes'])} per trial, fastest of {bw['trials']})")
    return "\n".join(lines)


def resolve_config(*, ranks: int, skew: float, model: str, tokens: int, slots: Optional[int], driver: str,
                   granularity: Optional[int], layers: Optional[int], seed: int) -> DemoConfig:
    """Build a :class:`DemoConfig` from CLI values (raises ConfigError on a bad model/size). ``driver`` is
    "host" or "cuda", as ``launch.plan_one_gpu_per_rank`` resolved it."""
    from ...errors import ConfigError

    spec = get_model(model)
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
