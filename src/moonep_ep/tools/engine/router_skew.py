"""A skewed workload for any checkpoint: prompts whose tokens the checkpoint's own routers send to one owner.

``vllm-demo --model PATH --workload skewed`` needs prompts that overload one
owner's experts per DP rank (what makes MoonEP's planner prefetch), without
knowing how the checkpoint was made. The routers say it: for each candidate
token id, the token's embedding, RMS-normalized and scaled by each MoE
layer's ``post_attention_layernorm`` weight, goes through that layer's router
(``mlp.gate`` / ``block_sparse_moe.gate``; DeepSeek-V3's ``noaux_tc``
selection adds ``e_score_correction_bias`` to the sigmoid scores), and the
top-k experts it picks are counted by owner (linear placement: expert ``e``
lives on rank ``e // (E / R)``). A token's *owner share* is the fraction of
its picks, over all MoE layers, on one owner.

This reads the residual stream as the embedding alone (attention and earlier
layers add to it); the workload is a choice of prompts, not a claim about
routing: the engine's own counts (``vllm/observe/stats.py``) report what was moved.
Only the embedding, the norms and the routers are read (safetensors), never
the experts.
"""

from __future__ import annotations

import functools
import json
import os
import re
from typing import Any

from ...errors import ConfigError

__all__ = ["owner_shares", "owner_pools", "pool_prompt"]

EMBEDDING = "model.embed_tokens.weight"
ROUTER = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.gate\.weight$")
#: Token ids below this are the special tokens of the tiny tokenizers (pad, bos, eos, unk).
FIRST_WORD = 4
#: Candidate ids read (the embedding rows beyond are never loaded).
MAX_CANDIDATES = 4096
#: Distinct tokens per owner a prompt cycles through.
POOL = 64


def _tensor_files(path: str) -> dict[str, str]:
    """Tensor name -> safetensors file, from the index or from every file's header."""
    from safetensors import safe_open

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
    files: dict[str, str] = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), framework="pt") as f:
                files.update({k: os.path.join(path, name) for k in f.keys()})
    return files


def owner_shares(path: str, experts: int, top_k: int, owners: int, vocab: int,
                 rms_eps: float = 1e-6) -> tuple[list[int], Any]:
    """``(candidate token ids, shares [len(ids), owners])``: each id's fraction of router picks per owner."""
    import torch
    from safetensors import safe_open

    if experts % owners:
        raise ConfigError(f"{experts} experts do not split over {owners} owners. Fix: a --dp that divides them")
    files = _tensor_files(path)
    routers = sorted((int(m.group(1)), k) for k in files if (m := ROUTER.match(k)))
    if EMBEDDING not in files or not routers:
        raise ConfigError(f"--workload skewed reads the embedding ({EMBEDDING}) and the routers "
                          f"(model.layers.N.mlp.gate.weight) of {path}; found embedding: {EMBEDDING in files}, "
                          f"routers: {len(routers)}. Fix: --workload mixed")

    def read(name: str) -> "torch.Tensor":
        with safe_open(files[name], framework="pt") as f:
            return f.get_tensor(name)

    ids = list(range(FIRST_WORD, min(vocab, FIRST_WORD + MAX_CANDIDATES)))
    emb = read(EMBEDDING)[ids].float()
    x = emb * torch.rsqrt(emb.pow(2).mean(-1, keepdim=True) + rms_eps)
    per_owner = experts // owners
    shares = torch.zeros(len(ids), owners)
    for layer, key in routers:
        gate = read(key).float()
        if gate.shape[0] != experts:
            raise ConfigError(f"{key}: {gate.shape[0]} router rows, the config says {experts} experts. "
                              "Fix: --workload mixed")
        norm_key = f"model.layers.{layer}.post_attention_layernorm.weight"
        h = x * read(norm_key).float() if norm_key in files else x
        logits = h @ gate.T
        bias_key = key.replace(".weight", ".e_score_correction_bias")
        score = torch.sigmoid(logits) + read(bias_key).float() if bias_key in files else logits
        picks = score.topk(top_k, dim=-1).indices // per_owner
        shares += torch.nn.functional.one_hot(picks, owners).float().mean(1)
    return ids, shares / len(routers)


def owner_pools(path: str, info: dict[str, Any], owners: int, pool: int = POOL) -> tuple[list[list[int]], list[float]]:
    """``(pools, mean shares)``: per owner, the ``pool`` candidate ids whose router picks fall most on it (ties by
    id), and their mean share of picks on that owner (``1 / owners`` is no skew, 1.0 every pick)."""
    return _owner_pools(path, int(info["experts"]), int(info["top_k"]), owners, int(info.get("vocab_size") or 1024),
                        pool)


@functools.lru_cache(maxsize=4)  # the workload and the summary ask for the same checkpoint's pools
def _owner_pools(path: str, experts: int, top_k: int, owners: int, vocab: int,
                 pool: int) -> tuple[list[list[int]], list[float]]:
    ids, shares = owner_shares(path, experts, top_k, owners, vocab)
    pools, means = [], []
    for owner in range(owners):
        order = sorted(range(len(ids)), key=lambda i: (-float(shares[i, owner]), ids[i]))[:pool]
        pools.append([ids[i] for i in order])
        means.append(round(float(shares[order, owner].mean()), 3))
    return pools, means


def pool_prompt(pool: list[int], length: int, start: int = 0) -> list[int]:
    """``length`` ids cycled from ``pool`` with a stride, so that neighbouring tokens differ."""
    return [pool[(start + 7 * j) % len(pool)] for j in range(length)]
