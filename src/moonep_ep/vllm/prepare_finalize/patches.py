"""Where vLLM's MoonEP prepare and finalize are patched (``plugin.py``'s convention).

* ``MoonEPPrepareAndFinalize._pad_to_capacity``: capacity padding that moves no weights (``padding.py``,
  ``MOONEP_EP_PADDING``); its prepare step also arms the slot-fill hand-off (``experts/overlap.py``).
* ``prepare_finalize.moonep``'s ``torch.bincount`` (the prepare's expert counts): a scatter-add on the device
  (``counting.py``: bincount reads its maximum back to the host).
* ``all2all_utils``: the MoonEP prepare/finalize names, which vLLM binds only on CUDA with ``moonep``
  importable, are bound when missing (the reference buffer needs no ``moonep`` package); then the class name
  builds the push prepare/finalize for a push pool (``MOONEP_EP_MOONEP_API=push``, ``push.py``) and vLLM's class
  otherwise.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ..hooks import Install, Mark, Note, Patch, is_wrapped

MOD_MOONEP_PF = "vllm.model_executor.layers.fused_moe.prepare_finalize.moonep"
MOD_ALL2ALL_UTILS = "vllm.model_executor.layers.fused_moe.all2all_utils"
#: what ``all2all_utils`` imports from ``prepare_finalize.moonep`` when vLLM finds ``moonep`` on CUDA
PF_NAMES = ("MOONEP_DEFAULT_NUM_PREFETCH_SLOTS", "MOONEP_DEFAULT_NUM_SMS", "MOONEP_DEFAULT_TOKEN_PADDING",
            "MoonEPPrepareAndFinalize")


def patch_padding(module: ModuleType, *, install: Install, mark: Mark, note: Note) -> None:
    """``MoonEPPrepareAndFinalize._pad_to_capacity``: ``padding.pad_to_capacity``."""
    from .padding import patch_prepare

    if patch_prepare(module):
        mark("MoonEPPrepareAndFinalize._pad_to_capacity (MOONEP_EP_PADDING)")


def count_experts_on_device(module: ModuleType, *, install: Install, mark: Mark, note: Note) -> None:
    """``prepare_finalize.moonep``'s ``torch.bincount``: ``counting.bincount_on_device``."""
    from .counting import count_on_device

    if count_on_device(module):
        mark("MoonEPPrepareAndFinalize.prepare's expert counts on the device (no bincount)")


def bind_pf_names(module: ModuleType, *, install: Install, mark: Mark, note: Note) -> None:
    """``all2all_utils``: the names of :data:`PF_NAMES` it lacks, from vLLM's ``prepare_finalize.moonep``."""
    if all(hasattr(module, n) for n in PF_NAMES):
        return
    pf = importlib.import_module(MOD_MOONEP_PF)
    for name in PF_NAMES:
        if not hasattr(module, name):
            setattr(module, name, getattr(pf, name))
    mark("all2all_utils.MoonEP names")


def bind_push_choice(module: ModuleType, *, install: Install, mark: Mark, note: Note) -> None:
    """``all2all_utils.MoonEPPrepareAndFinalize`` builds the push prepare/finalize for a push pool
    (``MOONEP_EP_MOONEP_API=push``, ``push.py``) and vLLM's class otherwise."""
    from .push import choose_prepare_finalize

    original = module.MoonEPPrepareAndFinalize
    if not is_wrapped(original):
        install(module, "MoonEPPrepareAndFinalize", choose_prepare_finalize(original), original,
                "all2all_utils.MoonEPPrepareAndFinalize (push API: prepare_finalize/push.py)")


#: On ``all2all_utils`` the names are bound before the choice wraps the class. On ``prepare_finalize.moonep`` the
#: padding comes after ``observe/patches.py``'s count of the all-gathers (the plugin's order of tables).
PATCHES: tuple[Patch, ...] = (
    Patch(MOD_MOONEP_PF, patch_padding),
    Patch(MOD_MOONEP_PF, count_experts_on_device),
    Patch(MOD_ALL2ALL_UTILS, bind_pf_names),
    Patch(MOD_ALL2ALL_UTILS, bind_push_choice),
)
