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
them unchanged) carrying the push arguments (:meth:`prefetch_arguments`).
:func:`push_prepare_finalize_class` runs vLLM's own ``prepare``, unchanged,
with one hook: the layout it resolves must be a :class:`PushWeightLayout`,
and the ``prefetch_weight`` call that follows goes through
:class:`PushPrefetch`, which hands the buffer the layout's push arguments in
place of the ``full_*_weight`` keywords vLLM passes. Everything else (the
padding to ``S``, ``dispatch``, ``cu_seqlens`` turned into per-group counts,
which holds for ``[2*epn]`` as for ``[E+B]``, ``finalize``) is vLLM's code.
``tests/vllm/test_push_prepare.py`` pins the shape of vLLM's ``prepare`` the
hook relies on. :func:`choose_prepare_finalize` is what the plugin binds in
``all2all_utils`` in place of the class name, so vLLM builds the push class
for a push pool and its own class otherwise.

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
from ...layout.store import FFN_PROJECTIONS

#: The attribute of a buffer pool that says which MoonEP API its buffers speak ("pull" when absent).
API_ATTR = "api"
#: The keywords vLLM 0.33.0's prepare passes to ``prefetch_weight`` besides ``plan``: the layout's tensors.
PULL_KEYWORDS = tuple(f"full_{p}_weight" for p in FFN_PROJECTIONS)


@functools.lru_cache(maxsize=None)
def push_weight_layout_class() -> type:
    """vLLM's ``MoonEPExpertWeightLayout`` with the push arguments (a subclass: vLLM's isinstance checks hold)."""
    from vllm.model_executor.layers.fused_moe.prepare_finalize import moonep as vllm_moonep

    class PushWeightLayout(vllm_moonep.MoonEPExpertWeightLayout):
        """``full_*_weight`` = ``[2*epn, ...]`` compute views (own experts, then slots); ``num_prefetch_slots``
        = ``epn``; :attr:`own_groups` = ``epn`` (where ``overlap.apply`` splits); :meth:`prefetch_arguments`
        the ``local_*_weight`` / ``*_prefetch_buffer`` keywords of the release's ``prefetch_weight``."""

        own_groups: int
        local: dict
        pools: dict

        def prefetch_arguments(self) -> dict[str, torch.Tensor]:
            """The push ``prefetch_weight``'s tensors (``plan`` apart): each rank's own rows and the slot pools;
            quantized layouts add their scales, pushed in the same call."""
            args = {f"local_{p}_weight": self.local[p] for p in FFN_PROJECTIONS}
            args.update({f"{p}_prefetch_buffer": self.pools[p] for p in FFN_PROJECTIONS})
            if f"{FFN_PROJECTIONS[0]}_scale" in self.local:  # quantized: the scales in the same push
                args.update({f"local_{p}_scale": self.local[f"{p}_scale"] for p in FFN_PROJECTIONS})
                args.update({f"{p}_scale_prefetch_buffer": self.pools[f"{p}_scale"] for p in FFN_PROJECTIONS})
            return args

    return PushWeightLayout


def make_push_layout(store: Any, idx: int, views: dict[str, torch.Tensor] | None = None) -> Any:
    """The push layout of layer ``idx`` of a :class:`~moonep_ep.vllm.store.sharded.ModelExpertStore` built for
    the push API (``num_slots = epn``): views only, no copy. BF16: ``full_*_weight`` the ``[2*epn]`` compute
    views. Quantized (``views``: the store's ``named_views``): the gate, up and down weights (as vLLM's
    quantized layout class carries them) and, for the push, every tensor's rows as bytes: weights as uint8
    views (the release's kernel moves bf16, int8 or uint8), scales whole padded rows."""
    s = store.store
    names = FFN_PROJECTIONS if views is None else tuple(store.shapes)
    compute = {p: s.push_view(idx, p) for p in FFN_PROJECTIONS} if views is None else views
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


#: What a drift of vLLM's prepare away from the shape the hook relies on tells the reader to re-check.
RECHECK = ("vLLM's MoonEPPrepareAndFinalize.prepare no longer has the shape the push hook relies on (one "
           "self._buffer.prefetch_weight(plan=, full_gate_weight=, full_up_weight=, full_down_weight=) call, "
           "with the tensors of the layout that self._resolve_weight_layout() returned just before). Fix: "
           "re-check src/moonep_ep/vllm/prepare_finalize/push.py against vLLM's prepare "
           "(tests/vllm/test_push_prepare.py pins the facts), or MOONEP_EP_MOONEP_API=pull")


class PushPrefetch:
    """The step's buffer as vLLM's prepare sees it from the layout's resolution to its ``prefetch_weight``
    call: that call (the pull keywords, the layout's own tensors, nothing else) becomes the push call with
    :meth:`PushWeightLayout.prefetch_arguments`; any other attribute is the buffer's."""

    def __init__(self, inner: Any, layout: Any):
        self.inner = inner
        self.layout = layout
        self.calls = 0

    def prefetch_weight(self, plan: Any = None, **pull: Any) -> Any:
        expected = {name: getattr(self.layout, name) for name in PULL_KEYWORDS}
        if sorted(pull) != sorted(expected) or any(pull[k] is not v for k, v in expected.items()):
            raise RuntimeError(f"moonep_ep: {RECHECK}. Got prefetch_weight keywords {sorted(pull)}")
        self.calls += 1
        # Collective: every rank pushes its experts to the slots that need them (the plugin's buffer asks for
        # async_finish and hands the event to the experts, which wait before the first slot row).
        return self.inner.prefetch_weight(plan=plan, **self.layout.prefetch_arguments())

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "layout", "calls"):   # not set yet (copy, pickle): no recursion through inner
            raise AttributeError(name)
        return getattr(self.inner, name)


@functools.lru_cache(maxsize=None)
def push_prepare_finalize_class() -> type:
    """vLLM's ``MoonEPPrepareAndFinalize`` whose ``prepare`` (vLLM's own) prefetches through the push API;
    finalize, ``combine`` and the ``TopKWeightAndReduceNoOP`` check are vLLM's too."""
    from vllm.model_executor.layers.fused_moe.prepare_finalize import moonep as vllm_moonep

    push_layout = push_weight_layout_class()

    class MoonEPPushPrepareAndFinalize(vllm_moonep.MoonEPPrepareAndFinalize):
        """Pad to the buffer's capacity → ``dispatch`` (``cu_seqlens [2*epn]``) → push prefetch from this
        rank's experts into the peers' slot pools (collective) → the experts over ``[2*epn]`` groups →
        vLLM's ``finalize`` (``combine``)."""

        _push_armed = False                  # True inside prepare: the layout's resolution arms the hook
        _push_prefetch: Any = None           # this step's PushPrefetch

        def prepare(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                    expert_map: Any, apply_router_weight_on_input: bool, quant_config: Any,
                    defer_input_quant: bool = False) -> Any:
            # vLLM refuses these too (NotImplementedError, "PoC"); this names the push path and the fix
            if a1.dtype != torch.bfloat16 or quant_config.quant_dtype is not None:
                raise ConfigError("moonep_ep: MoonEP's push path dispatches bf16 activations only (got "
                                  f"{a1.dtype}, quantized dispatch {quant_config.quant_dtype}). Fix: serve the "
                                  "model in bf16, or MOONEP_EP_MOONEP_API=pull")
            self._push_armed, self._push_prefetch = True, None
            try:
                result = super().prepare(a1, topk_weights, topk_ids, num_experts, expert_map,
                                         apply_router_weight_on_input, quant_config, defer_input_quant)
            finally:
                step, self._push_armed, self._push_prefetch = self._push_prefetch, False, None
                if step is not None and self._buffer is step:
                    self._buffer = step.inner   # finalize's combine and the plugin's readers get the buffer
            if step is None or step.calls != 1:
                raise RuntimeError(f"moonep_ep: {RECHECK}. The hook saw "
                                   f"{'no layout resolution' if step is None else f'{step.calls} prefetch calls'}")
            return result

        def _resolve_weight_layout(self) -> Any:
            layout = super()._resolve_weight_layout()
            if not isinstance(layout, push_layout):
                raise ConfigError(f"moonep_ep: the push prepare step got a {type(layout).__name__} ([E+B] pull "
                                  "views); the layer was converted for the pull API. Fix: set the same "
                                  "MOONEP_EP_MOONEP_API for the whole run")
            if self._push_armed and self._push_prefetch is None:
                # vLLM's next statement is self._buffer.prefetch_weight(...): the step's buffer (after the
                # pool's choice and the plugin's padding, which may swap it) seen through the push hook
                self._buffer = self._push_prefetch = PushPrefetch(self._buffer, layout)
            return layout

    return MoonEPPushPrepareAndFinalize


def choose_prepare_finalize(vllm_class: type) -> Any:
    """What the plugin binds as ``all2all_utils.MoonEPPrepareAndFinalize``: builds the push class for a pool
    whose buffers speak the push API, vLLM's class otherwise (same arguments)."""

    def build(buffer_pool: Any, *args: Any, **kwargs: Any) -> Any:
        cls = push_prepare_finalize_class() if getattr(buffer_pool, API_ATTR, "pull") == "push" else vllm_class
        return cls(buffer_pool, *args, **kwargs)

    build.__name__ = build.__qualname__ = "MoonEPPrepareAndFinalize"
    return build
