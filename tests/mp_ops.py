"""Rank bodies for the reference-buffer tests (importable by spawned ranks; return plain data)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moonep_ep.errors import CollectiveError, ConfigError
from moonep_ep.layout.store import ShardedExpertStore, ffn_projections
from moonep_ep.memory.host import HostDriver
from moonep_ep.ops.buffer import ReferenceBuffer
from moonep_ep.ops.experts import grouped_ffn, reference_moe
from moonep_ep.ops.instrument import CollectiveRecorder
from moonep_ep.ops.planner import entry_dst

PROJ = ("gate", "up", "down")
SENTINEL = -7.0  # bf16-exact value no expert row holds (N(0, 1/in) weights)


def expert_weight(seed: int, layer: int, proj: str, expert: int, shape) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 100_003 + layer * 1009 + PROJ.index(proj) * 101 + expert)
    return (torch.randn(shape, generator=gen) / math.sqrt(shape[1])).to(torch.bfloat16)


def dense_weights(seed: int, layer: int, E: int, H: int, I: int) -> dict[str, torch.Tensor]:
    shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    return {p: torch.stack([expert_weight(seed, layer, p, e, shapes[p]) for e in range(E)]) for p in PROJ}


def rank_inputs(seed: int, case: int, src: int, T: int, H: int, E: int, K: int, skew: float):
    """Tokens, top-k ids (int32) and route weights (fp32) of rank ``src`` in ``case`` (any rank can rebuild them)."""
    gen = torch.Generator().manual_seed(seed * 7919 + case * 131 + src)
    x = (torch.randn(T, H, generator=gen)).to(torch.bfloat16)
    shared = torch.Generator().manual_seed(seed * 31 + case)  # the skew bias is the same on every rank
    bias = torch.randn(E, generator=shared)
    logits = torch.randn(T, E, generator=gen) + skew * bias
    top, ids = torch.topk(logits, K, dim=-1)
    return x, ids.to(torch.int32), torch.softmax(top, dim=-1)


def bf16_path_dense(x, ids, w, W) -> torch.Tensor:
    """The grouped path's rounding points, per expert, without dispatch (bf16 [T, H])."""
    T, H = x.shape
    out = torch.zeros(T, H, dtype=torch.float32)
    tok = torch.arange(T).repeat_interleave(ids.shape[1])
    flat, fw = ids.reshape(-1).long(), w.reshape(-1)
    for e in flat.unique().tolist():
        sel = flat == e
        xe = x[tok[sel]]
        act = F.silu(xe @ W["gate"][e].T)
        act.mul_(xe @ W["up"][e].T)
        act.mul_(fw[sel].to(torch.bfloat16)[:, None])
        out.index_add_(0, tok[sel], (act @ W["down"][e].T).float())
    return out.to(torch.bfloat16)


def build_store(ctx: Any, H: int, I: int, E: int, layers: int, gran: int, seed: int) -> ShardedExpertStore:
    driver = HostDriver(rank=ctx.rank, granularity=gran)
    shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    store = ShardedExpertStore(num_layers=layers, num_experts=E, projections=ffn_projections(H, I),
                               num_slots=E // ctx.world_size, driver=driver, gen_b=True)
    store.load(lambda layer, proj, e: expert_weight(seed, layer, proj, e, shapes[proj]))
    return store


def forward_cases(ctx: Any, H: int, I: int, E: int, K: int, gran: int, cases: list, seed: int = 1) -> dict:
    """dispatch → prefetch → FFN → combine for every (skew, tokens) case, with all side checks."""
    rank, R = ctx.rank, ctx.world_size
    layers = 2
    store = build_store(ctx, H, I, E, layers, gran, seed)
    dense = [dense_weights(seed, layer, E, H, I) for layer in range(layers)]
    views = {(layer, p): store.gen_a(layer, p) for layer in range(layers) for p in PROJ}
    recorder = CollectiveRecorder(views.values(), rows_per_tensor=E)
    results = []
    buffers: dict[int, ReferenceBuffer] = {}
    for ci, (skew, T) in enumerate(cases):
        layer = ci % layers  # alternate layers: one slot pool serves both
        buf = buffers.get(T) or buffers.setdefault(T, ReferenceBuffer(T, H, K, E, R, explicitly_destroy=True))
        W = dense[layer]
        inputs = [rank_inputs(seed, ci, r, T, H, E, K, skew) for r in range(R)]
        x, ids, w = inputs[rank]
        tpe = torch.bincount(ids.reshape(-1).long(), minlength=E).to(torch.int32)
        res: dict[str, Any] = {"skew": skew, "T": T}
        for b in range(buf.B):  # mark this rank's slots: unused ones must survive the prefetch
            for p in PROJ:
                views[(layer, p)][E + b].fill_(SENTINEL)
        with recorder:
            with recorder.phase("dispatch"):
                hidden_nvsh, w_nvs, cu, plan = buf.dispatch(x, w, ids, tpe)
            with recorder.phase("prefetch"):
                buf.prefetch_weight(plan, full_gate_weight=views[(layer, "gate")], full_up_weight=views[(layer, "up")],
                                    full_down_weight=views[(layer, "down")])
            y_nvsh = grouped_ffn(hidden_nvsh, views[(layer, "gate")], views[(layer, "up")], views[(layer, "down")],
                                 cu, w_nvs)
            with recorder.phase("combine"):
                y, none_w, none_ev = buf.combine(plan, y_nvsh)
            # combine∘dispatch round trip (identity FFN), weights gathered back.
            with recorder.phase("roundtrip"):
                back, back_w, _ = buf.combine(plan, hidden_nvsh, w_nvs)
                re_hidden, re_w, re_cu, re_plan = buf.dispatch(x, w, plan=plan)
        gp = plan.global_plan
        ref = reference_moe(x, ids, w, W["gate"], W["up"], W["down"])
        emu = bf16_path_dense(x, ids, w, W)
        res["max_abs_err"] = float((y.float() - ref).abs().max())
        res["max_abs_ref"] = float(ref.abs().max())
        res["max_abs_vs_bf16_path"] = float((y.float() - emu.float()).abs().max())
        res["combine_extras_none"] = none_w is None and none_ev is None
        res["roundtrip_exact"] = torch.equal(back, (x.float() * K).to(torch.bfloat16))
        res["roundtrip_weights_exact"] = back_w is not None and torch.equal(back_w, w)
        end = int(cu[-1])
        res["reuse_same_rows"] = (re_cu is None and re_plan is plan and torch.equal(re_hidden[:end], hidden_nvsh[:end])
                                  and torch.equal(re_w[:end], w_nvs[:end]))
        res["received"] = plan.num_received
        res["cap"] = int(gp.cap[rank])
        res["cu_matches_planner"] = torch.equal(cu, gp.cu_seqlens[rank]) and cu.dtype == torch.int32 \
            and tuple(cu.shape) == (E + buf.B,)
        res["NvS"] = (tuple(hidden_nvsh.shape), buf._ctx["NvS"], T * K + (128 - 1) * 2 * (E // R))
        # §5 dispatch math, checked against every source rank's tokens (rebuilt locally).
        bad_rows = bad_w = 0
        for src, (xs, ids_s, ws) in enumerate(inputs):
            d_src = entry_dst(gp, src, ids_s).to(torch.int64)
            raw = torch.where(d_src >= 0, d_src, -d_src - 1)
            mine = (raw // buf.NvS) == rank
            loffs = raw[mine] % buf.NvS
            toks = torch.nonzero(mine).squeeze(1) // K
            bad_rows += int((hidden_nvsh[loffs] != xs[toks]).any(dim=1).sum())
            bad_w += int((w_nvs[loffs] != ws.reshape(-1)[mine]).sum())
        res["bad_rows"], res["bad_weights"] = bad_rows, bad_w
        pad = [(int(a), int(n)) for a, n in plan.zero_fill_ranges.tolist() if n > 0]
        res["padding_zero"] = all(bool((hidden_nvsh[a:a + n] == 0).all()) and bool((w_nvs[a:a + n] == 0).all())
                                  for a, n in pad)
        res["ffn_tail_zero"] = bool((y_nvsh[end:] == 0).all())
        # Slots: used ones hold the right expert, unused ones untouched.
        used = {b: e for b, e, _ in plan.slot_sources}
        res["slots_used"] = sorted(used.values())
        res["slots_right"] = all(torch.equal(views[(layer, p)][E + b], W[p][e]) for b, e in used.items() for p in PROJ)
        res["unused_untouched"] = all(bool((views[(layer, p)][E + b] == SENTINEL).all())
                                      for b in range(buf.B) if b not in used for p in PROJ)
        res["experts_to_copy"] = plan.experts_to_copy.tolist()
        res["dup_counts"] = plan.dup_counts.tolist()
        res["dups_hold_primary_row"] = all(
            torch.equal(hidden_nvsh[int(plan.dup_loffs[s0 + j])], hidden_nvsh[int(prim)])
            for prim, s0, n in plan.dup_groups[:int(plan.dup_counts[0])].tolist() for j in range(n))
        res["n_dup_entries_sent"] = int((plan.dst < 0).sum())
        res["weight_bytes"] = recorder.weight_bytes
        res["prefetch_ops"] = sorted(recorder.by_op("prefetch"))
        res["ops"] = sorted(recorder.by_op())
        recorder.calls.clear()
        results.append(res)
    for buf in buffers.values():
        buf.destroy()
    extra = prefetch_from_owner(ctx, store, views, E, K, H, seed)
    extra["push"] = push_matches_pull(ctx, store, views, E, H, K, seed)
    store.finish_loading()
    store.close()
    return {"cases": results, **extra}


def _skewed_plan(buf: ReferenceBuffer, ctx: Any, E: int, K: int, H: int, T: int, seed: int):
    """A dispatch whose plan fills slots on every rank but 0: all tokens pick experts 0..K-1,
    which rank 0 owns (K <= E/R), so rank 0's group overflows and every other rank receives
    some of it."""
    x, _, w = rank_inputs(seed, 999, ctx.rank, T, H, E, K, skew=0.0)
    ids = torch.arange(K, dtype=torch.int32).repeat(T, 1)
    tpe = torch.bincount(ids.reshape(-1).long(), minlength=E).to(torch.int32)
    return buf.dispatch(x, w, ids, tpe)


def prefetch_from_owner(ctx: Any, store: ShardedExpertStore, views: dict, E: int, K: int, H: int, seed: int) -> dict:
    """Prefetch reads the owner's *current* memory, with no collective at all (lockstep checks off)."""
    rank, R = ctx.rank, ctx.world_size
    epn = E // R
    layer = 0
    buf = ReferenceBuffer(64, H, K, E, R, lockstep_checks=False, explicitly_destroy=True)
    hidden_nvsh, w_nvs, cu, plan = _skewed_plan(buf, ctx, E, K, H, 64, seed)
    # Every owner rewrites its own rows in place (local stores only), then all sync.
    for p in PROJ:
        own = store.owner_view(layer, p)
        own.mul_(-2)
    store.finish_loading()
    rec = CollectiveRecorder([views[(layer, p)] for p in PROJ], rows_per_tensor=E)
    with rec:
        buf.prefetch_weight(plan, full_gate_weight=views[(layer, "gate")], full_up_weight=views[(layer, "up")],
                            full_down_weight=views[(layer, "down")])
    shapes = {"gate": store.projections[0].shape, "up": store.projections[1].shape, "down": store.projections[2].shape}
    fresh_ok = all(torch.equal(views[(layer, p)][E + b], expert_weight(seed, layer, p, e, shapes[p]) * -2)
                   for b, e, _ in plan.slot_sources for p in PROJ)
    remote_owner = all(o != rank for _, _, o in plan.slot_sources)
    # Positive control: a vLLM-0.33.0-style all-gather of the local experts is detected.
    control = CollectiveRecorder([views[(layer, p)] for p in PROJ], rows_per_tensor=E)
    with control:
        local = store.owner_view(layer, "gate").contiguous().clone()
        gathered = torch.empty(R * epn, *local.shape[1:], dtype=local.dtype)
        dist.all_gather_into_tensor(gathered, local)
        bcast = store.owner_view(layer, "down").clone() if rank == 0 else torch.empty_like(store.owner_view(layer, "down"))
        dist.broadcast(bcast, src=0)
    for p in PROJ:  # restore
        store.owner_view(layer, p).div_(-2)
    store.finish_loading()
    buf.destroy()
    row_gate, row_down = store.projections[0].row_bytes, store.projections[2].row_bytes
    return {
        "owner_read": {
            "slots": plan.slot_sources, "fresh_ok": fresh_ok, "remote_owner": remote_owner,
            "collectives_during_prefetch": len(rec.calls),
            "pulled_bytes": buf.last_prefetch.bytes,
            "control_weight_bytes": control.weight_bytes,
            "control_expected": R * epn * row_gate + epn * row_down,  # lower bound: payload received
            "control_ops": sorted(control.by_op()),
        }
    }


def push_matches_pull(ctx: Any, store: ShardedExpertStore, views: dict, E: int, H: int, K: int, seed: int) -> dict:
    """Gen B push into every rank's [R, epn] pool leaves the same slots (and FFN output) as the Gen A pull."""
    layer = 1
    buf = ReferenceBuffer(64, H, K, E, ctx.world_size, explicitly_destroy=True)
    hidden_nvsh, w_nvs, cu, plan = _skewed_plan(buf, ctx, E, K, H, 64, seed + 1)
    full = dict(full_gate_weight=views[(layer, "gate")], full_up_weight=views[(layer, "up")],
                full_down_weight=views[(layer, "down")])
    for p in PROJ:
        views[(layer, p)][E:].fill_(SENTINEL)
    store.finish_loading()
    buf.prefetch_weight(plan, **full)
    pulled = {p: views[(layer, p)][E:].clone() for p in PROJ}
    y_pull = grouped_ffn(hidden_nvsh, views[(layer, "gate")], views[(layer, "up")], views[(layer, "down")], cu, w_nvs)
    store.finish_loading()  # everyone has read its pulled slots before peers push into them
    for p in PROJ:
        views[(layer, p)][E:].fill_(SENTINEL)
    store.finish_loading()
    buf.prefetch_weight(plan, local_gate_weight=store.owner_view(layer, "gate"),
                        local_up_weight=store.owner_view(layer, "up"), local_down_weight=store.owner_view(layer, "down"),
                        gate_prefetch_buffer=store.gen_b_pool(layer, "gate"),
                        up_prefetch_buffer=store.gen_b_pool(layer, "up"),
                        down_prefetch_buffer=store.gen_b_pool(layer, "down"))
    pushed_equal = all(torch.equal(views[(layer, p)][E:], pulled[p]) for p in PROJ)
    y_push = grouped_ffn(hidden_nvsh, views[(layer, "gate")], views[(layer, "up")], views[(layer, "down")], cu, w_nvs)
    stats = buf.last_prefetch
    buf.destroy()
    return {"slots": plan.slot_sources, "pushed_equal": pushed_equal, "ffn_equal": torch.equal(y_pull, y_push),
            "push_copies": stats.copies, "generation": stats.generation}


def worked_example(ctx: Any) -> dict:
    """The contract's §4.10 example through the buffer (R=2, E=4, K=2, s=S=4, tp=4, B=2, H=128)."""
    topk = {0: [0, 1, 0, 1, 0, 2, 1, 0], 1: [0, 1, 1, 0, 0, 3, 0, 1]}[ctx.rank]
    ids = torch.tensor(topk, dtype=torch.int32).view(4, 2)
    x = (torch.arange(4 * 128, dtype=torch.float32).view(4, 128) / 64 + 100 * ctx.rank).to(torch.bfloat16)
    w = torch.rand(4, 2)
    buf = ReferenceBuffer(4, 128, 2, 4, 2, token_padding=4, B=2, explicitly_destroy=True)
    tpe = torch.bincount(ids.reshape(-1).long(), minlength=4).to(torch.int32)
    hidden_nvsh, w_nvs, cu, plan = buf.dispatch(x, w, ids, tpe)
    out = {"NvS": buf._ctx["NvS"], "dst": plan.dst.tolist(), "cu": cu.tolist(),
           "zero_fill": plan.zero_fill_ranges.tolist(), "etc": plan.experts_to_copy.tolist(),
           "remote_stats": plan.remote_stats.tolist(), "dup_counts": plan.dup_counts.tolist()}
    back, back_w, _ = buf.combine(plan, hidden_nvsh, w_nvs)
    out["roundtrip_exact"] = torch.equal(back, (x.float() * 2).to(torch.bfloat16)) and torch.equal(back_w, w)
    buf.destroy()
    return out


# ---------------------------------------------------------------------------
# bad input: every rank must raise, and the group must stay usable


def _attempt(fn) -> tuple[str, str]:
    try:
        fn()
        return ("no error", "")
    except (CollectiveError, ConfigError) as exc:
        return (type(exc).__name__, str(exc))


def bad_inputs(ctx: Any) -> dict:
    rank, R = ctx.rank, ctx.world_size
    H, K, E, S = 256, 2, 8, 8
    buf = ReferenceBuffer(S, H, K, E, R, explicitly_destroy=True)
    x, ids, w = rank_inputs(5, 0, rank, S, H, E, K, 1.0)
    tpe = torch.bincount(ids.reshape(-1).long(), minlength=E).to(torch.int32)
    views = {p: torch.zeros(E + buf.B, *(shape), dtype=torch.bfloat16)
             for p, shape in (("gate", (128, H)), ("up", (128, H)), ("down", (H, 128)))}
    out: dict[str, tuple[str, str]] = {}

    def on(r, bad, good):
        return bad if rank == r else good

    out["hidden_dtype"] = _attempt(lambda: buf.dispatch(on(1, x.float(), x), w, ids, tpe))
    out["hidden_width"] = _attempt(lambda: buf.dispatch(on(0, torch.zeros(S, H + 128, dtype=torch.bfloat16), x),
                                                        w, ids, tpe))
    big = torch.zeros(S + 1, H, dtype=torch.bfloat16)
    big_ids = torch.zeros(S + 1, K, dtype=torch.int32)
    big_tpe = torch.bincount(big_ids.reshape(-1).long(), minlength=E).to(torch.int32)
    out["s_gt_S"] = _attempt(lambda: buf.dispatch(on(1, big, x), None, on(1, big_ids, ids), on(1, big_tpe, tpe)))
    out["topk_dtype"] = _attempt(lambda: buf.dispatch(x, w, ids.long(), tpe))
    out["weights_dtype"] = _attempt(lambda: buf.dispatch(x, on(0, w.to(torch.bfloat16), w), ids, tpe))
    shifted = tpe.clone()
    shifted[0] += 1
    shifted[1] -= 1
    out["tpe_mismatch"] = _attempt(lambda: buf.dispatch(x, w, ids, on(1, shifted, tpe)))
    bad_ids = ids.clone()
    bad_ids[0, 0] = E
    out["topk_range"] = _attempt(lambda: buf.dispatch(x, w, on(0, bad_ids, ids), tpe))
    s0 = 3 if rank == 0 else 5
    x_s, ids_s, w_s = x[:s0].contiguous(), ids[:s0].contiguous(), w[:s0].contiguous()
    tpe_s = torch.bincount(ids_s.reshape(-1).long(), minlength=E).to(torch.int32)
    out["s_disagree"] = _attempt(lambda: buf.dispatch(x_s, w_s, ids_s, tpe_s))
    out["E_not_divisible"] = _attempt(lambda: ReferenceBuffer(S, H, K, 7, R))
    out["H_not_128"] = _attempt(lambda: ReferenceBuffer(S, 200, K, E, R))
    out["ctor_disagree"] = _attempt(lambda: ReferenceBuffer(S + rank, H, K, E, R))
    out["num_ep_ranks"] = _attempt(lambda: ReferenceBuffer(S, H, K, E, R + 1))
    hidden_nvsh, w_nvs, cu, plan = buf.dispatch(x, w, ids, tpe)  # a good call between bad ones
    odd = dict(views, gate=torch.zeros(E + buf.B, 100, H, dtype=torch.bfloat16))
    out["prefetch_dims"] = _attempt(lambda: buf.prefetch_weight(plan, **{f"full_{p}_weight": t for p, t in
                                                                        on(1, odd, views).items()}))
    short = dict(views, up=views["up"][:E])
    out["prefetch_rows"] = _attempt(lambda: buf.prefetch_weight(plan, **{f"full_{p}_weight": t for p, t in
                                                                        on(0, short, views).items()}))
    out["combine_shape"] = _attempt(lambda: buf.combine(plan, on(1, hidden_nvsh[:-1], hidden_nvsh)))
    out["combine_no_plan"] = _attempt(lambda: buf.combine(on(0, None, plan), hidden_nvsh))
    # The group is still in lockstep: a full good round trip works.
    buf.prefetch_weight(plan, **{f"full_{p}_weight": t for p, t in views.items()})
    back, _, _ = buf.combine(plan, hidden_nvsh)
    ok_after = torch.equal(back, (x.float() * K).to(torch.bfloat16))
    # varlen: ranks route different s when total_num_tokens says so (the s_disagree fix).
    hv, wv, cuv, pv = buf.dispatch(x_s, w_s, ids_s, tpe_s, total_num_tokens=8)
    back_v, back_w, _ = buf.combine(pv, hv, wv)
    varlen_ok = (torch.equal(back_v, (x_s.float() * K).to(torch.bfloat16)) and torch.equal(back_w, w_s)
                 and pv.num_tokens == s0 and int(cuv[-1]) <= pv.nvs_s and pv.num_received == int(pv.global_plan.cap[rank]))
    buf.destroy()
    destroyed = _attempt(lambda: buf.dispatch(x, w, ids, tpe))
    return {"cases": out, "ok_after": ok_after, "varlen_ok": varlen_ok, "destroyed": destroyed}
