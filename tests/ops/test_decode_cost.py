"""The prefetch cost model (ops/decode/cost.py) and `moonep-ep bench decode` (tools/bench/decode.py)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from moonep_ep.models import get_model
from moonep_ep.ops.decode.cost import PROFILES, cost_model, expert_bytes_for
from moonep_ep.tools.bench import decode as decode_bench


def test_bytes_per_expert_match_the_published_formats():
    k2, k3 = get_model("kimi-k2"), get_model("kimi-k3")
    assert expert_bytes_for(k2, "bf16") == 88_080_384
    assert expert_bytes_for(k2, "fp8-block") == 44_050_944
    assert expert_bytes_for(k2, "int4-g32") == 24_772_608
    assert expert_bytes_for(k2, "mxfp4") == 23_396_352
    assert expert_bytes_for(k3, "mxfp4") == 17_547_264
    with pytest.raises(ValueError) as unknown:
        expert_bytes_for(k2, "fp16")
    assert str(unknown.value) == "unknown weight format 'fp16': use one of ['bf16', 'fp8-block', 'int4-g32', 'mxfp4']"


def test_a_store_format_the_cost_model_does_not_price_is_refused():
    """layout.formats sizes INT4 at any group size that is a multiple of 8 (int4-g128: W4A16's default group), but
    FORMATS here prices int4-g32 only: the same refusal, listing what is priced."""
    from moonep_ep.layout.formats import get_format
    from moonep_ep.ops.decode.cost import canonical_format

    assert get_format("int4-g128").name == "int4-g128"
    with pytest.raises(ValueError) as unpriced:
        canonical_format("int4-g128")
    assert str(unpriced.value) == ("unknown weight format 'int4-g128': use one of ['bf16', 'fp8-block', "
                                   "'int4-g32', 'mxfp4']")
    assert canonical_format("BF16") == "bf16" and canonical_format("fp8") == "fp8-block"   # case, an alias


def test_a_copy_pays_exactly_above_its_rows_threshold(monkeypatch):
    for var in ("MOONEP_EP_COST_TFLOPS", "MOONEP_EP_COST_LINK_GBPS", "MOONEP_EP_GPU_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    cm = cost_model(get_model("kimi-k2"), "bf16", "h200")
    assert cm.describe()["profile"] == "h200" and "H200" in cm.source and cm.overrides == ()
    assert not cm.copy_pays(cm.rows_to_pay - 1) and cm.copy_pays(cm.rows_to_pay)
    # Hand-worked: a BF16 expert is 2*3*H*I bytes and a row costs 2*3*H*I FLOPs, so the copy pays above
    # floor(989e12 / 450e9) + 1 = floor(2197.78) + 1 = 2198 rows.
    assert cm.rows_to_pay == 2198
    # A slot serves up to S*K rows (not S): at K = 8, S = 274 gives 2192 rows (< 2198, no copy pays),
    # S = 275 gives 2200 (pays); S = 2197 alone would never reach 2198.
    assert cm.slot_budget(274, 8, 6) == 0 and cm.slot_budget(275, 8, 6) == 6
    assert cm.slot_budget(1099, 2, 6) == 6 and cm.slot_budget(1099, 1, 6) == 0   # S*K = 2198 exactly pays
    assert cm.slot_budget(128, 8, 6) == 0 and cm.slot_budget(8192, 8, 6) == 6
    assert cost_model(get_model("kimi-k2"), profile="h200") == cm   # the default format is bf16
    monkeypatch.setenv("MOONEP_EP_COST_LINK_GBPS", "45")   # a 10x slower link: copies pay 10x later
    slow = cost_model(get_model("kimi-k2"), "bf16", "h200")
    assert slow.overrides == ("MOONEP_EP_COST_LINK_GBPS=45.0",)
    assert slow.rows_to_pay == 21978          # floor(989e12 / 45e9) + 1 = floor(21977.8) + 1
    monkeypatch.setenv("MOONEP_EP_GPU_PROFILE", "gb200")
    assert cost_model(get_model("kimi-k2"), "bf16").profile == "gb200"
    assert set(PROFILES) == {"h100", "h200", "b200", "gb200"} and all(p.source for p in PROFILES.values())


@pytest.mark.parametrize("fmt, profile, tflops, rows", [
    # rows = floor(expert_bytes * rate / (6*H*I * link)) + 1, Kimi K2 (6*H*I = 88,080,384 FLOPs per row),
    # link 450 GB/s (Hopper) or 900 GB/s (Blackwell) per direction; the rate is the format's GEMM rate.
    ("bf16", "h200", 989.0, 2198),
    ("fp8-block", "h200", 1979.0, 2200),     # FP8 tensor cores, not the BF16 rate (that gives 1100)
    ("mxfp4", "h200", 989.0, 584),           # no FP4 tensor cores on Hopper: dequantised to BF16
    ("mxfp4", "b200", 4500.0, 1329),         # FP8 activations x FP4 weights: the FP8 rate (FP4's gives 2657)
    ("int4-g32", "b200", 2250.0, 704),       # W4A16: the BF16 rate
])
def test_each_format_is_priced_at_its_gemms_flop_rate(fmt, profile, tflops, rows, monkeypatch):
    for var in ("MOONEP_EP_COST_TFLOPS", "MOONEP_EP_COST_LINK_GBPS", "MOONEP_EP_COST_HBM_GBPS",
                "MOONEP_EP_COST_EXPERT_BYTES", "MOONEP_EP_GPU_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    cm = cost_model(get_model("kimi-k2"), fmt, profile)
    assert cm.flop_rate == tflops * 1e12 and cm.flops_per_row == 6 * 7168 * 2048
    assert cm.rows_to_pay == rows
    assert cm.link_bw == (900e9 if profile == "b200" else 450e9)
    assert cm.hbm_bw == (8000e9 if profile == "b200" else 4800e9)
    assert cm.copy_seconds(2) == 2 * cm.expert_bytes / cm.link_bw
    assert cm.rows_seconds(1000) == 1000 * 6 * 7168 * 2048 / (tflops * 1e12)


def test_every_cost_override_replaces_its_input(monkeypatch):
    for var, value in (("MOONEP_EP_COST_TFLOPS", "100"), ("MOONEP_EP_COST_LINK_GBPS", "50"),
                       ("MOONEP_EP_COST_HBM_GBPS", "1000"), ("MOONEP_EP_COST_EXPERT_BYTES", "1000000")):
        monkeypatch.setenv(var, value)
    cm = cost_model(get_model("kimi-k2"), "bf16", "h200")
    assert (cm.flop_rate, cm.link_bw, cm.hbm_bw, cm.expert_bytes) == (100e12, 50e9, 1000e9, 1_000_000)
    assert len(cm.overrides) == 4
    # floor(1e6 * 100e12 / (88,080,384 * 50e9)) + 1 = floor(22.7) + 1
    assert cm.rows_to_pay == 23
    assert cm.describe() == {"profile": "h200", "flop_rate_tflops": 100.0, "link_gbps_per_direction": 50.0,
                             "hbm_gbps": 1000.0, "expert_bytes": 1_000_000, "flops_per_row": 88_080_384,
                             "rows_to_pay": 23, "overrides": ["MOONEP_EP_COST_TFLOPS=100.0",
                                                              "MOONEP_EP_COST_LINK_GBPS=50.0",
                                                              "MOONEP_EP_COST_HBM_GBPS=1000.0",
                                                              "MOONEP_EP_COST_EXPERT_BYTES=1000000"],
                             "source": PROFILES["h200"].source}
    assert cm.copy_seconds() == 1_000_000 / 50e9     # one expert by default
    # Break-even does not pay: an expert of 44,040,192 bytes over 50 GB/s takes 880.80384 us, and 1000 rows of
    # 88,080,384 FLOPs at 100 TFLOP/s take 88,080,384,000 / 1e14 s = 880.80384 us too (both quotients of exact
    # integers, so the floats are equal); the copy pays from 1001 rows.
    monkeypatch.setenv("MOONEP_EP_COST_EXPERT_BYTES", "44040192")
    even = cost_model(get_model("kimi-k2"), "bf16", "h200")
    assert even.rows_seconds(1000) == even.copy_seconds(1)
    assert not even.copy_pays(1000) and even.copy_pays(1001) and even.rows_to_pay == 1001
    assert even.slot_budget(1000, 1, 6) == 0 and even.slot_budget(1001, 1, 6) == 6
    with pytest.raises(ValueError, match="unknown GPU profile 'a100'"):
        cost_model(get_model("kimi-k2"), "bf16", "a100")


@pytest.mark.parametrize("gpu, profile", [("NVIDIA GB200", "gb200"), ("NVIDIA B200", "b200"),
                                          ("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"),
                                          ("NVIDIA A100-SXM4-80GB", "h200"),
                                          ("NVIDIA GB 200", "gb200")])   # spaces are ignored in the match
def test_auto_profile_follows_the_visible_gpus_name(gpu, profile, monkeypatch):
    from moonep_ep.ops.decode.cost import detect_profile

    monkeypatch.delenv("MOONEP_EP_GPU_PROFILE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: gpu)
    assert detect_profile() == profile                  # "gb200" is tried before its substring "b200"
    monkeypatch.setenv("MOONEP_EP_GPU_PROFILE", "h100")
    assert detect_profile() == "h100"                   # a chosen profile wins over the GPU's name
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("MOONEP_EP_GPU_PROFILE", "auto")
    assert detect_profile() == "h200"                   # no GPU: the default


def test_k2_bf16_ep64_decode_moves_no_weights_with_the_fix():
    """The issue's figures, from the planner: vLLM's padding moves expert 0 to all 63 other ranks."""
    model = get_model("kimi-k2")
    cm = cost_model(model, "bf16", "h200")
    for n in (1, 8, 32):
        real = decode_bench.routing_counts(64, n, model.num_experts, model.top_k, seed=n)
        vllm = decode_bench.plan_step(real, "vllm-0.33.0", 128, model.top_k)
        fixed = decode_bench.plan_step(real, "padding-fixed", 128, model.top_k)
        assert vllm["remote_experts"] == 63 and vllm["busiest_owner_experts"] == 63   # 5.55 GB from rank 0
        assert vllm["busiest_owner_experts"] * cm.expert_bytes > 5.5e9
        assert fixed["remote_experts"] == 0 and fixed["busiest_owner_experts"] * cm.expert_bytes <= 0.3e9
        assert fixed["padding_only_remote"] == 0


def test_bench_json_cost_model_moves_nothing_that_cannot_pay(capsys, monkeypatch):
    monkeypatch.delenv("MOONEP_EP_GPU_PROFILE", raising=False)
    args = argparse.Namespace(models="kimi-k2", formats="bf16", ep="64", n="16,128", profile="h200", seed=0,
                              json=True, crossover_n="")
    assert decode_bench.run(args) == 0
    out = json.loads(capsys.readouterr().out)
    res = out["models"]["kimi-k2"]
    by_n = {row["n"]: row["policies"] for row in res["rows"]}
    # n = 128 fills the capacity: no padding, the planner evens out the real load ...
    # The bench's routing at n = 128 (seed 0 + 1000*64 + 128): the groups over S*K = 1024 real entries must
    # each send at least one expert away; the planner moves 46 (its figure for this routing, pinned).
    real = decode_bench.routing_counts(64, 128, 384, 8, 64128)
    overloaded = int((real.reshape(64, 64, 6).sum((0, 2)) > 128 * 8).sum())
    assert overloaded == 31 and by_n[128]["padding-fixed"]["remote_experts"] == 46
    assert by_n[128]["padding-fixed"]["padding_only_remote"] == 0
    assert by_n[128]["padding-fixed"]["paying_copies"] == 0
    # ... which the cost model avoids (its derived time prefers capacity 256 with balanced padding).
    assert by_n[128]["fixed+cost-model"]["remote_experts"] == 0 and by_n[128]["fixed+cost-model"]["S"] == 256
    assert by_n[16]["fixed+cost-model"]["remote_experts"] == 0
    assert res["crossover_by_profile"]["h200"]["bf16/EP64"]["rows_to_pay"] == res["cost_model"]["bf16"]["rows_to_pay"]
    if torch.cuda.is_available():
        assert out["copy_bandwidth"]["measured"] is True and out["copy_bandwidth"]["device"] == torch.cuda.get_device_name()
    else:
        assert out["copy_bandwidth"] == {"measured": False, "why": "no CUDA GPU here: copy bandwidth not measured"}
