"""``gpu_check.sh`` part 6 (``checks.gpu.mxfp4``) where there is no GPU: its reference, its block
configs, its answer when a precondition is missing, and its checks on CPU under the Triton interpreter."""

from __future__ import annotations

import json
import math

import pytest
import torch

from checks.gpu import mxfp4 as gpu_mxfp4
from tests.support.vllm_envs import run_json

#: OCP Microscaling Formats (MX) v1.0, FP4 E2M1: code -> value (codes 8..15 the same with the sign bit set)
SPEC_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def test_the_reference_decodes_e2m1_and_e8m0_from_the_bits_as_the_spec_tables_them():
    codes = torch.arange(16, dtype=torch.uint8)
    decoded = gpu_mxfp4.e2m1_from_bits(codes)
    assert decoded.tolist() == SPEC_E2M1 and torch.equal(torch.signbit(decoded), codes >= 8)
    # One group of 32: byte j holds code j in the low nibble (the even k) and code 15 - j in the high one.
    packed = (torch.arange(16, dtype=torch.uint8) | ((15 - torch.arange(16, dtype=torch.uint8)) << 4)).view(1, 16)
    expected = [v for j in range(16) for v in (SPEC_E2M1[j], SPEC_E2M1[15 - j])]
    for exponent, power in ((127, 1.0), (130, 8.0), (120, 2.0 ** -7), (1, math.ldexp(1.0, -126))):
        dense = gpu_mxfp4.dequantize_reference(packed, torch.tensor([[exponent]], dtype=torch.uint8))
        assert dense.shape == (1, 32) and dense[0].tolist() == [v * power for v in expected], exponent
    # Control: the nibbles read the other way round give another row.
    swapped = ((packed & 0xF) << 4) | (packed >> 4)
    assert gpu_mxfp4.dequantize_reference(swapped, torch.tensor([[127]], dtype=torch.uint8))[0].tolist() != expected


#: vLLM 0.33.0's get_default_config(M, E, N=4096, K=7168, topk=8, dtype=None) as it returned them
#: (.venv-vllm, vllm==0.33.0): M -> (BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, num_warps, num_stages)
VLLM_DEFAULTS = {1: (16, 64, 128, 1, 4, 4), 32: (16, 64, 128, 1, 4, 4), 33: (32, 64, 128, 1, 4, 3),
                 64: (32, 64, 128, 1, 4, 3), 65: (32, 128, 64, 1, 4, 3), 96: (32, 128, 64, 1, 4, 3),
                 97: (64, 128, 64, 1, 4, 3), 128: (64, 128, 64, 1, 4, 3), 129: (64, 128, 64, 1, 8, 3),
                 512: (64, 128, 64, 1, 8, 3), 513: (128, 128, 64, 1, 8, 3), 49153: (128, 128, 64, 1, 8, 3),
                 49919: (128, 128, 64, 16, 8, 3)}


@pytest.mark.parametrize("tokens", sorted(VLLM_DEFAULTS))
def test_block_configs_are_the_ones_vllm_0_33_picks_without_a_tuned_file(tokens):
    cfg = gpu_mxfp4.vllm_default_config(tokens, 384)
    keys = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")
    assert tuple(cfg[k] for k in keys) == VLLM_DEFAULTS[tokens] and cfg["SPLIT_K"] == 1


def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


@pytest.mark.skipif(torch.cuda.is_available() and _has_triton(), reason="with a GPU and Triton the check runs")
def test_without_triton_or_a_gpu_the_check_says_why_and_passes_nothing(monkeypatch, capsys):
    for name in ("MOONEP_EP_CUDA_EMULATOR", "TRITON_INTERPRET"):
        monkeypatch.delenv(name, raising=False)
    assert gpu_mxfp4.main(["--check", "experts", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is None and out["check"] == "experts"
    why = out["not_applicable"]
    assert ("Triton is not importable" in why) == (not _has_triton()), why
    assert ("torch sees no CUDA GPU" in why) == (not torch.cuda.is_available()), why
    monkeypatch.setenv("MOONEP_EP_CUDA_EMULATOR", "1")
    assert any("the emulated CUDA driver runs no GPU kernels" in r for r in gpu_mxfp4.missing_preconditions())
    monkeypatch.setenv("MOONEP_EP_CUDA_EMULATOR", "0")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert any("TRITON_INTERPRET=1" in r for r in gpu_mxfp4.missing_preconditions())


@pytest.mark.slow
def test_the_checks_run_on_cpu_under_the_interpreter_over_the_emulated_store():
    """``tests/support/gpu_mxfp4_interpreted.py`` in the vLLM environment (it has Triton): the part's own
    functions at a tiny shape. Offsets below are the tiny shape's rows, counted here: w13_weight_packed rows
    are 2·128 x 256/2 = 32768 bytes, so expert 15 starts at 491520 and slot 0 at 524288."""
    out = run_json("vllm", ["-m", "tests.support.gpu_mxfp4_interpreted", "--json"], timeout=300,
                   env={"MOONEP_EP_CUDA_EMULATOR": "1", "MOONEP_EP_CUDA_EMULATOR_NODE": "H200x1"})
    assert out["views"] == {"views": "store over CUDA VMM, one rank"}
    assert out["plain_views"] == {"views": "plain device tensors"}
    e = out["experts"]
    assert e["expert_last_offsets"]["w13_weight_packed"] == 15 * 32768
    assert e["slot_0_offsets"]["w13_weight_packed"] == 16 * 32768
    assert e["past_2_31"] is False  # a tiny shape: the real shapes' offsets are the GPU's to show
    for dtype in ("bfloat16", "float16"):
        assert e[dtype]["within"] and set(e[dtype]["max_row_rel_err"]) == {"expert_0", "expert_last", "slot_0"}
    control = e["control_slot_scale_plus_one"]
    assert control["exceeds"] and control["max_row_rel_err"] > 4 * control["bound"], control
    assert control["other_rows_unmoved"]
    k = out["kernel"]["decode"]
    assert out["kernel"]["ok"] and k["rows"] == 8 * 16
    assert all(k[p]["max_row_rel_diff_to_dense"] <= k[p]["bound"] and k[p]["mxfp4_over_dense_seconds"] > 0
               for p in ("w13", "w2"))
    # The race on CPU: deferred slot fills are read stale without the wait, in every trial; with it, never.
    deferred, at_issue = out["race_deferred"], out["race_at_issue"]
    assert deferred["no_wait"]["differed"] == deferred["no_wait"]["trials"] == 2
    assert deferred["wait"]["equal"] == 2 and deferred["ok"]
    # Control: copies made at issue leave nothing for the wait to order, so both modes match.
    assert at_issue["no_wait"]["equal"] == at_issue["wait"]["equal"] == 1 and at_issue["ok"]
    assert deferred["reference_max_row_rel_err"] <= deferred["bound"]
    assert out["described"] == {"constexprs": {"BLOCK_M": 128, "BLOCK_N": 64, "compute_type": "bf16"},
                                "num_warps": 8, "num_stages": 3, "shared_bytes": 65536, "n_regs": 255,
                                "n_spills": 40}
