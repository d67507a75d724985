"""The oracle on quantized checkpoints, and the negative controls that must fail it.

For each tiny quantized checkpoint (``tiny_quantized.py``) the oracle is HF
transformers (fp32) on :func:`~moonep_ep.tools.checkpoints.tiny_quantized.dequantized_copy`
— the experts decompressed by compressed-tensors' own decompressor, or by
DeepSeek's documented formula for FP8 block — under the same rule as every
vLLM run (``oracle.py``). The "engines" judged here are HF transformers too:

* ``bf16`` — the clean copy in bf16 arithmetic (a correct implementation):
  must **pass**;
* ``scale_doubled`` — expert 0's scales doubled in every MoE layer;
* ``nibble_swapped`` — the two nibbles of every packed INT4/MXFP4 byte
  exchanged (an unpacker reading the wrong nibble first);
* ``stale_scale`` — expert 0's weights with expert 8's scales (a slot
  refilled with its weight but still holding the previous expert's scale);

each bug is written into a copy of the quantized checkpoint
(:func:`~moonep_ep.tools.checkpoints.tiny_quantized.corrupt`) and decompressed by the
same decompressor; every bug must **fail**.

FP8 block is served W8A8 by the Triton experts (activations quantized per
1x128), judged by an oracle whose experts quantize alike under
:data:`~moonep_ep.tools.engine.oracle.W8A8_RULE`. So its W8A8 section repeats
the controls with every "engine" quantizing its expert inputs the same way:
``bf16`` (a correct W8A8 implementation in bf16 arithmetic) must pass the
W8A8 rule, ``scale_doubled`` and ``stale_scale`` must fail it.

``python -m tests.support.quantized_controls --json`` (an environment with
transformers and compressed-tensors).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Sequence

from moonep_ep.tools.engine.oracle import RULE, quantize_expert_inputs, rule_for
from moonep_ep.tools.checkpoints.tiny_quantized import CONTROLS, QUANTIZED_MODELS, build_tiny_quantized, corrupt, dequantized_copy


def controls_of(name: str) -> tuple[str, ...]:
    return tuple(c for c in CONTROLS if not (c == "nibble_swapped" and QUANTIZED_MODELS[name] == "fp8-block"))


#: format -> the activation quantization its GPU experts apply (the oracle and every "engine" apply it too)
ACTIVATION_QUANT = {"fp8-block": "fp8-1x128"}
W8A8_CONTROLS = ("scale_doubled", "stale_scale")


def run_controls(models: Sequence[str] = tuple(QUANTIZED_MODELS), max_tokens: int = 16,
                 num_prompts: int = 6) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from tests.support.oracle_controls import greedy, verdicts
    from moonep_ep.tools.checkpoints.tiny_model import mixed_prompt_ids

    prompts = mixed_prompt_ids(num_prompts)
    out: dict[str, Any] = {"rule": RULE.__dict__, "models": {}}
    t0 = time.perf_counter()
    for name in models:
        path = build_tiny_quantized(name)
        clean = dequantized_copy(path)
        # each bug written and decompressed once: the W8A8 section below runs the same copies again
        sources = {"bf16": clean, **{c: dequantized_copy(corrupt(path, c)) for c in controls_of(name)}}

        def generated(controls: Sequence[str], act_quant: Any = None) -> dict[str, Any]:
            runs = {}
            for run in ("bf16", *controls):
                dtype = torch.bfloat16 if run == "bf16" else torch.float32
                model = AutoModelForCausalLM.from_pretrained(sources[run], dtype=dtype, attn_implementation="eager",
                                                             local_files_only=True).eval()
                if act_quant:
                    quantize_expert_inputs(model, act_quant)
                runs[run] = greedy(model, prompts, max_tokens)
            return runs

        res = verdicts(clean, generated(controls_of(name)))
        entry = {"format": QUANTIZED_MODELS[name], "oracle_checkpoint": clean, "controls": res,
                 "ok": res["bf16"]["ok"] and not any(res[c]["ok"] for c in controls_of(name))}
        act_quant = ACTIVATION_QUANT.get(QUANTIZED_MODELS[name])
        if act_quant:
            w8a8 = verdicts(clean, generated(W8A8_CONTROLS, act_quant), act_quant)
            entry["w8a8"] = {"activation_quant": act_quant, "rule": rule_for(act_quant).__dict__, "controls": w8a8}
            entry["ok"] = entry["ok"] and w8a8["bf16"]["ok"] and not any(w8a8[c]["ok"] for c in W8A8_CONTROLS)
        out["models"][name] = entry
    out["ok"] = all(m["ok"] for m in out["models"].values())
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.support.quantized_controls")
    p.add_argument("--model", action="append", choices=sorted(QUANTIZED_MODELS),
                   help="a tiny quantized model (repeatable; default: all three)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    out = run_controls(args.model or tuple(QUANTIZED_MODELS), args.max_tokens)
    print(json.dumps(out, indent=1 if args.json else None))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
