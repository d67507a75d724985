"""The plugin's capacity padding for MoonEP's prepare step (``MOONEP_EP_PADDING``).

vLLM 0.33.0's ``MoonEPPrepareAndFinalize._pad_to_capacity`` pads every step
to the buffer's capacity ``S`` with rows routed to expert 0, which makes
MoonEP's planner prefetch expert 0 onto every rank at every decode step
(``ops/decode/padding.py`` explains why). :func:`pad_to_capacity` replaces
it for the MoonEP backend; the reference buffer and the real library both
receive its rows, since it runs before ``Buffer.dispatch``.

* ``balanced`` (default): padding fills every home group's deficit, so the
  planner moves nothing unless a group's real load exceeds ``S*K``, and never
  moves a padding entry. Costs one all-gather of ``R + 1`` integers per MoE
  layer and step (each rank's real token count and its real entries per home
  group), on the EP group's device group. The padding is built from the
  gathered counts by tensor ops (``ops/decode/padding.py``): nothing is read
  back to the host, except the busiest group's load where the cost model
  below applies (its answer picks a Buffer, which the host must know).
  Where a home group's real load exceeds ``S*K`` (the planner would move
  entries whatever the padding), the cost model (``ops/decode/cost.py``)
  may run the step at a larger capacity of the pool instead, so the padding
  absorbs it: when ``S*K`` extra padding rows per rank cost less (derived)
  than moving one expert. On GPUs, or with ``MOONEP_EP_GPU_PROFILE`` set.
* ``own``: each rank's padding over its own experts; no collective.
* ``vllm``: vLLM's own padding, unchanged (A/B runs).

The policy and the cost model's inputs (profile, overrides, whether it applies) decide which collectives run
(the all-gather, a larger Buffer's construction), so they are the ones every EP rank agreed at backend
selection (``manager.decisions``, ``buffers.agree_decisions``), never re-read per rank here.

Invalid (negative) top-k ids of real rows, which vLLM maps to expert 0 with
weight 0, are mapped to the rank's own experts instead (weight 0 as well).
The step's padding matrix is kept in :data:`LAST` for the instrumentation
(``observe/stats.py`` tells real entries from padding with it).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ... import envs
from ...ops.decode.padding import expert_padding, own_padding_row, padding_ids
from ..hooks import install, is_wrapped
from ..observe.stats import LAST_PADDING, last_padding, stats_dir  # noqa: F401 - last_padding: this module's reader for tests

#: This thread's last prepare, recorded in ``stats`` (which reads it and imports nothing of this module).
LAST = LAST_PADDING


def policy(manager: Any = None) -> str:
    """The padding policy every EP rank agreed at backend selection (``manager.decisions``: ``balanced``
    all-gathers, the others do not, so ranks must not choose apart); without that agreement (no manager,
    one process) this process's ``MOONEP_EP_PADDING``."""
    decided = getattr(manager, "decisions", None)
    return decided.padding if decided is not None else envs.MOONEP_EP_PADDING


def _group_of(manager: Any, device: torch.device) -> Any:
    if device.type == "cuda" and getattr(manager, "_device_group", None) is not None:
        return manager._device_group
    return manager.cpu_group


def _gather_loads(manager: Any, local: torch.Tensor) -> torch.Tensor:
    """``[R, R + 1]``: every rank's ``[n, real entries per home group...]`` (collective)."""
    import torch.distributed as dist

    from ...memory.group import TRANSPORT_ERRORS, peer_lost_error

    group = _group_of(manager, local.device)
    out = [torch.empty_like(local) for _ in range(manager.world_size)]
    try:
        dist.all_gather(out, local, group=group)
    except TRANSPORT_ERRORS as exc:
        # The first collective of a MoE layer: a dead peer surfaces here, so it is named here, as the
        # Buffer's own steps name it (memory/group.py), not left a bare backend error.
        raise peer_lost_error("capacity padding", manager.rank, group, exc) from exc
    return torch.stack(out)   # stays where the counts are: the padding is built from it there


def pad_to_capacity(self: Any, a1: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    capacity: int, *, original: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Drop-in for ``MoonEPPrepareAndFinalize._pad_to_capacity`` (same arguments and result)."""
    from ..experts.overlap import arm, decode_sized

    manager = getattr(getattr(self, "buffer_pool", None), "_manager", None)
    step_tokens = max(real_tokens_across_dp() or [a1.shape[0]])
    arm(self, one_pass=decode_sized(step_tokens, getattr(manager, "vllm_config", None)))
    chosen = policy(manager)
    if chosen == "vllm" or manager is None:
        LAST.state = {"policy": "vllm", "real_tokens": None, "pad": None, "S": capacity}
        return original(self, a1, topk_ids, topk_weights, capacity)
    num_tokens = a1.shape[0]
    if num_tokens > capacity:
        raise ValueError(f"[rank {manager.rank}] MoonEP static buffer capacity exceeded: {num_tokens} tokens "
                         f"> S={capacity}.")
    R, rank, E, K = manager.world_size, manager.rank, self.num_global_experts, topk_ids.shape[1]
    epn = E // R
    ids = topk_ids.to(torch.int32)
    weights = topk_weights.to(torch.float32)
    # Same zero weight as vLLM, but on this rank's own experts instead of expert 0. Unconditional: asking
    # whether any id is invalid would read the device.
    invalid = ids < 0
    own = (torch.arange(ids.numel(), device=ids.device, dtype=torch.int32).reshape(ids.shape) % epn) + rank * epn
    ids = torch.where(invalid, own, ids).contiguous()
    weights = torch.where(invalid, torch.zeros_like(weights), weights).contiguous()
    a1 = a1.contiguous()
    real_tokens = pad = None
    if chosen == "balanced":
        flat = ids.reshape(-1).to(torch.int64)
        # real entries per home group, counted on the device (bincount would read its maximum back)
        counts = torch.zeros(R, dtype=torch.int64, device=ids.device).index_add_(0, flat // epn,
                                                                                 torch.ones_like(flat))
        local = torch.cat([torch.full((1,), num_tokens, dtype=torch.int64, device=ids.device), counts])
        gathered = _gather_loads(manager, local)
        real_tokens, loads = gathered[:, 0], gathered[:, 1:].sum(0)
        capacity = _capacity_by_cost(self, capacity, loads, a1.shape[1], K, E, manager)
        pad = expert_padding("balanced", real_tokens, loads, S=capacity, K=K, E=E, R=R)
        pad_row = pad[rank]
    else:
        # each rank's own-policy row needs no other rank's count; the whole matrix only for the statistics
        pad_row = own_padding_row((capacity - num_tokens) * K, rank, E=E, R=R, device=ids.device)
        if stats_dir() is not None:
            real_tokens = _dp_tokens(R)
            if real_tokens is not None and real_tokens[rank] == num_tokens:
                pad = expert_padding("own", real_tokens, None, S=capacity, K=K, E=E, R=R)
            else:
                real_tokens = None  # not one EP rank per DP rank: only this rank's row is known
    LAST.state = {"policy": chosen, "real_tokens": real_tokens, "pad": pad, "S": capacity}
    if num_tokens == capacity:
        return a1, ids, weights, num_tokens
    extra = padding_ids(pad_row, K, rows=capacity - num_tokens).to(torch.int32)
    return (F.pad(a1, (0, 0, 0, capacity - num_tokens)),
            torch.cat([ids, extra]).contiguous(),
            F.pad(weights, (0, 0, 0, capacity - num_tokens)),
            num_tokens)


def _capacity_by_cost(self: Any, capacity: int, loads: torch.Tensor, hidden: int, K: int, E: int,
                      manager: Any) -> int:
    """A larger capacity (so the padding absorbs the imbalance) where the cost model says that moving an
    expert costs more than the extra padding rows; the same on every rank (``busiest_load`` is gathered).

    A home group whose real load exceeds ``S*K`` makes MoonEP's planner move entries whatever the padding;
    doubling ``S`` adds ``S*K`` padding rows on every rank instead. Swaps the prepare step's buffer (building
    one is a collective), so every input here is agreed: the load is gathered, the cost model's inputs are
    the ones every rank agreed at backend selection (:func:`cost_inputs`)."""
    pool = self.buffer_pool
    profile, overrides, applies = cost_inputs(manager)
    if not applies:
        return capacity
    # The one host read of the balanced step, where the cost model applies (a GPU, or a profile named): the
    # capacity picks a Buffer, which the host must know. The CPU engine's runs do not read it.
    busiest_load = int(loads.max())
    if busiest_load <= capacity * K:
        return capacity
    model = _cost_model(self, hidden, K, E, profile=profile, overrides=overrides)
    if model is None:
        return capacity
    new = capacity
    while busiest_load > new * K and 2 * new <= pool.max_tokens_per_rank:
        # Extra rows on every rank vs the at-least-one expert the planner would otherwise move.
        if model.rows_seconds((2 * new - capacity) * K) >= model.copy_seconds(1):
            break
        new *= 2
    if new != capacity:
        got, self._buffer = pool.get(new)
        assert got == new, (got, new)
    return new


_COST: dict[tuple, Any] = {}


def cost_model_applies() -> bool:
    """This process's view: on a GPU, or where MOONEP_EP_GPU_PROFILE names a profile: the CPU engine's costs
    are no GPU's (and its tests keep exercising the prefetch path)."""
    if envs.MOONEP_EP_GPU_PROFILE != "auto":
        return True
    return torch.cuda.is_available()


def cost_inputs(manager: Any = None) -> tuple[str, tuple[tuple[str, Any], ...], bool]:
    """``(profile, overrides, applies)`` of the cost model: the ones every EP rank agreed at backend selection
    (``manager.decisions``, ``buffers.agree_decisions``); without that agreement (no manager, one process)
    this process's settings."""
    decided = getattr(manager, "decisions", None)
    if decided is not None:
        return decided.cost_profile, decided.cost_overrides, decided.cost_applies
    from ...ops.decode.cost import cost_overrides, detect_profile

    return detect_profile(), cost_overrides(), cost_model_applies()


def _cost_model(self: Any, hidden: int, K: int, E: int, *, profile: str | None = None,
                overrides: tuple[tuple[str, Any], ...] | None = None) -> Any:
    """The cost model of this layer's experts in their stored format (None before the weights are bound), on
    ``profile`` with ``overrides`` (None: this process's, see :func:`cost_inputs`)."""
    if profile is None or overrides is None:
        local_profile, local_overrides, _ = cost_inputs(None)
        profile = local_profile if profile is None else profile
        overrides = local_overrides if overrides is None else overrides
    layout = getattr(self, "weight_layout", None) or getattr(getattr(self, "_fused_experts", None),
                                                             "weight_layout", None)
    gate = getattr(layout, "full_gate_weight", None)
    if gate is None:
        return None
    # BF16: the gate view [E+B, I, H]; quantized (quantized/engine.py's QuantizedWeightLayout): the fused w13
    # weight [E+B, 2I, H/pack], the format on the layout. Bytes per expert, scales included, from layout.formats.
    fmt = getattr(layout, "format", None) or "bf16"
    intermediate = int(gate.shape[1]) // (1 if fmt == "bf16" else 2)
    key = (hidden, intermediate, E, K, fmt, profile, overrides)
    if key not in _COST:
        from ...models import MoEModelConfig
        from ...ops.decode.cost import cost_model
        from ..observe.stats import STATS, stats_dir

        shape = MoEModelConfig("vllm-moe-layer", hidden, intermediate, E, K, 1)
        model = cost_model(shape, fmt, profile, overrides)
        _COST[key] = model
        import logging

        logging.getLogger("vllm.moonep_ep").info(
            "moonep_ep: prefetch cost model: profile %s, a copy pays above %d rows (%s)", model.profile,
            model.rows_to_pay, model.overrides or "no overrides")
        if stats_dir() is not None:
            STATS.set(cost_model=model.describe())
    return _COST[key]


def real_tokens_across_dp() -> list[int] | None:
    """Every DP rank's real token count this step (vLLM's forward context; the prepare step pads each
    rank's batch to the buffer's capacity), or None outside a forward."""
    from ..observe.deferred import dp_token_tensor

    counts = dp_token_tensor()
    return None if counts is None else [int(n) for n in counts.tolist()]


def _dp_tokens(R: int) -> list[int] | None:
    tokens = real_tokens_across_dp()
    return tokens if tokens is not None and len(tokens) == R else None


def patch_prepare(module: Any) -> bool:
    """Put :func:`pad_to_capacity` in place of the class's ``_pad_to_capacity``; False if already done."""
    cls = module.MoonEPPrepareAndFinalize
    orig = cls._pad_to_capacity
    if is_wrapped(orig):
        return False

    def _pad_to_capacity(self: Any, a1: Any, topk_ids: Any, topk_weights: Any, capacity: int) -> Any:
        return pad_to_capacity(self, a1, topk_ids, topk_weights, capacity, original=orig)

    install(cls, "_pad_to_capacity", _pad_to_capacity, orig, doc=pad_to_capacity.__doc__)
    return True
