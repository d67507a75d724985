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
