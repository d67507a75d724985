"""The slot fills' row-copy kernel (``ops/moonep/copy_rows_kernel.py``) under Triton's interpreter.

``python -m tests.support.copy_rows_check`` runs in the vllm==0.33.0 environment (it has Triton; nothing here
imports vLLM). Against a reference written here (a Python loop over the index tables, ``Tensor.copy_`` per
row): rows of 8, 4, 2 and 1-byte words, unused entries (``-1`` in either table), a ``[R, epn]`` pool whose ranks
lie apart in memory, and the two fills of ``prefetch.py`` composed as on CUDA (``RowCopies.index_tables`` then
one launch per tensor) against the CPU side stream's landing. The control: one wrong source index, which the
comparison must show. Prints one JSON document.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from moonep_ep.testing.triton_interpreter import enter_interpreter


def reference(dst: Any, dst_index: list[int], src: Any, src_index: list[int], group: int = 0) -> Any:
    """``dst`` after the copies, computed row by row (``group``: rows per outer index of a 2-level ``dst``)."""
    out = dst.clone()
    for d, s in zip(dst_index, src_index):
        if d >= 0 and s >= 0:
            (out[d] if not group else out[d // group, d % group]).copy_(src[s])
    return out


def main() -> int:
    enter_interpreter()
    import torch

    from moonep_ep.ops.moonep.copy_rows_kernel import copy_rows, word_size
    from moonep_ep.ops.moonep.prefetch import RowCopies

    gen = torch.Generator().manual_seed(45)
    out: dict[str, Any] = {"cases": {}}

    def rows(n: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        return torch.randint(0, 250, (n, *shape), generator=gen).to(dtype)

    def index(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32)

    # (name, source rows, destination rows): 8-byte words (bf16 4x8), 4 (fp32 3), 2 (bf16 3), 1 (uint8 5)
    for name, shape, dtype in (("int64 words", (4, 8), torch.bfloat16), ("int32 words", (3,), torch.float32),
                               ("int16 words", (3,), torch.bfloat16), ("bytes", (5,), torch.uint8)):
        src, dst = rows(6, shape, dtype), rows(5, shape, dtype)
        src_index, dst_index = [3, -1, 0, 5, 2], [0, 1, -1, 4, 2]   # entry 1 and 2 copy nothing
        want = reference(dst, dst_index, src, src_index)
        got = dst.clone()
        copy_rows(got, index(dst_index), src, index(src_index))
        view = got.view(got.shape[0], -1).view(torch.uint8)
        out["cases"][name] = {"equal": torch.equal(got, want), "word": word_size(view),
                              "untouched": torch.equal(got[1], dst[1])}
    # A [R=2, epn=3] pool with a gap row between the ranks (the store's pools need not be adjacent)
    base = rows(2, (4, 2, 8), torch.bfloat16)
    pool, local = base[:, :3], rows(3, (2, 8), torch.bfloat16)
    src_index, dst_index = [1, -1, 0, 2], [0, 1, 4, 5]              # rows (0,0), (0,1), (1,1), (1,2)
    want = reference(pool, dst_index, local, src_index, group=3)
    gap = base[:, 3].clone()
    copy_rows(pool, index(dst_index), local, index(src_index), dst_row_dims=2)
    out["cases"]["pool with gaps"] = {"equal": torch.equal(pool, want), "gap_untouched": torch.equal(base[:, 3], gap)}
    # The control: one wrong source index shows as a mismatch
    src, dst = rows(6, (4, 8), torch.bfloat16), rows(5, (4, 8), torch.bfloat16)
    want = reference(dst, [0, 1, 2], src, [3, 4, 5])
    got = dst.clone()
    copy_rows(got, index([0, 1, 2]), src, index([3, 1, 5]))
    out["control_wrong_index_equal"] = torch.equal(got, want)
    # prefetch.py's fills as composed on CUDA, against the CPU landing
    E, B = 4, 3
    full = rows(E + B, (2, 8), torch.bfloat16)
    pull_ids = torch.tensor([2, -1, 0], dtype=torch.int32)
    pools, own = rows(2, (3, 2, 8), torch.bfloat16), rows(3, (2, 8), torch.bfloat16)
    push_ids = torch.tensor([[4, 1], [0, 5]])                   # int64; rank 1 of 2 (experts 3-5), 2 slots used
    # the landing (rows read from the host table) and the kernel (index tables on the device), each on a copy
    full2 = full.clone()
    pull_cpu = RowCopies({"w": (full2, full2)}, pull_ids, 0, E, offset=E)
    for d, s in pull_cpu.landing_pairs():
        d.copy_(s)
    full3 = full.clone()
    src_index, dst_index = RowCopies({"w": (full3, full3)}, pull_ids, 0, E, offset=E).index_tables()
    copy_rows(full3, dst_index, full3, src_index)
    pools2, pools3 = pools.clone(), pools.clone()
    for d, s in RowCopies({"w": (pools2, own)}, push_ids, 3, 6, width=2).landing_pairs():
        d.copy_(s)
    push_k = RowCopies({"w": (pools3, own)}, push_ids, 3, 6, width=2)
    src_index, dst_index = push_k.index_tables()
    copy_rows(pools3, dst_index, own, src_index, dst_row_dims=2)
    out["composed"] = {"pull_equal": torch.equal(full2, full3), "pull_wrote": not torch.equal(full2, full),
                       "push_equal": torch.equal(pools2, pools3), "push_wrote": not torch.equal(pools2, pools),
                       "push_rows": [src_index.tolist(), dst_index.tolist()]}
    pull_want, push_want = full.clone(), pools.clone()
    pull_want[E], pull_want[E + 2] = full[2], full[0]           # slot 1 (-1) untouched
    push_want[0, 0], push_want[1, 1] = own[1], own[2]           # experts 4 and 5: rank 1's own 1 and 2
    out["composed"]["pull_as_planned"] = torch.equal(full3, pull_want)
    out["composed"]["push_as_planned"] = torch.equal(pools3, push_want)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
