"""Per-block weight rows from MoonEP's ``cu_seqlens`` (``ops/experts/grouped_blocks.py``), and the BLOCK_SIZE_M rule."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from moonep_ep.errors import ConfigError
from moonep_ep.ops.experts.grouped_blocks import check_block_size, check_segments_aligned, grouped_blocks


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
    from moonep_ep.vllm.experts.gpu import gpu_grouped_ffn

    with pytest.raises(ConfigError, match="BLOCK_SIZE_M 16 does not divide MoonEP's token_padding 24"):
        gpu_grouped_ffn("mxfp4", torch.zeros(48, 64, dtype=torch.bfloat16), {}, torch.tensor([48], dtype=torch.int32),
                        None, token_padding=24)


def test_blocks_of_zero_route_weight_rows_are_skipped_and_the_rest_kept():
    """MoonEP's padding rows carry route weight 0 (vLLM pads ``topk_weights`` with zeros): a block of only such
    rows is marked -1; one nonzero row keeps its block (the control), and the original metadata is untouched."""
    import torch

    from moonep_ep.ops.experts.grouped_blocks import grouped_blocks, skip_zero_weight_blocks

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


class _HostReads(TorchFunctionMode):
    """Counts the tensor calls that read values to the host (``item``, ``tolist``, ``bool(t)``, ``.cpu()``, ...)."""

    NAMES = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__index__", "__float__"}

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        to_cpu = name == "to" and any(str(a) == "cpu" for a in (*args[1:], *kwargs.values()))
        if name in self.NAMES or to_cpu:
            self.calls.append(name)
        return func(*args, **kwargs)


def test_a_misaligned_group_is_refused_in_the_library_path_without_a_host_read():
    """Groups [0, 16), [16, 24), [24, 48): the third starts at row 24, inside a 16-row block, so that block would
    be computed with group 1's weights for group 2's rows. ``grouped_blocks`` (what the GPU experts build their
    launch from) refuses it with a device-side assert: on CPU it raises at once."""
    from moonep_ep.vllm.experts.gpu import gpu_grouped_ffn

    misaligned = torch.tensor([16, 24, 48], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="not a multiple of BLOCK_SIZE_M 16.*Fix: pad every group to a multiple "
                                           "of 16") as e:
        grouped_blocks(misaligned, 48, 16)
    assert not isinstance(e.value, ConfigError)  # torch's device-assert error, not the host-side check's
    hidden = torch.zeros(48, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="not a multiple of BLOCK_SIZE_M 16"):
        gpu_grouped_ffn("mxfp4", hidden, {}, misaligned, None, token_padding=16)
    # block metadata passed in (a test's corrupted copy) does not skip the check on cu_seqlens
    with pytest.raises(RuntimeError, match="not a multiple of BLOCK_SIZE_M 16"):
        gpu_grouped_ffn("mxfp4", hidden, {}, misaligned, None, token_padding=16,
                        blocks=grouped_blocks(torch.tensor([16, 32, 48], dtype=torch.int32), 48, 16))
    # the control: the same ends moved to block boundaries pass (empty groups included)
    assert grouped_blocks(torch.tensor([16, 16, 48], dtype=torch.int32), 48, 16).expert_ids.tolist() == [0, 2, 2]
    # no host read on the way: none of the value-reading calls, where the host-side check makes two
    with _HostReads() as reads:
        grouped_blocks(torch.tensor([16, 16, 48, 48, 64, 80], dtype=torch.int32), 96, 16)
    assert reads.calls == []
    with _HostReads() as reads:
        check_segments_aligned(torch.tensor([16, 16, 48], dtype=torch.int32), 16)
    assert reads.calls == ["to", "tolist"]
    # and on the meta device, whose tensors hold no values (any read raises), the metadata and the check run
    meta = torch.empty(6, dtype=torch.int32, device="meta")
    blocks = grouped_blocks(meta, 96, 16)
    assert blocks.expert_ids.device.type == "meta" and blocks.num_blocks == 6
    with pytest.raises(NotImplementedError, match="meta tensor"):
        check_segments_aligned(meta, 16)


# -- the exact texts and edges (what mutation testing of ops/experts/grouped_blocks.py asks for) ----------------------------

def _refusal(call) -> str:
    with pytest.raises(ConfigError) as e:
        call()
    return str(e.value)


def test_every_refusal_of_the_block_rules_is_written_out_whole():
    """Typed from the wording the module means to print (rank, value and fix), not read from it."""
    assert _refusal(lambda: check_block_size(24, 96, rank=3)) == (
        "[rank 3] BLOCK_SIZE_M must be a power of two >= 16 (tl.dot's smallest tile): got 24. Fix: use 16, 32, 64 "
        "or 128")
    assert _refusal(lambda: check_block_size(64, 96, rank=5)) == (
        "[rank 5] BLOCK_SIZE_M 64 does not divide MoonEP's token_padding 96: a kernel block would hold rows of two "
        "experts: got (64, 96). Fix: use a BLOCK_SIZE_M that divides 96, or a token_padding that is a multiple of 64")
    bad = torch.tensor([8, 16, 24, 40, 56, 72, 80], dtype=torch.int32)   # ends 0, 2, 3, 4, 5 are off a 16-row block
    assert _refusal(lambda: check_segments_aligned(bad, 16)) == (
        "cu_seqlens ends are not multiples of BLOCK_SIZE_M 16: got [(0, 8), (2, 24), (3, 40), (4, 56)]. Fix: pad "
        "every group to a multiple of BLOCK_SIZE_M (MoonEP's token_padding)")
    two_d = torch.tensor([[16, 32]], dtype=torch.int32)
    assert _refusal(lambda: grouped_blocks(two_d, 32, 16)) == (
        "cu_seqlens must be a non-empty 1-D tensor: got (1, 2). Fix: pass dispatch's cu_seqlens [E+B]")
    assert _refusal(lambda: grouped_blocks(torch.zeros(0, dtype=torch.int32), 32, 16)) == (
        "cu_seqlens must be a non-empty 1-D tensor: got (0,). Fix: pass dispatch's cu_seqlens [E+B]")
    from moonep_ep.ops.experts.grouped_blocks import misaligned_message

    assert misaligned_message(32) == (
        "cu_seqlens holds a group end that is not a multiple of BLOCK_SIZE_M 32, so a kernel block would hold rows "
        "of two weight rows: got 'cu_seqlens % 32 != 0 (values on the device)'. Fix: pad every group to a multiple "
        "of 32 (MoonEP's token_padding), or use a BLOCK_SIZE_M that divides the token padding")


def test_a_token_padding_that_is_not_a_positive_int_is_refused_even_when_the_remainder_is_zero():
    # 0 % 16 == 0 and 128.0 % 16 == 0.0: only the type and sign rules refuse these
    for padding in (0, -32, 128.0):
        assert "does not divide MoonEP's token_padding" in _refusal(lambda: check_block_size(16, padding))
    check_block_size(16, 16)   # the control: the smallest padding a 16-row block divides
    check_block_size(128, 128)


def test_one_group_of_one_block_is_one_block_and_the_metadata_is_int32_on_the_input_device():
    one = grouped_blocks(torch.tensor([16], dtype=torch.int64), 16, 16)   # int64 ends in: int32 metadata out
    assert one.num_blocks == 1 and one.expert_ids.tolist() == [0] and one.sorted_token_ids.tolist() == list(range(16))
    assert (one.expert_ids.dtype, one.sorted_token_ids.dtype, one.num_tokens_post_padded.dtype) == (torch.int32,) * 3
    assert one.num_tokens_post_padded.tolist() == [16]
    # no rows at all: still one block, not computed (the kernels need a grid of at least one program)
    empty = grouped_blocks(torch.tensor([0, 0], dtype=torch.int32), 0, 16)
    assert empty.expert_ids.tolist() == [-1] and empty.num_tokens_post_padded.tolist() == [0]
    meta = grouped_blocks(torch.empty(3, dtype=torch.int32, device="meta"), 40, 16)
    made = (meta.expert_ids, meta.sorted_token_ids, meta.num_tokens_post_padded)
    assert [t.device.type for t in made] == ["meta"] * 3
    assert tuple(meta.sorted_token_ids.shape) == (48,)   # 3 blocks of 16 rows for 40 rows


def test_a_live_row_at_a_block_edge_keeps_its_own_block_only():
    from moonep_ep.ops.experts.grouped_blocks import skip_zero_weight_blocks

    blocks = grouped_blocks(torch.tensor([64], dtype=torch.int32), 64, 16)   # one group, 4 blocks
    w = torch.zeros(64)
    w[15] = 1.0    # the last row of block 0
    w[48] = 1.0    # the first row of block 3
    assert skip_zero_weight_blocks(blocks, w).expert_ids.tolist() == [0, -1, -1, 0]


# -- a launch limited to the own groups or the slots (the BF16 experts' parts on a GPU) -----------------------------

def test_a_part_keeps_its_groups_blocks_and_marks_every_other_block_as_writing_nothing():
    from moonep_ep.ops.experts.grouped_blocks import restrict_to_groups

    # own groups 0-3 end at row 64, slots 4-5 at 80; 16 stale rows follow
    cu = torch.tensor([16, 16, 48, 64, 64, 80], dtype=torch.int32)
    b = grouped_blocks(cu, 96, 16)
    own = restrict_to_groups(b, cu, 0, 4)
    assert own.num_tokens_post_padded.tolist() == [64]        # the slot block (row 64) exits at once
    assert own.expert_ids.tolist() == b.expert_ids.tolist() and own.sorted_token_ids is b.sorted_token_ids
    slots = restrict_to_groups(b, cu, 4, 6)
    assert slots.num_tokens_post_padded.tolist() == [80]
    assert slots.expert_ids.tolist() == [-1, -1, -1, -1, 5, -1]   # written out by hand: only row 64's block
    # the own blocks' row ids lie past every row (96 = 6 blocks x 16): vLLM's zero write for a -1 block is masked
    assert slots.sorted_token_ids.tolist() == [96] * 64 + list(range(64, 96))
    # the control: the whole range is the blocks as they were, and the parts' computed blocks make up the whole
    whole = restrict_to_groups(b, cu, 0, 6)
    assert whole.expert_ids.tolist() == b.expert_ids.tolist() and whole.num_tokens_post_padded.tolist() == [80]
    starts = torch.arange(6) * 16

    def computed(p):
        return set((starts[(p.expert_ids >= 0) & (starts < p.num_tokens_post_padded)] // 16).tolist())

    assert computed(own) | computed(slots) == computed(b) and not computed(own) & computed(slots)
    # an empty part (slots without rows) computes nothing
    none = restrict_to_groups(b, torch.tensor([16, 16, 48, 64, 64, 64], dtype=torch.int32), 4, 6)
    assert none.num_tokens_post_padded.tolist() == [64] and (none.expert_ids[:4] == -1).all()


def test_a_part_is_bounded_on_the_device_and_an_empty_range_is_refused_naming_it():
    from moonep_ep.ops.experts.grouped_blocks import restrict_to_groups

    cu = torch.tensor([16, 16, 48, 64, 64, 80], dtype=torch.int32)
    b = grouped_blocks(cu, 96, 16)
    with _HostReads() as reads:
        restrict_to_groups(b, cu, 4, 6)
        restrict_to_groups(b, cu, 0, 4)
    assert reads.calls == []
    meta = torch.empty(6, dtype=torch.int32, device="meta")
    assert restrict_to_groups(grouped_blocks(meta, 96, 16), meta, 4, 6).expert_ids.device.type == "meta"
    wide = restrict_to_groups(b, cu.to(torch.int64), 0, 4)        # the kernels read an int32 row count
    assert wide.num_tokens_post_padded.dtype == torch.int32 and wide.num_tokens_post_padded.tolist() == [64]
    assert _refusal(lambda: restrict_to_groups(b, cu, 4, 4)) == (
        "weight rows [4, 4) are not a non-empty part of the 6 groups: got (4, 4). Fix: pass 0 <= lo < hi <= 6")
    assert "[0, 7)" in _refusal(lambda: restrict_to_groups(b, cu, 0, 7))
