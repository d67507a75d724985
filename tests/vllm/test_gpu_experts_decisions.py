"""The GPU experts' decisions in this process (``vllm/experts/gpu.py``): block sizes, the kernel each format
gets and what it is handed, the FFN around the two grouped GEMMs.

The kernels run for real in the vLLM environment under Triton's interpreter
(``test_gpu_experts.py``, ``test_gpu_experts_mxfp4.py``), a subprocess where
mutation testing cannot see which function ran. Here vLLM's entry points are
stand-ins with vLLM 0.33.0's signatures (``fused_moe.py``:
``invoke_fused_moe_wna16_triton_kernel``, ``invoke_fused_moe_triton_kernel``,
``try_get_optimal_moe_config``; ``fp8_utils.per_token_group_quant_fp8``;
``input_quant_fp8.QuantFP8._quantize_group_native``) that record their
arguments (``tests/support/vllm_stubs.py``), and the MXFP4 kernel's launch is
computed in torch from the launch arguments (:class:`TorchMxfp4Launch`, the
E2M1 codes decoded from their bit fields), so the FFN's result is checked
against a float64 reference built per group here.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from moonep_ep.errors import ConfigError
from moonep_ep.ops.experts import mxfp4_kernel as mk
from moonep_ep.ops.experts.grouped_blocks import grouped_blocks
from moonep_ep.vllm.experts import gpu as ge
from moonep_ep.vllm.experts.gpu import (fit_block_m, gpu_grouped_ffn, gpu_grouped_gemm, int4_kernel_view,
                                        kernel_config, kernel_views, quantize_activations_fp8)
from tests.support.mxfp4_kernel_check import e2m1_values
from tests.support.vllm_stubs import install

FUSED = "vllm.model_executor.layers.fused_moe"
TL = types.SimpleNamespace(bfloat16="tl.bfloat16", float16="tl.float16")


def _refusal(call) -> str:
    with pytest.raises(ConfigError) as e:
        call()
    return str(e.value)


# -- block sizes -----------------------------------------------------------------------------------------------

def test_fit_block_m_takes_the_largest_power_of_two_at_most_the_ask_that_divides_the_padding():
    assert fit_block_m(64, 128) == 64
    assert fit_block_m(64, 96) == 32          # 96 = 3 x 32
    assert fit_block_m(128, 48) == 16         # 48 = 3 x 16
    assert fit_block_m(100, 128) == 64        # not a power of two: its largest power of two below, 64
    assert fit_block_m(8, 128) == 16          # vLLM's M 8 for tiny steps: tl.dot's least, 16
    assert fit_block_m(16, 16) == 16
    # nothing from the ask down to 16 divides the padding: the ask itself, for check_block_size to refuse
    assert fit_block_m(64, 24) == 64 and fit_block_m(16, 8) == 16 and fit_block_m(7, 24) == 7
    assert type(fit_block_m(64.0, 24)) is int and type(fit_block_m(64, 96)) is int


@pytest.fixture
def lookup(monkeypatch):
    """vLLM's ``try_get_optimal_moe_config``, recorded; it answers a tuned entry with BLOCK_SIZE_M 64."""
    tuned = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 32, "num_warps": 4,
             "num_stages": 3}
    calls = []

    def try_get_optimal_moe_config(w1_shape, w2_shape, top_k, dtype, M, block_shape=None):
        calls.append((w1_shape, w2_shape, top_k, dtype, M, block_shape))
        return tuned

    install(monkeypatch, {f"{FUSED}.fused_moe": {"try_get_optimal_moe_config": try_get_optimal_moe_config}})
    return calls, tuned


def test_kernel_config_asks_vllm_with_the_local_experts_and_real_tokens_and_fits_block_m(lookup):
    calls, tuned = lookup
    shapes = dict(local_experts=32, hidden=7168, intermediate=2048, top_k=8, interpreter=False)
    fp8 = kernel_config("fp8-block", tokens=32, token_padding=128, **shapes)
    assert fp8 == {**tuned, "BLOCK_SIZE_M": 64}
    int4 = kernel_config("int4-g32", tokens=4096, token_padding=96, **shapes)
    assert int4 == {**tuned, "BLOCK_SIZE_M": 32}                       # 64 does not divide 96: 32
    mxfp4 = kernel_config("mxfp4", tokens=0, token_padding=16, **shapes)
    assert mxfp4["BLOCK_SIZE_M"] == 16
    # w1 (E_local, 2I, H), w2 (E_local, H, I): INT4's w2 is two codes a byte (vLLM doubles its last dim back)
    assert calls == [((32, 4096, 7168), (32, 7168, 2048), 8, "fp8_w8a8", 32, [128, 128]),
                     ((32, 4096, 7168), (32, 7168, 1024), 8, "int4_w4a16", 4096, [0, 32]),
                     ((32, 4096, 7168), (32, 7168, 2048), 8, None, 1, None)]   # an empty step asks for M 1
    # ints: vLLM names the tuned file after them ("N=2048"; a float would name no file)
    assert all(type(v) is int for call in calls for v in (*call[0], *call[1], call[4]))
    assert tuned["BLOCK_SIZE_M"] == 64                                 # vLLM's dict is not changed in place


def test_under_the_interpreter_the_engine_config_is_used_with_block_m_fitted_and_vllm_not_asked(lookup):
    calls, _ = lookup
    args = dict(local_experts=8, hidden=256, intermediate=64, tokens=5, top_k=2, interpreter=True)
    assert kernel_config("fp8-block", token_padding=64, **args) == {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 512,
                                                                    "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1}
    assert kernel_config("mxfp4", token_padding=256, **args)["BLOCK_SIZE_M"] == 128
    assert ge.ENGINE_INTERPRETER_CONFIG["BLOCK_SIZE_M"] == 128 and calls == []


# -- the formats' views ----------------------------------------------------------------------------------------

def test_the_int4_view_is_the_words_little_endian_bytes_and_other_formats_pass_unchanged(monkeypatch):
    words = torch.tensor([[0x76543210, -0x01234568]], dtype=torch.int32)  # -0x01234568 = 0xFEDCBA98
    assert int4_kernel_view(words).tolist() == [[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]]
    assert int4_kernel_view(words).data_ptr() == words.data_ptr()        # a view: no bytes moved
    assert _refusal(lambda: int4_kernel_view(words.to(torch.int64))) == (
        "INT4 weight_packed must be int32 (compressed-tensors pack-quantized): got torch.int64. Fix: pass the "
        "store's weight_packed view")
    int4 = {"w13_weight_packed": torch.zeros(3, 8, 2, dtype=torch.int32), "w13_weight_scale": torch.ones(3, 8, 1),
            "w2_weight_packed": torch.zeros(3, 4, 1, dtype=torch.int32), "w2_weight_scale": torch.ones(3, 4, 1)}
    w13, s13, w2, s2 = kernel_views("int4-g32", int4)
    assert (w13.dtype, tuple(w13.shape), tuple(w2.shape)) == (torch.uint8, (3, 8, 8), (3, 4, 4))
    assert s13 is int4["w13_weight_scale"] and s2 is int4["w2_weight_scale"]
    mx = {"w13_weight_packed": torch.zeros(3, 8, 16, dtype=torch.uint8), "w13_weight_scale": torch.ones(3, 8, 1),
          "w2_weight_packed": torch.zeros(3, 4, 8, dtype=torch.uint8), "w2_weight_scale": torch.ones(3, 4, 1)}
    assert all(a is b for a, b in zip(kernel_views("mxfp4", mx), mx.values()))
    # the split layouts (push; BF16): gate and down rows, their scales for a quantized format, none for BF16
    split = {"gate": torch.zeros(3, 4, 16, dtype=torch.uint8), "gate_scale": torch.ones(3, 4, 1),
             "up": torch.zeros(3, 4, 16, dtype=torch.uint8), "up_scale": torch.ones(3, 4, 1),
             "down": torch.zeros(3, 8, 8, dtype=torch.uint8), "down_scale": torch.ones(3, 8, 1)}
    got = kernel_views("mxfp4", split)
    assert all(a is split[n] for a, n in zip(got, ("gate", "gate_scale", "down", "down_scale")))
    bf16 = {n: split[n].to(torch.bfloat16) for n in ("gate", "up", "down")}
    assert [t if t is None else t.data_ptr() for t in kernel_views("bf16", bf16)] == [
        bf16["gate"].data_ptr(), None, bf16["down"].data_ptr(), None]
    with pytest.raises(KeyError, match="gate_scale"):   # the control: a quantized split layout without its scales
        kernel_views("mxfp4", bf16)
    monkeypatch.setattr(sys, "byteorder", "big")
    assert _refusal(lambda: int4_kernel_view(words)) == (
        "the INT4 kernel view needs a little-endian host: got 'big'. Fix: convert the words with a byte swap first")


# -- what each format's kernel is handed -----------------------------------------------------------------------

@pytest.fixture
def kernels(monkeypatch):
    """vLLM's two Triton MoE launchers and FP8 activation quantizers (0.33.0 signatures), recorded; each
    launcher fills its output with a marker (3 for INT4, 5 for FP8) so the returned tensor shows it is C."""
    seen: dict[str, list] = {"wna16": [], "fp8": [], "quant": [], "native": []}

    def invoke_fused_moe_wna16_triton_kernel(A, B, C, B_scale, B_zp, topk_weights, sorted_token_ids, expert_ids,
                                             num_tokens_post_padded, mul_routed_weight, top_k, config,
                                             compute_type, use_int8_w8a16, use_int4_w4a16, block_shape):
        seen["wna16"].append(dict(locals()))
        C.fill_(3)

    def invoke_fused_moe_triton_kernel(A, B, C, A_scale, B_scale, topk_weights, sorted_token_ids, expert_ids,
                                       num_tokens_post_padded, mul_routed_weight, top_k, config, compute_type,
                                       use_fp8_w8a8, use_int8_w8a8, use_int8_w8a16, use_int4_w4a16,
                                       per_channel_quant, block_shape=None, B_bias=None):
        seen["fp8"].append(dict(locals()))
        C.fill_(5)

    def per_token_group_quant_fp8(x, group_size, eps=1e-10, dtype=None, column_major_scales=False,
                                  out_q=None, use_ue8m0=None):
        seen["quant"].append((x, group_size, use_ue8m0))
        return x.to(torch.float8_e4m3fn), torch.ones(x.shape[0], x.shape[1] // group_size)

    class QuantFP8:
        def _quantize_group_native(self, x):
            seen["native"].append((x, self.group_size, self.use_ue8m0, self.column_major_scales))
            return x.to(torch.float8_e4m3fn), torch.full((x.shape[0], x.shape[1] // self.group_size), 2.0)

    fused = types.ModuleType(f"{FUSED}.fused_moe")
    fused.invoke_fused_moe_wna16_triton_kernel = invoke_fused_moe_wna16_triton_kernel
    fused.invoke_fused_moe_triton_kernel = invoke_fused_moe_triton_kernel
    install(monkeypatch, {FUSED: {"fused_moe": fused}, "vllm.triton_utils": {"tl": TL},
                          "vllm.model_executor.layers.quantization.utils.fp8_utils":
                              {"per_token_group_quant_fp8": per_token_group_quant_fp8},
                          "vllm.model_executor.layers.quantization.input_quant_fp8": {"QuantFP8": QuantFP8}})
    return seen


def test_int4_gets_vllms_wna16_kernel_with_the_block_metadata_and_the_config_plus_split_k(kernels):
    a = torch.randn(32, 64).to(torch.bfloat16)
    weight, scale = torch.zeros(2, 48, 32, dtype=torch.uint8), torch.ones(2, 48, 2, dtype=torch.bfloat16)
    blocks = grouped_blocks(torch.tensor([16, 32], dtype=torch.int32), 32, 16)
    out = gpu_grouped_gemm("int4-g32", a, weight, scale, blocks, {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 32,
                                                                  "num_warps": 8})
    (call,) = kernels["wna16"]
    assert call["A"] is a and call["B"] is weight and call["B_scale"] is scale and call["B_zp"] is None
    assert call["C"].shape == (32, 1, 48) and call["C"].data_ptr() == out.data_ptr()
    assert call["topk_weights"] is None and call["sorted_token_ids"] is blocks.sorted_token_ids
    assert call["expert_ids"] is blocks.expert_ids and call["num_tokens_post_padded"] is blocks.num_tokens_post_padded
    assert (call["mul_routed_weight"], call["top_k"], call["compute_type"]) == (False, 1, "tl.bfloat16")
    assert (call["use_int8_w8a16"], call["use_int4_w4a16"], call["block_shape"]) == (False, True, [0, 32])
    # the metadata's block rows win over the config's; GROUP_SIZE_M 1 when the config has none
    assert call["config"] == {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "num_warps": 8, "GROUP_SIZE_M": 1,
                              "SPLIT_K": 1}
    assert out.dtype == torch.bfloat16 and out.shape == (32, 48) and bool((out == 3).all())


def test_fp8_block_quantizes_activations_per_128_and_gets_vllms_fp8_kernel(kernels):
    a = torch.randn(16, 256).to(torch.float16)
    weight = torch.zeros(3, 64, 256, dtype=torch.float8_e4m3fn)
    scale = torch.ones(3, 1, 2)
    blocks = grouped_blocks(torch.tensor([16, 16, 16], dtype=torch.int32), 16, 16)
    out = gpu_grouped_gemm("fp8-block", a, weight, scale, blocks, {"BLOCK_SIZE_M": 16, "GROUP_SIZE_M": 4})
    (q,) = kernels["quant"]
    assert q[0] is a and q[1:] == (128, False) and kernels["native"] == []
    (call,) = kernels["fp8"]
    assert call["A"].dtype == torch.float8_e4m3fn and call["A_scale"].shape == (16, 2)
    assert call["B"] is weight and call["B_scale"] is scale and call["C"].data_ptr() == out.data_ptr()
    assert call["C"].shape == (16, 1, 64)                              # [M, top_k 1, N], as vLLM's kernel reads C
    assert (call["use_fp8_w8a8"], call["use_int8_w8a8"], call["use_int8_w8a16"], call["use_int4_w4a16"],
            call["per_channel_quant"], call["block_shape"]) == (True, False, False, False, False, [128, 128])
    assert call["config"] == {"BLOCK_SIZE_M": 16, "GROUP_SIZE_M": 4} and call["compute_type"] == "tl.float16"
    assert call["topk_weights"] is None and call["mul_routed_weight"] is False and call["top_k"] == 1
    assert call["expert_ids"] is blocks.expert_ids and call["sorted_token_ids"] is blocks.sorted_token_ids
    assert out.dtype == torch.float16 and bool((out == 5).all())
    # vLLM's torch path of the same quantization on request (the CPU engine's interpreter runs)
    gpu_grouped_gemm("fp8-block", a, weight, scale, blocks, {"BLOCK_SIZE_M": 16}, native_act_quant=True)
    (n,) = kernels["native"]
    assert n[0] is a and n[1:] == (128, False, False) and len(kernels["quant"]) == 1
    assert bool((kernels["fp8"][1]["A_scale"] == 2.0).all())


def test_activations_of_another_dtype_and_a_format_without_a_kernel_are_refused(kernels):
    blocks = grouped_blocks(torch.tensor([16], dtype=torch.int32), 16, 16)
    weight = torch.zeros(1, 8, 8, dtype=torch.uint8)
    assert _refusal(lambda: gpu_grouped_gemm("int4-g32", torch.zeros(16, 16), weight, weight, blocks, {})) == (
        "activations must be bf16 or fp16: got torch.float32. Fix: pass MoonEP's bf16 hidden_nvsh")
    a = torch.zeros(16, 16, dtype=torch.bfloat16)
    assert _refusal(lambda: gpu_grouped_gemm("nvfp4", a, weight, weight, blocks, {})) == (
        "no GPU grouped kernel for this format: got 'nvfp4'. Fix: use int4-g32, fp8-block, mxfp4 or bf16")
    assert kernels["wna16"] == kernels["fp8"] == []


def test_bf16_hands_vllms_fused_moe_kernel_its_unquantized_form_and_writes_in_place(kernels):
    """The BF16 experts on CUDA (``bf16_gpu.py``): vLLM's ``fused_moe_kernel`` with no scales and every
    quantization flag off, the block metadata as built, one row per token, the caller's output as ``C``."""
    cu = torch.tensor([16, 16, 32], dtype=torch.int32)
    blocks = grouped_blocks(cu, 48, 16)
    a = torch.zeros(48, 64, dtype=torch.bfloat16)
    weight = torch.zeros(3, 32, 64, dtype=torch.bfloat16)
    out = torch.empty(48, 32, dtype=torch.bfloat16)
    got = gpu_grouped_gemm("bf16", a, weight, None, blocks, {"BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64})
    mine = gpu_grouped_gemm("bf16", a, weight, None, blocks, {"BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64}, out=out)
    assert mine is out and bool((out == 5).all()) and bool((got == 5).all())
    call = kernels["fp8"][0]
    assert call["A"] is a and call["B"] is weight and call["A_scale"] is None and call["B_scale"] is None
    assert all(call[f] is False for f in ("use_fp8_w8a8", "use_int8_w8a8", "use_int8_w8a16", "use_int4_w4a16",
                                          "per_channel_quant", "mul_routed_weight"))
    assert call["block_shape"] is None and call["top_k"] == 1 and call["compute_type"] == "tl.bfloat16"
    assert call["expert_ids"] is blocks.expert_ids and call["sorted_token_ids"] is blocks.sorted_token_ids
    assert call["config"]["BLOCK_SIZE_M"] == 16 and tuple(call["C"].shape) == (48, 1, 32)
    assert kernels["wna16"] == [] and kernels["quant"] == []


@pytest.mark.parametrize("fmt", ["int4-g32", "fp8-block"])
def test_a_split_layout_runs_gate_and_up_apart_each_with_its_own_weights_and_scales(kernels, fmt, monkeypatch):
    """The push layout (gate, up, down apart): three launches, each given its projection's rows and scales (INT4
    as the kernel's byte view), FP8's activations quantized by the path asked for in each."""
    monkeypatch.setattr(ge.gk, "use_triton", lambda t: False)   # the eager activation between the GEMMs
    G, H, I = 2, 128, 128
    if fmt == "int4-g32":
        w = lambda n, k: torch.zeros(G, n, k // 8, dtype=torch.int32)  # noqa: E731
        s = lambda n, k: torch.ones(G, n, k // 32, dtype=torch.bfloat16)  # noqa: E731
    else:
        w = lambda n, k: torch.zeros(G, n, k, dtype=torch.float8_e4m3fn)  # noqa: E731
        s = lambda n, k: torch.ones(G, n // 128, k // 128)  # noqa: E731
    views = {"gate": w(I, H), "gate_scale": s(I, H), "up": w(I, H), "up_scale": s(I, H), "down": w(H, I),
             "down_scale": s(H, I)}
    cu = torch.tensor([16, 32], dtype=torch.int32)
    gpu_grouped_ffn(fmt, torch.zeros(32, H, dtype=torch.bfloat16), views, cu, torch.ones(32), token_padding=16,
                    native_act_quant=True)
    calls = kernels["wna16" if fmt == "int4-g32" else "fp8"]
    assert [(c["B"].data_ptr(), c["B"].dtype, c["B_scale"]) for c in calls] == [
        (views[p].data_ptr(), torch.uint8 if fmt == "int4-g32" else torch.float8_e4m3fn, views[f"{p}_scale"])
        for p in ("gate", "up", "down")]
    assert kernels["quant"] == [] and len(kernels["native"]) == (3 if fmt == "fp8-block" else 0)


def test_bf16_own_then_slots_write_their_groups_rows_only_and_equal_one_pass(monkeypatch):
    """The BF16 experts' parts on a GPU (``restrict_to_groups``), vLLM's ``fused_moe_kernel`` computed in torch
    (each block below ``num_tokens_post_padded`` times its weight row; a ``-1`` block zeros at its valid row
    ids): the own part, then the slot part into the same output equal one pass and a float64 reference; the tail
    keeps its sentinel. Control: a slot part whose own blocks kept their row ids zeroes the own rows."""
    import dataclasses

    from moonep_ep.ops.experts.grouped_blocks import restrict_to_groups

    def invoke_fused_moe_triton_kernel(A, B, C, A_scale, B_scale, topk_weights, sorted_token_ids, expert_ids,
                                       num_tokens_post_padded, mul_routed_weight, top_k, config, compute_type,
                                       use_fp8_w8a8, use_int8_w8a8, use_int8_w8a16, use_int4_w4a16,
                                       per_channel_quant, block_shape=None, B_bias=None):
        m, c = config["BLOCK_SIZE_M"], C.view(C.shape[0], -1)
        for b in range(expert_ids.numel()):
            ids = sorted_token_ids[b * m:(b + 1) * m].long()
            ids = ids[ids < A.shape[0]]
            if b * m < int(num_tokens_post_padded):
                e = int(expert_ids[b])
                c[ids] = 0 if e < 0 else (A[ids].double() @ B[e].double().T).to(C.dtype)

    install(monkeypatch, {FUSED: {"fused_moe": types.SimpleNamespace(
        invoke_fused_moe_triton_kernel=invoke_fused_moe_triton_kernel)}, "vllm.triton_utils": {"tl": TL}})
    monkeypatch.setattr(ge.gk, "use_triton", lambda t: False)
    gen = torch.Generator().manual_seed(3)
    H, I, G = 64, 32, 4                                          # own groups 0-2, slot 3
    cu = torch.tensor([16, 16, 48, 64], dtype=torch.int32)       # 16 stale rows follow
    hidden = torch.randn(80, H, generator=gen).to(torch.bfloat16)
    route = torch.rand(80, generator=gen)
    views = {p: (torch.randn(G, *shape, generator=gen) / shape[1] ** 0.5).to(torch.bfloat16)
             for p, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I)))}
    blocks = grouped_blocks(cu, 80, 16)
    cfg = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64}
    run = lambda b, out: gpu_grouped_ffn("bf16", hidden, views, cu, route, token_padding=16, config=cfg,  # noqa: E731
                                         blocks=b, out=out)
    one = run(blocks, torch.full((80, H), 7.0, dtype=torch.bfloat16))
    parts = torch.full((80, H), 7.0, dtype=torch.bfloat16)
    run(restrict_to_groups(blocks, cu, 0, 3), parts)
    assert bool((parts[48:] == 7).all()) and not bool((parts[:48] == 7).any())   # own rows only
    run(restrict_to_groups(blocks, cu, 3, 4), parts)
    assert torch.equal(parts, one) and bool((one[64:] == 7).all())
    ref = torch.empty(64, H, dtype=torch.float64)
    for g, (lo, hi) in enumerate(((0, 16), (16, 16), (16, 48), (48, 64))):
        x = hidden[lo:hi].double()
        act = torch.nn.functional.silu(x @ views["gate"][g].double().T) * (x @ views["up"][g].double().T)
        ref[lo:hi] = (act * route[lo:hi, None].double()) @ views["down"][g].double().T
    assert float((one[:64].double() - ref).abs().max() / ref.abs().max()) < 2e-2
    slots = restrict_to_groups(blocks, cu, 3, 4)
    unmasked = dataclasses.replace(slots, sorted_token_ids=blocks.sorted_token_ids)
    control = parts.clone()
    run(unmasked, control)
    assert bool((control[:48] == 0).all()) and torch.equal(control[48:], parts[48:])


# -- the FFN around the two GEMMs, MXFP4's launch computed in torch --------------------------------------------

class TorchMxfp4Launch:
    """``mxfp4_grouped_gemm_kernel[grid](...)`` computed in torch from its launch arguments: program ``pid_m``
    writes rows ``[pid_m * BLOCK_M, +BLOCK_M)`` (below M) with weight row ``expert_ids[pid_m]``, zeros where that
    is -1, nothing where the block starts at or past ``num_tokens_post_padded``; float64 sums rounded once to the
    output dtype.
    Weights decoded from the E2M1 bit fields (``e2m1_values``) times ``2^(x - 127)``."""

    def __init__(self) -> None:
        self.launches: list[dict] = []

    def __getitem__(self, grid):
        def run(a, b, s, c, expert_ids, ntpp, M, N, K, *strides, BLOCK_M, BLOCK_N, BLOCK_K, SCALE_BEFORE_DOT,
                compute_type, num_warps, num_stages):
            self.launches.append({"grid": grid, "expert_ids": expert_ids.tolist(), "BLOCK_M": BLOCK_M,
                                  "BLOCK_N": BLOCK_N, "BLOCK_K": BLOCK_K, "num_warps": num_warps,
                                  "num_stages": num_stages, "K": K})
            weights = _dequantized(b, s)
            for pid in range(grid[0]):
                e, start = int(expert_ids[pid]), pid * BLOCK_M
                if start >= int(ntpp[0]):
                    continue
                rows = slice(start, min(start + BLOCK_M, M))
                c[rows] = 0 if e < 0 else (a[rows].double() @ weights[e].T).to(c.dtype)
        return run


def _dequantized(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()    # even k in the low nibble
    return e2m1_values(codes) * torch.exp2(scale.double() - 127).repeat_interleave(32, -1)


@pytest.fixture
def mxfp4_launch(monkeypatch) -> TorchMxfp4Launch:
    install(monkeypatch, {"triton": {}, "triton.language": {"bfloat16": "tl.bfloat16", "float16": "tl.float16"}})
    launch = TorchMxfp4Launch()
    monkeypatch.setattr(mk, "_kernel", lambda: launch)
    return launch


G, H, I = 3, 64, 32   # [E+B] rows 3; w13 [G, 2I, H], w2 [G, H, I]


def _mxfp4_views() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    codes = lambda n, k: torch.randint(0, 16, (G, n, k), generator=gen)           # noqa: E731
    pack = lambda c: (c[..., 0::2] | (c[..., 1::2] << 4)).to(torch.uint8)          # noqa: E731
    exps = lambda n, k: torch.randint(123, 127, (G, n, k // 32), generator=gen).to(torch.uint8)  # noqa: E731
    return {"w13_weight_packed": pack(codes(2 * I, H)), "w13_weight_scale": exps(2 * I, H),
            "w2_weight_packed": pack(codes(H, I)), "w2_weight_scale": exps(H, I)}


def _reference(hidden, views, cu, route) -> torch.Tensor:
    """float64 per row: its group's gate-up (rounded to bf16, as the kernel writes it), silu(gate) * up times
    the route weight, then the group's down projection; rows at or past cu[-1] zero (compared only before it)."""
    w13 = _dequantized(views["w13_weight_packed"], views["w13_weight_scale"])
    w2 = _dequantized(views["w2_weight_packed"], views["w2_weight_scale"])
    out = torch.zeros(hidden.shape[0], H, dtype=torch.float64)
    start = 0
    for g, end in enumerate(cu):
        for r in range(start, end):
            h = (hidden[r].double() @ w13[g].T).to(torch.bfloat16).double()
            act = torch.nn.functional.silu(h[:I]) * h[I:] * (1.0 if route is None else float(route[r]))
            out[r] = act @ w2[g].T
        start = end
    return out


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """bf16 arithmetic (silu, products, two roundings) against float64: within 2^-5 of the largest value."""
    return bool(((got.double() - want).abs() <= want.abs().max() / 32).all())


def test_the_mxfp4_ffn_matches_a_per_group_reference_skipping_zero_weight_blocks(mxfp4_launch):
    views = _mxfp4_views()
    gen = torch.Generator().manual_seed(3)
    hidden = (torch.randn(64, H, generator=gen) / 4).to(torch.bfloat16)
    cu = torch.tensor([16, 16, 48], dtype=torch.int32)      # group 0 rows 0-15, group 1 empty, group 2 rows 16-47
    route = torch.rand(64, generator=gen) + 0.5
    route[32:48] = 0                                        # block 2: padding rows only
    out = gpu_grouped_ffn("mxfp4", hidden, views, cu, route, token_padding=16,
                          out=torch.full((64, H), 7.0, dtype=torch.bfloat16))
    want = _reference(hidden, views, cu.tolist(), route)
    assert out.dtype == torch.bfloat16 and _close(out[:48], want[:48]), (out[:48].double() - want[:48]).abs().max()
    # block 2 (padding only) is the kernel's zeros; the tail past cu[-1] is never written (combine never reads it)
    assert bool((out[32:48] == 0).all()) and bool((out[:32] != 0).any(dim=1).all()) and bool((out[48:] == 7).all())
    # INTERPRETER_CONFIG (M 16, N 128, K 64): gate-up K = H 64, down K = I 32; block 2 and the tail not computed
    gate_up, down = mxfp4_launch.launches
    assert gate_up == {"grid": (4, 1), "expert_ids": [0, 2, -1, -1], "BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 64,
                       "num_warps": 4, "num_stages": 3, "K": 64}
    assert down == {**gate_up, "BLOCK_K": 32, "K": 32}
    # the control: no route weights, so nothing is skipped and no row is scaled
    mxfp4_launch.launches.clear()
    plain = gpu_grouped_ffn("mxfp4", hidden, views, cu, None, token_padding=32,
                            config={"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 32, "num_warps": 2,
                                    "num_stages": 2})
    assert _close(plain[:48], _reference(hidden, views, cu.tolist(), None)[:48])
    assert [(x["grid"], x["expert_ids"], x["BLOCK_K"], x["num_warps"], x["num_stages"])
            for x in mxfp4_launch.launches] == [((4, 2), [0, 2, 2, -1], 32, 2, 2), ((4, 2), [0, 2, 2, -1], 32, 2, 2)]


def test_given_blocks_are_computed_as_given_and_the_groups_rows_are_right(mxfp4_launch):
    """A caller's block metadata (the kernel tier's corrupted copy) may cover rows past ``cu_seqlens[-1]``: they
    are computed as the blocks say (no mask after the GEMM: MoonEP's combine never reads those rows,
    ``tests/ops/test_expert_bytes.py``); the groups' own rows are computed with the given blocks."""
    views = _mxfp4_views()
    hidden = torch.full((48, H), 0.25, dtype=torch.bfloat16)
    cu = torch.tensor([16, 16, 32], dtype=torch.int32)
    wide = grouped_blocks(torch.tensor([16, 16, 48], dtype=torch.int32), 48, 16)     # group 2 runs to row 48
    out = gpu_grouped_ffn("mxfp4", hidden, views, cu, torch.ones(48), token_padding=16, blocks=wide)
    assert [x["expert_ids"] for x in mxfp4_launch.launches] == [[0, 2, 2]] * 2        # given blocks, not skipped
    assert bool((out[:32] != 0).any(dim=1).all()) and bool((out[32:] != 0).any(dim=1).all())
    assert _close(out[:32], _reference(hidden, views, [16, 16, 32], torch.ones(48))[:32])


def test_the_ffn_refuses_cu_seqlens_of_another_row_count_and_passes_native_quantization_on(kernels):
    views = {"w13_weight": torch.zeros(3, 64, 128, dtype=torch.float8_e4m3fn), "w13_weight_scale_inv": torch.ones(3),
             "w2_weight": torch.zeros(3, 128, 32, dtype=torch.float8_e4m3fn), "w2_weight_scale_inv": torch.ones(3)}
    hidden = torch.ones(32, 128, dtype=torch.bfloat16)
    assert _refusal(lambda: gpu_grouped_ffn("fp8-block", hidden, views, torch.tensor([16, 32], dtype=torch.int32),
                                            None, token_padding=16)) == (
        "cu_seqlens must have one entry per [E+B] weight row: got (2, 3). Fix: pass dispatch's cu_seqlens with the "
        "layer's views")
    assert kernels["fp8"] == []
    cu = torch.tensor([16, 16, 16], dtype=torch.int32)                  # rows 16-31 are past the last group
    out = gpu_grouped_ffn("fp8-block", hidden, views, cu, None, token_padding=16, native_act_quant=True)
    assert len(kernels["native"]) == 2 and kernels["quant"] == []      # gate-up and down, both vLLM's torch path
    # the stand-in kernel writes 5 everywhere: act = silu(5) * 5, then down writes 5; no mask after it (the
    # tail past cu[-1] is left as the kernel left it: vLLM's writes nothing there)
    assert kernels["native"][1][0].shape == (32, 32) and bool((kernels["native"][1][0] == 24.875).all())
    assert bool((out == 5).all())
    gpu_grouped_ffn("fp8-block", hidden, views, cu, None, token_padding=16)
    assert len(kernels["quant"]) == 2 and len(kernels["native"]) == 2


def test_fp8_activation_quantization_takes_vllms_triton_path_unless_asked_for_the_torch_one(kernels):
    a = torch.ones(4, 256, dtype=torch.bfloat16)
    q, scales = quantize_activations_fp8(a)
    assert kernels["quant"][0][1:] == (128, False) and kernels["native"] == [] and scales.shape == (4, 2)
    quantize_activations_fp8(a, native=True)
    assert len(kernels["native"]) == 1 and len(kernels["quant"]) == 1


def test_the_route_weight_is_cast_to_the_activation_dtype_before_it_scales_a_row(kernels):
    """MoonEPExperts' order: the route weight rounded to bf16 first, then the product rounded. The stand-in
    kernel writes 5, so act = bf16(bf16(silu(5)) * 5) = bf16(4.96875 * 5 = 24.84375) = 24.875 (bf16 steps are
    0.125 in [16, 32)). Route 1 + 3 * 2^-9 rounds to 1.0078125 (steps 2^-7 in [1, 2)); 24.875 * 1.0078125 =
    25.0693 rounds to 25.125. The fp32 weight unrounded would give 24.875 * 1.005859 = 25.0208, i.e. 25.0."""
    views = {"w13_weight": torch.zeros(1, 64, 128, dtype=torch.float8_e4m3fn), "w13_weight_scale_inv": torch.ones(1),
             "w2_weight": torch.zeros(1, 128, 32, dtype=torch.float8_e4m3fn), "w2_weight_scale_inv": torch.ones(1)}
    route = torch.full((16,), 1 + 3 * 2 ** -9)
    gpu_grouped_ffn("fp8-block", torch.ones(16, 128, dtype=torch.bfloat16), views, torch.tensor([16]), route,
                    token_padding=16)
    down_input = kernels["quant"][1][0]
    assert down_input.dtype == torch.bfloat16 and down_input.shape == (16, 32)
    assert bool((down_input == 25.125).all()), down_input[0, :4]


class _MetaLaunch:
    def __init__(self) -> None:
        self.devices: list[str] = []

    def __getitem__(self, grid):
        return lambda a, b, s, c, *args, **kwargs: self.devices.append(c.device.type)


def test_the_ffn_builds_every_tensor_on_the_inputs_device(monkeypatch):
    """On the meta device (tensors without values, as a GPU's are to the host) the whole FFN runs and every
    tensor it makes (the GEMMs' outputs, the activation) is a meta tensor: one made on the CPU would fail there."""
    # torch imports its compiler at the first device-side assert on meta, and that import probes triton: done
    # here before the triton stand-in goes in
    grouped_blocks(torch.empty(1, dtype=torch.int32, device="meta"), 16, 16)
    install(monkeypatch, {"triton": {}, "triton.language": {"bfloat16": "tl.bfloat16", "float16": "tl.float16"}})
    launch = _MetaLaunch()
    monkeypatch.setattr(mk, "_kernel", lambda: launch)
    meta = lambda *shape, dtype=torch.uint8: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
    views = {"w13_weight_packed": meta(G, 2 * I, H // 2), "w13_weight_scale": meta(G, 2 * I, H // 32),
             "w2_weight_packed": meta(G, H, I // 2), "w2_weight_scale": meta(G, H, I // 32)}
    out = gpu_grouped_ffn("mxfp4", meta(48, H, dtype=torch.bfloat16), views, meta(G, dtype=torch.int32),
                          meta(48, dtype=torch.float32), token_padding=16)
    assert out.device.type == "meta" and out.shape == (48, H) and out.dtype == torch.bfloat16
    assert launch.devices == ["meta", "meta"]


def test_the_callers_out_takes_the_down_projection_in_place_and_a_wrong_one_is_refused(mxfp4_launch):
    views = _mxfp4_views()
    hidden = torch.full((48, H), 0.25, dtype=torch.bfloat16)
    cu = torch.tensor([16, 16, 32], dtype=torch.int32)
    out = torch.full((48, H), 7.0, dtype=torch.bfloat16)
    got = gpu_grouped_ffn("mxfp4", hidden, views, cu, torch.ones(48), token_padding=16, out=out)
    assert got is out and bool((out[32:] == 7).all()) and _close(out[:32], _reference(hidden, views, [16, 16, 32],
                                                                                      torch.ones(48))[:32])
    for wrong in (torch.empty(48, H), torch.empty(40, H, dtype=torch.bfloat16),
                  torch.empty(H, 48, dtype=torch.bfloat16).t()):
        assert _refusal(lambda: gpu_grouped_ffn("mxfp4", hidden, views, cu, None, token_padding=16, out=wrong)
                        ).startswith("out must be a contiguous [M, N] tensor of the activations' dtype")
