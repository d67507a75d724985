"""E8M0 0xFF is NaN (OCP MX spec v1.0) in the CPU experts' MXFP4 dequantization (``ops/experts/quantized.py``).

The kernel's side runs under Triton's interpreter in ``tests/vllm/test_mxfp4_e8m0_nan.py``.
"""

from __future__ import annotations

import pytest
import torch

from moonep_ep.ops.experts.quantized import dequantize_rows


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_the_scale_0xff_makes_its_32_weights_nan_and_0xfe_keeps_them_finite(out_dtype):
    # one row, N 2, K 64 (two groups); every code 2 (+1.0) but row 0's first byte: codes 0 (+0.0) and 2
    packed = torch.full((1, 2, 32), 0x22, dtype=torch.uint8)
    packed[0, 0, 0] = 0x20
    scale = torch.full((1, 2, 2), 127, dtype=torch.uint8)
    scale[0, 0, 0], scale[0, 1, 0] = 0xFF, 0xFE
    w = dequantize_rows("mxfp4", packed, scale, out_dtype).float()
    # 0xFF: all 32 weights of the group NaN, the +0.0 code included (it was +inf for the +1.0 codes before)
    assert w[0, 0, :32].isnan().all()
    # the control: 0xFE is 2^127, exact in bf16 and fp32; 1.0 * 2^127 finite
    assert torch.equal(w[0, 1, :32], torch.full((32,), 2.0 ** 127))
    # the other groups are untouched: 1.0 * 2^0, and no NaN leaks out of the 0xFF group
    assert torch.equal(w[0, :, 32:], torch.ones(2, 32))
