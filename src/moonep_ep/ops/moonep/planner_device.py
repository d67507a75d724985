"""MoonEP's dispatch planner as tensor ops on the counts' device, with no device→host read.

The host planner (:mod:`.planner`, :mod:`.planner_push`) is the contract; this
module computes the same :class:`~.planner.DispatchPlan` /
:class:`~.planner_push.PushDispatchPlan`, field by field, from a ``[R, E]``
integer tensor ``T`` on any device, as MoonEP's release plans on its GPUs
(docs/design/moonep.md §4.11). Every operation has a shape fixed by
``(R, E, B)``: no ``.item()``, ``.tolist()``, ``nonzero``, ``bincount`` or
loop whose trip count depends on the counts. The two greedy loops of §4.2 and
§4.3 run a static number of masked steps instead (``R - 1`` and
``R - 1 + epn``, their proven bounds); a finished loop's extra steps change
nothing.

The value checks of :func:`~.planner.check_counts` (negative counts, sums not
``s*K``, ``s`` outside ``[1, S]``, uneven ``s`` in uniform mode, a wrong
``total_num_tokens``; push: a row that is not ``S*K``) need the counts'
values, so here they set bits of a device ``int32`` flag (:data:`FLAG_BITS`)
instead of raising; :func:`raise_on_flags` reads it (one host read, where the
caller can afford it) and raises the host planner's ConfigError. Shape, dtype
and layout limits are host-known and raise at once, as in the host planner.

Internally every step carries a leading batch axis ``N`` (independent
routings with one shape), which lets the property test plan thousands of
routings in a few calls; the public functions plan one (``N = 1``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ...errors import config_error
from .limits import DispatchShape, as_int, check_shape
from .planner import DispatchPlan, check_counts
from .planner_push import PushDispatchPlan, plan_push_dispatch, push_nvs_rows

__all__ = ["FLAG_BITS", "plan_dispatch_device", "plan_push_dispatch_device", "plan_batch", "raise_on_flags"]

#: Bits of the device error flag: which check of the counts failed (0: none).
FLAG_BITS = {
    1: "a negative count",
    2: "a rank's counts sum to a value that is not a multiple of K",
    4: "a rank routes no tokens",
    8: "a rank routes more than S tokens",
    16: "ranks route different token counts in uniform mode",
    32: "total_num_tokens differs from the tokens routed",
    64: "push: a rank does not route exactly S*K entries",
    128: "planner invariant broken (cu_seqlens past nvs_s): a planner bug",
}

#: ``(shape, allocT [N, R, E], remote [N, R, E]) -> key [N, R, E]``: slots are the ``B`` largest keys
#: (``-1`` = not a candidate), in descending key order; keys of candidates are distinct per row.
SlotKey = Callable[[DispatchShape, torch.Tensor, torch.Tensor], torch.Tensor]
#: ``(shape, slots [N, R, B]) -> expert of each group [N, R, G]`` (``-1`` = empty group).
GroupOrder = Callable[[DispatchShape, torch.Tensor], torch.Tensor]


# ---------------------------------------------------------------------------
# public entry points


def plan_dispatch_device(tokens_per_expert: torch.Tensor, *, S: int, K: int, E: int, R: int, B: Optional[int] = None,
                         token_padding: int = 128, total_num_tokens: Optional[int] = None,
                         local_tokens: Optional[int] = None, rank: Optional[int] = None
                         ) -> tuple[DispatchPlan, torch.Tensor]:
    """:func:`~.planner.plan_dispatch` on ``tokens_per_expert``'s device, without reading it back.

    ``total_num_tokens`` is the varlen total (a host int, as in the host
    planner); in uniform mode (``None``) the plan's total is ``R *
    local_tokens``, the calling rank's ``s`` (which the host planner would
    read from the counts). Returns ``(plan, flags)``: the plan's tensors on
    the counts' device and a 0-d ``int32`` flag (:data:`FLAG_BITS`, 0 when the
    counts pass every check of :func:`~.planner.check_counts`). A plan whose
    flag is non-zero is meaningless.
    """
    shape = check_shape(rank, S=S, K=K, E=E, R=R, B=B, token_padding=token_padding)
    T = _device_counts(rank, tokens_per_expert, shape)
    if total_num_tokens is None:
        local = as_int(rank, "local_tokens", local_tokens,
                       "pass this rank's token count s in uniform mode (total_num_tokens=None)")
        total, uniform = shape.R * local, True
    else:
        total = as_int(rank, "total_num_tokens", total_num_tokens, "pass an int or None")
        uniform = False
    # pull rows this step may write: ceil(entries / R) + 2*epn paddings, as plan_dispatch.
    nvs_s = -(-total * shape.K // shape.R) + (shape.token_padding - 1) * 2 * shape.epn
    out, flags = plan_batch(T[None], shape, _one(total, T), _one(nvs_s, T), uniform, push=False)
    return _to_plan(DispatchPlan, shape, out, 0, total, nvs_s), flags[0]


def plan_push_dispatch_device(tokens_per_expert: torch.Tensor, *, S: int, K: int, E: int, R: int,
                              token_padding: int = 128, rank: Optional[int] = None
                              ) -> tuple[PushDispatchPlan, torch.Tensor]:
    """:func:`~.planner_push.plan_push_dispatch` on the counts' device: ``(plan, flags)`` as
    :func:`plan_dispatch_device` (flag 64 where a row is not exactly ``S*K``)."""
    shape = check_shape(rank, S=S, K=K, E=E, R=R, B=None, token_padding=token_padding)
    T = _device_counts(rank, tokens_per_expert, shape)
    nvs_s = push_nvs_rows(shape.S, shape.K, shape.E, shape.R, shape.token_padding)
    total = shape.R * shape.S
    out, flags = plan_batch(T[None], shape, _one(total, T), _one(nvs_s, T), True, push=True)
    return _to_plan(PushDispatchPlan, shape, out, 0, total, nvs_s), flags[0]


def raise_on_flags(flags: torch.Tensor, tokens_per_expert: Any, shape: DispatchShape,
                   total_num_tokens: Optional[int], push: bool = False, rank: Optional[int] = None) -> None:
    """Read ``flags`` (one device→host read) and, when set, raise the host planner's ConfigError
    for the same counts (its messages name the rank, the value and the fix)."""
    bits = int(flags)
    if not bits:
        return
    if push:
        plan_push_dispatch(tokens_per_expert, S=shape.S, K=shape.K, E=shape.E, R=shape.R,
                           token_padding=shape.token_padding, rank=rank)
    else:
        check_counts(rank, tokens_per_expert, shape, total_num_tokens)
    # The host checks passed but the device flagged (e.g. a local_tokens that disagrees with the counts).
    raise config_error(rank, "the device planner flagged the counts: " +
                       "; ".join(why for bit, why in FLAG_BITS.items() if bits & bit), bits,
                       "pass every rank's bincount(topk, minlength=E) and this rank's token count")


def _device_counts(rank: Optional[int], tokens_per_expert: Any, shape: DispatchShape) -> torch.Tensor:
    """Host-known checks of the counts tensor (dtype, shape): they need no read."""
    fix = f"pass the all-gathered tokens_per_expert of every rank as an integer [R, E] = [{shape.R}, {shape.E}] tensor"
    if not isinstance(tokens_per_expert, torch.Tensor):
        raise config_error(rank, "tokens_per_expert must be a torch.Tensor for the device planner",
                           type(tokens_per_expert).__name__, fix)
    t = tokens_per_expert.detach()
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise config_error(rank, "tokens_per_expert must have an integer dtype", t.dtype, fix)
    if tuple(t.shape) != (shape.R, shape.E):
        raise config_error(rank, "tokens_per_expert has the wrong shape", tuple(t.shape), fix)
    return t.to(torch.int64)


def _one(value: int, like: torch.Tensor) -> torch.Tensor:
    return torch.full((1,), value, dtype=torch.int64, device=like.device)


def _to_plan(plan_type: type[DispatchPlan], shape: DispatchShape, out: dict[str, torch.Tensor], i: int,
             total: int, nvs_s: int) -> DispatchPlan:
    return plan_type(S=shape.S, K=shape.K, E=shape.E, R=shape.R, B=shape.B, token_padding=shape.token_padding,
                     total_num_tokens=total, nvs_s=nvs_s,
                     **{name: t[i].to(torch.int32).contiguous() for name, t in out.items()})


# ---------------------------------------------------------------------------
# the pipeline, batched over a leading axis N


def plan_batch(T: torch.Tensor, shape: DispatchShape, total_tokens: torch.Tensor, nvs_s: torch.Tensor,
               uniform: bool, push: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """§4.1–4.6 for ``N`` routings of one shape: ``T`` ``[N, R, E]`` int64 on any device,
    ``total_tokens`` and ``nvs_s`` ``[N]`` (host-known per routing, copied to the device). Returns every tensor field
    of the plan with a leading ``N`` axis (int64) and the ``[N]`` int32 flags."""
    dev = T.device
    total_tokens, nvs_s = total_tokens.to(dev, torch.int64), nvs_s.to(dev, torch.int64)
    flags = _count_flags(T, shape, total_tokens, uniform, push)
    C = T.sum(1)                                                    # [N, E]
    cap, balance = _global_counts(C, shape)
    z = _receiver_quotas(balance)
    alloc = _split_tokens(C, z, shape)
    slot_key, group_order = (_key_by_id, _own_experts_then_slots) if push else (_key_by_count, _every_expert_then_slots)
    tables = _destination_tables(alloc, shape, slot_key, group_order)
    route_count, route_row = _entry_routes(T, alloc, tables["expert_off"])
    over = (tables["cu_seqlens"][..., -1] > nvs_s[:, None]).any(-1)
    flags = flags | torch.where(over, 128, 0).to(torch.int32)
    out = {
        "tokens_per_expert": T, "num_tokens": T.sum(2) // shape.K, "tpe_cumsum": T.cumsum(1), "cap": cap, "z": z,
        "alloc": alloc, "alloc_cumsum": alloc.cumsum(2), **tables, "route_count": route_count, "route_row": route_row,
    }
    return out, flags


def _count_flags(T: torch.Tensor, shape: DispatchShape, total_tokens: torch.Tensor, uniform: bool,
                 push: bool) -> torch.Tensor:
    """The value checks of ``check_counts`` (and the push row rule) as bits, one int per routing."""
    rows = T.sum(2)                                                 # [N, R] entries per rank
    s = rows // shape.K
    checks = [
        (T < 0).flatten(1).any(1),
        (rows % shape.K != 0).any(1),
        (s < 1).any(1),
        (s > shape.S).any(1),
        (s != s[:, :1]).any(1) if uniform else torch.zeros_like(rows[:, 0], dtype=torch.bool),
        s.sum(1) != total_tokens,
        (rows != shape.N).any(1) if push else torch.zeros_like(rows[:, 0], dtype=torch.bool),
    ]
    flags = torch.zeros_like(rows[:, 0], dtype=torch.int32)
    for i, bad in enumerate(checks):
        flags = flags | torch.where(bad, 1 << i, 0).to(torch.int32)
    return flags


def _first_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Max along the last axis and the index of its first occurrence (§4.8: first index on ties),
    explicit rather than relying on ``argmax``'s tie order."""
    n = x.shape[-1]
    mx = x.amax(-1, keepdim=True)
    idx = torch.where(x == mx, torch.arange(n, device=x.device), n).amin(-1)
    return mx.squeeze(-1), idx


def _global_counts(C: torch.Tensor, shape: DispatchShape) -> tuple[torch.Tensor, torch.Tensor]:
    """§4.1: ``cap[d] = total // R + (d < total % R)`` and each home group's surplus."""
    R = shape.R
    total = C.sum(1, keepdim=True)                                  # [N, 1]
    d = torch.arange(R, device=C.device)
    cap = total // R + (d < total % R).to(torch.int64)              # [N, R]
    balance = C.view(C.shape[0], R, shape.epn).sum(2) - cap
    return cap, balance


def _receiver_quotas(balance: torch.Tensor) -> torch.Tensor:
    """§4.2 in ``R - 1`` masked steps. Each effective step zeroes a receiver for good (it can neither
    donate nor receive again), and the last donor is never zeroed, so ``R - 1`` steps finish the loop."""
    N, R = balance.shape
    ar = torch.arange(R, device=balance.device)
    z = torch.zeros(N, R * R, dtype=torch.int64, device=balance.device)
    b = balance.clone()
    for _ in range(R - 1):
        bmax, h = _first_max(b)                                     # first max: donor
        neg_min, u = _first_max(-b)                                 # first min: receiver
        move = torch.where(bmax > 0, neg_min, 0)                    # -balance[u], 0 once done
        z.scatter_add_(1, (h * R + u)[:, None], move[:, None])
        b = b - move[:, None] * (ar == h[:, None])
        b = torch.where((ar == u[:, None]) & (bmax > 0)[:, None], 0, b)
    return z.view(N, R, R)


def _split_tokens(C: torch.Tensor, z: torch.Tensor, shape: DispatchShape) -> torch.Tensor:
    """§4.3 for every donor group at once, in ``R - 1 + epn`` masked steps: each effective step
    empties a quota or an expert (``take`` is the smaller), a donor has at most ``R - 1`` quotas and
    ``epn`` experts, and empties stay empty. Returns ``alloc`` ``[N, E, R]``."""
    N, R, epn, E = C.shape[0], shape.R, shape.epn, shape.E
    q = z.clone()                                                   # [N, h, d]
    rem = C.view(N, R, epn).clone()                                 # [N, h, j]
    moves = torch.zeros(N, R, epn * R, dtype=torch.int64, device=C.device)
    for _ in range(R - 1 + epn):
        qmax, d = _first_max(q)                                     # largest quota, first d
        rmax, j = _first_max(rem)                                   # fullest expert, first j
        take = torch.where((qmax > 0) & (rmax > 0), torch.minimum(qmax, rmax), 0)
        q.scatter_add_(2, d[..., None], -take[..., None])
        rem.scatter_add_(2, j[..., None], -take[..., None])
        moves.scatter_add_(2, (j * R + d)[..., None], take[..., None])
    moves = moves.view(N, E, R)
    home = (torch.arange(E, device=C.device)[:, None] // epn == torch.arange(R, device=C.device)).to(torch.int64)
    return home * (C - moves.sum(2))[..., None] + moves


def _key_by_count(shape: DispatchShape, allocT: torch.Tensor, remote: torch.Tensor) -> torch.Tensor:
    """pull slots: (count, id) descending (§4.8), as one integer key."""
    e = torch.arange(shape.E, device=allocT.device)
    return torch.where(remote, allocT * shape.E + e, -1)


def _key_by_id(shape: DispatchShape, allocT: torch.Tensor, remote: torch.Tensor) -> torch.Tensor:
    """push slots: every remote expert, ascending id (§4.9)."""
    e = torch.arange(shape.E, device=allocT.device)
    return torch.where(remote, shape.E - 1 - e, -1)


def _every_expert_then_slots(shape: DispatchShape, slots: torch.Tensor) -> torch.Tensor:
    """pull groups (``E + B``): every expert by id, ``-1`` where it is slotted on ``d``, then the slots."""
    N, R, E = slots.shape[0], shape.R, shape.E
    slotted = torch.zeros(N, R, E + 1, dtype=torch.bool, device=slots.device)
    slotted.scatter_(2, torch.where(slots >= 0, slots, E), True)    # column E absorbs the unused slots
    e = torch.arange(E, device=slots.device).expand(N, R, E)
    return torch.cat([torch.where(slotted[..., :E], -1, e), slots], 2)


def _own_experts_then_slots(shape: DispatchShape, slots: torch.Tensor) -> torch.Tensor:
    """push groups (``2*epn``): ``d``'s own experts, then its slots."""
    R, epn = shape.R, shape.epn
    own = torch.arange(R, device=slots.device)[:, None] * epn + torch.arange(epn, device=slots.device)
    return torch.cat([own.expand(slots.shape[0], R, epn), slots], 2)


def _destination_tables(alloc: torch.Tensor, shape: DispatchShape, slot_key: SlotKey,
                        group_order: GroupOrder) -> dict[str, torch.Tensor]:
    """§4.5 for every destination at once: slots, group layout, padding, expert offsets."""
    N, R, E, B, tp, epn = alloc.shape[0], shape.R, shape.E, shape.B, shape.token_padding, shape.epn
    dev = alloc.device
    allocT = alloc.transpose(1, 2)                                  # [N, d, e]
    owner = torch.arange(E, device=dev) // epn
    remote = (allocT > 0) & (owner != torch.arange(R, device=dev)[:, None])
    key = slot_key(shape, allocT, remote)
    k = min(B, E)
    vals, idx = key.topk(k, dim=2, largest=True, sorted=True)       # candidates' keys are distinct
    slots = torch.where(vals >= 0, idx, -1)
    if B > k:  # B > E: the extra slots are never used
        slots = torch.cat([slots, slots.new_full((N, R, B - k), -1)], 2)
    copy_owner = torch.where(slots >= 0, slots // epn, -1)
    # remote_stats[o, 1]: slots anywhere holding o's experts (column R absorbs the unused slots).
    held = torch.zeros(N, R + 1, dtype=torch.int64, device=dev)
    held.scatter_add_(1, torch.where(copy_owner >= 0, copy_owner, R).flatten(1), torch.ones_like(slots).flatten(1))
    remote_stats = torch.stack([remote.sum(2), held[:, :R]], 2)

    groups = group_order(shape, slots)                              # [N, R, G]
    cnt = torch.where(groups >= 0, allocT.gather(2, groups.clamp_min(0)), 0)
    padded = (cnt + tp - 1) // tp * tp
    ends = padded.cumsum(2)
    start = ends - padded
    fills = torch.where((padded > cnt)[..., None], torch.stack([start + cnt, padded - cnt], 3), 0)
    # Each expert is in at most one non-empty group per destination; column E absorbs the rest.
    expert_off = torch.full((N, R, E + 1), -1, dtype=torch.int64, device=dev)
    expert_off.scatter_(2, torch.where(cnt > 0, groups, E), start)
    return {"experts_to_copy": slots, "copy_owner": copy_owner, "remote_stats": remote_stats,
            "cu_seqlens": ends, "zero_fill_ranges": fills, "expert_off": expert_off[..., :E]}


def _entry_routes(T: torch.Tensor, alloc: torch.Tensor, expert_off: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """§4.6, as ``planner._entry_routes`` with a batch axis: the overlap of source ``s``'s range of
    expert ``e``'s entries with destination ``d``'s range."""
    tpe_cumsum, alloc_cumsum = T.cumsum(1), alloc.cumsum(2)
    t_lo = (tpe_cumsum - T)[..., None]                              # [N, R_src, E, 1]
    t_hi = tpe_cumsum[..., None]
    a_lo = (alloc_cumsum - alloc)[:, None]                          # [N, 1, E, R_dst]
    a_hi = alloc_cumsum[:, None]
    lo = torch.maximum(t_lo, a_lo)
    route_count = (torch.minimum(t_hi, a_hi) - lo).clamp_min(0)
    off_de = expert_off.transpose(1, 2)[:, None]                    # [N, 1, E, R_dst]
    route_row = torch.where(route_count > 0, off_de + (lo - a_lo), -1)
    return route_count, route_row
