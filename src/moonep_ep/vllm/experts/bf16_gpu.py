"""The BF16 experts on CUDA: the quantized experts' row-bounded kernels with bf16 weights.

vLLM's ``MoonEPExperts`` (and :func:`~moonep_ep.vllm.experts.overlap.apply` on CPU) runs ``torch._grouped_mm``
over all ``NvS`` rows, the activation eagerly over every row, then copies the ``[NvS, H]`` result into
``output``: at Kimi K3's decode shapes 483 MB (SiLU) and 2333 MB (SiTU) of non-GEMM writes per layer for
12.6 MB of live activation (``tests/ops/test_expert_bytes.py``). On CUDA ``overlap.apply`` runs
:meth:`Bf16TritonExperts.grouped_ffn` instead, ``experts/gpu.gpu_grouped_ffn`` in its ``bf16`` form:

* vLLM 0.33.0's ``fused_moe_kernel`` unquantized, over block metadata built on the device from ``cu_seqlens``
  (``ops/experts/grouped_blocks.py``; blocks of padding only skipped), outputs ``torch.empty``;
* the fused gated activation kernel (SiLU, or SiTU fp32 inside rounded once) times the route weight, over the
  computed blocks only;
* the down GEMM writing ``output`` in place; rows past ``cu_seqlens[-1]`` are not written (combine never reads
  them).

Own experts first, then the slot fill's wait, then the slots, as on CPU; but each part is the same launches over
all rows with the block metadata limited to its weight rows on the device
(:func:`~moonep_ep.ops.experts.grouped_blocks.restrict_to_groups`): no host read of ``cu_seqlens``.

:class:`Bf16TritonExperts` is also what the Triton warm-up (``warmup.py``) reads: the layer's views and tile
configs (``gpu.kernel_config`` for ``bf16``: vLLM's tuned bf16 entries), registered when vLLM binds the
layer's weights on a GPU (``overlap.patch_experts``).
"""

from __future__ import annotations

import types
from typing import Any, Optional

import torch

from ...ops.experts.activation import SILU
from ...ops.experts.grouped_blocks import GroupedBlocks, grouped_blocks, skip_zero_weight_blocks

__all__ = ["Bf16TritonExperts", "gpu_experts", "runs_here"]

#: the attribute of vLLM's experts object that holds its :class:`Bf16TritonExperts`
GPU_EXPERTS_ATTR = "_moonep_ep_bf16_gpu"


def runs_here(t: torch.Tensor) -> bool:
    """Whether the BF16 experts take the row-bounded kernels for rows on ``t``'s device: CUDA (the CPU engine
    keeps ``torch._grouped_mm``)."""
    return t.device.type == "cuda"


def default_token_padding() -> int:
    """What vLLM's MoonEP handle is built with (every group padded to it)."""
    from vllm.model_executor.layers.fused_moe.prepare_finalize.moonep import MOONEP_DEFAULT_TOKEN_PADDING

    return int(MOONEP_DEFAULT_TOKEN_PADDING)


class Bf16TritonExperts:
    """One BF16 MoonEP layer's experts as Triton launches (the quantized Triton experts' interface)."""

    experts_kind = "triton"

    def __init__(self, experts: Any, *, token_padding: Optional[int] = None, interpreter: bool = False) -> None:
        self.experts = experts
        self.moe_config = experts.moe_config
        self.token_padding = default_token_padding() if token_padding is None else int(token_padding)
        self.interpreter = interpreter
        self._configs: dict[tuple[int, int], dict[str, int]] = {}

    @property
    def _weight_layout(self) -> Any:
        """``format`` and ``views`` (gate, up, down ``[E+B]``) of the layer's layout, read at each call."""
        layout = self.experts._weight_layout
        return types.SimpleNamespace(format="bf16", views={"gate": layout.full_gate_weight,
                                                           "up": layout.full_up_weight,
                                                           "down": layout.full_down_weight})

    def config(self, hidden: torch.Tensor, topk_ids: torch.Tensor) -> dict[str, int]:
        """The tiles for this step's real tokens (``topk_ids``' rows: a shape, no host sync), as the quantized
        Triton experts pick them."""
        from .gpu import kernel_config

        tokens, top_k = int(topk_ids.size(0)), max(int(topk_ids.size(1)), 1)
        key = (tokens, top_k)
        if key not in self._configs:
            moe = self.moe_config
            self._configs[key] = kernel_config("bf16", local_experts=moe.num_local_experts, hidden=hidden.shape[1],
                                               intermediate=moe.intermediate_size_per_partition, tokens=tokens,
                                               top_k=top_k, token_padding=self.token_padding,
                                               interpreter=self.interpreter)
        return self._configs[key]

    def blocks(self, hidden: torch.Tensor, cu_seqlens: torch.Tensor, route: Optional[torch.Tensor],
               topk_ids: torch.Tensor) -> GroupedBlocks:
        """The step's block metadata over all rows (padding-only blocks ``-1``), built once for both parts."""
        blocks = grouped_blocks(cu_seqlens, hidden.shape[0], int(self.config(hidden, topk_ids)["BLOCK_SIZE_M"]))
        return blocks if route is None else skip_zero_weight_blocks(blocks, route)

    def grouped_ffn(self, layout: Any, hidden: torch.Tensor, cu_seqlens: torch.Tensor, route: Any,
                    topk_ids: torch.Tensor, *, activation: Any = SILU, out: Any = None,
                    blocks: Optional[GroupedBlocks] = None) -> torch.Tensor:
        """The FFN's rows of ``blocks`` (default: every group), written into ``out`` in place when given."""
        from .gpu import gpu_grouped_ffn

        if blocks is None:
            blocks = self.blocks(hidden, cu_seqlens, route, topk_ids)
        return gpu_grouped_ffn("bf16", hidden, layout.views, cu_seqlens, route, token_padding=self.token_padding,
                               config=self.config(hidden, topk_ids), blocks=blocks, activation=activation, out=out)


def gpu_experts(experts: Any, **kwargs: Any) -> Bf16TritonExperts:
    """vLLM's experts object's :class:`Bf16TritonExperts` (made once, kept on it)."""
    gpu = getattr(experts, GPU_EXPERTS_ATTR, None)
    if gpu is None:
        gpu = Bf16TritonExperts(experts, **kwargs)
        setattr(experts, GPU_EXPERTS_ATTR, gpu)
    return gpu
