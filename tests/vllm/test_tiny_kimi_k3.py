"""The tiny Kimi K3 checkpoints (``tools/checkpoints/tiny_kimi_k3.py``) and compressed-tensors entry matching.

The builder runs in the vLLM 0.33.0 environment (compressed-tensors writes the MXFP4 experts; vLLM's own
``KimiLinearConfig`` and matcher ``is_equal_or_regex_match`` judge the result): one subprocess,
``tests/support/tiny_kimi_k3_check.py``, about 20 s. The expected names below are read off vLLM 0.33.0's
``vllm/models/kimi_k3/nvidia/model.py`` (``KimiLinearModel.load_weights``: ``q/k/v/g/b/f_a_proj`` fused into
``in_proj_qkvgfab``, ``q/k/v_conv1d`` into ``conv1d``, ``q_a_proj``/``kv_a_proj_with_mqa``/``g_proj`` into
``fused_qkv_a_g_proj``, ``gate_proj``/``up_proj`` into ``gate_up_proj``, experts ``w1``/``w2``/``w3``;
``KimiMoE``: ``block_sparse_moe.gate`` with ``e_score_correction_bias``, ``routed_expert_down_proj``,
``routed_expert_norm``, ``routed_expert_up_proj``, ``shared_experts``; ``kda.py``: ``f_b_proj``, ``dt_bias``,
``A_log``, ``o_norm``, ``o_proj``), not from the builder.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
import tempfile

from moonep_ep.vllm.checkpoint.schemes import classify
from tests.support.vllm_envs import run_json

H, L, I, E, V, HEADS, KDA_HEADS, KDA_D, CONV = 256, 128, 128, 16, 1024, 2, 1, 64, 4


def _expected_bf16_names() -> dict[str, list[int]]:
    proj = KDA_HEADS * KDA_D
    names = {"model.embed_tokens.weight": [V, H], "model.norm.weight": [H], "lm_head.weight": [V, H]}
    for layer in range(4):
        p = f"model.layers.{layer}."
        names[p + "input_layernorm.weight"] = [H]
        names[p + "post_attention_layernorm.weight"] = [H]
        a = p + "self_attn."
        if layer < 3:  # kda_layers [1, 2, 3] (1-based)
            names.update({a + n + ".weight": [proj, H] for n in ("q_proj", "k_proj", "v_proj", "g_proj")})
            names.update({a + "b_proj.weight": [KDA_HEADS, H], a + "f_a_proj.weight": [KDA_D, H],
                          a + "f_b_proj.weight": [proj, KDA_D], a + "A_log": [KDA_HEADS], a + "dt_bias": [proj],
                          a + "o_norm.weight": [KDA_D], a + "o_proj.weight": [H, proj]})
            names.update({a + n + ".weight": [proj, 1, CONV] for n in ("q_conv1d", "k_conv1d", "v_conv1d")})
        else:  # MLA: q-LoRA 256, kv_lora 512, rope 64, nope 128, v 128, output gate
            names.update({a + "q_a_proj.weight": [256, H], a + "q_a_layernorm.weight": [256],
                          a + "q_b_proj.weight": [HEADS * 192, 256], a + "kv_a_proj_with_mqa.weight": [576, H],
                          a + "kv_a_layernorm.weight": [512], a + "kv_b_proj.weight": [HEADS * 256, 512],
                          a + "g_proj.weight": [HEADS * 128, H], a + "o_proj.weight": [H, HEADS * 128]})
        if layer == 0:
            names.update({p + "mlp.gate_proj.weight": [512, H], p + "mlp.up_proj.weight": [512, H],
                          p + "mlp.down_proj.weight": [H, 512]})
            continue
        m = p + "block_sparse_moe."
        names.update({m + "gate.weight": [E, H], m + "gate.e_score_correction_bias": [E],
                      m + "routed_expert_down_proj.weight": [L, H], m + "routed_expert_norm.weight": [L],
                      m + "routed_expert_up_proj.weight": [H, L],
                      m + "shared_experts.gate_proj.weight": [2 * I, H], m + "shared_experts.up_proj.weight": [2 * I, H],
                      m + "shared_experts.down_proj.weight": [H, 2 * I]})
        for e in range(E):
            names.update({f"{m}experts.{e}.w1.weight": [I, L], f"{m}experts.{e}.w3.weight": [I, L],
                          f"{m}experts.{e}.w2.weight": [L, I]})
    return names


@functools.lru_cache(maxsize=1)
def _check() -> dict:
    root = tempfile.mkdtemp(prefix="moonep-ep-tiny-k3-check-")
    try:  # a fresh directory: the builder itself runs, not a cached checkpoint
        return run_json("vllm", ["tests/support/tiny_kimi_k3_check.py", root], timeout=600)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_config_has_k3s_features_as_vllms_kimi_linear_config_reads_them():
    c = _check()["vllm_config"]
    assert _check()["architectures"] == ["KimiLinearForCausalLM"] and c["model_type"] == "kimi_linear"
    assert c["kda"] == [True, True, True, False] and c["is_mla"] and c["is_moe"] and c["is_linear_attn"]
    assert c["linear_attn_config"] == {"kda_layers": [1, 2, 3], "full_attn_layers": [4], "head_dim": 64,
                                       "num_heads": 1, "short_conv_kernel_size": 4, "use_full_rank_gate": True,
                                       "gate_lower_bound": -5.0}
    assert (c["hidden_act"], c["activation_situ_beta"], c["activation_situ_linear_beta"]) == ("situ", 4.0, 25.0)
    assert (c["routed_expert_hidden_size"], c["latent_moe_use_norm"]) == (128, True)
    assert (c["num_experts"], c["num_experts_per_token"], c["num_shared_experts"]) == (16, 4, 2)
    assert (c["moe_router_activation_func"], c["topk_method"], c["moe_renormalize"], c["routed_scaling_factor"]) == \
        ("sigmoid", "noaux_tc", True, 1.0)
    assert (c["use_grouped_topk"], c["num_expert_group"], c["topk_group"], c["first_k_dense_replace"]) == \
        (True, 1, 1, 1)
    assert c["mla_use_nope"] is True and c["mla_use_output_gate"] is True


def test_bf16_names_and_shapes_are_what_vllms_k3_loader_reads():
    got = {k: v[0] for k, v in _check()["bf16_names"].items()}
    assert got == _expected_bf16_names()
    dtypes = _check()["bf16_names"]
    fp32 = {k for k, v in dtypes.items() if v[1] == "torch.float32"}
    assert fp32 == {k for k in got if k.endswith(("e_score_correction_bias", "A_log", "dt_bias"))}


def test_mxfp4_experts_are_packed_with_e8m0_scales_and_the_rest_is_bf16():
    bf16, mx = _check()["bf16_names"], _check()["mxfp4_names"]
    experts = [k[:-len(".weight")] for k in bf16 if ".block_sparse_moe.experts." in k]
    assert len(experts) == 3 * E * 3
    for name in experts:
        n, k = bf16[name + ".weight"][0]
        assert mx[name + ".weight_packed"] == [[n, k // 2], "torch.uint8"]
        assert mx[name + ".weight_scale"] == [[n, k // 32], "torch.uint8"]
        assert name + ".weight" not in mx
    rest = {k: v for k, v in bf16.items() if k[:-len(".weight")] not in set(experts)}
    assert {k: v for k, v in mx.items() if k in rest} == rest and len(mx) == len(rest) + 2 * len(experts)
    q = _check()["quantization_config"]
    assert q["format"] == "mxfp4-pack-quantized" and q["config_groups"]["group_0"]["targets"] == ["Linear"]


def test_compressed_tensors_decompresses_the_experts_to_within_e2m1_rounding_of_the_bf16_variant():
    d = _check()["decompress"]
    assert d["ct_equals_format_decode"]              # compressed-tensors == the format decoded independently
    assert d["max_error_in_scale_units"] <= 1.0      # half of E2M1's widest step (4 -> 6) is one scale unit
    assert d["values_past_one_scale_unit"] == 0
    assert _check()["nibble_swap_changes_weights"]   # the decoder is sensitive to nibble order


def test_vllms_matcher_keeps_every_non_expert_layer_bf16_and_quantizes_every_expert():
    ignored = _check()["vllm_ignored"]
    experts = {m for m in ignored if ".block_sparse_moe.experts." in m}
    linears = {m for m in ignored if m.endswith(("_proj", "lm_head", "block_sparse_moe.gate")) and m not in experts}
    assert len(experts) == 3 * E * 3 and len(linears) > 40
    assert all(not ignored[m] for m in experts)
    assert all(ignored[m] for m in linears), [m for m in linears if not ignored[m]]
    assert _check()["classify_cpu"] == {"format": "mxfp4", "problems": []}


def test_our_matcher_agrees_with_vllms_exact_or_re_rule():
    pairs = _check()["matcher_pairs"]
    assert all(vllm == ours for _, _, vllm, ours in pairs), [p for p in pairs if p[2] != p[3]]
    table = {(n, p): vllm for n, p, vllm, _ in pairs}
    assert table[("model.layers.1.self_attn.o_proj", "o_proj")] is False        # a bare suffix does not match
    assert table[("model.layers.1.self_attn.o_proj", "re:.*o_proj")] is True
    assert table[("language_model.lm_head", "lm_head")] is False                # K3's prefixed lm_head
    assert table[("language_model.lm_head", "re:.*lm_head")] is True


def test_situ_saturates_on_a_part_of_the_routed_outputs():
    """Random unit-RMS MoE inputs (512, seed 0), the experts the router picks: measured on the default build
    gate 22.2 % past ±4 and up 13.4 % past ±25 (BF16), 22.1 % and 13.2 % (MXFP4)."""
    for fmt in ("bf16", "mxfp4"):
        s = _check()["saturation"][fmt]
        assert (s["beta"], s["linear_beta"]) == (4.0, 25.0)
        assert 0.05 < s["gate_past_beta"] < 0.5 and 0.05 < s["up_past_linear_beta"] < 0.5, s
        assert all(v["up_past_linear_beta"] > 0 and v["gate_past_beta"] > 0 for v in s["per_layer"].values())


# -- compressed-tensors entries matched as vLLM 0.33.0 matches them (no subprocess) --------------------------

def _ct(ignore: list[str], targets: tuple[str, ...] = ("Linear",)) -> dict:
    return {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
            "config_groups": {"group_0": {"targets": list(targets), "weights": {
                "num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True}}},
            "ignore": ignore}


DS_MODULES = ["lm_head", "model.layers.0.mlp.down_proj", "model.layers.1.self_attn.o_proj",
              "model.layers.1.mlp.shared_experts.down_proj", "model.layers.1.mlp.experts.0.gate_proj"]
K3_MODULES = ["language_model.lm_head", "language_model.layers.0.mlp.down_proj",
              "language_model.layers.1.self_attn.o_proj", "language_model.layers.3.self_attn.fused_qkv_a_g_proj",
              "language_model.layers.1.block_sparse_moe.shared_experts.down_proj",
              "language_model.layers.1.block_sparse_moe.routed_expert_down_proj",
              "language_model.layers.1.block_sparse_moe.experts.0.w1"]
OTHERS = ["lm_head", r"re:.*mlp\.(gate|up|down)_proj$", "re:.*shared_experts.*"]


def test_a_suffix_entry_no_longer_keeps_a_layer_bf16_but_a_regex_does():
    bare = classify(_ct(["o_proj", *OTHERS]), "vllm-cpu", DS_MODULES)
    assert bare.format is None and "quantized attention" in bare.problems[0]
    regex = classify(_ct(["re:.*o_proj", *OTHERS]), "vllm-cpu", DS_MODULES)
    assert regex.ok and regex.format == "mxfp4"
    exact = classify(_ct(["model.layers.1.self_attn.o_proj", *OTHERS]), "vllm-cpu", DS_MODULES)
    assert exact.ok


def test_a_suffix_target_does_not_reach_the_experts():
    assert classify(_ct([], targets=("gate_proj",)), "vllm", DS_MODULES).format is None
    assert classify(_ct([], targets=(r"re:.*experts\.\d+\.gate_proj$",)), "vllm", DS_MODULES).ok


def test_k3s_ignore_list_parses_and_keeps_its_bf16_layers_bf16():
    from moonep_ep.tools.checkpoints.tiny_kimi_k3 import K3_IGNORE

    assert classify(_ct(list(K3_IGNORE)), "vllm-cpu", K3_MODULES).ok
    # negative controls: drop one entry and that kind is quantized on the CPU engine; a bare lm_head misses
    # K3's language_model.lm_head
    no_shared = classify(_ct([p for p in K3_IGNORE if "shared" not in p]), "vllm-cpu", K3_MODULES)
    assert no_shared.format is None and "shared experts" in no_shared.problems[0]
    no_latent = classify(_ct([p for p in K3_IGNORE if "routed_expert" not in p]), "vllm-cpu", K3_MODULES)
    assert "latent MoE projections" in no_latent.problems[0]
    bare_head = classify(_ct([p if "lm_head" not in p else "lm_head" for p in K3_IGNORE]), "vllm-cpu", K3_MODULES)
    assert "lm_head" in bare_head.problems[0]
    # the experts themselves ignored: refused as not quantizing them
    all_ignored = classify(_ct([*K3_IGNORE, "re:.*experts.*"]), "vllm", K3_MODULES)
    assert "does not quantize the routed experts" in all_ignored.problems[0]


def test_vllm_demo_help_lists_the_tiny_k3_models():
    proc = subprocess.run([sys.executable, "-m", "moonep_ep.cli.main", "vllm-demo", "--help"], capture_output=True,
                          text=True, timeout=60)
    text = " ".join(proc.stdout.split())
    assert proc.returncode == 0
    assert "tiny-k3 (Kimi K3, bf16 experts)" in text and "tiny-k3-mxfp4 (Kimi K3, mxfp4 experts)" in text


def test_demo_builds_the_tiny_k3_by_name(monkeypatch):
    """``vllm-demo --model tiny-k3`` reaches the K3 builder (stood in: it needs the vLLM environment)."""
    from moonep_ep.tools.checkpoints import tiny_kimi_k3
    from moonep_ep.tools.engine.demo import model_path

    calls = []
    monkeypatch.setattr(tiny_kimi_k3, "build_tiny_kimi_k3", lambda name, d: calls.append((name, d)) or "/k3")
    assert model_path("tiny-k3-mxfp4", "/x") == "/k3" and calls == [("tiny-k3-mxfp4", "/x")]
    assert model_path("/some/path") == "/some/path"


def test_footprint_measure_sizes_the_tiny_k3s_latent_experts_as_the_os_counts_them(tmp_path):
    """``footprint --measure`` on the tiny K3's config (issue 47): K3's experts are latent-width (L x I per
    projection, not H), three MoE layers after the dense one; the host driver's memfd sizes equal the closed form,
    BF16 as the checkpoint says and MXFP4 (E2M1 + an E8M0 scale per 32) as the tiny-k3-mxfp4 is."""
    import json

    from moonep_ep.tools.checkpoints.tiny_kimi_k3 import TinyKimiK3Config, hf_config
    from tests.support.cli import moonep_ep_json

    (tmp_path / "config.json").write_text(json.dumps(hf_config(TinyKimiK3Config())))
    for fmt, weight, scale in (("bf16", 3 * L * I * 2, 0), ("mxfp4", 3 * L * I // 2, 3 * L * I // 32)):
        args = ["footprint", "--config", str(tmp_path), "--measure", "--ranks", "2"]
        out = moonep_ep_json(*args, *(["--format", fmt] if fmt != "bf16" else []))
        assert out["ok"] and out["format"] == fmt and out["layers"] == 3, out
        assert (out["expert_weight_bytes"], out["expert_scale_bytes"]) == (weight, scale), out
        assert out["measured_bytes_per_rank"] == out["predicted_bytes_per_rank"], out
        # vLLM 0.33.0's replica: every MoE layer holds all E experts and 4 slots on every rank
        assert out["replicated_bytes_per_rank"] == 3 * (E + 4) * (weight + scale), out
        assert all(row["filled"] for row in out["per_rank"])
