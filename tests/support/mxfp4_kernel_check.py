"""The MXFP4 kernel's launch and arithmetic under the Triton interpreter (run in the vllm==0.33.0 environment).

``python -m tests.support.mxfp4_kernel_check --json`` (torch and Triton only,
no vLLM import; a few seconds):

* ``launches``: the jitted kernel's ``run`` is wrapped, and every launch's
  block sizes, ``num_warps`` and ``num_stages`` recorded, for configs given to
  ``mxfp4_grouped_gemm`` directly and through ``gpu_experts.gpu_grouped_ffn``.
* ``exact``: inputs whose every product and partial sum is exact in fp32
  (activations small integers, scales ``2^-7 .. 2^2``), so any summation order
  gives the same fp32 sum and the 16-bit output is that sum rounded once: the
  kernel's output must equal, bit for bit, the float64 product of the
  activations and the weights decoded here from the E2M1 bit fields (OCP MX
  spec v1.0), rounded to the activations' dtype. bf16 (scale before the dot,
  BLOCK_K 128, 64 and — K 96 — 32) and fp16 (scale after each group's dot).
* ``edges``: bf16 with one group's E8M0 exponent at the ends of the range and
  past them (``0, 1, 2, 252, 253, 254, 255``) and the activations of that group
  times ``2^(127 - x)`` (so the products stay moderate), against the same
  float64 product of the format's fp32 dequantized weights (``value ·
  2^(x - 127)`` in fp32: ``±inf`` where that overflows, NaN for ``0 · inf``),
  NaN where the reference is NaN, equal elsewhere.

The interpreter's bf16 ``tl.dot`` and downcasts are mended first (the mends of
``moonep_ep.testing.triton_interpreter``), as in the kernel tier.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Callable

from moonep_ep.testing.triton_interpreter import enter_interpreter

EDGE_EXPONENTS = (0, 1, 2, 252, 253, 254, 255)


def e2m1_values(codes: Any) -> Any:
    """E2M1 code -> value from its bit fields: sign bit 3, exponent bits 2-1 with bias 1, mantissa bit 0;
    exponent 0 is subnormal (0 or 0.5). float64, independent of the kernel's decoding."""
    import torch

    sign = torch.where(codes & 8 > 0, -1.0, 1.0).double()
    exp, man = (codes >> 1) & 3, (codes & 1).double()
    mag = torch.where(exp == 0, man * 0.5, torch.exp2(exp.double() - 1) * (1 + man / 2))
    return sign * mag


def pack(codes: Any) -> Any:
    """``[G, N, K]`` codes -> ``[G, N, K/2]`` bytes, the even ``k`` in the low nibble (``pack_fp4_to_uint8``)."""
    import torch

    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def dequantized_fp32(codes: Any, exps: Any) -> Any:
    """The format's fp32 dequantization, ``float32(value) * float32(2^(x - 127))`` (``2^128`` = inf)."""
    import torch

    power = torch.exp2(exps.float() - 127.0).repeat_interleave(32, -1)
    return e2m1_values(codes).float() * power


def _blocks(rows_per_group: list[int], block_m: int = 16) -> tuple[Any, Any]:
    import torch

    from moonep_ep.ops.experts.grouped_blocks import grouped_blocks

    cu = torch.tensor(rows_per_group, dtype=torch.int32).cumsum(0).to(torch.int32)
    return cu, grouped_blocks(cu, int(cu[-1]), block_m)


def _reference(a: Any, w: Any, rows_per_group: list[int]) -> Any:
    """float64 ``a[rows of g] @ w[g].T`` per group, rounded to ``a``'s dtype."""
    import torch

    out, start = [], 0
    for g, n in enumerate(rows_per_group):
        out.append(a[start:start + n].double() @ w[g].double().T)
        start += n
    return torch.cat(out).to(a.dtype)


def exact_case(dtype_name: str, K: int, block_k: int, seed: int) -> dict[str, Any]:
    import torch

    from moonep_ep.ops.experts.mxfp4_kernel import mxfp4_grouped_gemm

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(seed)
    rows = [16, 0, 32]                      # an empty group: its weight row is never read
    G, N = len(rows), 80                    # N not a multiple of BLOCK_N: masked columns
    codes = torch.randint(0, 16, (G, N, K), generator=gen)
    exps = torch.randint(120, 130, (G, N, K // 32), generator=gen)
    cu, blocks = _blocks(rows)
    a = torch.randint(-8, 9, (int(cu[-1]), K), generator=gen).to(dtype)
    out = torch.full((int(cu[-1]), N), float("nan"), dtype=dtype)
    mxfp4_grouped_gemm(a, pack(codes), exps.to(torch.uint8), out, blocks,
                       {"BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": block_k})
    ref = _reference(a, dequantized_fp32(codes, exps), rows)
    return {"dtype": dtype_name, "K": K, "block_k_asked": block_k, "bitwise_equal": bool(torch.equal(out, ref)),
            "max_abs_diff": float((out.double() - ref.double()).abs().max())}


def edge_case(x: int) -> dict[str, Any]:
    import torch

    from moonep_ep.ops.experts.mxfp4_kernel import mxfp4_grouped_gemm

    gen = torch.Generator().manual_seed(x)
    K, N, M = 64, 32, 16
    codes = torch.randint(0, 16, (1, N, K), generator=gen)
    codes[0, : N // 2, :32] &= 0b1011            # columns 0..15: |value| <= 1.5 in the edge group (finite to 254)
    exps = torch.full((1, N, K // 32), 127)
    exps[..., 0] = x                             # group 0 at the edge exponent, group 1 at 2^0
    a = torch.randint(-1, 2, (M, K), generator=gen).double()
    a[:, :32] *= 2.0 ** (127 - min(x, 254))      # exact in bf16 (a power of two times -1, 0 or 1)
    a = a.to(torch.bfloat16)
    _, blocks = _blocks([M])
    out = torch.zeros(M, N, dtype=torch.bfloat16)
    mxfp4_grouped_gemm(a, pack(codes), exps.to(torch.uint8), out, blocks, {"BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64})
    w = dequantized_fp32(codes, exps)
    ref = _reference(a, w, [M])
    same = (out == ref) | (out.isnan() & ref.isnan())
    finite_half = slice(0, N // 2)
    return {"x": x, "matches_fp32_dequantization": bool(same.all()),
            "weights_nonfinite": int((~torch.isfinite(w)).sum()),
            "out_nonfinite": int((~torch.isfinite(out)).sum()),
            "small_codes_finite": bool(torch.isfinite(out[:, finite_half]).all()),
            "weights_normal_bf16": bool(((w == 0) | (w.abs() >= 2.0 ** -126)).all() and torch.isfinite(w).all())}


def launches() -> dict[str, Any]:
    """Every launch's parameters, recorded at the jitted kernel's ``run``."""
    import torch

    from moonep_ep.ops.experts import mxfp4_kernel as mk
    from moonep_ep.vllm.experts.gpu import gpu_grouped_ffn

    kernel = mk._kernel()
    calls: list[dict[str, Any]] = []
    original = kernel.run

    def recording_run(*args: Any, **kwargs: Any) -> Any:
        calls.append({k: kwargs.get(k) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SCALE_BEFORE_DOT", "num_warps",
                                                  "num_stages")} | {"grid": list(kwargs["grid"])})
        return original(*args, **kwargs)

    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (2, 64, 256), generator=gen)
    exps = torch.randint(124, 130, (2, 64, 8), generator=gen).to(torch.uint8)
    _, blocks = _blocks([16, 16])
    out: dict[str, Any] = {}
    kernel.run = recording_run
    try:
        for name, dtype, cfg in (("bf16_w8_s5", torch.bfloat16, {"BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64,
                                                                  "num_warps": 8, "num_stages": 5}),
                                 ("fp16_w8_s5", torch.float16, {"BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64,
                                                                 "num_warps": 8, "num_stages": 5}),
                                 ("bf16_no_config", torch.bfloat16, None)):
            a = torch.randn(32, 256, generator=gen).to(dtype)
            mk.mxfp4_grouped_gemm(a, pack(codes), exps, torch.zeros(32, 64, dtype=dtype), blocks, cfg)
            out[name] = calls[-1]
        # through the GPU experts' FFN, with a tuned-style config: both GEMMs' launches
        views = {"w13_weight_packed": pack(torch.randint(0, 16, (2, 128, 256), generator=gen)),
                 "w13_weight_scale": torch.randint(124, 130, (2, 128, 8), generator=gen).to(torch.uint8),
                 "w2_weight_packed": pack(torch.randint(0, 16, (2, 256, 64), generator=gen)),
                 "w2_weight_scale": torch.randint(124, 130, (2, 256, 2), generator=gen).to(torch.uint8)}
        cu = torch.tensor([16, 32], dtype=torch.int32)
        before = len(calls)
        gpu_grouped_ffn("mxfp4", torch.randn(32, 256, generator=gen).to(torch.bfloat16), views, cu, None,
                        token_padding=16, config={"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128,
                                                  "GROUP_SIZE_M": 1, "num_warps": 2, "num_stages": 4})
        out["ffn_w2_s4"] = calls[before:]
    finally:
        del kernel.run  # the instance attribute; the class's run again
    return out


def run_interpreted(build: Callable[[], dict[str, Any]], argv: list[str] | None = None) -> int:
    """A check's entry point: ``--json``, Triton's interpreter entered with its bf16 dot and downcasts mended,
    then ``build()``'s figures and the seconds they took printed as one JSON line."""
    p = argparse.ArgumentParser()
    p.add_argument("--json", action="store_true")
    p.parse_args(argv)
    enter_interpreter()
    from moonep_ep.testing import triton_interpreter as ti

    t0 = time.perf_counter()
    ti.mend_bf16_dot()
    ti.mend_downcasts()
    out = build()
    out["seconds"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(out))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_interpreted(lambda: {
        "launches": launches(),
        "exact": [exact_case("bfloat16", 256, 128, 1), exact_case("bfloat16", 256, 64, 2),
                  exact_case("bfloat16", 96, 128, 3), exact_case("float16", 256, 128, 4)],
        "edges": [edge_case(x) for x in EDGE_EXPONENTS]}, argv)


if __name__ == "__main__":
    sys.exit(main())
