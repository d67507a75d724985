"""E8M0 0xFF decodes to NaN in the MXFP4 kernel (OCP MX spec v1.0), under Triton's interpreter.

Runs ``python -m tests.support.mxfp4_e8m0_nan_check --json`` in the ``vllm==0.33.0`` environment (torch and
Triton only). Expected outputs worked out by hand from the harness's inputs: every weight +1.0 at scale
``2^0`` except one group (expert 0, column 3, group 0) whose byte is under test.
"""

from __future__ import annotations

import math

from tests.support.vllm_envs import run_json

COLUMN, ROWS, N = 3, 16, 32


def _split(out: list[list[float]]) -> tuple[list[float], list[float]]:
    """(the 16 entries that read the byte under test, every other entry)."""
    hit = [out[m][COLUMN] for m in range(ROWS)]
    rest = [out[m][n] for m in range(2 * ROWS) for n in range(N) if not (m < ROWS and n == COLUMN)]
    return hit, rest


def test_e8m0_0xff_is_nan_in_the_kernel_and_0xfe_is_not(report):
    out = run_json("vllm", ["-m", "tests.support.mxfp4_e8m0_nan_check", "--json"], timeout=300)
    # bf16 (scale before the dot): group 0 is 32 products 2^-127 * 1 * 2^(x-127), group 1 32 products 1.
    # Elsewhere 32 * 2^-127 + 32 = 32 after rounding; expert 1's rows of column 3 too (the byte is expert 0's).
    hit, rest = _split(out["bfloat16_0xff"])
    assert all(math.isnan(v) for v in hit), hit
    assert rest == [32.0] * len(rest)
    # the control: 0xFE is 2^127, so the 16 entries are 32 * 2^-127 * 2^127 + 32 = 64, finite
    hit, rest = _split(out["bfloat16_0xfe"])
    assert hit == [64.0] * ROWS and rest == [32.0] * len(rest)
    # fp16 (scale after each group's dot): activations 1, so elsewhere 32 + 32 = 64. 0xFF: NaN; the control
    # 0xFE: the group's partial sum 32 times 2^127 is 2^132, past fp32's range: +inf (as before), not NaN
    hit, rest = _split(out["float16_0xff"])
    assert all(math.isnan(v) for v in hit), hit
    assert rest == [64.0] * len(rest)
    hit, rest = _split(out["float16_0xfe"])
    assert hit == [math.inf] * ROWS and rest == [64.0] * len(rest)
    report(f"[mxfp4 kernel, interpreter] E8M0 0xFF -> NaN, 0xFE finite (bf16) / +inf (fp16) in {out['seconds']} s")
