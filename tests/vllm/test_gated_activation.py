"""The fused gated activation kernel (``ops/experts/gated_activation_kernel.py``) under Triton's interpreter.

Runs ``python -m tests.support.gated_activation_check`` in the vLLM environment. The kernel must equal the eager
chain it replaces (SiLU: silu rounded, product rounded; SiTU: fp32 inside, rounded once; then the route weight)
bit for bit on bf16 and within one ulp on fp16 (its ``tanh`` is built from ``exp``: measured 100 % equal on bf16,
99.99 % on fp16 without ``linear_beta``), equal vLLM's ``per_token_group_quant_fp8`` (alone and fused after the
activation), and leave the rows of padding-only blocks and of blocks past ``cu_seqlens[-1]`` unwritten; with
16-row blocks and with 64-row blocks (computed in 32-row slices).
"""

from __future__ import annotations

import pytest

from tests.support.vllm_envs import run_json

pytestmark = pytest.mark.slow


def test_the_fused_activation_equals_the_eager_chain_and_writes_only_the_computed_blocks():
    out = run_json("vllm", ["-m", "tests.support.gated_activation_check"], timeout=300)
    # blocks: rows 0-31 group 0, 32-47 group 2, 48-63 padding only (-1), 64-95 past cu_seqlens[-1] (-1)
    assert out["expert_ids"] == [0, 0, 2, -1, -1, -1]
    for name, r in out["runs"].items():
        assert r["untouched_rows"] == 96 - 48, (name, r)
        # one flip at most, of one ulp (measured against |ref| · 2^-7 or 2^-10: up to 2 at a binade's bottom)
        assert r["equal_share"] >= 0.999 and r["max_ulps"] <= 2.0, (name, r)
    # 64-row blocks in 32-row slices: both slices written, the block past cu_seqlens[-1] not
    assert out["block64"]["expert_ids"] == [0, 2, -1] and out["block64"]["untouched_rows"] == 64, out["block64"]
    assert out["block64"]["equal_share"] >= 0.999, out["block64"]
    assert out["quant_equal"]
    assert out["fused_quant_equal_share"] >= 0.999 and out["fused_scale_equal_share"] >= 0.999, out
