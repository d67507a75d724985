"""The collective recorder counts what a rank sends, never what a receive buffer held before.

A receive buffer holds whatever its memory held last. The demo on CI once
reported 262144 weight bytes in a dispatch ``all_to_all_single``: the
allocator had handed the output the block where the loader had built an
expert, and the recorder scanned the output before the call. Each case here
plants an expert row in a receive buffer (the false positive the old scan
made) next to its positive control (the same row in what the rank sends).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from moonep_ep.launch import run_ranks
from moonep_ep.ops.moonep.instrument import CollectiveRecorder

ROWS, COLS = 4, 64  # one registered "expert row" is COLS bf16 = 128 bytes
ROW_BYTES = COLS * 2


def _weights() -> torch.Tensor:
    gen = torch.Generator().manual_seed(11)
    return torch.randn(ROWS, COLS, generator=gen).to(torch.bfloat16)


def recorder_cases(ctx: Any) -> dict[str, int]:
    rank, R = ctx.rank, ctx.world_size
    w = _weights()
    out: dict[str, int] = {}

    def record(label: str, body) -> None:
        rec = CollectiveRecorder([w])
        with rec:
            body()
        out[label] = rec.weight_bytes

    zeros = lambda: torch.zeros(R, COLS, dtype=torch.bfloat16)  # noqa: E731 - one row per peer
    stale = lambda: w[:R].clone()  # noqa: E731 - R expert rows: a freed copy the allocator reused

    record("a2a_stale_output", lambda: dist.all_to_all_single(stale(), zeros()))
    record("a2a_sent_rows", lambda: dist.all_to_all_single(zeros(), stale()))
    record("recv_stale_buffer", lambda: (dist.send(zeros()[0], 1) if rank == 0 else dist.recv(w[1].clone(), 0)))
    record("send_row", lambda: (dist.send(w[1].clone(), 1) if rank == 0 else dist.recv(torch.zeros(COLS, dtype=torch.bfloat16), 0)))
    record("broadcast_stale_receiver", lambda: dist.broadcast(zeros()[0] if rank == 0 else w[2].clone(), src=0))
    record("broadcast_row", lambda: dist.broadcast(w[2].clone() if rank == 0 else zeros()[0], src=0))
    gather_name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    gather = lambda *a: getattr(dist, gather_name)(*a)  # noqa: E731 - looked up at call time, as the recorder needs
    record("gather_stale_output", lambda: gather(w[:R].clone().reshape(-1), torch.zeros(COLS, dtype=torch.bfloat16)))
    record("gather_sent_row", lambda: gather(torch.zeros(R * COLS, dtype=torch.bfloat16), w[rank].clone()))
    return out


def test_receive_buffers_are_not_scanned_before_the_call_and_sent_rows_are():
    r0, r1 = run_ranks(recorder_cases, 2, timeout_s=120)
    # Stale bytes in a receive buffer: the collective overwrites them with zeros, so nothing was carried.
    for case in ("a2a_stale_output", "gather_stale_output"):
        assert r0[case] == 0 and r1[case] == 0, (case, r0, r1)
    assert r1["recv_stale_buffer"] == 0 and r0["recv_stale_buffer"] == 0, (r0, r1)
    assert r1["broadcast_stale_receiver"] == 0 and r0["broadcast_stale_receiver"] == 0, (r0, r1)
    # Positive controls: the same rows sent are counted, on the sender (before) and the receiver (after).
    # all_to_all_single of R rows: each rank sends its 2 rows (one to itself) and receives 2.
    assert r0["a2a_sent_rows"] == r1["a2a_sent_rows"] == 2 * ROW_BYTES, (r0, r1)
    assert r0["send_row"] == ROW_BYTES and r1["send_row"] == ROW_BYTES, (r0, r1)
    assert r0["broadcast_row"] == ROW_BYTES and r1["broadcast_row"] == ROW_BYTES, (r0, r1)
    # all-gather: each rank sends its row and receives both: max(before, after) = 2 rows.
    assert r0["gather_sent_row"] == r1["gather_sent_row"] == 2 * ROW_BYTES, (r0, r1)
