"""vLLM's own configuration checks for ``all2all_backend="moonep"``, as a user meets them.

Run in an environment with vLLM (``python -m tests.support.vllm_config_checks
MODEL_DIR``): builds ``VllmConfig`` for each unsupported setting and prints
one JSON object ``{case: error message}``. These checks run in the process
that parses the arguments, before any engine or collective exists, so they
cannot hang:

* quantized model, non-bf16 dtype, non-linear expert placement: vLLM
  0.33.0's moonep checks (``config/vllm.py``);
* EPLB: on CUDA vLLM's moonep check; on the CPU platform vLLM rejects EPLB
  itself, earlier (``ParallelConfig``).

The plugin does not relax any of them (``E % EP size`` and the 128-multiples
are checked by the plugin at load, ``vllm/store/sharded.py``).
"""

from __future__ import annotations

import json
import sys
from typing import Any, Callable


def collect(model_dir: str) -> dict[str, str]:
    from vllm.config import ModelConfig, ParallelConfig, VllmConfig

    def par(**kw: Any) -> Any:
        return ParallelConfig(all2all_backend="moonep", enable_expert_parallel=True, data_parallel_size=2, **kw)

    cases: dict[str, Callable[[], Any]] = {
        "quantized": lambda: VllmConfig(model_config=ModelConfig(model=model_dir, dtype="bfloat16",
                                                                 quantization="fp8"), parallel_config=par()),
        "fp16": lambda: VllmConfig(model_config=ModelConfig(model=model_dir, dtype="float16"),
                                   parallel_config=par()),
        "eplb": lambda: VllmConfig(parallel_config=par(enable_eplb=True)),
        "round_robin_placement": lambda: VllmConfig(parallel_config=par(expert_placement_strategy="round_robin")),
        "supported": lambda: VllmConfig(model_config=ModelConfig(model=model_dir, dtype="bfloat16"),
                                        parallel_config=par()),
    }
    out = {}
    for name, build in cases.items():
        try:
            build()
            out[name] = "no error"
        except Exception as exc:  # noqa: BLE001 - pydantic wraps vLLM's ValueError
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


if __name__ == "__main__":
    from moonep_ep.tools.checkpoints.tiny_model import build_tiny_qwen3_moe, default_model_dir

    model = sys.argv[1] if len(sys.argv) > 1 else build_tiny_qwen3_moe(default_model_dir())
    print(json.dumps(collect(model)))
