"""The ops demo (dispatch, pull prefetch from owners' pages, grouped FFN, combine) with the
expert store on CudaDriver over the CUDA driver emulator."""

from __future__ import annotations

import pytest

from tests.support.cli import moonep_ep_json

pytestmark = [pytest.mark.cuda_emulated, pytest.mark.slow]


def test_demo_four_ranks_skew_8_over_the_emulator(monkeypatch):
    monkeypatch.setenv("MOONEP_EP_CUDA_EMULATOR", "1")
    monkeypatch.setenv("MOONEP_EP_CUDA_EMULATOR_NODE", "H100x8")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    out = moonep_ep_json("demo", "--ranks", "4", "--skew", "8", "--driver", "cuda", timeout=600)
    assert out["ok"] and out["driver"] == "cuda" and out["emulated"] and out["backend"] == "gloo"
    assert out["weight_allgather_bytes"] == 0
    assert len(set(out["tokens_received"])) == 1
    # Skew makes ranks prefetch experts whose pages another rank holds.
    assert any(p["owner"] != r for r, ranks in enumerate(out["redundant_experts"]) for layer in ranks for p in layer)
    assert out["granularity"] == 2 << 20  # the CUDA driver's page, not the host option
