"""The BF16 experts' CUDA branch (``overlap.apply`` -> ``bf16_gpu.py``: vLLM's unquantized ``fused_moe_kernel``,
the fused activation, own groups, wait, slots bounded on the device) against a dense reference, under the Triton
interpreter in the vllm==0.33.0 environment (``tests/support/bf16_gpu_experts_check.py``).

Measured (2-core machine, Dec 7): 13.6-17.1 s in the subprocess, vLLM's import included; 0.15-0.3 s per
interpreted FFN call after the first (4.6 s); max row error fp16 4.1e-4 (SiLU) and 3.7e-5 (SiTU), bf16 0.0 for
both (the reference rounds where the path rounds, and at K 128 the fp32 sums agreed within bf16's rounding on
every element); the CPU engine's branch on the same inputs 1.1e-6 to 6.4e-5; controls (block metadata off by
one row, no wait for the slot fill) 183-199.
"""

from __future__ import annotations

import pytest

from tests.support.vllm_envs import run_json

pytestmark = pytest.mark.slow

#: per-row relative bound, per dtype: about twice the largest fp16 error measured; bf16 two bf16 ulps
BOUND = {"float16": 1e-3, "bfloat16": 8e-3}


def test_the_bf16_gpu_branch_matches_the_dense_reference_and_the_controls_miss(report):
    out = run_json("vllm", ["-m", "tests.support.bf16_gpu_experts_check"], timeout=300)
    runs = out["runs"]
    for dtype, bound in BOUND.items():
        for act in ("silu", "situ"):
            split, one = runs[f"{dtype} {act} split"], runs[f"{dtype} {act} one pass"]
            assert split["trace"] == ["own", "filled", "waited", "slots"], split
            assert one["trace"] == ["filled", "waited", "one pass"], one
            for r in (split, one):
                assert r["error"] <= bound and r["tail_untouched"], (dtype, act, r)
                assert r["block_m"] == 16 and r["padding_blocks_skipped"] == 2, r
            cpu = runs[f"{dtype} {act} cpu branch"]
            assert cpu["error"] <= bound, (dtype, act, cpu)
            report(f"[bf16 gpu branch, interpreted] {dtype} {act}: max row err split {split['error']:.1e}, one pass "
                   f"{one['error']:.1e} <= {bound:.0e}; CPU branch {cpu['error']:.1e}")
        off, no_wait = runs[f"{dtype} control off-by-one blocks"], runs[f"{dtype} control no wait"]
        assert off["error"] > bound and no_wait["error"] > bound, (off, no_wait)
        assert no_wait["trace"] == ["own", "slots"]
        report(f"[bf16 gpu branch] {dtype} controls: off-by-one blocks {off['error']:.1f}, no wait "
               f"{no_wait['error']:.1f}")
    report(f"[bf16 gpu branch] {out['seconds']} s in the vLLM environment")
