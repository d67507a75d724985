"""A small model of vLLM 0.33.0's real MoE layers (``RoutedExperts``) and its checkpoints, for the kernel tier.

``TinyMoEModel`` holds ``L`` of vLLM's ``RoutedExperts`` (vLLM's constructor,
its ``UnquantizedFusedMoEMethod`` with the backend the parallel config selects,
``create_weights`` as patched by the plugin) and routes checkpoint names to
``RoutedExperts.load_weights`` as vLLM's MoE runner does. :func:`build` does
what ``base_loader.initialize_model`` does with the plugin active: construct,
record the reload metadata, bind the MoonEP layers to a store.
:func:`checkpoint` yields the routed experts of a deterministic checkpoint
(any rank can regenerate any expert).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

SEED_A, SEED_B = 0, 1


@dataclasses.dataclass
class KernelCase:
    ranks: int = 2
    experts: int = 16
    top_k: int = 4
    hidden: int = 256
    intermediate: int = 128
    layers: int = 2
    tokens: int = 128          # rank r routes tokens - 9*r tokens (all within one pool capacity)
    skew: float = 8.0
    max_num_tokens: int = 256
    seed: int = 0
    activation: str = "silu"   # or "situ", with Kimi K3's betas (SITU_BETAS)


#: Kimi K3's SiTU betas (its config.json): what a SiTU layer's FusedMoEConfig carries
SITU_BETAS = {"activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0}


def expert_weights(case: KernelCase, layer: int, expert: int) -> tuple[Any, Any, Any]:
    """gate ``[I, H]``, up ``[I, H]``, down ``[H, I]`` bf16 of one global expert (any rank can regenerate it)."""
    import torch

    g = torch.Generator().manual_seed(case.seed * 1_000_003 + layer * 10_007 + expert)
    I, H = case.intermediate, case.hidden
    gate = (torch.randn(I, H, generator=g) * 0.06).to(torch.bfloat16)
    up = (torch.randn(I, H, generator=g) * 0.06).to(torch.bfloat16)
    down = (torch.randn(H, I, generator=g) * 0.06).to(torch.bfloat16)
    return gate, up, down


def fused_moe_config(case: KernelCase, rank: int) -> Any:
    import torch
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (FusedMoEConfig, FusedMoEParallelConfig,
                                                             RoutingMethodType)

    R = case.ranks
    pc = FusedMoEParallelConfig(tp_size=1, pcp_size=1, dp_size=R, ep_size=R, tp_rank=0, pcp_rank=0, dp_rank=rank,
                                ep_rank=rank, sp_size=1, use_ep=True, all2all_backend="moonep", enable_eplb=False)
    return FusedMoEConfig(num_experts=case.experts, experts_per_token=case.top_k, hidden_dim=case.hidden,
                          intermediate_size=case.intermediate, num_local_experts=case.experts // R,
                          num_logical_experts=case.experts, activation=MoEActivation(case.activation),
                          device="cpu", routing_method=RoutingMethodType.Renormalize, moe_parallel_config=pc,
                          in_dtype=torch.bfloat16, max_num_tokens=case.max_num_tokens,
                          **(SITU_BETAS if case.activation == "situ" else {}))


def _layer_names(case: KernelCase, prefix: str = "model") -> list[str]:
    return [f"{prefix}.layers.{l}.mlp.experts" for l in range(case.layers)]


def checkpoint(case: KernelCase, seed: int, rank: int | None = None, reverse: bool = False,
               intermediate: int | None = None, skip_layer: int | None = None) -> Iterator[tuple[int, str, Any]]:
    """``(layer, name, tensor)`` of every routed expert (``rank``: only that rank's experts), HF names."""
    import torch

    c = KernelCase(**{**case.__dict__, "seed": seed})
    epn = case.experts // case.ranks
    experts = range(case.experts) if rank is None else range(rank * epn, (rank + 1) * epn)
    order = [(l, e) for l in range(case.layers) for e in experts if l != skip_layer]
    for l, e in (reversed(order) if reverse else order):
        gate, up, down = expert_weights(c, l, e)
        if intermediate is not None:  # another model's shape
            gate, up = (torch.zeros(intermediate, case.hidden, dtype=torch.bfloat16) for _ in range(2))
            down = torch.zeros(case.hidden, intermediate, dtype=torch.bfloat16)
        yield l, f"{e}.gate_proj.weight", gate
        yield l, f"{e}.up_proj.weight", up
        yield l, f"{e}.down_proj.weight", down


def model_class() -> Any:
    import torch

    class TinyMoEModel(torch.nn.Module):
        """``L`` of vLLM's ``RoutedExperts``; ``load_weights`` routes names as vLLM's MoE runner does."""

        def __init__(self, case: KernelCase, rank: int, prefix: str = "model") -> None:
            super().__init__()
            from vllm.model_executor.layers.fused_moe.expert_map_manager import ExpertMapManager
            from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

            moe_cfg = fused_moe_config(case, rank)
            layers = []
            for name in _layer_names(case, prefix):
                emm = ExpertMapManager(max_num_batched_tokens=case.max_num_tokens, top_k=case.top_k,
                                       global_num_experts=case.experts, num_redundant_experts=0,
                                       num_expert_group=None, moe_parallel_config=moe_cfg.moe_parallel_config,
                                       placement_strategy="linear", enable_eplb=False)
                layers.append(RoutedExperts(name, torch.bfloat16, moe_cfg, None, expert_map_manager=emm))
            self.layers = torch.nn.ModuleList(layers)

        def load_weights(self, weights: Any) -> set[str]:
            loaded: set[str] = set()
            for l, name, tensor in weights:
                loaded.update(self.layers[l].load_weights([(name, tensor)]))
            return loaded

    return TinyMoEModel


def build(case: KernelCase, rank: int, prefix: str = "model") -> Any:
    """What ``base_loader.initialize_model`` does with the plugin active: construct, record, bind."""
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

    from moonep_ep.vllm.store import loading
    from moonep_ep.vllm.store.patches import sharded_manager

    model = model_class()(case, rank, prefix)
    record_metadata_for_reloading(model)
    loading.bind_model(model, sharded_manager().new_model_store)
    return model
