"""MoonEP's layout and kernel limits, and the input checks built on them.

One module for every limit the reference buffer and the planner enforce, so a
configuration that one accepts the other accepts too (and MoonEP's kernels as
well; the limits are listed in docs/design/moonep.md §7). Every check raises
:class:`~moonep_ep.errors.ConfigError` naming the rank, the value and the fix.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Mapping, Optional, Sequence

import torch

from ...errors import config_error
from ...layout.store import FFN_PROJECTIONS

#: MoonEP kernels tile expert weights and activations by 128 (vLLM's MOONEP_WEIGHT_TILE).
WEIGHT_TILE = 128
MAX_K = 32                 # kmask bitset (also <= 127 for the 7-bit kidx packing)
MAX_R = 128                # duplicate-detection bitset (also <= 512 planning threads)
MAX_NVS = 2**24 - 1        # loff packed next to a 7-bit kidx
INT32_MAX = 2**31 - 1
WEIGHT_DTYPES = (torch.bfloat16, torch.int8, torch.uint8)
SCALE_TILE_BYTES = 128 * 128


def as_int(rank: Optional[int], name: str, value: Any, fix: str) -> int:
    """``value`` as a Python int; bools and non-integers are rejected."""
    if isinstance(value, bool):
        raise config_error(rank, f"{name} must be an integer", value, fix)
    try:
        return operator.index(value)
    except TypeError:
        raise config_error(rank, f"{name} must be an integer", value, fix) from None


def positive_int(rank: Optional[int], name: str, value: Any, fix: str) -> int:
    v = as_int(rank, name, value, fix)
    if v < 1:
        raise config_error(rank, f"{name} must be a positive int", value, fix)
    return v


def nvs_rows(S: int, K: int, E: int, R: int, token_padding: int) -> int:
    """The pull generation's ``NvS = S*K + (tp-1)*2*epn`` (moonep.md §1.2), no validation.

    The extra rows cover the padding of at most ``2*epn`` non-empty segments
    per destination (``epn`` local + ``epn`` from the single remote group).
    """
    return S * K + (token_padding - 1) * 2 * (E // R)


@dataclasses.dataclass(frozen=True)
class DispatchShape:
    """The sizes every MoonEP call of one Buffer shares (validated by :func:`check_shape`)."""

    S: int
    K: int
    E: int
    R: int
    B: int
    token_padding: int

    @property
    def epn(self) -> int:
        return self.E // self.R

    @property
    def N(self) -> int:
        return self.S * self.K

    @property
    def NvS(self) -> int:
        return nvs_rows(self.S, self.K, self.E, self.R, self.token_padding)


def check_shape(rank: Optional[int], *, S: Any, K: Any, E: Any, R: Any, B: Any,
                token_padding: Any) -> DispatchShape:
    """Check the sizes against MoonEP's planning-launch limits (moonep.md §7)."""
    S = positive_int(rank, "S (token capacity per rank)", S, "pass the largest per-rank token count, e.g. 128")
    K = positive_int(rank, "K (top-k)", K, f"pass 1 <= K <= {MAX_K}")
    if K > MAX_K:
        raise config_error(rank, f"K (top-k) must be <= {MAX_K} (MoonEP kmask bitset)", K, f"use K <= {MAX_K}")
    R = positive_int(rank, "R (EP ranks)", R, f"pass the EP group size (1 <= R <= {MAX_R})")
    if R > MAX_R:
        raise config_error(rank, f"R (EP ranks) must be <= {MAX_R} (MoonEP duplicate bitset)", R,
                           f"use at most {MAX_R} EP ranks")
    E = positive_int(rank, "E (routed experts)", E, f"pass a positive multiple of R={R}")
    if E % R:
        lo, hi = (E // R) * R, (E // R + 1) * R
        raise config_error(rank, f"E (routed experts) must be a multiple of R={R} (each rank owns E/R experts)", E,
                           f"use E={hi}" + (f" or E={lo}" if lo else "") + f", or an EP size dividing {E}")
    tp = positive_int(rank, "token_padding", token_padding, "pass a positive int, e.g. 128 (1 = no padding)")
    epn = E // R
    B = epn if B is None else positive_int(rank, "B (prefetch slots per rank)", B,
                                           f"pass a positive int or None (= E/R = {epn})")
    shape = DispatchShape(S, K, E, R, B, tp)
    if shape.N >= INT32_MAX:
        raise config_error(rank, "S*K must be < 2^31-1 (int32 entry indices)", shape.N, "lower S or K")
    if shape.NvS > MAX_NVS:
        raise config_error(rank, "NvS = S*K + (token_padding-1)*2*E/R exceeds 2^24-1 (MoonEP packs loff in "
                           "24 bits next to a 7-bit kidx)", shape.NvS, "lower S, K or token_padding")
    if R * shape.NvS > INT32_MAX:
        raise config_error(rank, "R*NvS exceeds 2^31-1 (int32 dst = rank*NvS + loff)", R * shape.NvS,
                           "lower S, K, token_padding or R")
    return shape


def check_hidden(rank: Optional[int], H: Any) -> int:
    H = positive_int(rank, "H (hidden size)", H, f"pass the model's hidden size (a multiple of {WEIGHT_TILE})")
    if H % WEIGHT_TILE:
        raise config_error(rank, f"H (hidden size) must be a multiple of {WEIGHT_TILE} (MoonEP tiles rows by 128)",
                           H, f"pad the hidden size to {-(-H // WEIGHT_TILE) * WEIGHT_TILE}")
    return H


def check_tensor(rank: Optional[int], device: torch.device, name: str, t: Any, dtype: torch.dtype,
                 shape: Sequence[Optional[int]], fix: str) -> torch.Tensor:
    """``t`` is a tensor of ``dtype`` on ``device`` whose dims match ``shape`` (None = any)."""
    if not isinstance(t, torch.Tensor):
        raise config_error(rank, f"{name} must be a torch.Tensor", type(t).__name__, fix)
    if t.dtype != dtype:
        raise config_error(rank, f"{name} must be {str(dtype).replace('torch.', '')}", t.dtype, fix)
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape)):
        want = "[" + ", ".join("*" if x is None else str(x) for x in shape) + "]"
        raise config_error(rank, f"{name} must have shape {want}", tuple(t.shape), fix)
    if t.device != device:
        raise config_error(rank, f"{name} must be on {device}", t.device, f"move it with .to('{device}')")
    return t


def check_expert_weight(rank: Optional[int], device: torch.device, name: str, t: Any, rows: int) -> torch.Tensor:
    """A contiguous ``[rows, out, in]`` bf16/int8/uint8 weight with both expert dims tiled by 128."""
    fix = (f"pass a contiguous [{rows}, out, in] bf16/int8/uint8 tensor on {device} with out, in "
           f"multiples of {WEIGHT_TILE}")
    if not isinstance(t, torch.Tensor):
        raise config_error(rank, f"{name} is missing (all three projections are required)", type(t).__name__, fix)
    if t.dtype not in WEIGHT_DTYPES:
        raise config_error(rank, f"{name} must be bf16, int8 or uint8", t.dtype, fix)
    if t.dim() != 3 or t.shape[0] != rows:
        raise config_error(rank, f"{name} must have shape [{rows}, out, in]", tuple(t.shape), fix)
    inner = t.shape[2] * (2 if t.dtype == torch.uint8 else 1)  # uint8 packs two MXFP4 values per byte
    if t.shape[1] % WEIGHT_TILE or inner % WEIGHT_TILE:
        raise config_error(rank, f"{name}'s expert dims must be multiples of {WEIGHT_TILE} (MoonEP weight tile)",
                           tuple(t.shape[1:]), f"pad the expert dims to multiples of {WEIGHT_TILE}")
    if not t.is_contiguous():
        raise config_error(rank, f"{name} must be contiguous", tuple(t.stride()), "pass a contiguous tensor")
    if t.device != device:
        raise config_error(rank, f"{name} must be on {device}", t.device, "use views on the Buffer's device")
    return t


def check_pull_weights(rank: Optional[int], device: torch.device, full: Mapping[str, Any],
                        scales: Mapping[str, Any], rows: int) -> dict[str, torch.Tensor]:
    """The pull prefetch's ``full_*_weight`` ``[E+B, out, in]`` (and all three ``full_*_scale`` or none)."""
    out = {name: check_expert_weight(rank, device, f"full_{name}_weight", t, rows) for name, t in full.items()}
    given = [k for k, v in scales.items() if v is not None]
    if not given:
        return out
    if len(given) != 3:
        raise config_error(rank, "full_*_scale must be given for all three projections or none", given,
                           "pass full_gate_scale, full_up_scale and full_down_scale together")
    for name, t in full.items():
        if t.dtype != torch.uint8:
            raise config_error(rank, f"scales need uint8 (packed MXFP4) weights; full_{name}_weight is", t.dtype,
                               "drop the scales for bf16/int8 weights")
    for name, t in scales.items():
        if not isinstance(t, torch.Tensor) or t.dim() < 2 or t.shape[0] != rows or not t.is_contiguous() \
                or t.device != device:
            raise config_error(rank, f"full_{name} must be a contiguous [{rows}, ...] tensor on {device}",
                               getattr(t, "shape", type(t).__name__), "pass the scale tensors of the same [E+B] layout")
        per_expert = t[0].numel() * t.element_size()
        if per_expert % SCALE_TILE_BYTES:
            raise config_error(rank, f"full_{name}: per-expert scale bytes must be a multiple of {SCALE_TILE_BYTES}",
                               per_expert, "use MoonEP's 128x128-tiled scale layout")
        out[name] = t
    return out


def check_push_weights(rank: Optional[int], device: torch.device, local: Mapping[str, Any],
                        pools: Mapping[str, Any], R: int, epn: int, B: int) -> None:
    """The push prefetch's ``local_*_weight`` ``[epn, out, in]`` and ``*_prefetch_buffer`` ``[R, epn, out, in]``."""
    if B > epn:
        raise config_error(rank, "push needs B <= E/R (the pool has E/R slots per rank)", B,
                           f"build the Buffer with B <= {epn}")
    for name in FFN_PROJECTIONS:
        lw = check_expert_weight(rank, device, f"local_{name}_weight", local[name], epn)
        pool = pools[name]
        fix = (f"pass the [R, epn, out, in] = [{R}, {epn}, {lw.shape[1]}, {lw.shape[2]}] view of every "
               "rank's slot pool (ShardedExpertStore.push_pool)")
        if not isinstance(pool, torch.Tensor) or tuple(pool.shape) != (R, epn, *lw.shape[1:]):
            raise config_error(rank, f"{name}_prefetch_buffer has the wrong shape",
                               getattr(pool, "shape", type(pool).__name__), fix)
        if pool.dtype != lw.dtype or pool.device != device:
            raise config_error(rank, f"{name}_prefetch_buffer must match local_{name}_weight's dtype and device",
                               (pool.dtype, pool.device), fix)
        want = torch.empty(epn, *lw.shape[1:], device="meta").stride()
        if pool[0].stride() != want or pool.stride(0) < epn * lw[0].numel():
            raise config_error(rank, f"{name}_prefetch_buffer rows must be contiguous within each rank's pool",
                               tuple(pool.stride()), fix)
