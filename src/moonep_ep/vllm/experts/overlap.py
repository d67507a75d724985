"""Own experts first, slot experts after the prefetch: the prefetch overlaps the expert compute.

vLLM 0.33.0's prepare step calls ``Buffer.prefetch_weight`` synchronously and
``MoonEPExperts.apply`` runs one grouped GEMM over all ``E + B`` groups, so
the weight copies and the compute of the rank's own experts run one after
the other. Here:

* :func:`prefetch` (the plugin's buffer wrapper calls it) asks the buffer for
  ``async_finish=True`` and hands the returned event over to this thread's
  next expert compute (:class:`SlotFillHandoff`), in a step the prepare step
  armed (:func:`arm`) because the layer's experts run :func:`apply`; other
  experts get the blocking call;
* :func:`apply` (in place of ``MoonEPExperts.apply``) computes groups
  ``[0, E)`` (own experts; on the sharded store also remote experts without a
  slot, read in place), then waits on the event, then computes the slot
  groups ``[E, E + B)``. Same arithmetic per row as vLLM's single grouped
  GEMM (every group is an independent ``a[seg] @ w[g].T``), with the layer's
  activation (``vllm/experts/activation.py``): SiLU as vLLM computes it, or SiTU
  (Kimi K3), which vLLM's ``MoonEPExperts`` refuses; :func:`patch_experts`
  makes that class declare SiTU too (``_supports_activation``), so vLLM's
  backend oracle keeps MoonEP for a SiTU layer and this ``apply`` serves it.

On a GPU the wait (``ops.moonep.prefetch.wait_for_slots``, the one wait of every
path) makes the current stream wait on the event: the own groups' kernels are
queued before it, the copies run on the buffer's copy stream meanwhile. On
CPU the slot copies are deferred (``MOONEP_EP_CPU_DEFERRED_COPIES``) and land
at that wait, so a missing wait reads stale slots there too; :data:`TRACE`
records the order (``own``, ``waited``, ``slots``) for the tests. On CPU
splitting needs the row where the slot groups start on the host (one ``int``
read per layer), so only prefill-sized steps split: a decode-sized step (at
most vLLM's ``max_num_seqs`` times one plus the speculative tokens, the most
of any DP rank: :func:`decode_sized`) waits, then runs every group in one
pass (``waited``, ``one pass``) and reads nothing back.

On CUDA the experts are the quantized experts' row-bounded Triton kernels
with bf16 weights (``bf16_gpu.py``): work follows the rows that carry tokens,
the down GEMM writes ``output`` in place, and each part's rows are bounded on
the device, so neither a split nor a one-pass step reads anything back.
:func:`patch_experts` also registers each layer bound on a GPU for the Triton
warm-up (``warmup.py``).

The quantized layers' prefetch (``quantized/engine.py``
``prefetch_quantized``) hands its weight and scale events over with
:func:`deliver_slot_fill`; their experts take them with :func:`take_slot_fill`
and wait before any slot row is read.
"""

from __future__ import annotations

import threading
import types
from typing import Any

import torch

from ...ops.experts.activation import SILU, SUPPORTED_ACTIVATIONS, GatedActivation
from ...ops.experts.grouped_blocks import restrict_to_groups
from ...ops.moonep import prefetch as slot_copies
from ...ops.moonep.prefetch import wait_for_slots
from . import bf16_gpu
from .activation import activation_name, activation_of
from ..hooks import install, is_wrapped

__all__ = ["SLOT_FILL_HANDOFF", "SlotFillHandoff", "arm", "decode_sized", "decode_token_bound", "prefetch", "deliver_slot_fill", "take_slot_fill", "apply",
           "patch_experts", "TRACE"]
#: Set on an experts class whose ``apply`` takes this thread's slot fill (:func:`take_slot_fill`) and waits.
WAITS_ATTR = "_moonep_ep_waits_for_slot_fills"


class SlotFillHandoff(threading.local):
    """A MoE layer's slot fill, handed from its prepare step to its experts on the same thread.

    vLLM's modular kernel calls a layer's prepare (dispatch, then the prefetch that fills the slots) and then its
    experts' ``apply``, one after the other on one thread, and carries nothing of ours between them. The fill's
    event therefore goes beside those calls, here. Thread-local because the hand-off belongs to that one
    thread's forward: where vLLM runs forwards on several threads (dual-batch overlap runs each micro-batch on
    its own), one thread's event never reaches another thread's experts.

    * :attr:`armed`: written by the prepare step (:func:`arm`, from the plugin's ``_pad_to_capacity`` in
      ``prepare_finalize/padding.py``): this layer's experts take the event and wait on it; read and cleared by
      the fill that follows (:meth:`take_armed`), which otherwise waits itself.
    * :attr:`event`: written by an armed fill (:meth:`put`, from :func:`deliver_slot_fill`: :func:`prefetch`
      for the buffer's fill, ``manager.py`` for the quantized one); read and cleared by the experts' ``apply``
      (:meth:`take`, through :func:`take_slot_fill`: :func:`apply`, the quantized experts in
      ``quantized/engine.py``) before any slot row is read.

    If nobody takes the event (a layer that raised between its prepare and its experts), it stays until this
    thread's next armed fill replaces it, or the next experts' ``apply`` takes it and waits on an older fill (a
    wait too many, never one too few). A replaced event is never waited on: the reference buffer issues every
    fill on one copy stream per device (on CPU one queue, ``ops/moonep/prefetch.py``), so the replacing fill's
    event covers the copies queued before it too."""

    armed: bool = False   # class defaults: each thread starts unarmed, with no event
    event: Any = None
    one_pass: bool = False

    def take_one_pass(self) -> bool:
        """Whether the prepare step asked this layer's experts for one pass after the wait (a decode-sized
        step: :func:`arm`); cleared for the next layer."""
        one_pass = self.one_pass
        self.one_pass = False
        return one_pass

    def take_armed(self) -> bool:
        """Whether the prepare step armed this fill; disarmed for the next one."""
        armed = self.armed
        self.armed = False
        return armed

    def put(self, event: Any) -> None:
        self.event = event

    def take(self) -> Any:
        """The event put last (None if none), once."""
        event = self.event
        self.event = None
        return event


#: The hand-off every thread of this process uses (:class:`SlotFillHandoff`: its fields are per thread).
SLOT_FILL_HANDOFF = SlotFillHandoff()
#: Per thread, when ``TRACE.events`` is a list: the order of the steps of :func:`apply`.
TRACE = threading.local()


def _trace(step: str) -> None:
    events = getattr(TRACE, "events", None)
    if events is not None:
        events.append(step)


def arm(prepare: Any, *, one_pass: bool = False) -> None:
    """Called by the prepare step: the next prefetch of this thread may finish asynchronously only when the
    layer's experts run :func:`apply` (which waits on the event); any other experts get a blocking prefetch.

    ``one_pass``: a decode-sized step (:func:`decode_sized`): the experts wait, then compute every group in
    one pass, so that no row index is read back to the host (the own/slot split needs one)."""
    experts = getattr(prepare, "_fused_experts", None)
    SLOT_FILL_HANDOFF.armed = (is_wrapped(getattr(type(experts), "apply", None))
                               or getattr(type(experts), WAITS_ATTR, False))
    SLOT_FILL_HANDOFF.one_pass = bool(one_pass)


def decode_token_bound(vllm_config: Any) -> int | None:
    """The most tokens a rank's decode step carries: vLLM's ``max_num_seqs`` times one plus the speculative
    tokens per sequence (None without a config)."""
    seqs = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_seqs", None)
    if not seqs:
        return None
    spec = getattr(getattr(vllm_config, "speculative_config", None), "num_speculative_tokens", None) or 0
    return int(seqs) * (1 + int(spec))


def decode_sized(step_tokens: int, vllm_config: Any) -> bool:
    """Whether a step of ``step_tokens`` tokens (the most of any DP rank: host values vLLM keeps) is
    decode-sized: at most :func:`decode_token_bound`. Such steps run the experts in one pass after the slot
    fill's wait: the own/slot split reads the split row back to the host (a device round trip per MoE layer,
    and an op no CUDA graph can hold) to overlap copies with GEMMs that are short at decode. Larger steps
    (prefill) keep the overlap: their GEMMs hide the copies, and one read per layer is small beside them."""
    bound = decode_token_bound(vllm_config)
    return bound is not None and step_tokens <= bound


#: async_finish asked of a Buffer whose async mode a capture cannot hold, while capturing
ASYNC_UNDER_CAPTURE = (
    "moonep_ep: prefetch_weight(async_finish=True) asked of {cls} during a CUDA graph capture: its async mode "
    "runs on the library's comm stream and calls record_stream on its inputs, which a capture cannot hold "
    "(kvcache-ai/Mooncake#2087: stream recording is incompatible with CUDA graphs). Under capture the plugin "
    "drives it synchronously, in the capturing stream. Fix: pass async_finish=False while capturing, or keep "
    "this step out of the graph (-cc.cudagraph_mode=PIECEWISE, the plugin's default under moonep)")


def prefetch(buffer: Any, plan: Any, async_finish: bool, weights: dict[str, Any]) -> Any:
    """The plugin's prefetch: asynchronous for an armed step (the event waits for :func:`apply`), else as asked.

    Inside a CUDA graph capture a Buffer whose async mode the capture cannot hold (the real MoonEP library:
    ``record_stream`` on its comm stream; the reference buffers declare ``async_capture_safe``) runs
    synchronously, in the capturing stream, and an explicit ``async_finish`` is refused with the reason. A
    decode-sized step loses no overlap by it: its experts run in one pass after the wait anyway."""
    if slot_copies.stream_capturing() and not getattr(buffer, "async_capture_safe", False):
        if async_finish:
            raise RuntimeError(ASYNC_UNDER_CAPTURE.format(cls=type(buffer).__name__))
        SLOT_FILL_HANDOFF.armed = False
        return buffer.prefetch_weight(plan=plan, async_finish=False, **weights)
    if not SLOT_FILL_HANDOFF.armed or async_finish:
        SLOT_FILL_HANDOFF.armed = False
        return buffer.prefetch_weight(plan=plan, async_finish=async_finish, **weights)
    return deliver_slot_fill(buffer.prefetch_weight(plan=plan, async_finish=True, **weights), async_finish=False)


def deliver_slot_fill(event: Any, async_finish: bool) -> Any:
    """An issued slot fill's event, to whoever reads the slots first: the caller when it asked for
    ``async_finish``; else this thread's next experts ``apply`` in an armed step (:class:`SlotFillHandoff`);
    else the current stream, now."""
    armed = SLOT_FILL_HANDOFF.take_armed()
    if async_finish:
        return event
    if armed:
        SLOT_FILL_HANDOFF.put(event)
        _trace("prefetch issued")
    else:
        wait_for_slots(event)
    return None


def take_slot_fill() -> Any:
    """The slot-fill event this thread's last armed prefetch handed over to the experts (None if none); once."""
    return SLOT_FILL_HANDOFF.take()


def _grouped(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a, w.transpose(1, 2), offs=offs)


def _mlp(a: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor, offs: torch.Tensor,
         route_weights: torch.Tensor | None, *, activation: GatedActivation = SILU) -> torch.Tensor:
    act = activation(_grouped(a, gate_w, offs), _grouped(a, up_w, offs))
    if route_weights is not None:
        act.mul_(route_weights.to(act.dtype).unsqueeze(-1))
    return _grouped(act, down_w, offs)


def apply(self: Any, output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
          topk_weights: torch.Tensor, topk_ids: Any, activation: Any, global_num_experts: int, expert_map: Any,
          a1q_scale: Any, a2_scale: Any, workspace13: Any, workspace2: Any, expert_tokens_meta: Any,
          apply_router_weight_on_input: bool, *, original: Any = None) -> None:
    """``MoonEPExperts.apply`` with the own groups before the prefetch wait and the slot groups after, and the
    layer's activation (SiLU or SiTU, its betas from ``self.moe_config``)."""
    event = take_slot_fill()
    layout = getattr(self, "_weight_layout", None)
    # Pull: [E+B] rows, the own part ends at E; push (prepare_finalize/push.py's PushWeightLayout): [2*epn],
    # it ends at epn
    E = int(getattr(layout, "own_groups", global_num_experts))
    act = activation_of(activation, getattr(self, "moe_config", None))   # refuses what the experts cannot compute
    known = layout is not None and expert_tokens_meta is not None
    on_gpu = bf16_gpu.runs_here(hidden_states)
    # [E+B] rows: split; E rows (no slots) with SiTU, or on a GPU: the split's own part is all of it
    ours = known and (w1.size(0) > E or (w1.size(0) == E and (act.name != "silu" or on_gpu)))
    if original is not None and not ours:
        wait_for_slots(event)   # not the [E+B] layout this split knows: vLLM's code, after the copies
        return original(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                        global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
                        expert_tokens_meta, apply_router_weight_on_input)
    cu = torch.cumsum(expert_tokens_meta.expert_num_tokens, dim=0, dtype=torch.int32)
    assert cu.numel() == w1.size(0)
    weights = None if apply_router_weight_on_input else topk_weights
    up = layout.full_up_weight
    one_pass = SLOT_FILL_HANDOFF.take_one_pass()
    if on_gpu:
        _apply_on_gpu(self, output, hidden_states, w1, up, w2, cu, weights, topk_ids, act, E, event, one_pass)
        return
    if one_pass:
        # decode-sized: wait, then every group at once; rows past the last group are left undefined (MoonEP's
        # combine reads the dispatched rows only)
        if event is not None:
            wait_for_slots(event)
            _trace("waited")
        output.copy_(_mlp(hidden_states, w1, up, w2, cu, weights, activation=act))
        _trace("one pass")
        return
    own_end, end = (int(x) for x in cu[[E - 1, -1]].tolist())
    output[own_end:].zero_()
    if own_end:
        own = _mlp(hidden_states[:own_end], w1[:E], up[:E], w2[:E], cu[:E],
                   None if weights is None else weights[:own_end], activation=act)
        output[:own_end].copy_(own)
    _trace("own")
    if event is not None:
        wait_for_slots(event)
        _trace("waited")
    if end > own_end:
        offs = (cu[E:] - own_end).to(torch.int32)
        slots = _mlp(hidden_states[own_end:end], w1[E:], up[E:], w2[E:], offs,
                     None if weights is None else weights[own_end:end], activation=act)
        output[own_end:end].copy_(slots)
    _trace("slots")


def _apply_on_gpu(experts: Any, output: torch.Tensor, hidden: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                  down: torch.Tensor, cu: torch.Tensor, route: torch.Tensor | None, topk_ids: torch.Tensor,
                  act: GatedActivation, own_groups: int, event: Any, one_pass: bool) -> None:
    """:func:`apply` on CUDA (``bf16_gpu.py``): the row-bounded kernels, own groups, wait, slot groups, each part
    limited on the device (or every group in one pass after the wait); ``output`` written in place."""
    gpu = bf16_gpu.gpu_experts(experts)
    views = types.SimpleNamespace(format="bf16", views={"gate": gate, "up": up, "down": down})
    blocks = gpu.blocks(hidden, cu, route, topk_ids)
    fits = output.is_contiguous() and output.dtype == hidden.dtype
    dst = output if fits else torch.empty(output.shape, dtype=hidden.dtype, device=hidden.device)

    def part(lo: int, hi: int) -> None:
        rows = blocks if (lo, hi) == (0, cu.numel()) else restrict_to_groups(blocks, cu, lo, hi)
        gpu.grouped_ffn(views, hidden, cu, route, topk_ids, activation=act, out=dst, blocks=rows)

    if one_pass:
        if event is not None:
            wait_for_slots(event)
            _trace("waited")
        part(0, cu.numel())
        _trace("one pass")
    else:
        part(0, own_groups)
        _trace("own")
        if event is not None:
            wait_for_slots(event)
            _trace("waited")
        if cu.numel() > own_groups:
            part(own_groups, cu.numel())
        _trace("slots")
    if not fits:   # an output the kernel cannot write in place (not seen from vLLM's workspaces): one copy
        output.copy_(dst)


def supports_activation(activation: Any) -> bool:
    """``MoonEPExperts._supports_activation`` once patched: the activations :func:`apply` computes (SiLU, SiTU)."""
    return activation_name(activation) in SUPPORTED_ACTIVATIONS


def patch_experts(module: Any) -> bool:
    """Put :func:`apply` in place of ``MoonEPExperts.apply`` and let the class declare SiTU
    (:func:`supports_activation`); False if already done."""
    cls = module.MoonEPExperts
    while getattr(cls, "_moonep_ep_cpu", False) and cls.__bases__:  # the plugin's CPU subclass: patch vLLM's
        cls = cls.__bases__[0]
    orig = cls.apply
    if is_wrapped(orig):
        return False

    def overlapped_apply(self: Any, *args: Any, **kwargs: Any) -> None:
        return apply(self, *args, **kwargs, original=orig)

    install(cls, "apply", overlapped_apply, orig, doc=apply.__doc__)
    # vLLM's oracle asks the class (``cls._supports_activation(moe_config.activation)``, modular_kernel.py) and,
    # MoonEP being the only backend it allows under --all2all-backend moonep, refuses SiTU layers otherwise
    def supports(activation: Any) -> bool:
        return supports_activation(activation)

    install(cls, "_supports_activation", supports, getattr(cls, "_supports_activation", None),
            doc=supports_activation.__doc__)
    cls._supports_activation = staticmethod(supports)   # static, as vLLM declares it (called on the class)
    process = getattr(cls, "process_weights_after_loading", None)
    if process is not None:
        def bind(self: Any, layer: Any) -> None:
            process(self, layer)
            register_for_warmup(self)

        install(cls, "process_weights_after_loading", bind, process, doc=register_for_warmup.__doc__)
    return True


def register_for_warmup(experts: Any) -> None:
    """After vLLM binds a BF16 layer's weights: on a GPU, its Triton variants compile at vLLM's warm-up
    (``warmup.register_experts``). Not the quantized experts (subclasses with an ``experts_kind``, whose
    binding registers them itself) nor weights of another dtype."""
    layout = getattr(experts, "_weight_layout", None)
    gate = getattr(layout, "full_gate_weight", None)
    bf16 = isinstance(gate, torch.Tensor) and gate.dtype in (torch.bfloat16, torch.float16)
    if bf16 and getattr(experts, "experts_kind", None) is None and bf16_gpu.runs_here(gate):
        from .warmup import register_experts

        register_experts(bf16_gpu.gpu_experts(experts))
