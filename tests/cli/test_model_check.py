"""``--model PATH`` is checked from its files before any engine starts (``vllm/checkpoint/model_check.py``)."""

from __future__ import annotations

import json
import pytest

from moonep_ep.errors import ConfigError
from moonep_ep.vllm.checkpoint.model_check import check_model_dir, is_k3_checkpoint, require_servable, rope_type

QWEN3 = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 512,
         "moe_intermediate_size": 256, "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2,
         "vocab_size": 1024, "hidden_act": "silu", "torch_dtype": "bfloat16", "max_position_embeddings": 512}
DSV3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 512,
        "moe_intermediate_size": 256, "intermediate_size": 1024, "n_routed_experts": 16, "num_experts_per_tok": 4,
        "num_hidden_layers": 4, "first_k_dense_replace": 1, "vocab_size": 1024, "hidden_act": "silu",
        "torch_dtype": "bfloat16", "kv_lora_rank": 512, "num_attention_heads": 4, "n_group": 1, "topk_group": 1,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "rope_scaling": {"type": "yarn", "factor": 32.0}}


def _ckpt(tmp_path, cfg, files=("model.safetensors", "tokenizer.json")):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for name in files:
        (tmp_path / name).write_text("")
    return str(tmp_path)


def _keys(problems, severity="error"):
    return sorted(p.key for p in problems if p.severity == severity)


@pytest.mark.parametrize("cfg", [QWEN3, DSV3])
def test_supported_checkpoints_pass(tmp_path, cfg):
    problems, info = check_model_dir(_ckpt(tmp_path, cfg), ep_size=2, engine="vllm-cpu")
    assert problems == [] and info["experts"] in (8, 16) and info["moe_layers"] >= 2


def test_every_problem_is_listed_at_once(tmp_path):
    bad = dict(QWEN3, num_experts=7, hidden_size=500, hidden_act="gelu",
               quantization_config={"quant_method": "fp8"})
    path = _ckpt(tmp_path, bad, files=())
    problems, _ = check_model_dir(path, ep_size=2)
    assert _keys(problems) == ["hidden_act", "hidden_size", "n_routed_experts", "quantization_config", "tokenizer",
                               "weights"]
    with pytest.raises(ConfigError) as info:
        require_servable(path, ep_size=2, engine="vllm")
    text = str(info.value)
    assert "6 problem(s), nothing was started" in text and text.count("Fix:") == 6 and "\n" not in text


def test_deepseek_v3_needs_its_routing_keys_and_warns_on_plain_rope_on_the_cpu_engine(tmp_path):
    cfg = {k: v for k, v in DSV3.items() if k not in ("topk_method", "scoring_func", "rope_scaling")}
    problems, _ = check_model_dir(_ckpt(tmp_path, cfg), ep_size=2, engine="vllm-cpu")
    assert _keys(problems) == ["topk_method/scoring_func"]
    assert _keys(problems, "warning") == ["rope_scaling"]
    problems, _ = check_model_dir(str(tmp_path), ep_size=2, engine="vllm")   # GPUs: no rope warning
    assert _keys(problems, "warning") == []


def test_unsupported_untested_and_unreadable_checkpoints(tmp_path):
    gpt_oss = dict(QWEN3, architectures=["GptOssForCausalLM"], model_type="gpt_oss", num_local_experts=8)
    problems, _ = check_model_dir(_ckpt(tmp_path / "g", gpt_oss), ep_size=2)
    assert _keys(problems) == ["architectures"] and "SwiGLU-OAI" in problems[0].message
    other = dict(QWEN3, architectures=["SomeNewMoeForCausalLM"])
    problems, _ = check_model_dir(_ckpt(tmp_path / "n", other), ep_size=2)
    assert _keys(problems) == [] and _keys(problems, "warning") == ["architectures"]
    dense = {k: v for k, v in QWEN3.items() if k not in ("num_experts",)}
    assert _keys(check_model_dir(_ckpt(tmp_path / "d", dense), ep_size=2)[0]) == ["MoE shape"]
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "config.json").write_text("{not json")
    assert _keys(check_model_dir(str(tmp_path / "j"), ep_size=2)[0]) == ["config.json"]
    assert _keys(check_model_dir(str(tmp_path / "missing"), ep_size=2)[0]) == ["--model"]
    assert _keys(check_model_dir(_ckpt(tmp_path / "e", QWEN3), ep_size=200)[0]) == ["data-parallel size"]


@pytest.mark.parametrize("rope,warned", [
    ({"rope_scaling": {"type": "yarn", "factor": 32.0}}, False),                        # transformers 4
    ({"rope_parameters": {"rope_type": "yarn", "factor": 32.0, "rope_theta": 10000.0}}, False),  # transformers 5
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0}}}, False),  # per attention type
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, True),      # transformers 5, plain
    ({"rope_scaling": None}, True),
    ({}, True),
])
def test_rope_scaling_is_read_from_rope_scaling_and_rope_parameters(tmp_path, rope, warned):
    """A YaRN checkpoint saved by transformers 5 carries rope_parameters, not rope_scaling: no plain-RoPE warning."""
    cfg = {k: v for k, v in DSV3.items() if k != "rope_scaling"}
    cfg.update(rope)
    problems, _ = check_model_dir(_ckpt(tmp_path, cfg), ep_size=2, engine="vllm-cpu")
    assert _keys(problems) == []
    assert _keys(problems, "warning") == (["rope_scaling"] if warned else [])


# -- the experts' activation: SiLU or SiTU (Kimi K3), at the top level or in text_config --------------------------

K3_TEXT = {"model_type": "kimi_linear", "hidden_size": 1024, "routed_expert_hidden_size": 512,
           "moe_intermediate_size": 256, "intermediate_size": 2048, "num_experts": 8, "num_experts_per_token": 2,
           "num_shared_experts": 1, "num_hidden_layers": 4, "first_k_dense_replace": 1, "vocab_size": 1024,
           "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
           "torch_dtype": "bfloat16"}
K3 = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "text_config": K3_TEXT}
KIMI_LINEAR = dict(K3_TEXT, architectures=["KimiLinearForCausalLM"])


@pytest.mark.parametrize("cfg", [K3, KIMI_LINEAR], ids=["text_config", "top_level"])
def test_k3_situ_is_accepted_at_the_top_level_and_in_text_config(tmp_path, cfg):
    problems, info = check_model_dir(_ckpt(tmp_path, cfg), ep_size=2)
    assert problems == []   # no error, and no "not run here" warning for K3's two architectures
    assert (info["experts"], info["top_k"], info["hidden"], info["moe_layers"]) == (8, 2, 512, 3)
    assert info["activation"] == {"name": "situ", "beta": 4.0, "linear_beta": 25.0}
    # linear_beta may be left out (SiTU without up saturation)
    plain = {k: v for k, v in K3_TEXT.items() if k != "activation_situ_linear_beta"}
    problems, info = check_model_dir(_ckpt(tmp_path / "p", dict(plain, architectures=["KimiLinearForCausalLM"])),
                                     ep_size=2)
    assert problems == [] and info["activation"]["linear_beta"] is None


@pytest.mark.parametrize("cfg", [K3, KIMI_LINEAR], ids=["wrapper", "text_model"])
def test_k3_on_the_cpu_engine_needs_its_stand_ins_and_is_stopped_without_them_naming_why(tmp_path, cfg):
    # Without moonep_ep.testing.k3_cpu the CPU engine cannot run K3's attention; vllm-demo and serve arm them.
    arch = cfg["architectures"][0]
    path = _ckpt(tmp_path, cfg)
    assert _texts(check_model_dir(path, ep_size=2, engine="vllm-cpu", cpu_k3_standins=False)[0]) == [
        f"error: architectures: {arch}: the CPU engine (vllm-cpu 0.32.0) cannot run Kimi K3's attention without "
        "stand-ins: its KDA layers' kernels are Triton-only and its MLA layer writes the KV cache with CUDA-only ops "
        "(fused_kimi_k3_mla_key_concat_kv_cache_insert and its decode twin). Fix: set MOONEP_EP_CPU_K3_STANDINS=1 "
        "(the torch stand-ins of moonep_ep.testing.k3_cpu; vllm-demo and serve set it on the CPU engine), or serve "
        "Kimi K3 on GPUs"]
    assert check_model_dir(path, ep_size=2, engine="vllm-cpu", cpu_k3_standins=True)[0] == []   # with them
    assert check_model_dir(path, ep_size=2, engine="vllm")[0] == []   # control: the GPU engine takes it
    with pytest.raises(ConfigError, match="cannot run Kimi K3's attention without stand-ins"):
        require_servable(path, ep_size=2, engine="vllm-cpu", warn=lambda *_: None, cpu_k3_standins=False)
    assert is_k3_checkpoint(path) and not is_k3_checkpoint(str(tmp_path / "missing"))


@pytest.mark.parametrize("where", ["top_level", "text_config"])
def test_an_unknown_activation_is_refused_wherever_it_sits_naming_it_and_the_fix(tmp_path, where):
    cfg = dict(K3, text_config=dict(K3_TEXT, hidden_act="gelu")) if where == "text_config" \
        else dict(KIMI_LINEAR, hidden_act="gelu")
    path = _ckpt(tmp_path, cfg)
    problems, info = check_model_dir(path, ep_size=2)
    assert _keys(problems) == ["hidden_act"] and info["activation"] == "gelu"
    text = str(problems[0])
    place = "text_config" if where == "text_config" else "config.json"
    assert text == (f"error: hidden_act: activation 'gelu' ({place}): MoonEP's experts compute SiLU-gated "
                    "(silu, swiglu) and SiTU-gated (situ) experts only. Fix: serve this model with another "
                    "--all2all-backend")
    with pytest.raises(ConfigError, match="1 problem.*nothing was started.*'gelu'.*another --all2all-backend"):
        require_servable(path, ep_size=2, engine="vllm")
    # text_config's value is the one vLLM reads: a silu text model under a gelu top level passes, and vice versa
    mixed = dict(K3, hidden_act="gelu", text_config=dict(K3_TEXT, hidden_act="silu"))
    assert check_model_dir(_ckpt(tmp_path / "m", mixed), ep_size=2)[0] == []
    mixed = dict(K3, hidden_act="silu", text_config=dict(K3_TEXT, hidden_act="relu2"))
    assert "'relu2' (text_config)" in str(check_model_dir(_ckpt(tmp_path / "r", mixed), ep_size=2)[0][0])


@pytest.mark.parametrize("act", [None, "silu", "swiglu"])
def test_silu_spellings_and_none_pass(tmp_path, act):
    cfg = {k: v for k, v in QWEN3.items() if k != "hidden_act"}
    if act is not None:
        cfg["hidden_act"] = act
    problems, info = check_model_dir(_ckpt(tmp_path, cfg), ep_size=2)
    assert problems == [] and info["activation"] == act


def test_hidden_activation_is_read_when_hidden_act_is_absent(tmp_path):
    cfg = {k: v for k, v in QWEN3.items() if k != "hidden_act"}
    problems, _ = check_model_dir(_ckpt(tmp_path, dict(cfg, hidden_activation="gelu_pytorch_tanh")), ep_size=2)
    assert _keys(problems) == ["hidden_activation"] and "'gelu_pytorch_tanh' (config.json)" in problems[0].message
    problems, _ = check_model_dir(_ckpt(tmp_path / "n", dict(cfg, hidden_act=None, hidden_activation="silu")),
                                  ep_size=2)
    assert problems == []


@pytest.mark.parametrize("beta", [None, 0, 0.0, -4.0, "4.0", True, float("nan")])
def test_situ_needs_a_positive_numeric_beta(tmp_path, beta):
    text = dict(K3_TEXT, activation_situ_beta=beta)
    if beta is None:
        del text["activation_situ_beta"]
    problems, _ = check_model_dir(_ckpt(tmp_path, dict(K3, text_config=text)), ep_size=2)
    assert _keys(problems) == ["activation_situ_beta"]
    assert str(problems[0]) == (
        f"error: activation_situ_beta: hidden_act 'situ' (text_config) needs activation_situ_beta > 0 (got "
        f"{beta!r}): vLLM's SiTU experts take it from the layer and assert it is set. Fix: add "
        '"activation_situ_beta" (Kimi K3: 4.0) next to hidden_act in text_config')


@pytest.mark.parametrize("beta", [1, 0.5, 4.0])
def test_situ_beta_positive_passes(tmp_path, beta):
    problems, info = check_model_dir(_ckpt(tmp_path, dict(KIMI_LINEAR, activation_situ_beta=beta)), ep_size=2)
    assert problems == [] and info["activation"]["beta"] == beta


@pytest.mark.parametrize("linear_beta,ok", [("25", False), (True, False), ([25.0], False), (0, True), (-1.0, True),
                                            (25, True)])
def test_situ_linear_beta_must_be_a_number(tmp_path, linear_beta, ok):
    problems, _ = check_model_dir(_ckpt(tmp_path, dict(KIMI_LINEAR, activation_situ_linear_beta=linear_beta)),
                                  ep_size=2)
    if ok:   # <= 0 is vLLM's "unset" (the CUDA op's -1): accepted
        assert problems == []
    else:
        assert _keys(problems) == ["activation_situ_linear_beta"]
        assert str(problems[0]) == (f"error: activation_situ_linear_beta: activation_situ_linear_beta {linear_beta!r} "
                                    "(config.json) is not a number. Fix: write a number (Kimi K3: 25.0), or leave it "
                                    "out for SiTU without up saturation")


def test_an_unsupported_architecture_is_not_also_refused_for_its_activation(tmp_path):
    gpt_oss = dict(QWEN3, architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_act="swigluoai")
    problems, _ = check_model_dir(_ckpt(tmp_path, gpt_oss), ep_size=2)
    assert _keys(problems) == ["architectures"]


# -- every problem's whole text, every branch's edge, what was read (the texts are written out here, not built from
#    model_check's tables, so a changed word, bound or table entry fails) ------------------------------------------


def _texts(problems):
    return [str(p) for p in problems]


def test_what_was_read_is_returned_whole(tmp_path):
    path = _ckpt(tmp_path, QWEN3)
    problems, info = check_model_dir(path, ep_size=2)
    assert problems == []
    assert info == {"path": str(tmp_path.resolve()), "architecture": "Qwen3MoeForCausalLM", "model_type": "qwen3_moe",
                    "vocab_size": 1024, "max_position_embeddings": 512, "experts": 8, "hidden": 512,
                    "moe_intermediate": 256, "top_k": 2, "moe_layers": 2, "native_dtype": "bfloat16",
                    "activation": "silu"}
    # text_config's values win (K3's wrapper: model_type and the routed width come from the text model)
    problems, info = check_model_dir(_ckpt(tmp_path / "k3", dict(K3, max_position_embeddings=4096)), ep_size=2)
    assert problems == []
    assert info == {"path": str((tmp_path / "k3").resolve()), "architecture": "KimiK3ForConditionalGeneration",
                    "model_type": "kimi_linear", "vocab_size": 1024, "max_position_embeddings": 4096, "experts": 8,
                    "hidden": 512, "moe_intermediate": 256, "top_k": 2, "moe_layers": 3, "native_dtype": "bfloat16",
                    "activation": {"name": "situ", "beta": 4.0, "linear_beta": 25.0}}


def test_an_unreadable_model_path_is_refused_with_its_whole_text(tmp_path):
    missing = str(tmp_path / "missing")
    problems, info = check_model_dir(missing, ep_size=2)
    assert _texts(problems) == [
        f"error: --model: {missing!r} is not a directory. Fix: pass a HuggingFace checkpoint directory (config.json, "
        "*.safetensors, tokenizer), or tiny-deepseek-v3 / tiny-qwen3"]
    assert info == {"path": missing}
    (tmp_path / "empty").mkdir()
    problems, info = check_model_dir(str(tmp_path / "empty"), ep_size=2)
    assert _texts(problems) == [f"error: config.json: no config.json in {tmp_path / 'empty'}. Fix: pass a HuggingFace "
                                "checkpoint directory"]
    assert info == {"path": str(tmp_path / "empty")}


@pytest.mark.parametrize("raw,reason", [
    (b"{not json", "is not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"
                   ". Fix: repair config.json"),
    (b'{"model_type": "qwen3_moe\xff"}', "is not valid JSON ('utf-8' codec can't decode byte 0xff in position 25: "
                                         "invalid start byte). Fix: repair config.json"),
    (b"[1, 2]", "holds a list, not an object. Fix: pass a HuggingFace config.json"),
    (b'"qwen3"', "holds a str, not an object. Fix: pass a HuggingFace config.json"),
])
def test_a_bad_config_json_is_refused_with_its_whole_text(tmp_path, raw, reason):
    (tmp_path / "config.json").write_bytes(raw)
    problems, info = check_model_dir(str(tmp_path), ep_size=2)
    assert _texts(problems) == [f"error: config.json: {tmp_path / 'config.json'} {reason}"]
    assert info == {"path": str(tmp_path)}


def test_utf8_is_read_whatever_the_locale(tmp_path):
    """A config with a non-ASCII name: read as UTF-8 (the locale's encoding could be ASCII)."""
    path = _ckpt(tmp_path, dict(QWEN3, model_type="qwen3_moe", _name_or_path="Qwen/Qwen3-Ünïcode"))
    problems, info = check_model_dir(path, ep_size=2)
    assert problems == [] and info["experts"] == 8


def test_architecture_refusal_and_warning_texts(tmp_path):
    gpt_oss = dict(QWEN3, architectures=["GptOssForCausalLM"], model_type="gpt_oss")
    assert _texts(check_model_dir(_ckpt(tmp_path / "g", gpt_oss), ep_size=2)[0]) == [
        "error: architectures: GptOssForCausalLM: its experts use the SwiGLU-OAI activation (clamped, with biases); "
        "vLLM's MoonEPExperts computes silu(gate)*up without biases. Fix: serve it with another --all2all-backend"]
    untested = ("DeepseekV3ForCausalLM, DeepseekV2ForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM, "
                "OlmoeForCausalLM")
    other = dict(QWEN3, architectures=["SomeNewMoeForCausalLM", "Second"])
    assert _texts(check_model_dir(_ckpt(tmp_path / "n", other), ep_size=2)[0]) == [
        f"warning: architectures: 'SomeNewMoeForCausalLM' has not been run with the moonep backend here (run: "
        f"{untested}). Fix: expect vLLM to decide; report what happens"]
    for name, cfg in (("none", {k: v for k, v in QWEN3.items() if k != "architectures"}),
                      ("emptylist", dict(QWEN3, architectures=[]))):
        problems, info = check_model_dir(_ckpt(tmp_path / name, cfg), ep_size=2)
        assert _texts(problems) == [f"warning: architectures: None has not been run with the moonep backend here "
                                    f"(run: {untested}). Fix: expect vLLM to decide; report what happens"]
        assert info["architecture"] is None


@pytest.mark.parametrize("arch", ["DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM", "Qwen3MoeForCausalLM",
                                  "MixtralForCausalLM", "OlmoeForCausalLM", "KimiLinearForCausalLM",
                                  "KimiK3ForConditionalGeneration"])
def test_every_run_architecture_passes_without_a_warning(tmp_path, arch):
    cfg = dict(QWEN3, architectures=[arch], topk_method="noaux_tc", scoring_func="sigmoid")
    problems, info = check_model_dir(_ckpt(tmp_path, cfg), ep_size=2)
    assert problems == [] and info["architecture"] == arch


def test_a_config_without_experts_is_refused_with_the_parsers_text_and_nothing_after(tmp_path):
    dense = {k: v for k, v in QWEN3.items() if k != "num_experts"}
    path = _ckpt(tmp_path, dense, files=())   # no weights, no tokenizer: not reported, the shape stops the check
    problems, info = check_model_dir(path, ep_size=3)
    assert _texts(problems) == [
        f"error: MoE shape: {tmp_path / 'config.json'}: missing key n_routed_experts / num_experts / "
        "num_local_experts. Fix: this is not an MoE config (no routed-expert count); add the number of routed experts "
        "per layer under one of these keys. Fix: pass a mixture-of-experts checkpoint"]
    assert info == {"path": str(tmp_path.resolve()), "architecture": "Qwen3MoeForCausalLM", "model_type": "qwen3_moe",
                    "vocab_size": 1024, "max_position_embeddings": 512}


@pytest.mark.parametrize("ep_size,experts,expected", [
    (0, 8, "error: data-parallel size: 0 EP ranks is outside MoonEP's 1..128. Fix: use between 2 and 128 ranks"),
    (1, 8, None),
    (128, 128, None),
    (129, 129, "error: data-parallel size: 129 EP ranks is outside MoonEP's 1..128. Fix: use between 2 and 128 "
               "ranks"),
    (3, 8, "error: n_routed_experts: 8 routed experts do not split evenly over 3 EP ranks (MoonEP places E/R "
           "experts on every rank). Fix: use a data-parallel size that divides 8"),
    (4, 8, None),
])
def test_ep_size_bounds_and_the_even_split(tmp_path, ep_size, experts, expected):
    problems, _ = check_model_dir(_ckpt(tmp_path, dict(QWEN3, num_experts=experts)), ep_size=ep_size)
    assert _texts(problems) == ([expected] if expected else [])


def test_weight_tile_texts_for_both_widths(tmp_path):
    path = _ckpt(tmp_path, dict(QWEN3, hidden_size=500, moe_intermediate_size=200))
    assert _texts(check_model_dir(path, ep_size=2)[0]) == [
        "error: hidden_size: hidden_size 500 is not a multiple of 128 (MoonEP tiles expert weights by 128). Fix: "
        "serve this model with another --all2all-backend",
        "error: moe_intermediate_size: moe_intermediate_size 200 is not a multiple of 128 (MoonEP tiles expert "
        "weights by 128). Fix: serve this model with another --all2all-backend"]
    path = _ckpt(tmp_path / "i", dict(QWEN3, moe_intermediate_size=384))
    assert check_model_dir(path, ep_size=2)[0] == []


@pytest.mark.parametrize("top_k,experts,expected", [
    (1, 8, None),
    (8, 8, None),
    (32, 64, None),
    (33, 64, "error: num_experts_per_tok: top-k 33 is outside [1, min(32, E=64)]. Fix: MoonEP routes at most 32 "
             "experts per token"),
])
def test_top_k_bounds(tmp_path, top_k, experts, expected):
    cfg = dict(QWEN3, num_experts=experts, num_experts_per_tok=top_k)
    problems, info = check_model_dir(_ckpt(tmp_path, cfg), ep_size=2)
    assert _texts(problems) == ([expected] if expected else []) and info["top_k"] == top_k


@pytest.mark.parametrize("top_k,reason", [
    (0, "top_k must be a positive int: got 0. Fix: give top_k as a positive integer"),
    (9, "top_k 9 exceeds num_experts 8. Fix: check num_experts_per_tok in the config"),
])
def test_a_top_k_the_parser_refuses_is_a_shape_problem(tmp_path, top_k, reason):
    problems, _ = check_model_dir(_ckpt(tmp_path, dict(QWEN3, num_experts_per_tok=top_k)), ep_size=2)
    assert _texts(problems) == [f"error: MoE shape: model {str(tmp_path / 'config.json')!r}: {reason}. Fix: pass a "
                                "mixture-of-experts checkpoint"]


@pytest.mark.parametrize("torch_dtype,dtype,warned", [
    ("bfloat16", None, None), ("bf16", None, None), (None, None, None),
    ("float16", None, "float16"), (None, "float32", "float32"), ("bfloat16", "float32", None),
    ("float32", "bfloat16", "float32"),
])
def test_a_non_bf16_checkpoint_is_warned_about_reading_torch_dtype_then_dtype(tmp_path, torch_dtype, dtype, warned):
    cfg = {k: v for k, v in QWEN3.items() if k != "torch_dtype"}
    cfg.update({k: v for k, v in (("torch_dtype", torch_dtype), ("dtype", dtype)) if v is not None})
    problems, _ = check_model_dir(_ckpt(tmp_path, cfg), ep_size=2)
    assert _texts(problems) == ([] if warned is None else [
        f"warning: torch_dtype: the checkpoint is {warned}: vLLM casts it to bfloat16 at load (MoonEP serves bf16 "
        "only); the oracle reads the checkpoint as stored. Fix: none needed"])


FP8_BLOCK = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


def test_quantization_verdicts_one_reason_several_reasons_and_a_served_format(tmp_path):
    # the default engine (vLLM on GPUs) serves FP8 block experts: nothing to report
    problems, info = check_model_dir(_ckpt(tmp_path / "ok", dict(QWEN3, quantization_config=FP8_BLOCK)), ep_size=2)
    assert problems == [] and info["quantization"] == {"quant_method": "fp8", "format": "fp8-block"}
    # one reason: its text, then its own fix
    per_tensor = {"quant_method": "fp8"}
    problems, info = check_model_dir(_ckpt(tmp_path / "one", dict(QWEN3, quantization_config=per_tensor)), ep_size=2)
    assert _texts(problems) == [
        "error: quantization_config: per-tensor FP8 (quant_method fp8 without weight_block_size) is not supported: "
        "moonep_ep holds FP8 experts with 128x128 block scales. Fix: an FP8-block checkpoint (weight_block_size "
        "[128, 128], as DeepSeek-V3 and Kimi K2 ship)"]
    assert info["quantization"] == {"quant_method": "fp8", "format": None}
    # two reasons: each keeps its fix in the message, the problem's fix points at them
    two = {"quant_method": "fp8", "weight_block_size": [64, 64], "activation_scheme": "static"}
    problems, _ = check_model_dir(_ckpt(tmp_path / "two", dict(QWEN3, quantization_config=two)), ep_size=2)
    assert _texts(problems) == [
        "error: quantization_config: FP8 with weight_block_size [64, 64]: moonep_ep holds 128x128 blocks (DeepGEMM's "
        "and DeepSeek's layout). Fix: re-quantize with weight_block_size [128, 128]; FP8 activation_scheme 'static': "
        "block FP8 needs dynamic activation scales. Fix: activation_scheme dynamic. Fix: see each reason above"]
    # an empty quantization_config is no quantization
    problems, info = check_model_dir(_ckpt(tmp_path / "none", dict(QWEN3, quantization_config={})), ep_size=2)
    assert problems == [] and "quantization" not in info


_ROUTING = ("error: topk_method/scoring_func: config.json lacks topk_method ({}) or scoring_func ({}): transformers' "
            "DeepseekV3 always routes noaux_tc with sigmoid scores and writes neither key, but vLLM reads them "
            "(absent: softmax routing without the correction bias, and the load fails on "
            "'...mlp.gate.e_score_correction_bias'). Fix: add \"topk_method\": \"noaux_tc\", \"scoring_func\": "
            "\"sigmoid\" to config.json")
_UNTESTED = ("warning: architectures: {!r} has not been run with the moonep backend here (run: DeepseekV3ForCausalLM, "
             "DeepseekV2ForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM, OlmoeForCausalLM). Fix: expect vLLM to "
             "decide; report what happens")


@pytest.mark.parametrize("drop,method,scoring", [("scoring_func", "'noaux_tc'", "None"),
                                                 ("topk_method", "None", "'sigmoid'")])
def test_deepseek_v3_needs_both_routing_keys(tmp_path, drop, method, scoring):
    cfg = {k: v for k, v in DSV3.items() if k != drop}
    assert _texts(check_model_dir(_ckpt(tmp_path, cfg), ep_size=2)[0]) == [_ROUTING.format(method, scoring)]


@pytest.mark.parametrize("arch,model_type,checked", [
    ("DeepseekV3ForCausalLM", "deepseek_v3", True),
    ("SomeDeepseekForCausalLM", "deepseek_v3", True),    # by its model_type
    ("KimiK2ForCausalLM", "kimi_k2", True),              # Kimi K2's model_type
    ("DeepseekV3ForCausalLM", "some_moe", True),         # by its architecture
    ("DeepseekV2ForCausalLM", "deepseek_v2", False),     # V2 routes without these keys
])
def test_which_configs_the_routing_keys_are_checked_for(tmp_path, arch, model_type, checked):
    cfg = {k: v for k, v in DSV3.items() if k not in ("topk_method", "scoring_func")}
    cfg.update(architectures=[arch], model_type=model_type)
    problems, _ = check_model_dir(_ckpt(tmp_path, cfg), ep_size=2)
    expected = [] if arch.startswith("Deepseek") else [_UNTESTED.format(arch)]
    assert _texts(problems) == expected + ([_ROUTING.format("None", "None")] if checked else [])


@pytest.mark.parametrize("n_group,topk_group,top_k,ok", [
    (None, None, 4, True), (None, None, 9, True),   # one group: any K <= E
    (4, 1, 4, True),                                # K = topk_group * E / n_group: the most it can pick
    (4, 1, 5, False),
    (2, 2, 16, True),
    (8, 1, 4, False),                               # 1 group of 2 experts cannot give 4
    (3, 1, 2, False),                               # 3 does not divide 16
    (4, 5, 4, False),                               # topk_group > n_group
])
def test_grouped_routing_must_be_able_to_pick_k(tmp_path, n_group, topk_group, top_k, ok):
    cfg = {k: v for k, v in DSV3.items() if k not in ("n_group", "topk_group")}
    cfg.update({k: v for k, v in (("n_group", n_group), ("topk_group", topk_group)) if v is not None})
    cfg["num_experts_per_tok"] = top_k
    problems, _ = check_model_dir(_ckpt(tmp_path, cfg), ep_size=2)
    assert _texts(problems) == ([] if ok else [
        f"error: n_group/topk_group: grouped routing n_group={n_group}, topk_group={topk_group} cannot pick {top_k} "
        "of 16 experts. Fix: n_group must divide E, topk_group <= n_group, K <= topk_group*E/n_group"])


_PLAIN_ROPE = ("warning: rope_scaling: MLA with plain RoPE on vllm-cpu 0.32.0: its CPU rotary kernel rotates only the "
               "first T rows of MLA's 3-D query [T, heads, rope_dim], so every vLLM path (single process and DP "
               "alike) drifts from the model; the oracle will show it. Fix: use a checkpoint with rope_scaling (e.g. "
               "Kimi K2's YaRN), or vLLM on GPUs (not affected)")


@pytest.mark.parametrize("arch,model_type,changes,warned", [
    ("DeepseekV3ForCausalLM", "deepseek_v3", {}, True),
    ("DeepseekV2ForCausalLM", "deepseek_v2", {}, True),
    ("DeepseekV3ForCausalLM", "kimi_k2", {}, True),
    ("DeepseekV3ForCausalLM", "deepseek_v3", {"kv_lora_rank": None}, False),      # no MLA
    ("Qwen3MoeForCausalLM", "qwen3_moe", {}, False),                               # kv_lora_rank, but not an MLA model
    ("DeepseekV3ForCausalLM", "deepseek_v3", {"num_attention_heads": 2}, True),
    ("DeepseekV3ForCausalLM", "deepseek_v3", {"num_attention_heads": 1}, False),   # one head: one row per token
    ("DeepseekV3ForCausalLM", "deepseek_v3", {"num_attention_heads": None}, False),
])
def test_the_plain_rope_warning_is_for_multi_head_mla_on_the_cpu_engine(tmp_path, arch, model_type, changes, warned):
    cfg = {k: v for k, v in DSV3.items() if k != "rope_scaling"}
    cfg.update(architectures=[arch], model_type=model_type)
    for k, v in changes.items():
        if v is None:
            del cfg[k]
        else:
            cfg[k] = v
    path = _ckpt(tmp_path, cfg)
    assert _texts(check_model_dir(path, ep_size=2, engine="vllm-cpu")[0]) == ([_PLAIN_ROPE] if warned else [])
    assert check_model_dir(path, ep_size=2, engine="vllm")[0] == []


@pytest.mark.parametrize("cfg,kind", [
    ({"rope_scaling": {"type": "yarn", "factor": 32.0}}, "yarn"),
    ({"rope_scaling": {"rope_type": "linear", "type": "yarn"}}, "linear"),   # rope_type first, as vLLM reads it
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0}}, "yarn"),
    ({"rope_parameters": {"sliding": {"rope_type": "default"}, "full": {"rope_type": "llama3"}}}, "llama3"),
    ({"rope_scaling": {"type": "default"}, "rope_parameters": {"rope_type": "dynamic"}}, "dynamic"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, None),
    ({"rope_scaling": None}, None),
    ({"rope_parameters": {}}, None),
    ({}, None),
])
def test_rope_type_names_the_declared_scaling(cfg, kind):
    assert rope_type(cfg) == kind


@pytest.mark.parametrize("files,missing", [
    ((), ("weights", "tokenizer")),
    (("model.bin", "tokenizer.model"), ()),
    (("model.safetensors.index.json", "tokenizer_config.json"), ()),
    (("model-00001-of-00002.safetensors", "tokenizer.json"), ()),
    (("weights.pt", "vocab.txt"), ("weights", "tokenizer")),
    (("model.bin",), ("tokenizer",)),
    (("tokenizer.model",), ("weights",)),
])
def test_weights_and_tokenizer_files_are_looked_for(tmp_path, files, missing):
    path = _ckpt(tmp_path, QWEN3, files=files)
    texts = {"weights": f"error: weights: no *.safetensors or *.bin file in {path}. Fix: point --model at the "
                        "checkpoint directory",
             "tokenizer": f"error: tokenizer: no tokenizer files in {path}. Fix: save the tokenizer next to the "
                          "weights (tokenizer.save_pretrained)"}
    assert _texts(check_model_dir(path, ep_size=2)[0]) == [texts[m] for m in missing]


def test_require_servable_warns_each_warning_for_its_engine_and_returns_what_was_read(tmp_path):
    cfg = {k: v for k, v in DSV3.items() if k != "rope_scaling"}
    path = _ckpt(tmp_path, cfg)
    warned = []
    info = require_servable(path, ep_size=2, engine="vllm-cpu", warn=warned.append)
    assert warned == [_PLAIN_ROPE]
    assert info == check_model_dir(path, ep_size=2, engine="vllm-cpu")[1] and info["experts"] == 16
    warned.clear()
    require_servable(path, ep_size=2, engine="vllm", warn=warned.append)   # GPUs: nothing to warn about
    assert warned == []


def test_require_servable_lists_every_problem_warnings_included_and_warns_nothing(tmp_path):
    cfg = dict(QWEN3, architectures=["SomeNewMoeForCausalLM"], num_experts=6, torch_dtype="float16")
    path = _ckpt(tmp_path, cfg, files=("model.safetensors",))
    warned = []
    with pytest.raises(ConfigError) as err:
        require_servable(path, ep_size=4, engine="vllm", warn=warned.append)
    assert str(err.value) == (
        f"{path} cannot be served with --all2all-backend moonep on 4 EP ranks (2 problem(s), nothing was started): "
        f"{_UNTESTED.format('SomeNewMoeForCausalLM')}; error: n_routed_experts: 6 routed experts do not split evenly "
        "over 4 EP ranks (MoonEP places E/R experts on every rank). Fix: use a data-parallel size that divides 6; "
        "warning: torch_dtype: the checkpoint is float16: vLLM casts it to bfloat16 at load (MoonEP serves bf16 "
        "only); the oracle reads the checkpoint as stored. Fix: none needed; error: tokenizer: no tokenizer files in "
        f"{path}. Fix: save the tokenizer next to the weights (tokenizer.save_pretrained)")
    assert warned == []
