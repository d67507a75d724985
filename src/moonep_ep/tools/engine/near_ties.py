"""Routing near-ties: is a divergence from the oracle explained by bf16 arithmetic crossing a router's top-k boundary?

A top-k router is discontinuous. Where the oracle's (fp32) selection scores
of the k-th and the (k+1)-th expert are closer than what bf16 arithmetic
moves them, a correct bf16 engine may pick the other expert; that token's
output then moves by an expert's worth, and so does everything that attends
to it. How far bf16 arithmetic moves them, measured on the tiny
DeepSeek-V3 (free-running and forced, the margins of the choices that
differed): docs/design/vllm_observe.md, "Near-ties, explained".

So the oracle explains a divergence (and a position over ``abs_max``) with
measured quantities, never with a wider bound:

1. the engine recorded the experts every MoE layer chose for every row it
   computed (``vllm/observe/routing_record.py``); the oracle runs one forward of the
   sequence with those choices **forced** into its own routers (its own
   arithmetic, the engine's experts; the route weights are the oracle's own
   scores at the forced experts, normalized as the model does);
2. along that forced forward, every engine choice that differs from what the
   oracle's router would have chosen at that row and layer has a **margin**
   ``max(s[own not engine]) - min(s[engine not own])`` in the oracle's
   selection scores; each must be at most :attr:`NearTieRule.margin_bound`
   (``2^-5``: 8 bf16 ulps of a score in ``[0.5, 1)``, 2.6 times the largest
   margin measured there) — a wrong expert (large margin) is not a near-tie;
3. the forced oracle must **agree** with the engine at the position: its gap
   to the engine's token and ``|Δ|`` of the engine's log-prob at most
   :attr:`NearTieRule.agreement` (the rule's ``p90_max``) — wrong expert math
   does not agree;
4. every row up to the position must have been recorded, and at least one
   engine choice must differ (else it is no routing near-tie; the rule alone
   judges it).

Only then is the position excused, and the verdict names it with its margins
and the forced agreement. The distribution gates (p50, p90) are never excused.

Routers supported (transformers' classes; another router leaves every
divergence unexplained, as before): DeepSeek-V3's ``noaux_tc`` sigmoid router
(Kimi K2), Qwen3-MoE's and Mixtral's softmax routers.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

__all__ = ["NearTieRule", "NEAR_TIE_RULE", "ForcedRouting", "explain", "routing_for_sequence", "attach_routing",
           "describe"]


@dataclasses.dataclass(frozen=True)
class NearTieRule:
    margin_bound: float = 2.0 ** -5   # oracle selection-score units (sigmoid scores + bias; softmax probabilities)
    agreement: Optional[float] = None  # forced gap and forced |Δ| at the position; None: the run rule's p90_max


NEAR_TIE_RULE = NearTieRule()


def _layer_of(name: str) -> Optional[int]:
    parts = name.split(".")
    for a, b in zip(parts, parts[1:]):
        if a == "layers" and b.isdigit():
            return int(b)
    return None


class _Router:
    """How one transformers router class selects and weighs (its own ``forward``, restated per expert set)."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.kind = {"DeepseekV3TopkRouter": "sigmoid", "Qwen3MoeTopKRouter": "softmax",
                     "MixtralTopKRouter": "softmax"}[type(module).__name__]

    def choice_scores(self, logits: Any) -> Any:
        import torch

        m = self.module
        if self.kind == "softmax":
            return torch.softmax(logits.float(), dim=-1)
        scores = logits.float().sigmoid() + m.e_score_correction_bias.float()
        if m.num_group > 1:  # group-limited selection: experts of unselected groups are not candidates
            E = scores.shape[-1]
            grouped = scores.view(-1, m.num_group, E // m.num_group)
            group_idx = grouped.topk(2, dim=-1)[0].sum(-1).topk(m.topk_group, dim=-1)[1]
            mask = torch.zeros(scores.shape[0], m.num_group, dtype=torch.bool, device=scores.device)
            mask.scatter_(1, group_idx, True)
            scores = scores.masked_fill(~mask.repeat_interleave(E // m.num_group, dim=1), float("-inf"))
        return scores

    def weights(self, logits: Any, indices: Any, like: Any) -> Any:
        import torch

        m = self.module
        if self.kind == "softmax":
            w = torch.softmax(logits.float(), dim=-1).gather(1, indices)
            if getattr(m, "norm_topk_prob", True):
                w = w / w.sum(dim=-1, keepdim=True)
            return w.to(like.dtype)
        w = logits.float().sigmoid().gather(1, indices)
        if m.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return (w * m.routed_scaling_factor).to(like.dtype)


class ForcedRouting:
    """Hooks on every supported router of an HF model: records each forward's selection scores and own choices,
    and replaces the choices by forced ones while :attr:`forced` is set (``{layer: [T, K] long}``, rows of
    ``-1`` keep the router's own)."""

    def __init__(self, model: Any) -> None:
        self.forced: Optional[dict[int, Any]] = None
        self.seen: dict[int, tuple[Any, Any, Any]] = {}   # layer -> (scores [T, E], own [T, K], used [T, K])
        self.layers: list[int] = []
        for name, module in model.named_modules():
            if type(module).__name__ in ("DeepseekV3TopkRouter", "Qwen3MoeTopKRouter", "MixtralTopKRouter"):
                layer = _layer_of(name)
                if layer is not None:
                    self._wrap(module, layer)
                    self.layers.append(layer)

    def _wrap(self, module: Any, layer: int) -> None:
        router, original = _Router(module), module.forward

        def forward(hidden_states: Any) -> Any:
            logits, weights, own = original(hidden_states)
            if self.forced is None:
                return logits, weights, own
            forced = self.forced.get(layer)
            used = own
            if forced is not None:
                rows = min(forced.shape[0], own.shape[0])
                used = own.clone()
                take = forced[:rows, 0] >= 0
                used[:rows][take] = forced[:rows][take].to(own.dtype)
                weights = router.weights(logits, used.long(), weights)
            self.seen[layer] = (router.choice_scores(logits).detach(), own.detach(), used.detach())
            return logits, weights, used

        module.forward = forward


def routing_for_sequence(routing: Any, rows: int, layers: Sequence[int], top_k: int) -> tuple[dict[int, Any], list[int]]:
    """``({layer: [rows, K] long, -1 where not recorded}, positions not recorded)`` from a sequence's
    ``routing`` (:func:`attach_routing`)."""
    import torch

    forced = {layer: torch.full((rows, top_k), -1, dtype=torch.long) for layer in layers}
    missing = []
    recorded = (routing or {}).get("topk") or []
    order = (routing or {}).get("layers") or []
    for pos in range(rows):
        entry = recorded[pos] if pos < len(recorded) else None
        if entry is None:
            missing.append(pos)
            continue
        for li, layer in enumerate(order):
            if layer in forced and len(entry[li]) == top_k:
                forced[layer][pos] = torch.tensor(entry[li], dtype=torch.long)
    return forced, missing


def _margin(scores: Any, own: Sequence[int], used: Sequence[int]) -> float:
    a, b = sorted(set(own) - set(used)), sorted(set(used) - set(own))
    return float(scores[a].max() - scores[b].min())


def explain(oracle: Any, sequence: dict[str, Any], positions: Sequence[int], rule: Any,
            near: NearTieRule = NEAR_TIE_RULE) -> dict[int, dict[str, Any]]:
    """``{generated position: evidence}`` for each of ``positions`` of one judged sequence: the forced forward's
    gap and ``|Δ|`` there, the engine choices that differ from the forced oracle's own up to that row (their
    count, largest margin, the first few), rows not recorded, and ``near_tie``: whether it is excused."""
    prompt, generated = list(sequence["prompt_token_ids"]), list(sequence["token_ids"])
    engine_lps = sequence.get("logprobs") or []
    agreement = rule.p90_max if near.agreement is None else near.agreement
    hooks = oracle.forced_routing()
    if not hooks.layers or not sequence.get("routing"):
        why = "no supported router in the oracle" if not hooks.layers else "the engine recorded no routing"
        return {j: {"near_tie": False, "why_not": why} for j in positions}
    tokens = prompt + generated
    T = len(tokens)
    recorded = [e for e in sequence["routing"]["topk"] if e is not None]
    if not recorded:
        return {j: {"near_tie": False, "why_not": "no row of this sequence was recorded"} for j in positions}
    forced, missing = routing_for_sequence(sequence["routing"], T, hooks.layers, len(recorded[0][0]))
    lp = oracle.forced_logprobs(tokens, forced)
    out: dict[int, dict[str, Any]] = {}
    flips_by_row: list[tuple[int, int, list[int], list[int], float]] = []
    for layer in hooks.layers:
        scores, own, used = hooks.seen[layer]
        for r in range(min(T, own.shape[0])):
            o, u = own[r].tolist(), used[r].tolist()
            if set(o) != set(u):
                flips_by_row.append((r, layer, sorted(o), sorted(u), _margin(scores[r], o, u)))
    for j in positions:
        row = len(prompt) - 1 + j
        token = generated[j]
        row_lp = lp[row]
        forced_gap = float(row_lp.max() - row_lp[token])
        engine = engine_lps[j] if j < len(engine_lps) else None
        forced_delta = None if engine is None else float(engine - row_lp[token])
        flips = [f for f in flips_by_row if f[0] <= row]
        worst = max((f[4] for f in flips), default=0.0)
        gaps = [p for p in missing if p <= row]
        reasons = []
        if gaps:
            reasons.append(f"{len(gaps)} row(s) not recorded (first {gaps[0]})")
        if not flips:
            reasons.append("the engine chose the oracle's experts at every row up to here: not a routing near-tie")
        if worst > near.margin_bound:
            reasons.append(f"an engine choice {worst:.4f} below the oracle's (bound {near.margin_bound:.4f}): a wrong "
                           "expert, not a near-tie")
        if forced_gap > agreement or forced_delta is None or abs(forced_delta) > agreement:
            reasons.append(f"forced onto the engine's experts the oracle still disagrees (gap {forced_gap:.4f}, "
                           f"|Δ| {abs(forced_delta) if forced_delta is not None else None}, bound {agreement})")
        out[j] = {"near_tie": not reasons, "forced_gap": round(forced_gap, 5),
                  "forced_delta": None if forced_delta is None else round(forced_delta, 5),
                  "routing_differences": len(flips), "largest_margin": round(worst, 5),
                  "margin_bound": near.margin_bound,
                  "first_differences": [{"row": r, "layer": layer, "oracle_experts": o, "engine_experts": u,
                                         "margin": round(m, 5)} for r, layer, o, u, m in flips[:3]],
                  **({"why_not": "; ".join(reasons)} if reasons else {})}
    return out


def describe(near_tie: dict[str, Any]) -> str:
    """One excused position of a verdict's ``near_ties``, with its margins and the forced agreement, in words."""
    n = near_tie
    return (f"sequence {n['sequence']} position {n['position']}: gap {n['gap']} nats; {n['routing_differences']} "
            f"engine choice(s) differ, largest margin {n['largest_margin']} <= {n['margin_bound']:.5f}; forced onto "
            f"them the oracle agrees (gap {n['forced_gap']}, |d| {n['forced_delta']})")


def attach_routing(payload: Any, records: dict[str, dict[int, tuple[int, dict[int, tuple[int, ...]]]]]) -> int:
    """Give every generated sequence in ``payload`` (dicts with ``request_id``, ``prompt_token_ids`` and
    ``token_ids``, at any depth) its engine's routing: ``{"layers": [...], "topk": [per row: [per layer:
    top-k ids]] or None}`` for every row the engine computed (prompt and generated tokens but the last).

    vLLM's internal request id is the external one plus ``-`` and a random suffix; every DP rank's ``LLM``
    counts its own external ids from 0, so one external id names a request on each rank: the sequence takes
    the request whose recorded input ids are all its own tokens (a request with any other input id is not
    this sequence's). Returns the sequences given one."""
    by_external: dict[str, list[dict[int, tuple[int, dict[int, tuple[int, ...]]]]]] = {}
    for internal, rows in records.items():
        by_external.setdefault(internal.rsplit("-", 1)[0], []).append(rows)
    count = 0

    def matching(rows: dict[int, tuple[int, Any]], tokens: list[int]) -> int:
        if any(pos >= len(tokens) or rec[0] != tokens[pos] for pos, rec in rows.items()):
            return -1
        return len(rows)

    def visit(node: Any) -> None:
        nonlocal count
        if isinstance(node, dict):
            if "token_ids" in node and "prompt_token_ids" in node and node.get("request_id") is not None:
                tokens = list(node["prompt_token_ids"]) + list(node["token_ids"])
                candidates = by_external.get(str(node["request_id"]), [])
                best = max(candidates, key=lambda rows: matching(rows, tokens), default=None)
                if best is not None and matching(best, tokens) > 0:
                    layers = sorted({lid for _, per in best.values() for lid in per})
                    topk = []
                    for pos in range(len(tokens) - 1):
                        rec = best.get(pos)
                        topk.append(None if rec is None else [list(rec[1].get(lid, ())) for lid in layers])
                    node["routing"] = {"layers": layers, "topk": topk}
                    count += 1
            for value in node.values():
                visit(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                visit(value)

    visit(payload)
    return count
