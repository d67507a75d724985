"""Bytes the non-GEMM ops of one MoE layer's experts write at Kimi K3's decode shapes, per format and activation.

Scenario and method: ``tests/support/expert_bytes.py`` (EP 8, capacity 128, token_padding 128: NvS 30496 rows, of
which 2048 carry (token, expert) pairs: capacity 128 x top-k 16; their groups padded to 128 end at
``cu_seqlens[-1]`` = 14336; ``BLOCK_SIZE_M`` 16, vLLM's decode tile, leaves 2960 rows in blocks with a token).
torch ops are measured on meta tensors under a ``TorchDispatchMode``; the Triton launches (grouped GEMMs, counted
apart, and the fused activation / FP8 quantization) by their grid and early exits. Bound: at most 2x the live
rows' bf16 activation, 2048 x 3072 x 2 B = 12.58 MB.

Before this change (``gpu_grouped_ffn`` zero-filling both GEMM outputs, the eager activation and route
multiply over all NvS rows, the ``[NvS, H]`` tail mask, vLLM's FP8 quantization over all rows), measured by this
file against that code, MB per layer (x the bound's yardstick):

=========== ================ ================
format      SiLU             SiTU
=========== ================ ================
int4-g32    1374.7 (109x)    5309.4 (422x)
fp8-block   1584.0 (126x)    5518.7 (439x)
mxfp4       1374.7 (109x)    5309.4 (422x)
bf16        482.9 (38x)      2332.6 (185x)
=========== ================ ================

After: int4-g32 and mxfp4 18.5 MB (1.47x), fp8-block 20.6 MB (1.64x), SiLU and SiTU alike (one kernel each).
BF16 (``vllm/experts/overlap.apply`` on CUDA, ``vllm/experts/bf16_gpu.py``: vLLM's unquantized
``fused_moe_kernel`` over the same block metadata, the fused activation, the down GEMM into ``output`` in place):
18.5 MB (1.47x) in a decode-sized one-pass step, 18.8 MB (1.50x) split into own groups, wait, slots (the
part limits: 0.36 MB), SiLU and SiTU alike; its code runs on meta tensors as on CUDA, so it reads no value back
(a read of a meta tensor raises). The "before" BF16 figures were the split path (own rows, then slots, a
zero-filled tail, the split row read on the host); the CPU engine's branch, still that code, is the control here:
780.8 MB (SiLU, 62x) and 4715.5 MB (SiTU, 375x) in one pass over all NvS rows.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from moonep_ep.launch import run_ranks
from moonep_ep.ops.experts.activation import SILU, GatedActivation
from tests.support import expert_bytes as X

SITU = GatedActivation("situ", beta=4.0, linear_beta=25.0)
ACTIVATIONS = {"silu": SILU, "situ": SITU}
#: today's figures (MB, the module docstring's table), measured by this file against the code before the change
BEFORE_MB = {("int4-g32", "silu"): 1374.7, ("fp8-block", "silu"): 1584.0, ("mxfp4", "silu"): 1374.7,
             ("bf16", "silu"): 482.9, ("int4-g32", "situ"): 5309.4, ("fp8-block", "situ"): 5518.7,
             ("mxfp4", "situ"): 5309.4, ("bf16", "situ"): 2332.6}
BOUND = 2.0


@pytest.fixture(scope="module")
def sc() -> X.Scenario:
    return X.scenario(block_m=16)


def test_the_k3_decode_scenario(sc):
    assert (sc.H, sc.I, sc.E, sc.K) == (3584, 3072, 896, 16)
    assert sc.nvs == 128 * 16 + 127 * 2 * 112 == 30496
    assert sc.live_rows == 2048 and int((sc.route > 0).sum()) == 2048
    assert int(sc.cu[-1]) == 112 * 128          # every one of the rank's 112 groups holds 1-128 rows
    assert sc.computed_rows() == 2960           # blocks of 16 with at least one token
    assert sc.live_activation_bytes == 12_582_912


def _report(report: Any, fmt: str, name: str, r: dict, sc: X.Scenario) -> float:
    ratio = r["non_gemm"] / sc.live_activation_bytes
    before = BEFORE_MB[(fmt, name.split()[0])]
    report(f"[expert bytes, K3 decode EP8 cap128] {fmt} {name}: non-GEMM {r['non_gemm'] / 1e6:.1f} MB "
           f"({ratio:.2f}x live act) vs {before:.1f} MB before ({before * 1e6 / sc.live_activation_bytes:.0f}x); "
           f"GEMM outputs {r['gemm'] / 1e6:.1f} MB")
    return ratio


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
@pytest.mark.parametrize("fmt", ["int4-g32", "fp8-block", "mxfp4"])
def test_the_quantized_experts_write_at_most_twice_the_live_activation(fmt, name, sc, monkeypatch, report):
    r = X.measure_ffn(fmt, ACTIVATIONS[name], sc, monkeypatch)
    assert r["fused_activation"]
    ratio = _report(report, fmt, name, r, sc)
    assert ratio <= BOUND, r
    # what is left of torch's own ops is the block metadata (KB), no fill, mask or pass over rows
    assert max(r["torch_ops"].values()) < 200_000, r["torch_ops"]
    # the kernels write the computed blocks' rows only: activation (and FP8's quantizations) x 2960 rows
    act = sc.computed_rows() * sc.I * (1 if fmt == "fp8-block" else 2)
    assert r["kernels"]["fused gated activation"] == act + (sc.computed_rows() * sc.I // 128 * 4
                                                            if fmt == "fp8-block" else 0)


def test_with_64_row_tiles_the_writes_follow_the_blocks_that_hold_a_token(monkeypatch, report):
    """vLLM's default tile for 128 tokens a rank is 64 rows: one block per group here (7168 rows), so the same
    kernels write 2.4x the rows of 16-row tiles, 3.5x the live activation: the writes follow the computed
    blocks, and the bound holds for tiles up to the groups' share of rows (16 here, vLLM's for up to 32 tokens,
    FP8 64). Finer activation blocks than the GEMMs' would leave rows unwritten inside a computed GEMM block,
    among them a real token's zero-weight entries (an invalid id), which combine reads: their rows must be
    computed (0) or zeroed, so the activation follows the GEMMs' blocks. Reading each group's weights once is
    why a larger tile is picked; this file does not choose it."""
    sc64 = X.scenario(block_m=64)
    assert sc64.computed_rows() == 112 * 64
    for fmt in ("int4-g32", "fp8-block", "mxfp4"):
        r = X.measure_ffn(fmt, SITU, sc64, monkeypatch)
        per_row = (sc64.I * (1 + 4 / 128) + sc64.H * (1 + 4 / 128)) if fmt == "fp8-block" else sc64.I * 2
        assert sum(r["kernels"].values()) == round(sc64.computed_rows() * per_row), (fmt, r["kernels"])
        report(f"[expert bytes, K3 decode, 64-row tiles] {fmt} situ: non-GEMM {r['non_gemm'] / 1e6:.1f} MB "
               f"({r['non_gemm'] / sc64.live_activation_bytes:.2f}x live act)")


def test_control_the_eager_chain_over_every_row_exceeds_the_bound(sc, monkeypatch):
    """The counter sees a pass over NvS rows: the eager chain (the path where the kernel cannot run) is far past
    the bound, SiTU's ~12 fp32 passes more than SiLU's 3."""
    silu = X.measure_ffn("mxfp4", SILU, sc, monkeypatch, fused=False)
    situ = X.measure_ffn("mxfp4", SITU, sc, monkeypatch, fused=False)
    assert not silu["kernels"] and silu["non_gemm"] >= 3 * sc.nvs * sc.I * 2 > 40 * sc.live_activation_bytes
    assert situ["non_gemm"] > 3 * silu["non_gemm"]


@pytest.mark.parametrize("one_pass", [True, False], ids=["one pass", "own then slots"])
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_the_bf16_experts_write_at_most_twice_the_live_activation(name, one_pass, sc, monkeypatch, report):
    r = X.measure_bf16(ACTIVATIONS[name], sc, monkeypatch, one_pass=one_pass)
    assert r["trace"] == (["one pass"] if one_pass else ["own", "slots"])
    ratio = _report(report, "bf16", f"{name} {'one pass' if one_pass else 'own then slots'}", r, sc)
    assert ratio <= BOUND, r
    assert max(r["torch_ops"].values()) < 200_000, r["torch_ops"]   # block metadata and part limits only
    # the activation over the computed blocks only, once (the slot part of this scenario holds no rows)
    assert r["kernels"] == {"fused gated activation": sc.computed_rows() * sc.I * 2}
    # the GEMMs (gate, up, down) write the rows below cu_seqlens[-1] once, whichever the split
    assert r["gemm"] == int(sc.cu[-1]) * (2 * sc.I + sc.H) * 2


def test_with_rows_in_the_slots_the_two_parts_write_the_computed_blocks_once(monkeypatch, report):
    """The rank's rows spread over its 112 experts and its 8 slots: the own part computes the own groups' blocks,
    the slot part the slots', together every computed block once; the bound holds in both orders."""
    sc = X.scenario(block_m=16, slot_groups=X.SLOTS)
    own_end = int(sc.cu[sc.E - 1])
    assert int(sc.cu[-1]) > own_end and int((sc.route[own_end:] > 0).sum()) > 0   # live slot rows
    for one_pass in (True, False):
        r = X.measure_bf16(SITU, sc, monkeypatch, one_pass=one_pass)
        assert r["kernels"] == {"fused gated activation": sc.computed_rows() * sc.I * 2}, r["kernels"]
        assert r["gemm"] == int(sc.cu[-1]) * (2 * sc.I + sc.H) * 2
        ratio = r["non_gemm"] / sc.live_activation_bytes
        assert ratio <= BOUND, r
        report(f"[expert bytes, K3 decode, rows in 8 slots] bf16 situ {'one pass' if one_pass else 'own then slots'}"
               f": non-GEMM {r['non_gemm'] / 1e6:.1f} MB ({ratio:.2f}x live act)")


def test_control_the_bf16_cpu_branch_over_every_row_exceeds_the_bound(sc, monkeypatch):
    """The same harness on the CPU engine's branch (``torch._grouped_mm``, the eager activation and the copy
    into ``output`` over all NvS rows) is far past the bound, SiTU more than SiLU: the counter sees it."""
    silu = X.measure_bf16(SILU, sc, monkeypatch, gpu_path=False)
    situ = X.measure_bf16(SITU, sc, monkeypatch, gpu_path=False)
    assert silu["trace"] == ["one pass"] and not silu["kernels"]
    assert silu["non_gemm"] >= 3 * sc.nvs * sc.I * 2 + sc.nvs * sc.H * 2 > 40 * sc.live_activation_bytes
    assert situ["non_gemm"] > 3 * silu["non_gemm"]


# -- the rows past cu_seqlens[-1] are never read -----------------------------------------------------------------

def combine_ignores_unwritten_rows(ctx: Any) -> dict:
    """One dispatch, then combine twice: the FFN stand-in's rows as they are, and with every row at or past
    ``cu_seqlens[-1]`` and every padding row set to NaN (what an unwritten ``torch.empty`` row may hold)."""
    from moonep_ep.ops.moonep.pull import ReferenceBuffer

    S, H, K, E, R = 16, 128, 4, 8, ctx.world_size
    gen = torch.Generator().manual_seed(11 + ctx.rank)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(S)]).to(torch.int32)
    x = torch.randn(S, H, generator=gen).to(torch.bfloat16)
    w = torch.rand(S, K, generator=gen)
    buf = ReferenceBuffer(S, H, K, E, R, token_padding=16, explicitly_destroy=True)
    tpe = torch.bincount(ids.reshape(-1).long(), minlength=E).to(torch.int32)
    hidden, w_nvs, cu, plan = buf.dispatch(x, w, ids, tpe)
    y = (hidden.float() * 3).to(torch.bfloat16)
    end = int(cu[-1])
    clean, _, _ = buf.combine(plan, y.clone(), w_nvs)
    dirty = y.clone()
    dirty[end:] = float("nan")
    dirty[(w_nvs == 0) & (torch.arange(y.shape[0]) < end)] = float("nan")   # padding rows inside the groups
    got, _, _ = buf.combine(plan, dirty, w_nvs)
    out = {"equal": torch.equal(clean, got), "finite": bool(torch.isfinite(got.float()).all()),
           "nvs": y.shape[0], "end": end, "nan_rows": int(torch.isnan(dirty.float()).any(dim=1).sum())}
    buf.destroy()
    return out


def test_combine_never_reads_rows_past_the_last_group_nor_group_padding():
    """Why ``gpu_grouped_ffn`` neither zero-fills nor masks its output's tail: MoonEP's combine reads the rows of
    dispatched (token, expert) pairs only (``ops/moonep/base.py``: ``Y[recv_row_loff]``, ``Y[recv_entry_loff]``),
    all inside the groups. NaN there changes nothing."""
    for r in run_ranks(combine_ignores_unwritten_rows, 2, timeout_s=120):
        assert r["equal"] and r["finite"], r
        assert r["end"] < r["nvs"] and r["nan_rows"] > r["nvs"] - r["end"], r
