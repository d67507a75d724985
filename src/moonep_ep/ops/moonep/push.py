"""A pure-PyTorch MoonEP ``Buffer`` of the push generation (MoonEP's public release 26/09) over ``torch.distributed``.

:class:`PushReferenceBuffer` has the release's contract (docs/design/moonep.md
§2.8) over :class:`~.base.ReferenceBufferBase` (lockstep checks, ``all_to_all_single``
exchanges, placement, combine); the push step itself is :mod:`.push_step`. What
differs from the pull generation is the contract and the plan:

* ``Buffer(S, H, K, E, num_ep_ranks, num_sms=None, token_padding=128,
  group=None, comm_stream_priority=-1, enable_pdl=True,
  explicitly_destroy=False)``: no ``B``, slots = ``epn = E/R``. ``B=`` is
  refused on every rank, naming the fix.
* ``S`` is fixed per buffer: ``dispatch`` takes exactly ``S`` tokens, ``S*K``
  routed entries (the release asserts it), refused otherwise on every rank;
  the caller pads a batch to the capacity (vLLM keeps one buffer per capacity).
* ``NvS = S*K + (tp-1)*2*epn`` rounded up to a multiple of ``token_padding``;
  ``hidden_nvsh`` is ``[NvS, H]`` and ``combine`` takes exactly ``NvS`` rows.
* ``cu_seqlens`` ``[2*epn]``: this rank's own experts (group ``g`` = expert
  ``rank*epn + g``), then its slots (group ``epn + b`` = slot ``b``, holding
  ``plan.experts_to_copy[rank, b]``), planned by :mod:`~moonep_ep.ops.moonep.planner_push`
  (slots in ascending expert id, as the release's planner).
* ``prefetch_weight(plan, async_finish=False, *, local_{gate,up,down}_weight
  [epn, out, in], {gate,up,down}_prefetch_buffer [R, epn, out, in], optional
  local_*_scale + *_scale_prefetch_buffer)``: every owner pushes its experts
  into the slot pools of the ranks that need them, between two barriers
  (collective, in stream order): the first waits until every rank has read its slots of the
  previous layer (write after read: the pool is shared by all layers), the
  second until every push landed (``push_step.py``). The experts then read
  ``[2*epn]`` rows: ``ShardedExpertStore.push_view``.
* ``async_finish`` on every call returns an event (complete on CPU: the gloo
  collectives and the host-side push have finished on return); ``zero_copy``
  on ``dispatch``/``combine`` as in the pull generation.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from ...errors import config_error
from ...layout.store import FFN_PROJECTIONS
from .base import ReferenceBufferBase
from .push_step import check_push_args, run_push
from .limits import INT32_MAX, MAX_NVS
from .planner import DispatchPlan
from .planner_device import plan_push_dispatch_device
from .planner_push import push_nvs_rows

__all__ = ["PushReferenceBuffer", "push_prefetch"]


class PushReferenceBuffer(ReferenceBufferBase):
    """MoonEP's release ``Buffer`` (push generation) in pure PyTorch (see the module docstring).

    Collective: construct on every rank of ``group`` with identical arguments,
    after ``torch.distributed.init_process_group``. ``lockstep_checks`` and
    ``timeout_s`` are the reference buffer's (keyword-only, not MoonEP's).
    """

    def __init__(self, S: int, H: int, K: int, E: int, num_ep_ranks: int, num_sms: Optional[int] = None,
                 token_padding: int = 128, group: Any = None, comm_stream_priority: int = -1,
                 enable_pdl: bool = True, explicitly_destroy: bool = False, *, lockstep_checks: bool = True,
                 timeout_s: Optional[float] = None, **unexpected: Any):
        self._destroyed = True  # until construction succeeds
        self._slot_count_given = unexpected.pop("B", _ABSENT)
        if unexpected:  # what Python would say, for every other unknown keyword
            raise TypeError(f"PushReferenceBuffer() got an unexpected keyword argument {next(iter(unexpected))!r}")
        if isinstance(group, int) and not isinstance(group, bool):  # pull-style Buffer(S, H, K, E, R, sms, tp, B)
            raise config_error(dist.get_rank() if dist.is_initialized() else None,
                               "the 8th positional argument of the push Buffer is group, not B", group,
                               "drop B (the push generation has E/R slots per rank) and pass group= by keyword")
        super().__init__(S, H, K, E, num_ep_ranks, num_sms, token_padding, None, group, comm_stream_priority,
                         enable_pdl, explicitly_destroy, lockstep_checks=lockstep_checks, timeout_s=timeout_s)
        self.NvS = push_nvs_rows(self.S, self.K, self.E, self.R, self.token_padding)
        self._alloc_shards()
        self._ctx.pop("B")
        self._ctx["NvS"] = self.NvS

    # -- check (inside the reference buffer's lockstep steps: a refusal raises on every rank) ---------------
    def _check_config(self, S: Any, H: Any, K: Any, E: Any, R: Any, num_sms: Any, tp: Any, B: Any) -> tuple:
        if self._slot_count_given is not _ABSENT:
            raise config_error(self.rank, "the push generation (MoonEP's release) has no B: every rank has "
                               "E/R slots", self._slot_count_given,
                               "drop B=, or use ReferenceBuffer (the pull generation, MOONEP_EP_MOONEP_API=pull) "
                               "to choose B")
        checked = super()._check_config(S, H, K, E, R, num_sms, tp, None)
        S, _, K, E, R, _, tp, _ = checked
        nvs = push_nvs_rows(S, K, E, R, tp)
        if nvs > MAX_NVS or R * nvs > INT32_MAX:
            raise config_error(self.rank, "NvS = S*K + (token_padding-1)*2*E/R rounded up to token_padding "
                               f"exceeds MoonEP's row limits (NvS <= {MAX_NVS}, R*NvS <= {INT32_MAX})", nvs,
                               "lower S, K or token_padding")
        return checked

    def _check_hidden(self, hidden_sh: Any) -> int:
        s = super()._check_hidden(hidden_sh)
        if s != self.S:
            raise config_error(self.rank, f"the push generation routes exactly S*K = {self.S}*{self.K} = "
                               f"{self.S * self.K} entries per call (S is fixed per Buffer); hidden_sh has {s} "
                               f"tokens ({s * self.K} entries)", s * self.K,
                               f"pad the batch to the capacity S={self.S} (dummy tokens with route weight 0), "
                               f"or use a Buffer built with S={s}")
        return s

    def _check_routing_shapes(self, topk: Any, tpe: Any, s: int) -> None:
        if isinstance(topk, torch.Tensor) and topk.numel() != self.S * self.K:
            raise config_error(self.rank, f"the push generation routes exactly S*K = {self.S * self.K} entries "
                               "per call; topk_experts_sk holds", topk.numel(),
                               f"pass [S, K] = [{self.S}, {self.K}] ids, padded to the capacity")
        super()._check_routing_shapes(topk, tpe, s)

    # -- plan ---------------------------------------------------------------------------------------------
    def _plan(self, counts: torch.Tensor, total_num_tokens: Optional[int],
              local_tokens: Optional[int] = None) -> tuple[DispatchPlan, torch.Tensor]:
        """The push plan on the counts' device (``planner_device.py``, equal to ``planner_push.py``'s) and its
        flag (every row ``S*K``: checked per rank in :meth:`_check_routing_shapes`), as the pull plan's."""
        return plan_push_dispatch_device(counts, S=self.S, K=self.K, E=self.E, R=self.R,
                                         token_padding=self.token_padding, rank=self.rank)

    # -- the release's calls ------------------------------------------------------------------------------
    def dispatch(self, hidden_sh: torch.Tensor, route_weights_sk: Optional[torch.Tensor] = None,
                 topk_experts_sk: Optional[torch.Tensor] = None, tokens_per_expert: Optional[torch.Tensor] = None,
                 plan: Any = None, async_finish: bool = False, *, inter_rank_sync: bool = True,
                 zero_copy: bool = False, router_weights_zero_copy: bool = False) -> tuple:
        """Send every ``(token, k)`` entry to the row the plan gives it (collective).

        ``hidden_sh`` ``[S, H]`` bf16, ``topk_experts_sk`` ``[S, K]`` int32 and
        ``tokens_per_expert`` ``[E]`` int32 (a fresh plan), or a saved ``plan``
        (reuse: ``cu_seqlens`` is ``None``). Returns ``(hidden_nvsh [NvS, H],
        route_weights_nvs [NvS] | None, cu_seqlens [2*epn] int32 | None,
        plan[, event])``: rows in group order (own experts, then slots),
        padding rows zero, rows at or past ``cu_seqlens[-1]`` stale.
        """
        return super().dispatch(hidden_sh, route_weights_sk, topk_experts_sk, tokens_per_expert, plan, async_finish,
                                inter_rank_sync=inter_rank_sync, zero_copy=zero_copy,
                                router_weights_zero_copy=router_weights_zero_copy)

    def prefetch_weight(self, plan: Any = None, async_finish: bool = False, *,
                        local_gate_weight: Optional[torch.Tensor] = None,
                        local_up_weight: Optional[torch.Tensor] = None,
                        local_down_weight: Optional[torch.Tensor] = None,
                        gate_prefetch_buffer: Optional[torch.Tensor] = None,
                        up_prefetch_buffer: Optional[torch.Tensor] = None,
                        down_prefetch_buffer: Optional[torch.Tensor] = None,
                        local_gate_scale: Optional[torch.Tensor] = None, local_up_scale: Optional[torch.Tensor] = None,
                        local_down_scale: Optional[torch.Tensor] = None,
                        gate_scale_prefetch_buffer: Optional[torch.Tensor] = None,
                        up_scale_prefetch_buffer: Optional[torch.Tensor] = None,
                        down_scale_prefetch_buffer: Optional[torch.Tensor] = None) -> Any:
        """Push this rank's experts into every slot that holds one of them, then a barrier (collective).

        ``local_*_weight`` ``[epn, out, in]`` contiguous (bf16, int8 or uint8),
        ``*_prefetch_buffer`` ``[R, epn, out, in]`` (every rank's slot pool,
        ``ShardedExpertStore.push_pool``); optional scales (uint8 weights only,
        all six or none, per-expert bytes a multiple of 16 KiB) travel in the
        same push. Work queued after the return (CUDA: on the current stream) reads
        ``plan.experts_to_copy[d, b]`` in slot ``b`` of every rank ``d``; no host read of the table. Returns
        ``None``, or with ``async_finish`` an event (complete on CPU).
        """
        self._check_alive("prefetch_weight")
        push_prefetch(self, plan, local_gate_weight=local_gate_weight, local_up_weight=local_up_weight,
                      local_down_weight=local_down_weight, gate_prefetch_buffer=gate_prefetch_buffer,
                      up_prefetch_buffer=up_prefetch_buffer, down_prefetch_buffer=down_prefetch_buffer,
                      local_gate_scale=local_gate_scale, local_up_scale=local_up_scale,
                      local_down_scale=local_down_scale, gate_scale_prefetch_buffer=gate_scale_prefetch_buffer,
                      up_scale_prefetch_buffer=up_scale_prefetch_buffer,
                      down_scale_prefetch_buffer=down_scale_prefetch_buffer)
        return self._event() if async_finish else None


def push_prefetch(buffer: ReferenceBufferBase, plan: Any, **keywords: Optional[torch.Tensor]) -> None:
    """The push prefetch of ``plan`` over ``buffer``'s group: the keywords of the push ``prefetch_weight``
    checked in one lockstep step (``lockstep_checks=False``: on this rank only, as every entry point's), then
    the push of weights and scales between its two barriers (``push_step.run_push``: write after read, read
    after write); ``buffer.last_prefetch`` records it. Any reference buffer's plan works, so the tests can push
    the slots a pull plan chose and compare them with the pull's."""
    local = {p: keywords.get(f"local_{p}_weight") for p in FFN_PROJECTIONS}
    pools = {p: keywords.get(f"{p}_prefetch_buffer") for p in FFN_PROJECTIONS}
    local_scales = {p: keywords.get(f"local_{p}_scale") for p in FFN_PROJECTIONS}
    scale_pools = {p: keywords.get(f"{p}_scale_prefetch_buffer") for p in FFN_PROJECTIONS}
    # Not a barrier the push relies on: run_push orders itself after every rank's reads (write after read)
    with buffer._agree("prefetch_weight", buffer.lockstep_checks):
        buffer._check_plan(plan)
        local, pools = check_push_args(buffer.rank, buffer.device, local, pools, local_scales, scale_pools,
                                       buffer.R, buffer.epn, buffer.B)
    buffer.last_prefetch = run_push(buffer, plan, local, pools)  # weights + scales, then the barrier


_ABSENT = object()
