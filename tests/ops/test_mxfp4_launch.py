"""The MXFP4 kernel's host side in this process (``ops/experts/mxfp4_kernel.py``): launch parameters, the shape
and dtype refusals, and what one launch receives.

The kernel itself runs in the vLLM environment under Triton's interpreter
(``tests/vllm/test_gpu_experts_mxfp4.py``), where mutation testing cannot see
it. Here the launch is recorded instead of run: ``_kernel()`` is replaced by
an object that takes ``kernel[grid](*args, **kwargs)`` as Triton's launcher
does and keeps the arguments, and ``triton.language`` (absent from this
environment) by the two dtype names the host code reads. Every expected value
is worked out by hand below from the inputs and the module's documented
rules, not read from the module.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from moonep_ep.errors import ConfigError
from moonep_ep.ops.experts import mxfp4_kernel as mk
from moonep_ep.ops.experts.grouped_blocks import grouped_blocks
from moonep_ep.ops.experts.mxfp4_kernel import mxfp4_grouped_gemm, mxfp4_launch_config

BF16, FP16 = torch.bfloat16, torch.float16


class _Launcher:
    """``kernel[grid](*args, **kwargs)`` as Triton's ``JITFunction`` takes it; every launch is kept."""

    def __init__(self) -> None:
        self.launches: list[tuple[tuple, tuple, dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


@pytest.fixture
def launcher(monkeypatch) -> _Launcher:
    language = types.ModuleType("triton.language")
    language.bfloat16, language.float16 = "tl.bfloat16", "tl.float16"
    triton = types.ModuleType("triton")
    triton.language = language
    monkeypatch.setitem(sys.modules, "triton", triton)
    monkeypatch.setitem(sys.modules, "triton.language", language)
    rec = _Launcher()
    monkeypatch.setattr(mk, "_kernel", lambda: rec)
    return rec


def test_the_launch_config_picks_block_k_by_dtype_k_and_the_config_and_passes_warps_and_stages():
    def cfg(dtype, K, config=None):
        c = mxfp4_launch_config(dtype, K, config)
        return c["BLOCK_N"], c["BLOCK_K"], c["SCALE_BEFORE_DOT"], c["num_warps"], c["num_stages"]

    # no config: N 64, K 128 (128 divides 256), Triton's 4 warps and 3 stages
    assert mxfp4_launch_config(BF16, 256) == {"BLOCK_N": 64, "BLOCK_K": 128, "SCALE_BEFORE_DOT": True,
                                              "num_warps": 4, "num_stages": 3}
    # bf16: the largest of 128, 64, 32 at most the asked BLOCK_SIZE_K that divides K
    assert cfg(BF16, 192) == (64, 64, True, 4, 3)        # 192 = 1.5 x 128, = 3 x 64
    assert cfg(BF16, 96) == (64, 32, True, 4, 3)         # 96 = 3 x 32 only
    assert cfg(BF16, 256, {"BLOCK_SIZE_K": 64}) == (64, 64, True, 4, 3)
    assert cfg(BF16, 256, {"BLOCK_SIZE_K": 32}) == (64, 32, True, 4, 3)
    assert cfg(BF16, 256, {"BLOCK_SIZE_K": 16}) == (64, 32, True, 4, 3)   # below one group: one group
    assert cfg(BF16, 256, {"BLOCK_SIZE_K": 256}) == (64, 128, True, 4, 3)  # above 128: 128
    # fp16: one 32-value group per dot whatever is asked, the scale after it
    assert cfg(FP16, 256, {"BLOCK_SIZE_K": 128}) == (64, 32, False, 4, 3)
    # the config's N, warps and stages reach the launch, as ints; keys it does not use are left out
    tuned = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": "128", "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 32,
             "num_warps": 8.0, "num_stages": 5}
    assert mxfp4_launch_config(BF16, 512, tuned) == {"BLOCK_N": 128, "BLOCK_K": 128, "SCALE_BEFORE_DOT": True,
                                                    "num_warps": 8, "num_stages": 5}
    assert mxfp4_launch_config(FP16, 512, {"num_warps": 2}) == {"BLOCK_N": 64, "BLOCK_K": 32,
                                                               "SCALE_BEFORE_DOT": False, "num_warps": 2,
                                                               "num_stages": 3}
    assert type(mxfp4_launch_config(BF16, 512, tuned)["num_warps"]) is int


def _operands(M: int, N: int, K: int, G: int, dtype=BF16):
    """Operands with distinct strides in each dimension (views into wider buffers), so a swapped stride shows."""
    a = torch.zeros(K + 8, M, dtype=dtype).t()[:, :K]                 # [M, K], strides (1, M)
    weight = torch.zeros(G, N, K // 2 + 3, dtype=torch.uint8)[:, :, :K // 2]
    scale = torch.zeros(G, N, K // 32 + 1, dtype=torch.uint8)[:, :, :K // 32]
    out = torch.zeros(N + 2, M, dtype=dtype).t()[:, :N]               # [M, N], strides (1, M)
    return a, weight, scale, out


def test_one_launch_receives_the_grid_pointers_shapes_strides_blocks_and_config(launcher):
    M, N, K, G = 48, 96, 256, 3
    a, weight, scale, out = _operands(M, N, K, G)
    blocks = grouped_blocks(torch.tensor([16, 16, 48], dtype=torch.int32), M, 16)   # 3 blocks of 16 rows
    config = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64, "num_warps": 8, "num_stages": 5}
    assert mxfp4_grouped_gemm(a, weight, scale, out, blocks, config=config) is out
    (grid, args, kwargs), = launcher.launches
    assert grid == (3, 3)                                               # 3 blocks, 96 / 32 N tiles
    assert args[0] is a and args[1] is weight and args[2] is scale and args[3] is out
    assert args[4] is blocks.expert_ids and args[5] is blocks.num_tokens_post_padded
    # M, N, K; a (1, 48); weight (96 * 131, 131, 1); scale (96 * 9, 9, 1); out (1, 48)
    assert args[6:] == (48, 96, 256, 1, 48, 12576, 131, 1, 864, 9, 1, 1, 48)
    assert kwargs == {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SCALE_BEFORE_DOT": True,
                      "compute_type": "tl.bfloat16", "num_warps": 8, "num_stages": 5}


def test_fp16_launches_one_group_per_dot_and_an_uneven_n_rounds_the_grid_up(launcher):
    M, N, K, G = 32, 80, 96, 2
    a, weight, scale, out = _operands(M, N, K, G, FP16)
    blocks = grouped_blocks(torch.tensor([32, 32], dtype=torch.int32), M, 32)       # 1 block of 32 rows
    mxfp4_grouped_gemm(a, weight, scale, out, blocks)
    (grid, args, kwargs), = launcher.launches
    assert grid == (1, 2)                                               # 80 / 64 rounds up to 2 N tiles
    assert args[6:9] == (32, 80, 96)
    assert kwargs == {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 32, "SCALE_BEFORE_DOT": False,
                      "compute_type": "tl.float16", "num_warps": 4, "num_stages": 3}


def _refused(launcher, a, weight, scale, out) -> str:
    blocks = grouped_blocks(torch.tensor([a.shape[0]], dtype=torch.int32), a.shape[0], 16)
    with pytest.raises(ConfigError) as e:
        mxfp4_grouped_gemm(a, weight, scale, out, blocks)
    assert launcher.launches == []
    return str(e.value)


def test_every_shape_and_dtype_refusal_is_written_out_whole_and_nothing_launches(launcher):
    M, N, K, G = 16, 64, 64, 2
    a, weight, scale, out = _operands(M, N, K, G)
    kinds = ("MXFP4 weights and scales must be [G, N, K/2] and [G, N, K/32] uint8: got {}. Fix: pass the store's "
             "weight_packed and weight_scale views")
    assert _refused(launcher, a, weight.to(torch.int8), scale, out) == kinds.format(
        "(torch.int8, (2, 64, 32), torch.uint8, (2, 64, 2))")
    assert _refused(launcher, a, weight, scale.to(torch.int8), out) == kinds.format(
        "(torch.uint8, (2, 64, 32), torch.int8, (2, 64, 2))")
    assert _refused(launcher, a, weight[0], scale, out) == kinds.format(
        "(torch.uint8, (64, 32), torch.uint8, (2, 64, 2))")
    assert _refused(launcher, a, weight, scale[0], out) == kinds.format(
        "(torch.uint8, (2, 64, 32), torch.uint8, (64, 2))")
    shapes = "MXFP4 shapes do not fit activations with K={}: got {}. Fix: pass weights [G, N, {}] and scales [G, N, {}]"
    # K 48 is not a multiple of the 32-value group (weights and scales sized as if it were)
    a48 = torch.zeros(M, 48, dtype=BF16)
    w24, s1 = torch.zeros(G, N, 24, dtype=torch.uint8), torch.zeros(G, N, 1, dtype=torch.uint8)
    assert _refused(launcher, a48, w24, s1, out) == shapes.format(48, "((2, 64, 24), (2, 64, 1))", 24, 1)
    assert _refused(launcher, a, weight[:, :, :16], scale, out) == shapes.format(
        64, "((2, 64, 16), (2, 64, 2))", 32, 2)                          # K/4 bytes: half the codes
    assert _refused(launcher, a, weight, scale[:, :, :1], out) == shapes.format(64, "((2, 64, 32), (2, 64, 1))", 32, 2)
    assert _refused(launcher, a, weight, scale[:, :32], out) == shapes.format(64, "((2, 64, 32), (2, 32, 2))", 32, 2)
    assert _refused(launcher, a, weight, scale[:1], out) == shapes.format(64, "((2, 64, 32), (1, 64, 2))", 32, 2)
    acts = ("activations must be bf16/fp16 and out [M, N] of the same dtype: got {}. Fix: pass out = empty(16, 64, "
            "dtype={})")
    assert _refused(launcher, a.float(), weight, scale, out.float()) == acts.format(
        "(torch.float32, torch.float32, (16, 64))", "torch.float32")
    assert _refused(launcher, a, weight, scale, out.half()) == acts.format(
        "(torch.bfloat16, torch.float16, (16, 64))", "torch.bfloat16")
    assert _refused(launcher, a, weight, scale, out[:8]) == acts.format(
        "(torch.bfloat16, torch.bfloat16, (8, 64))", "torch.bfloat16")
    assert _refused(launcher, a, weight, scale, out[:, :32]) == acts.format(
        "(torch.bfloat16, torch.bfloat16, (16, 32))", "torch.bfloat16")
    # the control: the same operands, well formed, launch once
    mxfp4_grouped_gemm(a, weight, scale, out, grouped_blocks(torch.tensor([16], dtype=torch.int32), 16, 16))
    assert len(launcher.launches) == 1
