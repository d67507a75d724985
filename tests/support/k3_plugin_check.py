"""vLLM 0.33.0's two refusals of Kimi K3 under ``--all2all-backend moonep``, and the plugin lifting them (kernel tier).

Run with the interpreter of the ``vllm==0.33.0`` environment (one process, no engine)::

    python -m tests.support.k3_plugin_check

Prints one JSON object:

* ``layers``: vLLM's own ``FusedMoEFactory`` (as ``KimiMoE`` calls it: the
  activation as a string, SiTU's betas, sigmoid routing with a correction
  bias) for ``silu``, ``situ`` (K3's betas 4 / 25) and ``gelu``, as DP rank 0
  of 2 with expert parallelism and ``all2all_backend="moonep"`` in a
  one-process gloo world: the backend vLLM's oracle chose, the experts class,
  whether its ``apply`` is the plugin's (``overlap.apply``) and whether an
  experts object builds; or the error.
* ``situ_without_plugin_check``: the same SiTU layer with vLLM's own
  ``MoonEPExperts._supports_activation`` put back (the negative control).
* ``situ_without_beta``: a SiTU layer without ``activation_situ_beta``: the
  experts refuse it when built.
* ``configs``: ``VllmConfig`` for a tiny K3 (``KimiLinearForCausalLM`` and
  ``KimiK3ForConditionalGeneration``), BF16 and compressed-tensors MXFP4,
  with the plugin, with vLLM's ``VllmConfig.__post_init__`` put back, and
  (MXFP4) with the plugin but without its undo of vLLM's K3 rewrite of
  ``quant_method`` to ``mxfp4``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from typing import Any, Callable, Iterator

from tests.support.vllm_moe_model import SITU_BETAS   # Kimi K3's betas (its config.json)


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@contextlib.contextmanager
def _original(cls: Any, name: str, static: bool = False) -> Iterator[None]:
    """``cls.name`` as vLLM defines it (under every wrapper of the plugin's, by ``__wrapped__``) inside the block."""
    from moonep_ep.vllm.hooks import is_wrapped

    patched = cls.__dict__[name]
    fn = patched.__func__ if isinstance(patched, staticmethod) else patched
    while is_wrapped(fn):  # the quantized check's and the CUDA-graph patch's wrappers both sit on __post_init__
        fn = fn.__wrapped__
    setattr(cls, name, staticmethod(fn) if static else fn)
    try:
        yield
    finally:
        setattr(cls, name, patched)


def _layer(activation: str, index: int, **betas: float) -> Any:
    import torch
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

    return FusedMoEFactory(num_experts=16, top_k=4, hidden_size=256, intermediate_size=128,
                           params_dtype=torch.bfloat16, tp_size=1, dp_size=2, pcp_size=1,
                           prefix=f"model.layers.{index}.block_sparse_moe.experts", activation=activation,
                           scoring_func="sigmoid", e_score_correction_bias=torch.zeros(16), use_grouped_topk=True,
                           num_expert_group=1, topk_group=1, **betas)


def _describe(build: Callable[[], Any]) -> dict[str, Any]:
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG

    from moonep_ep.vllm.hooks import is_wrapped

    try:
        runner = build()
    except Exception as exc:  # noqa: BLE001 - the refusal is the result
        return {"built": False, "error": _error(exc)}
    experts = next(m for m in runner.modules() if getattr(m, "quant_method", None) is not None)
    method, moe = experts.quant_method, experts.moe_config
    cls = method.experts_cls
    out = {"built": True, "backend": method.unquantized_backend.name, "experts_class": cls.__qualname__,
           "experts_module": cls.__module__, "apply_is_plugins": is_wrapped(cls.apply),
           "activation": moe.activation.value, "betas": [moe.activation_situ_beta, moe.activation_situ_linear_beta],
           "use_moonep_kernels": moe.moe_parallel_config.use_moonep_kernels}
    try:
        cls(moe_config=moe, quant_config=FUSED_MOE_UNQUANTIZED_CONFIG)
        out["experts_object"] = "built"
    except Exception as exc:  # noqa: BLE001
        out["experts_object"] = _error(exc)
    return out


def layer_checks() -> dict[str, Any]:
    from vllm.model_executor.layers.fused_moe.experts import moonep_experts

    out: dict[str, Any] = {"layers": {}}
    for i, act in enumerate(("silu", "situ", "gelu")):
        out["layers"][act] = _describe(lambda: _layer(act, i, **(SITU_BETAS if act == "situ" else {})))
    base = moonep_experts.MoonEPExperts
    while getattr(base, "_moonep_ep_cpu", False):   # the plugin's CPU subclass: vLLM's class is its base
        base = base.__bases__[0]
    with _original(base, "_supports_activation", static=True):
        out["situ_without_plugin_check"] = _describe(lambda: _layer("situ", 3, **SITU_BETAS))
    out["situ_without_beta"] = _describe(lambda: _layer("situ", 4))
    return out


def _k3_dirs(root: str) -> dict[str, str]:
    """config.json-only tiny K3 folders: ``{arch}/{bf16|mxfp4}``; the MXFP4 config is the tiny K3's own."""
    from moonep_ep.tools.checkpoints.tiny_kimi_k3 import TinyKimiK3Config, build_tiny_kimi_k3, hf_config

    with open(os.path.join(build_tiny_kimi_k3("tiny-k3-mxfp4"), "config.json")) as f:
        qcfg = json.load(f)["quantization_config"]
    text = hf_config(TinyKimiK3Config())
    dirs = {}
    for fmt, q in (("bf16", None), ("mxfp4", qcfg)):
        t = dict(text, **({"quantization_config": q} if q else {}))
        for arch, cfg in (("KimiLinearForCausalLM", t),
                          ("KimiK3ForConditionalGeneration", {"model_type": "kimi_k3", "architectures": [
                              "KimiK3ForConditionalGeneration"], "text_config": t, "torch_dtype": "bfloat16"})):
            d = os.path.join(root, f"{arch}-{fmt}")
            os.makedirs(d)
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump(cfg, f)
            dirs[f"{arch}/{fmt}"] = d
    return dirs


def _vllm_config(model_dir: str) -> Any:
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig, VllmConfig

    # Prefix caching off: vLLM's hybrid-model hook sets mamba_block_size for it, then its CPU platform turns it
    # off for MLA and the config refuses the pair (an engine on CPU must pass enable_prefix_caching=False).
    return VllmConfig(model_config=ModelConfig(model=model_dir, dtype="bfloat16", skip_tokenizer_init=True),
                      cache_config=CacheConfig(enable_prefix_caching=False),
                      parallel_config=ParallelConfig(all2all_backend="moonep", enable_expert_parallel=True,
                                                     data_parallel_size=2))


def config_checks() -> dict[str, Any]:
    from vllm.config import VllmConfig

    from moonep_ep.vllm.checkpoint import patches as checkpoint_patches

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="moonep-ep-k3-") as root:
        for case, d in _k3_dirs(root).items():
            modes = ("plugin", "vllm") + (("plugin_keeps_rewrite",) if case.endswith("mxfp4") else ())
            for mode in modes:
                key = f"{case}/{mode}"
                ctx = contextlib.ExitStack()
                if mode == "vllm":
                    ctx.enter_context(_original(VllmConfig, "__post_init__"))
                    ctx.enter_context(_original(VllmConfig, "_set_compile_ranges"))
                elif mode == "plugin_keeps_rewrite":   # control: the plugin without its undo of K3's rewrite
                    keep = checkpoint_patches._keep_k3_compressed_tensors
                    checkpoint_patches._keep_k3_compressed_tensors = lambda vllm_config: None
                    ctx.callback(setattr, checkpoint_patches, "_keep_k3_compressed_tensors", keep)
                with ctx:
                    try:
                        cfg = _vllm_config(d)
                        out[key] = {"error": None, "quantization": cfg.model_config.quantization}
                    except Exception as exc:  # noqa: BLE001 - pydantic wraps vLLM's ValueError
                        out[key] = {"error": _error(exc)}
    return out


def main() -> int:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ["MOONEP_EP_CPU"] = "1"
    from moonep_ep.tools.engine.harness import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))   # a one-process gloo world
    from moonep_ep.vllm import plugin

    plugin.install()
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    out: dict[str, Any] = {"plugin": plugin.state()["patched"]}
    with set_current_vllm_config(VllmConfig(parallel_config=ParallelConfig(enable_expert_parallel=True,
                                                                           all2all_backend="moonep"))):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method="env://")
        initialize_model_parallel(tensor_model_parallel_size=1)
        out.update(layer_checks())
    out["configs"] = config_checks()
    out["plugin"] = plugin.state()["patched"]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
