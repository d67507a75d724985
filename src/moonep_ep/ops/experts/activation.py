"""The gated activation of an expert FFN: SiLU (DeepSeek-V3, Kimi K2) or SiTU (Kimi K3).

Every expert path (CPU grouped FFN, the quantized CPU and GPU experts, the
own-experts-first overlap path) takes one :class:`GatedActivation` from the
layer and calls it on the gate and up projections; none assumes SiLU.

* ``silu``: ``silu(gate) * up`` in the inputs' dtype, as vLLM 0.33.0's
  ``MoonEPExperts`` computes it on bf16 tensors (two roundings: ``silu`` and
  the product).
* ``situ`` (vLLM 0.33.0 ``SituAndMul.forward_native``, the reference its CUDA
  op follows): both halves in fp32,
  ``beta·tanh(g/beta)·sigmoid(g) · linear_beta·tanh(u/linear_beta)``, one
  rounding of the product to the inputs' dtype. ``linear_beta`` unset (None,
  or ``<= 0`` as the CUDA op's ``-1.0`` means) leaves ``u`` as is. No clamp.
  Kimi K3 ships ``beta`` 4.0 and ``linear_beta`` 25.0.

This eager chain (SiTU: about a dozen fp32 kernels) is the reference and the
path where no Triton kernel runs. The GPU experts compute the same rounding
steps, with the route weight, in one Triton pass over the row blocks that hold
a token (:mod:`.gated_activation_kernel`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F

#: the activations an expert path computes; anything else is refused before an engine starts
SUPPORTED_ACTIVATIONS = ("silu", "situ")


@dataclasses.dataclass(frozen=True)
class GatedActivation:
    """``act(gate, up)`` of a gated expert FFN.

    ``name``: ``"silu"`` or ``"situ"``; ``beta``: SiTU's gate saturation (required for SiTU);
    ``linear_beta``: SiTU's up saturation (None: none)."""

    name: str = "silu"
    beta: Optional[float] = None
    linear_beta: Optional[float] = None

    def __post_init__(self) -> None:
        if self.name not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"expert activation {self.name!r} is not supported: the expert paths compute "
                             f"{' or '.join(SUPPORTED_ACTIVATIONS)}")
        if self.name == "situ":
            if self.beta is None or not float(self.beta) > 0:
                raise ValueError(f"SiTU needs beta > 0 (activation_situ_beta), got {self.beta!r}")
            if self.linear_beta is not None and float(self.linear_beta) <= 0:
                object.__setattr__(self, "linear_beta", None)   # the CUDA op's "unset"
        elif self.beta is not None or self.linear_beta is not None:
            raise ValueError(f"betas are SiTU's; {self.name} takes none (got {self.beta}, {self.linear_beta})")

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``[n, I]`` gate and up -> ``[n, I]`` in ``gate``'s dtype (a new tensor; inputs untouched)."""
        if self.name == "silu":
            act = F.silu(gate)
            return act.mul_(up)
        return situ(gate, up, float(self.beta), self.linear_beta)


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: Optional[float]) -> torch.Tensor:
    """SiTU-GLU in fp32, rounded once to ``gate``'s dtype."""
    g = gate.float()
    g = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    u = up.float()
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return (g * u).to(gate.dtype)


SILU = GatedActivation()
