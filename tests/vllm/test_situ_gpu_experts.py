"""The GPU experts (``vllm/experts/gpu.gpu_grouped_ffn``: INT4 g32, FP8 block, MXFP4) compute SiTU, under the
Triton interpreter in the vllm==0.33.0 environment (``tests/support/situ_gpu_experts_check.py``).

Same inputs, reference and bound as ``tests/ops/test_situ_experts.py`` (dense fp32 SiTU with beta 4 and
linear_beta 25, written from vLLM's formula; FP8's activations quantized per 1x128 as vLLM's torch path does);
controls SiLU and SiTU without linear_beta must miss the bound. Also what vLLM declares: ``MoEActivation``'s
values, the betas' fields on ``FusedMoEConfig``, and ``MoonEPExperts._supports_activation`` refusing SiTU until
``overlap.patch_experts`` makes it accept SiTU (GELU stays refused). Measured (2-core machine, Dec 4): 25 s in
the subprocess (about 10 s of it importing vLLM), 0.5-1.4 s per interpreted FFN call; SiTU max row error 8.2e-3
(INT4), 3.8e-3 (FP8 block), 8.3e-3 (MXFP4); controls 0.84-2.40.
"""

from __future__ import annotations

import pytest

from tests.ops.test_situ_experts import BOUND, MIN_SATURATED
from tests.support.vllm_envs import run_json

pytestmark = pytest.mark.slow


def test_triton_experts_of_every_format_compute_situ_and_the_controls_miss(report):
    out = run_json("vllm", ["-m", "tests.support.situ_gpu_experts_check"], timeout=300)
    v = out["vllm"]
    assert v["values"] == {"SILU": "silu", "SITU": "situ"}
    assert v["config_fields"] == ["activation_situ_beta", "activation_situ_linear_beta"]
    assert v["supports_before_patch"] == {"silu": True, "situ": False, "gelu": False}
    assert v["patched"] and v["supports_after_patch"] == {"silu": True, "situ": True, "gelu": False}
    assert v["situ_of_enum"] == ["situ", 4.0, 25.0]
    assert "'gelu'" in v["gelu_refusal"] and "Fix:" in v["gelu_refusal"]
    assert set(out["formats"]) == {"int4-g32", "fp8-block", "mxfp4"}
    for fmt, r in out["formats"].items():
        sat, err = r["saturation"], r["errors"]
        assert sat["gate_past_beta"] > MIN_SATURATED and sat["up_past_linear_beta"] > MIN_SATURATED, (fmt, sat)
        assert r["tail_untouched"] and r["dtype"] == "bfloat16"
        assert err["situ"] <= BOUND, (fmt, err)
        assert err["silu"] > BOUND and err["situ_without_linear_beta"] > BOUND, (fmt, err)
        report(f"[situ triton {fmt}] max row err {err['situ']:.2e} <= {BOUND:.0e}; controls silu {err['silu']:.2f}, "
               f"situ_without_linear_beta {err['situ_without_linear_beta']:.2f}; gate past 4 "
               f"{sat['gate_past_beta']:.1%}, up past 25 {sat['up_past_linear_beta']:.1%} "
               f"({sum(r['seconds'].values()):.1f} s interpreted)")
    report(f"[situ triton] {out['seconds']} s in the vLLM environment")
