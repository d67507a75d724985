"""The reference MoonEP ``Buffer`` of the pull generation: the API vLLM 0.33.0 calls (upstream's "Gen A").

:class:`ReferenceBuffer` is :class:`~.base.ReferenceBufferBase` (construction,
checks, dispatch, combine, teardown) with the pull prefetch: each rank copies
the experts its slots need from the owners' rows, through the caller's
``[E+B]`` views (over the sharded store: mappings of the owners' memory). No
collective beyond the lockstep check; ``lockstep_checks=False`` removes that
one too, as in MoonEP.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

from ...errors import config_error
from .base import ReferenceBufferBase
from .commplan import CommPlan, PrefetchStats
from .limits import WEIGHT_TILE, check_pull_weights
from .prefetch import pull_slots, wait_for_slots

__all__ = ["ReferenceBuffer", "Buffer", "CommPlan", "PrefetchStats", "WEIGHT_TILE"]


class ReferenceBuffer(ReferenceBufferBase):
    """MoonEP's pull ``Buffer`` in pure PyTorch; the arguments are :class:`~.base.ReferenceBufferBase`'s
    (``B`` = prefetch slots per rank, ``None`` -> ``E // R``)."""

    def prefetch_weight(self, plan: Optional[CommPlan] = None, async_finish: bool = False, *,
                        full_gate_weight: Optional[torch.Tensor] = None, full_up_weight: Optional[torch.Tensor] = None,
                        full_down_weight: Optional[torch.Tensor] = None, full_gate_scale: Optional[torch.Tensor] = None,
                        full_up_scale: Optional[torch.Tensor] = None,
                        full_down_scale: Optional[torch.Tensor] = None) -> Any:
        """Fill slots so that slot ``b`` of this rank holds ``plan.experts_to_copy[rank, b]``.

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
          ``[0, E)`` and unused slots are not written.

        Returns:
            ``None`` (the slots are ready for the current stream), or with
            ``async_finish`` the copy stream's event, which the caller waits on
            with ``prefetch.wait_for_slots`` before any slot is read (CPU: the
            copies land then).
        """
        self._check_alive("prefetch_weight")
        full = {"gate": full_gate_weight, "up": full_up_weight, "down": full_down_weight}
        scales = {"gate_scale": full_gate_scale, "up_scale": full_up_scale, "down_scale": full_down_scale}
        with self._agree("prefetch_weight", self.lockstep_checks):
            self._check_plan(plan)
            if all(v is None for v in full.values()):
                raise config_error(self.rank, "the pull prefetch_weight needs full_gate/up/down_weight", "none",
                                   "pass the three [E+B] views (the push generation's local_*_weight keywords "
                                   "belong to PushReferenceBuffer, MOONEP_EP_MOONEP_API=push)")
            tensors = check_pull_weights(self.rank, self.device, full, scales, self.E + self.B)
        t0 = time.perf_counter()
        # The plan's device row: read by the copies on the device, by the stats when first asked (issue 45)
        fill = pull_slots(tensors, plan.experts_to_copy[self.rank], self.E, streams=self._streams)
        if not async_finish:
            wait_for_slots(fill.event)  # CUDA: the current stream waits; CPU: the copies land now
        timed = not async_finish and self.device.type != "cuda"
        self.last_prefetch = PrefetchStats.of_fill(fill, time.perf_counter() - t0 if timed else None, self.epn,
                                                   self.rank)
        return fill.event if async_finish else None  # async: the caller waits (wait_for_slots) before a slot read


#: MoonEP's class name, for code that does ``moonep.Buffer(...)``.
Buffer = ReferenceBuffer
