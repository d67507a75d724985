"""``--model PATH`` is checked from its files before any engine starts (``vllm/model_check.py``)."""

from __future__ import annotations

import json
import pytest

from moonep_ep.errors import ConfigError
from moonep_ep.vllm.model_check import check_model_dir, require_servable

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
