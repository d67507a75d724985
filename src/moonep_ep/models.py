"""Routed-expert shapes of public MoE models, and a HuggingFace config reader.

Only what sizes the routed experts is kept: the width an expert reads
(``hidden_size``, ``H``), its intermediate size (``I``), the number of routed
experts per MoE layer (``E``), top-k (``K``) and the number of MoE layers
(``L``). One routed expert is three projections, gate ``[I, H]``, up
``[I, H]`` and down ``[H, I]``, i.e. ``3*H*I`` parameters.

Shapes come from each model's released config; docs/design/models.md §1
names the source of every one. ``row_bytes`` / ``expert_bytes`` here are
BF16 (``dtype_bytes = 2``); ``expert_format`` names the format the released
checkpoint stores its routed experts in (``bf16``, ``fp8-block``,
``int4-g32``, ``mxfp4``; ``moonep_ep.layout.formats`` sizes each, scales
included), and ``footprint`` uses it by default.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Mapping

from .errors import ConfigError

__all__ = [
    "MoEModelConfig",
    "MODELS",
    "DEFAULT_MODELS",
    "model_names",
    "lookup_model",
    "get_model",
    "load_hf_config",
    "parse_hf_config",
    "expert_bytes",
    "expert_format_of",
]


@dataclasses.dataclass(frozen=True)
class MoEModelConfig:
    """Routed-expert geometry of one MoE model.

    Attributes:
        name: canonical name (``kimi-k2``) or, for a parsed config, its path.
        hidden_size: ``H``, the width each expert reads and writes (for Kimi
            K3 the latent 3584, not the model width 7168), in elements.
        moe_intermediate_size: ``I``, each routed expert's intermediate size.
        num_experts: ``E``, routed experts per MoE layer (shared experts excluded).
        top_k: ``K``, routed experts selected per token.
        num_moe_layers: ``L``, decoder layers that have routed experts
            (dense layers and MTP layers excluded).
        dtype_bytes: bytes per parameter used for sizing (2 = BF16).
        native_dtype: dtype the released checkpoint stores routed experts in (free text).
        notes: provenance and caveats.
        expert_format: the routed experts' storage format in the released checkpoint
            (``layout.formats`` name); ``""`` when a parsed config's quantization is not
            one of them (``quantization`` says why).
        quantization: the checkpoint's quantization, in words (``""`` for none).
    """

    name: str
    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    num_moe_layers: int
    dtype_bytes: int = 2
    native_dtype: str = "bf16"
    notes: str = ""
    expert_format: str = "bf16"
    quantization: str = ""

    def __post_init__(self) -> None:
        for field in ("hidden_size", "moe_intermediate_size", "num_experts", "top_k",
                      "num_moe_layers", "dtype_bytes"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model {self.name!r}: {field} must be a positive int: got {value!r}. "
                                  f"Fix: give {field} as a positive integer")
        if self.top_k > self.num_experts:
            raise ConfigError(f"model {self.name!r}: top_k {self.top_k} exceeds num_experts "
                              f"{self.num_experts}. Fix: check num_experts_per_tok in the config")

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert (gate + up + down): ``3*H*I``."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def row_bytes(self) -> tuple[int, int, int]:
        """Bytes of one expert row per projection, ``(gate, up, down)``: each ``I*H*dtype_bytes``."""
        rb = self.hidden_size * self.moe_intermediate_size * self.dtype_bytes
        return (rb, rb, rb)

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert (all three projections) at ``dtype_bytes``."""
        return sum(self.row_bytes)

    @property
    def routed_bytes(self) -> int:
        """Bytes of every routed expert of every MoE layer: ``L*E*3*H*I*dtype_bytes``."""
        return self.num_moe_layers * self.num_experts * self.expert_bytes

    def summary(self) -> str:
        """One line: ``E=.. K=.. H=.. I=.. L=..`` and MB per expert (1 MB = 1e6 bytes)."""
        return (f"E={self.num_experts} K={self.top_k} H={self.hidden_size} "
                f"I={self.moe_intermediate_size} L={self.num_moe_layers}, "
                f"{self.dtype_bytes} B/param, {self.expert_bytes / 1e6:.1f} MB/expert "
                f"(native {self.native_dtype})")


def expert_bytes(config: MoEModelConfig, dtype_bytes: int | None = None) -> int:
    """Bytes of one routed expert (``3*H*I`` params) at ``dtype_bytes`` (default: the config's)."""
    b = config.dtype_bytes if dtype_bytes is None else dtype_bytes
    return config.expert_params * b


_REF = "models.md §1, source"

MODELS: dict[str, MoEModelConfig] = {m.name: m for m in [
    MoEModelConfig("kimi-k3", 3584, 3072, 896, 16, 92, native_dtype="mxfp4",
                   notes=f"H = latent routed-expert width 3584 (model width 7168); 93 layers, "
                         f"92 MoE; 2 shared experts not counted ({_REF}s 1-5)",
                   expert_format="mxfp4", quantization="compressed-tensors mxfp4-pack-quantized"),
    MoEModelConfig("kimi-k2", 7168, 2048, 384, 8, 60, native_dtype="fp8",
                   notes=f"K2-Instruct/Base; 61 layers, first_k_dense_replace=1; 1 shared expert not "
                         f"counted; K2-Thinking/K2.5+ are kimi-k2-thinking ({_REF}s 6-10)",
                   expert_format="fp8-block", quantization="fp8, weight_block_size [128, 128]"),
    MoEModelConfig("kimi-k2-thinking", 7168, 2048, 384, 8, 60, native_dtype="int4",
                   notes=f"K2-Thinking, K2.5, K2.6, K2.7-Code: K2's MoE with routed experts INT4 W4A16 "
                         f"(attention, shared expert, lm_head BF16) ({_REF}s 7, 9, 10)",
                   expert_format="int4-g32",
                   quantization="compressed-tensors pack-quantized, int4, group 32, symmetric"),
    MoEModelConfig("deepseek-v3", 7168, 2048, 256, 8, 58, native_dtype="fp8",
                   notes=f"61 layers, 3 dense; MTP layer not counted; same MoE for R1, V3.1, "
                         f"V3.2 ({_REF}s 7, 11)",
                   expert_format="fp8-block", quantization="fp8, weight_block_size [128, 128]"),
    MoEModelConfig("qwen3-235b-a22b", 4096, 1536, 128, 8, 94, native_dtype="bf16",
                   notes=f"no shared experts ({_REF} 12)"),
    MoEModelConfig("qwen3-30b-a3b", 2048, 768, 128, 8, 48, native_dtype="bf16",
                   notes=f"no shared experts ({_REF} 13)"),
    MoEModelConfig("qwen3-next-80b-a3b", 2048, 512, 512, 10, 48, native_dtype="bf16",
                   notes=f"1 shared expert (I 512) not counted ({_REF}s 14, 15)"),
    MoEModelConfig("glm-4.5", 5120, 1536, 160, 8, 89, native_dtype="bf16",
                   notes=f"92 layers, 3 dense; MTP layer not counted; same shape for GLM-4.6/4.7 "
                         f"({_REF}s 17, 18)"),
    MoEModelConfig("llama-4-maverick", 5120, 8192, 128, 1, 24, native_dtype="bf16",
                   notes=f"48 blocks, interleave_moe_layer_step=2 ({_REF}s 19, 20)"),
    MoEModelConfig("gpt-oss-120b", 2880, 2880, 128, 4, 36, native_dtype="mxfp4",
                   notes=f"experts ship MXFP4 ({_REF}s 22, 23); per-expert biases not counted",
                   expert_format="mxfp4", quantization="mxfp4"),
    MoEModelConfig("olmoe-1b-7b", 2048, 1024, 64, 8, 16, native_dtype="bf16",
                   notes=f"OLMoE-1B-7B-0924; used by the vLLM MoonEP PR for DP4/EP4 ({_REF} 24)"),
    MoEModelConfig("mixtral-8x22b", 6144, 16384, 8, 2, 56, native_dtype="bf16",
                   notes=f"E=8: MoonEP needs E % EP == 0, so EP <= 8 ({_REF} 21)"),
    MoEModelConfig("tiny", 512, 256, 16, 4, 4, native_dtype="bf16",
                   notes="moonep_ep CPU demo model; H, I multiples of 128 (MoonEP tile), "
                         "after hyper-accel/tiny-random-kimi-k2 (docs/design/models.md §1.2)"),
]}

#: Models reported by default (``tiny`` is a demo shape, not a real model).
DEFAULT_MODELS: tuple[str, ...] = tuple(n for n in MODELS if n != "tiny")

# Extra spellings; keys are compared after _normalize().
_ALIASES = {
    "kimik3": "kimi-k3", "kimik31": "kimi-k3", "kimik31pro": "kimi-k3",
    "kimik2": "kimi-k2", "kimik2instruct": "kimi-k2", "kimik2base": "kimi-k2",
    "kimik2thinking": "kimi-k2-thinking", "kimik25": "kimi-k2-thinking", "kimik26": "kimi-k2-thinking",
    "kimik27": "kimi-k2-thinking", "kimik27code": "kimi-k2-thinking", "k2thinking": "kimi-k2-thinking",
    "deepseekv3": "deepseek-v3", "deepseekr1": "deepseek-v3", "deepseekv31": "deepseek-v3",
    "deepseekv32": "deepseek-v3", "dsv3": "deepseek-v3",
    "qwen3235b": "qwen3-235b-a22b", "qwen3235ba22b": "qwen3-235b-a22b",
    "qwen330b": "qwen3-30b-a3b", "qwen330ba3b": "qwen3-30b-a3b",
    "qwen3next": "qwen3-next-80b-a3b", "qwen3next80b": "qwen3-next-80b-a3b",
    "glm45": "glm-4.5", "glm46": "glm-4.5", "glm47": "glm-4.5",
    "llama4maverick": "llama-4-maverick", "maverick": "llama-4-maverick",
    "gptoss120b": "gpt-oss-120b", "gptoss": "gpt-oss-120b",
    "olmoe": "olmoe-1b-7b", "olmoe1b7b": "olmoe-1b-7b", "olmoe1b7b0924": "olmoe-1b-7b",
    "mixtral8x22b": "mixtral-8x22b",
}


def _normalize(name: str) -> str:
    """Case-, underscore-, hyphen-, dot- and space-insensitive key (``Qwen3_30B-A3B`` -> ``qwen330ba3b``)."""
    return re.sub(r"[\s_\-./]+", "", name.strip().lower())


_LOOKUP: dict[str, str] = {_normalize(n): n for n in MODELS}
_LOOKUP.update(_ALIASES)


def model_names() -> list[str]:
    """Canonical names of every built-in model, ``tiny`` included."""
    return list(MODELS)


def lookup_model(name: str) -> MoEModelConfig | None:
    """The built-in model for ``name`` (any alias, any case), or ``None``."""
    canonical = _LOOKUP.get(_normalize(name))
    return MODELS[canonical] if canonical else None


def get_model(name_or_path: str) -> MoEModelConfig:
    """A built-in model by name, or a HuggingFace ``config.json`` (file or its directory).

    Raises ConfigError when ``name_or_path`` is neither.
    """
    model = lookup_model(name_or_path)
    if model is not None:
        return model
    if os.path.exists(name_or_path):
        return load_hf_config(name_or_path)
    raise ConfigError(f"unknown model {name_or_path!r} (not a built-in name and no such file). "
                      f"Fix: use one of {', '.join(MODELS)} or the path of a HuggingFace config.json")


# --------------------------------------------------------------------------------------------
# HuggingFace config.json
# --------------------------------------------------------------------------------------------

def _missing(path: str, key: str, fix: str) -> ConfigError:
    return ConfigError(f"{path}: missing key {key}. Fix: {fix}")


def _first(cfg: Mapping[str, Any], keys: tuple[str, ...]) -> tuple[str | None, Any]:
    for k in keys:
        if cfg.get(k) is not None:
            return k, cfg[k]
    return None, None


def _as_int(path: str, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{path}: key {key} must be an integer: got {value!r}. "
                          f"Fix: correct {key} in the config")
    return value


def _moe_layer_count(path: str, cfg: Mapping[str, Any], num_layers: int) -> tuple[int, str]:
    """Number of decoder layers with routed experts, and which rule decided it.

    Rules, first match wins (as the HF / vLLM model code does):

    * ``moe_layers`` (explicit list of indices, Llama 4);
    * ``first_k_dense_replace`` (+ ``moe_layer_freq``; DeepSeek, Kimi, GLM):
      layer ``i`` is MoE when ``i >= first_k_dense_replace and i % moe_layer_freq == 0``;
    * ``decoder_sparse_step`` / ``mlp_only_layers`` (Qwen2/3-MoE): layer ``i`` is MoE
      when ``i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0``;
    * ``interleave_moe_layer_step`` (Llama 4): layers ``step-1, 2*step-1, ...``;
    * otherwise every layer (Mixtral, OLMoE, gpt-oss).

    MTP layers (``num_nextn_predict_layers``) are not in ``num_hidden_layers``
    and are not counted.
    """
    layers = range(num_layers)
    if cfg.get("moe_layers") is not None:
        moe_layers = cfg["moe_layers"]
        if not isinstance(moe_layers, list):
            raise ConfigError(f"{path}: key moe_layers must be a list of layer indices: got "
                              f"{moe_layers!r}. Fix: correct moe_layers in the config")
        return len({i for i in moe_layers if 0 <= int(i) < num_layers}), "moe_layers"
    if cfg.get("first_k_dense_replace") is not None:
        k = _as_int(path, "first_k_dense_replace", cfg["first_k_dense_replace"])
        freq = _as_int(path, "moe_layer_freq", cfg.get("moe_layer_freq") or 1)
        return sum(1 for i in layers if i >= k and i % freq == 0), "first_k_dense_replace"
    if cfg.get("decoder_sparse_step") is not None or cfg.get("mlp_only_layers"):
        step = _as_int(path, "decoder_sparse_step", cfg.get("decoder_sparse_step") or 1)
        dense = set(cfg.get("mlp_only_layers") or [])
        return (sum(1 for i in layers if i not in dense and (i + 1) % step == 0),
                "decoder_sparse_step/mlp_only_layers")
    if cfg.get("interleave_moe_layer_step") is not None:
        step = _as_int(path, "interleave_moe_layer_step", cfg["interleave_moe_layer_step"])
        return len(range(step - 1, num_layers, step)), "interleave_moe_layer_step"
    return num_layers, "all layers"


def _native_dtype(cfg: Mapping[str, Any]) -> str:
    q = cfg.get("quantization_config")
    if isinstance(q, Mapping):
        method = str(q.get("quant_method") or q.get("format") or "quantized")
        bits, kind = q.get("num_bits"), q.get("type")
        groups = q.get("config_groups")
        if bits is None and isinstance(groups, Mapping):
            for group in groups.values():
                if isinstance(group, Mapping) and isinstance(group.get("weights"), Mapping):
                    bits, kind = group["weights"].get("num_bits"), group["weights"].get("type")
                    break
        # compressed-tensors' weight type: "int" (INT4 W4A16) or "float" (MXFP4: fp4 e2m1 values)
        return f"{method} {'fp' if kind == 'float' else 'int'}{bits}" if bits else method
    return str(cfg.get("torch_dtype") or cfg.get("dtype") or "bf16")


def _expert_group(groups: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The compressed-tensors config group that quantizes the routed experts' Linear layers.

    A group whose targets name experts wins; otherwise the one targeting ``Linear``
    (K2-Thinking: ``targets ["Linear"]`` and ``ignore`` lists attention and shared experts)."""
    candidates = [g for g in groups.values() if isinstance(g, Mapping) and isinstance(g.get("weights"), Mapping)]
    for g in candidates:
        if any("expert" in str(t).lower() for t in g.get("targets") or []):
            return g
    for g in candidates:
        if any(str(t) == "Linear" for t in g.get("targets") or []):
            return g
    return candidates[0] if candidates else None


def expert_format_of(qcfg: Any) -> tuple[str, str]:
    """``(expert_format, description)`` of a ``quantization_config`` (``None``: unquantized).

    Reads the two forms the supported checkpoints use:

    * vLLM/DeepSeek native ``{"quant_method": "fp8", "weight_block_size": [128, 128]}``
      -> ``fp8-block``; gpt-oss ``{"quant_method": "mxfp4"}`` -> ``mxfp4``;
    * compressed-tensors ``config_groups``: the experts' group's ``weights`` args —
      int 4-bit, ``strategy group``, symmetric, no act-order -> ``int4-g<group_size>``
      (K2-Thinking: g32); float 4-bit group 32 (E8M0 scales) -> ``mxfp4`` (Kimi K3);
      float 8-bit ``strategy block`` ``[128, 128]`` -> ``fp8-block``.

    Anything else gives ``("", why)``: the caller sizes it with an explicit format.
    """
    if qcfg is None:
        return "bf16", ""
    if not isinstance(qcfg, Mapping):
        return "", f"quantization_config is not an object ({qcfg!r})"
    method = str(qcfg.get("quant_method") or "").lower()
    if method == "fp8":
        block = qcfg.get("weight_block_size")
        desc = f"fp8, weight_block_size {block}"
        if block is not None and [int(b) for b in block] == [128, 128]:
            return "fp8-block", desc
        return "", f"{desc}: only 128x128 block FP8 is supported (per-tensor/channel FP8 is not)"
    if method == "mxfp4":
        return "mxfp4", "mxfp4"
    if method != "compressed-tensors":
        return "", f"quant_method {method or '?'!r} is not one of fp8 (block), mxfp4, compressed-tensors"
    fmt = str(qcfg.get("format") or "")
    group = _expert_group(qcfg.get("config_groups") or {})
    if group is None:
        return "", f"compressed-tensors {fmt}: no config group with weight quantization"
    w = group["weights"]
    bits, kind, strategy = w.get("num_bits"), str(w.get("type") or "int"), str(w.get("strategy") or "")
    gs, symmetric, actorder = w.get("group_size"), w.get("symmetric", True), w.get("actorder")
    desc = (f"compressed-tensors {fmt}, {kind}{bits}, {strategy}"
            + (f" {gs}" if gs else "") + (f" {w.get('block_structure')}" if w.get("block_structure") else "")
            + ("" if symmetric else ", asymmetric") + (f", actorder {actorder}" if actorder else ""))
    if kind == "int" and bits == 4 and strategy == "group" and isinstance(gs, int) and gs > 0:
        if not symmetric:
            return "", f"{desc}: zero points (asymmetric INT4) are not supported"
        if actorder:
            return "", f"{desc}: act-order (g_idx) is not supported"
        return f"int4-g{gs}", desc
    if kind == "float" and bits == 4 and strategy == "group" and gs == 32:
        return "mxfp4", desc
    if kind == "float" and bits == 8 and strategy == "block" and \
            [int(b) for b in (w.get("block_structure") or [])] == [128, 128]:
        return "fp8-block", desc
    return "", f"{desc}: not one of INT4 W4A16 group-wise, MXFP4, 128x128 block FP8"


def parse_hf_config(cfg: Mapping[str, Any], *, path: str = "<config>",
                    name: str | None = None) -> MoEModelConfig:
    """Build a MoEModelConfig from a parsed HuggingFace ``config.json`` dict.

    Keys read (a nested ``text_config`` overrides the top level, as in Llama 4
    and multimodal Kimi/Qwen configs):

    * ``H``: ``routed_expert_hidden_size`` (Kimi K3 latent MoE) else ``hidden_size``;
    * ``E``: ``n_routed_experts`` | ``num_experts`` | ``num_local_experts``;
    * ``I``: ``moe_intermediate_size``; ``intermediate_size`` only for configs whose
      experts use it (``num_local_experts`` / ``num_experts`` families without a
      ``moe_intermediate_size``, e.g. Mixtral, OLMoE, gpt-oss, Llama 4). A DeepSeek-style
      config (``n_routed_experts``) must have ``moe_intermediate_size``: its
      ``intermediate_size`` is the dense MLP;
    * ``K``: ``num_experts_per_tok`` | ``num_experts_per_token`` (Kimi K3) | ``experts_per_token`` | ``moe_topk``;
    * ``L``: ``num_hidden_layers`` filtered by the dense-layer keys (see
      ``_moe_layer_count``).

    ``row_bytes`` are BF16 (``dtype_bytes = 2``) whatever the checkpoint dtype;
    ``quantization_config`` sets ``expert_format`` (``expert_format_of``) and the
    checkpoint's dtype or quantization goes to ``native_dtype``.

    Raises ConfigError naming the missing or bad key and the fix.
    """
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"{path}: expected a JSON object at the top level: got "
                          f"{type(cfg).__name__}. Fix: pass a HuggingFace config.json")
    merged: dict[str, Any] = dict(cfg)
    text = cfg.get("text_config")
    if isinstance(text, Mapping):
        merged.update({k: v for k, v in text.items() if v is not None})

    ekey, num_experts = _first(merged, ("n_routed_experts", "num_experts", "num_local_experts"))
    if ekey is None:
        raise _missing(path, "n_routed_experts / num_experts / num_local_experts",
                       "this is not an MoE config (no routed-expert count); add the number of "
                       "routed experts per layer under one of these keys")
    num_experts = _as_int(path, ekey, num_experts)
    if num_experts <= 0:
        raise ConfigError(f"{path}: key {ekey} is {num_experts}: this model has no routed experts. "
                          f"Fix: pass an MoE model's config")

    hkey, hidden = _first(merged, ("routed_expert_hidden_size", "hidden_size"))
    if hkey is None:
        raise _missing(path, "hidden_size", "add hidden_size (the width each routed expert reads)")
    hidden = _as_int(path, hkey, hidden)

    if merged.get("moe_intermediate_size") is not None:
        ikey = "moe_intermediate_size"
    elif ekey != "n_routed_experts" and merged.get("intermediate_size") is not None:
        ikey = "intermediate_size"
    elif ekey == "n_routed_experts":
        raise _missing(path, "moe_intermediate_size",
                       "add moe_intermediate_size (each routed expert's intermediate size); "
                       "intermediate_size in a DeepSeek-style config is the dense MLP's")
    else:
        raise _missing(path, "moe_intermediate_size / intermediate_size",
                       "add moe_intermediate_size (each routed expert's intermediate size)")
    inter = _as_int(path, ikey, merged[ikey])

    # num_experts_per_token: KimiLinearConfig's spelling (Kimi K3, vLLM transformers_utils/configs/kimi_linear.py)
    kkey, top_k = _first(merged, ("num_experts_per_tok", "num_experts_per_token", "experts_per_token", "moe_topk"))
    if kkey is None:
        raise _missing(path, "num_experts_per_tok", "add num_experts_per_tok (top-k routed experts)")
    top_k = _as_int(path, kkey, top_k)

    lkey, num_layers = _first(merged, ("num_hidden_layers", "num_layers", "n_layers"))
    if lkey is None:
        raise _missing(path, "num_hidden_layers", "add num_hidden_layers (decoder layers)")
    num_layers = _as_int(path, lkey, num_layers)
    moe_layers, rule = _moe_layer_count(path, merged, num_layers)
    if moe_layers <= 0:
        raise ConfigError(f"{path}: no decoder layer has routed experts ({rule}, "
                          f"{num_layers} layers). Fix: check first_k_dense_replace / "
                          f"decoder_sparse_step / mlp_only_layers")

    if name is None:
        name = str(cfg.get("_name_or_path") or merged.get("_name_or_path") or path)
    notes = (f"parsed from {path}: H from {hkey}, I from {ikey}, E from {ekey}, K from {kkey}, "
             f"{moe_layers}/{num_layers} MoE layers ({rule}); model_type "
             f"{merged.get('model_type', '?')}")
    fmt, quant = expert_format_of(merged.get("quantization_config"))
    return MoEModelConfig(name=name, hidden_size=hidden, moe_intermediate_size=inter,
                          num_experts=num_experts, top_k=top_k, num_moe_layers=moe_layers,
                          dtype_bytes=2, native_dtype=_native_dtype(merged), notes=notes,
                          expert_format=fmt, quantization=quant)


def load_hf_config(path: str | os.PathLike[str]) -> MoEModelConfig:
    """Read a HuggingFace ``config.json`` (the file, or a directory holding it).

    Raises ConfigError if the file is missing, is not JSON, or lacks a key.
    """
    p = os.fspath(path)
    if os.path.isdir(p):
        p = os.path.join(p, "config.json")
    try:
        with open(p, encoding="utf-8") as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such file. Fix: pass the path of a HuggingFace config.json "
                          f"or the model directory that holds it") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{p}: not valid JSON ({exc}). Fix: pass a HuggingFace config.json") from None
    return parse_hf_config(cfg, path=p)
