"""Warm-up of the GPU experts: every Triton variant a step can pick, compiled before serving.

The Triton experts (``quantized/engine.py``; for BF16 layers on a GPU ``bf16_gpu.Bf16TritonExperts``, registered
by ``overlap.patch_experts`` when vLLM binds the layer) pick their block sizes per step from the step's token count
(:func:`~moonep_ep.vllm.experts.gpu.kernel_config`: vLLM's tuned entry nearest ``M``, or its default for ``M``),
and each new config is a new Triton specialization (``BLOCK_SIZE_*``, ``num_warps``, ``num_stages``): a compile on
the first step that sees it, on every rank, mid-serving. Here, before serving:

* :func:`kernel_variants` lists every distinct config a layer can pick over ``1 .. max_tokens`` (vLLM's
  ``max_num_batched_tokens``: no step routes more tokens on a rank). With a tuned file, the config is constant
  over each key's nearest-``M`` bucket, so one token count per bucket (:func:`token_buckets`) finds them all;
  without one (vLLM's default config has its own thresholds) every token count is asked, which is exact and
  costs microseconds each.
* :func:`warm_up_experts` launches each variant once per distinct (format, layer shape, config, activation,
  route weight or not), through the experts' own ``grouped_ffn`` (the forward's launch path: the same config
  cache, views, strides and row alignment, so the same specializations compile), on one group of
  ``token_padding`` dummy rows routed to weight row 0; ``topk_ids`` is a ``meta`` tensor of the bucket's token
  count, which is all ``grouped_ffn`` reads of it.
* :func:`patch_kernel_warmup` (``quantized/hooks.py``'s table) runs it after vLLM 0.33.0's ``kernel_warmup``
  in the GPU worker's ``compile_or_warm_up_model`` (before CUDA-graph capture).

Under Triton's interpreter (the CPU engine) nothing compiles: the listing is made and logged, no launch.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any, Iterable, Optional, Sequence

import torch

logger = logging.getLogger("vllm.moonep_ep")

__all__ = ["config_key", "kernel_variants", "patch_kernel_warmup", "register_experts", "token_buckets",
           "tuned_m_keys", "warm_up_experts", "warm_up_registered"]


#: id -> the bound Triton experts of this process (one per quantized MoonEP layer); weak: a dropped model goes
_REGISTERED: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()


def config_key(config: dict[str, Any]) -> tuple:
    """A config as a hashable key (what a Triton specialization is built from)."""
    return tuple(sorted(config.items()))


def token_buckets(keys: Optional[Iterable[int]], max_tokens: int) -> list[int]:
    """One token count in every bucket of ``1 .. max_tokens`` whose nearest tuned ``M`` key differs.

    Each key's bucket (the counts whose nearest key it is; a tie goes either way) is an interval holding the key
    itself, so a bucket that meets ``1 .. max_tokens`` holds its key, or 1 (the first bucket), or
    ``max_tokens`` (the last one the range reaches). ``keys`` None: every count (no tuned file)."""
    top = max(int(max_tokens), 1)
    if keys is None:
        return list(range(1, top + 1))
    cand = {1, top, *(int(k) for k in keys)}
    return sorted(t for t in cand if 1 <= t <= top)


def tuned_m_keys(fmt: str, *, local_experts: int, intermediate: int) -> Optional[list[int]]:
    """The ``M`` keys of the tuned file vLLM's ``try_get_optimal_moe_config`` reads for this layer (the lookup
    :func:`~moonep_ep.vllm.experts.gpu.kernel_config` makes), ``[1]`` under vLLM's override config (one config
    for every ``M``), or None: no file, or the lookup failed (then every token count is asked)."""
    from .gpu import VLLM_CONFIG_KEYS

    try:
        from vllm.model_executor.layers.fused_moe import get_config
        from vllm.model_executor.layers.fused_moe.fused_moe import get_moe_configs

        if get_config():
            return [1]
        dtype, block = VLLM_CONFIG_KEYS[fmt]
        # vLLM's lookup: N = w2's last dim, doubled back for INT4's packed w2 = the intermediate size
        configs = get_moe_configs(int(local_experts), int(intermediate), dtype, block[0] if block else 0,
                                  block[1] if block else 0)
    except Exception:  # noqa: BLE001 - an unknown lookup is asked at every token count instead
        logger.debug("moonep_ep: tuned MoE config keys unknown; warm-up asks every token count", exc_info=True)
        return None
    return sorted(int(k) for k in configs) if configs else None


def kernel_variants(fmt: str, *, local_experts: int, hidden: int, intermediate: int, top_k: int,
                    token_padding: int, interpreter: bool, max_tokens: int,
                    keys: Any = "tuned") -> list[tuple[int, dict[str, int]]]:
    """``[(first token count, config)]``: every distinct :func:`~moonep_ep.vllm.experts.gpu.kernel_config` of a
    layer over ``1 .. max_tokens``, in token order. ``keys``: the tuned ``M`` keys (default: :func:`tuned_m_keys`;
    None asks every count)."""
    from . import gpu

    shape = dict(local_experts=local_experts, hidden=hidden, intermediate=intermediate, top_k=top_k,
                 token_padding=token_padding, interpreter=interpreter)
    if interpreter:  # one config for every step (ENGINE_INTERPRETER_CONFIG)
        counts: Sequence[int] = [1]
    else:
        if keys == "tuned":
            keys = tuned_m_keys(fmt, local_experts=local_experts, intermediate=intermediate)
        counts = token_buckets(keys, max_tokens)
    found: dict[tuple, tuple[int, dict[str, int]]] = {}
    for tokens in counts:
        cfg = gpu.kernel_config(fmt, tokens=tokens, **shape)
        found.setdefault(config_key(cfg), (tokens, cfg))
    return list(found.values())


def register_experts(experts: Any) -> None:
    """Keep a bound Triton experts object for the warm-up (``engine.bind_quantized_layer``, and
    ``overlap.register_for_warmup`` for BF16); others are not kept."""
    if getattr(experts, "experts_kind", None) == "triton":
        _REGISTERED[id(experts)] = experts


def _shape_key(experts: Any, layout: Any, act: Any) -> tuple:
    """What a launch specializes on besides the config: format, views (trailing shape, dtype, strides), the
    activations' width and dtype, the activation, top-k."""
    moe = experts.moe_config
    views = tuple((n, tuple(v.shape[1:]), str(v.dtype), tuple(v.stride())) for n, v in sorted(layout.views.items()))
    return (layout.format, views, int(moe.hidden_dim), str(moe.in_dtype), repr(act), int(moe.experts_per_token))


def warm_up_experts(experts: Any, *, max_tokens: int, seen: Optional[set] = None, launch: bool = True,
                    variants: Optional[list[tuple[int, dict[str, int]]]] = None) -> list[tuple[int, dict[str, int]]]:
    """Launch every variant of one bound Triton experts object once (not those in ``seen``, which it extends).

    ``variants``: the listing to warm (default :func:`kernel_variants` of the layer); ``launch`` False, or the
    interpreter: list only. Returns the variants launched (or listed)."""
    from .activation import activation_of

    layout, moe = experts._weight_layout, experts.moe_config
    act = activation_of(moe)
    top_k = max(int(moe.experts_per_token), 1)
    if variants is None:
        variants = kernel_variants(layout.format, local_experts=moe.num_local_experts, hidden=moe.hidden_dim,
                                   intermediate=moe.intermediate_size_per_partition, top_k=top_k,
                                   token_padding=experts.token_padding, interpreter=experts.interpreter,
                                   max_tokens=max_tokens)
    seen = set() if seen is None else seen
    shape = _shape_key(experts, layout, act)
    todo = [(t, c) for t, c in variants if (shape, config_key(c)) not in seen]
    seen.update((shape, config_key(c)) for _, c in todo)
    if not launch or experts.interpreter:
        return todo
    view = next(iter(layout.views.values()))
    rows, dev = int(experts.token_padding), view.device
    hidden = torch.zeros(rows, int(moe.hidden_dim), dtype=moe.in_dtype, device=dev)
    out = torch.empty_like(hidden)
    # one group of token_padding rows (what MoonEP pads each group to) on weight row 0, every other group empty
    cu = torch.full((view.shape[0],), rows, dtype=torch.int32, device=dev)
    for tokens, _ in todo:
        ids = torch.empty((tokens, top_k), dtype=torch.int64, device="meta")  # only its shape is read
        # route weights applied in the activation kernel (HAS_ROUTE) or on the input: both specializations
        for route in (torch.ones(rows, dtype=torch.float32, device=dev), None):
            experts.grouped_ffn(layout, hidden, cu, route, ids, activation=act, out=out)
    return todo


def warm_up_registered(max_tokens: int, *, launch: bool = True) -> dict[str, Any]:
    """:func:`warm_up_experts` for every registered experts object of this process; a layer whose warm-up fails
    is logged and skipped (its first step compiles then, as without the warm-up)."""
    start, seen, warmed, failed = time.perf_counter(), set(), 0, 0
    experts_list = list(_REGISTERED.values())
    for experts in experts_list:
        try:
            warmed += len(warm_up_experts(experts, max_tokens=max_tokens, seen=seen, launch=launch))
        except Exception:  # noqa: BLE001 - the warm-up must not stop serving
            failed += 1
            logger.exception("moonep_ep: warm-up of a quantized experts layer failed; its variants compile on "
                             "first use")
    if launch and any(getattr(e, "interpreter", False) is False for e in experts_list) and torch.cuda.is_available():
        torch.cuda.synchronize()
    interpreted = any(getattr(e, "interpreter", False) for e in experts_list)
    summary = {"layers": len(experts_list), "variants": warmed, "failed_layers": failed, "max_tokens": max_tokens,
               "launched": bool(launch and not interpreted), "s": round(time.perf_counter() - start, 3)}
    if experts_list:
        logger.info("moonep_ep: Triton experts warm-up: %d Triton variants over 1..%d tokens, %d layers%s "
                    "(%.2f s)", warmed, max_tokens, len(experts_list),
                    "" if summary["launched"] else ", listed only (Triton's interpreter compiles nothing)",
                    summary["s"])
    return summary


def patch_kernel_warmup(module: Any, *, install: Any, mark: Any, note: Any) -> None:
    """vLLM's GPU worker: after its ``kernel_warmup`` (the name ``gpu_worker`` bound at import), warm the quantized
    experts' variants over ``1 .. max_num_batched_tokens``."""
    from ..hooks import is_wrapped

    original = getattr(module, "kernel_warmup", None)
    if original is None or is_wrapped(original):  # a vLLM without the name: nothing to wrap
        return

    def kernel_warmup(worker: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(worker, *args, **kwargs)
        warm_up_registered(int(worker.scheduler_config.max_num_batched_tokens))
        return result

    install(module, "kernel_warmup", kernel_warmup, original, "gpu_worker.kernel_warmup")
