"""CUDA graphs under ``--all2all-backend moonep``: every layer captured but the MoE step, or decode whole.

vLLM 0.33.0 turns CUDA graphs off whenever the backend is ``moonep`` (``VllmConfig.__post_init__``: "MoonEP:
Disabling CUDA Graphs since the MoonEP integration is currently eager-only"), so attention, dense layers and
norms run eager too. Two patches (``plugin.py``'s convention) lift that rule for one mode, breakable CUDA graphs
(``vllm/compilation/breakable_cudagraph.py``) at ``cudagraph_mode=PIECEWISE``:

* ``VllmConfig.__post_init__``: under ``moonep`` with graphs not refused by the user, breakable graphs are asked
  for (``VLLM_USE_BREAKABLE_CUDAGRAPH=1`` when unset, as vLLM does itself for Kimi K3), and where vLLM's rule set
  ``NONE`` the mode becomes ``PIECEWISE``; one log line names it. ``--enforce-eager``, ``cudagraph_mode`` NONE,
  ``-O0`` and ``VLLM_USE_BREAKABLE_CUDAGRAPH=0`` keep eager.
* ``MoERunner._select_forward``: a MoonEP layer's ``vllm::moe_forward`` / ``vllm::moe_forward_shared`` becomes an
  eager break. Its outputs are allocated inside the open graph piece (at addresses the later pieces read), the
  op runs eager between the pieces and copies its result into them, at capture and at every replay.

Nothing of the MoE step is captured, so any buffer and any MoE step work (docs/design/vllm_graphs.md).

Full decode graphs, on request: ``-cc.cudagraph_mode=FULL_DECODE_ONLY`` or ``FULL_AND_PIECEWISE`` given by the
user (``FULL`` becomes ``FULL_AND_PIECEWISE``: a mixed batch's step reads the host) keeps that mode, so a
uniform decode batch is captured whole, the MoE step with it: the decode step reads nothing back (issue 45),
every decode capacity's Buffer is built at start (``manager.ShardedBufferPool``; one built inside a capture is
refused), each capture size gets a warm-up step first (``cudagraph_num_of_warmups`` at least 1), and the MoonEP
library runs synchronously under capture (``experts/overlap.prefetch``). Mixed batches keep the breakable
pieces with the MoE step eager. On the CPU engine, which captures nothing, the same request puts each
decode-sized MoE step under the capture-and-replay emulator (``cpu/moe_graphs.py``).
"""

from __future__ import annotations

import logging
import os
import threading
from types import ModuleType
from typing import Any, Callable

from .. import envs
from .hooks import Install, Mark, Note, Patch, wrapped_with

logger = logging.getLogger("vllm.moonep_ep")

__all__ = ["PATCHES", "BREAKABLE_ENV", "MOE_OPS", "eager_between_pieces"]

MOD_VLLM_CONFIG = "vllm.config.vllm"
MOD_MOE_RUNNER = "vllm.model_executor.layers.fused_moe.runner.moe_runner"
BREAKABLE_ENV = "VLLM_USE_BREAKABLE_CUDAGRAPH"
CPU_MOE_GRAPHS_ENV = "MOONEP_EP_CPU_MOE_GRAPHS"
MOE_OPS = "vllm::moe_forward, vllm::moe_forward_shared"
_MARK = "_moonep_ep_graphs"

#: per thread: the config whose __post_init__ runs under the patch, and its cudagraph_mode before vLLM's moonep block
_before_rule = threading.local()


def _moonep_all2all(config: Any) -> bool:
    """The condition of vLLM's rule: the moonep backend with all2all in use."""
    par = config.parallel_config
    return par.all2all_backend == "moonep" and bool(par.use_all2all)


def _user_wants_graphs(config: Any) -> bool:
    """Neither ``--enforce-eager``, ``cudagraph_mode`` NONE nor ``-O0``, on a platform that captures graphs."""
    from vllm.config import CUDAGraphMode
    from vllm.platforms import current_platform

    model = config.model_config
    if model is not None and model.enforce_eager:
        return False
    if config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE:
        return False
    if int(getattr(config, "optimization_level", 1)) == 0:
        return False
    return bool(current_platform.support_static_graph_mode())


def lift_eager_rule(module: ModuleType, *, install: Install, mark: Mark, note: Note) -> None:
    """``VllmConfig.__post_init__``: breakable CUDA graphs at PIECEWISE under moonep, in place of vLLM's NONE."""
    cls = module.VllmConfig
    orig, ranges = cls.__post_init__, getattr(cls, "_set_compile_ranges", None)
    if ranges is None or wrapped_with(orig, _MARK):
        return

    def __post_init__(self: Any, *args: Any, **kwargs: Any) -> None:
        requested = _requested_mode(self)   # before vLLM fills in its default: None unless the user set it
        if envs.MOONEP_EP_CPU and _moonep_all2all(self):
            orig(self, *args, **kwargs)
            _emulate_on_cpu(requested, note)
            return
        if not (_moonep_all2all(self) and _user_wants_graphs(self)):
            orig(self, *args, **kwargs)
            return
        set_here = BREAKABLE_ENV not in os.environ
        if set_here:  # before vLLM reads it (_maybe_enable_breakable_cudagraph); workers inherit it
            os.environ[BREAKABLE_ENV] = "1"
        _before_rule.config, _before_rule.mode = self, None
        try:
            orig(self, *args, **kwargs)
        except BaseException:
            if set_here:
                os.environ.pop(BREAKABLE_ENV, None)
            raise
        finally:
            seen, _before_rule.config, _before_rule.mode = _before_rule.mode, None, None
        _lift(self, seen, requested, note)

    def _set_compile_ranges(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = ranges(self, *args, **kwargs)
        if getattr(_before_rule, "config", None) is self:  # vLLM's moonep block comes right after this call
            _before_rule.mode = self.compilation_config.cudagraph_mode
        return out

    for fn in (__post_init__, _set_compile_ranges):
        setattr(fn, _MARK, True)
    install(cls, "__post_init__", __post_init__, orig, "VllmConfig.__post_init__ (CUDA graphs under moonep)")
    install(cls, "_set_compile_ranges", _set_compile_ranges, ranges,
            "VllmConfig._set_compile_ranges (cudagraph_mode before the moonep rule)")


def _requested_mode(config: Any) -> Any:
    """The ``cudagraph_mode`` the user gave (a ``CUDAGraphMode``), or None where vLLM will pick its default."""
    mode = getattr(config.compilation_config, "cudagraph_mode", None)
    if isinstance(mode, str):
        from vllm.config import CUDAGraphMode

        mode = CUDAGraphMode[mode.upper()]
    return mode


def _emulate_on_cpu(requested: Any, note: Note) -> None:
    """CPU engine: a requested full decode mode puts the decode-sized MoE steps under the capture emulator."""
    if requested is None or not requested.has_full_cudagraphs():
        return
    os.environ[CPU_MOE_GRAPHS_ENV] = "1"   # read at each MoE step (cpu/moe_graphs.py); engine processes inherit it
    _log_once(note, logging.INFO,
              f"moonep_ep: -cc.cudagraph_mode={requested.name} on the CPU engine, which captures no CUDA graph: each "
              "MoonEP layer's decode-sized MoE step runs under the capture-and-replay emulator "
              "(moonep_ep.testing.cuda_capture), captured once per buffer capacity and replayed, as a full decode "
              "graph holds it; everything else runs eager")


def _full_decode_mode(seen: Any, requested: Any, breakable: bool) -> Any:
    """The full decode mode kept for a user's explicit request (None: not asked for, or not a full mode)."""
    from vllm.config import CUDAGraphMode

    if requested is None or not seen.has_full_cudagraphs():
        return None
    if not breakable:   # torch.compile's pieces would hold the MoE step of a mixed batch: decode only
        return CUDAGraphMode.FULL_DECODE_ONLY
    return CUDAGraphMode.FULL_AND_PIECEWISE if seen == CUDAGraphMode.FULL else seen


def _lift(config: Any, seen: Any, requested: Any, note: Note) -> None:
    from vllm.compilation.breakable_cudagraph import is_breakable_cudagraph_enabled
    from vllm.config import CUDAGraphMode

    cc = config.compilation_config
    if seen is None or seen == CUDAGraphMode.NONE or cc.cudagraph_mode != CUDAGraphMode.NONE:
        return  # vLLM's rule did not fire
    full = _full_decode_mode(seen, requested, is_breakable_cudagraph_enabled())
    if full is not None:
        cc.cudagraph_mode = full
        cc.cudagraph_num_of_warmups = max(1, int(cc.cudagraph_num_of_warmups or 0))
        why = "" if full == seen else f" (asked: {seen.name})"
        mixed = ("mixed batches in breakable pieces with the MoE ops eager" if full.has_piecewise_cudagraphs()
                 else "mixed batches eager")
        _log_once(note, logging.INFO,
                  f"moonep_ep: CUDA graphs under --all2all-backend moonep: cudagraph_mode={full.name}{why}: uniform "
                  f"decode batches captured whole, the MoE step included (MoonEP synchronous under capture, every "
                  f"decode Buffer built before capture, cudagraph_num_of_warmups={cc.cudagraph_num_of_warmups}); "
                  f"{mixed}")
        return
    if not is_breakable_cudagraph_enabled():
        _log_once(note, logging.INFO,
                  f"moonep_ep: CUDA graphs stay off under --all2all-backend moonep: {BREAKABLE_ENV}=0, and "
                  f"torch.compile's piecewise graphs would capture the MoE step ({MOE_OPS} are not among its "
                  f"splitting ops). Fix: unset {BREAKABLE_ENV} (the plugin then uses breakable CUDA graphs)")
        return
    cc.cudagraph_mode = CUDAGraphMode.PIECEWISE
    why = "" if seen == CUDAGraphMode.PIECEWISE else f" (not {seen.name}: full graphs would capture the MoE step)"
    _log_once(note, logging.INFO,
              f"moonep_ep: CUDA graphs under --all2all-backend moonep: cudagraph_mode=PIECEWISE{why}, breakable "
              f"CUDA graphs ({BREAKABLE_ENV}=1); the MoE ops ({MOE_OPS}) run eager between graph pieces")


def _log_once(note: Note, level: int, message: str) -> None:
    said = note.setdefault("graphs_logged", set())
    if message not in said:
        said.add(message)
        logger.log(level, message)


# -- the MoE op as an eager break ------------------------------------------------------------------

def eager_between_pieces(entry: Callable[..., Any], fake: Callable[..., Any], shared: bool,
                         capture_cls: Any, eager_break: Callable[[Any], Any]) -> Callable[..., Any]:
    """``entry`` (the MoE op) as an eager break of a breakable capture (``capture_cls``, ``eager_break``: vLLM's).

    Outside a capture it is ``entry``. Inside, the outputs are allocated by ``fake`` (vLLM's fake of the op: its
    shapes) in the open graph segment, then ``eager_break`` ends the segment, runs the op eagerly, copies its
    result into them and records that for replay: the later segments read those fixed addresses."""

    def into(out: Any, *args: Any) -> None:
        _copy(out, entry(*args), args)

    def into_shared(shared_out: Any, fused_out: Any, *args: Any) -> None:
        result = entry(*args)
        _copy(shared_out, result[0], args)
        _copy(fused_out, result[1], args)

    run = eager_break(into_shared if shared else into)

    def moe_entry(*args: Any) -> Any:
        capture = capture_cls.current()
        if capture is None or not capture._capturing:
            if not _full_runtime():   # a full decode graph holds the step (the mode the user asked for)
                _refuse_plain_capture(args[0])
            return entry(*args)
        outs = fake(*args)
        run(*(outs if shared else (outs,)), *args)  # each output its own argument: weak-referenced for replay
        return outs

    moe_entry.__wrapped__ = entry  # type: ignore[attr-defined]
    return moe_entry


def _full_runtime() -> bool:
    """Whether this forward runs as a FULL CUDA graph (vLLM's forward context), which only a full decode mode the
    plugin kept (``_lift``) can dispatch under moonep."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import get_forward_context, is_forward_context_available

    return is_forward_context_available() and get_forward_context().cudagraph_runtime_mode == CUDAGraphMode.FULL


def _copy(out: Any, result: Any, args: tuple) -> None:
    if result is None or tuple(result.shape) != tuple(out.shape):
        raise RuntimeError(
            f"moonep_ep: the MoE op of layer {args[4]!r} returned "
            f"{None if result is None else tuple(result.shape)}, not the {tuple(out.shape)} its fake declares, "
            "so it cannot run eager between CUDA graph pieces. Fix: --enforce-eager (or "
            "-cc.cudagraph_mode=NONE) for this model")
    out.copy_(result)


def _refuse_plain_capture(hidden_states: Any) -> None:
    """A whole-graph capture (FULL, or torch.compile's pieces) would bake the MoE step in: refused."""
    import torch

    if getattr(hidden_states, "is_cuda", False) and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "moonep_ep: a CUDA graph capture reached the MoonEP MoE step outside a breakable capture and outside "
            "a full decode graph the plugin kept (torch.compile's piecewise graphs, or a full graph of a mixed "
            "batch): a prefill-sized step reads the host. Fix: let the plugin choose the mode (unset "
            f"-cc.cudagraph_mode and {BREAKABLE_ENV}), -cc.cudagraph_mode=FULL_DECODE_ONLY, or --enforce-eager")


def break_at_moe_ops(module: ModuleType, *, install: Install, mark: Mark, note: Note) -> None:
    """``MoERunner._select_forward``: a MoonEP layer's MoE op an eager break of breakable CUDA graphs."""
    cls = getattr(module, "MoERunner", None)
    orig = getattr(cls, "_select_forward", None)
    fakes = (getattr(module, "_moe_forward_fake", None), getattr(module, "_moe_forward_shared_fake", None))
    if orig is None or None in fakes or wrapped_with(orig, _MARK):
        return

    def _select_forward(self: Any) -> Any:
        entry = orig(self)
        par = self.moe_config.moe_parallel_config
        if par.all2all_backend != "moonep" or not par.use_all2all_kernels:
            return entry
        # imported when a layer is built, not when moe_runner is (vLLM's layers may still be importing then)
        from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture, eager_break_during_capture

        shared = self._shared_experts is not None
        return eager_between_pieces(entry, fakes[shared], shared, BreakableCUDAGraphCapture,
                                    eager_break_during_capture)

    setattr(_select_forward, _MARK, True)
    install(cls, "_select_forward", _select_forward, orig,
            "fused_moe MoERunner._select_forward (the MoE op eager between CUDA graph pieces)")


PATCHES: tuple[Patch, ...] = (Patch(MOD_VLLM_CONFIG, lift_eager_rule), Patch(MOD_MOE_RUNNER, break_at_moe_ops))
