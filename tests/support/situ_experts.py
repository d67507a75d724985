"""SiTU experts against a dense fp32 reference: weights, inputs and the reference, written here from the formula.

Shared by ``tests/ops/test_situ_experts.py`` (CPU paths, main environment) and
``tests/support/situ_gpu_experts_check.py`` (the Triton experts in the vLLM
environment). Nothing here calls the code under test: the quantized weights
are drawn as codes and scales, and their dense values are computed from each
format's definition (INT4 g32: ``(q - 8) · scale``; MXFP4: the E2M1 value of
a code times ``2^(e8m0 - 127)``; FP8 block: ``e4m3 · scale_inv`` per 128x128
block); SiTU is vLLM 0.33.0's ``SituAndMul.forward_native`` formula in fp32:
``beta·tanh(g/beta)·sigmoid(g) · linear_beta·tanh(u/linear_beta)``.

Magnitudes: ``x ~ N(0, 1)`` at ``H = 256`` with gate weights of std 0.25 and
up weights of std 1.25 give gate outputs of std ~4 and up outputs of std ~20,
so a good share of entries lie past SiTU's ``beta`` 4 and ``linear_beta`` 25,
where a SiLU or a dropped ``linear_beta`` differs (:func:`saturation`).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

BETA, LINEAR_BETA = 4.0, 25.0
H, I, E = 256, 128, 4
TOKEN_PADDING = 16
#: rows per group of the ``E`` experts (multiples of TOKEN_PADDING; expert 1 has none) and stale tail rows
COUNTS = [16, 0, 32, 16]
TAIL = 16
#: std of the dense weights of each projection
STD = {"gate": 0.25, "up": 1.25, "down": 0.05}


def situ_reference(g: torch.Tensor, u: torch.Tensor, beta: float, linear_beta: Optional[float]) -> torch.Tensor:
    g, u = g.double(), u.double()
    up = u if linear_beta is None else linear_beta * torch.tanh(u / linear_beta)
    return (beta * torch.tanh(g / beta) * torch.sigmoid(g) * up).float()


def e2m1(code: int) -> float:
    """OCP MX E2M1: sign bit, 2 exponent bits (bias 1), 1 mantissa bit; exponent 0 is subnormal (0 or 0.5)."""
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    return sign * (man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2))


def _int4(n: int, k: int, std: float, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randint(0, 16, (n, k), generator=gen)
    scale = (torch.rand(n, k // 32, generator=gen) + 0.5) * (std / 4.6)
    scale = scale.to(torch.bfloat16)
    dense = (q - 8).double() * scale.double().repeat_interleave(32, -1)
    words = torch.zeros(n, k // 8, dtype=torch.int64)
    for i in range(8):   # value i of a word in bits 4i..4i+3
        words |= q[:, i::8] << (4 * i)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return words, scale, dense


def _mxfp4(n: int, k: int, std: float, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    codes = torch.randint(0, 16, (n, k), generator=gen)
    top = round(math.log2(std / 2.93))      # 2.93: rms of the E2M1 values over the 16 codes
    exps = torch.randint(top - 1, top + 1, (n, k // 32), generator=gen)
    values = torch.tensor([e2m1(c) for c in range(16)], dtype=torch.float64)[codes]
    dense = values * (2.0 ** exps.double()).repeat_interleave(32, -1)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)   # first value in the low nibble
    return packed, (exps + 127).to(torch.uint8), dense


def _fp8(n: int, k: int, std: float, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # codes of std ~100 (e4m3 max 448): clear of e4m3's subnormals, as DeepSeek's amax/448 block scales keep them
    scale = (torch.rand(n // 128, k // 128, generator=gen) + 0.5) * (std / 100)
    full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    w = (torch.randn(n, k, generator=gen) * std / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    return w, scale, w.double() * full.double()


def _bf16(n: int, k: int, std: float, gen: torch.Generator) -> tuple[torch.Tensor, None, torch.Tensor]:
    w = (torch.randn(n, k, generator=gen) * std).to(torch.bfloat16)
    return w, None, w.double()


MAKERS = {"int4-g32": _int4, "mxfp4": _mxfp4, "fp8-block": _fp8, "bf16": _bf16}


def experts(fmt: str, experts: int = E, seed: int = 0) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``({store name: [E, ...]}, {gate/up/down: [E, out, in] fp64 dense})``. Store names as vLLM's parameters:
    ``w13_weight_packed``/``w13_weight_scale`` (INT4, MXFP4), ``w13_weight``/``w13_weight_scale_inv`` (FP8),
    ``w13``/``w2`` = ``[gate; up]`` and down; bf16: ``gate``/``up``/``down``."""
    gen = torch.Generator().manual_seed(seed)
    parts: dict[str, list] = {p: [] for p in ("gate", "up", "down")}
    for _ in range(experts):
        for proj, (n, k) in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            parts[proj].append(MAKERS[fmt](n, k, STD[proj], gen))
    dense = {p: torch.stack([t[2] for t in parts[p]]) for p in parts}
    if fmt == "bf16":
        return {p: torch.stack([t[0] for t in parts[p]]) for p in parts}, dense
    weight, scale = ("weight", "weight_scale_inv") if fmt == "fp8-block" else ("weight_packed", "weight_scale")
    views = {}
    for i, suffix in ((0, weight), (1, scale)):
        views[f"w13_{suffix}"] = torch.stack([torch.cat([g[i], u[i]]) for g, u in zip(parts["gate"], parts["up"])])
        views[f"w2_{suffix}"] = torch.stack([d[i] for d in parts["down"]])
    return views, dense


def inputs(counts: list[int] = COUNTS, seed: int = 11) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """``(hidden bf16 [M, H], route fp32 [M] with NaN stale tail, cu_seqlens int32, row -> group or -1)``."""
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    rows = int(cu[-1]) + TAIL
    hidden = torch.randn(rows, H, generator=gen).to(torch.bfloat16)
    route = torch.rand(rows, generator=gen) + 0.1
    route[int(cu[-1]):] = float("nan")
    groups = [g for g, n in enumerate(counts) for _ in range(n)] + [-1] * TAIL
    return hidden, route, cu, groups


def fp8_act_quant(x: torch.Tensor) -> torch.Tensor:
    """Per 1x128 e4m3 quantize-dequantize of the activations, as vLLM 0.33.0's torch path of the op computes it
    (``QuantFP8._quantize_group_native``: scale ``amax / 448``, codes ``x / scale``, which the interpreter runs
    take): bf16 inputs land on e4m3 ties often, so the scale must be the same float, not ``amax · (1/448)``."""
    g = x.float().unflatten(-1, (-1, 128))
    s = g.abs().amax(-1, keepdim=True).clamp_min(1e-10) / 448.0
    return ((g / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).flatten(-2)


def gate_up(hidden: torch.Tensor, row_experts: list[int], dense: dict[str, torch.Tensor], fp8: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """fp32 gate and up outputs of the live rows (``[n, I]`` each) and those rows' indices."""
    rows = [r for r, e in enumerate(row_experts) if e >= 0]
    x = hidden[rows].float()
    if fp8:
        x = fp8_act_quant(x)
    ids = torch.tensor([row_experts[r] for r in rows])
    g = torch.einsum("nh,nih->ni", x.double(), dense["gate"][ids]).float()
    u = torch.einsum("nh,nih->ni", x.double(), dense["up"][ids]).float()
    return g, u, rows


def reference(hidden: torch.Tensor, route: torch.Tensor, row_experts: list[int], dense: dict[str, torch.Tensor],
              linear_beta: Optional[float] = LINEAR_BETA, fp8: bool = False) -> torch.Tensor:
    """``[M, H]`` fp32: every live row through its expert in fp32/fp64 with SiTU (beta 4) and its route weight.

    ``fp8``: the FP8 path's activations of both GEMMs quantized per 1x128; the down GEMM's are quantized from
    bf16 values there (gate, up, act and route weight each rounded to bf16), and one ulp of difference flips
    an e4m3 code, so the reference rounds those to bf16 too before it quantizes."""
    g, u, rows = gate_up(hidden, row_experts, dense, fp8)
    if fp8:
        bf16 = lambda t: t.to(torch.bfloat16).float()  # noqa: E731
        act = bf16(bf16(situ_reference(bf16(g), bf16(u), BETA, linear_beta)) * bf16(route[rows, None]))
        act = fp8_act_quant(act)
    else:
        act = situ_reference(g, u, BETA, linear_beta) * route[rows, None]
    ids = torch.tensor([row_experts[r] for r in rows])
    out = torch.zeros(hidden.shape[0], H)
    out[rows] = torch.einsum("ni,nhi->nh", act.double(), dense["down"][ids]).float()
    return out


def saturation(hidden: torch.Tensor, row_experts: list[int], dense: dict[str, torch.Tensor]) -> dict[str, float]:
    """Fractions of the live rows' gate entries past ±beta and up entries past ±linear_beta."""
    g, u, _ = gate_up(hidden, row_experts, dense)
    return {"gate_past_beta": float((g.abs() > BETA).float().mean()),
            "up_past_linear_beta": float((u.abs() > LINEAR_BETA).float().mean())}


def row_error(out: torch.Tensor, ref: torch.Tensor, row_experts: list[int]) -> float:
    """``max`` over live rows of ``max|out - ref| / max|ref|``; NaN anywhere in a live row counts as infinite."""
    rows = [r for r, e in enumerate(row_experts) if e >= 0]
    d = (out[rows].float() - ref[rows]).abs().amax(-1) / ref[rows].abs().amax(-1).clamp_min(1e-30)
    d = torch.nan_to_num(d, nan=float("inf"))
    return float(d.max())
