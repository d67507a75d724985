"""Capacity padding in a dispatch plan: which slot fills serve real tokens.

vLLM's MoonEP prepare step pads every rank's batch up to the buffer's token
capacity ``S`` with rows routed ``K`` times to expert 0 at route weight 0,
appended after the rank's real tokens. Those rows count in the plan like any
others, so a rank with few real tokens adds ``(S - n)·K`` entries to expert 0
and can make the planner move expert 0's entries, and prefetch expert 0, to
another rank although no real token needs it there.

The planner hands the entries of source ``s`` to expert ``e`` to the
destinations in ascending rank, in flat ``(token, k)`` order (planner §4.6),
so the padding entries of expert 0 (the last ones of every source) land on the
highest destinations that expert 0's entries of ``s`` reach. The same holds for
any padding layout (the plugin's, ``ops/decode/padding.py``): given as an
``[R, E]`` matrix of padding entries per source and expert, each source's
padding entries of an expert follow its real ones. From that:

* :func:`real_entries` — entries of each expert on each destination that come
  from real tokens;
* :func:`classify_slot_fills` — for a destination's used slots, how many of
  the slot's entries are real (a fill with none is *padding-only*);
* :func:`replan_without_padding` — the slots a plan of the real entries alone
  would fill (varlen mode), to tell which fills the padding caused.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from .planner import DispatchPlan, plan_dispatch

__all__ = ["SlotFill", "padding_entries", "real_entries", "classify_slot_fills", "replan_without_padding"]

#: The expert vLLM routes capacity-padding rows to (``prepare_finalize/moonep.py``: ``F.pad`` of ids with 0).
PADDING_EXPERT = 0


@dataclasses.dataclass(frozen=True)
class SlotFill:
    """One used slot of one destination rank."""

    slot: int
    expert: int
    owner: int
    entries: int          # (token, k) entries of ``expert`` the destination computes in this slot
    real_entries: int     # of those, from real tokens (0: the fill serves padding only)

    @property
    def padding_only(self) -> bool:
        return self.real_entries == 0


def padding_entries(plan: DispatchPlan, real_tokens: Sequence[int]) -> list[int]:
    """Padding entries each source added: ``(S - n_s)·K`` for ``n_s`` real tokens on source ``s``."""
    if len(real_tokens) != plan.R:
        raise ValueError(f"need one real-token count per source rank ({plan.R}), got {list(real_tokens)}")
    pads = []
    for s, n in enumerate(real_tokens):
        if not 0 <= int(n) <= plan.S:
            raise ValueError(f"source rank {s}: {n} real tokens is outside [0, S={plan.S}]")
        pads.append((plan.S - int(n)) * plan.K)
    return pads


def _pad_matrix(plan: DispatchPlan, pads: "Sequence[int] | torch.Tensor") -> torch.Tensor:
    """``[R, E]`` padding entries per source and expert: a per-source list means vLLM's
    padding (all on :data:`PADDING_EXPERT`); a tensor is taken as it is
    (:func:`moonep_ep.ops.decode.padding.expert_padding`)."""
    if isinstance(pads, torch.Tensor):
        if tuple(pads.shape) != (plan.R, plan.E):
            raise ValueError(f"padding matrix must be [R, E] = [{plan.R}, {plan.E}], got {tuple(pads.shape)}")
        return pads.to(torch.int64)
    matrix = torch.zeros(plan.R, plan.E, dtype=torch.int64)
    matrix[:, PADDING_EXPERT] = torch.tensor([int(p) for p in pads], dtype=torch.int64)
    return matrix


def real_entries(plan: DispatchPlan, pads: "Sequence[int] | torch.Tensor") -> torch.Tensor:
    """``[E, R]`` int64: entries of expert ``e`` computed on rank ``d`` that come from real tokens.

    ``pads``: padding entries of each source (:func:`padding_entries`, all
    routed to :data:`PADDING_EXPERT`), or an ``[R, E]`` matrix of padding
    entries per source and expert; a source's padding follows its real entries."""
    counts = plan.route_count.to(torch.int64)              # [s, e, d]
    matrix = _pad_matrix(plan, pads)
    totals = plan.tokens_per_expert.to(torch.int64)
    if (matrix > totals).any():
        s, e = (int(x) for x in torch.nonzero(matrix > totals)[0])
        raise ValueError(f"source rank {s}: {int(matrix[s, e])} padding entries but only {int(totals[s, e])} "
                         f"entries of expert {e}: the real-token counts do not match this plan")
    n_real = (totals - matrix)[:, :, None]                 # a source's entries of e: [0, n_real) are real
    hi = counts.cumsum(2)                                  # destinations take them in ascending rank
    lo = hi - counts
    return (torch.minimum(hi, n_real) - lo).clamp_min(0).sum(0)


def classify_slot_fills(plan: DispatchPlan, dest: int, real: Optional[torch.Tensor]) -> list[SlotFill]:
    """Every used slot of rank ``dest``; ``real`` from :func:`real_entries` (None: counted as all real)."""
    fills = []
    for slot, (expert, owner) in enumerate(zip(plan.experts_to_copy[dest].tolist(),
                                              plan.copy_owner[dest].tolist())):
        if expert < 0:
            continue
        entries = int(plan.alloc[expert, dest])
        fills.append(SlotFill(slot, expert, owner, entries,
                              entries if real is None else int(real[expert, dest])))
    return fills


def replan_without_padding(plan: DispatchPlan, pads: "Sequence[int] | torch.Tensor") -> Optional[DispatchPlan]:
    """The plan of the real entries alone (varlen), or None when a source has no real token
    (MoonEP's varlen mode needs at least one token per rank)."""
    counts = plan.tokens_per_expert.to(torch.int64).clone()
    counts -= _pad_matrix(plan, pads)
    if (counts < 0).any():
        raise ValueError("more padding entries than entries in the plan: the padding does not match this plan")
    tokens = [int(row.sum()) // plan.K for row in counts]
    if min(tokens) < 1:
        return None
    return plan_dispatch(counts, S=plan.S, K=plan.K, E=plan.E, R=plan.R, B=plan.B,
                         token_padding=plan.token_padding, total_num_tokens=sum(tokens))
