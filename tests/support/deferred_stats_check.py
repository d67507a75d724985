"""Prefetch calls for ``tests/vllm/test_deferred_stats.py``, and its check of ``manager.py``'s stats block.

:func:`prefetch_calls` builds several prefetches of two ranks (the plugin's three padding policies, push and
quantized copy counts, the classification's error paths, a plan without the global tables) with the padding
state the plugin records for each (``LAST_PADDING``).

``python -m tests.support.deferred_stats_check STATS_DIR`` runs ``SlotFillBuffer.prefetch_weight`` over vLLM's
stand-ins (``lockstep_decisions_check.install_vllm_stand_ins``; a child process, so they stay out of the
test's) for every call, under the host-sync counter, twice: with today's immediate analysis in the op (the
control) and with the deferred one; prints one JSON line: the reads of each call, the slots ``last_slots``
reads afterwards and those of the plan at the call, and whether both runs' statistics are equal.
"""

from __future__ import annotations

import json
import os
import sys
import types
from typing import Any

import torch

R, E, K, S, B = 2, 8, 2, 8, 4
EPN = E // R


def _real_counts(gen: torch.Generator, tokens: list[int], skew: int) -> torch.Tensor:
    """``[R, E]`` real entries: each source's ``n*K`` entries, ``skew`` in 8 of them on owner 0's experts."""
    rows = []
    for n in tokens:
        hot = torch.randint(0, EPN, (n * K,), generator=gen)
        cold = torch.randint(0, E, (n * K,), generator=gen)
        pick = torch.where(torch.rand(n * K, generator=gen) < skew / 8, hot, cold)
        rows.append(torch.zeros(E, dtype=torch.int64).index_add_(0, pick, torch.ones_like(pick)))
    return torch.stack(rows)


def _step(gen: torch.Generator, policy: str, tokens: list[int], skew: int) -> tuple[Any, dict[str, Any]]:
    """One step: the plan of the padded counts and the padding state the plugin records."""
    from moonep_ep.ops.decode.padding import expert_padding
    from moonep_ep.ops.moonep.planner import plan_dispatch

    real = _real_counts(gen, tokens, skew)
    n = torch.tensor(tokens)
    loads = real.reshape(R, R, EPN).sum(2).sum(0)  # real entries per home group, over the sources
    pad = expert_padding(policy, n, loads if policy == "balanced" else None, S=S, K=K, E=E, R=R)
    plan = plan_dispatch(real + pad, S=S, K=K, E=E, R=R, B=B, token_padding=1)
    state = {"policy": policy, "real_tokens": n if policy != "vllm" else None,
             "pad": pad if policy != "vllm" else None, "S": S}
    return plan, state


class CommPlan:
    """What the analysis reads of a buffer's plan: its global plan and its own copy of the slot table."""

    def __init__(self, global_plan: Any) -> None:
        self.global_plan = global_plan
        self.experts_to_copy = global_plan.experts_to_copy.clone()


def prefetch_calls() -> list[tuple[Any, Any, dict[str, Any]]]:
    """``(plan, padding state, record_prefetch keywords)``: every branch of the analysis."""
    from moonep_ep.ops.moonep.commplan import PrefetchStats
    from moonep_ep.ops.moonep.planner import plan_dispatch

    gen = torch.Generator().manual_seed(45)
    calls: list[tuple[Any, Any, dict[str, Any]]] = []
    for i, (policy, tokens, skew) in enumerate([("vllm", [8, 1], 7), ("balanced", [8, 3], 8), ("own", [5, 8], 6),
                                                 ("balanced", [8, 8], 8), ("vllm", [2, 8], 0)]):
        plan, state = _step(gen, policy, tokens, skew)
        copied = PrefetchStats.from_copies("pull", 3, {e: 300 for e in range(E)}, 0.0, [], epn=EPN, rank=i % R)
        calls.append((CommPlan(plan), state, dict(ep_rank=i % R, epn=EPN, copied=copied, real_tokens=tokens,
                                                  hosts=["h0", "h1"])))
    # vLLM's padding overflows owner 0's group onto rank 1 with padding alone: a padding-only fill (E=4)
    small = plan_dispatch(torch.tensor([[8, 8, 0, 0], [14, 0, 1, 1]]), S=8, K=2, E=4, R=2, B=2, token_padding=1)
    calls.append((CommPlan(small), {"policy": "vllm", "real_tokens": None, "pad": None, "S": 8},
                  dict(ep_rank=1, epn=2, real_tokens=[8, 1])))
    plan, state = _step(gen, "balanced", [8, 2], 8)
    pushed = PrefetchStats("push", 3, 300, 0.0, [], bytes_by_owner={0: 300}, remote_bytes=300,
                           bytes_by_expert={0: 300}, bytes_by_tensor={"w13": 200, "w13_scale": 100})
    quantized = types.SimpleNamespace(weight_bytes=10, scale_bytes=2, remote_weight_bytes=10, remote_scale_bytes=2)
    calls += [
        (CommPlan(plan), state, dict(ep_rank=0, epn=EPN, copied=pushed, real_tokens=[8, 2])),
        (CommPlan(plan), state, dict(ep_rank=1, epn=EPN, copied=quantized, real_tokens=[8, 2])),
        (CommPlan(plan), state, dict(ep_rank=1, epn=EPN, real_tokens=None)),            # unclassified
        (CommPlan(plan), None, dict(ep_rank=1, epn=EPN, real_tokens=[8, 2])),           # vLLM's counts, no state
        (CommPlan(plan), dict(state, S=2 * S), dict(ep_rank=1, epn=EPN, real_tokens=[8, 2])),  # another step's
        (CommPlan(plan), dict(state, pad=None), dict(ep_rank=1, epn=EPN, real_tokens=[8, 2])),  # error, reported
        (CommPlan(plan), None, dict(ep_rank=1, epn=EPN, real_tokens=[8, 0])),           # counts that do not fit
        (types.SimpleNamespace(experts_to_copy=plan.experts_to_copy.clone()), None,     # no global plan
         dict(ep_rank=1, epn=EPN, real_tokens=[8, 2])),
    ]
    return calls


def _run_buffer(manager_mod: Any, stats_mod: Any, immediate: bool) -> dict[str, Any]:
    """Every call through ``SlotFillBuffer.prefetch_weight``, each under the counter; a fresh ``STATS``."""
    from moonep_ep.testing.host_syncs import HostSyncs

    stats = stats_mod.Stats()
    if immediate:  # the control: today's analysis inside the op (vLLM's counts read as a list, as it did)
        def immediate_record(plan, r, epn, copied=None, real_tokens=None, hosts=None, counts=None):  # noqa: ANN
            if counts is not None:
                counts()
            stats.record_prefetch(plan, r, epn, copied=copied,
                                  real_tokens=None if real_tokens is None else real_tokens.tolist(), hosts=hosts)
        stats.defer_prefetch = immediate_record
    manager_mod.STATS = stats
    inner = types.SimpleNamespace(epn=EPN, last_prefetch=None, prefetch_weight=lambda plan=None, async_finish=False,
                                  **weights: None)
    owner = types.SimpleNamespace(rank=0, world_size=R, expert_store=types.SimpleNamespace(hosts=["h0", "h1"]),
                                  check_ready_for_prefetch=lambda: None)
    buffer = manager_mod.SlotFillBuffer(inner, owner)
    forward_context = sys.modules["vllm.forward_context"]
    out: dict[str, Any] = {"reads": [], "last_slots": [], "last_slots_want": []}
    for plan, state, kw in prefetch_calls():
        owner.rank, inner.epn, inner.last_prefetch = kw["ep_rank"], kw["epn"], kw.get("copied")
        tokens = kw["real_tokens"]
        forward_context.meta = (None if tokens is None else
                                types.SimpleNamespace(num_tokens_across_dp_cpu=torch.tensor(tokens)))
        stats_mod.LAST_PADDING.state = state
        want = [(b, e, e // kw["epn"]) for b, e in enumerate(plan.experts_to_copy[kw["ep_rank"]].tolist()) if e >= 0]
        with HostSyncs() as syncs:
            buffer.prefetch_weight(plan=plan)
        plan.experts_to_copy.fill_(-1)  # the buffer's next plan, written over this one's table
        out["reads"].append(syncs.total)
        out["last_slots"].append([list(t) for t in buffer.last_slots])
        out["last_slots_want"].append([list(t) for t in want])
    out["data"] = json.loads(json.dumps(stats.data, default=str))
    return out


def main(stats_dir: str) -> dict[str, Any]:
    os.environ["MOONEP_EP_VLLM_STATS_DIR"] = stats_dir
    from tests.support.lockstep_decisions_check import install_vllm_stand_ins

    install_vllm_stand_ins()
    forward_context = types.ModuleType("vllm.forward_context")
    forward_context.meta = None
    forward_context.get_forward_context = lambda: types.SimpleNamespace(dp_metadata=forward_context.meta)
    sys.modules["vllm.forward_context"] = forward_context
    from moonep_ep.vllm import manager
    from moonep_ep.vllm.observe import stats

    control = _run_buffer(manager, stats, immediate=True)
    deferred_run = _run_buffer(manager, stats, immediate=False)
    for run in (control, deferred_run):
        run["data"].pop("pid")
    return {"calls": len(deferred_run["reads"]), "reads_in_op": deferred_run["reads"],
            "control_reads_in_op": control["reads"], "last_slots": deferred_run["last_slots"],
            "last_slots_want": deferred_run["last_slots_want"],
            "forward_equal": control["data"] == deferred_run["data"],
            "remote_prefetched": deferred_run["data"]["forward"]["remote_prefetched"]}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
