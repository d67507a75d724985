"""The oracle's near-tie evidence (``tools/engine/near_ties.py``) on a router full of near-ties.

The tiny DeepSeek-V3 of the first tiny checkpoints (a random router: ``gate_std`` 0.1, the owner skew's
``alpha`` 0.3, correction bias std 0.1, no word clusters) has 37.8 % of its routing decisions within ``2^-5``
of the top-k boundary on the demo's prompts. Its "engines" are HF transformers generating greedily over the
KV cache over the demo's six mixed prompts, each recording what its routers chose
(``oracle_controls.greedy``):

* ``forcing_is_exact`` — the fp32 oracle forced onto its **own** choices gives the same log-probs as without
  forcing, to the bit (the forced path changes nothing but the choices);
* ``forcing_moves`` — forced onto one other expert at one row, the log-probs after it move;
* ``bf16`` — the model in bf16 (a correct implementation): every divergence it makes must be explained as a
  near-tie (margins within the bound, the forced oracle agreeing), and judged without its routing the same
  run reads a larger gap;
* ``bias_ignored`` — the correction bias left out of the selection (a routing bug): its divergences must not
  be explained (the engine's experts are far from the oracle's own choices).

``python -m tests.support.near_tie_check --json`` (an environment with transformers).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

from moonep_ep.tools.checkpoints.tiny_deepseek_v3 import (ROUTERS, TinyDeepseekV3Config, build_tiny_deepseek_v3,
                                                          default_model_dir)
from moonep_ep.tools.engine.oracle import RULE, TeacherForcedOracle, judge_runs

#: the first tiny checkpoints' router (before the word clusters): near-ties everywhere
RANDOM_ROUTER = TinyDeepseekV3Config(**ROUTERS["random"])


def _forcing_controls(path: str, prompt: list[int]) -> dict[str, Any]:
    import torch

    oracle = TeacherForcedOracle(path, "float32")
    hooks = oracle.forced_routing()
    plain = torch.log_softmax(oracle._load()(input_ids=torch.tensor([prompt]), use_cache=False).logits[0].float(), -1)
    none = {layer: torch.full((len(prompt), 4), -1, dtype=torch.long) for layer in hooks.layers}
    oracle.forced_logprobs(prompt, none)
    own = {layer: hooks.seen[layer][1].long() for layer in hooks.layers}
    same = oracle.forced_logprobs(prompt, own)
    moved = {layer: t.clone() for layer, t in own.items()}
    first = hooks.layers[0]
    row = len(prompt) // 2
    spare = next(e for e in range(16) if e not in moved[first][row].tolist())
    moved[first][row, 0] = spare
    after = oracle.forced_logprobs(prompt, moved)
    return {"layers": hooks.layers, "forcing_is_exact": bool(torch.equal(same, plain)),
            "rows_unchanged_before_the_forced_row": bool(torch.equal(after[:row], plain[:row])),
            "largest_move_after_the_forced_row": float((after[row:] - plain[row:]).abs().max())}


def run(max_tokens: int = 16) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from moonep_ep.tools.engine.demo import DemoConfig, resolve_model, workload
    from tests.support.oracle_controls import greedy

    t0 = time.perf_counter()
    path = build_tiny_deepseek_v3(default_model_dir(RANDOM_ROUTER), RANDOM_ROUTER)
    choice = dataclasses.replace(resolve_model(DemoConfig(), lambda m: None), path=path)
    prompts = workload(choice, 2)[0][4:]  # the six mixed prompts (4 to 200 tokens)
    out: dict[str, Any] = {"model": path, "forcing": _forcing_controls(path, prompts[-1][:64])}
    runs = {}
    for name, dtype in (("bf16", torch.bfloat16), ("bias_ignored", torch.float32)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager",
                                                     local_files_only=True).eval()
        if name == "bias_ignored":
            with torch.no_grad():
                for layer in model.model.layers:
                    if hasattr(layer.mlp, "gate"):
                        layer.mlp.gate.e_score_correction_bias.zero_()
        runs[name] = greedy(model, prompts, max_tokens)
    runs["bf16_without_routing"] = [{k: v for k, v in s.items() if k != "routing"} for s in runs["bf16"]]
    judged = judge_runs(path, runs, dtypes=(RULE.reference_dtype,))
    keys = ("ok", "failed", "divergences", "max_gap_at_divergence", "max_gap_not_near_tie", "max_abs_not_near_tie",
            "abs_logprob_diff", "near_ties", "unexplained", "explained_positions")
    out["runs"] = {name: {k: v[RULE.reference_dtype][k] for k in keys} for name, v in judged.items()}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.support.near_tie_check")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    print(json.dumps(run(args.max_tokens), indent=1 if args.json else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
