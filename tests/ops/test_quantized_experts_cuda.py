"""Quantized experts on the CUDA path: the store's weight and scale rows in CUDA VMM memory, a slot fill through
the mapped rows, and the quantized expert FFN (``ops.experts.quantized``) on the device's views.

Over the CUDA driver emulator on 2 ranks in CI (``cuda_emulated``), and on a real GPU (2 ranks on one GPU,
``cuda``; part 1 of ``scripts/gpu_check.sh`` runs it with the other ``cuda`` tests). A GPU machine that runs
scripts/gpu_check.sh needs torch and cuda-bindings only, so the reference is built here from the codes
themselves: each format's values are drawn as codes (INT4 ``q - 8``, E2M1 codes, e4m3 values) and scales,
the dense reference is ``value · scale`` in fp32 (the formats' definitions: compressed-tensors' symmetric INT4, the OCP MX spec's
E2M1 × 2^(E8M0 - 127), DeepSeek-V3's ``weight · weight_scale_inv`` per 128×128 block), and the codes are
packed here in the documented bit order. The CPU tier checks the same dequantization against
compressed-tensors' own decompressor (``tests/vllm/test_quantized_controls.py``).

Negative control: a slot filled with its weight and another expert's (stale) scale must miss the reference.
vLLM's own quantized GPU kernels (Marlin, DeepGEMM; docs/design/vllm_quantized.md) need vLLM, which
scripts/gpu_check.sh does not need; they are not run here.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from moonep_ep.layout.formats import expert_projections, get_format
from moonep_ep.layout.store import ShardedExpertStore
from moonep_ep.ops.moonep.prefetch import pull_slots
from moonep_ep.ops.experts.quantized import quantized_grouped_ffn, views_of
from tests.support.memory import run_emulated_ranks

pytestmark = pytest.mark.slow

H, I, E, L = 256, 128, 8, 2
FORMATS = ("int4-g32", "mxfp4", "fp8-block")
#: OCP MX spec, E2M1: code -> value (codes 8..15 negative)
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
ENTRY_REL_TOL = 2.0 ** -6  # bf16 activations and output against the fp32 reference, per entry, scale-free


def _projection(fmt: str, layer: int, expert: int, name: str, out: int, inn: int) -> dict[str, torch.Tensor]:
    """``{"weight", "scale", "dense"}`` of one ``[out, inn]`` projection: codes and scales drawn from a seed
    every rank shares, the stored (packed) weight, and the dense fp32 value the format defines."""
    gen = torch.Generator().manual_seed(1000 * layer + 10 * expert + {"w13": 1, "w2": 2}[name])
    if fmt == "int4-g32":
        q = torch.randint(0, 16, (out, inn), generator=gen, dtype=torch.int32)  # stored q + 8, value q - 8
        scale = (torch.rand(out, inn // 32, generator=gen) * 0.02 + 0.005).to(torch.bfloat16)
        shifts = torch.arange(0, 32, 4, dtype=torch.int32)
        packed = (q.view(out, inn // 8, 8) << shifts).sum(-1, dtype=torch.int64)  # value i in bits 4i..4i+3
        packed = torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)
        dense = (q.float() - 8.0) * scale.float().repeat_interleave(32, -1)
        return {"weight": packed, "scale": scale, "dense": dense}
    if fmt == "mxfp4":
        codes = torch.randint(0, 16, (out, inn), generator=gen, dtype=torch.uint8)
        exponent = torch.randint(120, 124, (out, inn // 32), generator=gen, dtype=torch.uint8)
        packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # the first value in the low nibble
        dense = E2M1[codes.long()] * torch.exp2(exponent.float() - 127.0).repeat_interleave(32, -1)
        return {"weight": packed, "scale": exponent, "dense": dense}
    weight = (torch.randn(out, inn, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-out // 128), -(-inn // 128), generator=gen) * 1e-4 + 1e-5
    dense = weight.float() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:out, :inn]
    return {"weight": weight, "scale": scale, "dense": dense}


def _expert(fmt: str, layer: int, expert: int) -> dict[str, dict[str, torch.Tensor]]:
    return {"w13": _projection(fmt, layer, expert, "w13", 2 * I, H), "w2": _projection(fmt, layer, expert, "w2", H, I)}


def quantized_ffn_over_the_cuda_driver(ctx: Any, fmt: str) -> dict[str, Any]:
    from moonep_ep.memory import make_driver

    rank, world = ctx.rank, ctx.world_size
    epn = E // world
    f = get_format(fmt)
    projs = expert_projections(f, H, I)
    out: dict[str, Any] = {"format": fmt}
    with make_driver("cuda", rank=rank) as driver:
        dev = driver.torch_device
        store = ShardedExpertStore(num_layers=L, num_experts=E, projections=projs, num_slots=epn, driver=driver)
        try:
            def loader(layer: int, name: str, expert: int) -> torch.Tensor:
                proj, role = name.split("_", 1)
                return _expert(fmt, layer, expert)[proj]["scale" if role == f.scale_name else "weight"].to(dev)

            store.load(loader)  # own experts only; every rank reads the others' through its mappings
            layer = 1
            views = {p.name: store.pull_view(layer, p.name) for p in projs}
            out["device"] = str(views[projs[0].name].device)
            remote = [((rank + 1) % world) * epn + j for j in range(epn)]  # the next owner's experts
            tally: dict[str, int] = {}
            _, by_expert, event = pull_slots(views, remote, E, bytes_by_tensor=tally)
            if event is not None:
                event.synchronize()
            out["weight_bytes"] = sum(v for n, v in tally.items() if n.endswith(f.weight_name))
            out["scale_bytes"] = sum(v for n, v in tally.items() if n.endswith(str(f.scale_name)))
            # rows: 5 for each own expert, 3 for each slot; the groups in [E+B] order, the rest empty
            lengths = [5 if e // epn == rank else 0 for e in range(E)] + [3] * epn
            cu = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0).to(torch.int32).to(dev)
            gen = torch.Generator().manual_seed(7 + rank)
            x = (torch.randn(sum(lengths), H, generator=gen) * 0.5).to(torch.bfloat16)
            groups = [e for e in range(E) if e // epn == rank] + remote

            def reference() -> torch.Tensor:
                rows, start = [], 0
                for g, n in zip(groups, [5] * epn + [3] * epn):
                    w = _expert(fmt, layer, g)
                    xs = x[start:start + n].float()
                    gate_up = xs @ w["w13"]["dense"].T
                    rows.append((torch.nn.functional.silu(gate_up[:, :I]) * gate_up[:, I:]) @ w["w2"]["dense"].T)
                    start += n
                return torch.cat(rows)

            def worst_error() -> float:
                got = quantized_grouped_ffn(x.to(dev), fmt, *views_of(fmt, views), cu).float().cpu()
                ref = reference()
                return float(((got - ref).abs() / ref.abs().amax(dim=1, keepdim=True).clamp_min(1e-6)).max())

            out["max_entry_rel_err"] = worst_error()
            # negative control: slot 0 keeps its weight but gets another expert's scale (stale)
            scale_views = [n for n in views if n.endswith(str(f.scale_name))]
            stale_from = rank * epn  # one of this rank's own experts
            for n in scale_views:
                views[n][E].copy_(views[n][stale_from])
            out["stale_scale_err"] = worst_error()
            for n in scale_views:  # refill: the weight and its scale together again
                views[n][E].copy_(views[n][remote[0]])
            out["refilled_err"] = worst_error()
            del views
        finally:
            store.close()
            gc.collect()
        out["leaks"] = {k: v for k, v in driver.live_objects().items() if v}
    return out


def _check(results: list[dict[str, Any]], fmt: str) -> None:
    f = get_format(fmt)
    per_expert = {p.role: 0 for p in expert_projections(f, H, I)}
    for p in expert_projections(f, H, I):
        per_expert[p.role] += p.row_bytes
    for res in results:
        assert res["max_entry_rel_err"] < ENTRY_REL_TOL, res
        assert res["stale_scale_err"] > 10 * ENTRY_REL_TOL, res  # the control misses the reference
        assert res["refilled_err"] < ENTRY_REL_TOL, res
        # every slot's weights and scales moved, counted apart at the copy
        assert res["weight_bytes"] == (E // 2) * per_expert["weight"], res
        assert res["scale_bytes"] == (E // 2) * per_expert["scale"], res
        assert res["leaks"] == {}, res


@pytest.mark.cuda_emulated
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_experts_over_the_cuda_emulator(fmt):
    results = run_emulated_ranks(quantized_ffn_over_the_cuda_driver, 2, args=(fmt,))
    _check(results, fmt)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_experts_on_a_real_gpu(fmt):
    """Two ranks on one GPU (POSIX fds, gloo metadata): the store's rows, the fill and the FFN on the device."""
    from moonep_ep.launch import run_ranks

    results = run_ranks(quantized_ffn_over_the_cuda_driver, 2, args=(fmt,), backend="gloo", use_cuda=True,
                        timeout_s=300)
    assert all(r["device"].startswith("cuda") for r in results), results
    _check(results, fmt)
