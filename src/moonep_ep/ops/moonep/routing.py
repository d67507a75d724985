"""Where every ``(token, k)`` entry of one dispatch goes, and where it lands: pure functions.

Given a rank's ``dst`` (moonep.md §4.6–4.7: ``rank*NvS + loff``, duplicates
stored ``-raw-1``), :func:`source_routes` decides what this rank sends to
each destination: one payload row per (token, destination) and one metadata
entry per ``(token, k)``. :func:`destination_routes` turns the metadata a
rank received into the shard rows its entries land on, and
:func:`dedup_tables` into MoonEP's duplicate structures. No process group,
no device: the buffer (``buffer.py``) moves the tensors between them.

Metadata entry (int32 columns): ``loff`` (shard row on the destination),
``enc`` (index of the payload row inside this source's block for that
destination; ``-x-1`` for a duplicate that reuses the primary's row), and,
when route weights travel, the fp32 weight's bits.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

__all__ = ["Routing", "SendPlan", "source_routes", "destination_routes", "dedup_tables"]


@dataclasses.dataclass(eq=False)
class Routing:
    """Send/receive index tables of one rank for one plan (all ``torch.int64``, CPU).

    Source side (this rank's tokens):

    * ``send_row_splits`` ``[R]`` list: rows sent to each destination, one
      per (token, destination) pair; ``send_row_token`` ``[P]``: token of
      each sent row, in send order (destination, then flat index).
    * ``send_entry_splits`` ``[R]`` list: entries per destination;
      ``send_entry_index`` ``[n]``: flat index ``t*K + k`` of each entry in
      send order.

    Destination side (rows this rank computes):

    * ``recv_row_splits`` ``[R]``: rows received from each source;
      ``recv_row_loff`` ``[P']``: shard row of each received row's primary.
    * ``recv_entry_splits`` ``[R]``: entries from each source;
      ``recv_entry_loff`` ``[n']``: shard row of each received entry;
      ``recv_entry_row`` ``[n']``: index of its payload in the received rows.
    * ``pad_rows``: shard rows zeroed by dispatch (this rank's ``zero_fill_ranges``).
    """

    send_row_splits: list[int]
    send_row_token: torch.Tensor
    send_entry_splits: list[int]
    send_entry_index: torch.Tensor
    recv_row_splits: list[int]
    recv_row_loff: torch.Tensor
    recv_entry_splits: list[int]
    recv_entry_loff: torch.Tensor
    recv_entry_row: torch.Tensor
    pad_rows: torch.Tensor

    def clone(self) -> "Routing":
        return Routing(**{f.name: (v.clone() if isinstance(v, torch.Tensor) else list(v))
                          for f in dataclasses.fields(self) for v in [getattr(self, f.name)]})


@dataclasses.dataclass(eq=False)
class SendPlan:
    """What one source rank sends: row and entry splits per destination, the token of each
    payload row, the send order of the entries, and the metadata ``[n, width]`` int32."""

    row_splits: list[int]
    row_token: torch.Tensor
    entry_splits: list[int]
    entry_index: torch.Tensor
    meta: torch.Tensor


def source_routes(dst: torch.Tensor, s: int, K: int, NvS: int, R: int,
                  weights_sk: Optional[torch.Tensor] = None) -> SendPlan:
    """The send side of one dispatch from ``dst`` ``[s*K]`` (int32 or int64, CPU)."""
    n = s * K
    dst64 = dst.to("cpu", torch.int64)
    raw = torch.where(dst64 >= 0, dst64, -dst64 - 1)
    dest, loff = raw // NvS, raw % NvS
    primary = dst64 >= 0
    entry_order = torch.sort(dest, stable=True).indices          # entries grouped by destination
    entry_splits = torch.bincount(dest, minlength=R)
    # Primary of every entry: the first k of the same token landing on the same destination.
    dd = dest.view(s, K)
    first_k = (dd[:, :, None] == dd[:, None, :]).to(torch.int8).argmax(dim=2)  # first max = smallest k'
    prim_flat = (torch.arange(s)[:, None] * K + first_k).reshape(-1)
    prim_idx = torch.nonzero(primary).squeeze(1)                  # ascending flat index
    row_order = prim_idx[torch.sort(dest[prim_idx], stable=True).indices]
    row_splits = torch.bincount(dest[prim_idx], minlength=R)
    row_start = torch.cumsum(row_splits, 0) - row_splits
    pos_in_block = torch.zeros(n, dtype=torch.int64)
    pos_in_block[row_order] = torch.arange(row_order.numel()) - row_start[dest[row_order]]
    prim_row = pos_in_block[prim_flat]
    enc = torch.where(primary, prim_row, -prim_row - 1)           # MoonEP-style: dups as -x-1
    cols = [loff, enc]
    if weights_sk is not None:
        cols.append(weights_sk.detach().reshape(-1).to("cpu").view(torch.int32).to(torch.int64))
    meta = torch.stack(cols, dim=1)[entry_order].to(torch.int32)
    return SendPlan(row_splits=row_splits.tolist(), row_token=torch.div(row_order, K, rounding_mode="floor"),
                    entry_splits=entry_splits.tolist(), entry_index=entry_order, meta=meta)


def destination_routes(send: SendPlan, meta_recv: torch.Tensor, recv_entry_splits: list[int],
                       recv_row_splits: list[int], zero_fill_ranges: torch.Tensor
                       ) -> tuple[Routing, Optional[torch.Tensor]]:
    """The receive side: where each received entry and payload row lands in this rank's shard.

    ``meta_recv`` ``[n', width]`` int64 in source order; ``zero_fill_ranges``
    ``[G, 2]`` this rank's padding. Returns the routing tables and, when the
    metadata carried route weights, the received weights ``[n']`` fp32.
    """
    R = len(recv_entry_splits)
    r_loff, r_enc = meta_recv[:, 0], meta_recv[:, 1]
    r_prim = r_enc >= 0
    r_local = torch.where(r_prim, r_enc, -r_enc - 1)
    src = torch.repeat_interleave(torch.arange(R), torch.tensor(recv_entry_splits, dtype=torch.int64))
    rows_per_src = torch.tensor(recv_row_splits, dtype=torch.int64)
    rbase = torch.cumsum(rows_per_src, 0) - rows_per_src
    r_row = rbase[src] + r_local
    recv_row_loff = torch.empty(sum(recv_row_splits), dtype=torch.int64)
    recv_row_loff[r_row[r_prim]] = r_loff[r_prim]
    zf = zero_fill_ranges.to(torch.int64)
    pad_rows = torch.cat([torch.arange(int(a), int(a) + int(c)) for a, c in zf.tolist() if c > 0] or
                         [torch.zeros(0, dtype=torch.int64)])
    routing = Routing(
        send_row_splits=send.row_splits, send_row_token=send.row_token,
        send_entry_splits=send.entry_splits, send_entry_index=send.entry_index,
        recv_row_splits=list(recv_row_splits), recv_row_loff=recv_row_loff,
        recv_entry_splits=list(recv_entry_splits), recv_entry_loff=r_loff, recv_entry_row=r_row, pad_rows=pad_rows)
    weights = meta_recv[:, 2].to(torch.int32).view(torch.float32) if meta_recv.shape[1] > 2 else None
    return routing, weights


def dedup_tables(routing: Routing, NvS: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MoonEP's dedup structures of this rank (moonep.md §3, §4.7): ``dup_groups`` ``[NvS, 3]``
    (primary row, first dup, dup count) for every source token with several entries here,
    ``dup_loffs`` ``[NvS]`` (the duplicates' rows) and ``dup_counts`` ``[2]`` (valid prefixes).
    Ordered by received row (MoonEP's order is arrival order: compare as sets)."""
    r_loff, r_row = routing.recv_entry_loff, routing.recv_entry_row
    dup = r_loff != routing.recv_row_loff[r_row]
    dup_sel = torch.nonzero(dup).squeeze(1)
    dup_sel = dup_sel[torch.sort(r_row[dup_sel], stable=True).indices]
    dup_rows, dup_cnt = torch.unique_consecutive(r_row[dup_sel], return_counts=True)
    n_groups, n_dups = dup_rows.numel(), dup_sel.numel()
    dup_groups = torch.zeros(NvS, 3, dtype=torch.int64)
    dup_loffs = torch.zeros(NvS, dtype=torch.int64)
    if n_groups:
        dup_groups[:n_groups, 0] = routing.recv_row_loff[dup_rows]
        dup_groups[:n_groups, 1] = torch.cumsum(dup_cnt, 0) - dup_cnt
        dup_groups[:n_groups, 2] = dup_cnt
        dup_loffs[:n_dups] = r_loff[dup_sel]
    return dup_groups, dup_loffs, torch.tensor([n_groups, n_dups])
