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

__all__ = ["POLICIES", "group_padding", "expert_padding", "own_padding_row", "padding_ids"]

POLICIES = ("vllm", "own", "balanced")
#: The expert vLLM 0.33.0 routes padding rows to (``F.pad`` of the ids with 0).
VLLM_PADDING_EXPERT = 0


def _check(policy: str, real_tokens: Sequence[int] | torch.Tensor, S: int, R: int) -> torch.Tensor:
    """``real_tokens`` as an int64 tensor; host values are checked here, a tensor (already on the device, the
    step's gathered counts) is not read: each rank checked its own count against ``S`` before the gather."""
    if policy not in POLICIES:
        raise ValueError(f"padding policy {policy!r} is not one of {POLICIES}")
    if isinstance(real_tokens, torch.Tensor):
        if tuple(real_tokens.shape) != (R,):
            raise ValueError(f"need one real-token count per rank ({R}), got shape {tuple(real_tokens.shape)}")
        return real_tokens.to(torch.int64)
    if len(real_tokens) != R:
        raise ValueError(f"need one real-token count per rank ({R}), got {list(real_tokens)}")
    n = [int(x) for x in real_tokens]
    bad = [(r, x) for r, x in enumerate(n) if not 0 <= x <= S]
    if bad:
        raise ValueError(f"rank {bad[0][0]}: {bad[0][1]} real tokens is outside [0, S={S}]")
    return torch.tensor(n, dtype=torch.int64)


def _group_padding(policy: str, n: torch.Tensor, group_loads: Sequence[int] | torch.Tensor | None, *, S: int,
                   K: int, R: int) -> torch.Tensor:
    """``[R, R]`` int64 ``P`` on ``n``'s device, by tensor ops only (no value is read back to the host).

    ``balanced`` is a greedy fill, sources in rank order, each group's deficit in rank order, after every
    source filled its own group: that greedy is the north-west-corner rule, so source ``s`` sends group
    ``h`` the overlap of its interval of the cumulated padding with ``h``'s interval of the cumulated
    deficits."""
    left = (S - n) * K
    if policy == "own":
        return torch.diag(left)
    if group_loads is None or len(group_loads) != R:
        raise ValueError(f"the balanced policy needs the real load of each of the {R} groups, got {group_loads}")
    loads = torch.as_tensor(group_loads, dtype=torch.int64).to(n.device)
    need = (S * K - loads).clamp(min=0)
    own = torch.minimum(left, need)          # own group first: that padding is never sent
    left, need = left - own, need - own
    left_end, need_end = left.cumsum(0), need.cumsum(0)
    sent = (torch.minimum(left_end[:, None], need_end[None, :])
            - torch.maximum((left_end - left)[:, None], (need_end - need)[None, :])).clamp(min=0)
    # unreachable (sum(need) >= sum(left) always); what no group needs stays on the source's own group
    return sent + torch.diag(own + left - sent.sum(1))


def group_padding(policy: str, real_tokens: Sequence[int] | torch.Tensor, group_loads: Sequence[int] | torch.Tensor | None,
                  *, S: int, K: int, R: int) -> list[list[int]]:
    """``P[s][h]``: padding entries source ``s`` routes to home group ``h`` (``own``/``balanced``).

    ``group_loads[h]``: real entries of every source routed to group ``h``
    (needed by ``balanced`` only). Row ``s`` sums to ``(S - n_s)*K``."""
    n = _check(policy, real_tokens, S, R)
    if policy == "vllm":
        raise ValueError("the vllm policy pads one expert, not groups: use expert_padding")
    return _group_padding(policy, n, group_loads, S=S, K=K, R=R).tolist()


def expert_padding(policy: str, real_tokens: Sequence[int] | torch.Tensor,
                   group_loads: Sequence[int] | torch.Tensor | None, *, S: int, K: int, E: int, R: int) -> torch.Tensor:
    """``[R, E]`` int64: padding entries each source routes to each expert, on ``real_tokens``' device.

    Within a group the entries go round robin over its ``epn`` experts,
    continuing across sources, so each expert of a group gets an equal share
    (within one). Tensor ops only: given the step's gathered counts on the device, nothing is read back
    (the prepare step of a decode graph)."""
    n = _check(policy, real_tokens, S, R)
    if policy == "vllm":
        pad = torch.zeros(R, E, dtype=torch.int64, device=n.device)
        pad[:, VLLM_PADDING_EXPERT] = (S - n) * K
        return pad
    epn = E // R
    P = _group_padding(policy, n, group_loads, S=S, K=K, R=R)
    # source s's entries for group h take round-robin offsets [start, start + P[s, h]) of that group
    start = P.cumsum(0) - P
    return _round_robin(start, start + P, epn).reshape(R, E)


def _round_robin(begin: torch.Tensor, end: torch.Tensor, epn: int) -> torch.Tensor:
    """``[..., epn]``: how many offsets ``j`` of ``[begin, end)`` have ``j % epn == k``, for each ``k``."""
    k = torch.arange(epn, dtype=torch.int64, device=begin.device)

    def below(x: torch.Tensor) -> torch.Tensor:   # offsets j in [0, x) with j % epn == k (x >= 0)
        return torch.div(x[..., None] - k + epn - 1, epn, rounding_mode="floor")

    return below(end) - below(begin)


def own_padding_row(entries: int, rank: int, *, E: int, R: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[E]`` int64: ``entries`` padding entries of ``rank`` round robin over its own experts (the ``own``
    policy's row of that rank, which needs no other rank's count), built on ``device``."""
    epn = E // R
    row = torch.zeros(E, dtype=torch.int64, device=device)
    row[rank * epn:(rank + 1) * epn] = _round_robin(torch.zeros((), dtype=torch.int64, device=device),
                                                    torch.full((), entries, dtype=torch.int64, device=device), epn)
    return row


def padding_ids(pad_row: torch.Tensor, K: int, rows: int | None = None) -> torch.Tensor:
    """One source's padding rows: ``[rows, K]`` expert ids with ``bincount == pad_row``.

    Entries are laid out expert by expert, so a row's ``K`` entries mostly
    share one owner (MoonEP sends a row once per destination). ``rows``: the row count when the caller knows
    it (the prepare step: capacity minus real tokens), so the ids are built on ``pad_row``'s device without
    reading its sum back."""
    counts = pad_row.to(torch.int64)
    if rows is None:
        total = int(counts.sum())
        if total % K:
            raise ValueError(f"padding entries ({total}) are not a multiple of K={K}")
        rows = total // K
    ids = torch.repeat_interleave(torch.arange(counts.numel(), dtype=torch.int64, device=counts.device), counts,
                                  output_size=rows * K)
    return ids.reshape(rows, K)
