"""Where vLLM's ``MoonEPExperts`` is patched (``plugin.py``'s convention).

* ``MoonEPExperts.apply``: own experts first, slot experts after the slot fill's event (``overlap.py``; the
  prefetch is then asynchronous), with the layer's activation.
* ``MoonEPExperts._supports_activation`` declares SiLU and SiTU (vLLM's: SiLU only), so vLLM's backend oracle,
  which allows only MoonEP under ``moonep``, keeps it for a SiTU layer (Kimi K3) and still refuses every other
  activation.
* ``MoonEPExperts.__init__`` refuses a SiTU layer without its beta when the layer is built, not at its first
  step (``activation.py``).

Always on vLLM's own class: with ``MOONEP_EP_CPU=1`` the module's ``MoonEPExperts`` is by then the CPU engine's
subclass (``cpu/patches.py``, applied first), whose base is vLLM's.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ..hooks import Install, Mark, Note, Patch, is_wrapped

MOD_EXPERTS = "vllm.model_executor.layers.fused_moe.experts.moonep_experts"


def vllm_experts_class(module: ModuleType) -> Any:
    """vLLM's ``MoonEPExperts``, under the CPU engine's subclass if the module holds that."""
    cls = module.MoonEPExperts
    while getattr(cls, "_moonep_ep_cpu", False) and cls.__bases__:
        cls = cls.__bases__[0]
    return cls


def patch_overlap(module: ModuleType, *, install: Install, mark: Mark, note: Note) -> None:
    """``apply`` and ``_supports_activation`` (``overlap.patch_experts``), then the activation check at build."""
    from .overlap import patch_experts

    if patch_experts(module):
        mark("MoonEPExperts.apply (own experts before the prefetch wait, SiLU or SiTU)")
        if is_wrapped(vllm_experts_class(module)._supports_activation):
            mark("MoonEPExperts._supports_activation (SiLU, SiTU)")
    _check_activation_at_build(module, install)


def _check_activation_at_build(module: ModuleType, install: Install) -> None:
    """``MoonEPExperts.__init__``: the layer's activation is one :func:`overlap.apply` computes, with its betas
    (``activation.activation_of``), checked when vLLM builds the layer's kernel on every rank."""
    cls = vllm_experts_class(module)
    orig = cls.__init__
    if is_wrapped(orig):
        return

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig(self, *args, **kwargs)
        from .activation import activation_of

        activation_of(self.moe_config)   # ConfigError naming the activation (or the missing beta) and the fix

    install(cls, "__init__", __init__, orig, "MoonEPExperts.__init__ (activation and betas)")


#: The plugin applies this table last: on ``moonep_experts`` after the CPU engine's subclass.
PATCHES: tuple[Patch, ...] = (Patch(MOD_EXPERTS, patch_overlap),)
