"""GPU: vLLM's memory profiling counts the sharded store as model memory (the KV cache does not over-commit).

Needs >= 2 CUDA GPUs and the ``vllm==0.33.0`` environment; runs
``python -m tests.support.kv_accounting`` (DP=2, ``all2all_backend="moonep"``)
and checks, on every worker: vLLM's reported model memory includes the
store's physical bytes, its ``cuMemGetInfo``-based ``total_consumed`` does
too, and the KV cache it chose leaves them out of the requested memory.
``check`` itself is tested without a GPU (positive and negative cases).
"""

from __future__ import annotations

import json

import pytest

from tests.support.kv_accounting import check
from tests.support.vllm_envs import run_json


def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0


@pytest.mark.cuda
@pytest.mark.multi_gpu
@pytest.mark.skipif(_gpus() < 2, reason="needs >= 2 CUDA GPUs (the DP=2 moonep engine)")
def test_vllm_counts_the_store_as_model_memory_and_sizes_kv_around_it():
    out = run_json("vllm", ["-m", "tests.support.kv_accounting", "--json"], timeout=580)
    print(json.dumps(out))  # scripts/gpu_checks/kv_accounting.sh keeps it (pytest -s)
    assert len(out["workers"]) == 2
    for w in out["workers"]:
        assert w["store_bytes"] > 1 << 30  # the default model's store is ~1.7 GB per rank
        assert w["model_memory_includes_store"], w
        assert w["profiling_counts_store"], w
        assert w["kv_cache_leaves_store"], w
    assert out["ok"]


def _worker(**kw):
    w = {"store_bytes": 100, "model_memory_usage": 150, "total_consumed": 400, "requested_memory": 1000,
         "available_kv_cache_memory_bytes": 600}
    w.update(kw)
    return w


def test_check_needs_every_claim():
    assert check([_worker(), _worker()])["ok"]
    assert not check([_worker(model_memory_usage=50)])["ok"]          # vLLM reported the weights without the store
    assert not check([_worker(total_consumed=50)])["ok"]              # profiling did not see the store
    assert not check([_worker(available_kv_cache_memory_bytes=950)])["ok"]  # KV over-commits into the store
    assert not check([_worker(store_bytes=0)])["ok"]                  # no store: nothing was checked
    assert not check([])["ok"]
