"""The slot fills' row-copy kernel (``ops/moonep/copy_rows_kernel.py``) under Triton's interpreter.

Runs ``python -m tests.support.copy_rows_check`` in the vLLM environment (Triton). The kernel reads both index
tables itself (issue 45: no host read of the slot table): it must equal a row-by-row reference for every word
width, skip the entries marked ``-1`` (their rows untouched), address a push pool whose ranks lie apart, and,
composed as ``prefetch._run_copies`` composes it on CUDA, equal the CPU side stream's landing. The control: one
wrong source index is seen as a mismatch.
"""

from __future__ import annotations

import pytest

from tests.support.vllm_envs import run_json

pytestmark = pytest.mark.slow


def test_the_kernel_copies_the_rows_its_device_tables_name_and_no_other():
    out = run_json("vllm", ["-m", "tests.support.copy_rows_check"], timeout=300)
    assert {name: case["word"] for name, case in out["cases"].items() if "word" in case} == {
        "int64 words": 8, "int32 words": 4, "int16 words": 2, "bytes": 1}
    for name, case in out["cases"].items():
        assert all(case.values()), (name, case)
    assert out["control_wrong_index_equal"] is False  # the comparison sees one wrong row
    composed = out["composed"]
    assert composed["push_rows"] == [[1, -1, -1, 2], [0, 1, 3, 4]]  # rank 1's experts 4, 5 -> pool rows (0,0), (1,1)
    assert all(v for k, v in composed.items() if k != "push_rows"), composed
