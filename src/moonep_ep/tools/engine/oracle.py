"""The oracle outside vLLM: HuggingFace transformers' forward of the same checkpoint, teacher-forced.

For every sequence an engine generated (greedy), the oracle runs one forward
over ``prompt + generated`` — the engine's **own** tokens, so after a
divergence each engine is judged on the path it took — and reads, at every
generated position ``j``, its log-softmax: its argmax, its top two, and the
log-prob of the engine's token. The engine reported its own log-prob of that
token (vLLM's ``logprobs``), so ``Δ = engine − oracle`` is measured there.

The rule (:class:`OracleRule`; why these numbers: ``docs/design/vllm_observe.md``):

1. **divergence gap** — where the engine's token is not the oracle's argmax,
   the oracle's log-prob of its argmax minus its log-prob of the engine's
   token is at most ``divergence_gap`` nats. This implies that the oracle's
   top two are within the same bound there (the engine's token is at best its
   second choice), which is the form the requirement states;
2. over all generated positions of a run, the median ``|Δ|`` is at most
   ``p50_max``, the 90th percentile at most ``p90_max``, and every ``|Δ|``
   at most ``abs_max``.

``max_abs_logprob_diff_at_matching_tokens`` (the largest ``|Δ|`` where the
engine's token equals the oracle's argmax) is reported for every run.

The verdict uses the fp32 oracle (``reference_dtype``); the bf16 oracle is
reported beside it as the yardstick of what bf16 arithmetic alone does.

Pure rule code (:func:`judge`, :func:`position_record`) needs no
transformers; :class:`TeacherForcedOracle` imports it (the vLLM
environments have it) and torch.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Iterable, Mapping, Optional, Sequence

__all__ = ["OracleRule", "RULE", "W8A8_RULE", "rule_for", "judge", "position_record", "TeacherForcedOracle",
           "judge_runs", "oracle_version"]


@dataclasses.dataclass(frozen=True)
class OracleRule:
    reference_dtype: str = "float32"
    divergence_gap: float = 1.5   # nats, at a position where the greedy token is not the oracle's argmax
    p50_max: float = 0.02         # median |Δ log-prob| over every generated position of a run
    p90_max: float = 0.06         # 90th percentile of the same
    abs_max: float = 2.0          # every |Δ log-prob|


RULE = OracleRule()
#: The rule when the served experts quantize their GEMM inputs to e4m3 per 1x128 (W8A8: the Triton FP8-block
#: experts), judged against an oracle whose experts quantize alike. e4m3 keeps 3 mantissa bits, so a bf16 input
#: one ulp from the fp32 oracle's can land on the next code (up to 12.5 % of the value): the oracle's own bf16
#: W8A8 forward differs from its fp32 one by more than :data:`RULE` allows. Its tails are wider too: on a CPU
#: without AMX that bf16 forward picked another expert than fp32 at one position of 96 (a routing near-tie,
#: with or without the activation quantization), 2.15 nats of gap and 2.21 of |Δ| there. The bounds and the
#: runs they come from: ``docs/design/vllm_observe.md`` (FP8 activations).
W8A8_RULE = OracleRule(divergence_gap=1.5, p50_max=0.06, p90_max=0.20, abs_max=2.0)
#: ``expert_activation_quant`` -> the rule its runs are judged by
RULES = {None: RULE, "fp8-1x128": W8A8_RULE}


def rule_for(expert_activation_quant: Optional[str]) -> OracleRule:
    """The rule for runs whose experts quantize their inputs as ``expert_activation_quant`` says (None: none)."""
    if expert_activation_quant not in RULES:
        raise ValueError(f"expert_activation_quant {expert_activation_quant!r}: no rule; one of "
                         f"{sorted(k for k in RULES if k)} or None")
    return RULES[expert_activation_quant]


def position_record(token: int, oracle_lp_token: float, top1: tuple[int, float], top2: tuple[int, float],
                    engine_lp: Optional[float]) -> dict[str, Any]:
    """One generated position, as the rule reads it."""
    match = token == top1[0]
    delta = None if engine_lp is None or math.isinf(engine_lp) else engine_lp - oracle_lp_token
    return {"token": token, "oracle_argmax": top1[0], "match": match,
            "oracle_top2_gap": top1[1] - top2[1],
            "gap_to_engine_token": 0.0 if match else top1[1] - oracle_lp_token,
            "oracle_logprob": oracle_lp_token, "engine_logprob": engine_lp, "delta": delta}


def _quantile(sorted_values: Sequence[float], q: float) -> Optional[float]:
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * q))]


def judge(sequences: Sequence[Sequence[Mapping[str, Any]]], rule: OracleRule = RULE,
          explained: Optional[Mapping[tuple[int, int], Mapping[str, Any]]] = None) -> dict[str, Any]:
    """The rule's verdict over one run: ``sequences[i]`` = the position records of sequence ``i``.

    ``explained``: ``{(sequence, position): evidence}`` from :func:`~moonep_ep.tools.engine.near_ties.explain`;
    a divergence or a position over ``abs_max`` whose evidence says ``near_tie`` is excused from the gap and
    ``abs_max`` gates (named in ``near_ties``); p50 and p90 count every position."""
    explained = explained or {}
    positions = [p for seq in sequences for p in seq]
    deltas = sorted(abs(p["delta"]) for p in positions if p["delta"] is not None)
    matching = [abs(p["delta"]) for p in positions if p["match"] and p["delta"] is not None]
    mismatches = [(i, j, p) for i, seq in enumerate(sequences) for j, p in enumerate(seq) if not p["match"]]

    def excused(i: int, j: int) -> bool:
        return bool((explained.get((i, j)) or {}).get("near_tie"))

    worst_gap = max((p["gap_to_engine_token"] for _, _, p in mismatches), default=0.0)
    gate_gap = max((p["gap_to_engine_token"] for i, j, p in mismatches if not excused(i, j)), default=0.0)
    gate_abs = max((abs(p["delta"]) for i, seq in enumerate(sequences) for j, p in enumerate(seq)
                    if p["delta"] is not None and not excused(i, j)), default=0.0)
    p50, p90 = _quantile(deltas, 0.5), _quantile(deltas, 0.9)
    failed = []
    if gate_gap > rule.divergence_gap:
        failed.append("divergence_gap")
    if len(deltas) < len(positions):
        failed.append("engine_logprobs_missing")
    if p50 is None or p50 > rule.p50_max:
        failed.append("p50")
    if p90 is None or p90 > rule.p90_max:
        failed.append("p90")
    if gate_abs > rule.abs_max:
        failed.append("abs_max")
    near_ties = [{"sequence": i, "position": j, "token": sequences[i][j]["token"],
                  "oracle_argmax": sequences[i][j]["oracle_argmax"],
                  "gap": round(sequences[i][j]["gap_to_engine_token"], 5),
                  "delta": _round(sequences[i][j]["delta"]), **dict(ev)}
                 for (i, j), ev in sorted(explained.items()) if ev.get("near_tie")]
    return {
        "ok": bool(positions) and not failed,
        "failed": failed,
        "sequences": len(sequences),
        "positions": len(positions),
        "matching_positions": len(positions) - len(mismatches),
        "divergences": len(mismatches),
        "max_abs_logprob_diff_at_matching_tokens": round(max(matching), 5) if matching else None,
        "max_gap_at_divergence": round(worst_gap, 5),
        "max_top2_gap_at_divergence": round(max((p["oracle_top2_gap"] for _, _, p in mismatches), default=0.0), 5),
        "abs_logprob_diff": {"p50": _round(p50), "p90": _round(p90), "max": _round(deltas[-1] if deltas else None),
                             "over_0.1": sum(d > 0.1 for d in deltas)},
        "divergence_positions": [{"sequence": i, "position": j, "token": p["token"], "oracle_argmax": p["oracle_argmax"],
                                  "gap": round(p["gap_to_engine_token"], 5),
                                  **({"near_tie": excused(i, j)} if (i, j) in explained else {})}
                                 for i, j, p in mismatches],
        # what the gap and abs_max gates read: every position but the near-ties explained below
        "max_gap_not_near_tie": round(gate_gap, 5),
        "max_abs_not_near_tie": round(gate_abs, 5),
        "near_ties": near_ties,
        "explained_positions": len(explained),
        "unexplained": [{"sequence": i, "position": j, "why_not": ev.get("why_not")}
                        for (i, j), ev in sorted(explained.items()) if not ev.get("near_tie")],
    }


def _round(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(x, 5)


def oracle_version() -> str:
    import transformers

    return f"transformers {transformers.__version__}"


#: ``expert_activation_quant`` -> what the oracle does to the routed experts' two GEMM inputs
EXPERT_ACTIVATION_QUANT = {
    "fp8-1x128": "dynamic e4m3 per 1x128 group, scale max|x|/448, round-trip (DeepSeek-V3's act_quant; what the "
                 "Triton FP8-block experts compute)"}


def fake_quant_fp8_1x128(x: Any) -> Any:
    """``x`` with every 128-wide group of its last dim quantized to e4m3 and back (scale ``max|x| / 448``),
    the arithmetic of vLLM's ``per_token_group_quant_fp8`` and DeepSeek-V3's ``act_quant``."""
    import torch
    import torch.nn.functional as F

    k = x.shape[-1]
    pad = (-k) % 128
    g = F.pad(x.float(), (0, pad)).reshape(*x.shape[:-1], -1, 128)
    scale = (g.abs().amax(dim=-1, keepdim=True) / 448.0).clamp(min=1.0 / (448.0 * 512.0))
    q = (g / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale
    return q.reshape(*x.shape[:-1], k + pad)[..., :k].to(x.dtype)


def quantize_expert_inputs(model: Any, kind: str, calls: Optional[list[int]] = None) -> int:
    """Make the routed experts of an HF model (transformers' fused ``*Experts`` modules: ``gate_up_proj`` and
    ``down_proj`` parameters, applied with ``nn.functional.linear``) see their inputs fake-quantized (``kind``:
    :data:`EXPERT_ACTIVATION_QUANT`). Returns how many expert modules were wrapped (0 is an error)."""
    import torch.nn.functional as F

    if kind not in EXPERT_ACTIVATION_QUANT:
        raise ValueError(f"expert_activation_quant {kind!r}: unknown; one of {sorted(EXPERT_ACTIVATION_QUANT)}")
    linear = F.linear

    def quantized_linear(x: Any, weight: Any, bias: Any = None) -> Any:
        if calls is not None:
            calls[0] += 1
        return linear(fake_quant_fp8_1x128(x), weight, bias)

    wrapped = 0
    for module in model.modules():
        if type(module).__name__.endswith("Experts") and hasattr(module, "gate_up_proj") \
                and hasattr(module, "down_proj"):
            if getattr(module, "config", None) is not None:
                # transformers' own per-expert loop (its "eager" experts implementation), the one that applies
                # the experts with nn.functional.linear; the batched / grouped_mm ones would bypass the wrapper
                module.config._experts_implementation = "eager"
            forward = module.forward

            def quantized_forward(*args: Any, _forward: Any = forward, **kwargs: Any) -> Any:
                F.linear = quantized_linear  # only the experts' own two GEMMs run inside this call
                try:
                    return _forward(*args, **kwargs)
                finally:
                    F.linear = linear

            module.forward = quantized_forward
            wrapped += 1
    if not wrapped:
        raise ValueError(f"expert_activation_quant {kind!r}: no fused experts module in {type(model).__name__}")
    return wrapped


class TeacherForcedOracle:
    """HF ``AutoModelForCausalLM`` of one checkpoint in one dtype (native classes, no remote code, offline)."""

    def __init__(self, model_dir: str, dtype: str = "float32", expert_activation_quant: Optional[str] = None):
        self.model_dir, self.dtype = model_dir, dtype
        self.expert_activation_quant = expert_activation_quant
        #: expert GEMMs that ran on fake-quantized inputs (checked after each forward: another experts
        #: implementation of transformers would bypass the wrapper)
        self.quantized_calls = [0]
        self._model: Any = None
        self._cache: dict[tuple[int, ...], Any] = {}

    def _load(self) -> Any:
        if self._model is None:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            import torch
            from transformers import AutoModelForCausalLM

            from .k3_oracle import load_k3_model, needs_k3_oracle

            if needs_k3_oracle(self.model_dir):  # Kimi K3: transformers' kimi_linear with K3's MoE put in
                self._model = load_k3_model(self.model_dir, self.dtype)
            else:
                self._model = AutoModelForCausalLM.from_pretrained(
                    self.model_dir, dtype=getattr(torch, self.dtype), attn_implementation="eager",
                    trust_remote_code=False, local_files_only=True).eval()
            if self.expert_activation_quant:
                quantize_expert_inputs(self._model, self.expert_activation_quant, self.quantized_calls)
        return self._model

    def logprobs(self, prompt: Sequence[int], generated: Sequence[int]) -> Any:
        """``[len(generated), V]`` fp32 log-softmax at each generated position (cached per sequence)."""
        import torch

        key = (len(prompt), *prompt, *generated)
        if key not in self._cache:
            ids = torch.tensor([list(prompt) + list(generated)], dtype=torch.long)
            before = self.quantized_calls[0]
            with torch.no_grad():
                logits = self._load()(input_ids=ids, use_cache=False).logits[0]
            if self.expert_activation_quant and self.quantized_calls[0] == before:
                raise RuntimeError(f"oracle: {self.expert_activation_quant} was asked for, but no routed expert GEMM "
                                   "ran through the wrapper (transformers chose another experts implementation)")
            first = len(prompt) - 1
            self._cache[key] = torch.log_softmax(logits[first:first + len(generated)].float(), dim=-1)
        return self._cache[key]

    def forced_routing(self) -> Any:
        """The router hooks of this oracle's model (installed once; inert until forced)."""
        if getattr(self, "_forced", None) is None:
            from .k3_oracle import attach_forced_routing
            from .near_ties import ForcedRouting

            self._forced = ForcedRouting(self._load())
            if not self._forced.layers:  # K3's routers (k3_oracle.K3Router), not a transformers class
                attach_forced_routing(self._forced, self._model)
        return self._forced

    def forced_logprobs(self, tokens: Sequence[int], forced: Mapping[int, Any]) -> Any:
        """``[len(tokens), V]`` fp32 log-softmax of one forward with ``forced`` expert choices in its routers
        (``{layer: [T, K]}``, rows of -1 keep the router's own); the hooks keep what every router saw."""
        import torch

        hooks = self.forced_routing()
        hooks.forced, hooks.seen = dict(forced), {}
        try:
            with torch.no_grad():
                logits = self._load()(input_ids=torch.tensor([list(tokens)], dtype=torch.long),
                                      use_cache=False).logits[0]
        finally:
            hooks.forced = None
        return torch.log_softmax(logits.float(), dim=-1)

    def records(self, prompt: Sequence[int], generated: Sequence[int],
                engine_logprobs: Sequence[Optional[float]]) -> list[dict[str, Any]]:
        import torch

        lp = self.logprobs(prompt, generated)
        top = torch.topk(lp, 2, dim=-1)
        out = []
        for j, token in enumerate(generated):
            engine = engine_logprobs[j] if j < len(engine_logprobs) else None
            out.append(position_record(int(token), float(lp[j, token]),
                                       (int(top.indices[j, 0]), float(top.values[j, 0])),
                                       (int(top.indices[j, 1]), float(top.values[j, 1])), engine))
        return out


def explain_positions(oracle: "TeacherForcedOracle", seqs: Sequence[Mapping[str, Any]],
                      records: Sequence[Sequence[Mapping[str, Any]]], rule: OracleRule
                      ) -> dict[tuple[int, int], dict[str, Any]]:
    """Near-tie evidence (``near_ties.explain``) for every divergence and every position over ``abs_max`` of the
    sequences whose engine recorded its routing; one forced forward per such sequence."""
    from .near_ties import explain

    out: dict[tuple[int, int], dict[str, Any]] = {}
    for i, (seq, recs) in enumerate(zip(seqs, records)):
        wanted = [j for j, p in enumerate(recs)
                  if not p["match"] or (p["delta"] is not None and abs(p["delta"]) > rule.abs_max)]
        if wanted and seq.get("routing"):
            for j, evidence in explain(oracle, seq, wanted, rule).items():
                out[(i, j)] = evidence
    return out


def judge_runs(model_dir: str, runs: Mapping[str, Iterable[Mapping[str, Any]]],
               dtypes: Sequence[str] = ("float32", "bfloat16"), rule: Optional[OracleRule] = None,
               oracles: Optional[dict[str, TeacherForcedOracle]] = None,
               expert_activation_quant: Optional[str] = None) -> dict[str, dict[str, Any]]:
    """``{run: {dtype: verdict}}`` for every run's sequences (dicts with ``prompt_token_ids``,
    ``token_ids`` and ``logprobs``: the engine's log-prob of each of its tokens).

    ``verdict["ok"]`` of the reference dtype is the run's verdict; the other
    dtypes carry the same figures for comparison (their ``ok`` is informational). ``expert_activation_quant``:
    the routed experts' inputs quantized as the served experts quantize them (:data:`EXPERT_ACTIVATION_QUANT`);
    ``rule`` defaults to that quantization's (:func:`rule_for`)."""
    rule = rule or rule_for(expert_activation_quant)
    oracles = oracles if oracles is not None else {}
    out: dict[str, dict[str, Any]] = {}
    for name, sequences in runs.items():
        seqs = list(sequences)
        out[name] = {}
        for dtype in dtypes:
            oracle = oracles.setdefault(dtype, TeacherForcedOracle(model_dir, dtype, expert_activation_quant))
            records = [oracle.records(s["prompt_token_ids"], s["token_ids"], s.get("logprobs") or [])
                       for s in seqs]
            explained = explain_positions(oracle, seqs, records, rule) if dtype == rule.reference_dtype else {}
            verdict = judge(records, rule, explained)
            verdict["dtype"] = dtype
            out[name][dtype] = verdict
    return out
