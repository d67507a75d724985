"""Quantized experts in vLLM's engine over the sharded store (compressed-tensors W4A16 INT4 g32, MXFP4
weight-only, and vLLM's FP8 with 128x128 block scales), on the GPU and the CPU engine.

The BF16 path (``store/loading.py``, ``manager.py``) extended to a quantized
method, piece by piece:

1. **Config check**: a scheme in ``schemes.ENGINE_FORMATS`` (``checkpoint/schemes.py``) passes vLLM's
   ``VllmConfig.__post_init__`` (``checkpoint/patches.py`` hides the
   quantization from its one ``moonep`` refusal only; every other rule of
   that block — bf16 dtype, no EPLB, linear placement, eager — still applies).
2. **Backend** (``quantized/hooks.py``): for MoonEP layers vLLM's
   selection points hand back this module's experts class —
   ``select_wna16_moe_backend`` (INT4), ``CompressedTensorsW4A4Mxfp4MoEMethod``'s
   ``__init__`` in place of CUTLASS / Marlin (both repack or swizzle the
   checkpoint layout), ``select_fp8_moe_backend`` (FP8 block, with vLLM's
   weight-only label ``Fp8MoeBackend.CPU``: bf16 activations, as MoonEP
   dispatches them). Which class: :func:`experts_kind`
   (``MOONEP_EP_QUANTIZED_EXPERTS``): ``MoonEPTritonQuantizedExperts`` (the
   formats' Triton grouped GEMMs, ``experts/gpu.py``; the default on GPUs) or
   ``MoonEPQuantizedExperts`` (dequantize the used rows; the default on the
   CPU engine, where vLLM's quantized experts need x86 AMX). Each method
   keeps its own weight-only quant config.
3. **create_weights** runs on ``meta`` (:func:`create_quantized_placeholders`):
   vLLM's parameter names and shapes, no memory; :func:`load_quantized_expert`
   is their ``weight_loader`` and writes each checkpoint tensor into the
   store's owner row (``w1``/``w3`` into the halves of the ``w13`` row,
   weights and scales alike); ``weight_shape`` tensors are checked, not stored.
4. **process_weights_after_loading** (:func:`bind_quantized_layer`): the
   parameters become the store's ``[E+B]`` views, no repack (the CPU experts
   read the checkpoint layout); a residency check fails loudly if any
   parameter does not alias the store; the modular kernel is MoonEP's
   prepare/finalize with :func:`experts_class`.
5. **Prefetch** (:func:`prefetch_quantized`, called by the manager's
   buffer): weights and scales of each planned slot pulled through the
   mapped rows by the plan's device row (no host read), their bytes counted apart when first read
   (:class:`QuantizedFill`); both copies' events
   go to the experts (``overlap.deliver_slot_fill``), whose ``apply`` computes the own groups first, then
   waits on them (``ops.moonep.prefetch.wait_for_slots``), then computes the slot groups (:func:`own_then_slots`,
   the BF16 experts' order: the fill overlaps the own experts' GEMMs).
"""

from __future__ import annotations

import collections.abc
import os
import time
import types
from typing import Any, Callable

import torch

from ... import envs
from ...errors import ConfigError
from ...ops.experts.activation import SILU
from ...ops.moonep.prefetch import wait_for_slots
from ..experts.overlap import SLOT_FILL_HANDOFF, _trace, take_slot_fill

FORMAT_ATTR = "_moonep_ep_format"
#: w1/w3 -> the half of the fused w13 row; w2 -> the whole w2 row
_PART_OF_SHARD = {"w1": 0, "w3": 1, "w2": None}
#: ``id`` of a bound layer's ``[E+B]`` w13 weight view (the tensor object MoonEP's prepare() hands the
#: buffer) -> (format, {name: view}, E); the entry holds the view, so the id stays unique until forgotten
_LAYOUTS: dict[int, tuple[str, dict[str, torch.Tensor], int]] = {}


def method_format(method: Any) -> str | None:
    """The store format of a vLLM MoE method moonep_ep binds on this engine, or None."""
    name = type(method).__name__
    if name == "CompressedTensorsWNA16MoEMethod":
        quant = getattr(method, "weight_quant", None)
        if getattr(method, "num_bits", None) == 4 and getattr(method, "group_size", None) == 32 \
                and getattr(quant, "symmetric", False):
            return "int4-g32"
    if name == "CompressedTensorsW4A4Mxfp4MoEMethod" and getattr(method, "group_size", None) == 32:
        return "mxfp4"  # weight-only by the config check (schemes.classify refuses activation quantization)
    if name == "Fp8MoEMethod" and getattr(method, "block_quant", False) \
            and list(getattr(method, "weight_block_size", None) or ()) == [128, 128]:
        return "fp8-block"  # dynamic activations by the config check; computed weight-only (bf16 inputs)
    return None


# -- 3. construction and loading -----------------------------------------------------------------

def create_quantized_placeholders(create_weights: Callable[..., Any], method: Any, layer: Any, fmt: str,
                                  *args: Any, **kwargs: Any) -> None:
    """vLLM's quantized ``create_weights`` on ``meta``, every expert tensor loaded by :func:`load_quantized_expert`."""
    from ..store.loading import TARGET_DEVICE_ATTR, ZERO_COPY_FLAG

    target = torch.get_default_device()
    with torch.device("meta"):
        create_weights(method, layer, *args, **kwargs)
    loader = types.MethodType(load_quantized_expert, layer)
    for name, param in layer.named_parameters(recurse=False):
        if name.startswith(("w13_", "w2_")):
            param.weight_loader = loader
    setattr(layer, ZERO_COPY_FLAG, True)
    setattr(layer, TARGET_DEVICE_ATTR, target)
    setattr(layer, FORMAT_ATTR, fmt)


def _param_name(layer: Any, param: torch.Tensor, weight_name: str) -> str:
    for name, p in layer.named_parameters(recurse=False):
        if p is param:
            return name
    return weight_name.rsplit(".", 1)[-1]


def load_quantized_expert(layer: Any, param: torch.Tensor, loaded_weight: torch.Tensor, weight_name: str,
                          shard_id: str, expert_id: int, return_success: bool = False) -> bool | None:
    """The ``weight_loader`` of a sharded quantized MoonEP layer (vLLM's expert-loader signature)."""
    from ..store.loading import BINDING_ATTR, layerwise_replay
    from ..observe.stats import STATS

    ok = True if return_success else None
    local = layer._map_global_expert_id_to_local_expert_id(expert_id)
    if local == -1:
        return False if return_success else None
    binding = getattr(layer, BINDING_ATTR, None)
    if binding is None:
        raise ConfigError(f"moonep_ep: MoE layer {layer.layer_name} was built for the sharded MoonEP layout but "
                          "no store was allocated for it. Fix: load the model with vLLM's default loader")
    store, idx = binding
    if layerwise_replay(param, store, idx):
        return ok
    name = _param_name(layer, param, weight_name)
    if name.endswith("_weight_shape"):  # compressed-tensors' [out, in] of the unpacked weight: checked only
        proj = "w13" if name.startswith("w13_") else "w2"
        want = [store.intermediate, store.hidden] if proj == "w13" else [store.hidden, store.intermediate]
        got = [int(v) for v in loaded_weight.flatten().tolist()]
        if got != want:
            store.refuse(f"[rank {store.rank}] {weight_name} (expert {expert_id}, {shard_id}): weight_shape {got} "
                         f"differs from the served {want}. Fix: load a checkpoint of the served model's shapes")
        return ok
    target, part = store.store_target(name, _PART_OF_SHARD.get(shard_id))
    if shard_id not in _PART_OF_SHARD or target not in store.shapes:
        store.refuse(f"[rank {store.rank}] {weight_name}: parameter {name!r} (shard {shard_id!r}) is not one of the "
                     f"{store.format} store's tensors {sorted(store.shapes)}. Fix: serve a checkpoint in one of "
                     "the formats moonep_ep binds, or another --all2all-backend")
        return ok
    STATS.register_loaded_weight(loaded_weight)
    store.write_expert(idx, target, local, loaded_weight, where=weight_name, part=part)
    return ok


# -- 4. after loading ----------------------------------------------------------------------------

def bind_quantized_layer(method: Any, layer: Any) -> None:
    """Replace the method's ``process_weights_after_loading`` for a sharded MoonEP layer (CPU: no repack)."""
    from vllm.model_executor.layers.fused_moe import modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.all2all_utils import maybe_make_prepare_finalize
    from vllm.model_executor.layers.fused_moe.prepare_finalize import moonep as vllm_moonep

    from ..store.loading import BINDING_ATTR

    binding = getattr(layer, BINDING_ATTR, None)
    if binding is None:
        raise ConfigError(f"moonep_ep: quantized MoE layer {getattr(layer, 'layer_name', '?')} has no sharded "
                          "store. Fix: build the model through vLLM's model loader")
    store, idx = binding
    if not store.ready:
        raise ConfigError(f"[rank {store.rank}] moonep_ep: quantized MoE layer {layer.layer_name} is converted "
                          "before its expert weights were loaded. Fix: load a real checkpoint")
    previous = getattr(layer, "_moonep_weight_layout", None)
    # A reload binds again: the same view objects, so the prepare's layout and _LAYOUTS keep their keys.
    views = previous.views if getattr(previous, "views", None) is not None else store.named_views(idx)
    weight = "weight_packed" if store.format != "fp8-block" else "weight"
    scale = "weight_scale" if store.format != "fp8-block" else "weight_scale_inv"
    params = parameter_views(views, weight, scale)
    for name, view in params.items():
        if name in layer._parameters:
            del layer._parameters[name]
        layer.register_parameter(name, torch.nn.Parameter(view, requires_grad=False))
    check_residency(layer, params)
    layer.w13_weight = getattr(layer, f"w13_{weight}")
    layer.w2_weight = getattr(layer, f"w2_{weight}")
    w13 = params[f"w13_{weight}"]
    if store.api == "push":  # the push API: [2*epn] rows, what the push prepare step hands the release's buffer
        from ..prepare_finalize.push import make_push_layout

        layout = make_push_layout(store, idx, views)
    else:
        layout = QuantizedWeightLayout(w13, params[f"w13_{scale}"], params[f"w2_{weight}"], store.num_slots)
    layout.format, layout.views = store.format, views
    layer._moonep_weight_layout = layout
    _LAYOUTS[id(w13)] = (store.format, views, store.num_experts)
    kernel = getattr(method, "moe_kernel", None)
    if kernel is None or not isinstance(kernel.fused_experts, experts_class()):
        method.moe_quant_config = method.get_fused_moe_quant_config(layer)
        prepare_finalize = maybe_make_prepare_finalize(moe=method.moe, quant_config=method.moe_quant_config,
                                                       routing_tables=layer._expert_routing_tables(),
                                                       allow_new_interface=True, use_monolithic=False)
        if not isinstance(prepare_finalize, vllm_moonep.MoonEPPrepareAndFinalize):
            raise ConfigError(f"moonep_ep: quantized MoE layer {layer.layer_name} got "
                              f"{type(prepare_finalize).__name__}, not MoonEP's prepare/finalize. Fix: "
                              "--all2all-backend moonep with expert parallelism over more than one rank")
        experts = experts_class()(moe_config=method.moe, quant_config=method.moe_quant_config)
        method.moe_kernel = mk.FusedMoEKernel(prepare_finalize, experts)
        _record_experts(experts, store.format)
    method.moe_kernel.fused_experts.process_weights_after_loading(layer)
    from ..experts.warmup import register_experts

    register_experts(method.moe_kernel.fused_experts)  # its Triton variants compile at vLLM's warm-up


def _record_experts(experts: Any, fmt: str) -> None:
    """Which experts class serves the quantized layers, and with which kernel (``vllm-demo`` reports it)."""
    from ..experts.gpu import GPU_KERNELS
    from ..observe.stats import STATS

    triton = experts.experts_kind == "triton"
    STATS.set(quantized_experts={"class": type(experts).__name__, "format": fmt,
                                 "kernel": GPU_KERNELS[fmt] if triton else "moonep_ep dequantize + grouped GEMM",
                                 "triton_interpreter": bool(triton and experts.interpreter)})


def parameter_views(views: dict[str, torch.Tensor], weight: str, scale: str) -> dict[str, torch.Tensor]:
    """The layer's expert parameters over the store: vLLM's names and ``[E+B]`` views (pull), or in the push
    layout (gate, up, down apart) ``w13_*`` bound to the gate rows and ``w2_*`` to the down rows, ``[2*epn]``
    (vLLM only passes them through; the experts read every view from the layout)."""
    from ...ops.experts.quantized import is_split

    if not is_split(views):
        return dict(views)
    return {f"w13_{weight}": views["gate"], f"w13_{scale}": views["gate_scale"], f"w2_{weight}": views["down"],
            f"w2_{scale}": views["down_scale"]}


def check_residency(layer: Any, views: dict[str, torch.Tensor]) -> None:
    """Every expert parameter must alias the store's ``[E+B]`` view (no private copy)."""
    private = [name for name, view in views.items()
               if getattr(layer, name).data_ptr() != view.data_ptr() or getattr(layer, name).shape != view.shape]
    if private:
        raise ConfigError(f"moonep_ep: MoE layer {layer.layer_name}: {private} were re-bound to private memory, "
                          "not the sharded store's rows: prefetched slots would never be read. Fix: report this "
                          "(a vLLM conversion re-bound the parameters)")


_LAYOUT_CLS: list[Any] = []
#: experts kind -> its class, built on first use (vLLM's module is imported then)
_EXPERTS_CLS: dict[str, Any] = {}


def _layout_base() -> Any:
    from vllm.model_executor.layers.fused_moe.prepare_finalize.moonep import MoonEPExpertWeightLayout

    return MoonEPExpertWeightLayout


def QuantizedWeightLayout(w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, slots: int) -> Any:
    """vLLM's ``MoonEPExpertWeightLayout`` (its prepare() checks the type) carrying the quantized views."""
    if not _LAYOUT_CLS:
        class _QuantizedLayout(_layout_base()):  # type: ignore[misc]
            """gate/up/down fields hold w13 weight, w13 scale, w2 weight; ``views`` has all four."""

        _LAYOUT_CLS.append(_QuantizedLayout)
    return _LAYOUT_CLS[0](full_gate_weight=w13, full_up_weight=w13_scale, full_down_weight=w2,
                          num_prefetch_slots=slots)


def experts_kind() -> str:
    """``MOONEP_EP_QUANTIZED_EXPERTS`` on this platform: ``triton`` (the formats' Triton grouped GEMMs,
    ``experts/gpu.py``) or ``dequant`` (``ops.experts.quantized``); ``auto`` is triton on CUDA GPUs."""
    choice = envs.MOONEP_EP_QUANTIZED_EXPERTS
    if choice != "auto":
        return choice
    from vllm.platforms import current_platform

    return "triton" if current_platform.is_cuda() else "dequant"


def experts_class(kind: str | None = None) -> Any:
    """MoonEP's experts for quantized ``[E+B]`` views, of ``kind`` (default :func:`experts_kind`)."""
    kind = kind or experts_kind()
    if kind not in _EXPERTS_CLS:
        _EXPERTS_CLS[kind] = _build_experts_class(kind)
    return _EXPERTS_CLS[kind]


def _check_triton_here() -> bool:
    """Whether the Triton kernels run in the interpreter here; refuses when vLLM turned Triton off."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    interpreter = os.environ.get("TRITON_INTERPRET") == "1"
    if not HAS_TRITON or (current_platform.is_cpu() and not interpreter):
        raise ConfigError("moonep_ep: MOONEP_EP_QUANTIZED_EXPERTS=triton, but vLLM has no usable Triton in this "
                          f"process (HAS_TRITON={HAS_TRITON}, TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}"
                          f", platform {current_platform.device_name}). Fix: on GPUs install vLLM's Triton; on the "
                          "CPU engine start through `moonep-ep vllm-demo` or `moonep-ep serve` (they run the "
                          "kernels in Triton's interpreter), or set MOONEP_EP_QUANTIZED_EXPERTS=dequant")
    if interpreter:
        # MoonEP serves bf16, and the interpreter's bf16 dot and downcasts are wrong (docs/design/vllm_experts.md)
        from ...testing.triton_interpreter import mend_interpreter

        mend_interpreter()
    return interpreter


def own_then_slots(experts: Any, layout: Any, output: torch.Tensor, hidden: torch.Tensor, cu_seqlens: torch.Tensor,
                   route: torch.Tensor | None, topk_ids: torch.Tensor, activation: Any, own_groups: int,
                   event: Any, *, one_pass: bool = False) -> None:
    """``output`` = the experts' FFN, in ``overlap.apply``'s order for BF16: the own groups ``[0, own_groups)``
    first (the owners' rows, final before the step), then the wait for the slot fill ``event``, then the slot
    groups, so the fill's copies overlap the own experts' GEMMs. Each part is ``experts.grouped_ffn`` over its
    rows and its weight rows alone: every group is an independent GEMM per row block, so the rows equal one pass
    over all groups, bit for bit (``tests/vllm/test_quantized_own_first.py``). :data:`overlap.TRACE` records
    ``own``, ``waited``, ``slots``.

    The split reads its row on the host (one ``int`` per layer, as ``overlap.apply``), so a decode-sized step
    (``one_pass``: ``overlap.decode_sized``, as the BF16 experts decide) waits, then runs every group in one
    pass (``waited``, ``one pass``) and reads nothing back. Rows at or past the last group are not written
    (MoonEP's combine reads only the rows of dispatched entries, all before it). A part writes its rows of
    ``output`` in place where the experts' ``grouped_ffn`` takes ``out`` (the Triton experts), else one copy."""

    def part(lo: int, hi: Any, groups: slice) -> None:
        rows = types.SimpleNamespace(format=layout.format, views={n: v[groups] for n, v in layout.views.items()})
        cu = cu_seqlens[groups] if lo == 0 else cu_seqlens[groups] - lo
        dst = output[lo:hi]
        got = experts.grouped_ffn(rows, hidden[lo:hi], cu, None if route is None else route[lo:hi], topk_ids,
                                  activation=activation, out=dst)
        if got.data_ptr() != dst.data_ptr():
            dst.copy_(got)

    if one_pass:
        if event is not None:
            wait_for_slots(event)
            _trace("waited")
        part(0, None, slice(None))   # every row and group: nothing is read back
        _trace("one pass")
        return
    own_end, end = (int(x) for x in cu_seqlens[[own_groups - 1, -1]].tolist())
    if own_end:
        part(0, own_end, slice(0, own_groups))
    _trace("own")
    if event is not None:
        wait_for_slots(event)   # the slot rows [own_groups, ...) are read below: weights and scales landed
        _trace("waited")
    if end > own_end:
        part(own_end, end, slice(own_groups, None))
    _trace("slots")


def _build_experts_class(kind: str) -> Any:
    from vllm.model_executor.layers.fused_moe.experts import moonep_experts
    from vllm.model_executor.layers.fused_moe.prepare_finalize.moonep import MOONEP_DEFAULT_TOKEN_PADDING

    if kind not in ("triton", "dequant"):
        raise ConfigError(f"moonep_ep: no quantized experts of kind {kind!r}. Fix: triton or dequant")
    base = moonep_experts.MoonEPExperts

    from ..experts.overlap import WAITS_ATTR

    class _QuantizedExperts(base):  # type: ignore[misc, valid-type]
        experts_kind = kind

        @staticmethod
        def _supports_current_device() -> bool:
            from vllm.platforms import current_platform

            return current_platform.is_cpu() or current_platform.is_cuda()

        @staticmethod
        def _supports_quant_scheme(weight_key: Any, activation_key: Any) -> bool:
            return activation_key is None  # weight-only: bf16 activations, as MoonEP dispatches them

        @staticmethod
        def _supports_activation(activation: Any) -> bool:
            from ..experts.overlap import supports_activation

            return supports_activation(activation)  # SiLU and SiTU (vLLM's MoonEPExperts: SiLU only)

        def moe_problem_size(self, a1: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                             topk_ids: torch.Tensor) -> tuple[int, int, int, int, int]:
            return w1.size(0), a1.size(0), self.moe_config.intermediate_size_per_partition, a1.size(1), \
                topk_ids.size(1)

        def apply(self, output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: Any, global_num_experts: int,
                  expert_map: Any, a1q_scale: Any, a2_scale: Any, workspace13: Any, workspace2: Any,
                  expert_tokens_meta: Any, apply_router_weight_on_input: bool) -> None:
            layout = self._weight_layout
            assert layout is not None and expert_tokens_meta is not None
            from ..experts.activation import activation_of
            from ..observe.stats import STATS

            act = activation_of(activation, self.moe_config)  # SiLU or SiTU with the layer's betas; else refused

            start = time.perf_counter()
            event = take_slot_fill()
            cu_seqlens = torch.cumsum(expert_tokens_meta.expert_num_tokens, dim=0, dtype=torch.int32)
            route = None if apply_router_weight_on_input else topk_weights
            # pull: [E+B] rows, the own part ends at E; push (PushWeightLayout): [2*epn], it ends at epn
            own_groups = int(getattr(layout, "own_groups", global_num_experts))
            own_then_slots(self, layout, output, hidden_states, cu_seqlens, route, topk_ids, act, own_groups, event,
                           one_pass=SLOT_FILL_HANDOFF.take_one_pass())
            STATS.record_experts_call(time.perf_counter() - start, hidden_states.shape[0])

    setattr(_QuantizedExperts, WAITS_ATTR, True)  # apply takes the prefetch's events and waits (overlap.arm)

    class MoonEPQuantizedExperts(_QuantizedExperts):
        """Dequantize the used ``[E+B]`` rows, then a bf16 grouped GEMM (``ops.experts.quantized``; the CPU
        engine's path: vLLM's quantized CPU experts need x86 AMX)."""

        def grouped_ffn(self, layout: Any, hidden: torch.Tensor, cu_seqlens: torch.Tensor, route: Any,
                        topk_ids: torch.Tensor, *, activation: Any = SILU, out: Any = None) -> torch.Tensor:
            """The FFN's rows (a new tensor: ``quantized_grouped_ffn`` takes no ``out``; the caller copies)."""
            from ...ops.experts.quantized import SPLIT_NAMES, is_split, quantized_grouped_ffn, views_of

            if is_split(layout.views):  # the push layout: [2*epn] rows, gate and up apart
                g, gs, u, us, d, ds = (layout.views[n] for n in SPLIT_NAMES)
                return quantized_grouped_ffn(hidden, layout.format, g, gs, d, ds, cu_seqlens, route,
                                             activation=activation, up=(u, us))
            return quantized_grouped_ffn(hidden, layout.format, *views_of(layout.format, layout.views), cu_seqlens,
                                         route, activation=activation)

    class MoonEPTritonQuantizedExperts(_QuantizedExperts):
        """The formats' Triton grouped GEMMs over the ``[E+B]`` views (``experts/gpu.py``: vLLM's INT4 and
        FP8-block MoE kernels, the project's MXFP4 kernel); on the CPU engine, in Triton's interpreter."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.interpreter = _check_triton_here()
            self.token_padding = MOONEP_DEFAULT_TOKEN_PADDING  # what vLLM's MoonEP handle is built with
            self._configs: dict[tuple[str, int, int], dict[str, int]] = {}

        def grouped_ffn(self, layout: Any, hidden: torch.Tensor, cu_seqlens: torch.Tensor, route: Any,
                        topk_ids: torch.Tensor, *, activation: Any = SILU, out: Any = None) -> torch.Tensor:
            """The FFN's rows, written into ``out`` (``[rows, H]``, contiguous) when given."""
            from ..experts.gpu import gpu_grouped_ffn, kernel_config

            # Tiles follow the step's real tokens: topk_ids holds the tokens vLLM routed this step (MoonEP's prepare
            # pads its own copy to the buffer's capacity; this one is not), a shape, no host sync. MoonEP's planner
            # spreads the rows evenly over the ranks, so this rank computes about tokens x top_k rows. Not NvS:
            # it counts the capacity and every group's padding (K2 at EP 12: a 32-token decode step has 9152).
            tokens, top_k = int(topk_ids.size(0)), max(int(topk_ids.size(1)), 1)
            key = (layout.format, tokens, top_k)
            if key not in self._configs:
                self._configs[key] = kernel_config(
                    layout.format, local_experts=self.moe_config.num_local_experts, hidden=hidden.shape[1],
                    intermediate=self.moe_config.intermediate_size_per_partition, tokens=tokens, top_k=top_k,
                    token_padding=self.token_padding, interpreter=self.interpreter)
            # the down GEMM writes the caller's rows in place where they fit its output (contiguous, same dtype)
            fits = out is not None and out.is_contiguous() and out.dtype == hidden.dtype
            into = {"out": out} if fits else {}
            return gpu_grouped_ffn(layout.format, hidden, layout.views, cu_seqlens, route,
                                   token_padding=self.token_padding, config=self._configs[key],
                                   native_act_quant=self.interpreter, activation=activation, **into)

    cls = MoonEPTritonQuantizedExperts if kind == "triton" else MoonEPQuantizedExperts
    cls.__module__ = __name__
    return cls


# -- 5. prefetch ---------------------------------------------------------------------------------

def quantized_views_for(full_gate_weight: Any) -> tuple[str, dict[str, torch.Tensor], int] | None:
    """``(format, {name: [E+B] view}, E)`` when ``full_gate_weight`` is a bound quantized layer's w13 view."""
    if not isinstance(full_gate_weight, torch.Tensor) or full_gate_weight.dtype == torch.bfloat16:
        return None
    entry = _LAYOUTS.get(id(full_gate_weight))
    if entry is None or not any(v is full_gate_weight for v in entry[1].values()):
        return None
    return entry


def forget_layouts() -> None:
    """Drop every bound layer's views (the manager's destroy: the stores close next)."""
    _LAYOUTS.clear()


def prefetch_quantized(views: dict[str, torch.Tensor], row: Any, num_experts: int, rank: int, epn: int
                       ) -> "QuantizedFill":
    """Pull each used slot's weights, then its scales, through the mapped rows. ``row``: this rank's ``[B]``
    row of the plan's slot table, the device tensor (read by the copies only) or host ints. Returns a
    :class:`QuantizedFill`: ``event``, both pulls' events, to wait on (``ops.moonep.prefetch.wait_for_slots``)
    before a slot row is read; the bytes, counted apart when first read."""
    from ...ops.moonep.prefetch import pull_slots

    weights = {n: v for n, v in views.items() if not n.endswith(("_scale", "_scale_inv"))}
    scales = {n: v for n, v in views.items() if n not in weights}
    w_fill = pull_slots(weights, row, num_experts)
    s_fill = pull_slots(scales, row, num_experts)
    return QuantizedFill((w_fill.event, s_fill.event), w_fill, s_fill, rank, epn)


class QuantizedFill(collections.abc.MutableMapping):
    """A quantized fill's ``{"event", "bytes_by_expert", "weight_bytes", "scale_bytes", "remote_weight_bytes",
    "remote_scale_bytes"}`` (the counts also as attributes). The counts are read from the fills' copies of the
    table when one is first asked for: one host read then, outside the MoE op (issue 45)."""

    COUNTS = ("bytes_by_expert", "weight_bytes", "scale_bytes", "remote_weight_bytes", "remote_scale_bytes")

    def __init__(self, event: Any, w_fill: Any, s_fill: Any, rank: int, epn: int) -> None:
        self._data: dict[str, Any] = {"event": event}
        self._pending: Any = (w_fill, s_fill, rank, epn)

    def _count(self) -> None:
        if self._pending is None:
            return
        w_fill, s_fill, rank, epn = self._pending
        w_bytes, s_bytes = w_fill.bytes_by_expert, s_fill.bytes_by_expert
        experts = set(w_bytes) | set(s_bytes)
        remote = [e for e in experts if e // epn != rank]
        self._data.update({
            "bytes_by_expert": {e: w_bytes.get(e, 0) + s_bytes.get(e, 0) for e in experts},
            "weight_bytes": sum(w_bytes.values()), "scale_bytes": sum(s_bytes.values()),
            "remote_weight_bytes": sum(w_bytes.get(e, 0) for e in remote),
            "remote_scale_bytes": sum(s_bytes.get(e, 0) for e in remote)})
        self._pending = None

    def __getitem__(self, key: str) -> Any:
        if key in self.COUNTS:
            self._count()
        return self._data[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._count()
        self._data[key] = value

    def __delitem__(self, key: str) -> None:
        if key in self.COUNTS:
            self._count()
        del self._data[key]

    def __iter__(self) -> Any:
        keys = list(self._data) + ([k for k in self.COUNTS if k not in self._data] if self._pending else [])
        return iter(keys)

    def __len__(self) -> int:
        return len(list(iter(self)))

    def __getattr__(self, name: str) -> Any:
        if name in QuantizedFill.COUNTS:
            return self[name]
        raise AttributeError(name)

    def __reduce__(self) -> tuple:
        """Pickled as a plain dict, counted now."""
        return dict, (dict(self.items()),)
