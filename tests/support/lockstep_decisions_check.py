"""Two EP ranks build the MoonEP all2all manager, each with its own settings (``test_lockstep_decisions.py``).

Every case sets its variables on each rank, builds ``ShardedMoonEPAll2AllManager`` over the default gloo
group and records what came of it: ``["ok", decisions]`` or ``[error type, message]``. After the cases every
rank meets the others once more ("after"): a rank left waiting in a collective would time out there.

``stand_ins=True`` (the main environment, no vLLM) puts stand-ins under the vLLM names ``manager.py``
imports (``tests/support/vllm_stubs.py`` explains the idea): the base class's ``__init__`` keeps the group's
rank and size, as vLLM's does. ``stand_ins=False`` runs over vLLM 0.33.0 itself (its environment has no
pytest, so this module imports none); there vLLM's base ``__init__`` needs vLLM's parallel state, which
these ranks do not build: a case whose ranks agreed gets that far and fails there.

``python -m tests.support.lockstep_decisions_check`` runs the vLLM 0.33.0 tier and prints its JSON.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import types
from typing import Any

#: Not a variable: vLLM's ``scheduler_config.max_num_batched_tokens`` on that rank (the pool's largest capacity).
MAX_TOKENS = "max_num_batched_tokens"
DEFAULT_MAX_TOKENS = 8192

#: ``name: (rank 0's settings, rank 1's settings)``; each case starts from none of these variables set.
CASES: dict[str, tuple[dict[str, str], dict[str, str]]] = {
    "same_defaults": ({}, {}),
    "padding_differs": ({"MOONEP_EP_PADDING": "balanced"}, {"MOONEP_EP_PADDING": "own"}),
    "padding_same": ({"MOONEP_EP_PADDING": "own"}, {"MOONEP_EP_PADDING": "own"}),
    "api_differs": ({"MOONEP_EP_MOONEP_API": "pull"}, {"MOONEP_EP_MOONEP_API": "push"}),
    "api_same": ({"MOONEP_EP_MOONEP_API": "push"}, {"MOONEP_EP_MOONEP_API": "push"}),
    # auto keeps pull on the reference buffer: the same API, however it was asked for.
    "api_same_decision": ({"MOONEP_EP_MOONEP_API": "auto"}, {"MOONEP_EP_MOONEP_API": "pull"}),
    "tflops_differs": ({}, {"MOONEP_EP_COST_TFLOPS": "500"}),
    "tflops_same": ({"MOONEP_EP_COST_TFLOPS": "500"}, {"MOONEP_EP_COST_TFLOPS": "500"}),
    "profile_differs": ({"MOONEP_EP_GPU_PROFILE": "h100"}, {"MOONEP_EP_GPU_PROFILE": "h200"}),
    "profile_same": ({"MOONEP_EP_GPU_PROFILE": "h100"}, {"MOONEP_EP_GPU_PROFILE": "h100"}),
    # CPU ranks: auto applies no cost model, a named profile does.
    "applies_differs": ({"MOONEP_EP_GPU_PROFILE": "h200"}, {}),
    "layout_differs": ({"MOONEP_EP_LAYOUT": "sharded"}, {"MOONEP_EP_LAYOUT": "replicated"}),
    "max_tokens_differs": ({MAX_TOKENS: "2048"}, {MAX_TOKENS: "4096"}),
    "two_differ": ({"MOONEP_EP_PADDING": "vllm", "MOONEP_EP_MOONEP_API": "push"}, {}),
    "bad_value_on_rank_1": ({}, {"MOONEP_EP_PADDING": "sideways"}),
    "bad_api_on_rank_1": ({}, {"MOONEP_EP_MOONEP_API": "gen_b"}),
}
VARIABLES = sorted({k for pair in CASES.values() for s in pair for k in s if k != MAX_TOKENS}
                   | {"MOONEP_EP_BUFFER", "MOONEP_EP_COST_LINK_GBPS", "MOONEP_EP_COST_HBM_GBPS",
                      "MOONEP_EP_COST_EXPERT_BYTES", "MOONEP_EP_VLLM_STATS_DIR"})


def _config(max_tokens: int) -> Any:
    return types.SimpleNamespace(scheduler_config=types.SimpleNamespace(max_num_batched_tokens=max_tokens),
                                 model_config=types.SimpleNamespace(enable_sleep_mode=False))


def install_vllm_stand_ins() -> None:
    """The vLLM names ``manager.py`` imports, in ``sys.modules`` of this rank process."""

    class All2AllManagerBase:
        def __init__(self, cpu_group: Any, tcp_store_group: Any = None):
            self.cpu_group, self.tcp_store_group = cpu_group, tcp_store_group
            self.rank, self.world_size = cpu_group.rank(), cpu_group.size()

    class MoonEPAll2AllManager(All2AllManagerBase):
        pass

    class MoonEPBufferPool:
        def __init__(self, buffer_kwargs: dict, max_tokens_per_rank: int):
            self._kwargs = {k: v for k, v in buffer_kwargs.items() if k != "S"}
            self.max_tokens_per_rank, self._buffers = max_tokens_per_rank, {}

    base = "vllm.distributed.device_communicators"
    fused = "vllm.model_executor.layers.fused_moe"
    modules = {
        "vllm": {}, "vllm.distributed": {}, base: {},
        f"{base}.all2all": {"MoonEPAll2AllManager": MoonEPAll2AllManager},
        f"{base}.base_device_communicator": {"All2AllManagerBase": All2AllManagerBase, "Cache": dict},
        "vllm.model_executor": {}, "vllm.model_executor.layers": {}, fused: {}, f"{fused}.prepare_finalize": {},
        f"{fused}.prepare_finalize.moonep": {"MoonEPBufferPool": MoonEPBufferPool,
                                             "MOONEP_DEFAULT_NUM_PREFETCH_SLOTS": 8},
        "vllm.platforms": {"current_platform": types.SimpleNamespace(is_cuda_alike=lambda: False)},
        "vllm.utils": {}, "vllm.utils.gc_utils": {"freeze_gc_heap": lambda: None},
        "vllm.config": {"get_current_vllm_config_or_none": lambda: None},
    }
    made = {}
    for name, attrs in modules.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        made[name] = sys.modules[name] = module
    for name, module in made.items():
        parent, _, leaf = name.rpartition(".")
        if parent in made:
            setattr(made[parent], leaf, module)


def _outcome(fn: Any) -> list:
    try:
        return ["ok", fn()]
    except Exception as exc:  # noqa: BLE001 - the kind and message are what the test compares
        return [type(exc).__name__, str(exc)]


def manager_cases(ctx: Any, stand_ins: bool = True) -> dict[str, Any]:
    """Every case of :data:`CASES` on this rank, then the hot path (stand-ins only), then one more meeting."""
    import torch.distributed as dist

    if stand_ins:
        install_vllm_stand_ins()
    import vllm.config

    from moonep_ep.memory.group import GroupComm
    from moonep_ep.vllm.manager import ShardedMoonEPAll2AllManager

    out: dict[str, Any] = {}
    for name, pair in CASES.items():
        mine = dict(pair[ctx.rank])
        max_tokens = int(mine.pop(MAX_TOKENS, DEFAULT_MAX_TOKENS))
        vllm.config.get_current_vllm_config_or_none = lambda: _config(max_tokens)
        for var in VARIABLES:
            os.environ.pop(var, None)
        os.environ.update(mine)
        out[name] = _outcome(lambda: dataclasses.asdict(ShardedMoonEPAll2AllManager(dist.group.WORLD).decisions))
    for var in VARIABLES:
        os.environ.pop(var, None)
    if stand_ins:
        out["hot_path"] = _outcome(lambda: hot_path(ctx, ShardedMoonEPAll2AllManager))
    out["after"] = GroupComm().all_gather_object(ctx.rank, "still in step")  # nobody hung or fell out of step
    return out


def hot_path(ctx: Any, manager_cls: Any) -> dict[str, Any]:
    """Both ranks agree (balanced padding, the h200 profile), then rank 1 changes both settings; the prepare
    step's padding (a real all-gather of the loads) and its capacity must still follow the agreement.

    2 ranks x 24 tokens x K=2 all on rank 0's experts: 96 entries over S*K = 64 at S = 32. Agreed (h200, no
    override): 64 extra rows cost less than moving one expert, so the step runs at S = 64. Rank 1's late
    ``MOONEP_EP_COST_TFLOPS=0.001`` would price those rows above the copy (it would stay at 32), and its
    late ``MOONEP_EP_PADDING=own`` would skip the all-gather."""
    import torch
    import torch.distributed as dist

    from moonep_ep.vllm.prepare_finalize import padding

    os.environ["MOONEP_EP_GPU_PROFILE"] = "h200"
    os.environ["MOONEP_EP_PADDING"] = "balanced"
    manager = manager_cls(dist.group.WORLD)
    if ctx.rank == 1:
        os.environ["MOONEP_EP_COST_TFLOPS"] = "0.001"
        os.environ["MOONEP_EP_PADDING"] = "own"
    E, K, H, n = 8, 2, 128, 24
    swapped: list[int] = []

    def get(capacity: int) -> tuple[int, str]:
        swapped.append(capacity)
        return capacity, f"buffer S={capacity}"

    layout = types.SimpleNamespace(full_gate_weight=torch.empty(E + 4, 256, H, dtype=torch.bfloat16, device="meta"))
    pool = types.SimpleNamespace(_manager=manager, max_tokens_per_rank=1024, get=get)
    layer = types.SimpleNamespace(num_global_experts=E, buffer_pool=pool, weight_layout=layout, _buffer="buffer S=32")

    def vllm_padding(*args: Any) -> Any:
        raise AssertionError("vLLM's own padding ran: the policy was re-read")

    ids = torch.tensor([[0, 1]] * n, dtype=torch.int32)
    _, out_ids, _, _ = padding.pad_to_capacity(layer, torch.zeros(n, H, dtype=torch.bfloat16), ids,
                                               torch.rand(n, K), 32, original=vllm_padding)
    state = padding.last_padding()
    return {"capacity": int(out_ids.shape[0]), "swapped": swapped, "buffer": layer._buffer, "policy": state["policy"],
            "agreed_inputs": list(padding.cost_inputs(manager)), "own_inputs": list(padding.cost_inputs(None)),
            "agreed_policy": padding.policy(manager), "own_policy": padding.policy(None)}


def main() -> int:
    from moonep_ep.launch import RankFailure, run_ranks

    try:
        results = run_ranks(manager_cases, 2, args=(False,), timeout_s=240, group_timeout_s=60)
    except RankFailure as exc:
        print(json.dumps({"ok": False, "errors": exc.errors}, default=str))
        return 1
    print(json.dumps({"ok": True, "ranks": results}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
