"""vLLM's ``MoonEPPrepareAndFinalize.prepare`` as the push hook sees it, in the ``vllm==0.33.0`` environment.

    python -m tests.support.push_prepare_check

Prints one JSON object:

* ``vllm``: the source of vLLM's ``prepare`` and ``_resolve_weight_layout`` (``inspect.getsource``) and
  ``prepare``'s parameters (``inspect.signature``), which ``tests/vllm/test_push_prepare.py`` checks against
  the facts ``vllm/prepare_finalize/push.py`` relies on (and mutates, for its positive controls);
* ``push_parameters``: the push class's ``prepare`` parameters (they must be vLLM's);
* ``run``: the push class's ``prepare`` on one process with a recording buffer (no collective): what the
  buffer received (dispatch of exactly ``S`` tokens, the one push ``prefetch_weight`` with the layout's own
  tensors), ``cu_seqlens [2*epn]`` turned into ``2*epn`` counts, the buffer handed back to ``finalize``; the
  refusals (fp16 activations, a pull layout); the runtime guards, each under a stand-in for vLLM's
  ``prepare`` that drifts (no prefetch, no layout resolution, an extra keyword, other tensors);
  :func:`choose_prepare_finalize` by the pool's ``api``.
"""

from __future__ import annotations

import inspect
import json
import sys
import types
from typing import Any

import torch

from tests.support.load_check import error_of

S, K, H, I, R, EPN = 128, 2, 128, 128, 2, 2
E = R * EPN


class RecordingBuffer:
    """A buffer of the push API that records what it is handed (dispatch returns ``cu_seqlens [2*epn]``)."""

    def __init__(self, name: str):
        self.name = name
        self.log: list[Any] = []
        self.prefetched: dict[str, Any] = {}
        self.plan = types.SimpleNamespace(experts_to_copy=torch.full((R, EPN), -1, dtype=torch.int32))
        self._ctx = {"NvS": S * K}

    def dispatch(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 tokens_per_expert: torch.Tensor) -> Any:
        self.log.append(["dispatch", list(a1.shape), list(topk_ids.shape), int(tokens_per_expert.sum())])
        self.dispatched = (topk_ids.clone(), tokens_per_expert.clone())
        counts = torch.tensor([3, 5, 0, 2], dtype=torch.int32)[: 2 * EPN]   # own experts, then the epn slots
        cu = torch.cumsum(counts, 0).to(torch.int32)
        nvs = a1.shape[0] * topk_ids.shape[1]
        return torch.zeros(nvs, a1.shape[1], dtype=a1.dtype), torch.ones(nvs), cu, self.plan

    def prefetch_weight(self, plan: Any = None, async_finish: bool = False, **weights: Any) -> None:
        self.log.append(["prefetch_weight", plan is self.plan, async_finish, sorted(weights)])
        self.prefetched = weights

    def combine(self, plan: Any, hidden_nvsh: torch.Tensor, route_weights_nvs: Any) -> Any:
        self.log.append(["combine", plan is self.plan])
        return torch.ones(S, H, dtype=torch.bfloat16), None, None


class Pool:
    def __init__(self, api: str | None, buffer: RecordingBuffer):
        if api is not None:
            self.api = api
        self.buffer = buffer
        self.max_tokens_per_rank = S

    def get(self, num_tokens: int) -> tuple[int, Any]:
        return S, self.buffer


def push_layout(quantized: bool = False) -> Any:
    from moonep_ep.layout.store import FFN_PROJECTIONS as PROJECTIONS
    from moonep_ep.vllm.prepare_finalize.push import push_weight_layout_class

    def rows(n: int, proj: str) -> torch.Tensor:
        return torch.zeros(n, *((H, I) if proj == "down" else (I, H)), dtype=torch.bfloat16)

    layout = push_weight_layout_class()(full_gate_weight=rows(2 * EPN, "gate"), full_up_weight=rows(2 * EPN, "up"),
                                        full_down_weight=rows(2 * EPN, "down"), num_prefetch_slots=EPN)
    layout.own_groups = EPN
    layout.local = {p: rows(EPN, p) for p in PROJECTIONS}
    layout.pools = {p: torch.zeros(R, *rows(EPN, p).shape, dtype=torch.bfloat16) for p in PROJECTIONS}
    if quantized:
        layout.local.update({f"{p}_scale": torch.zeros(EPN, 16384, dtype=torch.uint8) for p in PROJECTIONS})
        layout.pools.update({f"{p}_scale": torch.zeros(R, EPN, 16384, dtype=torch.uint8) for p in PROJECTIONS})
    return layout


def _params(fn: Any) -> list[list[Any]]:
    return [[p.name, p.kind.name, None if p.default is p.empty else repr(p.default)]
            for p in inspect.signature(fn).parameters.values()]


def _inputs(dtype: torch.dtype = torch.bfloat16, tokens: int = 5) -> tuple:
    gen = torch.Generator().manual_seed(0)
    a1 = torch.randn(tokens, H, generator=gen).to(dtype)
    ids = torch.randint(0, E, (tokens, K), generator=gen, dtype=torch.int32)
    weights = torch.rand(tokens, K, generator=gen)
    return a1, weights, ids, E, None, False, types.SimpleNamespace(quant_dtype=None)




def run() -> dict[str, Any]:
    from vllm.model_executor.layers.fused_moe.prepare_finalize import moonep as vllm_moonep
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP

    from moonep_ep.vllm.prepare_finalize.push import choose_prepare_finalize

    vllm_class = vllm_moonep.MoonEPPrepareAndFinalize
    build = choose_prepare_finalize(vllm_class)
    out: dict[str, Any] = {}

    def make(layout: Any, buffer: RecordingBuffer, api: str | None = "push") -> Any:
        return build(Pool(api, buffer), S, 1, E, weight_layout=layout)

    # -- one step: prepare (vLLM's), the push prefetch, finalize ----------------------------------------
    for quantized in (False, True):
        buf, layout = RecordingBuffer("pool"), push_layout(quantized)
        pf = make(layout, buf)
        a1, w, ids, *rest = _inputs()
        hidden, scale, meta, topk_ids, route = pf.prepare(a1, w, ids, *rest)
        wanted = layout.prefetch_arguments()
        step = {"class": type(pf).__name__, "log": buf.log[:],
                "prefetched_is_layouts": sorted(buf.prefetched) == sorted(wanted)
                and all(buf.prefetched[k] is v for k, v in wanted.items()),
                "groups": int(meta.expert_num_tokens.numel()),
                "counts": [int(x) for x in meta.expert_num_tokens.tolist()],
                "result_shape": [list(hidden.shape), scale, topk_ids, list(route.shape)],
                "buffer_after_prepare_is_the_pools": pf._buffer is buf, "num_tokens": pf._num_tokens}
        output = torch.zeros(5, H, dtype=torch.bfloat16)
        pf.finalize(output, hidden, w, ids, False, TopKWeightAndReduceNoOP())
        step["after_finalize"] = {"log_tail": buf.log[-1], "plan_cleared": pf._plan is None,
                                  "output_rows_from_combine": bool((output == 1).all())}
        out["quantized" if quantized else "bf16"] = step

    # -- the plugin's padding may swap the step's buffer for a larger capacity (prepare_finalize/padding.py) -
    first, swapped = RecordingBuffer("first"), RecordingBuffer("swapped")
    pf = make(push_layout(), first)

    def pad_and_swap(a1: Any, topk_ids: Any, topk_weights: Any, capacity: int) -> Any:
        pf._buffer = swapped
        return vllm_class._pad_to_capacity(pf, a1, topk_ids, topk_weights, capacity)

    pf._pad_to_capacity = pad_and_swap
    pf.prepare(*_inputs())
    out["swapped"] = {"first_log": first.log, "swapped_ops": [e[0] for e in swapped.log],
                      "buffer_after_prepare_is_swapped": pf._buffer is swapped}

    # -- refusals ---------------------------------------------------------------------------------------
    buf = RecordingBuffer("fp16")
    out["fp16"] = {"error": error_of(lambda: make(push_layout(), buf).prepare(*_inputs(torch.float16))),
                   "log": buf.log}
    pull = vllm_moonep.MoonEPExpertWeightLayout(full_gate_weight=torch.zeros(E + 4, I, H),
                                                full_up_weight=torch.zeros(E + 4, I, H),
                                                full_down_weight=torch.zeros(E + 4, H, I), num_prefetch_slots=4)
    buf = RecordingBuffer("pull-layout")
    pf = make(pull, buf)
    out["pull_layout"] = {"error": error_of(lambda: pf.prepare(*_inputs())),
                          "ops": [e[0] for e in buf.log], "buffer_restored": pf._buffer is buf}

    # -- the runtime guards: stand-ins for a vLLM prepare that drifted ----------------------------------
    def keywords(extra: dict[str, Any] | None = None, clone: bool = False, times: int = 1):
        def prepare(self: Any, *args: Any, **kwargs: Any) -> None:
            self._buffer = self.buffer_pool.get(S)[1]
            layout = self._resolve_weight_layout()
            tensors = {k: getattr(layout, k) for k in ("full_gate_weight", "full_up_weight", "full_down_weight")}
            if clone:
                tensors["full_up_weight"] = tensors["full_up_weight"].clone()
            for _ in range(times):
                self._buffer.prefetch_weight(plan=None, **tensors, **(extra or {}))
        return prepare

    def no_prefetch(self: Any, *args: Any, **kwargs: Any) -> None:
        self._buffer = self.buffer_pool.get(S)[1]
        self._resolve_weight_layout()

    def no_resolution(self: Any, *args: Any, **kwargs: Any) -> None:
        self._buffer = self.buffer_pool.get(S)[1]

    drifted = {"as_vllm_calls_it": keywords(), "no_prefetch": no_prefetch, "no_layout_resolution": no_resolution,
               "extra_keyword": keywords({"async_finish": True}), "other_tensors": keywords(clone=True),
               "two_prefetches": keywords(times=2)}
    original = vllm_class.prepare
    guards = {}
    try:
        for name, stand_in in drifted.items():
            vllm_class.prepare = stand_in
            buf = RecordingBuffer(name)
            pf = make(push_layout(), buf)
            guards[name] = {"error": error_of(lambda: pf.prepare(*_inputs())),
                            "prefetches": sum(e[0] == "prefetch_weight" for e in buf.log),
                            "buffer_restored": pf._buffer is buf}
    finally:
        vllm_class.prepare = original
    out["guards"] = guards

    # -- which class the pool's api builds ----------------------------------------------------------------
    out["chosen"] = {str(api): type(make(push_layout(), RecordingBuffer("c"), api)).__name__
                     for api in ("push", "pull", None)}
    legacy = Pool(None, RecordingBuffer("legacy"))
    legacy.moonep_api = "push"   # the attribute's former name: no longer read
    out["chosen"]["moonep_api=push"] = type(build(legacy, S, 1, E)).__name__
    out["counting"] = counting(vllm_moonep, make)
    return out


def counting(vllm_moonep: Any, make: Any) -> dict[str, Any]:
    """vLLM's ``prepare`` before and after the plugin's ``counting.count_on_device``: which aten ops count the
    experts (``bincount`` reads its maximum back to the host; the scatter-add does not), and the counts MoonEP's
    dispatch receives against ``torch.bincount`` of the ids it receives."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from moonep_ep.vllm.prepare_finalize.counting import TORCH_COUNTING_ON_DEVICE, count_on_device

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: set[str] = set()

        def __torch_dispatch__(self, func: Any, types_: Any, args: tuple = (), kwargs: Any = None) -> Any:
            self.names.add(str(func.overloadpacket.__name__))
            return func(*args, **(kwargs or {}))

    def step() -> dict[str, Any]:
        buf = RecordingBuffer("counting")
        pf = make(push_layout(), buf)
        ops = Ops()
        with ops:
            pf.prepare(*_inputs(tokens=7))
        ids, tpe = buf.dispatched
        want = torch.bincount(ids.reshape(-1).to(torch.int64), minlength=E).to(torch.int32)
        return {"bincount_ran": "bincount" in ops.names, "index_add_ran": bool({"index_add", "index_add_"} & ops.names),
                "counts_equal_bincount": bool(torch.equal(tpe, want)), "dtype": str(tpe.dtype),
                "counts": [int(x) for x in tpe.tolist()]}

    original = vllm_moonep.torch
    result = {"before": step(), "patched_now": count_on_device(vllm_moonep)}
    try:
        result["after"] = step()
        result["patched_twice"] = count_on_device(vllm_moonep)
        result["module_torch_is_the_counting_one"] = vllm_moonep.torch is TORCH_COUNTING_ON_DEVICE
    finally:
        vllm_moonep.torch = original
    return result


def collect() -> dict[str, Any]:
    from vllm.model_executor.layers.fused_moe.prepare_finalize import moonep as vllm_moonep

    from moonep_ep.vllm.prepare_finalize.push import push_prepare_finalize_class

    cls = vllm_moonep.MoonEPPrepareAndFinalize
    return {"vllm": {"prepare": inspect.getsource(cls.prepare),
                     "_resolve_weight_layout": inspect.getsource(cls._resolve_weight_layout),
                     "parameters": _params(cls.prepare)},
            "push_parameters": _params(push_prepare_finalize_class().prepare),
            "run": run()}


if __name__ == "__main__":
    json.dump(collect(), sys.stdout, default=str)
    print()
