"""A tiny Qwen3-MoE checkpoint and an offline WordLevel tokenizer, built locally.

Nothing is downloaded: the weights are random bf16 tensors from a fixed seed
written as one ``model.safetensors`` with HuggingFace Qwen3-MoE parameter
names, next to ``config.json``, ``generation_config.json`` and a
``tokenizer.json`` built with the ``tokenizers`` library (a ``WordLevel``
vocabulary ``<pad> <s> </s> <unk> w4 … w{V-1}`` split on whitespace).
Prompts are therefore strings such as ``"w5 w6 w7 w8"``.

Default shape: hidden 512, moe_intermediate 256, 8 experts, top-2, 2
layers, vocab 1024, 4 heads (2 KV heads, head_dim 128). About 18 MB on disk,
built in a couple of seconds. ``hidden`` and ``intermediate`` may be set to
non-multiples of 128 to exercise MoonEP's tile check.

:func:`write_checkpoint` and :func:`write_wordlevel_tokenizer` are shared
with the tiny DeepSeek-V3 builder (``tiny_deepseek_v3.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable

__all__ = ["TinyMoEConfig", "build_tiny_qwen3_moe", "demo_prompts", "default_model_dir", "write_checkpoint",
           "write_wordlevel_tokenizer", "mixed_prompt_ids"]


def default_model_dir(config: "TinyMoEConfig | None" = None) -> str:
    """A per-shape cache directory under the system temp dir."""
    import tempfile

    c = config or TinyMoEConfig()
    tag = "" if c == TinyMoEConfig() else f"-h{c.hidden}-i{c.intermediate}-e{c.experts}-k{c.top_k}-l{c.layers}"
    if c.seed != TinyMoEConfig().seed:  # another checkpoint of the same shape (weight updates)
        tag += f"-s{c.seed}"
    return os.path.join(tempfile.gettempdir(), f"moonep-ep-tiny-qwen3-moe{tag}")


@dataclasses.dataclass(frozen=True)
class TinyMoEConfig:
    hidden: int = 512
    intermediate: int = 256
    experts: int = 8
    top_k: int = 2
    layers: int = 2
    vocab: int = 1024
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 128
    max_positions: int = 512
    seed: int = 0


def config_cache_dir(name: str, config: Any, default: Any) -> str:
    """``moonep-ep-<name>`` under the system temp dir for the default ``config`` (a dataclass), and with a hash of
    its fields for any other, so two configs never share a cached checkpoint."""
    import hashlib
    import tempfile

    tag = "" if config == default else "-" + hashlib.sha1(
        json.dumps(dataclasses.asdict(config), sort_keys=True).encode()).hexdigest()[:10]
    return os.path.join(tempfile.gettempdir(), f"moonep-ep-{name}{tag}")


class WeightDraw:
    """Seeded draws of a tiny checkpoint's tensors: every builder draws in a fixed order from one generator, so
    one seed gives the same bytes on every machine."""

    def __init__(self, seed: int):
        import torch

        self.gen = torch.Generator().manual_seed(seed)

    def randn(self, *shape: int, std: float) -> Any:
        import torch

        return torch.randn(*shape, generator=self.gen) * std

    @staticmethod
    def bf16(t: Any) -> Any:
        import torch

        return t.to(torch.bfloat16).contiguous()

    @staticmethod
    def ones(n: int) -> Any:
        import torch

        return torch.ones(n, dtype=torch.bfloat16)

    def owner_skewed_embeddings(self, vocab: int, hidden: int, alpha: float) -> tuple[Any, Any]:
        """``[vocab, hidden]`` embeddings and a unit direction ``v``; with ``alpha``, each embedding's component
        along ``v`` is replaced by +-0.5*sqrt(hidden) (low words +, high words -), which routers tilted along
        ``v`` turn into an owner skew."""
        import torch

        v = self.randn(hidden, std=1.0)
        v = v / v.norm()
        emb = self.randn(vocab, hidden, std=1.0)
        if alpha:
            sign = torch.where(torch.arange(vocab) < vocab // 2, 1.0, -1.0)
            emb = emb - (emb @ v)[:, None] * v[None, :] + (sign * 0.5 * hidden ** 0.5)[:, None] * v[None, :]
        return emb, v


#: ``config.json`` keys every tiny model shares (the WordLevel tokenizer's special ids, bf16, no biases).
COMMON_HF_CONFIG: dict[str, Any] = {
    "rms_norm_eps": 1e-6, "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "use_cache": True,
}


def _hf_config(c: TinyMoEConfig) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": c.vocab,
        "hidden_size": c.hidden,
        "intermediate_size": c.intermediate * 2,   # dense MLP size (no dense layer is built)
        "moe_intermediate_size": c.intermediate,
        "num_hidden_layers": c.layers,
        "num_attention_heads": c.heads,
        "num_key_value_heads": c.kv_heads,
        "head_dim": c.head_dim,
        "num_experts": c.experts,
        "num_experts_per_tok": c.top_k,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "output_router_logits": False,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_positions,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        **COMMON_HF_CONFIG,
        "sliding_window": None,
        "use_sliding_window": False,
    }


def _weights(c: TinyMoEConfig) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(c.seed)

    def randn(*shape: int, std: float) -> "torch.Tensor":
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)

    H, I, E = c.hidden, c.intermediate, c.experts
    q_out, kv_out = c.heads * c.head_dim, c.kv_heads * c.head_dim
    w: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": randn(c.vocab, H, std=1.0),
        "model.norm.weight": torch.ones(H, dtype=torch.bfloat16),
        "lm_head.weight": randn(c.vocab, H, std=0.05),
    }
    for layer in range(c.layers):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16)
        w[p + "post_attention_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16)
        w[p + "self_attn.q_proj.weight"] = randn(q_out, H, std=0.02)
        w[p + "self_attn.k_proj.weight"] = randn(kv_out, H, std=0.02)
        w[p + "self_attn.v_proj.weight"] = randn(kv_out, H, std=0.02)
        w[p + "self_attn.o_proj.weight"] = randn(H, q_out, std=0.02)
        w[p + "self_attn.q_norm.weight"] = torch.ones(c.head_dim, dtype=torch.bfloat16)
        w[p + "self_attn.k_norm.weight"] = torch.ones(c.head_dim, dtype=torch.bfloat16)
        w[p + "mlp.gate.weight"] = randn(E, H, std=0.1)
        for e in range(E):
            q = f"{p}mlp.experts.{e}."
            w[q + "gate_proj.weight"] = randn(I, H, std=0.05)
            w[q + "up_proj.weight"] = randn(I, H, std=0.05)
            w[q + "down_proj.weight"] = randn(H, I, std=0.05)
    return w


def write_wordlevel_tokenizer(out_dir: str, vocab_size: int, max_positions: int) -> None:
    """The offline tokenizer: ``<pad> <s> </s> <unk> w4 … w{V-1}``, word ``wN`` = token id ``N``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for i in range(4, vocab_size):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
            "model_max_length": max_positions, "add_bos_token": False, "add_eos_token": False,
            "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}",
        }, f, indent=1)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}, f)


def write_checkpoint(out_dir: str, stamp: dict[str, Any], hf_config: dict[str, Any],
                     weights: Callable[[], dict[str, Any]], vocab_size: int, max_positions: int) -> str:
    """Write ``config.json``, ``generation_config.json``, ``model.safetensors`` (from ``weights()``) and the
    tokenizer into ``out_dir``, unless its stamp file already records ``stamp``. Returns ``out_dir``."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    stamp_path = os.path.join(out_dir, "moonep_ep_tiny.json")
    want = json.loads(json.dumps(stamp))  # tuples -> lists, as the stamp file holds them
    if os.path.exists(stamp_path):
        with open(stamp_path) as f:
            if json.load(f) == want and os.path.exists(os.path.join(out_dir, "model.safetensors")):
                return out_dir
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=1)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "do_sample": False}, f)
    save_file(weights(), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    write_wordlevel_tokenizer(out_dir, vocab_size, max_positions)
    with open(stamp_path, "w") as f:
        json.dump(want, f)
    return out_dir


def build_tiny_qwen3_moe(out_dir: str, config: TinyMoEConfig | None = None) -> str:
    """Write the checkpoint into ``out_dir`` (created) and return it. Idempotent per config."""
    c = config or TinyMoEConfig()
    return write_checkpoint(out_dir, dataclasses.asdict(c), _hf_config(c), lambda: _weights(c), c.vocab,
                            c.max_positions)


def demo_prompts(n: int = 6, vocab: int = 1024) -> list[str]:
    """``n`` distinct prompts of the WordLevel vocabulary; the last one is long (200 words)."""
    return [" ".join(f"w{t}" for t in ids) for ids in mixed_prompt_ids(n, vocab)]


def mixed_prompt_ids(n: int = 6, vocab: int = 1024) -> list[list[int]]:
    """Token ids of :func:`demo_prompts` (word ``wN`` is id ``N``), for any vocabulary of at least 128."""
    out = []
    for i in range(max(n - 1, 0)):
        start = 4 + (37 * i) % (vocab - 64)
        out.append([start + j * (i + 1) % 50 for j in range(4 + 3 * i)])
    if n:
        out.append([4 + (j * 7) % (vocab - 4) for j in range(200)])
    return out[:n]
