"""E8M0 0xFF (the OCP MX spec's NaN) in the MXFP4 kernel, under Triton's interpreter (vllm==0.33.0 environment).

``python -m tests.support.mxfp4_e8m0_nan_check --json`` (torch and Triton only, a few seconds) prints one
output tensor per (dtype, scale byte): two experts of 16 rows, ``N`` 32, ``K`` 64 (two scale groups), every
code 2 (the value +1.0), every scale byte 127 (``2^0``) except expert 0's column 3, group 0, which is the byte
under test (0xFF, and 0xFE as the control). Activations are +1, except bf16's group-0 columns,
``2^-127`` (exact in bf16) so that 0xFE's ``2^127`` weights give a moderate sum. Outputs as lists
(``NaN``/``Infinity`` as JSON writes them); the test works out what each must be.

The interpreter's bf16 ``tl.dot`` and downcasts are mended first (``moonep_ep.testing.triton_interpreter``).
"""

from __future__ import annotations

import sys
from typing import Any

from tests.support.mxfp4_kernel_check import run_interpreted

COLUMN, ROWS, N, K = 3, 16, 32, 64
BYTES = (0xFF, 0xFE)


def case(dtype_name: str, byte: int) -> list[list[float]]:
    import torch

    from moonep_ep.ops.experts.grouped_blocks import grouped_blocks
    from moonep_ep.ops.experts.mxfp4_kernel import mxfp4_grouped_gemm

    dtype = getattr(torch, dtype_name)
    packed = torch.full((2, N, K // 2), 0x22, dtype=torch.uint8)    # code 2 in both nibbles: +1.0, +1.0
    scale = torch.full((2, N, K // 32), 127, dtype=torch.uint8)
    scale[0, COLUMN, 0] = byte
    a = torch.ones(2 * ROWS, K, dtype=torch.float64)
    if dtype == torch.bfloat16:
        a[:, :32] = 2.0 ** -127
    a = a.to(dtype)
    cu = torch.tensor([ROWS, 2 * ROWS], dtype=torch.int32)
    out = torch.zeros(2 * ROWS, N, dtype=dtype)
    mxfp4_grouped_gemm(a, packed, scale, out, grouped_blocks(cu, 2 * ROWS, 16),
                       {"BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64})
    return out.double().tolist()


def main(argv: list[str] | None = None) -> int:
    return run_interpreted(lambda: {f"{d}_{b:#x}": case(d, b) for d in ("bfloat16", "float16") for b in BYTES},
                           argv)


if __name__ == "__main__":
    sys.exit(main())
