"""A tiny Kimi K3 (``KimiLinearForCausalLM``), built locally, in BF16 and with MXFP4 routed experts.

Nothing is downloaded: random weights from a fixed seed under the names vLLM
0.33.0's K3 loader reads (``vllm/models/kimi_k3/nvidia/model.py``
``KimiLinearModel.load_weights``), a ``config.json`` that vLLM's
``KimiLinearConfig`` (``transformers_utils/configs/kimi_linear.py``) parses,
and the offline WordLevel tokenizer of the other tiny models. What it keeps
from K3:

* **attention**: KDA layers and MLA layers by ``linear_attn_config``
  (``kda_layers`` 1-based, ``full_attn_layers``; here layers 1-3 KDA, layer 4
  MLA, K3's 3:1 pattern), K3's full-rank KDA output gate
  (``use_full_rank_gate``: ``g_proj`` beside ``q/k/v_proj``, so vLLM builds
  ``KimiK3DeltaAttention``) and ``gate_lower_bound`` -5; MLA NoPE
  (``mla_use_nope``) with q-LoRA and the output gate (``mla_use_output_gate``:
  ``self_attn.g_proj``), Kimi K2's MLA dims (kv_lora_rank 512, rope 64, nope 128,
  v 128), so GPU MLA backends take it;
* a **dense layer 0** (``first_k_dense_replace`` 1), SiTU like every MLP;
* **latent MoE**: ``routed_expert_down_proj`` H -> ``routed_expert_hidden_size``,
  the routed experts at the latent width, ``routed_expert_norm`` (RMSNorm of the
  K-summed latent output, ``latent_moe_use_norm``), ``routed_expert_up_proj``
  back to H; the router and ``num_shared_experts`` (one MLP of width
  ``moe_intermediate * num_shared_experts``) read the full H;
* **SiTU** (``hidden_act: situ``, ``activation_situ_beta`` 4.0,
  ``activation_situ_linear_beta`` 25.0), K3's values;
* **routing**: sigmoid scores, a non-zero fp32 ``e_score_correction_bias`` that
  only selects (``noaux_tc``, one group), ``moe_renormalize``,
  ``routed_scaling_factor`` 1.0;
* **checkpoint**: per expert separate ``w1`` (gate), ``w3`` (up), ``w2`` (down),
  no biases; the MXFP4 variant writes them as compressed-tensors
  ``mxfp4-pack-quantized`` (``weight_packed`` uint8 ``[N, K/2]`` + E8M0
  ``weight_scale`` uint8 ``[N, K/32]``) with compressed-tensors' own
  ``ModelCompressor`` (``tiny_quantized.compress_experts_ct``), and
  everything else BF16 through an ``ignore`` list of ``re:`` patterns
  (:data:`K3_IGNORE`).

Left out, by default: **AttnRes** (``attn_res_block_size``, 12 in K3). vLLM's
K3 class builds it (``self_attention_res_proj``/``mlp_res_proj`` per layer),
but it runs only as Triton / CUDA kernels (``nvidia/ops/attn_res.py``) and the
oracle's model (transformers' ``kimi_linear``) has no AttnRes, so a run could
not be judged; ``TinyKimiK3Config(attn_res_block_size=N)`` writes the config
key and its weights for a GPU-only check. The vision tower is not built: this
is the text model ``KimiK3ForConditionalGeneration`` wraps. **MTP** layers
(``num_nextn_predict_layers``): none by default; ``TinyKimiK3Config(mtp_layers=1)``
writes one as vLLM's ``kimi_k3/nvidia/mtp.py`` reads it, at index
``num_hidden_layers`` (``model.layers.4.``): a whole decoder layer (MLA, since
its 1-based index is no KDA layer, and a MoE block) plus ``enorm``, ``hnorm``,
``eh_proj`` ``[H, 2H]`` and ``shared_head.{norm,head}``, drawn after every other
tensor (the other tensors are the same as without it).

Default shape: hidden 256, latent 128, moe_intermediate 128, 16 experts top-4,
2 shared, 4 layers (1 dense + 3 MoE), vocab 1024: widths are multiples of 128
(MoonEP's tile).

**SiTU saturation** (:func:`saturation_fractions`). Each expert's ``w1`` and
``w3`` are drawn so that, on unit-RMS MoE inputs, the gate outputs have a
standard deviation of about ``gate_out_std`` (3) and the up outputs about
``up_out_std`` (14), before the per-128x128-block gains in ``[1/2, 2]`` that
spread the MXFP4 scales (``tiny_quantized.with_block_gains``). So a part of
the gate outputs lies past ``±beta`` (4), where ``beta·tanh(g/beta)`` bends,
and a part of the up outputs past ``±linear_beta`` (25), where
``linear_beta·tanh(u/linear_beta)`` does: a SiLU run, or one that drops
``linear_beta``, computes other values there.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

from ...errors import ConfigError
from .tiny_model import COMMON_HF_CONFIG, WeightDraw, config_cache_dir, write_checkpoint

__all__ = ["K3_MODELS", "K3_IGNORE", "TinyKimiK3Config", "build_tiny_kimi_k3", "default_model_dir", "hf_config",
           "random_weights", "expert_module_names", "saturation_fractions", "low_prompt_ids", "high_prompt_ids"]

#: tiny K3 name -> expert format (``vllm-demo --model NAME``)
K3_MODELS = {"tiny-k3": "bf16", "tiny-k3-mxfp4": "mxfp4"}
#: the MXFP4 variant's compressed-tensors ``ignore``, ``re:`` patterns as K3's checkpoint lists them (attention,
#: shared experts, the dense MLP, ``lm_head``, vision tower, projector), plus the MoE block's BF16 parts (router,
#: latent projections): vLLM matches an entry exactly or as ``re:`` (``is_equal_or_regex_match``), and K3's names
#: carry a ``language_model.`` prefix, so a bare ``lm_head`` would not match there
K3_IGNORE = ["re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|down)_proj$", "re:.*lm_head",
             "re:.*vision_tower.*", "re:.*mm_projector.*", r"re:.*block_sparse_moe\.gate$",
             r"re:.*routed_expert_(down|up)_proj$"]
_EXPERT_PROJ = ("w1", "w2", "w3")


@dataclasses.dataclass(frozen=True)
class TinyKimiK3Config:
    hidden: int = 256
    latent: int = 128                 # routed_expert_hidden_size
    moe_intermediate: int = 128
    intermediate: int = 512           # the dense layer 0
    experts: int = 16
    top_k: int = 4
    shared_experts: int = 2           # num_shared_experts: one MLP of moe_intermediate * 2
    layers: int = 4
    first_k_dense: int = 1
    kda_layers: tuple[int, ...] = (1, 2, 3)   # 1-based, as linear_attn_config writes them
    full_attn_layers: tuple[int, ...] = (4,)
    vocab: int = 1024
    heads: int = 2                    # MLA heads
    q_lora_rank: int = 256
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_output_gate: bool = True
    # one KDA head of 64: its state (64 x 64 fp32 + three bf16 conv windows, 17,536 B) fits one 16-token page of
    # the CPU engine's MLA backend (16 x 576 bf16, 18,432 B), the only block CPU_MLA takes (vllm/cpu/k3.py)
    kda_heads: int = 1
    kda_head_dim: int = 64
    short_conv: int = 4
    gate_lower_bound: float = -5.0
    attn_res_block_size: Optional[int] = None  # K3: 12; see the module docstring
    mtp_layers: int = 0               # num_nextn_predict_layers; see the module docstring
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    gate_out_std: float = 3.0         # std of w1·x on unit-RMS x (before the block gains)
    up_out_std: float = 14.0          # std of w3·x on unit-RMS x (before the block gains)
    router_std: float = 0.02
    bias_std: float = 0.02
    owner_split: tuple[int, float] = (2, 0.05)  # (R, alpha): low words route to owner 0's experts (tiny DeepSeek-V3)
    rms_norm_eps: float = 1e-5        # K3's
    max_positions: int = 512
    seed: int = 0


def default_model_dir(name: str = "tiny-k3", config: Optional[TinyKimiK3Config] = None) -> str:
    return config_cache_dir(name, config or TinyKimiK3Config(), TinyKimiK3Config())


def _validate(c: TinyKimiK3Config) -> None:
    problems = []
    for field in ("hidden", "latent", "moe_intermediate", "intermediate"):
        if getattr(c, field) % 128:
            problems.append(f"{field} {getattr(c, field)} is not a multiple of 128 (MoonEP's tile)")
    if sorted(set(c.kda_layers) | set(c.full_attn_layers)) != list(range(1, c.layers + 1)) or \
            set(c.kda_layers) & set(c.full_attn_layers):
        problems.append(f"kda_layers {list(c.kda_layers)} and full_attn_layers {list(c.full_attn_layers)} must "
                        f"split layers 1..{c.layers} (1-based)")
    if not 0 <= c.first_k_dense < c.layers:
        problems.append(f"first_k_dense {c.first_k_dense} leaves no MoE layer among {c.layers}")
    if not 1 <= c.top_k <= c.experts:
        problems.append(f"top_k {c.top_k} is outside [1, experts={c.experts}]")
    R = int(c.owner_split[0])
    if c.owner_split[1] and (R < 2 or c.experts % R):
        problems.append(f"owner_split R={R} must be >= 2 and divide the {c.experts} experts")
    if not -5.0 <= c.gate_lower_bound < 0:  # KimiK3DeltaAttention asserts [-5, 0)
        problems.append(f"gate_lower_bound {c.gate_lower_bound} is outside [-5, 0)")
    if problems:
        raise ConfigError("tiny Kimi K3: " + "; ".join(problems) + ". Fix: choose consistent sizes")


def hf_config(c: TinyKimiK3Config) -> dict[str, Any]:
    """``config.json``: the field names of vLLM 0.33.0's ``KimiLinearConfig``."""
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": c.vocab,
        "hidden_size": c.hidden,
        "intermediate_size": c.intermediate,
        "num_hidden_layers": c.layers,
        "num_attention_heads": c.heads,
        "num_key_value_heads": c.heads,
        "hidden_act": "situ",
        "activation_situ_beta": c.situ_beta,
        "activation_situ_linear_beta": c.situ_linear_beta,
        "moe_intermediate_size": c.moe_intermediate,
        "num_experts": c.experts,
        "num_experts_per_token": c.top_k,
        "num_shared_experts": c.shared_experts,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": 1.0,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "first_k_dense_replace": c.first_k_dense,
        "moe_layer_freq": 1,
        "routed_expert_hidden_size": c.latent,
        "latent_moe_use_norm": True,
        "q_lora_rank": c.q_lora_rank,
        "kv_lora_rank": c.kv_lora_rank,
        "qk_nope_head_dim": c.qk_nope_head_dim,
        "qk_rope_head_dim": c.qk_rope_head_dim,
        "v_head_dim": c.v_head_dim,
        "mla_use_nope": True,
        "mla_use_output_gate": c.mla_output_gate,
        "linear_attn_config": {"kda_layers": list(c.kda_layers), "full_attn_layers": list(c.full_attn_layers),
                               "head_dim": c.kda_head_dim, "num_heads": c.kda_heads,
                               "short_conv_kernel_size": c.short_conv, "use_full_rank_gate": True,
                               "gate_lower_bound": c.gate_lower_bound},
        "attn_res_block_size": c.attn_res_block_size,
        "num_nextn_predict_layers": c.mtp_layers,
        "max_position_embeddings": c.max_positions,
        "rope_theta": 10000.0,
        "initializer_range": 0.02,
        **COMMON_HF_CONFIG,
        "rms_norm_eps": c.rms_norm_eps,
    }


def expert_module_names(c: TinyKimiK3Config) -> list[str]:
    """The routed experts' module names (no ``.weight``), in checkpoint order."""
    return [f"model.layers.{layer}.block_sparse_moe.experts.{e}.{p}"
            for layer in range(c.first_k_dense, c.layers) for e in range(c.experts) for p in _EXPERT_PROJ]


def random_weights(c: TinyKimiK3Config) -> dict[str, Any]:
    """Every tensor of the BF16 checkpoint (the experts before the block gains)."""
    import torch

    draw = WeightDraw(c.seed)
    gen, randn, bf16, ones = draw.gen, draw.randn, draw.bf16, draw.ones
    H, E = c.hidden, c.experts
    R, alpha = int(c.owner_split[0]), float(c.owner_split[1])
    emb, v = draw.owner_skewed_embeddings(c.vocab, H, alpha)
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": bf16(emb), "model.norm.weight": ones(H),
                                  "lm_head.weight": bf16(randn(c.vocab, H, std=0.05))}
    for layer in range(c.layers):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = ones(H)
        w[p + "post_attention_layernorm.weight"] = ones(H)
        a = p + "self_attn."
        if layer + 1 in c.kda_layers:
            proj, D = c.kda_heads * c.kda_head_dim, c.kda_head_dim
            for name in ("q_proj", "k_proj", "v_proj", "g_proj"):  # g_proj: K3's full-rank output gate
                w[a + name + ".weight"] = bf16(randn(proj, H, std=0.05))
            w[a + "b_proj.weight"] = bf16(randn(c.kda_heads, H, std=0.05))
            w[a + "f_a_proj.weight"] = bf16(randn(D, H, std=0.05))
            w[a + "f_b_proj.weight"] = bf16(randn(proj, D, std=0.05))
            for name in ("q_conv1d", "k_conv1d", "v_conv1d"):  # nn.Conv1d layout [channels, 1, kernel]
                w[a + name + ".weight"] = bf16(randn(proj, 1, c.short_conv, std=0.3))
            # fp32 as vLLM registers them; A_log 1-D (vLLM also reads the older [1, 1, heads, 1])
            w[a + "A_log"] = torch.log(torch.rand(c.kda_heads, generator=gen) * 15 + 1).float()
            w[a + "dt_bias"] = randn(proj, std=0.1).float()
            w[a + "o_norm.weight"] = ones(D)
            w[a + "o_proj.weight"] = bf16(randn(H, proj, std=0.05))
        else:
            w.update(_mla_attention(c, draw, a))
        if c.attn_res_block_size is not None:
            w[p + "self_attention_res_norm.weight"] = ones(H)
            w[p + "mlp_res_norm.weight"] = ones(H)
            w[p + "self_attention_res_proj.weight"] = bf16(randn(1, H, std=0.05))
            w[p + "mlp_res_proj.weight"] = bf16(randn(1, H, std=0.05))
        if layer < c.first_k_dense:
            w.update(_mlp(c, draw, p + "mlp.", c.intermediate))
            continue
        gate = randn(E, H, std=c.router_std)
        if alpha:
            owner = torch.arange(E) // (E // R)
            gate = gate + torch.where(owner == 0, alpha, -alpha)[:, None] * v[None, :]
        w.update(_moe_block(c, draw, p + "block_sparse_moe.", gate))
    if c.attn_res_block_size is not None:
        w["model.output_attn_res_norm.weight"] = ones(H)
        w["model.output_attn_res_proj.weight"] = bf16(randn(1, H, std=0.05))
    for layer in range(c.layers, c.layers + c.mtp_layers):
        w.update(_mtp_layer(c, draw, layer))
    return w


def _mlp(c: TinyKimiK3Config, draw: WeightDraw, prefix: str, width: int) -> dict[str, Any]:
    """A SiTU MLP of ``width`` on the full hidden (the dense layer, the shared experts)."""
    H = c.hidden
    return {prefix + "gate_proj.weight": draw.bf16(draw.randn(width, H, std=0.05)),
            prefix + "up_proj.weight": draw.bf16(draw.randn(width, H, std=0.05)),
            prefix + "down_proj.weight": draw.bf16(draw.randn(H, width, std=0.05))}


def _mla_attention(c: TinyKimiK3Config, draw: WeightDraw, a: str) -> dict[str, Any]:
    """An MLA layer's ``self_attn.`` tensors (q-LoRA, NoPE, the output gate where configured)."""
    randn, bf16, ones, H = draw.randn, draw.bf16, draw.ones, c.hidden
    qk_head = c.qk_nope_head_dim + c.qk_rope_head_dim
    w = {a + "q_a_proj.weight": bf16(randn(c.q_lora_rank, H, std=0.05))}
    w[a + "q_a_layernorm.weight"] = ones(c.q_lora_rank)
    w[a + "q_b_proj.weight"] = bf16(randn(c.heads * qk_head, c.q_lora_rank, std=0.05))
    w[a + "kv_a_proj_with_mqa.weight"] = bf16(randn(c.kv_lora_rank + c.qk_rope_head_dim, H, std=0.05))
    w[a + "kv_a_layernorm.weight"] = ones(c.kv_lora_rank)
    w[a + "kv_b_proj.weight"] = bf16(randn(c.heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank,
                                           std=0.05))
    if c.mla_output_gate:
        w[a + "g_proj.weight"] = bf16(randn(c.heads * c.v_head_dim, H, std=0.05))
    w[a + "o_proj.weight"] = bf16(randn(H, c.heads * c.v_head_dim, std=0.05))
    return w


def _moe_block(c: TinyKimiK3Config, draw: WeightDraw, m: str, gate: Any) -> dict[str, Any]:
    """A latent MoE block's tensors under ``m`` (``...block_sparse_moe.``), its router weights ``gate`` given."""
    randn, bf16, ones = draw.randn, draw.bf16, draw.ones
    H, L, E, Im = c.hidden, c.latent, c.experts, c.moe_intermediate
    w = {m + "gate.weight": bf16(gate), m + "gate.e_score_correction_bias": randn(E, std=c.bias_std).float()}
    # latent down: unit-RMS MoE inputs (post_attention_layernorm) give unit-RMS latent rows
    w[m + "routed_expert_down_proj.weight"] = bf16(randn(L, H, std=H ** -0.5))
    w[m + "routed_expert_norm.weight"] = ones(L)
    w[m + "routed_expert_up_proj.weight"] = bf16(randn(H, L, std=0.5 * L ** -0.5))
    for e in range(E):
        q = f"{m}experts.{e}."
        w[q + "w1.weight"] = bf16(randn(Im, L, std=c.gate_out_std * L ** -0.5))
        w[q + "w3.weight"] = bf16(randn(Im, L, std=c.up_out_std * L ** -0.5))
        w[q + "w2.weight"] = bf16(randn(L, Im, std=Im ** -0.5))
    if c.shared_experts:
        w.update(_mlp(c, draw, m + "shared_experts.", Im * c.shared_experts))
    return w


def _mtp_layer(c: TinyKimiK3Config, draw: WeightDraw, layer: int) -> dict[str, Any]:
    """One MTP layer's tensors: MLA attention, a MoE block (BF16 experts, an unskewed router), the MTP head's
    projections."""
    randn, bf16, ones, H = draw.randn, draw.bf16, draw.ones, c.hidden
    p = f"model.layers.{layer}."
    w = {p + "input_layernorm.weight": ones(H), p + "post_attention_layernorm.weight": ones(H),
         p + "enorm.weight": ones(H), p + "hnorm.weight": ones(H),
         p + "eh_proj.weight": bf16(randn(H, 2 * H, std=0.05)),
         p + "shared_head.norm.weight": ones(H), p + "shared_head.head.weight": bf16(randn(c.vocab, H, std=0.05))}
    w.update(_mla_attention(c, draw, p + "self_attn."))
    w.update(_moe_block(c, draw, p + "block_sparse_moe.", randn(c.experts, H, std=c.router_std)))
    return w


def _weights(c: TinyKimiK3Config, fmt: str) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
    from .tiny_quantized import compress_experts_ct, with_block_gains

    names = expert_module_names(c)
    weights = with_block_gains(random_weights(c), names, c.seed)
    if fmt == "bf16":
        return weights, None
    tensors, qcfg = compress_experts_ct(weights, "mxfp4", names=names, ignore=K3_IGNORE)
    out = {k: t for k, t in weights.items() if k[:-len(".weight")] not in set(names)}
    out.update(tensors)
    return out, qcfg


def build_tiny_kimi_k3(name: str = "tiny-k3", out_dir: Optional[str] = None,
                       config: Optional[TinyKimiK3Config] = None) -> str:
    """Write tiny K3 ``name`` (a key of :data:`K3_MODELS`) into ``out_dir`` (default :func:`default_model_dir`)
    and return it; idempotent (a stamp of the config and format)."""
    if name not in K3_MODELS:
        raise ConfigError(f"unknown tiny Kimi K3 {name!r}. Fix: one of {sorted(K3_MODELS)}")
    c = config or TinyKimiK3Config()
    _validate(c)
    fmt = K3_MODELS[name]
    if c.mtp_layers and fmt != "bf16":
        raise ConfigError(f"tiny Kimi K3 {name!r}: mtp_layers {c.mtp_layers} with {fmt} experts; the MTP layer's "
                          "experts are written in BF16 only. Fix: build tiny-k3 with mtp_layers")
    out = out_dir or default_model_dir(name, c)
    stamp = {"format": fmt, **dataclasses.asdict(c)}
    stamp_path = os.path.join(out, "moonep_ep_tiny.json")
    if os.path.exists(stamp_path) and os.path.exists(os.path.join(out, "model.safetensors")):
        with open(stamp_path) as f:
            if json.load(f) == json.loads(json.dumps(stamp)):
                return out
    tensors, qcfg = _weights(c, fmt)
    cfg = hf_config(c) if qcfg is None else {**hf_config(c), "quantization_config": qcfg}
    return write_checkpoint(out, stamp, cfg, lambda: tensors, c.vocab, c.max_positions)


def saturation_fractions(model_dir: str, hidden: Any = None, tokens: int = 512, seed: int = 0) -> dict[str, Any]:
    """How often SiTU saturates on the experts the router picks, per MoE layer and in all.

    ``hidden``: MoE-block inputs ``[T, H]`` (after ``post_attention_layernorm``), e.g. a prompt's hidden states;
    default ``tokens`` random rows of unit RMS from ``seed`` (what ``post_attention_layernorm`` with unit weights
    gives). Per layer: the latent ``x = routed_expert_down_proj · h``, the router's top-k (sigmoid scores plus
    the correction bias), and for each chosen (token, expert) the gate ``g = w1·x`` and up ``u = w3·x`` in fp32
    with the checkpoint's expert weights (the MXFP4 ones decompressed by compressed-tensors). Returns the
    fractions of ``|g| > beta`` and ``|u| > linear_beta`` (and the counts)."""
    import torch

    from .tiny_quantized import _read, decompress_tensors

    cfg, tensors = _read(model_dir)
    if cfg.get("quantization_config"):
        tensors = decompress_tensors(cfg, tensors)
    beta, lbeta = float(cfg["activation_situ_beta"]), float(cfg["activation_situ_linear_beta"])
    H, E, K = int(cfg["hidden_size"]), int(cfg["num_experts"]), int(cfg["num_experts_per_token"])
    given = hidden is not None
    if hidden is None:
        h = torch.randn(tokens, H, generator=torch.Generator().manual_seed(seed))
        hidden = h / h.pow(2).mean(-1, keepdim=True).sqrt()
    hidden = hidden.float()
    per_layer, totals = {}, [0, 0, 0]
    for layer in range(int(cfg["first_k_dense_replace"]), int(cfg["num_hidden_layers"])):
        m = f"model.layers.{layer}.block_sparse_moe."
        x = hidden @ tensors[m + "routed_expert_down_proj.weight"].float().T
        scores = torch.sigmoid(hidden @ tensors[m + "gate.weight"].float().T)
        chosen = torch.topk(scores + tensors[m + "gate.e_score_correction_bias"].float(), K, dim=-1).indices
        g_past = u_past = n = 0
        for e in range(E):
            rows = (chosen == e).any(-1)
            if not rows.any():
                continue
            xe = x[rows]
            g = xe @ tensors[f"{m}experts.{e}.w1.weight"].float().T
            u = xe @ tensors[f"{m}experts.{e}.w3.weight"].float().T
            g_past += int((g.abs() > beta).sum())
            u_past += int((u.abs() > lbeta).sum())
            n += g.numel()
        per_layer[layer] = {"gate_past_beta": g_past / n, "up_past_linear_beta": u_past / n, "outputs": n}
        totals = [totals[0] + g_past, totals[1] + u_past, totals[2] + n]
    return {"beta": beta, "linear_beta": lbeta, "tokens": int(hidden.shape[0]),
            "inputs": "the given MoE-block inputs" if given else f"random unit-RMS rows (seed {seed})",
            "gate_past_beta": totals[0] / totals[2], "up_past_linear_beta": totals[1] / totals[2],
            "outputs": totals[2], "per_layer": per_layer}


def low_prompt_ids(n: int, start: int = 0, vocab: int = 1024) -> list[int]:
    """``n`` token ids of "low" words (their embeddings lean to owner 0's experts)."""
    from .tiny_deepseek_v3 import low_prompt_ids as low

    return low(n, start, vocab)


def high_prompt_ids(n: int, start: int = 0, vocab: int = 1024) -> list[int]:
    """``n`` token ids of "high" words (their embeddings lean to the other owners' experts)."""
    from .tiny_deepseek_v3 import high_prompt_ids as high

    return high(n, start, vocab)


def skewed_by_default(name: str) -> bool:
    """Tiny models whose demo workload is skewed unless asked otherwise, and whose runs must then show fills from
    every owner: the tiny DeepSeek-V3 family (its planted skew) and the tiny Kimi K3s (prompts read off their own
    routers, ``tools/engine/router_skew.py``)."""
    from .tiny_quantized import skewed_tiny_deepseek

    return skewed_tiny_deepseek(name) or name in K3_MODELS
