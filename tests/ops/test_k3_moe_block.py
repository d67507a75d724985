"""Kimi K3's MoE block through MoonEP's path, every expert format and path, against a dense reference of the formula.

Two gloo ranks over the host driver. Around the path, as vLLM 0.33.0's ``KimiMoE`` does it outside MoonEP
(``tests/support/k3_moe_reference.py`` says where each step sits there): the router (sigmoid, top-k on the
biased scores, the unbiased scores renormalized), ``routed_expert_down_proj`` to the latent width ``L``, and
after the combine ``routed_expert_norm`` (RMSNorm on the K-summed latent), ``routed_expert_up_proj`` and the
shared experts on the full-width hidden, all at bf16 as the model runs them. The path under test: the
latent rows through ``ReferenceBuffer.dispatch``, the sharded store of each format (each rank loads only its
own experts), slot fills pulled from the owners (BF16: ``prefetch_weight``; quantized: the plugin's
``prefetch_quantized``, weights and scales), the experts with ``activation=GatedActivation("situ", 4, 25)``
(BF16: ``ops.experts.grouped.grouped_ffn``; INT4 g32, FP8 block, MXFP4:
``ops.experts.quantized.quantized_grouped_ffn``; MXFP4 again through the project's Triton kernel, ``vllm.experts.gpu.gpu_grouped_ffn``, under the interpreter in
the vLLM environment), and ``combine``. The rank code is ``tests/support/k3_block_check.py``. The router leans on rank 0's experts (their score-correction bias is larger), so rank 0 is
overloaded and rank 1's slots are filled from rank 0's memory and computed.

The oracle (:func:`k3_moe_block`) is fp32 from the formats' exact values (``k3_moe_reference.quantize``).
Controls, each a bug of the system side run through the same path, must exceed the bound: SiLU for SiTU,
SiTU without ``linear_beta``, the bias in the route weights as well as in the choice, the norm skipped.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from moonep_ep.launch import run_ranks
from tests.support.k3_block_check import BOUND, CONTROLS, CPU_KINDS, RANKS, TRITON_KINDS, block_rank
from tests.support.k3_moe_reference import K3MoEWeights, k3_moe_block, token_rel_errors
from tests.support.vllm_envs import run_json

@pytest.fixture(scope="module")
def ranks():
    return run_ranks(block_rank, RANKS, args=(CPU_KINDS,), timeout_s=240)


def test_situ_saturation_matters_on_these_inputs(ranks, report):
    """Gate outputs past beta and up outputs past linear_beta on the chosen (token, expert) pairs, else a SiLU
    run or a dropped linear_beta could pass (measured: about 0.3 and 0.07)."""
    for r in ranks:
        assert r["gate_past_beta"] > 0.05 and r["up_past_linear_beta"] > 0.02, r
    report("[K3 MoE block] fraction of chosen experts' gate outputs past +-4: "
           + ", ".join(f"rank {r['rank']} {r['gate_past_beta']:.3f}" for r in ranks)
           + "; up outputs past +-25: " + ", ".join(f"rank {r['rank']} {r['up_past_linear_beta']:.3f}" for r in ranks))


def _check_block(ranks: list, kinds: tuple, report: Any) -> None:
    # rank 1's slots are filled from rank 0's memory, and rows are computed in them
    remote = [(b, e, owner) for b, e, owner in ranks[1]["slot_sources"] if owner == 0]
    assert remote, ranks[1]["slot_sources"]
    assert any(ranks[1]["slot_rows"][str(b)] > 0 for b, _, _ in remote), ranks[1]["slot_rows"]
    for kind in kinds:
        for r in ranks:
            res = r["kinds"][kind]
            assert res["slots_hold_owner_rows"] and res["finite"], (r["rank"], kind, res)
            assert 0 <= res["max_token_rel_err"] <= BOUND, (r["rank"], kind, res)
            assert set(res["controls"]) == set(CONTROLS)
            for name, err in res["controls"].items():
                assert err > BOUND, (r["rank"], kind, name, err)
        worst = max(r["kinds"][kind]["max_token_rel_err"] for r in ranks)
        ctl = {n: min(r["kinds"][kind]["controls"][n] for r in ranks) for n in CONTROLS}
        report(f"[K3 MoE block, {kind}] max token rel err {worst:.2e} <= {BOUND:.2e}; controls (least over ranks): "
               + ", ".join(f"{n} {v:.2e}" for n, v in ctl.items()))


def test_the_k3_moe_block_matches_the_dense_reference_and_every_control_fails(ranks, report):
    """bf16, INT4 g32, FP8 block and MXFP4 through the CPU experts."""
    _check_block(ranks, CPU_KINDS, report)


@pytest.mark.slow
def test_the_k3_moe_block_through_the_mxfp4_triton_experts(report):
    """The same block with the MXFP4 Triton experts (``gpu_grouped_ffn``) under the interpreter, in the vLLM
    environment (Triton), over the same buffer, store and slot fills."""
    out = run_json("vllm", ["-m", "tests.support.k3_block_check", "--json"], timeout=300)
    assert all(r["mended"] == ["bf16 dot", "downcasts"] for r in out["ranks"])
    _check_block(out["ranks"], TRITON_KINDS, report)


# -- gpu_check.sh part 7 (checks/gpu/k3.py) where there is no GPU ---------------------------------------------

def _unpack_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of MXFP4 bytes by this file's reference module (even element in the low nibble)."""
    from tests.support.k3_moe_reference import e2m1_from_bits

    codes = torch.stack((packed & 0xF, packed >> 4), -1).flatten(-2)
    values = e2m1_from_bits(codes)
    return (values.unflatten(-1, (values.shape[-1] // 32, 32)) * torch.exp2(scale.float() - 127).unsqueeze(-1)
            ).flatten(-2)


def test_the_gpu_parts_reference_is_the_oracles_formula():
    """The GPU part builds its reference apart from ``tests/support`` (a check imports no test code): on its own
    drawn layer (tiny widths), its fp32 block equals :func:`k3_moe_block`, and the drawn experts saturate SiTU
    there too. Control: the oracle with any of the four bugs differs from it."""
    from checks.gpu import k3 as gpu_k3

    dims = gpu_k3.K3Dims(hidden=256, latent=128, inter=128, shared=256, experts=8, top_k=4, tokens=16)
    cpu = torch.device("cpu")
    views = gpu_k3._views(dims, cpu)
    w = gpu_k3.draw_layer(dims, views, cpu, seed=3)
    x = torch.randn(dims.tokens, dims.hidden, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    E, inter = dims.experts, dims.inter
    w13 = _unpack_mxfp4(views["w13_weight_packed"][:E], views["w13_weight_scale"][:E])
    w2 = _unpack_mxfp4(views["w2_weight_packed"][:E], views["w2_weight_scale"][:E])
    ref = gpu_k3.reference_block(x, w, {e: (w13[e], w2[e]) for e in range(E)}, dims.top_k)
    oracle = K3MoEWeights(router=w["router"].float(), bias=w["bias"], down_proj=w["down_proj"].float(),
                          norm_weight=w["norm_weight"].float(), up_proj=w["up_proj"].float(), gate=w13[:, :inter],
                          up=w13[:, inter:], down=w2, shared_gate=w["shared_gate"].float(),
                          shared_up=w["shared_up"].float(), shared_down=w["shared_down"].float(), top_k=dims.top_k)
    want = k3_moe_block(x, oracle)
    assert float(token_rel_errors(ref["out"], want).max()) < 1e-5
    assert ref["gate_past_beta"] > 0.05 and ref["up_past_linear_beta"] > 0.02, ref
    for bug in ("silu", "ignore_linear_beta", "bias_in_weights", "skip_norm"):
        assert float(token_rel_errors(ref["out"], k3_moe_block(x, oracle, **{bug: True})).max()) > BOUND, bug


def test_the_gpu_part_says_why_it_cannot_run_here(capsys):
    from checks.gpu import k3 as gpu_k3, mxfp4 as gpu_mxfp4

    why = gpu_mxfp4.missing_preconditions()
    assert why  # this environment has no GPU (and no Triton)
    assert gpu_k3.main(["--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"check": "k3_moe_layer", "not_applicable": "; ".join(why),
                                                   "ok": None}


@pytest.mark.slow
def test_the_gpu_part_passes_under_the_triton_interpreter_and_its_controls_fail(report):
    """``tests/support/gpu_k3_interpreted.py`` in the vLLM environment (it has Triton): the GPU part's own
    functions at a tiny shape, the project's MXFP4 Triton experts with SiTU, one expert read from slot 0."""
    out = run_json("vllm", ["-m", "tests.support.gpu_k3_interpreted", "--json"], timeout=300,
                   env={"CUDA_VISIBLE_DEVICES": ""})
    assert out["mended"] == ["bf16 dot", "downcasts"] and out["finite"] and out["slot_expert_chosen"]
    assert out["gate_past_beta"] > 0.05 and out["up_past_linear_beta"] > 0.02, out
    assert 0 <= out["max_token_rel_err"] <= out["bound"] == BOUND, out
    assert set(out["controls"]) == set(CONTROLS) and all(v > BOUND for v in out["controls"].values()), out
    assert out["ok"] is True
    report(f"[K3 MoE layer, MXFP4 Triton experts, interpreter] max token rel err {out['max_token_rel_err']:.2e} "
           f"<= {BOUND:.2e}; controls " + ", ".join(f"{k} {v:.2e}" for k, v in out["controls"].items())
           + f" ({out['seconds']} s)")
