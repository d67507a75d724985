"""MoonEP dispatch planner (pull, ``[E+B]`` groups) as a pure function.

``plan_dispatch`` restates MoonEP's planning algorithm
(docs/design/moonep.md §4) on the host: from every rank's
``tokens_per_expert`` (all-gathered, ``[R, E]``) and the layout parameters it
computes the global tables that MoonEP's rank 0 computes and multicasts
(``alloc``, quotas, ``experts_to_copy``, ``cu_seqlens``, ``zero_fill_ranges``,
``remote_stats``, expert offsets) plus, per (source rank, expert, destination),
how many entries move and where they land. It has no randomness, no process
group and no device state, so every rank that feeds it the same gathered counts
gets a bit-identical plan.

``entry_dst`` then maps one rank's top-k ids onto destination rows (the
per-rank ``dst`` of moonep.md §4.6–4.7, duplicates encoded as ``-raw-1``).

Pipeline (moonep.md sections)::

    T[R,E] --4.1--> C, cap, balance --4.2--> z[R,R] --4.3--> alloc[E,R]
           --4.5--> experts_to_copy, cu_seqlens, zero_fill, expert_off
           --4.6--> route_count / route_row           (entry_dst: per entry)

:func:`build_plan` is the pipeline from checked counts on; the push generation
(``planner_push.py``) calls it too, with its own slot choice and group order
(the two arguments of :func:`_destination_tables` where the generations differ).

Tie-breaking follows §4.8 exactly: donor/receiver = first max/min balance;
split quota / expert = first max; pull slots by (count, id) descending, first
``B`` kept; entries in (source rank, flat index) order fill destinations in
ascending rank.

Choices where MoonEP's contract leaves room (each also noted where it applies):

* **Global plan.** MoonEP's ``MoonEPCommPlan`` is per rank (``dst`` and the
  dedup tensors belong to one rank). This planner returns the whole-group
  tables, with a leading rank axis where MoonEP keeps one row per rank
  (``remote_stats[R, 2]``, ``cu_seqlens[R, E+B]``, ``zero_fill_ranges[R, E+B, 2]``).
  ``dst`` needs the rank's top-k ids, not only counts, so it comes from
  :func:`entry_dst`. The dedup structures (``dup_groups`` ...) are written by
  MoonEP's dispatch, not by planning, and are not produced here.
* **Errors.** MoonEP asserts (``AssertionError``) or traps on the device; here
  every bad input raises :class:`moonep_ep.errors.ConfigError` naming the value
  and the fix. The kernel limits of §7 (``K <= 32``, ``R <= 128``,
  ``NvS <= 2^24-1``, ``R*NvS <= 2^31-1``, ``0 < S*K < 2^31-1``) are enforced
  too, so a configuration this planner accepts also plans on MoonEP.
* **varlen.** Per-rank ``s_r = sum(T[r]) / K`` must be an integer in
  ``[1, S]`` (``s = 0`` is unsupported upstream: pass a dummy token). With
  ``total_num_tokens=None`` every rank must route the same ``s`` (MoonEP's
  uniform mode traps otherwise); when given it must equal ``sum_r s_r``.
* **``nvs_s``** uses the pull formula (``recv_cap + extra``, not rounded up to
  ``token_padding``), matching ``NvS`` pull (``N + extra``, not rounded).
* **``B > epn``** is accepted (MoonEP only requires a positive ``B``);
  slots past ``epn`` are always ``-1`` because a destination never holds more
  than ``epn`` remote experts (§4.4).
* **``N``** is the capacity ``S*K`` (upstream meaning); the per-rank entry
  counts of this step are ``num_tokens * K``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np
import torch

from ...errors import config_error
from .limits import DispatchShape, as_int, check_shape, nvs_rows

__all__ = ["DispatchPlan", "plan_dispatch", "build_plan", "check_counts", "check_token_totals", "entry_dst",
           "entry_rows", "nvs_rows"]

#: A generation's slot choice: ``(remote experts of d in ascending id, alloc, d, B) -> slot experts in slot order``.
SlotPicker = Callable[[list[int], list[list[int]], int, int], list[int]]
#: A generation's groups: ``(d, d's slot row padded with -1 to B, shape) -> the expert of each group, -1 = empty``.
GroupOrder = Callable[[int, list[int], DispatchShape], list[int]]


@dataclasses.dataclass(frozen=True, eq=False)
class DispatchPlan(DispatchShape):
    """Global MoonEP pull dispatch plan, identical on every rank.

    All tensors are ``torch.int32``, contiguous, on the CPU. Notation:
    ``R`` ranks, ``E`` experts, ``epn = E // R``, ``B`` slots per rank,
    ``G = E + B`` groups per rank, ``owner(e) = e // epn``.

    Configuration (``int``):

    * ``S`` token capacity per rank; ``K`` top-k; ``E``; ``R``; ``B`` (pull
      prefetch slots per rank, after ``None -> epn``); ``token_padding``
      (``tp``); ``epn``.
    * ``N`` = ``S*K``, entries per rank at capacity.
    * ``NvS`` = ``S*K + (tp-1)*2*epn``: logical rows of every rank's shard and
      the rank stride of ``dst`` (pull, not rounded to ``tp``).
    * ``total_num_tokens`` = ``sum_r num_tokens[r]`` tokens this step.
    * ``nvs_s`` = ``ceil(total_num_tokens*K / R) + (tp-1)*2*epn``: shard
      prefix this step may write; ``cu_seqlens[d, -1] <= nvs_s <= NvS``.

    Inputs kept for dispatch:

    * ``tokens_per_expert`` ``[R, E]``: ``T[r, e]``, entries of rank ``r`` to
      expert ``e``.
    * ``num_tokens`` ``[R]``: ``s_r = sum_e T[r, e] / K``.
    * ``tpe_cumsum`` ``[R, E]``: ``Tcum[r, e] = sum_{r' <= r} T[r', e]``.

    Balancing (§4.1–4.3):

    * ``cap`` ``[R]``: rows rank ``d`` receives, exactly
      ``total // R + (d < total % R)`` with ``total = sum T`` (``S*K`` for
      every rank when every rank sends ``S`` tokens).
    * ``z`` ``[R, R]``: ``z[h, u]`` entries of home group ``h`` (experts owned
      by rank ``h``) computed on receiver ``u``. Each column has at most one
      non-zero entry (one remote home group per destination); ``z[h, h] == 0``.
    * ``alloc`` ``[E, R]``: entries of expert ``e`` computed on rank ``d``;
      ``alloc.sum(1) == C`` and ``alloc.sum(0) == cap``.
    * ``alloc_cumsum`` ``[E, R]``: ``Acum[e, d] = sum_{d' <= d} alloc[e, d']``.

    Per-destination tables (§4.5, pull):

    * ``experts_to_copy`` ``[R, B]``: row ``d`` = global expert ids prefetched
      into rank ``d``'s slots, in slot order (count desc, ties larger id
      first), valid ids first, ``-1`` = unused.
    * ``copy_owner`` ``[R, B]``: owner rank of ``experts_to_copy[d, b]`` (the
      rank whose weights the slot is pulled from), ``-1`` = unused slot.
    * ``remote_stats`` ``[R, 2]``: row ``d`` = ``[#remote experts with entries
      on d (slotted or not), #slots on all ranks holding d's experts]``.
    * ``cu_seqlens`` ``[R, E+B]``: row ``d`` = inclusive padded end offset of
      each group of rank ``d``'s shard (``torch._grouped_mm`` ``offs``). Group
      ``g < E`` is expert ``g`` (empty when ``g`` is slotted on ``d``), group
      ``E + b`` is slot ``b``. Every group's length is a multiple of ``tp``.
    * ``zero_fill_ranges`` ``[R, E+B, 2]``: ``(pad_start_loff, n_pad_rows)``
      of each group, ``(0, 0)`` when the group has no padding.
    * ``expert_off`` ``[R, E]``: first row (``loff``) of expert ``e``'s segment
      on rank ``d``, ``-1`` when ``alloc[e, d] == 0``. For a slotted expert it
      is the slot group's start.

    Entry routing (§4.6): the entries of source rank ``s`` to expert ``e``,
    taken in flat top-k order (``i = t*K + k`` ascending), go to destinations
    in ascending rank: the first ``route_count[s, e, 0]`` to rank 0, the next
    ``route_count[s, e, 1]`` to rank 1, ...

    * ``route_count`` ``[R, E, R]``: entries of expert ``e`` from source ``s``
      landing on destination ``d``; ``route_count.sum(2) == T`` and
      ``route_count.sum(0) == alloc``.
    * ``route_row`` ``[R, E, R]``: ``loff`` on ``d`` of the first of those
      entries (they occupy consecutive rows), ``-1`` when the count is 0.

    The two route tables are dense (``8*R*E*R`` bytes: 0.5 MiB at ``R=8,
    E=1024``), which suits the reference buffer's rank counts.
    """

    total_num_tokens: int
    nvs_s: int
    tokens_per_expert: torch.Tensor
    num_tokens: torch.Tensor
    tpe_cumsum: torch.Tensor
    cap: torch.Tensor
    z: torch.Tensor
    alloc: torch.Tensor
    alloc_cumsum: torch.Tensor
    experts_to_copy: torch.Tensor
    copy_owner: torch.Tensor
    remote_stats: torch.Tensor
    cu_seqlens: torch.Tensor
    zero_fill_ranges: torch.Tensor
    expert_off: torch.Tensor
    route_count: torch.Tensor
    route_row: torch.Tensor

    def __post_init__(self) -> None:
        # Shape/dtype self-check, as MoonEPCommPlan.__post_init__ does (G: the generation's groups per rank).
        R, E, G = self.R, self.E, self.num_groups
        shapes = {
            "tokens_per_expert": (R, E),
            "num_tokens": (R,),
            "tpe_cumsum": (R, E),
            "cap": (R,),
            "z": (R, R),
            "alloc": (E, R),
            "alloc_cumsum": (E, R),
            "experts_to_copy": (R, self.B),
            "copy_owner": (R, self.B),
            "remote_stats": (R, 2),
            "cu_seqlens": (R, G),
            "zero_fill_ranges": (R, G, 2),
            "expert_off": (R, E),
            "route_count": (R, E, R),
            "route_row": (R, E, R),
        }
        for name, shape in shapes.items():
            t = getattr(self, name)
            assert isinstance(t, torch.Tensor), name
            assert tuple(t.shape) == shape, (name, tuple(t.shape), shape)
            assert t.dtype == torch.int32 and t.is_contiguous(), name

    @property
    def num_groups(self) -> int:
        """``E + B``: grouped-GEMM groups per rank (pull)."""
        return self.E + self.B

    def tensor_fields(self) -> dict[str, torch.Tensor]:
        """Every tensor field by name (for comparison and serialisation)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }

    def same_as(self, other: "DispatchPlan") -> bool:
        """True when every field is identical (ints equal, tensors equal)."""
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, torch.Tensor):
                if not (isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)):
                    return False
            elif a != b:
                return False
        return True


# ---------------------------------------------------------------------------
# validation helpers


def _counts_array(rank: int | None, tokens_per_expert: Any, R: int, E: int) -> np.ndarray:
    """Gathered counts as an int64 ``[R, E]`` numpy array, or ConfigError."""
    fix_shape = f"pass the all-gathered tokens_per_expert of every rank as an integer [R, E] = [{R}, {E}] array"
    if isinstance(tokens_per_expert, torch.Tensor):
        t = tokens_per_expert.detach().cpu()
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise config_error(rank, "tokens_per_expert must have an integer dtype", t.dtype, fix_shape)
        arr = t.to(torch.int64).numpy()
    else:
        try:
            arr = np.asarray(tokens_per_expert)
        except Exception as exc:  # ragged nested lists and the like
            raise config_error(rank, "tokens_per_expert is not an array", type(tokens_per_expert).__name__, fix_shape) from exc
        if arr.dtype.kind not in "iu":
            raise config_error(rank, "tokens_per_expert must have an integer dtype", str(arr.dtype), fix_shape)
        if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
            raise config_error(rank, "tokens_per_expert has a count too large for int64", int(arr.max()), fix_shape)
        arr = arr.astype(np.int64)
    if arr.shape != (R, E):
        raise config_error(rank, "tokens_per_expert has the wrong shape", tuple(arr.shape), fix_shape)
    return arr


# ---------------------------------------------------------------------------
# the planner


def plan_dispatch(
    tokens_per_expert: Any,
    *,
    S: int,
    K: int,
    E: int,
    R: int,
    B: int | None = None,
    token_padding: int = 128,
    total_num_tokens: int | None = None,
    rank: int | None = None,
) -> DispatchPlan:
    """Plan one MoonEP pull dispatch from every rank's expert counts.

    Args:
        tokens_per_expert: ``[R, E]`` integer array (``torch.Tensor``, numpy
            array or nested lists): row ``r`` is rank ``r``'s
            ``bincount(topk, minlength=E)``. Each row sums to ``s_r * K`` with
            ``1 <= s_r <= S``.
        S: token capacity per rank (sizes ``NvS``).
        K: top-k, ``1 <= K <= 32``.
        E: routed experts, a multiple of ``R``.
        R: EP ranks, ``1 <= R <= 128``.
        B: pull prefetch slots per rank; ``None`` means ``epn = E // R``.
        token_padding: every non-empty group is padded up to a multiple of it.
        total_num_tokens: ``sum_r s_r`` (varlen); ``None`` requires every rank
            to route the same number of tokens (MoonEP's uniform mode).
        rank: the calling rank, used only to prefix error messages.

    Returns:
        A :class:`DispatchPlan` (int32 CPU tensors), identical for identical
        inputs.

    Raises:
        ConfigError: bad parameter or counts; the message names the offending
            value and the fix.
    """
    shape = check_shape(rank, S=S, K=K, E=E, R=R, B=B, token_padding=token_padding)
    T, num_tokens = check_counts(rank, tokens_per_expert, shape, total_num_tokens)
    # pull rows this step may write: ceil(entries / R), not rounded to token_padding, plus 2*epn paddings.
    nvs_s = -(-int(T.sum()) // shape.R) + (shape.token_padding - 1) * 2 * shape.epn
    return build_plan(DispatchPlan, shape, T, num_tokens, nvs_s, _slots_by_count, _every_expert_then_slots)


def build_plan(plan_type: type[DispatchPlan], shape: DispatchShape, T: np.ndarray, num_tokens: list[int],
               nvs_s: int, pick_slots: SlotPicker, group_experts: GroupOrder) -> DispatchPlan:
    """§4.1–4.6 from checked counts (:func:`check_counts`): the balancing both generations share, then the
    generation's layout of each destination (``pick_slots``, ``group_experts``) and the entry routes onto it."""
    epn = shape.epn
    total = int(T.sum())  # entries, = sum of tokens * K
    # Python ints from here on: the loops are short (<= R receiver picks,
    # <= R + epn split steps per group) and ints cannot overflow.
    C = [int(c) for c in T.sum(axis=0)]
    cap, balance = _global_counts(C, total, shape.R, epn)
    z = _receiver_quotas(balance)
    alloc = _split_tokens(C, z, shape.R, epn)
    tables = _destination_tables(alloc, shape, pick_slots, group_experts)

    def i32(x: Any) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64).to(torch.int32).contiguous()

    T64 = torch.from_numpy(T.copy())
    alloc64 = torch.tensor(alloc, dtype=torch.int64)
    expert_off64 = torch.tensor(tables["expert_off"], dtype=torch.int64)
    route_count, route_row = _entry_routes(T64, alloc64, expert_off64)
    plan = plan_type(
        **dataclasses.asdict(shape), total_num_tokens=sum(num_tokens), nvs_s=nvs_s,
        tokens_per_expert=T64.to(torch.int32).contiguous(),
        num_tokens=i32(num_tokens),
        tpe_cumsum=T64.cumsum(0).to(torch.int32).contiguous(),
        cap=i32(cap),
        z=i32(z),
        alloc=alloc64.to(torch.int32).contiguous(),
        alloc_cumsum=alloc64.cumsum(1).to(torch.int32).contiguous(),
        experts_to_copy=i32(tables["experts_to_copy"]),
        copy_owner=i32(tables["copy_owner"]),
        remote_stats=i32(tables["remote_stats"]),
        cu_seqlens=i32(tables["cu_seqlens"]),
        zero_fill_ranges=i32(tables["zero_fill"]),
        expert_off=expert_off64.to(torch.int32).contiguous(),
        route_count=route_count.to(torch.int32).contiguous(),
        route_row=route_row.to(torch.int32).contiguous(),
    )
    # Proven bound (cap[d] <= ceil(total / R), <= 2*epn padded segments); a failure
    # here is a planner bug, not a user error.
    assert all(row[-1] <= nvs_s for row in tables["cu_seqlens"]) and nvs_s <= plan.NvS
    return plan


def check_counts(rank: int | None, tokens_per_expert: Any, shape: DispatchShape,
                 total_num_tokens: int | None) -> tuple[np.ndarray, list[int]]:
    """The gathered ``[R, E]`` counts and each rank's token count ``s_r``, or ConfigError."""
    R, K, S = shape.R, shape.K, shape.S
    T = _counts_array(rank, tokens_per_expert, R, shape.E)
    if (T < 0).any():
        r, e = (int(x) for x in np.argwhere(T < 0)[0])
        raise config_error(rank, f"tokens_per_expert[{r}][{e}] is negative", int(T[r, e]),
                           "pass each rank's bincount(topk, minlength=E) (counts >= 0)")
    num_tokens = []
    for r, n_r in enumerate(int(x) for x in T.sum(axis=1)):
        if n_r % K != 0:
            raise config_error(rank, f"tokens_per_expert of rank {r} sums to a value that is not a multiple of K={K}",
                               n_r, "each rank's counts must sum to s*K (s tokens, K entries each); pass "
                               "bincount(topk, minlength=E)")
        s_r = n_r // K
        if s_r < 1:
            raise config_error(rank, f"rank {r} routes no tokens (sum of tokens_per_expert is 0)", n_r,
                               "MoonEP does not support s = 0: route at least one (dummy) token on every rank")
        if s_r > S:
            raise config_error(rank, f"rank {r} routes s = sum/K tokens, more than the capacity S={S}", s_r,
                               f"route at most S tokens per rank (sum of counts <= S*K = {shape.N}) or raise S")
        num_tokens.append(s_r)
    return T, check_token_totals(rank, num_tokens, total_num_tokens)


def check_token_totals(rank: int | None, num_tokens: list[int], total_num_tokens: int | None) -> list[int]:
    """The cross-rank rules on the token counts ``s_r`` (uniform mode, the varlen total), or ConfigError."""
    total_tokens = sum(num_tokens)
    if total_num_tokens is None:
        # Uniform mode: MoonEP's rank 0 traps when ranks disagree.
        if any(s_r != num_tokens[0] for s_r in num_tokens):
            raise config_error(rank, "ranks route different token counts but total_num_tokens is None", num_tokens,
                               f"pass total_num_tokens={total_tokens} (varlen) or route the same s on every rank")
    else:
        total_num_tokens = as_int(rank, "total_num_tokens", total_num_tokens,
                                  f"pass an int (here {total_tokens}) or None")
        if total_num_tokens != total_tokens:
            raise config_error(rank, "total_num_tokens differs from the tokens routed by all ranks (sum of "
                               "tokens_per_expert / K)", total_num_tokens, f"pass total_num_tokens={total_tokens}")
    return num_tokens


def _global_counts(C: list[int], total: int, R: int, epn: int) -> tuple[list[int], list[int]]:
    """§4.1: every rank's capacity ``cap[d]`` and each home group's surplus ``balance[h]``."""
    cap = [total // R + (1 if d < total % R else 0) for d in range(R)]
    balance = [sum(C[h * epn:(h + 1) * epn]) - cap[h] for h in range(R)]
    return cap, balance


def _receiver_quotas(balance: list[int]) -> list[list[int]]:
    """§4.2: ``z[h][u]`` entries the most loaded group ``h`` hands to the roomiest receiver ``u``.

    A receiver is filled completely and zeroed for good; a donor may overshoot
    and become a receiver itself. Hence at most one donor group per receiver (§4.4).
    """
    balance = list(balance)
    R = len(balance)
    z = [[0] * R for _ in range(R)]
    while True:
        h = max(range(R), key=balance.__getitem__)  # first max
        u = min(range(R), key=balance.__getitem__)  # first min
        if balance[h] <= 0:
            return z
        move = -balance[u]
        z[h][u] = move
        balance[h] -= move
        balance[u] = 0


def _split_tokens(C: list[int], z: list[list[int]], R: int, epn: int) -> list[list[int]]:
    """§4.3: ``alloc[e][d]`` entries of expert ``e`` computed on rank ``d``: the largest
    remaining quota is served by the currently fullest expert of the donor group."""
    E = len(C)
    alloc = [[0] * R for _ in range(E)]
    for e in range(E):
        alloc[e][e // epn] = C[e]
    for h in range(R):
        rem = C[h * epn:(h + 1) * epn]
        q = list(z[h])
        while True:
            d = max(range(R), key=q.__getitem__)
            if q[d] <= 0:
                break
            j = max(range(epn), key=rem.__getitem__)
            if rem[j] <= 0:  # unreachable (a donor never sends more than it has); kept as in MoonEP
                break
            take = min(rem[j], q[d])
            alloc[h * epn + j][d] += take
            alloc[h * epn + j][h] -= take
            rem[j] -= take
            q[d] -= take
    return alloc


def _slots_by_count(remote: list[int], alloc: list[list[int]], d: int, B: int) -> list[int]:
    """pull slots of destination ``d``: count desc, ties larger id first (§4.8); the first ``B``."""
    return sorted(remote, key=lambda e: (alloc[e][d], e), reverse=True)[:B]


def _every_expert_then_slots(d: int, slot_row: list[int], shape: DispatchShape) -> list[int]:
    """pull groups (``E + B``): every expert by id, empty (``-1``) where it is slotted on ``d``, then the slots."""
    slotted = set(slot_row)
    return [(-1 if g in slotted else g) for g in range(shape.E)] + slot_row


def _destination_tables(alloc: list[list[int]], shape: DispatchShape, pick_slots: SlotPicker,
                        group_experts: GroupOrder) -> dict[str, list]:
    """§4.5: each destination's slots, group layout, padding and expert offsets.

    The generation decides which remote experts take slots, in which order (``pick_slots``), and which
    expert each group computes (``group_experts``); the groups are then laid out back to back, each padded
    to a multiple of ``token_padding``.
    """
    R, E, B, tp, epn = shape.R, shape.E, shape.B, shape.token_padding, shape.epn
    experts_to_copy, cu_seqlens, zero_fill = [], [], []
    remote_stats = [[0, 0] for _ in range(R)]
    expert_off = [[-1] * E for _ in range(R)]
    for d in range(R):
        remote = [e for e in range(E) if alloc[e][d] > 0 and e // epn != d]
        slots = pick_slots(remote, alloc, d, B)
        for e in slots:
            remote_stats[e // epn][1] += 1
        remote_stats[d][0] = len(remote)
        experts_to_copy.append(slots + [-1] * (B - len(slots)))
        start, ends, fills = 0, [], []
        for e in group_experts(d, experts_to_copy[d], shape):
            cnt = alloc[e][d] if e >= 0 else 0
            padded = -(-cnt // tp) * tp
            if cnt > 0:
                expert_off[d][e] = start
            fills.append([start + cnt, padded - cnt] if padded > cnt else [0, 0])
            start += padded
            ends.append(start)
        cu_seqlens.append(ends)
        zero_fill.append(fills)
    copy_owner = [[(e // epn if e >= 0 else -1) for e in row] for row in experts_to_copy]
    return {"experts_to_copy": experts_to_copy, "copy_owner": copy_owner, "remote_stats": remote_stats,
            "cu_seqlens": cu_seqlens, "zero_fill": zero_fill, "expert_off": expert_off}


def _entry_routes(T: torch.Tensor, alloc: torch.Tensor, expert_off: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """§4.6: entries per (source, expert, destination) and the first row they land on.

    Global order of expert e's entries is (source rank, flat index); source s
    owns ``[Tprev, Tcum)`` of it and destination d takes ``[Aprev, Acum)``. The
    overlap of the two intervals is what s sends to d.
    """
    tpe_cumsum, alloc_cumsum = T.cumsum(0), alloc.cumsum(1)
    t_lo = (tpe_cumsum - T)[:, :, None]  # [R_src, E, 1]
    t_hi = tpe_cumsum[:, :, None]
    a_lo = (alloc_cumsum - alloc)[None, :, :]  # [1, E, R_dst]
    a_hi = alloc_cumsum[None, :, :]
    lo = torch.maximum(t_lo, a_lo)
    route_count = (torch.minimum(t_hi, a_hi) - lo).clamp_min(0)
    off_de = expert_off.t()[None, :, :]  # [1, E, R_dst]: expert_off[d][e]
    route_row = torch.where(route_count > 0, off_de + (lo - a_lo), torch.full_like(lo, -1))
    return route_count, route_row


# ---------------------------------------------------------------------------
# per-entry destinations


def entry_dst(plan: DispatchPlan, rank: int, topk: Any) -> torch.Tensor:
    """Destination rows of one rank's top-k entries (moonep.md §4.6–4.7).

    Args:
        plan: the plan built from the same gathered counts.
        rank: source rank whose entries these are.
        topk: ``[s, K]`` (or flat ``[s*K]``) integer expert ids of ``rank``,
            ``s = plan.num_tokens[rank]``; its histogram must equal
            ``plan.tokens_per_expert[rank]`` (MoonEP does not check this and
            silently corrupts the plan; here it raises).

    Returns:
        ``dst``: ``[s*K]`` int32. For flat entry ``i = t*K + k``,
        ``raw = d*NvS + loff`` (destination rank ``d``, shard row ``loff``).
        The first entry of token ``t`` landing on ``d`` (smallest ``k``) is
        stored as ``raw`` (primary); later entries of ``t`` on the same ``d``
        as ``-raw-1`` (duplicates: payload not sent again).

    Raises:
        ConfigError: bad rank, shape, ids out of ``[0, E)``, or a histogram
            that disagrees with the plan.
    """
    R, E, K = plan.R, plan.E, plan.K
    rank_i = as_int(None, "rank", rank, f"pass a source rank in [0, {R})")
    if not 0 <= rank_i < R:
        raise config_error(None, f"source rank must be in [0, {R})", rank, f"pass a source rank in [0, {R})")
    s = int(plan.num_tokens[rank_i])
    fix = f"pass rank {rank_i}'s top-k ids, an integer [s, K] = [{s}, {K}] tensor, the same ids whose bincount built the plan"
    t = topk if isinstance(topk, torch.Tensor) else torch.as_tensor(np.asarray(topk))
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise config_error(rank_i, "topk must have an integer dtype", t.dtype, fix)
    if t.numel() != s * K or t.dim() not in (1, 2) or (t.dim() == 2 and tuple(t.shape) != (s, K)):
        raise config_error(rank_i, "topk has the wrong shape", tuple(t.shape), fix)
    e = t.detach().cpu().reshape(-1).to(torch.int64)
    if e.numel() and (int(e.min()) < 0 or int(e.max()) >= E):
        bad = int(e[(e < 0) | (e >= E)][0])
        raise config_error(rank_i, f"topk holds an expert id outside [0, {E})", bad, fix)
    hist = torch.bincount(e, minlength=E)
    if not torch.equal(hist, plan.tokens_per_expert[rank_i].to(torch.int64)):
        ex = int(torch.nonzero(hist != plan.tokens_per_expert[rank_i].to(torch.int64))[0])
        raise config_error(
            rank_i, f"bincount(topk)[{ex}] differs from the planned tokens_per_expert[{rank_i}][{ex}]="
            f"{int(plan.tokens_per_expert[rank_i, ex])}", int(hist[ex]), fix,
        )
    return entry_rows(plan, rank_i, e, s).to(torch.int32).contiguous()


def entry_rows(plan: DispatchPlan, rank: int, e: torch.Tensor, s: int) -> torch.Tensor:
    """:func:`entry_dst` without its checks, on the device of ``e`` and the plan (no value read back):
    ``e`` is rank ``rank``'s ``[s*K]`` int64 expert ids, already checked (or made safe) by the caller.
    Returns ``[s*K]`` int64, duplicates as ``-raw-1``."""
    E, K, dev = plan.E, plan.K, e.device
    n = e.numel()
    # local_cnt[i] = #{i' < i : e[i'] == e[i]}: rank inside a stable sort by id.
    order = torch.sort(e, stable=True).indices
    sorted_e = e[order]
    first = torch.searchsorted(sorted_e, sorted_e, right=False)  # first index of each id
    local_cnt = torch.empty(n, dtype=torch.int64, device=dev)
    local_cnt[order] = torch.arange(n, dtype=torch.int64, device=dev) - first

    tcum = plan.tpe_cumsum.to(torch.int64)
    tprev = tcum[rank - 1] if rank > 0 else torch.zeros(E, dtype=torch.int64, device=dev)
    gr = tprev[e] + local_cnt  # position in expert e's global entry order
    acum = plan.alloc_cumsum.to(torch.int64)[e]  # [n, R]
    # Smallest d with Acum[e][d] > gr.
    # (clamped: only a plan of inconsistent counts, flagged by the caller, could point past the last rank)
    d = torch.searchsorted(acum, gr[:, None], right=True).squeeze(1).clamp_max(plan.R - 1)
    aprev = torch.where(d > 0, acum.gather(1, (d - 1).clamp_min(0)[:, None]).squeeze(1), torch.zeros_like(d))
    off = plan.expert_off.to(torch.int64)[d, e]
    raw = d * plan.NvS + off + (gr - aprev)

    # Dedup: an entry is a duplicate when an earlier k of the same token
    # already lands on the same destination rank.
    dd = d.reshape(s, K)
    same = dd[:, :, None] == dd[:, None, :]  # [s, k, k']
    ks = torch.arange(K, device=dev)
    earlier = ks[None, :] < ks[:, None]  # [k, k']: k' < k
    dup = (same & earlier).any(dim=2).reshape(-1)
    return torch.where(dup, -raw - 1, raw)
