"""Kernel tier: vLLM 0.33.0's real MoonEP classes over the sharded layout, 2 and 4 gloo ranks (CPU).

Runs ``python -m tests.support.kernel_check`` in the ``vllm==0.33.0``
environment (see ``tests/support/vllm_envs.py``) and asserts on its JSON: vLLM's
own MoE layers (``RoutedExperts``) load their experts straight into the
plugin's store (parameters on ``meta``), and vLLM's
``FusedMoEKernel(MoonEPPrepareAndFinalize, MoonEPExperts)`` over the
sharded ``[E+B]`` views equals a dense fp32 torch MoE within bf16
tolerance under skewed routing, equals vLLM's replicated (all-gathered)
layout bit for bit, prefetches redundant experts from remote owners, and
holds fewer expert bytes per rank (printed side by side).

``python -m tests.support.load_check`` (one 2-rank start for every case):
zero-copy load with its measured peak, stale slots (with a positive
control), vLLM's own in-place ``reload_weights`` to another checkpoint,
wrong-shape updates refused on every rank (iterator and disk pre-check),
missing rows, a model built later, and sleep mode refused.
"""

from __future__ import annotations

import time

import pytest

from tests.support.vllm_envs import run_json

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("ranks", [2, 4])
def test_real_vllm_kernel_sharded_equals_dense_and_replicated(ranks, report):
    out = run_json("vllm", ["-m", "tests.support.kernel_check", "--ranks", str(ranks), "--json"], timeout=280)
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
        assert r["sharded_param_devices"] == ["meta"]  # vLLM's expert parameters never held memory
        assert r["replicated_is_vllm_path"] and r["vllm_gather_calls"] == L  # the A/B layers took vLLM's path
        assert r["store_ready"] and r["store_released"]
        assert r["bad_rows"] == 0                     # row e of every view == owner's expert e
        assert r["slot_pool_shared_by_layers"]
        for layer in r["layers"]:
            assert layer["within_tolerance"], (rank, layer)
            assert layer["sharded_equals_replicated"], (rank, layer)
            assert layer["slot_contents_ok"] is (True if layer["slots"] else None), (rank, layer)
        # Bytes: measured by the OS (memfd sizes) vs the replicated tensors' storage.
        assert r["sharded_bytes_measured_os"] == r["sharded_bytes"]
        assert r["replicated_bytes_measured"] == r["replicated_bytes_formula"]
        assert r["sharded_bytes_measured_os"] < r["replicated_bytes_measured"]
    # Skewed routing made ranks prefetch experts owned by other ranks.
    assert sum(r["remote_prefetched"] for r in results) > 0
    assert any(o != r["rank"] for r in results for layer in r["layers"] for _, _, o in layer["slots"])
    report(f"[kernel tier, {ranks} ranks, {L} layers, E={E}] per-rank expert bytes:")
    report(f"  {'rank':>4}  {'sharded (OS-measured)':>22}  {'replicated [E+B]':>18}")
    for r in results:
        report(f"  {r['rank']:>4}  {r['sharded_bytes_measured_os']:>22,}  {r['replicated_bytes_measured']:>18,}")
    errs = [layer["max_abs_err"] for r in results for layer in r["layers"]]
    report(f"  max |sharded - dense fp32| = {max(errs):.4f}; sharded == replicated on every rank and layer")


def test_misconfigurations_fail_on_every_rank_with_a_fix():
    out = run_json("vllm", ["-m", "tests.support.kernel_check", "--bad", "all", "--ranks", "2"], timeout=180)
    assert out["ok"]
    needles = {
        "experts_not_divisible": "E % EP size == 0",
        "hidden_not_128": "hidden_size to be a multiple of 128",
        "intermediate_not_128": "moe_intermediate_size to be a multiple of 128",
        "ranks_disagree": "describe the MoE layers differently",
        "nonlinear_placement": "needs the linear placement",
        "fp16": "bf16 expert weights",
        "heterogeneous_layers": "same expert shapes",
        "buffer_moonep_on_cpu": "MOONEP_EP_BUFFER=moonep, but the real MoonEP library runs on CUDA GPUs only",
    }
    for rank, msgs in enumerate(out["messages"]):
        assert set(msgs) == set(needles)
        assert "MoonEP backend selection" in msgs["buffer_moonep_on_cpu"]  # raised on every rank, together
        for case, needle in needles.items():
            assert needle in msgs[case] and "Fix:" in msgs[case], (rank, case, msgs[case])


def test_plugin_is_lazy_idempotent_and_leaves_other_backends_alone():
    out = run_json("vllm", ["-m", "tests.support.kernel_check", "--plugin-checks"], timeout=120)
    assert out["compat"]["supported"] and out["compat"]["version"] == "0.33.0"
    assert out["compat"]["moonep_files_match"]
    # Nothing is imported or patched at plugin load; the patches wait for their modules.
    assert out["first"]["patched"] == [] and out["first"]["active"]
    assert "vllm.distributed.device_communicators.all2all" in out["first"]["pending"]
    assert out["second"] == out["first"]  # a second load changes nothing
    assert out["wrapped_in_oracle"] and out["wrapped_in_method"] and out["wrapped_once"]
    assert out["other_backend_untouched"]


def test_zero_copy_load_in_place_update_and_refusals_on_vllm_layers(report):
    t0 = time.monotonic()
    out = run_json("vllm", ["-m", "tests.support.load_check", "--ranks", "2", "--json"], timeout=280)
    elapsed = time.monotonic() - t0
    assert out["ok"] and out["failed"] == []
    for r in out["ranks"]:
        store, mem = r["store"], r["load_memory"]
        final, one_layer = store["physical_bytes"]["total_bytes"], store["one_layer_local_bytes"]
        # Zero-copy: parameters on meta, the peak is the store itself (memfds), sampled at every loader call.
        assert r["param_devices"] == ["meta"]
        assert mem["samples"] >= r["expert_tensors_loaded"] == 3 * 16 // 2 * 2  # own experts only
        assert mem["peak_expert_bytes"] == final and mem["tensor_bytes_at_peak"] == 0
        assert mem["peak_expert_bytes"] <= final + one_layer
        assert r["load_collective_weight_bytes"] == 0 and set(r["load_collectives"]) == {"all_gather_object"}
        assert store["collective_rounds"]["handle_exchange"] == 1
        assert r["rows_are_a"] and all(l["within_tolerance"] for l in r["forward_a"])
        assert r["kernel_classes"] == ["MoonEPPrepareAndFinalize+MoonEPExperts"]
        # Stale slots: refilled by every prefetch; the control shows poisoned slots do reach the output.
        assert all(l["within_tolerance"] and not l["has_nan"] for l in r["forward_after_poison"])
        # In place: same parameters and views, new rows, slots invalidated; the update's peak is
        # the store plus vLLM's materialized copy of one layer (measured), within the bound.
        assert r["pointers_unchanged_after_update"] and r["rows_are_b"] and r["slots_poisoned_after_update"]
        assert all(l["within_tolerance"] for l in r["forward_b"])
        upd = r["update_memory"]
        assert final < upd["peak_expert_bytes"] <= final + one_layer, upd
        # Wrong shapes: one message on every rank; nothing written; B still serves.
        assert "rank(s) [0, 1]" in r["wrong_shape_error"]
        assert "differs from the served (128, 256)" in r["wrong_shape_error"]
        assert "the previous expert weights still serve" in r["wrong_shape_error"]
        assert r["rows_are_b_after_wrong_shape"] and r["pointers_unchanged_after_wrong_shape"]
        assert all(l["within_tolerance"] for l in r["forward_after_wrong_shape"])
        assert "reload refused before any weight was read, on every EP rank" in r["precheck_error"]
        assert "shape (256, 64), served (256, 128)" in r["precheck_error"] and "Fix:" in r["precheck_error"]
        assert r["precheck_same_shape"] == "no error"
        assert [p["kind"] for p in r["passes"]] == ["initial", "update", "update"]
        # Rows a checkpoint lacks, a model built later, sleep mode.
        assert "did not provide 24 of this rank's 48 expert rows" in r["skipped_layer_error"]
        assert "rank(s) [0, 1]" in r["skipped_layer_error"]
        assert r["late_store_rounds"] == 1 and all(l["within_tolerance"] for l in r["late_forward"])
        assert all(l["within_tolerance"] for l in r["first_model_forward_after_late"])
        assert "rank(s) [0, 1]" in r["sleep_mode_error"] and "MOONEP_EP_LAYOUT=replicated" in r["sleep_mode_error"]
        assert r["stores_closed"]
    # The positive control: in a layer where some rank used a slot, skipping the prefetch lets the poison
    # reach an output (on that rank, or on a rank whose tokens it computed and sent back); a layer where no
    # rank used a slot stays clean. So the clean forwards above did read refilled slots.
    for l in range(out["case"]["layers"]):
        used = any(r["forward_without_prefetch"][l]["slots_used"] for r in out["ranks"])
        poisoned = any(r["forward_without_prefetch"][l]["has_nan"] for r in out["ranks"])
        assert poisoned == used, (l, [r["forward_without_prefetch"][l] for r in out["ranks"]])
    assert any(l["slots_used"] for r in out["ranks"] for l in r["forward_after_poison"])
    r = out["ranks"][0]
    report(f"[kernel tier, load] peak {r['load_memory']['peak_expert_bytes']:,} B = store "
           f"{r['store']['physical_bytes']['total_bytes']:,} B "
           f"(one layer {r['store']['one_layer_local_bytes']:,} B); "
           f"update peak {r['update_memory']['peak_expert_bytes']:,} B; {elapsed:.0f}s")


def test_kernel_verdict_fails_when_any_check_fails():
    """Positive control of the kernel tier's "ok": one failed check on one rank makes it false."""
    from tests.support.kernel_check import verdict

    def passing(rank: int) -> dict:
        layer = {"within_tolerance": True, "sharded_equals_replicated": True, "slot_contents_ok": True}
        return {"rank": rank, "layers": [dict(layer), dict(layer)], "bad_rows": 0, "load_weight_bytes_sharded": 0,
                "load_weight_bytes_replicated": 4096, "store": {"collective_rounds": {"handle_exchange": 1}},
                "sharded_param_devices": ["meta"], "replicated_is_vllm_path": True,
                "store_ready": True, "store_released": True,
                "sharded_bytes_measured_os": 10, "sharded_bytes": 10, "replicated_bytes_measured": 20,
                "remote_prefetched": rank}
    assert verdict([passing(0), passing(1)]) == []
    broken = [passing(0), passing(1)]
    broken[1]["layers"][1]["sharded_equals_replicated"] = False
    assert verdict(broken) == ["rank 1: sharded output equals vLLM's replicated layout"]
    copied = [passing(0), passing(1)]
    copied[0]["sharded_param_devices"] = ["cpu"]  # a local copy of the experts existed
    assert verdict(copied) == ["rank 0: vLLM's expert parameters held no memory (meta)"]
    assert verdict([passing(0), passing(0)]) == [
        "no rank prefetched an expert from a remote owner (skewed routing should make them)"]
    unused = [passing(0), passing(1)]
    for r in unused:  # no layer filled a slot: "every filled slot is right" is then no evidence
        for layer in r["layers"]:
            layer["slot_contents_ok"] = None
    assert verdict(unused) == ["no layer of any rank filled a slot, so no slot's contents were checked"]
    wrong = [passing(0), passing(1)]
    wrong[0]["layers"][0]["slot_contents_ok"] = False
    assert verdict(wrong) == ["rank 0: every filled slot holds its expert"]


def test_load_check_verdict_fails_when_any_check_fails():
    """Positive control of load_check's "ok"."""
    from tests.support.load_check import verdict

    def fwd(nan=False, slots=1):
        return [{"within_tolerance": not nan, "has_nan": nan, "slots_used": slots}]

    def passing(rank: int) -> dict:
        return {"rank": rank, "param_devices": ["meta"], "load_collective_weight_bytes": 0,
                "store": {"physical_bytes": {"total_bytes": 100}, "one_layer_local_bytes": 40,
                          "collective_rounds": {"handle_exchange": 1}},
                "load_memory": {"peak_expert_bytes": 100}, "update_memory": {"peak_expert_bytes": 130},
                "rows_are_a": True, "forward_a": fwd(), "forward_after_poison": fwd(),
                "forward_without_prefetch": fwd(nan=True), "pointers_unchanged_after_update": True,
                "rows_are_b": True, "slots_poisoned_after_update": True, "forward_b": fwd(),
                "wrong_shape_error": "rank(s) [0, 1]", "rows_are_b_after_wrong_shape": True,
                "pointers_unchanged_after_wrong_shape": True, "forward_after_wrong_shape": fwd(),
                "precheck_error": "reload refused", "precheck_same_shape": "no error",
                "skipped_layer_error": "rank(s) [0, 1]", "late_store_rounds": 1, "late_forward": fwd(),
                "first_model_forward_after_late": fwd(), "sleep_mode_error": "rank(s) [0, 1]", "stores_closed": True}
    assert verdict([passing(0), passing(1)], layers=1) == []
    copied = [passing(0), passing(1)]
    copied[1]["load_memory"]["peak_expert_bytes"] = 140  # a local copy of one layer existed
    assert verdict(copied, layers=1) == ["rank 1: load peak = the store (zero-copy)"]
    blind = [passing(0), passing(1)]
    for r in blind:
        r["forward_without_prefetch"] = fwd(nan=False)  # disabling the prefetch changed nothing
    assert verdict(blind, layers=1) == ["layer 0: disabling the prefetch did not poison the output"]
