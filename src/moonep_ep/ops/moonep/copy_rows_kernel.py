"""Row copies whose row numbers stay on the device: ``dst[dst_index[m]] <- src[src_index[m]]`` (Triton).

The slot fills (:mod:`.prefetch`) copy whole expert rows; which rows is the plan's slot table, a device
tensor. A copy per used slot (``cudaMemcpyAsync``) needs the table on the host, so the step would wait for
the device (issue 45). :func:`copy_rows` is one launch per tensor whose shape depends on the table's size
only: program ``(chunk, m)`` reads ``src_index[m]`` and ``dst_index[m]`` from device memory and copies one
chunk of the row, or nothing where either index is negative (that destination row is never written).

Addresses: source row ``i`` at ``i * src.stride(0)``; destination row ``j`` at
``(j // group) * outer + (j % group) * inner``: ``dst`` ``[N, ...]`` (``group = N``) or a push pool
``[R, epn, ...]`` (row ``j`` = rank ``j // epn``'s slot ``j % epn``, the ranks' pools apart in memory). Rows
move as words of the widest integer type (8, 4, 2 or 1 bytes) dividing the row's bytes, the strides and
both pointers. Triton is imported at the first launch (the module imports without it).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ...errors import config_error

__all__ = ["copy_rows", "word_size", "BLOCK_WORDS", "MAX_ROWS"]

#: words one program copies (8 KiB of int64)
BLOCK_WORDS = 1024
#: index entries per launch: CUDA's limit on a grid's second dimension
MAX_ROWS = 65535
_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@functools.lru_cache(maxsize=None)
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def copy_rows_kernel(src, dst, src_index, dst_index, words, src_stride, group, outer, inner,
                         BLOCK: tl.constexpr):
        m = tl.program_id(1)
        s = tl.load(src_index + m).to(tl.int64)
        d = tl.load(dst_index + m).to(tl.int64)
        valid = (s >= 0) & (d >= 0)
        s = tl.maximum(s, 0)
        d = tl.maximum(d, 0)
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = (offs < words) & valid
        row = tl.load(src + s * src_stride + offs, mask=mask)
        tl.store(dst + (d // group) * outer + (d % group) * inner + offs, row, mask=mask)

    return copy_rows_kernel


def _row_words(t: torch.Tensor, row_dims: int) -> torch.Tensor:
    """``t`` as ``[*rows, row_bytes]`` bytes (each row contiguous), or a clear error."""
    try:
        return t.view(*t.shape[:row_dims], -1).view(torch.uint8)
    except RuntimeError as exc:
        raise config_error(None, f"copy_rows needs every row of a {tuple(t.shape)} tensor contiguous; its strides",
                           tuple(t.stride()), "pass the store's [E+B] pull view or [R, epn] push pool, whose rows "
                           "are contiguous") from exc


def word_size(*byte_views: torch.Tensor) -> int:
    """The widest word (8, 4, 2, 1 bytes) dividing every view's row length, strides and pointer."""
    numbers = [n for v in byte_views for n in (v.shape[-1], v.data_ptr(), *v.stride()[:-1])]
    return next(w for w in _WORDS if all(n % w == 0 for n in numbers))


def copy_rows(dst: torch.Tensor, dst_index: torch.Tensor, src: torch.Tensor, src_index: torch.Tensor, *,
              dst_row_dims: int = 1) -> None:
    """``dst`` row ``dst_index[m]`` <- ``src`` row ``src_index[m]`` for every ``m`` with both indices ``>= 0``.

    Args:
        dst: ``[N, ...]`` (``dst_row_dims=1``) or ``[G0, G1, ...]`` (``dst_row_dims=2``: row ``j`` is
            ``dst[j // G1, j % G1]``), each row contiguous.
        dst_index, src_index: ``[M]`` int32 or int64 on ``dst``'s device, read by the kernel only.
        src: ``[N', ...]``, each row contiguous, rows of ``dst``'s bytes.

    Runs on the current stream; the caller orders it (``prefetch._run_copies``: a side stream).
    """
    d = _row_words(dst, dst_row_dims)
    s = _row_words(src, 1)
    M = src_index.numel()
    if d.shape[-1] != s.shape[-1] or dst_index.numel() != M:
        raise config_error(None, "copy_rows: destination and source row bytes, destination and source indices",
                           (d.shape[-1], s.shape[-1], dst_index.numel(), M),
                           "pass rows of one size and one destination index per source index")
    if M > MAX_ROWS:
        raise config_error(None, f"copy_rows: index entries past one launch's {MAX_ROWS}", M,
                           "split the table over several launches")
    if M == 0 or s.shape[-1] == 0:
        return
    w = word_size(d, s)
    d, s = d.view(_WORDS[w]), s.view(_WORDS[w])
    words = s.shape[-1]
    if dst_row_dims == 1:
        group, outer, inner = d.shape[0], 0, d.stride(0)
    else:
        group, outer, inner = d.shape[1], d.stride(0), d.stride(1)
    grid = (-(-words // BLOCK_WORDS), M)
    _kernel()[grid](s, d, src_index, dst_index, words, s.stride(0), max(group, 1), outer, inner,
                    BLOCK=BLOCK_WORDS)

