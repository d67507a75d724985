"""What both reference MoonEP ``Buffer`` generations share, in pure PyTorch over ``torch.distributed``.

:class:`ReferenceBufferBase` follows MoonEP's contract (docs/design/moonep.md):
the planner (§4, :mod:`moonep_ep.ops.moonep.planner`) decides where every
``(token, k)`` entry is computed, dispatch (§2.1, §5) lays the entries out in
each destination's ``[NvS, H]`` shard in ``cu_seqlens`` group order with
padding zeroed, prefetch (§2.3, in each generation's subclass: :mod:`.pull`, :mod:`.push`)
fills the slots from the owners' weights, combine (§2.2, §5) sums every token's ``K`` rows back on its source
rank. The real library does this with NVLink stores and multicast from CUDA
kernels; here activations move with ``all_to_all_single`` over the group
(gloo on CPU, NCCL on GPU) and expert weights never travel through the group:
the pull prefetch reads the owners' rows through the caller's views, the push
prefetch writes them into the readers' slot pools.

One call, rank ``r``, ``s`` tokens, ``K`` top-k, ``R`` ranks::

    dispatch   all_gather_object  (error?, s, tokens_per_expert[E], flags)   lockstep + plan input
               plan_dispatch_device(T[R,E]) on the device -> identical global plan on every rank
               entry_dst(plan, r, topk) -> dst[s*K]  (rank*NvS + loff, dups as -raw-1)
               all_to_all_single  counts [R,2]        rows and entries per destination
               all_to_all_single  meta  [n,2|3] int32 (loff, primary row | -row-1, weight bits)
               all_to_all_single  rows  [P,H] bf16    one row per (token, destination)
               destination: shard[loff] = row (dups too), weights, zero padding groups
    prefetch   pull: slot[b] <- full[experts_to_copy[r, b]]   local copies, no collective
               push: pool[d][b] <- local[e] for the experts r owns, then a barrier
    combine    destination: fp32 sum of each (token, destination)'s dup rows into its primary
               all_to_all_single  rows back [P,H] bf16 (+ weights [n] fp32 if given)
               source: out[t] = bf16(sum_k fp32(row))

Each entry point is orchestration: **check** the inputs (``limits.py``),
**agree** (one lockstep step, ``GroupComm.step``), **plan** (``planner_device.py``,
a pure function of the gathered counts, tensor ops on the buffer's device; equal to
``planner.py``'s plan, then copied to the host for the routing), **exchange** (``all_to_all_single``
of counts, metadata and rows; ``routing.py`` decides who sends what), and
**place** (rows into the shard, padding zeroed).

**Lockstep errors.** Every entry point first checks its inputs locally and
shares the verdict in one metadata collective, so a bad input on any rank
raises :class:`CollectiveError` on *every* rank before any data collective
could hang. Dispatch folds this into the gather of
``tokens_per_expert`` it needs anyway; combine and prefetch add one small
``all_gather_object``. ``lockstep_checks=False`` is the sync-free path
(:mod:`.sync_free`): fixed-size exchanges, the plan kept on the device, every
check a bit of a device error word that :meth:`raise_deferred_errors` reads
after the step and raises on every rank alike; the pull prefetch then runs no
collective, as MoonEP's.

Where it deviates from MoonEP, and why, is listed in docs/design/ops.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import warnings
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from ...errors import CollectiveError, ConfigError, config_error
from ...memory.group import GroupComm, Lockstep
from .commplan import CommPlan, PrefetchStats
from .limits import check_hidden, check_shape, check_tensor, positive_int
from .planner import DispatchPlan, check_token_totals, entry_dst
from .planner_device import plan_dispatch_device
from .prefetch import DoneEvent, SideStreams
from . import sync_free
from .routing import Routing, dedup_tables, destination_routes, source_routes

__all__ = ["ReferenceBufferBase"]

_uid = itertools.count(1)


class ReferenceBufferBase:
    """The construction, checks, dispatch, combine and teardown both MoonEP generations share (see the
    module docstring); :class:`~.pull.ReferenceBuffer` and :class:`~.push.PushReferenceBuffer` add each
    generation's ``prefetch_weight`` (and the push one its plan and exact-``S`` rule).

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
            so errors raise on all ranks (default); ``False`` makes the pull
            prefetch free of collectives, like MoonEP.
        timeout_s: wait bound of the lockstep helper (default
            ``MOONEP_EP_TIMEOUT_S``).

    Sizes: ``epn = E // R``; ``NvS = S*K + (token_padding-1)*2*epn``
    (``_ctx["NvS"]``, read by vLLM 0.33.0).
    """

    #: ``async_finish=True`` is safe inside a CUDA graph capture: the copies fork from the current stream and the
    #: event the caller waits on joins them back (``prefetch.py``); nothing calls ``record_stream``. The real
    #: MoonEP library's async mode does (it runs on its comm stream), so under capture it is driven synchronously.
    async_capture_safe = True

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
        self.device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
        with self.comm.step("Buffer.__init__") as created:
            created.share(self._check_config(S, H, K, E, num_ep_ranks, num_sms, token_padding, B))
        everyone = created.gathered
        differing = [r for r, c in enumerate(everyone) if c != everyone[0]]
        if differing:  # every rank sees the same list: every rank raises alike
            names = ("S", "H", "K", "E", "num_ep_ranks", "num_sms", "token_padding", "B")
            raise ConfigError(
                f"[rank {self.rank}] ranks disagree on the Buffer arguments: ranks {differing} differ from rank 0 "
                f"({dict(zip(names, everyone[0]))} vs rank {differing[0]}: {dict(zip(names, everyone[differing[0]]))})."
                " Fix: construct the Buffer with the same arguments on every rank (vLLM: the same DP-max capacity)")
        (self.S, self.H, self.K, self.E, self.R, self.num_sms, self.token_padding, self.B) = everyone[self.rank]
        self.epn = self.E // self.R
        shape = check_shape(self.rank, S=self.S, K=self.K, E=self.E, R=self.R, B=self.B,
                            token_padding=self.token_padding)
        self.NvS = shape.NvS
        self.uid = next(_uid)
        self._ctx = {"NvS": self.NvS, "S": self.S, "H": self.H, "K": self.K, "E": self.E, "R": self.R,
                     "B": self.B, "epn": self.epn, "token_padding": self.token_padding, "num_sms": self.num_sms,
                     "N": self.S * self.K}
        self._alloc_shards()
        self._streams = SideStreams()
        self.last_prefetch: Optional[PrefetchStats] = None
        self._errors = sync_free.DeferredErrors(self.R, self.device)
        if not self.lockstep_checks:
            sync_free.register(self)
        self._destroyed = False

    def _alloc_shards(self) -> None:
        """The persistent shard (MoonEP's hidden_buf / weight region of meta_buf): dispatch writes it, combine
        reads it; rows past a call's cu_seqlens[-1] keep earlier contents (stale). One spare row past ``NvS``
        takes the sync-free dispatch's absent entries (``sync_free.py``); the views end before it."""
        self._hidden_full = torch.zeros(self.NvS + 1, self.H, dtype=torch.bfloat16, device=self.device)
        self._weight_full = torch.zeros(self.NvS + 1, dtype=torch.float32, device=self.device)
        self._hidden_shard = self._hidden_full[:self.NvS]
        self._weight_shard = self._weight_full[:self.NvS]

    # -- check ------------------------------------------------------------------------------
    def _check_config(self, S: Any, H: Any, K: Any, E: Any, R: Any, num_sms: Any, tp: Any, B: Any) -> tuple:
        r = self.rank
        H = check_hidden(r, H)
        R = positive_int(r, "num_ep_ranks", R, f"pass the EP group size ({self.world_size})")
        if R != self.world_size:
            raise config_error(r, f"num_ep_ranks must equal the process group's size {self.world_size}", R,
                               f"pass num_ep_ranks={self.world_size} or the matching group")
        shape = check_shape(r, S=S, K=K, E=E, R=R, B=B, token_padding=tp)
        num_sms = 32 if num_sms is None else positive_int(r, "num_sms", num_sms, "pass a positive int or None (= 32)")
        return (shape.S, H, shape.K, shape.E, shape.R, num_sms, shape.token_padding, shape.B)

    def _check_alive(self, what: str) -> None:
        if self._destroyed:
            raise config_error(self.rank, f"{what} called on a destroyed Buffer", "destroyed",
                               "create a new Buffer (destroy() is final)")

    def _check_tensor(self, name: str, t: Any, dtype: torch.dtype, shape: tuple, fix: str) -> torch.Tensor:
        return check_tensor(self.rank, self.device, name, t, dtype, shape, fix)

    def _check_plan(self, plan: Any) -> CommPlan:
        if not isinstance(plan, CommPlan):
            raise config_error(self.rank, "plan must be the CommPlan returned by this Buffer's dispatch",
                               type(plan).__name__, "pass the plan from dispatch() (save it for prefetch and combine)")
        if plan.buffer_uid != self.uid or plan.rank != self.rank:
            raise config_error(self.rank, "plan was made by another Buffer or rank", (plan.buffer_uid, plan.rank),
                               "use the plan returned by this Buffer's dispatch on this rank")
        return plan

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

    def _check_routing_shapes(self, topk: Any, tpe: Any, s: int) -> None:
        """The checks of the routing tensors that need no value (type, dtype, shape, device)."""
        self._check_tensor("topk_experts_sk", topk, torch.int32, (s, self.K),
                           f"pass int32 expert ids of shape [s, K] = [{s}, {self.K}] (.to(torch.int32))")
        self._check_tensor("tokens_per_expert", tpe, torch.int32, (self.E,),
                           f"pass bincount(topk, minlength={self.E}).to(torch.int32)")

    def _check_routing(self, topk: Any, tpe: Any, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        E = self.E
        self._check_routing_shapes(topk, tpe, s)
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

    # -- agree --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _agree(self, name: str, collective: bool = True) -> Iterator[Lockstep]:
        """The lockstep step of one entry point; without ``lockstep_checks`` (and where the
        call has no collective of its own) a local check that raises on this rank only."""
        if collective:
            with self.comm.step(name) as state:
                yield state
            return
        state = Lockstep(name)
        yield state
        state.gathered = [state.payload] * self.R

    def _same_everywhere(self, step: str, everyone: list[Any], fields: dict[int, str]) -> None:
        """Raise on every rank when ranks made different kinds of call (they all see ``everyone``)."""
        for idx, what in fields.items():
            values = [p[idx] for p in everyone]
            if any(v != values[0] for v in values):
                raise ConfigError(f"[rank {self.rank}] {step}: ranks disagree on {what}: "
                                  f"{dict(enumerate(values))}. Fix: make the same kind of call on every rank")

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
        return DoneEvent()  # CPU dispatch/combine: gloo collectives, complete on return

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
        if not self.lockstep_checks:   # no device->host read: fixed-size exchanges, errors deferred
            cu, plan = sync_free.dispatch(self, hidden_sh, route_weights_sk, topk_experts_sk, tokens_per_expert,
                                          plan, total_num_tokens)
            return self._dispatch_outputs(plan, cu, route_weights_sk is not None, async_finish, zero_copy,
                                          router_weights_zero_copy)
        fresh = plan is None
        topk = tpe = None
        with self._agree("dispatch") as agreed:
            s = self._check_hidden(hidden_sh)
            if route_weights_sk is not None:
                self._check_tensor("route_weights_sk", route_weights_sk, torch.float32, (s, self.K),
                                   f"pass fp32 route weights of shape [s, K] = [{s}, {self.K}] (or None)")
            if fresh:
                topk, tpe = self._check_routing(topk_experts_sk, tokens_per_expert, s)
            else:
                self._check_plan(plan)
                if plan.num_tokens != s or plan.routing is None or not hasattr(plan.routing, "recv_row_splits"):
                    raise self._reuse_error(plan, s)
            total_num_tokens = self._check_total(total_num_tokens, s)
            agreed.share((s, fresh, route_weights_sk is not None, total_num_tokens, tpe.tolist() if fresh else None))
        everyone = agreed.gathered
        counts = torch.tensor([p[4] for p in everyone], dtype=torch.int64, device=self.device) if fresh else None
        self._same_everywhere("dispatch", everyone, {1: "a fresh plan (plan=None) vs a reused plan",
                                                      2: "route weights (given vs None)", 3: "total_num_tokens"})
        if fresh:
            # Each rank's counts passed its own checks (a bincount of its checked ids, 1 <= s <= S); the rules
            # across ranks need only the gathered s, so the device planner's flag stays unread.
            tokens = check_token_totals(self.rank, [p[0] for p in everyone], total_num_tokens)
            gplan, _ = self._plan(counts, sum(tokens))                                       # plan
            plan = self._fresh_dispatch(gplan, topk, hidden_sh, route_weights_sk)
            cu = plan.cu_seqlens
        else:
            self._reuse_dispatch(plan, hidden_sh, route_weights_sk)
            cu = None
        return self._dispatch_outputs(plan, cu, route_weights_sk is not None, async_finish, zero_copy,
                                      router_weights_zero_copy)

    def _check_total(self, total_num_tokens: Any, s: int) -> Optional[int]:
        if total_num_tokens is None:
            return None
        total = positive_int(self.rank, "total_num_tokens", total_num_tokens,
                             "pass the sum of s over the group, or None")
        if not s <= total <= self.R * self.S:
            raise config_error(self.rank, f"total_num_tokens must be in [s, R*S] = [{s}, {self.R * self.S}]", total,
                               "pass the sum of s over all ranks")
        return total

    def _reuse_error(self, plan: CommPlan, s: int) -> Exception:
        if plan.num_tokens != s:
            return config_error(self.rank, f"reused plan was made for {plan.num_tokens} tokens", s,
                                "pass the same number of tokens as the dispatch that made the plan")
        return config_error(self.rank, "reused plan was made by a Buffer with other lockstep_checks",
                            type(plan.routing).__name__, "reuse plans within one Buffer")

    def _dispatch_outputs(self, plan: CommPlan, cu: Optional[torch.Tensor], weighted: bool, async_finish: bool,
                          zero_copy: bool, router_weights_zero_copy: bool) -> tuple:
        hidden_nvsh = self._hidden_shard if zero_copy else self._hidden_shard.clone()
        weights_nvs = None
        if weighted:
            weights_nvs = self._weight_shard if router_weights_zero_copy else self._weight_shard.clone()
        out = (hidden_nvsh, weights_nvs, cu, plan)
        return (*out, self._event()) if async_finish else out

    def _plan(self, counts: torch.Tensor, total_num_tokens: Optional[int],
              local_tokens: Optional[int] = None) -> tuple[DispatchPlan, torch.Tensor]:
        """The global plan from every rank's ``[R, E]`` counts on the device (the pull plan, planned there:
        ``planner_device.py``; the push buffer plans its own) and its device flag. ``total_num_tokens``: the
        group's token total, or None in uniform mode with this rank's ``local_tokens``. Lockstep path: every
        rule the flag checks was checked on the host (each rank's counts are a bincount of its checked ids,
        1 <= s <= S), so the flag stays unread; sync-free path: the flag goes into the deferred error word."""
        return plan_dispatch_device(counts, S=self.S, K=self.K, E=self.E, R=self.R, B=self.B,
                                    token_padding=self.token_padding, total_num_tokens=total_num_tokens,
                                    local_tokens=local_tokens, rank=self.rank)

    def _fresh_dispatch(self, gplan: DispatchPlan, topk: torch.Tensor, hidden_sh: torch.Tensor,
                        weights_sk: Optional[torch.Tensor]) -> CommPlan:
        """Exchange counts, metadata and rows of a fresh plan, then place them."""
        R, rank, dev = self.R, self.rank, self.device
        # The routing below runs on the host (all_to_all splits, entry_dst): the plan's tables in one copy.
        fields = gplan.tensor_fields()
        flat = torch.cat([t.reshape(-1) for t in fields.values()]).to("cpu")
        host, at = {}, 0
        for name, t in fields.items():
            host[name] = flat[at:at + t.numel()].view(t.shape)
            at += t.numel()
        gplan = dataclasses.replace(gplan, **host)
        dst = entry_dst(gplan, rank, topk)
        send = source_routes(dst, hidden_sh.shape[0], self.K, self.NvS, R, weights_sk)
        counts_send = torch.tensor([send.row_splits, send.entry_splits], dtype=torch.int64).t().contiguous().to(dev)
        counts_recv = torch.empty_like(counts_send)
        self.comm.all_to_all_single("dispatch: counts", counts_recv, counts_send)
        counts_recv = counts_recv.cpu()
        recv_row_splits, recv_entry_splits = counts_recv[:, 0].tolist(), counts_recv[:, 1].tolist()
        expected = gplan.route_count[:, :, rank].sum(dim=1).tolist()
        if recv_entry_splits != expected:  # the plan is global: a mismatch means a bug, not bad input
            raise RuntimeError(f"[rank {rank}] received entry counts {recv_entry_splits} differ from the plan {expected}")
        width = send.meta.shape[1]
        meta_recv = torch.empty(sum(recv_entry_splits) * width, dtype=torch.int32, device=dev)
        self.comm.all_to_all_single("dispatch: metadata", meta_recv, send.meta.reshape(-1).to(dev),
                                    [c * width for c in recv_entry_splits], [c * width for c in send.entry_splits])
        rows_recv = self._exchange_rows("dispatch: rows", hidden_sh[send.row_token.to(dev)], send.row_splits,
                                        recv_row_splits)
        zero_fill = gplan.zero_fill_ranges[rank]
        routing, weights_recv = destination_routes(send, meta_recv.to("cpu", torch.int64).view(-1, width),
                                                   recv_entry_splits, recv_row_splits, zero_fill)
        self._place(routing, rows_recv, weights_recv)
        dup_groups, dup_loffs, dup_counts = dedup_tables(routing, self.NvS)

        def i32(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=dev, dtype=torch.int32).contiguous()

        return CommPlan(
            dst=i32(dst), experts_to_copy=i32(gplan.experts_to_copy), zero_fill_ranges=i32(zero_fill),
            remote_stats=i32(gplan.remote_stats[rank]), dup_groups=i32(dup_groups), dup_loffs=i32(dup_loffs),
            dup_counts=i32(dup_counts), N=int(dst.numel()), R=R, E=self.E, NvS=self.NvS, K=self.K, B=self.B,
            nvs_s=gplan.nvs_s, rank=rank, cu_seqlens=i32(gplan.cu_seqlens[rank]), global_plan=gplan,
            num_received=int(routing.recv_entry_loff.numel()), routing=routing, buffer_uid=self.uid)

    def _exchange_rows(self, step: str, send: torch.Tensor, send_splits: list[int],
                       recv_splits: list[int]) -> torch.Tensor:
        """``all_to_all_single`` of ``[rows, H]`` bf16 activations (the token payload)."""
        recv = torch.empty(sum(recv_splits), send.shape[1], dtype=send.dtype, device=self.device)
        self.comm.all_to_all_single(step, recv, send.contiguous(), recv_splits, send_splits)
        return recv

    def _place(self, routing: Routing, rows_recv: torch.Tensor, weights_recv: Optional[torch.Tensor]) -> None:
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
        rows_recv = self._exchange_rows("dispatch (reused plan): rows", hidden_sh[rt.send_row_token.to(dev)],
                                        rt.send_row_splits, rt.recv_row_splits)
        weights_recv = None
        if weights_sk is not None:
            send = weights_sk.reshape(-1)[rt.send_entry_index.to(dev)].contiguous()
            weights_recv = torch.empty(sum(rt.recv_entry_splits), dtype=torch.float32, device=dev)
            self.comm.all_to_all_single("dispatch (reused plan): route weights", weights_recv, send,
                                        rt.recv_entry_splits, rt.send_entry_splits)
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
        if not self.lockstep_checks:   # its all-to-alls order the ranks (MoonEP's inter_rank_sync)
            hidden_sh, weights_sk = sync_free.combine(self, plan, hidden_nvsh, route_weights_nvs, zero_copy,
                                                      router_weights_zero_copy)
            return hidden_sh, weights_sk, (self._event() if async_finish else None)
        with self._agree("combine") as agreed:
            self._check_combine_inputs(plan, hidden_nvsh, route_weights_nvs, zero_copy, router_weights_zero_copy)
            agreed.share((route_weights_nvs is not None,))
        self._same_everywhere("combine", agreed.gathered, {0: "route weights (given vs None)"})
        rt, dev = plan.routing, self.device
        # Boundary copy into the shard (MoonEP copies unless zero_copy); the prologue works in place there.
        if not zero_copy:
            self._hidden_shard[:hidden_nvsh.shape[0]].copy_(hidden_nvsh)
        Y = self._hidden_shard
        # Combine prologue: fp32 sum of every (source token, destination)'s rows into its primary, one bf16 rounding.
        prim_loff = rt.recv_row_loff.to(dev)
        acc = Y[prim_loff].float()
        dup = rt.recv_entry_loff != rt.recv_row_loff[rt.recv_entry_row]
        if bool(dup.any()):
            acc.index_add_(0, rt.recv_entry_row[dup].to(dev), Y[rt.recv_entry_loff[dup].to(dev)].float())
        merged = acc.to(torch.bfloat16)
        Y[prim_loff] = merged
        back = self._exchange_rows("combine: rows", merged, rt.recv_row_splits, rt.send_row_splits)
        s = plan.num_tokens
        out = torch.zeros(s, self.H, dtype=torch.float32, device=dev)
        out.index_add_(0, rt.send_row_token.to(dev), back.float())
        hidden_sh = out.to(torch.bfloat16)
        weights_sk = None
        if route_weights_nvs is not None:
            send = route_weights_nvs[rt.recv_entry_loff.to(dev)].contiguous()
            got = torch.empty(sum(rt.send_entry_splits), dtype=torch.float32, device=dev)
            self.comm.all_to_all_single("combine: route weights", got, send, rt.send_entry_splits,
                                        rt.recv_entry_splits)
            flat = torch.empty(s * self.K, dtype=torch.float32, device=dev)
            flat[rt.send_entry_index.to(dev)] = got
            weights_sk = flat.view(s, self.K)
        return hidden_sh, weights_sk, (self._event() if async_finish else None)

    def _check_combine_inputs(self, plan: Any, hidden_nvsh: Any, route_weights_nvs: Any, zero_copy: bool,
                              router_weights_zero_copy: bool) -> None:
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

    # -- prefetch ---------------------------------------------------------------------------------
    # -- teardown ------------------------------------------------------------------------------------
    def raise_deferred_errors(self) -> None:
        """Sync-free buffers (``lockstep_checks=False``): read the device error word (one read) and raise
        :class:`CollectiveError` naming each failing rank, the value and the fix, alike on every rank (the
        word is the same on each), then clear it. Call it where a read costs nothing (vLLM: after each
        step); ``destroy()`` calls it last. A lockstep buffer raised at once: nothing to do."""
        if not self._destroyed:
            self._errors.raise_if_set(self.rank, self.E)

    def destroy(self) -> None:
        """Collective and idempotent: synchronize, barrier, release the shards, then raise a deferred error."""
        if self._destroyed:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._streams.close()  # CPU: copies still queued land before teardown, as a CUDA stream's do
        self.comm.barrier("Buffer.destroy")
        errors = self._errors
        self._release()
        errors.raise_if_set(self.rank, self.E)

    def _release(self) -> None:
        self._hidden_full = self._hidden_shard = torch.empty(0)
        self._weight_full = self._weight_shard = torch.empty(0)
        self._destroyed = True

    def __del__(self) -> None:
        if getattr(self, "_destroyed", True):
            return
        try:
            if self.explicitly_destroy:
                warnings.warn(f"{type(self).__name__} was not destroy()ed before being garbage collected", ResourceWarning)
            self._streams.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown may have torn warnings or tensors down
            pass
        self._release()

