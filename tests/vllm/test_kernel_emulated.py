"""Kernel tier over the CUDA driver emulator: vLLM 0.33.0's real MoonEP classes with the
plugin's expert store on CudaDriver (``MOONEP_EP_CUDA_EMULATOR=1``); tensors stay CPU tensors."""

from __future__ import annotations

import pytest

from tests.support.vllm_envs import run_json

pytestmark = [pytest.mark.cuda_emulated, pytest.mark.slow]


def test_real_vllm_kernel_over_the_cuda_store_driver_on_the_emulator():
    out = run_json("vllm", ["-m", "moonep_ep.tools.kernel_check", "--ranks", "2", "--json"], timeout=400,
                   env={"MOONEP_EP_CUDA_EMULATOR": "1", "MOONEP_EP_CUDA_EMULATOR_NODE": "H100x8"})
    assert out["ok"]
    E = out["case"]["experts"]
    for r in out["ranks"]:
        assert r["store_driver"] == "cuda" and r["store_driver_emulated"], r.get("store")
        assert r["store"]["granularity"] == 2 << 20
        assert r["pf_class"] == "MoonEPPrepareAndFinalize"
        assert r["load_weight_bytes_sharded"] == 0 and r["bad_rows"] == 0
        assert r["store"]["collective_rounds"]["handle_exchange"] == 1  # all layers, one round
        for layer in r["layers"]:
            assert layer["within_tolerance"] and layer["sharded_equals_replicated"] and layer["slot_contents_ok"]
        # Bytes the emulated driver holds for this rank == the store's allocation. (With 2 MiB CUDA pages
        # the tiny test model is not smaller than the replicated layout: no ratio is asserted here.)
        assert r["sharded_bytes_measured_os"] == r["sharded_bytes"] > 0
        assert r["store_released"]
        assert len(r["view_shapes"]) == 3 and r["view_shapes"][0][0] == E + r["store"]["slots"]
    assert sum(r["remote_prefetched"] for r in out["ranks"]) > 0
