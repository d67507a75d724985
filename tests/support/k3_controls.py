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
  (``tiny_quantized.corrupt``);
* ``bias_in_weights``: the routing weights read ``e_score_correction_bias`` too, where K3's ``noaux_tc`` routing
  uses it only to choose. No checkpoint can say that, so the engine runs vLLM's CPU router with the bug planted
  (``k3_router_plant/sitecustomize.py``, on ``PYTHONPATH`` of that run only). The tiny K3's bias (std 0.02) moves
  the weights by about bf16's own rounding (``test_k3_oracle.py``: 0.0074 mean, 0.022 largest change of a
  log-prob), so this control runs on a tiny K3 whose bias has std :data:`BIAS_STD`, and that checkpoint served
  without the plant must pass the same oracle (the control's own control). Measured on 2 cores (4 tokens, mixed
  prompts): planted p50 0.031 (the rule's 0.02), p90 0.042; unplanted p50 0.0059, p90 0.012, max 0.013. A bias std
  of 0.1 failed harder (p50 0.040, p90 0.19) but its correct run came closer to the rule (p90 0.042, a routing
  near-tie of 0.52), and 0.07 failed p90 only (0.070): the checkpoint changes the routing, so the margin does not
  grow with the std.

``python -m tests.support.k3_controls CONTROL`` (an environment with the project's builders) prints the planted
checkpoint's directory, its oracle's and the environment the engine runs with.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from moonep_ep.tools.checkpoints.tiny_kimi_k3 import TinyKimiK3Config, build_tiny_kimi_k3
from moonep_ep.tools.checkpoints.tiny_quantized import _copy_beside, _read, corrupt, dequantized_copy

#: the bias_in_weights control's checkpoint: e_score_correction_bias std (the tiny K3's is 0.02)
BIAS_STD = 0.05
#: the folder whose sitecustomize plants the routing bug in every process started with it on PYTHONPATH
ROUTER_PLANT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "k3_router_plant")
#: control -> (the tiny K3 it plants into, the config change (None: a tensor change; "router": the planted router))
CONTROLS = {"silu": ("tiny-k3", {"hidden_act": "silu"}),
            "no_linear_beta": ("tiny-k3", {"activation_situ_linear_beta": None}),
            "no_norm": ("tiny-k3", {"latent_moe_use_norm": False}),
            "scale_doubled": ("tiny-k3-mxfp4", None),
            "bias_in_weights": ("tiny-k3", "router")}


def router_plant_env(environ: dict[str, str]) -> dict[str, str]:
    """``PYTHONPATH`` with the router plant first (the run's other entries kept)."""
    rest = environ.get("PYTHONPATH")
    return {"PYTHONPATH": ROUTER_PLANT + (os.pathsep + rest if rest else "")}


def planted(control: str) -> tuple[str, str, dict[str, str]]:
    """``(planted checkpoint, the correct checkpoint's oracle directory, the engine's environment additions)``."""
    model, change = CONTROLS[control]
    if change == "router":
        correct = build_tiny_kimi_k3(model, config=TinyKimiK3Config(bias_std=BIAS_STD))
        return correct, correct, router_plant_env(dict(os.environ))
    correct = build_tiny_kimi_k3(model)
    oracle = dequantized_copy(correct) if model.endswith("mxfp4") else correct
    if change is None:
        return corrupt(correct, control), oracle, {}
    cfg, tensors = _read(correct)
    for key, value in change.items():
        if value is None:
            cfg.pop(key)
        else:
            cfg[key] = value
    if control == "no_norm":   # a served model without the norm has no norm weight (vLLM refuses an unknown one)
        tensors = {k: v for k, v in tensors.items() if not k.endswith("routed_expert_norm.weight")}
    return _copy_beside(correct, f"{correct.rstrip('/')}-{control}", cfg, tensors), oracle, {}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.support.k3_controls")
    p.add_argument("control", choices=sorted(CONTROLS))
    args = p.parse_args(argv)
    path, oracle, env = planted(args.control)
    print(json.dumps({"control": args.control, "model": path, "oracle_model": oracle, "env": env,
                      "config": json.load(open(os.path.join(path, "config.json")))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
