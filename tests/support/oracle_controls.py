"""Controls of the oracle rule: a correct bf16 implementation passes it, simulated MoE bugs fail it.

Each "engine" here is HF transformers itself generating greedily (16 tokens,
the demo's prompts) on the tiny DeepSeek-V3, and the fp32 oracle judges it
with the same rule as the vLLM runs (``oracle.py``):

* ``bf16`` — the unchanged model in bf16: right, but with bf16 arithmetic
  (near-tie routing flips included); must **pass**;
* ``swap_experts`` — experts 8 and 9 exchanged in every MoE layer (a slot
  or a view serving the wrong expert's rows);
* ``expert_zeroed`` — expert 3's down projection zeroed (a slot never
  filled);
* ``no_routed_scaling`` — routed weights not multiplied by 2.5;
* ``no_shared_expert`` — the shared expert's output dropped;
* ``bias_ignored`` — the ``noaux_tc`` correction bias left out of the
  selection.

Every bug must **fail**. ``python -m tests.support.oracle_controls --json``
(in an environment with transformers).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from moonep_ep.tools.engine.oracle import RULE, judge_runs

BUGS = ("swap_experts", "expert_zeroed", "no_routed_scaling", "no_shared_expert", "bias_ignored")


def _perturb(model: Any, bug: str) -> None:
    import torch

    with torch.no_grad():
        for layer in model.model.layers:
            mlp = layer.mlp
            if not hasattr(mlp, "experts"):
                continue  # the dense first layer
            if bug == "swap_experts":
                for t in (mlp.experts.gate_up_proj, mlp.experts.down_proj):
                    t[[8, 9]] = t[[9, 8]].clone()
            elif bug == "expert_zeroed":
                mlp.experts.down_proj[3].zero_()
            elif bug == "no_routed_scaling":
                mlp.gate.routed_scaling_factor = 1.0
            elif bug == "no_shared_expert":
                mlp.shared_experts.down_proj.weight.zero_()
            elif bug == "bias_ignored":
                mlp.gate.e_score_correction_bias.zero_()
            else:
                raise ValueError(f"unknown bug {bug!r}; known: {BUGS}")


class EngineRouting:
    """What an HF "engine"'s routers chose, row by row as it decodes (the prompt's rows, then one a step): the
    ``routing`` a vLLM engine records (``vllm/observe/routing_record.py``), for the oracle's near-tie evidence."""

    ROUTERS = ("DeepseekV3TopkRouter", "Qwen3MoeTopKRouter", "MixtralTopKRouter")

    def __init__(self, model: Any) -> None:
        from moonep_ep.tools.engine.near_ties import _layer_of

        self.rows: dict[int, list[list[int]]] = {}
        for name, module in model.named_modules():
            if type(module).__name__ in self.ROUTERS and _layer_of(name) is not None:
                self._wrap(module, _layer_of(name))

    def _wrap(self, module: Any, layer: int) -> None:
        original = module.forward

        def forward(hidden_states: Any) -> Any:
            out = original(hidden_states)
            self.rows.setdefault(layer, []).extend(out[2].tolist())
            return out

        module.forward = forward

    def take(self) -> dict[str, Any]:
        layers = sorted(self.rows)
        n = min((len(v) for v in self.rows.values()), default=0)
        routing = {"layers": layers, "topk": [[self.rows[lid][r] for lid in layers] for r in range(n)]}
        self.rows = {}
        return routing


def greedy(model: Any, prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
    """Greedy tokens and each token's log-prob from an HF model (the "engine" under test): the prompt once,
    then one token a step over the model's KV cache, as an engine decodes (a full forward per token cost
    ten times the compute on the 250-token prompts). Each sequence carries the experts the engine's routers
    chose (``routing``), as the vLLM runs' do."""
    import torch

    recorder = EngineRouting(model)
    out = []
    for prompt in prompts:
        tokens, logprobs = [], []
        recorder.take()
        with torch.no_grad():
            step = model(input_ids=torch.tensor([list(prompt)]), use_cache=True)
            for i in range(max_tokens):
                lp = torch.log_softmax(step.logits[0, -1].float(), dim=-1)
                token = int(lp.argmax())
                tokens.append(token)
                logprobs.append(float(lp[token]))
                if i + 1 < max_tokens:
                    step = model(input_ids=torch.tensor([[token]]), past_key_values=step.past_key_values,
                                 use_cache=True)
        out.append({"prompt_token_ids": list(prompt), "token_ids": tokens, "logprobs": logprobs,
                    "routing": recorder.take()})
    return out


def verdicts(oracle_dir: str, runs: dict[str, Any], expert_activation_quant: Any = None) -> dict[str, Any]:
    """``{run: verdict}`` of the reference dtype, the fields the controls report (``judge_runs``' rule by default:
    the one for ``expert_activation_quant``)."""
    judged = judge_runs(oracle_dir, runs, dtypes=(RULE.reference_dtype,),
                        expert_activation_quant=expert_activation_quant)
    return {run: {k: v[RULE.reference_dtype][k] for k in ("ok", "failed", "positions", "divergences",
                                                          "max_gap_at_divergence", "max_gap_not_near_tie",
                                                          "max_abs_not_near_tie", "abs_logprob_diff", "near_ties",
                                                          "unexplained", "explained_positions")}
            for run, v in judged.items()}


def run_controls(max_tokens: int = 16) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from moonep_ep.tools.engine.demo import DemoConfig, resolve_model, workload

    choice = resolve_model(DemoConfig(), lambda m: None)
    prompts = workload(choice, 2)[0]
    runs = {}
    t0 = time.perf_counter()
    for name in ("bf16", *BUGS):
        dtype = torch.bfloat16 if name == "bf16" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(choice.path, dtype=dtype, attn_implementation="eager",
                                                     local_files_only=True).eval()
        if name != "bf16":
            _perturb(model, name)
        runs[name] = greedy(model, prompts, max_tokens)
    out = verdicts(choice.path, runs)
    return {"model": choice.path, "rule": RULE.__dict__, "controls": out,
            "ok": out["bf16"]["ok"] and not any(out[b]["ok"] for b in BUGS),
            "seconds": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.support.oracle_controls")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    out = run_controls(args.max_tokens)
    print(json.dumps(out, indent=1 if args.json else None))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
