"""``--all2all-backend moonep`` on quantized checkpoints: the verdict a user meets when vLLM parses the arguments.

Run in an environment with vLLM (``python -m tests.support.quantized_config_checks``):
registers the plugin as vLLM's engine arguments do, then builds
``VllmConfig`` (``ModelConfig`` of the checkpoint, DP=2, expert parallel,
moonep) for each tiny quantized checkpoint and for copies of the INT4 one
rewritten to a scheme moonep_ep refuses, and prints one JSON object
``{case: error message or "no error"}``. The check runs in the process that
parses the arguments, before any engine or collective exists, on every DP
rank alike.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from typing import Any, Callable

from moonep_ep.tools.checkpoints.tiny_quantized import QUANTIZED_MODELS, build_tiny_quantized

#: rewrites of the INT4 checkpoint's quantization_config, each refused
REWRITES: dict[str, Callable[[dict[str, Any]], None]] = {
    "zero_points": lambda q: q["config_groups"]["group_0"]["weights"].update(symmetric=False),
    "act_order": lambda q: q["config_groups"]["group_0"]["weights"].update(actorder="group"),
    "quantized_attention": lambda q: q.update(ignore=["lm_head", "re:.*shared_experts.*", r"re:.*mlp\.gate$",
                                                      r"re:.*mlp\.(gate|up|down)_proj$"]),
}


def rewritten(src: str, name: str, rewrite: Callable[[dict[str, Any]], None], root: str) -> str:
    dst = os.path.join(root, name)
    shutil.copytree(src, dst, symlinks=True, ignore=lambda d, names: [n for n in names if n.endswith(".safetensors")])
    for n in os.listdir(src):
        if n.endswith(".safetensors"):
            os.symlink(os.path.join(src, n), os.path.join(dst, n))
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    rewrite(cfg["quantization_config"])
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


def collect() -> dict[str, str]:
    from vllm.config import ModelConfig, ParallelConfig, VllmConfig
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # what EngineArgs does before it builds the config
    out: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="moonep-ep-qcheck-") as root:
        cases = {name: build_tiny_quantized(name) for name in QUANTIZED_MODELS}
        int4 = cases["tiny-kimi-k2-thinking-int4"]
        cases.update({name: rewritten(int4, name, fn, root) for name, fn in REWRITES.items()})
        for name, path in cases.items():
            try:
                config = VllmConfig(model_config=ModelConfig(model=path, dtype="bfloat16"),
                                    parallel_config=ParallelConfig(all2all_backend="moonep",
                                                                   enable_expert_parallel=True, data_parallel_size=2))
                out[name] = "no error"
                if name == "tiny-kimi-k2-thinking-int4":  # a served scheme: the quantization is put back
                    out["int4_quantization_after_check"] = str(config.model_config.quantization)
            except Exception as exc:  # noqa: BLE001 - pydantic may wrap the error
                out[name] = f"{type(exc).__name__}: {exc}"
        # A served scheme still meets vLLM's other moonep rules (here: linear expert placement)
        try:
            VllmConfig(model_config=ModelConfig(model=int4, dtype="bfloat16"),
                       parallel_config=ParallelConfig(all2all_backend="moonep", enable_expert_parallel=True,
                                                      data_parallel_size=2, expert_placement_strategy="round_robin"))
            out["int4_round_robin_placement"] = "no error"
        except Exception as exc:  # noqa: BLE001
            out["int4_round_robin_placement"] = f"{type(exc).__name__}: {exc}"
    return out


if __name__ == "__main__":
    print(json.dumps(collect()))
    sys.exit(0)
