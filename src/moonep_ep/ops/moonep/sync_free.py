"""The reference buffer's dispatch and combine without a device→host read (``lockstep_checks=False``).

MoonEP's release plans on its GPUs and moves rows with NVLink stores: nothing in a decode step waits for the
host. The reference buffer's lockstep path (``base.py``) cannot: it gathers Python objects, sizes its
``all_to_all`` splits on the host and checks the routing there. This path keeps every value on the device:

* **Fixed-size exchanges.** Every source sends every destination the same shapes, fixed by the buffer: its
  ``S`` token rows ``[R, S, H]`` and, per entry slot ``i < S*K``, the shard row ``loff`` the entry lands on
  at that destination (``-1``: not there) with its route weight's bits, ``[R, 2, S*K]`` int32. No split is
  read. A token sends one row per destination whatever its entries there (MoonEP's dedup, by layout). The
  bytes moved are ``R*S*H`` per rank, not the routed rows: a reference, not a fast path.
* **The plan on the device** (``planner_device.py``) from one fixed-size gather of ``[R, 6+E]`` int64: a
  header (failed checks, ``s``, fresh plan, weights given, ``total_num_tokens``, the first bad id), then
  each rank's counts, which this rank computes itself from its ids (a scatter-add, so the plan always
  matches the entries it routes).
* **Placement by index**: entries land with ``index_copy_`` into a shard with one spare row (``NvS``), where
  every absent entry goes; padding rows are zeroed with a mask built from ``zero_fill_ranges``.
* **Combine** sums each received ``(source, token)``'s entries in fp32 in ``k`` order (MoonEP's prologue,
  the same order as the lockstep path, so the bits are equal), rounds once, sends ``[R, S, H]`` back, and
  each source sums its destinations in rank order in fp32 and rounds once.

**Errors are deferred, never lost.** A value check (an expert id outside ``[0, E)``, counts that are not
``bincount(topk)``, the device planner's flags, ranks making different kinds of call) sets bits of a device
error word that every rank holds alike (the flags travel in the gather); nothing reads it in the step.
:meth:`~.base.ReferenceBufferBase.raise_deferred_errors` reads it (one read) and raises
:class:`~moonep_ep.errors.CollectiveError` naming each failing rank, the value and the fix, on every rank;
vLLM's runner calls it after every step (``vllm/observe/deferred_errors.py``), ``destroy()`` at the end.
Until then the step's outputs are meaningless but every index is clamped, so nothing is written out of
bounds. A rank whose *host-side* checks fail (shapes, dtypes, a foreign plan) does not raise either: it takes
part in the call's exchanges with nothing routed and returns outputs of the right kind (no tokens), so its
caller and its peers stay in step (a rank that raised here would leave its peers waiting in the next
collective); its own error, with the value and the fix, is raised by the same deferred read.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Optional

import torch
import torch.distributed as dist

from ...errors import CollectiveError
from .commplan import CommPlan
from .planner import entry_rows
from .planner_device import FLAG_BITS

__all__ = ["FixedRoutes", "DeferredErrors", "LOCAL_FLAG_BITS", "dispatch", "combine", "raise_everywhere"]

#: Bits a rank sets in its own header word (the planner's :data:`~.planner_device.FLAG_BITS` sit below them).
LOCAL_FLAG_BITS = {
    1 << 8: "its host-side checks failed (that rank raised its own error, naming the value and the fix)",
    1 << 9: "topk_experts_sk holds an expert id outside [0, E)",
    1 << 10: "tokens_per_expert disagrees with bincount(topk_experts_sk, minlength=E)",
    1 << 11: "the ranks made different kinds of call (a fresh vs a reused plan, route weights given vs None, "
             "or different total_num_tokens)",
}
_HOST_CHECK, _BAD_ID, _BAD_COUNTS, _KINDS = LOCAL_FLAG_BITS
_HEADER = 6  # flags, s, fresh, weighted, total_num_tokens (-1: uniform), first bad id

#: The sync-free buffers alive in this process (vLLM's runner checks their error words after each step).
_LIVE: "weakref.WeakSet[Any]" = weakref.WeakSet()


@dataclasses.dataclass(eq=False)
class FixedRoutes:
    """One rank's tables of one sync-free dispatch (device tensors; the plan's ``routing``).

    ``dst`` ``[s*K]`` int64 (MoonEP's encoding, duplicates ``-raw-1``); ``recv_loff`` ``[R, S*K]`` int64:
    the shard row of every entry slot each source sent here, ``-1`` where none."""

    s: int
    dst: torch.Tensor
    recv_loff: torch.Tensor

    def clone(self) -> "FixedRoutes":
        return FixedRoutes(self.s, self.dst.clone(), self.recv_loff.clone())


class DeferredErrors:
    """A buffer's device error word: ``[R+1]`` int64 bits (each rank's, then the planner's) and the first bad
    expert id per rank, the same on every rank; read only by :meth:`raise_if_set`."""

    def __init__(self, R: int, device: torch.device):
        self.bits = torch.zeros(R + 1, dtype=torch.int64, device=device)
        self.bad_id = torch.zeros(R, dtype=torch.int64, device=device)
        #: this rank's first failed host-side check since the last read (its words name the value and the fix)
        self.held: Optional[Exception] = None

    def hold(self, error: Exception) -> None:
        self.held = self.held or error

    def record(self, header: torch.Tensor, planner_flags: torch.Tensor) -> None:
        fresh = self.bits[:-1] == 0
        self.bad_id.copy_(torch.where(fresh, header[:, 5], self.bad_id))  # the first step's id is kept
        self.bits[:-1].bitwise_or_(header[:, 0])
        self.bits[-1:].bitwise_or_(planner_flags.to(torch.int64).view(1))

    def raise_if_set(self, rank: int, E: int) -> None:
        bits = self.bits.to("cpu").tolist()  # the one read, outside the step
        if not any(bits):
            return
        bad = self.bad_id.to("cpu").tolist()
        held, self.held = self.held, None
        self.bits.zero_()
        if held is not None or any(word & _HOST_CHECK for word in bits[:-1]):
            # a rank that failed a host-side check routed nothing: what the planner and the kinds check then
            # see follows from it, and would only blur the one message that matters
            bits = [word & ~_KINDS for word in bits[:-1]] + [0]
        failures: dict[int, str] = {}
        if held is not None:
            failures[rank] = f"{type(held).__name__}: {held}"
        for r, word in enumerate(bits[:-1]):
            if r == rank and held is not None:
                word &= ~_HOST_CHECK
            reasons = [why + (f" (the first: {bad[r]}; pass ids in [0, {E}), an invalid slot as expert 0 with "
                              "weight 0)" if bit == _BAD_ID else "")
                       for bit, why in LOCAL_FLAG_BITS.items() if word & bit]
            if word & _BAD_COUNTS:
                reasons.append("fix: pass tokens_per_expert = bincount(topk, minlength=E) of the same call")
            if reasons:
                failures[r] = "; ".join(([failures[r]] if r in failures else []) + reasons)
        if bits[-1]:   # a rule across ranks: named under every rank, the same words on each
            planner = ("the device planner flagged the gathered counts: " +
                       "; ".join(why for bit, why in FLAG_BITS.items() if bits[-1] & bit) +
                       " (fix: route 1 <= s <= S tokens on every rank, the same s in uniform mode, "
                       "total_num_tokens = the sum of s)")
            for r in range(len(bad)):
                failures[r] = f"{failures[r]}; {planner}" if r in failures else planner
        raise CollectiveError("dispatch (sync-free, checked after the step)", failures, rank=rank)


def raise_everywhere() -> None:
    """Every live sync-free buffer's :meth:`~.base.ReferenceBufferBase.raise_deferred_errors` (vLLM's runner
    calls this after each step)."""
    for buffer in list(_LIVE):
        if not buffer.destroyed:
            buffer.raise_deferred_errors()


def register(buffer: Any) -> None:
    _LIVE.add(buffer)


# -- dispatch ---------------------------------------------------------------------------------------------------
def dispatch(buf: Any, hidden_sh: torch.Tensor, weights_sk: Optional[torch.Tensor], topk: Any, tpe: Any,
             plan: Optional[CommPlan], total_num_tokens: Optional[int]) -> tuple[Optional[torch.Tensor], CommPlan]:
    """The sync-free dispatch of ``buf`` (a :class:`~.base.ReferenceBufferBase`): ``(cu_seqlens or None on
    reuse, plan)``; the rows are in ``buf``'s shard. Collective: three fixed-size collectives on every rank."""
    R, S, K, E, dev = buf.R, buf.S, buf.K, buf.E, buf.device
    fresh = plan is None
    error: Optional[Exception] = None
    s = 0
    try:
        s = buf._check_hidden(hidden_sh)
        if weights_sk is not None:
            buf._check_tensor("route_weights_sk", weights_sk, torch.float32, (s, K),
                              f"pass fp32 route weights of shape [s, K] = [{s}, {K}] (or None)")
        if fresh:
            buf._check_routing_shapes(topk, tpe, s)
        else:
            buf._check_plan(plan)
            if not isinstance(plan.routing, FixedRoutes) or plan.num_tokens != s:
                raise buf._reuse_error(plan, s)
        total_num_tokens = buf._check_total(total_num_tokens, s)
    except Exception as exc:  # noqa: BLE001 - raised by the deferred read, so every rank stays in step
        error, s = exc, 0
    head = [s, int(fresh), int(weights_sk is not None), -1 if total_num_tokens is None else total_num_tokens]
    counts = torch.zeros(E, dtype=torch.int64, device=dev)
    flags = torch.zeros((), dtype=torch.int64, device=dev)
    first_bad = torch.zeros(1, dtype=torch.int64, device=dev)
    ids = None
    if error is not None:
        flags = flags + _HOST_CHECK
    elif fresh:
        ids = topk.detach().reshape(-1).to(torch.int64)
        bad = (ids < 0) | (ids >= E)
        first_bad = ids.gather(0, torch.argmax(bad.to(torch.int8)).view(1))
        ids = torch.where(bad, torch.zeros_like(ids), ids)   # safe ids: the flag makes the step void
        counts.index_add_(0, ids, torch.ones_like(ids))
        flags = torch.where(bad.any(), _BAD_ID, 0) | torch.where((counts != tpe.to(torch.int64)).any(), _BAD_COUNTS, 0)
    # the header's Python ints by scalar fills, not torch.tensor(..., device=): that is a blocking host->device
    # copy, which CUDA graph capture refuses; a fill's scalar is baked, as the capture size fixes it
    head_t = torch.empty(len(head), dtype=torch.int64, device=dev)
    for i, value in enumerate(head):
        head_t[i].fill_(value)
    mine = torch.cat([flags.view(1), head_t, first_bad, counts])
    gathered = torch.empty(R * (_HEADER + E), dtype=torch.int64, device=dev)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the name in torch >= 2.13
    with buf.comm.peer_loss_named("dispatch: counts gather"):
        gather(gathered, mine, group=buf.group)
    gathered = gathered.view(R, _HEADER + E)
    header = gathered[:, :_HEADER]
    kinds = header[:, 2:5]
    header = header.clone()
    header[:, 0] |= torch.where((kinds != kinds[:1]).any(), _KINDS, 0)
    planner_flags = torch.zeros((), dtype=torch.int64, device=dev)
    if error is None and not fresh:
        gplan, dst = plan.global_plan, plan.routing.dst
    else:   # a failed rank plans too (from the same counts), so it returns a plan of the right kind
        gplan, planner_flags = buf._plan(gathered[:, _HEADER:], total_num_tokens, local_tokens=max(s, 1))
        dst = entry_rows(gplan, buf.rank, ids, s) if error is None else torch.zeros(0, dtype=torch.int64, device=dev)
    buf._errors.record(header, planner_flags)
    if error is not None:
        buf._errors.hold(error)   # raised by the deferred read, with every rank's
    recv_loff = _exchange_and_place(buf, dst, hidden_sh if error is None else None,
                                    weights_sk if error is None else None, gplan.zero_fill_ranges[buf.rank])
    if error is None and not fresh:
        return None, plan
    return gplan.cu_seqlens[buf.rank].to(torch.int32), _comm_plan(buf, gplan, dst, recv_loff, s)


def _exchange_and_place(buf: Any, dst: torch.Tensor, hidden_sh: Optional[torch.Tensor],
                        weights_sk: Optional[torch.Tensor], zero_fill: torch.Tensor) -> torch.Tensor:
    """Send every destination its entries' rows and metadata (fixed shapes), place what arrived here; return
    ``recv_loff`` ``[R, S*K]``. ``hidden_sh`` None: this rank routes nothing (its checks failed)."""
    R, S, K, H, NvS, dev = buf.R, buf.S, buf.K, buf.H, buf.NvS, buf.device
    SK, n = S * K, dst.numel()
    raw = torch.where(dst >= 0, dst, -dst - 1)
    dest = torch.full((SK,), -1, dtype=torch.int64, device=dev)
    loff = torch.full((SK,), -1, dtype=torch.int64, device=dev)
    dest[:n] = (raw // NvS).clamp(0, R - 1)
    loff[:n] = raw % NvS
    ranks = torch.arange(R, dtype=torch.int64, device=dev)
    meta = torch.where(dest[None, :] == ranks[:, None], loff[None, :], -1).to(torch.int32)
    wbits = torch.zeros(SK, dtype=torch.float32, device=dev)
    if weights_sk is not None:
        wbits[:n] = weights_sk.detach().reshape(-1)
    send_meta = torch.stack([meta, wbits.view(torch.int32).expand(R, SK)], dim=1).contiguous()
    recv_meta = torch.empty_like(send_meta)
    buf.comm.all_to_all_single("dispatch: metadata", recv_meta, send_meta)
    rows = torch.zeros(S, H, dtype=torch.bfloat16, device=dev)
    if hidden_sh is not None:
        rows[:hidden_sh.shape[0]] = hidden_sh
    recv_rows = torch.empty(R, S, H, dtype=torch.bfloat16, device=dev)
    buf.comm.all_to_all_single("dispatch: rows", recv_rows, rows.expand(R, S, H).contiguous())
    recv_loff = recv_meta[:, 0].to(torch.int64)
    at = torch.where(recv_loff >= 0, recv_loff, NvS).reshape(-1)   # absent entries: the spare row
    source_row = (ranks[:, None] * S + torch.arange(SK, device=dev)[None, :] // K).reshape(-1)
    buf._hidden_full.index_copy_(0, at, recv_rows.view(R * S, H).index_select(0, source_row))
    buf._weight_full.index_copy_(0, at, recv_meta[:, 1].contiguous().view(torch.float32).reshape(-1))
    pad = _padding_mask(zero_fill, NvS)
    buf._hidden_shard.masked_fill_(pad[:, None], 0)
    buf._weight_shard.masked_fill_(pad, 0)
    return recv_loff


def _padding_mask(zero_fill: torch.Tensor, NvS: int) -> torch.Tensor:
    """``[NvS]`` bool: the rows inside one of the ``(start, count)`` ranges (disjoint), by a difference array."""
    start, count = zero_fill[:, 0].to(torch.int64), zero_fill[:, 1].to(torch.int64)
    used = (count > 0).to(torch.int64)
    delta = torch.zeros(NvS + 1, dtype=torch.int64, device=zero_fill.device)
    delta.index_add_(0, start.clamp(0, NvS), used)
    delta.index_add_(0, (start + count).clamp(0, NvS), -used)
    return delta.cumsum(0)[:NvS] > 0


def _comm_plan(buf: Any, gplan: Any, dst: torch.Tensor, recv_loff: torch.Tensor, s: int) -> CommPlan:
    R, S, K, NvS, dev = buf.R, buf.S, buf.K, buf.NvS, buf.device
    entries = recv_loff.view(R * S, K)
    dup_groups, dup_loffs, dup_counts = _dedup_tables(entries, NvS)

    def i32(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=dev, dtype=torch.int32).contiguous()

    return CommPlan(
        dst=i32(dst), experts_to_copy=i32(gplan.experts_to_copy),
        zero_fill_ranges=i32(gplan.zero_fill_ranges[buf.rank]),
        remote_stats=i32(gplan.remote_stats[buf.rank]), dup_groups=i32(dup_groups), dup_loffs=i32(dup_loffs),
        dup_counts=i32(dup_counts), N=s * K, R=R, E=buf.E, NvS=NvS, K=K, B=buf.B, nvs_s=gplan.nvs_s,
        rank=buf.rank, cu_seqlens=i32(gplan.cu_seqlens[buf.rank]), global_plan=gplan,
        num_received=(recv_loff >= 0).sum(), routing=FixedRoutes(s, dst, recv_loff), buffer_uid=buf.uid)


def _dedup_tables(entries: torch.Tensor, NvS: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MoonEP's dedup structures (``routing.dedup_tables``) from ``[pairs, K]`` received shard rows (``-1``:
    none), pairs in (source, token) order, the received-row order of the lockstep path: fixed shapes, with
    every absent row written to a spare row that is cut off."""
    pairs, K = entries.shape
    dev = entries.device
    present = entries >= 0
    count = present.sum(1)
    grouped = count >= 2
    first_k = torch.argmax(present.to(torch.int8), dim=1)
    primary = entries.gather(1, first_k[:, None]).squeeze(1)
    n_dup = torch.where(grouped, count - 1, 0)
    dup_start = torch.cumsum(n_dup, 0) - n_dup
    at = torch.where(grouped, torch.cumsum(grouped.to(torch.int64), 0) - 1, NvS)
    groups = torch.zeros(NvS + 1, 3, dtype=torch.int64, device=dev)
    groups.index_copy_(0, at, torch.stack([primary, dup_start, n_dup], dim=1))
    is_dup = present & (torch.arange(K, device=dev)[None, :] != first_k[:, None])
    dup_at = torch.where(is_dup, dup_start[:, None] + torch.cumsum(is_dup.to(torch.int64), 1) - 1, NvS)
    loffs = torch.zeros(NvS + 1, dtype=torch.int64, device=dev)
    loffs.index_copy_(0, dup_at.reshape(-1), entries.reshape(-1))
    return groups[:NvS], loffs[:NvS], torch.stack([grouped.sum(), n_dup.sum()])


# -- combine ----------------------------------------------------------------------------------------------------
def combine(buf: Any, plan: Any, hidden_nvsh: Any, route_weights_nvs: Any, zero_copy: bool,
            router_weights_zero_copy: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The sync-free combine of ``buf``: ``(hidden_sh [s, H] bf16, route_weights_sk [s, K] fp32 or None)``.
    Collective: two fixed-size ``all_to_all_single`` on every rank."""
    R, S, K, H, NvS, dev = buf.R, buf.S, buf.K, buf.H, buf.NvS, buf.device
    error: Optional[Exception] = None
    try:
        buf._check_combine_inputs(plan, hidden_nvsh, route_weights_nvs, zero_copy, router_weights_zero_copy)
        if not isinstance(plan.routing, FixedRoutes):
            raise buf._reuse_error(plan, plan.num_tokens)
    except Exception as exc:  # noqa: BLE001 - raised by the deferred read, so every rank stays in step
        error = exc
        buf._errors.hold(exc)
    merged = torch.zeros(R, S, H, dtype=torch.bfloat16, device=dev)
    # the route weights of every entry slot, then this rank's flag (every peer learns of a failed check)
    weights_back = torch.zeros(R, S * K + 1, dtype=torch.float32, device=dev)
    weights_back[:, -1] = 0.0 if error is None else float(_HOST_CHECK)
    if error is None:
        if not zero_copy:
            buf._hidden_shard[:hidden_nvsh.shape[0]].copy_(hidden_nvsh)
        entries = plan.routing.recv_loff.view(R, S, K)
        present = entries >= 0
        at = torch.where(present, entries, NvS)
        acc = torch.zeros(R, S, H, dtype=torch.float32, device=dev)
        for k in range(K):   # k order: the lockstep path's order (primary, then its duplicates)
            acc += torch.where(present[:, :, k, None], buf._hidden_full[at[:, :, k]].float(), 0.0)
        merged = acc.to(torch.bfloat16)
        if route_weights_nvs is not None:
            rows = route_weights_nvs.shape[0]
            got = route_weights_nvs[at.view(R, S * K).clamp_max(rows - 1)]
            weights_back[:, :-1] = torch.where(present.view(R, S * K), got, 0.0)
    back = torch.empty(R, S, H, dtype=torch.bfloat16, device=dev)
    buf.comm.all_to_all_single("combine: rows", back, merged)
    weights_recv = torch.empty_like(weights_back)
    buf.comm.all_to_all_single("combine: route weights", weights_recv, weights_back)
    buf._errors.bits[:R].bitwise_or_(weights_recv[:, -1].to(torch.int64))
    if error is not None:   # outputs of the right kind, no tokens' worth
        s = plan.num_tokens if isinstance(plan, CommPlan) else 0
        return (torch.zeros(s, H, dtype=torch.bfloat16, device=dev),
                None if route_weights_nvs is None else torch.zeros(s, K, dtype=torch.float32, device=dev))
    routes: FixedRoutes = plan.routing
    s = routes.s
    out = torch.zeros(s, H, dtype=torch.float32, device=dev)
    for d in range(R):   # rank order: the lockstep path's order of a token's destinations
        out += back[d, :s].float()
    weights_sk = None
    if route_weights_nvs is not None:
        raw = torch.where(routes.dst >= 0, routes.dst, -routes.dst - 1)
        dest = (raw // NvS).clamp(0, R - 1)
        weights_sk = weights_recv[:, :s * K].gather(0, dest[None, :]).view(s, K)
    return out.to(torch.bfloat16), weights_sk
