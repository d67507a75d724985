"""``moonep-ep bench decode``: what MoonEP's planner moves per MoE layer at decode, per padding policy.

For Kimi K2 / K3 shapes, EP sizes and ``n`` real tokens per rank (random
top-k routing, seeded), every figure comes from running the project's planner
(``ops/moonep/planner.py``, MoonEP's algorithm) on the padded counts, as the plugin's
prepare step would hand them to ``Buffer.dispatch``. Policies:

* ``vllm-0.33.0``: capacity padding routed to expert 0 (vLLM's ``_pad_to_capacity``);
* ``padding-fixed``: the plugin's balanced padding (``ops/decode/padding.py``);
* ``fixed+cost-model``: balanced padding, and the capacity (``S`` or ``2S``) whose
  derived step time is lower; the slot budget ``B`` of that capacity from the
  cost model (``ops/decode/cost.py``).

Per plan: remote experts (a destination computing entries of an expert another
rank owns: the expert's bytes leave the owner, into a slot or read by the
GEMM), bytes, the busiest owner's egress, the busiest rank's rows (padding
included: MoonEP computes ``S*K`` rows on every rank) and its real rows.
Times are **derived** from the GPU profile. The crossover ``n`` is the smallest
``n`` (the sweep's, then ``--crossover-n``) at which the padding-fixed plan
moves an expert whose rows make its copy pay. On a GPU the bench also **measures** the copy bandwidth of one
expert's bytes (HBM, and peer-to-peer with two GPUs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any, Sequence

import torch

from ...models import get_model
from ...ops.decode.cost import FORMATS, PROFILES, cost_model
from ...ops.decode.padding import expert_padding
from ...ops.moonep.padding import real_entries
from ...ops.moonep.planner import plan_dispatch

__all__ = ["add_arguments", "run", "plan_step", "sweep"]

DEFAULT_FORMATS = {"kimi-k2": ("bf16", "fp8-block", "int4-g32"), "kimi-k3": ("bf16", "mxfp4")}
POLICIES = ("vllm-0.33.0", "padding-fixed", "fixed+cost-model")
MIN_CAPACITY = 128          # vLLM's MOONEP_MIN_DISPATCH_TOKENS
MAX_TOKENS_PER_RANK = 8192  # vLLM's default max_num_batched_tokens: the pool's largest capacity


def capacity_for(n: int) -> int:
    """vLLM's MoonEPBufferPool.capacity_for."""
    if n >= MAX_TOKENS_PER_RANK:
        return MAX_TOKENS_PER_RANK
    return min(max(1 << max(n - 1, 0).bit_length(), MIN_CAPACITY), MAX_TOKENS_PER_RANK)


def routing_counts(R: int, n: int, E: int, K: int, seed: int) -> torch.Tensor:
    """``[R, E]`` real entries: every rank's ``n`` tokens route to ``K`` distinct experts, uniformly.

    Each token draws ``K`` experts uniformly and redraws all ``K`` while two coincide: every ordered tuple of
    distinct experts is equally likely, so every set of ``K`` is. O(n K) per rank; the top-k of ``n x E``
    random keys it replaces took 8 s at EP 64, n = 8192, E = 384."""
    if not 0 < K <= E:
        raise ValueError(f"top-k {K} of {E} experts: K must be in 1..E")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(E, (R * n, K), generator=gen)
    pending = torch.arange(R * n)  # rows that may hold a clash: all, then only the ones just redrawn
    while True:
        ordered = ids[pending].sort(dim=1).values
        pending = pending[(ordered[:, 1:] == ordered[:, :-1]).any(dim=1)]
        if not pending.numel():
            break
        ids[pending] = torch.randint(E, (pending.numel(), K), generator=gen)
    rank = torch.arange(R).repeat_interleave(n * K)
    return torch.bincount(rank * E + ids.reshape(-1), minlength=R * E).reshape(R, E)


def plan_step(real: torch.Tensor, policy: str, S: int, K: int) -> dict[str, Any]:
    """Plan one step of real counts ``real`` at capacity ``S`` with ``policy``'s padding."""
    R, E = real.shape
    epn = E // R
    n = [int(x) // K for x in real.sum(1).tolist()]
    loads = real.reshape(R, R, epn).sum((0, 2)).tolist()
    pad = expert_padding("vllm" if policy == "vllm-0.33.0" else "balanced", n, loads, S=S, K=K, E=E, R=R)
    plan = plan_dispatch(real + pad, S=S, K=K, E=E, R=R, B=epn)
    alloc = plan.alloc.to(torch.int64)                            # [E, R]
    owner = torch.arange(E) // epn
    remote = (alloc > 0) & (owner[:, None] != torch.arange(R)[None, :])
    real_alloc = real_entries(plan, pad)
    moved_rows = torch.where(remote, alloc, torch.zeros_like(alloc))
    per_owner = torch.zeros(R, dtype=torch.int64).index_add_(0, owner, remote.sum(1).to(torch.int64))
    slots_used = int(remote.sum(0).clamp_max(epn).max())
    return {"S": S, "remote_experts": int(remote.sum()), "busiest_rank_weight_rows": epn + slots_used, "busiest_owner_experts": int(per_owner.max()),
            "busiest_rank_rows": int(alloc.sum(0).max()), "busiest_rank_real_rows": int(real_alloc.sum(0).max()),
            "padding_only_remote": int((remote & (real_alloc == 0)).sum()),
            "moved_rows": moved_rows[remote].tolist()}


def _with_bytes(step: dict[str, Any], cm: Any, K: int) -> dict[str, Any]:
    out = {k: v for k, v in step.items() if k != "moved_rows"}
    out["bytes_moved"] = step["remote_experts"] * cm.expert_bytes
    out["busiest_owner_egress_bytes"] = step["busiest_owner_experts"] * cm.expert_bytes
    out["paying_copies"] = sum(1 for rows in step["moved_rows"] if cm.copy_pays(rows))
    out["derived_copy_ms"] = round(cm.copy_seconds(step["busiest_owner_experts"]) * 1e3, 4)
    out["derived_rows_ms"] = round(cm.rows_seconds(step["busiest_rank_rows"]) * 1e3, 4)
    # A rank reads its experts' weights once (HBM) and computes its rows; the slower bounds the layer.
    out["derived_weights_read_ms"] = round(step["busiest_rank_weight_rows"] * cm.expert_bytes / cm.hbm_bw * 1e3, 4)
    out["derived_step_ms"] = round(out["derived_copy_ms"] + max(out["derived_rows_ms"],
                                                                 out["derived_weights_read_ms"]), 4)
    out["slot_budget_B"] = cm.slot_budget(step["S"], K, step.get("epn", 0))
    return out


def sweep(model_name: str, formats: Sequence[str], eps: Sequence[int], ns: Sequence[int], profile: str,
          seed: int, progress: Any = None, extra_ns: Sequence[int] = ()) -> dict[str, Any]:
    model = get_model(model_name)
    E, K = model.num_experts, model.top_k
    models = {fmt: cost_model(model, fmt, profile) for fmt in formats}
    rows, crossover, moved = [], {}, {}
    for R in eps:
        if E % R:
            continue
        for n in ns:
            real = routing_counts(R, n, E, K, seed + 1000 * R + n)
            S = capacity_for(n)
            steps = {"vllm-0.33.0": plan_step(real, "vllm-0.33.0", S, K),
                     "padding-fixed": plan_step(real, "padding-fixed", S, K)}
            bumped = plan_step(real, "padding-fixed", 2 * S, K) if 2 * S <= MAX_TOKENS_PER_RANK else None
            moved[(R, n)] = steps["padding-fixed"]["moved_rows"]
            for step in [*steps.values(), bumped]:
                if step is not None:
                    step["epn"] = E // R
            for fmt, cm in models.items():
                entry = {"model": model_name, "format": fmt, "ep": R, "n": n, "S": S}
                fixed = _with_bytes(steps["padding-fixed"], cm, K)
                choice = dict(fixed)
                if bumped is not None:
                    alt = _with_bytes(bumped, cm, K)
                    if alt["derived_step_ms"] < fixed["derived_step_ms"]:
                        choice = dict(alt)
                    # Why: the other capacity's derived time (moves at S are a group's overflow past S*K,
                    # which the planner must place elsewhere; 2S lets the padding absorb it).
                    other = fixed if choice["S"] == alt["S"] else alt
                    choice["rejected"] = {"S": other["S"], "remote_experts": other["remote_experts"],
                                          "derived_step_ms": other["derived_step_ms"]}
                entry["policies"] = {"vllm-0.33.0": _with_bytes(steps["vllm-0.33.0"], cm, K),
                                     "padding-fixed": fixed, "fixed+cost-model": choice}
                rows.append(entry)
                key = f"{fmt}/EP{R}"
                if fixed["paying_copies"] and key not in crossover:
                    crossover[key] = n
            if progress:
                progress(f"{model_name} EP{R} n={n}: planned")
        for n in extra_ns:   # the crossover only: the padding-fixed plan at larger n
            if n not in ns:
                real = routing_counts(R, n, E, K, seed + 1000 * R + n)
                moved[(R, n)] = plan_step(real, "padding-fixed", capacity_for(n), K)["moved_rows"]
                if progress:
                    progress(f"{model_name} EP{R} n={n}: planned (crossover)")
        for fmt in formats:
            crossover.setdefault(f"{fmt}/EP{R}", None)
    return {"rows": rows, "crossover_n": crossover, "moved_rows": moved,
            "cost_model": {fmt: cm.describe() for fmt, cm in models.items()}}


def crossover_by_profile(model_name: str, formats: Sequence[str], moved: dict[tuple[int, int], list[int]]
                         ) -> dict[str, Any]:
    """Smallest swept ``n`` whose padding-fixed plan (``moved[(R, n)]``: rows of each moved expert, from
    :func:`sweep`) moves an expert whose copy pays, per profile, format and EP size."""
    model = get_model(model_name)
    out: dict[str, Any] = {p: {} for p in PROFILES}
    for R in sorted({r for r, _ in moved}):
        ns = sorted(n for r, n in moved if r == R)
        largest = max((max(moved[(R, n)], default=0) for n in ns), default=0)
        for p in PROFILES:
            for fmt in formats:
                cm = cost_model(model, fmt, p)
                hit = next((n for n in ns if any(cm.copy_pays(r) for r in moved[(R, n)])), None)
                out[p][f"{fmt}/EP{R}"] = {"crossover_n": hit, "rows_to_pay": cm.rows_to_pay,
                                         "largest_moved_rows": largest}
    return out


def measure_copy(nbytes: int, trials: int = 10) -> dict[str, Any]:
    """Measured on a GPU: GB/s of copying ``nbytes`` (one expert) within HBM, and peer-to-peer with 2 GPUs."""
    if not torch.cuda.is_available():
        return {"measured": False, "why": "no CUDA GPU here: copy bandwidth not measured"}
    out: dict[str, Any] = {"measured": True, "device": torch.cuda.get_device_name(), "bytes": nbytes}
    pairs = [("hbm", 0, 0)] + ([("peer", 1, 0)] if torch.cuda.device_count() > 1 else [])
    for label, src_dev, dst_dev in pairs:
        src = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{src_dev}")
        dst = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dst_dev}")
        times = []
        with torch.cuda.device(dst_dev):
            for _ in range(trials + 2):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src, non_blocking=True)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
        med = statistics.median(times[2:])
        out[f"{label}_gbps"] = round(nbytes / med / 1e9, 1)
        out[f"{label}_ms"] = round(med * 1e3, 4)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default="kimi-k2,kimi-k3", help="comma-separated (default: kimi-k2,kimi-k3)")
    p.add_argument("--formats", default=None, help="comma-separated weight formats for every model "
                   f"({', '.join(FORMATS)}); default: BF16 and each model's real formats")
    p.add_argument("--ep", default="8,16,32,64", help="EP sizes (default 8,16,32,64)")
    p.add_argument("--n", default="1,2,4,8,16,32,64,128,256,512,1024", help="real tokens per rank")
    p.add_argument("--crossover-n", default="2048,4096,8192",
                   help="further n planned for the crossover only (default 2048,4096,8192; up to vLLM's 8192)")
    p.add_argument("--profile", default=None, choices=sorted(PROFILES),
                   help="GPU profile of the derived times (default: MOONEP_EP_GPU_PROFILE / the visible GPU / h200)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the whole result as JSON")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def run(args: argparse.Namespace) -> int:
    from ...ops.decode.cost import detect_profile

    profile = args.profile or detect_profile()
    eps, ns = _ints(args.ep), _ints(args.n)
    result: dict[str, Any] = {"profile": profile, "profile_source": PROFILES[profile].source,
                              "labels": {"derived_*": "derived from the GPU profile, not measured",
                                         "everything else": "computed by running the project's planner"},
                              "models": {}}
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        formats = args.formats.split(",") if args.formats else DEFAULT_FORMATS.get(name, ("bf16",))
        res = sweep(name, formats, eps, ns, profile, args.seed,
                    progress=lambda msg: print(msg, file=sys.stderr, flush=True),
                    extra_ns=_ints(args.crossover_n or ""))
        res["crossover_by_profile"] = crossover_by_profile(name, formats, res.pop("moved_rows"))
        result["models"][name] = res
    first = next(iter(result["models"].values()))
    nbytes = next(iter(first["cost_model"].values()))["expert_bytes"]
    result["copy_bandwidth"] = measure_copy(nbytes)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(render(result))
    return 0


def render(result: dict[str, Any]) -> str:
    lines = [f"GPU profile: {result['profile']} ({result['profile_source']}); times are derived"]
    for name, res in result["models"].items():
        for fmt, cm in res["cost_model"].items():
            lines.append(f"{name} {fmt}: {cm['expert_bytes']:,} B/expert; a copy pays above "
                         f"{cm['rows_to_pay']} rows taken off the busiest rank")
        lines.append(f"{'model':8} {'fmt':10} {'EP':>3} {'n':>5} {'S':>5} | " + " | ".join(
            f"{p:>28}" for p in POLICIES))
        lines.append(" " * 37 + " | ".join(f"{'moved  owner_GB  ms(derived)':>28}" for _ in POLICIES))
        for row in res["rows"]:
            cells = []
            for p in POLICIES:
                st = row["policies"][p]
                cells.append(f"{st['remote_experts']:>5} {st['busiest_owner_egress_bytes'] / 1e9:>9.3f} "
                             f"{st['derived_step_ms']:>12.3f}")
            lines.append(f"{name:8} {row['format']:10} {row['ep']:>3} {row['n']:>5} {row['S']:>5} | "
                         + " | ".join(f"{c:>28}" for c in cells))
        for p, table in res["crossover_by_profile"].items():
            lines.append(f"crossover n ({p}): " + ", ".join(
                f"{k}: {v['crossover_n'] if v['crossover_n'] is not None else 'none <= max n'}"
                for k, v in table.items()))
    bw = result["copy_bandwidth"]
    lines.append("copy bandwidth: " + (json.dumps(bw) if bw.get("measured") else bw["why"]))
    return "\n".join(lines)
