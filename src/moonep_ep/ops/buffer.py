"""A pure-PyTorch MoonEP ``Buffer`` (Gen A, the API vLLM 0.33.0 calls) over ``torch.distributed``.

:class:`ReferenceBuffer` follows ``shared/reference/moonep_contract.md``:
the planner (§4, :mod:`moonep_ep.ops.planner`) decides where every
``(token, k)`` entry is computed, dispatch (§2.1, §5) lays the entries out in
each destination's ``[NvS, H]`` shard in ``cu_seqlens`` group order with
padding zeroed, prefetch (§2.3) fills this rank's slots from the owners'
weights, combine (§2.2, §5) sums every token's ``K`` rows back on its source
rank. The real library does this with NVLink stores and multicast from CUDA
kernels; here activations move with ``all_to_all_single`` over the group
(gloo on CPU, NCCL on GPU) and expert weights never travel through the group:
prefetch reads the owners' rows through the caller's Gen A views.

One call, rank ``r``, ``s`` tokens, ``K`` top-k, ``R`` ranks::

    dispatch   all_gather_object  (error?, s, tokens_per_expert[E], flags)   lockstep + plan input
               plan_dispatch(T[R,E])  -> identical global plan on every rank
               entry_dst(plan, r, topk) -> dst[s*K]  (rank*NvS + loff, dups as -raw-1)
               all_to_all_single  counts [R,2]        rows and entries per destination
               all_to_all_single  meta  [n,2|3] int32 (loff, primary row | -row-1, weight bits)
               all_to_all_single  rows  [P,H] bf16    one row per (token, destination)
               destination: shard[loff] = row (dups too), weights, zero padding groups
    prefetch   (Gen A) slot[b] <- full[experts_to_copy[r, b]]   local copies, no collective
    combine    destination: fp32 sum of each (token, destination)'s dup rows into its primary
               all_to_all_single  rows back [P,H] bf16 (+ weights [n] fp32 if given)
               source: out[t] = bf16(sum_k fp32(row))

**Lockstep errors.** Every entry point first checks its inputs locally and
shares the verdict in one metadata collective (:class:`GroupComm`-style), so a
bad input on any rank raises :class:`CollectiveError` on *every* rank before
any data collective could hang. Dispatch folds this into the gather of
``tokens_per_expert`` it needs anyway; combine and prefetch add one small
``all_gather_object`` (``lockstep_checks=False`` removes it, restoring
MoonEP's sync-free Gen A prefetch at the price of rank-local errors).

**Deviations from MoonEP** (each because there is no kernel to emulate):

* Errors are :class:`ConfigError` / :class:`CollectiveError`, not asserts or
  device traps; ``tokens_per_expert`` must equal ``bincount(topk)`` (MoonEP
  checks only its sum and silently corrupts the plan otherwise) and top-k
  ids must lie in ``[0, E)``.
* ``H % 128 == 0`` is checked by the constructor (MoonEP: combine).
* Work runs synchronously; ``async_finish=True`` returns an event that has
  completed (CPU) or is recorded on the current stream (CUDA), so the
  caller's ``event.wait()`` is valid. Gen A prefetch on CUDA really is
  asynchronous (side stream, see :mod:`moonep_ep.ops.prefetch`).
* ``inter_rank_sync``, ``num_sms``, ``comm_stream_priority``, ``enable_pdl``
  are accepted and validated; the lockstep collective is the entry barrier.
* ``dispatch`` always returns ``[NvS, H]`` rows (Gen A upstream), also for
  ``s < S``; rows at or past ``cu_seqlens[-1]`` are stale (whatever the
  persistent shard held), as on MoonEP.
* ``__del__`` without ``destroy()`` drops local state without the barrier:
  a collective inside a finalizer can deadlock.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import time
import warnings
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from ..errors import CollectiveError, ConfigError, config_error
from ..memory.group import GroupComm
from .planner import DispatchPlan, entry_dst, nvs_rows, plan_dispatch
from .prefetch import SideStreams, pull_slots, push_slots

__all__ = ["ReferenceBuffer", "Buffer", "CommPlan", "PrefetchStats", "WEIGHT_TILE"]

#: MoonEP kernels tile expert weights and activations by 128 (vLLM MOONEP_WEIGHT_TILE).
WEIGHT_TILE = 128
_MAX_K, _MAX_R, _MAX_NVS, _INT32_MAX = 32, 128, 2**24 - 1, 2**31 - 1
_WEIGHT_DTYPES = (torch.bfloat16, torch.int8, torch.uint8)
_SCALE_TILE_BYTES = 128 * 128
_uid = itertools.count(1)


# ---------------------------------------------------------------------------
# plan


@dataclasses.dataclass(eq=False)
class _Routing:
    """Send/receive index tables of one rank for one plan (all ``torch.int64``).

    Source side (this rank's tokens):

    * ``send_row_splits`` ``[R]`` list: rows sent to each destination, one
      per (token, destination) pair; ``send_row_token`` ``[P]``: token of
      each sent row, in send order (destination, then flat index).
    * ``send_entry_splits`` ``[R]`` list: entries per destination;
      ``send_entry_index`` ``[n]``: flat index ``t*K + k`` of each entry in
      send order.

    Destination side (rows this rank computes):

    * ``recv_row_splits`` ``[R]``: rows received from each source;
      ``recv_row_loff`` ``[P']``: shard row of each received row's primary.
    * ``recv_entry_splits`` ``[R]``: entries from each source;
      ``recv_entry_loff`` ``[n']``: shard row of each received entry;
      ``recv_entry_row`` ``[n']``: index of its payload in the received rows.
    """

    send_row_splits: list[int]
    send_row_token: torch.Tensor
    send_entry_splits: list[int]
    send_entry_index: torch.Tensor
    recv_row_splits: list[int]
    recv_row_loff: torch.Tensor
    recv_entry_splits: list[int]
    recv_entry_loff: torch.Tensor
    recv_entry_row: torch.Tensor
    pad_rows: torch.Tensor  # shard rows zeroed by dispatch (zero_fill_ranges of this rank)

    def clone(self) -> "_Routing":
        return _Routing(**{f.name: (v.clone() if isinstance(v, torch.Tensor) else list(v))
                           for f in dataclasses.fields(self) for v in [getattr(self, f.name)]})


@dataclasses.dataclass(eq=False)
class CommPlan:
    """This rank's view of one dispatch plan: MoonEP's ``MoonEPCommPlan`` fields plus reference state.

    MoonEP fields (int32, contiguous, on the buffer's device; ``G = E + B``):

    * ``dst`` ``[n]`` (``n = s*K``): entry ``i = t*K + k`` goes to
      ``raw = dest_rank*NvS + loff``; the first entry of a token on a
      destination is stored ``raw`` (primary), later ones ``-raw-1``.
    * ``experts_to_copy`` ``[R, B]``: the whole slot table, identical on every
      rank; row ``d`` = experts prefetched into rank ``d``'s slots, ``-1``
      unused.
    * ``zero_fill_ranges`` ``[G, 2]``: this rank's ``(pad_start, n_pad)``
      per group.
    * ``remote_stats`` ``[2]``: ``[#remote experts with entries here,
      #slots on all ranks holding this rank's experts]``.
    * ``dup_groups`` ``[NvS, 3]``, ``dup_loffs`` ``[NvS]``, ``dup_counts``
      ``[2]``: for every source token with several entries on this rank,
      ``(primary_loff, dup_start, dup_count)`` (valid prefix
      ``dup_counts[0]`` rows) and the duplicates' rows (prefix
      ``dup_counts[1]``). Ordered by received row; MoonEP's order is arrival
      order, so compare as sets.
    * ``N = s*K`` (varlen meaning), ``R``, ``E``, ``NvS``, ``K``, ``B``,
      ``nvs_s``; ``num_tokens = N // K``.

    Reference extras: ``rank``; ``cu_seqlens`` ``[G]`` int32 (also returned by
    dispatch); ``global_plan`` (the :class:`DispatchPlan`, CPU);
    ``num_received`` (entries this rank computes); the routing tables.
    """

    dst: torch.Tensor
    experts_to_copy: torch.Tensor
    zero_fill_ranges: torch.Tensor
    remote_stats: torch.Tensor
    dup_groups: torch.Tensor
    dup_loffs: torch.Tensor
    dup_counts: torch.Tensor
    N: int
    R: int
    E: int
    NvS: int
    K: int
    B: int
    nvs_s: int
    rank: int
    cu_seqlens: torch.Tensor
    global_plan: DispatchPlan
    num_received: int
    routing: _Routing
    buffer_uid: int

    @property
    def num_tokens(self) -> int:
        return self.N // self.K

    @property
    def slot_sources(self) -> list[tuple[int, int, int]]:
        """``(slot, expert, owner rank)`` of every used slot of this rank."""
        row = self.global_plan.experts_to_copy[self.rank].tolist()
        owners = self.global_plan.copy_owner[self.rank].tolist()
        return [(b, e, o) for b, (e, o) in enumerate(zip(row, owners)) if e >= 0]

    def clone(self) -> "CommPlan":
        fields = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            fields[f.name] = v.clone() if isinstance(v, (torch.Tensor, _Routing)) else v
        return CommPlan(**fields)


@dataclasses.dataclass
class PrefetchStats:
    """What the last ``prefetch_weight`` call did on this rank."""

    generation: str          # "A" (pull) or "B" (push)
    copies: int              # row copies issued (used slots x tensors)
    bytes: int               # bytes copied
    seconds: Optional[float]  # wall time of the copies (None when left asynchronous on CUDA)
    slots: list[tuple[int, int, int]]  # (slot, expert, owner) filled on this rank (Gen A)


class _DoneEvent:
    """Event handle of work that already completed (CPU): ``wait``/``synchronize`` return at once."""

    def wait(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


# ---------------------------------------------------------------------------
# the buffer


def _as_pos_int(rank: int, name: str, value: Any, fix: str) -> int:
    if isinstance(value, bool):
        raise config_error(rank, f"{name} must be a positive int", value, fix)
    try:
        v = operator.index(value)
    except TypeError:
        raise config_error(rank, f"{name} must be a positive int", value, fix) from None
    if v < 1:
        raise config_error(rank, f"{name} must be a positive int", value, fix)
    return v


class ReferenceBuffer:
    """MoonEP Gen A ``Buffer`` in pure PyTorch (see the module docstring).

    Collective: construct on every rank of ``group`` with identical
    arguments, after ``torch.distributed.init_process_group``.

    Args:
        S: token capacity per rank (sizes ``NvS``); each call routes
            ``1 <= s <= S`` tokens.
        H: hidden size, a multiple of 128.
        K: top-k, ``1 <= K <= 32``.
        E: routed experts, a multiple of ``num_ep_ranks``.
        num_ep_ranks: ``R``, must equal the group's size (``R <= 128``).
        num_sms: SMs of MoonEP's comm kernels (``None`` -> 32); validated, unused.
        token_padding: every non-empty group is padded to a multiple of it.
        B: prefetch slots per rank (``None`` -> ``E // R``).
        group: the EP process group (``None`` = WORLD). Backend ``nccl``
            puts every tensor on the current CUDA device; others on the CPU.
        comm_stream_priority, enable_pdl: accepted for signature
            compatibility; unused.
        explicitly_destroy: ``True``: ``__del__`` warns if ``destroy()`` was
            not called; ``False``: ``__del__`` releases local state.
        lockstep_checks: share every input check in one metadata collective
            so errors raise on all ranks (default); ``False`` makes Gen A
            prefetch free of collectives, like MoonEP.
        timeout_s: wait bound of the lockstep helper (default
            ``MOONEP_EP_TIMEOUT_S``).

    Sizes: ``epn = E // R``; ``NvS = S*K + (token_padding-1)*2*epn``
    (``_ctx["NvS"]``, read by vLLM 0.33.0).
    """

    def __init__(self, S: int, H: int, K: int, E: int, num_ep_ranks: int, num_sms: Optional[int] = None,
                 token_padding: int = 128, B: Optional[int] = None, group: Any = None,
                 comm_stream_priority: int = -1, enable_pdl: bool = True, explicitly_destroy: bool = False,
                 *, lockstep_checks: bool = True, timeout_s: Optional[float] = None):
        self._destroyed = True  # until construction succeeds (__del__ must not act on a half object)
        self.explicitly_destroy = bool(explicitly_destroy)
        self.comm = GroupComm(group, timeout_s)
        self.group = group
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self.lockstep_checks = bool(lockstep_checks)
        backend = str(dist.get_backend(group)).lower()
        if "nccl" in backend:
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        error: Optional[ConfigError] = None
        config: Any = None
        try:
            config = self._validate_config(S, H, K, E, num_ep_ranks, num_sms, token_padding, B)
        except ConfigError as exc:
            error = exc
        everyone = self._lockstep("Buffer.__init__", error, config)
        if any(c != everyone[0] for c in everyone):
            differing = [r for r, c in enumerate(everyone) if c != everyone[0]]
            names = ("S", "H", "K", "E", "num_ep_ranks", "num_sms", "token_padding", "B")
            raise ConfigError(
                f"[rank {self.rank}] ranks disagree on the Buffer arguments: ranks {differing} differ from rank 0 "
                f"({dict(zip(names, everyone[0]))} vs rank {differing[0]}: {dict(zip(names, everyone[differing[0]]))})."
                " Fix: construct the Buffer with the same arguments on every rank (vLLM: the same DP-max capacity)")
        (self.S, self.H, self.K, self.E, self.R, self.num_sms, self.token_padding, self.B) = config
        self.epn = self.E // self.R
        self.NvS = nvs_rows(self.S, self.K, self.E, self.R, self.token_padding)
        self.uid = next(_uid)
        self._ctx = {"NvS": self.NvS, "S": self.S, "H": self.H, "K": self.K, "E": self.E, "R": self.R,
                     "B": self.B, "epn": self.epn, "token_padding": self.token_padding, "num_sms": self.num_sms,
                     "N": self.S * self.K}
        # Persistent shard (MoonEP's hidden_buf / weight region of meta_buf): dispatch writes it,
        # combine reads it; rows past a call's cu_seqlens[-1] keep earlier contents (stale).
        self._hidden_shard = torch.zeros(self.NvS, self.H, dtype=torch.bfloat16, device=self.device)
        self._weight_shard = torch.zeros(self.NvS, dtype=torch.float32, device=self.device)
        self._streams = SideStreams()
        self.last_prefetch: Optional[PrefetchStats] = None
        self._destroyed = False

    # -- validation helpers ---------------------------------------------------------------
    def _validate_config(self, S: Any, H: Any, K: Any, E: Any, R: Any, num_sms: Any, tp: Any, B: Any) -> tuple:
        r = self.rank
        S = _as_pos_int(r, "S (token capacity per rank)", S, "pass the largest per-rank token count, e.g. 128")
        H = _as_pos_int(r, "H (hidden size)", H, f"pass the model's hidden size (a multiple of {WEIGHT_TILE})")
        if H % WEIGHT_TILE:
            raise config_error(r, f"H (hidden size) must be a multiple of {WEIGHT_TILE} (MoonEP tiles rows by 128)",
                               H, f"pad the hidden size to {-(-H // WEIGHT_TILE) * WEIGHT_TILE}")
        K = _as_pos_int(r, "K (top-k)", K, f"pass 1 <= K <= {_MAX_K}")
        if K > _MAX_K:
            raise config_error(r, f"K (top-k) must be <= {_MAX_K} (MoonEP kmask bitset)", K, f"use K <= {_MAX_K}")
        R = _as_pos_int(r, "num_ep_ranks", R, f"pass the EP group size ({self.world_size})")
        if R != self.world_size:
            raise config_error(r, f"num_ep_ranks must equal the process group's size {self.world_size}", R,
                               f"pass num_ep_ranks={self.world_size} or the matching group")
        if R > _MAX_R:
            raise config_error(r, f"num_ep_ranks must be <= {_MAX_R} (MoonEP duplicate bitset)", R,
                               f"use at most {_MAX_R} EP ranks")
        E = _as_pos_int(r, "E (routed experts)", E, f"pass a positive multiple of num_ep_ranks={R}")
        if E % R:
            lo, hi = (E // R) * R, (E // R + 1) * R
            raise config_error(r, f"E (routed experts) must be a multiple of num_ep_ranks={R} "
                               "(each rank owns E/R experts)", E,
                               f"use E={hi}" + (f" or E={lo}" if lo else "") + f", or an EP size dividing {E}")
        num_sms = 32 if num_sms is None else _as_pos_int(r, "num_sms", num_sms, "pass a positive int or None (= 32)")
        tp = _as_pos_int(r, "token_padding", tp, "pass a positive int, e.g. 128 (1 = no padding)")
        epn = E // R
        B = epn if B is None else _as_pos_int(r, "B (prefetch slots per rank)", B, f"pass a positive int or None (= E/R = {epn})")
        N = S * K
        if N >= _INT32_MAX:
            raise config_error(r, "S*K must be < 2^31-1 (int32 entry indices)", N, "lower S or K")
        NvS = nvs_rows(S, K, E, R, tp)
        if NvS > _MAX_NVS:
            raise config_error(r, "NvS = S*K + (token_padding-1)*2*E/R exceeds 2^24-1 (MoonEP packs loff in 24 bits)",
                               NvS, "lower S, K or token_padding")
        if R * NvS > _INT32_MAX:
            raise config_error(r, "R*NvS exceeds 2^31-1 (int32 dst)", R * NvS, "lower S, K, token_padding or R")
        return (S, H, K, E, R, num_sms, tp, B)

    def _lockstep(self, step: str, error: Optional[BaseException], payload: Any = None) -> list[Any]:
        """One metadata collective: everyone's verdict and payload; raise everywhere if any rank failed."""
        message = None if error is None else f"{type(error).__name__}: {error}"
        gathered = self.comm.all_gather_object((message, payload))
        failures = {r: m for r, (m, _) in enumerate(gathered) if m is not None}
        if failures:
            exc = CollectiveError(step, failures, rank=self.rank)
            if error is not None:
                raise exc from error
            raise exc
        return [p for _, p in gathered]

    def _check_alive(self, what: str) -> None:
        if self._destroyed:
            raise config_error(self.rank, f"{what} called on a destroyed Buffer", "destroyed",
                               "create a new Buffer (destroy() is final)")

    def _check_tensor(self, name: str, t: Any, dtype: torch.dtype, shape: Sequence[Optional[int]], fix: str) -> torch.Tensor:
        r = self.rank
        if not isinstance(t, torch.Tensor):
            raise config_error(r, f"{name} must be a torch.Tensor", type(t).__name__, fix)
        if t.dtype != dtype:
            raise config_error(r, f"{name} must be {str(dtype).replace('torch.', '')}", t.dtype, fix)
        if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape)):
            want = "[" + ", ".join("*" if x is None else str(x) for x in shape) + "]"
            raise config_error(r, f"{name} must have shape {want}", tuple(t.shape), fix)
        if t.device != self.device:
            raise config_error(r, f"{name} must be on {self.device}", t.device, f"move it with .to('{self.device}')")
        return t

    def _check_plan(self, plan: Any) -> "CommPlan":
        if not isinstance(plan, CommPlan):
            raise config_error(self.rank, "plan must be the CommPlan returned by this Buffer's dispatch",
                               type(plan).__name__, "pass the plan from dispatch() (save it for prefetch and combine)")
        if plan.buffer_uid != self.uid or plan.rank != self.rank:
            raise config_error(self.rank, "plan was made by another Buffer or rank", (plan.buffer_uid, plan.rank),
                               "use the plan returned by this Buffer's dispatch on this rank")
        return plan

    # -- properties -----------------------------------------------------------------------
    @property
    def destroyed(self) -> bool:
        return self._destroyed

    @property
    def hidden_nvsh_buffer_view(self) -> torch.Tensor:
        """``[NvS, H]`` bf16: this rank's persistent shard (aliases comm state; never save for autograd)."""
        self._check_alive("hidden_nvsh_buffer_view")
        return self._hidden_shard

    @property
    def router_weight_buffer_view(self) -> torch.Tensor:
        """``[NvS]`` fp32: this rank's persistent route-weight shard."""
        self._check_alive("router_weight_buffer_view")
        return self._weight_shard

    def _event(self) -> Any:
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            return event
        return _DoneEvent()

    # -- dispatch ---------------------------------------------------------------------------
    def dispatch(self, hidden_sh: torch.Tensor, route_weights_sk: Optional[torch.Tensor] = None,
                 topk_experts_sk: Optional[torch.Tensor] = None, tokens_per_expert: Optional[torch.Tensor] = None,
                 plan: Optional[CommPlan] = None, async_finish: bool = False, *, inter_rank_sync: bool = True,
                 zero_copy: bool = False, router_weights_zero_copy: bool = False,
                 total_num_tokens: Optional[int] = None) -> tuple:
        """Send every ``(token, k)`` entry to the row the plan gives it (collective).

        Args:
            hidden_sh: ``[s, H]`` bf16, ``1 <= s <= S``.
            route_weights_sk: ``[s, K]`` fp32 or ``None`` (no weight shard).
            topk_experts_sk: ``[s, K]`` int32 expert ids in ``[0, E)``
                (required for a fresh plan; repeats allowed).
            tokens_per_expert: ``[E]`` int32, ``bincount(topk, minlength=E)``
                (required for a fresh plan).
            plan: a saved :class:`CommPlan` to reuse (combine backward): no
                planning; ``topk``/``tokens_per_expert`` ignored; returned
                ``cu_seqlens`` is ``None``.
            async_finish: also return an event (already complete here).
            zero_copy: return the persistent shard itself instead of a copy.
            router_weights_zero_copy: same for the route weights.
            total_num_tokens: varlen: ``sum_r s_r`` (same on every rank);
                ``None`` requires every rank to pass the same ``s``.

        Returns:
            ``(hidden_nvsh, route_weights_nvs, cu_seqlens, plan[, event])``:
            ``hidden_nvsh`` ``[NvS, H]`` bf16 in group order, padding rows
            zero, rows at or past ``cu_seqlens[-1]`` stale;
            ``route_weights_nvs`` ``[NvS]`` fp32 or ``None``; ``cu_seqlens``
            ``[E+B]`` int32 inclusive group ends (``None`` on reuse); ``plan``.
        """
        self._check_alive("dispatch")
        fresh = plan is None
        error: Optional[ConfigError] = None
        payload: Any = None
        topk = tpe = None
        try:
            s = self._check_hidden(hidden_sh)
            if route_weights_sk is not None:
                self._check_tensor("route_weights_sk", route_weights_sk, torch.float32, (s, self.K),
                                   f"pass fp32 route weights of shape [s, K] = [{s}, {self.K}] (or None)")
            if fresh:
                topk, tpe = self._check_routing(topk_experts_sk, tokens_per_expert, s)
            else:
                self._check_plan(plan)
                if plan.num_tokens != s:
                    raise config_error(self.rank, f"reused plan was made for {plan.num_tokens} tokens", s,
                                       "pass the same number of tokens as the dispatch that made the plan")
            if total_num_tokens is not None:
                total_num_tokens = _as_pos_int(self.rank, "total_num_tokens", total_num_tokens,
                                               "pass the sum of s over the group, or None")
                if not s <= total_num_tokens <= self.R * self.S:
                    raise config_error(self.rank, f"total_num_tokens must be in [s, R*S] = [{s}, {self.R * self.S}]",
                                       total_num_tokens, "pass the sum of s over all ranks")
            payload = (s, fresh, route_weights_sk is not None, total_num_tokens,
                       tpe.tolist() if fresh else None)
        except ConfigError as exc:
            error = exc
        everyone = self._lockstep("dispatch", error, payload)
        self._agree_flags("dispatch", everyone, {1: "a fresh plan (plan=None) vs a reused plan",
                                                  2: "route weights (given vs None)",
                                                  3: "total_num_tokens"})
        if fresh:
            gplan = plan_dispatch([p[4] for p in everyone], S=self.S, K=self.K, E=self.E, R=self.R, B=self.B,
                                  token_padding=self.token_padding, total_num_tokens=total_num_tokens, rank=self.rank)
            dst = entry_dst(gplan, self.rank, topk)
            plan = self._fresh_dispatch(gplan, dst, hidden_sh, route_weights_sk)
            cu = plan.cu_seqlens
        else:
            self._reuse_dispatch(plan, hidden_sh, route_weights_sk)
            cu = None
        hidden_nvsh = self._hidden_shard if zero_copy else self._hidden_shard.clone()
        weights_nvs = None
        if route_weights_sk is not None:
            weights_nvs = self._weight_shard if router_weights_zero_copy else self._weight_shard.clone()
        out = (hidden_nvsh, weights_nvs, cu, plan)
        return (*out, self._event()) if async_finish else out

    def _check_hidden(self, hidden_sh: Any) -> int:
        fix = f"pass bf16 tokens of shape [s, H] = [s, {self.H}] with 1 <= s <= S = {self.S}"
        if not isinstance(hidden_sh, torch.Tensor) or hidden_sh.dim() != 2:
            raise config_error(self.rank, "hidden_sh must be a 2-D tensor [s, H]",
                               tuple(hidden_sh.shape) if isinstance(hidden_sh, torch.Tensor) else type(hidden_sh).__name__,
                               fix)
        s = hidden_sh.shape[0]
        if s > self.S:
            raise config_error(self.rank, f"hidden_sh has more tokens than the capacity S={self.S}", s,
                               f"route at most S={self.S} tokens per call, or build the Buffer with S >= {s}")
        if s < 1:
            raise config_error(self.rank, "hidden_sh has no tokens (MoonEP does not support s = 0)", s,
                               "pass at least one (dummy) token")
        self._check_tensor("hidden_sh", hidden_sh, torch.bfloat16, (None, self.H), fix)
        return s

    def _check_routing(self, topk: Any, tpe: Any, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        K, E = self.K, self.E
        self._check_tensor("topk_experts_sk", topk, torch.int32, (s, K),
                           f"pass int32 expert ids of shape [s, K] = [{s}, {K}] (.to(torch.int32))")
        self._check_tensor("tokens_per_expert", tpe, torch.int32, (E,),
                           f"pass bincount(topk, minlength={E}).to(torch.int32)")
        ids = topk.detach().to("cpu", torch.int64).reshape(-1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= E):
            bad = int(ids[(ids < 0) | (ids >= E)][0])
            raise config_error(self.rank, f"topk_experts_sk holds an expert id outside [0, {E})", bad,
                               "map invalid ids to a real expert with weight 0 (vLLM maps them to expert 0)")
        counts = tpe.detach().to("cpu", torch.int64)
        hist = torch.bincount(ids, minlength=E)
        if not torch.equal(hist, counts):
            e = int(torch.nonzero(hist != counts)[0])
            raise config_error(self.rank, f"tokens_per_expert[{e}] disagrees with bincount(topk)[{e}]={int(hist[e])}",
                               int(counts[e]), "pass tokens_per_expert = bincount(topk, minlength=E) of this call")
        return topk.detach().to("cpu", torch.int64), counts

    def _agree_flags(self, step: str, everyone: list[Any], fields: dict[int, str]) -> None:
        for idx, what in fields.items():
            values = [p[idx] for p in everyone]
            if any(v != values[0] for v in values):
                raise ConfigError(f"[rank {self.rank}] {step}: ranks disagree on {what}: "
                                  f"{dict(enumerate(values))}. Fix: make the same kind of call on every rank")

    def _fresh_dispatch(self, gplan: DispatchPlan, dst: torch.Tensor, hidden_sh: torch.Tensor,
                        weights_sk: Optional[torch.Tensor]) -> CommPlan:
        R, K, NvS, rank = self.R, self.K, self.NvS, self.rank
        s = hidden_sh.shape[0]
        n = s * K
        # ---- source side: destinations, primaries, send order -------------------------------
        dst64 = dst.to(torch.int64)
        raw = torch.where(dst64 >= 0, dst64, -dst64 - 1)
        dest, loff = raw // NvS, raw % NvS
        primary = dst64 >= 0
        entry_order = torch.sort(dest, stable=True).indices          # entries grouped by destination
        entry_splits = torch.bincount(dest, minlength=R)
        # Primary of every entry: the first k of the same token landing on the same destination.
        dd = dest.view(s, K)
        first_k = (dd[:, :, None] == dd[:, None, :]).to(torch.int8).argmax(dim=2)  # first max = smallest k'
        prim_flat = (torch.arange(s)[:, None] * K + first_k).reshape(-1)
        prim_idx = torch.nonzero(primary).squeeze(1)                  # ascending flat index
        row_order = prim_idx[torch.sort(dest[prim_idx], stable=True).indices]
        row_splits = torch.bincount(dest[prim_idx], minlength=R)
        row_start = torch.cumsum(row_splits, 0) - row_splits
        pos_in_block = torch.zeros(n, dtype=torch.int64)
        pos_in_block[row_order] = torch.arange(row_order.numel()) - row_start[dest[row_order]]
        prim_row = pos_in_block[prim_flat]
        enc = torch.where(primary, prim_row, -prim_row - 1)           # MoonEP-style: dups as -x-1
        cols = [loff, enc]
        if weights_sk is not None:
            cols.append(weights_sk.detach().reshape(-1).to("cpu").view(torch.int32).to(torch.int64))
        meta_send = torch.stack(cols, dim=1)[entry_order].to(torch.int32)
        width = meta_send.shape[1]

        # ---- exchange counts, metadata, rows --------------------------------------------------
        dev = self.device
        counts_send = torch.stack([row_splits, entry_splits], dim=1).to(dev)
        counts_recv = torch.empty_like(counts_send)
        dist.all_to_all_single(counts_recv, counts_send, group=self.group)
        counts_recv = counts_recv.cpu()
        recv_row_splits = counts_recv[:, 0].tolist()
        recv_entry_splits = counts_recv[:, 1].tolist()
        expected = gplan.route_count[:, :, rank].sum(dim=1).tolist()
        if recv_entry_splits != expected:  # the plan is global: a mismatch means a bug, not bad input
            raise RuntimeError(f"[rank {rank}] received entry counts {recv_entry_splits} differ from the plan {expected}")
        meta_recv = torch.empty(sum(recv_entry_splits) * width, dtype=torch.int32, device=dev)
        dist.all_to_all_single(meta_recv, meta_send.reshape(-1).to(dev),
                               [c * width for c in recv_entry_splits], [int(c) * width for c in entry_splits.tolist()],
                               group=self.group)
        send_row_token = torch.div(row_order, K, rounding_mode="floor")
        rows_recv = self._exchange_rows(hidden_sh[send_row_token.to(dev)], row_splits.tolist(), recv_row_splits)

        # ---- destination side: place rows, dups, weights, padding ---------------------------------
        meta = meta_recv.to("cpu", torch.int64).view(-1, width)
        r_loff, r_enc = meta[:, 0], meta[:, 1]
        r_prim = r_enc >= 0
        r_local = torch.where(r_prim, r_enc, -r_enc - 1)
        src = torch.repeat_interleave(torch.arange(R), torch.tensor(recv_entry_splits, dtype=torch.int64))
        rbase = torch.cumsum(torch.tensor(recv_row_splits, dtype=torch.int64), 0) - torch.tensor(recv_row_splits)
        r_row = rbase[src] + r_local
        recv_row_loff = torch.empty(sum(recv_row_splits), dtype=torch.int64)
        recv_row_loff[r_row[r_prim]] = r_loff[r_prim]
        zf = gplan.zero_fill_ranges[rank].to(torch.int64)
        pad_rows = torch.cat([torch.arange(int(a), int(a) + int(c)) for a, c in zf.tolist() if c > 0] or
                             [torch.zeros(0, dtype=torch.int64)])
        routing = _Routing(
            send_row_splits=row_splits.tolist(), send_row_token=send_row_token,
            send_entry_splits=entry_splits.tolist(), send_entry_index=entry_order,
            recv_row_splits=recv_row_splits, recv_row_loff=recv_row_loff,
            recv_entry_splits=recv_entry_splits, recv_entry_loff=r_loff, recv_entry_row=r_row, pad_rows=pad_rows)
        self._place(routing, rows_recv, None if weights_sk is None else
                    meta[:, 2].to(torch.int32).view(torch.float32))

        # ---- dedup structures (MoonEP's builder), this rank's plan ------------------------------------
        dup_sel = torch.nonzero(~r_prim).squeeze(1)
        dup_sel = dup_sel[torch.sort(r_row[dup_sel], stable=True).indices]
        dup_rows, dup_cnt = torch.unique_consecutive(r_row[dup_sel], return_counts=True)
        n_groups, n_dups = dup_rows.numel(), dup_sel.numel()
        dup_groups = torch.zeros(NvS, 3, dtype=torch.int64)
        dup_loffs = torch.zeros(NvS, dtype=torch.int64)
        if n_groups:
            dup_groups[:n_groups, 0] = recv_row_loff[dup_rows]
            dup_groups[:n_groups, 1] = torch.cumsum(dup_cnt, 0) - dup_cnt
            dup_groups[:n_groups, 2] = dup_cnt
            dup_loffs[:n_dups] = r_loff[dup_sel]

        def i32(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=dev, dtype=torch.int32).contiguous()

        return CommPlan(
            dst=i32(dst), experts_to_copy=i32(gplan.experts_to_copy), zero_fill_ranges=i32(zf),
            remote_stats=i32(gplan.remote_stats[rank]), dup_groups=i32(dup_groups), dup_loffs=i32(dup_loffs),
            dup_counts=i32(torch.tensor([n_groups, n_dups])), N=n, R=R, E=self.E, NvS=NvS, K=K, B=self.B,
            nvs_s=gplan.nvs_s, rank=rank, cu_seqlens=i32(gplan.cu_seqlens[rank]), global_plan=gplan,
            num_received=int(r_loff.numel()), routing=routing, buffer_uid=self.uid)

    def _exchange_rows(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        """``all_to_all_single`` of ``[rows, H]`` bf16 activations (the token payload)."""
        recv = torch.empty(sum(recv_splits), send.shape[1], dtype=send.dtype, device=self.device)
        dist.all_to_all_single(recv, send.contiguous(), recv_splits, send_splits, group=self.group)
        return recv

    def _place(self, routing: _Routing, rows_recv: torch.Tensor, weights_recv: Optional[torch.Tensor]) -> None:
        """Destination side of dispatch: shard[loff] = payload (dups get their primary's row), zero padding."""
        dev = self.device
        loff = routing.recv_entry_loff.to(dev)
        self._hidden_shard[loff] = rows_recv[routing.recv_entry_row.to(dev)]
        pad = routing.pad_rows.to(dev)
        self._hidden_shard[pad] = 0
        if weights_recv is not None:
            self._weight_shard[loff] = weights_recv.to(dev)
            self._weight_shard[pad] = 0

    def _reuse_dispatch(self, plan: CommPlan, hidden_sh: torch.Tensor, weights_sk: Optional[torch.Tensor]) -> None:
        rt, dev = plan.routing, self.device
        rows_recv = self._exchange_rows(hidden_sh[rt.send_row_token.to(dev)], rt.send_row_splits, rt.recv_row_splits)
        weights_recv = None
        if weights_sk is not None:
            send = weights_sk.reshape(-1)[rt.send_entry_index.to(dev)].contiguous()
            weights_recv = torch.empty(sum(rt.recv_entry_splits), dtype=torch.float32, device=dev)
            dist.all_to_all_single(weights_recv, send, rt.recv_entry_splits, rt.send_entry_splits, group=self.group)
        self._place(rt, rows_recv, weights_recv)

    # -- combine ------------------------------------------------------------------------------
    def combine(self, plan: Optional[CommPlan] = None, hidden_nvsh: Optional[torch.Tensor] = None,
                route_weights_nvs: Optional[torch.Tensor] = None, async_finish: bool = False,
                inter_rank_sync: bool = True, *, zero_copy: bool = False,
                router_weights_zero_copy: bool = False) -> tuple:
        """Sum every token's ``K`` rows back on its source rank (collective).

        Args:
            plan: the plan of the dispatch whose rows these are.
            hidden_nvsh: ``[NvS, H]`` (or ``[plan.nvs_s, H]``) bf16 contiguous,
                rows in dispatch order (e.g. the expert FFN output).
            route_weights_nvs: optional ``[NvS]`` (or ``[nvs_s]``) fp32
                contiguous per-row weights to gather back per ``(t, k)``.
            async_finish: return an event as the third element.
            zero_copy: ``hidden_nvsh`` must be the shard view of a
                ``zero_copy`` dispatch (the FFN wrote in place).
            router_weights_zero_copy: same for the weights.

        Returns:
            ``(hidden_sh, route_weights_sk, event_or_None)``: ``hidden_sh``
            ``[s, H]`` bf16 with ``out[t] = bf16(Σ_k fp32(row_k))``
            (a token's rows on one destination are first summed there in
            fp32 and rounded once to bf16, MoonEP's combine prologue);
            ``route_weights_sk`` ``[s, K]`` fp32 or ``None``.
        """
        self._check_alive("combine")
        error: Optional[ConfigError] = None
        payload: Any = None
        try:
            self._check_plan(plan)
            rows_ok = (self.NvS, plan.nvs_s)
            fix = f"pass bf16 contiguous [NvS, H] = [{self.NvS}, {self.H}] rows in dispatch order"
            self._check_tensor("hidden_nvsh", hidden_nvsh, torch.bfloat16, (None, self.H), fix)
            if hidden_nvsh.shape[0] not in rows_ok or not hidden_nvsh.is_contiguous():
                raise config_error(self.rank, "hidden_nvsh must be contiguous with NvS (or plan.nvs_s) rows",
                                   (tuple(hidden_nvsh.shape), hidden_nvsh.is_contiguous()), fix)
            if route_weights_nvs is not None:
                self._check_tensor("route_weights_nvs", route_weights_nvs, torch.float32, (None,),
                                   f"pass fp32 contiguous [NvS] = [{self.NvS}] weights, or None")
                if route_weights_nvs.shape[0] not in rows_ok or not route_weights_nvs.is_contiguous():
                    raise config_error(self.rank, "route_weights_nvs must be contiguous with NvS (or nvs_s) rows",
                                       tuple(route_weights_nvs.shape), f"pass [{self.NvS}] fp32 weights")
            if zero_copy and hidden_nvsh.data_ptr() != self._hidden_shard.data_ptr():
                raise config_error(self.rank, "zero_copy combine needs hidden_nvsh to alias the dispatch shard",
                                   hex(hidden_nvsh.data_ptr()), "write the FFN output into the zero_copy dispatch view")
            if router_weights_zero_copy and route_weights_nvs is not None and \
                    route_weights_nvs.data_ptr() != self._weight_shard.data_ptr():
                raise config_error(self.rank, "router_weights_zero_copy needs route_weights_nvs to alias the weight shard",
                                   hex(route_weights_nvs.data_ptr()), "pass the zero-copy route_weights_nvs view")
            payload = (route_weights_nvs is not None,)
        except ConfigError as exc:
            error = exc
        if self.lockstep_checks:
            everyone = self._lockstep("combine", error, payload)
            self._agree_flags("combine", everyone, {0: "route weights (given vs None)"})
        elif error is not None:
            raise error
        elif inter_rank_sync:
            self.comm.barrier()
        rt, dev = plan.routing, self.device
        # Boundary copy into the shard (MoonEP copies unless zero_copy); the prologue works in place there.
        rows = hidden_nvsh.shape[0]
        if not zero_copy:
            self._hidden_shard[:rows].copy_(hidden_nvsh)
        Y = self._hidden_shard
        # Combine prologue: fp32 sum of every (source token, destination)'s rows into its primary, one bf16 rounding.
        prim_loff = rt.recv_row_loff.to(dev)
        acc = Y[prim_loff].float()
        dup = rt.recv_entry_loff != rt.recv_row_loff[rt.recv_entry_row]
        if bool(dup.any()):
            acc.index_add_(0, rt.recv_entry_row[dup].to(dev), Y[rt.recv_entry_loff[dup].to(dev)].float())
        merged = acc.to(torch.bfloat16)
        Y[prim_loff] = merged
        back = self._exchange_rows(merged, rt.recv_row_splits, rt.send_row_splits)
        s = plan.num_tokens
        out = torch.zeros(s, self.H, dtype=torch.float32, device=dev)
        out.index_add_(0, rt.send_row_token.to(dev), back.float())
        hidden_sh = out.to(torch.bfloat16)
        weights_sk = None
        if route_weights_nvs is not None:
            send = route_weights_nvs[rt.recv_entry_loff.to(dev)].contiguous()
            got = torch.empty(sum(rt.send_entry_splits), dtype=torch.float32, device=dev)
            dist.all_to_all_single(got, send, rt.send_entry_splits, rt.recv_entry_splits, group=self.group)
            flat = torch.empty(s * self.K, dtype=torch.float32, device=dev)
            flat[rt.send_entry_index.to(dev)] = got
            weights_sk = flat.view(s, self.K)
        return hidden_sh, weights_sk, (self._event() if async_finish else None)

    # -- prefetch ---------------------------------------------------------------------------------
    def prefetch_weight(self, plan: Optional[CommPlan] = None, async_finish: bool = False, *,
                        full_gate_weight: Optional[torch.Tensor] = None, full_up_weight: Optional[torch.Tensor] = None,
                        full_down_weight: Optional[torch.Tensor] = None, full_gate_scale: Optional[torch.Tensor] = None,
                        full_up_scale: Optional[torch.Tensor] = None, full_down_scale: Optional[torch.Tensor] = None,
                        local_gate_weight: Optional[torch.Tensor] = None, local_up_weight: Optional[torch.Tensor] = None,
                        local_down_weight: Optional[torch.Tensor] = None,
                        gate_prefetch_buffer: Optional[torch.Tensor] = None,
                        up_prefetch_buffer: Optional[torch.Tensor] = None,
                        down_prefetch_buffer: Optional[torch.Tensor] = None) -> Any:
        """Fill slots so that slot ``b`` of rank ``d`` holds ``plan.experts_to_copy[d, b]``.

        Gen A (pull; what vLLM 0.33.0 calls), keyword ``full_*``:

        * ``full_gate_weight`` ``[E+B, I, H]``, ``full_up_weight``
          ``[E+B, I, H]``, ``full_down_weight`` ``[E+B, H, I]``: contiguous,
          bf16 / int8 / uint8 (uint8 = packed MXFP4, last dim halved), both
          trailing dims multiples of 128. Rows ``[0, E)`` = experts by global
          id (over the sharded store: mappings of the owners' memory), rows
          ``[E, E+B)`` = this rank's slots.
        * Optional ``full_*_scale`` (all three or none, uint8 weights only):
          contiguous ``[E+B, ...]``, per-expert bytes a multiple of 16384;
          copied row for row like the weights.
        * For every ``b`` with ``t = experts_to_copy[rank, b] >= 0``:
          ``full[E+b] <- full[t]`` (one copy per used slot and tensor). Rows
          ``[0, E)`` and unused slots are not written. No collective beyond
          the lockstep check.

        Gen B (push), keyword ``local_*`` + ``*_prefetch_buffer``:

        * ``local_*_weight`` ``[epn, out, in]`` contiguous (this rank's
          experts); ``*_prefetch_buffer`` ``[R, epn, out, in]`` every rank's
          slot pool (rank-strided, gaps allowed), same dtype. Requires
          ``B <= epn``.
        * For every ``(r, b)`` whose expert this rank owns:
          ``pool[r][b] <- local[e - rank*epn]``, then a barrier: on return
          every rank's slots are final. Collective.

        Returns:
            ``None``, or with ``async_finish`` an event (CUDA Gen A: the copy
            stream's event, which the caller waits on; otherwise complete).
        """
        self._check_alive("prefetch_weight")
        full = {"gate": full_gate_weight, "up": full_up_weight, "down": full_down_weight}
        scales = {"gate_scale": full_gate_scale, "up_scale": full_up_scale, "down_scale": full_down_scale}
        local = {"gate": local_gate_weight, "up": local_up_weight, "down": local_down_weight}
        pools = {"gate": gate_prefetch_buffer, "up": up_prefetch_buffer, "down": down_prefetch_buffer}
        gen_a = any(v is not None for v in (*full.values(), *scales.values()))
        gen_b = any(v is not None for v in (*local.values(), *pools.values()))
        error: Optional[ConfigError] = None
        try:
            self._check_plan(plan)
            if gen_a == gen_b:
                raise config_error(self.rank, "prefetch_weight needs exactly one weight set",
                                   "both" if gen_a else "neither",
                                   "pass full_gate/up/down_weight (Gen A pull) or local_*_weight + "
                                   "*_prefetch_buffer (Gen B push)")
            if gen_a:
                tensors = self._check_gen_a(full, scales)
            else:
                self._check_gen_b(local, pools)
        except ConfigError as exc:
            error = exc
        if self.lockstep_checks or gen_b:
            # Gen B ends in a barrier, so its entry check must be collective too.
            everyone = self._lockstep("prefetch_weight", error, ("A" if gen_a else "B",))
            self._agree_flags("prefetch_weight", everyone, {0: "the prefetch generation (full_* vs local_*)"})
        elif error is not None:
            raise error
        t0 = time.perf_counter()
        if gen_a:
            row = plan.global_plan.experts_to_copy[self.rank].tolist()
            copies, nbytes, event = pull_slots(tensors, row, self.E, streams=self._streams)
            seconds = None if event is not None else time.perf_counter() - t0
            self.last_prefetch = PrefetchStats("A", copies, nbytes, seconds, plan.slot_sources)
            if event is None:
                return _DoneEvent() if async_finish else None
            if async_finish:
                return event
            torch.cuda.current_stream(self.device).wait_event(event)
            return None
        copies, nbytes, event = push_slots({k: v for k, v in local.items()}, {k: v for k, v in pools.items()},
                                           plan.global_plan.experts_to_copy, self.rank, self.epn,
                                           streams=self._streams)
        if event is not None:
            event.synchronize()  # our pushes must land before the barrier releases the readers
        self.comm.barrier()
        self.last_prefetch = PrefetchStats("B", copies, nbytes, time.perf_counter() - t0, plan.slot_sources)
        return self._event() if async_finish else None

    def _check_weight_tensor(self, name: str, t: Any, rows: int) -> torch.Tensor:
        r = self.rank
        fix = (f"pass a contiguous [{rows}, out, in] bf16/int8/uint8 tensor on {self.device} with out, in "
               f"multiples of {WEIGHT_TILE}")
        if not isinstance(t, torch.Tensor):
            raise config_error(r, f"{name} is missing (all three projections are required)", type(t).__name__, fix)
        if t.dtype not in _WEIGHT_DTYPES:
            raise config_error(r, f"{name} must be bf16, int8 or uint8", t.dtype, fix)
        if t.dim() != 3 or t.shape[0] != rows:
            raise config_error(r, f"{name} must have shape [{rows}, out, in]", tuple(t.shape), fix)
        inner = t.shape[2] * (2 if t.dtype == torch.uint8 else 1)  # uint8 packs two MXFP4 values per byte
        if t.shape[1] % WEIGHT_TILE or inner % WEIGHT_TILE:
            raise config_error(r, f"{name}'s expert dims must be multiples of {WEIGHT_TILE} (MoonEP weight tile)",
                               tuple(t.shape[1:]), f"pad the expert dims to multiples of {WEIGHT_TILE}")
        if not t.is_contiguous():
            raise config_error(r, f"{name} must be contiguous", tuple(t.stride()), "pass a contiguous tensor")
        if t.device != self.device:
            raise config_error(r, f"{name} must be on {self.device}", t.device, "use views on the Buffer's device")
        return t

    def _check_gen_a(self, full: dict, scales: dict) -> dict[str, torch.Tensor]:
        rows = self.E + self.B
        out = {name: self._check_weight_tensor(f"full_{name}_weight", t, rows) for name, t in full.items()}
        given = [k for k, v in scales.items() if v is not None]
        if given:
            if len(given) != 3:
                raise config_error(self.rank, "full_*_scale must be given for all three projections or none", given,
                                   "pass full_gate_scale, full_up_scale and full_down_scale together")
            for name, t in full.items():
                if t.dtype != torch.uint8:
                    raise config_error(self.rank, f"scales need uint8 (packed MXFP4) weights; full_{name}_weight is",
                                       t.dtype, "drop the scales for bf16/int8 weights")
            for name, t in scales.items():
                if not isinstance(t, torch.Tensor) or t.dim() < 2 or t.shape[0] != rows or not t.is_contiguous() \
                        or t.device != self.device:
                    raise config_error(self.rank, f"full_{name} must be a contiguous [{rows}, ...] tensor on "
                                       f"{self.device}", getattr(t, "shape", type(t).__name__),
                                       "pass the scale tensors of the same [E+B] layout")
                per_expert = t[0].numel() * t.element_size()
                if per_expert % _SCALE_TILE_BYTES:
                    raise config_error(self.rank, f"full_{name}: per-expert scale bytes must be a multiple of "
                                       f"{_SCALE_TILE_BYTES}", per_expert, "use MoonEP's 128x128-tiled scale layout")
                out[name] = t
        return out

    def _check_gen_b(self, local: dict, pools: dict) -> None:
        r, R, epn = self.rank, self.R, self.epn
        if self.B > epn:
            raise config_error(r, "Gen B push needs B <= E/R (the pool has E/R slots per rank)", self.B,
                               f"build the Buffer with B <= {epn}")
        for name in ("gate", "up", "down"):
            lw = self._check_weight_tensor(f"local_{name}_weight", local[name], epn)
            pool = pools[name]
            fix = (f"pass the [R, epn, out, in] = [{R}, {epn}, {lw.shape[1]}, {lw.shape[2]}] view of every "
                   "rank's slot pool (ShardedExpertStore.gen_b_pool)")
            if not isinstance(pool, torch.Tensor) or tuple(pool.shape) != (R, epn, *lw.shape[1:]):
                raise config_error(r, f"{name}_prefetch_buffer has the wrong shape",
                                   getattr(pool, "shape", type(pool).__name__), fix)
            if pool.dtype != lw.dtype or pool.device != self.device:
                raise config_error(r, f"{name}_prefetch_buffer must match local_{name}_weight's dtype and device",
                                   (pool.dtype, pool.device), fix)
            row_strides = pool[0].stride()
            want = torch.empty(epn, *lw.shape[1:], device="meta").stride()
            if row_strides != want or pool.stride(0) < epn * lw[0].numel():
                raise config_error(r, f"{name}_prefetch_buffer rows must be contiguous within each rank's pool",
                                   tuple(pool.stride()), fix)

    # -- teardown ------------------------------------------------------------------------------------
    def destroy(self) -> None:
        """Collective and idempotent: synchronize, barrier, release the shards."""
        if self._destroyed:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.comm.barrier()
        self._release()

    def _release(self) -> None:
        self._hidden_shard = torch.empty(0)
        self._weight_shard = torch.empty(0)
        self._destroyed = True

    def __del__(self) -> None:
        if getattr(self, "_destroyed", True):
            return
        try:
            if self.explicitly_destroy:
                warnings.warn("ReferenceBuffer was not destroy()ed before being garbage collected", ResourceWarning)
        except Exception:  # noqa: BLE001 - interpreter shutdown may have torn warnings down
            pass
        self._release()


#: MoonEP's class name, for code that does ``moonep.Buffer(...)``.
Buffer = ReferenceBuffer
