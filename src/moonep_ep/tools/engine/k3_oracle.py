"""Kimi K3 in HuggingFace transformers' ``kimi_linear``: the oracle's model of a K3 checkpoint (issue 47).

transformers' ``KimiLinearForCausalLM`` holds K3's skeleton (KDA and MLA layers by ``linear_attn_config``, the
decoder layer, norms, ``lm_head``) but not K3's additions. :func:`load_k3_model` builds that model from the
checkpoint's config and puts in, written from the formulas (vLLM 0.33.0's ``vllm/models/kimi_k3/nvidia``
names and semantics):

* **the MoE block** (:class:`K3MoE`, every MoE layer; fp32 math from the weights as given)::

      scores = sigmoid(fp32(x) @ gate.T); chosen = top-k(scores + e_score_correction_bias)   (noaux_tc, 1 group)
      w      = scores[chosen] / sum(scores[chosen]) * routed_scaling_factor                  (bias only selects)
      latent = x @ routed_expert_down_proj.T
      routed = sum_k w_k * w2_e( situ(w1_e latent, w3_e latent) )                            [T, L]
      routed = rms_norm(routed) * routed_expert_norm.weight                                  (latent_moe_use_norm)
      out    = routed @ routed_expert_up_proj.T + shared_experts(x)
      situ(g, u) = beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta)

  (``KimiMoE.forward``, ``KimiRoutedOutputTransform``, ``SituAndMul``; the same order as
  ``tests/support/k3_moe_reference.py``, which a test ties this module to);
* **SiTU** in the dense MLP and the shared experts (:class:`K3SituMLP`; transformers has no ``situ``);
* **KDA**: K3's full-rank output gate (``g_proj``: transformers' low-rank ``g_a_proj``/``g_b_proj`` become
  identity / ``g_proj``), the bounded forget gate ``gate_lower_bound * sigmoid(exp(A_log) * (f + dt_bias))``
  (:class:`K3ForgetGate`), the separate ``q/k/v_conv1d`` concatenated into transformers' ``conv1d``, SiLU on
  the short convolution (transformers reads ``hidden_act``, which is ``situ`` in K3);
* **MLA**: the sigmoid output gate ``o_proj(attn * sigmoid(g_proj(x)))`` (``mla_use_output_gate``) and the
  q/kv LoRA norms' ``rms_norm_eps`` (transformers' default is 1e-6).

The weights are read by their checkpoint names (``model.layers.*``, or K3's multimodal ``language_model.*``
with the vision tower and projector dropped); a quantized checkpoint is decompressed first by its format's own
library (``tiny_quantized.decompress_tensors``). Every parameter of the built model must be loaded (strict).
Not expressible here: AttnRes (``attn_res_block_size``) and MTP layers (refused / skipped).
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ...vllm.checkpoint.model_check import K3_ARCHITECTURES

__all__ = ["needs_k3_oracle", "read_k3_checkpoint", "load_k3_model", "build_k3_model",
           "K3MoE", "K3Router", "K3LatentExperts", "K3SituMLP", "K3ForgetGate", "k3_moe_from_tensors", "situ",
           "attach_forced_routing", "k3_moe_modules"]



def situ(g: torch.Tensor, u: torch.Tensor, beta: float, linear_beta: Optional[float]) -> torch.Tensor:
    """SiTU-GLU, fp32: ``beta*tanh(g/beta)*sigmoid(g)`` times ``u`` (``linear_beta*tanh(u/linear_beta)`` if set)."""
    g, u = g.float(), u.float()
    gate = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    return gate * (u if linear_beta is None else linear_beta * torch.tanh(u / linear_beta))


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.float() @ w.float().T


class K3SituMLP(nn.Module):
    """``down(situ(gate x, up x))`` in fp32 (the dense layer's MLP and the shared experts); returns ``x``'s dtype."""

    def __init__(self, hidden: int, width: int, beta: float, linear_beta: Optional[float], act: str = "situ"):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)
        self.beta, self.linear_beta, self.act_name = beta, linear_beta, act

    def act(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        if self.act_name == "silu":
            return F.silu(g.float()) * u.float()
        return situ(g, u, self.beta, self.linear_beta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(_linear(x, self.gate_proj.weight), _linear(x, self.up_proj.weight))
        return _linear(h, self.down_proj.weight).to(x.dtype)


class K3Router(nn.Module):
    """K3's router: fp32 logits, sigmoid scores, top-k of ``scores + e_score_correction_bias`` (one group), the
    unbiased scores of the chosen renormalized, times ``routed_scaling_factor``. ``forward`` returns
    ``(logits [T, E], weights [T, K], ids [T, K])`` like transformers' routers."""

    def __init__(self, hidden: int, experts: int, top_k: int, scale: float, renormalize: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(experts, hidden))
        self.register_buffer("e_score_correction_bias", torch.zeros(experts, dtype=torch.float32))
        self.top_k, self.routed_scaling_factor, self.norm_topk_prob = top_k, scale, renormalize

    def choice_scores(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.float().sigmoid() + self.e_score_correction_bias.float()

    def weights_at(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        w = logits.float().sigmoid().gather(1, ids)
        if self.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        return w * self.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = _linear(x.reshape(-1, self.weight.shape[1]), self.weight)
        ids = torch.topk(self.choice_scores(logits), self.top_k, dim=-1).indices
        return logits, self.weights_at(logits, ids), ids


class K3LatentExperts(nn.Module):
    """The routed experts at the latent width ``L``: ``w1``/``w3`` ``[E, I, L]`` (gate, up), ``w2`` ``[E, L, I]``.
    ``forward(latent [T, L], ids, weights)`` -> the weighted sum over the chosen experts ``[T, L]``, fp32."""

    def __init__(self, experts: int, latent: int, inter: int, beta: float, linear_beta: Optional[float],
                 act: str = "situ"):
        super().__init__()
        self.w1 = nn.Parameter(torch.zeros(experts, inter, latent))
        self.w3 = nn.Parameter(torch.zeros(experts, inter, latent))
        self.w2 = nn.Parameter(torch.zeros(experts, latent, inter))
        self.beta, self.linear_beta, self.act_name = beta, linear_beta, act

    def act(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        if self.act_name == "silu":
            return F.silu(g.float()) * u.float()
        return situ(g, u, self.beta, self.linear_beta)

    def forward(self, latent: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        latent = latent.float()
        out = torch.zeros_like(latent)
        for e in torch.unique(ids).tolist():          # expert by expert, as a dispatch would group them
            rows, slot = torch.where(ids == e)
            xe = latent[rows]
            y = _linear(self.act(_linear(xe, self.w1[e]), _linear(xe, self.w3[e])), self.w2[e])
            out[rows] += y * weights[rows, slot].float().unsqueeze(-1)   # a token picks an expert once
        return out


class K3RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        v = v.float()
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()


class K3MoE(nn.Module):
    """K3's whole MoE block (the module docstring's formula), ``[..., H] -> [..., H]`` in ``x``'s dtype, fp32 math.
    Attribute names are the checkpoint's (``block_sparse_moe.*``)."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        H, E, K = int(cfg["hidden_size"]), int(cfg["num_experts"]), int(cfg["num_experts_per_token"])
        inter = int(cfg["moe_intermediate_size"])
        L = cfg.get("routed_expert_hidden_size")
        act, beta, lbeta = _activation(cfg)
        self.gate = K3Router(H, E, K, float(cfg.get("routed_scaling_factor", 1.0)),
                             bool(cfg.get("moe_renormalize", True)))
        if L is not None:
            self.routed_expert_down_proj = nn.Linear(H, int(L), bias=False)
            self.routed_expert_up_proj = nn.Linear(int(L), H, bias=False)
        else:
            self.routed_expert_down_proj = self.routed_expert_up_proj = None
        self.routed_expert_norm = (K3RMSNorm(int(L), float(cfg.get("rms_norm_eps", 1e-5)))
                                   if L is not None and cfg.get("latent_moe_use_norm") else None)
        self.experts = K3LatentExperts(E, int(L or H), inter, beta, lbeta, act)
        shared = cfg.get("num_shared_experts")
        self.shared_experts = K3SituMLP(H, inter * int(shared), beta, lbeta, act) if shared else None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape, dtype = hidden_states.shape, hidden_states.dtype
        x = hidden_states.reshape(-1, shape[-1]).float()
        _, weights, ids = self.gate(x)
        latent = x if self.routed_expert_down_proj is None else _linear(x, self.routed_expert_down_proj.weight)
        routed = self.experts(latent, ids, weights)
        if self.routed_expert_norm is not None:
            routed = self.routed_expert_norm(routed)          # on the K-summed latent, after the combine
        if self.routed_expert_up_proj is not None:
            routed = _linear(routed, self.routed_expert_up_proj.weight)
        if self.shared_experts is not None:
            routed = routed + self.shared_experts(x).float()
        return routed.to(dtype).reshape(shape)


class K3ForgetGate(nn.Module):
    """KDA's log-decay per head and channel ``[B, T, heads, D]``: ``lower_bound * sigmoid(exp(A_log) * x)`` with
    ``x = f_b(f_a(h)) + dt_bias`` (``gate_lower_bound`` set, K3), else ``-exp(A_log) * softplus(x)``."""

    def __init__(self, hidden: int, heads: int, head_dim: int, lower_bound: Optional[float]):
        super().__init__()
        self.f_a_proj = nn.Linear(hidden, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, heads * head_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(heads * head_dim))
        self.A_log = nn.Parameter(torch.zeros(heads))
        self.heads, self.head_dim, self.lower_bound = heads, head_dim, lower_bound

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = (self.f_b_proj(self.f_a_proj(h)).float() + self.dt_bias.float()).view(*h.shape[:2], self.heads,
                                                                                  self.head_dim)
        a = self.A_log.float().reshape(-1).exp().view(1, 1, self.heads, 1)
        if self.lower_bound is not None:
            return self.lower_bound * torch.sigmoid(a * x)
        return -a * F.softplus(x, beta=1.0, threshold=20.0)


def _activation(cfg: dict[str, Any]) -> tuple[str, float, Optional[float]]:
    act = cfg.get("hidden_act", "silu")
    if act not in ("situ", "silu"):
        raise ValueError(f"K3 oracle: hidden_act {act!r}; only situ and silu are K3's (vLLM's KimiMLP)")
    beta = float(cfg.get("activation_situ_beta") or 1.0)   # vLLM: ``activation_situ_beta or 1.0``
    lbeta = cfg.get("activation_situ_linear_beta")
    return act, beta, None if lbeta is None else float(lbeta)


# -- the checkpoint --------------------------------------------------------------------------------------

def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text model's config (K3's multimodal wrapper nests it in ``text_config``)."""
    if isinstance(cfg.get("text_config"), dict):
        return {**cfg["text_config"], **({"quantization_config": cfg["quantization_config"]}
                                         if cfg.get("quantization_config") else {})}
    return dict(cfg)


def needs_k3_oracle(model_dir: str) -> bool:
    """Whether the oracle must put K3's additions in: a K3 architecture (or a Kimi-Linear one with K3's MoE: SiTU or latent experts) in ``config.json``."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
    except OSError:
        return False
    arch = set(cfg.get("architectures") or [])
    text = _text_config(cfg)
    return K3_ARCHITECTURES[1] in arch or (K3_ARCHITECTURES[0] in arch and (
        text.get("hidden_act") == "situ" or text.get("routed_expert_hidden_size") is not None
        or bool((text.get("linear_attn_config") or {}).get("use_full_rank_gate"))))


def _text_name(name: str) -> Optional[str]:
    """A checkpoint name as the text model's (``model.layers.*``); None for the vision tower and projector."""
    if name.startswith(("vision_tower.", "mm_projector.", "multi_modal_projector.")):
        return None
    if name.startswith("language_model."):
        name = name[len("language_model."):]
    if name.startswith("layers.") or name in ("embed_tokens.weight", "norm.weight"):
        name = "model." + name
    return name


def read_k3_checkpoint(model_dir: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(text config, {text name: tensor})``; a quantized checkpoint's experts decompressed by its format's own
    library (compressed-tensors; FP8 block: DeepSeek's formula), exactly as the oracle's dequantized copy."""
    from ..checkpoints.tiny_quantized import _read, decompress_tensors

    cfg, tensors = _read(model_dir)
    if cfg.get("quantization_config"):
        tensors = decompress_tensors(cfg, tensors)
    text = _text_config(cfg)
    text.pop("quantization_config", None)
    out = {}
    for name, t in tensors.items():
        mapped = _text_name(name)
        if mapped is not None:
            out[mapped] = t
    return text, out


def k3_moe_from_tensors(cfg: dict[str, Any], tensors: dict[str, torch.Tensor], prefix: str) -> K3MoE:
    """One :class:`K3MoE` (fp32) from the tensors under ``prefix`` (e.g. ``model.layers.1.block_sparse_moe.``)."""
    moe = K3MoE(cfg)
    sd = _moe_state(cfg, tensors, prefix, "")
    missing, unexpected = moe.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise ValueError(f"K3 oracle: MoE {prefix}: missing {missing}, unexpected {unexpected}")
    return moe


def _moe_state(cfg: dict[str, Any], tensors: dict[str, torch.Tensor], src: str, dst: str) -> dict[str, Any]:
    E = int(cfg["num_experts"])
    sd = {}
    for name, t in tensors.items():
        if name.startswith(src) and ".experts." not in name[len(src) - 1:]:
            sd[dst + name[len(src):]] = t.float()
    for w in ("w1", "w3", "w2"):                                  # per expert -> [E, out, in]
        sd[f"{dst}experts.{w}"] = torch.stack([tensors[f"{src}experts.{e}.{w}.weight"].float() for e in range(E)])
    return sd


def _patch(model: nn.Module, cfg: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Put K3's modules into ``model`` and return its state dict built from the checkpoint's ``tensors``."""
    act, beta, lbeta = _activation(cfg)
    eps = float(cfg.get("rms_norm_eps", 1e-5))
    lin = cfg.get("linear_attn_config") or {}
    H = int(cfg["hidden_size"])
    sd: dict[str, torch.Tensor] = {}
    n_layers = int(cfg["num_hidden_layers"])
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        attn = layer.self_attn
        if type(attn).__name__ == "KimiLinearDeltaAttention":
            attn.activation = "silu"                              # the short convolution's (vLLM: silu)
            attn.forget_gate = K3ForgetGate(H, attn.num_heads, attn.head_dim, lin.get("gate_lower_bound"))
            a = p + "self_attn."
            sd[a + "conv1d.weight"] = torch.cat([tensors.pop(a + f"{c}_conv1d.weight").float()
                                                 for c in "qkv"]).reshape(attn.conv1d.weight.shape)
            for n in ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log"):
                sd[a + "forget_gate." + n] = tensors.pop(a + n).float().reshape(-1) if n == "A_log" \
                    else tensors.pop(a + n).float()
            if lin.get("use_full_rank_gate"):
                attn.g_a_proj = nn.Identity()
                attn.g_b_proj = nn.Linear(H, attn.qkv_dim, bias=False)
                sd[a + "g_b_proj.weight"] = tensors.pop(a + "g_proj.weight").float()
        else:
            for norm in (attn.q_a_layernorm, attn.kv_a_layernorm):
                if norm is not None:
                    norm.variance_epsilon = eps
            if cfg.get("mla_use_output_gate"):
                _add_mla_output_gate(attn, H)
        if (p + "block_sparse_moe.gate.weight") in tensors:
            layer.mlp = K3MoE(cfg)
            src = p + "block_sparse_moe."
            sd.update(_moe_state(cfg, tensors, src, p + "mlp."))
            for name in [n for n in tensors if n.startswith(src)]:
                del tensors[name]
        else:
            layer.mlp = K3SituMLP(H, int(cfg["intermediate_size"]), beta, lbeta, act)
    for name, t in tensors.items():
        parts = name.split(".")
        if len(parts) > 2 and parts[1] == "layers" and int(parts[2]) >= n_layers:
            continue                                              # MTP layers: not the text model's
        sd[name] = t.float()
    return sd


def _add_mla_output_gate(attn: nn.Module, hidden: int) -> None:
    """``o_proj(attn_out * sigmoid(g_proj(x)))``: the gate from the attention's input, applied before ``o_proj``."""
    attn.g_proj = nn.Linear(hidden, attn.num_heads * attn.v_head_dim, bias=False)
    state: dict[str, torch.Tensor] = {}

    def take_input(module: nn.Module, args: tuple, kwargs: dict) -> None:
        h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        state["gate"] = torch.sigmoid(module.g_proj(h))

    def gate_output(module: nn.Module, args: tuple) -> tuple:
        return (args[0] * state.pop("gate").to(args[0].dtype),)

    attn.register_forward_pre_hook(take_input, with_kwargs=True)
    attn.o_proj.register_forward_pre_hook(gate_output)


def build_k3_model(cfg: dict[str, Any], tensors: dict[str, torch.Tensor], dtype: str = "float32") -> nn.Module:
    """transformers' ``KimiLinearForCausalLM`` with K3's modules, every weight from ``tensors`` (text names)."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    if cfg.get("attn_res_block_size") is not None:
        raise ValueError("K3 oracle: AttnRes (attn_res_block_size) has no transformers implementation; judge a "
                         "checkpoint without it")
    moe_freq = int(cfg.get("moe_layer_freq") or 1)
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    n = int(cfg["num_hidden_layers"])
    keep = {k: v for k, v in cfg.items() if k not in ("architectures", "auto_map", "text_config",
                                                      "vision_config", "torch_dtype", "dtype")}
    # built with silu (transformers has no situ); K3's activations are put in by _patch
    hf_cfg = KimiLinearConfig(**{**keep, "hidden_act": "silu",
                                 "mlp_layer_types": ["sparse" if i >= first_dense and i % moe_freq == 0
                                                     else "dense" for i in range(n)]})
    hf_cfg._attn_implementation = "eager"
    model = KimiLinearForCausalLM(hf_cfg).float()         # its random init is overwritten below (strict)
    sd = _patch(model, cfg, dict(tensors))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not m.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise ValueError(f"K3 oracle: the checkpoint does not fill transformers' KimiLinear model: missing "
                         f"{sorted(missing)[:12]}, unexpected {sorted(unexpected)[:12]}")
    model = model.to(getattr(torch, dtype))
    for name, module in model.named_modules():                # fp32 as vLLM keeps them
        if isinstance(module, K3Router):
            module.e_score_correction_bias.data = module.e_score_correction_bias.data.float()
            module.e_score_correction_bias.copy_(sd[name + ".e_score_correction_bias"])
        if isinstance(module, K3ForgetGate):
            for attr in ("A_log", "dt_bias"):
                getattr(module, attr).data = sd[f"{name}.{attr}"].clone()
    return model.eval()


def load_k3_model(model_dir: str, dtype: str = "float32") -> nn.Module:
    """The oracle's model of the K3 checkpoint ``model_dir`` (:func:`read_k3_checkpoint`, :func:`build_k3_model`)."""
    cfg, tensors = read_k3_checkpoint(model_dir)
    return build_k3_model(cfg, tensors, dtype)


def k3_moe_modules(model: nn.Module) -> dict[int, K3MoE]:
    """``{layer: K3MoE}`` of a model :func:`load_k3_model` built."""
    return {i: layer.mlp for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, K3MoE)}


def attach_forced_routing(hooks: Any, model: nn.Module) -> int:
    """Give ``near_ties.ForcedRouting`` ``hooks`` K3's routers (it recognises transformers' router classes only):
    the same contract as its own wrapping (record ``(choice scores, own, used)``, force the rows of
    ``hooks.forced``, the route weights then the oracle's scores at the forced experts). Returns how many."""
    wrapped = 0
    for layer, moe in k3_moe_modules(model).items():
        router, original = moe.gate, moe.gate.forward

        def forward(x: torch.Tensor, _r: K3Router = router, _orig: Any = original, _layer: int = layer) -> Any:
            logits, weights, own = _orig(x)
            if hooks.forced is None:
                return logits, weights, own
            forced, used = hooks.forced.get(_layer), own
            if forced is not None:
                rows = min(forced.shape[0], own.shape[0])
                used = own.clone()
                take = forced[:rows, 0] >= 0
                used[:rows][take] = forced[:rows][take].to(own.dtype)
                weights = _r.weights_at(logits, used.long())
            hooks.seen[_layer] = (_r.choice_scores(logits).detach(), own.detach(), used.detach())
            return logits, weights, used

        router.forward = forward
        hooks.layers.append(layer)
        wrapped += 1
    return wrapped
