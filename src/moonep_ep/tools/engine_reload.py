"""Engine tier, weight updates and load memory: what ``vllm-demo --reload`` adds to the DP run and its summary.

In every DP rank's process, after the first generation on checkpoint A
(:func:`run_reload_sequence`):

1. the data pointers of every MoE layer's parameters and ``[E+B]`` views are
   read from the worker (:class:`MoonEPProbe`, a vLLM worker extension);
2. generation is paused on every DP rank together (vLLM's ``pause_scheduler``:
   a DP-wide consensus, so no rank is still stepping a wave whose MoE layers
   need its peers), then ``collective_rpc("reload_weights", weights_path=B)``
   updates the weights in place, then generation resumes;
3. pointers again, and the same prompts are generated on B;
4. the same with a checkpoint whose experts have another shape: the reload
   must fail (its message is kept), pointers stay, and the next generation
   must repeat step 3's tokens (the old weights still serve).

The oracle for step 3 is a fresh single-process engine started on B (the
harness runs it next to the reference on A). :func:`load_memory_fields` and
:func:`reload_fields` turn the workers' stats and these results into the
``vllm-demo --json`` fields.
"""

from __future__ import annotations

import time
from typing import Any

PROBE = "moonep_ep.tools.engine_reload.MoonEPProbe"


class MoonEPProbe:
    """Worker extension (``LLM(worker_extension_cls=...)``): methods run in the worker via ``collective_rpc``."""

    def moonep_ep_pointers(self) -> dict[str, dict[str, int]]:
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        out = {}
        for name, module in model.named_modules():
            layout = getattr(module, "_moonep_weight_layout", None)
            if layout is None:
                continue
            out[name] = {"w13_weight": module.w13_weight.data_ptr(), "w2_weight": module.w2_weight.data_ptr(),
                         "full_gate_weight": layout.full_gate_weight.data_ptr(),
                         "full_up_weight": layout.full_up_weight.data_ptr(),
                         "full_down_weight": layout.full_down_weight.data_ptr()}
        return out

    def moonep_ep_memory(self) -> dict[str, Any]:
        """What vLLM measured for this worker (model memory, KV cache) next to the store's physical bytes."""
        import torch
        from vllm.distributed import get_ep_group

        manager = getattr(get_ep_group().device_communicator, "all2all_manager", None)
        runner = self.model_runner  # type: ignore[attr-defined]
        snapshot = getattr(self, "init_snapshot", None)
        free, total = torch.cuda.mem_get_info() if torch.cuda.is_available() else (None, None)
        return {"store_bytes": manager.store_bytes() if hasattr(manager, "store_bytes") else None,
                "model_memory_usage": int(getattr(runner, "model_memory_usage", 0) or 0),
                "total_consumed": getattr(self, "total_consumed", None),
                "requested_memory": getattr(self, "requested_memory", None),
                "available_kv_cache_memory_bytes": getattr(self, "available_kv_cache_memory_bytes", None),
                "init_free_memory": getattr(snapshot, "free_memory", None),
                "free_memory_now": free, "total_memory": total,
                "gpu_memory_utilization": self.cache_config.gpu_memory_utilization}  # type: ignore[attr-defined]


def reload_kwargs(cfg: Any) -> dict[str, Any]:
    """``LLM`` keyword arguments the reload sequence needs (the pointer probe)."""
    return {"worker_extension_cls": PROBE} if getattr(cfg, "reload_model_dir", None) else {}


def _generate(llm: Any, prompts: list[str], params: Any) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)] if prompts else []


def _paused(llm: Any, call: Any) -> Any:
    """Run ``call()`` while every DP rank's scheduler is paused (vLLM's DP-wide pause consensus)."""
    core = llm.llm_engine.engine_core
    core.call_utility("pause_scheduler", "abort", False)
    try:
        return call()
    finally:
        core.call_utility("resume_scheduler")


def run_reload_sequence(llm: Any, cfg: Any, prompts: list[str], params: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"pointers_a": llm.collective_rpc("moonep_ep_pointers")[0]}
    t0 = time.perf_counter()
    _paused(llm, lambda: llm.collective_rpc("reload_weights", kwargs={"weights_path": cfg.reload_model_dir}))
    out["reload_s"] = round(time.perf_counter() - t0, 2)
    out["pointers_b"] = llm.collective_rpc("moonep_ep_pointers")[0]
    out["token_ids_b"] = _generate(llm, prompts, params)
    out["wrong_shape_error"] = None
    if cfg.wrong_shape_model_dir:
        def wrong() -> None:
            try:
                llm.collective_rpc("reload_weights", kwargs={"weights_path": cfg.wrong_shape_model_dir})
            except Exception as exc:  # noqa: BLE001 - the refusal is the expected result
                out["wrong_shape_error"] = f"{type(exc).__name__}: {exc}"

        _paused(llm, wrong)
        out["pointers_after_wrong_shape"] = llm.collective_rpc("moonep_ep_pointers")[0]
        out["token_ids_after_wrong_shape"] = _generate(llm, prompts, params)
    return out


def load_memory_fields(stats: list[dict[str, Any]], ranks: list[int]) -> dict[str, Any]:
    """The load-peak fields of the summary, from every EP rank's stats (either layout)."""
    by_rank = {s.get("ep_rank"): s for s in stats if s.get("ep_rank") is not None}
    per = [by_rank.get(r, {}) for r in ranks]
    layout = sorted({s.get("layout") for s in per if s.get("layout")})
    peaks = [(s.get("load_memory") or {}).get("peak_expert_bytes") for s in per]
    stores = [s.get("store") or {} for s in per]
    replicated = [s.get("replicated") or {} for s in per]
    one_layer = [st.get("one_layer_local_bytes") or rep.get("one_layer_local_bytes")
                 for st, rep in zip(stores, replicated)]
    final = [(st.get("physical_bytes") or {}).get("total_bytes") or rep.get("layout_bytes")
             for st, rep in zip(stores, replicated)]
    within = [isinstance(p, int) and isinstance(f, int) and isinstance(o, int) and p <= f + o
              for p, f, o in zip(peaks, final, one_layer)]
    return {
        "layout_measured": layout,
        "load_peak_expert_bytes_per_rank": peaks,
        "one_layer_local_expert_bytes": one_layer[0] if len(set(one_layer)) == 1 else one_layer,
        "final_expert_bytes_per_rank": final,
        "load_peak_within_final_plus_one_layer_by_rank": within,
        "load_peak_at_by_rank": [(s.get("load_memory") or {}).get("peak_at") for s in per],
        "load_peak_tensors_by_rank": [(s.get("load_memory") or {}).get("tensors_at_peak") for s in per],
        "load_peak_samples_by_rank": [(s.get("load_memory") or {}).get("samples") for s in per],
        "load_peak_method": (per[0].get("load_memory") or {}).get("method") if per else None,
        "update_peak_expert_bytes_per_rank": [(s.get("update_memory") or {}).get("peak_expert_bytes") for s in per],
        "weight_passes_by_rank": [s.get("passes") for s in per],
    }


def reload_fields(dp: dict[int, Any], single_a: dict[str, Any], single_b: dict[str, Any] | None,
                  n_prompts: int) -> dict[str, Any]:
    """The ``--reload`` fields: tokens after the update vs a fresh engine on B, pointers, the wrong-shape refusal.

    ``reload_changes_tokens`` is the positive control: A and B must generate
    differently, or matching B would not show that the update took effect."""
    ref = {g["index"]: g["token_ids"] for g in (single_b or {}).get("generated", [])}
    ref_a = {g["index"]: g["token_ids"] for g in single_a.get("generated", [])}
    got: dict[int, list[int]] = {}
    after_wrong: dict[int, list[int]] = {}
    pointers_same, pointers_same_after_wrong, errors, seconds = [], [], [], []
    for rank in sorted(dp):
        seq = dp[rank].get("reload") or {}
        indices = [g["index"] for g in dp[rank]["generated"]]
        got.update(zip(indices, seq.get("token_ids_b") or []))
        after_wrong.update(zip(indices, seq.get("token_ids_after_wrong_shape") or []))
        pointers_same.append(bool(seq.get("pointers_a")) and seq.get("pointers_a") == seq.get("pointers_b"))
        pointers_same_after_wrong.append(bool(seq.get("pointers_a"))
                                         and seq.get("pointers_a") == seq.get("pointers_after_wrong_shape"))
        errors.append(seq.get("wrong_shape_error"))
        seconds.append(seq.get("reload_s"))
    match = len(ref) == n_prompts and all(got.get(i) == ref[i] for i in range(n_prompts))
    return {
        "reload_tokens_match_fresh_engine": match,
        "reload_changes_tokens": bool(ref) and any(ref.get(i) != ref_a.get(i) for i in range(n_prompts)),
        "reload_mismatched_prompts": [i for i in range(n_prompts) if got.get(i) != ref.get(i)],
        "reload_pointers_unchanged_by_rank": pointers_same,
        "reload_seconds_by_rank": seconds,
        "wrong_shape_reload_error_by_rank": errors,
        "wrong_shape_reload_refused": all(e is not None for e in errors) and bool(errors),
        "wrong_shape_pointers_unchanged_by_rank": pointers_same_after_wrong,
        "generation_after_wrong_shape_matches_b": bool(after_wrong) and all(
            after_wrong.get(i) == got.get(i) for i in range(n_prompts)),
        "fresh_engine_b_token_ids": [ref.get(i) for i in range(n_prompts)],
    }
