"""The MXFP4 launch bound against the compiler: tiles vLLM's tuned entries ask for, raw and as bounded, compiled for
Hopper (sm_90a) on the CPU by the ``vllm==0.33.0`` environment's Triton and ``ptxas -v``
(``tests/support/mxfp4_ptxas_check.py``, about 10-20 s).

The raw tiles spill (the control: the check sees spills when there are some); the bounded ones must not, and
Triton's shared memory must be at most the bound's formula.
"""

from __future__ import annotations

import json

import pytest
import torch

from moonep_ep.ops.experts.mxfp4_kernel import mxfp4_launch_config
from tests.ops.test_mxfp4_bounds import within_bound
from tests.support.vllm_envs import run_json

pytestmark = pytest.mark.slow

BF16, FP16 = torch.bfloat16, torch.float16
#: (row block, vLLM entry, dtype): vLLM's commonest large-M bf16 entry (128x128x64 at 4 warps, 96 of its 2660),
#: 64x256x64 at 8 warps (40 entries), and vLLM's bf16 prefill default run in fp16 (the accumulator counted twice)
CASES = [(128, {"BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "num_warps": 4, "num_stages": 3}, BF16),
         (64, {"BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 64, "num_warps": 8, "num_stages": 4}, BF16),
         (128, {"BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "num_warps": 8, "num_stages": 3}, FP16)]


def _spec(bm: int, launch: dict, dtype: torch.dtype) -> list:
    return [bm, launch["BLOCK_N"], launch["BLOCK_K"], launch["num_warps"], launch["num_stages"],
            "bf16" if dtype == BF16 else "fp16"]


def test_bounded_tiles_compile_without_spills_and_raw_ones_spill(report):
    raw, bounded = [], []
    for bm, entry, dtype in CASES:
        asked = {"BLOCK_N": entry["BLOCK_SIZE_N"], "BLOCK_K": 32 if dtype == FP16 else entry["BLOCK_SIZE_K"],
                 "num_warps": entry["num_warps"], "num_stages": entry["num_stages"]}
        assert not within_bound(bm, asked, dtype)[0]
        launch = mxfp4_launch_config(dtype, 7168, entry, block_m=bm)
        ok, cost = within_bound(bm, launch, dtype)
        assert ok
        raw.append(_spec(bm, asked, dtype))
        bounded.append((_spec(bm, launch, dtype), cost["shared"]))
    out = run_json("vllm", ["-m", "tests.support.mxfp4_ptxas_check", "--json",
                            json.dumps(raw + [s for s, _ in bounded])], timeout=300)
    got = out["configs"]
    assert [c["cfg"] for c in got] == raw + [s for s, _ in bounded]
    # the control: every raw tile spills (ptxas reports it; all 255 registers in use)
    for c in got[:len(raw)]:
        assert c["spill_stores"] > 0 and c["registers"] == 255, c
    # bounded: no spills, and Triton's shared memory within the formula (itself within 227 KiB)
    for c, (_, shared) in zip(got[len(raw):], bounded):
        assert c["spill_stores"] == 0 and c["spill_loads"] == 0 and c["registers"] < 255, c
        assert c["shared"] <= shared <= 227 * 1024, (c, shared)
    report(f"[mxfp4 ptxas sm_90a] raw {[(c['cfg'][:5], c['spill_stores']) for c in got[:len(raw)]]} spill; "
           f"bounded {[(c['cfg'][:5], c['registers']) for c in got[len(raw):]]} do not ({out['seconds']} s)")
