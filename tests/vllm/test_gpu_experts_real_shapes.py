"""Real shapes through the GPU experts under the Triton interpreter (``tests/support/gpu_experts_real_shapes.py``).

One expert per format at the real checkpoint's shape (K2-Thinking INT4 and K2
FP8 block: H 7168, I 2048, E 384; K3 MXFP4: H 3584, I 3072, E 896) as the
last expert of a store with the model's expert count, so every weight row it
reads starts past 2^31 bytes of its ``[E+B]`` view; a slot fill copies it
after the last owner row; owner rows and slot rows both match the decompressed
expert within the kernel tier's bound. Measured on the 2-core machine: 27 s
(INT4), 42 s (FP8, max row rel err 1.0e-3), 47 s (MXFP4), one process each
(72 / 92 / 77 s and FP8 3.1e-2 before the interpreter mends were fixed). That
is too long for the default run, so it runs when ``MOONEP_EP_REAL_SHAPES=1`` and is skipped,
saying so, otherwise.
"""

from __future__ import annotations

import pytest

from moonep_ep import envs
from tests.support.vllm_envs import run_json

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not envs.MOONEP_EP_REAL_SHAPES,
                                 reason="real-shape check costs about 2 min on 2 cores: set MOONEP_EP_REAL_SHAPES=1")]


@pytest.mark.parametrize("fmt", ["int4-g32", "fp8-block", "mxfp4"])
def test_one_real_shaped_expert_past_2_31_bytes_through_store_slot_and_kernel(fmt, report):
    out = run_json("vllm", ["-m", "tests.support.gpu_experts_real_shapes", "--json", "--formats", fmt], timeout=600)
    r = out["formats"][fmt]
    weights = [n for n in r["owner_row_offset"] if "scale" not in n]
    assert all(r["owner_row_offset"][n] >= 2 ** 31 and r["slot_row_offset"][n] > r["owner_row_offset"][n]
               for n in weights), r
    assert r["slot_equals_owner"]
    assert r["max_row_rel_err"] <= r["bound"] and r["max_row_rel_err_slot_rows"] <= r["bound"], r
    assert out["ok"]
    report(f"[real shape {fmt}, {r['model']} H {r['H']} I {r['I']} E {r['E']}] max row rel err "
           f"{r['max_row_rel_err']:.2e} <= {r['bound']:.2e}; kernel {r['kernel_seconds']} s, "
           f"total {out['seconds']} s")
