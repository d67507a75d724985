"""Kernel tier of the GPU experts (``vllm/experts/gpu.py``) on CPU, under the Triton interpreter.

Runs ``python -m tests.support.gpu_experts_check`` in the ``vllm==0.33.0``
environment: two gloo ranks over the host driver, one sharded store per
format, rank 0's slots filled by ops' pull (one from rank 1's pages, one
from its own), and the format's kernel — vLLM's ``fused_moe_kernel_gptq_awq``
(INT4 W4A16 g32), vLLM's ``fused_moe_kernel`` with 128x128 blocks (FP8), the
project's MXFP4 kernel — over the ``[E+B]`` views with MoonEP-grouped rows.
Judged against the format's own dequantization (compressed-tensors'
decompressor; DeepSeek's FP8 block formula) within the harness's bounds
(about twice the measured maxima); the negative controls must exceed them. Rank 1, idle while rank 0
computes, also builds vLLM's three quantized MoE methods for a MoonEP layer
and records which experts each selects (the GPU engine's selection), and the block sizes the engine's
experts pick at K2's shapes for a decode and a prefill step on an H200 (``gpu_experts_tiles.py``). Cost
(measured on the 2-core CI machine): 26-95 s, of which ~20 s is importing vLLM and ~10 s
compressed-tensors' compression; each interpreted FFN call is 0.2-3 s.
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
    _check_tile_choices(out["ranks"][1]["tile_choices"])
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
        # the push layout (gate and up rows apart, padded scale rows read through strided data views): same bits
        assert res["push_layout_equals_fused"], fmt
        for dtype in ("float16", "bfloat16"):
            d = res["dtypes"][dtype]
            # rows past cu_seqlens[-1] are never written (combine never reads them: test_expert_bytes.py)
            assert d["finite"] and d["tail_untouched"], (fmt, dtype, d)
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
    for ep in ("ep8", "ep12"):
        for step, r in out["ranks"][1]["tile_choices"][ep].items():
            c, old = r["config"], r["keyed_by_nvs_and_global_e"]
            report(f"  K2 FP8 {ep} {step} ({r['tokens']} tokens, NvS {r['nvs']}): BLOCK_SIZE_M/N/K "
                   f"{c['BLOCK_SIZE_M']}/{c['BLOCK_SIZE_N']}/{c['BLOCK_SIZE_K']} GROUP_SIZE_M {c['GROUP_SIZE_M']} "
                   f"warps {c['num_warps']} stages {c['num_stages']} (keyed by NvS and E 384: BLOCK_SIZE_M "
                   f"{old['BLOCK_SIZE_M']}, GROUP_SIZE_M {old['GROUP_SIZE_M']})")


#: vLLM 0.33.0's ``get_default_config`` for ``fp8_w8a8`` with a ``[128, 128]`` block on a CUDA GPU, written out
#: from its source (``fused_moe.py``): ``BLOCK_SIZE_M`` 16 up to M 64, else 64; N 64 up to M 8, else 128; K 128;
#: ``GROUP_SIZE_M`` 1 up to M 16, else 32; 4 warps; 4 stages up to M 4, else 3
def _vllm_fp8_block_default(m: int) -> dict[str, int]:
    return {"BLOCK_SIZE_M": 16 if m <= 64 else 64, "BLOCK_SIZE_N": 64 if m <= 8 else 128, "BLOCK_SIZE_K": 128,
            "GROUP_SIZE_M": 1 if m <= 16 else 32, "SPLIT_K": 1, "num_warps": 4,
            "num_stages": 4 if m <= 4 else 3}


def _check_tile_choices(tc: dict) -> None:
    """``MoonEPTritonQuantizedExperts.grouped_ffn`` at K2's FP8 shapes on an H200 (``gpu_experts_tiles.py``):
    the block sizes follow the step's tokens (32 decode, 4096 prefill per rank) and vLLM's tuned file for the
    *local* expert count. EP 8: 48 local experts, no file: vLLM's default. EP 12: 32 local experts, vLLM's file
    (read directly). Controls: keyed the old way (``NvS // top_k`` tokens, E 384) decode gets 64-row blocks."""
    # NvS = S*K + (token_padding - 1)*2*E/EP, S = max(128, next power of two of the tokens)
    assert {(ep, s): tc[ep][s]["nvs"] for ep in ("ep8", "ep12") for s in ("decode", "prefill")} == {
        ("ep8", "decode"): 128 * 8 + 127 * 2 * 48, ("ep8", "prefill"): 4096 * 8 + 127 * 2 * 48,
        ("ep12", "decode"): 128 * 8 + 127 * 2 * 32, ("ep12", "prefill"): 4096 * 8 + 127 * 2 * 32}
    files = tc["files_present"]
    assert [files[n] for n in sorted(files, key=lambda n: int(n.split(",")[0][2:]))] == [True, False, False], files
    assert tc["ep8"]["decode"]["config"] == _vllm_fp8_block_default(32)
    assert tc["ep8"]["prefill"]["config"] == _vllm_fp8_block_default(4096)
    assert tc["ep12"]["decode"]["config"] == tc["tuned_file"]["decode"]
    assert tc["ep12"]["prefill"]["config"] == tc["tuned_file"]["prefill"]
    assert tc["ep12"]["decode"]["config"]["BLOCK_SIZE_M"] == 16
    assert tc["ep12"]["prefill"]["config"]["BLOCK_SIZE_M"] == 64
    for ep in ("ep8", "ep12"):
        old = tc[ep]["decode"]["keyed_by_nvs_and_global_e"]
        assert old == _vllm_fp8_block_default(tc[ep]["decode"]["nvs"] // 8) and old["BLOCK_SIZE_M"] == 64
    # at EP 12 the global E misses vLLM's file: its prefill config is the default's, not the file's
    assert tc["ep12"]["prefill"]["keyed_by_nvs_and_global_e"] == _vllm_fp8_block_default(40896 // 8)
    assert tc["ep12"]["prefill"]["keyed_by_nvs_and_global_e"] != tc["tuned_file"]["prefill"]


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
