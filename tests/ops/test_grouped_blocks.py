"""Per-block weight rows from MoonEP's ``cu_seqlens`` (``ops/grouped_blocks.py``), and the BLOCK_SIZE_M rule."""

from __future__ import annotations

import pytest
import torch

from moonep_ep.errors import ConfigError
from moonep_ep.ops.grouped_blocks import check_block_size, check_segments_aligned, grouped_blocks


def test_blocks_name_their_group_skip_empty_groups_and_stop_at_the_last_row():
    # groups 1 and 3 are empty; 16 stale rows follow cu[-1] = 80
    cu = torch.tensor([16, 16, 48, 48, 64, 80], dtype=torch.int32)
    b = grouped_blocks(cu, 96, 16)
    assert b.expert_ids.tolist() == [0, 2, 2, 4, 5, -1]   # written out by hand from the groups
    assert b.num_tokens_post_padded.tolist() == [80]
    assert b.sorted_token_ids.tolist() == list(range(96))
    # 32-row blocks over groups padded to 32, no tail: every block is computed
    wide = grouped_blocks(torch.tensor([32, 32, 96], dtype=torch.int32), 96, 32)
    assert wide.expert_ids.tolist() == [0, 2, 2] and wide.num_tokens_post_padded.tolist() == [96]


def test_a_block_size_that_does_not_divide_the_token_padding_is_refused_naming_both():
    check_block_size(16, 128)
    with pytest.raises(ConfigError, match="BLOCK_SIZE_M 64 does not divide MoonEP's token_padding 96") as e:
        check_block_size(64, 96)
    assert "Fix:" in str(e.value)
    with pytest.raises(ConfigError, match="power of two >= 16"):
        check_block_size(8, 128)
    with pytest.raises(ConfigError, match="not multiples of BLOCK_SIZE_M 16"):
        check_segments_aligned(torch.tensor([16, 24], dtype=torch.int32), 16)


def test_the_gpu_experts_refuse_the_block_size_before_any_kernel():
    from moonep_ep.vllm.gpu_experts import gpu_grouped_ffn

    with pytest.raises(ConfigError, match="BLOCK_SIZE_M 16 does not divide MoonEP's token_padding 24"):
        gpu_grouped_ffn("mxfp4", torch.zeros(48, 64, dtype=torch.bfloat16), {}, torch.tensor([48], dtype=torch.int32),
                        None, token_padding=24)


def test_blocks_of_zero_route_weight_rows_are_skipped_and_the_rest_kept():
    """MoonEP's padding rows carry route weight 0 (vLLM pads ``topk_weights`` with zeros): a block of only such
    rows is marked -1; one nonzero row keeps its block (the control), and the original metadata is untouched."""
    import torch

    from moonep_ep.ops.grouped_blocks import grouped_blocks, skip_zero_weight_blocks

    cu = torch.tensor([32, 32, 64, 96], dtype=torch.int32)       # groups: 2 blocks, empty, 2 blocks, 2 blocks
    blocks = grouped_blocks(cu, 112, 16)                         # 7 blocks: 6 in groups, 1 past the end
    assert blocks.expert_ids.tolist() == [0, 0, 2, 2, 3, 3, -1]
    w = torch.zeros(112)
    w[3] = 0.5                                                   # block 0: one real row
    w[40] = 1e-30                                                # block 2: tiny but nonzero is live
    w[80:96] = 0.25                                              # block 5: all real
    w[100] = 0.7                                                 # past cu_seqlens[-1]: stays -1 anyway
    skipped = skip_zero_weight_blocks(blocks, w)
    assert skipped.expert_ids.tolist() == [0, -1, 2, -1, -1, 3, -1]
    assert blocks.expert_ids.tolist() == [0, 0, 2, 2, 3, 3, -1]
    assert torch.equal(skipped.sorted_token_ids, blocks.sorted_token_ids)
    # NvS not a multiple of BLOCK_SIZE_M: the weights are padded with zeros to whole blocks
    odd = skip_zero_weight_blocks(grouped_blocks(cu, 100, 16), torch.ones(100))
    assert odd.expert_ids.tolist() == [0, 0, 2, 2, 3, 3, -1]
