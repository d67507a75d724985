"""The MXFP4 kernel's launch parameters and arithmetic under the Triton interpreter (``ops/experts/mxfp4_kernel.py``).

Runs ``python -m tests.support.mxfp4_kernel_check --json`` in the
``vllm==0.33.0`` environment (torch and Triton only; about 15 s on the 2-core
machine). The expected values below are worked out by hand from the inputs
the harness builds (what a launch must receive) and from the formats'
definitions (what the arithmetic must give), not read from the module.
"""

from __future__ import annotations

from tests.support.vllm_envs import run_json


def test_mxfp4_launches_exact_sums_and_edge_exponents(report):
    out = run_json("vllm", ["-m", "tests.support.mxfp4_kernel_check", "--json"], timeout=300)
    launch = out["launches"]
    # 32 rows in two 16-row groups, N 64: grid (2 blocks, 64 / BLOCK_N). The config's warps and stages reach the
    # launch; three configs, three different pairs, so a constant would fail two of them.
    assert launch["bf16_w8_s5"] == {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SCALE_BEFORE_DOT": True,
                                    "num_warps": 8, "num_stages": 5, "grid": [2, 2]}
    # fp16 keeps the scale after each 32-value group's dot, whatever BLOCK_SIZE_K asks
    assert launch["fp16_w8_s5"] == {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "SCALE_BEFORE_DOT": False,
                                    "num_warps": 8, "num_stages": 5, "grid": [2, 2]}
    # no config: Triton's own defaults (4 warps, 3 stages), N 64, K 128
    assert launch["bf16_no_config"] == {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SCALE_BEFORE_DOT": True,
                                        "num_warps": 4, "num_stages": 3, "grid": [2, 1]}
    # through gpu_grouped_ffn: gate-up (K = H 256, N = 2I 128) and down (K = I 64: BLOCK_K 64, N = H 256)
    assert launch["ffn_w2_s4"] == [
        {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SCALE_BEFORE_DOT": True, "num_warps": 2, "num_stages": 4,
         "grid": [2, 2]},
        {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "SCALE_BEFORE_DOT": True, "num_warps": 2, "num_stages": 4,
         "grid": [2, 4]}]
    # exact sums: bit for bit the float64 product rounded once (bf16 at BLOCK_K 128, 64 and 32; fp16)
    assert [(c["dtype"], c["K"], c["block_k_asked"]) for c in out["exact"]] == [
        ("bfloat16", 256, 128), ("bfloat16", 256, 64), ("bfloat16", 96, 128), ("float16", 256, 128)]
    assert all(c["bitwise_equal"] and c["max_abs_diff"] == 0.0 for c in out["exact"]), out["exact"]
    edges = {e["x"]: e for e in out["edges"]}
    assert sorted(edges) == [0, 1, 2, 252, 253, 254, 255]
    # every edge gives what the format's fp32 dequantization gives (inf where it overflows, NaN for 0 * inf)
    assert all(e["matches_fp32_dequantization"] for e in edges.values()), edges
    # [2, 252]: every weight a normal bf16, all finite; 0 and 1: subnormal weights, still exact and finite
    assert edges[2]["weights_normal_bf16"] and edges[252]["weights_normal_bf16"]
    assert not edges[0]["weights_normal_bf16"] and not edges[1]["weights_normal_bf16"]
    assert all(edges[x]["out_nonfinite"] == 0 for x in (0, 1, 2, 252))
    # 253, 254: the largest codes overflow (the control: the check sees non-finite values), the small ones do not
    for x in (253, 254, 255):
        assert edges[x]["weights_nonfinite"] > 0 and edges[x]["out_nonfinite"] > 0, edges[x]
    assert edges[253]["small_codes_finite"] and edges[254]["small_codes_finite"]
    assert not edges[255]["small_codes_finite"]  # E8M0 0xFF: an inf scale for every code
    report(f"[mxfp4 kernel, interpreter] launches, exact sums and edge exponents in {out['seconds']} s")
