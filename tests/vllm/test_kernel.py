"""Kernel tier: vLLM 0.33.0's real MoonEP classes over the sharded layout, 2 and 4 gloo ranks (CPU).

Runs ``python -m moonep_ep.tools.kernel_check`` in the ``vllm==0.33.0``
environment (see ``tests/support/vllm_envs.py``) and asserts on its JSON: vLLM's
``FusedMoEKernel(MoonEPPrepareAndFinalize, MoonEPExperts)`` over the
plugin's sharded ``[E+B]`` views equals a dense fp32 torch MoE within bf16
tolerance under skewed routing, equals vLLM's replicated (all-gathered)
layout bit for bit, prefetches redundant experts from remote owners, and
holds fewer expert bytes per rank (printed side by side).
"""

from __future__ import annotations

import pytest

from tests.support.vllm_envs import run_json

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("ranks", [2, 4])
def test_real_vllm_kernel_sharded_equals_dense_and_replicated(ranks, capsys):
    out = run_json("vllm", ["-m", "moonep_ep.tools.kernel_check", "--ranks", str(ranks), "--json"], timeout=280)
    assert out["ok"]
    results = out["ranks"]
    E, L = out["case"]["experts"], out["case"]["layers"]
    assert len(results) == ranks
    for r in results:
        rank = r["rank"]
        # vLLM's own classes ran, over vLLM's layout type, and the plugin's patches were in place.
        assert r["pf_class"] == "MoonEPPrepareAndFinalize"
        assert r["experts_class"].endswith("moonep_experts.MoonEPExperts")
        assert r["layout_is_vllm_class"] and r["w13_is_gate_view"]
        B = r["store"]["slots"]
        assert r["view_shapes"] == [[E + B, 128, 256], [E + B, 128, 256], [E + B, 256, 128]]
        # Loading: local experts only, no expert byte in any collective; vLLM's all-gather did
        # carry them for the replicated layers (the detector works).
        assert r["load_weight_bytes_sharded"] == 0, r["load_collectives_sharded"]
        assert set(r["load_collectives_sharded"]) <= {"all_gather_object"}
        assert r["load_weight_bytes_replicated"] > 0
        assert r["store"]["collective_rounds"]["handle_exchange"] == 1  # all layers + slot pool, one round
        assert r["original_params_freed"] and r["store_ready"] and r["store_released"]
        assert r["bad_rows"] == 0                     # row e of every view == owner's expert e
        assert r["slot_pool_shared_by_layers"]
        for layer in r["layers"]:
            assert layer["within_tolerance"], (rank, layer)
            assert layer["sharded_equals_replicated"], (rank, layer)
            assert layer["slot_contents_ok"], (rank, layer)
        # Bytes: measured by the OS (memfd sizes) vs the replicated tensors' storage.
        assert r["sharded_bytes_measured_os"] == r["sharded_bytes"]
        assert r["replicated_bytes_measured"] == r["replicated_bytes_formula"]
        assert r["sharded_bytes_measured_os"] < r["replicated_bytes_measured"]
    # Skewed routing made ranks prefetch experts owned by other ranks.
    assert sum(r["remote_prefetched"] for r in results) > 0
    assert any(o != r["rank"] for r in results for layer in r["layers"] for _, _, o in layer["slots"])
    with capsys.disabled():
        print(f"\n[kernel tier, {ranks} ranks, {L} layers, E={E}] per-rank expert bytes:")
        print(f"  {'rank':>4}  {'sharded (OS-measured)':>22}  {'replicated [E+B]':>18}")
        for r in results:
            print(f"  {r['rank']:>4}  {r['sharded_bytes_measured_os']:>22,}  {r['replicated_bytes_measured']:>18,}")
        errs = [layer["max_abs_err"] for r in results for layer in r["layers"]]
        print(f"  max |sharded - dense fp32| = {max(errs):.4f}; sharded == replicated on every rank and layer")


def test_misconfigurations_fail_on_every_rank_with_a_fix():
    out = run_json("vllm", ["-m", "moonep_ep.tools.kernel_check", "--bad", "all", "--ranks", "2"], timeout=180)
    assert out["ok"]
    needles = {
        "experts_not_divisible": "E % EP size == 0",
        "hidden_not_128": "hidden_size to be a multiple of 128",
        "intermediate_not_128": "moe_intermediate_size to be a multiple of 128",
        "ranks_disagree": "describe the MoE layers differently",
        "nonlinear_placement": "needs the linear placement",
        "fp16": "bf16 expert weights",
        "buffer_moonep_on_cpu": "MOONEP_EP_BUFFER=moonep, but the real MoonEP library runs on CUDA GPUs only",
    }
    for rank, msgs in enumerate(out["messages"]):
        assert set(msgs) == set(needles)
        assert "MoonEP backend selection" in msgs["buffer_moonep_on_cpu"]  # raised on every rank, together
        for case, needle in needles.items():
            assert needle in msgs[case] and "Fix:" in msgs[case], (rank, case, msgs[case])


def test_plugin_is_lazy_idempotent_and_leaves_other_backends_alone():
    out = run_json("vllm", ["-m", "moonep_ep.tools.kernel_check", "--plugin-checks"], timeout=120)
    assert out["compat"]["supported"] and out["compat"]["version"] == "0.33.0"
    assert out["compat"]["moonep_files_match"]
    # Nothing is imported or patched at plugin load; the patches wait for their modules.
    assert out["first"]["patched"] == [] and out["first"]["active"]
    assert "vllm.distributed.device_communicators.all2all" in out["first"]["pending"]
    assert out["second"] == out["first"]  # a second load changes nothing
    assert out["wrapped_in_oracle"] and out["wrapped_in_method"] and out["wrapped_once"]
    assert out["other_backend_untouched"]


def test_kernel_verdict_fails_when_any_check_fails():
    """Positive control of the kernel tier's "ok": one failed check on one rank makes it false."""
    from moonep_ep.tools.kernel_check import verdict

    def passing(rank: int) -> dict:
        layer = {"within_tolerance": True, "sharded_equals_replicated": True, "slot_contents_ok": True}
        return {"rank": rank, "layers": [dict(layer), dict(layer)], "bad_rows": 0, "load_weight_bytes_sharded": 0,
                "load_weight_bytes_replicated": 4096, "store": {"collective_rounds": {"handle_exchange": 1}},
                "original_params_freed": True, "store_ready": True, "store_released": True,
                "sharded_bytes_measured_os": 10, "sharded_bytes": 10, "replicated_bytes_measured": 20,
                "remote_prefetched": rank}
    assert verdict([passing(0), passing(1)]) == []
    broken = [passing(0), passing(1)]
    broken[1]["layers"][1]["sharded_equals_replicated"] = False
    assert verdict(broken) == ["rank 1: sharded output equals vLLM's replicated layout"]
    assert verdict([passing(0), passing(0)]) == [
        "no rank prefetched an expert from a remote owner (skewed routing should make them)"]
