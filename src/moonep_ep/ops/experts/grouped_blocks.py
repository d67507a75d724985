"""Block metadata that lets a Triton grouped MoE kernel read MoonEP's ``[NvS, H]`` rows directly.

vLLM's Triton MoE kernels (``fused_moe_kernel``, ``fused_moe_kernel_gptq_awq``)
and this project's MXFP4 kernel compute one ``BLOCK_SIZE_M`` block of rows
with one weight row, named per block by ``expert_ids``; rows come through
``sorted_token_ids`` and the kernel stops at ``num_tokens_post_padded``.
MoonEP's dispatch already groups rows by weight row (``cu_seqlens`` over the
``[E+B]`` rows) and pads every non-empty group to a multiple of its
``token_padding``. So when ``BLOCK_SIZE_M`` divides ``token_padding`` every
block lies inside one group, and no sort (``moe_align_block_size``) and no
permute is needed:

* ``sorted_token_ids`` = ``arange(blocks · BLOCK_SIZE_M)``: row ids as they
  are; ids ``>= NvS`` are masked by the kernels (``token < num_valid_tokens``);
* ``expert_ids[b]`` = the group holding row ``b · BLOCK_SIZE_M`` (the first
  ``g`` with ``cu_seqlens[g] > start``: empty groups are skipped), ``-1`` for
  blocks at or past ``cu_seqlens[-1]`` (the kernels write nothing there);
* ``num_tokens_post_padded`` = ``cu_seqlens[-1]`` (a device tensor: no host sync).

:func:`restrict_to_groups` limits a launch to a range of weight rows (the own
experts before the slot fill's wait, the slots after it), on the device too.

That every group starts on a block boundary is checked on the device
(:func:`assert_segments_aligned`, ``torch._assert_async``): no host sync on
the way; a CUDA launch fails with a device-side assert, a CPU call raises at
once. A misaligned block would otherwise be computed silently with one
group's weights for another group's rows.
"""

from __future__ import annotations

import dataclasses

import torch

from ...errors import config_error

__all__ = ["GroupedBlocks", "assert_segments_aligned", "check_block_size", "grouped_blocks", "restrict_to_groups",
           "skip_zero_weight_blocks", "check_segments_aligned"]


@dataclasses.dataclass
class GroupedBlocks:
    """What a grouped kernel launch reads: see the module docstring."""

    block_m: int
    sorted_token_ids: torch.Tensor       # [blocks * block_m] int32
    expert_ids: torch.Tensor             # [blocks] int32, -1 past the last group
    num_tokens_post_padded: torch.Tensor  # [1] int32 = cu_seqlens[-1]

    @property
    def num_blocks(self) -> int:
        return self.expert_ids.numel()


def check_block_size(block_m: int, token_padding: int, rank: int | None = None) -> None:
    """Refuse a ``BLOCK_SIZE_M`` that does not divide MoonEP's ``token_padding`` (a block would straddle
    two experts' rows and be computed with one expert's weights)."""
    if not isinstance(block_m, int) or block_m < 16 or block_m & (block_m - 1):
        raise config_error(rank, "BLOCK_SIZE_M must be a power of two >= 16 (tl.dot's smallest tile)", block_m,
                           "use 16, 32, 64 or 128")
    if not isinstance(token_padding, int) or token_padding <= 0 or token_padding % block_m:
        raise config_error(rank, f"BLOCK_SIZE_M {block_m} does not divide MoonEP's token_padding {token_padding}: "
                           "a kernel block would hold rows of two experts", (block_m, token_padding),
                           f"use a BLOCK_SIZE_M that divides {token_padding}, or a token_padding that is a "
                           f"multiple of {block_m}")


def misaligned_message(block_m: int) -> str:
    """What :func:`assert_segments_aligned` says (the values stay on the device: naming them would sync)."""
    return str(config_error(None, f"cu_seqlens holds a group end that is not a multiple of BLOCK_SIZE_M {block_m}, "
                                  "so a kernel block would hold rows of two weight rows",
                            f"cu_seqlens % {block_m} != 0 (values on the device)",
                            f"pad every group to a multiple of {block_m} (MoonEP's token_padding), or use a "
                            "BLOCK_SIZE_M that divides the token padding"))


def assert_segments_aligned(cu_seqlens: torch.Tensor, block_m: int) -> None:
    """Every group of ``cu_seqlens`` starts on a ``block_m`` boundary, checked without a host sync.

    ``torch._assert_async``: on CUDA the check is a kernel queued on the current stream (a failure is a
    device-side assert at the next sync); on CPU it raises ``RuntimeError`` here; on the meta device it is
    a no-op. Ends that are multiples of ``block_m`` are starts that are (a group starts at the previous end)."""
    torch._assert_async((cu_seqlens.remainder(block_m) == 0).all(), misaligned_message(block_m))


def grouped_blocks(cu_seqlens: torch.Tensor, num_rows: int, block_m: int) -> GroupedBlocks:
    """Block metadata for ``num_rows`` (NvS) rows grouped by ``cu_seqlens`` (``[G]`` int32 inclusive ends);
    refuses (on the device, :func:`assert_segments_aligned`) a group that does not start on a block."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() == 0:
        raise config_error(None, "cu_seqlens must be a non-empty 1-D tensor", tuple(cu_seqlens.shape),
                           "pass dispatch's cu_seqlens [E+B]")
    assert_segments_aligned(cu_seqlens, block_m)
    device = cu_seqlens.device
    blocks = max(1, -(-num_rows // block_m))
    starts = torch.arange(blocks, device=device, dtype=torch.int64) * block_m
    ends = cu_seqlens.to(torch.int64)
    ids = torch.searchsorted(ends, starts, right=True)
    ids = torch.where(starts < ends[-1], ids, torch.full_like(ids, -1)).to(torch.int32)
    return GroupedBlocks(block_m=block_m,
                         sorted_token_ids=torch.arange(blocks * block_m, device=device, dtype=torch.int32),
                         expert_ids=ids,
                         num_tokens_post_padded=cu_seqlens[-1:].to(torch.int32).clone())


def skip_zero_weight_blocks(blocks: GroupedBlocks, route_weights_nvs: torch.Tensor) -> GroupedBlocks:
    """``blocks`` with every block whose rows all carry route weight 0 marked ``-1`` (not computed).

    Such rows are MoonEP's padding: the rows that fill a group to ``token_padding`` and the tokens vLLM adds to
    reach the buffer's static capacity (its prepare pads ``topk_weights`` with zeros). The experts multiply
    each row's activation by its route weight before the down projection, so these rows' outputs are 0
    whether computed or not; the kernels answer a ``-1`` block with zeros. (The tiny CPU engine's decode and
    dummy steps fill all 8 of a rank's groups with 1024 capacity rows: a layer under the Triton interpreter
    took 1.8 s with them, 0.35-0.6 s without.)"""
    n, m = blocks.num_blocks, blocks.block_m
    live = route_weights_nvs.reshape(-1) != 0
    live = torch.nn.functional.pad(live, (0, max(0, n * m - live.numel())))[: n * m].view(n, m).any(dim=1)
    ids = torch.where(live, blocks.expert_ids, torch.full_like(blocks.expert_ids, -1))
    return dataclasses.replace(blocks, expert_ids=ids)


def restrict_to_groups(blocks: GroupedBlocks, cu_seqlens: torch.Tensor, lo: int, hi: int) -> GroupedBlocks:
    """``blocks`` limited to the rows of weight rows ``[lo, hi)`` (the own experts, or the slots), bounded on the
    device: no host read of ``cu_seqlens``.

    ``num_tokens_post_padded`` becomes the part's last row (``cu_seqlens[hi - 1]``), so every block past it exits
    at once; a block before the part's first row (``cu_seqlens[lo - 1]``) gets expert ``-1`` and row ids past
    every row, so vLLM's kernels, which answer a ``-1`` block with zeros at its valid row ids, write nothing
    there either: the other part's rows of a shared output stay as they are."""
    G = cu_seqlens.numel()
    if not 0 <= lo < hi <= G:
        raise config_error(None, f"weight rows [{lo}, {hi}) are not a non-empty part of the {G} groups", (lo, hi),
                           f"pass 0 <= lo < hi <= {G}")
    end = cu_seqlens[hi - 1:hi].to(torch.int32)
    if lo == 0:
        return dataclasses.replace(blocks, num_tokens_post_padded=end)
    n, m = blocks.num_blocks, blocks.block_m
    before = torch.arange(n, device=cu_seqlens.device) * m < cu_seqlens[lo - 1]   # the part's first row
    ids = torch.where(before, torch.full_like(blocks.expert_ids, -1), blocks.expert_ids)
    rows = torch.where(before[:, None].expand(n, m).reshape(-1), torch.full_like(blocks.sorted_token_ids, n * m),
                       blocks.sorted_token_ids)
    return dataclasses.replace(blocks, sorted_token_ids=rows, expert_ids=ids, num_tokens_post_padded=end)


def check_segments_aligned(cu_seqlens: torch.Tensor, block_m: int) -> None:
    """Host-side check (one sync; for tests and tools, which may name the values) that every group starts
    on a block boundary: what MoonEP's padding guarantees when ``BLOCK_SIZE_M`` divides ``token_padding``.
    The library path checks on the device instead (:func:`assert_segments_aligned`)."""
    ends = cu_seqlens.to("cpu", torch.int64)
    bad = [(g, int(e)) for g, e in enumerate(ends.tolist()) if e % block_m]
    if bad:
        raise config_error(None, f"cu_seqlens ends are not multiples of BLOCK_SIZE_M {block_m}", bad[:4],
                           "pad every group to a multiple of BLOCK_SIZE_M (MoonEP's token_padding)")
