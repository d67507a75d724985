"""Kernel tier of the GPU experts (``vllm/gpu_experts.py``) on CPU, under the Triton interpreter.

Runs ``python -m tests.support.gpu_experts_check`` in the ``vllm==0.33.0``
environment: two gloo ranks over the host driver, one sharded store per
format, rank 0's slots filled by ops' pull (one from rank 1's pages, one
from its own), and the format's kernel — vLLM's ``fused_moe_kernel_gptq_awq``
(INT4 W4A16 g32), vLLM's ``fused_moe_kernel`` with 128x128 blocks (FP8), the
project's MXFP4 kernel — over the ``[E+B]`` views with MoonEP-grouped rows.
Judged against the format's own dequantization (compressed-tensors'
decompressor; DeepSeek's FP8 block formula) within the harness's stated
bound; four negative controls must exceed it. Rank 1, idle while rank 0
computes, also builds vLLM's three quantized MoE methods for a MoonEP layer
and records which experts each selects (the GPU engine's selection). Cost (measured on the 2-core
CI machine): 60-95 s, of which ~20 s is importing vLLM and ~10 s
compressed-tensors' compression; each interpreted FFN call is 0.3-3 s.
"""

from __future__ import annotations

import pytest

from tests.support.vllm_envs import run_json

pytestmark = pytest.mark.slow

FORMATS = ("int4-g32", "fp8-block", "mxfp4")
CONTROLS = {"int4-g32": {"expert_id_off_by_one", "stale_slot_scale", "swapped_nibbles"},
            "mxfp4": {"expert_id_off_by_one", "stale_slot_scale", "swapped_nibbles"},
            "fp8-block": {"expert_id_off_by_one", "stale_slot_scale", "transposed_block_scales"}}


def test_gpu_experts_of_every_format_match_the_formats_own_dequantization_under_the_interpreter(report):
    out = run_json("vllm", ["-m", "tests.support.gpu_experts_check", "--json"], timeout=420)
    r0 = out["ranks"][0]
    _check_engine_selection(out["ranks"][1]["engine_selection"])
    # The interpreter bugs the harness mends are real, and mended (fp16 runs need neither).
    # Mended: within fp32 rounding of a 16-term sum (bf16_dot_error's bound, ~2e-5; the summation order is the
    # BLAS's, so 0 on one machine and 4.8e-7 on another); bare: bf16 bit patterns multiplied as integers, ~1e10.
    assert r0["bf16_dot_error_bare"] > 1e3 and r0["bf16_dot_error_mended"] < 1e-4
    assert r0["downcast_mismatch_bare"]["e4m3"] > 0 and r0["downcast_mismatch_bare"]["bf16"] > 0
    assert r0["downcast_mismatch_mended"] == {"bf16": 0.0, "e4m3": 0.0}
    assert set(r0["formats"]) == set(FORMATS)
    rows = []
    for fmt in FORMATS:
        res = r0["formats"][fmt]
        # the slots hold the owners' bytes (one from rank 1's pages), and the owner rows the checkpoint's
        assert res["slot_rows_equal_sources"] and res["owner_rows_equal_checkpoint"]
        assert 3 in res["slot_experts"] and res["cu_seqlens"][0] == res["cu_seqlens"][1]  # remote slot, empty group
        for dtype in ("float16", "bfloat16"):
            d = res["dtypes"][dtype]
            assert d["finite"] and d["tail_zero"], (fmt, dtype, d)
            assert d["max_row_rel_err"] <= d["bound"], (fmt, dtype, d)
            rows.append((fmt, dtype, d["max_row_rel_err"], d["bound"], d["seconds"]))
        # every negative control fails the same bound the positive run passes
        assert set(res["controls"]) == CONTROLS[fmt]
        for name, err in res["controls"].items():
            assert err > res["control_bound"], (fmt, name, err)
    assert out["ok"]
    report(f"[gpu experts, interpreter] {out['seconds']} s for 2 ranks and 3 formats")
    for fmt, dtype, err, bnd, sec in rows:
        report(f"  {fmt:9} {dtype:8}  max row rel err {err:.2e} <= {bnd:.2e}  ({sec:.2f} s)")
    for fmt in FORMATS:
        ctl = r0["formats"][fmt]["controls"]
        report(f"  {fmt:9} controls (must exceed {r0['formats'][fmt]['control_bound']:.2e}): "
               + ", ".join(f"{k} {v:.2f}" for k, v in sorted(ctl.items())))


def _check_engine_selection(sel: dict) -> None:
    """vLLM 0.33.0's own quantized MoE methods, built for a MoonEP layer (two EP ranks), select
    ``MoonEPTritonQuantizedExperts`` on a CUDA platform (this machine has none: the platform is marked CUDA for
    the selection only, ``tests/support/gpu_engine_selection.py``; rank 1 of the kernel check runs it while rank 0
    computes). Controls: without CUDA, or with ``MOONEP_EP_QUANTIZED_EXPERTS=dequant``, the dequantizing experts;
    with the replicated layout vLLM's own choice (or vLLM's own error on a machine without GPUs), never ours."""
    assert sel["platform"] == "UnspecifiedPlatform"
    assert sel["cuda"] == {fmt: "MoonEPTritonQuantizedExperts" for fmt in FORMATS}, sel
    assert sel["no_gpu"] == sel["cuda_dequant"] == {fmt: "MoonEPQuantizedExperts" for fmt in FORMATS}, sel
    assert set(sel["replicated"]) == set(FORMATS)
    assert not [v for v in sel["replicated"].values() if v.startswith("MoonEP")], sel["replicated"]
    # block sizes on a GPU: vLLM's tuned file for the shape and device, BLOCK_SIZE_M fitted to the token padding
    tuned = sel["tuned_config"]
    assert tuned["file_m2048"]["BLOCK_SIZE_M"] == 64 and tuned["file_m2"]["BLOCK_SIZE_M"] == 8   # the control
    assert tuned["m2048_padding_128"] == tuned["file_m2048"]
    assert tuned["m2048_padding_32"] == {**tuned["file_m2048"], "BLOCK_SIZE_M": 32}
    assert tuned["m2_padding_128"] == {**tuned["file_m2"], "BLOCK_SIZE_M": 16}
