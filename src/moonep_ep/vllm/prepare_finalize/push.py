"""MoonEP's push API (the release 26/09) through vLLM 0.33.0's modular kernel (``MOONEP_EP_MOONEP_API=push``).

vLLM 0.33.0's ``MoonEPPrepareAndFinalize`` calls the pull API: ``cu_seqlens
[E+B]`` and ``prefetch_weight(plan, full_*_weight=[E+B, ...])``. The push API
(docs/design/moonep.md §2.8) differs in three places, all inside the prepare
step and the weights the experts read:

* ``dispatch`` returns ``cu_seqlens [2*epn]``: this rank's own experts, then
  its ``epn`` slots (§4.9), so the experts read ``[2*epn]`` rows: the store's
  ``push_view`` views (own expert pages followed by the shared slot pool,
  one physical layout with the pull views);
* ``prefetch_weight(plan, local_*_weight=[epn, ...], *_prefetch_buffer=[R,
  epn, ...])`` is collective: every owner pushes its experts into the slot
  pools of the ranks that need them (``push_pool`` views), then a barrier;
* ``dispatch`` takes exactly ``S`` tokens, which vLLM's prepare step already
  guarantees (it pads every batch to the pool buffer's capacity, one buffer
  per capacity).

:class:`PushWeightLayout` is vLLM's ``MoonEPExpertWeightLayout`` over the
``[2*epn]`` compute views (so ``MoonEPExperts`` and ``overlap.apply`` read
them unchanged) carrying the push arguments; :func:`push_prepare_finalize_class`
is vLLM's prepare/finalize with the push prefetch; :func:`choose_prepare_finalize`
is what the plugin binds in ``all2all_utils`` in place of the class name, so
vLLM builds the push class for a push pool and its own class otherwise.
Quantized layers (INT4 g32, MXFP4, FP8 block) use the push layout of the
store: gate, up and down apart, each with its scale rows padded per expert
to a multiple of 16 KiB (``layout.formats.push_projections``); their weights
travel as uint8 views with their scales in the same call (the release's
kernel contract), and the experts read ``[2*epn]`` views of all six.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ...errors import ConfigError

#: The attribute of a buffer pool that says which MoonEP API its buffers speak ("pull" when absent).
API_ATTR = "moonep_api"
PROJECTIONS = ("gate", "up", "down")


@functools.lru_cache(maxsize=None)
def push_weight_layout_class() -> type:
    """vLLM's ``MoonEPExpertWeightLayout`` with the push arguments (a subclass: vLLM's isinstance checks hold)."""
    from vllm.model_executor.layers.fused_moe.prepare_finalize import moonep as vllm_moonep

    class PushWeightLayout(vllm_moonep.MoonEPExpertWeightLayout):
        """``full_*_weight`` = ``[2*epn, ...]`` compute views (own experts, then slots); ``num_prefetch_slots``
        = ``epn``; :attr:`own_groups` = ``epn`` (where ``overlap.apply`` splits); :meth:`push_arguments` the
        ``local_*_weight`` / ``*_prefetch_buffer`` keywords of the release's ``prefetch_weight``."""

        own_groups: int
        local: dict
        pools: dict

        def push_arguments(self) -> dict[str, torch.Tensor]:
            args = {f"local_{p}_weight": self.local[p] for p in PROJECTIONS}
            args.update({f"{p}_prefetch_buffer": self.pools[p] for p in PROJECTIONS})
            if f"{PROJECTIONS[0]}_scale" in self.local:  # quantized: the scales in the same push
                args.update({f"local_{p}_scale": self.local[f"{p}_scale"] for p in PROJECTIONS})
                args.update({f"{p}_scale_prefetch_buffer": self.pools[f"{p}_scale"] for p in PROJECTIONS})
            return args

    return PushWeightLayout


def make_push_layout(store: Any, idx: int, views: dict[str, torch.Tensor] | None = None) -> Any:
    """The push layout of layer ``idx`` of a :class:`~moonep_ep.vllm.store.sharded.ModelExpertStore` built with
    ``gen_b=True`` (``num_slots = epn``): views only, no copy. BF16: ``full_*_weight`` the ``[2*epn]`` compute
    views. Quantized (``views``: the store's ``named_views``): the gate, up and down weights (as vLLM's
    quantized layout class carries them) and, for the push, every tensor's rows as bytes: weights as uint8
    views (the release's kernel moves bf16, int8 or uint8), scales whole padded rows."""
    s = store.store
    names = PROJECTIONS if views is None else tuple(store.shapes)
    compute = {p: s.push_view(idx, p) for p in PROJECTIONS} if views is None else views
    layout = push_weight_layout_class()(full_gate_weight=compute["gate"], full_up_weight=compute["up"],
                                        full_down_weight=compute["down"], num_prefetch_slots=store.num_slots)
    layout.own_groups = store.experts_per_rank
    as_bytes = (lambda t: t) if views is None else _as_push_bytes
    layout.local = {p: as_bytes(s.owner_view(idx, p)) for p in names}
    layout.pools = {p: as_bytes(s.push_pool(idx, p)) for p in names}
    return layout


def _as_push_bytes(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` (contiguous per expert) as uint8, the last dim in bytes: what the release pushes for quantized
    weights (int32-packed INT4, FP8 e4m3) and for scale rows of any dtype."""
    return rows if rows.dtype == torch.uint8 else rows.view(torch.uint8)


def is_push_layout(layout: Any) -> bool:
    return callable(getattr(layout, "push_arguments", None))


@functools.lru_cache(maxsize=None)
def push_prepare_finalize_class() -> type:
    """vLLM's ``MoonEPPrepareAndFinalize`` with the push API's prepare step (finalize, ``combine`` and the
    ``TopKWeightAndReduceNoOP`` check are vLLM's)."""
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.forward_context import get_forward_context
    from vllm.model_executor.layers.fused_moe.prepare_finalize import moonep as vllm_moonep

    class MoonEPPushPrepareAndFinalize(vllm_moonep.MoonEPPrepareAndFinalize):
        """Pad to the buffer's capacity → ``dispatch`` (``cu_seqlens [2*epn]``) → push prefetch from this
        rank's experts into the peers' slot pools (collective) → the experts over ``[2*epn]`` groups →
        vLLM's ``finalize`` (``combine``)."""

        def prepare(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                    expert_map: Any, apply_router_weight_on_input: bool, quant_config: Any,
                    defer_input_quant: bool = False) -> Any:
            if a1.dtype != torch.bfloat16 or quant_config.quant_dtype is not None:
                raise ConfigError("moonep_ep: MoonEP's push path dispatches bf16 activations only (got "
                                  f"{a1.dtype}, quantized dispatch {quant_config.quant_dtype}). Fix: serve the "
                                  "model in bf16, or MOONEP_EP_MOONEP_API=pull")
            assert num_experts == self.num_global_experts
            assert self._plan is None, "prepare() called again before finalize()"
            if apply_router_weight_on_input:  # top-1 only, weighted before dispatch (as vLLM's prepare)
                assert topk_ids.size(1) == 1, "apply_router_weight_on_input requires top-1 routing"
                a1 = a1 * topk_weights.to(a1.dtype)
            # The capacity must be the same on every rank (dispatch and the push are collectives): vLLM's rule,
            # the largest token count over the DP ranks, the local count outside a forward.
            num_tokens = a1.shape[0]
            try:
                dp_meta = get_forward_context().dp_metadata
            except AssertionError:
                dp_meta = None
            if dp_meta is not None:
                num_tokens = int(dp_meta.num_tokens_across_dp_cpu.max())
            capacity, self._buffer = self.buffer_pool.get(num_tokens)
            # Exactly S tokens: the release's dispatch asserts S*K entries (the plugin's padding may swap
            # self._buffer for a larger capacity, padding.py)
            a1, topk_ids, topk_weights, self._num_tokens = self._pad_to_capacity(a1, topk_ids, topk_weights,
                                                                                 capacity)
            tokens_per_expert = torch.bincount(topk_ids.reshape(-1).to(torch.int64),
                                               minlength=num_experts).to(torch.int32)
            hidden_nvsh, route_weights_nvs, cu_seqlens, plan = self._buffer.dispatch(
                a1, topk_weights, topk_ids, tokens_per_expert)
            self._plan, self._cu_seqlens = plan, cu_seqlens
            layout = self._resolve_weight_layout()
            if not is_push_layout(layout):
                raise ConfigError(f"moonep_ep: the push prepare step got a {type(layout).__name__} ([E+B] pull "
                                  "views); the layer was converted for the pull API. Fix: set the same "
                                  "MOONEP_EP_MOONEP_API for the whole run")
            # Collective: every rank pushes its experts to the slots that need them (the plugin's buffer asks
            # for async_finish and hands the event to the experts, which wait before the first slot row).
            self._buffer.prefetch_weight(plan=plan, **layout.push_arguments())
            expert_num_tokens = torch.diff(cu_seqlens, prepend=cu_seqlens.new_zeros(1))
            meta = mk.ExpertTokensMetadata(expert_num_tokens=expert_num_tokens, expert_num_tokens_cpu=None)
            return hidden_nvsh, None, meta, None, route_weights_nvs

    return MoonEPPushPrepareAndFinalize


def choose_prepare_finalize(vllm_class: type) -> Any:
    """What the plugin binds as ``all2all_utils.MoonEPPrepareAndFinalize``: builds the push class for a pool
    whose buffers speak the push API, vLLM's class otherwise (same arguments)."""

    def build(buffer_pool: Any, *args: Any, **kwargs: Any) -> Any:
        cls = push_prepare_finalize_class() if getattr(buffer_pool, API_ATTR, "pull") == "push" else vllm_class
        return cls(buffer_pool, *args, **kwargs)

    build.__name__ = build.__qualname__ = "MoonEPPrepareAndFinalize"
    return build
