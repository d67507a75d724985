"""vLLM's MoonEP prepare counts each expert's entries on the device, not with ``torch.bincount``.

``MoonEPPrepareAndFinalize.prepare`` (vLLM 0.33.0, ``prepare_finalize/moonep.py``) computes MoonEP's
``tokens_per_expert`` as ``torch.bincount(ids, minlength=E)``. On a GPU ``bincount`` reads the ids' maximum
back to the host to size its output: one device round trip per MoE layer and step, and an op CUDA graph
capture refuses. The ids there are the padded top-k ids, always in ``[0, E)`` (the router's, and the
capacity padding's, ``padding.py``), so the output is ``minlength`` long and a scatter-add over a
``minlength`` zero vector gives the same counts without a read.

The patch binds the module's ``torch`` name to :data:`TORCH_COUNTING_ON_DEVICE`, which is ``torch`` except for
``bincount``; the rest of vLLM's ``prepare`` runs unchanged. An id outside ``[0, minlength)`` fails the
scatter-add (a device-side index error on GPUs, an ``IndexError`` on CPU) where ``bincount`` would have
returned a longer vector that MoonEP's dispatch then refuses: both stop the step.
"""

from __future__ import annotations

import types
from typing import Any, Optional

import torch

__all__ = ["TORCH_COUNTING_ON_DEVICE", "bincount_on_device"]


def bincount_on_device(input: torch.Tensor, weights: Optional[torch.Tensor] = None,
                       minlength: int = 0) -> torch.Tensor:
    """``torch.bincount`` for ids known to lie in ``[0, minlength)``: int64 counts by a scatter-add on the ids'
    device. Weighted or unsized calls (``minlength`` 0) go to ``torch.bincount``."""
    if weights is not None or minlength <= 0 or input.dim() != 1:
        return torch.bincount(input, weights=weights, minlength=minlength)
    ids = input.to(torch.int64)
    return torch.zeros(minlength, dtype=torch.int64, device=ids.device).index_add_(0, ids, torch.ones_like(ids))


class _TorchCountingOnDevice(types.ModuleType):
    """``torch`` for the names a module looks up on it, with :func:`bincount_on_device` as ``bincount``."""

    bincount = staticmethod(bincount_on_device)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


#: What the patched module sees as ``torch``.
TORCH_COUNTING_ON_DEVICE = _TorchCountingOnDevice("torch")


def count_on_device(module: Any) -> bool:
    """Bind ``module.torch`` to :data:`TORCH_COUNTING_ON_DEVICE`; False if already done."""
    if getattr(module, "torch", None) is TORCH_COUNTING_ON_DEVICE:
        return False
    module.torch = TORCH_COUNTING_ON_DEVICE
    return True
