"""Where capacity-padding rows are routed, so that padding moves no expert weights.

MoonEP plans in uniform mode: every rank sends exactly ``S`` tokens, so a rank
with ``n < S`` real tokens adds ``(S - n)`` padding rows (route weight 0). The
planner counts their ``K`` entries like any others. It gives every rank
``cap = S*K`` rows and balances each home group ``h`` (the experts rank ``h``
owns) by its surplus ``G_h + P_h - S*K`` (``G_h`` real entries, ``P_h`` padding
entries routed to group ``h``; docs/design/moonep.md §4.1). Entries that move
off a group are computed on another rank, whose slot then holds a copy of the
expert's weights. So where the padding goes decides which weights move:

* ``vllm`` — vLLM 0.33.0: every padding entry to expert 0. Expert 0's owner
  looks ``(S - n)*K*R`` entries overloaded at every decode step; the planner
  moves expert 0 to every other rank.
* ``own`` — each rank's padding over its own experts (round robin): no
  collective, no padding sent anywhere; groups keep ``G_h - n_h*K`` surplus,
  the real imbalance, which the planner still evens out by moving experts.
* ``balanced`` — padding fills each group's deficit ``S*K - G_h`` (own group
  first, then the others in rank order), so every group holds exactly
  ``S*K`` entries and the planner moves nothing whenever no group's real load
  exceeds ``S*K``. Every rank still computes ``S*K`` rows, as with any padding
  (``cap`` is ``S*K`` whatever the padding does), so the moves it prevents
  could not have lowered the busiest rank's rows. A group whose real load
  exceeds ``S*K`` gets no padding, so any entry the planner moves is real:
  padding never reaches a slot. Needs every rank's group loads before the
  dispatch (one all-gather of ``R + 1`` integers).

Padding entries of a source follow its real entries (the rows are appended),
which is what :mod:`moonep_ep.ops.moonep.padding` relies on to tell real entries
from padding in a plan.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["POLICIES", "group_padding", "expert_padding", "padding_ids"]

POLICIES = ("vllm", "own", "balanced")
#: The expert vLLM 0.33.0 routes padding rows to (``F.pad`` of the ids with 0).
VLLM_PADDING_EXPERT = 0


def _check(policy: str, real_tokens: Sequence[int], S: int, R: int) -> list[int]:
    if policy not in POLICIES:
        raise ValueError(f"padding policy {policy!r} is not one of {POLICIES}")
    if len(real_tokens) != R:
        raise ValueError(f"need one real-token count per rank ({R}), got {list(real_tokens)}")
    n = [int(x) for x in real_tokens]
    bad = [(r, x) for r, x in enumerate(n) if not 0 <= x <= S]
    if bad:
        raise ValueError(f"rank {bad[0][0]}: {bad[0][1]} real tokens is outside [0, S={S}]")
    return n


def group_padding(policy: str, real_tokens: Sequence[int], group_loads: Sequence[int] | None, *, S: int, K: int,
                  R: int) -> list[list[int]]:
    """``P[s][h]``: padding entries source ``s`` routes to home group ``h`` (``own``/``balanced``).

    ``group_loads[h]``: real entries of every source routed to group ``h``
    (needed by ``balanced`` only). Row ``s`` sums to ``(S - n_s)*K``."""
    n = _check(policy, real_tokens, S, R)
    if policy == "vllm":
        raise ValueError("the vllm policy pads one expert, not groups: use expert_padding")
    left = [(S - x) * K for x in n]
    P = [[0] * R for _ in range(R)]
    if policy == "own":
        for s in range(R):
            P[s][s] = left[s]
        return P
    if group_loads is None or len(group_loads) != R:
        raise ValueError(f"the balanced policy needs the real load of each of the {R} groups, got {group_loads}")
    need = [max(0, S * K - int(g)) for g in group_loads]
    for s in range(R):                       # own group first: that padding is never sent
        take = min(left[s], need[s])
        P[s][s] += take
        left[s] -= take
        need[s] -= take
    for s in range(R):
        for h in range(R):
            take = min(left[s], need[h])
            if take:
                P[s][h] += take
                left[s] -= take
                need[h] -= take
    for s in range(R):                       # unreachable: sum(need) >= sum(left) always
        P[s][s] += left[s]
    return P


def expert_padding(policy: str, real_tokens: Sequence[int], group_loads: Sequence[int] | None, *, S: int, K: int,
                   E: int, R: int) -> torch.Tensor:
    """``[R, E]`` int64: padding entries each source routes to each expert.

    Within a group the entries go round robin over its ``epn`` experts,
    continuing across sources, so each expert of a group gets an equal share
    (within one)."""
    n = _check(policy, real_tokens, S, R)
    pad = torch.zeros(R, E, dtype=torch.int64)
    if policy == "vllm":
        for s in range(R):
            pad[s, VLLM_PADDING_EXPERT] = (S - n[s]) * K
        return pad
    epn = E // R
    P = group_padding(policy, n, group_loads, S=S, K=K, R=R)
    for h in range(R):
        start = 0
        for s in range(R):
            count = P[s][h]
            if count:
                idx = (torch.arange(start, start + count) % epn) + h * epn
                pad[s] += torch.bincount(idx, minlength=E)
                start += count
    return pad


def padding_ids(pad_row: torch.Tensor, K: int) -> torch.Tensor:
    """One source's padding rows: ``[rows, K]`` expert ids with ``bincount == pad_row``.

    Entries are laid out expert by expert, so a row's ``K`` entries mostly
    share one owner (MoonEP sends a row once per destination)."""
    counts = pad_row.to(torch.int64)
    total = int(counts.sum())
    if total % K:
        raise ValueError(f"padding entries ({total}) are not a multiple of K={K}")
    ids = torch.repeat_interleave(torch.arange(counts.numel(), dtype=torch.int64), counts)
    return ids.reshape(total // K, K)
