"""Planted bugs in Kimi K3's MoE, served by vLLM's K3 class on the CPU engine, that the oracle must reject (issue 47).

Each control is a copy of a tiny K3 checkpoint with one bug the engine then computes, judged by the correct
checkpoint's oracle (``vllm-demo --model <planted> --oracle-model <correct>``; for MXFP4 the correct checkpoint's
copy decompressed by compressed-tensors):

* ``silu``: ``hidden_act`` ``silu`` for ``situ``: SiLU in place of SiTU (in the routed experts, and in the shared
  experts and dense MLP, which read the same field);
* ``no_linear_beta``: ``activation_situ_linear_beta`` dropped: SiTU's up half without its ``tanh`` bound;
* ``no_norm``: ``latent_moe_use_norm`` false: the latent RMSNorm between the combine and the up-projection
  skipped;
* ``scale_doubled`` (MXFP4): expert 0's E8M0 scales one exponent up in every MoE layer
  (``tiny_quantized.corrupt``).

The fifth control of the issue, the selection bias added to the weights too, is not here: the engine computes
vLLM's routing, and planting it needs a change to the product; the oracle-side check is
``tests/vllm/test_k3_oracle.py``'s, where on the tiny checkpoint (bias std 0.02) it moves the log-probs by
about bf16's rounding, below the rule.

``python -m tests.support.k3_controls CONTROL`` (an environment with the project's builders) prints the planted
checkpoint's directory and its oracle's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from moonep_ep.tools.checkpoints.tiny_kimi_k3 import build_tiny_kimi_k3
from moonep_ep.tools.checkpoints.tiny_quantized import _copy_beside, _read, corrupt, dequantized_copy

#: control -> (the tiny K3 it plants into, the config change (None: a tensor change))
CONTROLS = {"silu": ("tiny-k3", {"hidden_act": "silu"}),
            "no_linear_beta": ("tiny-k3", {"activation_situ_linear_beta": None}),
            "no_norm": ("tiny-k3", {"latent_moe_use_norm": False}),
            "scale_doubled": ("tiny-k3-mxfp4", None)}


def planted(control: str) -> tuple[str, str]:
    """``(planted checkpoint, the correct checkpoint's oracle directory)``."""
    model, change = CONTROLS[control]
    correct = build_tiny_kimi_k3(model)
    oracle = dequantized_copy(correct) if model.endswith("mxfp4") else correct
    if change is None:
        return corrupt(correct, control), oracle
    cfg, tensors = _read(correct)
    for key, value in change.items():
        if value is None:
            cfg.pop(key)
        else:
            cfg[key] = value
    if control == "no_norm":   # a served model without the norm has no norm weight (vLLM refuses an unknown one)
        tensors = {k: v for k, v in tensors.items() if not k.endswith("routed_expert_norm.weight")}
    return _copy_beside(correct, f"{correct.rstrip('/')}-{control}", cfg, tensors), oracle


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.support.k3_controls")
    p.add_argument("control", choices=sorted(CONTROLS))
    args = p.parse_args(argv)
    path, oracle = planted(args.control)
    print(json.dumps({"control": args.control, "model": path, "oracle_model": oracle,
                      "config": json.load(open(os.path.join(path, "config.json")))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
