"""The MXFP4 kernel's launch bound (``ops/experts/mxfp4_kernel.py``, ``mxfp4_launch_config``) over every config it
can be given: vLLM 0.33.0's tuned bf16 MoE files, vLLM's defaults and the kernel's own.

The GPU experts hand the kernel what ``try_get_optimal_moe_config`` returns for dtype None: vLLM's tuned
``E=<local>,N=<I>,device_name=<gpu>.json`` entries for bf16 weights, written for vLLM's own kernel. The bound
is restated here from its definition (docs/design/vllm_experts.md, "The MXFP4 launch bound"), not read from the module:
per thread (``32 · warps`` threads) at most 32 values of the fp32 accumulator ``[BLOCK_M, BLOCK_N]`` (fp16: counted
twice), 64 of the ``[BLOCK_K, BLOCK_N]`` dequantization tile and 32 of the ``[BLOCK_M, BLOCK_K]`` activation tile,
scaled where a thread gets fewer than 255 registers (16 warps: 128) by what is left for tiles beside a reserve
of 63, (128 - 63) / (255 - 63); per block ``2 · (stages · BLOCK_M ·
BLOCK_K + BLOCK_K · BLOCK_N + BLOCK_M · BLOCK_N)`` bytes of shared memory within 227 KiB.

The tuned files are read from the ``vllm==0.33.0`` environment's package (this test runs in the main
environment, which has no vLLM); a missing environment fails the test, as everywhere in ``tests/vllm``.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess

import pytest
import torch

from moonep_ep.errors import ConfigError
from moonep_ep.ops.experts import mxfp4_kernel as mk
from moonep_ep.ops.experts.grouped_blocks import grouped_blocks
from moonep_ep.ops.experts.mxfp4_kernel import mxfp4_grouped_gemm, mxfp4_launch_config
from tests.ops.test_mxfp4_launch import launcher  # noqa: F401 - the fixture
from tests.support.vllm_envs import python_of

BF16, FP16 = torch.bfloat16, torch.float16
#: K2 (H 7168, I 2048) and K3 (H 3584, I 3072): the gate-up GEMM reduces over H, the down GEMM over I
MODEL_KS = {"kimi-k2": (7168, 2048), "kimi-k3": (3584, 3072)}


def within_bound(block_m: int, launch: dict, dtype: torch.dtype) -> tuple[bool, dict]:
    """The bound, from its definition (module docstring)."""
    bn, bk, warps, stages = launch["BLOCK_N"], launch["BLOCK_K"], launch["num_warps"], launch["num_stages"]
    threads = 32 * warps
    share = (min(255, 65536 // threads) - 63) / (255 - 63)
    cost = {"accumulator": -(-block_m * bn // threads) * (1 if dtype == BF16 else 2),
            "dequant": -(-bk * bn // threads), "activations": -(-block_m * bk // threads),
            "shared": 2 * (max(stages, 1) * block_m * bk + bk * bn + block_m * bn)}
    ok = (cost["accumulator"] <= 32 * share and cost["dequant"] <= 64 * share and cost["activations"] <= 32 * share
          and cost["shared"] <= 227 * 1024)
    return ok, cost


def raw_launch(entry: dict, block_k: int) -> dict:
    """A tuned entry as the kernel would receive it unbounded (BLOCK_K as the module picks it)."""
    return {"BLOCK_N": entry["BLOCK_SIZE_N"], "BLOCK_K": block_k, "num_warps": entry["num_warps"],
            "num_stages": entry["num_stages"]}


def largest_block_m(entry: dict) -> int:
    """The largest row block the kernel can get from an entry: ``fit_block_m`` raises it to 16 and brings it down
    to a power of two dividing the token padding, so at most the power of two at or below it."""
    m = max(16, int(entry["BLOCK_SIZE_M"]))
    return 1 << (m.bit_length() - 1)


def _vllm_tuned_files() -> list[str]:
    """vLLM 0.33.0's tuned MoE files without a dtype (bf16 weights), from the vllm environment's package."""
    py = python_of("vllm")
    probe = "import importlib.util; print(importlib.util.find_spec('vllm').submodule_search_locations[0])"
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    package = subprocess.run([py, "-c", probe], capture_output=True, text=True, check=True, env=env).stdout.strip()
    configs = os.path.join(package, "model_executor", "layers", "fused_moe", "configs")
    files = sorted(f for f in glob.glob(os.path.join(configs, "E=*,N=*,device_name=*.json"))
                   if ",dtype=" not in os.path.basename(f))
    if not files:
        pytest.fail(f"no tuned MoE files under {configs}. Fix: `make venv-vllm` (vllm==0.33.0)")
    return files


def test_every_tuned_bf16_entry_of_vllm_reaches_the_kernel_within_the_bound(report):
    files = _vllm_tuned_files()
    entries = checked = clamped = raw_over = 0
    entries_clamped: set[tuple[str, str]] = set()
    for path in files:
        N = int(os.path.basename(path).split(",")[1][2:])
        with open(path) as f:
            table = json.load(f)
        table.pop("triton_version", None)  # as vLLM's get_moe_configs does
        for m, entry in table.items():
            entries += 1
            bm = largest_block_m(entry)
            # the down GEMM reduces over N (where it is a whole number of 32-value groups: not N=176), the gate-up
            # GEMM over H: 7168 stands for every H that 128 divides (BLOCK_K depends on K only through that)
            for K in ((N, 7168) if N % 32 == 0 else (7168,)):
                for dtype in (BF16, FP16):
                    launch = mxfp4_launch_config(dtype, K, entry, block_m=bm)
                    ok, cost = within_bound(bm, launch, dtype)
                    assert ok, (path, entry, K, dtype, launch, cost)
                    assert K % launch["BLOCK_K"] == 0 and launch["BLOCK_K"] % 32 == 0
                    asked_k = 32 if dtype == FP16 else next(b for b in (128, 64, 32)
                                                             if b <= max(entry["BLOCK_SIZE_K"], 32) and K % b == 0)
                    raw = raw_launch(entry, asked_k)
                    raw_ok, _ = within_bound(bm, raw, dtype)
                    got = {k: launch[k] for k in raw}
                    if raw_ok:  # a config within the bound reaches the kernel as it is
                        assert got == raw, (path, entry, K, dtype, got)
                    else:
                        raw_over += 1
                        clamped += got != raw
                        entries_clamped.add((path, m))
                    checked += 1
    # vLLM 0.33.0 ships 147 such files, 2660 entries (counted from its package by hand: `ls configs | grep -v
    # dtype`, minus README; the numeric keys of each)
    assert (len(files), entries) == (147, 2660)
    assert raw_over == clamped > 0   # the control: some raw entries break the bound, and every one was clamped
    msg = (f"[mxfp4 launch bound] {len(files)} vLLM tuned files, {entries} entries ({len(entries_clamped)} clamped in "
           f"some launch), {checked} launches (bf16+fp16, K=N and 7168): {clamped} clamped, all within the bound")
    print(msg)
    report(msg)


def test_the_raw_bf16_tiles_break_the_bound_and_the_clamp_fixes_each_worked_out_by_hand():
    # E=16,N=2048,device_name=NVIDIA_H200.json at M 128: (16, 256, 128, 8 warps, 4 stages). Raw: 128 * 256 / 256
    # = 128 values a thread of the dequantization tile (> 64). N 128: 64; accumulator 16 * 128 / 256 = 8,
    # activations 16 * 128 / 256 = 8; 2 * (4 * 16 * 128 + 128 * 128 + 16 * 128) = 53248 bytes
    entry = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "num_warps": 8,
             "num_stages": 4}
    assert within_bound(16, raw_launch(entry, 128), BF16)[1]["dequant"] == 128
    assert not within_bound(16, raw_launch(entry, 128), BF16)[0]
    assert mxfp4_launch_config(BF16, 2048, entry, block_m=16) == {
        "BLOCK_N": 128, "BLOCK_K": 128, "SCALE_BEFORE_DOT": True, "num_warps": 8, "num_stages": 4}
    # E=8,N=2048,device_name=NVIDIA_H200.json at M 256: (128, 256, 64, 8, 4): accumulator 128 * 256 / 256 = 128;
    # N 128: 64, N 64: 32 (dequantization 64 * 64 / 256 = 16, activations 128 * 64 / 256 = 32)
    entry = {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 64, "num_warps": 8, "num_stages": 4}
    assert within_bound(128, raw_launch(entry, 64), BF16)[1]["accumulator"] == 128
    assert mxfp4_launch_config(BF16, 7168, entry, block_m=128) == {
        "BLOCK_N": 64, "BLOCK_K": 64, "SCALE_BEFORE_DOT": True, "num_warps": 8, "num_stages": 4}
    # (128, 128, 64, 4, 3), vLLM's commonest large-M entry: accumulator 128 * 128 / 128 = 128 -> N 32 (32);
    # activations 128 * 64 / 128 = 64 -> K 32 (32)
    entry = {"BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "num_warps": 4, "num_stages": 3}
    assert mxfp4_launch_config(BF16, 7168, entry, block_m=128) == {
        "BLOCK_N": 32, "BLOCK_K": 32, "SCALE_BEFORE_DOT": True, "num_warps": 4, "num_stages": 3}
    # 16 warps get 128 registers each, 65 beside the reserve: caps 32 * 65 / 192 = 10.8, 21.7, 10.8.
    # (64, 256, 128, 16, 2) holds accumulator 32, dequantization 64; at 8 warps 64 and 128, N 128: 32 and 64
    # (activations 64 * 128 / 256 = 32)
    entry = {"BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 128, "num_warps": 16, "num_stages": 2}
    assert mxfp4_launch_config(BF16, 7168, entry, block_m=64) == {
        "BLOCK_N": 128, "BLOCK_K": 128, "SCALE_BEFORE_DOT": True, "num_warps": 8, "num_stages": 2}
    # 16 warps within those caps stay: (16, 128, 64, 16): accumulator 4, dequantization 16, activations 2; the
    # control, (64, 128, 128, 16) (16, 32, 16; ptxas spills it), goes to 8 warps (32, 64, 32)
    entry = {"BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "num_warps": 16, "num_stages": 3}
    assert mxfp4_launch_config(BF16, 7168, entry, block_m=16)["num_warps"] == 16
    entry = {"BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "num_warps": 16, "num_stages": 3}
    assert mxfp4_launch_config(BF16, 7168, entry, block_m=64) == {
        "BLOCK_N": 128, "BLOCK_K": 128, "SCALE_BEFORE_DOT": True, "num_warps": 8, "num_stages": 3}
    # fp16 counts the accumulator twice: 128-row blocks, N 128, 4 warps: 2 * 128 = 256 -> N 16 (32); the
    # dequantization 32 * 16 / 128 = 4, activations 128 * 32 / 128 = 32
    entry = {"BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "num_warps": 4, "num_stages": 3}
    assert mxfp4_launch_config(FP16, 7168, entry, block_m=128) == {
        "BLOCK_N": 16, "BLOCK_K": 32, "SCALE_BEFORE_DOT": False, "num_warps": 4, "num_stages": 3}
    # ... bf16 once: N 32 (accumulator 32), then activations 128 * 128 / 128 = 128 -> K 32 (32)
    assert mxfp4_launch_config(BF16, 7168, entry, block_m=128) == {
        "BLOCK_N": 32, "BLOCK_K": 32, "SCALE_BEFORE_DOT": True, "num_warps": 4, "num_stages": 3}
    # warps: 1 warp, 256-row blocks, fp16: at N 16 and K 32 still accumulator 2 * 256 * 16 / 32 = 256 and
    # activations 256 * 32 / 32 = 256; 2, 4, 8 warps: 128/128, 64/64, 32/32
    entry = {"BLOCK_SIZE_N": 64, "num_warps": 1, "num_stages": 2}
    assert mxfp4_launch_config(FP16, 7168, entry, block_m=256) == {
        "BLOCK_N": 16, "BLOCK_K": 32, "SCALE_BEFORE_DOT": False, "num_warps": 8, "num_stages": 2}
    # shared memory: 256-row blocks, N 32, K 32, 8 warps (accumulator, activations 32, dequantization 4) and 14
    # stages: 2 * (14 * 256 * 32 + 32 * 32 + 256 * 32) = 247808 bytes > 232448; 13 stages 231424
    entry = {"BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 32, "num_warps": 8, "num_stages": 14}
    assert mxfp4_launch_config(BF16, 7168, entry, block_m=256)["num_stages"] == 13


def test_rows_blocks_too_large_for_any_launch_are_refused():
    # 256-row blocks fit (8 warps, N 16, K 32: accumulator 16 bf16 / 32 fp16, activations 32); at 512 the
    # activations alone are 512 * 32 / 256 = 64 > 32 (and fp16's accumulator 2 * 512 * 16 / 256 = 64)
    for dtype in (BF16, FP16):
        ok = mxfp4_launch_config(dtype, 7168, {"BLOCK_SIZE_N": 16}, block_m=256)
        assert within_bound(256, ok, dtype)[0] and (ok["BLOCK_N"], ok["BLOCK_K"], ok["num_warps"]) == (16, 32, 8)
        with pytest.raises(ConfigError, match="no MXFP4 launch for BLOCK_M 512 fits"):
            mxfp4_launch_config(dtype, 7168, None, block_m=512)


#: vLLM 0.33.0's ``get_default_config`` for dtype None on a CUDA GPU (what the GPU experts get where no tuned file
#: exists), written out from its source (``fused_moe.py``): BLOCK_SIZE_M 16 up to M 32, 32 up to 96, 64 up to 512,
#: else 128; N 64 up to M 64, else 128; K 128 up to M 64, else 64; 4 warps up to M 128, else 8; 4 stages up to
#: M 32, else 3
def _vllm_bf16_default(m: int) -> dict[str, int]:
    return {"BLOCK_SIZE_M": 16 if m <= 32 else 32 if m <= 96 else 64 if m <= 512 else 128,
            "BLOCK_SIZE_N": 64 if m <= 64 else 128, "BLOCK_SIZE_K": 128 if m <= 64 else 64,
            "num_warps": 4 if m <= 128 else 8, "num_stages": 4 if m <= 32 else 3}


@pytest.mark.parametrize("model", sorted(MODEL_KS))
def test_the_default_configs_at_k2_and_k3_shapes_are_within_the_bound(model):
    # decode (32 tokens) and prefill (4096): vLLM's default, BLOCK_SIZE_M within MoonEP's token padding of 128
    decode, prefill = _vllm_bf16_default(32), _vllm_bf16_default(4096)
    assert (decode["BLOCK_SIZE_M"], prefill["BLOCK_SIZE_M"]) == (16, 128)
    for K in MODEL_KS[model]:   # 128 divides every one
        # decode bf16 (16, 64, 128, 4 warps): accumulator 8, dequantization 64, activations 16: as asked
        assert mxfp4_launch_config(BF16, K, decode, block_m=16) == {
            "BLOCK_N": 64, "BLOCK_K": 128, "SCALE_BEFORE_DOT": True, "num_warps": 4, "num_stages": 4}
        # prefill bf16 (128, 128, 64, 8 warps): accumulator 64 -> N 64 (32; dequantization 16, activations 32)
        assert mxfp4_launch_config(BF16, K, prefill, block_m=128) == {
            "BLOCK_N": 64, "BLOCK_K": 64, "SCALE_BEFORE_DOT": True, "num_warps": 8, "num_stages": 3}
        # fp16 (K 32): decode 2 * 8 = 16, as asked; prefill 2 * 64 = 128 -> N 32 (32)
        assert mxfp4_launch_config(FP16, K, decode, block_m=16)["BLOCK_N"] == 64
        assert mxfp4_launch_config(FP16, K, prefill, block_m=128)["BLOCK_N"] == 32
        # the kernel's own default (N 64, K 128, 4 warps, 3 stages): at 16 rows as it is (8, 64, 16); at 128 rows
        # accumulator 64 -> N 32, activations 128 -> K 32
        assert mxfp4_launch_config(BF16, K, None, block_m=16) == {
            "BLOCK_N": 64, "BLOCK_K": 128, "SCALE_BEFORE_DOT": True, "num_warps": 4, "num_stages": 3}
        assert mxfp4_launch_config(BF16, K, None, block_m=128) == {
            "BLOCK_N": 32, "BLOCK_K": 32, "SCALE_BEFORE_DOT": True, "num_warps": 4, "num_stages": 3}
        for dtype in (BF16, FP16):
            for cfg, bm in ((decode, 16), (prefill, 128), (None, 16), (None, 128)):
                assert within_bound(bm, mxfp4_launch_config(dtype, K, cfg, block_m=bm), dtype)[0]
        # the control: vLLM's prefill tile as asked breaks the bound (accumulator 64)
        assert not within_bound(128, raw_launch(prefill, 64), BF16)[0]


def test_the_launch_bounds_the_row_blocks_it_is_given_and_not_the_interpreters(launcher, monkeypatch):
    rec = launcher  # test_mxfp4_launch's recording stand-in for Triton's launcher
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    M, N, K = 128, 128, 256
    a, out = torch.zeros(M, K, dtype=BF16), torch.zeros(M, N, dtype=BF16)
    weight, scale = torch.zeros(1, N, K // 2, dtype=torch.uint8), torch.zeros(1, N, K // 32, dtype=torch.uint8)
    cu = torch.tensor([M], dtype=torch.int32)
    # no config: the kernel's default, N 64 at 16-row blocks, N 32 (and K 32) at 128-row blocks (see above),
    # whatever BLOCK_SIZE_M a config claims: the blocks' own size is the one launched
    mxfp4_grouped_gemm(a, weight, scale, out, grouped_blocks(cu, M, 16))
    mxfp4_grouped_gemm(a, weight, scale, out, grouped_blocks(cu, M, 128), {"BLOCK_SIZE_M": 16})
    # Triton's interpreter has no registers: the config as asked (the CPU engine's N 512 tiles are its speed)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    mxfp4_grouped_gemm(a, weight, scale, out, grouped_blocks(cu, M, 128))
    mxfp4_grouped_gemm(a, weight, scale, out, grouped_blocks(cu, M, 128), {"BLOCK_SIZE_N": 512})
    assert [(kw["BLOCK_M"], kw["BLOCK_N"], grid) for grid, _, kw in rec.launches] == [
        (16, 64, (8, 2)), (128, 32, (1, 4)), (128, 64, (1, 2)), (128, 512, (1, 1))]
