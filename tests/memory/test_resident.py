"""``accounting.resident_bytes``: what the OS backs (mincore), not what was reserved."""

from __future__ import annotations

import mmap

import torch

from moonep_ep.memory.accounting import resident_bytes


def test_untouched_memory_is_not_resident_and_written_memory_is():
    page = mmap.PAGESIZE
    buf = mmap.mmap(-1, 64 * page)  # fresh anonymous pages: reserved, not backed
    t = torch.frombuffer(buf, dtype=torch.uint8)
    assert resident_bytes(t.data_ptr(), t.numel()) == 0  # negative control: nothing touched yet
    t[: 8 * page].fill_(1)
    assert resident_bytes(t.data_ptr(), t.numel()) == 8 * page
    t[20 * page + 5] = 1  # one byte backs its whole page
    assert resident_bytes(t.data_ptr(), t.numel()) == 9 * page
    # A range that starts and ends inside pages counts only its overlap.
    assert resident_bytes(t.data_ptr() + 100, 8 * page - 200) == 8 * page - 200
    assert resident_bytes(t.data_ptr(), 0) == 0
    del t
    buf.close()
