"""The count of vLLM's expert-weight all-gathers (``plugin.py``'s convention): the evidence for "no expert weight
all-gathered" on the sharded layout, and the replicated layout's load peak for the A/B runs (``stats.py``).

``prepare_finalize.moonep.gather_moonep_weight_layout`` (the all-gather) and its ``make_moonep_weight_layout`` are
wrapped to count their calls; the load peak is sampled inside. The other observers' patches are declared beside
their code: ``peer_naming.PATCHES``, ``routing_record.PATCHES``.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ..hooks import Install, Mark, Note, Patch, is_wrapped

MOD_MOONEP_PF = "vllm.model_executor.layers.fused_moe.prepare_finalize.moonep"


def count_gathers(module: ModuleType, *, install: Install, mark: Mark, note: Note) -> None:
    """``gather_moonep_weight_layout`` and ``make_moonep_weight_layout``, counted in ``STATS``."""
    orig = module.gather_moonep_weight_layout
    if is_wrapped(orig):
        return

    def gather_moonep_weight_layout(w13_local: Any, w2_local: Any, *args: Any, **kwargs: Any) -> Any:
        from .stats import STATS

        STATS.count_vllm_gather(w13_local, w2_local)
        return orig(w13_local, w2_local, *args, **kwargs)

    install(module, "gather_moonep_weight_layout", gather_moonep_weight_layout, orig,
            "prepare_finalize.moonep.gather_moonep_weight_layout")
    make = module.make_moonep_weight_layout

    def make_moonep_weight_layout(w13_weight: Any, w2_weight: Any, *args: Any, **kwargs: Any) -> Any:
        from .stats import STATS

        layout = make(w13_weight, w2_weight, *args, **kwargs)
        # Sampled here, inside the all-gather: its [E]-row outputs are still alive.
        STATS.record_replicated_layout((w13_weight, w2_weight), layout)
        return layout

    install(module, "make_moonep_weight_layout", make_moonep_weight_layout, make,
            "prepare_finalize.moonep.make_moonep_weight_layout")


PATCHES: tuple[Patch, ...] = (Patch(MOD_MOONEP_PF, count_gathers),)
