"""MoonEP dispatch-buffer bytes per CUDA graph capture size: pure arithmetic (issue 46).

A MoonEP ``Buffer`` has a fixed token capacity ``S`` per rank; a CUDA graph
captured at ``n`` tokens per rank replays with the buffer it captured, so
every capture size needs a buffer of ``S >= n``, built (collectively) in
warm-up before the capture. Two policies are sized here, rank by rank:

``vllm_pool``
    vLLM 0.33.0's pool (``vllm/model_executor/layers/fused_moe/prepare_finalize/moonep.py``,
    ``MoonEPBufferPool.capacity_for``): ``n >= max_tokens_per_rank`` gives
    ``max_tokens_per_rank``; otherwise the next power of two of ``n``, at least
    ``MOONEP_MIN_DISPATCH_TOKENS = 128`` and at most ``max_tokens_per_rank``
    (:func:`capacity_vllm`), with ``token_padding = 128``
    (``MOONEP_DEFAULT_TOKEN_PADDING``). Every capture size up to 128 shares
    one ``S = 128`` buffer.
``per_size``
    One buffer per capture size, ``S`` = the capture size rounded up to a
    power of two (:func:`capacity_per_size`), at ``token_padding = 128`` and
    at a small decode ``token_padding`` (``per_size_small_tp``).

Sizes (moonep.md §1.2; ``R`` EP ranks, ``E`` experts, ``epn = E/R``, ``K``
top-k, ``H`` the width a dispatch row carries, ``tp`` token padding): the
receive shard has ``NvS = S*K + (tp-1)*2*epn`` rows in the pull API; the push
API rounds that up to a multiple of ``tp`` (:func:`receive_rows`). A row is
``H`` bf16 values and one fp32 route weight: ``bytes = NvS*H*2 + NvS*4``
(:func:`shard_bytes`). The padding fraction is ``1 - S*K/NvS``: the rows the
token padding adds beyond the capacity's ``S*K`` entries. Only the receive
shard is counted (not the send side, nor the real library's rounding of the
shard to whole VMM pages). Every figure is derived from these formulas;
nothing is measured and nothing here allocates.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from ..errors import config_error
from ..models import MoEModelConfig

__all__ = [
    "DEFAULT_CAPTURE_SIZES",
    "VLLM_TOKEN_PADDING",
    "DEFAULT_SMALL_TOKEN_PADDING",
    "VLLM_MIN_DISPATCH_TOKENS",
    "DEFAULT_MAX_TOKENS_PER_RANK",
    "POLICIES",
    "FORMULAS",
    "capacity_vllm",
    "capacity_per_size",
    "receive_rows",
    "shard_bytes",
    "padding_fraction",
    "capture_size_rows",
    "capture_size_report",
]

#: Decode capture sizes of the table (a subset of vLLM's default 1, 2, 4, 8, 16, 24, ..., 512).
DEFAULT_CAPTURE_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
#: vLLM 0.33.0's ``MOONEP_DEFAULT_TOKEN_PADDING``, what it builds every Buffer with.
VLLM_TOKEN_PADDING = 128
#: The small decode token padding the per-size policy is also sized at.
DEFAULT_SMALL_TOKEN_PADDING = 16
#: vLLM 0.33.0's ``MOONEP_MIN_DISPATCH_TOKENS``: the pool's smallest capacity.
VLLM_MIN_DISPATCH_TOKENS = 128
#: The pool's largest capacity: vLLM's ``max_num_batched_tokens`` (8192, as ``bench decode`` assumes).
DEFAULT_MAX_TOKENS_PER_RANK = 8192

#: Policy keys, in report order.
POLICIES: tuple[str, ...] = ("vllm_pool", "per_size", "per_size_small_tp")

FORMULAS: dict[str, str] = {
    "rows_pull": "NvS = S*K + (tp-1)*2*epn",
    "rows_push": "NvS = ceil((S*K + (tp-1)*2*epn) / tp) * tp",
    "bytes": "NvS*H*2 + NvS*4 (H bf16 values and one fp32 route weight per row; receive shard only)",
    "padding_fraction": "1 - S*K/NvS",
    "vllm_pool_S": ("max_tokens_per_rank if n >= max_tokens_per_rank else "
                    "min(max(2**ceil(log2 n), 128), max_tokens_per_rank)"),
    "per_size_S": "2**ceil(log2 n)",
    "total_bytes": "sum of bytes over the policy's distinct S",
}


def _positive(what: str, value: Any, fix: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise config_error(None, what, value, fix)
    return value


def capacity_per_size(n: int) -> int:
    """``S`` of a buffer of its own for capture size ``n``: the next power of two (``n`` itself if one)."""
    _positive("capture size", n, "give tokens per rank as a positive integer")
    return 1 << (n - 1).bit_length()


def capacity_vllm(n: int, max_tokens_per_rank: int = DEFAULT_MAX_TOKENS_PER_RANK) -> int:
    """``S`` vLLM 0.33.0's ``MoonEPBufferPool.capacity_for(n)`` picks."""
    _positive("max_tokens_per_rank", max_tokens_per_rank, "give the pool's largest capacity as a positive integer")
    if _positive("capture size", n, "give tokens per rank as a positive integer") >= max_tokens_per_rank:
        return max_tokens_per_rank
    return min(max(capacity_per_size(n), VLLM_MIN_DISPATCH_TOKENS), max_tokens_per_rank)


def receive_rows(S: int, K: int, epn: int, tp: int, api: str = "pull") -> int:
    """``NvS``: ``S*K + (tp-1)*2*epn``, rounded up to a multiple of ``tp`` for the push API."""
    for what, value in (("S", S), ("K", K), ("epn", epn), ("token padding", tp)):
        _positive(what, value, f"give {what} as a positive integer")
    if api not in ("pull", "push"):
        raise config_error(None, "MoonEP API", api, "give 'pull' or 'push'")
    rows = S * K + (tp - 1) * 2 * epn
    return -(-rows // tp) * tp if api == "push" else rows


def shard_bytes(rows: int, hidden: int) -> int:
    """Bytes of ``rows`` receive rows: ``hidden`` bf16 values plus one fp32 route weight each."""
    return rows * hidden * 2 + rows * 4


def padding_fraction(S: int, K: int, rows: int) -> float:
    """Share of ``rows`` beyond the capacity's ``S*K`` entries: ``1 - S*K/NvS``."""
    return 1.0 - S * K / rows


def _entry(S: int, model: MoEModelConfig, epn: int, tp: int, api: str) -> dict[str, Any]:
    rows = receive_rows(S, model.top_k, epn, tp, api)
    return {"S": S, "tp": tp, "rows": rows, "bytes": shard_bytes(rows, model.hidden_size),
            "padding_fraction": padding_fraction(S, model.top_k, rows)}


def capture_size_rows(model: MoEModelConfig, ep: int, capture_sizes: Sequence[int],
                      tp_small: int = DEFAULT_SMALL_TOKEN_PADDING, api: str = "pull",
                      max_tokens_per_rank: int = DEFAULT_MAX_TOKENS_PER_RANK,
                      tp_large: int = VLLM_TOKEN_PADDING) -> dict[str, Any]:
    """One model at one EP size: a row per capture size under each policy, and each policy's total.

    ``{"supported": True, "epn", "rows": [{"capture_size", "vllm_pool", "per_size", "per_size_small_tp"}],
    "totals": {policy: {"S": [distinct S], "bytes"}}}``; each policy's entry is ``{"S", "tp", "rows",
    "bytes", "padding_fraction"}``. ``{"supported": False, "reason"}`` when ``E % ep != 0``.
    """
    _positive("EP size", ep, "give the EP size as a positive integer")
    if model.num_experts % ep:
        return {"supported": False,
                "reason": f"E={model.num_experts} is not a multiple of EP {ep} (MoonEP needs E % R == 0)"}
    epn = model.num_experts // ep
    rows = []
    for n in capture_sizes:
        rows.append({"capture_size": n,
                     "vllm_pool": _entry(capacity_vllm(n, max_tokens_per_rank), model, epn, tp_large, api),
                     "per_size": _entry(capacity_per_size(n), model, epn, tp_large, api),
                     "per_size_small_tp": _entry(capacity_per_size(n), model, epn, tp_small, api)})
    totals = {}
    for policy in POLICIES:
        distinct = {r[policy]["S"]: r[policy]["bytes"] for r in rows}
        totals[policy] = {"S": sorted(distinct), "bytes": sum(distinct.values())}
    return {"supported": True, "epn": epn, "rows": rows, "totals": totals}


def capture_size_report(models: Iterable[MoEModelConfig], ep_sizes: Iterable[int], capture_sizes: Sequence[int],
                        tp_small: int = DEFAULT_SMALL_TOKEN_PADDING, api: str = "pull",
                        max_tokens_per_rank: int = DEFAULT_MAX_TOKENS_PER_RANK) -> dict[str, Any]:
    """JSON-ready: the assumptions and formulas, then ``models[name]["ep"][str(R)] = capture_size_rows``."""
    capture_sizes = [_positive("capture size", n, "give tokens per rank as positive integers")
                     for n in capture_sizes]
    _positive("small token padding", tp_small, "give --token-padding-small as a positive integer")
    ep_sizes = list(ep_sizes)
    return {
        "figures": "derived (formulas below, moonep.md §1.2); nothing measured",
        "units": {"bytes": "bytes per EP rank of one Buffer's receive shard"},
        "assumptions": {"api": api, "capture_sizes": capture_sizes, "token_padding": VLLM_TOKEN_PADDING,
                        "token_padding_small": tp_small, "min_dispatch_tokens": VLLM_MIN_DISPATCH_TOKENS,
                        "max_tokens_per_rank": max_tokens_per_rank, "policies": list(POLICIES)},
        "formulas": dict(FORMULAS),
        "models": {m.name: {"config": {"num_experts": m.num_experts, "top_k": m.top_k, "hidden_size": m.hidden_size},
                            "ep": {str(r): capture_size_rows(m, r, capture_sizes, tp_small, api, max_tokens_per_rank)
                                   for r in ep_sizes}}
                   for m in models},
    }
