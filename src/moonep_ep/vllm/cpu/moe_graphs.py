"""The CPU engine's MoonEP MoE step captured and replayed by the capture-and-replay emulator (issue 46).

``-cc.cudagraph_mode=FULL_DECODE_ONLY`` (or another mode with full graphs; ``vllm/graphs.py`` then sets
``MOONEP_EP_CPU_MOE_GRAPHS=1``, with ``MOONEP_EP_CPU=1``): the CPU engine cannot capture CUDA graphs, so each
MoonEP layer's modular kernel (``FusedMoEKernelModularImpl.apply``: padding, dispatch, prefetch, experts,
combine) runs under ``moonep_ep.testing.cuda_capture`` at decode-sized steps, as a full decode graph would hold
it: at the first such step of each buffer capacity ``S`` the layer's step is warmed up, captured on static
input buffers of ``S`` rows, and replayed; every later step of that capacity copies its inputs into the static
buffers (the rows past the rank's tokens are padding: zero hidden rows, invalid ids with zero weight, which the
plugin's padding maps to the rank's own experts) and replays. The outputs are the replay's rows of the rank's
tokens, copied out. A capture refuses, at the offending call, what CUDA graph capture refuses (a host read, a
host wait, memory made outside the graph's pool), and anything the capture baked in shows in the tokens, which
the oracle judges.

Every decision here is one every DP rank takes alike, because a capture runs the step's collectives once more
than a replay: the step is decode-sized by the most real tokens of any DP rank (vLLM's DP metadata, host
values every rank holds), and ``S`` is the pool's capacity for that count. Prefill-sized steps run eager: their
own/slot split reads the split back to the host (``experts/overlap.decode_sized``).

Counts go to ``STATS.data["forward"]["moe_graph"]``: captures, replays, eager calls, and the host reads made
during replays (``host_syncs``, counted by ``moonep_ep.testing.host_syncs``); ``vllm-demo --json`` reports them
as ``moe_graph``.
"""

from __future__ import annotations

import inspect
import threading
from types import ModuleType
from typing import Any

from ... import envs
from ..hooks import Install, Mark, Note, Patch, wrapped_with

__all__ = ["PATCHES", "MODE", "enabled"]

MOD_MODULAR_KERNEL = "vllm.model_executor.layers.fused_moe.modular_kernel"
MODE = "emulated full decode graph of the MoE step (moonep_ep.testing.cuda_capture)"
_MARK = "_moonep_ep_moe_graphs"
_ATTR = "_moonep_ep_moe_graphs"   # on a layer's modular kernel: {capacity: _SizeGraph}
_lock = threading.Lock()


def enabled() -> bool:
    return envs.MOONEP_EP_CPU and envs.MOONEP_EP_CPU_MOE_GRAPHS


class _SizeGraph:
    """One layer's step at one capacity: the recording, its static inputs (``S`` rows) and its outputs."""

    def __init__(self, graph: Any, statics: dict[str, Any], outputs: Any) -> None:
        self.graph, self.statics, self.outputs = graph, statics, outputs


def _step_tokens(hidden_states: Any) -> int:
    """The most real tokens of any DP rank this step (vLLM's host-side DP metadata), else this rank's."""
    try:
        from vllm.forward_context import get_forward_context

        meta = get_forward_context().dp_metadata
    except (AssertionError, ImportError):
        meta = None
    if meta is None:
        return int(hidden_states.shape[0])
    return int(meta.num_tokens_across_dp_cpu.max())


def _record(**counts: int) -> None:
    from ..observe.stats import STATS, _lock as stats_lock

    with stats_lock:
        entry = STATS.data["forward"].setdefault("moe_graph", {"mode": MODE, "captures": 0, "replays": 0,
                                                                "eager_calls": 0, "host_syncs": 0,
                                                                "capacities": []})
        for key, n in counts.items():
            if key == "capacity":
                if n not in entry["capacities"]:
                    entry["capacities"].append(n)
            else:
                entry[key] += n


def _padded(t: Any, rows: int, fill: float) -> Any:
    import torch

    out = torch.full((rows, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
    out[:t.shape[0]].copy_(t)
    return out


def _run(impl: Any, orig: Any, hidden_states: Any, w1: Any, w2: Any, topk_ids: Any, topk_weights: Any,
         rest: dict[str, Any], capacity: int) -> Any:
    """The step at ``capacity``: captured the first time (after one eager warm-up), replayed every time."""
    import torch
    from torch.utils._pytree import tree_map

    from ...testing.cuda_capture import CapturedGraph
    from ...testing.host_syncs import HostSyncs

    M = int(hidden_states.shape[0])
    graphs = impl.__dict__.setdefault(_ATTR, {})
    entry = graphs.get(capacity)
    shared_input = rest.get("shared_experts_input")
    if entry is None:
        statics = {"hidden_states": _padded(hidden_states, capacity, 0.0),
                   "topk_ids": _padded(topk_ids, capacity, -1), "topk_weights": _padded(topk_weights, capacity, 0.0)}
        if isinstance(shared_input, torch.Tensor):
            statics["shared_experts_input"] = _padded(shared_input, capacity, 0.0)

        kwargs = dict(rest)
        if "shared_experts_input" in statics:
            kwargs["shared_experts_input"] = statics["shared_experts_input"]

        def step() -> Any:
            return orig(impl, statics["hidden_states"], w1, w2, statics["topk_ids"], statics["topk_weights"],
                        **kwargs)

        step()   # warm-up, as vLLM runs before it captures: anything made at a first call is made now
        graph = CapturedGraph()
        with graph.capture():
            outputs = step()
        entry = graphs[capacity] = _SizeGraph(graph, statics, outputs)
        _record(captures=1, capacity=capacity)
    statics = entry.statics
    statics["hidden_states"].zero_()[:M].copy_(hidden_states)
    statics["topk_ids"].fill_(-1)[:M].copy_(topk_ids)
    statics["topk_weights"].zero_()[:M].copy_(topk_weights)
    if "shared_experts_input" in statics:
        statics["shared_experts_input"].zero_()[:M].copy_(shared_input)
    reads = HostSyncs(cpu_is_device=True)
    with reads:
        entry.graph.replay()
    _record(replays=1, host_syncs=reads.total)
    return tree_map(lambda t: t[:M].clone() if isinstance(t, torch.Tensor) else t, entry.outputs)


#: experts that read the group sizes back to the host by design (CPU only: they dequantize only the rows a step
#: uses, ``ops/experts/grouped.group_bounds``), so no capture can hold them
_HOST_READING_EXPERTS = {"MoonEPQuantizedExperts": "MOONEP_EP_QUANTIZED_EXPERTS=triton (the GPU experts' Triton "
                                                   "kernels, interpreted on CPU)"}


def _refuse_host_reading_experts(impl: Any, manager: Any) -> None:
    """Before any collective of the step, on every rank alike (every rank runs the same experts class)."""
    name = type(getattr(impl, "fused_experts", None)).__name__
    if name in _HOST_READING_EXPERTS:
        from ...errors import ConfigError

        rank = getattr(manager, "rank", "?")
        raise ConfigError(f"[rank {rank}] moonep_ep: MOONEP_EP_CPU_MOE_GRAPHS=1, but this layer's experts ({name}) "
                          "read their group sizes back to the host, which no CUDA graph capture holds. Fix: "
                          f"{_HOST_READING_EXPERTS[name]}, or leave MOONEP_EP_CPU_MOE_GRAPHS unset")


def graph_moe_steps(module: ModuleType, *, install: Install, mark: Mark, note: Note) -> None:
    """``FusedMoEKernelModularImpl.apply``: a MoonEP layer's decode-sized step captured and replayed."""
    cls = getattr(module, "FusedMoEKernelModularImpl", None)
    orig = getattr(cls, "apply", None)
    if not envs.MOONEP_EP_CPU or orig is None or wrapped_with(orig, _MARK):
        return

    signature = inspect.signature(orig)

    def apply(self: Any, *args: Any, **kwargs: Any) -> Any:
        pf = getattr(self, "prepare_finalize", None)
        pool = getattr(pf, "buffer_pool", None)
        # read at each step: the engine's own config sets it (-cc.cudagraph_mode, vllm/graphs.py) after this
        # patch is in place
        if not enabled() or "MoonEP" not in type(pf).__name__ or pool is None:
            return orig(self, *args, **kwargs)
        from ..experts.overlap import decode_sized

        bound = signature.bind(self, *args, **kwargs).arguments
        bound.pop("self")
        hidden_states = bound.pop("hidden_states")
        tokens = _step_tokens(hidden_states)
        manager = getattr(pool, "_manager", None)
        if not decode_sized(tokens, getattr(manager, "vllm_config", None)):
            _record(eager_calls=1)
            return orig(self, *args, **kwargs)
        _refuse_host_reading_experts(self, manager)
        w1, w2, ids, weights = (bound.pop(k) for k in ("w1", "w2", "topk_ids", "topk_weights"))
        with _lock:
            return _run(self, orig, hidden_states, w1, w2, ids, weights, bound, pool.capacity_for(tokens))

    setattr(apply, _MARK, True)
    install(cls, "apply", apply, orig, "modular_kernel.FusedMoEKernelModularImpl.apply (MoE step graphs, emulated)")


#: Applied by the plugin on the CPU engine (the setting is read at each step), before ``observe/host_syncs.py``'s
#: counter (which then wraps this, so it counts the reads of a capture and of a replay as the MoE op's).
PATCHES: tuple[Patch, ...] = (Patch(MOD_MODULAR_KERNEL, graph_moe_steps),)
