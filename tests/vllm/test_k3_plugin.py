"""Kimi K3 under ``--all2all-backend moonep``: vLLM 0.33.0's two refusals, lifted by the plugin for K3 only.

One process in the ``vllm==0.33.0`` environment (``tests/support/k3_plugin_check.py``), no engine:

* a SiTU MoE layer built by vLLM's own ``FusedMoEFactory`` (as ``KimiMoE``
  calls it) keeps the MoonEP backend with the plugin's experts; with vLLM's
  own ``_supports_activation`` put back the same layer is refused (negative
  control); GELU stays refused; a SiTU layer without its beta is refused
  when its experts are built;
* a tiny K3's ``VllmConfig`` (``KimiLinearForCausalLM`` and
  ``KimiK3ForConditionalGeneration``, BF16 and compressed-tensors MXFP4):
  vLLM refuses MXFP4 ("unquantized BF16 only"); the plugin accepts it as
  compressed-tensors, also for ``KimiK3ForConditionalGeneration``, whose
  config vLLM rewrites to ``quant_method="mxfp4"`` (without the plugin's undo
  of that rewrite the plugin itself refuses it: the control).
"""

from __future__ import annotations

import pytest

from tests.support.vllm_envs import run_json

pytestmark = pytest.mark.slow

VLLM_REFUSAL = "The moonep all2all backend currently supports unquantized BF16 models only"


@pytest.fixture(scope="module")
def out():
    return run_json("vllm", ["-m", "tests.support.k3_plugin_check"], timeout=240)


def test_a_situ_layer_keeps_moonep_with_the_plugins_experts_and_only_silu_situ_pass(out):
    assert "MoonEPExperts._supports_activation (SiLU, SiTU)" in out["plugin"]
    for act, betas in (("silu", [None, None]), ("situ", [4.0, 25.0])):
        layer = out["layers"][act]
        assert layer["built"], layer
        assert (layer["backend"], layer["experts_class"]) == ("MOONEP", "MoonEPExperts")
        assert layer["experts_module"] == "vllm.model_executor.layers.fused_moe.experts.moonep_experts"
        assert layer["apply_is_plugins"] and layer["use_moonep_kernels"]
        assert (layer["activation"], layer["betas"]) == (act, betas)
        assert layer["experts_object"] == "built"
    gelu = out["layers"]["gelu"]
    assert not gelu["built"]
    assert "Unquantized MoE backend MOONEP does not support" in gelu["error"]
    assert "MoEActivation.GELU activation" in gelu["error"]


def test_without_the_plugins_activation_check_vllm_refuses_the_situ_layer(out):
    control = out["situ_without_plugin_check"]
    assert not control["built"]
    assert "kernel does not support MoEActivation.SITU activation" in control["error"]


def test_a_situ_layer_without_its_beta_is_refused_when_its_experts_are_built(out):
    layer = out["layers"]["situ"]
    assert layer["experts_object"] == "built"  # the same layer with K3's betas builds (positive control)
    bad = out["situ_without_beta"]
    assert bad["built"] and bad["betas"] == [None, None]  # the oracle sees only the activation's name
    assert bad["experts_object"].startswith("ConfigError: moonep_ep:")
    assert "activation_situ_beta > 0" in bad["experts_object"] and "Fix:" in bad["experts_object"]


@pytest.mark.parametrize("arch", ["KimiLinearForCausalLM", "KimiK3ForConditionalGeneration"])
def test_k3_configs_quantized_refusal_is_lifted_for_the_served_format(out, arch):
    cfgs = out["configs"]
    for mode in ("plugin", "vllm"):
        assert cfgs[f"{arch}/bf16/{mode}"] == {"error": None, "quantization": None}
    assert cfgs[f"{arch}/mxfp4/plugin"] == {"error": None, "quantization": "compressed-tensors"}
    refused = cfgs[f"{arch}/mxfp4/vllm"]["error"]
    assert VLLM_REFUSAL in refused
    # vLLM's K3 hook rewrites compressed-tensors mxfp4-pack-quantized to its own "mxfp4" method, for the
    # K3 wrapper only; the plugin undoes it under moonep, and without the undo it refuses the rewritten method.
    rewritten = arch == "KimiK3ForConditionalGeneration"
    assert ("quantization='mxfp4'" if rewritten else "quantization='compressed-tensors'") in refused
    kept = cfgs[f"{arch}/mxfp4/plugin_keeps_rewrite"]
    if rewritten:
        assert "moonep_ep: --all2all-backend moonep cannot serve" in kept["error"]
        assert "quant_method 'mxfp4'" in kept["error"]
    else:
        assert kept == {"error": None, "quantization": "compressed-tensors"}
