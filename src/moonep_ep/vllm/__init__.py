"""moonep_ep's vLLM plugin: ``--all2all-backend moonep`` on sharded symmetric memory.

Installed next to vLLM 0.33.0, ``vllm serve MODEL --data-parallel-size N
--enable-expert-parallel --all2all-backend moonep`` runs unchanged, but each
EP rank holds only its own experts plus one slot pool shared by all layers,
and MoonEP's prefetch reads each planned redundant expert directly from its
owner's memory. vLLM's own ``MoonEPPrepareAndFinalize`` and
``MoonEPExperts`` do the work.

Entry point (``pyproject.toml``)::

    [project.entry-points."vllm.general_plugins"]
    moonep_ep = "moonep_ep.vllm:register"

Environment:

* ``MOONEP_EP_BUFFER`` = ``auto`` | ``reference`` | ``moonep`` — which
  MoonEP Buffer serves (``buffers.py``);
* ``MOONEP_EP_CPU=1`` — the CPU engine overrides (tests, the CPU demo);
* ``MOONEP_EP_LAYOUT`` = ``sharded`` (default) | ``replicated`` — keep
  vLLM's all-gathered layout, for A/B comparisons;
* ``MOONEP_EP_HOST_GRANULARITY`` — host page size of the CPU store (64 KiB);
* ``MOONEP_EP_VLLM_STATS_DIR`` — write per-rank instrumentation (``observe/stats.py``);
* ``MOONEP_EP_VLLM_FORCE=1`` — activate on an unsupported vLLM build.

See ``docs/design/vllm.md``.
"""

from __future__ import annotations

from .compat import SUPPORTED_VLLM_VERSION

__all__ = ["register", "SUPPORTED_VLLM_VERSION"]


def register() -> None:
    """The ``vllm.general_plugins`` entry point: idempotent, never raises."""
    from .plugin import install

    install()
