"""Kernel tier over the CUDA driver emulator: vLLM 0.33.0's real MoonEP classes with the
plugin's expert store on CudaDriver (``MOONEP_EP_CUDA_EMULATOR=1``); tensors stay CPU tensors.

The tier's tiny model has 64 KiB expert rows; on 2 MiB CUDA pages one rank's page would hold
every expert of a layer and the sharded layout could not be smaller than the replicated one.
The emulated node therefore uses the CPU store's 64 KiB page (a node override); 2 MiB pages
are exercised by the selftest, store, demo and footprint tests over the emulator."""

from __future__ import annotations

import pytest

from tests.support.vllm_envs import run_json

pytestmark = [pytest.mark.cuda_emulated, pytest.mark.slow]

KiB = 1 << 10
NODE = "H100x8," + ",".join(f"{k}=64KiB" for k in ("fd_min", "fd_rec", "fabric_min", "fabric_rec", "mc_min"))


def test_real_vllm_kernel_over_the_cuda_store_driver_on_the_emulator():
    out = run_json("vllm", ["-m", "tests.support.kernel_check", "--ranks", "2", "--json"], timeout=400,
                   env={"MOONEP_EP_CUDA_EMULATOR": "1", "MOONEP_EP_CUDA_EMULATOR_NODE": NODE})
    assert out["ok"]
    E = out["case"]["experts"]
    for r in out["ranks"]:
        assert r["store_driver"] == "cuda" and r["store_driver_emulated"], r.get("store")
        assert r["store"]["granularity"] == 64 * KiB
        assert r["pf_class"] == "MoonEPPrepareAndFinalize"
        assert r["load_weight_bytes_sharded"] == 0 and r["bad_rows"] == 0
        assert r["store"]["collective_rounds"]["handle_exchange"] == 1  # all layers, one round
        for layer in r["layers"]:
            assert layer["within_tolerance"] and layer["sharded_equals_replicated"]
            assert layer["slot_contents_ok"] is (True if layer["slots"] else None), layer  # None: no slot filled
        # Bytes the emulated driver holds for this rank == the store's allocation < the replicated layout.
        assert r["sharded_bytes_measured_os"] == r["sharded_bytes"] > 0
        assert r["sharded_bytes_measured_os"] < r["replicated_bytes_measured"]
        assert r["sharded_param_devices"] == ["meta"]
        assert r["store_released"]
        assert r["view_shapes"] == [[E + r["store"]["slots"], 128, 256]] * 2 + [[E + r["store"]["slots"], 256, 128]]
    assert sum(r["remote_prefetched"] for r in out["ranks"]) > 0
    assert sum(len(layer["slots"]) for r in out["ranks"] for layer in r["layers"]) > 0  # slots were checked
